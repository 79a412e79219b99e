"""Target loading: the tiny random target is deterministic and real; missing assets name the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draftsmith.assets import AssetError
from draftsmith.target import load_target, load_tokenizer


def test_tiny_target_is_deterministic(make_tiny, tiny_target_dir: Path) -> None:
    a, b = make_tiny(), make_tiny()
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() == (
        tiny_target_dir / "model.safetensors"
    ).read_bytes()


def test_tiny_target_loads_with_chat_template(tiny_target, tiny_tokenizer) -> None:
    text = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "héllo"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n"
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tiny_tokenizer.decode(ids) == text
    assert not any(p.requires_grad for p in tiny_target.parameters())
    with torch.no_grad():
        logits = tiny_target(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tiny_tokenizer))
    # peaked, non-degenerate next-token distributions (few greedy ties)
    assert logits.softmax(-1).max(-1).values.mean() > 0.05


def test_lm_head_reads_contiguous_rows(tiny_target) -> None:
    """generate()'s prefill slices hidden[:, -1:] for the lm_head; a non-contiguous batch > 1
    view would make torch copy the frozen lm_head weight once per row."""
    seen = []
    head = tiny_target.get_output_embeddings()
    handle = head.register_forward_hook(lambda m, args, out: seen.append(args[0].is_contiguous()))
    try:
        ids = torch.randint(3, 200, (3, 7))
        with torch.no_grad():
            last = tiny_target(ids, logits_to_keep=1).logits  # [3, 1, V]
            full = tiny_target(ids).logits  # [3, 7, V]
    finally:
        handle.remove()
    assert seen == [True, True]
    torch.testing.assert_close(last[:, 0], full[:, -1])


def test_uncached_asset_names_the_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    with pytest.raises(AssetError, match="draftsmith assets fetch smollm2-135m-instruct"):
        load_target("smollm2-135m-instruct")
    with pytest.raises(AssetError, match="data, not a target"):
        load_tokenizer("sharegpt")


def test_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(AssetError, match="could not load target"):
        load_target(str(tmp_path / "nowhere"))
