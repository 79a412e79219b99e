"""Training: overfitting, exact resume, 2 ranks == 1 rank, online == offline, W&B offline files,
non-finite losses."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from pipeline import tiny_run
from safetensors.torch import load_file

from draftsmith.config import compose, save_config
from draftsmith.errors import MissingInput
from draftsmith.features import decoder_layers
from draftsmith.heads.medusa import MedusaHead
from draftsmith.inference.loading import draft_vocabulary
from draftsmith.train import loop
from draftsmith.train.data import batch_order

TRAIN = [
    "train.eval_every=1000",
    "train.micro_batch_size=2",
    "train.warmup_steps=2",
    "train.lr=3e-3",
]
HEAD = ["head=eagle3", "head.draft_vocab_size=128", "head.ttt_steps=2", *TRAIN]


@pytest.fixture(scope="module")
def run_overrides(tmp_path_factory) -> list[str]:
    return tiny_run(tmp_path_factory.mktemp("train"), rows=40) + HEAD


def losses(root: str, run_name: str, key: str = "train/loss") -> dict[int, float]:
    path = Path(root) / run_name / "train" / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


def runs_dir(overrides: list[str]) -> str:
    return next(o.split("=", 1)[1] for o in overrides if o.startswith("runs_dir="))


def test_tiny_head_overfits(run_overrides) -> None:
    loop.run(
        compose(
            [
                *run_overrides,
                "train.max_steps=150",
                "train.log_every=1",
                "train.save_every=1000",
                "train.eval_every=30",
            ]
        )
    )
    curve = losses(runs_dir(run_overrides), "t")
    acc = losses(runs_dir(run_overrides), "t", "train/acc_0")
    first, last = curve[1], sum(curve[s] for s in range(146, 151)) / 5
    # soft CE against the target has the target's entropy as floor, so the loss falls by ~40%
    # while top-1 agreement goes from chance (< 0.2) to > 0.3
    assert last < 0.65 * first, (first, last)
    assert acc[1] < 0.2 and sum(acc[s] for s in range(146, 151)) / 5 > 0.3, acc
    out = Path(runs_dir(run_overrides)) / "t" / "train"
    assert (out / "head" / "model.safetensors").exists() and (out / "best").exists()
    assert (out / "training.png").stat().st_size > 10_000


def test_features_of_other_layers_are_refused_naming_the_ways_on(run_overrides) -> None:
    """A head fusing other target layers than the collected ones cannot train on them; the
    error names the collected layers and the three ways on."""
    from draftsmith.heads.eagle3 import default_aux_layers

    collected = default_aux_layers(4)  # the tiny target's 4 layers: [2, 2, 1]
    with pytest.raises(ValueError, match="hold .*head.aux_layers=.*train.source=online") as err:
        loop.run(
            compose([*run_overrides, "inputs_from=t", "run_name=l", "head.aux_layers=[1,2,3]"])
        )
    assert f"head.aux_layers={collected}" in str(err.value)


def test_memory_savers_train_the_same_curve(run_overrides, monkeypatch) -> None:
    """deepspeed.offload_optimizer=true keeps the optimizer state in CPU memory (ZeRO 1-3):
    DeepSpeed refused our AdamW there ("ZeRO-Offload with a client provided optimizer").
    train.gradient_checkpointing=true recomputes each layer in backward: EAGLE-3's unrolled
    steps failed there ("Recomputed values ... have different metadata"), the list of earlier
    steps' keys having grown since. Neither changes the arithmetic: the same loss curve. Muon
    (unclipped, as ZeRO 1-3 take it) offloaded trains its curve too. ZeRO 0 trains the same curve
    and logs the same gradient norm before clipping (DeepSpeed keeps none there: read before
    its step, after which the gradients are clipped and zeroed). Muon's Adam half is torch's
    AdamW, in place and offloaded: DeepSpeed's FusedAdam and CPUAdam are C++ ops it would
    build on first use (~45 s each on 2 cores)."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    load = OpBuilder.load

    def no_adam_op(builder: OpBuilder, *args, **kwargs):
        assert "adam" not in builder.name, f"DeepSpeed built {builder.name}"
        return load(builder, *args, **kwargs)

    monkeypatch.setattr(OpBuilder, "load", no_adam_op)
    common = [*run_overrides, "inputs_from=t", "train.max_steps=4", "train.log_every=1"]
    common += ["deepspeed=zero2", "train.save_every=1000"]
    muon = ["train.optimizer=muon", "train.grad_clip=0"]
    offloaded = ["deepspeed.offload_optimizer=true"]
    savers = {
        "in_place": [],
        "offloaded": offloaded,
        "recomputed": ["train.gradient_checkpointing=true"],
        "muon": muon,
        "muon_offloaded": [*muon, *offloaded],
        "zero0": ["deepspeed=zero0"],
    }
    for name, overrides in savers.items():
        loop.run(compose([*common, f"run_name={name}", *overrides]))
    root = runs_dir(run_overrides)
    plain = losses(root, "in_place")
    assert len(plain) == 4 and HEAD[2] == "head.ttt_steps=2"  # an unrolled step to recompute
    for name in ("offloaded", "recomputed", "zero0"):
        assert losses(root, name) == pytest.approx(plain, rel=1e-5), name
    norms = losses(root, "in_place", "train/grad_norm")
    assert norms.keys() == plain.keys()
    # above train.grad_clip (0.5): the norm before clipping, not after
    assert all(v > 0.5 for v in norms.values())
    for name in ("offloaded", "zero0"):
        assert losses(root, name, "train/grad_norm") == pytest.approx(norms, rel=1e-5), name
    assert losses(root, "muon") != plain
    # Muon's Newton-Schulz iterations run in bf16: the offloaded copies' other summation order
    # grows to ~5e-5 by step 4
    assert losses(root, "muon_offloaded") == pytest.approx(losses(root, "muon"), rel=1e-3)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_continues_the_loss_curve_exactly(
    run_overrides, optimizer: str, monkeypatch
) -> None:
    """Also for Muon, whose momentum buffers the checkpoint must carry."""
    base = run_overrides[: -len(HEAD)]
    common = [
        *base,
        *TRAIN,
        "train.max_steps=8",
        "train.log_every=1",
        "train.save_every=4",
        "head=eagle1",
        "head.feature_noise=0.2",
        f"train.optimizer={optimizer}",
        "deepspeed=zero0" if optimizer == "muon" else "deepspeed=zero2",
    ]  # noise: the RNG state must be restored
    full, cut = f"full_{optimizer}", f"cut_{optimizer}"
    with pytest.raises(MissingInput, match=r"latest does not exist: .*without resume=true"):
        loop.run(compose([*common, f"run_name={full}", "inputs_from=t", "resume=true"]))
    whole = loop.run(compose([*common, f"run_name={full}", "inputs_from=t"]))
    first = loop.run(compose([*common, f"run_name={cut}", "inputs_from=t", "train.stop_after=4"]))
    # its checkpoints go on only with the settings they were made with (time-boxing aside)
    with pytest.raises(ValueError, match=r"train.lr: 0.003 -> 0.001"):
        loop.run(
            compose([*common, f"run_name={cut}", "inputs_from=t", "resume=true", "train.lr=1e-3"])
        )
    resumed = [*common, f"run_name={cut}", "inputs_from=t", "resume=true"]
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        killed_at(m, 3)  # step 7: steps 5 and 6 logged past the checkpoint of step 4
        loop.run(compose(resumed))
    second = loop.run(compose(resumed))  # from step 4 again
    metrics = Path(runs_dir(run_overrides), cut, "train", "metrics.jsonl").read_text()
    logged = [json.loads(line)["step"] for line in metrics.splitlines() if "train/loss" in line]
    assert logged == list(range(1, 9))  # one curve: steps 5 and 6 not twice
    full, cut = losses(runs_dir(run_overrides), full), losses(runs_dir(run_overrides), cut)
    assert [cut[s] for s in range(1, 9)] == [full[s] for s in range(1, 9)]
    # the resumed run carries the first invocation's training seconds (its reported minutes)
    assert whole["seconds_before_resume"] == first["seconds_before_resume"] == 0.0
    assert first["stopped_early"] and second["seconds_before_resume"] > 0.0
    # trained again from scratch and killed before its first checkpoint: neither a finished
    # training nor one to resume from the earlier training's checkpoints
    out = Path(runs_dir(run_overrides), f"cut_{optimizer}", "train")
    assert (out / "summary.json").exists() and (out / "checkpoints" / "latest").exists()
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        killed_at(m, 1)
        loop.run(compose([*common, f"run_name=cut_{optimizer}", "inputs_from=t"]))
    assert not (out / "summary.json").exists() and not (out / "checkpoints" / "latest").exists()
    assert (out / "metrics.jsonl").read_text() == ""  # a new curve


def test_a_finished_training_is_kept(run_overrides, capsys) -> None:
    """`draftsmith train` on a finished training does not train it again (a rerun by mistake
    would overwrite its head): with its settings it is complete, with others refused, as
    prepare and collect keep theirs."""
    from draftsmith.train import launch

    common = [*run_overrides, "inputs_from=t", "run_name=kept", "train.max_steps=2"]
    first = launch.run(compose(common))
    head = Path(first["head"], "model.safetensors")
    before = head.read_bytes(), head.stat().st_mtime_ns
    assert launch.run(compose(common)) == first
    assert "is complete; delete it to redo" in capsys.readouterr().out
    assert (head.read_bytes(), head.stat().st_mtime_ns) == before
    with pytest.raises(ValueError, match=r"train.lr: 0.003 -> 0.001"):
        launch.run(compose([*common, "train.lr=1e-3"]))


def test_a_killed_training_is_continued(run_overrides, capsys) -> None:
    """`draftsmith train` again after a kill (here a time-boxed stop) continues from its
    checkpoint, as `draftsmith run` does, without resume=true; under other settings refused."""
    from draftsmith.train import launch

    common = [*run_overrides, "inputs_from=t", "run_name=continued", "train.max_steps=3"]
    assert launch.run(compose([*common, "train.stop_after=1"]))["stopped_early"]
    with pytest.raises(ValueError, match=r"train.lr: 0.003 -> 0.001"):
        launch.run(compose([*common, "train.lr=1e-3"]))
    finished = launch.run(compose(common))
    assert finished["steps"] == 3 and finished["seconds_before_resume"] > 0.0
    assert "continuing the training" in capsys.readouterr().out


def killed_at(monkeypatch, call: int) -> None:
    """Training is interrupted (Ctrl-C, a killed job) at its `call`-th step of the invocation."""
    real, calls = loop.train_step, itertools.count(1)

    def step(*args, **kwargs):
        if next(calls) == call:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", step)


def test_muon_orthogonalizes_the_matrix_updates(run_overrides) -> None:
    """train.optimizer=muon: one step moves each of the head's matrices by muon_lr times an
    orthogonalized update (singular values near 1, times sqrt(rows/cols) when taller than wide),
    while Adam (at lr 0 here) leaves norms and the lm_head where they were (AdamW built instead
    moves nothing here, so the test fails). ZeRO 2 without clipping (the config's other way out)
    orthogonalizes too."""
    common = [*run_overrides, "inputs_from=t", "train.save_every=1000", "train.log_every=1"]
    loop.run(compose([*common, "run_name=mu_src", "train.max_steps=3"]))
    root = Path(runs_dir(run_overrides))
    src = root / "mu_src" / "train" / "head"
    step = [
        *common,
        "run_name=mu",
        "train.max_steps=1",
        "train.warmup_steps=0",
        "train.lr=0",
        "train.optimizer=muon",
        "train.muon_lr=0.01",
        "deepspeed=zero0",
        f"train.init_from={src}",
    ]
    loop.run(compose(step))
    loop.run(compose([*step, "run_name=mu2", "deepspeed=zero2", "train.grad_clip=0"]))
    before = load_file(str(src / "model.safetensors"))
    after = load_file(str(root / "mu" / "train" / "head" / "model.safetensors"))
    zero2 = load_file(str(root / "mu2" / "train" / "head" / "model.safetensors"))
    matrices = [k for k, w in before.items() if w.ndim == 2 and "lm_head" not in k]
    assert "fc.weight" in matrices and len(matrices) == 8, matrices
    for key, w in before.items():
        if key not in matrices:
            assert torch.equal(after[key], w), key
            continue
        rows, cols = w.shape
        for moved in (after[key], zero2[key]):
            s = torch.linalg.svdvals((moved - w).double() / 0.01)
            s = s / max(1.0, (rows / cols) ** 0.5)
            # Newton-Schulz's quintic brings singular values into ~[0.5, 1.5], not exactly to 1;
            # the gradient's smallest ones (a 2-row batch) it leaves below
            assert 0.4 < s[:4].min() and s.max() < 1.6, (key, s)


def test_init_from_starts_at_the_given_head(run_overrides) -> None:
    """train.init_from loads a trained head (weights and draft vocabulary); at lr 0 it comes out
    unchanged, and a head of another shape is refused by name."""
    common = [*run_overrides, "inputs_from=t", "train.save_every=1000", "train.log_every=1"]
    loop.run(compose([*common, "run_name=src", "train.max_steps=3"]))
    src = Path(runs_dir(run_overrides)) / "src" / "train" / "head"
    loop.run(
        compose(
            [*common, "run_name=ft", "train.max_steps=1", "train.lr=0", f"train.init_from={src}"]
        )
    )
    before = load_file(str(src / "model.safetensors"))
    after = load_file(str(src.parent.parent.parent / "ft" / "train" / "head" / "model.safetensors"))
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    with pytest.raises(ValueError, match="train.init_from=.*does not fit"):
        loop.run(
            compose(
                [
                    *common,
                    "run_name=bad",
                    "train.max_steps=1",
                    f"train.init_from={src}",
                    "head.draft_vocab_size=64",
                ]
            )
        )
    # zero steps used to save the untrained head as if it were trained (refused with the config)
    with pytest.raises(ValueError, match="train.epochs=0 must be >= 1"):
        loop.run(compose([*common, "run_name=none", "train.epochs=0"]))


def test_parallel_head_loss_vocab_comes_from_the_answers(run_overrides, monkeypatch) -> None:
    """A Hydra head's head.draft_vocab_size is set, before training, to the most frequent answer
    tokens of the prepared data: the tokens eval.draft_vocab_size drafts over."""
    seen: list[torch.Tensor] = []
    original = MedusaHead.set_vocab

    def spy(self: MedusaHead, counts: torch.Tensor) -> None:
        original(self, counts)
        seen.append(self.in_vocab.clone())

    monkeypatch.setattr(MedusaHead, "set_vocab", spy)
    base = run_overrides[: -len(HEAD)]
    common = [*base, *TRAIN, "inputs_from=t", "train.max_steps=1", "head=hydra"]
    loop.run(compose([*common, "run_name=hv", "head.draft_vocab_size=32"]))
    assert len(seen) == 1 and int(seen[0].sum()) == 32
    eval_cfg = compose([*common, "run_name=hv", "eval.draft_vocab_size=32"])
    drafted = draft_vocabulary(eval_cfg, SimpleNamespace(vocab_size=seen[0].numel()))
    assert seen[0][drafted].all()


def test_fused_hydra_trains_on_the_collected_layers(run_overrides) -> None:
    """head.aux_layers feeds a Hydra head the collected EAGLE-3 layers (its fc is trained and
    saved); layers the shards do not hold are refused, naming both."""
    base = run_overrides[: -len(HEAD)]
    common = [*base, *TRAIN, "inputs_from=t", "train.max_steps=2", "head=hydra"]
    loop.run(compose([*common, "run_name=hf", "head.aux_layers=[2,2,1]"]))
    saved = load_file(str(Path(runs_dir(run_overrides)) / "hf/train/head/model.safetensors"))
    assert saved["fc.weight"].abs().sum() > 0  # zero-initialised, then trained
    with pytest.raises(ValueError, match=r"aux layers \[1, 2, 3\].*hold \[2, 2, 1\]"):
        loop.run(compose([*common, "run_name=hf2", "head.aux_layers=[1,2,3]"]))


def test_hydra_prefix_attention_trains(run_overrides) -> None:
    """head.prefix_attention adds Hydra++'s decoder layer; training moves its zero-initialised
    output projections, and the saved head holds them."""
    base = run_overrides[: -len(HEAD)]
    common = [*base, *TRAIN, "inputs_from=t", "train.max_steps=2", "head=hydra"]
    loop.run(compose([*common, "run_name=hp", "head.prefix_attention=true"]))
    saved = load_file(str(Path(runs_dir(run_overrides)) / "hp/train/head/model.safetensors"))
    assert saved["context.self_attn.o_proj.weight"].abs().sum() > 0
    assert saved["context.mlp.down_proj.weight"].abs().sum() > 0


def test_loss_on_all_trains_every_real_token(run_overrides) -> None:
    """train.loss_on=all makes every real token a training target, not only assistant ones."""
    common = [*run_overrides, "inputs_from=t", "train.max_steps=1", "train.log_every=1"]
    common += ["train.save_every=1000"]
    cfg = compose([*common, "run_name=all", "train.loss_on=all"])
    _, _, sources, make_batch_for = loop.setup(cfg, 0)
    rows = sources["train"]
    first = batch_order(rows.lengths(), cfg.train.micro_batch_size, cfg.seed, 0)[0]
    assistant = make_batch_for(rows)(first)
    every = loop.loss_on_all(make_batch_for(rows))(first)
    assert every.loss_mask.sum() == sum(rows.lengths()[i] for i in first)
    assert assistant.loss_mask.sum() < every.loss_mask.sum()
    loop.run(compose([*common, "run_name=asst"]))
    loop.run(cfg)
    root = runs_dir(run_overrides)
    assert losses(root, "all")[1] != losses(root, "asst")[1]


RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in RANK_ENV}


def _shm_buffers() -> set[str]:
    """DeepSpeed's CPU all-reduce buffers in /dev/shm (RAM held until unlinked)."""
    return {p.name for p in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")}


@pytest.mark.parametrize(
    "optimizer", [["deepspeed=zero2"], ["deepspeed=zero0", "train.optimizer=muon"]]
)
def test_two_ranks_match_one_rank(run_overrides, optimizer: list[str], monkeypatch) -> None:
    """The 2 ranks launched by `draftsmith run`'s train stage (ZeRO 2), which reports the
    launched training's steps, and (Muon) by the train stage called from Python."""
    from draftsmith.train import launch

    common = [*run_overrides, *optimizer, "train.max_steps=3", "train.save_every=1000"]
    cli = [sys.executable, "-m", "draftsmith.cli"]
    tag = "muon" if "train.optimizer=muon" in optimizer else "adamw"
    one, two = f"one_{tag}", f"two_{tag}"  # each its own: a finished training is kept
    launched = [f"run_name={two}", "inputs_from=t", "launcher=deepspeed", "nproc=2"]
    commands = [(["train"], [f"run_name={one}", "inputs_from=t", "train.grad_accum=2"])]
    buffers = _shm_buffers()
    if "deepspeed=zero2" in optimizer:
        commands.append((["run", "stages=[train]"], launched))
    for command, extra in commands:
        result = subprocess.run(
            [*cli, *command, *common, *extra],
            env=_clean_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert "FutureWarning" not in result.stderr  # DeepSpeed's use of a renamed torch collective
        assert "built successfully" not in result.stdout  # DeepSpeed's op-built line, per rank
        # DeepSpeed's warning that it found no GPU, on a training asked to run on the CPU
        assert "Setting accelerator to CPU" not in result.stdout + result.stderr
    if "deepspeed=zero2" in optimizer:
        summary = json.loads(Path(runs_dir(run_overrides), two, "summary.json").read_text())
        assert summary["train"]["steps"] == 3
    else:
        for name in RANK_ENV:  # set by the in-process trainings before it
            monkeypatch.delenv(name, raising=False)
        assert launch.run(compose([*common, *launched]))["steps"] == 3
    assert _shm_buffers() <= buffers  # no rank leaves a 64 MiB buffer behind
    root = Path(runs_dir(run_overrides))
    ranks = {n: load_file(str(root / n / "train/head/model.safetensors")) for n in (one, two)}
    assert ranks[one].keys() == ranks[two].keys()
    for key in ranks[one]:  # fp32 gloo all-reduce vs local accumulation: summation order differs
        torch.testing.assert_close(ranks[two][key], ranks[one][key], rtol=1e-4, atol=1e-6)


def test_a_ctrl_c_stops_launched_ranks_in_one_line(run_overrides, tmp_path: Path) -> None:
    """A terminal's Ctrl-C (SIGINT to the whole process group) during a launched training stops
    its ranks and ends in the one line saying what was kept, status 130: no traceback from
    DeepSpeed's runner and no line from each rank."""
    import signal

    log, buffers = tmp_path / "stderr.txt", _shm_buffers()
    command = [sys.executable, "-m", "draftsmith.cli", "train", *run_overrides, "inputs_from=t"]
    command += ["run_name=ctrl_c", "launcher=deepspeed", "nproc=2", "train.max_steps=100000"]
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            command,
            env=_clean_env(),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,  # its own group, as a terminal's foreground job
            # SIGINT at its default even where this test runs as a background job (ignored)
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        for _ in range(600):  # until both ranks train (rank 0's progress bar moves)
            if re.search(r"train eagle3: +\d+%.*\| [1-9]\d*/", log.read_text()):
                break
            assert process.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(timeout=120) == 130
    err = log.read_text()
    assert "Traceback" not in err, err[-3000:]
    assert err.count("draftsmith train: interrupted; its last checkpoint is kept") == 1
    assert _shm_buffers() <= buffers  # interrupted ranks leave no buffer behind


def test_a_launched_rank_ends_an_input_error_in_its_message(run_overrides) -> None:
    """An error the user mends met inside the launched ranks (a head for layers the features
    were not collected from) ends in each rank's one-line message and the launch's own line,
    status 1, not in a traceback per rank."""
    command = [sys.executable, "-m", "draftsmith.cli", "train", *run_overrides, "inputs_from=t"]
    command += ["run_name=other_layers", "launcher=deepspeed", "nproc=2", "head.aux_layers=[1,1,1]"]
    done = subprocess.run(command, env=_clean_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"draftsmith train (rank {rank}): head wants aux layers [1, 1, 1]" in done.stderr
    assert done.stderr.rstrip().endswith(
        "draftsmith train: its ranks failed (exit code 1), saying why above"
    )


def test_a_launched_training_reports_where_it_stopped(
    run_overrides, tmp_path: Path, monkeypatch
) -> None:
    """`launcher=deepspeed`, called from Python: the ranks read this process's very config
    (with the resume `draftsmith run` asks for), saved beside the training; a time-boxed
    training's steps and earlier seconds are read back from what its rank 0 wrote (no launch
    here: the launcher's run is recorded, and what rank 0 writes written as it would). With
    nothing collected to train on, no rank is launched (each would fail with a traceback)."""
    from draftsmith.config import load_config
    from draftsmith.train import launch

    launcher = ["launcher=deepspeed", "nproc=2", "resume=true", "seed=3"]
    cfg = compose([*run_overrides, *launcher, "run_name=stopped", "inputs_from=t"])
    stopped = {"steps": 4, "stopped_early": True, "seconds_before_resume": 12.5}
    launched = []

    def ranks(cmd: list[str]) -> SimpleNamespace:
        launched.append(cmd)
        Path(cfg.stage_dir("train"), loop.STOPPED).write_text(json.dumps(stopped))
        return SimpleNamespace(wait=lambda: 0)

    monkeypatch.setattr(launch.subprocess, "Popen", ranks)
    monkeypatch.delenv("RANK", raising=False)  # set by the in-process trainings before it
    for source, stage in (("offline", "collect"), ("online", "prepare")):
        uncollected = compose(
            [*run_overrides, *launcher, "run_name=none", f"train.source={source}"]
        )
        needed = re.escape(uncollected.input_dir(stage))
        command = re.escape(f"run `draftsmith {stage} run_name=none` first")
        with pytest.raises(
            FileNotFoundError, match=f"^{needed}/.*: no finished {stage} .*{command}"
        ):
            launch.run(uncollected)
    assert launched == []
    assert launch.run(cfg) == stopped
    config = Path(cfg.stage_dir("train"), "launch.yaml")
    assert launched[0][-1] == f"--config={config}"
    assert load_config(config) == replace(cfg, stage="train", launcher="none")
    hydra = compose([f"runs_dir={tmp_path}", "head=hydra", "tree=static", "train.lr=2e-3"])
    save_config(hydra, tmp_path / "hydra.yaml")  # each head's own fields read back typed
    assert load_config(tmp_path / "hydra.yaml") == hydra


@pytest.mark.parametrize("head", ["eagle3", "hydra"])
def test_online_matches_offline(run_overrides, head: str) -> None:
    """Online features train as the collected ones do, for a head reading EAGLE-3's layers and
    for one reading the last layer only (whose batches carry no aux layers either way)."""
    if head != "eagle3":
        run_overrides = [*run_overrides[: -len(HEAD)], *TRAIN, f"head={head}"]
    common = [*run_overrides, "train.max_steps=1", "train.log_every=1", "train.save_every=1000"]
    cfg = compose([*common, f"run_name=offline_{head}", "inputs_from=t"])
    target, _, sources, make_batch_for = loop.setup(cfg, 0)
    assert (make_batch_for(sources["train"])([0, 1]).aux is None) == (head != "eagle3")
    assert len(decoder_layers(target)) == 0  # on collected features the layers stay on disk
    loop.run(cfg)
    online = compose([*common, f"run_name=online_{head}", "inputs_from=t", "train=online", *TRAIN])
    assert len(decoder_layers(loop.setup(online, 0)[0])) == 4
    loop.run(online)
    root = runs_dir(run_overrides)
    # shards store fp16 features; online features are fp32
    online, offline = losses(root, f"online_{head}")[1], losses(root, f"offline_{head}")[1]
    assert online == pytest.approx(offline, rel=5e-3)


def test_wandb_offline_run_files(run_overrides, monkeypatch) -> None:
    """A training resumed from its checkpoint goes on in the same W&B run; a fresh one starts
    another."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    common = [*run_overrides, "run_name=wb", "inputs_from=t", "tracking=wandb"]
    common += ["train.max_steps=2", "train.log_every=1", "train.save_every=1000"]
    loop.run(compose([*common, "train.stop_after=1"]))
    loop.run(compose([*common, "resume=true"]))
    runs = list((Path(runs_dir(run_overrides)) / "wb/train/wandb").glob("offline-run-*"))
    # offline-run-<date>_<time>-<id>, "-1" after it for a second run in the same second
    run_id = re.compile(r"offline-run-\d{8}_\d{6}-([a-z0-9]+)")
    ids = {run_id.match(run.name)[1] for run in runs}
    assert len(runs) == 2 and len(ids) == 1, runs
    data = b"".join(f.read_bytes() for run in runs for f in run.glob("*.wandb"))
    keys = ("train/loss", "train/acc_0", "train/grad_norm", "heldout/sim_tau", "tokens_per_second")
    for key in (*keys, "lr"):
        assert key.encode() in data
    loop.run(compose(common))
    runs = list((Path(runs_dir(run_overrides)) / "wb/train/wandb").glob("offline-run-*"))
    assert len({run_id.match(run.name)[1] for run in runs}) == 2


def test_tensorboard_event_files(run_overrides, monkeypatch) -> None:
    """tracking=tensorboard writes the metrics JSONL's scalars, step for step, and the config;
    a training killed past its checkpoint and resumed shows each step once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    common = [*run_overrides, "inputs_from=t", "tracking=tensorboard", "train.save_every=2"]
    common += ["run_name=tb", "train.max_steps=4", "train.log_every=1", "train.eval_every=1"]
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        killed_at(m, 4)  # step 3 logged past the checkpoint of step 2
        loop.run(compose(common))
    loop.run(compose([*common, "resume=true"]))
    out = Path(runs_dir(run_overrides)) / "tb" / "train"
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    keys = ("train/loss", "train/acc_0", "train/grad_norm", "heldout/sim_tau", "tokens_per_second")
    for key in (*keys, "lr"):
        logged = losses(runs_dir(run_overrides), "tb", key)
        assert [e.step for e in events.Scalars(key)] == [1, 2, 3, 4], key
        assert {e.step: e.value for e in events.Scalars(key)} == pytest.approx(logged), key
    assert "config/text_summary" in events.Tags()["tensors"]


def test_each_tracker_keeps_its_own_curve(tmp_path: Path) -> None:
    """An eval logged again into its folder (step 0) replaces its line; a training resumed from
    step 2 keeps the lines up to it, also when the file is gone."""
    from draftsmith.tracking import Tracker

    def logged(resume_step: int, steps: list[int]) -> list[int]:
        tracker = Tracker(tmp_path, "none", "t", {}, resume_step)
        for step in steps:
            tracker.log({"loss": 1.0}, step)
        tracker.finish()
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["step"] for line in lines]

    assert logged(0, [0]) == [0] and logged(0, [0]) == [0]
    assert logged(0, [1, 2, 3]) == [1, 2, 3]
    assert logged(2, [3, 4]) == [1, 2, 3, 4]
    (tmp_path / "metrics.jsonl").unlink()
    assert logged(4, [5]) == [5]


def test_non_finite_loss_stops_or_skips(run_overrides, monkeypatch) -> None:
    real = loop.collate
    calls = []

    def poisoned(rows, dtype):
        batch = real(rows, dtype)
        calls.append(1)
        if len(calls) == 3:
            batch.aux[0] = float("nan")
        return batch

    monkeypatch.setattr(loop, "collate", poisoned)
    common = [*run_overrides, "train.max_steps=4", "train.log_every=1", "train.save_every=2"]
    with pytest.raises(loop.NonFiniteLoss, match=r"at step 2 .*batch rows.*step_00000002"):
        loop.run(compose([*common, "run_name=nan_stop", "inputs_from=t"]))
    calls.clear()
    summary = loop.run(
        compose([*common, "run_name=nan_skip", "inputs_from=t", "train.nan_policy=skip"])
    )
    assert summary["steps"] == 4
    rows = [
        json.loads(x)
        for x in (Path(runs_dir(run_overrides)) / "nan_skip/train/metrics.jsonl")
        .read_text()
        .splitlines()
    ]
    assert sum(r.get("train/skipped", 0) for r in rows) == 1


def test_each_cuda_rank_takes_its_own_gpu(monkeypatch) -> None:
    """Under a launcher, rank r of a CUDA run makes GPU LOCAL_RANK its current device before
    joining NCCL, so its target, head and every tensor made on "cuda" land on its own GPU
    (without it every rank would load its target onto GPU 0). No GPU here: the calls are
    recorded, not made."""
    import deepspeed
    import torch.distributed as dist

    from draftsmith.train import engine

    calls: dict = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.setdefault("gpu", index))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    def init(dist_backend: str, verbose: bool) -> None:
        calls.setdefault("backend", dist_backend)

    monkeypatch.setattr(deepspeed, "init_distributed", init)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert engine.init_distributed("cuda") == (3, 4)
    assert calls == {"gpu": 1, "backend": "nccl"}
    calls.clear()
    assert engine.init_distributed("cpu") == (3, 4)
    assert calls == {"backend": "gloo"}  # a CPU run picks no GPU


def test_joining_on_the_cpu_builds_no_shared_memory_op(tmp_path: Path) -> None:
    """DeepSpeed's CPU backend would build its shared-memory all-reduce while joining (C++, 31-34 s
    the first time on a machine), say so, and map a 64 MiB /dev/shm buffer on one node, all for
    tensor-parallel inference: an empty extension folder stays empty and no buffer is left."""
    code = "from draftsmith.train import engine\nranks = engine.init_distributed('cpu')\n"
    code += "from deepspeed.comm import comm\nprint(ranks, comm.cdb.shm_comm_op)"
    extensions, buffers = tmp_path / "extensions", _shm_buffers()
    # LOCAL_SIZE: one node, where DeepSpeed's op would make its buffer
    env = {**_clean_env(), "TORCH_EXTENSIONS_DIR": str(extensions), "LOCAL_SIZE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["(0, 1) None"]
    assert not list(extensions.rglob("*.so"))
    assert _shm_buffers() <= buffers


def test_resume_restores_the_gpu_generator_too(monkeypatch) -> None:
    """A checkpoint of a CUDA run holds its GPU's generator state and resuming puts it back
    (EAGLE-1's feature noise draws on the GPU); a CPU run's holds none. No GPU here: the GPU
    generator is a recorded stand-in."""
    import random

    from draftsmith.train.loop import restore_rng, rng_state

    gpu = {"state": torch.tensor([1, 2, 3], dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: gpu["state"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s: gpu.update(state=s))
    assert "cuda" not in rng_state("cpu")
    saved = rng_state("cuda")
    cpu, python = torch.rand(3), random.random()
    gpu["state"] = torch.tensor([9, 9, 9], dtype=torch.uint8)  # the GPU drew meanwhile
    restore_rng(saved)
    assert torch.equal(torch.rand(3), cpu) and random.random() == python
    assert gpu["state"].tolist() == [1, 2, 3]
