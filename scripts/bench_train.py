"""Head-training throughput on collected shards and its FLOP utilisation, in one process:
achieved FLOP/s of the training step (counted from the head's matmuls) divided by this machine's
dense matmul FLOP/s measured in the same run and dtype, the share of CPU time spent in the
kernel and the page faults per step (freshly mapped memory is faulted in there;
--glibc-default measures training without draftsmith.allocator). Usage:
  python scripts/bench_train.py --collect runs/smollm2_eagle3/collect [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from draftsmith.allocator import reuse_freed_memory
from draftsmith.heads import TargetInfo, TargetParts, base, build_head
from draftsmith.target import load_target
from draftsmith.train.data import ShardRows, collate

HEADS = {
    "eagle1": {"name": "eagle1"},
    "eagle3": {"name": "eagle3", "draft_vocab_size": 4096, "ttt_steps": 5},
    "medusa": {"name": "medusa", "num_heads": 4},
    "hydra": {"name": "hydra", "num_heads": 4},
}


class FlopCount(TorchDispatchMode):
    """FLOPs of every aten op torch's flop counter knows. Not FlopCounterMode: its module
    tracker's backward hooks fail inside the autograd.grad the frozen-logits soft CE calls."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._overloadpacket in flop_registry:
            self.total += flop_registry[func._overloadpacket](*args, **kwargs, out_val=out)
        return out


def matmul_flops(dtype: torch.dtype, n: int = 2048) -> float:
    a, b = torch.randn(n, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
    for _ in range(3):
        a @ b
    t0 = time.perf_counter()
    reps = 30
    for _ in range(reps):
        a @ b
    return 2 * n * 576 * 1536 * reps / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--collect", required=True)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS))
    p.add_argument(
        "--block-rows",
        type=int,
        default=None,
        help="rows per vocab-sized block at the target's vocab (default: "
        "heads.base.rows_per_block), to measure what the block size costs",
    )
    p.add_argument(
        "--glibc-default",
        action="store_true",
        help="leave glibc's malloc as it is (big blocks mapped and faulted in on every use) "
        "instead of draftsmith.allocator.reuse_freed_memory(), as training runs",
    )
    p.add_argument("--out", default="runs/bench/train")
    args = p.parse_args()
    reused = False if args.glibc_default else reuse_freed_memory()
    target = load_target(args.target, args.dtype)
    info = TargetInfo.from_hf_config(target.config, args.target)
    if args.block_rows:
        base.BLOCK_ELEMENTS = args.block_rows * info.vocab_size
    rows = ShardRows(args.collect, "train", 512)
    batch = collate([rows[i] for i in range(args.batch)], torch.float32)
    tokens = int(batch.valid().sum())
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    peak = matmul_flops(torch.bfloat16 if args.dtype == "bfloat16" else torch.float32)
    results = {
        "dtype": args.dtype,
        "tokens_per_batch": tokens,
        "matmul_flops_per_second": peak,
        "reuse_freed_memory": reused,
    }
    for name in args.heads:
        config = HEADS[name]
        torch.manual_seed(0)
        head = build_head(dict(config), info).bind(TargetParts.from_model(target))
        optimizer = torch.optim.AdamW(head.parameters(), lr=1e-4)

        def step(head=head, optimizer=optimizer) -> None:
            with autocast:
                loss, _ = head.loss(batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        with FlopCount() as counter:
            step()
        flops = counter.total
        t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        for _ in range(args.steps):
            step()
        seconds = (time.perf_counter() - t0) / args.steps
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        user, kernel = r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime
        results[name] = {
            "kernel_share": kernel / (user + kernel),
            "page_faults_per_step": (r1.ru_minflt - r0.ru_minflt) / args.steps,
            "tokens_per_second": tokens / seconds,
            "step_flops": flops,
            "achieved_flops_per_second": flops / seconds,
            "utilisation": flops / seconds / peak,
        }
        print(name, json.dumps(results[name]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    table = (
        "| head | tokens/s | achieved GFLOP/s | matmul peak GFLOP/s | utilisation | kernel time "
        "| page faults/step |\n"
    )
    table += "|---|---:|---:|---:|---:|---:|---:|\n"
    for name in args.heads:
        r = results[name]
        achieved = r["achieved_flops_per_second"] / 1e9
        table += (
            f"| {name} | {r['tokens_per_second']:.0f} | {achieved:.0f}"
            f" | {peak / 1e9:.0f} | {r['utilisation']:.2f} | {r['kernel_share']:.0%}"
            f" | {r['page_faults_per_step']:.0f} |\n"
        )
    (out / "results.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
