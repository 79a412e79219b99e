"""Prepare -> collect -> train -> eval -> export, what is complete skipped (`draftsmith run`).

Each stage is skipped when its output is already complete (so a killed run is continued by
running the same command again); `stages=[...]` runs a subset, and the summary still lists the
others. The summary reports the eval this invocation's settings name, and points to the table
of all the run's evals.

Stages run in this process with the same typed config; a summary table of what each stage
produced and how long it took (also when an earlier invocation ran it: each run keeps
stage_seconds.json) is printed and written to runs/<run>/summary.{md,json}. With
`inputs_from=<run>` the prepare and collect stages belong to that run: they are found (or made)
there, so heads of several runs train on one collection.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from draftsmith.conf.schema import Config
from draftsmith.errors import InputError
from draftsmith.files import write_text_atomic
from draftsmith.heads.formats import SUPPORTED
from draftsmith.provenance import check_unchanged, export_dir, pin_target, upstream
from draftsmith.provenance import stale as is_stale
from draftsmith.tracking import check_wandb


def _done(cfg: Config, stage: str) -> bool:
    if stage == "prepare":
        return Path(cfg.stage_dir("prepare"), "stats.json").exists()
    if stage == "collect":
        index = Path(cfg.stage_dir("collect"), "index.json")
        return index.exists() and json.loads(index.read_text()).get("complete", False)
    if stage == "train":
        return Path(cfg.stage_dir("train"), "summary.json").exists()
    if stage == "eval":
        from draftsmith.inference.results import changed_settings, eval_tag

        # measured with this invocation's settings, not only into the folder they name
        results = Path(cfg.stage_dir("eval"), eval_tag(cfg), "results.json")
        return results.exists() and not changed_settings(
            json.loads(results.read_text()), cfg, cfg.tree, cfg.resolved_head_path()
        )
    return Path(export_dir(cfg)).exists()


def _stale(cfg: Config, stages: dict) -> set[str]:
    """The stages whose output (finished, or a training's checkpoints) was made from an input
    made again since, or one this invocation makes again (provenance)."""
    again: dict[str, bool] = {}  # stage -> this invocation makes its output (again)
    found: set[str] = set()
    for name in stages:
        c = _stage_config(cfg, name)
        up = upstream(c, name)
        kept = _done(c, name) or _resumable(c, name)
        if kept and up in stages and (again[up] or is_stale(c, name)):
            found.add(name)
        again[name] = name in cfg.stages and (name in found or not _done(c, name))
    return found


def _resumable(cfg: Config, stage: str) -> bool:
    """A training killed (or time-boxed) after a checkpoint, which the train stage continues."""
    return stage == "train" and Path(cfg.stage_dir("train"), "checkpoints", "latest").exists()


def _stage_config(cfg: Config, stage: str) -> Config:
    stage_cfg = dataclasses.replace(cfg, stage=stage)
    if stage in ("prepare", "collect") and cfg.inputs_from:
        # shared inputs live in the run they are read from (Config.input_dir)
        stage_cfg = dataclasses.replace(stage_cfg, run_name=cfg.inputs_from, inputs_from=None)
    return stage_cfg


def run(cfg: Config) -> dict:
    from draftsmith import export
    from draftsmith.inference import eval as evaluate
    from draftsmith.train import collect, launch, prepare

    stages = {
        "prepare": prepare.run,
        "collect": collect.run,
        "train": launch.run,  # in this process, or under DeepSpeed's launcher (launcher=)
        "eval": evaluate.run,
        "export": export.run,
    }
    if cfg.train.source == "online":
        stages.pop("collect")
    pin_target(cfg)  # one hub commit for every check and stage of this invocation
    stale = _stale(cfg, stages)
    # before anything runs: a finished output (or a training to resume) made with other settings
    # is not this run's (the prepared data and features `inputs_from` names are read as that run
    # made them; a stale output is made again anyway)
    for name in ("train",) if cfg.inputs_from else ("prepare", "collect", "train"):
        stage_cfg = _stage_config(cfg, name)
        kept = _done(stage_cfg, name) or _resumable(stage_cfg, name)
        if name in stages and kept and name not in stale:
            check_unchanged(stage_cfg, name)
    if cfg.tracking == "wandb":
        check_wandb()
    # an export the head has no format for would fail only after hours of training
    supported = SUPPORTED[cfg.head.name]
    if "export" in cfg.stages and cfg.export.format not in supported:
        raise InputError(
            f"format={cfg.export.format} does not serve {cfg.head.name} heads (they export to "
            f"{', '.join(supported)}): pass format=<one of them>, or leave export out of stages"
        )
    # as would a tree deeper than a Medusa or Hydra head's heads, or one that cannot verify
    # drawn children exactly at the eval's temperature, found only by the eval
    if "eval" in cfg.stages:
        cfg.tree.check_heads(getattr(cfg.head, "num_heads", None), cfg.head.name)
        cfg.tree.refuse_drawn(cfg.eval.temperature)
    rows = []
    stopped = False  # train.stop_after ended the training before its head was saved
    for name, fn in stages.items():
        stage_cfg = _stage_config(cfg, name)
        done = _done(stage_cfg, name) and name not in stale
        if name not in cfg.stages and not done:
            rows.append({"stage": name, "status": "not selected", "seconds": None})
            continue
        if stopped:
            # later stages read the finished head; the same command again continues the training
            rows.append({"stage": name, "status": "waiting for train", "seconds": None})
            continue
        if done:
            # the minutes it took when it ran (None: made before timings were kept)
            seconds = _timings(stage_cfg).get(_timing_key(stage_cfg, name))
            rows.append({"stage": name, "status": "already complete", "seconds": seconds})
            continue
        if name in stale:  # collect starts over by itself; a training starts afresh
            print(
                f"{name}: its output was made from {upstream(cfg, name)} output made again "
                "since; making it again"
            )
            if name == "export":
                overwrite = dataclasses.replace(stage_cfg.export, overwrite=True)
                stage_cfg = dataclasses.replace(stage_cfg, export=overwrite)
        t0 = time.perf_counter()
        result = fn(stage_cfg)
        seconds = time.perf_counter() - t0
        # a resumed training adds the seconds its earlier invocations spent on the steps it kept
        if isinstance(result, dict):
            seconds += result.get("seconds_before_resume", 0.0)
        # kept per run as each stage ends, so a later invocation still reports it
        timings = _timings(stage_cfg) | {_timing_key(stage_cfg, name): seconds}
        write_text_atomic(_timings_path(stage_cfg), json.dumps(timings, indent=2))
        stopped = isinstance(result, dict) and result.get("stopped_early", False)
        status = f"stopped at step {result['steps']} (train.stop_after)" if stopped else "done"
        rows.append({"stage": name, "status": status, "seconds": seconds})
    summary = {"run": cfg.run_name, "stages": rows, **_results(cfg)}
    out = Path(cfg.runs_dir, cfg.run_name)
    out.mkdir(parents=True, exist_ok=True)  # a run none of whose stages ran has no folder yet
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2))
    write_text_atomic(out / "summary.md", _markdown(summary))
    print(_markdown(summary))
    return summary


def _timings_path(cfg: Config) -> Path:
    return Path(cfg.runs_dir, cfg.run_name, "stage_seconds.json")


def _timing_key(cfg: Config, stage: str) -> str:
    """One entry per output: evals with other settings and exports to other formats differ."""
    if stage == "eval":
        from draftsmith.inference.results import eval_tag

        return f"eval/{eval_tag(cfg)}"
    return f"export/{cfg.export.format}" if stage == "export" else stage


def _timings(cfg: Config) -> dict[str, float]:
    path = _timings_path(cfg)
    return json.loads(path.read_text()) if path.exists() else {}


def _results(cfg: Config) -> dict:
    from draftsmith.inference.results import eval_tag

    found: dict = {}
    evals = Path(cfg.stage_dir("eval"))
    paths = {
        "data": Path(cfg.input_dir("prepare"), "stats.json"),
        "train": Path(cfg.stage_dir("train"), "summary.json"),
        "eval": evals / eval_tag(cfg) / "results.json",
    }
    for key, path in paths.items():
        if path.exists():
            found[key] = json.loads(path.read_text())
    # the summary reports this invocation's eval; the run's other evals (other trees, tags) are
    # all in the table eval writes beside them
    count = len(list(evals.glob("*/results.json")))
    if count > 1:
        found["evals"] = {"count": count, "table": str(evals / "summary.md")}
    return found


def _minutes(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 60:.1f}"


def _regenerated(data: dict) -> str:
    """Whose answers the head learns: the target's for how many conversations (data.regen.rows
    may leave the rest their own)."""
    if not data.get("regenerated"):
        return ""
    count = data.get("regenerated_rows", {}).get("train")  # (records before it: no count)
    whose = "the answers" if count is None else f"the answers of {count} conversations"
    return f"; the target regenerated {whose}"


def _skipped(data: dict) -> str:
    """How many rows prepare skipped, reading or rendering (stats.json says which and why)."""
    read = data.get("source", {}).get("skipped", {})  # (records older than these keys: none)
    count = sum(read.values()) + sum(data.get("skipped", {}).values())
    return f"; {count} rows skipped (prepare/stats.json names them)" if count else ""


def _markdown(summary: dict) -> str:
    lines = [
        f"## draftsmith run `{summary['run']}`",
        "",
        "| stage | status | minutes |",
        "|---|---|---:|",
    ]
    lines += [
        f"| {r['stage']} | {r['status']} | {_minutes(r['seconds'])} |" for r in summary["stages"]
    ]
    if "data" in summary:
        d = summary["data"]
        lines += [
            "",
            f"data: {d['rows']['train']} training conversations, "
            f"{d['tokens']['train']} tokens ({d['masked_tokens']['train']} under the loss mask)"
            + _regenerated(d)
            + _skipped(d),
        ]
    if "train" in summary:
        lines += [
            f"training: {summary['train'].get('steps')} steps, best held-out simulated tau "
            f"{summary['train'].get('best_heldout_sim_tau', float('nan')):.2f}"
        ]
    if "eval" in summary:
        from draftsmith.inference.report import output_tau

        e = summary["eval"]
        line = (
            f"eval ({e['eval']['benchmark']}, {e['prompts']} prompts, {e['machine']['dtype']}):"
            f" tau {e['tau']:.2f}"
        )
        if (out := output_tau(e)) is not None:  # (results before session 35: no per-prompt records)
            line += f" ({out:.2f} output tokens per forward)"
        if e["speedup"]:  # no baselines decoded: tau only
            speed = ", ".join(f"{k.removeprefix('vs_')} {v:.2f}x" for k, v in e["speedup"].items())
            line += f"; speedup over {speed}"
        if e["mismatch"]["checked"]:
            line += f"; greedy mismatches {e['mismatch']['prompts']}/{e['prompts']}"
        lines.append(line)
    if "evals" in summary:
        lines.append(
            f"all {summary['evals']['count']} evals of this run: {summary['evals']['table']}"
        )
    return "\n".join(lines) + "\n"
