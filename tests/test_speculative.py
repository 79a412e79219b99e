"""The lossless property, with untrained heads (correctness must not depend on training):
greedy speculative output == the target's own greedy output, token for token (fp32); sampled
speculative output keeps the target's distribution (chi-square test)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.errors import InputError
from draftsmith.heads import TargetInfo, TargetParts, build_head
from draftsmith.inference.decoder import SpecDecoder, TreeSpec
from draftsmith.inference.tree import Tree
from draftsmith.inference.verify import Sampling

HEADS = {
    "eagle1": {"name": "eagle1"},
    "eagle3": {"name": "eagle3", "draft_vocab_size": 128},
    "medusa": {"name": "medusa", "num_heads": 4},
    "hydra": {"name": "hydra", "num_heads": 4},
    # Hydra reading EAGLE-3's low/mid/high layers too (the aux features of each accepted node)
    "hydra+aux": {"name": "hydra", "num_heads": 4, "aux_layers": [1, 2, 4]},
    # Hydra++'s prefix attention, with its own KV cache of the committed positions
    "hydra+prefix": {"name": "hydra", "num_heads": 4, "prefix_attention": True},
}
TREES = {
    "dynamic": TreeSpec(kind="dynamic", depth=4, top_k=3, total_tokens=10),
    "static": TreeSpec(kind="static", depth=3, top_k=3, total_tokens=9),
    "chain": TreeSpec(kind="chain", depth=4),
    # a prompt-lookup branch grafted in (the tiny target loops, so it is often accepted)
    "dynamic+lookup": TreeSpec(kind="dynamic", depth=4, top_k=3, total_tokens=10, lookup=4),
    "static+lookup": TreeSpec(kind="static", depth=3, top_k=3, total_tokens=9, lookup=3),
    # its length by match length, a 3-token match's copy filling the tree (running on past the
    # context's end)
    "dynamic+lookup_by_match": TreeSpec(
        kind="dynamic", depth=4, top_k=3, total_tokens=10, lookup_by_match=[2, 4, 9]
    ),
    # per-step sizes from this machine's measured forward costs
    "dynamic+lookup+adaptive": TreeSpec(
        kind="dynamic", depth=4, top_k=3, total_tokens=10, lookup=4, adaptive=True
    ),
}


def prompts(tokenizer, count: int) -> list[list[int]]:
    texts = [
        f"Question {i}: {'why' if i % 2 else 'how'} is the sky {i * 7 % 13}?" for i in range(count)
    ]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, return_dict=False
        )
        for t in texts
    ]


def greedy_reference(target, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def untrained(name: str, target) -> object:
    torch.manual_seed(0)
    info = TargetInfo.from_hf_config(target.config)
    head = build_head(dict(HEADS[name]), info).bind(TargetParts.from_model(target)).eval()
    with torch.no_grad():  # break Medusa's identity init so drafts differ from the target
        for p in head.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return head


@pytest.fixture(scope="module")
def references(tiny_target, tiny_tokenizer):
    return [(p, greedy_reference(tiny_target, p, 48)) for p in prompts(tiny_tokenizer, 6)]


# passing the KV cache by the keyword the installed transformers deprecates fails it
@pytest.mark.filterwarnings("error:`past_key_values`:FutureWarning")
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("name", list(HEADS))
def test_greedy_is_lossless(name, tree, tiny_target, tiny_tokenizer, references) -> None:
    decoder = SpecDecoder(tiny_target, untrained(name, tiny_target), TREES[tree])
    for prompt, expected in references:
        out, stats = decoder.generate(prompt, 48, eos_token_ids={tiny_tokenizer.eos_token_id})
        assert out == expected
        assert stats.forwards >= 1 and stats.tau >= 1.0
        # the verify time is split into its parts, and nothing is lost between them
        parts = (stats.forward_seconds, stats.accept_seconds, stats.commit_seconds)
        assert min(parts) > 0 and sum(parts) == pytest.approx(stats.verify_seconds)
    # a budget that ends inside a step: output and stream stop at it, and agree
    prompt, expected = references[0]
    streamed: list[int] = []
    out, _ = decoder.generate(
        prompt, 13, eos_token_ids={tiny_tokenizer.eos_token_id}, on_tokens=streamed.extend
    )
    assert streamed == out == expected[:13]


@pytest.mark.parametrize("name", ["eagle1", "medusa", "hydra"])
def test_reduced_draft_vocab_is_lossless(name, tiny_target, tiny_tokenizer, references) -> None:
    """Drafting over a token subset: every drafted token is in it, and the output is still the
    target's greedy output; the caller's head keeps the full lm_head."""
    head = untrained(name, tiny_target)
    vocab_size = tiny_target.config.vocab_size
    vocab = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(0))[
        : vocab_size // 4
    ]
    vocab = vocab.sort().values  # [Vd] target ids
    decoder = SpecDecoder(tiny_target, head, TREES["dynamic"], draft_vocab=vocab)
    drafted = []
    to_target = decoder.drafter.to_target
    decoder.drafter.to_target = lambda ids: drafted.append(to_target(ids)) or drafted[-1]
    for prompt, expected in references[:3]:
        assert (
            decoder.generate(prompt, 48, eos_token_ids={tiny_tokenizer.eos_token_id})[0] == expected
        )
    assert drafted and torch.isin(torch.cat([d.flatten() for d in drafted]), vocab).all()
    assert head.parts.lm_head is tiny_target.get_output_embeddings()
    hidden = torch.randn(3, tiny_target.config.hidden_size)
    restricted = decoder.drafter.head.parts.lm_head
    assert torch.equal(restricted(hidden), head.parts.lm_head(hidden)[:, vocab])


def test_reduced_draft_vocab_refused_for_a_head_with_its_own(tiny_target) -> None:
    with pytest.raises(ValueError, match="its own vocabulary"):
        SpecDecoder(tiny_target, untrained("eagle3", tiny_target), TREES["chain"], torch.arange(8))


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_greedy_is_lossless_per_backend(backend, tiny_target, tiny_tokenizer, references) -> None:
    spec = TreeSpec(kind="dynamic", depth=3, top_k=2, total_tokens=6, attention=backend)
    decoder = SpecDecoder(tiny_target, untrained("eagle3", tiny_target), spec)
    for prompt, expected in references[:3]:
        assert decoder.generate(prompt, 48, eos_token_ids={2})[0] == expected
    # the target is shared (baselines, regeneration): decoding leaves it on its own backend
    assert tiny_target.config._attn_implementation == "sdpa"


# an image-text model's text decoder, the size of the Llama target's
TEXT = {
    "vocab_size": 259,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
# their vision towers, as small: a ViT (SigLIP, CLIP) and Qwen's
VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 32,
    "patch_size": 8,
}
QWEN_VISION = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
}
# other model families, tiny and random like the Llama target; windows of 12 tokens are shorter
# than every prompt: Mistral's and Phi-3's layers all slide (one mask), Gemma 3's alternate sliding
# and full (a mask per layer type). GPT-2, GPT-NeoX, Falcon, Phi and OPT keep their layers and
# final norm under other names, and GPT-2 and OPT learn absolute positions.
ARCHITECTURES = {
    "Qwen2": {},
    "Qwen3": {"head_dim": 16},
    "Qwen3Moe": {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2},
    "Olmo2": {},
    "Gemma": {"head_dim": 16},
    "Granite": {},
    "Mistral": {"sliding_window": 12},
    "Phi3": {"sliding_window": 12},
    "Gemma3Text": {"sliding_window": 12, "sliding_window_pattern": 2, "head_dim": 16},
    "GPT2": {},
    "GPTNeoX": {},
    "Falcon": {},
    "Phi": {},
    "OPT": {"ffn_dim": 128, "word_embed_proj_dim": 64},
    "Mixtral": {"sliding_window": 12, "num_local_experts": 4},
    "Cohere2": {"sliding_window": 12, "sliding_window_pattern": 2, "logit_scale": 0.25},
    "SmolLM3": {},  # every fourth layer without RoPE
    # eager attention only (verified with the additive mask): softcapped attention and final
    # logits; attention sinks, sliding and full layers alternating
    "Gemma2": {"sliding_window": 12, "head_dim": 16},
    "GptOss": {"sliding_window": 12, "head_dim": 16, "num_local_experts": 4},
    # an image-text checkpoint decoding text (Gemma 3 4B and up): its text decoder is the target
    "Gemma3": {
        "text_config": {**TEXT, "head_dim": 16, "sliding_window": 12, "sliding_window_pattern": 2},
        "vision_config": {**VISION, "model_type": "siglip_vision_model"},
        "mm_tokens_per_image": 4,
    },
    # an image-text checkpoint with no causal LM class: its rotary positions are 3-D (mrope),
    # one section per axis, which for text are all the token's position
    "Qwen2_5_VL": {
        "text_config": {**TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        "vision_config": {**QWEN_VISION, "fullatt_block_indexes": [0]},
    },
    # interleaved 3-D rotary sections, the vision features added to early layers (deepstack)
    "Qwen3VL": {
        "text_config": {
            **TEXT,
            "head_dim": 16,
            "rope_scaling": {"mrope_section": [2, 3, 3], "mrope_interleaved": True},
        },
        "vision_config": {**QWEN_VISION, "deepstack_visual_indexes": [0]},
    },
    # a vision tower in front of a plain Llama (LLaVA)
    "Llava": {
        "text_config": {**TEXT, "model_type": "llama"},
        "vision_config": {**VISION, "model_type": "clip_vision_model"},
    },
    # multi-head latent attention: keys and values decompressed per query head
    "DeepseekV3": {
        "num_key_value_heads": 4,
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    },
}
CASES = [(a, "sdpa") for a in ARCHITECTURES] + [("Mistral", "flex"), ("Gemma3Text", "flex")]


@pytest.mark.parametrize(("architecture", "backend"), CASES)
def test_other_architectures_are_lossless(architecture, backend, make_tiny) -> None:
    from draftsmith.features import FeatureCapture
    from draftsmith.target import load_target, load_tokenizer

    folder = make_tiny(architecture=architecture, **ARCHITECTURES[architecture])
    target, tokenizer = load_target(str(folder)), load_tokenizer(str(folder))
    spec = replace(TREES["dynamic+lookup"], attention=backend)
    decoder = SpecDecoder(target, untrained("eagle3", target), spec)
    for prompt in prompts(tokenizer, 2):
        assert len(prompt) > 12
        out, _ = decoder.generate(prompt, 40, eos_token_ids={tokenizer.eos_token_id})
        assert out == greedy_reference(target, prompt, 40)
    # the parts heads borrow (found under the family's own names) give the model's own logits
    with FeatureCapture(target) as capture, torch.no_grad():
        logits = target(input_ids=torch.tensor([prompt])).logits
    torch.testing.assert_close(TargetParts.from_model(target).logits(capture.hidden), logits)


def test_flash_refuses_sliding_window_targets(make_tiny) -> None:
    from draftsmith.target import load_target

    target = load_target(str(make_tiny(architecture="Mistral", sliding_window=12)))
    with pytest.raises(ValueError, match="flash does not support sliding-window"):
        SpecDecoder(target, untrained("eagle3", target), replace(TREES["chain"], attention="flash"))


def test_eager_targets_refuse_other_tree_backends(make_tiny) -> None:
    from draftsmith.target import load_target

    target = load_target(str(make_tiny(architecture="Gemma2", head_dim=16)))
    with pytest.raises(ValueError, match="runs eager attention"):
        SpecDecoder(target, untrained("eagle3", target), replace(TREES["chain"], attention="flex"))


def test_unsupported_attention_layers_are_refused(tiny_target) -> None:
    target = copy.deepcopy(tiny_target)
    target.config.layer_types = ["full_attention", "linear_attention"] * 2
    with pytest.raises(ValueError, match="'linear_attention' is not supported"):
        SpecDecoder(target, untrained("eagle3", target), TREES["chain"])


def test_an_empty_budget_is_refused(tiny_target) -> None:
    decoder = SpecDecoder(tiny_target, untrained("eagle3", tiny_target), TREES["chain"])
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        decoder.generate([1, 2, 3], 0)


def test_flash_backend_refuses_cleanly_without_cuda(tiny_target) -> None:
    with pytest.raises(InputError, match="flash"):
        SpecDecoder(tiny_target, untrained("eagle3", tiny_target), TreeSpec(attention="flash"))


def test_medusa_tree_deeper_than_heads_is_refused(tiny_target) -> None:
    """Each kind of tree is as deep as it drafts: a chain or dynamic tree its depth, a static
    one its deepest choice (generated or given)."""
    medusa = untrained("medusa", tiny_target)  # 4 heads
    deeper = [
        ("tree.depth", TreeSpec(kind="chain", depth=5)),
        ("tree.depth", TreeSpec(kind="dynamic", depth=5)),
        ("tree.depth", TreeSpec(kind="static", depth=5, top_k=1, total_tokens=8)),
        (
            "tree.choices",
            TreeSpec(kind="static", choices=[[0], [0, 0], [0, 0, 0], [0] * 4, [0] * 5]),
        ),
    ]
    for setting, tree in deeper:
        with pytest.raises(
            ValueError, match=f"{setting}: the tree drafts 5 tokens deep, but .* 4 heads"
        ):
            SpecDecoder(tiny_target, medusa, tree)
    # as deep as its heads, or a static tree of depth 5 whose 4 nodes reach only depth 2
    for tree in (TreeSpec(kind="chain", depth=4), TreeSpec(kind="static", depth=5, total_tokens=5)):
        SpecDecoder(tiny_target, medusa, tree)


def test_stops_at_an_eos_accepted_inside_a_draft(tiny_target, references) -> None:
    """An oracle drafts the target's own greedy chain, so an EOS arrives as an accepted draft
    token, not as the bonus token: decoding must stop there, as the target's generate does."""
    prompt, expected = references[0]
    depth = TREES["chain"].depth  # a step commits `depth` drafts + 1 bonus token
    step = depth + 1  # positions k with k % step == 0: the prefill token and the bonus tokens
    k = next(  # an EOS that is a draft and is not also the step's bonus token
        k
        for k in range(1, len(expected) - step)
        if k % step and expected[k] not in expected[:k] + expected[k + 1 : k + step + 1]
    )
    decoder = SpecDecoder(tiny_target, untrained("eagle1", tiny_target), TREES["chain"])
    committed: list[int] = []

    def oracle(root: int, context: list[int], draws=None) -> Tree:
        done = len(committed)
        tokens = torch.tensor([root, *expected[done : done + depth]])  # [N]
        n = tokens.numel()
        return Tree(tokens, torch.arange(n) - 1, torch.arange(n), torch.ones(n, n).tril().bool())

    decoder.build_tree = oracle
    out, stats = decoder.generate(
        prompt, 48, eos_token_ids={expected[k]}, on_tokens=committed.extend
    )
    hf = tiny_target.generate(
        torch.tensor([prompt]), max_new_tokens=48, do_sample=False, eos_token_id=expected[k]
    )[0, len(prompt) :].tolist()
    assert out == hf == expected[: k + 1]
    assert stats.tau > 1.0  # the drafts really were accepted
    # tau counts the step's drafts past the EOS, as EAGLE's eval does; the output tau does not
    assert stats.output_tokens == len(out) - 1 < stats.verify_tokens
    assert stats.output_tau < stats.tau
    # and where the budget ends mid-step
    cut = k - k % step + 2  # the output ends 1 token into the step that commits position k
    committed.clear()
    out, stats = decoder.generate(prompt, cut, on_tokens=committed.extend)
    assert out == expected[:cut]
    assert stats.output_tokens == cut - 1 < stats.verify_tokens


def test_adaptive_trees_follow_the_forward_costs(tiny_target, tiny_tokenizer, references) -> None:
    """`tree.adaptive` verifies every node when nodes cost nothing (the same steps as the fixed
    tree), only the root when a second node costs more than any step produces (plain decoding,
    one token per forward), and stays exact either way."""
    spec = TreeSpec(kind="dynamic", depth=4, top_k=3, total_tokens=10, adaptive=True)
    head = untrained("eagle3", tiny_target)
    decoder = SpecDecoder(tiny_target, head, spec)
    assert decoder.costs.shape == (10,) and bool((decoder.costs > 0).all())
    assert bool((decoder.costs.diff() >= 0).all())  # a bigger tree never priced below
    fixed = SpecDecoder(tiny_target, head, replace(spec, adaptive=False))
    eos = {tiny_tokenizer.eos_token_id}
    prompt, expected = references[0]
    decoder.costs = torch.ones(10)
    out, stats = decoder.generate(prompt, 48, eos_token_ids=eos)
    ref_out, ref_stats = fixed.generate(prompt, 48, eos_token_ids=eos)
    assert out == ref_out == expected
    assert (stats.forwards, stats.nodes) == (ref_stats.forwards, ref_stats.nodes)
    assert stats.nodes == 10 * stats.forwards  # every tree whole
    decoder.costs = torch.tensor([1.0] + [1e9] * 9)
    out, stats = decoder.generate(prompt, 48, eos_token_ids=eos)
    assert out == expected
    assert stats.nodes == stats.forwards and stats.tau == 1.0


def test_adaptive_trees_refuse_drawn_children(tiny_target) -> None:
    spec = TreeSpec(kind="dynamic", depth=3, top_k=2, total_tokens=6, adaptive=True)
    decoder = SpecDecoder(tiny_target, untrained("eagle1", tiny_target), spec)
    with pytest.raises(ValueError, match="tree.sample_drafts=false"):
        decoder.generate([1, 2, 3], 4, Sampling(temperature=1.0))


def test_traversal_refuses_dynamic_trees_of_drawn_children(tiny_target) -> None:
    """A dynamic tree keeps drawn children by scores competing across siblings; with top-k
    children (nothing drawn) it may be traversed."""
    spec = TreeSpec(kind="dynamic", depth=3, top_k=2, total_tokens=6, verify="traversal")
    decoder = SpecDecoder(tiny_target, untrained("eagle1", tiny_target), spec)
    with pytest.raises(ValueError, match="tree.verify=traversal decides whole subtrees"):
        decoder.generate([1, 2, 3], 4, Sampling(temperature=1.0))
    decoder.spec = replace(spec, sample_drafts=False)
    out, stats = decoder.generate([1, 2, 3], 8, Sampling(temperature=1.0))
    assert len(out) == 8 and stats.forwards > 0


@pytest.mark.parametrize("tree", ["dynamic+lookup", "static+lookup"])
@pytest.mark.parametrize("name", list(HEADS))
def test_every_head_samples_with_drawn_trees(name, tree, tiny_target, tiny_tokenizer) -> None:
    """Drawn trees for every head kind at T=1: each step's randomness comes from the caller's
    generator alone (the same seed, after other draws from torch's global generator, decodes
    the same tokens), and drafts are accepted."""
    decoder = SpecDecoder(tiny_target, untrained(name, tiny_target), TREES[tree])
    sampling = Sampling(temperature=1.0)
    runs = []
    for noise in (1, 50):
        torch.rand(noise)  # moves torch's global generator
        out, stats = [], None
        for prompt in prompts(tiny_tokenizer, 3):
            tokens, stats = decoder.generate(
                prompt, 24, sampling, generator=torch.Generator().manual_seed(7)
            )
            out.append(tokens)
        runs.append(out)
        assert all(len(t) == 24 for t in out) and stats.tau > 1.0
    assert runs[0] == runs[1]


SAMPLING_TREES = {
    "dynamic, drawn": TreeSpec(kind="dynamic", depth=2, top_k=2, total_tokens=5, lookup=2),
    "dynamic, drawn, top-p": TreeSpec(kind="dynamic", depth=2, top_k=2, total_tokens=5, lookup=2),
    "static, drawn": TreeSpec(kind="static", depth=2, top_k=2, total_tokens=6, lookup=2),
    "static, drawn, traversal": TreeSpec(
        kind="static", depth=2, top_k=2, total_tokens=6, lookup=2, verify="traversal"
    ),
    # sized per step (`tree.adaptive`): 1 to 4 of its 5 nodes, the root alone, the branch
    # alone, the head's best nodes beside it
    "dynamic, top-k, adaptive": TreeSpec(
        kind="dynamic",
        depth=2,
        top_k=2,
        total_tokens=5,
        lookup=2,
        sample_drafts=False,
        adaptive=True,
    ),
}


@pytest.mark.parametrize("tree", list(SAMPLING_TREES))
def test_sampling_keeps_the_target_distribution(tree: str) -> None:
    """Joint law of the second and third generated tokens (the first verified ones: a root
    child, then a depth-2 node or the next step's root child) on an 8-token vocabulary, against
    the exact target probabilities (top-k, or top-p), for drawn children and for top-k ones in
    trees sized per step. A prompt-lookup branch joins the tree when the context repeats a
    token, so draws with and without it are in the sample."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)  # peaked but not degenerate distributions
    head = untrained("eagle1", target)
    decoder = SpecDecoder(target, head, SAMPLING_TREES[tree])
    if decoder.costs is not None:
        # each node costs 1 ms at a rate held at 0.2 tokens per ms: a step keeps the nodes the
        # head gives >= 0.2, a size that varies from step to step (timing plays no part)
        decoder.costs = torch.arange(1.0, 6.0)
        decoder.produced, decoder.spent = 2e8, 1e9
    # eval.top_p: the nucleus of the target's distribution, drafts outside it never accepted
    top_p = tree.endswith("top-p")
    sampling = Sampling(temperature=0.9, top_p=0.8) if top_p else Sampling(0.9, top_k=6)
    prompt = [1, 5, 2]

    def next_probs(ids: list[int]) -> torch.Tensor:  # [8]
        return sampling.probs(target(torch.tensor([prompt + ids])).logits[0, -1:])[0]

    with torch.no_grad():
        p1 = next_probs([])
        joint = sum(
            p1[a] * next_probs([a])[:, None] * torch.stack([next_probs([a, b]) for b in range(8)])
            for a in range(8)
        )  # [8, 8]: P(second = b, third = c)
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(8, 8)
    draws = 3000
    sizes = []  # nodes per forward of each decode
    for _ in range(draws):
        out, stats = decoder.generate(prompt, 3, sampling, generator=g)
        counts[out[1], out[2]] += 1
        sizes.append(stats.nodes / stats.forwards)
    if decoder.costs is not None:  # the adaptive sizes really differed
        assert len(set(sizes)) > 1 and 1.0 < sum(sizes) / len(sizes) < 5.0
    expected = joint * draws
    keep = expected >= 5
    chi2 = (((counts - expected) ** 2 / expected.clamp_min(1e-9))[keep]).sum()
    dof = int(keep.sum()) - 1
    p_value = torch.special.gammaincc(torch.tensor(dof / 2), chi2 / 2)
    assert counts[~keep].sum() <= 5 * (~keep).sum() + 10  # rare cells stay rare
    assert p_value > 0.001, f"chi2={chi2:.1f} dof={dof} p={p_value:.2e}"


@pytest.mark.parametrize("head_name", sorted(HEADS))
def test_decoding_on_another_device_mixes_no_devices(
    head_name: str, tiny_target_dir, monkeypatch
) -> None:
    """The target and head on a device that is not the CPU, as on a GPU: the decoder and the
    drafters hand them tensors on their device only, and read their outputs back with `.cpu()`,
    where picks, trees and acceptance run (and draws use a CPU generator). The meta device
    stands in for the GPU: mixing it with the CPU is an error, as with CUDA; it holds no values,
    so `.cpu()` returns random ones of the same shape (any values make some tree)."""
    from draftsmith.target import load_target

    real_cpu = torch.Tensor.cpu

    def cpu(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not self.is_meta:
            return real_cpu(self, *args, **kwargs)
        if self.is_floating_point():
            return torch.rand(self.shape).to(self.dtype)
        return torch.zeros(self.shape, dtype=self.dtype)

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    target = load_target(str(tiny_target_dir)).to("meta")
    info = TargetInfo.from_hf_config(target.config)
    head = build_head(dict(HEADS[head_name]), info).to("meta")
    head.bind(TargetParts.from_model(target)).eval()
    generator = torch.Generator().manual_seed(0)
    for tree in ("dynamic+lookup", "static", "chain"):
        decoder = SpecDecoder(target, head, TREES[tree])
        for temperature in (0.0, 1.0):
            sampling = Sampling(temperature=temperature)
            out, stats = decoder.generate(list(range(5, 25)), 12, sampling, generator=generator)
            assert len(out) == 12 and stats.forwards >= 1, (tree, temperature)
