# Sourced by the other scripts: create or reuse .venv and install draftsmith into it (editable).
# torch is installed first on its own: on the reference CPU machines `torch==2.13.0` resolves to
# the local CPU wheel; letting the resolver pick freely would pull a multi-GB CUDA build.
# Override with DRAFTSMITH_TORCH (e.g. DRAFTSMITH_TORCH="torch" on a GPU machine).
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
stamp=.venv/.draftsmith-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip
  python -c "import torch" 2>/dev/null || python -m pip install -q "${DRAFTSMITH_TORCH:-torch==2.13.0}"
  python -m pip install -q -e ".[dev]"
  touch "$stamp"
fi
