"""Typed schemas for every config group. Plain dataclasses: no Hydra import here.

Registered in Hydra's ConfigStore by `draftsmith.config`; YAML files in `conf/<group>/` only set
values. Field comments are the documentation Hydra users see when they open the schema.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from draftsmith.inference.tree import TreeSpec


def _check(value: str, allowed: tuple[str, ...], key: str) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not one of {list(allowed)}")


@dataclass
class TargetConfig:
    # local folder, hub id, embedded asset name, or "tiny-random-llama"
    path: str = MISSING
    # run model code shipped with the checkpoint; off unless the user turns it on
    trust_remote_code: bool = False


@dataclass
class DataConfig:
    # conversations: file, folder, HF dataset id or asset name (sharegpt, mt-bench, humaneval)
    path: str = MISSING
    # keep at most this many valid conversations (null = all)
    limit: int | None = None
    # "auto" = the tokenizer's chat template; "plain" = role-prefixed text for template-less models
    template: str = "auto"
    # longest tokenized conversation kept, in tokens
    max_len: int = 2048
    # what to do with longer conversations: "truncate" or "drop"
    length_policy: str = "truncate"

    def __post_init__(self) -> None:
        _check(self.template, ("auto", "plain"), "data.template")
        _check(self.length_policy, ("truncate", "drop"), "data.length_policy")


@dataclass
class EvalConfig:
    # prompts: mt-bench | humaneval | heldout (prepared data) | a JSON/JSONL file of prompts
    benchmark: str = "mt-bench"
    # first N prompts (null = all); only the first user turn of each is decoded
    limit: int | None = 80
    max_new_tokens: int = 128
    # 0 = greedy; otherwise sampling with these warpers, identical for every method
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    # baselines decoded interleaved with speculation: "vanilla" (generate) and/or "lookup"
    # (transformers' prompt-lookup assisted generation)
    baselines: list[str] = field(default_factory=lambda: ["vanilla", "lookup"])
    # prompt lookup: tokens proposed per step
    lookup_tokens: int = 10
    # results subfolder of runs/<run>/eval/ (empty = named after the tree settings)
    tag: str = ""

    def __post_init__(self) -> None:
        for b in self.baselines:
            _check(b, ("vanilla", "lookup"), "eval.baselines")


@dataclass
class Config:
    # which CLI stage is running (set by the `draftsmith` dispatcher)
    stage: str = "none"
    # every stage reads and writes runs/<run_name>/<stage>/
    run_name: str = "default"
    runs_dir: str = "runs"
    seed: int = 0
    # "cpu" or "cuda"
    device: str = "cpu"
    # target compute dtype: float32 | bfloat16 | float16
    dtype: str = "float32"
    # "none" (local JSONL only) or "wandb"
    tracking: str = "none"
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # a head config from conf/head/ (typed per head: Eagle3Config, MedusaConfig, ...)
    head: Any = MISSING
    # an existing head folder for eval/export (null = runs/<run_name>/train/head)
    head_path: str | None = None
    tree: TreeSpec = field(default_factory=TreeSpec)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # free-form extras an experiment file may carry (notes, tags)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(self.dtype, ("float32", "bfloat16", "float16"), "dtype")
        _check(self.tracking, ("none", "wandb"), "tracking")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device={self.device!r}: expected 'cpu' or 'cuda[:n]'")

    def resolved_head_path(self) -> str:
        return self.head_path or f"{self.stage_dir('train')}/head"

    def stage_dir(self, stage: str | None = None) -> str:
        """runs/<run_name>/<stage>: where a stage writes and the next stage looks."""
        return f"{self.runs_dir}/{self.run_name}/{stage or self.stage}"
