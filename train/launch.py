"""Train a draft head, in this process or as N DeepSpeed ranks (`draftsmith train`).

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
from draftsmith.errors import MissingInput
from draftsmith.provenance import check_unchanged, stale, upstream
from draftsmith.train import loop
from draftsmith.train.engine import free_port, name_accelerator


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
    _check_inputs(cfg)
    out.mkdir(parents=True, exist_ok=True)
    # the ranks run this very config (resume as decided above), whether it came from the
    # command line, from `draftsmith run` or from Python
    launch_config = out / "launch.yaml"
    save_config(replace(cfg, stage="train", launcher="none"), launch_config)
    name_accelerator(cfg.device)  # for this process's and its ranks' `import deepspeed`
    code = _launch(cfg.nproc, launch_config)
    if code != 0:
        raise SystemExit(f"draftsmith train: its ranks failed (exit code {code}), saying why above")
    if (out / "summary.json").exists():
        return json.loads((out / "summary.json").read_text())
    # time-boxed (train.stop_after): where it stopped and the seconds before, as its rank 0 wrote
    return json.loads((out / loop.STOPPED).read_text())


def _check_inputs(cfg: Config) -> None:
    """Refuse a launch whose ranks would find nothing to train on, naming the command that makes
    it: each rank would fail with its own traceback of the same error."""
    stage = upstream(cfg, "train")  # collect, or prepare when training online
    if stage == "prepare":
        needed = Path(cfg.input_dir("prepare"), "dataset")
        done = needed.exists()
    else:
        needed = Path(cfg.input_dir("collect"), "index.json")
        done = needed.exists() and json.loads(needed.read_text()).get("complete", False)
    if not done:
        raise MissingInput(
            f"{needed}: no finished {stage} output to train on; run `draftsmith {stage} "
            f"run_name={cfg.inputs_from or cfg.run_name}` first (or `draftsmith run`)"
        )


def _launch(nproc: int, config: Path) -> int:
    """Run `-m draftsmith.train --config=<config>` as `nproc` ranks on this machine under
    DeepSpeed's per-node launcher, the command DeepSpeed's runner (`deepspeed --num_gpus N`)
    runs for one node. Not through the runner: a Ctrl-C, which reaches every process of the
    terminal's group, ends the runner in a traceback, where the per-node launcher stops the
    ranks and exits with one log line. This interpreter runs it, so it works whether or not the
    venv's `deepspeed` script is on PATH (`.venv/bin/python -m pytest` without activating)."""
    from deepspeed.launcher.runner import encode_world_info

    cmd = [
        sys.executable,
        "-u",
        "-m",
        "deepspeed.launcher.launch",
        f"--world_info={encode_world_info({'localhost': list(range(nproc))})}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "--module",
        "draftsmith.train",
        f"--config={config}",
    ]
    print("launch:", " ".join(cmd))
    launcher = subprocess.Popen(cmd)
    try:
        return launcher.wait()
    except KeyboardInterrupt:
        # the Ctrl-C reached the launcher too, which stops its ranks: wait for that, so the
        # shell's prompt does not come back with ranks still running (a second Ctrl-C does not
        # wait)
        launcher.wait()
        raise
