"""Read conversations from any supported source into one `Conversation` type.

Sources: ShareGPT JSON/JSONL (`conversations: [{from, value}]`), OpenAI messages JSONL
(`messages: [{role, content}]`, content a string or text parts), prompt/completion (or response)
pairs, Alpaca rows (`instruction`, `input`, `output`), question/answer rows, preference pairs
(the `chosen` reply; TRL's rows with text or messages, Orca's with a `system`, HH-RLHF's
transcripts), plain text rows (`text`), MT-bench (`turns`), HumanEval (`prompt`); as JSON,
JSONL (optionally .gz), Parquet, Arrow or CSV files, folders of them, HF datasets saved on disk
or on the hub, and the embedded data assets by name.
Malformed rows are skipped with their reason counted in a `ReadReport` and the first few named
where they are (a folder's file, then its line in JSON Lines, else its row), never silently; a
file that cannot be read at all is an error naming it. A JSON array cut off mid-record (the
embedded ShareGPT file is) keeps every complete record; a complete array with a malformed
record is an error, as reading on past it cannot be done reliably.

Tool use, as chat templates take it: a row's `tools` (function schemas, a list or JSON text),
assistant turns with `tool_calls` (OpenAI's `{type, function: {name, arguments}}`, arguments as
JSON text or an object; ShareGPT's `function_call` turns, whose value is the call) and tool
results (roles `tool`, `function`, `ipython`, `observation`); xLAM rows (`query`, `tools`,
`answers`: the calls) are a user turn and a reply of calls. A reply's reasoning given apart
(`reasoning_content`, `reasoning` or gpt-oss's `thinking`) is put in front of its text in a
`<think>` block; a template that reads it from a field gets it back there (core/tokenize.py).
"""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.assets import ASSETS, AssetError, asset_path
from draftsmith.errors import InputError, MissingInput
from draftsmith.files import content_digest

ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "bing": "assistant",
    "system": "system",
    # tool results: OpenAI (and its older `function`), Llama 3.1's `ipython`, LLaMA-Factory's
    # ShareGPT `observation`
    "tool": "tool",
    "function": "tool",
    "ipython": "tool",
    "observation": "tool",
    # LLaMA-Factory's ShareGPT: an assistant turn whose value is the call (JSON)
    "function_call": "assistant",
}


def fold_reasoning(reasoning: str, answer: str) -> str:
    """A reply's text with its reasoning in a `<think>` block before the answer."""
    return f"<think>\n{reasoning.strip()}\n</think>\n\n{answer.lstrip()}"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a reply's text: `fold_reasoning` undone; (None, text) when the
    text opens with no `<think>` block."""
    head = text.lstrip()
    if not head.startswith("<think>") or "</think>" not in head:
        return None, text
    thought, answer = head[len("<think>") :].split("</think>", 1)
    return thought.strip(), answer.lstrip()


@dataclass
class Turn:
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str
    # an assistant turn's calls: [{"type": "function", "function": {"name", "arguments"}}, ...]
    # with arguments decoded to objects (templates write them with `tojson`)
    tool_calls: list[dict] | None = None
    name: str | None = None  # a tool result's tool
    tool_call_id: str | None = None  # the call a tool result answers (Mistral's templates ask)

    def to_message(self) -> dict:
        """The chat-template message: role and content, and the tool fields that are set."""
        message: dict = {"role": self.role, "content": self.content}
        for key in ("tool_calls", "name", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


@dataclass
class Conversation:
    id: str
    turns: list[Turn]
    category: str = ""  # a benchmark's task category (MT-bench: writing, coding, ...), if given
    tools: list[dict] | None = None  # function schemas the template renders (`tools=`)
    # where it was read ("line 4", "b.jsonl line 1", "row 3"; its own id after it when it has
    # one): what messages about it name, since an id counted across rows or files shows in no
    # editor (empty: not read from a source)
    where: str = field(default="", compare=False)
    # a `text` row: its one user turn is the row's text as given, which data.preformatted reads
    # as a conversation the chat template already rendered
    rendered: bool = False

    @property
    def label(self) -> str:
        """How messages name this conversation: where it was read, else its id."""
        return self.where or f"id {self.id}"

    def user_prompts(self) -> list[str]:
        return [t.content for t in self.turns if t.role == "user"]

    def to_messages(self) -> list[dict]:
        return [t.to_message() for t in self.turns]

    def to_row(self) -> dict:
        """One JSONL record that `parse_row` reads back as this conversation."""
        if self.rendered:
            return {"id": self.id, "text": self.turns[0].content}
        row: dict = {"id": self.id, "messages": self.to_messages()}
        if self.tools is not None:
            row["tools"] = self.tools
        return row


@dataclass
class ReadReport:
    """What a read kept, what it skipped and why."""

    source: str
    rows_seen: int = 0
    rows_kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)  # first few "<where>: <reason>"
    truncated_bytes: int = 0  # bytes after the last complete record of a cut-off JSON array
    commit: str | None = None  # a hub dataset's commit the rows were read at (`hub_commit`)

    def skip(self, where: str, reason: str) -> None:
        """Count a skipped row; `where` names it ("line 4", "row 3", "b.jsonl line 1")."""
        self.skipped[reason.split(":")[0]] += 1
        if len(self.examples) < 20:
            self.examples.append(f"{where}: {reason}")

    def summary(self) -> str:
        text = f"{self.source}: kept {self.rows_kept}/{self.rows_seen} rows"
        if self.skipped:
            text += f"; {skipped_text(self.skipped, self.examples)}"
        if self.truncated_bytes:
            text += (
                f"; file truncated: {self.truncated_bytes} trailing bytes of an incomplete record"
            )
        return text

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "rows_seen": self.rows_seen,
            "rows_kept": self.rows_kept,
            "skipped": dict(self.skipped),
            "examples": self.examples,
            "truncated_bytes": self.truncated_bytes,
        } | ({"commit": self.commit} if self.commit else {})


def skipped_text(skipped: Counter, examples: list[str]) -> str:
    """What a report of skipped rows prints: the count per reason and the first three rows
    (by where they were read, so a user can open the file at them)."""
    return f"skipped {dict(skipped)}, e.g. " + "; ".join(examples[:3])


class RowError(InputError):
    """A row that cannot become a conversation; the message is the reason."""


class UnknownFormat(RowError):
    """A row with none of the keys any reader knows."""


def _json_text(value: Any, error: str) -> Any:
    """`value`, or the JSON it holds when it is text (CSV and Arrow columns hold lists as text;
    OpenAI's tool-call arguments are JSON text); RowError `error` if that text is not JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise RowError(f"{error}: {err.msg} at column {err.colno}") from None


def _turns_from(items: Any, role_key: str, content_key: str) -> list[Turn]:
    if isinstance(items, str) and items.lstrip().startswith("["):
        items = _json_text(items, "invalid JSON list")
    if not isinstance(items, list):
        raise RowError(f"not a list: {type(items).__name__}")
    turns = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise RowError(f"turn {i} is not an object")
        given = str(item.get(role_key, "")).lower()
        role = ROLE_ALIASES.get(given)
        if role is None:
            raise RowError(f"unknown role: turn {i} has {role_key}={item.get(role_key)!r}")
        content = item.get(content_key)
        calls = item.get("tool_calls") or None  # Arrow rows give every turn the column
        if given == "function_call":  # the value is the call itself
            calls, content = content, ""
        elif calls is not None and content is None:  # a reply that only calls tools
            content = ""
        if isinstance(content, list):  # OpenAI content parts: [{"type": "text", "text": ...}]
            content = _text_parts(content, i)
        if not isinstance(content, str):
            raise RowError(
                f"non-string content: turn {i} {content_key} is {type(content).__name__}"
            )
        reasoning = item.get("reasoning_content") or item.get("reasoning") or item.get("thinking")
        if role == "assistant" and isinstance(reasoning, str) and "</think>" not in content:
            # reasoning given apart (vLLM's and SGLang's reasoning parsers write it so) goes in
            # front of the answer as thinking models write it, and their templates read it back
            content = fold_reasoning(reasoning, content)
        turn = Turn(role, content)
        if calls is not None:
            if role != "assistant":
                raise RowError(f"invalid tool call: turn {i} is a {role} turn with tool_calls")
            turn.tool_calls = _tool_calls(calls, i)
        if role == "tool":
            for key in ("name", "tool_call_id"):
                if isinstance(item.get(key), str):
                    setattr(turn, key, item[key])
        turns.append(turn)
    return turns


def _tool_calls(value: Any, turn: int) -> list[dict]:
    """An assistant turn's calls in OpenAI's form with arguments as objects: from a list or one
    call, either `{function: {name, arguments}}` or flat `{name, arguments}`, any as JSON text."""
    calls = _json_text(value, f"invalid tool call: turn {turn} tool_calls are not JSON")
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list):
        raise RowError(f"invalid tool call: turn {turn} tool_calls is {type(calls).__name__}")
    out = []
    for k, call in enumerate(calls):
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RowError(f"invalid tool call: turn {turn} call {k} has no function name")
        arguments = _json_text(
            function.get("arguments", {}),
            f"invalid tool call: turn {turn} call {k} arguments are not JSON",
        )
        entry: dict = {
            "type": "function",
            "function": {"name": function["name"], "arguments": arguments},
        }
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def parse_tools(value: Any) -> list[dict] | None:
    """A row's function schemas (`tools`): a list of objects, or JSON text of one."""
    tools = _json_text(value, "invalid tools: not JSON") if value else None
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise RowError("invalid tools: not a list of objects")
    return tools or None


def _text_parts(parts: list, turn: int) -> str:
    """The text of OpenAI-style content parts, joined; a part that is not text (an image, an
    audio clip) is a RowError: a text target cannot read it."""
    texts = []
    for part in parts:
        if not (isinstance(part, dict) and part.get("type") == "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RowError(f"non-text content part: turn {turn} has a {kind!r} part")
        if not isinstance(part.get("text"), str):
            raise RowError(f"non-string content: turn {turn} text part")
        texts.append(part["text"])
    return "".join(texts)


def _text(row: dict, key: str) -> str:
    if not isinstance(row[key], str):
        raise RowError(f"non-string content: {key}")
    return row[key]


# a prompt row's answer, the first of these it has: prompt/completion (TRL's and OpenAI's old
# fine-tuning files), response and output (Alpaca), answer (QA sets), chosen (preference pairs:
# the preferred reply is the one to learn; `rejected` is dropped)
ANSWER_KEYS = ("completion", "response", "output", "answer", "chosen")


def _text_or_messages(row: dict, key: str, role: str) -> list[Turn]:
    """A prompt's or an answer's turns: text is one `role` turn, a message list (TRL's
    conversational rows) its own turns."""
    value = row[key]
    if isinstance(value, list):
        return _turns_from(value, "role", "content")
    return [Turn(role, _text(row, key))]


def _transcript_turns(text: str) -> list[Turn]:
    """Anthropic HH-RLHF's preference text ("\n\nHuman: ...\n\nAssistant: ..."): its turns;
    RowError for text that is no such transcript (a reply without its prompt)."""
    parts = re.split(r"\n\n(Human|Assistant): ?", "\n\n" + text.lstrip("\n"))
    if parts[0] or len(parts) < 3:
        raise RowError(
            "preference row without a prompt: chosen is text but no Human/Assistant transcript"
        )
    roles = {"Human": "user", "Assistant": "assistant"}
    return [Turn(roles[who], said) for who, said in zip(parts[1::2], parts[2::2], strict=True)]


def _pair_turns(row: dict) -> list[Turn]:
    """A prompt and, where the row has one, its answer (`ANSWER_KEYS`; HumanEval has the prompt
    alone): prompt, Alpaca's instruction [+ input], or a question; each prompt and answer text
    or, in TRL's conversational rows, messages; a `system` text (Orca's pairs) goes first.
    A preference row without a prompt holds the whole conversation in `chosen`."""
    if "instruction" in row:
        prompt = _text(row, "instruction")
        if row.get("input"):
            prompt = f"{prompt}\n\n{_text(row, 'input')}"
        turns = [Turn("user", prompt)]
    elif "prompt" in row or "question" in row:
        turns = _text_or_messages(row, "prompt" if "prompt" in row else "question", "user")
    elif isinstance(row["chosen"], list):
        return _turns_from(row["chosen"], "role", "content")
    else:
        return _transcript_turns(_text(row, "chosen"))
    if isinstance(row.get("system"), str) and row["system"].strip() and turns[0].role != "system":
        turns.insert(0, Turn("system", row["system"]))
    answer = next((k for k in ANSWER_KEYS if row.get(k) is not None), None)
    if answer is not None:
        turns += _text_or_messages(row, answer, "assistant")
    return turns


def parse_row(row: Any, index: int) -> Conversation:
    """One raw record -> Conversation, or RowError with the reason."""
    if not isinstance(row, dict):
        raise RowError(f"not an object: {type(row).__name__}")
    row_id = str(row.get("id", row.get("question_id", row.get("task_id", index))))
    rendered = False
    if "conversations" in row:
        items = row["conversations"]
        keys = ("from", "value")
        if isinstance(items, list) and items and isinstance(items[0], dict) and "role" in items[0]:
            keys = ("role", "content")
        turns = _turns_from(items, *keys)
    elif "messages" in row:
        turns = _turns_from(row["messages"], "role", "content")
    elif "turns" in row:  # MT-bench: user turns only
        if not all(isinstance(t, str) for t in row["turns"] or [None]):
            raise RowError("non-string content: MT-bench turns")
        turns = [Turn("user", t) for t in row["turns"]]
    elif "query" in row and "answers" in row:  # xLAM function calling: one reply of calls
        turns = [Turn("user", _text(row, "query"))]
        turns.append(Turn("assistant", "", tool_calls=_tool_calls(row["answers"], 1)))
    elif "prompt" in row or "instruction" in row or "chosen" in row:
        turns = _pair_turns(row)
    # GSM8K and other QA sets (SQuAD's answers dict is no reply: unknown)
    elif "question" in row and any(isinstance(row.get(k), str) for k in ("answer", "chosen")):
        turns = _pair_turns(row)
    elif "text" in row:  # a prompt, or with data.preformatted a rendered conversation
        turns, rendered = [Turn("user", _text(row, "text"))], True
    else:
        raise UnknownFormat(f"unknown format: keys {sorted(row)[:6]}")
    if not turns or all(not t.content.strip() and not t.tool_calls for t in turns):
        raise RowError("empty conversation")
    category = row.get("category")
    return Conversation(
        row_id,
        turns,
        category if isinstance(category, str) else "",
        parse_tools(row.get("tools")),
        rendered=rendered,
    )


def _iter_json_array(text: str, path: Path, report: ReadReport):
    """Yield records of a JSON array one by one; stop cleanly at a cut-off final record."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    end = len(text)
    while True:
        while pos < end and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= end or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            if text.rstrip().endswith("]"):  # the array is complete: this record is malformed
                raise InputError(
                    f"{path}: invalid JSON at line {err.lineno} column {err.colno}: {err.msg}"
                ) from None
            report.truncated_bytes = len(text[pos:].encode("utf-8"))
            return
        yield record


# files read through a `datasets` builder, by suffix (a hub dataset's data files often are these)
_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
_JSON_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
_SUFFIXES = (*_JSON_SUFFIXES, *_BUILDERS)


def _json_lines(lines: Iterable[str]) -> Iterator[tuple[str, Any]]:
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield f"line {line_no}", json.loads(line)
        except json.JSONDecodeError as err:
            yield f"line {line_no}", RowError(f"invalid JSON: {err.msg}")


def _numbered(records: Iterable) -> Iterator[tuple[str, Any]]:
    return ((f"row {i}", record) for i, record in enumerate(records))


def _iter_records(path: Path, report: ReadReport) -> Iterator[tuple[str, Any]]:
    """(where, record) of each record of a file: where is "line N" in JSON Lines (from 1, as
    editors count), else "row N" (from 0, as a JSON array or a dataset indexes it)."""
    if path.suffix in _BUILDERS:
        yield from _numbered(_iter_dataset(_BUILDERS[path.suffix], data_files=str(path)))
        return
    if not path.name.endswith(_JSON_SUFFIXES):
        raise InputError(
            f"{path}: unsupported file type; conversations are read from "
            f"{', '.join(_JSON_SUFFIXES + tuple(_BUILDERS))} files or a dataset folder"
        )
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        # utf-8-sig: a leading byte-order mark (Windows editors, spreadsheet exports write one)
        # is dropped, not read as the start of the first record
        with opener(path, "rt", encoding="utf-8-sig") as f:
            if path.name.removesuffix(".gz").endswith(".jsonl"):
                yield from _json_lines(f)  # streamed: JSONL files can be large
                return
            text = f.read()
    except UnicodeDecodeError as err:
        raise InputError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    if text.lstrip().startswith("["):
        yield from _numbered(_iter_json_array(text, path, report))
        return
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg != "Extra data":
            raise InputError(
                f"{path}: invalid JSON at line {err.lineno} column {err.colno}: {err.msg}"
            ) from None
        # one value per line: JSON Lines under a .json name (many hub datasets' files are)
        yield from _json_lines(text.splitlines())
        return
    yield from _numbered(_unwrapped(record, path))


def _unwrapped(record: Any, path: Path) -> list:
    """A file's one JSON object: a conversation, or an object holding the rows under one key
    ({"data": [...], "version": ...}, as `datasets`' `field=` reads), which yields them."""
    try:
        parse_row(record, 0)
        return [record]
    except UnknownFormat:
        pass
    except RowError:  # a conversation with a fault: reported as the row it is
        return [record]
    lists = [k for k, v in record.items() if isinstance(v, list) and v and _all_objects(v)]
    if len(lists) != 1:  # none, or no telling which: reported as the row it is
        return [record]
    print(f"{path}: reading the {len(record[lists[0]])} rows under its key {lists[0]!r}")
    return record[lists[0]]


def _all_objects(values: list) -> bool:
    return all(isinstance(v, dict) for v in values)


def _iter_dataset(
    source: str,
    data_files: str | None = None,
    split: str | None = None,
    revision: str | None = None,
):
    """Rows of a saved dataset folder, or of `datasets.load_dataset(source, data_files=...)`
    (a hub id at `revision`, a folder of data files, or a builder name such as "parquet" with
    its files): its `split`, by default "train" or, without one, its first (printed when it has
    several)."""
    import datasets

    if data_files is not None:
        ds = datasets.load_dataset(source, data_files=data_files)
    elif Path(source).is_dir() and any((Path(source) / f).exists() for f in _DATASET_MARKERS):
        ds = datasets.load_from_disk(source)
    else:
        try:
            ds = datasets.load_dataset(source, revision=revision)
        except (ConnectionError, FileNotFoundError) as err:  # a hub id: not there, or no hub
            raise MissingInput(f"{source}: no such file or folder here; {err}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split is not None and split not in ds:
            raise InputError(f"{source}: data.split={split}: no such split (it has {list(ds)})")
        name = split or ("train" if "train" in ds else next(iter(ds)))
        if len(ds) > 1:
            print(f"{source}: reading split {name!r} of {list(ds)} (data.split picks another)")
        ds = ds[name]
    elif split is not None:
        raise InputError(f"{source}: data.split={split}: a dataset of one split has no other")
    yield from ds


# Files `datasets.save_to_disk` writes: such a folder is an Arrow dataset, not loose JSON files.
_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def _source_path(source: str) -> Path:
    """Where `source` is read from on this machine: an asset's payload, or the path as given
    (`~` expanded); a hub id names no existing path."""
    return asset_path(source) if source in ASSETS else Path(source).expanduser()


def source_digest(source: str, revision: str | None = None) -> str | None:
    """What `source` holds: a file's or folder's `files.content_digest`, a hub dataset's
    commit at `revision` (`hub_commit`; a commit is itself a digest of its files); None for a
    source not here to read now (an asset not fetched, a file moved away, the hub offline)."""
    try:
        path = _source_path(source)
    except AssetError:
        return None
    if _is_hub_id(source, path):
        return hub_commit(source, revision)
    return content_digest(path) if path.exists() else None


def hub_commit(source: str, revision: str | None = None) -> str | None:
    """The commit hub dataset `source`'s `revision` (a branch, tag or commit; None: its default
    branch) is at now: reading at it reads what was recorded even if the branch moves meanwhile,
    and a later commit is other data. None when the hub does not answer (offline, unreachable,
    no such dataset: the read itself then says so, or reads datasets' cache)."""
    from huggingface_hub import HfApi

    try:
        return HfApi().dataset_info(source, revision=revision).sha
    except Exception:  # noqa: BLE001 (whatever the hub or the network said: no commit to name)
        return None


def _is_hub_id(source: str, path: Path) -> bool:
    """`source` names a hub dataset: no asset, nothing at its path here, and not written as a
    path or a file's name (`./x`, `~/x`, `x.jsonl`: missing, it is no dataset to look for on the
    hub)."""
    local = source.startswith(("/", "./", "../", "~")) or source.endswith(_SUFFIXES)
    return source not in ASSETS and not local and not path.exists()


def read_conversations(
    source: str, limit: int | None = None, split: str | None = None, revision: str | None = None
) -> tuple[list[Conversation], ReadReport]:
    """Read up to `limit` valid conversations from a file, folder, HF dataset (its `split`; a
    hub one at `revision`, its commit recorded in the report) or asset name."""
    path = _source_path(source)
    hub = _is_hub_id(source, path)
    if not hub and not path.exists() and source not in ASSETS:  # a path or a file's name
        raise MissingInput(f"{source}: no such file or folder")
    if revision is not None and not hub:
        raise InputError(  # data.revision's or eval.revision's: both name a hub dataset's
            f"revision {revision}: {source} is read from this machine, not from the hub, and has "
            "no revisions (drop data.revision or eval.revision)"
        )
    report = ReadReport(source=str(source), commit=hub_commit(source, revision) if hub else None)
    files = (
        sorted(
            p for p in path.iterdir() if p.name.endswith(_JSON_SUFFIXES) or p.suffix in _BUILDERS
        )
        if path.is_dir()
        else []
    )
    has_json = any(p.name.endswith(_JSON_SUFFIXES) for p in files)
    loose = path.is_file() or (has_json and not any((path / f).exists() for f in _DATASET_MARKERS))
    if split is not None and loose:
        raise InputError(f"data.split={split}: {source} is files, which have no splits")
    # (where a skipped row is, record)
    if path.is_file():
        located = _iter_records(path, report)
    elif loose:
        # loose files, JSON among them: each file read in name order, Parquet/Arrow/CSV too;
        # a skipped row is named by its file and its place there
        located = (
            (f"{p.name} {where}", record)
            for p in files
            for where, record in _iter_records(p, report)
        )
    else:  # a saved dataset, a folder of Parquet/Arrow/CSV files (datasets finds them), a hub id
        # a hub dataset read at the commit the report names, not wherever its branch is by then
        located = _numbered(
            _iter_dataset(
                str(path) if path.is_dir() else str(source),
                split=split,
                revision=report.commit or revision,
            )
        )
    conversations: list[Conversation] = []
    for index, (where, record) in enumerate(located):
        if limit is not None and len(conversations) >= limit:
            break
        report.rows_seen += 1
        try:
            if isinstance(record, RowError):
                raise record
            conv = parse_row(record, index)  # ids count across files
            conv.where = where if conv.id == str(index) else f"{where} (id {conv.id})"
            conversations.append(conv)
        except RowError as err:
            report.skip(where, str(err))
    report.rows_kept = len(conversations)
    return conversations, report
