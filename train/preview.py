"""Conversations as prepare renders them, the tokens a head learns marked (`draftsmith preview`).

The first `data.preview` conversations of `data.path`, rendered with the target's chat template
(`target.chat_template`, `target.chat_template_kwargs`, `data.template`) and tokenized as
prepare does (no regeneration), each learned span between ⟦ and ⟧ (green on a terminal), and
the reason prepare would skip each conversation it cannot use. Nothing is written: for checking
a template, tool calls or a dataset's format before a long prepare.
"""

from __future__ import annotations

import sys
from itertools import groupby
from typing import TextIO

from draftsmith.conf.schema import Config
from draftsmith.conversations import read_conversations
from draftsmith.tokenize import TemplateError
from draftsmith.train.prepare import conversation_renderer

MARKS = {False: ("⟦", "⟧"), True: ("\033[42m", "\033[0m")}  # by whether `out` is a terminal


def run(cfg: Config, out: TextIO | None = None) -> dict:
    """Print the preview to `out` (stdout); returns {id: learned tokens, or the skip reason}."""
    out = out or sys.stdout
    conversations, report = read_conversations(
        cfg.data.path, cfg.data.preview, cfg.data.split, cfg.data.revision
    )
    renderer = conversation_renderer(cfg)
    start, end = MARKS[out.isatty()]
    print(report.summary(), file=out)
    shown: dict[str, int | str] = {}
    for conv in conversations:
        try:
            row = renderer(conv)
        except TemplateError as err:
            print(f"\n== {conv.label}: skipped: {err}", file=out)
            shown[conv.id] = str(err)
            continue
        learned = sum(row.loss_mask)
        print(f"\n== {conv.label}: {len(row.input_ids)} tokens, {learned} learned", file=out)
        text = ""
        for masked, run_ in groupby(zip(row.input_ids, row.loss_mask), key=lambda t: t[1]):
            piece = renderer.tokenizer.decode([t for t, _ in run_])
            text += f"{start}{piece}{end}" if masked else piece
        print(text, file=out)
        shown[conv.id] = learned
    return shown
