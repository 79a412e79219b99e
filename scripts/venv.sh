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
# tcmalloc: the `draftsmith` command runs under it where it is installed (long training runs
# keep their speed; glibc's heap fragments: draftsmith.allocator). Debian/Ubuntu as root only;
# without it everything still runs, on glibc's malloc.
if ! python -c "import sys; from draftsmith.allocator import tcmalloc_library; sys.exit(tcmalloc_library() is None)" \
  && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "venv.sh: installing libtcmalloc-minimal4 (apt-get)" >&2
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y -q libtcmalloc-minimal4 || { apt-get update -q && apt-get install -y -q libtcmalloc-minimal4; }; } >/dev/null 2>&1 \
    || echo "venv.sh: could not install libtcmalloc-minimal4; draftsmith runs on glibc's malloc" >&2
fi
