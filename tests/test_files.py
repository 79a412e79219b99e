"""Atomic writes: an interrupted write leaves the previous content whole."""

from pathlib import Path

import pytest

from draftsmith.files import staged_dir, write_text_atomic


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
