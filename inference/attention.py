"""Tree attention for the target, plugged in through transformers' AttentionInterface.

Verification runs the target once over all tree nodes with a 4D mask [B, 1, Q, KV] (prefix
columns visible, tree columns = ancestor mask; `tree_mask` builds it in the backend's form);
transformers passes a 4D mask through untouched. Backends (`tree.attention`):
  sdpa  - torch SDPA with the dense mask, additive (CPU default; exact): transformers' own SDPA,
          except that grouped KV heads are read in place (see `sdpa_tree_attention`).
  flex  - FlexAttention with a BlockMask built from the dense mask.
  flash - CUDA only: flash-attn over the prefix (no mask, returns the log-sum-exp), a dense pass
          over the small tree block, the two merged by log-sum-exp. This file is the only place
          that imports flash_attn.
Asking for an unavailable backend is an error, never a silent switch. A target loaded with eager
attention (Gemma 2, GPT-OSS: transformers runs them eagerly only) keeps it, with sdpa's mask.
Sliding-window layers get the window in their mask (`attention_windows`, `tree_masks`): one mask
for the whole model, or one per layer type where a model mixes full and sliding layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from draftsmith.errors import InputError

BACKENDS = {"sdpa": "draftsmith_sdpa", "flex": "draftsmith_flex", "flash": "draftsmith_flash"}


def _expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def dense_attention_lse(
    q: torch.Tensor,  # [B, nh, Q, d]
    k: torch.Tensor,  # [B, nh, K, d]
    v: torch.Tensor,  # [B, nh, K, d]
    mask: torch.Tensor | None,  # [B or 1, 1, Q, K] bool, True = attend
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention returning (out [B, nh, Q, d], log-sum-exp [B, nh, Q]) in fp32."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # fully masked rows -> 0
    return probs @ v.float(), lse


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Combine attention over two disjoint key sets from their outputs and log-sum-exps."""
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse).nan_to_num(0.0)[..., None]
    weight_b = torch.exp(lse_b - lse).nan_to_num(0.0)[..., None]
    return out_a * weight_a + out_b * weight_b


def split_tree_attention(q, k, v, mask, scale, prefix_fn=None) -> torch.Tensor:
    """Attention over [prefix | tree] keys: prefix fully visible to every query (so a mask-free
    kernel can take it), tree block masked densely. `prefix_fn(q, k, v, scale) -> (out, lse)`
    defaults to the dense reference; the flash backend passes flash-attn."""
    Q, K = q.shape[2], k.shape[2]
    prefix = K - Q
    tree_mask = mask[..., prefix:] if mask is not None else None
    out_b, lse_b = dense_attention_lse(q, k[:, :, prefix:], v[:, :, prefix:], tree_mask, scale)
    if prefix == 0:
        return out_b
    if mask is not None and not bool(mask[..., :prefix].all()):
        raise ValueError("split tree attention needs every query to see the whole prefix")
    fn = prefix_fn or (lambda q_, k_, v_, s: dense_attention_lse(q_, k_, v_, None, s))
    out_a, lse_a = fn(q, k[:, :, :prefix], v[:, :, :prefix], scale)
    return merge_attention(out_a, lse_a, out_b, lse_b)


def _flash_prefix(q, k, v, scale):
    from flash_attn import flash_attn_func

    # flash-attn layout is [B, S, nh, d]; it returns lse as [B, nh, Q]
    out, lse, _ = flash_attn_func(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        softmax_scale=scale,
        causal=False,
        return_attn_probs=True,
    )
    return out.transpose(1, 2).float(), lse.float()


def sdpa_tree_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers' SDPA, but a masked call with grouped KV heads passes `enable_gqa` instead of
    copying every KV head per query head (transformers copies whenever a mask is given, on CPU
    and CUDA alike, i.e. in every tree verification: the whole cache twice per layer). Same
    kernel, same output:
    a 16-node SmolLM2 tree forward after 250 tokens, bf16, 2 cores: 27.9 ms against 29.1.
    Unmasked calls and single queries (which transformers packs per KV head) go to transformers."""
    if attention_mask is None or query.shape[1] == key.shape[1] or query.shape[2] == 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, **kwargs
        )
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
    )  # [B, nh, Q, d]
    return out.transpose(1, 2).contiguous(), None


def flash_tree_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    if not query.is_cuda:
        raise InputError("tree.attention=flash needs CUDA tensors; use sdpa or flex on CPU")
    groups = query.shape[1] // key.shape[1]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    key, value = _expand_kv(key, groups), _expand_kv(value, groups)
    if attention_mask is None:  # prefill: plain causal flash
        from flash_attn import flash_attn_func

        out = flash_attn_func(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            softmax_scale=scale,
            causal=True,
        )
        return out, None
    out = split_tree_attention(query, key, value, attention_mask, scale, _flash_prefix)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def flex_tree_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, _, Q, _ = query.shape
    K = key.shape[2]
    if attention_mask is None:
        offset = K - Q

        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + offset
    else:
        dense = attention_mask.expand(B, 1, Q, K)

        def mask_mod(b, h, q_idx, kv_idx):
            return dense[b, 0, q_idx, kv_idx]

    block_mask = create_block_mask(mask_mod, B, None, Q, K, device=query.device)
    out = flex_attention(
        query,
        key,
        value,
        block_mask=block_mask,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def tree_mask(
    ancestors: torch.Tensor,
    prefix: int,
    backend: str,
    dtype: torch.dtype,
    window: int | None = None,
    depths: torch.Tensor | None = None,
) -> torch.Tensor:
    """The target's attention mask [1, 1, N, prefix + N] for tree nodes with `ancestors` [N, N]
    after `prefix` cached tokens, in the form `backend` takes: for sdpa additive (0 / -inf in
    the target's `dtype`), which SDPA would otherwise make from a boolean mask in every layer
    (the same values, so the same outputs: 0.9 ms less per 16-node SmolLM2 forward on 2 cores);
    for flex and flash boolean, True = attend. With a sliding `window`, a node at position
    prefix + depth (`depths` [N]) also sees only keys fewer than `window` positions back, as
    transformers' sliding-window layers do."""
    N = ancestors.shape[0]
    if window is not None:
        if depths is None:
            raise ValueError("a sliding-window tree mask needs the nodes' depths")
        queries = prefix + depths  # [N] positions
        keys = torch.cat([torch.arange(prefix), queries])  # [prefix + N]
        allowed = torch.ones(N, prefix + N, dtype=torch.bool)
        allowed[:, prefix:] = ancestors
        allowed &= queries[:, None] - keys[None, :] < window
        if backend != "sdpa":
            return allowed[None, None]
        return torch.zeros(N, prefix + N, dtype=dtype).masked_fill_(~allowed, float("-inf"))[
            None, None
        ]
    if backend == "sdpa":
        mask = torch.zeros(N, prefix + N, dtype=dtype)
        mask[:, prefix:].masked_fill_(~ancestors, float("-inf"))
    else:
        mask = torch.ones(N, prefix + N, dtype=torch.bool)
        mask[:, prefix:] = ancestors
    return mask[None, None]


def attention_windows(config) -> dict[str, int | None]:
    """Layer type -> sliding window (None: full attention) of a transformers model config, as
    its KV cache is laid out; a layer type tree verification cannot mask (chunked, linear or
    compressed attention, state-space layers) is an error."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    windows: dict[str, int | None] = {}
    for layer_type, layer_kwargs in zip(types, kwargs):
        if layer_type not in ("full_attention", "sliding_attention"):
            raise InputError(
                f"{type(config).__name__}: layer type {layer_type!r} is not supported by tree "
                "verification (full and sliding-window attention layers are)"
            )
        windows[layer_type] = layer_kwargs.get("sliding_window")
    return windows


def tree_masks(
    windows: dict[str, int | None],
    ancestors: torch.Tensor,
    depths: torch.Tensor,
    prefix: int,
    backend: str,
    dtype: torch.dtype,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The attention mask(s) of one tree forward for a target with layer `windows`
    (`attention_windows`): one mask when every layer attends alike, else one per layer type,
    the mapping transformers' models with mixed layers take as `attention_mask`."""
    masks = {
        layer_type: tree_mask(ancestors, prefix, backend, dtype, window, depths)
        for layer_type, window in windows.items()
    }
    return next(iter(masks.values())) if len(masks) == 1 else masks


def tree_backend(backend: str) -> str:
    """The transformers attention name of tree backend `backend` (sdpa | flex | flash); an
    unavailable one is an error."""
    if backend not in BACKENDS:
        raise InputError(f"tree.attention={backend!r}: expected one of {sorted(BACKENDS)}")
    if backend == "flash":
        try:
            import flash_attn  # noqa: F401
        except ImportError as err:
            raise InputError(
                "tree.attention=flash needs the flash-attn package (pip install 'draftsmith[gpu]') "
                "and a CUDA device; use tree.attention=sdpa on CPU"
            ) from err
    return BACKENDS[backend]


def tree_implementation(model: torch.nn.Module, backend: str) -> str:
    """The transformers attention implementation `model` verifies trees with on tree backend
    `backend`: the backend's own, or, for a model loaded with eager attention (architectures
    transformers runs eagerly only: Gemma 2's softcapped logits, GPT-OSS's sinks), its eager
    attention, which adds the sdpa backend's additive mask to its scores as it is. A backend
    that cannot verify this model is an error."""
    if backend == "flash" and any(attention_windows(model.config).values()):
        # flash-attn reads the whole prefix unmasked, which a window cuts once the context
        # outgrows it
        raise InputError(
            "tree.attention=flash does not support sliding-window layers; use sdpa or flex"
        )
    name = tree_backend(backend)
    if model.config._attn_implementation != "eager":
        return name
    if backend != "sdpa":
        raise InputError(
            f"{type(model).__name__} runs eager attention, which verifies trees with the additive "
            f"mask of tree.attention=sdpa; tree.attention={backend} cannot apply to it"
        )
    return "eager"


@contextmanager
def tree_attention(model: torch.nn.Module, backend: str) -> Iterator[None]:
    """`model` on tree backend `backend` inside the block, on its own backend again after: the
    target is shared (baselines, regeneration, other decoders), and our backends are for
    unpadded batch-1 tree forwards only."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(tree_implementation(model, backend))
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


# Registered at import: the names resolve anywhere transformers looks up attention functions.
AttentionInterface.register("draftsmith_sdpa", sdpa_tree_attention)
AttentionInterface.register("draftsmith_flex", flex_tree_attention)
AttentionInterface.register("draftsmith_flash", flash_tree_attention)
for _name in ("draftsmith_sdpa", "draftsmith_flex", "draftsmith_flash"):
    ALL_MASK_ATTENTION_FUNCTIONS.register(_name, sdpa_mask)
