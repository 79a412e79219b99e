"""Serving formats: export our heads to the folders vLLM, SGLang and TensorRT-LLM load, and
import heads trained elsewhere (official EAGLE-1/EAGLE-3, speculators, FasterDecoding Medusa).

Key facts (research/features.md section 3):
  - EAGLE-3 weights use the official names: fc, midlayer.*, norm, lm_head, d2t (offsets), t2d.
    SGLang and TensorRT-LLM read `midlayer.*`; vLLM's speculators format reads `layers.0.*`.
  - Aux layer ids: ours are "input of layer k" (= vLLM's and the EAGLE default [2, n//2, n-3]).
    SGLang and TensorRT-LLM read explicit ids as "output of layer k" (k-1 in ours); ids equal to
    the server default are omitted.
  - Unknown weight names are skipped silently by SGLang, so every export is validated against the
    exact key set before anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from draftsmith.errors import InputError
from draftsmith.files import staged_dir
from draftsmith.heads.base import DraftHead, TargetInfo, read_safetensors
from draftsmith.heads.eagle3 import default_aux_layers

FORMATS = ("native", "sglang", "vllm", "trtllm", "medusa-vllm", "medusa")
SUPPORTED = {
    "eagle3": ("native", "sglang", "vllm", "trtllm"),
    "eagle1": ("native", "sglang", "vllm"),
    "medusa": ("native", "medusa-vllm", "medusa"),
    "hydra": ("native",),
}


class FormatError(InputError):
    """An export or import that would not load correctly; the message says why."""


# ---- layer-id conventions ----------------------------------------------------------------
def to_output_convention(ids: list[int]) -> list[int]:
    """Ours ("input of layer k") -> SGLang/TRT-LLM explicit ids ("output of layer k")."""
    return [k - 1 for k in ids]


def from_output_convention(ids: list[int]) -> list[int]:
    return [k + 1 for k in ids]


# ---- configs -------------------------------------------------------------------------------
def _llama_fields(t: TargetInfo, num_layers: int) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "head_dim": t.head_dim,
        "rms_norm_eps": t.rms_norm_eps,
        "rope_theta": t.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": t.max_position_embeddings,
        "vocab_size": t.vocab_size,
        "num_hidden_layers": num_layers,
        "hidden_act": t.hidden_act,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def _eagle3_config(head: DraftHead, fmt: str, num_speculative_tokens: int) -> dict[str, Any]:
    t, c = head.target, head.config
    base = {
        **_llama_fields(t, 1),
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": t.hidden_size,
    }
    is_default = list(c.aux_layers) == default_aux_layers(t.num_layers)
    if fmt == "vllm":
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.3.0",
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [
                    {"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens}
                ],
                "default_proposal_method": "greedy",
                "verifier": {
                    "name_or_path": t.name,
                    "architectures": [t.architecture] if t.architecture else [],
                },
            },
            "transformer_layer_config": _llama_fields(t, 1),
            "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": None,
            # our layer keeps the un-normed hidden as residual; vLLM assumes True when absent
            "norm_before_residual": False,
            "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),  # vLLM: input of layer k
            "norm_before_fc": False,
            "fc_norm": False,
            "norm_output": False,
        }
    eagle = {"use_aux_hidden_state": True}
    if not is_default:
        eagle["eagle_aux_hidden_state_layer_ids"] = to_output_convention(list(c.aux_layers))
    return {**base, "architectures": ["LlamaForCausalLMEagle3"], "eagle_config": eagle}


def _eagle1_config(head: DraftHead, fmt: str) -> dict[str, Any]:
    arch = "LlamaForCausalLMEagle" if fmt == "sglang" else "EagleLlamaForCausalLM"
    return {
        **_llama_fields(head.target, head.config.num_layers),
        "architectures": [arch],
        "bias": head.config.fc_bias,
    }


def _medusa_config(head: DraftHead, fmt: str) -> dict[str, Any]:
    t, c = head.target, head.config
    if fmt == "medusa-vllm":
        return {
            "model_type": "medusa",
            "architectures": ["MedusaModel"],
            "hidden_size": t.hidden_size,
            "vocab_size": t.vocab_size,
            "num_heads": c.num_heads,
            "num_hidden_layers": c.num_layers,
            "truncated_vocab_size": None,
            "medusa_fc_bias": True,
            "original_lm_head": not c.own_lm_head,
        }
    return {
        "medusa_num_heads": c.num_heads,
        "medusa_num_layers": c.num_layers,
        "base_model_name_or_path": t.name,
        "version": "1" if c.own_lm_head else "2",
        "hidden_size": t.hidden_size,
        "vocab_size": t.vocab_size,
    }


# ---- weight name maps ----------------------------------------------------------------------
def export_weights(head: DraftHead, fmt: str) -> dict[str, torch.Tensor]:
    """Our state dict -> the format's names (bf16 floats; d2t int64, t2d bool)."""
    state = {k: v.detach().cpu() for k, v in head.state_dict().items()}
    if head.name == "eagle3":
        if fmt == "vllm":
            state = {k.replace("midlayer.", "layers.0.", 1): v for k, v in state.items()}
        if fmt == "trtllm" and head.config.draft_vocab_size == head.target.vocab_size:
            state = {k: v for k, v in state.items() if k not in ("d2t", "t2d")}
    elif head.name == "medusa":
        state = _medusa_names(head, state, fmt)
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}


def _medusa_names(head, state: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    L = head.config.num_layers
    for key, value in state.items():
        parts = key.split(".")
        if parts[0] == "blocks":  # blocks.{head}.{layer}.linear.{weight,bias}
            h, layer, kind = parts[1], parts[2], parts[4]
            if fmt == "medusa-vllm":
                name = f"blocks.{h}.layers.{layer}.{kind}"
            else:
                name = f"{h}.{layer}.linear.{kind}"
        else:  # lm_heads.{head}.weight
            h = parts[1]
            name = f"lm_heads.{h}.weight" if fmt == "medusa-vllm" else f"{h}.{L}.weight"
        out[name] = value
    if fmt == "medusa-vllm" and not head.config.own_lm_head:
        # vLLM's Medusa has no access to the target's lm_head: the format carries a copy
        out["lm_head.weight"] = head.parts.lm_head.weight.detach().cpu()
    return out


def expected_keys(head: DraftHead, fmt: str) -> set[str]:
    return set(export_weights(head, fmt)) if fmt != "native" else set(head.state_dict())


def validate(head: DraftHead, fmt: str, weights: dict[str, torch.Tensor], config: dict) -> None:
    """Refuse exports a server would load wrongly: key set, shapes, d2t offsets."""
    if fmt not in SUPPORTED.get(head.name, ()):
        raise FormatError(
            f"format {fmt!r} does not exist for {head.name} heads; "
            f"supported: {SUPPORTED.get(head.name)}"
        )
    required = expected_keys(head, fmt)
    missing, unknown = required - set(weights), set(weights) - required
    if missing or unknown:
        raise FormatError(
            f"{fmt} export of {head.name}: missing {sorted(missing)}, unknown {sorted(unknown)}"
        )
    t = head.target
    if head.name == "eagle3":
        vd = head.config.draft_vocab_size
        checks = {
            "fc.weight": (t.hidden_size, len(head.config.aux_layers) * t.hidden_size),
            "lm_head.weight": (vd, t.hidden_size),
            "norm.weight": (t.hidden_size,),
        }
        for key, shape in checks.items():
            if tuple(weights[key].shape) != shape:
                raise FormatError(f"{key} has shape {tuple(weights[key].shape)}, expected {shape}")
        if "d2t" in weights:
            d2t = weights["d2t"]
            target_ids = torch.arange(d2t.numel()) + d2t
            if (
                d2t.numel() != vd
                or (d2t < 0).any()
                or (target_ids >= t.vocab_size).any()
                or (target_ids.diff() <= 0).any()
            ):
                raise FormatError("d2t offsets out of range or not strictly increasing")
    if config.get("vocab_size", t.vocab_size) != t.vocab_size:
        raise FormatError("config vocab_size differs from the target's")


def export_head(
    head: DraftHead,
    fmt: str,
    out: str | Path,
    overwrite: bool = False,
    num_speculative_tokens: int = 3,
) -> Path:
    """Validate, then write the `fmt` folder atomically (a temp folder renamed into place)."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise InputError(f"{out} exists; pass export.overwrite=true to replace it")
    if fmt == "native":
        config = head.config_dict()
    elif head.name == "eagle3":
        config = _eagle3_config(head, fmt, num_speculative_tokens)
    elif head.name == "eagle1":
        config = _eagle1_config(head, fmt)
    elif head.name == "medusa":
        config = _medusa_config(head, fmt)
    else:
        config = {}
    weights = export_weights(head, fmt) if fmt != "native" else head.state_dict()
    validate(head, fmt, weights, config)
    with staged_dir(out) as build:
        if fmt == "native":
            head.save(build)
        else:
            file = "medusa_lm_head.safetensors" if fmt == "medusa" else "model.safetensors"
            tensors = {k: v.contiguous() for k, v in weights.items()}
            save_file(tensors, str(build / file), metadata={"format": "pt"})
            (build / "config.json").write_text(json.dumps(config, indent=2))
    return out


# ---- import --------------------------------------------------------------------------------
# the weight files a head folder may hold, in the order they are looked for: safetensors first
SAFETENSORS_FILES = ("model.safetensors", "medusa_lm_head.safetensors")
PICKLE_FILES = ("pytorch_model.bin", "medusa_lm_head.pt", "medusa_lm_head.bin")


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """safetensors, or a .bin/.pt read with weights_only=True (never arbitrary pickles)."""
    for name in SAFETENSORS_FILES:
        if (folder / name).exists():
            return read_safetensors(folder / name)
    for name in PICKLE_FILES:
        if (folder / name).exists():
            try:
                state = torch.load(folder / name, map_location="cpu", weights_only=True)
            except Exception as err:
                raise FormatError(
                    f"{folder / name}: refused, it needs more than tensors to "
                    f"unpickle (weights_only=True failed: {err})"
                ) from err
            return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    # a run's train folder given for its head: name the subfolder that holds it
    inside = [
        str(d)
        for d in sorted(folder.glob("*/"))
        if any((d / n).exists() for n in SAFETENSORS_FILES + PICKLE_FILES)
    ]
    hint = f" (a head's weights are in {', '.join(inside)})" if inside else ""
    raise FormatError(f"{folder}: no model.safetensors, pytorch_model.bin or medusa weights{hint}")


def detect(folder: Path, config: dict, weights: dict[str, torch.Tensor]) -> tuple[str, str]:
    """-> (head name, source format)."""
    keys = set(weights)
    if config.get("speculators_model_type") == "eagle3":
        return "eagle3", "vllm"
    if any(k.startswith("midlayer.") for k in keys):
        return "eagle3", "sglang"
    if any(k.startswith("blocks.") for k in keys):
        return "medusa", "medusa-vllm"
    if any(k.split(".")[0].isdigit() for k in keys):
        return "medusa", "medusa"
    if "fc.weight" in keys and any(k.startswith("layers.") for k in keys):
        return "eagle1", "sglang"
    raise FormatError(f"{folder}: weights match no known head layout (keys {sorted(keys)[:6]})")


def import_head(folder: str | Path, target: TargetInfo) -> DraftHead:
    """Build one of our heads from a foreign folder, checked against the target's dimensions."""
    from draftsmith.heads import build_head

    folder = Path(folder)
    config = (
        json.loads((folder / "config.json").read_text())
        if (folder / "config.json").exists()
        else {}
    )
    weights = read_weights(folder)
    name, fmt = detect(folder, config, weights)
    state: dict[str, torch.Tensor] = {}
    if name == "eagle3":
        if fmt == "vllm":
            aux = config.get("eagle_aux_hidden_state_layer_ids")
            weights = {k.replace("layers.0.", "midlayer.", 1): v for k, v in weights.items()}
        else:
            ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            aux = from_output_convention(ids) if ids else None
        vd = weights["lm_head.weight"].shape[0]
        head = build_head(
            {
                "name": "eagle3",
                "draft_vocab_size": vd,
                "aux_layers": aux or default_aux_layers(target.num_layers),
            },
            target,
        )
        state = {k: v for k, v in weights.items() if not k.startswith("embed_tokens")}
        if "d2t" not in state:  # full vocabulary: identity mapping
            state["d2t"] = torch.zeros(vd, dtype=torch.int64)
        if "t2d" not in state:  # servers do not need t2d; rebuild it from d2t
            t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
            t2d[torch.arange(vd) + state["d2t"]] = True
            state["t2d"] = t2d
    elif name == "eagle1":
        layers = sorted({int(k.split(".")[1]) for k in weights if k.startswith("layers.")})
        head = build_head(
            {"name": "eagle1", "num_layers": len(layers), "fc_bias": "fc.bias" in weights}, target
        )
        state = {k: v for k, v in weights.items() if k.startswith(("fc.", "layers."))}
    else:
        state = _medusa_import(weights, fmt)
        heads = sorted({int(k.split(".")[1]) for k in state if k.startswith("blocks.")})
        layers = sorted({int(k.split(".")[2]) for k in state if k.startswith("blocks.")})
        own = any(k.startswith("lm_heads.") for k in state)
        head = build_head(
            {
                "name": "medusa",
                "num_heads": len(heads),
                "num_layers": len(layers),
                "own_lm_head": own,
            },
            target,
        )
    expected = head.state_dict()
    for key, value in state.items():
        if key in expected and tuple(value.shape) != tuple(expected[key].shape):
            raise FormatError(
                f"{folder}: {key} has shape {tuple(value.shape)}, the target "
                f"{target.name} needs {tuple(expected[key].shape)}"
            )
    missing, unexpected = head.load_state_dict(
        {k: v.to(expected[k].dtype) if k in expected else v for k, v in state.items()},
        strict=False,
    )
    if missing or unexpected:
        raise FormatError(f"{folder}: missing {missing}, unexpected {unexpected}")
    return head


def _medusa_import(weights: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    state = {}
    for key, value in weights.items():
        parts = key.split(".")
        if fmt == "medusa-vllm":
            if parts[0] == "blocks":  # blocks.{h}.layers.{l}.{kind}
                state[f"blocks.{parts[1]}.{parts[3]}.linear.{parts[4]}"] = value
            elif parts[0] == "lm_heads":
                state[key] = value
        elif parts[2] == "linear":  # {h}.{l}.linear.{kind}
            state[f"blocks.{parts[0]}.{parts[1]}.linear.{parts[3]}"] = value
        else:  # {h}.{L}.weight: the head's own lm_head
            state[f"lm_heads.{parts[0]}.weight"] = value
    return state
