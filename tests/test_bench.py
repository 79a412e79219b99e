"""The benchmark scripts run end to end (on the tiny target: what they print is not checked, only
that they measure every method and write their JSON)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch

from draftsmith.packed import packing_available
from draftsmith.tiny import TINY_NAME

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_bench_verify_times_every_tree_size_and_a_vanilla_step(tmp_path: Path) -> None:
    args = ["--target", TINY_NAME, "--dtype", "float32", "--sizes", "1", "4", "--context", "20"]
    args += ["--rounds", "2", "--out", str(tmp_path)]
    subprocess.run([sys.executable, str(SCRIPTS / "bench_verify.py"), *args], check=True)
    result = json.loads((tmp_path / "results.json").read_text())
    forwards = {"vanilla", "tree 1", "tree 4"}
    # both copies of the target are timed; fp32 linears are packed wherever oneDNN is built in
    assert set(result["median_ms"]) == {f"{m} {f}" for m in ("plain", "packed") for f in forwards}
    assert (result["packed_linears"] > 0) == packing_available(torch.float32)
    assert all(len(ms) == 2 and min(ms) > 0 for ms in result["ms"].values())
    assert "| tree 4 |" in (tmp_path / "results.md").read_text()


def test_bench_oracle_reads_tau_ceilings_off_the_target(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"count to {i}"}]} for i in range(2)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--target", TINY_NAME, "--dtype", "float32", "--benchmark", str(prompts)]
    args += ["--prompts", "2", "--max-new-tokens", "12", "--every", "4", "--depth", "3"]
    args += ["--top-k", "3", "--total-tokens", "1", "4", "10", "--out", str(tmp_path / "out")]
    subprocess.run([sys.executable, str(SCRIPTS / "bench_oracle.py"), *args], check=True)
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    tau = {int(n): t for n, t in result["oracle_tau"].items()}
    assert result["steps"] >= 4
    # a root alone accepts nothing; more nodes of the same tree never lower the expectation,
    # and no tree of depth 3 can beat 4
    assert tau[1] == 1.0 and 1.0 < tau[4] <= tau[10] < 4.0, tau


def test_bench_data_times_collection_and_regeneration(tmp_path: Path) -> None:
    """Collection against the plain forward and regeneration in every engine, on any
    conversations (`--data`); it had called the feature extraction with a padding mask."""
    chats = tmp_path / "chats.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"count to {i}"},
                {"role": "assistant", "content": "1 2 3"},
            ]
        }
        for i in range(6)
    ]
    chats.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--target", TINY_NAME, "--dtype", "float32", "--data", str(chats), "--rows", "6"]
    args += ["--regen-batch", "2", "--regen-tokens", "6", "--out", str(tmp_path / "out")]
    subprocess.run([sys.executable, str(SCRIPTS / "bench_data.py"), *args], check=True)
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    assert result["plain_forward_tokens_per_second"] > 0 < result["collect_tokens_per_second"]
    regen = ("batched", "batch1", "hf_generate", "continuous")
    assert all(result[f"regen_tokens_per_second_{k}"] > 0 for k in regen)


def test_bench_draft_times_the_drafting_modes(tmp_path: Path, head_dir: Path) -> None:
    """The modes asked for, and eager to compare them with; its random prompt had ids past a
    small vocabulary."""
    args = ["--head", str(head_dir), "--target", TINY_NAME, "--dtype", "float32", "--steps", "2"]
    args += ["--rounds", "2", "--modes", "packed", "--out", str(tmp_path)]
    subprocess.run([sys.executable, str(SCRIPTS / "bench_draft.py"), *args], check=True)
    result = json.loads((tmp_path / "results.json").read_text())
    assert all(result[mode]["ms_per_step"] > 0 for mode in ("eager", "packed"))
    assert "layer" not in result


def test_bench_first_draft_counts_ranks_and_vocabulary_coverage(
    tmp_path: Path, head_dir: Path
) -> None:
    """Every answer token after the first lands in one bucket; the share outside the vocabulary
    is the head's own vocabulary's, and a vocabulary of every token covers all of them."""
    from pipeline import tiny_run

    from draftsmith.heads import TargetInfo, load_head
    from draftsmith.target import load_config

    tiny_run(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"count to {i}"}]} for i in range(2)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    vocab_size = load_config(TINY_NAME).vocab_size
    args = ["--head", str(head_dir), "--prepared", str(tmp_path / "runs/t/prepare")]
    args += ["--target", TINY_NAME, "--dtype", "float32", "--benchmark", str(prompts)]
    args += ["--prompts", "2", "--max-new-tokens", "12", "--sizes", "8", str(vocab_size)]
    args += ["--out", str(tmp_path / "out")]
    subprocess.run([sys.executable, str(SCRIPTS / "bench_first_draft.py"), *args], check=True)
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    answers = result["answers"]
    assert result["tokens"] == len(result["ranks"]) == sum(len(a) - 1 for a in answers) > 10
    assert abs(sum(result["shares"].values()) - 1.0) < 1e-9
    head = load_head(str(head_dir), TargetInfo.from_hf_config(load_config(TINY_NAME)))
    outside = sum(not bool(head.t2d[t]) for a in answers for t in a[1:])
    assert result["shares"]["outside vocabulary"] == outside / result["tokens"]
    assert result["ranks"].count(0) == outside
    coverage = {int(n): c for n, c in result["vocab_coverage"].items()}
    assert coverage[vocab_size] == 1.0 and coverage[8] < 1.0
    assert "| rank 1 |" in (tmp_path / "out" / "results.md").read_text()
    assert (tmp_path / "out" / "first_draft.png").read_bytes().startswith(b"\x89PNG")


def test_first_drafts_are_the_heads_over_the_whole_answer(
    tiny_target, head_dir: Path, monkeypatch
) -> None:
    """Committing an answer one accepted token at a time, as the decoder does, ranks each token
    and overlaps the head's law with the target's as the head's one causal pass over the whole
    sequence does."""
    from draftsmith.features import FeatureCapture
    from draftsmith.heads import TargetInfo, TargetParts, load_head
    from draftsmith.inference.drafter import make_drafter
    from draftsmith.inference.verify import Sampling

    bench = _script("bench_first_draft", monkeypatch)
    info = TargetInfo.from_hf_config(tiny_target.config)
    head = load_head(str(head_dir), info).bind(TargetParts.from_model(tiny_target)).eval()
    vocab = head.t2d.nonzero().flatten()  # [Vd] target ids, in draft-id order
    prompt, answer = [1, 40, 41, 42, 43], [int(vocab[i]) for i in (3, 7, 3, 11, 0, 5)]
    answer[2] = int((~head.t2d).nonzero()[0])  # one token outside the draft vocabulary
    aux_layers, sampling = head.config.aux_layers, Sampling(temperature=0.7)
    drafts = bench.first_drafts(
        tiny_target, make_drafter(head), aux_layers, prompt, answer, sampling
    )
    ids = torch.tensor([prompt + answer])  # [1, S]
    with torch.no_grad(), FeatureCapture(tiny_target, aux_layers) as capture:
        target_logits = tiny_target(input_ids=ids).logits[0]  # [S, V]
        S = ids.shape[1]
        out = head.step(  # pair j: feature j with token j+1, predicting token j+2
            head.feature_input(capture.hidden, capture.aux)[:, : S - 1],
            ids[:, 1:],
            torch.arange(S - 1)[None],
            head.new_cache(),
        )
        logits = head.draft_logits(out)[0].float()  # [S-1, Vd]
    ranks, overlaps = [], []
    for k in range(1, len(answer)):
        row, token = logits[len(prompt) + k - 2], answer[k]
        d = int(head.t2d[: token + 1].sum()) - 1 if head.t2d[token] else -1
        ranks.append(0 if d < 0 else int((row > row[d]).sum()) + 1)
        p = sampling.probs(target_logits[len(prompt) + k - 1][None])[0]  # [V]
        q = torch.zeros_like(p).index_copy(0, vocab, torch.softmax(row, -1))  # [V]
        overlaps.append(float(torch.minimum(p, q).sum()))
        assert abs(drafts.inside[k - 1] - float(p[vocab].sum())) < 1e-5
    assert drafts.ranks == ranks and 0 in ranks and any(r > 1 for r in ranks)
    torch.testing.assert_close(torch.tensor(drafts.overlap), torch.tensor(overlaps))
    assert all(o <= i + 1e-6 for o, i in zip(drafts.overlap, drafts.inside))


def test_bench_train_times_every_head(tmp_path: Path) -> None:
    from pipeline import tiny_run

    tiny_run(tmp_path)
    args = ["--collect", str(tmp_path / "runs/t/collect"), "--target", TINY_NAME]
    args += ["--dtype", "float32", "--batch", "2", "--steps", "1", "--out", str(tmp_path / "o")]
    subprocess.run([sys.executable, str(SCRIPTS / "bench_train.py"), *args], check=True)
    result = json.loads((tmp_path / "o" / "results.json").read_text())
    assert all(result[h]["tokens_per_second"] > 0 for h in ("eagle1", "eagle3", "medusa", "hydra"))


# the scripts that run the recipes' comparisons and ablations, each a list of `draftsmith` runs
RECIPE_SCRIPTS = (
    "compare_heads.sh",
    "compare_heads_quick.sh",
    "quick_ablations.sh",
    "quick_sweep.sh",
    "regen_ablation.sh",
)


def test_recipe_scripts_compose_every_command(tmp_path: Path) -> None:
    """Every `draftsmith` command the comparison and ablation scripts run composes, so an option
    renamed since does not fail hours into a comparison. The commands are recorded by a shell
    function standing in for `draftsmith`, in a copy of the scripts whose venv.sh does nothing,
    and composed here; none runs."""
    from draftsmith.config import compose

    scripts = tmp_path / "scripts"
    scripts.mkdir()
    for name in (*RECIPE_SCRIPTS, "lane.sh"):
        shutil.copy(SCRIPTS / name, scripts / name)
    (scripts / "venv.sh").write_text("")
    log = tmp_path / "commands.txt"
    # one line per argument, an empty line after each command
    shim = f'draftsmith() {{ printf "%s\\n" "$@" "" >> {log}; }}; export -f draftsmith'
    for name in RECIPE_SCRIPTS:
        command = f"{shim}; bash {scripts / name} {tmp_path / 'runs'}"
        subprocess.run(["bash", "-c", command], check=True, capture_output=True, text=True)
    commands = [c.split("\n") for c in log.read_text().split("\n\n") if c.strip()]
    assert len(commands) > 40 and {c[0] for c in commands} == {"run"}
    for stage, *overrides in commands:
        compose([f"stage={stage}", *overrides])


def test_oracle_node_logits_are_the_targets_after_each_path(tiny_target, monkeypatch) -> None:
    """The oracle's tree forward (cached context, tree mask, depth positions) gives every node
    the logits a plain forward over context + the node's path gives."""
    import torch
    from transformers import DynamicCache

    from draftsmith.inference.attention import tree_attention
    from draftsmith.inference.tree import build_dynamic_tree
    from draftsmith.inference.verify import Sampling
    from draftsmith.target import cache_kwarg

    bench = _script("bench_oracle", monkeypatch)
    context = torch.randint(0, tiny_target.config.vocab_size, (1, 9))  # [1, 9], root last
    cache = DynamicCache(config=tiny_target.config)
    with torch.no_grad():
        out = tiny_target(input_ids=context, **{cache_kwarg(tiny_target): cache}, use_cache=True)
        oracle = bench.OracleExpander(tiny_target, cache, out.logits[0, -1], Sampling(1.0))
        with tree_attention(tiny_target, "sdpa"):
            tree = build_dynamic_tree(oracle, int(context[0, -1]), 3, 3, 10)
            nodes = torch.arange(1, tree.size)
            logits = oracle.node_logits(tree, nodes)  # [N-1, V]
        assert cache.get_seq_length() == 9  # the tree was cut away again
        expected = 0.0  # sum over nodes of the chance the target samples the path to them
        for i, node in enumerate(nodes.tolist()):
            path = tree.tokens[tree.ancestors[node]][1:]  # below the root
            plain = tiny_target(input_ids=torch.cat([context[0], path])[None]).logits[0, -1]
            torch.testing.assert_close(logits[i], plain.float(), atol=1e-4, rtol=1e-4)
            steps = tiny_target(input_ids=torch.cat([context[0], path[:-1]])[None]).logits[0]
            probs = torch.softmax(steps[-path.numel() :].float(), -1)  # [d, V] along the path
            expected += float(probs[torch.arange(path.numel()), path].prod())
    assert abs(oracle.expected_accepted(tree) - expected) < 1e-4 * max(expected, 1.0)


def test_readme_results_are_the_archive_regenerated(tmp_path: Path) -> None:
    """The README's results section and the archive's table of every eval are exactly what
    results_table.py writes from `results/` (no number typed by hand), and the tree column names
    every setting an eval ran with."""
    root = SCRIPTS.parent
    store = shutil.copytree(root / "results", tmp_path / "results", ignore=_png)
    readme = tmp_path / "README.md"
    shutil.copy(root / "README.md", readme)
    before, every = readme.read_text(), (store / "README.md").read_text()
    command = [sys.executable, str(SCRIPTS / "results_table.py"), "--archive", str(store)]
    subprocess.run([*command, "--readme", str(readme)], check=True, capture_output=True)
    assert readme.read_text() == before
    assert (store / "README.md").read_text() == every
    # the headline: each head of the recipe comparison once per benchmark and temperature
    section = before.split("<!-- results:begin -->")[1].split("<!-- results:end -->")[0]
    for head in ("eagle3", "eagle1", "medusa", "hydra"):
        assert section.count(f" | {head} | mt-bench | 0.0 | ") == 1, head
    assert "(results/headline.png)" in section and "(results/README.md)" in section
    # a head's own draft vocabulary follows its name (recorded since session 60)
    for named in (
        "+lookup8 p0.02 |",
        "+lookup8 rt0.5 |",
        "n12 v4096 compiled |",
        "| eagle3 v4096 |",
    ):
        assert named in every
    # q32_wd's budget row: data and features from an earlier run, eval not selected
    assert "| q32_wd | 316634 | True | 672 | 1.475 | reused | reused | 4.7 | - |" in every


def test_results_table_refuses_a_headline_eval_not_archived(tmp_path: Path) -> None:
    """A headline.json folder with no archived eval is an error naming it, raised before the
    archive page or the README is touched."""
    root = SCRIPTS.parent
    store = tmp_path / "results"
    store.mkdir()
    shutil.copy(root / "results" / "headline.json", store / "headline.json")
    chosen = json.loads((store / "headline.json").read_text())
    run = next(iter(chosen["evals"]))  # checked first: archived, one folder named wrong
    shutil.copytree(root / "results" / "runs" / run, store / "runs" / run, ignore=_png)
    chosen["evals"][run].append("mt-bench-typo")
    (store / "headline.json").write_text(json.dumps(chosen))
    readme = tmp_path / "README.md"
    empty = "<!-- results:begin -->\n<!-- results:end -->\n"
    readme.write_text(empty)
    command = [sys.executable, str(SCRIPTS / "results_table.py"), "--archive", str(store)]
    done = subprocess.run([*command, "--readme", str(readme)], capture_output=True, text=True)
    assert done.returncode != 0
    assert f"run {run}: eval folders not archived: ['mt-bench-typo']" in done.stderr
    assert not (store / "README.md").exists()
    assert readme.read_text() == empty


def test_tau_columns_hold_first_turn_evals_only(monkeypatch) -> None:
    """The tau plot and the headline matrix read the MATRIX columns (first turns, as the goals
    do): r39's eval of every MT-bench turn (tau 3.28) must not land in the MT-bench T=0 column."""
    table = _script("results_table", monkeypatch)
    evals = SCRIPTS.parent / "results" / "runs" / "r39" / "eval"
    tag = "mt-bench-dynamic-d4-k4-n16-lookup8{}-T0-bfloat16"
    first, every = (
        json.loads((evals / tag.format(t) / "results.json").read_text()) for t in ("", "-allturns")
    )
    assert table.column(first) == ("mt-bench", 0.0) and table.column(every) not in table.MATRIX
    assert table.taus_by_column([first, every])[("mt-bench", 0.0)] == first["tau"] < every["tau"]


def test_readme_goals_cite_archived_runs() -> None:
    """The goals table is written by hand, but every run it cites must be in the archive (and so
    in its generated tables, results/README.md), so a number there can be checked against its
    JSON."""
    root = SCRIPTS.parent
    readme = (root / "README.md").read_text()
    goals = readme.split("| goal | best measured | run | reached |")[1].split("\n\n")[0]
    cited = {name for row in goals.splitlines()[1:] for name in row.split("|")[3].split("`")[1::2]}
    assert {"r31_packed", "quick_s31"} <= cited
    assert not {name for name in cited if not (root / "results" / "runs" / name).is_dir()}


def _script(name: str, monkeypatch) -> ModuleType:
    """scripts/<name>.py as a module, registered while the test runs (dataclasses look their
    module up)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def _png(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if n.endswith(".png")]  # plots are not read back
