#!/usr/bin/env bash
# Head comparison on SmolLM2-135M-Instruct: EAGLE-1, EAGLE-3, Medusa and Hydra trained on the same
# tokens in the same order (the first LIMIT ShareGPT conversations, prepared and collected once by
# the EAGLE-3 run, read by the others through inputs_from) for the same number of steps. Then one
# MT-bench eval decodes the four heads interleaved with vanilla and prompt-lookup decoding (alone
# on the machine: the speedups; then EAGLE-1, Medusa and Hydra again with a reduced draft
# vocabulary), and tau-only evals follow: MT-bench T=1, held-out ShareGPT and
# HumanEval at T=0 and T=1, static vs dynamic trees, TTT-step and draft-vocab ablations.
# Every command is a resumable `draftsmith run`, so rerunning the script continues where it stopped.
#   bash scripts/compare_heads.sh [RUNS_DIR]     env: STEPS (100), LIMIT (1000), PARALLEL (1)
# Then: python scripts/results_table.py RUNS_DIR/cmp_* RUNS_DIR/abl_* --archive results
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/venv.sh
source scripts/venv.sh
runs="$(realpath -m "${1:-runs/compare}")"
# tau-only evals report no speed, so parallel lanes may share the cores (one thread each)
# shellcheck source=scripts/lane.sh
source scripts/lane.sh
common=(runs_dir="$runs" data.limit="${LIMIT:-1000}" train.max_steps="${STEPS:-100}")
tau_only=('eval.baselines=[]')

head_run() {  # head_run HEAD [overrides...]: train (if needed), eval and export one head
  local head=$1
  shift
  local from=()
  [ "$head" = eagle3 ] || from=(inputs_from=cmp_eagle3)
  draftsmith run experiment="smollm2_$head" run_name="cmp_$head" "${from[@]}" "${common[@]}" "$@"
}

evals_for_all() {  # evals_for_all [overrides...]: the same tau-only eval for every head
  for head in eagle1 eagle3 medusa hydra; do lane head_run "$head" "${tau_only[@]}" "$@"; done
}
ablation() {  # ablation NAME [overrides...]: an EAGLE-3 run abl_NAME on the same data
  local name=$1
  shift
  lane draftsmith run experiment=smollm2_eagle3 run_name="abl_$name" inputs_from=cmp_eagle3 \
    "${common[@]}" "${tau_only[@]}" "$@"
}

# the EAGLE-3 run prepares and collects the shared data first; then the other heads train
# (slowest first)
trained=('stages=[prepare,collect,train]')
head_run eagle3 "${trained[@]}"
for head in hydra medusa eagle1; do lane head_run "$head" "${trained[@]}"; done
wait
# the speedups: every head on MT-bench against one vanilla and one prompt-lookup pass, nothing
# else running (Medusa and Hydra draft 4 deep, one depth per head)
head_run eagle3 'eval.heads=[cmp_eagle1,cmp_medusa,cmp_hydra]' 'stages=[eval]'
# the three heads that draft through the target's 49k-token lm_head, drafting over the 4096 most
# frequent answer tokens instead (EAGLE-3's draft vocabulary size), again alone on the machine
head_run eagle1 eval.draft_vocab_size=4096 'eval.heads=[cmp_medusa,cmp_hydra]' 'stages=[eval]'
# all four again on a compiled target (every method runs the torch.compile'd forward)
head_run eagle1 eval.draft_vocab_size=4096 'eval.heads=[cmp_medusa,cmp_hydra,cmp_eagle3]' \
  eval.compile=true 'stages=[eval]'
evals_for_all eval.temperature=1.0
evals_for_all eval.benchmark=heldout
evals_for_all eval.benchmark=humaneval
evals_for_all eval.benchmark=heldout eval.temperature=1.0
evals_for_all eval.benchmark=humaneval eval.temperature=1.0
# the EAGLE-3 head's tree ablation (static vs dynamic at 12 nodes, dynamic at 16) and its
# training ablations (TTT steps, cmp_eagle3: 5; draft vocab, 4096)
lane head_run eagle3 "${tau_only[@]}" tree=static
lane head_run eagle3 "${tau_only[@]}" tree.total_tokens=16
ablation ttt1 head.ttt_steps=1
ablation ttt3 head.ttt_steps=3
ablation vocab1k head.draft_vocab_size=1024
ablation vocab16k head.draft_vocab_size=16384
wait
