"""The target and the draft heads as every decoding method runs them (`draftsmith eval` and
`draftsmith generate`): in the run's dtype, linear weights packed for oneDNN where allowed, and
the reduced draft vocabulary of `eval.draft_vocab_size`.
"""

from __future__ import annotations

import torch

from draftsmith.conf.schema import Config
from draftsmith.heads import DraftHead, TargetInfo, TargetParts, load_head
from draftsmith.heads.vocab import answer_token_counts, frequent_tokens
from draftsmith.packed import pack_linears
from draftsmith.target import load_target, target_name, torch_dtype


def decoding_target(cfg: Config) -> tuple[torch.nn.Module, TargetInfo, TargetParts, int]:
    """The target as every decoding method runs it: loaded in cfg's dtype, its linear weights
    packed for oneDNN where `target.pack_linears` allows (not with `eval.compile`); returns it,
    its shapes, its shared parts and the number of packed layers."""
    target = load_target(
        cfg.target.path,
        cfg.dtype,
        cfg.device,
        cfg.target.trust_remote_code,
        revision=cfg.target.revision,
    )
    packed = pack_linears(target) if _packs(cfg) else 0
    info = TargetInfo.from_hf_config(target.config, target_name(cfg.target.path))
    return target, info, TargetParts.from_model(target), packed


def decoding_head(
    cfg: Config, head_path: str, info: TargetInfo, parts: TargetParts
) -> tuple[DraftHead, int]:
    """The head at `head_path`, bound to the target's parts, frozen, in cfg's dtype and packed as
    the target is; returns it and the number of packed layers."""
    head = load_head(head_path, info).to(device=cfg.device, dtype=torch_dtype(cfg.dtype))
    head.bind(parts).eval().requires_grad_(False)
    return head, pack_linears(head) if _packs(cfg) else 0


def draft_vocabulary(cfg: Config, info: TargetInfo) -> torch.Tensor | None:
    """`eval.draft_vocab_size` most frequent answer tokens of the run's prepared data [Vd]
    (target ids), the vocabulary a head drafting through the target's lm_head is cut to; None
    when unset."""
    if not cfg.eval.draft_vocab_size:
        return None
    counts = answer_token_counts(cfg.input_dir("prepare"), info.vocab_size)
    return frequent_tokens(counts, cfg.eval.draft_vocab_size)


def _packs(cfg: Config) -> bool:
    """Whether decoding packs linear weights: `target.pack_linears`, except under
    `eval.compile` (inductor cannot lower packed weights; its freezing packs its own)."""
    return cfg.target.pack_linears and not cfg.eval.compile
