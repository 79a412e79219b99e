"""Drafting cost of an autoregressive head (EAGLE-1/3), eager, packed and `torch.compile`, side by
side in one process: ms per step of one dynamic draft tree plus one commit of 1-3 accepted
tokens, the drafter's whole share of a speculative step, median over rounds interleaved across
the modes (each mode on its own copy of the head):
  eager  - SpecDecoder on the head as loaded;
  packed - its linear weights packed for oneDNN (draftsmith.packed), as eval decodes (the
           target stays unpacked here: EAGLE-1's drafts through its lm_head would gain too);
  layer  - every draft decoder layer compiled whole (dynamic shapes; the KV cache append inside);
  parts  - the layers' pre/post-attention pieces and draft_logits compiled separately.
Compiling happens in an untimed warm-up. Writes JSON + a markdown table. Usage:
  python scripts/bench_draft.py --head runs/quick/train/head [--tree-nodes 16] [--steps 20]
                               [--rounds 15] [--modes packed layer parts]  (eager always)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from draftsmith.features import FeatureCapture
from draftsmith.heads import TargetInfo, TargetParts, load_head
from draftsmith.inference.decoder import SpecDecoder
from draftsmith.inference.tree import TreeSpec
from draftsmith.packed import pack_linears
from draftsmith.target import load_target, target_name, torch_dtype

MODES = ("eager", "packed", "layer", "parts")


def compiled(head, mode: str):
    if mode == "packed":
        pack_linears(head.requires_grad_(False))
    elif mode == "layer":
        for layer in head.layers:
            layer.compile(dynamic=True)
    elif mode == "parts":
        for layer in head.layers:
            layer.attention_input = torch.compile(layer.attention_input, dynamic=True)
            layer.self_attn.project = torch.compile(layer.self_attn.project, dynamic=True)
            layer.finish = torch.compile(layer.finish, dynamic=True)
        head.draft_logits = torch.compile(head.draft_logits, dynamic=True)
    return head


def drafting_round(decoder: SpecDecoder, hidden, aux, prompt, start: int, steps: int) -> float:
    """Commit a `start`-token prefix, then `steps` of draft tree + commit of 1-3 tokens; returns
    seconds per step. hidden [1, S, H], aux [1, S, kH] are the target's features of `prompt`."""
    drafter = decoder.drafter
    drafter.reset()
    drafter.commit(hidden[:, :start], aux[:, :start], prompt[:, 1 : start + 1])
    t0 = time.perf_counter()
    for s in range(steps):
        decoder.build_tree(5)
        a, m = start + 3 * s, 1 + s % 3
        drafter.commit(hidden[:, a : a + m], aux[:, a : a + m], prompt[:, a + 1 : a + 1 + m])
    return (time.perf_counter() - t0) / steps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--head", default="runs/quick/train/head")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tree-nodes", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--out", default="runs/bench/draft")
    args = p.parse_args()
    modes = ["eager", *(m for m in args.modes if m != "eager")]  # the others' ratios are to it
    target = load_target(args.target, args.dtype)
    info = TargetInfo.from_hf_config(target.config, target_name(args.target))
    spec = TreeSpec(kind="dynamic", depth=5, top_k=4, total_tokens=args.tree_nodes)
    gen = torch.Generator().manual_seed(0)
    # ids past the specials and below the rare tail of a large vocabulary (a tiny one: all)
    high = min(40000, info.vocab_size)
    prompt = torch.randint(min(100, high // 2), high, (1, 300), generator=gen)  # [1, 300]
    parts = TargetParts.from_model(target)
    decoders = {}
    for mode in modes:
        head = load_head(args.head, info).to(dtype=torch_dtype(args.dtype))
        decoders[mode] = SpecDecoder(target, compiled(head.bind(parts).eval(), mode), spec)
    with torch.no_grad(), FeatureCapture(target, decoders["eager"].aux_layers) as capture:
        target(input_ids=prompt, use_cache=False, logits_to_keep=1)
        hidden, aux = capture.hidden, capture.aux  # [1, 300, H], [1, 300, kH]
    results, times = {}, {mode: [] for mode in modes}
    with torch.no_grad():
        for mode, decoder in decoders.items():  # untimed warm-up: compiles every shape pattern
            t0 = time.perf_counter()
            for start in (150, 180):
                drafting_round(decoder, hidden, aux, prompt, start, args.steps)
            results[mode] = {"warmup_seconds": time.perf_counter() - t0}
        # interleaved rounds, so no mode always runs first; prefixes 100-180 tokens
        for r in range(args.rounds):
            for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                start = 100 + 20 * (r % 5)
                step = drafting_round(decoders[mode], hidden, aux, prompt, start, args.steps)
                times[mode].append(step * 1e3)
    for mode in modes:
        results[mode]["ms_per_step"] = sorted(times[mode])[len(times[mode]) // 2]
    base = results["eager"]["ms_per_step"]
    table = "| mode | ms per draft + commit step | vs eager | warm-up s |\n|---|---:|---:|---:|\n"
    for mode, r in results.items():
        ratio = base / r["ms_per_step"]
        table += f"| {mode} | {r['ms_per_step']:.2f} | {ratio:.2f}x | {r['warmup_seconds']:.1f} |\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), **results}, indent=2))
    (out / "results.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
