"""Train a draft head (`draftsmith train`), in this process or as N DeepSpeed ranks.

The train stage of `draftsmith run` too, and `run(cfg)` from Python: in-process, or
`launcher=deepspeed nproc=N`, which runs `-m draftsmith.train` under DeepSpeed's launcher with
N ranks on this machine, each reading this process's config from runs/<run>/train/launch.yaml.
Multi-node: run `deepspeed --hostfile hosts -m draftsmith.train ...` yourself (see README)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from draftsmith.conf.schema import Config
from draftsmith.config import save_config
from draftsmith.provenance import check_unchanged, stale
from draftsmith.train import loop
from draftsmith.train.engine import free_port


def run(cfg: Config) -> dict:
    """Train; returns what the training loop returns (launched: read back from its folder).
    What an earlier invocation trained is kept, as prepare and collect keep theirs: a finished
    training is complete and a killed (or time-boxed) one continues from its checkpoint, both
    refused under other settings; made from features made again since, it trains afresh."""
    out = Path(cfg.stage_dir("train"))
    if not stale(cfg, "train"):
        if (out / "summary.json").exists():
            check_unchanged(cfg, "train")
            print(f"train: {out} is complete; delete it to redo")
            return json.loads((out / "summary.json").read_text())
        if not cfg.resume and (out / "checkpoints" / "latest").exists():
            print(f"train: continuing the training in {out} from its checkpoint; delete it to redo")
            cfg = replace(cfg, resume=True)  # the loop refuses it under other settings
    if cfg.launcher == "none" or "RANK" in os.environ:
        return loop.run(cfg)
    out.mkdir(parents=True, exist_ok=True)
    # the ranks run this very config (resume as decided above), whether it came from the
    # command line, from `draftsmith run` or from Python
    launch_config = out / "launch.yaml"
    save_config(replace(cfg, stage="train", launcher="none"), launch_config)
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
        f"--config={launch_config}",
    ]
    print("launch:", " ".join(cmd))
    result = subprocess.run(cmd)
    if result.returncode != 0:
        raise SystemExit(f"deepspeed launch failed with exit code {result.returncode}")
    if (out / "summary.json").exists():
        return json.loads((out / "summary.json").read_text())
    # time-boxed (train.stop_after): where it stopped and the seconds before, as its rank 0 wrote
    return json.loads((out / loop.STOPPED).read_text())
