"""Conversation readers: every format, malformed rows counted, truncated ShareGPT salvaged."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

from draftsmith.conversations import read_conversations
from draftsmith.errors import MissingInput

SHAREGPT = [
    {
        "id": "a",
        "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}],
    },
    {
        "id": "b",
        "conversations": [
            {"from": "human", "value": "q"},
            {"from": "gpt", "value": "r"},
            {"from": "human", "value": "q2"},
            {"from": "gpt", "value": "r2"},
        ],
    },
    {"id": "c", "conversations": [{"from": "alien", "value": "??"}]},
    {"id": "d", "conversations": []},
    {"id": "e", "conversations": [{"from": "human", "value": 3}]},
    {
        "id": "f",
        "conversations": [
            {"from": "system", "value": "be nice"},
            {"from": "human", "value": "x"},
            {"from": "gpt", "value": "y"},
        ],
    },
]


def test_truncated_sharegpt_keeps_complete_records(tmp_path: Path) -> None:
    text = json.dumps(SHAREGPT, indent=2)
    cut = text[: text.index('"id": "f"') + 30]  # cut mid-record, as the embedded file is
    path = tmp_path / "sg.json"
    path.write_text(cut)
    convs, report = read_conversations(str(path))
    assert [c.id for c in convs] == ["a", "b"]
    assert report.rows_seen == 5 and report.rows_kept == 2
    assert report.skipped == {"unknown role": 1, "empty conversation": 1, "non-string content": 1}
    assert report.truncated_bytes == len(cut[cut.index('{\n    "id": "f"') :].encode())
    assert "truncated" in report.summary()
    assert convs[1].turns[3].role == "assistant" and convs[1].turns[3].content == "r2"


def test_complete_sharegpt_and_limit(tmp_path: Path) -> None:
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(SHAREGPT))
    convs, report = read_conversations(str(path))
    assert [c.id for c in convs] == ["a", "b", "f"] and report.truncated_bytes == 0
    assert convs[2].turns[0].role == "system"
    convs, _ = read_conversations(str(path), limit=1)
    assert [c.id for c in convs] == ["a"]


def test_a_json_object_holding_its_rows_under_one_key_is_read_as_those_rows(
    tmp_path: Path,
) -> None:
    """As `datasets`' `field=` reads {"data": [...]}: the rows under the one key holding a list of
    objects. One conversation object, sound or faulty, stays one row; two such keys are no
    telling which, so the object is the unknown row it is."""
    path = tmp_path / "wrapped.json"
    path.write_text(json.dumps({"version": "1.0", "data": SHAREGPT}))
    convs, report = read_conversations(str(path))
    assert [c.id for c in convs] == ["a", "b", "f"] and report.rows_seen == len(SHAREGPT)
    bad = {"id": "x", "messages": [{"role": "narrator", "content": "c"}]}
    path.write_text(json.dumps(bad))
    convs, report = read_conversations(str(path))
    assert not convs and report.skipped == {"unknown role": 1}
    path.write_text(json.dumps({"train": SHAREGPT, "test": SHAREGPT}))
    convs, report = read_conversations(str(path))
    assert not convs and report.skipped == {"unknown format": 1}


def test_openai_messages_jsonl_with_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    rows = [
        json.dumps(
            {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
        ),
        "{not json",
        json.dumps({"weird": 1}),
        json.dumps({"text": "plain text row"}),
        json.dumps({"conversations": [{"role": "user", "content": "sf"}]}),
    ]
    path.write_text("\n".join(rows) + "\n")
    convs, report = read_conversations(str(path))
    assert [c.turns[0].content for c in convs] == ["u", "plain text row", "sf"]
    assert report.skipped == {"invalid JSON": 1, "unknown format": 1}
    assert any(e.startswith("line 2:") for e in report.examples)


def test_mtbench_and_humaneval_formats(tmp_path: Path) -> None:
    mt = tmp_path / "question.jsonl"
    mt.write_text(json.dumps({"question_id": 81, "category": "w", "turns": ["t1", "t2"]}) + "\n")
    convs, _ = read_conversations(str(mt))
    assert convs[0].id == "81" and convs[0].user_prompts() == ["t1", "t2"]
    assert convs[0].category == "w"
    he = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(he, "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n"}) + "\n")
    convs, _ = read_conversations(str(he))
    assert convs[0].id == "HumanEval/0" and convs[0].user_prompts() == ["def f():\n"]
    assert convs[0].category == ""  # no category field


def test_question_answer_rows(tmp_path: Path) -> None:
    """GSM8K-style question/answer rows are a pair; a question without one string answer (SQuAD's
    context and answers dict) is no conversation this reader can tell, so it is skipped."""
    path = tmp_path / "qa.jsonl"
    rows = [
        {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"},
        {"question": "Who?", "context": "...", "answers": {"text": ["x"]}},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    convs, report = read_conversations(str(path))
    assert [(t.role, t.content) for t in convs[0].turns] == [
        ("user", "What is 2 + 3?"),
        ("assistant", "2 + 3 = 5\n#### 5"),
    ]
    assert len(convs) == 1 and report.skipped == {"unknown format": 1}


def test_prompt_completion_and_preference_rows(tmp_path: Path) -> None:
    """TRL's prompt/completion and preference rows, as text or messages, Orca's pairs with a
    system text and HH-RLHF's transcripts are read with the chosen reply (it was the prompt
    alone, or a skip: "non-string content: prompt"); a chosen text with no prompt is skipped."""
    user = [{"role": "user", "content": "Hi?"}]
    reply = [{"role": "assistant", "content": "Hello."}]
    rows = [
        {"prompt": "Hi?", "chosen": "Hello.", "rejected": "Go away."},
        {"prompt": user, "completion": reply},
        {"prompt": user, "chosen": reply, "rejected": [{"role": "assistant", "content": "No."}]},
        {"chosen": user + reply, "rejected": user + [{"role": "assistant", "content": "No."}]},
        {"system": "Be kind.", "question": "Hi?", "chosen": "Hello.", "rejected": "No."},
        {"chosen": "\n\nHuman: Hi?\n\nAssistant: Hello.", "rejected": "\n\nHuman: Hi?"},
        {"chosen": "Hello.", "rejected": "No."},
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    convs, report = read_conversations(str(path))
    pair = [("user", "Hi?"), ("assistant", "Hello.")]
    assert [[(t.role, t.content) for t in c.turns] for c in convs] == [
        pair,
        pair,
        pair,
        pair,
        [("system", "Be kind."), *pair],
        pair,
    ]
    assert report.examples == [
        "line 7: preference row without a prompt: chosen is text but no Human/Assistant transcript"
    ]


def test_hf_dataset_on_disk(tmp_path: Path) -> None:
    import datasets

    ds = datasets.Dataset.from_list(
        [
            {
                "messages": [
                    {"role": "user", "content": "hello"},
                    {"role": "assistant", "content": "hi"},
                ]
            }
        ]
    )
    ds.save_to_disk(str(tmp_path / "ds"))
    convs, report = read_conversations(str(tmp_path / "ds"))
    assert report.rows_kept == 1 and convs[0].turns[1].content == "hi"


def test_a_missing_file_is_named_not_looked_for_on_the_hub(tmp_path: Path, monkeypatch) -> None:
    """A file name or a path that does not exist is no hub dataset: the error names it (it was
    "Couldn't reach 'chats.jsonl' on the Hub"); `~` is the home folder. A hub id that cannot be
    read is named, with what the hub said (it was datasets' ConnectionError and its traceback)."""
    monkeypatch.chdir(tmp_path)
    for source in ("chats.jsonl", "data/chats.parquet", str(tmp_path / "folder"), "./folder"):
        with pytest.raises(FileNotFoundError, match=f"{re.escape(source)}: no such file or folder"):
            read_conversations(source)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "chats.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
    convs, _ = read_conversations("~/chats.jsonl")
    assert convs[0].turns[0].content == "hi"
    # a hub id the hub does not answer for (offline, as here): named, with what the hub said
    import datasets
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    # datasets' own words follow: "Couldn't reach 'acme/chats' ..." (3.0: "Couldn't reach the
    # Hugging Face Hub for dataset 'acme/chats' ...")
    hub = r"acme/chats: no such file or folder here; Couldn't reach .*'acme/chats'"
    with pytest.raises(MissingInput, match=hub):
        read_conversations("acme/chats")


def test_a_dataset_split_is_picked_by_data_split(tmp_path: Path, capsys) -> None:
    """UltraChat-style splits without a "train": the first unless `split` names one (printed),
    an unknown split named with the ones there are, and files have no splits to pick."""
    import datasets

    def split(answer: str) -> datasets.Dataset:
        rows = [{"prompt": "q", "response": answer}]
        return datasets.Dataset.from_list(rows)

    splits = datasets.DatasetDict({"train_sft": split("sft"), "test_sft": split("test")})
    splits.save_to_disk(str(tmp_path / "ds"))
    convs, _ = read_conversations(str(tmp_path / "ds"))
    assert convs[0].turns[1].content == "sft"
    assert "reading split 'train_sft' of ['train_sft', 'test_sft']" in capsys.readouterr().out
    convs, _ = read_conversations(str(tmp_path / "ds"), split="test_sft")
    assert convs[0].turns[1].content == "test"
    with pytest.raises(ValueError, match=r"no such split \(it has \['train_sft', 'test_sft'\]"):
        read_conversations(str(tmp_path / "ds"), split="train")
    (tmp_path / "chat.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
    with pytest.raises(ValueError, match="data.split=train: .*chat.jsonl is files"):
        read_conversations(str(tmp_path / "chat.jsonl"), split="train")


def test_parquet_csv_files_and_a_folder_of_them(tmp_path: Path) -> None:
    import datasets

    rows = [{"prompt": f"q{i}", "response": f"a{i}"} for i in range(3)]
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "train.parquet"))
    ds.to_csv(str(tmp_path / "train.csv"), index=False)
    (tmp_path / "hub" / "data").mkdir(parents=True)  # a hub dataset repo's layout
    ds.to_parquet(str(tmp_path / "hub" / "data" / "train-00000-of-00001.parquet"))
    for source in ("train.parquet", "train.csv", "hub"):
        convs, report = read_conversations(str(tmp_path / source))
        assert report.rows_kept == 3, source
        assert [(t.role, t.content) for t in convs[2].turns] == [
            ("user", "q2"),
            ("assistant", "a2"),
        ]


def test_folder_of_json_and_parquet_files_reads_both(tmp_path: Path) -> None:
    import datasets

    (tmp_path / "a.jsonl").write_text(json.dumps({"prompt": "q0", "response": "a0"}) + "\n")
    rows = [{"prompt": f"q{i}", "response": f"a{i}"} for i in (1, 2)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "b.parquet"))
    convs, report = read_conversations(str(tmp_path))
    assert [c.turns[0].content for c in convs] == ["q0", "q1", "q2"] and report.rows_kept == 3
    # a skipped row is named by its file and its line there, not by its place among all files
    (tmp_path / "c.jsonl").write_text(json.dumps({"prompt": "q3", "response": "a3"}) + "\n{x\n")
    (tmp_path / "d.jsonl").write_text(json.dumps({"weird": 1}) + "\n")
    convs, report = read_conversations(str(tmp_path))
    assert [c.id for c in convs] == ["0", "1", "2", "3"] and report.rows_seen == 6
    assert [e.split(":")[0] for e in report.examples] == ["c.jsonl line 2", "d.jsonl line 1"]
    # what later messages (rendering, regeneration) name a kept conversation by; its own id too
    labels = ["a.jsonl line 1", "b.parquet row 0", "b.parquet row 1", "c.jsonl line 1"]
    assert [c.label for c in convs] == labels
    (tmp_path / "e.json").write_text(json.dumps([{"id": "x", "prompt": "q", "response": "a"}]))
    assert read_conversations(str(tmp_path / "e.json"))[0][0].label == "row 0 (id x)"


def test_a_byte_order_mark_and_windows_line_ends_are_read(tmp_path: Path) -> None:
    """Files saved by Windows editors and spreadsheet exports start with a UTF-8 byte-order
    mark and end lines with CRLF; the first row used to be skipped as invalid JSON."""
    rows = [{"prompt": f"q{i}", "response": f"a{i}"} for i in range(2)]
    bom = "\ufeff"
    (tmp_path / "rows.jsonl").write_text(bom + "\r\n".join(map(json.dumps, rows)) + "\r\n")
    (tmp_path / "rows.json").write_text(bom + json.dumps(rows))
    (tmp_path / "row.json").write_text(bom + json.dumps(rows[0]))
    for name, kept in (("rows.jsonl", 2), ("rows.json", 2), ("row.json", 1)):
        convs, report = read_conversations(str(tmp_path / name))
        assert report.rows_kept == kept and not report.skipped, (name, report.examples)
        assert convs[0].turns[0].content == "q0", name


def test_csv_messages_column_holds_json_lists(tmp_path: Path) -> None:
    import datasets

    chat = [{"role": "user", "content": "Hi, 1"}, {"role": "assistant", "content": "Hello"}]
    rows = [{"messages": json.dumps(chat)}, {"messages": '[{"role": "user", "content": '}]
    datasets.Dataset.from_list(rows).to_csv(str(tmp_path / "chat.csv"), index=False)
    convs, report = read_conversations(str(tmp_path / "chat.csv"))
    assert [(t.role, t.content) for t in convs[0].turns] == [
        ("user", "Hi, 1"),
        ("assistant", "Hello"),
    ]
    assert report.rows_kept == 1 and "invalid JSON list" in report.summary()


def test_pair_rows_in_json_lines_under_a_json_name(tmp_path: Path) -> None:
    rows = [
        {"instruction": "Add", "input": "2 and 2", "output": "4"},
        {"instruction": "Say hi", "input": "", "output": "hi"},
        {"prompt": "Hi", "completion": "Hello!"},
        {"prompt": "Hi", "response": 3},
    ]
    path = tmp_path / "pairs.json"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    convs, report = read_conversations(str(path))
    assert [[(t.role, t.content) for t in c.turns] for c in convs] == [
        [("user", "Add\n\n2 and 2"), ("assistant", "4")],
        [("user", "Say hi"), ("assistant", "hi")],
        [("user", "Hi"), ("assistant", "Hello!")],
    ]
    assert report.skipped == {"non-string content": 1}
    assert "response" in report.examples[0]


def test_unreadable_files_are_errors_naming_them(tmp_path: Path) -> None:
    complete = json.dumps(SHAREGPT)
    broken = complete.replace('{"id": "b"', '{"id": "b",, ', 1)  # malformed, array complete
    cases = {
        "mid.json": (broken.encode(), "invalid JSON at line 1 column"),
        "obj.json": (b'{"messages": [', "invalid JSON at line 1 column"),
        "latin1.json": ('[{"text": "caf\u00e9"}]'.encode("latin-1"), "not UTF-8"),
        "rows.txt": (b"hello", "unsupported file type"),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=message) as err:
            read_conversations(str(tmp_path / name))
        assert name in str(err.value)


def test_openai_content_parts(tmp_path: Path) -> None:
    def row(*parts: object) -> str:
        user = {"role": "user", "content": list(parts)}
        return json.dumps({"messages": [user, {"role": "assistant", "content": "ok"}]})

    text = {"type": "text", "text": "Describe "}
    path = tmp_path / "parts.jsonl"
    path.write_text(
        "\n".join(
            [
                row(text, {"type": "text", "text": "the sky."}),
                row(text, {"type": "image_url", "image_url": {"url": "x.png"}}),
                row({"type": "text", "text": 5}),
            ]
        )
    )
    convs, report = read_conversations(str(path))
    assert [t.content for t in convs[0].turns] == ["Describe the sky.", "ok"]
    assert report.skipped == {"non-text content part": 1, "non-string content": 1}


def test_rows_of_the_wrong_shape_are_skipped_with_their_reasons(tmp_path: Path) -> None:
    """A row that is not an object, a turn list that is not a list or holds a non-object, and
    MT-bench turns that are not strings: each row is skipped, counted by reason and named by its
    row number; the good row survives."""
    path = tmp_path / "m.jsonl"
    good = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
    rows = [
        [1, 2],
        {"messages": "not a list"},
        {"messages": [{"role": "user", "content": "u"}, "a bare string"]},
        {"turns": ["fine", 7]},
        good,
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    convs, report = read_conversations(str(path))
    assert [c.turns[1].content for c in convs] == ["a"]
    assert report.skipped == {
        "not an object": 1,
        "not a list": 1,
        "turn 1 is not an object": 1,
        "non-string content": 1,
    }
    assert [e.split(":")[0] for e in report.examples] == ["line 1", "line 2", "line 3", "line 4"]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_tool_use_rows(tmp_path: Path) -> None:
    """OpenAI tool calls (arguments as JSON text, a reply without content), tool results and
    `tools`; LLaMA-Factory's ShareGPT `function_call` / `observation` turns with `tools` as
    JSON text; xLAM's query / tools / answers; a bad call is a skipped row naming its turn;
    rows survive to_row -> parse_row."""
    from draftsmith.conversations import parse_row

    call = {"id": "c1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    rows = [
        {
            "id": "openai",
            "tools": [WEATHER],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "22C"},
                {"role": "assistant", "content": "It is 22C."},
            ],
        },
        {
            "id": "llamafactory",
            "tools": json.dumps([WEATHER]),
            "conversations": [
                {"from": "human", "value": "Weather in Paris?"},
                {
                    "from": "function_call",
                    "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}',
                },
                {"from": "observation", "value": "22C"},
                {"from": "gpt", "value": "It is 22C."},
            ],
        },
        {
            "id": "xlam",
            "query": "Weather in Paris?",
            "tools": json.dumps([WEATHER]),
            "answers": '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        },
        {
            "id": "bad_arguments",
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{"}}],
                },
            ],
        },
        {
            "id": "user_calls",
            "messages": [{"role": "user", "content": "q", "tool_calls": [call]}],
        },
    ]
    path = tmp_path / "tools.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    convs, report = read_conversations(str(path))
    assert [c.id for c in convs] == ["openai", "llamafactory", "xlam"]
    assert report.examples == [
        "line 4: invalid tool call: turn 1 call 0 arguments are not JSON: Expecting property name "
        "enclosed in double quotes at column 2",
        "line 5: invalid tool call: turn 0 is a user turn with tool_calls",
    ]
    openai, factory, xlam = convs
    assert openai.tools == factory.tools == xlam.tools == [WEATHER]
    assert [t.role for t in openai.turns] == [t.role for t in factory.turns]
    assert [t.role for t in openai.turns] == ["user", "assistant", "tool", "assistant"]
    expected = {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert openai.turns[1].tool_calls == [{"type": "function", "function": expected, "id": "c1"}]
    assert factory.turns[1].tool_calls == [{"type": "function", "function": expected}]
    assert xlam.turns[1].tool_calls == factory.turns[1].tool_calls
    assert [t.role for t in xlam.turns] == ["user", "assistant"]
    assert openai.turns[1].content == factory.turns[1].content == ""
    assert openai.to_messages()[2] == {
        "role": "tool",
        "content": "22C",
        "name": "get_weather",
        "tool_call_id": "c1",
    }
    for conv in convs:
        assert parse_row(json.loads(json.dumps(conv.to_row())), 0) == conv


def test_reasoning_given_apart_goes_before_the_answer(tmp_path: Path) -> None:
    """A reply's `reasoning_content` (or `reasoning`, or gpt-oss's `thinking`) becomes the
    `<think>` block thinking models write before their answer; reasoning already in the text is
    left as it is."""
    rows = [
        {"messages": [{"role": "user", "content": "2+2?"}, reply]}
        for reply in (
            {"role": "assistant", "content": "4.", "reasoning_content": "\nTwo and two.\n"},
            {"role": "assistant", "content": "4.", "reasoning": "Two and two."},
            {"role": "assistant", "content": "4.", "thinking": "Two and two."},
            {"role": "assistant", "content": "<think>\nSum.\n</think>\n\n4.", "reasoning": "x"},
        )
    ]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    convs, _ = read_conversations(str(path))
    assert [c.turns[1].content for c in convs] == [
        *["<think>\nTwo and two.\n</think>\n\n4."] * 3,
        "<think>\nSum.\n</think>\n\n4.",
    ]


def test_tool_rows_from_parquet(tmp_path: Path) -> None:
    """Arrow gives every turn every column (tool_calls, tool_call_id: None where absent) and a
    row without tools a None: read as the JSONL rows are."""
    import datasets

    call = {"id": "c1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    rows = [
        {
            "id": "tools",
            "tools": json.dumps([WEATHER]),
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "22C", "tool_call_id": "c1"},
                {"role": "assistant", "content": "22C."},
            ],
        },
        {"id": "plain", "tools": None, "messages": [{"role": "user", "content": "Hi"}]},
    ]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "chats.parquet"))
    convs, report = read_conversations(str(tmp_path / "chats.parquet"))
    assert report.rows_kept == 2 and [c.tools for c in convs] == [[WEATHER], None]
    assert convs[0].to_messages()[1:3] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    "id": "c1",
                }
            ],
        },
        {"role": "tool", "content": "22C", "tool_call_id": "c1"},
    ]
    assert convs[1].to_messages() == [{"role": "user", "content": "Hi"}]
