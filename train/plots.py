"""Training curves from metrics.jsonl, as a PNG: the first draft step's loss (train and held
out: the same quantity, so they can be compared), per-step top-1 agreement (each step one colour,
train solid, held out dashed), the held-out simulated tau training keeps its best head by, and the
gradient norm before clipping against the clip."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _points(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in rows if key in r]


def plot_training(metrics_path: Path, out: Path, grad_clip: float = 0.0) -> None:
    """`grad_clip`: train.grad_clip, drawn under the gradient norms (0: none)."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    if not rows:
        return
    fig, (ax_loss, ax_acc, ax_tau, ax_norm) = plt.subplots(1, 4, figsize=(18, 3.6))
    # train/loss sums every unrolled step's (weighted) loss: not comparable with a held-out one
    train_loss = "train/loss_0" if any("train/loss_0" in r for r in rows) else "train/loss"
    for key, style in ((train_loss, "-"), ("heldout/loss_0", "o--")):
        if pts := _points(rows, key):
            ax_loss.plot(*zip(*pts), style, label=key)
    steps = sorted({int(k.rsplit("_", 1)[1]) for r in rows for k in r if "/acc_" in k})
    colours = plt.get_cmap("viridis")
    for i in steps:
        colour = colours(i / max(len(steps) - 1, 1))
        for split, style in (("train", "-"), ("heldout", "o--")):
            if pts := _points(rows, f"{split}/acc_{i}"):
                ax_acc.plot(*zip(*pts), style, color=colour, label=f"{split} step {i}", lw=1)
    if pts := _points(rows, "heldout/sim_tau"):
        ax_tau.plot(*zip(*pts), "o--", label="heldout/sim_tau")
        best = max(pts, key=lambda p: p[1])  # the first of equals, as training keeps it
        ax_tau.plot(*best, "r*", markersize=12, label=f"best: {best[1]:.2f} at step {best[0]}")
    if pts := _points(rows, "train/grad_norm"):
        ax_norm.plot(*zip(*pts), "-", label="train/grad_norm", lw=1)
        if grad_clip > 0:  # above it, every update was scaled down to it
            ax_norm.axhline(grad_clip, color="r", ls=":", label=f"train.grad_clip {grad_clip:g}")
        ax_norm.set_yscale("log")
    ax_loss.set_ylabel("loss of the first draft step")
    ax_acc.set_ylabel("top-1 agreement with the target")
    ax_acc.set_ylim(0, 1)
    ax_tau.set_ylabel("simulated tau (teacher-forced)")
    ax_norm.set_ylabel("gradient norm before clipping")
    for ax, size in ((ax_loss, 7), (ax_acc, 6), (ax_tau, 7), (ax_norm, 7)):
        ax.set_xlabel("step")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=size, ncol=2 if ax is ax_acc else 1)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
