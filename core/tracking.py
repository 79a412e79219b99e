"""Experiment tracking: a local metrics JSONL always, W&B when `tracking=wandb`, TensorBoard
event files when `tracking=tensorboard`.

Only rank 0 creates a Tracker. W&B's mode comes from WANDB_MODE (e.g. `offline` in tests and on
machines without network) or defaults to online; the run files land in the run directory, as
TensorBoard's do (`<folder>/tensorboard`, for `tensorboard --logdir runs`).

A training resumed from its checkpoint at step S continues one curve: the metrics file keeps
its lines up to S (the killed invocation may have logged past its last checkpoint; those steps
are logged again, identically), W&B goes on in the same run (its id kept in the folder), and
TensorBoard hides the earlier events after S (`purge_step`). A fresh start begins a new curve.
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from pathlib import Path
from typing import Any

from draftsmith.errors import InputError
from draftsmith.files import write_text_atomic


def check_wandb() -> None:
    """Fail at once, not when training starts after hours of preparation, where `tracking=wandb`
    would log online without credentials (W&B raises only when its run starts)."""
    if os.environ.get("WANDB_MODE", "online") in ("offline", "disabled", "dryrun"):
        return
    import wandb

    try:
        wandb.login(verify=False)  # reads the key (env, netrc, settings); no network
    except wandb.errors.UsageError as err:
        raise InputError(
            f"tracking=wandb logs online, but W&B says: {err} Run `wandb login` (or set "
            "WANDB_API_KEY), set WANDB_MODE=offline to keep the run files here, or use "
            "tracking=none|tensorboard"
        ) from err


class Tracker:
    def __init__(
        self, folder: str | Path, backend: str, run_name: str, config: Any, resume_step: int = 0
    ) -> None:
        """`resume_step`: the step a resumed training continues from (0: a new curve)."""
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        metrics = self.folder / "metrics.jsonl"
        resumed = resume_step and metrics.exists()
        kept = metrics.read_text().splitlines(keepends=True) if resumed else []
        kept = [line for line in kept if json.loads(line)["step"] <= resume_step]
        write_text_atomic(metrics, "".join(kept))
        self.metrics = open(metrics, "a")
        self.wandb = None
        self.tensorboard = None
        if backend == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(
                log_dir=str(self.folder / "tensorboard"), purge_step=resume_step + 1
            )
            # the resolved config, as W&B keeps it with the run
            text = json.dumps(_plain(config), indent=2, default=str)
            self.tensorboard.add_text("config", f"```\n{text}\n```")
        if backend == "wandb":
            import wandb

            check_wandb()
            run_id = self.folder / "wandb_run_id"
            resumed = resume_step > 0 and run_id.exists()
            if not resumed:
                write_text_atomic(run_id, uuid.uuid4().hex[:8])  # W&B's own ids are 8 characters
            self.wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "draftsmith"),
                name=run_name,
                id=run_id.read_text(),
                resume="allow" if resumed else None,
                dir=str(self.folder),
                config=_plain(config),
                mode=os.environ.get("WANDB_MODE", "online"),
                reinit="finish_previous",
            )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.metrics.write(json.dumps({"step": step, **metrics}) + "\n")
        self.metrics.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if self.tensorboard is not None:
            for key, value in metrics.items():
                self.tensorboard.add_scalar(key, value, step)

    def artifact(self, folder: str | Path, name: str, kind: str = "model") -> None:
        if self.wandb is not None:
            import wandb

            art = wandb.Artifact(name, type=kind)
            art.add_dir(str(folder))
            self.wandb.log_artifact(art)

    def finish(self) -> None:
        self.metrics.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()


def _plain(config: Any) -> Any:
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    return config
