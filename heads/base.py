"""The interface every draft head implements, and the types it shares with train/ and inference/.

A head is built from its own small config plus `TargetInfo` (dimensions read from the target's
config, never duplicated in YAML). The target's embedding, final norm and lm_head are bound by
reference with `bind()`: frozen, not parameters of the head, never in its checkpoint.

Feature convention: `hidden` is the output of the target's last decoder layer *before* the final
norm, `aux` the concatenated outputs of the EAGLE-3 layers; position t holds the state after
reading token t, i.e. the state that predicts token t+1.
"""

from __future__ import annotations

import dataclasses
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from draftsmith.errors import InputError, MissingInput
from draftsmith.features import FeatureCapture, final_norm
from draftsmith.files import staged_dir

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass
class TargetInfo:
    """What a head needs to know about its target, read from the target's HF config."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    hidden_act: str = "silu"
    name: str = ""
    architecture: str = ""  # the checkpoint's class (config.architectures), "" if it names none

    @classmethod
    def from_hf_config(cls, config: Any, name: str = "") -> TargetInfo:
        name = name or getattr(config, "_name_or_path", "")
        architecture = (getattr(config, "architectures", None) or [""])[0]
        # an image-text model's sizes are its text decoder's (a plain LM's config is its own)
        config = config.get_text_config(decoder=True)
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        heads = config.num_attention_heads
        return cls(
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            num_layers=config.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            # GPT-2-style configs name it otherwise (n_inner, ffn_dim, None = 4H); the head's MLP
            # width is the head's own choice, the target's is only its default
            intermediate_size=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
            rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=config.max_position_embeddings,
            hidden_act=getattr(config, "hidden_act", "silu"),
            name=name,
            architecture=architecture,
        )

    def check_compatible(self, other: TargetInfo, what: str) -> None:
        """Refuse a head built for another target, naming the mismatching dimensions."""
        keys = ("hidden_size", "vocab_size", "num_layers")
        diff = {
            k: (getattr(self, k), getattr(other, k))
            for k in keys
            if getattr(self, k) != getattr(other, k)
        }
        if diff:
            detail = ", ".join(f"{k}: head has {a}, target has {b}" for k, (a, b) in diff.items())
            raise InputError(f"{what} was built for another target ({detail})")


# glibc serves every block above 32 MB (the cap of its mmap threshold) with a fresh mmap, so each
# reuse page-faults it back in, zero-filled: vocabulary-sized blocks are kept below that. Measured
# on the full-vocab soft CE over 2048 x 49k rows, one thread: 1024-row chunks (200 MB blocks) took
# 12.5 s with 4.2 s in the kernel, 160-row chunks (31 MB) 6.6 s with 0.3 s. The `draftsmith`
# stages also turn glibc's mmap off (draftsmith.allocator), which covers every other big
# activation; the blocks stay for processes without it (library use, tests, other C libraries)
# and because they bound the peak memory of vocabulary-sized work.
BLOCK_ELEMENTS = 7 * 2**20  # 28 MB in float32


def rows_per_block(vocab_size: int) -> int:
    """Rows of a [rows, vocab_size] block that stays below glibc's mmap threshold."""
    return max(1, BLOCK_ELEMENTS // vocab_size)


@dataclass
class TargetParts:
    """Frozen target modules a head uses by reference (never copied into the head)."""

    embed_tokens: nn.Module
    norm: nn.Module
    lm_head: nn.Module
    # what the model itself does to its lm_head's output: a factor (Granite divides by
    # `logits_scaling`, Cohere multiplies by `logit_scale`; 1 for most) and a tanh softcap
    # (Gemma 2's `final_logit_softcapping`); they shape the distributions heads are trained on
    # and draft trees are ranked by
    logit_scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def from_model(cls, model: nn.Module) -> TargetParts:
        config = model.config.get_text_config(decoder=True)
        scale = (getattr(config, "logit_scale", None) or 1.0) / (
            getattr(config, "logits_scaling", None) or 1.0
        )
        softcap = getattr(config, "final_logit_softcapping", None)
        return cls(
            model.get_input_embeddings(),
            final_norm(model),
            model.get_output_embeddings(),
            scale,
            softcap,
        )

    def scaled(self, logits: torch.Tensor) -> torch.Tensor:
        """The lm_head's raw `logits` as the model outputs them."""
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.softcap is not None:  # in the model's order: divide, tanh, multiply
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Target logits from final-normed features [.., H] -> [.., V]."""
        return self.scaled(self.lm_head(normed))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target logits from pre-norm features: lm_head(norm(hidden)), scaled as the model does."""
        return self.head_logits(self.norm(hidden))

    @torch.no_grad()
    def check(self, model: nn.Module) -> TargetParts:
        """These parts, after checking that they reproduce `model`'s own logits on a few tokens
        (a model that transforms its last state in a way not modelled here, e.g. a projection
        or a softcap, would otherwise train heads on the wrong distribution, silently)."""
        device = self.lm_head.weight.device
        ids = (torch.arange(1, 17, device=device) % self.vocab_size)[None]  # [1, 16]
        with FeatureCapture(model) as capture:
            expected = model(input_ids=ids, use_cache=False).logits.float()  # [1, 16, V]
        got = self.logits(capture.hidden).float()
        gap = float((got - expected).abs().max())
        if not gap <= 1e-2 * max(float(expected.abs().max()), 1.0):
            known = f"lm_head(final norm(last layer)) x {self.logit_scale:g}" + (
                f", softcapped at {self.softcap:g}" if self.softcap is not None else ""
            )
            raise InputError(
                f"{type(model).__name__}: its logits are not {known} (max gap {gap:.3g}); "
                "draftsmith does not know how this architecture turns its last hidden state "
                "into logits"
            )
        return self

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    def restricted(self, token_ids: torch.Tensor) -> TargetParts:
        """The same parts with an lm_head over `token_ids` [Vd] only (its rows copied, so a
        draft's logits read Vd x H weights instead of V x H): logit i is target token
        token_ids[i]'s logit."""
        weight = self.lm_head.weight  # [V, H]
        lm_head = nn.Linear(weight.shape[1], token_ids.numel(), bias=False)
        lm_head.to(device=weight.device, dtype=weight.dtype)
        lm_head.weight.data = weight.detach()[token_ids.to(weight.device)].contiguous()
        return dataclasses.replace(self, lm_head=lm_head)

    @torch.no_grad()
    def top_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's greedy next token at every position [B, T] (chunked: [B, T, V] logits
        would not fit for real vocabularies)."""
        B, T, H = hidden.shape
        flat = self.norm(hidden).reshape(B * T, H)
        # 2-D matmuls and max().indices: both measurably faster on CPU than a 3-D lm_head call
        # followed by argmax (collection runs this over every collected token)
        rows = rows_per_block(self.vocab_size)
        top = [self.lm_head(x).max(-1).indices for x in flat.split(rows)]  # [n] each
        return torch.cat(top).reshape(B, T)


@dataclass
class HeadBatch:
    """One training batch of target features, right-padded to a common length T."""

    input_ids: torch.Tensor  # [B, T] int64
    loss_mask: torch.Tensor  # [B, T] 1 where token t is an assistant token to predict
    hidden: torch.Tensor  # [B, T, H] last decoder layer output, before the final norm
    aux: torch.Tensor | None = None  # [B, T, 3H] EAGLE-3 low/mid/high layer outputs
    lengths: torch.Tensor | None = None  # [B] valid tokens per row (None: all valid)
    # [B, T] the target's argmax next token at each position, if precomputed (collect does)
    target_top: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> HeadBatch:
        """The batch on `device` (a tensor already there is not copied)."""
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return HeadBatch(**{k: None if t is None else t.to(device) for k, t in moved.items()})

    def valid(self) -> torch.Tensor:
        """[B, T] bool: real (non-padding) positions."""
        B, T = self.input_ids.shape
        if self.lengths is None:
            return torch.ones(B, T, dtype=torch.bool, device=self.input_ids.device)
        return torch.arange(T, device=self.input_ids.device)[None, :] < self.lengths[:, None]


@dataclass
class HeadConfig:
    """Fields every head config has; each head adds its own."""

    name: str = ""

    @property
    def drafts_with_target_lm_head(self) -> bool:
        """True when the head drafts through the target's full-vocabulary lm_head (EAGLE-1,
        Medusa/Hydra sharing it), which inference can restrict to a frequent-token subset."""
        return False


def shifted(x: torch.Tensor, k: int, fill: float | int = 0) -> torch.Tensor:
    """x shifted left by k along dim 1 (position t gets x[t + k]); the tail is `fill`."""
    if k == 0:
        return x
    out = torch.full_like(x, fill)
    if k < x.shape[1]:
        out[:, : x.shape[1] - k] = x[:, k:]
    return out


def predicts_assistant_token(batch: HeadBatch, ahead: int) -> torch.Tensor:
    """[B, T] anchors t whose token t+ahead exists and is under the loss mask."""
    valid = batch.valid()
    mask = batch.loss_mask.bool()
    return valid & shifted(valid, ahead, False) & shifted(mask, ahead, False)


class DepthLosses:
    """Sums per-depth losses with weight decay^k and records per-depth top-1 agreement:
    the (loss, metrics) every head returns."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.total: torch.Tensor | float = 0.0
        self.metrics: dict[str, float] = {}
        self.accuracies: list[float] = []

    def add(self, k: int, loss_sum: torch.Tensor, correct: torch.Tensor, count: torch.Tensor):
        step_loss = loss_sum / count.clamp_min(1)
        self.total = self.total + self.decay**k * step_loss
        acc = (correct.float() / count.clamp_min(1)).item()
        self.accuracies.append(acc)
        self.metrics |= {
            f"loss_{k}": step_loss.item(),
            f"acc_{k}": acc,
            f"count_{k}": float(count.item()),
        }

    def result(self) -> tuple[torch.Tensor, dict[str, float]]:
        total = torch.as_tensor(self.total, dtype=torch.float32)
        return total, {
            **self.metrics,
            "loss": total.item(),
            "sim_tau": simulated_tau(self.accuracies),
        }


def simulated_tau(step_accuracies: list[float]) -> float:
    """1 + sum_k prod_{j<=k} acc_j: the chain acceptance length the step accuracies imply."""
    tau, running = 1.0, 1.0
    for acc in step_accuracies:
        running *= acc
        tau += running
    return tau


class DraftHead(nn.Module, ABC):
    """Base class of all draft heads.

    Subclasses set `name`, `config_class` and `kind` ("autoregressive" heads draft one depth at a
    time with their own KV cache; "parallel" heads propose every depth from one target state).
    """

    name: ClassVar[str]
    kind: ClassVar[str]
    config_class: ClassVar[type[HeadConfig]]

    def __init__(self, config: HeadConfig, target: TargetInfo) -> None:
        super().__init__()
        self.config = config
        self.target = target
        # recompute layer activations in backward (set by the trainer)
        self.gradient_checkpointing = False

    def bind(self, parts: TargetParts) -> DraftHead:
        """Attach the frozen target modules by reference (kept out of parameters/state_dict)."""
        for module in (parts.embed_tokens, parts.norm, parts.lm_head):
            module.requires_grad_(False)
        object.__setattr__(self, "_parts", parts)
        return self

    @property
    def parts(self) -> TargetParts:
        parts = getattr(self, "_parts", None)
        if parts is None:
            raise RuntimeError(f"{self.name} head is not bound to a target: call head.bind(parts)")
        return parts

    @property
    def drafts_with_target_lm_head(self) -> bool:
        return self.config.drafts_with_target_lm_head

    @property
    def own_vocab_size(self) -> int | None:
        """Rows of the head's own draft vocabulary (EAGLE-3's d2t), or None for a head that
        drafts from the target's whole vocabulary (through the target's lm_head or its own)."""
        return None

    @property
    def aux_layers(self) -> list[int]:
        """Target layers the head reads besides the last (EAGLE-3's, a fused Hydra's), in the
        features convention; [] for none. Training and decoding capture exactly these."""
        return list(getattr(self.config, "aux_layers", None) or [])

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (the identity unless the head has its own vocab)."""
        return draft_ids

    @abstractmethod
    def loss(self, batch: HeadBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Training loss and metrics (must include `acc_0..acc_{k-1}` per draft depth)."""

    def forward(self, batch: HeadBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Training engines call the module: forward is the loss. Batches are built on the CPU
        (collated shards, or online features): they go to the head's device here."""
        return self.loss(batch.to(next(self.parameters()).device))

    # ---- persistence: config.json + model.safetensors --------------------------------------
    def config_dict(self) -> dict[str, Any]:
        return {
            "draftsmith_head": self.name,
            "head_config": dataclasses.asdict(self.config),
            "target": dataclasses.asdict(self.target),
        }

    def save(self, folder: str | Path) -> Path:
        """Write config.json + model.safetensors atomically (a temp folder renamed into place)."""
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        with staged_dir(folder) as build:
            save_file(state, str(build / WEIGHTS_FILE), metadata={"format": "pt"})
            (build / CONFIG_FILE).write_text(json.dumps(self.config_dict(), indent=2))
        return Path(folder)


def read_head_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / CONFIG_FILE
    if not path.exists():
        raise MissingInput(f"{path}: not a draftsmith head folder (no {CONFIG_FILE})")
    data = json.loads(path.read_text())
    if "draftsmith_head" not in data:
        raise InputError(
            f"{path}: no 'draftsmith_head' key: not a draftsmith head folder "
            "(official EAGLE/Medusa/speculators folders are read by the importers)"
        )
    return data


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; a damaged one (truncated, overwritten) is named."""
    try:
        return load_file(str(path))
    except SafetensorError as err:
        raise InputError(f"{path}: not a readable safetensors file ({err})") from None


def load_weights(head: DraftHead, folder: str | Path) -> DraftHead:
    state = read_safetensors(Path(folder) / WEIGHTS_FILE)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise InputError(
            f"{folder}: weights do not fit the {head.name} head: "
            f"missing {missing}, unexpected {unexpected}"
        )
    return head


def _soft_ce_chunks(
    h: torch.Tensor,  # [M, H]
    target_hidden: torch.Tensor,  # [M, H]
    logits_fn,
    parts: TargetParts,
    chunk: int,
    want_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Chunked soft-CE sum and top-1 agreements; with want_grad also dL/dh [M, H], taken per chunk
    while its [chunk, V] blocks are alive."""
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    correct = torch.zeros((), dtype=torch.long, device=h.device)
    grads = []
    for s in range(0, h.shape[0], chunk):
        with torch.enable_grad():
            leaf = h[s : s + chunk].detach().requires_grad_(want_grad)  # [c, H]
            logits = logits_fn(leaf)  # [c, V]
        with torch.no_grad():
            target_logits = parts.logits(target_hidden[s : s + chunk]).float()  # [c, V]
            probs = torch.softmax(target_logits, dim=-1)
            log_q = torch.log_softmax(logits.detach().float(), dim=-1)
            total += -(probs * log_q).sum()
            # max().indices = argmax (first maximum), ~3x faster on CPU over [c, V] blocks
            correct += (log_q.max(-1).indices == target_logits.max(-1).indices).sum()
        if want_grad:
            # d/dz of -sum_v p_v log softmax(z)_v is softmax(z) - p (p sums to 1)
            grad_logits = (log_q.exp() - probs).to(logits.dtype)
            grads.append(torch.autograd.grad(logits, leaf, grad_logits)[0])
    if not want_grad:
        return total, correct, None
    return total, correct, torch.cat(grads) if grads else torch.zeros_like(h)


class _FrozenLogitsSoftCE(torch.autograd.Function):
    """Soft cross-entropy through a frozen logits layer, its input gradient taken in forward.

    Only dL/dh [M, H] is kept for backward: no [chunk, V] block outlives its chunk and nothing is
    recomputed, so 3 vocab-sized matmuls per chunk (draft logits, target logits, pull-back)
    instead of checkpointing's 5. At V = 49k they dominate Medusa / Hydra / EAGLE-1 steps.
    """

    @staticmethod
    def forward(ctx, h, target_hidden, logits_fn, parts, chunk):  # noqa: ANN001, ANN205
        total, correct, grad_h = _soft_ce_chunks(h, target_hidden, logits_fn, parts, chunk, True)
        ctx.save_for_backward(grad_h)
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx, grad_total, grad_correct):  # noqa: ANN001, ANN205
        (grad_h,) = ctx.saved_tensors
        return grad_total * grad_h, None, None, None, None


def distill_selected(
    draft_hidden: torch.Tensor,  # [M, H] draft states at the selected positions
    target_hidden: torch.Tensor,  # [M, H] target states (pre-final-norm) that define the labels
    draft_logits_fn,  # [m, H] -> [m, V] logits over the same vocab as the target's
    parts: TargetParts,
    frozen_logits: bool = True,
    chunk: int | None = None,  # rows per [chunk, V] block; default: below glibc's mmap threshold
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of soft cross-entropies against the full-vocab target distribution, and the number of
    top-1 agreements, over M selected positions.

    With a frozen `draft_logits_fn` (the target's lm_head) peak memory holds one [chunk, V] block
    instead of [M, V] (_FrozenLogitsSoftCE); with V = 49k that is the difference between fitting
    and not. A trainable one (Medusa's own lm_heads) takes plain autograd over all M rows.
    """
    chunk = chunk or rows_per_block(parts.vocab_size)
    if not (torch.is_grad_enabled() and draft_hidden.requires_grad):
        total, correct, _ = _soft_ce_chunks(
            draft_hidden, target_hidden, draft_logits_fn, parts, chunk, False
        )
        return total, correct
    if frozen_logits:
        return _FrozenLogitsSoftCE.apply(draft_hidden, target_hidden, draft_logits_fn, parts, chunk)
    logits = draft_logits_fn(draft_hidden).float()  # [M, V]
    with torch.no_grad():
        target_logits = parts.logits(target_hidden).float()  # [M, V]
        correct = (logits.max(-1).indices == target_logits.max(-1).indices).sum()
    loss = -(torch.softmax(target_logits, -1) * torch.log_softmax(logits, -1)).sum()
    return loss, correct
