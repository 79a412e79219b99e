#!/usr/bin/env bash
# Make (or reuse) .venv, install draftsmith with its dev extras, run the tests.
# Usage: scripts/test.sh [pytest args]   e.g. scripts/test.sh -m slow   (adds the real-model tests)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
python -m pytest "$@"
