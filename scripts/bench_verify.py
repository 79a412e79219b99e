"""What one verification forward of the target costs per tree size, next to a vanilla decoding
step, side by side in one process: ms per forward of N tree tokens (chain mask, positions
prefix + depth, the decoder's tree-attention backend) after a `--context`-token prefix, and of
one token through the model's own attention as `generate` runs it, median over rounds
interleaved across the sizes (the order rotates per round). The cache is cut back to the prefix
after every forward, so each one sees the same context. This is the cost side of the tree-size
choice: a tree of N nodes pays off when tau grows faster than its forward's cost. Each forward
runs on two copies of the target: `plain` as transformers loads it, `packed` with its bf16 or
fp32 linear weights packed for oneDNN (draftsmith.packed, what eval decodes with; the same as plain
where nothing can be packed). Writes JSON + a markdown table. Usage:
  python scripts/bench_verify.py [--sizes 1 4 8 12 16 20 24] [--context 300] [--rounds 20]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import DynamicCache

from draftsmith.inference.attention import tree_attention
from draftsmith.inference.costs import forward_ms
from draftsmith.packed import pack_linears
from draftsmith.target import cache_kwarg, load_target, native_dtype


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8, 12, 16, 20, 24])
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--out", default="runs/bench/verify")
    args = p.parse_args()
    dtype = native_dtype("cpu") if args.dtype == "auto" else args.dtype  # as dtype=auto does
    targets = {"plain": load_target(args.target, dtype), "packed": load_target(args.target, dtype)}
    packed = pack_linears(targets["packed"])
    config = targets["plain"].config
    gen = torch.Generator().manual_seed(0)
    high = min(40000, config.vocab_size)  # any ids: the cost does not depend on them
    prefix = torch.randint(0, high, (1, args.context), generator=gen)  # [1, S]
    caches = {mode: DynamicCache(config=config) for mode in targets}
    forwards = ["vanilla", *(f"tree {n}" for n in args.sizes)]
    methods = [(mode, f) for f in forwards for mode in targets]
    times: dict[tuple[str, str], list[float]] = {m: [] for m in methods}
    with torch.no_grad():
        for mode, target in targets.items():
            kv = {cache_kwarg(target): caches[mode]}
            target(input_ids=prefix, **kv, use_cache=True, logits_to_keep=1)
        for r in range(args.rounds + 1):  # round 0 is an untimed warm-up
            for mode, f in methods[r % len(methods) :] + methods[: r % len(methods)]:
                target, cache = targets[mode], caches[mode]
                if f == "vanilla":
                    ms = forward_ms(target, cache, args.context, 1)
                else:
                    with tree_attention(target, "sdpa"):
                        ms = forward_ms(target, cache, args.context, int(f.split()[1]), "sdpa")
                if r:
                    times[mode, f].append(ms)
    median = {m: sorted(t)[len(t) // 2] for m, t in times.items()}
    base = median["plain", "vanilla"]
    table = (
        f"Target forward after {args.context} cached tokens, {dtype}, median of {args.rounds}; "
        f"packed: {packed} linear layers\n\n"
        "| forward | plain ms | packed ms | packed / plain | plain vs a plain vanilla step "
        "| packed vs a packed vanilla step |\n|---|---:|---:|---:|---:|---:|\n"
    )
    for f in forwards:
        plain, fast = median["plain", f], median["packed", f]
        table += (
            f"| {f} | {plain:.1f} | {fast:.1f} | {fast / plain:.2f}x | {plain / base:.2f}x "
            f"| {fast / median['packed', 'vanilla']:.2f}x |\n"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "args": vars(args),
        "dtype": dtype,
        "packed_linears": packed,
        "median_ms": {f"{mode} {f}": ms for (mode, f), ms in median.items()},
        "ms": {f"{mode} {f}": ms for (mode, f), ms in times.items()},
    }
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "results.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
