"""Draft trees: static trees from a choices list (chains, Medusa/EAGLE-1 style) and EAGLE-2
dynamic trees (expand the top-k frontier per depth by cumulative log-prob, rerank all nodes,
keep the best `total_tokens`).

A tree always has the root at index 0: the newest committed token, which the target has not yet
read. Nodes are stored parents-first. Building is per depth, with tensor ops over all nodes of a
depth; the `Expander` (inference/drafter.py) turns frontier nodes into child log-probs.

When sampling (temperature > 0) the children can be drawn from the head's distribution instead
of taken as its top k (`Draws`): the k children of a node are k draws without replacement
(Gumbel top-k), recorded with the distribution they came from (`Proposals`) for recursive
rejection sampling (inference/verify.py). Every node still scores its parent's score plus the
log-prob of its *rank* (the k-th best), never of the token drawn, so which draws a tree keeps
does not depend on what they are, and a node's kept children are always its first draws (nor
does a lookup chain follow a drawn node). That is what keeps sampled verification exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from draftsmith.errors import InputError

if TYPE_CHECKING:
    from draftsmith.inference.costs import AdaptiveCut


@dataclass
class Proposals:
    """What a sampled tree's children were drawn from."""

    probs: torch.Tensor  # [M, Vd] the draft distribution of each expanded node
    row: torch.Tensor  # [N] each node's row in `probs` (its children's distribution), -1: none
    drawn: torch.Tensor  # [N] bool: drawn from the parent's row (else deterministic: lookup)
    ids: torch.Tensor  # [Vd] target ids of the draft vocabulary

    def select(self, keep: torch.Tensor) -> Proposals:
        return Proposals(self.probs, self.row[keep], self.drawn[keep], self.ids)

    def extended(self, r: int) -> Proposals:
        """With `r` deterministic (not drawn, not expanded) nodes appended."""
        return Proposals(
            self.probs,
            torch.cat([self.row, self.row.new_full((r,), -1)]),
            torch.cat([self.drawn, self.drawn.new_zeros(r)]),
            self.ids,
        )


@dataclass
class Tree:
    tokens: torch.Tensor  # [N] target token ids; tokens[0] = root
    parents: torch.Tensor  # [N] parent index, -1 for the root
    depths: torch.Tensor  # [N] root = 0
    ancestors: torch.Tensor  # [N, N] bool, ancestors[i, j] = j is i or an ancestor of i
    proposals: Proposals | None = None  # sampled trees only
    # [N] dynamic trees: each node's cumulative draft log-prob, +inf on a grafted chain's path
    # (always kept)
    scores: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.tokens.numel()

    @property
    def depth(self) -> int:
        return int(self.depths.max())

    def path_tokens(self, nodes: torch.Tensor) -> torch.Tensor:
        """[F, d+1] tokens from the root down to each node (all nodes at the same depth d)."""
        d = int(self.depths[nodes[0]])
        on_path = self.ancestors[nodes]  # [F, N]
        by_depth = self.depths[None, :] == torch.arange(d + 1)[:, None]  # [d+1, N]
        index = (on_path[:, None, :] & by_depth[None]).float().argmax(-1)  # [F, d+1]
        return self.tokens[index]

    def best(self, n: int) -> Tree:
        """The root and the n - 1 best-scoring nodes (dynamic trees). A child never outscores
        its parent and the stable sort ranks the lower index (an ancestor) first among equal
        scores, so the kept set is closed under ancestors."""
        if self.scores is None:
            raise ValueError("only a dynamic tree's nodes carry scores to keep the best by")
        order = torch.sort(-self.scores[1:], stable=True).indices + 1
        keep = torch.cat([torch.zeros(1, dtype=torch.long), order[: n - 1].sort().values])
        return self.select(keep)

    def select(self, keep: torch.Tensor) -> Tree:
        """Sub-tree of nodes `keep` (ascending, closed under ancestors), re-indexed."""
        remap = torch.full((self.size,), -1, dtype=torch.long)
        remap[keep] = torch.arange(keep.numel())
        parents = self.parents[keep]
        parents = torch.where(parents >= 0, remap[parents.clamp_min(0)], parents)
        proposals = None if self.proposals is None else self.proposals.select(keep)
        scores = None if self.scores is None else self.scores[keep]
        return Tree(
            self.tokens[keep],
            parents,
            self.depths[keep],
            self.ancestors[keep][:, keep],
            proposals,
            scores,
        )


class Expander(Protocol):
    """What a tree builder needs from a draft head (see inference/drafter.py)."""

    def root_logprobs(self) -> torch.Tensor:
        """[Vd] log-probs of the root's children (from the last committed draft state)."""

    def expand(self, nodes: torch.Tensor, tree: Tree) -> torch.Tensor:
        """[F, Vd] log-probs of the children of `nodes` (all at one depth) of the partial tree."""

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target ids."""


@dataclass
class Draws:
    """How a node's k children come from its draft log-probs [F, Vd]: the top k (EAGLE-2), or,
    with a temperature, k draws without replacement from softmax(log-probs / temperature)."""

    temperature: float = 0.0  # 0: the top k
    generator: torch.Generator | None = None

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    def sample(self, logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> ([F, k] draft ids drawn without replacement, in draw order; [F, Vd] the
        distribution they were drawn from, softmax(log-probs / temperature)). The order of
        logits + Gumbel noise is a sequence of draws without replacement from softmax(logits)."""
        logits = logprobs.float() / self.temperature
        uniform = torch.rand(logprobs.shape, generator=self.generator)
        gumbel = -torch.log(-torch.log(uniform))
        return (logits + gumbel).topk(k, dim=-1).indices, torch.softmax(logits, dim=-1)


def branch_label(tree: dict) -> str:
    """A tree's prompt-lookup branch in names (its settings as a dict: a TreeSpec's, or a
    results.json's, where results before session 93 have no lookup_by_match and older ones no
    lookup): lookup8, lookup4-8-8-15, or empty."""
    lengths = tree.get("lookup_by_match") or ([tree["lookup"]] if tree.get("lookup") else [])
    return "lookup" + "-".join(map(str, lengths)) if lengths else ""


@dataclass
class TreeSpec:
    """How to draft: `dynamic` (EAGLE-2), `static` (choices, or top-k rank products), `chain`."""

    # "dynamic" (EAGLE-2), "static" (choices or top-k rank products) or "chain"
    kind: str = "dynamic"
    # draft depth (tokens ahead of the root); children kept per expanded node
    depth: int = 5
    top_k: int = 4
    # nodes verified per target forward, root included (dynamic and generated static trees)
    total_tokens: int = 16
    # static tree paths of top-ranks, e.g. [[0], [1], [0, 0]]; empty = generated from top_k
    choices: list[list[int]] = field(default_factory=list)
    # target tree-attention backend: sdpa | flex | flash (CUDA)
    attention: str = "sdpa"
    # tokens of a prompt-lookup continuation (inference/lookup.py) grafted below the root,
    # 0 = off; a dynamic tree gives up a head node per chain token the head did not draft
    # itself, so total_tokens still bounds it (a static or chain tree grows by up to `lookup`)
    lookup: int = 0
    # instead of `lookup`: tokens of the branch after a 1-, 2-, .. n-token match (n = the list's
    # length, the longest suffix searched), a copy past the context's end running on into itself
    # (inference/lookup.py), e.g. [4, 8, 8, 15]; a dynamic tree keeps at most total_tokens - 1
    lookup_by_match: list[int] = field(default_factory=list)
    # at temperature > 0: draw each node's children from the head's distribution (without
    # replacement; verified by recursive rejection sampling) instead of taking its top k
    sample_drafts: bool = True
    # dynamic trees at T=0 (or top-k children): verify, per step, only the best nodes worth
    # their share of the forward's cost on this machine (measured when the decoder is built;
    # inference/costs.py), up to total_tokens
    adaptive: bool = False
    # at temperature > 0: "token" (each node's children in turn, as EAGLE and SpecInfer) or
    # "traversal" (whole paths, leaves first; inference/verify.py), which needs a tree shape
    # that does not depend on what was drawn: static and chain trees, or top-k children
    verify: str = "token"

    def __post_init__(self) -> None:
        if self.kind not in ("dynamic", "static", "chain"):
            raise InputError(f"tree.kind={self.kind!r}: expected dynamic, static or chain")
        if self.verify not in ("token", "traversal"):
            raise InputError(f"tree.verify={self.verify!r}: expected token or traversal")
        if self.attention not in ("sdpa", "flex", "flash"):
            raise InputError(f"tree.attention={self.attention!r}: expected sdpa, flex or flash")
        for name, least in (("depth", 1), ("top_k", 1), ("total_tokens", 2)):  # 2: root + a draft
            if getattr(self, name) < least:
                raise InputError(f"tree.{name}={getattr(self, name)}: expected >= {least}")
        if self.adaptive and self.kind != "dynamic":
            raise InputError(
                f"tree.adaptive=true sizes dynamic trees (their nodes carry draft scores); "
                f"tree.kind={self.kind!r}"
            )
        if self.lookup < 0 or (self.kind == "dynamic" and self.lookup >= self.total_tokens - 1):
            raise InputError(
                f"tree.lookup={self.lookup}: expected >= 0, and for a dynamic tree fewer than "
                f"total_tokens - 1 = {self.total_tokens - 1} (the head keeps the other nodes)"
            )
        by_match = self.lookup_by_match
        if by_match and self.lookup:
            raise InputError(
                f"tree.lookup={self.lookup} with tree.lookup_by_match={by_match}: set one "
                "(lookup_by_match=[] or lookup=0)"
            )
        longest = self.total_tokens - 1 if self.kind == "dynamic" else None
        if any(n < 1 or (longest and n > longest) for n in by_match):
            raise InputError(
                f"tree.lookup_by_match={by_match}: expected tokens >= 1 after each match length"
                + (f", and at most total_tokens - 1 = {longest}" if longest else "")
            )

    @property
    def branch(self) -> bool:
        """Whether a prompt-lookup branch is grafted into every tree."""
        return bool(self.lookup or self.lookup_by_match)

    @property
    def drafted_depth(self) -> int:
        """How many tokens ahead of the root the head drafts at most (a lookup branch aside)."""
        if self.kind == "static":
            choices = self.choices or topk_choices(self.depth, self.top_k, self.total_tokens)
            return max(map(len, choices))
        return self.depth

    def refuse_drawn(self, temperature: float) -> None:
        """Refuse, at `temperature`, the settings under which children drawn from the head
        (temperature > 0 with sample_drafts) would make decoding inexact."""
        if temperature <= 0 or not self.sample_drafts:
            return
        if self.adaptive:
            raise InputError(
                "tree.adaptive=true sizes each tree by the scores of all its nodes, which with "
                "drawn children depend on what was drawn (recursive rejection sampling would no "
                "longer be exact); at temperature > 0 set tree.sample_drafts=false (top-k "
                "children) or tree.adaptive=false"
            )
        if self.verify == "traversal" and self.kind == "dynamic":
            raise InputError(
                "tree.verify=traversal decides whole subtrees, and a dynamic tree keeps drawn "
                "children by scores that compete across siblings, so a subtree's shape would "
                "depend on its later siblings' draws (no longer exact); use tree=static or "
                "tree=chain, tree.sample_drafts=false (top-k children) or tree.verify=token"
            )

    def check_heads(self, heads: int | None, head: str) -> None:
        """Refuse a tree deeper than a parallel head's `heads`, one per depth (None: an
        autoregressive head, which drafts any depth)."""
        if heads is not None and self.drafted_depth > heads:
            which = "tree.choices" if self.kind == "static" and self.choices else "tree.depth"
            raise InputError(
                f"{which}: the tree drafts {self.drafted_depth} tokens deep, but the {head} head "
                f"has {heads} heads (head.num_heads), one per depth: pass a tree at most {heads} "
                f"deep (tree.depth={heads}) or train a head with more"
            )


class _Builder:
    """Growable node arrays with ancestor masks, filled one depth at a time; with sampled
    `draws`, also the distribution each expanded node's children were drawn from."""

    def __init__(self, root_token: int, capacity: int, draws: Draws, expander: Expander) -> None:
        self.tokens = torch.zeros(capacity, dtype=torch.long)
        self.parents = torch.full((capacity,), -1, dtype=torch.long)
        self.depths = torch.zeros(capacity, dtype=torch.long)
        self.scores = torch.zeros(capacity)
        self.ancestors = torch.zeros(capacity, capacity, dtype=torch.bool)
        self.tokens[0] = root_token
        self.ancestors[0, 0] = True
        self.size = 1
        self.draws, self.expander = draws, expander
        self.rows = torch.full((capacity,), -1, dtype=torch.long)
        self.probs: list[torch.Tensor] = []  # [F, Vd] per expansion, rows in expansion order
        self.expanded = 0  # rows in self.probs

    def children(
        self, nodes: torch.Tensor, logprobs: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The k children (target ids [.., k]) of `nodes` [F] given their log-probs [.., Vd],
        and their rank scores [.., k]: the k best log-probs. Records what draws came from."""
        top = logprobs.topk(k, dim=-1)
        ids = top.indices
        if self.draws.sampled:
            ids, probs = self.draws.sample(logprobs, k)
            self.rows[nodes] = torch.arange(self.expanded, self.expanded + nodes.numel())
            self.probs.append(probs.reshape(nodes.numel(), -1))
            self.expanded += nodes.numel()
        return self.expander.to_target(ids), top.values.float()

    def add(
        self, parents: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor
    ) -> torch.Tensor:
        n = parents.numel()
        ids = torch.arange(self.size, self.size + n)
        self.parents[ids], self.tokens[ids], self.scores[ids] = parents, tokens, scores
        self.depths[ids] = self.depths[parents] + 1
        self.ancestors[ids] = self.ancestors[parents]
        self.ancestors[ids, ids] = True
        self.size += n
        return ids

    def view(self) -> Tree:
        """The nodes so far (what an expansion reads)."""
        n = self.size
        return Tree(self.tokens[:n], self.parents[:n], self.depths[:n], self.ancestors[:n, :n])

    def finish(self) -> Tree:
        """The built tree, with what its draws came from when they were sampled."""
        tree = self.view()
        if self.draws.sampled:
            tree.proposals = Proposals(
                torch.cat(self.probs),
                self.rows[: tree.size],
                torch.arange(tree.size) > 0,  # every node but the root was drawn
                self.expander.to_target(torch.arange(self.probs[0].shape[-1])),
            )
        return tree


def build_dynamic_tree(
    expander: Expander,
    root_token: int,
    depth: int,
    top_k: int,
    total_tokens: int,
    chain: torch.Tensor | None = None,
    draws: Draws | None = None,
    cut: AdaptiveCut | None = None,
) -> Tree:
    """EAGLE-2: grow `depth` levels, expanding the top_k frontier nodes by cumulative log-prob,
    then keep the `total_tokens` best nodes (root included). A child never outscores its parent
    (log-probs <= 0) and ties go to the lower index, so the kept set is closed under ancestors.

    `chain` [C] (target ids, e.g. a prompt-lookup continuation) is grafted below the root and
    always kept; where it follows the head's own drafts it costs no extra node, so the head keeps
    `total_tokens - 1 - (C - shared)` of its best nodes rather than `total_tokens - 1 - C`.

    A level is not drafted when none of its nodes could be kept (`_never_kept`): the same tree,
    one head step sooner (the last of three expansions in 26% of the recipe's MT-bench steps).
    With `tree.adaptive`'s `cut`, also when this step's cut could keep none of them (on a Zen 4,
    the third expansion in 21% of `r67`'s steps, the last in 58% of those reaching it).

    With sampled `draws` the chain never follows drawn nodes (whether a draw is kept must not
    depend on which token it drew): its nodes are all extra, deterministic candidates."""
    draws = draws or Draws()
    capacity = 1 + top_k + (depth - 1) * top_k * top_k
    tree = _Builder(root_token, capacity, draws, expander)
    tokens, scores = tree.children(
        torch.zeros(1, dtype=torch.long), expander.root_logprobs(), top_k
    )
    frontier = tree.add(torch.zeros(top_k, dtype=torch.long), tokens, scores)
    # the head's nodes that can be kept besides the chain's C (which are kept whatever they score)
    chained = 0 if chain is None else chain.numel()
    slots = total_tokens - 1 - chained
    on_chain = 0  # the deepest node so far whose path from the root is a prefix of the chain
    follow = None if draws.sampled else chain
    for level in range(1, depth):
        on_chain = _follow_chain(tree, on_chain, follow, level)
        if _never_kept(tree, frontier, on_chain, slots, cut, chained):
            break  # nothing below this frontier can make the tree: the same tree, drafted sooner
        logprobs = expander.expand(frontier, tree.view())  # [F, Vd]
        tokens, ranks = tree.children(frontier, logprobs, top_k)  # [F, k] each
        scores = tree.scores[frontier][:, None] + ranks  # [F, k]
        added = tree.add(frontier.repeat_interleave(top_k), tokens.flatten(), scores.flatten())
        frontier = added[scores.flatten().topk(top_k).indices.sort().values]
    full, scores = tree.finish(), tree.scores[: tree.size]
    if chain is not None:
        full, leaf = graft_chain(full, chain)
        scores = torch.cat([scores, scores.new_zeros(full.size - scores.numel())])
        scores = scores.masked_fill(full.ancestors[leaf], float("inf"))  # the chain ranks first
    full.scores = scores
    return full.best(total_tokens)


def _follow_chain(tree: _Builder, node: int, chain: torch.Tensor | None, level: int) -> int:
    """`node` (on the chain's path at depth level - 1), or its child at depth `level` whose
    token continues the chain, if the head drafted one."""
    if chain is None or chain.numel() < level or int(tree.depths[node]) != level - 1:
        return node
    n = tree.size
    child = (tree.parents[:n] == node) & (tree.tokens[:n] == chain[level - 1])
    hit = child.nonzero().flatten()
    return int(hit[0]) if hit.numel() else node


def _never_kept(
    tree: _Builder,
    frontier: torch.Tensor,
    on_chain: int,
    slots: int,
    cut: AdaptiveCut | None,
    chain: int,
) -> bool:
    """Whether no descendant of `frontier` can be among the kept nodes: every frontier node
    scores at most the `slots`-th best of the nodes off the chain's path (the chain's `chain`
    nodes are kept whatever they score), or `cut` keeps none of them; a child scores at most
    its parent (log-probs <= 0) and, created later, loses ties. A chain node not drafted is
    grafted after every node kept with it, in the place drafting it would have taken, so the
    tree is the same either way."""
    if slots <= 0:
        return True
    n = tree.size
    competing = tree.scores[1:n][~tree.ancestors[on_chain, 1:n]]  # [M] off the chain's path
    top = float(tree.scores[frontier].max())
    if competing.numel() >= slots and top <= competing.topk(slots).values[-1]:
        return True
    return cut is not None and cut.keeps_none_below(competing, top, chain)


@dataclass
class StaticTree:
    """A fixed tree shape from `choices`: each choice is the path of top-ranks from the root,
    e.g. [[0], [1], [0, 0]] = the top-2 children of the root and the top child of the first."""

    choices: list[list[int]]

    def __post_init__(self) -> None:
        paths = sorted({tuple(c) for c in self.choices}, key=lambda p: (len(p), p))
        missing = [p for p in paths if len(p) > 1 and p[:-1] not in set(paths)]
        if missing or any(len(p) == 0 or min(p) < 0 for p in paths):
            raise InputError(
                f"tree choices must be non-empty rank paths closed under prefixes; "
                f"missing parents for {missing}"
            )
        self.paths = paths
        # every node's children are ranks 0..m-1 (generated trees are; hand-written ones may not be)
        self.rank_prefixes = all(p[-1] == 0 or (*p[:-1], p[-1] - 1) in set(paths) for p in paths)
        index = {(): 0, **{p: i + 1 for i, p in enumerate(paths)}}
        self.max_depth = max(len(p) for p in paths)
        # per depth: which nodes get expanded, and for each new node (its row there, its rank)
        self.levels = []
        for d in range(1, self.max_depth + 1):
            level = [p for p in paths if len(p) == d]
            expanded = sorted({index[p[:-1]] for p in level})
            row = {node: r for r, node in enumerate(expanded)}
            self.levels.append(
                (
                    torch.tensor(expanded),
                    torch.tensor([row[index[p[:-1]]] for p in level]),
                    torch.tensor([p[-1] for p in level]),
                    torch.tensor([index[p[:-1]] for p in level]),
                )
            )

    def build(self, expander: Expander, root_token: int, draws: Draws | None = None) -> Tree:
        draws = draws or Draws()
        if draws.sampled and not self.rank_prefixes:
            raise InputError(
                "sampled drafts need every node's children to be its first ranks (0, 1, ...), "
                "as a draw left out would change the law of the draws after it; fix "
                "tree.choices or set tree.sample_drafts=false"
            )
        tree = _Builder(root_token, 1 + len(self.paths), draws, expander)
        for d, (expanded, rows, ranks, parents) in enumerate(self.levels):
            if d == 0:
                logprobs = expander.root_logprobs()[None]
            else:
                logprobs = expander.expand(expanded, tree.view())
            tokens, scores = tree.children(expanded, logprobs, int(ranks.max()) + 1)
            tree.add(parents, tokens[rows, ranks], tree.scores[parents] + scores[rows, ranks])
        return tree.finish()


def graft_chain(tree: Tree, chain: torch.Tensor) -> tuple[Tree, int]:
    """`tree` with the path `chain` [C] (target ids) below its root, and the chain's last node.
    The chain follows existing nodes while their tokens match (siblings stay distinct) and the
    rest is appended as new nodes, after all others, so the tree stays parents-first. In a
    sampled tree it follows none (a drawn node must not be kept for what it drew)."""
    node, shared = 0, 0
    follow = chain.tolist() if tree.proposals is None else []
    for token in follow:  # C is a few tokens; each step one [N] comparison
        child = ((tree.parents == node) & (tree.tokens == token)).nonzero().flatten()
        if child.numel() == 0:
            break
        node, shared = int(child[0]), shared + 1
    rest = chain[shared:]  # [R]
    n, r = tree.size, rest.numel()
    if r == 0:
        return tree, node
    ancestors = torch.zeros(n + r, n + r, dtype=torch.bool)
    ancestors[:n, :n] = tree.ancestors
    ancestors[n:, :n] = tree.ancestors[node]
    ancestors[n:, n:] = torch.ones(r, r, dtype=torch.bool).tril()
    grafted = Tree(
        torch.cat([tree.tokens, rest]),
        torch.cat([tree.parents, torch.tensor([node]), torch.arange(n, n + r - 1)]),
        torch.cat([tree.depths, tree.depths[node] + torch.arange(1, r + 1)]),
        ancestors,
        None if tree.proposals is None else tree.proposals.extended(r),
    )
    return grafted, n + r - 1


def chain_choices(depth: int) -> list[list[int]]:
    return [[0] * d for d in range(1, depth + 1)]


def topk_choices(depth: int, top_k: int, total_tokens: int) -> list[list[int]]:
    """A static tree that keeps the `total_tokens - 1` paths most likely to be accepted, a
    data-free stand-in for Medusa's calibrated trees: a rank-r draft is taken to be accepted with
    probability 2^-(r+1) (0.5, 0.25, ...; trained heads measure ~0.4-0.6 for their top-1), and a
    path scores the product along it. (Scoring rank 0 as 1 made depth free: the tree was a
    top-1 chain with side branches at its bottom, without the root's second-best draft.)"""
    import heapq

    heap = [(-(0.5 ** (r + 1)), (r,)) for r in range(top_k)]
    heapq.heapify(heap)
    chosen: list[list[int]] = []
    while heap and len(chosen) < total_tokens - 1:
        score, path = heapq.heappop(heap)
        chosen.append(list(path))
        if len(path) < depth:
            for r in range(top_k):
                heapq.heappush(heap, (score * 0.5 ** (r + 1), (*path, r)))
    return chosen
