"""Benchmark reports: results JSON, a markdown table and PNG plots, plus a sweep summary that
collects every result under one eval folder (tau and speedup vs tree size)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from draftsmith.files import write_text_atomic  # noqa: E402
from draftsmith.inference.decoder import STEP_PARTS  # noqa: E402
from draftsmith.inference.tree import TreeSpec, branch_label  # noqa: E402


def benchmark_label(e: dict) -> str:
    """A results' `eval` settings -> the benchmark's name, marked where every turn was decoded."""
    return e["benchmark"] + (" (all turns)" if e.get("turns") == "all" else "")


def results_markdown(r: dict) -> str:
    rows = [
        "| method | tokens | seconds | tokens/s | speedup of speculative |",
        "|---|---:|---:|---:|---:|",
    ]
    for method, tokens in r["tokens"].items():
        speedup = "" if method == "speculative" else f"{r['speedup'][f'vs_{method}']:.2f}x"
        rows.append(
            f"| {method} | {tokens} | {r['seconds'][method]:.1f} | "
            f"{r['tokens_per_second'][method]:.1f} | {speedup} |"
        )
    depth = ", ".join(f"{a:.2f}" for a in r["depth_acceptance"])
    m = r["mismatch"]
    vocab = ""  # what the head drafted over, where it was not the target's whole vocabulary
    if own := r["head"].get("draft_vocab_size"):  # results since session 60 record it
        vocab = f" (its own draft vocabulary of {own} tokens)"
    elif cut := r.get("draft_vocab_size"):
        vocab = f" (drafting over the {cut} most frequent answer tokens)"
    lines = [
        f"**{r['head']['name']}**{vocab} on {r['target']} — {benchmark_label(r['eval'])}, "
        f"{r['prompts']} prompts, {r['eval']['max_new_tokens']} new tokens, "
        f"T={r['eval']['temperature']}, {r['machine']['dtype']}, tree {r['tree']['kind']} "
        f"(depth {r['tree']['depth']}, top-k {r['tree']['top_k']}, "
        + (
            f"adaptive, up to {r['tree']['total_tokens']} nodes"
            if r["tree"].get("adaptive")
            else f"{r['tree']['total_tokens']} nodes"
        )
        + _branch_words(r["tree"])
        + ")",
        "",
        f"tau = **{r['tau']:.2f}** over {r['verify_forwards']} verification forwards"
        + ("" if (out := output_tau(r)) is None else f" ({out:.2f} output tokens per forward)")
        + f"; acceptance by depth: {depth}",
        "",
    ]
    if skipped := r.get("skipped"):  # rows of the benchmark that were not prompts
        lines += [f"Benchmark rows skipped: {skipped}", ""]
    if by := r.get("by_category"):  # older results and benchmarks without categories: none
        parts = ", ".join(f"{name} {c['tau']:.2f}" for name, c in by.items())
        lines += [f"tau by category: {parts}", ""]
    lines += [
        *rows,
        "",
    ]
    if step := step_milliseconds(r):
        lines += [step, ""]
    if m["checked"]:
        lines.append(
            f"Greedy mismatches against vanilla: {m['prompts']} of "
            f"{m.get('compared', r['prompts'])} prompts decoded from the same context."
            + divergence_summary(m["details"])
        )
    return "\n".join(lines) + "\n"


def output_tau(r: dict) -> float | None:
    """A results.json's output tokens per verification forward (tau less the last step's
    tokens past EOS or max_new_tokens); from its prompts' records where it predates the key
    (session 94), None where it predates those."""
    if "tau_output" in r:
        return r["tau_output"]
    if not r.get("per_prompt"):
        return None
    forwards = sum(p["forwards"] for p in r["per_prompt"])
    # each prompt's `tokens` include the one its prefill picked, which no verification produced
    return sum(p["tokens"] - 1 for p in r["per_prompt"]) / max(forwards, 1)


def step_milliseconds(r: dict) -> str:
    """Where a speculative step's time goes, in ms per verification forward ("" for results
    written before the verify time was split into its parts)."""
    if "forward_seconds" not in r:
        return ""
    parts = (*STEP_PARTS, "verify")
    ms = {k: 1000 * r[f"{k}_seconds"] / max(r["verify_forwards"], 1) for k in parts}
    nodes = f"{r['nodes_per_forward']:.1f} nodes, " if "nodes_per_forward" in r else ""
    return (
        f"Per step: {nodes}draft {ms['draft']:.1f} ms, verify {ms['verify']:.1f} ms "
        f"(target forward {ms['forward']:.1f}, accept + cache {ms['accept']:.1f}, "
        f"head commit {ms['commit']:.1f})."
    )


def divergence_summary(details: list[dict]) -> str:
    """Where greedy mismatches start: the largest top-2 logit gap there (small = a near-tie the
    multi-token forward rounds the other way), and any output that ran on past vanilla's end
    (no gap: not numerics)."""
    gaps = [d["top2_gap"] for d in details if d["top2_gap"] is not None]
    text = f" Largest top-2 logit gap where one starts: {max(gaps):.3g}." if gaps else ""
    if past := len(details) - len(gaps):
        text += f" {past} ran on past the end of vanilla's output."
    return text


def write_report(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "results.json", json.dumps(results, indent=2))
    write_text_atomic(out / "results.md", results_markdown(results))
    depths = results["depth_acceptance"]
    if depths:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        # past the depth the head drafts to only a grafted prompt-lookup chain drafts
        head_depth = TreeSpec(**results["tree"]).drafted_depth
        xs = range(1, len(depths) + 1)
        bars = ax.bar(xs, depths, color=["#4c72b0" if d <= head_depth else "#dd8452" for d in xs])
        if len(depths) > head_depth:
            labels = ["head and lookup", "prompt-lookup branch only"]
            ax.legend([bars[0], bars[head_depth]], labels, fontsize=7)
        ax.set_xlabel("draft depth")
        ax.set_ylabel("P(accepted | offered)")
        ax.set_ylim(0, 1)
        ax.set_title(f"{results['head']['name']}: tau {results['tau']:.2f}")
        fig.tight_layout()
        fig.savefig(out / "acceptance_by_depth.png", dpi=120)
        plt.close(fig)
    if by := results.get("by_category"):
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.bar(list(by), [c["tau"] for c in by.values()], color="#55a868")
        ax.axhline(results["tau"], color="black", linewidth=1, linestyle="--", label="all")
        ax.set_ylabel("tau")
        ax.set_title(f"{results['head']['name']} on {results['eval']['benchmark']}, by category")
        ax.tick_params(axis="x", labelrotation=30)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "tau_by_category.png", dpi=120)
        plt.close(fig)


def write_sweep_summary(folder: Path) -> None:
    """Table + plot over every results.json below `folder` (e.g. a tree-size sweep)."""
    runs = []
    for path in sorted(folder.glob("*/results.json")):
        runs.append((path.parent.name, json.loads(path.read_text())))
    if not runs:
        return
    lines = [
        "| run | tree | nodes | T | tau | speedup vs vanilla | speedup vs lookup |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in runs:
        # "-": that baseline was not run (e.g. a speculative-only eval)
        s = {k: f"{v:.2f}x" for k, v in r["speedup"].items()}
        lines.append(
            f"| {name} | {_kind(r['tree'])} d{r['tree']['depth']} k{r['tree']['top_k']} | "
            f"{r['tree']['total_tokens']} | {r['eval']['temperature']} | {r['tau']:.2f} | "
            f"{s.get('vs_vanilla', '-')} | {s.get('vs_lookup', '-')} |"
        )
    write_text_atomic(folder / "summary.md", "\n".join(lines) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for kind in sorted({_kind(r["tree"]) for _, r in runs}):
        pts = sorted(
            (
                (r["tree"]["total_tokens"], r["tau"], r["speedup"].get("vs_vanilla"))
                for _, r in runs
                if _kind(r["tree"]) == kind
            ),
            key=lambda p: p[0],
        )
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=kind)
        timed = [p for p in pts if p[2] is not None]
        axes[1].plot([p[0] for p in timed], [p[2] for p in timed], "o-", label=kind)
    axes[0].set_ylabel("tau")
    axes[1].set_ylabel("speedup vs vanilla")
    for ax in axes:
        ax.set_xlabel("tree nodes per verification")
        ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "tree_sweep.png", dpi=120)
    plt.close(fig)


def _branch_words(tree: dict) -> str:
    """The tree's prompt-lookup branch in results.md's prose, or nothing."""
    if tree.get("lookup_by_match"):
        lengths = "/".join(map(str, tree["lookup_by_match"]))
        return f", prompt-lookup branch of {lengths} tokens by match length"
    return f", prompt-lookup branch of {tree['lookup']}" if tree.get("lookup") else ""


def _kind(tree: dict) -> str:
    """The tree kind, with its prompt-lookup branch if any (older results have no such key)."""
    return "+".join(filter(None, (tree["kind"], branch_label(tree))))
