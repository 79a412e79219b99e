"""Collection: batch-invariant features, byte-identical resume, verification of shard hashes."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from pipeline import tiny_run

from draftsmith.config import compose
from draftsmith.features import extract_features
from draftsmith.train import collect, prepare


def test_features_do_not_depend_on_batch_mates(tiny_target) -> None:
    g = torch.Generator().manual_seed(0)
    short = torch.randint(3, 250, (1, 9), generator=g)
    long = torch.randint(3, 250, (1, 17), generator=g)
    alone_h, alone_a = extract_features(tiny_target, short, aux_layers=[1, 2, 3])
    ids = torch.zeros(2, 17, dtype=torch.long)
    ids[0] = long
    ids[1, :9] = short  # right-padded with token 0
    batch_h, batch_a = extract_features(tiny_target, ids, aux_layers=[1, 2, 3])
    torch.testing.assert_close(batch_h[1, :9], alone_h[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batch_a[1, :9], alone_a[0], rtol=1e-5, atol=1e-5)
    assert alone_a.shape[-1] == 3 * alone_h.shape[-1]


def test_resume_is_byte_identical_and_verify_names_bad_shards(tmp_path: Path, monkeypatch) -> None:
    overrides = tiny_run(tmp_path)
    out = tmp_path / "runs/t/collect"
    index = json.loads((out / "index.json").read_text())
    assert index["complete"] and index["layer_convention"] == "input_of_layer"
    assert index["aux_layers"] == [2, 2, 1]  # [2, n//2, n-3] for the 4-layer tiny target
    shards = sorted(out.glob("train/*.safetensors"))
    assert len(shards) >= 3
    original = {p.name: p.read_bytes() for p in shards}
    # a collect killed while writing shard 2: the index lists shards 0-1, shard 2 is a temp file
    index["complete"] = False
    index["splits"]["train"]["shards"] = index["splits"]["train"]["shards"][:2]
    del index["splits"]["heldout"]
    (out / "index.json").write_text(json.dumps(index))
    for p in shards[2:]:
        p.unlink()
    calls = []
    real = collect.collect_shard
    monkeypatch.setattr(collect, "collect_shard", lambda *a: calls.append(1) or real(*a))
    collect.run(compose(overrides))
    assert len(calls) == len(shards) - 2 + 1  # the missing train shards + the heldout shard
    assert {p.name: p.read_bytes() for p in sorted(out.glob("train/*.safetensors"))} == original
    assert collect.verify_shards(out) == len(shards) + 1
    data = bytearray(shards[1].read_bytes())
    data[-5] ^= 0xFF
    shards[1].write_bytes(bytes(data))
    with pytest.raises(ValueError, match=shards[1].name):
        collect.run(compose([*overrides, "verify=true"]))
    with pytest.raises(FileNotFoundError, match="nothing collected to verify"):
        collect.verify_shards(tmp_path / "elsewhere")


def test_collect_refuses_other_settings(tmp_path: Path) -> None:
    overrides = tiny_run(tmp_path, rows=12)
    with pytest.raises(ValueError, match="other settings"):
        collect.run(compose([*overrides, "collect.aux_layers=[1,2,3]"]))


def test_collect_and_train_refuse_parts_that_miss_the_models_logits(
    tmp_path: Path, monkeypatch
) -> None:
    """Borrowed target parts that do not reproduce the model's logits (an architecture whose
    logit transform draftsmith does not know) stop both stages before any shard or step."""
    import dataclasses
    import shutil

    from draftsmith.heads import TargetParts
    from draftsmith.train import loop

    overrides = tiny_run(tmp_path, rows=12)
    real = TargetParts.from_model.__func__
    monkeypatch.setattr(
        TargetParts,
        "from_model",
        classmethod(lambda cls, model: dataclasses.replace(real(cls, model), logit_scale=2.0)),
    )
    with pytest.raises(ValueError, match="logits are not lm_head"):
        loop.run(compose([*overrides, "head=eagle3", "head.draft_vocab_size=128"]))
    assert not (tmp_path / "runs/t/train/head").exists()
    shutil.rmtree(tmp_path / "runs/t/collect")
    with pytest.raises(ValueError, match="logits are not lm_head"):
        collect.run(compose(overrides))
    assert not list((tmp_path / "runs/t").glob("collect/**/*.safetensors"))


def test_training_refuses_features_it_cannot_read_naming_the_file(
    tmp_path: Path, tiny_target
) -> None:
    """Shards from another target, a damaged shard, an unfinished or missing collection: each
    stops the training's reader with an error naming the folder or file."""
    import dataclasses

    from draftsmith.heads import TargetInfo
    from draftsmith.train.data import ShardRows

    tiny_run(tmp_path, rows=12)
    out = tmp_path / "runs/t/collect"
    info = json.loads((out / "index.json").read_text())
    rows = ShardRows(out, "train", max_len=64)
    mine = TargetInfo.from_hf_config(tiny_target.config, "tiny")
    rows.check(mine, info["aux_layers"])  # its own target passes
    other = dataclasses.replace(mine, name="other", hidden_size=mine.hidden_size * 2)
    with pytest.raises(ValueError, match=r"come from target .* the head's target is other"):
        rows.check(other, info["aux_layers"])

    shard = sorted(out.glob("train/*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])  # cut short, header and all
    with pytest.raises(ValueError, match=f"corrupted shard .*{shard.name}"):
        ShardRows(out, "train", max_len=64)
    index = out / "index.json"
    index.write_text(json.dumps({**info, "complete": False}))
    with pytest.raises(ValueError, match="collection is incomplete"):
        ShardRows(out, "train", max_len=64)
    index.unlink()
    with pytest.raises(FileNotFoundError, match="no collected features"):
        ShardRows(out, "train", max_len=64)


def test_workers_collect_the_same_shards(tmp_path: Path) -> None:
    """collect.workers=2: two processes collect the shards side by side into the same files and
    index as one process does (on a CPU each on one core; on GPUs one per device)."""
    from safetensors.torch import load_file

    overrides = tiny_run(tmp_path)
    collect.run(compose([*overrides, "run_name=w", "inputs_from=t", "collect.workers=2"]))
    one, two = tmp_path / "runs/t/collect", tmp_path / "runs/w/collect"
    index_one = json.loads((one / "index.json").read_text())
    index_two = json.loads((two / "index.json").read_text())
    assert index_two["complete"]
    for split in ("train", "heldout"):
        files = [s["file"] for s in index_one["splits"][split]["shards"]]
        assert [s["file"] for s in index_two["splits"][split]["shards"]] == files
        for name in files:
            a, b = load_file(one / name), load_file(two / name)
            assert a.keys() == b.keys()
            for key in a:
                torch.testing.assert_close(a[key], b[key], rtol=1e-3, atol=1e-3)
    assert collect.verify_shards(two) == sum(len(s["shards"]) for s in index_one["splits"].values())


def test_a_hub_target_is_collected_at_its_revision(tmp_path: Path, hub_target: Path) -> None:
    """target.revision reaches what transformers reads of a hub target: collected at a tag, the
    features are that commit's, byte for byte as from its folder, not the default branch's; the
    index records the commit, so another tag, or the default branch moved on since, is another
    target. A target on this machine has no revisions: refused naming the key."""
    from draftsmith.target import load_tokenizer
    from draftsmith.tiny import TINY_NAME

    repo = hub_target

    def shards(name: str, *target: str) -> tuple[list[str], list[str], str | None]:
        (tmp_path / name).mkdir()
        overrides = tiny_run(tmp_path / name, rows=12, extra=list(target))
        index = json.loads((tmp_path / name / "runs/t/collect/index.json").read_text())
        shas = [s["sha256"] for s in index["splits"]["train"]["shards"]]
        return overrides, shas, index["target_revision"]

    pinned, at_v1, commit = shards("v1", "target.path=acme/tiny", "target.revision=v1")
    assert commit == "b" * 40  # the tag's commit, which the stages loaded
    assert shards("b", f"target.path={repo / 'snapshots' / commit}")[1:] == (at_v1, None)
    main, at_main, commit = shards("main", "target.path=acme/tiny")
    assert at_v1 != at_main and commit == "a" * 40
    # another tag, or the default branch moved on: another target (collect's index, prepare's
    # settings)
    with pytest.raises(ValueError, match=rf"other settings \(\{{'target_revision': '{'b' * 40}'"):
        collect.run(compose([*pinned, "target.revision=main"]))
    (repo / "refs" / "main").write_text("b" * 40)
    with pytest.raises(ValueError, match=f"prepare was made with other settings .*{'b' * 40}"):
        prepare.run(compose(main))
    with pytest.raises(ValueError, match="target.revision=v1: 'tiny-random-llama' is loaded from"):
        load_tokenizer(TINY_NAME, revision="v1")


def test_a_hub_targets_commit_is_the_hubs_answer_else_its_caches(hub_target, monkeypatch) -> None:
    """Online, a hub target's commit is what the hub answers for its revision (one API call);
    the hub unreachable, the commit its cache holds for that revision, as transformers would load
    it from there."""
    from huggingface_hub import HfApi, constants

    from draftsmith.conf.schema import TargetConfig
    from draftsmith.target import target_commit

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    asked = []

    def answer(_api, repo_id: str, revision: str | None = None, **_) -> SimpleNamespace:
        asked.append((repo_id, revision))
        return SimpleNamespace(sha="c" * 40)

    monkeypatch.setattr(HfApi, "model_info", answer)
    assert target_commit(TargetConfig(path="acme/tiny", revision="v1")) == "c" * 40
    assert asked == [("acme/tiny", "v1")]

    def unreachable(*_, **__):
        raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.setattr(HfApi, "model_info", unreachable)
    assert target_commit(TargetConfig(path="acme/tiny", revision="v1")) == "b" * 40
    assert target_commit(TargetConfig(path="acme/tiny")) == "a" * 40
    assert target_commit(TargetConfig(path="acme/other", revision="v1")) == "v1"  # not cached
