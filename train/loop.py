"""Head training (`draftsmith train`): offline shards or the online target, one DeepSpeed engine.

Reads top to bottom: set up ranks and data, build the head and engine, resume, then one loop of
optimizer steps with logging, held-out evaluation (loss, per-step accuracy, simulated tau; the
best head by simulated tau is kept), checkpoints and, at the end, the native head folder
`runs/<run>/train/head` plus loss/accuracy plots. Only rank 0 writes shared files.

Data order: a (seed, epoch)-deterministic list of micro-batches; optimizer step s of an epoch
uses micro-batches [s*A*W, (s+1)*A*W) (A = grad_accum, W = world size), rank r taking every W-th.
So W ranks x A accumulation sees exactly what 1 rank x (W*A) accumulation sees, and a resumed
run continues at the same micro-batch with restored RNG states.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith.conf.schema import Config
from draftsmith.errors import InputError, MissingInput
from draftsmith.files import write_text_atomic
from draftsmith.heads import (
    DraftHead,
    HeadBatch,
    TargetInfo,
    TargetParts,
    build_head,
    load_head,
)
from draftsmith.heads.base import simulated_tau
from draftsmith.heads.vocab import answer_token_counts
from draftsmith.provenance import (
    check_unchanged,
    made,
    new_id,
    pin_target,
    record,
    stage_settings,
    stale,
    upstream,
)
from draftsmith.target import load_config, load_target, target_name
from draftsmith.tracking import Tracker
from draftsmith.train import engine as ds
from draftsmith.train.data import OnlineRows, ShardRows, batch_order, collate, online_batch
from draftsmith.train.plots import plot_training

STOPPED = "stopped.json"  # in train/: a time-boxed training's result (steps, earlier seconds)


class NonFiniteLoss(RuntimeError):
    pass


def train_step(
    engine, batches: list[HeadBatch], nan_policy: str = "stop", precision=contextlib.nullcontext
) -> dict[str, float]:
    """One optimizer step over `batches` (this rank's micro-batches). Returns mean metrics and,
    when every micro-batch counted, `grad_norm`: the gradients' global 2-norm before clipping."""
    sums: dict[str, float] = {}
    used = 0
    norm = None
    for batch in batches:
        with precision():
            loss, metrics = engine(batch)
        if not ds.all_ranks_finite(loss):
            if nan_policy == "stop":
                raise NonFiniteLoss(f"non-finite loss {loss.item()}")
            continue  # every rank skips this micro-batch together
        engine.backward(loss)
        norm = ds.step(engine)  # a number after the step's last micro-batch
        used += 1
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v
    means = {k: v / max(used, 1) for k, v in sums.items()} | {"skipped": len(batches) - used}
    if used == len(batches) and norm is not None:
        means["grad_norm"] = norm
    return means


@torch.no_grad()
def evaluate(engine, rows, cfg: Config, make_batch) -> dict[str, float]:
    """Held-out loss, per-step accuracy (token-weighted) and simulated tau. All ranks run it."""
    engine.eval()
    limit = len(rows) if cfg.train.eval_rows is None else min(len(rows), cfg.train.eval_rows)
    totals: dict[str, float] = {}
    counts: dict[str, float] = {}
    order = sorted(range(limit), key=lambda i: rows.lengths()[i])
    size = cfg.train.micro_batch_size
    for s in range(0, limit, size):
        with ds.autocast(cfg):
            _, metrics = engine(make_batch([order[j] for j in range(s, min(s + size, limit))]))
        for k, v in metrics.items():
            if k.startswith(("acc_", "loss_")):
                weight = metrics.get(f"count_{k.split('_')[1]}", 1.0)
                totals[k] = totals.get(k, 0.0) + v * weight
                counts[k] = counts.get(k, 0.0) + weight
    engine.train()
    out = {f"heldout/{k}": totals[k] / max(counts[k], 1.0) for k in totals}
    accs = [out[k] for k in sorted(out, key=lambda k: int(k.rsplit("_", 1)[1])) if "acc_" in k]
    out["heldout/sim_tau"] = simulated_tau(accs)
    return out


def setup(cfg: Config, rank: int):
    """Target, head (vocab mapping included), train and held-out row sources."""
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    t = cfg.train
    online = t.source == "online"
    trust, revision = cfg.target.trust_remote_code, cfg.target.revision
    # on collected features the head needs the target's embeddings, final norm and lm_head
    # only: its layers stay on disk. The check below still covers the logit transform; collect
    # checked the whole model's logits
    target = load_target(
        cfg.target.path, cfg.dtype, cfg.device, trust, layers=online, revision=revision
    )
    info = TargetInfo.from_hf_config(
        load_config(cfg.target.path, trust, revision), target_name(cfg.target.path)
    )
    head = build_head(cfg.head, info).bind(TargetParts.from_model(target).check(target))
    aux_layers = head.aux_layers
    import datasets

    prepared = Path(cfg.input_dir("prepare")) / "dataset"
    if getattr(head.config, "draft_vocab_size", 0):
        # before init_from: a start head's weights carry their own draft vocabulary (EAGLE-3's
        # d2t / t2d); a Medusa head's loss vocabulary is not in its weights
        head.set_vocab(answer_token_counts(cfg.input_dir("prepare"), info.vocab_size))
    if t.init_from:
        start = load_head(t.init_from, info)
        try:  # strict: every tensor of `head` must come from the start head, shapes included
            head.load_state_dict(start.state_dict())
        except RuntimeError as err:
            raise InputError(
                f"train.init_from={t.init_from}: does not fit head {head.name}: {err}"
            ) from None
    dtype = torch.float32
    if online:
        if not prepared.exists():
            raise MissingInput(f"{prepared}: run `draftsmith prepare` first")
        split = datasets.load_from_disk(str(prepared))
        sources = {
            name: OnlineRows(split[name], cfg.train.max_len) for name in ("train", "heldout")
        }

        def make_batch_for(rows):
            return lambda idx: online_batch(target, [rows[i] for i in idx], aux_layers, dtype)
    else:
        folder = cfg.input_dir("collect")
        sources = {
            name: ShardRows(folder, name, cfg.train.max_len, aux=bool(aux_layers))
            for name in ("train", "heldout")
        }
        sources["train"].check(info, aux_layers)

        def make_batch_for(rows):
            return lambda idx: collate([rows[i] for i in idx], dtype)

    return target, head, sources, make_batch_for


def run(cfg: Config) -> dict:
    pin_target(cfg)
    settings = stage_settings(cfg, "train")  # as asked: building the head fills in its defaults
    inputs = made(cfg, upstream(cfg, "train"))  # the features' (or online, the data's) id
    if cfg.resume:  # its checkpoints go on only with the settings and inputs they were made with
        check_unchanged(cfg, "train", settings)
        if stale(cfg, "train"):
            raise InputError(
                f"{cfg.stage_dir('train')}: its checkpoints were trained on "
                f"{upstream(cfg, 'train')} output made again since; train without resume=true"
            )
    rank, world = ds.init_distributed(cfg.device)
    out = Path(cfg.stage_dir("train"))
    target, head, sources, make_batch_for = setup(cfg, rank)
    train_rows, heldout_rows = sources["train"], sources["heldout"]
    if len(heldout_rows) == 0:  # its simulated tau would read 1.0 and pick the "best" head
        raise InputError(
            f"{cfg.input_dir('prepare')}: no held-out rows to pick the best head by (its "
            "held-out conversations were all skipped: see stats.json); prepare with more "
            "data.heldout"
        )
    train_batch, heldout_batch = make_batch_for(train_rows), make_batch_for(heldout_rows)
    t = cfg.train
    if t.loss_on == "all":
        train_batch = loss_on_all(train_batch)
    micro_per_step = t.grad_accum * world
    steps_per_epoch = (
        len(batch_order(train_rows.lengths(), t.micro_batch_size, cfg.seed, 0)) // micro_per_step
    )
    if steps_per_epoch == 0:
        raise InputError(
            f"{len(train_rows)} training rows are too few for {micro_per_step} "
            f"micro-batches of {t.micro_batch_size} per step"
        )
    total = steps_per_epoch * t.epochs if t.max_steps is None else t.max_steps
    head.train()
    if t.gradient_checkpointing:
        head.gradient_checkpointing = True
    engine = ds.build_engine(head, cfg, total)
    ckpt = out / "checkpoints"
    # earlier invocations' training seconds up to the checkpoint resumed from, so a run's
    # reported minutes are its whole training, not the last invocation's
    step, best, earlier = 0, -1.0, 0.0
    if cfg.resume:
        state = ds.load_checkpoint(engine, ckpt)
        if state is None:
            raise MissingInput(
                f"resume=true but {ckpt}/latest does not exist: no checkpoint to continue from "
                "(train without resume=true; a killed training continues without it too)"
            )
        step, best = state["step"], state["best"]
        earlier = state.get("seconds", 0.0)  # checkpoints before session 35 lack it
        restore_rng(state["rng"][rank])
    elif rank == 0:  # before the first checkpoint, so a resume can be checked against it
        out.mkdir(parents=True, exist_ok=True)
        record(cfg, "train", settings | {"inputs": inputs})
        # an earlier training's summary would mark this one finished if it were killed, and its
        # checkpoints would be resumed as this one's
        for old in (out / "summary.json", ckpt / "latest"):
            old.unlink(missing_ok=True)
    tracker = Tracker(out, cfg.tracking, cfg.run_name, cfg, step) if rank == 0 else None
    bar = tqdm(total=total, initial=step, desc=f"train {head.name}", disable=rank != 0)
    window: dict[str, float] = {}  # metric sums over the steps since the last log
    steps_with: dict[str, int] = {}
    tokens, t0, last_good = 0, time.perf_counter(), None
    started = t0
    history: list[dict] = []
    stop = total if t.stop_after is None else min(total, step + t.stop_after)
    while step < stop:
        epoch, in_epoch = divmod(step, steps_per_epoch)
        order = batch_order(train_rows.lengths(), t.micro_batch_size, cfg.seed, epoch)
        first = in_epoch * micro_per_step
        mine = [order[first + g * world + rank] for g in range(t.grad_accum)]
        batches = [train_batch(idx) for idx in mine]
        try:
            metrics = train_step(engine, batches, t.nan_policy, lambda: ds.autocast(cfg))
        except NonFiniteLoss as err:
            rows = [
                train_rows.rows[i] if hasattr(train_rows, "rows") else i
                for idx in mine
                for i in idx
            ]
            raise NonFiniteLoss(
                f"{err} at step {step} (rank {rank}); batch rows (shard, offset, "
                f"length): {rows}; last good checkpoint: {last_good}; "
                "train.nan_policy=skip skips such batches"
            ) from None
        step += 1
        tokens += sum(int(b.valid().sum()) for b in batches) * world
        for k, v in metrics.items():
            window[k] = window.get(k, 0.0) + v
            steps_with[k] = steps_with.get(k, 0) + 1
        bar.update(1)
        if step % t.log_every == 0 or step == total:
            # each metric's mean over the steps that had it (a step whose micro-batches were all
            # skipped has no loss, one that skipped any has no gradient norm)
            logged = {
                f"train/{k}": v / steps_with[k]
                for k, v in window.items()
                if not k.startswith("count")
            }
            logged["lr"] = engine.get_lr()[0]  # with Muon, its matrices' group
            logged["tokens_per_second"] = tokens / (time.perf_counter() - t0)
            window, steps_with, tokens, t0 = {}, {}, 0, time.perf_counter()
            loss = logged.get("train/loss", float("nan"))  # nan: every batch was skipped
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{logged['tokens_per_second']:.0f}")
            if tracker:
                tracker.log(logged, step)
            history.append({"step": step, **logged})
        if step % t.eval_every == 0 or step == total:
            held = evaluate(engine, heldout_rows, cfg, heldout_batch)
            history.append({"step": step, **held})
            if tracker:
                tracker.log(held, step)
            if held["heldout/sim_tau"] > best:
                best = held["heldout/sim_tau"]
                save_head(engine, head, out / "best", rank)
        if step % t.save_every == 0 or step in (total, stop):
            seconds = earlier + time.perf_counter() - started
            rng = _gather(rng_state(cfg.device), world)
            state = {"step": step, "best": best, "rng": rng, "seconds": seconds}
            last_good = ds.save_checkpoint(engine, ckpt, step, state, t.keep_last, rank)
    bar.close()
    if step < total:  # time-boxed: the checkpoint above is the state to resume from
        stopped = {"steps": step, "stopped_early": True, "seconds_before_resume": earlier}
        if rank == 0:  # what the process that launched the ranks reports (launch.py)
            write_text_atomic(out / STOPPED, json.dumps(stopped))
        ds.barrier()
        return stopped
    save_head(engine, head, out / "head", rank)
    summary = {
        "made": new_id(),  # what eval and export read, named (provenance); its inputs: settings
        "steps": step,
        "best_heldout_sim_tau": best,
        "head": str(out / "head"),
        "seconds_before_resume": earlier,
    }
    if rank == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        (out / STOPPED).unlink(missing_ok=True)  # an earlier invocation's stop, finished now
        plot_training(out / "metrics.jsonl", out / "training.png", t.grad_clip)
        tracker.artifact(out / "head", f"{cfg.run_name}-{head.name}")
        tracker.finish()
        print(f"train: {summary}")
    ds.barrier()
    return summary


MakeBatch = Callable[[list[int]], HeadBatch]


def loss_on_all(make_batch: MakeBatch) -> MakeBatch:
    """Wrap a batch maker so every real token is a training target, not only assistant ones
    (`train.loss_on=all`): the loss mask becomes the valid-token mask."""

    def wrapped(idx: list[int]) -> HeadBatch:
        batch = make_batch(idx)
        batch.loss_mask = batch.valid().to(batch.loss_mask.dtype)
        return batch

    return wrapped


def rng_state(device: str) -> dict:
    """This rank's random generators, for an identical loss curve after resuming: Python's, the
    CPU's and, on a GPU, its current device's (EAGLE-1's feature noise draws there)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.startswith("cuda"):
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict) -> None:
    """Undo `rng_state` (checkpoints from before session 62 hold no GPU state)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _gather(obj, world: int) -> list:
    import torch.distributed as dist

    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def save_head(engine, head: DraftHead, folder: Path, rank: int) -> None:
    with ds.full_parameters(engine):
        if rank == 0:
            head.save(folder)
    ds.barrier()
