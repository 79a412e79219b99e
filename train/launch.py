"""Head training stage entry (`draftsmith train`, and `draftsmith run`'s train stage):
in-process, or `launcher=deepspeed nproc=N`, which re-runs `-m draftsmith.train` under
DeepSpeed's launcher with N ranks on this machine. Multi-node: run
`deepspeed --hostfile hosts -m draftsmith.train ...` yourself (see README)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from draftsmith.conf.schema import Config
from draftsmith.train.engine import free_port, latest_step


def run(cfg: Config) -> dict:
    """Train; returns what the training loop returns (launched: read back from its folder)."""
    if cfg.launcher == "none" or "RANK" in os.environ:
        from draftsmith.train.loop import run as train

        return train(cfg)
    if not sys.argv[0].startswith("draftsmith"):  # the ranks re-read the command line
        raise RuntimeError("launcher=deepspeed launches from the `draftsmith` command line")
    drop = ("launcher=", "nproc=", "stage=", "resume=")
    overrides = [a for a in sys.argv[1:] if not a.startswith(drop)]
    # as this stage was asked: `draftsmith run` continues a killed training with resume=true
    overrides.append(f"resume={str(cfg.resume).lower()}")
    # DeepSpeed's launcher through this interpreter: works whether or not the venv's `deepspeed`
    # script is on PATH (e.g. `.venv/bin/python -m pytest` without activating the venv)
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(cfg.nproc),
        "--master_port",
        str(free_port()),
        "--module",
        "draftsmith.train",
        *overrides,
        "launcher=none",
    ]
    print("launch:", " ".join(cmd))
    result = subprocess.run(cmd)
    if result.returncode != 0:
        raise SystemExit(f"deepspeed launch failed with exit code {result.returncode}")
    out = Path(cfg.stage_dir("train"))
    if (out / "summary.json").exists():
        return json.loads((out / "summary.json").read_text())
    # time-boxed (train.stop_after): the checkpoint it stopped at
    return {"steps": latest_step(out / "checkpoints"), "stopped_early": True}
