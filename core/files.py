"""Atomic writes: a reader (or a rerun after a kill) sees the old content or the new, never half.

Files are written next to their destination and renamed over it; folders are built in a hidden
staging folder beside the destination and swapped in by rename (same filesystem, so the rename
is atomic). Every resumable stage relies on this to tell finished work from interrupted work.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` via `path.tmp` + rename."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextmanager
def staged_dir(final: str | Path) -> Iterator[Path]:
    """Yield an empty folder to fill; on success it replaces `final` (an existing `final` is
    moved aside first and deleted after the swap), on an exception it is deleted."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build = staging / "new"
        build.mkdir()
        yield build
        if final.exists():
            os.replace(final, staging / "old")
        os.replace(build, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
