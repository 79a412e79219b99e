"""Where a head's first draft misses, and what a draft vocabulary of each size would cover.

The target answers a benchmark's first turns greedily (`generate`, as the vanilla baseline); the
answers are teacher-forced through the head as the decoder commits them, one accepted token at a
time (inference/drafter.py), and each answer token after the first (the one a step's root is
followed by) is counted: outside the head's draft vocabulary, or at its rank in the head's
first-draft distribution (1, 2-4, 5-8, 9+). A tree's first-draft acceptance (results.md's
acceptance by depth) is what its top-k children and the prompt-lookup branch reach of these.
With --prepared, also the share of those tokens among the N most frequent answer tokens of that
prepared data, the vocabulary `head.draft_vocab_size=N` (EAGLE-3) or `eval.draft_vocab_size=N`
would draft over, for each N: whether a bigger vocabulary has anything left to reach.
With --temperature T > 0 the answers are sampled, and each token also counts the target's law p
before it: its mass inside the draft vocabulary, and sum(min(p, q)) against the head's q, the
chance that one child drawn from q is accepted (the T=1 trees' first draw).
Writes JSON, a markdown table and a plot. Usage:
  python scripts/bench_first_draft.py --head runs/<run>/train/head [--prepared runs/<run>/prepare]
      [--target smollm2-135m-instruct] [--benchmark mt-bench] [--prompts 80]
      [--max-new-tokens 128] [--dtype bfloat16] [--draft-vocab-size N] [--sizes 4096 16384]
      [--temperature 1.0] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith.features import FeatureCapture
from draftsmith.heads import TargetInfo, TargetParts, load_head
from draftsmith.heads.vocab import answer_token_counts, build_vocab_mapping, frequent_tokens
from draftsmith.inference.drafter import EagleDrafter, ParallelDrafter, make_drafter
from draftsmith.inference.prompts import first_turns
from draftsmith.inference.verify import Sampling, generate_kwargs
from draftsmith.target import load_target, load_tokenizer, stop_token_ids, target_name, torch_dtype

BUCKETS = ("outside vocabulary", "rank 1", "rank 2-4", "rank 5-8", "rank 9+")


def bucket(rank: int) -> str:
    """A 1-based rank's bucket (0: the token is outside the draft vocabulary)."""
    if rank == 0:
        return BUCKETS[0]
    return BUCKETS[1 if rank == 1 else 2 if rank <= 4 else 3 if rank <= 8 else 4]


@dataclass
class FirstDrafts:
    """Per answer token after the first: its rank in the head's first-draft distribution q
    (1-based; 0 = outside the draft vocabulary) and, when sampling, the target's law p there:
    the mass of p inside the draft vocabulary and sum(min(p, q)), the chance that one draw from
    q is accepted (min(1, p / q), inference/verify.py)."""

    ranks: list[int] = field(default_factory=list)
    inside: list[float] = field(default_factory=list)
    overlap: list[float] = field(default_factory=list)

    def extend(self, other: FirstDrafts) -> None:
        """Append another answer's tokens."""
        self.ranks += other.ranks
        self.inside += other.inside
        self.overlap += other.overlap


@torch.no_grad()
def first_drafts(
    target: torch.nn.Module,
    drafter: EagleDrafter | ParallelDrafter,
    aux_layers: Sequence[int],
    prompt: list[int],
    answer: list[int],
    sampling: Sampling,
) -> FirstDrafts:
    """The head's first draft before each answer[k], k >= 1, answer[:k] committed as the
    decoder commits: the prompt's features with their next tokens, then one (feature, token)
    pair per accepted token."""
    ids = torch.tensor([prompt + answer])  # [1, S]
    with FeatureCapture(target, aux_layers) as capture:
        logits = target(input_ids=ids).logits[0]  # [S, V]
    hidden, aux = capture.hidden, capture.aux  # [1, S, H], [1, S, kH] or None
    n = len(prompt)
    drafter.reset()
    # pairs 0..n-1: position j's feature with token j+1 (the last one the answer's first token)
    drafter.commit(hidden[:, :n], None if aux is None else aux[:, :n], ids[:, 1 : n + 1])
    # the draft id of every target id (-1: outside the draft vocabulary)
    drafted = drafter.to_target(torch.arange(drafter.root_logprobs().numel()))  # [Vd]
    index = torch.full((target.config.vocab_size,), -1, dtype=torch.long)  # [V]
    index[drafted] = torch.arange(drafted.numel())
    out = FirstDrafts()
    for k in range(1, len(answer)):
        logprobs = drafter.root_logprobs()  # [Vd] over answer[k]
        d = int(index[answer[k]])
        out.ranks.append(0 if d < 0 else int((logprobs > logprobs[d]).sum()) + 1)
        j = n + k - 1  # the position whose logits and pair answer[k] follows
        if not sampling.greedy:
            p = sampling.probs(logits[j][None])[0][drafted]  # [Vd] p on the draft vocabulary
            out.inside.append(float(p.sum()))
            out.overlap.append(float(torch.minimum(p, logprobs.exp()).sum()))
        drafter.commit(
            hidden[:, j : j + 1], None if aux is None else aux[:, j : j + 1], ids[:, j + 1 : j + 2]
        )
    return out


def plot(shares: dict[str, float], coverage: dict[int, float], title: str, out: Path) -> None:
    """Where the answer tokens fall (one stacked bar) and, with coverage, the share each draft
    vocabulary size would hold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if coverage else 1, figsize=(11 if coverage else 5.5, 4))
    bars = axes[0] if coverage else axes
    bottom = 0.0
    for name, share in shares.items():
        bars.bar(0, share, 0.5, bottom=bottom, label=f"{name} {share:.1%}")
        bottom += share
    bars.set_xticks([])
    bars.set_xlim(-0.5, 2.0)  # room for the legend
    bars.set_ylabel("share of answer tokens")
    bars.set_title(title, fontsize=9)
    bars.legend(fontsize=8, loc="center right")
    if coverage:
        sizes = sorted(coverage)
        axes[1].plot(sizes, [coverage[n] for n in sizes], marker="o")
        axes[1].set_xscale("log", base=2)
        axes[1].set_xlabel("draft vocabulary size (most frequent answer tokens of the data)")
        axes[1].set_ylabel("share of answer tokens inside")
        axes[1].set_ylim(0, 1)
        axes[1].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--head", required=True, help="a head folder (runs/<run>/train/head)")
    p.add_argument("--prepared", help="a prepared run folder (runs/<run>/prepare): vocab coverage")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--benchmark", default="mt-bench")
    p.add_argument("--prompts", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled answers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-vocab-size", type=int, default=0, help="as eval.draft_vocab_size")
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--out", default="runs/bench/first_draft")
    args = p.parse_args()
    tokenizer = load_tokenizer(args.target)
    target = load_target(args.target, args.dtype)
    info = TargetInfo.from_hf_config(target.config, target_name(args.target))
    head = load_head(args.head, info).to(dtype=torch_dtype(args.dtype))
    head.bind(TargetParts.from_model(target)).eval().requires_grad_(False)
    counts = answer_token_counts(args.prepared, info.vocab_size) if args.prepared else None
    vocab = None
    if args.draft_vocab_size:
        if counts is None:
            raise SystemExit("--draft-vocab-size chooses from prepared data: give --prepared")
        vocab = frequent_tokens(counts, args.draft_vocab_size)
    drafter = make_drafter(head, vocab)
    aux_layers = head.aux_layers
    prompts, _ = first_turns(args.benchmark, tokenizer, args.prompts)
    sampling = Sampling(temperature=args.temperature)
    kwargs = generate_kwargs(
        tokenizer, sampling, args.max_new_tokens, stop_token_ids(target, tokenizer)
    )
    torch.manual_seed(args.seed)
    answers, drafts = [], FirstDrafts()
    for prompt in tqdm(prompts, desc="first drafts", unit="prompt"):
        with torch.no_grad():
            answer = target.generate(torch.tensor([prompt]), **kwargs)[0, len(prompt) :]
        answers.append(answer.tolist())
        drafts.extend(first_drafts(target, drafter, aux_layers, prompt, answers[-1], sampling))
    ranks = drafts.ranks
    total = max(len(ranks), 1)
    shares = {b: sum(bucket(r) == b for r in ranks) / total for b in BUCKETS}
    drafted = [r for r in ranks if r > 0]
    reach = {k: sum(r <= k for r in drafted) / max(len(drafted), 1) for k in (1, 4, 8)}
    tokens = torch.tensor([t for a in answers for t in a[1:]], dtype=torch.long)
    coverage = {}
    if counts is not None and tokens.numel():
        for size in args.sizes:
            _, t2d = build_vocab_mapping(counts, min(size, info.vocab_size))  # [V] bool
            coverage[size] = float(t2d[tokens].float().mean())
    answered = "greedy" if sampling.greedy else f"T={args.temperature:g}"
    table = f"First drafts of `{args.head}` on {len(prompts)} {args.benchmark} {answered} answers "
    table += f"({len(ranks)} tokens, {args.dtype})\n\n| answer token | share |\n|---|---:|\n"
    table += "".join(f"| {b} | {s:.1%} |\n" for b, s in shares.items())
    table += "\nOf the tokens the head can draft: "
    table += ", ".join(f"top-{k} {s:.1%}" for k, s in reach.items()) + "\n"
    law = {}
    if drafts.overlap:
        law = {
            "inside": sum(drafts.inside) / len(drafts.inside),
            "overlap": sum(drafts.overlap) / len(drafts.overlap),
        }
        table += f"\nThe target's probability inside the draft vocabulary: {law['inside']:.1%} on "
        table += f"average; sum(min(p, q)), the chance one draw is accepted: {law['overlap']:.3f}\n"
    if coverage:
        table += "\n| draft vocabulary (most frequent answer tokens) | answer tokens inside |\n"
        table += "|---:|---:|\n" + "".join(f"| {n} | {c:.1%} |\n" for n, c in coverage.items())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "args": vars(args),
        "tokens": len(ranks),
        "shares": shares,
        "reach_of_drafted": reach,
        "vocab_coverage": coverage,
        "sampled_law": law,
        "answers": answers,
        "ranks": ranks,
        "inside": [round(x, 5) for x in drafts.inside],
        "overlap": [round(x, 5) for x in drafts.overlap],
    }
    # one line: the per-token lists (answers, ranks, laws) are ~10k numbers each
    (out / "results.json").write_text(json.dumps(result))
    (out / "results.md").write_text(table)
    plot(shares, coverage, table.split("\n")[0], out / "first_draft.png")
    print(table)


if __name__ == "__main__":
    main()
