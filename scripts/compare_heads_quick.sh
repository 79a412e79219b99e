#!/usr/bin/env bash
# Head comparison at the quick preset's budget: EAGLE-1, Medusa and Hydra trained on the data and
# features of the EAGLE-3 run EAGLE3_RUN (experiment=quick_<head>: the same tokens, steps and
# tree), then one MT-bench eval of the four heads interleaved with vanilla and prompt-lookup
# decoding (alone on the machine: the speedups, eval.tag=heads) and tau-only evals of the four on
# MT-bench at T=1 and on HumanEval and held-out ShareGPT at T=0 and T=1. EAGLE-1, Medusa and Hydra
# draft over the 4096 most frequent answer tokens (the presets' eval.draft_vocab_size), as many as
# the EAGLE-3 head's own draft vocabulary, and Medusa and Hydra train on them
# (head.draft_vocab_size). Every command resumes or skips finished work.
#   bash scripts/compare_heads_quick.sh [EAGLE3_RUN] [PREFIX]   (defaults: quick, quick)
# EAGLE3_RUN is an `experiment=quick` run (prepared, collected and trained there if missing);
# the other heads train as PREFIX_eagle1, PREFIX_medusa and PREFIX_hydra. Then:
#   python scripts/results_table.py runs/EAGLE3_RUN runs/PREFIX_* --archive results --readme README.md
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/venv.sh
source scripts/venv.sh
eagle3="${1:-quick}"
prefix="${2:-quick}"
draftsmith run experiment=quick run_name="$eagle3" 'stages=[prepare,collect,train]'
for head in eagle1 medusa hydra; do
  draftsmith run experiment="quick_$head" run_name="${prefix}_$head" inputs_from="$eagle3" \
    'stages=[prepare,collect,train]'
done
# EAGLE-1's run leads (its config carries the draft vocabulary, which an EAGLE-3 head refuses);
# each head's results go to its own run
lead=(experiment=quick_eagle1 run_name="${prefix}_eagle1" inputs_from="$eagle3")
lead+=("eval.heads=[${prefix}_medusa,${prefix}_hydra,$eagle3]")
# `draftsmith run` skips an eval whose results the lead run already holds
draftsmith run "${lead[@]}" 'eval.baselines=[vanilla,lookup]' eval.tag=heads 'stages=[eval]'
for benchmark in mt-bench humaneval heldout; do
  for temperature in 0 1; do
    [ "$benchmark-$temperature" = mt-bench-0 ] && continue  # the timed eval above
    draftsmith run "${lead[@]}" eval.benchmark="$benchmark" eval.temperature="$temperature" \
      'stages=[eval]'
  done
done
