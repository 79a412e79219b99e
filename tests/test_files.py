"""Atomic writes: an interrupted write leaves the previous content whole; content digests."""

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from draftsmith.files import content_digest, staged_dir, write_text_atomic


def test_staged_dir_replaces_on_success_and_keeps_old_on_error(tmp_path: Path) -> None:
    final = tmp_path / "out"
    with staged_dir(final) as build:
        (build / "a.txt").write_text("one")
    assert (final / "a.txt").read_text() == "one"
    with pytest.raises(RuntimeError), staged_dir(final) as build:
        (build / "a.txt").write_text("half")
        raise RuntimeError("killed mid-write")
    assert (final / "a.txt").read_text() == "one"  # the old folder is untouched
    with staged_dir(final) as build:
        (build / "b.txt").write_text("two")
    assert sorted(p.name for p in final.iterdir()) == ["b.txt"]  # replaced, not merged
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging left behind


def test_write_text_atomic(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    write_text_atomic(path, "{}")
    write_text_atomic(path, '{"a": 1}')
    assert path.read_text() == '{"a": 1}'
    assert [p.name for p in tmp_path.iterdir()] == ["stats.json"]


def test_content_digest_follows_content_not_times_or_places(tmp_path: Path) -> None:
    data = tmp_path / "a" / "chats.jsonl"
    data.parent.mkdir()
    data.write_text('{"prompt": "hi"}\n')
    (tmp_path / "a" / "more.jsonl").write_text('{"prompt": "yo"}\n')
    assert content_digest(data) == hashlib.sha256(data.read_bytes()).hexdigest()[:16]
    folder = content_digest(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # elsewhere, written later
    os.utime(tmp_path / "b" / "more.jsonl", (0, 0))
    assert content_digest(tmp_path / "b") == folder
    # the same bytes split differently between the files, or a file renamed: other content
    (tmp_path / "b" / "chats.jsonl").write_text('{"prompt": "hi"}\n{"prompt"')
    (tmp_path / "b" / "more.jsonl").write_text(': "yo"}\n')
    assert content_digest(tmp_path / "b") != folder
    (tmp_path / "a" / "more.jsonl").rename(tmp_path / "a" / "most.jsonl")
    assert content_digest(tmp_path / "a") != folder
