"""Export -> import round trips for every head x format, key/config snapshots, layer-id
translation, d2t semantics, official-layout fixtures, and the refusals."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.errors import InputError
from draftsmith.heads import TargetInfo, TargetParts, build_head, load_head
from draftsmith.heads.formats import (
    SUPPORTED,
    FormatError,
    export_head,
    from_output_convention,
    to_output_convention,
)

CONFIGS = {
    "eagle3": {"name": "eagle3", "draft_vocab_size": 64},
    "eagle1": {"name": "eagle1", "fc_bias": True},
    "medusa": {"name": "medusa", "num_heads": 3, "num_layers": 2},
    "medusa+own": {"name": "medusa", "num_heads": 2, "num_layers": 1, "own_lm_head": True},
    "hydra": {"name": "hydra", "num_heads": 2},
    "hydra+aux": {"name": "hydra", "num_heads": 2, "aux_layers": [1, 2, 4]},
    "hydra+prefix": {"name": "hydra", "num_heads": 2, "prefix_attention": True},
}
# every head in every format it supports, Medusa-1's own lm_heads in each of Medusa's, and Hydra
# with fused layers or prefix attention in its one
ROUND_TRIPS = [(n, f) for n, fs in SUPPORTED.items() for f in fs]
ROUND_TRIPS += [("medusa+own", f) for f in SUPPORTED["medusa"]]
ROUND_TRIPS += [("hydra+aux", "native"), ("hydra+prefix", "native")]


@pytest.fixture(scope="module")
def info(tiny_target) -> TargetInfo:
    return TargetInfo.from_hf_config(tiny_target.config, "tiny-random-llama")


def trained_like(name: str, info, tiny_target, **overrides):
    torch.manual_seed(0)
    head = build_head({**CONFIGS[name], **overrides}, info).bind(
        TargetParts.from_model(tiny_target)
    )
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
        if name == "eagle3":
            counts = torch.randint(0, 100, (info.vocab_size,))
            head.set_vocab(counts)
    return head.eval()


def bf16_rounded(head):
    """What a bf16 export holds: the same head with weights rounded to bf16."""
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return head


def draft_outputs(head, tiny_target) -> torch.Tensor:
    """Draft logits on fixed inputs, for any head kind."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 250, (1, 12), generator=g)
    from draftsmith.features import extract_features

    hidden, aux = extract_features(tiny_target, ids, aux_layers=head.aux_layers)
    with torch.no_grad():
        if head.kind == "autoregressive":
            out = head.step(
                head.feature_input(hidden, aux), ids, torch.arange(12)[None], head.new_cache()
            )
            return (
                head.to_target_ids(head.draft_logits(out).argmax(-1)).float()
                + head.draft_logits(out).mean()
            )
        path = ids[0, -3:][None]
        anchor = head.sequence_features(hidden, aux)[0, -1:]  # [1, H]
        return torch.stack(
            [head.depth_logits(k, anchor, path[:, : k + 1]) for k in range(head.config.num_heads)]
        )


@pytest.mark.parametrize("name,fmt", ROUND_TRIPS)
def test_export_import_round_trip(name, fmt, info, tiny_target, tmp_path: Path) -> None:
    head = trained_like(name, info, tiny_target)
    out = export_head(head, fmt, tmp_path / fmt)
    again = load_head(out, info).bind(TargetParts.from_model(tiny_target)).eval()
    expected = draft_outputs(head if fmt == "native" else bf16_rounded(head), tiny_target)
    torch.testing.assert_close(draft_outputs(again, tiny_target), expected, rtol=0, atol=0)
    weights = next(out.glob("*.safetensors"))
    keys = set(load_file(str(weights)))
    assert not any(k.startswith("embed") for k in keys)  # target embedding never exported


def test_head_by_hub_id_from_the_hub_cache(info, tiny_target, tmp_path: Path, monkeypatch) -> None:
    """A published head is named by its hub id; offline, its cached snapshot loads."""
    from huggingface_hub import constants

    head = trained_like("eagle3", info, tiny_target)
    out = export_head(head, "sglang", tmp_path / "export")
    repo = tmp_path / "hub" / "models--acme--eagle3-tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(out, repo / "snapshots" / commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    again = load_head("acme/eagle3-tiny", info).bind(TargetParts.from_model(tiny_target)).eval()
    expected = draft_outputs(bf16_rounded(head), tiny_target)
    torch.testing.assert_close(draft_outputs(again, tiny_target), expected, rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match="acme/other: no such head folder.*hub"):
        load_head("acme/other", info)


SNAPSHOTS = {
    ("eagle3", "sglang"): (
        {
            "fc.weight",
            "norm.weight",
            "lm_head.weight",
            "d2t",
            "t2d",
            "midlayer.input_layernorm.weight",
            "midlayer.hidden_norm.weight",
        },
        {
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": 64,
            "num_hidden_layers": 1,
            "eagle_config": {"use_aux_hidden_state": True},
        },
    ),
    ("eagle3", "vllm"): (
        {
            "fc.weight",
            "layers.0.hidden_norm.weight",
            "layers.0.self_attn.q_proj.weight",
            "d2t",
            "t2d",
            "lm_head.weight",
        },
        {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "norm_before_residual": False,
            "eagle_aux_hidden_state_layer_ids": [2, 2, 1],
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "default_proposal_method": "greedy",
                # the target's own class, which vLLM reads the verifier as
                "verifier": {
                    "name_or_path": "tiny-random-llama",
                    "architectures": ["LlamaForCausalLM"],
                },
            },
        },
    ),
    ("eagle3", "trtllm"): (
        {"midlayer.self_attn.q_proj.weight", "d2t"},
        {"architectures": ["LlamaForCausalLMEagle3"], "target_hidden_size": 64},
    ),
    ("eagle1", "sglang"): (
        {
            "fc.weight",
            "fc.bias",
            "layers.0.self_attn.q_proj.weight",
            "layers.0.post_attention_layernorm.weight",
        },
        {"architectures": ["LlamaForCausalLMEagle"], "bias": True},
    ),
    ("medusa", "medusa-vllm"): (
        {"blocks.0.layers.0.weight", "blocks.2.layers.1.bias", "lm_head.weight"},
        {
            "model_type": "medusa",
            "num_heads": 3,
            "num_hidden_layers": 2,
            "medusa_fc_bias": True,
            "original_lm_head": True,
        },
    ),
    ("medusa", "medusa"): (
        {"0.0.linear.weight", "2.1.linear.bias"},
        {"medusa_num_heads": 3, "medusa_num_layers": 2, "version": "2"},
    ),
    # Medusa-1: each head's own lm_head, after its blocks ({h}.{L}), or vLLM's lm_heads.{h}
    ("medusa+own", "medusa-vllm"): (
        {"blocks.1.layers.0.weight", "lm_heads.0.weight", "lm_heads.1.weight"},
        {"num_heads": 2, "num_hidden_layers": 1, "original_lm_head": False},
    ),
    ("medusa+own", "medusa"): (
        {"0.0.linear.weight", "0.1.weight", "1.1.weight"},
        {"medusa_num_heads": 2, "medusa_num_layers": 1, "version": "1"},
    ),
}


@pytest.mark.parametrize("name,fmt", list(SNAPSHOTS))
def test_key_and_config_snapshots(name, fmt, info, tiny_target, tmp_path: Path) -> None:
    keys, fields = SNAPSHOTS[(name, fmt)]
    out = export_head(trained_like(name, info, tiny_target), fmt, tmp_path / "x")
    weights = load_file(str(next(out.glob("*.safetensors"))))
    config = json.loads((out / "config.json").read_text())
    assert keys <= set(weights)
    assert all(config[k] == v for k, v in fields.items()), config
    assert all(v.dtype in (torch.bfloat16, torch.int64, torch.bool) for v in weights.values())
    if name == "eagle1":
        assert "layers.0.input_layernorm.weight" not in weights  # EAGLE-1 layer 0 has none
    if name == "medusa+own":
        assert "lm_head.weight" not in weights  # no copy of the target's: the heads have their own


def test_vllm_names_the_targets_own_class(make_tiny, tmp_path: Path) -> None:
    """The speculators config's verifier is the target's class, as its checkpoint names it (a
    head saved before the class was recorded names none rather than a wrong one)."""
    from draftsmith.target import load_target

    target = load_target(str(make_tiny(architecture="Qwen2")))
    info = TargetInfo.from_hf_config(target.config, "tiny-qwen2")
    for known, architectures in (
        (info, ["Qwen2ForCausalLM"]),
        (replace(info, architecture=""), []),
    ):
        head = build_head(CONFIGS["eagle3"], known).bind(TargetParts.from_model(target))
        head.set_vocab(torch.arange(known.vocab_size))
        out = export_head(head, "vllm", tmp_path / str(len(architectures)))
        verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
        assert verifier == {"name_or_path": "tiny-qwen2", "architectures": architectures}


def test_layer_ids_translate_both_ways(info, tiny_target, tmp_path: Path) -> None:
    assert to_output_convention([2, 15, 27]) == [1, 14, 26]
    assert from_output_convention(to_output_convention([3, 5])) == [3, 5]
    head = trained_like("eagle3", info, tiny_target, aux_layers=[1, 2, 4])
    sglang = export_head(head, "sglang", tmp_path / "s")
    ids = json.loads((sglang / "config.json").read_text())["eagle_config"]
    assert ids["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]  # SGLang: output of layer k
    vllm = export_head(head, "vllm", tmp_path / "v")
    assert json.loads((vllm / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [
        1,
        2,
        4,
    ]
    for folder in (sglang, vllm):
        assert load_head(folder, info).config.aux_layers == [1, 2, 4]


def test_d2t_semantics_on_reduced_vocab(info, tiny_target, tmp_path: Path) -> None:
    head = trained_like("eagle3", info, tiny_target)
    out = export_head(head, "sglang", tmp_path / "s")
    w = load_file(str(out / "model.safetensors"))
    target_ids = torch.arange(64) + w["d2t"]
    assert torch.equal(target_ids, head.draft_token_ids()) and w["t2d"][target_ids].all()
    # SGLang's hot_token_id = d2t + arange must be the same ids
    assert torch.equal(w["d2t"] + torch.arange(64), target_ids)


def test_official_layout_fixtures_import_and_draft(info, tiny_target, tmp_path: Path) -> None:
    H = info.hidden_size
    # official EAGLE-3 (SpecForge/SGLang layout, .bin, output-convention ids, embed included)
    src = trained_like("eagle3", info, tiny_target)
    state = {k: v.clone() for k, v in src.state_dict().items() if k != "t2d"}
    state["embed_tokens.weight"] = torch.zeros(info.vocab_size, H)
    (tmp_path / "e3").mkdir()
    torch.save(state, tmp_path / "e3" / "pytorch_model.bin")
    (tmp_path / "e3" / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "draft_vocab_size": 64,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 1, 0]},
            }
        )
    )
    e3 = load_head(tmp_path / "e3", info)
    assert e3.config.aux_layers == [2, 2, 1] and torch.equal(e3.t2d, src.t2d)
    # official EAGLE-1 (fc with bias, layers.0 without input norm)
    e1 = trained_like("eagle1", info, tiny_target)
    (tmp_path / "e1").mkdir()
    save_file(
        {k: v.contiguous() for k, v in e1.state_dict().items()},
        str(tmp_path / "e1" / "model.safetensors"),
    )
    assert load_head(tmp_path / "e1", info).config.fc_bias
    # FasterDecoding Medusa-1 with its own lm_heads ({h}.{L}.weight)
    (tmp_path / "m").mkdir()
    med = {f"{h}.0.linear.weight": torch.randn(H, H) for h in range(2)}
    med |= {f"{h}.0.linear.bias": torch.randn(H) for h in range(2)}
    med |= {f"{h}.1.weight": torch.randn(info.vocab_size, H) for h in range(2)}
    save_file(med, str(tmp_path / "m" / "medusa_lm_head.safetensors"))
    m = load_head(tmp_path / "m", info)
    assert m.config.num_heads == 2 and m.config.own_lm_head
    from draftsmith.inference.decoder import SpecDecoder, TreeSpec

    for head in (e3, e1, m):
        head.bind(TargetParts.from_model(tiny_target)).eval()
        decoder = SpecDecoder(tiny_target, head, TreeSpec(kind="chain", depth=2))
        out, stats = decoder.generate([1, 40, 50, 60], 8)
        assert len(out) == 8 and stats.forwards >= 1


def test_refusals(info, tiny_target, tmp_path: Path, make_tiny) -> None:
    head = trained_like("eagle3", info, tiny_target)
    export_head(head, "sglang", tmp_path / "out")
    with pytest.raises(InputError, match="exists; pass export.overwrite=true"):
        export_head(head, "sglang", tmp_path / "out")
    export_head(head, "sglang", tmp_path / "out", overwrite=True)
    with pytest.raises(FormatError, match="does not exist for hydra"):
        export_head(trained_like("hydra", info, tiny_target), "vllm", tmp_path / "h")
    assert not (tmp_path / "h").exists()  # nothing partial left behind
    with torch.no_grad():
        head.d2t[5] = 10**6  # an offset pointing past the vocabulary
    with pytest.raises(FormatError, match="d2t"):
        export_head(head, "sglang", tmp_path / "bad")
    # a pickle that needs more than tensors
    (tmp_path / "evil").mkdir()
    torch.save({"x": object}, tmp_path / "evil" / "pytorch_model.bin")
    with pytest.raises(FormatError, match="weights_only"):
        load_head(tmp_path / "evil", info)
    # a foreign head whose shapes do not fit the target
    other = TargetInfo.from_hf_config(
        __import__("transformers").AutoConfig.from_pretrained(make_tiny(hidden_size=32))
    )
    out = export_head(trained_like("eagle3", info, tiny_target), "vllm", tmp_path / "v")
    with pytest.raises(FormatError, match="needs"):
        load_head(out, other)
    # a folder with no weights at all, and one whose weights fit no known layout
    (tmp_path / "empty").mkdir()
    with pytest.raises(FormatError, match="empty: no model.safetensors, pytorch_model.bin"):
        load_head(tmp_path / "empty", info)
    # a run's train folder given for its head: the message names the subfolder holding it
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "checkpoints").mkdir()
    export_head(trained_like("eagle3", info, tiny_target), "native", tmp_path / "train" / "head")
    with pytest.raises(
        FormatError, match=r"train: no .* weights \(a head's weights are in \S+/train/head\)$"
    ):
        load_head(tmp_path / "train", info)
    (tmp_path / "odd").mkdir()
    save_file({"encoder.weight": torch.zeros(2, 2)}, str(tmp_path / "odd" / "model.safetensors"))
    with pytest.raises(FormatError, match=r"odd: weights match no known head layout .*encoder"):
        load_head(tmp_path / "odd", info)
    # damaged weights (a copy cut short), native and foreign: the file is named
    for fmt in ("native", "vllm"):
        cut = export_head(trained_like("eagle3", info, tiny_target), fmt, tmp_path / f"cut_{fmt}")
        weights = cut / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
        with pytest.raises(
            InputError, match=f"{re.escape(str(weights))}: not a readable safetensors"
        ):
            load_head(cut, info)
    # a head path that does not exist (no trained head yet) says how to get one
    with pytest.raises(FileNotFoundError, match="no such head folder.*draftsmith train"):
        load_head(tmp_path / "nowhere", info)
