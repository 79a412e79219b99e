"""Target hidden states -> sharded safetensors (`draftsmith collect`).

One no-grad target forward per length-bucketed batch; forward hooks capture the last decoder
layer's output (before the final norm) and the EAGLE-3 aux layers. Each shard holds concatenated
rows: input_ids [N] int32, loss_mask [N] uint8, hidden [N, H], aux [N, kH], target_top [N] int32
(the target's greedy next token, so training needs no full-vocabulary pass), offsets [rows+1].
`index.json` records the target, the layer ids and their convention, dtypes, token counts and the
sha256 of every shard; it is rewritten atomically after each shard. The shard plan depends only
on the prepared data, so an interrupted collect resumes at the first missing shard and produces
the same bytes. Only one shard of features is ever in memory.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from draftsmith.assets import sha256_file
from draftsmith.conf.schema import Config
from draftsmith.errors import InputError, MissingInput
from draftsmith.features import LAYER_CONVENTION, extract_features
from draftsmith.files import write_text_atomic
from draftsmith.heads import TargetInfo, TargetParts
from draftsmith.heads.eagle3 import default_aux_layers
from draftsmith.provenance import made, new_id, pin_target
from draftsmith.target import load_target, target_name, torch_dtype
from draftsmith.train.regen_server import served_target

INDEX = "index.json"


def plan_shards(lengths: list[int], shard_tokens: int) -> list[list[int]]:
    """Rows sorted by length (longest first, ties by index) packed into shards of ~shard_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    shards, current, size = [], [], 0
    for i in order:
        if current and size + lengths[i] > shard_tokens:
            shards.append(current)
            current, size = [], 0
        current.append(i)
        size += lengths[i]
    if current:
        shards.append(current)
    return shards


def plan_batches(rows: list[int], lengths: list[int], tokens_per_batch: int) -> list[list[int]]:
    """Consecutive rows (already length-sorted) grouped so padded tokens <= tokens_per_batch."""
    batches, current = [], []
    for i in rows:
        width = max([lengths[j] for j in current] + [lengths[i]])
        if current and width * (len(current) + 1) > tokens_per_batch:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def collect_shard(
    target,
    dataset,
    rows: list[int],
    lengths: list[int],
    aux_layers: list[int],
    cfg: Config,
    bar: tqdm | None = None,
) -> dict[str, torch.Tensor]:
    device = next(target.parameters()).device
    storage = torch_dtype(cfg.collect.storage_dtype)
    parts: dict[str, list[torch.Tensor]] = {
        "input_ids": [],
        "loss_mask": [],
        "hidden": [],
        "aux": [],
        "target_top": [],
    }
    target_parts = TargetParts.from_model(target)
    for batch in plan_batches(rows, lengths, cfg.collect.tokens_per_batch):
        width = max(lengths[i] for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)  # right-padded
        for r, i in enumerate(batch):
            ids[r, : lengths[i]] = torch.tensor(dataset[i]["input_ids"])
        hidden, aux = extract_features(target, ids.to(device), aux_layers)
        top = target_parts.top_tokens(hidden)  # the target's own greedy labels, in its dtype
        for r, i in enumerate(batch):
            n = lengths[i]
            parts["input_ids"].append(ids[r, :n].to(torch.int32))
            parts["loss_mask"].append(torch.tensor(dataset[i]["loss_mask"], dtype=torch.uint8))
            parts["hidden"].append(hidden[r, :n].to(storage).cpu())
            parts["aux"].append(aux[r, :n].to(storage).cpu())
            parts["target_top"].append(top[r, :n].to(torch.int32).cpu())
        if bar is not None:
            bar.update(sum(lengths[i] for i in batch))
    # shards store rows in plan order; offsets delimit them
    offsets = torch.tensor([0] + [lengths[i] for i in rows]).cumsum(0)
    return {**{k: torch.cat(v) for k, v in parts.items()}, "offsets": offsets}


def _write_index(out: Path, index: dict) -> None:
    write_text_atomic(out / INDEX, json.dumps(index, indent=2))


def verify_shards(out: Path) -> int:
    """Re-hash every shard against the index; raise naming the first bad file."""
    if not (out / INDEX).exists():
        raise MissingInput(f"{out / INDEX}: nothing collected to verify (run `draftsmith collect`)")
    index = json.loads((out / INDEX).read_text())
    shards = [shard for split in index["splits"].values() for shard in split["shards"]]
    for shard in tqdm(shards, desc="verify", unit="shard"):  # one bar over every split's
        path = out / shard["file"]
        if not path.exists() or sha256_file(path) != shard["sha256"]:
            raise InputError(f"corrupted or missing shard {path} (sha256 differs from {INDEX})")
    print(f"verify: {len(shards)} shards match {out / INDEX}")
    return len(shards)


def aux_layers_for(cfg: Config, num_layers: int) -> list[int]:
    if cfg.collect.aux_layers:
        return list(cfg.collect.aux_layers)
    head_layers = getattr(cfg.head, "aux_layers", None)
    return list(head_layers) if head_layers else default_aux_layers(num_layers)


SPLITS = ("train", "heldout")


def _collecting_target(cfg: Config, device: str):
    target = load_target(
        cfg.target.path,
        cfg.dtype,
        device,
        cfg.target.trust_remote_code,
        revision=cfg.target.revision,
    )
    TargetParts.from_model(target).check(target)  # an unknown logit transform fails here, early
    return target


def write_shard(
    out: Path,
    name: str,
    target,
    data,
    rows: list[int],
    lengths: list[int],
    aux_layers: list[int],
    cfg: Config,
    bar: tqdm | None,
) -> dict:
    """Collect shard `name` (split/shard_k) of `rows` to its file atomically; its index entry."""
    tensors = collect_shard(target, data, rows, lengths, aux_layers, cfg, bar)
    path = out / name
    tmp = path.with_suffix(".tmp")
    # one metadata key: safetensors writes its metadata map in no fixed order, and resumed
    # shards must be byte-identical
    meta = {"rows": json.dumps([[i, data[i]["id"]] for i in rows])}
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return {
        "file": name,
        "rows": len(rows),
        "tokens": int(tensors["offsets"][-1]),
        "size": path.stat().st_size,
        "sha256": sha256_file(path),
    }


# a collect.workers process's target and prepared data, loaded once by _start_worker
_WORKER: dict = {}


def _start_worker(cfg: Config, ranks, aux_layers: list[int], prepared: str) -> None:
    """Pool initializer: worker r collects on cuda:r (device=cuda), or on its share of the
    CPU's cores."""
    import datasets

    rank = ranks.get()
    device = f"cuda:{rank}" if cfg.device.startswith("cuda") else cfg.device
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.collect.workers))
    _WORKER.update(
        cfg=cfg,
        target=_collecting_target(cfg, device),
        dataset=datasets.load_from_disk(prepared),
        aux_layers=aux_layers,
    )


def _worker_shard(name: str, split: str, rows: list[int], lengths: list[int]) -> dict:
    """A pool task: one shard of `split` written by this worker; its index entry."""
    w = _WORKER
    out = Path(w["cfg"].stage_dir("collect"))
    data = w["dataset"][split]
    return write_shard(out, name, w["target"], data, rows, lengths, w["aux_layers"], w["cfg"], None)


def run(cfg: Config) -> dict:
    import datasets

    out = Path(cfg.stage_dir("collect"))
    if cfg.verify:
        verify_shards(out)
        return json.loads((out / INDEX).read_text())
    pin_target(cfg)
    prepared = Path(cfg.input_dir("prepare")) / "dataset"
    if not prepared.exists():
        raise MissingInput(f"{prepared}: run `draftsmith prepare run_name={cfg.run_name}` first")
    dataset = datasets.load_from_disk(str(prepared))
    workers = cfg.collect.workers
    # with workers, each loads its own target; this process reads only the target's config
    target = _collecting_target(cfg, cfg.device) if workers == 1 else None
    config = (
        target.config
        if target is not None
        else served_target(
            cfg.target.path, cfg.target.trust_remote_code, cfg.target.revision
        ).config
    )
    info = TargetInfo.from_hf_config(config)  # an image-text model's: its text decoder's
    n_layers = info.num_layers
    aux_layers = aux_layers_for(cfg, n_layers)
    header = {
        "target": target_name(cfg.target.path),
        "target_path": cfg.target.path,
        "target_revision": cfg.target.revision,
        "hidden_size": info.hidden_size,
        "vocab_size": info.vocab_size,
        "num_layers": n_layers,
        "layer_convention": LAYER_CONVENTION,
        "aux_layers": aux_layers,
        "hidden": "output of the last decoder layer, before the final norm",
        "storage_dtype": cfg.collect.storage_dtype,
        "compute_dtype": cfg.dtype,
    }
    inputs = made(cfg, "prepare")  # the prepared data's id: features of other data are stale
    index = {**header, "inputs": inputs, "complete": False, "splits": {}}
    old = json.loads((out / INDEX).read_text()) if (out / INDEX).exists() else None
    if old is not None and old.get("inputs") not in (None, inputs):
        print(f"collect: {out} holds features of data prepared before; collecting again")
        shutil.rmtree(out)
        old = None
    if old is not None:
        # a key the index lacks (written before it was recorded) is not compared
        if changed := {k: old[k] for k in header if k in old and old[k] != header[k]}:
            raise InputError(
                f"{out / INDEX} was collected with other settings ({changed}); "
                "use another run_name or delete it"
            )
        index = old | {"inputs": inputs}
    out.mkdir(parents=True, exist_ok=True)
    lengths = {split: [len(x) for x in dataset[split]["input_ids"]] for split in SPLITS}
    entries: dict[str, dict[int, dict]] = {split: {} for split in SPLITS}  # shard k -> entry
    pending = []  # (split, k, file name, rows) of shards still to collect, in plan order
    for split in SPLITS:
        (out / split).mkdir(exist_ok=True)
        done = {s["file"]: s for s in index["splits"].get(split, {}).get("shards", [])}
        for k, rows in enumerate(plan_shards(lengths[split], cfg.collect.shard_tokens)):
            name = f"{split}/shard_{k:05d}.safetensors"
            path = out / name
            if name in done and path.exists() and path.stat().st_size == done[name]["size"]:
                entries[split][k] = done[name]
            else:
                pending.append((split, k, name, rows))

    def shards(split: str) -> list[dict]:
        return [entries[split][k] for k in sorted(entries[split])]  # in plan order

    def record(split: str, k: int, entry: dict) -> None:
        """Index a finished shard at once: a killed collect resumes after it."""
        entries[split][k] = entry
        index["splits"][split] = {"shards": shards(split), "rows": None, "tokens": None}
        _write_index(out, index)

    # counted in tokens, not shards: a shard of fp32 forwards on a small CPU takes minutes
    bar = tqdm(total=sum(map(sum, lengths.values())), desc="collect", unit="tok", unit_scale=True)
    bar.update(sum(e["tokens"] for split in SPLITS for e in entries[split].values()))
    if workers == 1:
        for split, k, name, rows in pending:
            bar.set_postfix_str(name)
            data = dataset[split]
            entry = write_shard(out, name, target, data, rows, lengths[split], aux_layers, cfg, bar)
            record(split, k, entry)
    else:
        spawn = multiprocessing.get_context("spawn")
        ranks = spawn.Queue()
        for rank in range(workers):
            ranks.put(rank)
        init = (cfg, ranks, aux_layers, str(prepared))
        with ProcessPoolExecutor(workers, spawn, _start_worker, init) as pool:
            futures = {
                pool.submit(_worker_shard, name, split, rows, lengths[split]): (split, k)
                for split, k, name, rows in pending
            }
            try:
                for future in as_completed(futures):
                    entry = future.result()
                    record(*futures[future], entry)
                    bar.update(entry["tokens"])
            except BaseException:
                pool.shutdown(cancel_futures=True)  # the shards not started stay for a rerun
                raise
    bar.close()
    for split in SPLITS:
        index["splits"][split] = {
            "shards": shards(split),
            "rows": len(lengths[split]),
            "tokens": sum(lengths[split]),
        }
    index["complete"] = True
    index.setdefault("made", new_id())  # what training reads, named (provenance)
    _write_index(out, index)
    print(f"collect: {sum(s['tokens'] for s in index['splits'].values())} tokens -> {out}")
    return index
