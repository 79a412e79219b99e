"""What EAGLE-1 and EAGLE-3 share: a draft that steps token by token with its own KV cache,
and the training-time-test (TTT) loss that unrolls it k steps on its own hidden states.

Indexing (both heads): the draft input at anchor position t pairs a feature of position t with
token t+1 and predicts token t+2. Unrolled step i at anchor t reads the step i-1 output and token
t+i+1, sits at position t+i, and predicts token t+i+2, whose target distribution is the target's
state at position t+i+1. Step i attends to the step-0 entries of positions <= t and to its own
earlier steps at anchor t, which is exactly what drafting i tokens ahead sees at inference.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import nn

from draftsmith.heads.base import (
    DepthLosses,
    DraftHead,
    HeadBatch,
    predicts_assistant_token,
    shifted,
)
from draftsmith.heads.blocks import KVCache


class AutoregressiveHead(DraftHead):
    """Base of EAGLE heads. Subclasses define `layers`, the feature/token fusion and the logits."""

    kind = "autoregressive"
    layers: nn.ModuleList

    # ---- what subclasses define ----------------------------------------------------------
    @abstractmethod
    def feature_input(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """Target features [B, N, H] (+ aux [B, N, 3H]) -> the draft's hidden input [B, N, H]."""

    def fuse(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """Mix token embeddings into the hidden stream before the layers (EAGLE-1's fc)."""
        return hidden

    @abstractmethod
    def draft_logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """Layer output [.., H] -> logits over the draft vocabulary [.., Vd]."""

    @abstractmethod
    def step_loss(
        self, i: int, hidden_out: torch.Tensor, batch: HeadBatch, select: torch.Tensor, cache: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss sum and top-1 agreements of unrolled step i over the `select`ed anchors [B, T]."""

    # ---- drafting (inference) ------------------------------------------------------------
    def new_cache(self) -> KVCache:
        return KVCache()

    def step(
        self,
        hidden_in: torch.Tensor,  # [B, N, H] feature_input(...) or a parent's step output
        tokens: torch.Tensor,  # [B, N] the token paired with each input
        positions: torch.Tensor,  # [B, N]
        cache: KVCache,
        mask: torch.Tensor | None = None,  # [N, cache_len + N] bool; None = causal
    ) -> torch.Tensor:
        """Run the draft layers on N new inputs, appending them to `cache`. Returns [B, N, H]."""
        embeds = self.parts.embed_tokens(tokens)
        hidden = self.fuse(hidden_in, embeds)
        for index, layer in enumerate(self.layers):
            hidden, _ = layer(hidden, embeds, positions, cache, index, mask)
        return hidden

    # ---- training ------------------------------------------------------------------------
    def unroll(self, batch: HeadBatch, steps: int):
        """Yield the layer output [B, T, H] of each unrolled TTT step 0..steps-1."""
        B, T = batch.input_ids.shape
        positions = torch.arange(T, device=batch.input_ids.device).expand(B, T)
        hidden = self.feature_input(batch.hidden, batch.aux)
        base_kv: list = []
        diag_kv: list[list] = [[] for _ in self.layers]
        for i in range(steps):
            embeds = self.parts.embed_tokens(shifted(batch.input_ids, i + 1))
            hidden = self.fuse(hidden, embeds)
            for index, layer in enumerate(self.layers):
                if i == 0:
                    hidden, kv = self._maybe_checkpoint(layer, hidden, embeds, positions)
                    base_kv.append(kv)
                else:
                    # a copy of the earlier steps' k/v: the list grows with later steps, and a
                    # checkpointed step is recomputed in backward with the inputs it was given
                    hidden, kv = self._maybe_checkpoint(
                        layer.ttt_forward,
                        hidden,
                        embeds,
                        positions + i,
                        base_kv[index],
                        list(diag_kv[index]),
                    )
                    diag_kv[index].append(kv)
            yield hidden

    def _maybe_checkpoint(self, fn, *args):
        if self.gradient_checkpointing and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def loss(self, batch: HeadBatch) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config
        scratch: dict = {}  # per-batch values a subclass computes once for all steps
        losses = DepthLosses(cfg.step_decay)
        for i, hidden in enumerate(self.unroll(batch, cfg.ttt_steps)):
            select = predicts_assistant_token(batch, i + 2)
            loss_sum, correct = self.step_loss(i, hidden, batch, select, scratch)
            losses.add(i, loss_sum, correct, select.sum())
        return losses.result()
