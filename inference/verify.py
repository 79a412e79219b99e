"""Verification of a draft tree against the target's logits at every node.

Greedy: follow the children whose token equals the target's argmax; the argmax at the last
accepted node is the bonus token. Stochastic (temperature > 0): multi-round speculative sampling
over siblings as in EAGLE's `evaluate_posterior`: a deterministic candidate x is accepted with
probability p(x); on rejection p(x) is zeroed and p renormalised before the next sibling; if all
are rejected the bonus is drawn from what is left. A candidate drawn from the head's
distribution q (sampled trees, inference/tree.py `Draws`) is accepted with probability
min(1, p(x) / q(x)); on rejection p becomes the residual norm(max(0, p - q)) and x leaves q, as
the next sibling was drawn without it (recursive rejection sampling without replacement, RSD).
Either way each round hands on exactly a draw from p, so the output distribution is the
target's whatever the draft proposes.

`tree.verify=traversal` decides whole paths instead (Traversal Verification, Weng et al. 2025;
on a chain, Block Verification, Sun et al. 2024): a node reached with weight w (1 at the root)
gives a child x the weight min(1, w p(x) / q(x)) and tries its subtree first, leaves before
their parents (post-order); a node whose children are all rejected is accepted with its weight,
and a rejected subtree leaves its parent p = norm(max(0, w p - q)) and w = r / (1 - w + r),
r = sum(max(0, w p - q)). By induction over the tree each node, reached with weight w, is
accepted with its next token b with probability w p(b) and rejected with 1 - w, so the root
(w = 1) hands on exactly a draw from p. A path rejected token by token for one unlikely step
can still be accepted whole (w carries its other steps' surplus). The induction needs every
subtree's shape fixed before its later siblings are drawn; a dynamic tree keeps draws by
competing scores across siblings, so it is refused with drawn children (decoder.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from draftsmith.inference.tree import Tree


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def processors(self) -> LogitsProcessorList:
        """The same warpers, in the same order, as transformers' `generate(do_sample=True)`."""
        procs = LogitsProcessorList()
        if self.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k > 0:
            procs.append(TopKLogitsWarper(top_k=self.top_k))
        if self.top_p < 1.0:
            procs.append(TopPLogitsWarper(top_p=self.top_p))
        return procs

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V] logits -> [N, V] sampling probabilities."""
        scores = self.processors()(None, logits.float())
        return torch.softmax(scores, dim=-1)


def generate_kwargs(
    tokenizer, sampling: Sampling, max_new_tokens: int, stop_ids: list[int]
) -> dict:
    """transformers `generate` settings for plain decoding with `sampling` until one of
    `stop_ids` (target.stop_token_ids), as the speculative decoder samples and stops. top_k
    goes in even when 0 (off), so a model's own generation config cannot add one (load_target
    already drops a checkpoint's decoding defaults)."""
    kwargs = {
        "max_new_tokens": max_new_tokens,
        "do_sample": not sampling.greedy,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": stop_ids,
    }
    if not sampling.greedy:
        kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    return kwargs


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of `probs` [..., V] (each row's mass need not sum to 1) -> [...]: the
    inverse of each row's cumulative distribution at a uniform draw, summed in float64 so every
    token keeps its own probability to ~1e-16. On a CPU, torch.multinomial draws V exponentials
    per row: 2.0 ms for one row of SmolLM2's 49k tokens against 0.1 here, paid by every sampled
    step (51.6 against 10.5 ms for regeneration's 32 rows)."""
    cdf = probs.double().cumsum(-1)  # [..., V]
    total = cdf[..., -1:]  # [..., 1]
    if not bool((total > 0).all()):  # what torch.multinomial refuses too: no mass, or NaN logits
        raise ValueError(f"cannot draw from probabilities summing to {total.flatten().tolist()}")
    u = torch.rand(total.shape, dtype=torch.float64, generator=generator)  # [..., 1] in [0, 1)
    # the first token whose cumulative mass passes u * total, a token of no mass never; u is at
    # most 1 - 2^-53, so u * total rounds below total and every row finds one
    return torch.searchsorted(cdf, u * total, right=True).squeeze(-1)


def pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> int:
    """One token from one row of logits [V] (argmax or a sample)."""
    if sampling.greedy:
        return int(logits.max(-1).indices)
    return int(draw(sampling.probs(logits[None])[0], generator))


def _path_to(tree: Tree, leaf: int) -> torch.Tensor:
    # nodes are stored parents-first, so ascending index along a path is ascending depth
    return tree.ancestors[leaf].nonzero().flatten()


def accept_greedy(tree: Tree, logits: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Returns (accepted path node ids, root first) and the bonus token."""
    # max().indices, not argmax(): the same first-maximum index, ~3x faster on CPU (0.2 against
    # 0.6 ms for a 16-node tree's [16, 49k] logits, every step)
    predicted = logits.max(-1).indices  # [N]
    match = tree.tokens == predicted[tree.parents.clamp_min(0)]  # [N] drafted = parent's argmax
    match[0] = True
    ok = ~(tree.ancestors & ~match).any(-1)  # [N] every node from the root down to it matches
    leaf = int(torch.where(ok, tree.depths, -1).argmax())  # deepest; ties: the lowest index
    return _path_to(tree, leaf), int(predicted[leaf])


def _proposal(tree: Tree, node: int, vocab: int) -> torch.Tensor | None:
    """[V] the distribution `node`'s drawn children came from, over target ids; None if none."""
    props = tree.proposals
    if props is None or int(props.row[node]) < 0:
        return None
    q = torch.zeros(vocab)
    q[props.ids] = props.probs[props.row[node]]
    return q


def _children(tree: Tree, node: int) -> list[tuple[int, int, bool]]:
    """`node`'s children as (node id, token, drawn) in the order they are tried: a
    deterministic child (a lookup chain's) before drawn ones, so that when a draw and the chain
    hold the same token the chain's deeper branch is the one taken; drawn children in the order
    they were drawn."""
    children = (tree.parents == node).nonzero().flatten()
    if tree.proposals is None:
        drawn = torch.zeros_like(children, dtype=torch.bool)
    else:
        drawn = tree.proposals.drawn[children]
        order = torch.sort(drawn.int(), stable=True).indices
        children, drawn = children[order], drawn[order]
    return list(zip(children.tolist(), tree.tokens[children].tolist(), drawn.tolist()))


def _rejected(
    w: float, p: torch.Tensor, q: torch.Tensor | None, token: int, drawn: bool
) -> tuple[torch.Tensor, float, torch.Tensor | None]:
    """What a rejected child `token` leaves its parent (weight w, 1 token by token): the
    residual norm(max(0, w p - q)) [V] (q one-hot for a deterministic child) and its mass
    before normalising, and q without the token when the child was drawn (the next sibling
    was drawn without it). A zero mass keeps p: token by token, or at weight 1, only by
    rounding (the rejection had probability > 0); below weight 1 the weight becomes 0, and p
    is never drawn from."""
    if drawn:
        residual = (w * p - q).clamp_min(0.0)  # [V]
        q[token] = 0.0
        q = q / q.sum()
    else:
        residual = w * p
        residual[token] = 0.0  # w p(x) - 1 <= 0
    r = float(residual.sum())
    return (residual / r if r > 0 else p), r, q


def accept_sampled(
    tree: Tree, logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, int]:
    node = 0
    while True:
        # only the nodes on the accepted path: a few of the tree's rows
        p = sampling.probs(logits[node][None])[0]  # [V]
        q = _proposal(tree, node, p.numel())  # [V] or None
        accepted = None
        for child, token, drawn in _children(tree, node):
            u = torch.rand((), generator=generator)
            # u < p / q: accepted with probability min(1, p / q); a deterministic child: q = 1
            if u * (q[token] if drawn else 1.0) < p[token]:
                accepted = child
                break
            p, _, q = _rejected(1.0, p, q, token, drawn)
        if accepted is None:
            bonus = int(draw(p, generator))
            return _path_to(tree, node), bonus
        node = accepted


def accept_traversal(
    tree: Tree, logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, int]:
    """Traversal verification (module docstring): the accepted path and the bonus token."""

    def visit(node: int, w: float) -> tuple[int, int] | None:
        """(accepted node, bonus), or None: `node`'s subtree rejected (probability 1 - w)."""
        p = sampling.probs(logits[node][None])[0]  # [V], only for nodes the traversal reaches
        q = _proposal(tree, node, p.numel())  # [V] or None
        for child, token, drawn in _children(tree, node):
            q_token = float(q[token]) if drawn else 1.0  # a deterministic child: q = one-hot
            w_child = min(1.0, w * float(p[token]) / q_token)
            if w_child > 0 and (found := visit(child, w_child)) is not None:
                return found
            p, r, q = _rejected(w, p, q, token, drawn)
            w = 1.0 if w >= 1.0 else r / (1.0 - w + r)  # the root's stays 1: never rejected
        if torch.rand((), generator=generator) < w:
            return node, int(draw(p, generator))
        return None

    found = visit(0, 1.0)
    assert found is not None  # the root's weight is 1
    return _path_to(tree, found[0]), found[1]


def accept(
    tree: Tree,
    logits: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator | None = None,
    traversal: bool = False,
) -> tuple[torch.Tensor, int]:
    """The accepted path and bonus: greedy, or sampled token by token or by `traversal`."""
    if sampling.greedy:
        return accept_greedy(tree, logits)
    if traversal:
        return accept_traversal(tree, logits, sampling, generator)
    return accept_sampled(tree, logits, sampling, generator)
