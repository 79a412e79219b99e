"""Prompt lookup (n-gram matching against the context), as a branch of the draft tree.

The latest `max_ngram` tokens (then fewer) are searched for earlier in the prompt + output; the
tokens that followed the earliest match are a free draft, exact copies of the context being what
a small head predicts worst (code, names, repeated phrases). The matching is the one transformers'
prompt-lookup assisted generation does (`PromptLookupCandidateGenerator`), so the eval's
prompt-lookup baseline and this branch propose the same tokens, up to their lengths (the baseline
also cuts its proposal at an EOS; the decoder stops at one anyway).
"""

from __future__ import annotations

import torch


def prompt_lookup(context: torch.Tensor, max_tokens: int, max_ngram: int = 2) -> torch.Tensor:
    """[L] token ids, newest last -> [C] ids (C <= max_tokens, maybe 0) proposed to follow."""
    length = context.numel()
    for n in range(min(max_ngram, length - 1), 0, -1):
        windows = context.unfold(0, n, 1)  # [L-n+1, n]
        starts = (windows == context[-n:]).all(-1).nonzero().flatten() + n  # [M]
        starts = starts[starts < length]  # the newest n-gram matches itself, with nothing after
        if starts.numel():
            start = int(starts[0])
            return context[start : start + max_tokens]
    return context[:0]
