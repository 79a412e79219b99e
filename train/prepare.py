"""Conversations -> ids + assistant loss masks, answers kept or regenerated (`draftsmith prepare`).

Writes runs/<run>/prepare/: `dataset/` (an Arrow DatasetDict with `train` and `heldout` splits of
id, input_ids, loss_mask), `heldout.jsonl` (the held-out conversations, for
`eval.benchmark=heldout`), `regen/` (resumable regeneration chunks) and `stats.json` (rows in/out,
tokens, masked tokens, rows skipped by reason), written last: its presence marks the stage done.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from draftsmith.conf.schema import Config
from draftsmith.conversations import Conversation, read_conversations, skipped_text
from draftsmith.errors import InputError
from draftsmith.files import write_text_atomic
from draftsmith.packed import pack_linears
from draftsmith.provenance import check_unchanged, new_id, pin_target, record, stage_settings
from draftsmith.target import chat_template_digest, load_target, target_tokenizer
from draftsmith.tokenize import ConversationTokenizer, TemplateError
from draftsmith.train.regen_server import served_target
from draftsmith.train.regenerate import regenerate


def tokenize_all(
    renderer: ConversationTokenizer,
    conversations: list[Conversation],
    skipped: Counter,
    examples: list[str],
    desc: str,
) -> list[dict]:
    rows = []
    for conv in tqdm(conversations, desc=f"tokenize {desc}", unit="conv"):
        try:
            t = renderer(conv)
        except TemplateError as err:
            reason = str(err)
            skipped[reason.split(":")[0]] += 1
            if len(examples) < 20:
                examples.append(f"{conv.label}: {reason}")
            continue
        rows.append({"id": conv.id, "input_ids": t.input_ids, "loss_mask": t.loss_mask})
    return rows


def conversation_renderer(cfg: Config) -> ConversationTokenizer:
    """The target's tokenizer and chat template as prepare renders conversations with them."""
    tokenizer = target_tokenizer(cfg.target)
    d = cfg.data
    return ConversationTokenizer(
        tokenizer,
        d.template,
        d.max_len,
        d.length_policy,
        cfg.target.chat_template_kwargs,
        d.last_reply_only,
        d.preformatted,
    )


def _answering_target(cfg: Config):
    """The target as regeneration runs it: loaded (packed: the same answers, faster), or only
    its config files when servers run it (data.regen.engine=server)."""
    if cfg.data.regen.engine == "server":
        return served_target(cfg.target.path, cfg.target.trust_remote_code, cfg.target.revision)
    target = load_target(
        cfg.target.path,
        cfg.dtype,
        cfg.device,
        cfg.target.trust_remote_code,
        attn_implementation=cfg.data.regen.attn_implementation,
        revision=cfg.target.revision,
    )
    if cfg.target.pack_linears:
        pack_linears(target)
    return target


def run(cfg: Config) -> dict:
    import datasets

    pin_target(cfg)
    out = Path(cfg.stage_dir("prepare"))
    if (out / "stats.json").exists():
        check_unchanged(cfg, "prepare")
        print(f"prepare: {out} is complete; delete it to redo")
        return json.loads((out / "stats.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    settings = stage_settings(cfg, "prepare")  # the data's digest as read, not as edited since
    d = cfg.data
    conversations, report = read_conversations(d.path, d.limit, d.split, d.revision)
    print(report.summary())
    if report.commit is not None:  # the hub dataset's commit read, even if its branch moved
        settings["data.sha256"] = report.commit
    random.Random(cfg.seed).shuffle(conversations)
    heldout_count = min(d.heldout, max(len(conversations) // 10, 1))
    splits = {"heldout": conversations[:heldout_count], "train": conversations[heldout_count:]}
    renderer = conversation_renderer(cfg)
    tokenizer = renderer.tokenizer
    regenerated: dict[str, int] = {}  # conversations per split whose answers the target wrote
    if d.regenerate:
        target = _answering_target(cfg)
        template = chat_template_digest(cfg.target.chat_template)
        for name in ("heldout", "train"):
            n = len(splits[name]) if d.regen.rows is None else d.regen.rows
            first, rest = splits[name][:n], splits[name][n:]
            new = regenerate(
                target, tokenizer, renderer, first, d.regen, out / "regen" / name, template
            )
            regenerated[name] = len(new)
            splits[name] = new + rest
    skipped: Counter = Counter()
    examples: list[str] = []
    tokenized = {
        name: tokenize_all(renderer, convs, skipped, examples, name)
        for name, convs in splits.items()
    }
    if not tokenized["train"]:
        templated = f"; rendering {skipped_text(skipped, examples)}"
        raise InputError(
            f"no usable training conversations: {report.summary()}; "
            f"{len(splits['heldout'])} held out for evaluation{templated if skipped else ''}"
        )
    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value("int8")),
        }
    )
    dataset = datasets.DatasetDict(
        {
            name: datasets.Dataset.from_list(rows, features=features)
            if rows
            else datasets.Dataset.from_dict(
                {"id": [], "input_ids": [], "loss_mask": []}, features=features
            )
            for name, rows in tokenized.items()
        }
    )
    tmp = out / "dataset.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    # one shard even when empty: `datasets` writes none for a 0-row split and cannot load it back
    dataset.save_to_disk(str(tmp), num_shards={k: 1 for k, rows in tokenized.items() if not rows})
    shutil.rmtree(out / "dataset", ignore_errors=True)
    os.replace(tmp, out / "dataset")
    write_text_atomic(
        out / "heldout.jsonl", "".join(json.dumps(c.to_row()) + "\n" for c in splits["heldout"])
    )
    stats = {
        "made": new_id(),  # what collect and online training read, named (provenance)
        "source": report.to_dict(),
        "regenerated": d.regenerate,
        "regenerated_rows": regenerated,
        "rows": {name: len(rows) for name, rows in tokenized.items()},
        "tokens": {
            name: sum(len(r["input_ids"]) for r in rows) for name, rows in tokenized.items()
        },
        "masked_tokens": {
            name: sum(sum(r["loss_mask"]) for r in rows) for name, rows in tokenized.items()
        },
        "skipped": dict(skipped),
        "skipped_examples": examples,
    }
    record(cfg, "prepare", settings)
    write_text_atomic(out / "stats.json", json.dumps(stats, indent=2))  # the last: complete
    print(
        f"prepare: {stats['rows']} rows, {stats['tokens']} tokens, "
        f"{stats['masked_tokens']} masked; skipped {dict(skipped)} -> {out}"
    )
    return stats
