"""An exponential moving average of the head's weights (`train.ema_decay`).

After each optimizer step the average moves toward the weights by 1 - d, with the warm-up
d_t = min(decay, (1 + t) / (10 + t)) so the random start is forgotten within a few steps.
Held-out evaluation, the kept best head and the final head read the average (`swapped_in`);
training goes on with the raw weights. Every rank holds the whole head (ZeRO 0-2: the
parameters are not partitioned), so every rank keeps the same average.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class WeightAverage:
    def __init__(self, module: torch.nn.Module, decay: float, step: int = 0) -> None:
        self.module, self.decay, self.step = module, decay, step
        self.params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self.average = {n: p.detach().float().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        d = min(self.decay, (1 + self.step) / (10 + self.step))
        for name, p in self.params.items():
            self.average[name].lerp_(p.detach().float(), 1 - d)
        self.step += 1

    @contextmanager
    @torch.no_grad()
    def swapped_in(self) -> Iterator[None]:
        """Inside, the module's parameters hold the average; the raw weights come back after."""
        raw = {n: p.detach().clone() for n, p in self.params.items()}
        for name, p in self.params.items():
            p.copy_(self.average[name])
        try:
            yield
        finally:
            for name, p in self.params.items():
                p.copy_(raw[name])

    def state_dict(self) -> dict:
        return {"step": self.step, "average": self.average}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        for name, tensor in state["average"].items():
            self.average[name].copy_(tensor)
