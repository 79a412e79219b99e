"""What a finished stage's output was made from, so it is never taken for one made with other
settings: prepare writes `<stage dir>/settings.json` when it completes (with a digest of the data
source's files, so one edited in place is other data, or the commit a hub dataset was read at),
train when it starts (so a training killed mid-way is resumed only with the settings its
checkpoints were made with);
collect's index.json records its own (target, dtypes).

Lineage: prepare, collect and train give each finished output an id ("made": in stats.json,
index.json, summary.json); what reads one records the id it read ("inputs": collect's index,
train's settings, written when it starts; an eval's results under "head", an export in the
run's export/made_from.json).
An output whose recorded input is no longer the one there (its input made again since: a
deleted training trained again, data prepared again) is stale, and `draftsmith run` makes it
again rather than report it as made from what is there now.

`draftsmith run` skips a stage whose output is complete (and resumes a training that has a
checkpoint), and prepare skips itself the same way; before either does, and before a training
resumes, `check_unchanged` compares the recorded settings with this invocation's and
refuses a difference, naming the keys (e.g. `data.limit: 800 -> 2000` after a quick run: the
output would otherwise be reported as this invocation's). Only what changes the output counts:
cadence, batching and worker counts do not. Outputs made before records were kept, or by a stage
whose record is missing, are not checked; nor, in `draftsmith run`, the prepared data and features
`inputs_from` names (read as that run made them).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path
from typing import Any

from draftsmith.conf.schema import Config
from draftsmith.conversations import source_digest
from draftsmith.errors import InputError
from draftsmith.files import write_text_atomic
from draftsmith.target import chat_template_digest, target_commit

RECORD = "settings.json"
# collect's settings under the names its index.json gives them
COLLECT_INDEX = {
    "target.path": "target_path",
    "target.revision": "target_revision",
    "dtype": "compute_dtype",
    "collect.storage_dtype": "storage_dtype",
}

# keys of a stage's sections that do not change what it writes (how fast, how often, where logged)
IGNORED = {
    "data": {"preview"},
    "data.regen": {
        "engine",
        "batch_size",
        "servers",
        "server_model",
        "server_timeout",
        "max_batch_tokens",
        "chunk_rows",
        "attn_implementation",
    },
    "train": {
        "log_every",
        "eval_every",
        "save_every",
        "keep_last",
        "stop_after",
        "nan_policy",
        "gradient_checkpointing",
        "eval_rows",
    },
}


def _flat(prefix: str, section: Any) -> dict[str, Any]:
    """A config section as {"prefix.key": value}, nested sections flattened, ignored keys out."""
    values = section if isinstance(section, dict) else dataclasses.asdict(section)
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if key in IGNORED.get(prefix, ()):
            continue
        if isinstance(value, dict) and f"{prefix}.{key}" in IGNORED:  # a nested section
            flat |= _flat(f"{prefix}.{key}", value)
        else:
            flat[f"{prefix}.{key}"] = value
    return flat


def stage_settings(cfg: Config, stage: str) -> dict[str, Any]:
    """The settings `stage`'s output depends on, flattened to "section.key" names."""
    # a hub target's commit: its branch moved on since is another target
    target = {"target.path": cfg.target.path, "target.revision": target_commit(cfg.target)}
    if stage == "prepare":
        data = _flat("data", cfg.data)
        if not cfg.data.regenerate:  # answers are the data's own: how to regenerate is moot
            data = {k: v for k, v in data.items() if not k.startswith("data.regen.")}
        settings = {
            **target,
            "target.chat_template": chat_template_digest(cfg.target.chat_template),
            "target.chat_template_kwargs": cfg.target.chat_template_kwargs,
            "seed": cfg.seed,
            **data,
        }
        # the data's content: a file edited in place under the same data.path, or a hub dataset
        # at another commit, is other data; a source not here to read now (not fetched, moved
        # away, the hub offline) is not compared
        if (digest := source_digest(cfg.data.path, cfg.data.revision)) is not None:
            settings["data.sha256"] = digest
    elif stage == "collect":
        # the aux layers are checked against the head's when training reads the features
        settings = {
            **target,
            "dtype": cfg.dtype,
            "collect.storage_dtype": cfg.collect.storage_dtype,
        }
    elif stage == "train":
        settings = {
            **target,
            "dtype": cfg.dtype,
            "seed": cfg.seed,
            "inputs_from": cfg.inputs_from,
            **_flat("train", cfg.train),
            **_flat("head", cfg.head),
        }
    else:
        raise ValueError(f"no settings are recorded for stage {stage!r}")
    return settings


def pin_target(cfg: Config) -> None:
    """Set cfg.target.revision to the commit a hub target is at now (`target_commit`), so every
    load of this stage reads the commit its records name (a no-op for a target on this
    machine)."""
    cfg.target = dataclasses.replace(cfg.target, revision=target_commit(cfg.target))


def record(cfg: Config, stage: str, settings: dict[str, Any] | None = None) -> None:
    """Write what prepare's or train's output is made from into its folder (`settings`: taken
    when the stage began; building a head fills defaults into cfg.head)."""
    settings = stage_settings(cfg, stage) if settings is None else settings
    write_text_atomic(Path(cfg.stage_dir(stage), RECORD), json.dumps(settings, indent=2))


def _recorded(folder: Path, stage: str) -> dict[str, Any]:
    """The settings `stage`'s output records ({}: none, so nothing is compared)."""
    if stage == "collect":  # what collect's index.json says it collected
        i = _json(folder / "index.json")
        return {key: i[name] for key, name in COLLECT_INDEX.items() if name in i}
    return _json(folder / RECORD)


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def differences(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """ "key: before -> now" for each key whose value differs; a key `before` lacks (a setting
    added since it was recorded) is not compared."""
    now = json.loads(json.dumps(now))  # tuples as lists, as a record reads back
    return [f"{k}: {before[k]} -> {v}" for k, v in now.items() if k in before and before[k] != v]


def check_unchanged(cfg: Config, stage: str, now: dict[str, Any] | None = None) -> None:
    """Refuse to take `stage`'s output (finished, or a training's checkpoints) as this
    invocation's when it was made with other settings than `now` (default: cfg's); nothing
    recorded: not checked."""
    folder = Path(cfg.stage_dir(stage))
    now = stage_settings(cfg, stage) if now is None else now
    if changes := differences(_recorded(folder, stage), now):
        # another head or budget on the same data needs no new preparation or collection
        reuse = f" (inputs_from={cfg.run_name} reuses its data and features)" * (stage == "train")
        raise InputError(
            f"{folder} was made with other settings ({'; '.join(changes)}), so it is not this "
            f"invocation's {stage} output: go back to its settings, pick another run_name"
            f"{reuse}, or delete {folder} to make it again"
        )


# the stage whose output each stage reads (train: collect's features, or prepare's data online)
UPSTREAM = {"collect": "prepare", "train": "collect", "eval": "train", "export": "train"}
EXPORTS = "made_from.json"  # in the run's export folder: {export folder: the head's id}


def new_id() -> str:
    return uuid.uuid4().hex[:12]


def upstream(cfg: Config, stage: str) -> str | None:
    if stage == "train" and cfg.train.source == "online":
        return "prepare"
    return UPSTREAM.get(stage)


def made(cfg: Config, stage: str) -> str | None:
    """The id of `stage`'s finished output (None: none, or made before ids were kept)."""
    if stage == "prepare":
        return _json(Path(cfg.input_dir("prepare"), "stats.json")).get("made")
    if stage == "collect":
        index = _json(Path(cfg.input_dir("collect"), "index.json"))
        return index.get("made") if index.get("complete") else None
    if stage == "train":
        return head_made(cfg.resolved_head_path())
    raise ValueError(f"stage {stage!r} has no output others read")


def head_made(head_path: str) -> str | None:
    """The id of the training that wrote the head at `head_path` (a run's train/head)."""
    path = Path(head_path)
    return _json(path.parent / "summary.json").get("made") if path.name == "head" else None


def made_from(cfg: Config, stage: str) -> str | None:
    """The id of the input `stage`'s output (finished, or a training's checkpoints) was made
    from (None: no output, or one made before ids were kept)."""
    if stage == "collect":
        return _json(Path(cfg.stage_dir("collect"), "index.json")).get("inputs")
    if stage == "train":  # recorded when it starts, so its checkpoints have it too
        return _json(Path(cfg.stage_dir("train"), RECORD)).get("inputs")
    if stage == "eval":
        from draftsmith.inference.results import eval_tag

        results = _json(Path(cfg.stage_dir("eval"), eval_tag(cfg), "results.json"))
        return results.get("head", {}).get("made")
    if stage == "export":
        return _json(Path(cfg.stage_dir("export"), EXPORTS)).get(export_dir(cfg))
    raise ValueError(f"stage {stage!r} reads no other stage's output")


def export_dir(cfg: Config) -> str:
    return cfg.export.out or f"{cfg.stage_dir('export')}/{cfg.export.format}"


def record_export(cfg: Config) -> None:
    """Note which training's head the export folder was made from."""
    path = Path(cfg.stage_dir("export"), EXPORTS)
    path.parent.mkdir(parents=True, exist_ok=True)  # not made by an export to another folder
    exports = _json(path) | {export_dir(cfg): head_made(cfg.resolved_head_path())}
    write_text_atomic(path, json.dumps(exports, indent=2))


def stale(cfg: Config, stage: str) -> bool:
    """`stage`'s output was made from an input that has been made again since."""
    before = made_from(cfg, stage)
    now = made(cfg, upstream(cfg, stage))
    return None not in (before, now) and before != now
