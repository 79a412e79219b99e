"""`draftsmith generate`: one prompt decoded speculatively and streamed, next to the target
alone."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from draftsmith.config import compose
from draftsmith.inference import generate


def overrides(head_dir: Path, *extra: str) -> list[str]:
    return [
        "target=tiny-random-llama",
        "dtype=float32",
        f"head_path={head_dir}",
        "tree.depth=3",
        "tree.lookup=3",
        # Hydra reads a comma as a list: a prompt with one is quoted inside the override
        "generate.prompt='Count to twenty, please.'",
        "generate.max_new_tokens=40",
        *extra,
    ]


def test_streams_the_targets_greedy_output(head_dir: Path, tiny_tokenizer) -> None:
    out = io.StringIO()
    result = generate.run(compose(overrides(head_dir, "generate.compare=true")), out=out)
    # fp32: the streamed text is exactly the target's own greedy output
    assert result["identical"] and result["tokens"] == result["vanilla_tokens"]
    assert 0 < len(result["tokens"]) <= 40 and result["tau"] >= 1.0
    text = tiny_tokenizer.decode(result["tokens"], skip_special_tokens=True)
    assert result["text"] == text
    printed = out.getvalue()
    assert printed.startswith(text + "\n")
    assert "tau" in printed and "identical to the target's own greedy output" in printed
    # the tiny EAGLE-3 head's (test_cli_streams_to_stdout checks the printed line)
    assert result["head_draft_vocab_size"] == 128


def test_adaptive_tree_decodes_exactly_and_reports_its_sizes(head_dir: Path) -> None:
    out = io.StringIO()
    adaptive = overrides(head_dir, "generate.compare=true", "tree.adaptive=true")
    result = generate.run(compose(adaptive), out=out)
    assert result["identical"] and 1.0 <= result["nodes_per_forward"] <= 16.0
    assert f"adaptive: {result['nodes_per_forward']:.1f} nodes per forward" in out.getvalue()


def test_sampled_decoding_is_seeded(head_dir: Path) -> None:
    sampled = overrides(head_dir, "generate.temperature=0.8", "generate.top_p=0.9")
    first = generate.run(compose(sampled), out=io.StringIO())
    again = generate.run(compose(sampled), out=io.StringIO())
    assert first["tokens"] == again["tokens"] and "identical" not in first


def test_prompt_from_stdin(head_dir: Path, monkeypatch) -> None:
    given = generate.run(compose(overrides(head_dir)), out=io.StringIO())
    monkeypatch.setattr("sys.stdin", io.StringIO("Count to twenty, please.\n"))
    piped = generate.run(compose([*overrides(head_dir), "generate.prompt=-"]), out=io.StringIO())
    assert piped["tokens"] == given["tokens"]


def test_bad_settings_are_refused(head_dir: Path) -> None:
    with pytest.raises(ValueError, match="generate.prompt is empty"):
        generate.run(compose([*overrides(head_dir), "generate.prompt= "]))
    with pytest.raises(ValueError, match="generate.max_new_tokens=0"):
        compose([*overrides(head_dir), "generate.max_new_tokens=0"])
    # a tree that cannot verify drawn children exactly is refused before the target loads (a
    # target that is not there: its error would come first otherwise)
    drawn = ["target.path=/nonexistent/target", "tree.adaptive=true", "generate.temperature=1"]
    with pytest.raises(ValueError, match="tree.adaptive=true sizes each tree"):
        generate.run(compose([*overrides(head_dir), *drawn]))


def test_text_stream_holds_back_a_split_character(tiny_tokenizer) -> None:
    """A multi-byte character arriving over two chunks is printed once, whole."""
    ids = tiny_tokenizer.encode("né", add_special_tokens=False)
    assert len(ids) >= 3  # a byte tokenizer: "é" is two tokens
    out = io.StringIO()
    stream = generate.TextStream(tiny_tokenizer, out)
    for token in ids:
        stream([token])
    stream.end()
    assert out.getvalue() == "né\n"


def test_cli_streams_to_stdout(head_dir: Path, tmp_path: Path, capsys) -> None:
    """Through the `draftsmith` dispatcher and Hydra: the quoted prompt arrives whole."""
    from draftsmith.cli import main

    assert main(["generate", f"runs_dir={tmp_path}/runs", *overrides(head_dir)]) == 0
    out = capsys.readouterr().out
    said = "verification forwards (eagle3 head with its own 128-token draft vocabulary,"
    assert f"{said} dynamic tree, float32)" in out


def test_a_divergence_is_located() -> None:
    assert "at token 2 (bfloat16: a near-tie" in generate._agreement(
        [1, 2, 3], [1, 2, 4], "bfloat16"
    )
    assert "at token 2 (in float32 this is a bug" in generate._agreement(
        [1, 2], [1, 2, 3], "float32"
    )


def test_stops_on_every_stop_id_the_checkpoint_lists(head_dir: Path, make_tiny) -> None:
    """A generation config listing a second stop id (as Llama-3 instruct checkpoints do) ends
    the speculative output and the target's own at its first occurrence, identically."""
    import json

    folder = make_tiny()
    cfg = [*overrides(head_dir, "generate.compare=true"), f"target.path={folder}"]
    full = generate.run(compose(cfg), out=io.StringIO())["tokens"]
    stop = full[len(full) // 2]  # a token the target emits mid-reply
    first = full.index(stop)
    settings = json.loads((folder / "config.json").read_text())
    ids = {k: settings[k] for k in ("bos_token_id", "pad_token_id")}
    ids["eos_token_id"] = [settings["eos_token_id"], stop]
    (folder / "generation_config.json").write_text(json.dumps(ids))
    result = generate.run(compose(cfg), out=io.StringIO())
    assert result["tokens"] == result["vanilla_tokens"] == full[: first + 1]


def test_a_system_message_comes_before_the_prompt(head_dir: Path, tiny_tokenizer) -> None:
    """generate.system is the chat's system turn, ahead of the prompt."""
    result = generate.run(
        compose(overrides(head_dir, "generate.system='Answer in French.'")), out=io.StringIO()
    )
    prompt = tiny_tokenizer.decode(result["prompt"])
    assert prompt.startswith("<|im_start|>system\nAnswer in French.<|im_end|>\n<|im_start|>user")


TOOLS_CHATML = (
    "{% if tools %}{{ '<|im_start|>system\n<tools>' + (tools | tojson) + '</tools><|im_end|>\n' }}"
    "{% endif %}{% for m in messages %}"
    "{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_tools_reach_the_prompt_or_are_refused(
    head_dir: Path, tiny_tokenizer, tmp_path: Path
) -> None:
    """generate.tools (a JSON file or text) is rendered by a template that writes tools; a
    template that leaves them out, text that is not a list of schemas, or a missing file, is an
    error naming it."""
    import json

    schema = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([schema]))
    template = tmp_path / "tools.jinja"
    template.write_text(TOOLS_CHATML)
    cfg = overrides(head_dir, f"generate.tools={tools}", f"target.chat_template={template}")
    result = generate.run(compose(cfg), out=io.StringIO())
    prompt = tiny_tokenizer.decode(result["prompt"])
    assert prompt.startswith('<|im_start|>system\n<tools>[{"type": "function"')
    with pytest.raises(ValueError, match="generate.tools=.*does not render tools"):
        generate.run(compose(overrides(head_dir, f"generate.tools={tools}")), out=io.StringIO())
    # the JSON text itself, however long (a path of over 255 bytes is no file name)
    many = json.dumps([schema] * 8)
    (tmp_path / "many.json").write_text(many)
    for value in (f"'{many}'", tmp_path / "many.json"):
        result = generate.run(
            compose([*cfg[:-2], f"generate.tools={value}", cfg[-1]]), out=io.StringIO()
        )
        assert tiny_tokenizer.decode(result["prompt"]).count("get_weather") == 8
    with pytest.raises(ValueError, match="generate.tools=.*not a list of objects"):
        generate.run(compose([*cfg[:-2], "generate.tools='{\"a\": 1}'"]), out=io.StringIO())
    with pytest.raises(FileNotFoundError, match="generate.tools='nope.json': no such file"):
        generate.run(compose([*cfg[:-2], "generate.tools=nope.json"]), out=io.StringIO())
