"""Load a target causal LM (local folder, hub id, embedded asset or the tiny test target).

This is the one place that turns a user's `target.path` into a model and tokenizer, so every
stage agrees on dtype handling, a hub target's revision, `trust_remote_code` (off unless asked)
and error messages.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from draftsmith.assets import ASSETS, AssetError, asset_path
from draftsmith.errors import InputError, MissingInput
from draftsmith.tiny import TINY_NAME, tiny_target_path

if TYPE_CHECKING:
    from draftsmith.conf.schema import TargetConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def native_dtype(device: str) -> str:
    """The fastest exact-enough compute dtype here: bf16 on CUDA and on CPUs with bf16 hardware
    (AVX512-BF16 or AMX), else fp32. Without that hardware torch emulates bf16 matmuls: measured
    6.6x slower than fp32 on an AVX2-only EPYC (SmolLM2 prefill, 72 vs 475 tok/s)."""
    if device.startswith("cuda"):
        return "bfloat16"
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        return "bfloat16"
    return "float32"


def check_device(device: str) -> None:
    """Refuse a CUDA device this torch cannot reach before anything loads (torch's own error, an
    AssertionError deep in a stage, does not name the setting)."""
    if not device.startswith("cuda"):
        return
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():  # 0 on a CPU build or without a visible GPU
        raise InputError(
            f"device={device}: torch {torch.__version__} sees {torch.cuda.device_count()} CUDA "
            "devices (a CPU build, or none visible); pass device=cpu"
        )


def cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword a causal LM's forward takes its KV cache by. Recent transformers (5.24
    here) renamed `past_key_values` to `cache` (the old name warns and goes in 5.40); older
    releases, which `transformers>=4.56` still allows, only know `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise InputError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[name]


def local_only(name_or_path: str) -> bool:
    """Whether `name_or_path` can only be a local path: a hub id is "name" or "owner/name"."""
    return name_or_path.startswith(("/", ".", "~")) or name_or_path.count("/") > 1


def resolve_target_path(name_or_path: str, revision: str | None = None) -> str:
    """Asset name -> cached folder; `tiny-random-llama` -> built tiny target; else unchanged.
    `revision` (target.revision) is a hub target's branch, tag or commit: refused for any other."""
    if revision is not None and _on_this_machine(name_or_path):
        raise InputError(
            f"target.revision={revision}: {name_or_path!r} is loaded from this machine, not from "
            "the hub, and has no revisions (drop target.revision)"
        )
    if name_or_path == TINY_NAME:
        return str(tiny_target_path())
    if name_or_path in ASSETS:
        if ASSETS[name_or_path].kind != "target":
            raise AssetError(f"asset {name_or_path!r} is data, not a target model")
        return str(asset_path(name_or_path))
    # a local path must exist (transformers would otherwise report a missing folder as a
    # malformed repo id)
    if local_only(name_or_path):
        path = Path(name_or_path).expanduser()
        if not path.exists():
            raise AssetError(f"could not load target {name_or_path!r}: no such folder")
        return str(path)
    return name_or_path


def _on_this_machine(name_or_path: str) -> bool:
    """A target that is no hub id: the tiny one, an asset, a path."""
    return (
        name_or_path == TINY_NAME
        or name_or_path in ASSETS
        or local_only(name_or_path)
        or Path(name_or_path).is_dir()
    )


def target_commit(target: TargetConfig) -> str | None:
    """The commit a hub target's `target.revision` (None: its default branch) is at now: the
    hub's answer, or offline (or the hub unreachable) its cache's, where transformers would load
    it from; so a stage loads one commit and records it, and a branch moved on since is another
    target. `target.revision` as given for a target on this machine, or when no commit can be
    read (loading then says why)."""
    from huggingface_hub import HfApi, constants
    from transformers.utils.hub import cached_file, extract_commit_hash

    if _on_this_machine(target.path):  # (a revision given it is refused where it loads)
        return target.revision
    if _is_commit(target.revision):  # a stage's pinned target: no question for the hub
        return target.revision
    if not constants.HF_HUB_OFFLINE:
        try:  # one API call: a file download would retry an unreachable hub for ~25 s
            return HfApi().model_info(target.path, revision=target.revision).sha
        except Exception:  # noqa: BLE001 (unreachable, unknown, gated: the cache may know)
            pass
    try:
        resolved = cached_file(
            target.path,
            "config.json",
            revision=target.revision,
            local_files_only=True,
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
        )
    except OSError:
        return target.revision
    return extract_commit_hash(resolved, None) or target.revision


def _is_commit(revision: str | None) -> bool:
    """A full commit hash, which every hub and cache resolves to itself."""
    return (
        revision is not None
        and len(revision) == 40
        and all(c in "0123456789abcdef" for c in revision)
    )


def target_name(name_or_path: str) -> str:
    """A stable, human-readable name for indexes and exported configs."""
    if name_or_path == TINY_NAME or name_or_path in ASSETS:
        return name_or_path
    path = Path(name_or_path)
    return path.name if path.exists() else name_or_path


def _unloadable(name_or_path: str, err: OSError) -> AssetError:
    if Path(resolve_target_path(name_or_path)).is_dir():  # a folder, not a whole checkpoint
        return AssetError(f"could not load target {name_or_path!r} from its folder: {err}")
    return AssetError(
        f"could not load target {name_or_path!r}: not a local folder with config.json, and the "
        f"hub is not reachable or has no such model. Embedded targets: "
        f"{[a for a, v in ASSETS.items() if v.kind == 'target']} "
        f"(`draftsmith assets fetch NAME`) or {TINY_NAME!r}. ({err})"
    )


def load_tokenizer(
    name_or_path: str,
    trust_remote_code: bool = False,
    chat_template: str | None = None,
    revision: str | None = None,
):
    """The target's tokenizer (a hub target's at `revision`); `chat_template`
    (target.chat_template: a file or the template's text) replaces its own chat template."""
    from transformers import AutoTokenizer

    path = resolve_target_path(name_or_path, revision)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            path, trust_remote_code=trust_remote_code, revision=revision
        )
    except OSError as err:
        raise _unloadable(name_or_path, err) from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if chat_template is not None:
        tokenizer.chat_template = chat_template_text(chat_template)
    elif tokenizer.chat_template is None:
        tokenizer.chat_template = _processor_chat_template(path, revision)
    return tokenizer


def _processor_chat_template(path: str, revision: str | None) -> str | None:
    """The template an image-text checkpoint keeps for its processor only (Qwen2.5-VL's
    chat_template.json), which its tokenizer does not load; None when there is none."""
    from transformers.utils import cached_file

    found = cached_file(
        path,
        "chat_template.json",
        revision=revision,
        local_files_only=os.path.isdir(path),
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
    )
    if found is None:
        return None
    template = json.loads(Path(found).read_text()).get("chat_template")
    return template if isinstance(template, str) else None


def target_tokenizer(target: TargetConfig):
    """The tokenizer every stage renders with: `target.path`'s, with `target.chat_template` in
    place of its own when set (trust_remote_code as the config says)."""
    return load_tokenizer(
        target.path, target.trust_remote_code, target.chat_template, target.revision
    )


def chat_template_digest(value: str | None) -> str | None:
    """A short name for target.chat_template's template (None when it is not set), for the
    names of what its renderings produce."""
    if value is None:
        return None
    return hashlib.sha256(chat_template_text(value).encode()).hexdigest()[:8]


def chat_template_text(value: str) -> str:
    """target.chat_template's template: the text itself when it holds Jinja tags, else the
    contents of the file it names."""
    if "{%" in value or "{{" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise MissingInput(
            f"target.chat_template={value!r}: no such file (give a Jinja template file, such as "
            "a model's chat_template.jinja, or the template's text)"
        )
    return path.read_text()


def load_target(
    name_or_path: str,
    dtype: str = "float32",
    device: str = "cpu",
    trust_remote_code: bool = False,
    attn_implementation: str | None = "sdpa",
    layers: bool = True,
    revision: str | None = None,
):
    """Load a frozen target model in eval mode: a causal LM, or an image-text model transformers
    builds none of (decoding text, it is one).

    Args:
        name_or_path: local folder, hub id, asset name, or `tiny-random-llama`.
        dtype: "float32" | "bfloat16" | "float16".
        device: "cpu" or "cuda[:n]".
        trust_remote_code: run model code shipped with the checkpoint (off by default).
        attn_implementation: transformers attention backend name.
        layers: False builds the model without its decoder layers, whose tensors are never
            read: its embeddings, final norm and lm_head are what a head trains against on
            collected features, and an 8B target's layers would hold ~15 GB on every rank.
            Its config then says 0 layers (`load_config` gives the checkpoint's).
        revision: a hub target's branch, tag or commit (target.revision; None: its default
            branch).

    Returns:
        The model (requires_grad off everywhere).
    """
    check_device(device)
    path = resolve_target_path(name_or_path, revision)
    local = os.path.isdir(path)
    kwargs = {
        "dtype": torch_dtype(dtype),
        "trust_remote_code": trust_remote_code,
        "attn_implementation": attn_implementation,
        "local_files_only": local,
        "revision": revision,
    }
    try:
        config = load_config(name_or_path, trust_remote_code, revision)
        model = None if layers else _without_layers(path, config, kwargs)
        if model is None:
            model = auto_model_class(config).from_pretrained(path, config=config, **kwargs)
    except OSError as err:
        raise _unloadable(name_or_path, err) from err
    except ValueError as err:
        if "attention implementation" not in str(err) or attn_implementation == "eager":
            raise
        # architectures transformers runs eagerly only (Gemma 2's softcapped attention logits,
        # GPT-OSS's attention sinks): their eager attention also verifies trees, taking the tree
        # mask as it is (inference/attention.py: tree_implementation)
        return load_target(
            name_or_path, dtype, device, trust_remote_code, "eager", layers, revision
        )
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    model.generation_config = special_tokens_only(model.generation_config)
    head = model.get_output_embeddings()
    if head is not None:
        head.register_forward_pre_hook(_contiguous_input)
    return model


def load_config(name_or_path: str, trust_remote_code: bool = False, revision: str | None = None):
    """The target's transformers config (the checkpoint's, whatever `load_target` builds)."""
    from transformers import AutoConfig

    path = resolve_target_path(name_or_path, revision)
    try:
        return AutoConfig.from_pretrained(
            path,
            trust_remote_code=trust_remote_code,
            local_files_only=os.path.isdir(path),
            revision=revision,
        )
    except OSError as err:
        raise _unloadable(name_or_path, err) from err


_LAYER_WARNINGS = ("modeling_utils", "distributed.tensor_parallel")


def _without_layers(path: str, config, kwargs: dict):
    """The model built with no decoder layers, or None when it cannot be: an architecture that
    needs its layers to be built, or a checkpoint that lacks (under the names this build looks
    for) a tensor the model keeps. Then the caller loads the whole model, which costs memory,
    never correctness."""
    import copy
    import logging

    config = copy.deepcopy(config)
    text = config.get_text_config(decoder=True)
    text.num_hidden_layers = 0
    if getattr(text, "layer_types", None) is not None:  # one entry per layer (Qwen3, Gemma 3)
        text.layer_types = []
    # transformers would warn of the layers' absence: its load report lists every layer tensor
    # of the checkpoint as unexpected, its tensor-parallel check the layers' rules as unused
    quiet = [logging.getLogger(f"transformers.{name}") for name in _LAYER_WARNINGS]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        model, info = auto_model_class(config).from_pretrained(
            path, config=config, output_loading_info=True, **kwargs
        )
    except Exception:  # noqa: BLE001 (any failure: the whole model loads instead)
        return None
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    return None if info["missing_keys"] or info["mismatched_keys"] else model


def auto_model_class(config):
    """AutoModelForCausalLM, or AutoModelForImageTextToText for an image-text checkpoint
    transformers builds no causal LM of (Qwen2.5-VL, LLaVA): the whole model, decoding text,
    is the target."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    )

    kind = type(config)
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING and kind in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def stop_token_ids(model, tokenizer) -> list[int]:
    """The ids that end a reply: the tokenizer's eos, then any the model's generation config
    lists (Llama-3 instruct checkpoints stop on both <|eot_id|> and <|end_of_text|>, and
    transformers' `generate` stops on that list). Every decoder, baseline and regeneration
    stops on this same set, so their outputs stay comparable token for token."""
    listed = getattr(model.generation_config, "eos_token_id", None)
    listed = listed if isinstance(listed, list) else [listed]
    return list(dict.fromkeys(i for i in [tokenizer.eos_token_id, *listed] if i is not None))


def special_tokens_only(config):
    """The checkpoint's generation config without its decoding defaults. draftsmith decodes
    with exactly the keys it is given (eval, generate, regeneration), but transformers'
    `generate`, which the baselines and regeneration call, applies whatever the checkpoint's
    generation_config.json sets unless overridden: Qwen2.5 ships repetition_penalty 1.05, which
    changes even greedy decoding; others ship top_k, no_repeat_ngram_size or min_new_tokens.
    The speculative decoder applies none of them, so they would make plain decoding differ."""
    from transformers import GenerationConfig

    keep = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
    return GenerationConfig(**{k: getattr(config, k, None) for k in keep})


def _contiguous_input(module: torch.nn.Module, args: tuple) -> tuple:
    """transformers feeds the lm_head `hidden[:, -k:]` (generate's prefill: logits_to_keep=1).
    That view keeps the parent's strides, and torch's bf16 CPU matmul with a frozen weight takes
    a slow path for any non-row-major strides, even on size-1 dims that `is_contiguous()`
    ignores: SmolLM2, one core, 1 row 158 ms instead of 7 ms; batch 32 10.4 s instead of
    0.02 s. Copying the small input to row-major strides is free by comparison."""
    x = args[0]
    if x.stride() != row_major_strides(x.shape):
        x = x.clone(memory_format=torch.contiguous_format)
    return (x, *args[1:])


def row_major_strides(shape: torch.Size) -> tuple[int, ...]:
    strides = [1]
    for size in reversed(shape[1:]):
        strides.insert(0, strides[0] * size)
    return tuple(strides)


def compile_target(model: torch.nn.Module) -> None:
    """Compile the target's transformer body in place (torch.compile, dynamic shapes), so every
    caller (generate, prompt lookup, tree verification) runs the same compiled forward.

    Why: on CPU a small target's eager forward spends much of its time in small elementwise ops
    (norms, RoPE, activations) that grow with the number of new tokens; inductor fuses them. With
    freezing, inductor also treats the weights as constants and packs them for oneDNN once (what
    draftsmith.packed does for eager forwards; a compiled target is not packed as well). SmolLM2
    bf16 on a 2-core AMX Xeon, 300 cached tokens (session 62): one token 32.7 ms against 39.5
    eager packed, a 16-node tree 36.6 against 47.3; without freezing 45.2 and 50.3. The weights
    must not change afterwards (the eval only reads them). Each new call pattern (prefill, one
    token, a masked tree) compiles once on first use, which takes minutes on 2 cores.
    """
    import torch._dynamo

    # FeatureCapture hooks the decoder layers after compiling, and different heads hook different
    # layers: by default dynamo does not guard on submodule hooks and would silently keep running
    # the graph traced with the first head's hooks
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    # one graph per call pattern x hooked layer set (prefill, tree, one token, lookup; with and
    # without hooks): more than dynamo's default 8, after which it would fall back to eager
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    model.get_decoder().compile(dynamic=True, options={"freezing": True})
