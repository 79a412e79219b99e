#!/usr/bin/env bash
# Test the dependency floors pyproject.toml declares: make (or reuse) .venv-floors with every
# dependency at the lowest version its `>=` allows, then run the tests there. A floor no
# test has run is a guess: pip would install it beside draftsmith and the user would meet the
# ImportError. Usage: scripts/floors.sh [pytest args]   (the fast suite by default)
# PYTHON picks the interpreter (python3 by default): test on the oldest `requires-python` admits.
# torch's floor comes from PyPI as a CUDA build (~3.5 GB with its NVIDIA libraries); it runs on
# the CPU too.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv-floors/bin/python ] || "$PYTHON" -m venv .venv-floors
# shellcheck disable=SC1091
source .venv-floors/bin/activate
python -m pip install -q --upgrade pip
# every `name>=x` of [project] dependencies pinned to `name==x` (the dev extras float)
python - > .venv-floors/floors.txt <<'EOF'
import re, tomllib
with open("pyproject.toml", "rb") as f:
    for dep in tomllib.load(f)["project"]["dependencies"]:
        print(re.sub(r"\s*>=\s*", "==", dep))
EOF
python -m pip install -q -c .venv-floors/floors.txt -e ".[dev]"
# PyPI's torch is a CUDA build, which brings triton; without a GPU triton finds no driver, and
# DeepSpeed's older releases import it at `import deepspeed` and fail there. A CPU build has no
# triton: take it out where there is no GPU.
command -v nvidia-smi >/dev/null || python -m pip uninstall -q -y triton
python -m pip list 2>/dev/null | grep -iE "^($(sed 's/==.*//' .venv-floors/floors.txt | paste -sd'|'))\s"
# a cache of its own: the tiny target is built by this venv's transformers
export DRAFTSMITH_CACHE="${DRAFTSMITH_CACHE:-$PWD/.venv-floors/cache}"
python -m pytest "$@"
