"""`draftsmith eval` on a benchmark file whose rows name a category: tau per prompt and per
category, consistent with the overall tau."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import pytest

from draftsmith.config import Config, compose
from draftsmith.inference import eval as evaluate
from draftsmith.inference.prompts import benchmark_source
from draftsmith.inference.report import output_tau


def _benchmark(path: Path, rows: list[tuple[str, str]]) -> Path:
    """A question.jsonl of (category, first turn) rows, each with the second turn "And then?"."""
    path.write_text(
        "".join(
            json.dumps({"question_id": i, "category": c, "turns": [t, "And then?"]}) + "\n"
            for i, (c, t) in enumerate(rows)
        )
    )
    return path


def _tiny_eval(tmp_path: Path, head_dir: Path, bench: Path, *extra: str) -> list[str]:
    """Overrides evaluating the untrained head on the tiny target in fp32."""
    return [
        f"runs_dir={tmp_path}/runs",
        "target=tiny-random-llama",
        "dtype=float32",
        f"head_path={head_dir}",
        "tree.depth=3",
        "tree.lookup=3",  # an untrained head drafts little; the lookup branch lifts tau off 1
        f"eval.benchmark={bench}",
        "tracking=none",
        *extra,
    ]


def test_tau_by_category(tmp_path: Path, head_dir: Path) -> None:
    """Also what `tracking=tensorboard` writes beside the results."""
    rows = [("writing", "Write a poem about rain."), ("math", "What is 12 times 7?")]
    rows.append(("writing", "Describe a sunrise in two sentences."))
    bench = _benchmark(tmp_path / "question.jsonl", rows)
    overrides = _tiny_eval(tmp_path, head_dir, bench, "eval.max_new_tokens=24", "eval.baselines=[]")
    overrides[overrides.index("tracking=none")] = "tracking=tensorboard"
    r = evaluate.run(compose(overrides))
    assert [p["category"] for p in r["per_prompt"]] == ["writing", "math", "writing"]
    assert {k: c["prompts"] for k, c in r["by_category"].items()} == {"math": 1, "writing": 2}
    # each category's tau is its prompts' verified tokens over their forwards; together the overall
    per = r["per_prompt"]
    assert sum(p["forwards"] for p in per) == r["verify_forwards"]
    assert sum(p["tokens"] for p in per) == r["tokens"]["speculative"]
    writing = [p for p in per if p["category"] == "writing"]
    verified = sum(p["tau"] * p["forwards"] for p in writing)
    forwards = sum(p["forwards"] for p in writing)
    assert r["by_category"]["writing"]["tau"] == pytest.approx(verified / forwards, abs=1e-9)
    assert r["tau"] > 1.0
    # the output's tokens per forward, as archived results without the key are read from their
    # prompts' records (each prompt's first token is its prefill's)
    older = {k: v for k, v in r.items() if k != "tau_output"}
    assert output_tau(older) == pytest.approx(r["tau_output"]) and r["tau_output"] <= r["tau"]
    (report,) = (tmp_path / "runs").glob("*/eval/*/results.md")
    assert f"({r['tau_output']:.2f} output tokens per forward)" in report.read_text()
    out = report.parent
    assert "tau by category: math" in (out / "results.md").read_text()
    assert (out / "tau_by_category.png").stat().st_size > 5_000
    # tracking=tensorboard: the results' numbers as scalars beside them
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard")).Reload()
    assert events.Scalars("tau")[0].value == pytest.approx(r["tau"])
    math = r["by_category"]["math"]["tau"]
    assert events.Scalars("tau_by_category/math")[0].value == pytest.approx(math)


def test_benchmark_rows_that_are_not_prompts_are_reported(
    tmp_path: Path, head_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    """A benchmark row that is not JSON or has no user turn is skipped, named in what the eval
    prints and counted in its results: the prompts decoded are never fewer unseen."""
    bench = _benchmark(tmp_path / "question.jsonl", [("math", "What is 12 times 7?")])
    system_only = {"id": "q-sys", "messages": [{"role": "system", "content": "Be brief."}]}
    with bench.open("a") as f:
        f.write("{not json\n" + json.dumps(system_only) + "\n")
    overrides = _tiny_eval(tmp_path, head_dir, bench, "eval.max_new_tokens=4", "eval.baselines=[]")
    r = evaluate.run(compose(overrides))
    assert r["prompts"] == 1
    assert r["skipped"] == {"invalid JSON": 1, "no user turn": 1}
    printed = capsys.readouterr().out
    assert "kept 1/3 rows" in printed and "line 2: invalid JSON" in printed
    assert "line 3 (id q-sys): no user turn" in printed
    (report,) = (tmp_path / "runs").glob("*/eval/*/results.md")
    assert "Benchmark rows skipped: {'invalid JSON': 1, 'no user turn': 1}" in report.read_text()


def test_all_turns_follow_each_methods_own_answers(
    tmp_path: Path, head_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """eval.turns=all decodes the second turns after the first answers, losslessly (fp32)."""
    texts = ["Write a poem about rain.", "What is 12 times 7?"]
    bench = _benchmark(tmp_path / "question.jsonl", [("c", t) for t in texts])
    seen: list[tuple[list[int], list[int]]] = []  # (prompt, output) of each speculative decode
    generate = evaluate.SpecDecoder.generate

    def recording(self, prompt, *args, **kwargs):
        out, stats = generate(self, prompt, *args, **kwargs)
        seen.append((prompt, out))
        return out, stats

    monkeypatch.setattr(evaluate.SpecDecoder, "generate", recording)
    overrides = _tiny_eval(
        tmp_path, head_dir, bench, "eval.max_new_tokens=16", "eval.baselines=[vanilla]"
    )
    r = evaluate.run(compose([*overrides, "eval.turns=all"]))
    assert r["prompts"] == 4 and r["conversations"] == 2
    assert [p["turn"] for p in r["per_prompt"]] == [0, 1, 0, 1]
    assert r["mismatch"] == {
        "checked": True,
        "prompts": 0,
        "compared": 4,
        "rate": 0.0,
        "details": [],
    }
    from draftsmith.target import load_tokenizer

    tokenizer = load_tokenizer("tiny-random-llama")
    for (first, answer), (second, _) in (seen[:2], seen[2:]):
        text = tokenizer.decode(second)
        assert tokenizer.decode(first) in text  # the first turn's prompt, as it was
        assert tokenizer.decode(answer, skip_special_tokens=True) in text
        assert text.count("And then?") == 1
    assert list((tmp_path / "runs").glob("*/eval/*-allturns-*/results.md"))


def test_workers_decode_what_one_process_does(tmp_path: Path, head_dir: Path) -> None:
    """eval.workers=2 (this process and a spawned one, every other conversation each) gives the
    results of one process: every prompt is seeded by its index, so even sampled decoding and
    later turns match, and the records come back in benchmark order. Evals with baselines keep
    one process."""
    texts = ["Write a poem about rain.", "What is 12 times 7?", "Name three colours."]
    bench = _benchmark(tmp_path / "question.jsonl", [(f"c{i % 2}", t) for i, t in enumerate(texts)])
    overrides = _tiny_eval(
        tmp_path, head_dir, bench, "eval.max_new_tokens=16", "eval.turns=all", "eval.temperature=1"
    )
    one = evaluate.evaluate(compose([*overrides, "eval.baselines=[]"]))["default"]
    two = evaluate.evaluate(compose([*overrides, "eval.baselines=[]", "eval.workers=2"]))["default"]
    assert [p["turn"] for p in two["per_prompt"]] == [0, 1] * 3
    keys = ("per_prompt", "by_category", "tau", "depth_acceptance", "prompts", "tokens")
    assert {k: two[k] for k in keys} == {k: one[k] for k in keys}
    assert two["verify_forwards"] == one["verify_forwards"] > 6
    assert (one["workers"], two["workers"]) == (1, 2)
    # with a baseline the methods decode interleaved in one process, whatever eval.workers says
    timed = [*overrides, "eval.baselines=[vanilla]", "eval.workers=2", "eval.limit=1"]
    assert evaluate.evaluate(compose(timed))["default"]["workers"] == 1


def _finish_later(cfg: Config, shard: int) -> dict:
    """A spawned worker whose share takes a few seconds, then leaves a mark that it finished."""
    time.sleep(3)
    Path(cfg.runs_dir).mkdir(parents=True, exist_ok=True)
    Path(cfg.runs_dir, f"worker{shard}.done").write_text("finished")
    return {}


def test_a_failing_eval_stops_its_workers(
    tmp_path: Path, head_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When this process fails mid-eval, eval.workers' spawned process is stopped, not waited
    for: the error comes back before the worker's share is done, and no worker is left."""
    bench = _benchmark(tmp_path / "question.jsonl", [("c", "Write a poem about rain.")] * 2)
    overrides = _tiny_eval(tmp_path, head_dir, bench, "eval.baselines=[]", "eval.workers=2")

    def fail(cfg: Config, shard: int = 0) -> evaluate._Pass:
        raise RuntimeError("this process failed")

    monkeypatch.setattr(evaluate, "_decode", fail)  # this process only: the worker is spawned
    monkeypatch.setattr(evaluate, "_worker", _finish_later)
    with pytest.raises(RuntimeError, match="this process failed"):
        evaluate.evaluate(compose(overrides))
    assert multiprocessing.active_children() == []
    assert not list((tmp_path / "runs").glob("worker*.done"))


def test_a_greedy_mismatch_records_where_and_the_targets_top2_gap(tiny_target) -> None:
    """The record of an output that left vanilla greedy decoding: the first differing position
    and the gap between the target's top-2 logits there (what tells a near-tie in bf16 from a
    verification bug); an output that only ran longer has no gap to report."""
    import torch

    prompt, ref = [5, 6, 7], [10, 11, 12, 13, 14]
    out = [10, 11, 99, 13, 14]
    record = evaluate._mismatch(tiny_target, prompt, out, ref, index=4, turn=1)
    with torch.no_grad():
        logits = tiny_target(torch.tensor([prompt + ref[:2]])).logits[0, -1].float()
    top = logits.topk(2).values
    assert record == {
        "prompt": 4,
        "turn": 1,
        "first_divergence": 2,
        "top2_gap": pytest.approx(float(top[0] - top[1])),
    }
    longer = evaluate._mismatch(tiny_target, prompt, ref + [15], ref, index=0, turn=0)
    assert longer["first_divergence"] == 5 and longer["top2_gap"] is None


def test_greedy_turns_are_compared_until_a_prompt_differs(tiny_target) -> None:
    """A head's turns count against vanilla's while both answered the same prompt: a differing
    answer is recorded, and no later turn (asked after a different answer) is compared."""
    head = evaluate._Contender(run="r", head_path="h", decoder=None, draft_vocab=0)
    same, other = [5, 6, 7], [5, 6, 8]
    vanilla = [(same, [1, 2]), (same, [3]), (same + [9], [4]), (same, [5])]
    mine = [(same, [1, 2]), (same, [3, 3]), (other, [4]), (same, [6])]
    head.compare(tiny_target, mine, vanilla, index=7)
    assert head.compared == 2
    assert [(m["prompt"], m["turn"], m["first_divergence"]) for m in head.mismatches] == [(7, 1, 1)]


def test_a_target_without_a_template_is_prompted_as_its_data_was_rendered(
    tmp_path: Path, head_dir: Path, make_tiny, monkeypatch
) -> None:
    """data.template=plain (a base model without a chat template): eval and generate prompt it
    in the "Role: text" lines prepare rendered its data in, where they failed in transformers'
    apply_chat_template; its results go to their own folder."""
    import io

    from draftsmith.inference import generate

    prompts = []

    def recording(real):
        def wrapper(*args):
            prompts.append(real(*args))
            return prompts[-1]

        return wrapper

    monkeypatch.setattr(evaluate, "chat_prompt", recording(evaluate.chat_prompt))
    monkeypatch.setattr(generate, "chat_prompt", recording(generate.chat_prompt))
    base = make_tiny(chat_template=None)  # the tiny target's weights and tokens, no template
    bench = _benchmark(tmp_path / "question.jsonl", [("math", "What is 12 times 7?")])
    overrides = _tiny_eval(tmp_path, head_dir, bench, f"target.path={base}", "data.template=plain")
    r = evaluate.run(compose([*overrides, "eval.baselines=[vanilla]", "eval.max_new_tokens=8"]))
    assert r["mismatch"]["checked"] and r["mismatch"]["prompts"] == 0
    assert list(Path(tmp_path, "runs/default/eval").glob("question-*-plain-*/results.json"))
    generate.run(
        compose([*overrides, "generate.prompt=hi", "generate.max_new_tokens=4"]), out=io.StringIO()
    )
    from draftsmith.target import load_tokenizer

    tokenizer = load_tokenizer(str(base))
    # eval renders the prompt once per method
    assert list(dict.fromkeys(tokenizer.decode(p) for p in prompts)) == [
        "User: What is 12 times 7?\nAssistant: ",
        "User: hi\nAssistant: ",
    ]


def test_preformatted_held_out_rows_are_prompted_up_to_their_first_reply(
    tmp_path: Path, head_dir: Path, monkeypatch
) -> None:
    """data.preformatted: eval.benchmark=heldout decodes a rendered row from its text through
    the first reply header, the prompt its conversation's first turn renders to, so both
    decode alike."""
    from draftsmith.target import load_tokenizer
    from draftsmith.tokenize import ConversationTokenizer
    from draftsmith.train import prepare

    tokenizer = load_tokenizer("tiny-random-llama")
    renderer = ConversationTokenizer(tokenizer)
    chats = [
        [{"role": "user", "content": f"Count to {i}."}, {"role": "assistant", "content": "1 2"}]
        for i in range(6)
    ]
    texts, rows = tmp_path / "texts.jsonl", tmp_path / "chats.jsonl"
    texts.write_text(
        "".join(
            json.dumps({"id": str(i), "text": renderer.render(m)}) + "\n"
            for i, m in enumerate(chats)
        )
    )
    rows.write_text(
        "".join(json.dumps({"id": str(i), "messages": m}) + "\n" for i, m in enumerate(chats))
    )
    read, real = [], evaluate.user_turns

    def recording(*args):
        out = real(*args)
        read.append(out[0])  # each held-out row's turns, as eval reads them
        return out

    monkeypatch.setattr(evaluate, "user_turns", recording)
    results = {}
    for run, path, extra in (("t", texts, ["data.preformatted=true"]), ("c", rows, [])):
        common = [*_tiny_eval(tmp_path, head_dir, "heldout", *extra), f"run_name={run}"]
        prepare.run(compose([*common, f"data.path={path}", "data.heldout=2"]))
        evals = ["eval.baselines=[vanilla]", "eval.max_new_tokens=8"]
        results[run] = evaluate.run(compose([*common, f"data.path={path}", *evals]))
    assert results["t"]["mismatch"]["checked"] and results["t"]["mismatch"]["prompts"] == 0
    assert results["t"]["per_prompt"] == results["c"]["per_prompt"]
    assert [t[0] for t in read[0]] == [
        tokenizer.decode(evaluate.chat_prompt(tokenizer, t[0])) for t in read[1]
    ]


def test_preformatted_benchmark_row_without_a_reply_is_skipped_by_name(tmp_path: Path) -> None:
    """data.preformatted: a rendered benchmark row with no reply to prompt for is skipped with
    prepare's reason, named by its line; the others are prompted up to their first reply."""
    from draftsmith.target import load_tokenizer
    from draftsmith.tokenize import ConversationTokenizer

    renderer = ConversationTokenizer(load_tokenizer("tiny-random-llama"))
    chat = [{"role": "user", "content": "Count to 3."}, {"role": "assistant", "content": "1 2 3"}]
    path = tmp_path / "bench.jsonl"
    rows = [{"text": renderer.render(chat)}, {"text": "no template here"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    turns, _, settings, report = evaluate.user_turns(str(path), None, renderer)
    assert turns == [[renderer.render(chat[:1]) + "<|im_start|>assistant\n"]]
    assert settings[0].rendered and report.rows_kept == 1
    assert report.skipped == {"no assistant turn": 1}
    assert report.examples[0].startswith("line 2: no assistant turn: the text holds no")


def test_chat_template_kwargs_reach_every_rendering(tmp_path: Path, head_dir: Path, monkeypatch):
    """target.chat_template_kwargs reach the renderings of prepare (loss masks, regeneration
    prompts), eval (every turn's prompt) and generate."""
    import io

    from draftsmith.inference import generate
    from draftsmith.train import prepare

    seen = []

    def recording(stage: str, real):
        def wrapper(*args):
            seen.append((stage, args[3]))  # chat_prompt(tokenizer, text, history, kwargs)
            return real(*args)

        return wrapper

    monkeypatch.setattr(evaluate, "chat_prompt", recording("eval", evaluate.chat_prompt))
    monkeypatch.setattr(generate, "chat_prompt", recording("generate", generate.chat_prompt))
    renderer = prepare.ConversationTokenizer
    monkeypatch.setattr(
        prepare,
        "ConversationTokenizer",
        lambda *a: seen.append(("prepare", a[4])) or renderer(*a),
    )
    kwargs = "+target.chat_template_kwargs.enable_thinking=false"
    bench = _benchmark(tmp_path / "question.jsonl", [("math", "What is 12 times 7?")])
    overrides = _tiny_eval(tmp_path, head_dir, bench, "eval.max_new_tokens=4", kwargs)
    r = evaluate.run(compose([*overrides, "eval.baselines=[]", "eval.turns=all"]))
    assert r["chat_template_kwargs"] == {"enable_thinking": False}
    tag = (
        "question-*-dynamic-d3-k4-n16-lookup3-allturns-enable_thinking=False-new4-head*-T0-float32"
    )
    assert list(Path(tmp_path, "runs/default/eval").glob(f"{tag}/results.json"))
    generate.run(
        compose([*overrides, "generate.prompt=hi", "generate.max_new_tokens=4"]), out=io.StringIO()
    )
    chats = tmp_path / "chats.jsonl"
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    chats.write_text(f"{json.dumps(chat)}\n" * 3)
    prepare.run(compose([*overrides, f"data.path={chats}"]))
    off = {"enable_thinking": False}
    # eval's two turns, generate's prompt, prepare's renderer
    assert seen == [("eval", off), ("eval", off), ("generate", off), ("prepare", off)]


def test_a_conversations_system_turns_and_tools_reach_its_prompts(
    tmp_path: Path, head_dir: Path, monkeypatch
) -> None:
    """Every prompt of a benchmark conversation starts with its system turns and carries its
    tools, later turns after the method's own answers."""
    seen = []
    real = evaluate.chat_prompt

    def recording(tokenizer, text, history, kwargs, tools, template):
        seen.append((text, list(history), tools))
        return real(tokenizer, text, history, kwargs, tools, template)

    monkeypatch.setattr(evaluate, "chat_prompt", recording)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    system = {"role": "system", "content": "Be brief."}
    turns = [system, {"role": "user", "content": "Weather?"}, {"role": "user", "content": "More?"}]
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"id": "s", "tools": tools, "messages": turns}) + "\n")
    overrides = _tiny_eval(tmp_path, head_dir, bench, "eval.max_new_tokens=4")
    evaluate.run(compose([*overrides, "eval.baselines=[]", "eval.turns=all"]))
    (first, history, tools_first), (second, later, tools_second) = seen
    assert (first, history, tools_first) == ("Weather?", [system], tools)
    assert second == "More?" and tools_second == tools
    assert [m["role"] for m in later] == ["system", "user", "assistant"]


# ChatML that writes tool calls (the tiny target's own, as SmolLM2's, leaves them out)
TOOL_CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content }}"
    "{% for c in m.tool_calls or [] %}{{ '<tool_call>' + (c.function | tojson) + '</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_a_chat_template_of_ones_own_reaches_every_rendering(
    tmp_path: Path, head_dir: Path, monkeypatch
) -> None:
    """target.chat_template (a file, or the text itself) replaces the tokenizer's template in
    prepare (tool calls the target's own template drops are then learned), eval and generate;
    eval names it in its folder and results."""
    import io

    from draftsmith.inference import generate
    from draftsmith.target import chat_template_digest, load_tokenizer
    from draftsmith.train import prepare

    template = tmp_path / "tools.jinja"
    template.write_text(TOOL_CHATML)
    call = {"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    tool_chat = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "22C"},
        {"role": "assistant", "content": "22C."},
    ]
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        "".join(json.dumps({"id": f"t{i}", "messages": tool_chat}) + "\n" for i in range(4))
    )
    bench = _benchmark(tmp_path / "question.jsonl", [("math", "What is 12 times 7?")])
    overrides = _tiny_eval(tmp_path, head_dir, bench, "eval.max_new_tokens=4", f"data.path={chats}")
    with pytest.raises(ValueError, match="template does not render tool calls"):
        prepare.run(compose(overrides))  # the tiny target's own template: every row skipped
    overrides.append(f"target.chat_template={template}")
    stats = prepare.run(compose(overrides))
    assert stats["skipped"] == {} and stats["rows"]["train"] == 3
    tokenizer = load_tokenizer("tiny-random-llama", chat_template=TOOL_CHATML)
    assert tokenizer.chat_template == TOOL_CHATML
    with pytest.raises(FileNotFoundError, match="target.chat_template='nowhere.jinja'"):
        load_tokenizer("tiny-random-llama", chat_template="nowhere.jinja")
    train = __import__("datasets").load_from_disk(str(tmp_path / "runs/default/prepare/dataset"))
    row = train["train"][0]
    masked = tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
    assert masked == (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        "<|im_end|>\n22C.<|im_end|>\n"
    )

    seen = []

    def recording(stage: str, real):
        def wrapper(tokenizer, *args):
            seen.append((stage, tokenizer.chat_template))
            return real(tokenizer, *args)

        return wrapper

    monkeypatch.setattr(evaluate, "chat_prompt", recording("eval", evaluate.chat_prompt))
    monkeypatch.setattr(generate, "chat_prompt", recording("generate", generate.chat_prompt))
    r = evaluate.run(compose([*overrides, "eval.baselines=[]"]))
    digest = chat_template_digest(str(template))
    assert r["chat_template"] == digest == chat_template_digest(TOOL_CHATML)
    tag = f"question-*-dynamic-d3-k4-n16-lookup3-template{digest}-new4-head*-T0-float32"
    assert list(Path(tmp_path, "runs/default/eval").glob(f"{tag}/results.json"))
    generate.run(
        compose([*overrides, "generate.prompt=hi", "generate.max_new_tokens=4"]), out=io.StringIO()
    )
    assert seen == [("eval", TOOL_CHATML), ("generate", TOOL_CHATML)]
    # regeneration chunks are named by it
    named = []
    regenerate = prepare.regenerate
    monkeypatch.setattr(prepare, "regenerate", lambda *a: named.append(a[-1]) or regenerate(*a))
    regen = ["run_name=regen", "data.regenerate=true", "data.regen.max_new_tokens=4"]
    prepare.run(compose([*overrides, *regen]))
    assert named == [digest, digest]  # the held-out and training splits


def test_a_missing_heldout_benchmark_names_the_run_that_prepares_it(tmp_path: Path) -> None:
    """With inputs_from, the held-out conversations are that run's to prepare."""
    cfg = compose([f"runs_dir={tmp_path}", "run_name=a", "inputs_from=b", "eval.benchmark=heldout"])
    with pytest.raises(
        FileNotFoundError, match="b/prepare/heldout.jsonl: run `draftsmith prepare run_name=b`"
    ):
        benchmark_source(cfg)


def test_a_tree_inexact_at_the_temperature_is_refused_before_the_target_loads(
    tmp_path: Path, head_dir: Path
) -> None:
    bench = _benchmark(tmp_path / "q.jsonl", [("writing", "Hi")])
    drawn = ["target.path=/nonexistent/target", "eval.temperature=1", "tree.verify=traversal"]
    cfg = compose(_tiny_eval(tmp_path, head_dir, bench, *drawn))
    with pytest.raises(ValueError, match="tree.verify=traversal decides whole subtrees"):
        evaluate.run(cfg)
