"""Shared fixtures: tiny random Llama targets built on CPU, no network."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draftsmith.tiny import build_tiny_target, tiny_target_path


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_target_dir() -> Path:
    """The cached default tiny target (4 layers, hidden 64, byte tokenizer, ChatML)."""
    return tiny_target_path()


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir: Path):
    from draftsmith.target import load_target

    return load_target(str(tiny_target_dir))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_target_dir: Path):
    from draftsmith.target import load_tokenizer

    return load_tokenizer(str(tiny_target_dir))


@pytest.fixture
def make_tiny(tmp_path: Path):
    """Build a tiny target with custom settings (e.g. another chat template)."""

    def _make(**kwargs) -> Path:
        return build_tiny_target(tmp_path / f"tiny-{len(list(tmp_path.iterdir()))}", **kwargs)

    return _make


@pytest.fixture
def head_dir(tmp_path: Path, tiny_target) -> Path:
    """An untrained EAGLE-3 head for the tiny target, saved as a head folder."""
    from draftsmith.heads import TargetInfo, build_head

    torch.manual_seed(0)
    info = TargetInfo.from_hf_config(tiny_target.config)
    head = build_head({"name": "eagle3", "draft_vocab_size": 128}, info)
    return head.save(tmp_path / "head")
