"""The tau ceiling of a tree budget when sampling top-k trees: the target drafts for itself.

At temperature T > 0 verification accepts a drafted child x of an accepted node with probability
p(x | path) when the children are the head's top k (`tree.sample_drafts=false`: deterministic
drafts, multi-round over siblings, inference/verify.py), so such a tree's expected accepted
length is the sum over its nodes of the product of p along the path to each.
Here the EAGLE-2 dynamic tree (inference/tree.py) grows from the target's own log-probabilities,
the best proposals any draft head could make under the same depth / top-k / node budget, and the
sum is read off the target's probabilities at the kept nodes: oracle tau = 1 + that sum,
averaged over steps. The steps are every `--every`-th position of the target's own sampled
answers to MT-bench prompts. (At T=0 an oracle is always right: tau = depth + 1. So is it with
drawn children, the default: a child drawn from q = p is accepted with probability
min(1, p / q) = 1, so this ceiling does not bound those trees.)
Writes JSON + a markdown table. Usage:
  python scripts/bench_oracle.py [--temperature 1.0] [--prompts 20] [--every 8] [--depth 4]
                                 [--top-k 8] [--total-tokens 8 12 16]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

from draftsmith.inference.attention import tree_attention
from draftsmith.inference.prompts import first_turns
from draftsmith.inference.tree import Tree, build_dynamic_tree
from draftsmith.inference.verify import Sampling
from draftsmith.target import cache_kwarg, load_target, load_tokenizer


class OracleExpander:
    """The `Expander` protocol backed by the target: `cache` holds the context up to the root
    (`n` tokens); tree nodes are fed with a tree mask and cut away again after each forward.
    Log-probs are kept per path below the root, so trees of several sizes grown from one context
    share their forwards, and a tree's expectation needs none."""

    def __init__(self, target, cache: DynamicCache, root_logits: torch.Tensor, sampling: Sampling):
        self.target, self.cache, self.sampling = target, cache, sampling
        self.n = cache.get_seq_length()
        # [V] log-probs of the next token after each path of tokens below the root
        self.after: dict[tuple[int, ...], torch.Tensor] = {(): self.logprobs(root_logits[None])[0]}

    def logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        return self.sampling.probs(logits).log()  # [F, V], -inf where a warper removed a token

    @staticmethod
    def path(tree: Tree, node: int) -> tuple[int, ...]:
        return tuple(tree.tokens[tree.ancestors[node]][1:].tolist())  # below the root

    def node_logits(self, tree: Tree, nodes: torch.Tensor) -> torch.Tensor:
        """[F, V] target logits after the path to each of `nodes` (all of them non-root)."""
        need = tree.ancestors[nodes].any(0)  # [N] the nodes and their ancestors
        need[0] = False  # the root is the cache's last token
        fed = need.nonzero().flatten()  # [U] ascending: parents first
        mask = torch.ones(fed.numel(), self.n + fed.numel(), dtype=torch.bool)
        mask[:, self.n :] = tree.ancestors[fed][:, fed]
        out = self.target(
            input_ids=tree.tokens[fed][None],
            position_ids=(self.n - 1 + tree.depths[fed])[None],
            attention_mask=mask[None, None],
            **{cache_kwarg(self.target): self.cache},
            use_cache=True,
        )
        self.cache.crop(-fed.numel())  # transformers 5: a negative count of tokens to drop
        return out.logits[0, torch.searchsorted(fed, nodes)].float()

    def root_logprobs(self) -> torch.Tensor:
        return self.after[()]

    def expand(self, nodes: torch.Tensor, tree: Tree) -> torch.Tensor:
        paths = [self.path(tree, node) for node in nodes.tolist()]
        new = [i for i, path in enumerate(paths) if path not in self.after]
        if new:
            rows = self.logprobs(self.node_logits(tree, nodes[new]))  # [F', V]
            self.after.update({paths[i]: row for i, row in zip(new, rows)})
        return torch.stack([self.after[path] for path in paths])  # [F, V]

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def expected_accepted(self, tree: Tree) -> float:
        """Sum over the non-root nodes of the probability that the target samples the path to
        them (every parent of a tree node was expanded, so its log-probs are known)."""
        total = 0.0
        for node in range(1, tree.size):
            path = self.path(tree, node)
            total += math.exp(sum(float(self.after[path[:i]][t]) for i, t in enumerate(path)))
        return total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--benchmark", default="mt-bench")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--every", type=int, default=8)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--total-tokens", type=int, nargs="+", default=[8, 12, 16])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench/oracle")
    args = p.parse_args()
    if args.temperature <= 0:
        raise SystemExit("--temperature must be > 0: at T=0 an oracle's tau is depth + 1")
    tokenizer = load_tokenizer(args.target)
    target = load_target(args.target, args.dtype)
    sampling = Sampling(temperature=args.temperature)
    prompts, _ = first_turns(args.benchmark, tokenizer, args.prompts)
    sums = dict.fromkeys(args.total_tokens, 0.0)
    steps = 0
    torch.manual_seed(args.seed)
    with torch.no_grad():
        for prompt in tqdm(prompts, desc="oracle trees", unit="prompt"):
            ids = torch.tensor([prompt])  # [1, P]
            sequence = target.generate(
                ids,
                do_sample=True,
                temperature=args.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
            )[0]  # [P + A] the target's own sampled answer
            cache = DynamicCache(config=target.config)
            kv = {cache_kwarg(target): cache, "use_cache": True}
            fed = 0
            for n in range(len(prompt) + 1, sequence.numel(), args.every):
                # context up to and including the root (token n-1); its last logits are the root's
                out = target(input_ids=sequence[fed:n][None], **kv)
                fed = n
                oracle = OracleExpander(target, cache, out.logits[0, -1].float(), sampling)
                root = int(sequence[n - 1])
                with tree_attention(target, "sdpa"):
                    for total in args.total_tokens:
                        tree = build_dynamic_tree(oracle, root, args.depth, args.top_k, total)
                        sums[total] += oracle.expected_accepted(tree)
                steps += 1
    taus = {total: 1 + s / max(steps, 1) for total, s in sums.items()}
    table = f"Oracle tau (the target drafts for itself), T={args.temperature:g}, {args.dtype}, "
    table += f"{steps} steps of {len(prompts)} {args.benchmark} answers\n\n"
    table += "| tree | oracle tau |\n|---|---:|\n"
    for total, tau in taus.items():
        table += f"| dynamic d{args.depth} k{args.top_k} n{total} | {tau:.2f} |\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"args": vars(args), "steps": steps, "oracle_tau": taus}
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "results.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
