"""Hydra heads: Medusa heads made sequentially dependent.

Head k sees the target's post-norm state at anchor t *and* the embeddings of the tokens on the
candidate path before it (t+1, the target's next token, then the k tokens drafted by heads
0..k-1), so every tree node is scored given its own ancestors. Head k = Linear((k+2)H -> H) over
[feature, embeds...] followed by L residual blocks and the (shared or own) lm_head; it predicts
token t+k+2 like Medusa head k. Training is teacher-forced on the real tokens.

With `aux_layers`, the feature also reads EAGLE-3's low/mid/high target layers: feature =
norm(h) + fc(concat(rms(aux_1), .., rms(aux_k))), each layer RMS-normalised first (mid-stack
residual streams can run far larger than the post-norm state) and fc zero-initialised, so a
fresh head starts as the plain Hydra head it extends.

With `prefix_attention` (Hydra++'s prefix attention), one Llama decoder layer runs over the
sequence of features before the heads, so the anchor also reads the context before it; at
inference the layer keeps its own KV cache, fed the accepted positions' features at each commit.
Its output projections (attention o_proj, MLP down_proj) are zero-initialised: a fresh layer is
the identity and a fresh head is again the plain one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import InputError
from draftsmith.heads.base import TargetInfo
from draftsmith.heads.blocks import DraftDecoderLayer, KVCache, ResBlock
from draftsmith.heads.eagle3 import check_aux_layers
from draftsmith.heads.medusa import MedusaConfig, MedusaHead


@dataclass
class HydraConfig(MedusaConfig):
    name: str = "hydra"
    # target layers also fused into the feature, in EAGLE-3's convention ("input of layer k");
    # empty = the last layer's post-norm state only, as the paper
    aux_layers: list[int] = field(default_factory=list)
    # Hydra++'s prefix attention: a decoder layer over the features of all positions so far
    prefix_attention: bool = False


class HydraHead(MedusaHead):
    name = "hydra"
    config_class = HydraConfig
    uses_path = True

    def __init__(self, config: HydraConfig, target: TargetInfo) -> None:
        check_aux_layers(config.aux_layers, target.num_layers)
        super().__init__(config, target)
        H = target.hidden_size
        self.prefix = nn.ModuleList(
            [nn.Linear((k + 2) * H, H, bias=False) for k in range(config.num_heads)]
        )
        self.blocks = nn.ModuleList(
            [
                nn.Sequential(*[ResBlock(H) for _ in range(config.num_layers)])
                for _ in range(config.num_heads)
            ]
        )
        if config.aux_layers:  # made last: the other weights draw as a plain head's would
            self.fc = nn.Linear(len(config.aux_layers) * H, H, bias=False)
            nn.init.zeros_(self.fc.weight)
        if config.prefix_attention:  # also last, for the same reason
            self.context = DraftDecoderLayer(target)
            nn.init.zeros_(self.context.self_attn.o_proj.weight)
            nn.init.zeros_(self.context.mlp.down_proj.weight)

    def feature_input(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        feature = self.parts.norm(hidden)  # [.., H]
        if not self.config.aux_layers:
            return feature
        if aux is None:
            raise InputError(
                f"this hydra head fuses target layers {self.config.aux_layers}: it needs their "
                "features (collect with the same aux_layers)"
            )
        layers = aux.unflatten(-1, (len(self.config.aux_layers), -1))  # [.., k, H]
        normed = F.rms_norm(layers, layers.shape[-1:], eps=self.target.rms_norm_eps)
        return feature + self.fc(normed.flatten(-2))

    def new_cache(self) -> KVCache | None:
        return KVCache() if self.config.prefix_attention else None

    def sequence_features(
        self, hidden: torch.Tensor, aux: torch.Tensor | None, cache: KVCache | None = None
    ) -> torch.Tensor:
        feature = self.feature_input(hidden, aux)  # [B, N, H]
        if not self.config.prefix_attention:
            return feature
        B, N, _ = feature.shape
        start = 0 if cache is None else cache.length()
        positions = torch.arange(start, start + N, device=feature.device).expand(B, N)
        out, _ = self.context(feature, None, positions, cache)  # causal over cache + block
        return out

    def head_states(
        self, k: int, feature: torch.Tensor, path_tokens: torch.Tensor | None
    ) -> torch.Tensor:
        if path_tokens is None or path_tokens.shape[-1] != k + 1:
            raise ValueError(f"hydra head {k} needs the {k + 1} path tokens before it")
        embeds = self.parts.embed_tokens(path_tokens).flatten(-2)  # [N, (k+1) H]
        return self.blocks[k](self.prefix[k](torch.cat([feature, embeds], dim=-1)))
