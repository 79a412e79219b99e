"""The only module that touches DeepSpeed: process group, engine, checkpoints, weight gathering.

On CUDA the engine runs over NCCL, on CPU over gloo, so multi-rank training is exercised for real
on machines without GPUs; `dtype=bfloat16` autocasts the head's forward on either (`autocast`).
Checkpoints are written with `save_latest=False`; `latest` is then replaced atomically by rank 0
after a barrier, so it never names a partial checkpoint. Older checkpoints beyond `keep_last` are
deleted.
"""

from __future__ import annotations

import math
import os
import shutil
import warnings
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from draftsmith.conf.schema import Config
from draftsmith.errors import MissingInput
from draftsmith.files import write_text_atomic
from draftsmith.target import check_device


def name_accelerator(device: str) -> None:
    """Tell DeepSpeed, before it is imported here or in the processes started from here, that a
    training on the CPU runs on the CPU. It picks its accelerator at import: a GPU if it sees
    one (a CPU training on a GPU machine would be placed there), else the CPU with a warning
    that it found none. A user's own DS_ACCELERATOR stays."""
    if not device.startswith("cuda"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def init_distributed(device: str) -> tuple[int, int]:
    """Join (or create) the process group; returns (rank, world size)."""
    name_accelerator(device)
    import deepspeed
    import torch.distributed as dist

    if device.startswith("cuda"):  # this rank's GPU, before anything joins or loads
        check_device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}")
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # a plain single process
            os.environ.update(
                RANK="0",
                LOCAL_RANK="0",
                WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())),
            )
        cuda = device.startswith("cuda")
        if cuda:
            # one GPU per rank: "cuda" then means this rank's GPU for the target, the head and
            # every tensor made on "cuda" (else every rank would load its target onto GPU 0)
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        else:
            skip_shm_all_reduce()
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
        # DeepSpeed's ZeRO gathers call the collective torch renamed (all_gather_single): a
        # warning per rank that its users cannot act on
        warnings.filterwarnings(
            "ignore", r"`torch\.distributed\.all_gather_into_tensor` is deprecated", FutureWarning
        )
    return dist.get_rank(), dist.get_world_size()


def skip_shm_all_reduce() -> None:
    """Keep DeepSpeed's CPU backend from building its shared-memory all-reduce.

    Joining, it builds that op (C++ with ninja: 31-34 s on 2 cores, the first time on a machine),
    prints a line per rank saying so and maps a 64 MiB /dev/shm buffer per rank that it never
    unlinks, all for tensor-parallel inference's all-reduce; training reduces over gloo. It skips
    an op its table of compatible ops marks unusable (a DeepSpeed without that table trains on,
    building the op; tests/test_train.py would say so).
    """
    import deepspeed.ops

    getattr(deepspeed.ops, "__compatible_ops__", {})["deepspeed_shm_comm"] = False


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ds_config(cfg: Config) -> dict:
    t, d = cfg.train, cfg.deepspeed
    zero: dict = {"stage": d.zero_stage}
    if d.offload_optimizer and d.zero_stage > 0:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        # with the optimizer offloaded, ours (torch's AdamW, DeepSpeed's Muon) steps on the CPU
        # copies; DeepSpeed otherwise refuses any but its compiled CPU Adam
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    config.update(d.extra)
    return config


def lr_lambda(cfg: Config, total_steps: int):
    t = cfg.train

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / max(t.warmup_steps, 1)
        if t.schedule == "constant":
            return 1.0
        progress = min((step - t.warmup_steps) / max(total_steps - t.warmup_steps, 1), 1.0)
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if t.schedule == "cosine" else 1 - progress
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * shape

    return factor


def build_engine(head: torch.nn.Module, cfg: Config, total_steps: int):
    """The optimizer (`train.optimizer`) + warmup/decay schedule wrapped in a DeepSpeed engine.

    AdamW is built here. Muon is DeepSpeed's own (`"optimizer": {"type": "Muon"}`): it tags
    every matrix but embeddings and lm_heads for Muon and gives the rest torch's AdamW, in one
    optimizer whose param groups the schedule scales alike."""
    import deepspeed

    t = cfg.train
    params = [p for p in head.parameters() if p.requires_grad]
    config = ds_config(cfg)
    schedule = lr_lambda(cfg, total_steps)
    if t.optimizer == "muon":
        config["optimizer"] = {
            "type": "Muon",
            "params": {
                "muon_lr": t.muon_lr,
                "adam_lr": t.lr,
                "betas": [t.beta1, t.beta2],
                "weight_decay": t.weight_decay,
                "momentum": t.muon_momentum,
                "ns_method": t.muon_ns_method,
                # the Adam half runs torch's AdamW: DeepSpeed's own (FusedAdam, or CPUAdam when
                # offloaded) are C++ ops built on first use, ~45 s each on 2 cores
                "torch_adam": True,
            },
        }
        optimizer = None  # DeepSpeed builds it, then the schedule over it
        scheduler = partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=schedule)
    else:
        optimizer = torch.optim.AdamW(
            params, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    engine, _, _, _ = deepspeed.initialize(
        model=head,
        model_parameters=params,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=config,
    )
    return engine


def autocast(cfg: Config):
    """Mixed precision for the head's forward when `dtype=bfloat16`: bf16 matmuls over fp32
    master weights, the same on CPU and CUDA. DeepSpeed's own bf16 mode stays off: it would
    hold the head's weights in bf16, and the fp32 features would meet them in mixed-dtype
    matmuls that only autocast reconciles."""
    device_type = "cuda" if cfg.device.startswith("cuda") else "cpu"
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16")


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def all_ranks_finite(loss: torch.Tensor) -> bool:
    """True iff the loss is finite on every rank (a collective decision, so ranks stay in step)."""
    import torch.distributed as dist

    # on the loss's device: NCCL reduces CUDA tensors only
    flag = torch.tensor([0.0 if torch.isfinite(loss).all() else 1.0], device=loss.device)
    if dist.is_initialized():
        dist.all_reduce(flag)
    return flag.item() == 0.0


CHECKPOINT = "step_"  # a checkpoint's tag: CHECKPOINT + its step, 8 digits


def step(engine) -> float | None:
    """`engine.step()`; at a gradient accumulation boundary, returns the gradients' global 2-norm
    before clipping (None where DeepSpeed computes none). ZeRO 1-3 keep the norm their optimizer
    computed over every rank's partition; ZeRO 0 keeps none, so it is read from the gradients on
    the parameters (all-reduced in the boundary's backward: the same on every rank) before the
    step clips and zeroes them."""
    if not engine.is_gradient_accumulation_boundary():
        engine.step()
        return None
    if engine.zero_optimization_stage() == 0:
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else None
        engine.step()
    else:
        engine.step()
        norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def save_checkpoint(
    engine, folder: Path, step: int, client_state: dict, keep_last: int, rank: int
) -> str:
    tag = f"{CHECKPOINT}{step:08d}"
    engine.save_checkpoint(str(folder), tag=tag, client_state=client_state, save_latest=False)
    barrier()
    if rank == 0:
        write_text_atomic(folder / "latest", tag)
        old = sorted(p for p in folder.glob(f"{CHECKPOINT}*") if p.is_dir())[:-keep_last]
        for path in old:
            shutil.rmtree(path, ignore_errors=True)
    barrier()
    return tag


def load_checkpoint(engine, folder: Path) -> dict | None:
    """Load the checkpoint `latest` names; None if there is none."""
    latest = folder / "latest"
    if not latest.exists():
        return None
    tag = latest.read_text().strip()
    path, client_state = engine.load_checkpoint(str(folder), tag=tag)
    if path is None:
        raise MissingInput(f"{folder}/{tag}: checkpoint named by `latest` could not be loaded")
    return client_state


@contextmanager
def full_parameters(engine):
    """Inside, every rank sees full (un-partitioned) head parameters (to save under ZeRO-3)."""
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(
            list(engine.module.parameters()), modifier_rank=None
        ):
            yield
    else:
        yield
