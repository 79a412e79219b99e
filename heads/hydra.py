"""Hydra heads: Medusa heads made sequentially dependent.

Head k sees the target's post-norm state at anchor t *and* the embeddings of the tokens on the
candidate path before it (t+1, the target's next token, then the k tokens drafted by heads
0..k-1), so every tree node is scored given its own ancestors. Head k = Linear((k+2)H -> H) over
[feature, embeds...] followed by L residual blocks and the (shared or own) lm_head; it predicts
token t+k+2 like Medusa head k. Training is teacher-forced on the real tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from draftsmith.heads.base import TargetInfo
from draftsmith.heads.blocks import ResBlock
from draftsmith.heads.medusa import MedusaConfig, MedusaHead


@dataclass
class HydraConfig(MedusaConfig):
    name: str = "hydra"


class HydraHead(MedusaHead):
    name = "hydra"
    config_class = HydraConfig
    uses_path = True

    def __init__(self, config: HydraConfig, target: TargetInfo) -> None:
        super().__init__(config, target)
        H = target.hidden_size
        self.prefix = nn.ModuleList(
            [nn.Linear((k + 2) * H, H, bias=False) for k in range(config.num_heads)]
        )
        self.blocks = nn.ModuleList(
            [
                nn.Sequential(*[ResBlock(H) for _ in range(config.num_layers)])
                for _ in range(config.num_heads)
            ]
        )

    def head_states(
        self, k: int, feature: torch.Tensor, path_tokens: torch.Tensor | None
    ) -> torch.Tensor:
        if path_tokens is None or path_tokens.shape[-1] != k + 1:
            raise ValueError(f"hydra head {k} needs the {k + 1} path tokens before it")
        embeds = self.parts.embed_tokens(path_tokens).flatten(-2)  # [N, (k+1) H]
        return self.blocks[k](self.prefix[k](torch.cat([feature, embeds], dim=-1)))
