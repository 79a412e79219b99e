"""Packed bf16 linear weights (draftsmith.packed) change speed only: the same logits bit for bit,
the same speculative output, the same parameters; fp32 and trainable layers are left alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from draftsmith.heads import TargetInfo, TargetParts, build_head
from draftsmith.inference.decoder import SpecDecoder, TreeSpec
from draftsmith.packed import PackedLinear, pack_linears, packing_available
from draftsmith.target import load_target

pytestmark = pytest.mark.skipif(
    not packing_available(), reason="no oneDNN bf16 kernels on this CPU build: nothing is packed"
)


def bf16_target(path: Path) -> nn.Module:
    return load_target(str(path), "bfloat16")


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


def test_only_frozen_bf16_linears_are_packed(tiny_target_dir) -> None:
    assert pack_linears(load_target(str(tiny_target_dir), "float32")) == 0
    trainable = nn.Linear(8, 8).to(torch.bfloat16)
    assert pack_linears(trainable) == 0 and type(trainable) is nn.Linear
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    expected = trainable(x).detach()
    assert pack_linears(trainable.requires_grad_(False)) == 1
    assert isinstance(trainable, PackedLinear)
    assert torch.equal(trainable(x), expected)  # with its bias
    assert pack_linears(trainable) == 0  # packing twice is a no-op


def test_packed_speculative_output_is_unchanged(tiny_target_dir, tiny_tokenizer) -> None:
    outputs = []
    for pack in (False, True):
        target = bf16_target(tiny_target_dir)
        torch.manual_seed(0)
        info = TargetInfo.from_hf_config(target.config)
        head = build_head({"name": "eagle3", "draft_vocab_size": 128}, info)
        head = head.to(torch.bfloat16).bind(TargetParts.from_model(target)).eval()
        head.requires_grad_(False)
        if pack:
            assert pack_linears(target) and pack_linears(head)
        spec = TreeSpec(kind="dynamic", depth=3, top_k=3, total_tokens=8, lookup=3)
        decoder = SpecDecoder(target, head, spec)
        prompt = tiny_tokenizer.apply_chat_template(
            [{"role": "user", "content": "why is the sky blue?"}],
            add_generation_prompt=True,
            return_dict=False,
        )
        tokens, stats = decoder.generate(list(prompt), 32)
        outputs.append((tokens, stats.forwards))
    assert outputs[0] == outputs[1]


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
