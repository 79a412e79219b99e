"""Benchmark prompts: the conversations an eval reads (`eval.benchmark`) and how a user turn
becomes the target's prompt ids, rendered as prepare renders its training data. `draftsmith
eval` and `draftsmith generate` both prompt through `chat_prompt`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from draftsmith.conf.schema import Config
from draftsmith.conversations import ReadReport, read_conversations
from draftsmith.errors import InputError, MissingInput
from draftsmith.tokenize import ConversationTokenizer, TemplateError


def benchmark_source(cfg: Config) -> str:
    """Where `eval.benchmark`'s conversations are read from."""
    source = cfg.eval.benchmark
    if source == "heldout":
        source = f"{cfg.input_dir('prepare')}/heldout.jsonl"
        if not Path(source).exists():
            raise MissingInput(
                f"{source}: run `draftsmith prepare run_name={cfg.inputs_from or cfg.run_name}` "
                "first (it writes the held-out conversations)"
            )
    return source


@dataclass
class Setting:
    """What a benchmark conversation gives every prompt besides its user turns: the system
    turns before its first user turn and its tools (function schemas); or, `rendered`, that its
    one turn is already the prompt's text as the template renders it (data.preformatted)."""

    system: list[dict]
    tools: list[dict] | None
    rendered: bool = False


def user_turns(
    source: str,
    limit: int | None = None,
    rendered: ConversationTokenizer | None = None,
    revision: str | None = None,
) -> tuple[list[list[str]], list[str], list[Setting], ReadReport]:
    """User turns of the first `limit` conversations of `source` (file, folder, HF dataset or
    asset name; a hub one at `revision`), each conversation's category ("" where the source
    names none) and setting, and the read's report: a row that is not a conversation with a user
    turn is skipped and counted there (printed by the callers, recorded in the results), never
    dropped unseen.
    With `rendered` (data.preformatted: the renderer prepare reads rendered rows with), a `text`
    row is a rendered conversation whose one turn is its text up to where its first reply starts
    (`ConversationTokenizer.rendered_spans`, as prepare finds it): the prompt of that reply."""
    conversations, report = read_conversations(source, limit=limit, revision=revision)
    kept = []
    for conv in conversations:
        if rendered is not None and conv.rendered:
            text = conv.turns[0].content
            try:
                start = rendered.rendered_spans(text)[0][0]
            except TemplateError as err:  # no reply to prompt for: prepare's reason
                report.skip(conv.label, str(err))
                continue
            prompt = dataclasses.replace(conv.turns[0], content=text[:start])
            conv = dataclasses.replace(conv, turns=[prompt])
        if not conv.user_prompts():
            report.skip(conv.label, "no user turn")
            continue
        kept.append(conv)
    conversations = kept
    report.rows_kept = len(conversations)
    if not conversations:
        raise InputError(f"benchmark {source!r} has no usable prompts ({report.summary()})")
    settings = []
    for conv in conversations:
        first_user = next(i for i, t in enumerate(conv.turns) if t.role == "user")
        system = [t.to_message() for t in conv.turns[:first_user] if t.role == "system"]
        settings.append(Setting(system, conv.tools, rendered is not None and conv.rendered))
    turns = [conv.user_prompts() for conv in conversations]
    return turns, [c.category for c in conversations], settings, report


def first_turns(
    source: str, tokenizer, limit: int | None = None
) -> tuple[list[list[int]], list[str]]:
    """First user turn of the first `limit` conversations of `source`, rendered with the target's
    chat template as the model sees a new chat, and each conversation's category."""
    turns, categories, settings, report = user_turns(source, limit)
    if report.skipped:
        print(report.summary())
    prompts = [
        chat_prompt(tokenizer, t[0], s.system, None, s.tools) for t, s in zip(turns, settings)
    ]
    return prompts, categories


def chat_prompt(
    tokenizer,
    text: str,
    history: list[dict] | None = None,
    template_kwargs: dict | None = None,
    tools: list[dict] | None = None,
    template: str = "auto",
) -> list[int]:
    """`text` as the next user turn after `history` (earlier messages; none: a new chat),
    rendered as prepare renders conversations (`template`: data.template, the target's chat
    template or "plain" lines; `template_kwargs`: target.chat_template_kwargs; `tools`),
    ending in the generation prompt."""
    renderer = ConversationTokenizer(tokenizer, template, template_kwargs=template_kwargs)
    return renderer.prompt_ids([*(history or []), {"role": "user", "content": text}], tools)
