"""Speculative decoding with a draft head and a draft tree, verified by one target forward.

Per step: the head drafts a tree rooted at the newest token (optionally with a prompt-lookup
branch grafted in); the target reads every node at once (tree attention mask, positions =
prefix + depth); the longest acceptable path plus one bonus token is committed; the target's KV
cache keeps exactly that path; the head is re-fed the target's true features of the accepted
tokens. Batch size 1 per sequence, as in EAGLE.

tau (acceptance length) = tokens produced by verification steps / verification forwards; the
first token comes from the prefill and is counted in neither.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from draftsmith.errors import InputError
from draftsmith.features import FeatureCapture
from draftsmith.heads import DraftHead
from draftsmith.inference.attention import (
    attention_windows,
    tree_attention,
    tree_implementation,
    tree_masks,
)
from draftsmith.inference.cache import keep_accepted
from draftsmith.inference.costs import AdaptiveCut, clock, tree_forward_costs
from draftsmith.inference.drafter import make_drafter
from draftsmith.inference.lookup import lookup_by_match, prompt_lookup
from draftsmith.inference.tree import (
    Draws,
    StaticTree,
    Tree,
    TreeSpec,
    build_dynamic_tree,
    chain_choices,
    graft_chain,
    topk_choices,
)
from draftsmith.inference.verify import Sampling, accept, pick
from draftsmith.target import cache_kwarg

# the timed parts of a speculative step (DecodeStats.<part>_seconds); verify = the last three
STEP_PARTS = ("draft", "forward", "accept", "commit")


@dataclass
class DecodeStats:
    new_tokens: int = 0
    verify_tokens: int = 0  # tokens produced by verification steps (excludes the prefill token)
    # of those, the ones the output kept: not the last step's past EOS or max_new_tokens
    output_tokens: int = 0
    forwards: int = 0  # target verification forwards
    nodes: int = 0  # tree nodes verified, root included, over all forwards
    accepted_at_depth: list[int] = field(default_factory=list)  # steps that accepted >= d drafts
    offered_at_depth: list[int] = field(default_factory=list)  # steps whose tree reached depth d
    draft_seconds: float = 0.0  # building the draft tree
    forward_seconds: float = 0.0  # the target's forward over the tree
    accept_seconds: float = 0.0  # choosing the accepted path, compacting the target's cache
    commit_seconds: float = 0.0  # re-feeding the head the accepted tokens' true features

    @property
    def tau(self) -> float:
        """Tokens accepted per verification forward, bonus included, as EAGLE's eval counts
        them (the last step's all, even past EOS or max_new_tokens)."""
        return self.verify_tokens / max(self.forwards, 1)

    @property
    def output_tau(self) -> float:
        """Output tokens per verification forward (the prefill's excluded): tau without the
        last step's tokens the output cut (SpecForge's accept length, less the prefill token)."""
        return self.output_tokens / max(self.forwards, 1)

    @property
    def nodes_per_forward(self) -> float:
        return self.nodes / max(self.forwards, 1)

    @property
    def verify_seconds(self) -> float:
        """The rest of a step after drafting: forward, acceptance and the head's commit."""
        return self.forward_seconds + self.accept_seconds + self.commit_seconds

    def add(self, other: DecodeStats) -> None:
        for name in (
            "new_tokens",
            "verify_tokens",
            "output_tokens",
            "forwards",
            "nodes",
            *(f"{part}_seconds" for part in STEP_PARTS),
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("accepted_at_depth", "offered_at_depth"):
            mine, theirs = getattr(self, name), getattr(other, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for d, v in enumerate(theirs):
                mine[d] += v

    def depth_acceptance(self) -> list[float]:
        """Per depth d: P(draft d accepted | draft d offered)."""
        return [a / o if o else 0.0 for a, o in zip(self.accepted_at_depth, self.offered_at_depth)]


class SpecDecoder:
    """Speculative decoding of `target` with `head` (bound to the target) and a tree spec;
    `draft_vocab` [Vd] (target ids) restricts a head that drafts through the target's lm_head
    to those tokens."""

    def __init__(
        self,
        target: torch.nn.Module,
        head: DraftHead,
        tree: TreeSpec,
        draft_vocab: torch.Tensor | None = None,
    ) -> None:
        self.target, self.head, self.spec = target, head, tree
        # an unsupported layer type or a backend that cannot verify this target fails here,
        # not mid-eval
        self.windows = attention_windows(target.config)
        tree_implementation(target, tree.attention)
        self.drafter = make_drafter(head, draft_vocab)
        self.aux_layers = head.aux_layers
        tree.check_heads(getattr(self.drafter, "max_depth", None), head.name)
        if tree.kind == "chain":
            self.static = StaticTree(chain_choices(tree.depth))
        elif tree.kind == "static":
            choices = tree.choices or topk_choices(tree.depth, tree.top_k, tree.total_tokens)
            self.static = StaticTree(choices)
        else:
            self.static = None
        # tree.adaptive: ms per forward of 1..total_tokens nodes, and the decoder's running
        # tokens and ms over its steps (the rate a node must beat), starting from one plain
        # forward's worth
        self.costs: torch.Tensor | None = None
        self.produced, self.spent = 0.0, 0.0
        if tree.adaptive:
            self.measure_costs()

    def measure_costs(self) -> None:
        """Time the target's tree forward per size on this machine (`tree.adaptive`); again
        after anything that changes its speed, such as compiling it."""
        self.costs = tree_forward_costs(self.target, self.spec.attention, self.spec.total_tokens)
        self.produced, self.spent = 1.0, float(self.costs[0])

    def build_tree(
        self, root: int, context: list[int] | None = None, draws: Draws | None = None
    ) -> Tree:
        """The head's tree below `root`; with a lookup branch (`spec.branch`), plus the
        prompt-lookup continuation of `context` (prompt + output so far, `root` last), of
        `lookup` tokens or of `lookup_by_match[n - 1]` after an n-token match. `draws`: top-k
        or sampled children.
        With `tree.adaptive`, only its nodes worth their cost at the decoder's rate so far."""
        s = self.spec
        chain = None
        if context and s.lookup_by_match:
            chain = lookup_by_match(torch.tensor(context), s.lookup_by_match)
        elif context and s.lookup:
            chain = prompt_lookup(torch.tensor(context), s.lookup)
        if self.static is not None:
            tree = self.static.build(self.drafter, root, draws)
            return tree if chain is None else graft_chain(tree, chain)[0]
        cut = None if self.costs is None else AdaptiveCut(self.costs, self.produced / self.spent)
        tree = build_dynamic_tree(
            self.drafter, root, s.depth, s.top_k, s.total_tokens, chain, draws, cut
        )
        return tree if cut is None else tree.best(cut.size(tree.scores))

    def draws(self, sampling: Sampling, generator: torch.Generator | None) -> Draws:
        """How trees pick children for `sampling`: drawn at its temperature (`sample_drafts`
        and temperature > 0), else the head's top k."""
        if sampling.greedy or not self.spec.sample_drafts:
            return Draws()
        return Draws(sampling.temperature, generator)

    @torch.no_grad()
    def generate(
        self,
        prompt: list[int],
        max_new_tokens: int,
        sampling: Sampling | None = None,
        eos_token_ids: Collection[int] | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[list[int], DecodeStats]:
        """Decode one prompt; `on_tokens` streams each committed chunk."""
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens={max_new_tokens} must be >= 1")
        sampling = sampling or Sampling()
        self.spec.refuse_drawn(sampling.temperature)  # a no-op at T=0 or with top-k children
        draws = self.draws(sampling, generator)
        eos = set(eos_token_ids or ())
        stats = DecodeStats()
        device = next(self.target.parameters()).device
        timer = clock(device)
        # full layers everywhere: compaction indexes absolute positions, which a sliding-window
        # layer's cache (keeping only its last keys) does not hold; the masks apply the windows
        cache = DynamicCache()
        kv = {cache_kwarg(self.target): cache}
        ids = torch.tensor([prompt], device=device)
        with (
            tree_attention(self.target, self.spec.attention),
            FeatureCapture(self.target, self.aux_layers) as capture,
        ):
            out = self.target(input_ids=ids, **kv, use_cache=True, logits_to_keep=1)
            # picks, trees and acceptance run on the CPU (and draw from a CPU generator)
            root = pick(out.logits[0, -1].cpu(), sampling, generator)
            self.drafter.reset()
            self.drafter.commit(
                capture.hidden, capture.aux, torch.tensor([[*prompt[1:], root]], device=device)
            )
            generated = [root]
            if on_tokens:
                on_tokens([root])
            n = len(prompt)
            while len(generated) < max_new_tokens and root not in eos:
                t0 = timer()
                # the context is copied for the lookup branch only: no per-step work without it
                context = [*prompt, *generated] if self.spec.branch else None
                tree = self.build_tree(root, context, draws)
                t1 = timer()
                mask = tree_masks(
                    self.windows,
                    tree.ancestors,
                    tree.depths,
                    n,
                    self.spec.attention,
                    self.target.dtype,
                )
                out = self.target(
                    input_ids=tree.tokens[None].to(device),
                    position_ids=(n + tree.depths)[None].to(device),
                    attention_mask=_to(mask, device),
                    **kv,
                    use_cache=True,
                )
                t2 = timer()
                # in the target's dtype: greedy picks are the same in bf16 (0.1 ms less per step)
                # and sampling converts to fp32 itself
                path, bonus = accept(
                    tree,
                    out.logits[0].cpu(),
                    sampling,
                    generator,
                    self.spec.verify == "traversal",
                )
                keep_accepted(cache, n, path)
                kept = path.to(device)
                new = [*tree.tokens[path[1:]].tolist(), bonus]
                t3 = timer()
                self.drafter.commit(
                    capture.hidden[:, kept],
                    None if capture.aux is None else capture.aux[:, kept],
                    torch.tensor([new], device=device),
                )
                t4 = timer()
                stats.draft_seconds += t1 - t0
                stats.forward_seconds += t2 - t1
                stats.accept_seconds += t3 - t2
                stats.commit_seconds += t4 - t3
                stats.forwards += 1
                stats.nodes += tree.size
                stats.verify_tokens += len(new)
                if self.costs is not None:
                    self.produced += len(new)
                    self.spent += (t4 - t0) * 1e3
                _count_depths(stats, tree.depth, len(path) - 1)
                n += len(path)
                root = bonus
                for i, token in enumerate(new):  # stop at the first EOS, even an accepted draft
                    if token in eos:
                        new, root = new[: i + 1], token  # root in eos ends the loop
                        break
                new = new[: max_new_tokens - len(generated)]  # the stream stops where output does
                stats.output_tokens += len(new)
                generated.extend(new)
                if on_tokens:
                    on_tokens(new)
        stats.new_tokens = len(generated)
        return generated, stats


def _to(
    mask: torch.Tensor | dict[str, torch.Tensor], device: torch.device
) -> torch.Tensor | dict[str, torch.Tensor]:
    if isinstance(mask, dict):
        return {layer_type: m.to(device) for layer_type, m in mask.items()}
    return mask.to(device)


def _count_depths(stats: DecodeStats, tree_depth: int, accepted: int) -> None:
    while len(stats.offered_at_depth) < tree_depth:
        stats.offered_at_depth.append(0)
        stats.accepted_at_depth.append(0)
    for d in range(tree_depth):
        stats.offered_at_depth[d] += d <= accepted  # draft d+1 is tested only if d were accepted
        stats.accepted_at_depth[d] += d < accepted
