#!/usr/bin/env bash
# Batch size x learning rate at experiment=quick's budget: `quick` runs end to end once (4 rows,
# lr 2e-3), then the same EAGLE-3 head trains on its collected features (inputs_from, same tokens
# in the same order, 2 epochs) with other micro-batch sizes and learning rates. The `quick_b*` runs
# only train; their held-out simulated tau is the comparison (README training-budget table). With
# PARALLEL=2 two trainings share the cores (one thread each), so their train minutes are not
# comparable.
#   bash scripts/quick_sweep.sh [RUNS_DIR]     env: PARALLEL (1)
# Then: python scripts/results_table.py RUNS_DIR/quick RUNS_DIR/quick_b* --archive results
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/venv.sh
source scripts/venv.sh
# shellcheck source=scripts/lane.sh
source scripts/lane.sh
runs="$(realpath -m "${1:-runs/quick_sweep}")"
draftsmith run experiment=quick runs_dir="$runs"
for point in "8 8e-4" "8 2e-3" "4 8e-4" "2 1.2e-3"; do
  read -r rows lr <<<"$point"
  lane draftsmith run experiment=quick runs_dir="$runs" run_name="quick_b${rows}_lr${lr}" \
    inputs_from=quick 'stages=[train]' train.micro_batch_size="$rows" train.lr="$lr" \
    train.eval_every=$((400 / rows))
done
wait
