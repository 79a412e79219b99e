"""Experiment tracking: a local metrics JSONL always, W&B when `tracking=wandb`.

Only rank 0 creates a Tracker. W&B's mode comes from WANDB_MODE (e.g. `offline` in tests and on
machines without network) or defaults to online; the run files land in the run directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any


class Tracker:
    def __init__(self, folder: str | Path, backend: str, run_name: str, config: Any) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.metrics = open(self.folder / "metrics.jsonl", "a")
        self.wandb = None
        if backend == "wandb":
            import wandb

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


def _plain(config: Any) -> Any:
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    return config
