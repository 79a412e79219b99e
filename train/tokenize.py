"""Conversation -> token ids + assistant-only loss mask, for ANY chat template.

The mask is derived by rendering growing prefixes of the conversation with the tokenizer's own
template: the assistant span of turn i is the text between the rendering of turns < i with the
generation prompt appended and the rendering of turns <= i. That covers the reply and the
template's end-of-turn marker (so the draft learns to predict it), never the role header, and
needs no per-model regex. A template that renders a turn otherwise once later turns follow
(Qwen3) has each reply found in the whole rendering instead. Character spans become token masks
through the offset mapping.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from draftsmith.conversations import Conversation

PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}


class TemplateError(ValueError):
    """The template cannot render this conversation; the message is the skip reason."""


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]


def _render_plain(messages: list[dict], add_generation_prompt: bool, eos: str) -> str:
    text = "".join(
        f"{PLAIN_ROLES[m['role']]}: {m['content']}{eos if m['role'] == 'assistant' else ''}\n"
        for m in messages
    )
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
    ) -> None:
        if template == "auto" and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
                "pass data.template=plain to use 'Role: text' rendering instead"
            )
        self.tokenizer, self.template = tokenizer, template
        self.max_len, self.length_policy = max_len, length_policy
        # variables the template reads besides the messages (target.chat_template_kwargs)
        self.template_kwargs = dict(template_kwargs or {})

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        if self.template == "plain":
            return _render_plain(messages, add_generation_prompt, self.tokenizer.eos_token or "")
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **self.template_kwargs,
            )
        except Exception as err:  # jinja raises TemplateError or whatever the template throws
            raise TemplateError(f"template rejected the conversation: {err}") from err

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` followed by the assistant generation prompt."""
        text = self.render(messages, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character span of each assistant turn."""
        full = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = len(self.render(messages[:i], add_generation_prompt=True))
            prefix = self.render(messages[: i + 1])
            if not full.startswith(prefix) or len(prefix) < start:
                # the template renders a turn otherwise once later turns follow (Qwen3 gives
                # only the replies after the last user turn a think block)
                return full, self._found_spans(messages, full)
            spans.append((start, len(prefix)))
        return full, spans

    @functools.cached_property
    def _end_of_turn(self) -> str:
        """What the template writes after a reply's text (ChatML: `<|im_end|>\n`)."""
        probe = "draftsmith probe reply"
        rendered = self.render(
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": probe}]
        )
        return rendered[rendered.rindex(probe) + len(probe) :]

    def _found_spans(self, messages: list[dict], full: str) -> list[tuple[int, int]]:
        """Assistant spans of a template that is not prefix-stable: each message's text found
        in order in the whole rendering; a reply's span is its text and the template's
        end-of-turn marker after it (what the prefix renderings give a stable template). A reply
        whose reasoning the template drops from the history (Qwen3 and other thinking models
        show earlier replies without their `<think>` block) is found by its answer alone."""
        marker = self._end_of_turn
        spans, cursor = [], 0
        for i, message in enumerate(messages):
            text = message["content"].strip()  # templates may trim it (Llama 3 does)
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
                if full.startswith(marker, cursor):
                    cursor += len(marker)
                spans.append((at, cursor))
        return spans

    def __call__(self, conversation: Conversation) -> Tokenized:
        turns = conversation.turns
        last = max((i for i, t in enumerate(turns) if t.role == "assistant"), default=-1)
        if last < 0:
            raise TemplateError("no assistant turn")
        messages = conversation.to_messages()[: last + 1]  # trailing user turns carry no loss
        while messages and messages[0]["role"] == "assistant":  # a reply to nothing: no prompt
            messages = messages[1:]
        if not messages:
            raise TemplateError("no assistant turn after a prompt")
        text, spans = self.assistant_spans(messages)
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
