"""EAGLE-1 head: fc(concat(token embedding, feature)) -> N Llama layers -> next feature.

Features are the target's *post-final-norm* last hidden states (what the official EAGLE-1 trains
on and what the serving engines feed it), so the predicted feature goes straight through the
frozen target lm_head. Layer 0 has no input norm. Loss = SmoothL1 on the predicted feature
(scale-free: divided by the target feature's RMS) + `token_weight` x soft CE against the target.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import InputError
from draftsmith.heads.autoregressive import AutoregressiveHead
from draftsmith.heads.base import HeadBatch, HeadConfig, TargetInfo, distill_selected, shifted
from draftsmith.heads.blocks import DraftDecoderLayer


@dataclass
class Eagle1Config(HeadConfig):
    name: str = "eagle1"
    # decoder layers in the head (official checkpoints use 1)
    num_layers: int = 1
    # bias on fc; vLLM's EAGLE-1 loader has none (and skips fc.bias silently), so default off
    fc_bias: bool = False
    # weights of the feature-regression and token (soft CE) terms
    feature_weight: float = 1.0
    token_weight: float = 0.1
    # uniform noise on input features during training, as a fraction of each token's feature RMS
    feature_noise: float = 0.0
    # unrolled training-time-test steps (1 = EAGLE-1's teacher-forced training) and step decay
    ttt_steps: int = 1
    step_decay: float = 0.8

    @property
    def drafts_with_target_lm_head(self) -> bool:
        return True

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.ttt_steps < 1:
            raise InputError(
                f"head.num_layers={self.num_layers} and head.ttt_steps={self.ttt_steps} "
                "must be >= 1"
            )


class Eagle1Head(AutoregressiveHead):
    name = "eagle1"
    config_class = Eagle1Config

    def __init__(self, config: Eagle1Config, target: TargetInfo) -> None:
        super().__init__(config, target)
        H = target.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=config.fc_bias)
        self.layers = nn.ModuleList(
            [DraftDecoderLayer(target, input_norm=i > 0) for i in range(config.num_layers)]
        )

    def feature_input(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        feature = self.parts.norm(hidden)
        if self.training and self.config.feature_noise > 0:
            rms = feature.pow(2).mean(-1, keepdim=True).sqrt()
            feature = feature + (torch.rand_like(feature) - 0.5) * self.config.feature_noise * rms
        return feature

    def fuse(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([embeds, hidden], dim=-1))

    def draft_logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        return self.parts.head_logits(hidden_out)

    def step_loss(self, i, hidden_out, batch: HeadBatch, select, scratch):
        predicted = hidden_out[select]  # [M, H]
        target_hidden = shifted(batch.hidden, i + 1)[select]  # [M, H] pre-norm state at t+i+1
        token_loss, correct = distill_selected(
            predicted, target_hidden, self.draft_logits, self.parts
        )
        with torch.no_grad():
            goal = self.parts.norm(target_hidden)
            rms = goal.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6)
        feature_loss = (
            F.smooth_l1_loss(predicted / rms, goal / rms, reduction="none").mean(-1).sum()
        )
        cfg = self.config
        return cfg.feature_weight * feature_loss + cfg.token_weight * token_loss, correct
