#!/usr/bin/env bash
# TTT steps and draft vocabulary at experiment=quick's budget, with a second seed for scale:
# `quick` runs end to end once (TTT 2, 4096 draft tokens), then EAGLE-3 heads train on its
# collected features (inputs_from: the same tokens in the same order, 2 epochs) with one setting
# changed each, and each decodes the quick eval (MT-bench T=0, tau only). The seed run changes the
# head's initialisation and the order of the rows only: its gap to `quick` is the noise the other
# gaps are read against (docs/experiments.md, session 28). With PARALLEL=2 two runs share the
# cores (one thread each): tau is unaffected, their train minutes are not comparable.
#   bash scripts/quick_ablations.sh [RUNS_DIR]     env: PARALLEL (1)
# Then: python scripts/results_table.py RUNS_DIR/quick RUNS_DIR/quick_* --archive results
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/venv.sh
source scripts/venv.sh
# shellcheck source=scripts/lane.sh
source scripts/lane.sh
runs="$(realpath -m "${1:-runs/quick_ablations}")"
draftsmith run experiment=quick runs_dir="$runs"
for point in "ttt1 head.ttt_steps=1" "ttt4 head.ttt_steps=4" "seed1 seed=1" \
  "v1k head.draft_vocab_size=1024" "v16k head.draft_vocab_size=16384"; do
  read -r name override <<<"$point"
  lane draftsmith run experiment=quick runs_dir="$runs" run_name="quick_$name" inputs_from=quick \
    'stages=[train,eval]' "$override"
done
wait
