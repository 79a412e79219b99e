"""EAGLE-3 head: fused low/mid/high target features, one 2H-input decoder layer, its own
lm_head over a reduced draft vocabulary, trained with training-time test (TTT).

    x_in   = fc(concat(aux_low, aux_mid, aux_high))                 # [.., H], fc: 3H -> H
    a      = concat(input_layernorm(embed(token)), hidden_norm(x_in)) # [.., 2H]
    x      = x_in + o_proj(attn(q/k/v_proj(a)));  x = x + mlp(post_attention_layernorm(x))
    logits = lm_head(norm(x))                                         # [.., draft_vocab]
The next drafting step reads x (pre-norm). Module names follow the official checkpoint layout
(`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`) so export is a rename-free copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import InputError
from draftsmith.heads.autoregressive import AutoregressiveHead
from draftsmith.heads.base import HeadBatch, HeadConfig, TargetInfo, rows_per_block
from draftsmith.heads.blocks import DraftDecoderLayer, LlamaRMSNorm
from draftsmith.heads.vocab import build_vocab_mapping


def default_aux_layers(num_layers: int) -> list[int]:
    """Low/mid/high layers as EAGLE/vLLM pick them, in our convention (see Eagle3Config)."""
    return [2, num_layers // 2, num_layers - 3]


def check_aux_layers(layers: list[int], num_layers: int) -> None:
    """Refuse layer ids outside 1..num_layers (the target's layers, in our convention)."""
    bad = [k for k in layers if not 1 <= k <= num_layers]
    if bad:
        raise InputError(f"aux_layers {bad} out of range 1..{num_layers}")


@dataclass
class Eagle3Config(HeadConfig):
    name: str = "eagle3"
    # target layers whose *input* is fused ("input of layer k" = HF hidden_states[k] = output of
    # layer k-1); empty = [2, n//2, n-3], the EAGLE/vLLM default (on SmolLM2 at the quick
    # budget [2, 15, 30] and [2, 15, 24] measured lower: docs/experiments.md). Exports
    # translate per server.
    aux_layers: list[int] = field(default_factory=list)
    # size of the reduced draft vocabulary (0 = the target's full vocabulary)
    draft_vocab_size: int = 8192
    # unrolled training-time-test steps, and the weight decay^i of step i
    ttt_steps: int = 7
    step_decay: float = 0.8

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise InputError(f"head.ttt_steps={self.ttt_steps} must be >= 1")
        if self.draft_vocab_size < 0:  # (a negative size drafted over every token, silently)
            raise InputError(f"head.draft_vocab_size={self.draft_vocab_size} must be >= 0")


class Eagle3Head(AutoregressiveHead):
    name = "eagle3"
    config_class = Eagle3Config

    def __init__(self, config: Eagle3Config, target: TargetInfo) -> None:
        if not config.aux_layers:
            config.aux_layers = default_aux_layers(target.num_layers)
        check_aux_layers(config.aux_layers, target.num_layers)
        if config.draft_vocab_size <= 0 or config.draft_vocab_size > target.vocab_size:
            config.draft_vocab_size = target.vocab_size
        super().__init__(config, target)
        H = target.hidden_size
        self.fc = nn.Linear(len(config.aux_layers) * H, H, bias=False)
        self.midlayer = DraftDecoderLayer(target, fuse_token=True)
        self.norm = LlamaRMSNorm(H, eps=target.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        # identity mapping over the first Vd ids until set_vocab() sees real token counts
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    @property
    def layers(self) -> tuple[DraftDecoderLayer]:  # type: ignore[override]
        # a plain tuple: the layer is registered once, as `midlayer` (the checkpoint's name); a
        # ModuleList built per call cost ~40 us of every drafting step
        return (self.midlayer,)

    @property
    def own_vocab_size(self) -> int:
        return self.config.draft_vocab_size

    def set_vocab(self, counts: torch.Tensor) -> None:
        """Pick the draft vocabulary from token counts [V] under the loss mask."""
        d2t, t2d = build_vocab_mapping(counts, self.config.draft_vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_token_ids(self) -> torch.Tensor:
        """[Vd] target ids of the draft vocabulary, in draft-id order."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def feature_input(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        if aux is None:
            raise InputError("the eagle3 head needs aux features (collect with the eagle3 layers)")
        return self.fc(aux)

    def draft_logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden_out))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def step_loss(self, i, hidden_out, batch: HeadBatch, select, scratch):
        if not scratch:
            # once per batch: the target's distribution restricted to the draft vocab, and its
            # full-vocab top-1 (precomputed by collect, or computed here)
            with torch.no_grad():
                normed = self.parts.norm(batch.hidden)
                weight = self.parts.lm_head.weight[self.draft_token_ids()]  # [Vd, H]
                logits = self.parts.scaled(F.linear(normed, weight))  # [B, T, Vd]
                scratch["probs"] = torch.softmax(logits.float(), dim=-1)
                top = batch.target_top
                scratch["top"] = self.parts.top_tokens(batch.hidden) if top is None else top
        b, t = select.nonzero(as_tuple=True)  # [M] each: anchors that predict token t+i+1
        t = t + i + 1  # the predicted token's position (selected anchors have one)
        top = scratch["top"][b, t]  # [M] target's top-1 for the predicted token
        # as in EAGLE-3: no loss where the target's top token is outside the draft vocab
        in_vocab = self.t2d[top].float()  # [M]
        hidden = hidden_out[select]  # [M, H]
        loss, correct = hidden.new_zeros((), dtype=torch.float32), top.new_zeros(())
        # in row blocks, the target's probabilities gathered per block: [M, Vd] blocks above
        # 32 MB would be page-faulted in afresh each time (heads.base.rows_per_block)
        rows = rows_per_block(self.config.draft_vocab_size)
        for s in range(0, hidden.shape[0], rows):
            probs = scratch["probs"][b[s : s + rows], t[s : s + rows]]  # [r, Vd]
            logits = self.draft_logits(hidden[s : s + rows]).float()  # [r, Vd]
            log_q = torch.log_softmax(logits, -1)
            loss = loss - ((probs * log_q).sum(-1) * in_vocab[s : s + rows]).sum()
            with torch.no_grad():
                agree = self.to_target_ids(logits.max(-1).indices) == top[s : s + rows]
                correct = correct + agree.sum()
        return loss, correct
