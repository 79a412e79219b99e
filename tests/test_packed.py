"""Packed linear weights (draftsmith.packed) change speed only: in bf16 the same logits bit for
bit, the same speculative output, the same parameters; in fp32 logits within rounding and
speculative output equal to the packed target's own greedy output; trainable layers are left
alone."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
import torch
from torch import nn

from draftsmith.heads import TargetInfo, TargetParts, build_head
from draftsmith.inference.decoder import SpecDecoder, TreeSpec
from draftsmith.packed import PackedLinear, pack_linears, packing_available
from draftsmith.target import load_target

needs_bf16 = pytest.mark.skipif(
    not packing_available(torch.bfloat16),
    reason="no oneDNN bf16 kernels on this CPU build: nothing in bf16 is packed",
)
needs_fp32 = pytest.mark.skipif(
    not packing_available(torch.float32), reason="no oneDNN in this torch build"
)


SPEC = TreeSpec(kind="dynamic", depth=3, top_k=3, total_tokens=8, lookup=3)


def bf16_target(path: Path) -> nn.Module:
    return load_target(str(path), "bfloat16")


def frozen_head(target: nn.Module) -> nn.Module:
    """A seeded untrained EAGLE-3 head in the target's dtype, bound to it, frozen (packable)."""
    torch.manual_seed(0)
    head = build_head(
        {"name": "eagle3", "draft_vocab_size": 128}, TargetInfo.from_hf_config(target.config)
    )
    head = head.to(target.dtype).bind(TargetParts.from_model(target)).eval()
    return head.requires_grad_(False)


def sky_prompt(tokenizer) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "why is the sky blue?"}],
            add_generation_prompt=True,
            return_dict=False,
        )
    )


@needs_bf16
def test_packed_target_gives_the_same_logits(tiny_target_dir) -> None:
    plain, packed = bf16_target(tiny_target_dir), bf16_target(tiny_target_dir)
    linears = sum(type(m) is nn.Linear for m in plain.modules())
    assert pack_linears(packed) == linears > 0
    assert all(type(m) is not nn.Linear for m in packed.modules())
    # the plain weights stay where they were: the same state dict
    state = packed.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in plain.state_dict().items())
    assert plain.state_dict().keys() == state.keys()
    with torch.no_grad():
        for rows in (1, 3, 16):  # a decoding step, a small tree, a bigger one
            ids = torch.randint(0, plain.config.vocab_size, (2, rows))
            assert torch.equal(plain(ids).logits, packed(ids).logits)


@needs_bf16
def test_only_frozen_linears_are_packed() -> None:
    assert pack_linears(nn.Linear(8, 8).to(torch.float16).requires_grad_(False)) == 0
    trainable = nn.Linear(8, 8).to(torch.bfloat16)
    assert pack_linears(trainable) == 0 and type(trainable) is nn.Linear
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    expected = trainable(x).detach()
    assert pack_linears(trainable.requires_grad_(False)) == 1
    assert isinstance(trainable, PackedLinear)
    assert torch.equal(trainable(x), expected)  # with its bias
    assert pack_linears(trainable) == 0  # packing twice is a no-op


@needs_bf16
def test_packed_speculative_output_is_unchanged(tiny_target_dir, tiny_tokenizer) -> None:
    outputs = []
    for pack in (False, True):
        target = bf16_target(tiny_target_dir)
        head = frozen_head(target)
        if pack:
            assert pack_linears(target) and pack_linears(head)
        tokens, stats = SpecDecoder(target, head, SPEC).generate(sky_prompt(tiny_tokenizer), 32)
        outputs.append((tokens, stats.forwards))
    assert outputs[0] == outputs[1]


@needs_bf16
def test_packed_regeneration_gives_the_same_answers(tiny_target_dir, tiny_tokenizer) -> None:
    """prepare packs the target before regenerating answers: every engine answers alike."""
    from draftsmith.conf.schema import RegenConfig
    from draftsmith.train.regenerate import generate_answers

    prompts = [list(range(5, 5 + n)) for n in (3, 17, 9)]
    plain, packed = bf16_target(tiny_target_dir), bf16_target(tiny_target_dir)
    assert pack_linears(packed)
    for engine in ("padded", "generate", "continuous"):
        regen = RegenConfig(max_new_tokens=10, engine=engine, batch_size=len(prompts))
        expected = generate_answers(plain, tiny_tokenizer, prompts, regen)
        assert generate_answers(packed, tiny_tokenizer, prompts, regen) == expected


@needs_fp32
def test_packed_fp32_target_is_lossless(tiny_target_dir, tiny_tokenizer) -> None:
    """fp32 packs too (oneDNN's kernel, not MKL's sgemm): logits within rounding of the plain
    target's, and at T=0 speculative output is the packed target's own greedy output."""
    plain, packed = (load_target(str(tiny_target_dir), "float32") for _ in range(2))
    linears = sum(type(m) is nn.Linear for m in plain.modules())
    assert pack_linears(packed) == linears > 0
    with torch.no_grad():
        for rows in (1, 3, 16):
            ids = torch.randint(0, plain.config.vocab_size, (2, rows))
            torch.testing.assert_close(packed(ids).logits, plain(ids).logits, atol=1e-4, rtol=0)
    head = frozen_head(packed)
    assert pack_linears(head)
    prompt = sky_prompt(tiny_tokenizer)
    greedy = packed.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
    eos = {tiny_tokenizer.eos_token_id}
    tokens, stats = SpecDecoder(packed, head, SPEC).generate(prompt, 32, eos_token_ids=eos)
    assert tokens == greedy[0, len(prompt) :].tolist() and stats.forwards > 1


@needs_fp32
def test_a_model_too_big_for_the_memory_is_left_plain(
    tiny_target_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packed copies that would take more than half the available memory are not made."""
    target = load_target(str(tiny_target_dir), "float32")
    weights = sum(m.weight.nbytes for m in target.modules() if type(m) is nn.Linear)
    memory = psutil.virtual_memory()._replace(available=2 * weights - 1)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory)
    assert pack_linears(target) == 0
    assert not any(isinstance(m, PackedLinear) for m in target.modules())
    memory = memory._replace(available=2 * weights)  # just enough: packed
    assert pack_linears(target) > 0
