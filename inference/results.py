"""Where an eval's results live (`runs/<run>/eval/<tag>`, the tag naming every setting the
numbers depend on) and which settings earlier results there were measured with, so a new eval
says what it replaces and `draftsmith run` knows whether its eval is still the run's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from draftsmith.conf.schema import Config, EvalConfig
from draftsmith.conversations import source_digest
from draftsmith.inference.prompts import benchmark_source
from draftsmith.inference.tree import TreeSpec, branch_label
from draftsmith.provenance import differences
from draftsmith.target import chat_template_digest, target_commit


def _where(path: str) -> str:
    """A short digest of a file, folder or hub id as given (normalised: `a/b/` is `a/b`)."""
    return hashlib.sha256(os.path.normpath(path).encode()).hexdigest()[:8]


def eval_tag(cfg: Config, tree: TreeSpec | None = None, draft_vocab: int | None = None) -> str:
    """Results folder name: benchmark, tree and draft-vocabulary settings (`tree`, `draft_vocab`:
    a head's own, else cfg's)."""
    t = tree or cfg.tree
    # a benchmark given as a file or hub id is named by its stem (the tag is one folder under the
    # run's eval/) and a digest of where it is, so two of one name (files in two folders, a file
    # and a hub dataset) never share a folder, where the later eval would replace the earlier's
    spec = cfg.eval.benchmark
    bench = Path(spec).name.removesuffix(".jsonl").removesuffix(".json")
    if bench != spec:  # mt-bench, humaneval, heldout: named by themselves
        bench += f"-{_where(spec)}"
    tag = cfg.eval.tag or f"{bench}-{t.kind}-d{t.depth}-k{t.top_k}-n{t.total_tokens}"
    if t.kind == "static" and t.choices and not cfg.eval.tag:  # its shape is the choices'
        digest = hashlib.sha256(json.dumps(t.choices).encode()).hexdigest()[:8]
        depth = max(len(c) for c in t.choices)
        nodes = len({tuple(c) for c in t.choices}) + 1  # the root and one node per path
        tag = f"{bench}-static-d{depth}-n{nodes}-choices{digest}"
    if t.branch and not cfg.eval.tag:
        tag += f"-{branch_label(dataclasses.asdict(t))}"
    if t.adaptive and not cfg.eval.tag:
        tag += "-adaptive"
    if cfg.eval.turns == "all" and not cfg.eval.tag:
        tag += "-allturns"
    if cfg.eval.temperature > 0 and t.sample_drafts and not cfg.eval.tag:
        tag += "-drawn"  # children drawn from the head (earlier T > 0 evals took its top k)
    if cfg.eval.temperature > 0 and t.verify == "traversal" and not cfg.eval.tag:
        tag += "-traversal"  # whole paths decided at once (at T=0 the same greedy walk)
    if not cfg.eval.tag:  # another template or its variables, other prompts: other results
        if cfg.target.chat_template is not None:
            tag += f"-template{chat_template_digest(cfg.target.chat_template)}"
        if cfg.data.template == "plain":  # "Role: text" prompts, as prepare rendered the data
            tag += "-plain"
        tag += "".join(f"-{k}={v}" for k, v in sorted(cfg.target.chat_template_kwargs.items()))
        # fewer prompts or tokens than the protocol's (a smoke test) never replace its results
        e, protocol = cfg.eval, EvalConfig()
        if e.limit != protocol.limit:
            tag += f"-limit{'all' if e.limit is None else e.limit}"
        if e.max_new_tokens != protocol.max_new_tokens:
            tag += f"-new{e.max_new_tokens}"
        if e.temperature > 0 and (e.top_p, e.top_k) != (protocol.top_p, protocol.top_k):
            tag += f"-p{e.top_p:g}-k{e.top_k}"
        if cfg.imports_head():  # another head's results never replace the run's own head's
            tag += f"-head{_where(cfg.head_path)}"
    vocab = cfg.eval.draft_vocab_size if draft_vocab is None else draft_vocab
    tag = f"{tag}-T{cfg.eval.temperature:g}-{cfg.dtype}" + (f"-v{vocab}" if vocab else "")
    return tag + ("-compiled" if cfg.eval.compile else "")


# eval keys that only place or split the same measurement; every other one (and every tree
# key) is a setting the numbers depend on
NOT_MEASURED = ("tag", "heads", "workers")


def _benchmark_digest(cfg: Config) -> str | None:
    """The benchmark file's `source_digest`; None when there is none to read now (a held-out
    benchmark whose prepared data is gone: made again, the eval is stale by its lineage)."""
    try:
        return source_digest(benchmark_source(cfg), cfg.eval.revision)
    except FileNotFoundError:
        return None


def changed_settings(recorded: dict, cfg: Config, tree: TreeSpec, head_path: str) -> list[str]:
    """Each eval or tree setting (and the head) an earlier results.json (`recorded`) was measured
    with that this eval's differs in, as "key: before -> now" (`differences`)."""
    now = {f"eval.{k}": v for k, v in vars(cfg.eval).items() if k not in NOT_MEASURED}
    now |= {f"tree.{k}": v for k, v in vars(tree).items()}
    now["head.path"] = os.path.normpath(head_path)
    if (digest := _benchmark_digest(cfg)) is not None:  # a benchmark file edited in place
        now["benchmark.sha256"] = digest
    now["target.revision"] = target_commit(cfg.target)  # a hub target updated since
    before = {f"eval.{k}": v for k, v in recorded["eval"].items()}
    before |= {f"tree.{k}": v for k, v in recorded["tree"].items()}
    before["head.path"] = os.path.normpath(recorded["head"]["path"])
    if recorded.get("benchmark_sha256") is not None:  # results before session 75 hold none
        before["benchmark.sha256"] = recorded["benchmark_sha256"]
    if "target_revision" in recorded:  # recorded since session 97
        before["target.revision"] = recorded["target_revision"]
    return differences(before, now)


def results_dir(cfg: Config, run: str, tree: TreeSpec, draft_vocab: int) -> Path:
    """runs/<run>/eval/<tag>: where this eval writes `run`'s results (`draft_vocab` 0: the
    head's own vocabulary)."""
    if run != cfg.run_name:  # an `eval.heads` run decodes its own head
        cfg = dataclasses.replace(cfg, head_path=None)
    return Path(cfg.runs_dir, run, "eval", Path(eval_tag(cfg, tree, draft_vocab)).name)
