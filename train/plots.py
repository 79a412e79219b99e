"""Training curves: loss and per-step accuracy (train and held-out) from metrics.jsonl, as a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_training(metrics_path: Path, out: Path) -> None:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    if not rows:
        return
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.6))
    for key, style in (("train/loss", "-"), ("heldout/loss_0", "o--")):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax_loss.plot(*zip(*pts), style, label=key)
    acc_keys = sorted({k for r in rows for k in r if k.startswith(("train/acc_", "heldout/acc_"))})
    for key in acc_keys:
        pts = [(r["step"], r[key]) for r in rows if key in r]
        ax_acc.plot(*zip(*pts), "o--" if key.startswith("heldout") else "-", label=key)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.legend(fontsize=7)
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("top-1 agreement with the target")
    ax_acc.set_ylim(0, 1)
    ax_acc.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
