"""Building blocks shared by two heads or more: draft attention with an explicit KV cache,
training-time-test attention, Llama MLP/RMSNorm (from transformers), Medusa's ResBlock.

The draft attention is written out (not transformers' LlamaAttention) because EAGLE-3's q/k/v
read 2H inputs, drafting attends through arbitrary tree masks, and TTT attention adds one
"diagonal" key per unrolled step; all three need the raw q/k/v.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, rotate_half

from draftsmith.heads.base import TargetInfo

__all__ = ["LlamaMLP", "LlamaRMSNorm", "DraftAttention", "KVCache", "ResBlock", "llama_config"]


def llama_config(target: TargetInfo, num_layers: int = 1) -> LlamaConfig:
    """A LlamaConfig with the target's dimensions, for transformers' MLP/RMSNorm modules."""
    return LlamaConfig(
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads,
        head_dim=target.head_dim,
        rms_norm_eps=target.rms_norm_eps,
        hidden_act=target.hidden_act,
        max_position_embeddings=target.max_position_embeddings,
        rope_theta=target.rope_theta,
    )


@functools.lru_cache(maxsize=8)
def _inverse_frequencies(d: int, theta: float, device: torch.device) -> torch.Tensor:
    """[d/2] fp32 RoPE frequencies, computed once per (head_dim, theta, device): a module buffer
    would be cast by the head's `.to(bf16)`, and recomputing them took ~8 ops per call."""
    return 1.0 / (theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))


def rope_tables(
    positions: torch.Tensor, d: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, N, d] at `positions` [B, N] (Llama's rotate_half layout), in `dtype`;
    built once per attention call and shared by its queries and keys."""
    angles = positions.to(torch.float32)[..., None] * _inverse_frequencies(
        d, theta, positions.device
    )
    emb = torch.cat([angles, angles], dim=-1)[:, None]  # [B, 1, N, d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, nh, N, d] with `rope_tables`' cos/sin."""
    return x * cos + rotate_half(x) * sin


@dataclass
class KVCache:
    """Per-layer keys/values of a draft head: [B, n_kv, S, d] each (post-rotary keys)."""

    keys: list[torch.Tensor | None] = field(default_factory=list)
    values: list[torch.Tensor | None] = field(default_factory=list)

    def length(self) -> int:
        return 0 if not self.keys or self.keys[0] is None else self.keys[0].shape[2]

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self.keys) <= layer:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def crop(self, length: int) -> None:
        """Drop every entry at or after `length` (discard a drafted tree)."""
        self.keys = [k[:, :, :length] if k is not None else None for k in self.keys]
        self.values = [v[:, :, :length] if v is not None else None for v in self.values]


class DraftAttention(nn.Module):
    """Llama attention whose q/k/v read `in_features` (H, or 2H for EAGLE-3), with GQA and RoPE."""

    def __init__(self, target: TargetInfo, in_features: int) -> None:
        super().__init__()
        self.num_heads = target.num_attention_heads
        self.num_kv = target.num_key_value_heads
        self.head_dim = target.head_dim
        self.theta = target.rope_theta
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.num_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.num_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, target.hidden_size, bias=False)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x [B, N, in] -> q [B, nh, N, d], k/v [B, n_kv, N, d] with RoPE at `positions` [B, N]."""
        B, N, _ = x.shape
        q = self.q_proj(x).view(B, N, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, N, self.num_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, N, self.num_kv, self.head_dim).transpose(1, 2)
        cos, sin = rope_tables(positions, self.head_dim, self.theta, q.dtype)
        return rope(q, cos, sin), rope(k, cos, sin), v

    def _expand(self, t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(self.num_heads // self.num_kv, dim=1)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """[B, nh, N, d] -> [B, N, H]."""
        B, _, N, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, N, self.num_heads * self.head_dim))

    def forward(
        self,
        x: torch.Tensor,  # [B, N, in]
        positions: torch.Tensor,  # [B, N]
        cache: KVCache | None = None,
        layer: int = 0,
        mask: torch.Tensor | None = None,  # [N, S_total] bool, True = may attend; None = causal
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        q, k, v = self.project(x, positions)
        new_kv = (k, v)
        if cache is not None:
            k, v = cache.append(layer, k, v)
        # without gradients (drafting, evaluation) grouped KV heads are read in place: the same
        # output as copying each KV head per query head, ~30 us less per drafting step. Training
        # keeps the copies, whose backward sums the groups' gradients in the order it always did
        gqa = self.num_kv != self.num_heads and not torch.is_grad_enabled()
        if not gqa:
            k, v = self._expand(k), self._expand(v)
        if mask is None:
            # plain causal over the new block, all cached entries visible
            N, S = q.shape[2], k.shape[2]
            mask = torch.ones(N, S, dtype=torch.bool, device=x.device).tril(S - N)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.out(o), new_kv

    def ttt_forward(
        self,
        x: torch.Tensor,  # [B, T, in] the inputs of unrolled step i (one per anchor position)
        positions: torch.Tensor,  # [B, T] positions of these inputs (anchor + i)
        base_kv: tuple[torch.Tensor, torch.Tensor],  # step-0 k/v [B, n_kv, T, d]
        diag_kv: list[tuple[torch.Tensor, torch.Tensor]],  # earlier steps' k/v, same shapes
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Training-time-test attention at unrolled step i >= 1.

        The query of anchor t sees the step-0 keys of positions <= t (causal) plus, from each
        unrolled step j <= i, the one key of the same anchor t: exactly what drafting i tokens
        ahead from position t sees at inference.
        """
        q, k_i, v_i = self.project(x, positions)
        diag = [*diag_kv, (k_i, v_i)]
        k0, v0 = self._expand(base_kv[0]), self._expand(base_kv[1])
        T = q.shape[2]
        scale = self.head_dim**-0.5
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        scores0 = (q @ k0.transpose(-1, -2)) * scale  # [B, nh, T, T]
        scores0 = scores0.masked_fill(~causal, float("-inf"))
        ks = torch.stack([self._expand(k) for k, _ in diag], dim=-2)  # [B, nh, T, i+1, d]
        vs = torch.stack([self._expand(v) for _, v in diag], dim=-2)
        scores_d = (q[..., None, :] * ks).sum(-1) * scale  # [B, nh, T, i+1]
        probs = torch.softmax(torch.cat([scores0, scores_d], dim=-1).float(), dim=-1).to(q.dtype)
        o = probs[..., :T] @ v0 + (probs[..., T:, None] * vs).sum(-2)  # [B, nh, T, d]
        return self.out(o), (k_i, v_i)


class ResBlock(nn.Module):
    """Medusa's residual block: x + SiLU(Linear(x)), zero-initialised so a fresh head = identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class DraftDecoderLayer(nn.Module):
    """One Llama decoder layer of a draft head.

    `fuse_token=True` is EAGLE-3's layer: attention reads `input_layernorm(embeds) ++
    hidden_norm(hidden)` (2H) and the residual stream is the un-normed hidden. Otherwise it is a
    plain Llama layer over the hidden stream; `input_norm=False` drops the input norm, as
    EAGLE-1's first layer does (its input is already a normalised feature).
    """

    def __init__(self, target: TargetInfo, fuse_token: bool = False, input_norm: bool = True):
        super().__init__()
        H = target.hidden_size
        self.fuse_token = fuse_token
        if fuse_token or input_norm:
            self.input_layernorm = LlamaRMSNorm(H, eps=target.rms_norm_eps)
        if fuse_token:
            self.hidden_norm = LlamaRMSNorm(H, eps=target.rms_norm_eps)
        self.self_attn = DraftAttention(target, 2 * H if fuse_token else H)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=target.rms_norm_eps)
        self.mlp = LlamaMLP(llama_config(target))

    def attention_input(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        if self.fuse_token:
            return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        return self.input_layernorm(hidden) if hasattr(self, "input_layernorm") else hidden

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        hidden = hidden + attn_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward(self, hidden, embeds, positions, cache=None, layer=0, mask=None):
        out, kv = self.self_attn(
            self.attention_input(hidden, embeds), positions, cache, layer, mask
        )
        return self.finish(hidden, out), kv

    def ttt_forward(self, hidden, embeds, positions, base_kv, diag_kv):
        x = self.attention_input(hidden, embeds)
        out, kv = self.self_attn.ttt_forward(x, positions, base_kv, diag_kv)
        return self.finish(hidden, out), kv
