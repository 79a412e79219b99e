"""Tree builders, tree attention math and cache compaction."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
from transformers import DynamicCache

from draftsmith.inference.attention import (
    dense_attention_lse,
    merge_attention,
    split_tree_attention,
    tree_attention,
    tree_mask,
)
from draftsmith.inference.cache import keep_accepted
from draftsmith.inference.costs import AdaptiveCut, adaptive_size
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
from draftsmith.inference.verify import (
    Sampling,
    accept_greedy,
    accept_sampled,
    accept_traversal,
    draw,
)
from draftsmith.target import cache_kwarg


class RandomExpander:
    """Deterministic fake draft: log-probs from a seeded table indexed by depth and parent token."""

    def __init__(self, vocab: int = 11, seed: int = 0, scale: float = 1.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.table = torch.log_softmax(scale * torch.randn(8, vocab, vocab, generator=g), -1)
        self.root_token = 3
        self.expanded = 0  # expand() calls

    def root_logprobs(self) -> torch.Tensor:
        return self.table[0, self.root_token]

    def expand(self, nodes: torch.Tensor, tree: Tree) -> torch.Tensor:
        assert len(set(tree.depths[nodes].tolist())) == 1
        self.expanded += 1
        return self.table[tree.depths[nodes], tree.tokens[nodes]]

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids


def check_invariants(tree: Tree) -> None:
    n = tree.size
    assert tree.parents[0] == -1 and tree.depths[0] == 0
    for i in range(1, n):
        p = int(tree.parents[i])
        assert 0 <= p < i, "parents precede children"
        assert tree.depths[i] == tree.depths[p] + 1
        expected = tree.ancestors[p].clone()
        expected[i] = True
        assert torch.equal(tree.ancestors[i], expected), "mask = ancestors + self"
    # siblings carry distinct tokens (so at most one child can match the target)
    for p in range(n):
        kids = tree.tokens[tree.parents == p].tolist()
        assert len(kids) == len(set(kids))


@pytest.mark.parametrize("depth,top_k,total", [(1, 3, 4), (4, 3, 10), (6, 4, 16), (3, 2, 50)])
def test_dynamic_tree_invariants_and_budget(depth, top_k, total) -> None:
    tree = build_dynamic_tree(RandomExpander(), 3, depth, top_k, total)
    check_invariants(tree)
    assert tree.size == min(total, 1 + top_k + (depth - 1) * top_k * top_k)
    assert tree.depth <= depth


def test_dynamic_tree_skips_only_levels_that_cannot_change_it(monkeypatch) -> None:
    """The builder stops drafting when nothing below the frontier could be kept: the tree must
    be the one drafting every level gives, with and without a chain (whose nodes are kept
    whatever they score), and the skipping must happen."""
    from draftsmith.inference import tree as tree_module

    def build(ex: RandomExpander, chain: torch.Tensor | None, prune: bool) -> Tree:
        with monkeypatch.context() as m:
            if not prune:
                m.setattr(tree_module, "_never_kept", lambda *args: False)
            return build_dynamic_tree(ex, 3, 5, 3, 12, chain)

    g = torch.Generator().manual_seed(0)
    saved = {"no chain": 0, "chain": 0}
    for seed in range(60):
        full = build(RandomExpander(seed=seed, scale=3.0), None, False)
        drafted = full.tokens[full.ancestors[int(full.depths.argmax())]][1:]  # a deepest path
        chains = {
            None: "no chain",
            drafted: "chain",
            torch.cat([drafted[:2], torch.randint(0, 11, (3,), generator=g)]): "chain",
            torch.randint(0, 11, (4,), generator=g): "chain",
        }
        for chain, kind in chains.items():
            reference, pruned = (
                RandomExpander(seed=seed, scale=3.0),
                RandomExpander(seed=seed, scale=3.0),
            )
            expected, got = build(reference, chain, False), build(pruned, chain, True)
            for field in ("tokens", "parents", "depths", "ancestors"):
                assert torch.equal(getattr(got, field), getattr(expected, field)), (seed, field)
            saved[kind] += reference.expanded - pruned.expanded
    assert saved["no chain"] > 0 and saved["chain"] > 0, saved


def test_adaptive_cut_skips_only_levels_it_would_cut(monkeypatch) -> None:
    """With `tree.adaptive`'s cut the builder also stops drafting when the cut would keep none
    of the nodes below the frontier: the cut tree must be the cut of the tree drafting every
    level gives, for forward costs flat, steep and in between, with no chain, a chain along
    drafted nodes and a random one; and it must draft fewer levels than the budget alone
    allows."""
    from draftsmith.inference import tree as tree_module

    g = torch.Generator().manual_seed(1)
    expanded = dict.fromkeys(("full", "budget", "cut"), 0)
    for seed in range(40):
        plain = build_dynamic_tree(RandomExpander(seed=seed, scale=3.0), 3, 5, 3, 12)
        drafted = plain.tokens[plain.ancestors[int(plain.depths.argmax())]][1:4]  # followed
        for chain in (None, drafted, torch.randint(0, 11, (3,), generator=g)):
            steps = torch.rand(12, generator=g) * float(torch.rand(1, generator=g)) * 4
            costs = 20 + steps.cumsum(0)  # [12] ms, never less for more nodes
            cut = AdaptiveCut(costs, float(torch.rand(1, generator=g)) * 0.1)
            built = {}
            for kind in ("full", "budget", "cut"):
                ex = RandomExpander(seed=seed, scale=3.0)
                with monkeypatch.context() as m:
                    if kind == "full":
                        m.setattr(tree_module, "_never_kept", lambda *args: False)
                    bound = cut if kind == "cut" else None
                    tree = build_dynamic_tree(ex, 3, 5, 3, 12, chain, cut=bound)
                built[kind] = tree.best(cut.size(tree.scores))
                expanded[kind] += ex.expanded
            for field in ("tokens", "parents", "depths", "ancestors", "scores"):
                expected = getattr(built["full"], field)
                assert torch.equal(getattr(built["cut"], field), expected), (seed, field)
    assert expanded["cut"] < expanded["budget"] < expanded["full"], expanded


def test_dynamic_tree_keeps_best_paths() -> None:
    ex = RandomExpander()
    tree = build_dynamic_tree(ex, 3, 1, 4, 5)
    assert sorted(tree.tokens[1:].tolist()) == sorted(ex.root_logprobs().topk(4).indices.tolist())


@pytest.mark.parametrize("chain", [None, torch.tensor([5, 1, 7])])
def test_best_nodes_of_a_tree_are_the_smaller_budget_tree(chain) -> None:
    """Cutting a built tree to its n best nodes (`tree.adaptive`) gives the tree a budget of n
    builds, chain included: a closed sub-tree, the same nodes."""
    for n in (4, 5, 7, 9):
        big = build_dynamic_tree(RandomExpander(scale=2.0), 3, 4, 3, 12, chain)
        small = build_dynamic_tree(RandomExpander(scale=2.0), 3, 4, 3, n, chain)
        cut = big.best(n)
        check_invariants(cut)
        for field in ("tokens", "parents", "depths", "ancestors", "scores"):
            assert torch.equal(getattr(cut, field), getattr(small, field)), (n, field)


def test_adaptive_size_trades_expected_tokens_against_forward_cost() -> None:
    # nodes the head gives 0.9, 0.5 and 0.1 (any order); 2 nodes cost what 3 do
    scores = torch.tensor([0.0, 0.1, 0.9, 0.5]).log()
    costs = torch.tensor([10.0, 20.0, 20.0, 40.0])
    # at 0.02 tokens/ms: 1 node -0.2, 2: 0.9 - 0.4, 3: 1.4 - 0.4 (best), 4: 1.5 - 0.8
    assert adaptive_size(scores, costs, 0.02) == 3
    assert adaptive_size(scores, costs, 0.0) == 4  # free nodes: all of them
    assert adaptive_size(scores, costs, 1.0) == 1  # nothing is worth a ms
    # a grafted chain's nodes (+inf) stay whatever they cost
    chained = torch.tensor([float("inf"), float("inf"), 0.9, 0.5]).log()  # as built: root too
    assert adaptive_size(chained, torch.tensor([10.0, 20.0, 30.0, 40.0]), 1.0) == 2


def test_static_trees() -> None:
    ex = RandomExpander()
    chain = StaticTree(chain_choices(4)).build(ex, 3)
    check_invariants(chain)
    assert chain.size == 5 and chain.depth == 4 and chain.parents.tolist() == [-1, 0, 1, 2, 3]
    # the chain follows the top-1 of each step
    assert int(chain.tokens[1]) == int(ex.root_logprobs().argmax())
    choices = topk_choices(depth=3, top_k=3, total_tokens=12)
    tree = StaticTree(choices).build(ex, 3)
    check_invariants(tree)
    assert tree.size == 12
    with pytest.raises(ValueError, match="closed under prefixes"):
        StaticTree([[0, 1]])


@pytest.mark.parametrize(
    "setting",
    [
        {"depth": 0},
        {"top_k": 0},
        {"total_tokens": 1},
        {"kind": "wide"},
        {"attention": "xformers"},
        {"adaptive": True, "kind": "static"},  # only dynamic trees score their nodes
        {"verify": "block"},
    ],
)
def test_tree_spec_refuses_settings_that_cannot_draft(setting: dict) -> None:
    # a zero depth or width used to decode at tau 1 (or fail deep in the drafter)
    name = next(iter(setting))
    with pytest.raises(ValueError, match=f"tree.{name}="):
        TreeSpec(**setting)


def test_default_static_tree_is_wide_at_the_root_and_deep_on_top_1() -> None:
    """Depth is not free: the root's runner-up draft comes before a third top-1 step, and the
    top-1 chain still goes deepest (what Medusa's calibrated trees look like)."""
    choices = topk_choices(depth=5, top_k=4, total_tokens=12)
    assert choices.index([1]) < choices.index([0, 0, 0])
    assert [0, 0, 0, 0] in choices and max(map(len, choices)) == 4
    assert [2] in choices and [0, 1] in choices


def test_path_tokens() -> None:
    tree = StaticTree(chain_choices(3)).build(RandomExpander(), 3)
    assert tree.path_tokens(torch.tensor([3])).tolist() == [tree.tokens.tolist()]


def test_greedy_acceptance_takes_the_deepest_path_the_target_agrees_with() -> None:
    """Against a walk from the root: step to the child holding the target's argmax, as long as
    one does. Logits are made to agree with the tree often, so deep paths and dead ends (a node
    that matches under a parent that did not) both occur."""
    g = torch.Generator().manual_seed(0)
    depths_seen = set()
    for _ in range(200):
        tree = build_dynamic_tree(RandomExpander(), 3, 4, 3, 12)
        predicted = torch.randint(0, 11, (tree.size,), generator=g)
        for i in range(1, tree.size):  # each child is the parent's argmax with probability 1/2
            if torch.rand((), generator=g) < 0.5:
                predicted[tree.parents[i]] = tree.tokens[i]
        logits = torch.nn.functional.one_hot(predicted, 11).float()  # [N, V]
        walk, node = [0], 0
        while match := [
            c
            for c in range(tree.size)
            if tree.parents[c] == node and tree.tokens[c] == predicted[node]
        ]:
            node = match[0]
            walk.append(node)
        path, bonus = accept_greedy(tree, logits)
        assert path.tolist() == walk and bonus == int(predicted[node])
        depths_seen.add(len(walk) - 1)
    assert depths_seen >= {0, 1, 2, 3}


def test_draw_keeps_each_rows_law(monkeypatch: pytest.MonkeyPatch) -> None:
    """`draw` (every sampled token: bonus tokens, first tokens, regeneration) samples each row of
    a batch from its own unnormalised mass, never a token of none, the extreme uniform draws
    included; a row without mass (NaN logits) is refused."""
    g = torch.Generator().manual_seed(0)
    mass = torch.tensor([[3.0, 0.0, 1.0, 0.0, 4.0, 0.0], [0.0, 1e-3, 0.0, 0.0, 0.0, 2e-3]])
    n = 100_000
    rows = draw(mass.repeat(n, 1), g).view(n, 2)  # [n, 2]
    for r in range(2):
        p = mass[r] / mass[r].sum()
        freq = torch.bincount(rows[:, r], minlength=6) / n
        assert (freq[p == 0] == 0).all()
        assert ((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt()).all(), (freq, p)
    with pytest.raises(ValueError, match="summing to"):  # NaN logits' probabilities
        draw(torch.tensor([[0.5, 0.5], [float("nan"), 1.0]]))
    # the extreme uniform draws (0 and torch.rand's largest double) land on the first and the
    # last token with mass
    mass = torch.tensor([0.0, 0.1, 0.7, 0.2, 0.0, 0.0])
    for u, token in ((0.0, 1), (1 - 2**-53, 3)):
        monkeypatch.setattr(
            torch, "rand", lambda shape, u=u, **_: torch.full(shape, u, dtype=torch.float64)
        )
        assert int(draw(mass)) == token


class MarkovTarget:
    """A target whose next token's law depends on the last token only, p[a, b] = P(b | a),
    decoded one verification step at a time from the trees `build(last, chain)` makes."""

    def __init__(self, vocab: int, seed: int, scale: float = 2.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.logits = scale * torch.randn(vocab, vocab, generator=g)  # [V, V]
        self.p = torch.softmax(self.logits, -1)  # [V, V]
        self.vocab = vocab

    def step(self, build, last: int, verify, g: torch.Generator) -> list[int]:
        """One step from `last`: the accepted drafts and the bonus token. The chain stands for a
        lookup branch: deterministic, from the context."""
        chain = torch.tensor([(last + 1) % self.vocab, (last + 2) % self.vocab])
        tree = build(last, chain)
        path, bonus = verify(tree, self.logits[tree.tokens], Sampling(temperature=1.0), g)
        return [*tree.tokens[path[1:]].tolist(), bonus]

    def law_p_value(self, build, verify, n: int, runs: int) -> float:
        """Chi-square p-value of the first `n` tokens decoded from token 0 against their exact
        law (over the V^n sequences)."""
        g = torch.Generator().manual_seed(3)
        counts = torch.zeros([self.vocab] * n)
        for _ in range(runs):
            out = self.step(build, 0, verify, g)
            while len(out) < n:
                out += self.step(build, out[-1], verify, g)
            counts[tuple(out[:n])] += 1
        expected = self.p[0]
        for _ in range(n - 1):  # [V] * n: P(x_1..x_n) = P(x_1 | 0) P(x_2 | x_1) ...
            expected = expected[..., None] * self.p.reshape(
                [1] * (expected.dim() - 1) + [-1, self.vocab]
            )
        expected = expected * runs
        keep = expected >= 5
        chi2 = (((counts - expected) ** 2 / expected)[keep]).sum()
        p_value = torch.special.gammaincc(torch.tensor((int(keep.sum()) - 1) / 2), chi2 / 2)
        assert counts[~keep].sum() <= 5 * (~keep).sum() + 10  # rare sequences stay rare
        return float(p_value)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_drawn_trees_keep_the_target_law(kind: str) -> None:
    """Decoding a Markov target with trees of drawn children, a lookup-like chain and recursive
    rejection sampling: the first two tokens follow the target's law exactly (chi-square over
    all 25 pairs, 24000 decodes). The draft's law differs sharply from the target's, and the
    budget drops draws, so a tree that kept draws for what they drew, or a verifier with the
    wrong residuals, would show."""
    target = MarkovTarget(vocab=5, seed=2)
    expander = RandomExpander(vocab=5, seed=1, scale=2.0)
    draws = Draws(1.0, torch.Generator().manual_seed(4))
    static = StaticTree(topk_choices(depth=2, top_k=3, total_tokens=5))

    def build(last: int, chain: torch.Tensor) -> Tree:
        expander.root_token = last
        if kind == "dynamic":
            return build_dynamic_tree(expander, last, 2, 3, 6, chain, draws)
        return graft_chain(static.build(expander, last, draws), chain)[0]

    p_value = target.law_p_value(build, accept_sampled, 2, 24000)
    assert p_value > 0.001, f"p={p_value:.2e}"


def traversal_builder(kind: str):
    """`kind`'s 3-deep trees of RandomExpander drafts: (last token, chain or None) -> Tree."""
    expander = RandomExpander(vocab=4, seed=6)
    draws = Draws(1.0, torch.Generator().manual_seed(4)) if "drawn" in kind else Draws()
    static = StaticTree(chain_choices(3) if kind.startswith("chain") else topk_choices(3, 2, 7))

    def build(last: int, chain: torch.Tensor | None) -> Tree:
        expander.root_token = last
        if kind.startswith("dynamic"):
            return build_dynamic_tree(expander, last, 3, 2, 8, chain, draws)
        tree = static.build(expander, last, draws)
        return tree if chain is None else graft_chain(tree, chain)[0]

    return build


@pytest.mark.parametrize("kind", ["static, drawn", "chain, drawn", "dynamic, top-k"])
def test_traversal_keeps_the_target_law(kind: str) -> None:
    """Traversal verification on 3-deep trees with a lookup-like chain: the first three tokens
    follow a Markov target's law exactly (chi-square over all 64 sequences, 12000 decodes). A
    child weighed without its parent's weight, or a parent left its weight after a rejected
    subtree, fails it."""
    target = MarkovTarget(vocab=4, seed=5, scale=1.0)
    p_value = target.law_p_value(traversal_builder(kind), accept_traversal, 3, 12000)
    assert p_value > 0.001, f"p={p_value:.2e}"


@pytest.mark.parametrize("kind", ["static, drawn", "chain, drawn"])
def test_traversal_accepts_more_drawn_drafts(kind: str) -> None:
    """On the same drawn trees (3 deep), traversal verification accepts more drafts per step
    than verification token by token, by more than 4 standard errors of the paired difference
    over 6000 trees: a path rejected token by token at a step the draft
    overrates is accepted whole when its other steps make up for it. (With top-k children,
    q one-hot, a child's weight is w p(x) <= w and the two accept alike.)"""
    target = MarkovTarget(vocab=4, seed=5, scale=1.0)
    build = traversal_builder(kind)
    g, h = torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)
    gains = []
    for _ in range(6000):
        tree = build(0, None)
        logits = target.logits[tree.tokens]
        accepted = [
            verify(tree, logits, Sampling(temperature=1.0), rng)[0].numel()
            for verify, rng in ((accept_traversal, g), (accept_sampled, h))
        ]
        gains.append(accepted[0] - accepted[1])
    gain = torch.tensor(gains, dtype=torch.float)
    se = gain.std() / len(gains) ** 0.5
    assert gain.mean() > 4 * se, f"traversal accepts {gain.mean():+.3f} per step (se {se:.3f})"


def test_drawn_static_tree_needs_first_ranks() -> None:
    tree = StaticTree([[0], [2]])  # the third draw without the second
    tree.build(RandomExpander(), 3)  # top-k children: any ranks
    with pytest.raises(ValueError, match="first ranks"):
        tree.build(RandomExpander(), 3, Draws(1.0))


def test_split_attention_matches_dense_reference() -> None:
    g = torch.Generator().manual_seed(0)
    B, nh, prefix, Q, d = 1, 2, 7, 5, 8
    q = torch.randn(B, nh, Q, d, generator=g)
    k = torch.randn(B, nh, prefix + Q, d, generator=g)
    v = torch.randn(B, nh, prefix + Q, d, generator=g)
    tree = StaticTree(topk_choices(2, 2, Q)).build(RandomExpander(), 3)
    mask = torch.ones(Q, prefix + Q, dtype=torch.bool)
    mask[:, prefix:] = tree.ancestors
    reference, _ = dense_attention_lse(q, k, v, mask[None, None], d**-0.5)
    merged = split_tree_attention(q, k, v, mask[None, None], d**-0.5)
    torch.testing.assert_close(merged, reference, rtol=1e-5, atol=1e-6)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(merged, sdpa, rtol=1e-5, atol=1e-5)
    # merging is symmetric in its two halves
    oa, la = dense_attention_lse(q, k[:, :, :3], v[:, :, :3], None, 0.3)
    ob, lb = dense_attention_lse(q, k[:, :, 3:], v[:, :, 3:], None, 0.3)
    full, _ = dense_attention_lse(q, k, v, None, 0.3)
    torch.testing.assert_close(merge_attention(oa, la, ob, lb), full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merge_attention(ob, lb, oa, la), full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.filterwarnings("error:`past_key_values`:FutureWarning")  # deprecated keyword
def test_sdpa_backend_equals_transformers_sdpa_on_a_tree(dtype, tiny_target) -> None:
    """Our sdpa backend only skips transformers' per-head KV copies (grouped heads: 4 query heads
    on 2 KV heads) and takes the mask additive: a tree forward must give the very same logits as
    transformers' SDPA with the boolean mask."""
    prefix, tree = 9, StaticTree(topk_choices(3, 2, 6)).build(RandomExpander(), 3)
    mask = torch.ones(tree.size, prefix + tree.size, dtype=torch.bool)
    mask[:, prefix:] = tree.ancestors
    assert torch.equal(tree_mask(tree.ancestors, prefix, "flex", dtype), mask[None, None])
    additive = tree_mask(tree.ancestors, prefix, "sdpa", dtype)  # [1, 1, N, prefix + N]
    assert additive.dtype == dtype and torch.equal(additive[0, 0] == 0, mask)
    ids = torch.arange(5, 5 + prefix)[None]
    # a copy: casting the session's tiny target to bf16 and back would round its weights for
    # every later test (the golden head losses moved when this test ran before them)
    target = copy.deepcopy(tiny_target).to(dtype)
    logits = []
    for ours in (False, True):
        kv = {cache_kwarg(target): DynamicCache(config=target.config)}
        with torch.no_grad(), tree_attention(target, "sdpa") if ours else nullcontext():
            assert (target.config._attn_implementation == "draftsmith_sdpa") == ours
            target(input_ids=ids, **kv, use_cache=True)
            logits.append(
                target(
                    input_ids=tree.tokens[None],
                    position_ids=(prefix + tree.depths)[None],
                    attention_mask=additive if ours else mask[None, None],
                    **kv,
                    use_cache=True,
                ).logits
            )
    assert target.config._attn_implementation == "sdpa"  # back on its own backend
    assert torch.equal(logits[0], logits[1])


def _numbered_cache(length: int) -> DynamicCache:
    """Two layers whose entry j holds j (layer 0 keys, -j values) and 10 j (layer 1 keys)."""
    cache = DynamicCache()
    keys = torch.arange(length, dtype=torch.float32).view(1, 1, -1, 1).repeat(1, 2, 1, 3)
    cache.update(keys.clone(), -keys.clone(), 0)
    cache.update(keys.clone() * 10, keys.clone(), 1)
    return cache


def test_keep_accepted_moves_path_behind_prefix() -> None:
    prefix, tree_size = 4, 5
    cache = _numbered_cache(prefix + tree_size)
    keep_accepted(cache, prefix, torch.tensor([0, 2, 3]))
    assert cache.get_seq_length() == prefix + 3
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 6, 7]
    assert cache.layers[0].values[0, 1, :, 0].tolist() == [-0.0, -1, -2, -3, -4, -6, -7]
    assert cache.layers[1].keys[0, 0, :, 0].tolist() == [0, 10, 20, 30, 40, 60, 70]
    # a path of the tree's first nodes is already in place: only the cut remains
    for path in ([0], [0, 1]):
        cache = _numbered_cache(prefix + tree_size)
        keep_accepted(cache, prefix, torch.tensor(path))
        assert cache.layers[1].keys[0, 1, :, 0].tolist() == [10 * j for j in range(4 + len(path))]
        assert cache.layers[0].values[0, 0, :, 2].tolist() == [-j for j in range(4 + len(path))]
