#!/usr/bin/env bash
# Ablation: regenerated vs original ShareGPT answers at equal size. Two EAGLE-3 runs on the same
# first LIMIT conversations (same held-out split, same steps): abl_orig keeps ShareGPT's answers,
# abl_regen lets SmolLM2 answer every user turn itself (greedy, up to 192 tokens per turn; later
# turns whose prompt exceeds 384 tokens are dropped and logged). Then the tau-only MT-bench eval.
# Both runs are resumable `draftsmith run`s; with PARALLEL=2 they share the cores (one thread
# each), which is fine for tau (no timings are compared).
#   bash scripts/regen_ablation.sh [RUNS_DIR]     env: LIMIT (256), STEPS (90), PARALLEL (1)
# Then: python scripts/results_table.py RUNS_DIR/abl_orig RUNS_DIR/abl_regen --archive results
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/venv.sh
source scripts/venv.sh
runs="$(realpath -m "${1:-runs/regen_ablation}")"
common=(experiment=smollm2_eagle3 runs_dir="$runs" data.limit="${LIMIT:-256}" data.heldout=16
  train.max_steps="${STEPS:-90}" 'eval.baselines=[]')
regen=(data.regenerate=true data.regen.max_new_tokens=192 data.regen.max_prompt_len=384
  data.regen.chunk_rows=256)
if [ "${PARALLEL:-1}" -gt 1 ]; then
  OMP_NUM_THREADS=1 draftsmith run run_name=abl_regen "${common[@]}" "${regen[@]}" &
  OMP_NUM_THREADS=1 draftsmith run run_name=abl_orig "${common[@]}"
  wait
else
  draftsmith run run_name=abl_regen "${common[@]}" "${regen[@]}"
  draftsmith run run_name=abl_orig "${common[@]}"
fi
