"""Data-pipeline throughput on the real target, measured side by side in one process:
  1. collection (forward + hooks + target top-1 + shard tensors) vs the plain target forward on
     the same length-bucketed batches (goal: ratio >= 0.9);
  2. regeneration tokens/s, batched (--regen-batch prompts per batch; finished rows leave it) vs
     batch size 1 on the same prompts (goal: >= 4x), against transformers' `generate` on the same
     batches (engine=generate) and its continuous batching (engine=continuous) with as many rows
     in flight, all with the attention backend prepare generates with.
Writes JSON + a markdown table. Usage:
  python scripts/bench_data.py [--target smollm2-135m-instruct] [--dtype bfloat16] [--rows 48]
                               [--regen-batch 32] [--regen-tokens 256] [--data sharegpt]
(--regen-batch 0 measures collection only; --data: any conversations prepare reads.)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from draftsmith.conf.schema import RegenConfig
from draftsmith.conversations import Conversation, read_conversations
from draftsmith.features import extract_features
from draftsmith.heads import TargetParts
from draftsmith.heads.eagle3 import default_aux_layers
from draftsmith.target import load_target, load_tokenizer
from draftsmith.tokenize import ConversationTokenizer, TemplateError
from draftsmith.train.collect import plan_batches
from draftsmith.train.regenerate import regenerate_chunk


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--data", default="sharegpt", help="conversations to render (data.path)")
    p.add_argument("--rows", type=int, default=48)
    p.add_argument("--tokens-per-batch", type=int, default=4096)
    p.add_argument("--regen-batch", type=int, default=32, help="0 = skip regeneration")
    # the answer length regeneration really uses: short answers would time mostly the prefill
    p.add_argument("--regen-tokens", type=int, default=RegenConfig.max_new_tokens)
    p.add_argument("--out", default="runs/bench/data")
    args = p.parse_args()
    tokenizer = load_tokenizer(args.target)
    target = load_target(args.target, args.dtype)
    renderer = ConversationTokenizer(tokenizer, max_len=512)
    conversations, _ = read_conversations(args.data, limit=max(args.rows, args.regen_batch) * 2)
    rows = []
    for conv in conversations:
        try:
            rows.append(renderer(conv).input_ids)
        except TemplateError:
            continue
    rows = rows[: args.rows]
    lengths = [len(r) for r in rows]
    order = sorted(range(len(rows)), key=lambda i: -lengths[i])
    batches = plan_batches(order, lengths, args.tokens_per_batch)
    parts = TargetParts.from_model(target)

    def padded(batch):
        width = max(lengths[i] for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for r, i in enumerate(batch):
            ids[r, : lengths[i]] = torch.tensor(rows[i])
            mask[r, : lengths[i]] = 1
        return ids, mask

    aux_layers = default_aux_layers(target.config.num_hidden_layers)  # as collect's default

    # both on right-padded rows without a padding mask, as collect runs the target
    # (features.extract_features): the difference is the hooks, top-1 labels and copies
    def plain(ids, mask) -> None:
        with torch.no_grad():
            target(input_ids=ids, use_cache=False)

    def collect(ids, mask) -> None:
        hidden, aux = extract_features(target, ids, aux_layers)
        top = parts.top_tokens(hidden)
        _ = [
            (hidden[r, :n].half(), aux[r, :n].half(), top[r, :n].int())
            for r, n in enumerate(mask.sum(1).tolist())
        ]

    times = {"plain": 0.0, "collect": 0.0}
    # interleaved batch by batch, first pass warms up; the order alternates between passes so
    # neither side always runs on caches the other one warmed
    for rep in range(3):
        for batch in batches:
            ids, mask = padded(batch)
            for name in ("plain", "collect") if rep % 2 else ("collect", "plain"):
                t0 = time.perf_counter()
                {"plain": plain, "collect": collect}[name](ids, mask)
                if rep:
                    times[name] += time.perf_counter() - t0
    tokens = sum(lengths)
    results = {
        "target": args.target,
        "dtype": args.dtype,
        "tokens": tokens,
        "plain_forward_tokens_per_second": tokens / times["plain"],
        "collect_tokens_per_second": tokens / times["collect"],
        "collect_vs_plain": times["plain"] / times["collect"],
    }
    table = (
        "| measurement | value |\n|---|---:|\n"
        f"| plain target forward (tok/s) | {results['plain_forward_tokens_per_second']:.0f} |\n"
        f"| collection incl. hooks, top-1, fp16 copies (tok/s) | "
        f"{results['collect_tokens_per_second']:.0f} |\n"
        f"| collection / plain forward | {results['collect_vs_plain']:.2f} |\n"
    )
    if args.regen_batch > 0:
        regen, batched = bench_regen(target, tokenizer, renderer, conversations, args)
        results |= {
            "regen_batch": batched,
            "regen_max_new_tokens": args.regen_tokens,
            "regen_attn_implementation": RegenConfig.attn_implementation,
            "regen_tokens_per_second_batched": regen["padded", batched],
            "regen_tokens_per_second_batch1": regen["padded", 1],
            "regen_tokens_per_second_hf_generate": regen["generate", batched],
            "regen_tokens_per_second_continuous": regen["continuous", batched],
            "regen_batched_vs_single": regen["padded", batched] / regen["padded", 1],
        }
        table += (
            f"| regeneration, batch {batched} (tok/s) | {regen['padded', batched]:.1f} |\n"
            f"| regeneration, batch 1 (tok/s) | {regen['padded', 1]:.1f} |\n"
            f"| regeneration, transformers generate(), batch {batched} (tok/s) | "
            f"{regen['generate', batched]:.1f} |\n"
            f"| regeneration, continuous batching, {batched} in flight (tok/s) | "
            f"{regen['continuous', batched]:.1f} |\n"
            f"| regeneration batched / single | {results['regen_batched_vs_single']:.2f}x |\n"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(table)
    print(table)


def bench_regen(target, tokenizer, renderer, conversations, args) -> tuple[dict, int]:
    """Regeneration tokens/s for padded batches of --regen-batch, batch 1, transformers'
    generate() and continuous batching, on the same first user turns."""
    cfg = RegenConfig(max_new_tokens=args.regen_tokens, max_prompt_len=512)
    target.set_attn_implementation(cfg.attn_implementation)  # as prepare loads it to generate
    regen = {}
    # first user turn of --regen-batch conversations: the same work for both batch sizes
    sample = [
        Conversation(c.id, [next(t for t in c.turns if t.role == "user")])
        for c in conversations
        if any(t.role == "user" for t in c.turns)
    ][: args.regen_batch]
    batched = len(sample)
    runs = (("padded", batched), ("padded", 1), ("generate", batched), ("continuous", batched))
    for engine, size in runs:
        cfg.engine, cfg.batch_size = engine, size
        t0 = time.perf_counter()
        _, produced = regenerate_chunk(target, tokenizer, renderer, sample, cfg, [])
        regen[engine, size] = produced / (time.perf_counter() - t0)
    return regen, batched


if __name__ == "__main__":
    main()
