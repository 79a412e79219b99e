"""How many tree nodes pay on this machine (`tree.adaptive`): what one target forward costs per
number of tokens, and the per-step size that trades expected accepted tokens against it.

A forward over N tree nodes reads every weight once, as a one-token step does, but its kernels
are not flat in N: on a 2-core AVX2-only CPU, packed fp32, one token took 69 ms and two to six
~105 (session 49); with bf16 instructions eight cost about what one does (DESIGN.md). The costs
are measured, not assumed: after a `context`-token prefix, median over interleaved rounds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from draftsmith.inference.attention import attention_windows, tree_attention, tree_masks
from draftsmith.target import cache_kwarg


def clock(device: torch.device) -> Callable[[], float]:
    """perf_counter, after waiting for queued CUDA work (kernels run asynchronously, so an
    unsynchronised clock would bill the forward to whichever part next reads a result)."""
    if device.type != "cuda":
        return time.perf_counter

    def synced() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return synced


def forward_ms(
    target: torch.nn.Module,
    cache: DynamicCache,
    context: int,
    size: int,
    attention: str | None = None,
) -> float:
    """One forward of `size` tokens after the `context` cached ones, in ms; the cache is cut
    back to `context` afterwards. `attention`: a tree backend (a chain mask, positions prefix +
    depth, as the decoder verifies; call inside `tree_attention`), or None for the model's own
    attention as `generate` runs it."""
    device = next(target.parameters()).device
    ids = torch.randint(0, min(40000, target.config.vocab_size), (1, size), device=device)
    kwargs = {cache_kwarg(target): cache, "use_cache": True}
    if attention is not None:
        chain = torch.ones(size, size, dtype=torch.bool).tril()  # [N, N]
        depths = torch.arange(size)
        masks = tree_masks(
            attention_windows(target.config), chain, depths, context, attention, target.dtype
        )
        if isinstance(masks, dict):
            kwargs["attention_mask"] = {k: m.to(device) for k, m in masks.items()}
        else:
            kwargs["attention_mask"] = masks.to(device)
        kwargs["position_ids"] = (context + depths)[None].to(device)
    timer = clock(device)
    t0 = timer()
    target(input_ids=ids, **kwargs)
    seconds = timer() - t0
    cache.crop(-size)  # transformers 5: a negative count of tokens to drop
    if cache.get_seq_length() != context:
        raise RuntimeError("the cache did not go back to the prefix")
    return seconds * 1e3


@torch.no_grad()
def tree_forward_costs(
    target: torch.nn.Module, attention: str, max_size: int, context: int = 256, rounds: int = 5
) -> torch.Tensor:
    """[max_size] ms of a tree forward over 1..max_size nodes: the median of `rounds` (sizes
    interleaved, their order rotating per round, after an untimed warm-up round), each size
    priced at most what any bigger one measured. A bigger tree never costs less, and timing
    noise mostly adds: a slow outlier must not price every size above it (a running maximum
    from below would; a running minimum from above drops it)."""
    device = next(target.parameters()).device
    generator = torch.Generator().manual_seed(0)
    high = min(40000, target.config.vocab_size)
    prefix = torch.randint(0, high, (1, context), generator=generator).to(device)  # [1, S]
    cache = DynamicCache(config=target.config)
    target(input_ids=prefix, **{cache_kwarg(target): cache}, use_cache=True, logits_to_keep=1)
    sizes = list(range(1, max_size + 1))
    times: dict[int, list[float]] = {n: [] for n in sizes}
    with tree_attention(target, attention):
        for r in range(rounds + 1):  # round 0 warms up
            for n in sizes[r % max_size :] + sizes[: r % max_size]:
                ms = forward_ms(target, cache, context, n, attention)
                if r:
                    times[n].append(ms)
    median = torch.tensor([sorted(times[n])[len(times[n]) // 2] for n in sizes])  # [max_size]
    return median.flip(0).cummin(0).values.flip(0)


def adaptive_size(scores: torch.Tensor, costs: torch.Tensor, rate: float) -> int:
    """How many of a dynamic tree's nodes (root included) to verify: the n <= len(scores) that
    maximises expected accepted drafts - `rate` (tokens per ms) x `costs`[n - 1] (ms).

    A node's exp(score), the product of its path's draft probabilities, estimates the chance
    that the target accepts it (EAGLE-2's argument; measured for `qa48`'s head in fp32: nodes
    predicted 0.03 / 0.14 / 0.28 / 0.52 / 0.82 were accepted 0.03 / 0.13 / 0.29 / 0.51 / 0.72 of
    the time), so the best n - 1 nodes are expected to add the sum of theirs. With `rate` the
    decoder's tokens per ms, a node is worth its share of the forward's cost when it adds more
    than that time would produce at the running rate (Dinkelbach: maximising the long-run rate,
    not each step's). A grafted chain's nodes (+inf) are always kept."""
    n = scores.numel()
    chain = int(scores[1:].isinf().sum())  # [N-1] scores after the root; the chain's come first
    values = scores[1:][scores[1:].isfinite()].exp().sort(descending=True).values  # [N-1-C]
    gain = torch.cat([values.new_zeros(1 + chain), values.cumsum(0)])  # [N] by size 1..N
    objective = gain - rate * costs[:n].to(gain.dtype)
    objective[:chain] = float("-inf")  # fewer nodes than the root and the chain
    return int(objective.argmax()) + 1


@dataclass(frozen=True)
class AdaptiveCut:
    """One step's `tree.adaptive` cut: the forward's cost by size and the running rate."""

    costs: torch.Tensor  # [N] ms of a forward over 1..N nodes
    rate: float  # tokens per ms so far: what a node's share of the cost must beat

    def size(self, scores: torch.Tensor) -> int:
        """How many of a built tree's nodes to verify (`adaptive_size`)."""
        return adaptive_size(scores, self.costs, self.rate)

    def keeps_none_below(self, drafted: torch.Tensor, top: float, chain: int) -> bool:
        """Whether the cut keeps no node still to be drafted below a frontier whose best score
        is `top`, whatever they score, so the tree need not grow further. `drafted` [M]: the
        finite scores drafted so far (off the chain's path); `chain`: the chain's node count.

        A node to come scores at most `top` and loses ties to those drafted before it, so the
        nodes drafted so far that score >= `top` rank first: every size that keeps only them and
        the chain has an objective the new nodes cannot change. A bigger size adds at most
        exp(`top`) per node over them, so when even that bound cannot reach the best of the
        smaller sizes, the cut of the grown tree is the cut of this one. The bound works in
        float64 and asks a margin over `adaptive_size`'s float32 rounding."""
        costs = self.costs.double()
        first = 1 + chain + int((drafted >= top).sum())  # sizes <= first: decided already
        if first >= costs.numel():
            return True
        values = drafted.double().exp().sort(descending=True).values[: first - 1 - chain]
        gain = torch.cat([values.new_zeros(1 + chain), values.cumsum(0)])  # [first]
        decided = gain - self.rate * costs[:first]
        decided[:chain] = float("-inf")  # fewer nodes than the root and the chain
        more = torch.arange(1, costs.numel() - first + 1, dtype=torch.float64)  # nodes past first
        bound = gain[-1] + more * math.exp(top) - self.rate * costs[first:]
        return bool(decided.max() >= bound.max() + 1e-4)
