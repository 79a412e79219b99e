"""Conversation -> token ids + assistant-only loss mask, for ANY chat template.

The mask is derived by rendering growing prefixes of the conversation with the tokenizer's own
template: the assistant span of turn i is the text between the rendering of turns < i with the
generation prompt appended and the rendering of turns <= i. That covers the reply and the
template's end-of-turn marker (so the draft learns to predict it), never the role header, and
needs no per-model regex. A template that renders a turn otherwise once later turns follow
(Qwen3) has each reply found in the whole rendering instead. Character spans become token masks
through the offset mapping. Tool use: a conversation's `tools` reach the template, a reply's
span covers the calls it makes as the template writes them (tool results stay context), and a
template that does not write the calls is a skip reason, not a reply trained without them.
Reasoning: conversations hold it as a `<think>` block opening the reply's text; a template that
reads it from a `thinking` field instead (gpt-oss's harmony format) is given it there, and a
reply the target generates in such a format is read back into a `<think>` block by where the
template writes a probe's reasoning and answer. Text rows already rendered with the template
(data.preformatted) learn what the template writes after each user turn's end and generation
prompt, up to the end-of-turn marker: the spans the conversation itself would give.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

from draftsmith.conversations import Conversation, fold_reasoning, split_reasoning
from draftsmith.errors import InputError

PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
# stands in for an empty reply's text, to find where the template writes a reply
PROBE = "draftsmith probe reply"
PROBE_REASONING = "draftsmith probe reasoning"
# a template that reads a reply's reasoning from a `thinking` field (gpt-oss: `"thinking" in
# message`, `message.thinking`); Qwen3's `enable_thinking` flag is not one
THINKING_FIELD = re.compile(r"""\.thinking\b|\[['"]thinking['"]\]|['"]thinking['"] in\b""")


class TemplateError(InputError):
    """The template cannot render this conversation; the message is the skip reason."""


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]


def _thinking_apart(message: dict) -> dict:
    """A reply whose text opens with a `<think>` block as the template reads it: the block's
    reasoning in `thinking`, the answer in `content`."""
    if message["role"] != "assistant":
        return message
    reasoning, answer = split_reasoning(message["content"])
    return message if reasoning is None else {**message, "thinking": reasoning, "content": answer}


def _render_plain(
    messages: list[dict], add_generation_prompt: bool, eos: str, tools: list[dict] | None
) -> str:
    """`data.template=plain`: "Role: text" lines for a target without a chat template."""
    text = f"Tools: {json.dumps(tools)}\n" if tools else ""
    for m in messages:
        calls = "".join(f"\nCall: {json.dumps(c['function'])}" for c in m.get("tool_calls") or ())
        end = eos if m["role"] == "assistant" else ""
        text += f"{PLAIN_ROLES[m['role']]}: {m['content']}{calls}{end}\n"
    return text + ("Assistant: " if add_generation_prompt else "")


class ConversationTokenizer:
    """Renders and tokenizes conversations with a target tokenizer's template (or `plain`)."""

    def __init__(
        self,
        tokenizer,
        template: str = "auto",
        max_len: int = 2048,
        length_policy: str = "truncate",
        template_kwargs: dict | None = None,
        last_reply_only: bool = False,
        preformatted: bool = False,
    ) -> None:
        if template == "auto" and not getattr(tokenizer, "chat_template", None):
            raise InputError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
                "pass data.template=plain to use 'Role: text' rendering instead"
            )
        self.tokenizer, self.template = tokenizer, template
        self.max_len, self.length_policy = max_len, length_policy
        # variables the template reads besides the messages (target.chat_template_kwargs)
        self.template_kwargs = dict(template_kwargs or {})
        # learn only each conversation's last reply (data.last_reply_only: in thinking data the
        # earlier replies are shown without their reasoning, not as the model wrote them)
        self.last_reply_only = last_reply_only
        # `text` rows are conversations the template already rendered (data.preformatted)
        self.preformatted = preformatted

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = False,
        tools: list[dict] | None = None,
    ) -> str:
        if self.template == "plain":
            eos = self.tokenizer.eos_token or ""
            return _render_plain(messages, add_generation_prompt, eos, tools)
        if self.reads_thinking:
            messages = [_thinking_apart(m) for m in messages]
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **self.template_kwargs,
            )
        except Exception as err:  # jinja raises TemplateError or whatever the template throws
            raise TemplateError(f"template rejected the conversation: {err}") from err

    @functools.cached_property
    def reads_thinking(self) -> bool:
        """Whether the template reads a reply's reasoning from a `thinking` field."""
        template = getattr(self.tokenizer, "chat_template", None)
        if self.template == "plain" or not isinstance(template, str):
            return False
        return THINKING_FIELD.search(template) is not None

    @functools.cached_property
    def _reply_layouts(self) -> list[tuple[str, str]]:
        """(head, between) of each way the template writes a generated reply: with reasoning,
        what it writes before the reasoning and between it and the answer; without, what it
        writes before the answer ("" between)."""
        asked = [{"role": "user", "content": "q"}]
        start = len(self.render(asked, add_generation_prompt=True))
        thought = self.render(
            [*asked, {"role": "assistant", "content": fold_reasoning(PROBE_REASONING, PROBE)}]
        )[start:]
        plain = self.render([*asked, {"role": "assistant", "content": PROBE}])[start:]
        layouts = []
        at, answer = thought.find(PROBE_REASONING), thought.find(PROBE)
        if 0 <= at and at + len(PROBE_REASONING) < answer:
            layouts.append((thought[:at], thought[at + len(PROBE_REASONING) : answer]))
        if PROBE in plain:
            layouts.append((plain[: plain.index(PROBE)], ""))
        return layouts

    def reply_text(self, ids: list[int]) -> str | None:
        """A generated reply's token ids as a message's text (see `read_reply`)."""
        if not self.reads_thinking:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        return self.read_reply(self.tokenizer.decode(ids))

    def read_reply(self, text: str) -> str | None:
        """A generated reply, decoded with its special tokens, as a message's text. A template
        that reads reasoning from a field has the model write it in its own format (gpt-oss: an
        analysis channel, then a final one, in special tokens): found where the template writes
        a probe's, it becomes the `<think>` block conversations hold. A reply in none of the
        template's layouts, or with special tokens left in its parts (a gpt-oss tool call goes
        to another channel), is None: the template would not write it as the model did. Other
        templates' replies are their text as it is."""
        if not self.reads_thinking:
            return text
        for head, between in self._reply_layouts:
            if not text.startswith(head):
                continue
            rest = text[len(head) :]
            # a reply cut off by max_new_tokens mid-reasoning keeps the reasoning it wrote
            parts = rest.partition(between)[::2] if between else (rest,)
            if all(map(self._plain, parts)):
                return fold_reasoning(*parts) if between else rest
        return None

    def _plain(self, text: str) -> bool:
        """Whether `text` holds no special tokens."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer.decode(ids, skip_special_tokens=True) == self.tokenizer.decode(ids)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of `messages` followed by the assistant generation prompt."""
        text = self.render(messages, add_generation_prompt=True, tools=tools)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def assistant_spans(
        self, messages: list[dict], tools: list[dict] | None = None
    ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character span of each assistant turn."""
        full = self.render(messages, tools=tools)
        spans: list[tuple[int, int] | None] = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True, tools=tools)
            prefix = self.render(messages[: i + 1], tools=tools)
            # None: the template renders this reply otherwise once later turns follow (Qwen3
            # and gpt-oss drop the reasoning of replies before the last user turn)
            start, end = len(prompt), len(prefix)
            stable = full.startswith(prompt) and full.startswith(prefix) and end >= start
            spans.append((start, end) if stable else None)
        if None in spans:
            spans = self._found_spans(messages, full, spans, tools)
        replies = [m for m in messages if m["role"] == "assistant"]
        for i, (message, (start, end)) in enumerate(zip(replies, spans)):
            missing = [
                c["function"]["name"]
                for c in message.get("tool_calls") or ()
                if c["function"]["name"] not in full[start:end]
            ]
            if missing:
                raise TemplateError(
                    f"template does not render tool calls: reply {i} calls {missing[0]!r}, "
                    "which its rendering leaves out (target.chat_template=<file> can give one "
                    "that writes them)"
                )
        return full, spans

    @functools.cached_property
    def _end_of_turn(self) -> str:
        """What the template writes after a reply's text (ChatML: `<|im_end|>\n`)."""
        rendered = self.render(
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": PROBE}]
        )
        return rendered[rendered.rindex(PROBE) + len(PROBE) :]

    @functools.cached_property
    def reply_header(self) -> str:
        """What the template writes between a user turn's text and the reply: the turn's end
        and the generation prompt (ChatML: `<|im_end|>\n<|im_start|>assistant\n`; Mistral,
        which has no generation prompt: ` [/INST]`), which finds replies in rendered text."""
        rendered = self.render([{"role": "user", "content": PROBE}], add_generation_prompt=True)
        header = rendered[rendered.rindex(PROBE) + len(PROBE) :]
        if not header:
            raise TemplateError(
                "rendered text cannot be read: the template writes nothing between a user "
                "turn and the reply to find replies by"
            )
        return header

    def rendered_spans(self, text: str) -> list[tuple[int, int]]:
        """The character span of each reply in a conversation the template already rendered:
        from the end of each `reply_header` to the end of the end-of-turn marker after it (the
        spans `assistant_spans` gives the same conversation), or to the end of the text."""
        header, marker = self.reply_header, self._end_of_turn
        spans, at = [], text.find(header)
        while at >= 0:
            start = at + len(header)
            end = text.find(marker, start)
            end = len(text) if end < 0 else end + len(marker)
            spans.append((start, end))
            at = text.find(header, end)
        if not spans:
            raise TemplateError(
                f"no assistant turn: the text holds no {header!r}, which the target's chat "
                "template writes before a reply"
            )
        return spans

    def _found_spans(
        self,
        messages: list[dict],
        full: str,
        stable: list[tuple[int, int] | None],
        tools: list[dict] | None,
    ) -> list[tuple[int, int]]:
        """Assistant spans of a template that is not prefix-stable: the `stable` ones (the
        prefix renderings' spans, None where they fail) kept, each other message's text found
        in order in the whole rendering; a found reply's span is its text and the template's
        end-of-turn marker after it (what the prefix renderings give a stable template), its
        tool calls between them. A reply whose reasoning the template drops from the history
        (Qwen3 and other thinking models show earlier replies without their `<think>` block) is
        found by its answer alone; one that only calls tools is found where the template writes
        a probe text in its place."""
        marker = self._end_of_turn
        spans, cursor, replies = [], 0, iter(stable)
        for i, message in enumerate(messages):
            kept = next(replies) if message["role"] == "assistant" else None
            if kept is not None:
                spans.append(kept)
                cursor = kept[1]
                continue
            text = message["content"].strip()  # templates may trim it (Llama 3 does)
            calls = message.get("tool_calls")
            if calls and not text:
                at = self._probe_position(messages, i, full, cursor, tools)
            else:
                at = full.find(text, cursor)
                if at < 0 and "</think>" in text:
                    text = text.split("</think>")[-1].strip()
                    at = full.find(text, cursor)
            if at < 0:
                raise TemplateError(
                    f"template not prefix-stable and turn {i}'s text is not in its rendering"
                )
            cursor = at + len(text)
            if message["role"] == "assistant":
                if calls:  # the calls come between the text and the end of the turn
                    end = full.find(marker, cursor)
                    cursor = cursor if end < 0 else end
                if full.startswith(marker, cursor):
                    cursor += len(marker)
                spans.append((at, cursor))
        return spans

    def _probe_position(
        self, messages: list[dict], i: int, full: str, cursor: int, tools: list[dict] | None
    ) -> int:
        """Where reply `i`, which has no text, starts in `full`: where the template writes a
        probe text given as its content, if the rendering up to there is the same (-1 if not)."""
        probed = [*messages[:i], {**messages[i], "content": PROBE}, *messages[i + 1 :]]
        rendering = self.render(probed, tools=tools)
        at = rendering.find(PROBE, cursor)
        return at if at >= 0 and rendering[:at] == full[:at] else -1

    def __call__(self, conversation: Conversation) -> Tokenized:
        if self.preformatted and conversation.rendered:
            text = conversation.turns[0].content
            return self._tokenized(text, self.rendered_spans(text))
        turns = conversation.turns
        last = max((i for i, t in enumerate(turns) if t.role == "assistant"), default=-1)
        if last < 0:
            raise TemplateError(
                "no assistant turn: a prompt alone (data.regenerate=true has the target answer it)"
                if any(t.role == "user" for t in turns)
                else "no assistant turn"
            )
        messages = conversation.to_messages()[: last + 1]  # trailing user turns carry no loss
        while messages and messages[0]["role"] == "assistant":  # a reply to nothing: no prompt
            messages = messages[1:]
        if not messages:
            raise TemplateError("no assistant turn after a prompt")
        return self._tokenized(*self.assistant_spans(messages, conversation.tools))

    def _tokenized(self, text: str, spans: list[tuple[int, int]]) -> Tokenized:
        """`text`'s token ids, learning the tokens that start inside `spans` (character spans
        of the replies, in order), cut or refused at max_len."""
        if self.last_reply_only:
            spans = spans[-1:]
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
        mask = [0] * len(ids)
        span_index = 0
        for t, (s, e) in enumerate(offsets):
            while span_index < len(spans) and s >= spans[span_index][1]:
                span_index += 1
            if (
                span_index < len(spans)
                and spans[span_index][0] <= s < spans[span_index][1]
                and e > s
            ):
                mask[t] = 1
        if len(ids) > self.max_len:
            if self.length_policy == "drop":
                raise TemplateError(f"too long: {len(ids)} tokens > max_len {self.max_len}")
            ids, mask = ids[: self.max_len], mask[: self.max_len]
        if not any(mask):
            raise TemplateError("no assistant tokens within max_len")
        return Tokenized(ids, mask)
