"""Experiment tracking: a local metrics JSONL always, W&B when `tracking=wandb`, TensorBoard
event files when `tracking=tensorboard`.

Only rank 0 creates a Tracker. W&B's mode comes from WANDB_MODE (e.g. `offline` in tests and on
machines without network) or defaults to online; the run files land in the run directory, as
TensorBoard's do (`<folder>/tensorboard`, for `tensorboard --logdir runs`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any


def check_wandb() -> None:
    """Fail at once, not when training starts after hours of preparation, where `tracking=wandb`
    would log online without credentials (W&B raises only when its run starts)."""
    if os.environ.get("WANDB_MODE", "online") in ("offline", "disabled", "dryrun"):
        return
    import wandb

    try:
        wandb.login(verify=False)  # reads the key (env, netrc, settings); no network
    except wandb.errors.UsageError as err:
        raise ValueError(
            f"tracking=wandb logs online, but W&B says: {err} Run `wandb login` (or set "
            "WANDB_API_KEY), set WANDB_MODE=offline to keep the run files here, or use "
            "tracking=none|tensorboard"
        ) from err


class Tracker:
    def __init__(self, folder: str | Path, backend: str, run_name: str, config: Any) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.metrics = open(self.folder / "metrics.jsonl", "a")
        self.wandb = None
        self.tensorboard = None
        if backend == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=str(self.folder / "tensorboard"))
            # the resolved config, as W&B keeps it with the run
            text = json.dumps(_plain(config), indent=2, default=str)
            self.tensorboard.add_text("config", f"```\n{text}\n```")
        if backend == "wandb":
            import wandb

            check_wandb()
            self.wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "draftsmith"),
                name=run_name,
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
