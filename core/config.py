"""Hydra glue: register the schemas and the `by_dtype` resolver, compose configs, and convert
them once to dataclasses; save a composed config and load it back (what launched ranks read).

Only the CLI entry points, the launcher and tests call this module; everything downstream
receives the typed `Config` dataclass, never a DictConfig.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from draftsmith.conf import CONF_DIR
from draftsmith.conf.schema import (
    Config,
    DataConfig,
    DeepSpeedConfig,
    EvalConfig,
    ExportConfig,
    TargetConfig,
    TrainConfig,
)
from draftsmith.errors import InputError
from draftsmith.files import write_text_atomic
from draftsmith.heads import HEADS
from draftsmith.inference.tree import TreeSpec

CONFIG_NAME = "draftsmith"


def by_dtype(sixteen_bit: Any, fp32: Any, *, _root_: DictConfig) -> Any:
    """`${by_dtype:A,B}`: A when the run computes in bf16/fp16 (CUDA, or a CPU with bf16
    instructions under dtype=auto), B in float32. The quick preset's stages took 3-8x as long
    in fp32 on an AVX2-only CPU as in bf16 on one with AMX (collection 15.6 against 1.9 min),
    so a preset with a time budget takes less data there."""
    from draftsmith.target import native_dtype

    dtype = _root_.dtype if _root_.dtype != "auto" else native_dtype(_root_.device)
    return fp32 if dtype == "float32" else sixteen_bit


def register_schemas() -> None:
    if not OmegaConf.has_resolver("by_dtype"):
        OmegaConf.register_new_resolver("by_dtype", by_dtype)
    cs = ConfigStore.instance()
    # outside the groups, so `--help` lists each group's presets without them; a group's
    # files extend theirs by absolute path (`- /tree_schema@_here_`)
    cs.store(name="draftsmith_schema", node=Config)
    cs.store(name="target_schema", node=TargetConfig)
    cs.store(name="data_schema", node=DataConfig)
    cs.store(name="tree_schema", node=TreeSpec)
    cs.store(name="eval_schema", node=EvalConfig)
    cs.store(name="export_schema", node=ExportConfig)
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="deepspeed_schema", node=DeepSpeedConfig)
    for name, (config_class, _) in HEADS.items():
        cs.store(name=f"{name}_schema", node=config_class)


def _unknown_keys(raw: Any, typed: Any, where: str) -> list[str]:
    """Keys present in the composed config but absent from the dataclass (to_object drops them)."""
    if not isinstance(raw, dict) or not dataclasses.is_dataclass(typed):
        return []
    names = {f.name for f in dataclasses.fields(typed)}
    unknown = [f"{where}{k}" for k in raw if k not in names]
    for k in raw:
        if k in names:
            unknown += _unknown_keys(raw[k], getattr(typed, k), f"{where}{k}.")
    return unknown


def to_typed(cfg: DictConfig) -> Config:
    """DictConfig -> Config dataclass; fail loudly on keys the schema does not know."""
    raw = OmegaConf.to_container(cfg, resolve=True)
    typed = OmegaConf.to_object(cfg)
    if not isinstance(typed, Config):
        raise TypeError(f"composed config is {type(typed).__name__}, expected Config")
    unknown = _unknown_keys(raw, typed, "")
    if unknown:
        raise InputError(f"unknown config keys (typo or missing schema field?): {unknown}")
    return typed


def compose(overrides: list[str] | None = None) -> Config:
    """Compose the config as the CLI would (for tests and notebooks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_schemas()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_typed(hydra_compose(config_name=CONFIG_NAME, overrides=overrides or []))


def save_config(cfg: Config, path: str | Path) -> None:
    """`cfg` as YAML, every value resolved, for `load_config` (how launched ranks get the very
    config of the process that launched them, however it was made)."""
    write_text_atomic(path, OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def load_config(path: str | Path) -> Config:
    """The Config `save_config` wrote; the head's fields typed by the head it names."""
    raw = OmegaConf.load(path)
    schema = OmegaConf.structured(Config(head=HEADS[raw.head.name][0]()))
    return to_typed(OmegaConf.merge(schema, raw))
