"""Frozen bf16 and fp32 linear layers, their weights packed once for oneDNN (CPU decoding speed).

On CPU, torch's bf16 `F.linear` runs oneDNN's matmul on the weight in its plain layout, and the
kernel copies it into its blocked bf16 layout inside every call. Decoding multiplies a few rows by
every weight of the model, so that copy is a large share of each call. Packing the weights once
(`_reorder_linear_weight`, as torch.compile's freezing passes do) and running oneDNN's inner
product on them gives the same bits in less time: on SmolLM2's layer shapes (Zen 4, 2 cores)
~26% less at 1 row and ~35% less at 16, none at collection's 4096 rows (`scripts/bench_verify.py`
measures whole forwards both ways).
In fp32 the plain `F.linear` runs MKL's sgemm, which repacks the weight for every call of more
than one row: on an AVX2-only CPU (session 48) a SmolLM2 forward of 2 tokens cost 101-114 ms
against 63-74 for one (packed: 78 against 61). oneDNN's fp32 inner product on a packed weight
is not bit-identical to MKL's sgemm (it differs within float rounding, as sgemm's own one-row and
many-row kernels do), so in fp32 a packed model is a different-kernel copy of the target; every
decoding method of an eval runs the same packed model, so speculative output is still compared
with that model's own greedy output.
The plain weight stays in place (tied embeddings, weight indexing and state dicts still read
it), so a packed model holds its linear weights twice: a model whose copies would take more than
half the memory still available is left plain (slower, but not swapping or killed).
"""

from __future__ import annotations

import psutil
import torch
from torch import nn


class PackedLinear(nn.Linear):
    """nn.Linear whose forward reads a oneDNN-packed copy of its frozen weight (`packed`)."""

    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def packing_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this torch build's oneDNN has `dtype` kernels on this CPU (else nothing of that
    dtype is packed): fp32 wherever oneDNN is built in, bf16 where the CPU has bf16 support."""
    if not torch.backends.mkldnn.is_available() or dtype not in (torch.bfloat16, torch.float32):
        return False
    return dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def can_pack(module: nn.Module) -> bool:
    """A frozen bf16 or fp32 nn.Linear on CPU whose dtype oneDNN has kernels for."""
    return (
        type(module) is nn.Linear
        and module.weight.device.type == "cpu"
        and not module.weight.requires_grad
        and packing_available(module.weight.dtype)
    )


def pack_linears(model: nn.Module) -> int:
    """Turn every packable nn.Linear of `model` into a PackedLinear in place (same module object,
    same parameters; in bf16 the same outputs bit for bit); returns how many. Anything else (GPU,
    trainable weights, other dtypes, bf16 without oneDNN bf16) is left as it is. Pack after the
    last `.to()`: the packed copies do not follow the module to another device or dtype."""
    linears = [m for m in model.modules() if can_pack(m)]
    copies = sum(m.weight.nbytes for m in linears)
    available = psutil.virtual_memory().available
    if copies > available // 2:
        print(
            f"linear weights left unpacked: their packed copies ({copies / 2**30:.1f} GiB) would "
            f"take more than half the memory available ({available / 2**30:.1f} GiB)"
        )
        return 0
    for module in linears:
        # the batch size is only a hint for oneDNN's choice of layout: 1 or 16 measured alike
        module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), 1)
        module.__class__ = PackedLinear
    return len(linears)
