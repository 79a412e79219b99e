"""The prompt-lookup branch: transformers' prompt lookup's proposals in its matching mode, the
longest and latest match by default, lengths by match length, grafted into a draft tree without
duplicate siblings, and accepted by the target (losslessness is tested with the other trees in
test_speculative.py)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from draftsmith.errors import InputError
from draftsmith.inference.decoder import SpecDecoder, TreeSpec
from draftsmith.inference.lookup import lookup_by_match, prompt_lookup
from draftsmith.inference.tree import Tree, branch_label, build_dynamic_tree, graft_chain


def test_proposes_what_transformers_prompt_lookup_proposes() -> None:
    g = torch.Generator().manual_seed(0)
    hf = PromptLookupCandidateGenerator(num_output_tokens=5, max_length=10**6)
    found = 0
    for length in range(1, 60):
        context = torch.randint(0, 6, (length,), generator=g)  # small vocab: many repeats
        ours = prompt_lookup(context, 5, max_ngram=2, latest=False)
        theirs = hf.get_candidates(context[None])[0][0, length:]
        assert torch.equal(ours, theirs), (context.tolist(), ours.tolist(), theirs.tolist())
        found += ours.numel() > 0
    assert found > 40  # the cases with a match were compared too
    assert prompt_lookup(torch.tensor([3, 4, 5]), 5).numel() == 0  # no repeat, no proposal


def test_default_match_is_the_longest_then_the_latest() -> None:
    # the suffix "1 2 3" was followed by 7 (at 3) and later by 9 (at 9)
    context = torch.tensor([1, 2, 3, 7, 5, 0, 1, 2, 3, 9, 1, 8, 1, 2, 3])
    assert prompt_lookup(context, 2).tolist() == [9, 1]
    assert prompt_lookup(context, 2, latest=False).tolist() == [7, 5]
    # the 4-gram suffix "3 1 2 3" was followed by 6; the 2-gram "2 3" last by 4: longest first
    context = torch.tensor([3, 1, 2, 3, 6, 2, 3, 4, 3, 1, 2, 3])
    assert prompt_lookup(context, 1).tolist() == [6]
    assert prompt_lookup(context, 1, max_ngram=2).tolist() == [4]


def test_by_match_copies_by_match_length_and_runs_on_past_the_end() -> None:
    # "3 1 2 3" was seen before (at 0), followed by "6 2 3 4 3 1 2 3"
    context = torch.tensor([3, 1, 2, 3, 6, 2, 3, 4, 3, 1, 2, 3])
    assert lookup_by_match(context, [1, 1, 1, 3]).tolist() == [6, 2, 3]
    assert lookup_by_match(context, [1, 1, 2]).tolist() == [6, 2]  # 3-token matches at most
    # a 1-token match (9 last seen at 1) gets by_match[0] tokens
    assert lookup_by_match(torch.tensor([5, 9, 7, 8, 9]), [2, 6]).tolist() == [7, 8]
    # the copy reaches the context's end and runs on: "1 2 3" again, one period (3) back
    looped = torch.tensor([9, 1, 2, 3, 1, 2, 3])
    assert lookup_by_match(looped, [1, 1, 7]).tolist() == [1, 2, 3, 1, 2, 3, 1]
    assert lookup_by_match(torch.tensor([3, 4, 5]), [4, 4]).numel() == 0  # no repeat


def test_by_match_settings_are_checked() -> None:
    with pytest.raises(InputError, match="set one"):
        TreeSpec(lookup=4, lookup_by_match=[4, 8])
    with pytest.raises(InputError, match="at most total_tokens - 1 = 9"):
        TreeSpec(total_tokens=10, lookup_by_match=[4, 10])
    with pytest.raises(InputError, match=">= 1"):
        TreeSpec(kind="static", lookup_by_match=[0, 8])
    assert TreeSpec(kind="static", total_tokens=10, lookup_by_match=[4, 12]).branch  # on top
    assert branch_label({"lookup": 8}) == "lookup8"
    assert branch_label({"lookup": 0, "lookup_by_match": [4, 8, 8, 15]}) == "lookup4-8-8-15"
    assert branch_label({"kind": "dynamic"}) == ""  # results older than the branch


def _tree(tokens: list[int], parents: list[int]) -> Tree:
    n = len(tokens)
    ancestors = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            ancestors[i] |= ancestors[p]
    depths = ancestors.sum(-1) - 1
    return Tree(torch.tensor(tokens), torch.tensor(parents), depths, ancestors)


def test_graft_shares_matching_nodes_and_appends_the_rest() -> None:
    # root 9 -> {1 -> {3}, 2}
    tree = _tree([9, 1, 2, 3], [-1, 0, 0, 1])
    grafted, leaf = graft_chain(tree, torch.tensor([1, 4, 5]))  # follows node 1, adds 4 -> 5
    assert _same(grafted, _tree([9, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 4])) and leaf == 5
    assert graft_chain(tree, torch.tensor([1, 3])) == (tree, 3)  # already there: unchanged
    fresh, leaf = graft_chain(tree, torch.tensor([7]))  # a new child of the root
    assert fresh.parents.tolist() == [-1, 0, 0, 1, 0] and fresh.depths[-1] == 1 and leaf == 4


def test_dynamic_tree_keeps_the_chain_and_spends_shared_nodes_on_the_head() -> None:
    from tests.test_tree import RandomExpander, check_invariants

    ex = RandomExpander()

    def deepest_path(tree: Tree) -> torch.Tensor:  # [depth] tokens below the root
        return tree.tokens[tree.ancestors[int(tree.depths.argmax())]][1:]

    # a chain along the head's own drafts adds nothing: the tree is the head's alone
    plain = build_dynamic_tree(ex, 3, 4, 3, 10)
    assert _same(build_dynamic_tree(ex, 3, 4, 3, 10, deepest_path(plain)), plain)
    # a chain that leaves the head's 7 best nodes after 2 tokens costs 2 head nodes, not 4
    head_only = build_dynamic_tree(ex, 3, 4, 3, 8)
    assert head_only.depth >= 2
    chain = torch.cat([deepest_path(head_only)[:2], torch.tensor([10, 10])])
    tree = build_dynamic_tree(ex, 3, 4, 3, 10, chain)
    check_invariants(tree)
    assert tree.size == 10
    assert graft_chain(tree, chain)[0] is tree  # the whole chain is in it
    for node in range(1, head_only.size):  # and so are the head's 7 best nodes
        assert graft_chain(tree, head_only.tokens[head_only.ancestors[node]][1:])[0] is tree


def _same(a: Tree, b: Tree) -> bool:
    names = ("tokens", "parents", "depths", "ancestors")
    return all(torch.equal(getattr(a, n), getattr(b, n)) for n in names)


def test_lookup_branch_is_accepted_and_budget_kept(tiny_target, tiny_tokenizer) -> None:
    """A random tiny target loops, so its own output is the best lookup source: the branch must
    raise tau of the same untrained head, on a tree of at most the same number of nodes."""
    from tests.test_speculative import prompts, untrained

    head = untrained("eagle3", tiny_target)
    taus, sizes = [], []
    for branch in ({}, {"lookup": 4}, {"lookup_by_match": [2, 4, 9]}):
        spec = TreeSpec(depth=4, top_k=3, total_tokens=10, **branch)
        decoder = SpecDecoder(tiny_target, head, spec)
        build = decoder.build_tree

        def recorded(*args, build=build) -> Tree:
            tree = build(*args)
            sizes.append(tree.size)
            return tree

        decoder.build_tree = recorded
        forwards = tokens = 0
        for prompt in prompts(tiny_tokenizer, 4):
            _, stats = decoder.generate(prompt, 48)
            forwards, tokens = forwards + stats.forwards, tokens + stats.verify_tokens
        taus.append(tokens / forwards)
    assert max(sizes) <= 10
    assert min(taus[1:]) > taus[0] + 0.3, taus
