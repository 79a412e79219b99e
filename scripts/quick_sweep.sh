#!/usr/bin/env bash
# Batch size x learning rate x loss positions at experiment=quick's budget: `quick` runs end to end
# once (2 rows, lr 1.2e-3, loss on every real token), then the same EAGLE-3 head trains on its
# collected features (inputs_from, same tokens in the same order, 2 epochs) with other micro-batch
# sizes, learning rates and train.loss_on (`_all` runs: every real token; the others: assistant
# tokens only). The `quick_b*` runs only train; their held-out simulated tau is the comparison
# (README training-budget table; its `quick_b4_lr2e-3` row is the preset before loss_on=all,
# run end to end). With PARALLEL=2 two trainings share the cores (one thread each), so their
# train minutes are not comparable.
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
for point in "8 8e-4 assistant" "8 2e-3 assistant" "4 8e-4 assistant" "4 2e-3 assistant" \
  "4 4e-3 assistant" "2 1.2e-3 assistant" "4 2e-3 all" "4 3e-3 all"; do
  read -r rows lr loss_on <<<"$point"
  name="quick_b${rows}_lr${lr}"
  [[ $loss_on == all ]] && name+="_all"
  lane draftsmith run experiment=quick runs_dir="$runs" run_name="$name" \
    inputs_from=quick 'stages=[train]' train.micro_batch_size="$rows" train.lr="$lr" \
    train.loss_on="$loss_on" train.eval_every=$((400 / rows))
done
wait
