"""Shared fixtures: tiny random Llama targets built on CPU, no network."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

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


class FakeHub:
    """A dataset hub in memory (the machine has none): `push` makes a commit of rows on a branch
    or tag; `HfApi.dataset_info` resolves a branch, tag or commit to its commit, and
    `datasets.load_dataset` reads a commit only, so a read that was not pinned to the commit it
    recorded fails rather than read wherever the branch is by then."""

    def __init__(self) -> None:
        self.refs: dict[tuple[str, str], str] = {}  # (repo, branch or tag) -> commit
        self.commits: dict[str, tuple[str, list[dict]]] = {}  # commit -> (repo, rows)
        self.online = True

    def push(self, repo: str, rows: list[dict], ref: str = "main") -> str:
        commit = hashlib.sha1(json.dumps([repo, rows, len(self.commits)]).encode()).hexdigest()
        self.commits[commit] = (repo, rows)
        self.refs[repo, ref] = commit
        return commit

    def dataset_info(self, repo_id: str, revision: str | None = None, **_) -> SimpleNamespace:
        if not self.online:
            raise ConnectionError("the hub is not reachable")
        ref = revision or "main"
        commit = self.refs.get((repo_id, ref), ref)
        if self.commits.get(commit, ("",))[0] != repo_id:
            raise LookupError(f"{repo_id}: no revision {ref}")
        return SimpleNamespace(sha=commit)

    def load_dataset(self, source: str, revision: str | None = None, **_):
        import datasets

        repo, rows = self.commits[revision]  # a branch name, or none: KeyError
        assert repo == source
        return datasets.Dataset.from_list(rows)


@pytest.fixture
def fake_hub(monkeypatch) -> FakeHub:
    import datasets
    from huggingface_hub import HfApi

    hub = FakeHub()
    monkeypatch.setattr(HfApi, "dataset_info", hub.dataset_info)
    monkeypatch.setattr(datasets, "load_dataset", hub.load_dataset)
    return hub


@pytest.fixture
def hub_target(tmp_path: Path, monkeypatch) -> Path:
    """A hub target `acme/tiny` in a huggingface_hub cache laid out on disk and read offline (the
    machine has no hub): two commits of the tiny target ("a" * 40, seed 0, on `main`; "b" * 40,
    seed 1, tagged `v1`). Returns the repo's cache folder (its `refs/` move a branch)."""
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--acme--tiny"
    for seed, commit in [(0, "a" * 40), (1, "b" * 40)]:
        build_tiny_target(repo / "snapshots" / commit, seed=seed)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    (repo / "refs" / "v1").write_text("b" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return repo
