"""Draft heads. `HEADS` maps a head name to its (config class, head class); adding a head is one
file, one line here, one conf/head/<name>.yaml and one test file."""

from __future__ import annotations

from pathlib import Path

from draftsmith.errors import InputError, MissingInput
from draftsmith.heads.base import (
    DraftHead,
    HeadBatch,
    HeadConfig,
    TargetInfo,
    TargetParts,
    load_weights,
    read_head_config,
)
from draftsmith.heads.eagle1 import Eagle1Config, Eagle1Head
from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
from draftsmith.heads.hydra import HydraConfig, HydraHead
from draftsmith.heads.medusa import MedusaConfig, MedusaHead

HEADS: dict[str, tuple[type[HeadConfig], type[DraftHead]]] = {
    "eagle1": (Eagle1Config, Eagle1Head),
    "eagle3": (Eagle3Config, Eagle3Head),
    "medusa": (MedusaConfig, MedusaHead),
    "hydra": (HydraConfig, HydraHead),
}


def build_head(config: HeadConfig | dict, target: TargetInfo) -> DraftHead:
    """Build a head from its config (dataclass or plain dict with a `name`) and the target info."""
    name = config["name"] if isinstance(config, dict) else config.name
    if name not in HEADS:
        raise InputError(f"unknown head {name!r}; known: {sorted(HEADS)}")
    config_class, head_class = HEADS[name]
    if isinstance(config, dict):
        config = config_class(**config)
    return head_class(config, target)


def head_folder(name_or_path: str | Path) -> Path:
    """A local head folder, or a hub repo id ("owner/name", as heads are published) fetched into
    the hub cache: its config and weight files only."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    from draftsmith.heads.formats import PICKLE_FILES, SAFETENSORS_FILES
    from draftsmith.target import local_only

    how = "train one with `draftsmith train`, or pass head_path=<folder or hub id>"
    text = str(name_or_path)
    if local_only(text) or "/" not in text:  # heads are published as owner/name
        raise MissingInput(f"{name_or_path}: no such head folder ({how})")

    try:
        # offline, the cached snapshot of the repo's main branch is used
        fetched = snapshot_download(
            text, allow_patterns=["config.json", *SAFETENSORS_FILES, *PICKLE_FILES]
        )
    except Exception as err:  # no such repo, no network and no cached copy, a malformed id
        raise MissingInput(
            f"{name_or_path}: no such head folder, and no hub head of that id could be fetched "
            f"({how}; {type(err).__name__}: {err})"
        ) from None
    return Path(fetched)


def load_head(folder: str | Path, target: TargetInfo | None = None) -> DraftHead:
    """Load a head folder or hub id (`head_folder`): ours (config.json + model.safetensors,
    refused if built for another target) or a foreign one (official EAGLE/EAGLE-3, speculators,
    Medusa), imported for `target`."""
    import json

    from draftsmith.heads.formats import import_head

    folder = head_folder(folder)
    config_path = Path(folder) / "config.json"
    if config_path.exists() and "draftsmith_head" in json.loads(config_path.read_text()):
        data = read_head_config(folder)
        built_for = TargetInfo(**data["target"])
        if target is not None:
            built_for.check_compatible(target, f"head {folder}")
        head = build_head({**data["head_config"], "name": data["draftsmith_head"]}, built_for)
        return load_weights(head, folder)
    if target is None:
        raise InputError(f"{folder}: a foreign head folder needs the target's TargetInfo to import")
    return import_head(folder, target)


__all__ = [
    "HEADS",
    "DraftHead",
    "HeadBatch",
    "HeadConfig",
    "TargetInfo",
    "TargetParts",
    "build_head",
    "head_folder",
    "load_head",
]
