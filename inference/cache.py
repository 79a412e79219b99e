"""KV-cache compaction after verification: keep the accepted tree path, drop the rest.

The target's transformers cache holds the prefix followed by every tree node; the accepted
nodes are moved right behind the prefix and the cache is cut there, so accepted tokens are never
recomputed and rejected ones never seen again.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def keep_accepted(cache: DynamicCache, prefix: int, path: torch.Tensor) -> None:
    """Cache [prefix | tree nodes] -> [prefix | tree nodes at `path`] in place, every layer.
    `path` on the CPU (read here), whatever device the cache is on."""
    end = prefix + path.numel()
    # the path is ascending, so it is the tree's first nodes (the root alone, or the root and
    # its first child: half the steps on MT-bench) exactly when it ends at index len - 1: in place
    in_place = int(path[-1]) == path.numel() - 1
    keep = (prefix + path).to(cache.layers[0].keys.device)  # [A]
    for layer in cache.layers:
        if getattr(layer, "sliding_window", None):
            raise ValueError("tree verification does not support sliding-window attention layers")
        if not in_place:
            # gather first (the source and destination ranges overlap), then write and cut: the
            # next forward's torch.cat copies the cache anyway, so no second full copy here
            layer.keys[:, :, prefix:end] = layer.keys.index_select(2, keep)
            layer.values[:, :, prefix:end] = layer.values.index_select(2, keep)
        layer.keys = layer.keys[:, :, :end]
        layer.values = layer.values[:, :, :end]
