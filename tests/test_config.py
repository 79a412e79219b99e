"""Every config in conf/ composes into the typed schema; bad overrides fail loudly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from draftsmith.conf import CONF_DIR
from draftsmith.conf.schema import Config
from draftsmith.config import compose

GROUPS = sorted(p.name for p in Path(CONF_DIR).iterdir() if p.is_dir() and p.name != "__pycache__")


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "override", [f"{g}={o}" for g in GROUPS for o in _options(g)], ids=lambda s: s
)
def test_every_option_composes(override: str) -> None:
    cfg = compose([override])
    assert isinstance(cfg, Config)


def test_default_composes_to_embedded_target() -> None:
    cfg = compose()
    assert cfg.target.path == "smollm2-135m-instruct"
    assert cfg.data.path == "sharegpt"
    assert cfg.stage_dir("train") == "runs/default/train"


def test_unknown_plus_key_fails() -> None:
    with pytest.raises(ValueError, match="unknown config keys.*foo"):
        compose(["+foo=1"])


def test_unknown_nested_key_fails() -> None:
    with pytest.raises(Exception, match="nope"):
        compose(["data.nope=3"])


@pytest.mark.parametrize("override", ["dtype=float8", "tracking=mlflow", "data.template=jinja"])
def test_bad_enum_fails(override: str) -> None:
    with pytest.raises(Exception, match=override.split("=")[1]):
        compose([override])


def test_unknown_stage_fails() -> None:
    with pytest.raises(ValueError, match="stages='trian' is not one of"):
        compose(["stages=[prepare,trian]"])


BAD_SAMPLING = [
    (group, override)
    for group in ("eval", "generate", "data.regen")
    for override in ("temperature=-0.5", "top_p=0", "top_p=1.5", "top_k=-1")
]


@pytest.mark.parametrize(("group", "override"), BAD_SAMPLING)
def test_bad_sampling_fails(group: str, override: str) -> None:
    """eval, generate and regeneration check their sampling keys alike, when the config is
    built rather than mid-stage."""
    with pytest.raises(ValueError, match=re.escape(f"{group}.{override}")):
        compose([f"{group}.{override}"])
    cfg = compose([f"{group}.temperature=0.7", f"{group}.top_p=0.9", f"{group}.top_k=5"])
    section = cfg.data.regen if group == "data.regen" else getattr(cfg, group)
    assert (section.temperature, section.top_p, section.top_k) == (0.7, 0.9, 5)


# out-of-range counts, sizes and rates, each refused naming its key (mid-stage they were a
# ZeroDivisionError, "range() arg 3 must not be zero", or nothing: keep_last=0 kept every
# checkpoint, min_lr_ratio=2 raised the lr after warmup)
BAD_VALUES = [
    ("train.micro_batch_size=0", "must be >= 1"),
    ("train.grad_accum=0", "must be >= 1"),
    ("train.log_every=0", "must be >= 1"),
    ("train.eval_every=0", "must be >= 1"),
    ("train.save_every=0", "must be >= 1"),
    ("train.keep_last=0", "must be >= 1"),
    ("train.epochs=0", "must be >= 1"),
    ("train.max_steps=0", "must be >= 1"),
    ("train.stop_after=0", "must be >= 1"),
    ("train.max_len=1", "must be >= 2"),
    ("train.warmup_steps=-1", "must be >= 0"),
    ("train.grad_clip=-1.0", "must be >= 0"),
    ("train.lr=-1.0", "must be >= 0"),
    ("train.muon_lr=-0.02", "must be >= 0"),
    ("train.beta1=1.0", "must be in [0, 1)"),
    ("train.muon_momentum=-0.1", "must be in [0, 1)"),
    ("train.min_lr_ratio=2.0", "must be in [0, 1]"),
    ("data.limit=0", "must be >= 1"),
    ("data.max_len=1", "must be >= 2"),
    ("data.regen.batch_size=0", "must be >= 1"),
    ("data.regen.rows=-1", "must be >= 0"),
    ("data.regen.server_timeout=0.0", "must be > 0"),
    ("collect.shard_tokens=0", "must be >= 1"),
    ("collect.workers=0", "must be >= 1"),
    ("eval.limit=0", "must be >= 1"),
    ("eval.max_new_tokens=0", "must be >= 1"),
    ("eval.draft_vocab_size=-1", "must be >= 0"),
    ("export.num_speculative_tokens=0", "must be >= 1"),
    ("generate.max_new_tokens=0", "must be >= 1"),
    ("nproc=0", "must be >= 1"),
    ("head.ttt_steps=0", "must be >= 1"),
    ("head.draft_vocab_size=-5", "must be >= 0"),
]


@pytest.mark.parametrize(("override", "why"), BAD_VALUES)
def test_out_of_range_values_fail_naming_the_key(override: str, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{override} {why}")):
        compose([override])


def test_in_range_edges_compose() -> None:
    """The edges that mean something: no warmup, no clipping, no decay, frozen weights, a
    constant lr floor, epochs replaced by max_steps, no regenerated rows, the head's own draft
    vocabulary."""
    edges = [
        "train.lr=0",
        "train.warmup_steps=0",
        "train.grad_clip=0",
        "train.weight_decay=0",
        "train.min_lr_ratio=1.0",
        "train.beta2=0.0",
        "train.epochs=0",
        "train.max_steps=5",
        "data.regen.rows=0",
        "eval.draft_vocab_size=0",
    ]
    cfg = compose(edges)
    assert (cfg.train.epochs, cfg.train.max_steps, cfg.data.regen.rows) == (0, 5, 0)


def test_draft_vocab_for_a_head_with_its_own_fails() -> None:
    """Refused when the config is built, not after `draftsmith run` has trained the head."""
    with pytest.raises(ValueError, match="eagle3 head drafts over its own vocabulary"):
        compose(["experiment=smollm2_eagle3", "eval.draft_vocab_size=4096"])
    with pytest.raises(ValueError, match="medusa head drafts over its own vocabulary"):
        compose(["head=medusa", "head.own_lm_head=true", "eval.draft_vocab_size=64"])
    assert compose(["head=hydra", "eval.draft_vocab_size=64"]).eval.draft_vocab_size == 64


@pytest.mark.parametrize(("recipe", "eagle3"), [("smollm2", "smollm2_eagle3"), ("quick", "quick")])
def test_recipe_heads_share_data_and_budget(recipe: str, eagle3: str) -> None:
    """The four head experiments of a recipe (the full SmolLM2 one, and the quick one) train on
    one collection with one training budget and decode with one tree."""
    names = [eagle3, *(f"{recipe}_{h}" for h in ("eagle1", "medusa", "hydra"))]
    cfgs = [compose([f"experiment={name}"]) for name in names]
    assert [c.head.name for c in cfgs] == ["eagle3", "eagle1", "medusa", "hydra"]
    assert {c.input_dir("collect") for c in cfgs} == {f"runs/{eagle3}/collect"}
    assert all(c.data == cfgs[0].data and c.train == cfgs[0].train for c in cfgs)
    # Medusa and Hydra are cut to their 4 heads (inference/eval.py _tree_for)
    assert all(c.tree.top_k == cfgs[0].tree.top_k and c.tree.depth == 4 for c in cfgs)
    # the heads drafting through the target's lm_head draft over (and Medusa and Hydra train on)
    # as many tokens as the EAGLE-3 head's own draft vocabulary
    vocab = cfgs[0].head.draft_vocab_size
    assert [c.eval.draft_vocab_size for c in cfgs[1:]] == [vocab] * 3
    assert [c.head.draft_vocab_size for c in cfgs[2:]] == [vocab] * 2


def test_every_stage_reuses_freed_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """`draftsmith <stage>` switches glibc to reusing freed big blocks before the stage runs."""
    from draftsmith import allocator
    from draftsmith.cli import main

    calls = []
    monkeypatch.setattr(allocator, "reuse_freed_memory", lambda: calls.append(True) or True)
    main(["collect", "--cfg", "job"])
    assert calls == [True]


def test_an_interrupted_command_says_what_it_kept(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Ctrl-C inside a stage ends in one line saying what the same command goes on from, and
    the shell's status for SIGINT, not a traceback through Hydra's and DeepSpeed's frames."""
    from draftsmith import cli

    def stage(_stage: str, _cfg: dict) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_load", lambda name: lambda cfg: stage(name, cfg))
    assert cli.main(["train", "target=tiny-random-llama"]) == 130
    err = capsys.readouterr().err
    assert "draftsmith train: interrupted; its last checkpoint is kept" in err
    assert "Traceback" not in err
    assert cli.main(["eval", "target=tiny-random-llama"]) == 130
    assert "nothing partial was written" in capsys.readouterr().err


def test_an_input_error_is_its_message_alone(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A setting the user can mend ends in its message, named by the command (status 1), not
    below a traceback; any other failure, a bug, keeps its traceback."""
    from draftsmith import cli

    with pytest.raises(SystemExit) as stop:
        cli.main(["train", "target=tiny-random-llama", "train.keep_last=0"])
    assert stop.value.code == "draftsmith train: train.keep_last=0 must be >= 1"
    assert "Traceback" not in capsys.readouterr().err

    def bug(_cfg: dict) -> None:
        return [][0]

    monkeypatch.setattr(cli, "_load", lambda name: bug)
    with pytest.raises(SystemExit) as stop:
        cli.main(["eval", "target=tiny-random-llama"])
    assert stop.value.code == 1
    assert re.search(r"Traceback.*IndexError", capsys.readouterr().err, re.S)


def test_cli_prints_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    """`draftsmith <stage> <overrides> --cfg job` prints the composed config and runs nothing."""
    from draftsmith.cli import main

    main(["train", "experiment=smollm2_medusa", "--cfg", "job"])
    out = capsys.readouterr().out
    assert "inputs_from: smollm2_eagle3" in out and "name: medusa" in out


def test_cli_help_sums_up_each_command_in_a_whole_sentence(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`draftsmith --help` shows each stage's summary line (its module's first docstring line),
    never a line cut mid-sentence."""
    from draftsmith import cli

    assert cli.main(["--help"]) == 0
    usage = capsys.readouterr().out
    rows = {line.split()[0]: line for line in usage.splitlines() if line[:2] == "  "}
    # no command at all is a usage error: the same text on stderr, status 2
    assert cli.main([]) == 2 and capsys.readouterr().err.strip() == usage.strip()
    for stage in cli.STAGES:
        assert rows[stage].endswith("."), rows[stage]
    # a command's own help is named after it and lists its settings, not "cli is powered by Hydra"
    with pytest.raises(SystemExit):  # Hydra's help exits
        cli.main(["eval", "eval.limit=3", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("draftsmith eval: every setting below") and "limit: 3" in out
    # each group lists the presets a user picks, not the schemas they extend
    listing = out.split("== Configuration groups ==")[1].split("== Config ==")[0]
    groups = dict(line.split(": ", 1) for line in listing.splitlines()[2:] if line)
    assert groups["tree"].split(", ") == ["chain", "dynamic", "static"], groups
    assert not any("schema" in options for options in groups.values()), groups


def test_cli_takes_overrides_after_its_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's sweep, `draftsmith eval ... -m tree.total_tokens=8,16`, runs the stage once
    per value, and an override after `--cfg job` still counts (Hydra's argparse takes its
    overrides in one run, before the flags)."""
    from draftsmith import cli

    seen: list[Config] = []
    monkeypatch.setattr(cli, "_load", lambda stage: seen.append)
    cli.main(["eval", f"runs_dir={tmp_path}", "tree=dynamic", "-m", "tree.total_tokens=8,16"])
    assert [(c.stage, c.tree.kind, c.tree.total_tokens) for c in seen] == [
        ("eval", "dynamic", 8),
        ("eval", "dynamic", 16),
    ]
    assert not list(tmp_path.rglob("*.log"))  # no Hydra job log of libraries' INFO lines
    cli.main(["train", "--cfg", "job", "experiment=smollm2_medusa"])
    assert "name: medusa" in capsys.readouterr().out


def test_auto_dtype_is_bf16_only_where_the_hardware_has_it(monkeypatch) -> None:
    """`dtype=auto` resolves when the config is built, so every stage and record sees one dtype."""
    import torch

    assert compose(["dtype=auto", "device=cuda"]).dtype == "bfloat16"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert compose(["dtype=auto"]).dtype == "float32"  # emulated bf16 is slower than fp32
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert compose(["dtype=auto"]).dtype == "bfloat16"
    assert compose(["experiment=quick"]).dtype == "bfloat16"


def test_presets_take_less_data_where_they_compute_in_fp32(monkeypatch) -> None:
    """`${by_dtype:A,B}` keeps experiment=quick and the full recipe within their minutes on an
    AVX2-only CPU, where fp32 forwards cost 3-8x; their other heads follow, and an override still
    wins."""
    import torch

    def budget(*overrides: str) -> tuple[int | None, int | None]:
        data = compose(["experiment=quick", *overrides]).data
        return data.limit, data.regen.rows

    assert budget("dtype=bfloat16") == (800, 8)
    assert budget("dtype=float32") == (160, 2)
    assert budget("dtype=auto", "device=cuda") == (800, 8)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert budget("dtype=auto") == (160, 2)
    assert budget("data.limit=50") == (50, 2)
    hydra = compose(["experiment=quick_hydra", "dtype=float32"])
    assert hydra.data == compose(["experiment=quick", "dtype=float32"]).data

    def recipe(*overrides: str) -> tuple[int | None, int]:
        cfg = compose(["experiment=smollm2_eagle3", *overrides])
        return cfg.data.limit, cfg.train.epochs

    assert recipe("dtype=bfloat16") == (6000, 3)
    assert recipe("dtype=auto") == recipe("dtype=float32") == (2000, 3)
    data = compose(["experiment=smollm2_eagle3", "dtype=float32"]).data
    for head in ("smollm2_eagle1", "smollm2_medusa", "smollm2_hydra"):
        other = compose([f"experiment={head}", "dtype=float32"])
        assert (other.data, other.train.epochs) == (data, 3)


def test_eval_folder_names_the_settings_and_stays_under_the_run() -> None:
    from draftsmith.inference.results import eval_tag

    cfg = compose(["eval.benchmark=/data/tune_prompts.jsonl"])
    tag = eval_tag(cfg)
    assert re.match(r"tune_prompts-[0-9a-f]{8}-dynamic-", tag)
    assert Path(cfg.stage_dir("eval"), tag).parent == Path(cfg.stage_dir("eval"))
    assert eval_tag(compose()).startswith("mt-bench-dynamic-")
    assert eval_tag(compose(["eval.benchmark=heldout"])).startswith("heldout-dynamic-")
    # benchmarks of one name elsewhere (another folder, a hub dataset) are other folders
    others = ["/other/tune_prompts.jsonl", "acme/tune_prompts", "tune_prompts.json"]
    tags = {eval_tag(compose([f"eval.benchmark={b}"])) for b in others}
    assert len(tags) == 3 and tag not in tags
    assert eval_tag(compose(["eval.benchmark=/data//tune_prompts.jsonl"])) == tag
    # settings that change a sampled eval's results are in its name, not at T=0
    sampled = ["tree=static", "tree.verify=traversal"]
    assert eval_tag(compose([*sampled, "eval.temperature=1"])).endswith(
        "-drawn-traversal-T1-float32"
    )
    assert "traversal" not in eval_tag(compose(sampled))
    # fewer prompts or tokens than the protocol's go to their own folder, never over its results
    assert eval_tag(compose(["eval.limit=2", "eval.max_new_tokens=8"])).endswith(
        "-limit2-new8-T0-float32"
    )
    assert eval_tag(compose(["eval.limit=null"])).endswith("-limitall-T0-float32")
    nucleus = ["eval.temperature=1", "eval.top_p=0.9"]
    assert eval_tag(compose(nucleus)).endswith("-drawn-p0.9-k0-T1-float32")
    assert eval_tag(compose(["eval.top_p=0.9"])) == eval_tag(compose())  # greedy: no top-p
    # a static tree of explicit choices is named by their shape and digest, not top-k settings
    choices = ["tree=static", "tree.choices=[[0],[1],[0,0]]"]
    assert re.search(r"-static-d2-n4-choices[0-9a-f]{8}-T0-", eval_tag(compose(choices)))
    assert eval_tag(compose(choices)) != eval_tag(compose([*choices[:1], "tree.choices=[[0]]"]))
    # a head other than the run's own (imported, another run's) is named by its path's digest
    assert eval_tag(compose(["head_path=runs/default/train/head/"])) == eval_tag(compose())
    other = eval_tag(compose(["head_path=yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"]))
    assert re.fullmatch(r"mt-bench-dynamic-d\d+-k\d+-n\d+-head[0-9a-f]{8}-T0-float32", other)


def test_deepspeed_half_precision_modes_are_refused() -> None:
    """DeepSpeed's own bf16/fp16 modes would meet fp32 features with half-precision weights;
    the config names the key and what to set instead, while other extra keys pass through."""
    for mode in ("bf16", "fp16"):
        with pytest.raises(ValueError, match=f"deepspeed.extra.{mode}.enabled.*dtype=bfloat16"):
            compose([f"+deepspeed.extra.{mode}.enabled=true"])
    cfg = compose(["+deepspeed.extra.communication_data_type=fp32"])
    assert cfg.deepspeed.extra == {"communication_data_type": "fp32"}


def test_muon_with_zero_and_clipping_is_refused() -> None:
    """ZeRO 1-3 clip Muon's orthogonalized update rather than the gradient: refused when the
    config is built, naming both ways out, each of which composes."""
    with pytest.raises(ValueError, match="train.optimizer=muon with deepspeed.zero_stage=2.*zero0"):
        compose(["train.optimizer=muon"])
    assert compose(["train.optimizer=muon", "deepspeed=zero0"]).deepspeed.zero_stage == 0
    assert compose(["train.optimizer=muon", "deepspeed=zero3", "train.grad_clip=0"])
    with pytest.raises(ValueError, match="train.muon_ns_method='cubic' is not one of"):
        compose(["train.optimizer=muon", "deepspeed=zero0", "train.muon_ns_method=cubic"])


def test_preformatted_text_refuses_regeneration() -> None:
    """Rendered text rows hold no user turns apart for the target to answer: refused when the
    config is built, before prepare."""
    with pytest.raises(ValueError, match="data.preformatted=true with data.regenerate=true"):
        compose(["data.preformatted=true", "data.regenerate=true"])
    assert compose(["data.preformatted=true", "eval.benchmark=heldout"]).data.preformatted


def test_short_export_keys_set_the_export_and_win_over_its_group() -> None:
    """`draftsmith export format=vllm out=<folder>` (the README's and DESIGN's contract): the
    short keys are export.format and export.out; a format typo fails when the config is built,
    before `draftsmith run` trains for hours."""
    cfg = compose(["format=vllm", "out=exported/vllm"])
    assert (cfg.export.format, cfg.export.out) == ("vllm", "exported/vllm")
    assert compose(["export=trtllm"]).export.format == "trtllm"
    assert compose(["export=trtllm", "format=native"]).export.format == "native"
    for override in ("format=vlm", "export.format=vlm"):
        with pytest.raises(ValueError, match="format='vlm' is not one of"):
            compose([override])
