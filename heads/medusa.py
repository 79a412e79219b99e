"""Medusa-1 heads: K parallel heads on the target's last (post-norm) hidden state.

Convention: at anchor position t (the target has read tokens <= t and its own lm_head predicts
token t+1), head k predicts token t+k+2, i.e. head 0 is one token past the target's next token.
Each head is L residual blocks with their own weights (the original code's `[ResBlock] * L`
shared one block L times; not here), then an lm_head: the frozen target lm_head by default
(Medusa "v2" checkpoints), or a trained one of its own. Loss = sum_k decay^k soft-CE_k, over the
full vocabulary or, with `draft_vocab_size`, over the most frequent answer tokens only (as
EAGLE-3's reduced vocabulary: ~12x cheaper per row at 4096 of SmolLM2's 49k tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from draftsmith.errors import InputError
from draftsmith.heads.base import (
    DepthLosses,
    DraftHead,
    HeadBatch,
    HeadConfig,
    TargetInfo,
    TargetParts,
    distill_selected,
    predicts_assistant_token,
    shifted,
)
from draftsmith.heads.blocks import KVCache, ResBlock
from draftsmith.heads.vocab import build_vocab_mapping


@dataclass
class MedusaConfig(HeadConfig):
    name: str = "medusa"
    # number of heads K (draft depth) and residual blocks per head L
    num_heads: int = 4
    num_layers: int = 1
    # train an lm_head per head (K x H x V parameters) instead of sharing the target's
    own_lm_head: bool = False
    # loss weight of head k is step_decay^k
    step_decay: float = 0.8
    # distil over the N most frequent answer tokens of the training data only (0 = the full
    # vocabulary); draft over the same ones with eval.draft_vocab_size = N. Not stored with the
    # weights: both sides recompute the same tokens from the prepared data (heads.vocab)
    draft_vocab_size: int = 0

    @property
    def drafts_with_target_lm_head(self) -> bool:
        return not self.own_lm_head

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 1:
            raise InputError(
                f"head.num_heads={self.num_heads} and head.num_layers={self.num_layers} "
                "must be >= 1"
            )
        if self.draft_vocab_size < 0:
            raise InputError(f"head.draft_vocab_size={self.draft_vocab_size} must be >= 0")
        if self.draft_vocab_size and self.own_lm_head:
            raise InputError(
                "draft_vocab_size cuts the shared target lm_head: it needs own_lm_head=false"
            )


class MedusaHead(DraftHead):
    name = "medusa"
    kind = "parallel"
    config_class = MedusaConfig

    def __init__(self, config: MedusaConfig, target: TargetInfo) -> None:
        super().__init__(config, target)
        H = target.hidden_size
        self.blocks = nn.ModuleList(
            [
                nn.Sequential(*[ResBlock(H) for _ in range(config.num_layers)])
                for _ in range(config.num_heads)
            ]
        )
        if config.own_lm_head:
            self.lm_heads = nn.ModuleList(
                [nn.Linear(H, target.vocab_size, bias=False) for _ in range(config.num_heads)]
            )
        # the loss vocabulary as a [V] mask, set by set_vocab() (all tokens until then)
        self.register_buffer(
            "in_vocab", torch.ones(target.vocab_size, dtype=torch.bool), persistent=False
        )
        self._loss_parts: tuple[TargetParts, TargetParts] | None = None

    def set_vocab(self, counts: torch.Tensor) -> None:
        """Cut the loss to the `draft_vocab_size` most frequent tokens of `counts` [V]."""
        if not self.config.draft_vocab_size:
            return
        _, t2d = build_vocab_mapping(counts, self.config.draft_vocab_size)  # [V] membership
        self.in_vocab.copy_(t2d)
        self._loss_parts = None

    def loss_parts(self) -> TargetParts:
        """The bound target parts, with the lm_head cut to the loss vocabulary if there is one
        (built once per binding: a [Vd, H] copy of the lm_head's rows)."""
        if not self.config.draft_vocab_size:
            return self.parts
        if self._loss_parts is None or self._loss_parts[0] is not self.parts:
            ids = self.in_vocab.nonzero().squeeze(-1)  # [Vd] ascending target ids
            self._loss_parts = (self.parts, self.parts.restricted(ids))
        return self._loss_parts[1]

    @property
    def depth(self) -> int:
        return self.config.num_heads

    def head_logits(
        self, k: int, states: torch.Tensor, parts: TargetParts | None = None
    ) -> torch.Tensor:
        """Head-k output states [.., H] -> logits over the target vocabulary [.., V] (over
        `parts`' lm_head, e.g. a restricted one, when the head shares the target's)."""
        if self.config.own_lm_head:
            return self.lm_heads[k](states)
        return (parts or self.parts).head_logits(states)

    def feature_input(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """Pre-norm target states [.., H] (+ aux [.., kH]) -> the heads' feature [.., H]: the
        post-norm state the target's own lm_head reads."""
        return self.parts.norm(hidden)

    def new_cache(self) -> KVCache | None:
        """The state a drafter keeps between commits: none, unless `sequence_features` reads
        earlier positions (Hydra's prefix attention)."""
        return None

    def sequence_features(
        self, hidden: torch.Tensor, aux: torch.Tensor | None, cache: KVCache | None = None
    ) -> torch.Tensor:
        """Features [B, N, H] of N consecutive positions from their target states [B, N, H]
        (+ aux [B, N, kH]), following the positions already in `cache` (appended to it); without
        a cache, the N positions are a sequence's first. Medusa: `feature_input` per position."""
        return self.feature_input(hidden, aux)

    def head_states(
        self, k: int, feature: torch.Tensor, path_tokens: torch.Tensor | None
    ) -> torch.Tensor:
        """Head k on features [N, H]; Medusa ignores the path tokens."""
        return self.blocks[k](feature)

    def depth_logits(
        self, k: int, feature: torch.Tensor, path_tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Inference: head-k logits [N, V] from features [N, H] (`feature_input`) and, per node,
        the tokens of its path from the root (t+1 .. t+k+1) [N, k+1]."""
        return self.head_logits(k, self.head_states(k, feature, path_tokens))

    def loss(self, batch: HeadBatch) -> tuple[torch.Tensor, dict[str, float]]:
        feature = self.sequence_features(batch.hidden, batch.aux)  # [B, T, H]
        parts = self.loss_parts()
        top = None
        if parts is not self.parts:  # the target's full-vocab top-1 per position [B, T]
            top = batch.target_top
            top = self.parts.top_tokens(batch.hidden) if top is None else top
        losses = DepthLosses(self.config.step_decay)
        for k in range(self.config.num_heads):
            select = predicts_assistant_token(batch, k + 2)
            count = select.sum()
            if top is not None:
                # as EAGLE-3: no loss where the target's top token (t+k+2, read at t+k+1) is
                # outside the vocabulary, which no draft could match; it still counts as a miss
                select = select & self.in_vocab[shifted(top, k + 1)]
            path = None
            if getattr(self, "uses_path", False):
                path = torch.stack([shifted(batch.input_ids, j + 1) for j in range(k + 1)], dim=-1)[
                    select
                ]  # [M, k+1] tokens t+1 .. t+k+1
            states = self.head_states(k, feature[select], path)  # [M, H]
            target_hidden = shifted(batch.hidden, k + 1)[select]  # target state at t+k+1
            loss_sum, correct = distill_selected(
                states,
                target_hidden,
                lambda s, k=k: self.head_logits(k, s, parts),
                parts,
                frozen_logits=not self.config.own_lm_head,
            )
            losses.add(k, loss_sum, correct, count)
        return losses.result()
