"""Loss masks cover exactly the assistant tokens for several template styles; bad input is
counted and skipped with its reason; regeneration resumes."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from pipeline import regeneration_run

from draftsmith.config import compose
from draftsmith.conversations import Conversation, Turn, parse_row
from draftsmith.target import load_tokenizer
from draftsmith.tokenize import ConversationTokenizer, TemplateError

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
    "'<|end_header_id|>\n\n' + m['content'] + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    "{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
)
# DeepSeek-R1's way (its template, cut to the roles used here): replies lose their reasoning,
# and the generation prompt opens a think block the rendered replies do not have, so it is no
# prefix of the whole rendering
DEEPSEEK_R1 = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% else %}{% set c = m['content'] %}{% if '</think>' in c %}"
    "{% set c = c.split('</think>')[-1] %}{% endif %}{{ '<｜Assistant｜>' + c + eos_token }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\n' }}"
    "{% endif %}"
)
# Qwen3's way with replies (its template, cut to the roles used here): a reply after the last
# user turn gets a think block (its reasoning, or an empty one), earlier ones lose it, so
# rendering a conversation's prefix does not give the start of its whole rendering;
# enable_thinking=false ends the generation prompt with an empty think block. Tools as Qwen's
# templates write them: schemas in a system turn, calls after a reply's text, results as user
# turns
TOOL_SCHEMAS = (
    "{%- if tools %}{{- '<|im_start|>system\n<tools>' + (tools | tojson) }}"
    "{{- '</tools><|im_end|>\n' }}{%- endif %}"
)
TOOL_CALLS = (
    "{%- for call in m.tool_calls or [] %}{%- if m.content or not loop.first %}{{- '\n' }}"
    "{%- endif %}{{- '<tool_call>\n' + (call.function | tojson) + '\n</tool_call>' }}"
    "{%- endfor %}"
)
QWEN3 = (
    TOOL_SCHEMAS + "{%- set ns = namespace(found=false, last_query_index=messages|length - 1) %}"
    "{%- for m in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if m.role == 'user' and not ns.found %}"
    "{%- set ns.found = true %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<|im_start|>user\n' + m.content + '<|im_end|>\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}{%- set content = m.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1]"
    ".lstrip('\n') %}{%- set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n'"
    " + content }}"
    "{%- else %}{{- '<|im_start|>assistant\n' + content }}{%- endif %}"
    + TOOL_CALLS
    + "{{- '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}"
)
# Qwen2.5's way with tools (prefix-stable): consecutive tool results share one user turn
QWEN25 = (
    TOOL_SCHEMAS + "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if m.content %}{{- '\n' + m.content }}{%- endif %}"
    "{%- for call in m.tool_calls or [] %}"
    "{{- '\n<tool_call>\n' + (call.function | tojson) + '\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}"
    "{%- endif %}{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
CONV = Conversation(
    "c",
    [
        Turn("user", "Hi there"),
        Turn("assistant", "Hello!"),
        Turn("user", "And?"),
        Turn("assistant", "Bye."),
    ],
)


def masked_and_not(tokenizer, out) -> tuple[str, str]:
    """The decoded text a row learns, and the rest."""
    masked = tokenizer.decode([t for t, m in zip(out.input_ids, out.loss_mask) if m])
    return masked, tokenizer.decode([t for t, m in zip(out.input_ids, out.loss_mask) if not m])


@pytest.mark.parametrize(
    "template,end",
    [
        (None, "<|im_end|>\n"),  # the tiny target's ChatML, as SmolLM2 renders it
        (LLAMA3, "<|eot_id|>"),
        (MISTRAL, "<|im_end|>"),  # Mistral closes replies with eos
        (DEEPSEEK_R1, "<|im_end|>"),
    ],
)
def test_loss_mask_is_exactly_the_assistant_text(template, end, tiny_tokenizer) -> None:
    tokenizer = load_tokenizer(str(Path(tiny_tokenizer.name_or_path)))
    if template is not None:
        tokenizer.chat_template = template
    out = ConversationTokenizer(tokenizer)(CONV)
    masked, unmasked = masked_and_not(tokenizer, out)
    assert masked == f"Hello!{end}Bye.{end}"
    assert "Hi there" in unmasked and "And?" in unmasked and "Hello" not in unmasked


@pytest.mark.parametrize("template", [None, LLAMA3, MISTRAL, "plain"])
def test_preformatted_text_learns_what_its_conversation_does(template, tiny_tokenizer) -> None:
    """data.preformatted: a `text` row holding a conversation the template rendered gives the
    ids and loss mask the conversation itself gives (ChatML, Llama 3, Mistral's eos-closed
    replies, plain); off, the same row is a prompt alone; text without the template's reply
    header is skipped naming it."""
    tokenizer = load_tokenizer(str(Path(tiny_tokenizer.name_or_path)))
    kind = "auto"
    if template == "plain":
        kind = "plain"
    elif template is not None:
        tokenizer.chat_template = template
    renderer = ConversationTokenizer(tokenizer, kind, preformatted=True)
    text = renderer.render(CONV.to_messages())
    row = parse_row({"id": "r", "text": text}, 0)
    assert row.rendered and row.to_row() == {"id": "r", "text": text}
    assert renderer(row) == renderer(CONV)
    # the last reply cut off mid-text (max_len would cut it too) is learned up to there
    cut = renderer(dataclasses.replace(row, turns=[Turn("user", text[: text.rindex("Bye") + 2])]))
    assert masked_and_not(tokenizer, cut)[0].endswith("By")
    with pytest.raises(TemplateError, match="^no assistant turn: a prompt alone"):
        ConversationTokenizer(tokenizer, kind)(row)
    unanswered = dataclasses.replace(row, turns=[Turn("user", "Once upon a time")])
    header = re.escape(repr(renderer.reply_header))
    with pytest.raises(TemplateError, match=f"^no assistant turn: the text holds no {header}"):
        renderer(unanswered)


def test_replies_are_found_where_a_template_renders_them_otherwise_later(
    tiny_tokenizer,
) -> None:
    """Qwen3's template renders a reply otherwise once a user turn follows it: the mask is
    still exactly each reply and its end-of-turn marker, the last reply's as the model writes
    it (with the think block thinking mode opens it with); `template_kwargs` (from
    target.chat_template_kwargs) reach every rendering, prompts included."""
    from draftsmith.inference.prompts import chat_prompt

    tokenizer = load_tokenizer(tiny_tokenizer.name_or_path)
    tokenizer.chat_template = QWEN3
    # the template is not prefix-stable: the first reply lost its think block in the whole
    first = tokenizer.apply_chat_template(CONV.to_messages()[:2], tokenize=False)
    assert not tokenizer.apply_chat_template(CONV.to_messages(), tokenize=False).startswith(first)
    for kwargs, think in (({}, "<think>\n\n</think>\n\n"), ({"enable_thinking": False}, "")):
        out = ConversationTokenizer(tokenizer, template_kwargs=kwargs)(CONV)
        masked = masked_and_not(tokenizer, out)[0]
        assert masked == f"Hello!<|im_end|>\n{think}Bye.<|im_end|>\n", kwargs
    # one reply, a stable rendering: with thinking on the model writes the empty think block
    # itself, so the draft learns it too; off, the generation prompt holds it
    one = Conversation("c", CONV.turns[:2])
    for kwargs, reply in (
        ({}, "<think>\n\n</think>\n\nHello!"),
        ({"enable_thinking": False}, "Hello!"),
    ):
        out = ConversationTokenizer(tokenizer, template_kwargs=kwargs)(one)
        masked = masked_and_not(tokenizer, out)[0]
        assert masked == f"{reply}<|im_end|>\n", kwargs
    # replies with reasoning (thinking-mode regeneration): the history shows the first without
    # it, so its answer alone is learned there; the last keeps its reasoning
    thought = Conversation(
        "t",
        [
            Turn("user", "Hi there"),
            Turn("assistant", "<think>\nA greeting.\n</think>\n\nHello!"),
            Turn("user", "And?"),
            Turn("assistant", "<think>\nA farewell.\n</think>\n\nBye."),
        ],
    )
    out = ConversationTokenizer(tokenizer)(thought)
    masked = masked_and_not(tokenizer, out)[0]
    assert masked == "Hello!<|im_end|>\n<think>\nA farewell.\n</think>\n\nBye.<|im_end|>\n"
    # data.last_reply_only: the last reply alone, with its reasoning
    out = ConversationTokenizer(tokenizer, last_reply_only=True)(thought)
    masked = masked_and_not(tokenizer, out)[0]
    assert masked == "<think>\nA farewell.\n</think>\n\nBye.<|im_end|>\n"
    off = {"enable_thinking": False}
    prompt = ConversationTokenizer(tokenizer, template_kwargs=off).prompt_ids(
        CONV.to_messages()[:1]
    )
    assert chat_prompt(tokenizer, "Hi there", None, off) == prompt
    assert tokenizer.decode(prompt).endswith("assistant\n<think>\n\n</think>\n\n")
    assert not tokenizer.decode(chat_prompt(tokenizer, "Hi there")).endswith("</think>\n\n")
    cfg = compose(["+target.chat_template_kwargs.enable_thinking=false"])
    assert cfg.target.chat_template_kwargs == off


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
PARIS, ROME = (
    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}
    for city in ("Paris", "Rome")
)


def tool_conversation(text: str) -> Conversation:
    """A reply calling two tools (with `text` before the calls), their results, an answer and
    one more exchange."""
    return Conversation(
        "w",
        [
            Turn("user", "Weather in Paris and Rome?"),
            Turn("assistant", text, tool_calls=[PARIS, ROME]),
            Turn("tool", "22C", name="get_weather"),
            Turn("tool", "25C", name="get_weather"),
            Turn("assistant", "Paris 22C, Rome 25C."),
            Turn("user", "Thanks!"),
            Turn("assistant", "You are welcome."),
        ],
        tools=[WEATHER],
    )


def test_tool_calls_are_learned_as_the_template_writes_them(tiny_tokenizer) -> None:
    """A reply's span covers the calls it makes as the template writes them, with or without
    text before them, in a prefix-stable template (Qwen2.5's) and in one found in the whole
    rendering (Qwen3's); the schemas reach the template and tool results stay context. A
    template that leaves calls out is a skip reason; `plain` writes them too."""
    from draftsmith.inference.prompts import chat_prompt

    tokenizer = load_tokenizer(tiny_tokenizer.name_or_path)
    calls = "\n".join(
        f"<tool_call>\n{json.dumps(c['function'])}\n</tool_call>" for c in (PARIS, ROME)
    )
    rest = "<|im_end|>\nParis 22C, Rome 25C.<|im_end|>\n{}You are welcome.<|im_end|>\n"
    # Qwen3 gives the reply after the last user turn the think block its model writes
    for template, think in ((QWEN25, ""), (QWEN3, "<think>\n\n</think>\n\n")):
        tokenizer.chat_template = template
        for text, reply in (("", calls), ("Let me check.", f"Let me check.\n{calls}")):
            out = ConversationTokenizer(tokenizer)(tool_conversation(text))
            masked, unmasked = masked_and_not(tokenizer, out)
            assert masked == reply + rest.format(think), (template == QWEN3, text)
            assert f"<tools>{json.dumps([WEATHER])}</tools>" in unmasked
            assert "22C" in unmasked and "25C" in unmasked
    # eval renders a benchmark row's prompts with its tools as prepare does
    first = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    prompt = ConversationTokenizer(tokenizer).prompt_ids(first, [WEATHER])
    assert chat_prompt(tokenizer, first[0]["content"], None, None, [WEATHER]) == prompt
    tokenizer.chat_template = None  # the tiny target's ChatML, as SmolLM2's: no tool calls
    with pytest.raises(TemplateError, match="does not render tool calls: reply 0 calls"):
        ConversationTokenizer(tiny_tokenizer)(tool_conversation(""))
    out = ConversationTokenizer(tokenizer, template="plain")(tool_conversation(""))
    masked, unmasked = masked_and_not(tokenizer, out)
    assert masked.startswith(f"\nCall: {json.dumps(PARIS['function'])}\nCall: ")
    assert unmasked.startswith(f"Tools: {json.dumps([WEATHER])}")


# gpt-oss's harmony format, as its template writes replies (cut to the roles used here): the
# reasoning comes from a `thinking` field, in an analysis channel, for the last reply only; a
# reply ends with <|return|> as the model writes it, with <|end|> once the history holds it
HARMONY = (
    "{%- for m in messages %}{%- if m.role == 'user' %}"
    "{{- '<|start|>user<|message|>' + m.content + '<|end|>' }}"
    "{%- elif loop.last and not add_generation_prompt %}{%- if 'thinking' in m %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}"
    "{%- endif %}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|return|>' }}"
    "{%- else %}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start|>assistant' }}"
    "{%- endif %}"
)
HARMONY_TOKENS = ["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>"]


def harmony_tokenizer(tiny_tokenizer):
    tokenizer = load_tokenizer(tiny_tokenizer.name_or_path)
    tokenizer.add_tokens(HARMONY_TOKENS, special_tokens=True)
    tokenizer.chat_template = HARMONY
    return tokenizer


def test_reasoning_reaches_a_template_that_reads_it_from_a_field(tiny_tokenizer) -> None:
    """gpt-oss's template reads a reply's reasoning from `thinking`: the `<think>` block a
    conversation holds is given there, so the last reply is learned as the model writes it,
    analysis channel and all; an earlier one, which the history shows without its reasoning,
    by its answer. Templates that read no such field keep the block in the text."""
    from draftsmith.conversations import parse_row

    tokenizer = harmony_tokenizer(tiny_tokenizer)
    row = {
        "messages": [
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!", "thinking": "A greeting."},
            {"role": "user", "content": "And?"},
            {"role": "assistant", "content": "Bye.", "reasoning_content": "A farewell."},
        ]
    }
    conversation = parse_row(row, 0)
    assert conversation.turns[3].content == "<think>\nA farewell.\n</think>\n\nBye."
    renderer = ConversationTokenizer(tokenizer)
    assert renderer.reads_thinking
    masked, unmasked = masked_and_not(tokenizer, renderer(conversation))
    last = "<|channel|>analysis<|message|>A farewell.<|end|><|start|>assistant"
    assert masked == f"Hello!{last}<|channel|>final<|message|>Bye.<|return|>"
    assert "<think>" not in unmasked and "A greeting" not in unmasked
    assert not ConversationTokenizer(tiny_tokenizer).reads_thinking  # ChatML
    qwen3 = load_tokenizer(tiny_tokenizer.name_or_path)
    qwen3.chat_template = QWEN3  # its `enable_thinking` is no field
    assert not ConversationTokenizer(qwen3).reads_thinking


def test_generated_reasoning_is_read_back_as_the_model_wrote_it(
    tiny_target, tiny_tokenizer, monkeypatch
) -> None:
    """A reply the target generates in harmony format (reasoning in an analysis channel, the
    answer in a final one, in special tokens) becomes a `<think>` block and the answer, which
    render back to the very tokens generated: from in-process engines and from servers, which
    are asked to keep the special tokens. A reply cut off mid-reasoning keeps its reasoning; one
    the template cannot write back (a tool call, on another channel) is a logged failure."""
    from test_regen_server import StandIn

    from draftsmith.conf.schema import RegenConfig
    from draftsmith.train import regenerate

    tokenizer = harmony_tokenizer(tiny_tokenizer)
    renderer = ConversationTokenizer(tokenizer)
    analysis = "<|channel|>analysis<|message|>Two and two.<|end|>"
    final = "<|start|>assistant<|channel|>final<|message|>4."
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    for generated, text in (
        (analysis + final, "<think>\nTwo and two.\n</think>\n\n4."),
        ("<|channel|>final<|message|>4.", "4."),
        ("<|channel|>analysis<|message|>Two and", "<think>\nTwo and\n</think>\n\n"),
    ):
        assert renderer.reply_text(encode(generated)) == text, generated
    ids = encode(analysis + final)
    reply = renderer.reply_text(ids)
    asked = Conversation("c", [Turn("user", "2+2?"), Turn("assistant", reply)])
    out = renderer(asked)
    learned = [t for t, m in zip(out.input_ids, out.loss_mask) if m]
    assert learned == [*ids, *encode("<|return|>")]  # the stop token the model ends with
    # the regeneration engines
    prompts = [encode("<|start|>user<|message|>2+2?<|end|><|start|>assistant")] * 2
    monkeypatch.setattr(regenerate, "generate_answers", lambda *args: [ids] * len(args[2]))
    texts, _ = regenerate.answer_texts(tiny_target, renderer, prompts, RegenConfig())
    assert texts == [reply] * 2
    server = StandIn(tiny_target, tokenizer)
    server.generate = lambda target, tokenizer, batch, cfg: [ids] * len(batch)
    try:
        served = RegenConfig(engine="server", servers=[server.url])
        texts, _ = regenerate.answer_texts(tiny_target, renderer, prompts, served)
    finally:
        server.close()
    assert texts == [reply] * 2
    assert all(r["skip_special_tokens"] is False for r in server.requests)
    # a call goes to another channel, in special tokens the answer cannot hold
    call = encode(analysis + "<|start|>assistant to=functions.f<|channel|>commentary<|message|>{}")
    assert renderer.reply_text(call) is None
    monkeypatch.setattr(regenerate, "generate_answers", lambda *args: [call] * len(args[2]))
    failures: list[str] = []
    kept, _ = regenerate.regenerate_chunk(
        tiny_target, tokenizer, renderer, [asked], RegenConfig(), failures
    )
    assert kept == [] and failures == [
        "id c: the reply is in no form the template writes back (gpt-oss's calls)"
    ]


def test_bad_rows_are_rejected_with_reasons(tiny_tokenizer) -> None:
    renderer = ConversationTokenizer(tiny_tokenizer, max_len=8, length_policy="drop")
    with pytest.raises(TemplateError, match=r"^no assistant turn: a prompt alone \(data.regen"):
        renderer(Conversation("x", [Turn("user", "q")]))
    with pytest.raises(TemplateError, match="^no assistant turn$"):
        renderer(Conversation("x", [Turn("system", "be brief")]))
    with pytest.raises(TemplateError, match="no assistant turn after a prompt"):
        renderer(Conversation("x", [Turn("assistant", "a reply to nothing")]))
    with pytest.raises(TemplateError, match="too long"):
        renderer(CONV)
    tokenizer = load_tokenizer(tiny_tokenizer.name_or_path)
    tokenizer.chat_template = MISTRAL
    with pytest.raises(TemplateError, match="template rejected"):
        two_users = [Turn("user", "a"), Turn("user", "b"), Turn("assistant", "c")]
        ConversationTokenizer(tokenizer)(Conversation("y", two_users))
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="data.template=plain"):
        ConversationTokenizer(tokenizer)
    plain = ConversationTokenizer(tokenizer, template="plain")(CONV)
    assert masked_and_not(tokenizer, plain)[0] == ("Hello!<|im_end|>\nBye.<|im_end|>\n")


def test_prepare_without_training_rows_names_the_rows_it_skipped(tmp_path: Path) -> None:
    from draftsmith.train import prepare

    rows = [
        {"messages": [{"role": "user", "content": "a question"}]},
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistent", "content": "y"}]},
        {"messages": [{"role": "user", "content": "another question"}]},
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join([*map(json.dumps, rows), "not json"]) + "\n")
    cfg = compose([f"runs_dir={tmp_path}/runs", "target=tiny-random-llama", f"data.path={path}"])
    # one conversation is held out and the other has no answer to learn (no regeneration):
    # no training rows, and the error says which rows went where and why
    with pytest.raises(ValueError, match="no usable training conversations") as err:
        prepare.run(cfg)
    message = str(err.value)
    assert "kept 2/4 rows" in message
    assert "line 2: unknown role: turn 1 has role='assistent'" in message
    assert "line 4: invalid JSON" in message and "1 held out" in message
    # the conversation rendering skipped is named by its line too (one of lines 1 and 3 is
    # held out), not by an id no editor shows
    assert re.search(r"rendering skipped .*e\.g\. line [13]: no assistant turn", message)
    assert not Path(cfg.stage_dir("prepare"), "stats.json").exists()


def test_prepare_reads_preformatted_text(tmp_path: Path, tiny_tokenizer) -> None:
    """data.preformatted reaches prepare: rendered `text` rows prepare to the rows their
    conversations do, and their held-out ones are written back as text rows."""
    from draftsmith.train import prepare

    renderer = ConversationTokenizer(tiny_tokenizer)
    convs = [dataclasses.replace(CONV, id=str(i)) for i in range(4)]
    texts, chats = tmp_path / "texts.jsonl", tmp_path / "chats.jsonl"
    texts.write_text(
        "".join(
            json.dumps({"id": c.id, "text": renderer.render(c.to_messages())}) + "\n" for c in convs
        )
    )
    chats.write_text("".join(json.dumps(c.to_row()) + "\n" for c in convs))
    common = [f"runs_dir={tmp_path}/runs", "target=tiny-random-llama", "data.heldout=1"]
    made = {
        name: prepare.run(compose([*common, f"run_name={name}", f"data.path={path}", *extra]))
        for name, path, extra in [("t", texts, ["data.preformatted=true"]), ("c", chats, [])]
    }
    assert made["t"]["masked_tokens"] == made["c"]["masked_tokens"]
    assert made["t"]["tokens"] == made["c"]["tokens"]
    heldout = json.loads(Path(tmp_path, "runs/t/prepare/heldout.jsonl").read_text())
    assert list(heldout) == ["id", "text"]


def test_held_out_conversations_all_skipped_are_named_by_training(
    tmp_path: Path, monkeypatch
) -> None:
    """Prepared data whose held-out split came out empty (its conversations all skipped, as too
    long ones are with data.length_policy=drop) loads back (`datasets` writes no shard for an
    empty split unless asked), and training refuses it by name rather than pick a "best" head
    by the simulated tau of no rows. data.heldout=0 is refused when the config is built."""
    import datasets

    from draftsmith.train import loop, prepare

    with pytest.raises(ValueError, match="data.heldout=0: training picks its best head"):
        compose(["data.heldout=0"])
    rows = [{"prompt": f"Say {i}.", "response": f"{i}, said."} for i in range(12)]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = [f"runs_dir={tmp_path}/runs", "experiment=tiny", f"data.path={path}"]
    real = prepare.tokenize_all
    monkeypatch.setattr(
        prepare,
        "tokenize_all",
        lambda r, convs, *a: [] if a[-1] == "heldout" else real(r, convs, *a),
    )
    cfg = compose(common)
    prepare.run(cfg)
    split = datasets.load_from_disk(str(Path(cfg.stage_dir("prepare"), "dataset")))
    assert (len(split["train"]), len(split["heldout"])) == (11, 0)
    with pytest.raises(ValueError, match="prepare: no held-out rows to pick the best head by"):
        loop.run(compose([*common, "train=online", "tracking=none"]))


def test_prepare_with_regeneration_resumes(tmp_path: Path, monkeypatch) -> None:
    from draftsmith.train import prepare, regenerate

    overrides = regeneration_run(tmp_path)
    calls = []
    real = regenerate.generate_answers
    monkeypatch.setattr(regenerate, "generate_answers", lambda *a: calls.append(1) or real(*a))
    stats = prepare.run(compose(overrides))
    assert stats["source"]["skipped"] == {"unknown role": 1}
    # the question-only row got its answer from the target
    assert stats["skipped"] == {} and stats["rows"] == {"heldout": 3, "train": 28}
    assert stats["regenerated"] and stats["regenerated_rows"] == {"heldout": 3, "train": 28}
    first = len(calls)
    out = tmp_path / "runs/default/prepare"
    chunks = sorted((out / "regen/train").glob("chunk_*.jsonl"))
    assert len(chunks) == 4
    regen = [json.loads(x) for x in chunks[0].read_text().splitlines()]
    assert [m["role"] for m in regen[0]["messages"]] == ["user", "assistant", "user", "assistant"]
    # a killed run: the stage marker and one chunk are gone; the rerun redoes only that chunk
    (out / "stats.json").unlink()
    chunks[1].unlink()
    prepare.run(compose(overrides))
    assert 0 < len(calls) - first < first
    assert (out / "heldout.jsonl").exists() and (out / "dataset" / "train").exists()
    # other generation settings: nothing finished is reused (the chunk names differ)
    (out / "stats.json").unlink()
    again = len(calls)
    prepare.run(compose([*overrides, "data.regen.max_new_tokens=6"]))
    assert len(calls) - again == first
    assert len(list((out / "regen/train").glob("chunk_*.jsonl"))) == 8


@pytest.mark.filterwarnings("error:`past_key_values`:FutureWarning")  # deprecated keyword
def test_regeneration_engines_give_the_targets_greedy_answers(
    tiny_target, tiny_tokenizer, monkeypatch
) -> None:
    """Every regeneration engine gives the target's own greedy answers, prompt for prompt, also
    when rows end at EOS at different steps (the padded engine then drops them from the batch),
    whether the tokenizer names that stop id or only the model's generation config lists it."""
    from types import SimpleNamespace

    from draftsmith.conf.schema import RegenConfig
    from draftsmith.train.regenerate import generate_answers

    prompts = [list(range(5, 5 + n)) for n in (3, 17, 9, 30, 1)]

    def answers(tokenizer) -> dict[str, list]:
        return {
            engine: generate_answers(
                tiny_target,
                tokenizer,
                prompts,
                RegenConfig(max_new_tokens=12, engine=engine, batch_size=len(prompts)),
            )
            for engine in ("padded", "generate", "continuous")
        }

    made = []  # the continuous engine's batching config, as transformers left it
    batch = tiny_target.generate_batch

    def record(*args, **kwargs):
        made.append(kwargs["continuous_batching_config"])
        return batch(*args, **kwargs)

    monkeypatch.setattr(tiny_target, "generate_batch", record)
    full = answers(tiny_tokenizer)
    assert full["padded"] == full["generate"] == full["continuous"]
    # its KV cache holds the rows in flight (the longest 30 + 12 tokens, in one 256-token page
    # each), not 60% of the machine's RAM, whatever else runs there
    assert made[0].num_blocks == len(prompts)
    assert all(len(a) == 12 for a in full["padded"])  # no EOS from a random model
    # a token the random model emits mid-answer acts as EOS: answers end at different steps
    counts: dict[int, int] = {}
    for answer in full["padded"]:
        for t in set(answer[1:-1]):
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=counts.get)
    cut = answers(SimpleNamespace(eos_token_id=eos, pad_token_id=tiny_tokenizer.pad_token_id))
    expected = [a[: a.index(eos)] if eos in a else a for a in full["padded"]]
    assert cut["padded"] == cut["generate"] == expected
    assert len({len(a) for a in expected}) > 1
    listed = [tiny_tokenizer.eos_token_id, eos]
    monkeypatch.setattr(tiny_target.generation_config, "eos_token_id", listed)
    cut = answers(tiny_tokenizer)
    assert cut["padded"] == cut["generate"] == cut["continuous"] == expected
    with pytest.raises(ValueError, match="data.regen.engine"):
        generate_answers(tiny_target, tiny_tokenizer, prompts, RegenConfig(engine="vllm"))


def test_sampled_regeneration(tiny_target, tiny_tokenizer, monkeypatch) -> None:
    """Sampling goes through temperature, top-k and top-p, alike in every engine: a top-p or a
    top-k that keeps one token is greedy, a full one at temperature 1 leaves the greedy path,
    and top_k=0 means no top-k, whatever the model's own generation config says."""
    from draftsmith.conf.schema import RegenConfig
    from draftsmith.train.regenerate import generate_answers

    prompts = [list(range(5, 5 + n)) for n in (3, 17, 9)]

    def run(engine: str = "padded", rows: list = prompts, **sampling) -> list:
        cfg = RegenConfig(max_new_tokens=10, batch_size=len(rows), engine=engine, **sampling)
        return generate_answers(tiny_target, tiny_tokenizer, rows, cfg)

    greedy = run()
    # load_target drops a checkpoint's decoding defaults, but a model built otherwise may carry
    # one, and transformers' engines would apply it unless told top_k
    monkeypatch.setattr(tiny_target.generation_config, "top_k", 20)
    for engine in ("padded", "generate", "continuous"):
        torch.manual_seed(0)
        assert run(engine, temperature=1.0, top_p=1e-6) == greedy, engine
        torch.manual_seed(0)
        assert run(engine, temperature=1.0, top_k=1) == greedy, engine
        torch.manual_seed(0)
        sampled = run(engine, temperature=1.0, top_p=1.0)
        assert sampled != greedy and all(len(a) == 10 for a in sampled), engine
        # one context, near-uniform over the 259-token vocabulary: 64 first tokens drawn from
        # all of it (~56 distinct), not from the checkpoint's top 20
        torch.manual_seed(0)
        flat = run(engine, [[5, 6]] * 64, temperature=100.0)
        assert len({t for a in flat for t in a[:1]}) > 30, engine


def test_regeneration_chunk_names_follow_their_settings() -> None:
    """A chunk's name changes with any setting that changes its answers, and chunks written
    before top_k existed (no top_k, or top_k=0) keep their names, so they are not redone."""
    from types import SimpleNamespace

    from draftsmith.conf.schema import RegenConfig
    from draftsmith.train.regenerate import chunk_path

    target = SimpleNamespace(config=SimpleNamespace(_name_or_path="smollm2-135m-instruct"))
    chunk = [Conversation("a", []), Conversation("b", [])]

    def name(template_kwargs: dict | None = None, template=None, **settings) -> str:
        return chunk_path(
            Path("r"), 3, chunk, target, RegenConfig(**settings), template_kwargs, template
        ).name

    assert name(temperature=0.7, top_p=0.9) == "chunk_00003_52791ea5cc16.jsonl"  # as before
    assert name({}, temperature=0.7, top_p=0.9) == "chunk_00003_52791ea5cc16.jsonl"
    names = {
        name({"enable_thinking": False}, temperature=0.7, top_p=0.9),
        name(None, "0123abcd", temperature=0.7, top_p=0.9),  # target.chat_template's digest
        name(temperature=0.7, top_p=0.9, top_k=5),
        name(temperature=0.7, top_p=0.8),
        name(temperature=0.7, top_p=0.9, max_new_tokens=64),
        name(temperature=0.7, top_p=0.9, max_prompt_len=512),
        name(temperature=0.7, top_p=0.9),
    }
    assert len(names) == 7


def test_regeneration_keeps_the_turns_answered_before_a_bad_prompt(
    tiny_target, tiny_tokenizer
) -> None:
    """A user turn whose prompt is too long (or that the chat template rejects) ends that
    conversation's regeneration: the turns answered before it are kept, a conversation with no
    answer left is dropped, and each is reported by id."""
    from draftsmith.conf.schema import RegenConfig
    from draftsmith.train.regenerate import regenerate_chunk

    long_user = Turn("user", " ".join(["word"] * 100))
    keeps_one = Conversation("keeps_one", [*CONV.turns[:2], long_user, Turn("assistant", "x")])
    too_long = Conversation("too_long", [long_user, Turn("assistant", "x")])
    renderer = ConversationTokenizer(tiny_tokenizer)
    limit = len(renderer.prompt_ids([{"role": "user", "content": "Hi there"}])) + 100
    failures: list[str] = []
    cfg = RegenConfig(max_new_tokens=4, max_prompt_len=limit)
    out, produced = regenerate_chunk(
        tiny_target, tiny_tokenizer, renderer, [CONV, keeps_one, too_long], cfg, failures
    )
    assert [c.id for c in out] == ["c", "keeps_one"]
    assert [t.role for t in out[0].turns] == ["user", "assistant", "user", "assistant"]
    assert [t.role for t in out[1].turns] == ["user", "assistant"]  # the long turn is gone
    assert out[1].turns[0].content == "Hi there" and out[1].turns[1].content != "Hello!"
    assert produced == 3 * 4  # three answered turns of 4 tokens (a random model: no EOS)
    # in the order they happen: too_long's first turn, then keeps_one's second
    assert [f.split(":")[0] for f in failures] == ["id too_long", "id keeps_one"]
    assert all(f.endswith(f"tokens > max_prompt_len {limit}") for f in failures)

    tokenizer = load_tokenizer(tiny_tokenizer.name_or_path)
    tokenizer.chat_template = MISTRAL  # roles must alternate: a system turn is refused
    mistral = ConversationTokenizer(tokenizer)
    system = Conversation("system", [Turn("system", "be brief"), *CONV.turns])
    failures = []
    out, _ = regenerate_chunk(tiny_target, tokenizer, mistral, [system, CONV], cfg, failures)
    assert [c.id for c in out] == ["c"]
    assert len(failures) == 1 and failures[0].startswith("id system: ")


def test_regeneration_answers_tool_conversations_up_to_their_first_result(
    tiny_target, tiny_tokenizer, tmp_path: Path, monkeypatch
) -> None:
    """The target answers a tool conversation up to its first tool result (the results answer
    the original calls, not the target's), with the schemas in its prompt; the turns after it
    are dropped and counted, and the chunk keeps the conversation's tools."""
    from draftsmith.conf.schema import RegenConfig
    from draftsmith.train import regenerate as regen

    tokenizer = load_tokenizer(tiny_tokenizer.name_or_path)
    tokenizer.chat_template = QWEN25
    prompts: list[str] = []
    real = regen.answer_texts

    def recording(target, renderer, batch, *args):
        prompts.extend(renderer.tokenizer.decode(p) for p in batch)
        return real(target, renderer, batch, *args)

    monkeypatch.setattr(regen, "answer_texts", recording)
    renderer = ConversationTokenizer(tokenizer)
    convs = [dataclasses.replace(tool_conversation("Let me check."), where="line 7"), CONV]
    cfg = RegenConfig(max_new_tokens=4)
    out = regen.regenerate(tiny_target, tokenizer, renderer, convs, cfg, tmp_path)
    assert [c.id for c in out] == ["w", "c"]
    assert [c.label for c in out] == ["line 7", "id c"]  # read back, named as read
    assert [t.role for t in out[0].turns] == ["user", "assistant"]
    assert out[0].turns[1].tool_calls is None and out[0].tools == [WEATHER]
    assert [t.role for t in out[1].turns] == ["user", "assistant", "user", "assistant"]
    with_tools = [p for p in prompts if f"<tools>{json.dumps([WEATHER])}</tools>" in p]
    assert len(prompts) == 3 and len(with_tools) == 1
    assert with_tools[0].endswith("Weather in Paris and Rome?<|im_end|>\n<|im_start|>assistant\n")
    stats = json.loads((tmp_path / "stats.jsonl").read_text().splitlines()[-1])
    assert stats["cut_at_tool_results"] == 1


def test_preview_marks_the_learned_tokens_and_names_skips(tmp_path: Path) -> None:
    """`draftsmith preview` prints conversations as prepare renders them, each learned span
    marked, and why prepare would skip the others; it writes nothing."""
    import io

    from draftsmith.train import preview

    rows = [
        {"id": "ok", "messages": CONV.to_messages()},
        {"id": "question", "messages": [{"role": "user", "content": "only a question"}]},
        {"id": "unseen", "messages": CONV.to_messages()},
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = io.StringIO()
    overrides = [f"runs_dir={tmp_path}/runs", "target=tiny-random-llama", f"data.path={path}"]
    shown = preview.run(compose([*overrides, "data.preview=2"]), out)
    text = out.getvalue()
    assert (
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n⟦Hello!<|im_end|>\n⟧" in text
    )
    skip = "== line 2 (id question): skipped: no assistant turn: a prompt alone (data.regenerate"
    assert skip in text and "unseen" not in text
    # byte tokens, <|im_end|> one: "Hello!" <|im_end|> "\n" "Bye." <|im_end|> "\n"
    assert shown["ok"] == 6 + 2 + 4 + 2 and shown["question"].startswith("no assistant turn: a")
    # data.last_reply_only reaches prepare's renderer: "Bye." <|im_end|> "\n" alone
    assert preview.run(compose([*overrides, "data.last_reply_only=true"]), io.StringIO())["ok"] == 6
    assert not (tmp_path / "runs").exists()


def test_a_hub_dataset_is_read_and_recorded_at_its_commit(tmp_path: Path, fake_hub) -> None:
    """A hub dataset is read at the commit its branch (or data.revision) is at, and prepare
    records that commit: the branch moved on since is other data, refused naming the commits; the
    hub offline leaves nothing to compare; a revision of a local file is refused."""
    from draftsmith.train import prepare

    def rows(answer: str) -> list[dict]:
        return [{"prompt": f"Say {i}.", "response": f"{answer} {i}."} for i in range(4)]

    first = fake_hub.push("acme/chats", rows("Sure"))
    fake_hub.refs["acme/chats", "v1"] = first
    common = [f"runs_dir={tmp_path}/runs", "target=tiny-random-llama", "data.heldout=1"]
    cfg = compose([*common, "data.path=acme/chats"])
    stats = prepare.run(cfg)
    assert stats["source"]["commit"] == first and stats["rows"]["train"] == 3
    settings = json.loads(Path(cfg.stage_dir("prepare"), "settings.json").read_text())
    assert settings["data.sha256"] == first
    moved = fake_hub.push("acme/chats", rows("Okay then"))  # longer: other token counts
    with pytest.raises(ValueError, match=f"data.sha256: {first} -> {moved}"):
        prepare.run(cfg)
    fake_hub.online = False  # nothing to compare: the prepared data stands
    assert prepare.run(cfg)["source"]["commit"] == first
    fake_hub.online = True
    # pinned by its tag while main is elsewhere: the tag's rows (main's have more tokens)
    pinned = prepare.run(
        compose([*common, "run_name=pinned", "data.path=acme/chats", "data.revision=v1"])
    )
    assert pinned["source"]["commit"] == first and pinned["tokens"] == stats["tokens"]
    main = prepare.run(compose([*common, "run_name=main", "data.path=acme/chats"]))
    assert main["source"]["commit"] == moved and main["tokens"] != stats["tokens"]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows("Sure")))
    local = compose([*common, "run_name=local", f"data.path={data}", "data.revision=v1"])
    with pytest.raises(ValueError, match=r"revision v1: .*chats.jsonl is read from this machine"):
        prepare.run(local)
