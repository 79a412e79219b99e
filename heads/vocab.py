"""Reduced draft vocabulary: the most frequent target tokens under the loss mask.

Encoding as in EAGLE-3 / SpecForge / speculators: `d2t[i] = target_id(i) - i` (offsets, so that
`target_id = draft_id + d2t[draft_id]`), `t2d[j] = True` iff target token j is in the draft vocab.
Draft ids are sorted by target id, which makes the offsets non-decreasing and non-negative.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.errors import InputError, MissingInput


def frequent_tokens(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """Token counts [V] -> the `draft_vocab_size` most frequent token ids [Vd], ascending.

    Ties in count are broken by the lower token id, so the choice is deterministic.
    """
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise InputError(f"draft_vocab_size={draft_vocab_size} must be in 1..{vocab_size}")
    # stable sort on -count keeps lower ids first among equal counts
    order = torch.sort(-counts.to(torch.float64), stable=True).indices
    return torch.sort(order[:draft_vocab_size]).values


def build_vocab_mapping(
    counts: torch.Tensor, draft_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token counts [V] -> (d2t [Vd] int64 offsets, t2d [V] bool) over `frequent_tokens`."""
    vocab_size = counts.numel()
    used = frequent_tokens(counts, draft_vocab_size)  # [Vd] target ids, ascending
    d2t = used - torch.arange(draft_vocab_size, dtype=used.dtype)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t.to(torch.int64), t2d


def count_tokens(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Counts [V] of the tokens under the loss mask (the tokens a draft has to predict)."""
    return torch.bincount(input_ids[loss_mask.bool()].flatten(), minlength=vocab_size)


def answer_token_counts(prepared: str | Path, vocab_size: int) -> torch.Tensor:
    """Counts [V] of the answer tokens (under the loss mask) of a prepared `train` split: what a
    reduced draft vocabulary is chosen from."""
    import datasets

    folder = Path(prepared) / "dataset"
    if not folder.exists():
        raise MissingInput(
            f"{folder}: the draft vocabulary is built from prepared data; run `draftsmith prepare` "
            "first"
        )
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for rows in datasets.load_from_disk(str(folder))["train"].iter(batch_size=1024):
        for ids, mask in zip(rows["input_ids"], rows["loss_mask"]):
            counts += count_tokens(torch.tensor(ids), torch.tensor(mask), vocab_size)
    return counts
