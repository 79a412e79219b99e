"""Keep freed memory for reuse instead of handing it back to the kernel (glibc only).

glibc serves every allocation above its mmap threshold (at most 32 MB) with a fresh `mmap` and
returns it with `munmap` on free. A training step allocates the same big activations (TTT
attention scores [B, nh, T, T], fp32 softmax copies, vocab-sized blocks) every step, so each one
is page-faulted in again, one 4 KB page at a time. With mmap off and trimming disabled, big
blocks come from the heap and, once it has grown over the first steps, freed ones are reused.
Measured on 2 CPU cores (scripts/bench_train.py, 8 rows of 512 tokens): EAGLE-3 training
734 -> 1116 tokens/s, kernel time 16% -> 3%, page faults per step 394k -> 15k; the anonymous
memory of 35 training steps stays within 5% of glibc's default. Collection: +10%.

Even so, a long training process slows down as it ages under glibc's malloc (its heap grows and
fragments): on a 2-core Xeon, EAGLE-3 recipe training fell from ~2470 to ~2030 tokens/s over its
first 300-600 steps, and a fresh process resumed from a step-500 checkpoint was back at ~2450.
Under tcmalloc the same training holds its speed: ~2900 settling at ~2760, and the recipe's 3924
steps took 45.7 min instead of 78.1 (docs/experiments.md, session 38). So the
`draftsmith` command re-executes itself with tcmalloc preloaded where the library is installed
(scripts/venv.sh installs Debian's libtcmalloc-minimal4 where it can); `DRAFTSMITH_MALLOC=glibc`
keeps glibc's malloc, with `reuse_freed_memory` as above.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys

_M_TRIM_THRESHOLD = -1  # mallopt parameter numbers from glibc's malloc.h
_M_MMAP_MAX = -4


def reuse_freed_memory() -> bool:
    """Switch this process's glibc malloc to heap-only, never-trimmed big blocks. Returns False
    (and changes nothing) where the C library is not glibc, e.g. macOS or musl."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    # mallopt returns 1 on success; 1 GiB of free heap top is kept before trimming
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**30))


def tcmalloc_library() -> str | None:
    """The installed tcmalloc's library name (the loader finds it), or None."""
    for name in ("tcmalloc_minimal", "tcmalloc"):
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def exec_under_tcmalloc() -> None:
    """Re-execute this command with tcmalloc preloaded, unless it already is, tcmalloc is not
    installed, or DRAFTSMITH_MALLOC=glibc. Returns only when nothing is re-executed. The
    environment carries over, so DeepSpeed's rank processes get tcmalloc too."""
    preload = os.environ.get("LD_PRELOAD", "")
    if os.environ.get("DRAFTSMITH_MALLOC", "tcmalloc") == "glibc" or "tcmalloc" in preload:
        return
    library = tcmalloc_library() if platform.system() == "Linux" else None
    if library is None:
        return
    env = dict(os.environ, LD_PRELOAD=f"{library} {preload}".strip())
    # tcmalloc prints a line for every allocation above 1 GB: big batches are no news here
    env.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(2**40))
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)
