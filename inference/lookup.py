"""Prompt lookup (n-gram matching against the context), as a branch of the draft tree.

The latest `max_ngram` tokens (then fewer) are searched for earlier in the prompt + output; the
tokens that followed the match are a free draft, exact copies of the context being what a small
head predicts worst (code, names, repeated phrases). transformers' prompt-lookup assisted
generation (`PromptLookupCandidateGenerator`, the eval's prompt-lookup baseline) matches at most
2 tokens and takes the earliest occurrence (`max_ngram=2, latest=False` here proposes what it
does). The branch matches up to 4 and takes the latest: a longer match is more likely to go on
the same way, and the latest occurrence is the text the output is repeating now. On the
`r29_ttt3` head (MT-bench T=0, d4 k4 n16 + 8 lookup tokens) tau 2.88 against 2.83, on 60 unused
ShareGPT first turns 3.19 against 3.06 (session 30, docs/experiments.md).

How far a match is worth copying depends on its length (session 93, `r92`'s head and 16-node
tree, MT-bench T=0 over 3333 steps: the first token after a 1-token match was the target's 28%
of the time, after a 4-token match 89%, and 56% of 4-token matches held for 8 tokens). Given
lengths per match length (`by_match`), a copy that reaches the context's end runs on into
itself, LZ77-style: a latest match inside a loop sits one period back, so the loop goes on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def prompt_lookup(
    context: torch.Tensor, max_tokens: int, max_ngram: int = 4, latest: bool = True
) -> torch.Tensor:
    """[L] token ids, newest last -> [C] ids (C <= max_tokens, maybe 0) proposed to follow the
    longest (up to `max_ngram`) suffix of `context` seen before, at its latest earlier
    occurrence (`latest=False`: its earliest)."""
    start, _ = _match(context, max_ngram, latest)
    return context[start : start + max_tokens]


def lookup_by_match(context: torch.Tensor, by_match: Sequence[int]) -> torch.Tensor:
    """[L] token ids, newest last -> [C] ids proposed to follow the longest suffix of `context`
    seen before (up to len(by_match) tokens), at its latest earlier occurrence: by_match[n - 1]
    of them after an n-token match, the copy running on into itself past the context's end."""
    start, n = _match(context, len(by_match), latest=True)
    if not n:
        return context[:0]
    period, want = context.numel() - start, by_match[n - 1]  # the match repeats `period` back
    if want <= period:
        return context[start : start + want]
    copies = -(-want // period)  # ceil: the repeat, as many times as `want` needs
    return context[start:].repeat(copies)[:want]


def _match(context: torch.Tensor, max_ngram: int, latest: bool) -> tuple[int, int]:
    """Where the tokens after the longest (up to `max_ngram`) suffix of `context` seen before
    start, and that suffix's length; (L, 0) when no suffix was seen before."""
    length = context.numel()
    for n in range(min(max_ngram, length - 1), 0, -1):
        windows = context.unfold(0, n, 1)  # [L-n+1, n]
        starts = (windows == context[-n:]).all(-1).nonzero().flatten() + n  # [M]
        starts = starts[starts < length]  # the newest n-gram matches itself, with nothing after
        if starts.numel():
            return int(starts[-1] if latest else starts[0]), n
    return length, 0
