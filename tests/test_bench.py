"""The benchmark scripts run end to end (on the tiny target: what they print is not checked, only
that they measure every method and write their JSON)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from draftsmith.tiny import TINY_NAME

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_bench_verify_times_every_tree_size_and_a_vanilla_step(tmp_path: Path) -> None:
    args = ["--target", TINY_NAME, "--dtype", "float32", "--sizes", "1", "4", "--context", "20"]
    args += ["--rounds", "2", "--out", str(tmp_path)]
    subprocess.run([sys.executable, str(SCRIPTS / "bench_verify.py"), *args], check=True)
    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result["median_ms"]) == {"vanilla", "tree 1", "tree 4"}
    assert all(len(ms) == 2 and min(ms) > 0 for ms in result["ms"].values())
    assert "| tree 4 |" in (tmp_path / "results.md").read_text()
