"""Tree-verified decoding on a benchmark -> tau, per-depth acceptance, speedup (`draftsmith eval`).

Vanilla decoding (transformers `generate`), prompt-lookup assisted generation and speculative
decoding run interleaved prompt by prompt in one process (the order rotates per prompt), so the
speedups are ratios measured side by side; `eval.heads` adds other runs' heads to the rotation,
so several heads share one pass of each baseline. Greedy speculative outputs are compared with
vanilla token for token; each divergence is reported with the target's top-2 logit gap where it
starts. Tau is also reported per prompt and, where the benchmark's rows name one (MT-bench's
eight), per category. `eval.turns=all` decodes every user turn of a conversation (MT-bench's
second turns, as EAGLE's MT-bench numbers do), each method answering after its own earlier
answers; the goals' protocol is the first turns alone. A benchmark conversation's system turns
(before its first user turn) and tools (function schemas) are in each of its prompts, as a
served request has them. A tau-only eval (no baselines) can split its conversations among
`eval.workers` processes.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import platform
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from draftsmith.conf.schema import Config
from draftsmith.conversations import source_digest
from draftsmith.errors import InputError
from draftsmith.heads import TargetInfo
from draftsmith.inference.decoder import STEP_PARTS, DecodeStats, SpecDecoder
from draftsmith.inference.loading import decoding_head, decoding_target, draft_vocabulary
from draftsmith.inference.prompts import Setting, benchmark_source, chat_prompt, user_turns
from draftsmith.inference.report import write_report, write_sweep_summary
from draftsmith.inference.results import changed_settings, results_dir
from draftsmith.inference.tree import TreeSpec
from draftsmith.inference.verify import Sampling, generate_kwargs
from draftsmith.provenance import head_made, pin_target
from draftsmith.target import (
    chat_template_digest,
    compile_target,
    stop_token_ids,
    target_tokenizer,
)
from draftsmith.tokenize import ConversationTokenizer
from draftsmith.tracking import Tracker


def _top2_gap(target, sequence: list[int], position: int) -> float:
    """Target logit gap between its top-2 tokens when predicting sequence[position]."""
    with torch.no_grad():
        ids = torch.tensor([sequence[:position]], device=next(target.parameters()).device)
        logits = target(ids).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def machine_info(cfg: Config) -> dict:
    import transformers

    import draftsmith

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": torch.get_num_threads(),
        "device": cfg.device,
        "dtype": cfg.dtype,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "draftsmith": draftsmith.__version__,
    }


@dataclass
class _Contender:
    """One head decoded in this eval: where its results go and what it measured."""

    run: str
    head_path: str
    decoder: SpecDecoder
    draft_vocab: int  # 0 = the head's own vocabulary
    # (conversation index, turn, category, statistics) per decoded prompt
    records: list[tuple[int, int, str, DecodeStats]] = field(default_factory=list)
    mismatches: list[dict] = field(default_factory=list)
    # greedy prompts decoded from the same context as vanilla's (all turns of a conversation up
    # to the first that follows a diverged answer)
    compared: int = 0

    def totals(self) -> tuple[DecodeStats, dict[str, DecodeStats], list[dict]]:
        """Statistics overall, by category and per prompt (in benchmark order: the workers of
        `eval.workers` return theirs out of order)."""
        stats, by_category, per_prompt = DecodeStats(), {}, []
        for _, turn, category, prompt in sorted(self.records, key=lambda r: r[:2]):
            stats.add(prompt)
            by_category.setdefault(category, DecodeStats()).add(prompt)
            per_prompt.append(
                {
                    "category": category,
                    "turn": turn,
                    "tokens": prompt.new_tokens,
                    "forwards": prompt.forwards,
                    "tau": prompt.tau,
                }
            )
        return stats, by_category, per_prompt

    def compare(
        self,
        target: torch.nn.Module,
        mine: list[tuple[list[int], list[int]]],
        vanilla: list[tuple[list[int], list[int]]],
        index: int,
    ) -> None:
        """Count conversation `index`'s greedy turns (prompt, output) against vanilla's, up to
        the first whose prompt differs, and record where each differing output left vanilla."""
        for turn, ((prompt, out), (ref_prompt, ref)) in enumerate(zip(mine, vanilla)):
            if prompt != ref_prompt:  # an earlier turn diverged: not like for like
                break
            self.compared += 1
            if out != ref:
                self.mismatches.append(_mismatch(target, prompt, out, ref, index, turn))


@dataclass
class _Pass:
    """What one process decoded: its share of the conversations (all of them with one worker)."""

    contenders: list[_Contender]
    conversations: list[list[str]]
    categories: list[str]
    skipped: dict[str, int]  # the benchmark's rows not read as prompts, by reason
    benchmark_sha256: str | None  # what the benchmark held when read (`source_digest`)
    info: TargetInfo
    packed: int
    tokens: dict[str, int]
    seconds: dict[str, float]

    def shard_records(self) -> dict:
        """The picklable part a worker process sends back."""
        return {
            "records": {c.run: c.records for c in self.contenders},
            "tokens": self.tokens,
            "seconds": self.seconds,
        }

    def merge(self, other: dict) -> None:
        """Add a worker's `shard_records()` to this pass."""
        for c in self.contenders:
            c.records += other["records"][c.run]
        for method in self.tokens:
            self.tokens[method] += other["tokens"][method]
            self.seconds[method] += other["seconds"][method]


def _tree_for(head, tree: TreeSpec) -> TreeSpec:
    """A parallel head (Medusa, Hydra) drafts one depth per head: a dynamic tree deeper than its
    heads is cut to them, so heads of different depths can share one eval's tree settings."""
    if head.kind == "parallel" and tree.kind == "dynamic":
        return dataclasses.replace(tree, depth=min(tree.depth, head.config.num_heads))
    return tree


def evaluate(cfg: Config) -> dict[str, dict]:
    """Run the benchmark; returns {run name: results} for this run's head and `eval.heads`.
    With `eval.workers` N > 1, N processes (this one and N - 1 spawned) decode every N-th
    conversation each, the cores split among them."""
    # before the target loads: a tree that cannot verify drawn children exactly at this
    # temperature (the decoder refuses it too)
    cfg.tree.refuse_drawn(cfg.eval.temperature)
    pin_target(cfg)  # a hub target: every process decodes the commit the results name
    n = _processes(cfg)
    if n < cfg.eval.workers:
        print(
            f"eval.workers={cfg.eval.workers} unused: with baselines every method decodes in "
            "this process, so the speedups are measured side by side"
        )
    if n == 1:
        return _results(cfg, _decode(cfg))
    threads = torch.get_num_threads()
    share = max(1, threads // n)
    spawn = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(
            n - 1, mp_context=spawn, initializer=torch.set_num_threads, initargs=(share,)
        ) as pool:
            others = [pool.submit(_worker, cfg, k) for k in range(1, n)]
            torch.set_num_threads(share)
            try:
                mine = _decode(cfg)
                for other in others:
                    mine.merge(other.result())
            except BaseException:
                # leaving the pool would wait for every worker's share: when this process (or a
                # worker) fails, stop them instead (they are its only multiprocessing children;
                # Python 3.11's executor cannot terminate its own)
                for child in multiprocessing.active_children():
                    child.terminate()
                raise
    finally:
        torch.set_num_threads(threads)
    return _results(cfg, mine)


def _processes(cfg: Config) -> int:
    """Processes the eval decodes in: `eval.workers` for tau only, one with baselines (their
    speed ratios are measured side by side in one process)."""
    return 1 if cfg.eval.baselines else cfg.eval.workers


def _worker(cfg: Config, shard: int) -> dict:
    """A spawned `eval.workers` process: decode shard `shard`, send back its records."""
    return _decode(cfg, shard).shard_records()


def _decode(cfg: Config, shard: int = 0) -> _Pass:
    """Decode conversations shard, shard + workers, ... with every method."""
    if len({cfg.run_name, *cfg.eval.heads}) != 1 + len(cfg.eval.heads):
        raise InputError(f"eval.heads={cfg.eval.heads}: repeats a run (this run is {cfg.run_name})")
    tokenizer = target_tokenizer(cfg.target)
    template_kwargs = cfg.target.chat_template_kwargs
    template = cfg.data.template  # as prepare rendered the head's data
    # every method decodes with the same (maybe packed) target, so the ratios stay like for like
    target, info, parts, packed = decoding_target(cfg)
    vocab = draft_vocabulary(cfg, info)  # [Vd] target ids, or None
    contenders = []
    heads = [(cfg.run_name, cfg.resolved_head_path())]
    heads += [(run, f"{cfg.runs_dir}/{run}/train/head") for run in cfg.eval.heads]
    for run, head_path in heads:
        head, count = decoding_head(cfg, head_path, info, parts)
        packed += count
        tree = cfg.tree if run == cfg.run_name else _tree_for(head, cfg.tree)
        # this run's head must take the reduced vocabulary; other heads take it if they can
        own = vocab if run == cfg.run_name or head.drafts_with_target_lm_head else None
        decoder = SpecDecoder(target, head, tree, own)
        draft = 0 if own is None else own.numel()
        done = results_dir(cfg, run, decoder.spec, draft) / "results.json"
        if run != cfg.run_name and done.exists():
            # another run's results are an earlier measurement the user did not ask to redo
            raise InputError(
                f"{done} already holds an eval of {run}'s head under this tag; eval.heads would "
                "overwrite it: give this eval another eval.tag (or delete that folder)"
            )
        contenders.append(_Contender(run, head_path, decoder, draft))
    e = cfg.eval
    # before reading: as read, not as edited since
    digest = source_digest(benchmark_source(cfg), cfg.eval.revision)
    # data.preformatted: `text` rows are rendered conversations, read as prepare reads them
    renderer = None
    if cfg.data.preformatted:
        renderer = ConversationTokenizer(tokenizer, template, template_kwargs=template_kwargs)
    conversations, categories, settings, report = user_turns(
        benchmark_source(cfg), e.limit, renderer, e.revision
    )
    if report.skipped and shard == 0:  # every worker reads the benchmark; one says so
        print(report.summary())
    digest = report.commit or digest  # a hub dataset: the commit read, even if its branch moved
    if e.turns == "first":
        conversations = [turns[:1] for turns in conversations]
    sampling = Sampling(e.temperature, e.top_p, e.top_k)
    stops = stop_token_ids(target, tokenizer)
    gen_kwargs = generate_kwargs(tokenizer, sampling, e.max_new_tokens, stops)
    by_run = {c.run: c for c in contenders}
    methods = [*by_run, *e.baselines]

    def decode(method: str, prompt: list[int], seed: int) -> tuple[list[int], DecodeStats | None]:
        torch.manual_seed(seed)
        if method in by_run:
            generator = torch.Generator().manual_seed(seed)
            return by_run[method].decoder.generate(
                prompt, e.max_new_tokens, sampling, stops, generator=generator
            )
        extra = {"prompt_lookup_num_tokens": e.lookup_tokens} if method == "lookup" else {}
        ids = torch.tensor([prompt], device=cfg.device)
        with torch.no_grad():
            out = target.generate(ids, **gen_kwargs, **extra)[0, ids.shape[1] :].tolist()
        return out, None

    def prompt_ids(text: str, history: list[dict], setting: Setting) -> list[int]:
        if setting.rendered:  # already the template's text, up to its first reply
            return tokenizer(text, add_special_tokens=False)["input_ids"]
        return chat_prompt(tokenizer, text, history, template_kwargs, setting.tools, template)

    if e.compile:
        compile_target(target)
        first = prompt_ids(conversations[0][0], settings[0].system, settings[0])
        for method in tqdm(methods, desc="compile (untimed warm-up)", unit="method"):
            decode(method, first, cfg.seed)
        for c in contenders:
            if c.decoder.costs is not None:
                c.decoder.measure_costs()  # the compiled forward's costs size the trees
    seconds = dict.fromkeys(methods, 0.0)
    tokens = dict.fromkeys(methods, 0)
    n = _processes(cfg)
    indices = range(shard, len(conversations), n)
    desc = f"eval {e.benchmark}" + (f" (worker {shard + 1}/{n})" if n > 1 else "")
    with _no_compiling(e.compile):
        for index in tqdm(indices, desc=desc, unit="conv", position=shard):
            turns = conversations[index]
            # per method: each turn's prompt and output; later turns follow the method's own
            # answers
            seen: dict[str, list[tuple[list[int], list[int]]]] = {}
            # the order rotates per conversation so no method always runs first (warm caches,
            # clocks)
            order = methods[index % len(methods) :] + methods[: index % len(methods)]
            setting = settings[index]
            for method in order:
                history = list(setting.system)
                seen[method] = []
                for turn, text in enumerate(turns):
                    prompt = prompt_ids(text, history, setting)
                    # turn 0 keeps the seed a first-turn eval has always used
                    seed = cfg.seed + index + turn * len(conversations)
                    t0 = time.perf_counter()
                    out, prompt_stats = decode(method, prompt, seed)
                    seconds[method] += time.perf_counter() - t0
                    if prompt_stats is not None:
                        by_run[method].records.append(
                            (index, turn, categories[index], prompt_stats)
                        )
                    tokens[method] += len(out)
                    seen[method].append((prompt, out))
                    answer = tokenizer.decode(out, skip_special_tokens=True)
                    history += [
                        {"role": "user", "content": text},
                        {"role": "assistant", "content": answer},
                    ]
            if sampling.greedy and "vanilla" in seen:
                for c in contenders:
                    c.compare(target, seen[c.run], seen["vanilla"], index)
    skipped = dict(report.skipped)
    return _Pass(
        contenders, conversations, categories, skipped, digest, info, packed, tokens, seconds
    )


def _no_compiling(compiled: bool) -> AbstractContextManager:
    """Around the timed decodes of a compiled target: a call pattern the warm-up did not meet
    (a prompt-lookup step over a cache of another layout, a first top-2 gap check) runs eagerly
    instead of compiling, which takes minutes on 2 cores and would be billed to one method's
    time (session 62: 125 s inside one MT-bench prompt-lookup decode)."""
    return torch.compiler.set_stance("eager_on_recompile") if compiled else nullcontext()


def _results(cfg: Config, p: _Pass) -> dict[str, dict]:
    """{run name: results} of a finished pass (all workers' records merged)."""
    e = cfg.eval
    rate = {m: p.tokens[m] / max(p.seconds[m], 1e-9) for m in p.tokens}
    machine = {**machine_info(cfg), "packed_linears": p.packed}
    runs = [c.run for c in p.contenders]
    results = {}
    for c in p.contenders:
        # this head is "speculative" in its own results
        names = {"speculative": c.run, **{b: b for b in e.baselines}}
        stats, by_category, per_prompt = c.totals()
        results[c.run] = {
            "machine": machine,
            "target": p.info.name,
            "target_revision": cfg.target.revision,  # a hub target's commit (`target_commit`)
            "chat_template": chat_template_digest(cfg.target.chat_template),
            "chat_template_kwargs": cfg.target.chat_template_kwargs,
            # the head's own draft vocabulary (None: the target's); `draft_vocab_size` below is
            # a subset of the target's vocabulary chosen at eval (eval.draft_vocab_size)
            "head": {
                "name": c.decoder.head.name,
                "path": c.head_path,
                "draft_vocab_size": c.decoder.head.own_vocab_size,
                "made": head_made(c.head_path),  # the training that wrote it (provenance)
            },
            "tree": vars(c.decoder.spec),
            "draft_vocab_size": c.draft_vocab,
            "eval": vars(e),
            "benchmark_sha256": p.benchmark_sha256,
            "workers": _processes(cfg),
            # heads decoded in the same process, interleaved prompt by prompt (shared baselines)
            "decoded_with": [r for r in runs if r != c.run],
            # every head decodes every prompt once
            "prompts": len(c.records),
            "conversations": len(p.conversations),
            "skipped": p.skipped,
            "tokens": {n: p.tokens[m] for n, m in names.items()},
            "seconds": {n: p.seconds[m] for n, m in names.items()},
            "tokens_per_second": {n: rate[m] for n, m in names.items()},
            "speedup": {f"vs_{m}": rate[c.run] / rate[m] for m in e.baselines},
            "tau": stats.tau,
            "tau_output": stats.output_tau,
            "depth_acceptance": stats.depth_acceptance(),
            # per benchmark category (MT-bench's eight), where the rows name one
            "by_category": {
                name: {
                    "prompts": sum(
                        len(t) for t, k in zip(p.conversations, p.categories) if k == name
                    ),
                    "tau": part.tau,
                    "depth_acceptance": part.depth_acceptance(),
                }
                for name, part in sorted(by_category.items())
                if name
            },
            "per_prompt": per_prompt,
            **{f"{part}_seconds": getattr(stats, f"{part}_seconds") for part in STEP_PARTS},
            "verify_seconds": stats.verify_seconds,
            "verify_forwards": stats.forwards,
            "nodes_per_forward": stats.nodes_per_forward,
            "mismatch": {
                "checked": Sampling(e.temperature).greedy and "vanilla" in e.baselines,
                "prompts": len(c.mismatches),
                "compared": c.compared,
                "rate": len(c.mismatches) / max(c.compared, 1),
                "details": c.mismatches,
            },
        }
    return results


def _mismatch(
    target, prompt: list[int], spec: list[int], ref: list[int], index: int, turn: int
) -> dict:
    """Where a greedy speculative output first left vanilla, and the target's top-2 gap there."""
    first = first_divergence(spec, ref)
    gap = _top2_gap(target, prompt + ref, len(prompt) + first) if first < len(ref) else None
    return {"prompt": index, "turn": turn, "first_divergence": first, "top2_gap": gap}


def first_divergence(tokens: list[int], reference: list[int]) -> int:
    """The first position where two outputs differ (or the shorter one's length)."""
    same = (i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b)
    return next(same, min(len(tokens), len(reference)))


def run(cfg: Config) -> dict:
    """Stage entry point: evaluate, then write JSON + markdown + plots under runs/<run>/eval/
    (and under each `eval.heads` run's own eval folder); returns this run's results."""
    results = evaluate(cfg)
    for run_name, r in results.items():
        tree = TreeSpec(**r["tree"])
        out = results_dir(cfg, run_name, tree, r["draft_vocab_size"])
        if (old := out / "results.json").exists() and (
            changes := changed_settings(json.loads(old.read_text()), cfg, tree, r["head"]["path"])
        ):
            print(f"{out}: replacing results measured with other settings ({'; '.join(changes)})")
        write_report(r, out)
        write_sweep_summary(out.parent)
        if cfg.tracking != "none":
            tracker = Tracker(out, cfg.tracking, f"{run_name}-eval-{out.name}", cfg)
            flat = {
                "tau": r["tau"],
                "tau_output": r["tau_output"],
                **{f"speedup/{k}": v for k, v in r["speedup"].items()},
                **{f"tokens_per_second/{k}": v for k, v in r["tokens_per_second"].items()},
                **{f"acceptance/depth_{d + 1}": a for d, a in enumerate(r["depth_acceptance"])},
                **{f"tau_by_category/{k}": c["tau"] for k, c in r["by_category"].items()},
            }
            tracker.log(flat, 0)
            tracker.artifact(out, f"{run_name}-eval", kind="results")
            tracker.finish()
        print(run_name, json.dumps({k: r[k] for k in ("tau", "speedup", "tokens_per_second")}))
        print(f"results: {out}/results.json, {out}/results.md")
    return results[cfg.run_name]
