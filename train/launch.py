"""Head training stage entry (`draftsmith train`): in-process, or `launcher=deepspeed nproc=N`,
which re-runs `-m draftsmith.train` under DeepSpeed's launcher with N ranks on this machine.
Multi-node: run `deepspeed --hostfile hosts -m draftsmith.train ...` yourself (see README)."""

from __future__ import annotations

import os
import subprocess
import sys

from draftsmith.conf.schema import Config
from draftsmith.train.engine import free_port


def run(cfg: Config) -> dict | None:
    if cfg.launcher == "none" or "RANK" in os.environ:
        from draftsmith.train.loop import run as train

        return train(cfg)
    overrides = [a for a in sys.argv[1:] if not a.startswith(("launcher=", "nproc=", "stage="))]
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
    return None
