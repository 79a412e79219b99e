"""Atomic writes: a reader (or a rerun after a kill) sees the old content or the new, never half.

Files are written next to their destination and renamed over it; folders are built in a hidden
staging folder beside the destination and swapped in by rename (same filesystem, so the rename
is atomic). Every resumable stage relies on this to tell finished work from interrupted work.
"""

from __future__ import annotations

import hashlib
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


def content_digest(path: Path) -> str:
    """sha256 (16 hex digits) of a file's bytes, or of a folder's files' relative names and bytes
    in name order: the same for the same content wherever and whenever it was written (an asset
    fetched again on another machine), unlike sizes and times."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():  # the name and size first, so files' bytes cannot run into each other
            digest.update(f"{file.relative_to(path)}\0{file.stat().st_size}\0".encode())
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]
