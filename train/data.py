"""Training data: feature rows from collected shards (offline) or from the target in the loop
(online), length-bucketed into batches in a deterministic order. Both sources yield the same
`HeadBatch`, so the training loop never knows which one it reads.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors import safe_open

from draftsmith.errors import InputError, MissingInput
from draftsmith.features import LAYER_CONVENTION, extract_features
from draftsmith.heads import HeadBatch, TargetInfo, TargetParts


class ShardRows:
    """Random access to the rows of one split of a collect folder (lazy safetensors slices)."""

    def __init__(self, folder: str | Path, split: str, max_len: int, aux: bool = True) -> None:
        self.folder = Path(folder)
        # a head that reads the last layer only skips the aux layers (3x the hidden state's bytes)
        self.keys = ("input_ids", "loss_mask", "hidden", *(("aux",) if aux else ()), "target_top")
        index_path = self.folder / "index.json"
        if not index_path.exists():
            raise MissingInput(f"{index_path}: no collected features (run `draftsmith collect`)")
        self.index = json.loads(index_path.read_text())
        if not self.index.get("complete"):
            raise InputError(f"{index_path}: collection is incomplete; rerun `draftsmith collect`")
        self.max_len = max_len
        self.rows: list[tuple[int, int, int]] = []  # (shard, start, length)
        self.files = []
        positions = []  # each row's index in the prepared dataset
        for k, shard in enumerate(self.index["splits"][split]["shards"]):
            path = self.folder / shard["file"]
            self.files.append(path)
            try:
                with safe_open(str(path), framework="pt") as f:
                    offsets = f.get_tensor("offsets").tolist()
                    positions += [i for i, _ in json.loads(f.metadata()["rows"])]
            except Exception as err:  # a truncated or overwritten file
                raise InputError(
                    f"corrupted shard {path}: {err}; "
                    "`draftsmith collect verify=true` checks every shard"
                ) from err
            self.rows += [(k, a, min(b - a, max_len)) for a, b in zip(offsets, offsets[1:])]
        # back to prepared-dataset order, so offline and online training see the same batches
        self.rows = [row for _, row in sorted(zip(positions, self.rows))]
        self._handles: dict[int, object] = {}

    def check(self, target: TargetInfo, aux_layers: list[int] | None) -> None:
        """Refuse shards from another target or layer convention, naming both sides."""
        mine = {
            "hidden_size": self.index["hidden_size"],
            "vocab_size": self.index["vocab_size"],
            "num_layers": self.index["num_layers"],
        }
        theirs = {
            "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size,
            "num_layers": target.num_layers,
        }
        if mine != theirs:
            raise InputError(
                f"shards in {self.folder} come from target {self.index['target']} "
                f"{mine}, the head's target is {target.name} {theirs}"
            )
        if self.index["layer_convention"] != LAYER_CONVENTION:
            raise InputError(
                f"shards use layer convention {self.index['layer_convention']}, "
                f"expected {LAYER_CONVENTION}"
            )
        if aux_layers and list(aux_layers) != list(self.index["aux_layers"]):
            raise InputError(
                f"head wants aux layers {aux_layers} ({LAYER_CONVENTION}), shards in "
                f"{self.folder} hold {self.index['aux_layers']}: train a head on those "
                f"(head.aux_layers={list(self.index['aux_layers'])}), collect these into "
                "another run (collect.aux_layers=..., its own run_name), or read the target "
                "online (train.source=online)"
            )

    def __len__(self) -> int:
        return len(self.rows)

    def lengths(self) -> list[int]:
        return [n for _, _, n in self.rows]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        shard, start, n = self.rows[i]
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.files[shard]), framework="pt")
        f = self._handles[shard]
        return {key: f.get_slice(key)[start : start + n] for key in self.keys if key in f.keys()}


def collate(rows: list[dict[str, torch.Tensor]], dtype: torch.dtype) -> HeadBatch:
    """Right-pad rows into a HeadBatch (aux None when the rows hold none)."""
    width = max(r["input_ids"].shape[0] for r in rows)
    B = len(rows)
    ids = torch.zeros(B, width, dtype=torch.long)
    mask = torch.zeros(B, width)
    hidden = torch.zeros(B, width, rows[0]["hidden"].shape[-1], dtype=dtype)
    aux = torch.zeros(B, width, rows[0]["aux"].shape[-1], dtype=dtype) if "aux" in rows[0] else None
    lengths = torch.tensor([r["input_ids"].shape[0] for r in rows])
    top = torch.zeros(B, width, dtype=torch.long) if "target_top" in rows[0] else None
    for b, r in enumerate(rows):
        n = r["input_ids"].shape[0]
        ids[b, :n] = r["input_ids"].long()
        mask[b, :n] = r["loss_mask"].float()
        hidden[b, :n] = r["hidden"].to(dtype)
        if aux is not None:
            aux[b, :n] = r["aux"].to(dtype)
        if top is not None:
            top[b, :n] = r["target_top"].long()
    return HeadBatch(ids, mask, hidden, aux, lengths, top)


def batch_order(lengths: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Length-bucketed micro-batches in a (seed, epoch)-deterministic order: shuffle, sort within
    windows of 32 batches (little padding), then shuffle the batches."""
    rng = random.Random(seed * 100003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = batch_size * 32
    batches = []
    for s in range(0, len(order), window):
        chunk = sorted(order[s : s + window], key=lambda i: lengths[i])
        batches += [chunk[j : j + batch_size] for j in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


class OnlineRows:
    """Rows of a prepared dataset whose features are computed by the target at batch time."""

    def __init__(self, dataset, max_len: int) -> None:
        self.dataset, self.max_len = dataset, max_len
        self._lengths = [min(len(x), max_len) for x in dataset["input_ids"]]

    def __len__(self) -> int:
        return len(self._lengths)

    def lengths(self) -> list[int]:
        return self._lengths

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.dataset[i]
        n = self._lengths[i]
        return {
            "input_ids": torch.tensor(row["input_ids"][:n]),
            "loss_mask": torch.tensor(row["loss_mask"][:n]),
        }


def online_batch(
    target, rows: list[dict[str, torch.Tensor]], aux_layers: list[int], dtype: torch.dtype
) -> HeadBatch:
    """Tokens -> HeadBatch with features from one no-grad target forward."""
    width = max(r["input_ids"].shape[0] for r in rows)
    B = len(rows)
    ids = torch.zeros(B, width, dtype=torch.long)  # right-padded
    mask = torch.zeros(B, width)
    for b, r in enumerate(rows):
        n = r["input_ids"].shape[0]
        ids[b, :n], mask[b, :n] = r["input_ids"], r["loss_mask"].float()
    device = next(target.parameters()).device
    hidden, aux = extract_features(target, ids.to(device), aux_layers)
    top = TargetParts.from_model(target).top_tokens(hidden)
    lengths = torch.tensor([r["input_ids"].shape[0] for r in rows])
    aux = None if aux is None else aux.to(dtype)  # None: the head reads no aux layers
    # the features stay on the target's device; the head's forward moves the rest there
    return HeadBatch(ids, mask, hidden.to(dtype), aux, lengths, top)
