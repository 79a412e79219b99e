"""Typed schemas for every config group. Plain dataclasses: no Hydra import here.

Registered in Hydra's ConfigStore by `draftsmith.config`; YAML files in `conf/<group>/` only set
values. Field comments are the documentation Hydra users see when they open the schema.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from draftsmith.errors import InputError
from draftsmith.heads.formats import FORMATS
from draftsmith.inference.tree import TreeSpec


def _check(value: str, allowed: tuple[str, ...], key: str) -> None:
    if value not in allowed:
        raise InputError(f"{key}={value!r} is not one of {list(allowed)}")


def _at_least(section: str, config: Any, least: float, *names: str) -> None:
    """Refuse a count, size or rate of `config` below `least` (None: unset), naming the key, when
    the config is built: mid-stage it would be a ZeroDivisionError after hours of work, or
    nothing at all (train.keep_last=0 kept every checkpoint)."""
    for name in names:
        value = getattr(config, name)
        if value is not None and value < least:
            raise InputError(f"{section}.{name}={value} must be >= {least}")


def _fraction(key: str, value: float, below_one: bool = False) -> None:
    """Refuse a ratio outside [0, 1], or a decay (`below_one`: Adam's betas, a momentum)
    outside [0, 1)."""
    if not (0 <= value < 1 if below_one else 0 <= value <= 1):
        raise InputError(f"{key}={value} must be in [0, 1{')' if below_one else ']'}")


@dataclass
class TargetConfig:
    # local folder, hub id, embedded asset name, or "tiny-random-llama"
    path: str = MISSING
    # a hub target's branch, tag or commit (null: its default branch); prepare, collect, train
    # and eval load the commit it is at and record it, so a target updated on the hub since is
    # another
    revision: str | None = None
    # run model code shipped with the checkpoint; off unless the user turns it on
    trust_remote_code: bool = False
    # extra variables for the chat template wherever prompts and conversations are rendered
    # (prepare's loss masks and regeneration prompts, eval and generate prompts), e.g.
    # {enable_thinking: false} for Qwen3's non-thinking mode
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # a chat template (a Jinja file, or its text) instead of the tokenizer's own, in the same
    # renderings: e.g. one that writes tool calls, for a target whose own template drops them
    chat_template: str | None = None
    # where the target decodes (eval, with the heads; regeneration), pack its frozen bf16 or fp32
    # linear weights for oneDNN on CPU first (draftsmith.packed: in bf16 the same outputs bit for
    # bit, decoding ~25% faster on SmolLM2; in fp32 within rounding, ~20% faster on AVX2). Off
    # keeps the weights as loaded, e.g. when a second copy of them would not fit in memory. With
    # eval.compile they stay unpacked (the two were never measured together).
    pack_linears: bool = True


@dataclass
class SamplingKeys:
    """The sampling keys eval, generate and regeneration share: 0 temperature = greedy;
    otherwise sampling with these warpers, in transformers' order
    (draftsmith.inference.verify.Sampling)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def check_sampling(self, group: str) -> None:
        """Values transformers' warpers accept, checked when the config is built rather than
        mid-stage."""
        t, p, k = self.temperature, self.top_p, self.top_k
        if t < 0 or not 0 < p <= 1 or k < 0:
            raise InputError(
                f"{group}.temperature={t} must be >= 0, {group}.top_p={p} in (0, 1]"
                + (f" and {group}.top_k={k} >= 0" if k else "")
            )


@dataclass
class RegenConfig(SamplingKeys):
    # (temperature / top_p / top_k: SamplingKeys; 0 temperature = greedy)
    # new tokens per answer
    max_new_tokens: int = 256
    # "padded": length-sorted, left-padded batches; a row leaves the batch and its KV cache at
    # EOS. "generate": transformers generate() on the same batches (finished rows keep stepping
    # until the longest answer ends). "continuous": transformers generate_batch() (continuous
    # batching: a finished row's slot is refilled at once). "server": OpenAI-compatible servers
    # running the target (`servers` below; draftsmith.train.regen_server)
    engine: str = "padded"
    # rows generated together (with engine=server: prompts per request); SmolLM2 on 2 CPU cores:
    # batch 32 gives 4.6x the tokens/s of batch 1 (scripts/bench_data.py, 256 new tokens)
    batch_size: int = 32
    # engine=server: base URLs of servers running the target, e.g. [http://localhost:8000/v1]
    # (vllm serve, python -m sglang.launch_server, trtllm-serve); requests are spread over them
    servers: list[str] = field(default_factory=list)
    # engine=server: the name the servers know the target by (null: the first of /v1/models)
    server_model: str | None = None
    # engine=server: seconds one request (batch_size prompts) may take
    server_timeout: float = 600.0
    # continuous engine: most tokens in one forward (prompts are prefilled in chunks of this)
    max_batch_tokens: int = 512
    # conversations per resumable chunk file
    chunk_rows: int = 64
    # attention backend of the generating target: on CPU, transformers' eager attention decodes
    # ~1.4x faster than SDPA at batch 32 (torch's CPU SDPA kernel is slow for 1-token queries);
    # use "sdpa" (or "flash_attention_2") on GPUs
    attn_implementation: str = "eager"
    # longer prompts are skipped (and logged)
    max_prompt_len: int = 1024
    # regenerate only the first N conversations of each split (null = all); the rest keep
    # their original answers (regeneration is the slow part of prepare on a CPU)
    rows: int | None = None

    def __post_init__(self) -> None:
        self.check_sampling("data.regen")
        names = ("max_new_tokens", "batch_size", "max_batch_tokens", "chunk_rows", "max_prompt_len")
        _at_least("data.regen", self, 1, *names)
        _at_least("data.regen", self, 0, "rows")  # 0: none regenerated
        if self.server_timeout <= 0:
            raise InputError(f"data.regen.server_timeout={self.server_timeout} must be > 0")
        _check(self.engine, ("padded", "generate", "continuous", "server"), "data.regen.engine")
        if self.engine == "server" and not self.servers:
            raise InputError(
                "data.regen.engine=server needs data.regen.servers=[http://HOST:PORT/v1,...], "
                "OpenAI-compatible servers running the target"
            )


@dataclass
class DataConfig:
    # conversations: file, folder, HF dataset id or asset name (sharegpt, mt-bench, humaneval)
    path: str = MISSING
    # keep at most this many valid conversations (null = all)
    limit: int | None = None
    # a dataset's split (hub id or saved folder): null = "train", or its first if it has none
    split: str | None = None
    # a hub dataset's branch, tag or commit (null: its default branch); prepare reads the commit
    # it is at and records it, so a dataset updated on the hub since is other data
    revision: str | None = None
    # "auto" = the tokenizer's chat template; "plain" = role-prefixed text for template-less models
    template: str = "auto"
    # longest tokenized conversation kept, in tokens
    max_len: int = 2048
    # what to do with longer conversations: "truncate" or "drop"
    length_policy: str = "truncate"
    # only each conversation's last reply under the loss mask (SpecForge's
    # train_only_last_turn): thinking models' templates show earlier replies without their
    # reasoning, so only the last is rendered as the model wrote it
    last_reply_only: bool = False
    # conversations held out (after a seeded shuffle) for validation and eval.benchmark=heldout;
    # at least 1: training keeps its best head by their simulated tau
    heldout: int = 32
    # `text` rows are conversations already rendered with the target's chat template
    # (SpecForge's is_preformatted): tokenized as they are, each reply learned from what the
    # template writes after a user turn (its end, the generation prompt) to the end-of-turn
    # marker; eval prompts one with its text up to its first reply. Off: a `text` row is a prompt
    preformatted: bool = False
    # let the target answer every user turn itself (self-distillation)
    regenerate: bool = False
    regen: RegenConfig = field(default_factory=RegenConfig)
    # conversations `draftsmith preview` shows rendered, the tokens a head learns marked
    preview: int = 3

    def __post_init__(self) -> None:
        _check(self.template, ("auto", "plain"), "data.template")
        _check(self.length_policy, ("truncate", "drop"), "data.length_policy")
        _at_least("data", self, 1, "limit", "preview")
        _at_least("data", self, 2, "max_len")  # a position and the token after it
        if self.heldout < 1:  # training keeps its best head by them; eval.benchmark=heldout too
            raise InputError(
                f"data.heldout={self.heldout}: training picks its best head by held-out "
                "simulated tau, so at least 1 conversation is held out"
            )
        if self.preformatted and self.regenerate:
            raise InputError(
                "data.preformatted=true with data.regenerate=true: a rendered text row has no "
                "user turns apart for the target to answer"
            )


@dataclass
class CollectConfig:
    # EAGLE-3 layers to capture ("input of layer k"); empty = the head's, else [2, n//2, n-3]
    aux_layers: list[int] = field(default_factory=list)
    # on-disk feature dtype: float16 | bfloat16
    storage_dtype: str = "float16"
    # padded tokens per target forward (rows are length-bucketed)
    tokens_per_batch: int = 8192
    # tokens per shard file
    shard_tokens: int = 131072
    # processes collecting shards side by side, each with its own copy of the target: on GPUs
    # (device=cuda) worker r uses cuda:r; on a CPU they split its cores
    workers: int = 1

    def __post_init__(self) -> None:
        _check(self.storage_dtype, ("float16", "bfloat16"), "collect.storage_dtype")
        _at_least("collect", self, 1, "tokens_per_batch", "shard_tokens", "workers")


@dataclass
class TrainConfig:
    # "offline" reads runs/<run>/collect shards; "online" runs the target inside training
    source: str = "offline"
    epochs: int = 1
    # stop after this many optimizer steps (null = run all epochs)
    max_steps: int | None = None
    # sequences per micro-batch per rank, and micro-batches accumulated per optimizer step
    micro_batch_size: int = 4
    grad_accum: int = 1
    # longest sequence used in training (tokens; longer rows are cut)
    max_len: int = 1024
    # "adamw", or "muon": DeepSpeed's Muon (momentum, then the update orthogonalized by
    # Newton-Schulz iterations) for the head's matrices at `muon_lr`, and Adam at `lr` for norms,
    # biases and lm_heads. Muon needs deepspeed=zero0 while grad_clip is set (see Config)
    optimizer: str = "adamw"
    lr: float = 3e-4
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    # "standard" iterates in bf16; DeepSpeed's default "gram" in fp16, which CPUs without fp16
    # matrix units run slowly (the quick preset's training: 5.9 min against 4.1, same tau)
    muon_ns_method: str = "standard"
    weight_decay: float = 0.0
    # AdamW betas as in EAGLE-3
    beta1: float = 0.9
    beta2: float = 0.95
    warmup_steps: int = 50
    # lr schedule after warmup: cosine | linear | constant; floor as a fraction of lr
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    grad_clip: float = 0.5
    # cadence, in optimizer steps
    log_every: int = 10
    eval_every: int = 200
    save_every: int = 500
    # DeepSpeed checkpoints kept (oldest deleted first)
    keep_last: int = 2
    # non-finite loss: "stop" (error naming step, rows, last checkpoint) or "skip" the batch
    nan_policy: str = "stop"
    # recompute the head's activations in backward (less memory, more time)
    gradient_checkpointing: bool = False
    # heldout rows evaluated at each eval (null = all)
    eval_rows: int | None = 256
    # end this invocation after N steps without finishing (time-boxed jobs; resume=true goes on)
    stop_after: int | None = None
    # start from a trained head's weights and draft vocabulary (a head folder: another run's
    # train/head, or a foreign head `load_head` imports) instead of a random init; its shapes
    # must match `head`. The optimizer and lr schedule start fresh (resume=true continues a run)
    init_from: str | None = None
    # positions the head learns to predict: "assistant" (the loss mask, as EAGLE does) or "all"
    # real tokens (user turns and templates too: the target's features and top-1 exist there as
    # well). Held-out evaluation always scores assistant tokens.
    loss_on: str = "assistant"

    def __post_init__(self) -> None:
        _check(self.source, ("offline", "online"), "train.source")
        _check(self.loss_on, ("assistant", "all"), "train.loss_on")
        _check(self.optimizer, ("adamw", "muon"), "train.optimizer")
        _check(self.muon_ns_method, ("standard", "gram"), "train.muon_ns_method")
        _check(self.schedule, ("cosine", "linear", "constant"), "train.schedule")
        _check(self.nan_policy, ("stop", "skip"), "train.nan_policy")
        # max_steps, when set, replaces epochs; zero steps would save an untrained head
        counts = ("micro_batch_size", "grad_accum", "max_steps", "stop_after", "eval_rows")
        _at_least("train", self, 1, *counts, "log_every", "eval_every", "save_every", "keep_last")
        _at_least("train", self, 1 if self.max_steps is None else 0, "epochs")
        _at_least("train", self, 2, "max_len")
        # 0: none (lr 0 keeps those weights as they start)
        _at_least("train", self, 0, "warmup_steps", "weight_decay", "grad_clip", "lr", "muon_lr")
        for name in ("beta1", "beta2", "muon_momentum"):
            _fraction(f"train.{name}", getattr(self, name), below_one=True)
        _fraction("train.min_lr_ratio", self.min_lr_ratio)


@dataclass
class DeepSpeedConfig:
    # ZeRO stage 0 (plain data parallel), 1 (optimizer states), 2 (+ gradients), 3 (+ parameters)
    zero_stage: int = 2
    # move optimizer states to CPU memory (ZeRO 1-3)
    offload_optimizer: bool = False
    # extra DeepSpeed JSON keys merged last (e.g. {"communication_data_type": "fp32"})
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise InputError(f"deepspeed.zero_stage={self.zero_stage} must be 0, 1, 2 or 3")
        for mode in ("bf16", "fp16"):
            section = self.extra.get(mode)
            if isinstance(section, dict) and section.get("enabled"):
                raise InputError(
                    f"deepspeed.extra.{mode}.enabled: DeepSpeed's {mode} mode would hold the "
                    "head's weights in half precision against the target's fp32 features; "
                    "set dtype=bfloat16 instead (bf16 autocast over fp32 master weights)"
                )


@dataclass
class ExportConfig:
    # native | sglang | vllm | trtllm | medusa-vllm | medusa (see README "Serving")
    format: str = "sglang"
    # output folder (empty = runs/<run>/export/<format>)
    out: str = ""
    # replace an existing output folder
    overwrite: bool = False
    # draft tokens per step written into the vLLM speculators config
    num_speculative_tokens: int = 3

    def __post_init__(self) -> None:
        _at_least("export", self, 1, "num_speculative_tokens")


@dataclass
class EvalConfig(SamplingKeys):
    # prompts: mt-bench | humaneval | heldout (prepared data) | a file or folder of conversations
    benchmark: str = "mt-bench"
    # a hub benchmark's branch, tag or commit (null: its default branch); the commit read is
    # recorded with the results, so a benchmark updated on the hub since is measured again
    revision: str | None = None
    # first N conversations (null = all)
    limit: int | None = 80
    # user turns decoded per conversation: "first" (the goals' protocol) or "all" (later turns
    # follow each method's own earlier answers, as EAGLE's MT-bench evaluation does)
    turns: str = "first"
    max_new_tokens: int = 128
    # (temperature / top_p / top_k: SamplingKeys, identical for every method)
    # baselines decoded interleaved with speculation: "vanilla" (generate) and/or "lookup"
    # (transformers' prompt-lookup assisted generation)
    baselines: list[str] = field(default_factory=lambda: ["vanilla", "lookup"])
    # prompt lookup: tokens proposed per step
    lookup_tokens: int = 10
    # results subfolder of runs/<run>/eval/ (empty = named after the tree settings)
    tag: str = ""
    # other runs whose heads (runs/<run>/train/head) are decoded interleaved with this run's, on
    # the same prompts and baselines (vanilla and lookup decode once for all); each run's results
    # go to its own eval folder (never over results it already has: a new tag measures again). A
    # parallel head's dynamic tree is cut to its number of heads.
    heads: list[str] = field(default_factory=list)
    # 0 = every head drafts over its own vocabulary. N > 0: heads that draft through the target's
    # full lm_head (eagle1, medusa, hydra) draft over the N most frequent answer tokens of this
    # run's prepared data instead (far cheaper per expansion; exactness is unchanged). This run's
    # head must be one of them; its results folder name ends in -v<N>.
    draft_vocab_size: int = 0
    # torch.compile the target for every method (vanilla, lookup and speculative run the same
    # compiled forward); compiling happens in an untimed warm-up decode of the first prompt by
    # each method. Results folder name ends in -compiled.
    compile: bool = False
    # processes decoding disjoint conversations side by side, the cores split among them, in a
    # tau-only eval (with baselines it decodes in one process: speed ratios must be measured side
    # by side, and results.json records the workers used). Every prompt is seeded by its index,
    # so in fp32 the results are those of one process: on 2 AVX2 cores two 1-thread processes ran
    # the quick preset's eval in 7.9 min against 11.7, with identical results (small tree
    # forwards use 2 threads poorly). In bf16 1- and 2-thread kernels round differently, so a few
    # greedy paths part at near-ties (AMX Xeon: 2 of 80 prompts, 2.2 min against 3.0)
    workers: int = 1

    def __post_init__(self) -> None:
        self.check_sampling("eval")
        _at_least("eval", self, 1, "limit", "max_new_tokens", "lookup_tokens", "workers")
        _check(self.turns, ("first", "all"), "eval.turns")
        for b in self.baselines:
            _check(b, ("vanilla", "lookup"), "eval.baselines")
        _at_least("eval", self, 0, "draft_vocab_size")  # 0: the head's own


@dataclass
class GenerateConfig(SamplingKeys):
    # `draftsmith generate`: the user's message, decoded as the first turn of a new chat ("-":
    # read it from stdin)
    prompt: str = ""
    # a system message before it (empty: none, so the template's default where it has one)
    system: str = ""
    # function schemas the chat template renders for the prompt, as OpenAI's `tools`: a JSON
    # file of a list of them, or its text (empty: none)
    tools: str = ""
    max_new_tokens: int = 256
    # (temperature / top_p / top_k: SamplingKeys, as eval's)
    # also decode with the target alone (transformers generate, same sampling): its speed next
    # to the speculative one, and at temperature 0 whether the two outputs are identical
    compare: bool = False

    def __post_init__(self) -> None:
        self.check_sampling("generate")
        _at_least("generate", self, 1, "max_new_tokens")


@dataclass
class Config:
    # which CLI stage is running (set by the `draftsmith` dispatcher)
    stage: str = "none"
    # every stage reads and writes runs/<run_name>/<stage>/
    run_name: str = "default"
    # read prepared data / features from this run instead (ablations sharing one collection)
    inputs_from: str | None = None
    runs_dir: str = "runs"
    seed: int = 0
    # "cpu" or "cuda"
    device: str = "cpu"
    # target compute dtype: float32 | bfloat16 | float16 | auto (bf16 where the device has bf16
    # hardware, else fp32; resolved when the config is built, so runs record the real dtype)
    dtype: str = "float32"
    # "none" (local JSONL only), "wandb" or "tensorboard" (event files beside the JSONL)
    tracking: str = "none"
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # a head config from conf/head/ (typed per head: Eagle3Config, MedusaConfig, ...)
    head: Any = MISSING
    # an existing head folder for eval/export (null = runs/<run_name>/train/head)
    head_path: str | None = None
    tree: TreeSpec = field(default_factory=TreeSpec)
    collect: CollectConfig = field(default_factory=CollectConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    # continue from runs/<run>/train/checkpoints/latest (the train stage sets it by itself when
    # that checkpoint is there and its features were not made again since; other settings than
    # it was trained with are refused)
    resume: bool = False
    # `draftsmith run` runs these stages, in pipeline order (e.g. [prepare,collect,train] trains
    # several heads before one eval compares them)
    stages: list[str] = field(
        default_factory=lambda: ["prepare", "collect", "train", "eval", "export"]
    )
    # "none": this process (or an outer `deepspeed`/torchrun launch); "deepspeed": spawn nproc ranks
    launcher: str = "none"
    nproc: int = 1
    # `draftsmith collect verify=true`: re-hash every shard against the index and stop
    verify: bool = False
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    # the short keys of `draftsmith export format=vllm out=<folder>`: export.format and
    # export.out (a group option, `export=vllm`, picks the format too; these win over it)
    format: str = ""
    out: str = ""
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    # free-form extras an experiment file may carry (notes, tags)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.export.format = self.format or self.export.format
        self.export.out = self.out or self.export.out
        # here, not at export time, so `draftsmith run` refuses a typo before hours of training
        _check(self.export.format, FORMATS, "format")
        _check(self.dtype, ("float32", "bfloat16", "float16", "auto"), "dtype")
        if self.dtype == "auto":
            from draftsmith.target import native_dtype

            self.dtype = native_dtype(self.device)
        _check(self.tracking, ("none", "wandb", "tensorboard"), "tracking")
        _check(self.launcher, ("none", "deepspeed"), "launcher")
        if self.nproc < 1:
            raise InputError(f"nproc={self.nproc} must be >= 1")
        for stage in self.stages:
            _check(stage, ("prepare", "collect", "train", "eval", "export"), "stages")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise InputError(f"device={self.device!r}: expected 'cpu' or 'cuda[:n]'")
        if self.train.optimizer == "muon" and self.deepspeed.zero_stage and self.train.grad_clip:
            raise InputError(
                f"train.optimizer=muon with deepspeed.zero_stage={self.deepspeed.zero_stage}: "
                "ZeRO 1-3 orthogonalize Muon's update before clipping, so train.grad_clip="
                f"{self.train.grad_clip} would clip the update itself (on the quick preset "
                "held-out simulated tau fell from 1.46 to 1.22); use deepspeed=zero0 (a head's "
                "optimizer state fits every rank) or train.grad_clip=0"
            )
        # checked here, not at eval time, so `draftsmith run` refuses it before hours of training
        if self.eval.draft_vocab_size and not self.head.drafts_with_target_lm_head:
            raise InputError(
                f"eval.draft_vocab_size={self.eval.draft_vocab_size}: the {self.head.name} head "
                "drafts over its own vocabulary (it applies to heads sharing the target's lm_head)"
            )

    def resolved_head_path(self) -> str:
        return self.head_path or f"{self.stage_dir('train')}/head"

    def imports_head(self) -> bool:
        """`head_path` names a head other than this run's trained one (imported, exported,
        another run's), so its evals are not this run's head's."""
        own = os.path.normpath(f"{self.stage_dir('train')}/head")
        return self.head_path is not None and os.path.normpath(self.head_path) != own

    def input_dir(self, stage: str) -> str:
        """Where a stage's *inputs* from an earlier stage live (see `inputs_from`)."""
        return f"{self.runs_dir}/{self.inputs_from or self.run_name}/{stage}"

    def stage_dir(self, stage: str | None = None) -> str:
        """runs/<run_name>/<stage>: where a stage writes and the next stage looks."""
        return f"{self.runs_dir}/{self.run_name}/{stage or self.stage}"
