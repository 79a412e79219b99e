"""`draftsmith run` end to end on the tiny target; a second run skips every completed stage."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.config import compose
from draftsmith.errors import InputError
from draftsmith.pipeline import _markdown, run
from draftsmith.provenance import record


def test_run_end_to_end_then_skips(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"Say {i} twice."},
                        {"role": "assistant", "content": f"{i} {i}, and once more: {i} {i}."},
                    ]
                }
            )
            + "\n"
            for i in range(60)
        )
    )
    overrides = [
        f"runs_dir={tmp_path}/runs",
        "experiment=tiny",
        f"data.path={data}",
        "data.heldout=6",
        "data.regenerate=true",
        "data.regen.rows=4",
        "data.regen.max_new_tokens=8",
        "head.draft_vocab_size=128",
        "train.max_steps=6",
        "train.eval_every=3",
        "eval.benchmark=heldout",
        "eval.limit=3",
        "eval.max_new_tokens=16",
        "export=sglang",
        "tracking=wandb",
    ]
    summary = run(compose(overrides))
    assert [r["status"] for r in summary["stages"]] == ["done"] * 5
    assert summary["eval"]["mismatch"]["prompts"] == 0  # fp32: lossless
    assert summary["train"]["steps"] == 6
    out = tmp_path / "runs" / "tiny"
    assert (out / "export" / "sglang" / "model.safetensors").exists()
    assert "tau" in (out / "summary.md").read_text()
    # data.regen.rows=4: the target wrote the answers of 4 training conversations, not all 54
    assert (
        "; the target regenerated the answers of 4 conversations"
        in (out / "summary.md").read_text()
    )
    assert list((out / "eval").glob("*/wandb/offline-run-*/*.wandb"))  # eval logged to W&B
    assert list((out / "train").glob("wandb/offline-run-*/*.wandb"))
    again = run(compose(overrides))
    assert [r["status"] for r in again["stages"]] == ["already complete"] * 5
    assert [r["seconds"] for r in again["stages"]] == [r["seconds"] for r in summary["stages"]]
    # a tau-only eval into the same folder replaces the results, says so, and the pipeline then
    # measures its own settings again instead of reporting the other eval as its own
    from draftsmith.inference import eval as evaluate

    evaluate.run(compose([*overrides, "eval.baselines=[]", "tracking=none"]))
    assert "replacing results measured with other settings (eval.baselines: ['vanilla', " in (
        capsys.readouterr().out
    )
    remeasured = run(compose(overrides))
    statuses = [r["status"] for r in remeasured["stages"]]
    assert statuses == ["already complete"] * 3 + ["done", "already complete"]
    assert remeasured["eval"]["speedup"].keys() == {"vs_vanilla", "vs_lookup"}
    # a finished stage made with other settings is refused before anything runs, by the pipeline
    # and by prepare itself; a change that does not alter an output (cadence) is not
    from draftsmith.train import prepare

    timings = (out / "stage_seconds.json").read_text()
    with pytest.raises(ValueError, match=r"prepare was made with other settings \(data.limit: 64"):
        run(compose([*overrides, "data.limit=30"]))
    with pytest.raises(ValueError, match=r"data.limit: 64 -> 30\)"):
        prepare.run(compose([*overrides, "data.limit=30", "stage=prepare"]))
    with pytest.raises(ValueError, match=r"train was made .*\(train.max_steps: 6 -> 7\)"):
        run(compose([*overrides, "train.max_steps=7"]))
    with pytest.raises(ValueError, match=r"collect was made .*\(dtype: float32 -> bfloat16\)"):
        run(compose([*overrides, "dtype=bfloat16"]))
    assert (out / "stage_seconds.json").read_text() == timings  # no stage ran
    cadence = run(compose([*overrides, "train.eval_every=2", "train.log_every=1"]))
    assert [r["status"] for r in cadence["stages"]] == ["already complete"] * 5
    # an eval with other settings: the summary reports it and points to the table of both
    assert "evals" not in summary
    tagged = run(compose([*overrides, "stages=[eval]", "eval.tag=chain", "tree=chain"]))
    assert tagged["eval"]["tree"]["kind"] == "chain" and tagged["evals"]["count"] == 2
    table = out / "eval" / "summary.md"
    assert f"all 2 evals of this run: {table}" in (out / "summary.md").read_text()
    assert len(table.read_text().splitlines()) == 4  # header, rule, both evals
    # another head (its export, imported) evaluated in this run: its results go to their own
    # folder, never replacing this run's head's, and under a shared eval.tag the replacement
    # names the head
    imported = [*overrides, f"head_path={out}/export/sglang", "eval.baselines=[]"]
    evaluate.run(compose([*imported, "tracking=none"]))
    assert len(list((out / "eval").glob("heldout-*-limit3-new16-head*-T0-float32"))) == 1
    assert [r["status"] for r in run(compose(overrides))["stages"]] == ["already complete"] * 5
    capsys.readouterr()
    evaluate.run(compose([*imported, "eval.tag=chain", "tree=chain", "tracking=none"]))
    assert re.search(r"head.path: .*/tiny/train/head -> .*/export/sglang", capsys.readouterr().out)

    # another head on the same prepared data and features: nothing is prepared or collected again
    medusa = [o for o in overrides if o.split("=")[0] not in ("head.draft_vocab_size", "export")]
    medusa += ["run_name=tiny_medusa", "inputs_from=tiny", "head=medusa", "tree.depth=4"]
    medusa += ["seed=1"]  # another training seed: tiny's data and features are read as they are
    medusa += ["export=medusa"]  # sglang serves EAGLE heads only
    trained = run(compose([*medusa, "stages=[prepare,collect,train]"]))
    statuses = ["already complete"] * 2 + ["done"] + ["not selected"] * 2
    assert [r["status"] for r in trained["stages"]] == statuses
    assert not (tmp_path / "runs" / "tiny_medusa" / "prepare").exists()
    assert not (tmp_path / "runs" / "tiny_medusa" / "eval").exists()  # stages stops at train
    assert trained["stages"][1]["seconds"] == summary["stages"][1]["seconds"]  # tiny's collection

    # both heads in one eval, one vanilla and one lookup pass for both; the Medusa head's results
    # land in its own run, under its own (4-deep) tree, where its `draftsmith run` finds them
    mine = evaluate.run(compose([*overrides, "eval.heads=[tiny_medusa]", "tracking=none"]))
    found = list((tmp_path / "runs" / "tiny_medusa" / "eval").glob("*-d4-*/results.json"))
    assert len(found) == 1
    theirs = json.loads(found[0].read_text())
    assert mine["decoded_with"] == ["tiny_medusa"] and theirs["decoded_with"] == ["tiny"]
    assert mine["head"]["name"] != theirs["head"]["name"]
    # the EAGLE-3 head's own draft vocabulary is recorded; Medusa drafts from the target's
    assert mine["head"]["draft_vocab_size"] == 128 and theirs["head"]["draft_vocab_size"] is None
    assert theirs["tree"]["depth"] == 4 and mine["tree"]["depth"] == 5
    for method in ("vanilla", "lookup"):
        assert mine["seconds"][method] == theirs["seconds"][method] > 0
    assert mine["tokens"]["speculative"] == theirs["tokens"]["speculative"] > 0  # both lossless
    assert mine["mismatch"]["checked"] and theirs["mismatch"]["prompts"] == 0
    # the same eval again would overwrite the Medusa run's results: refused before decoding
    kept = found[0].read_bytes()
    with pytest.raises(InputError, match=f"{re.escape(str(found[0]))} already holds"):
        evaluate.run(compose([*overrides, "eval.heads=[tiny_medusa]", "tracking=none"]))
    assert found[0].read_bytes() == kept
    other = run(compose(medusa))
    assert [r["status"] for r in other["stages"]] == ["already complete"] * 4 + ["done"]
    assert other["data"] == summary["data"] and other["eval"]["decoded_with"] == ["tiny"]

    # the Medusa head drafting over the 64 most frequent answer tokens (its own results folder,
    # still lossless); the EAGLE-3 head decoded alongside keeps its own draft vocabulary
    cut = [*medusa, "eval.draft_vocab_size=64", "eval.baselines=[vanilla]"]
    mine = evaluate.run(compose([*cut, "eval.heads=[tiny]", "tracking=none"]))
    assert mine["draft_vocab_size"] == 64 and mine["mismatch"]["checked"]
    assert mine["mismatch"]["prompts"] == 0
    cut_dirs = list((tmp_path / "runs" / "tiny_medusa" / "eval").glob("*-v64"))
    assert len(cut_dirs) == 1 and len(found) == 1 and found[0].exists()  # the full-vocab eval kept
    assert (
        "(drafting over the 64 most frequent answer tokens)"
        in (cut_dirs[0] / "results.md").read_text()
    )
    # (under the Medusa run's 4-deep tree; the run's other evals are 5 deep or tagged)
    (theirs,) = (tmp_path / "runs" / "tiny" / "eval").glob("*-d4-*/results.json")
    theirs = json.loads(theirs.read_text())
    assert theirs["draft_vocab_size"] == 0 and theirs["decoded_with"] == ["tiny_medusa"]
    assert [r["status"] for r in run(compose(cut))["stages"]] == ["already complete"] * 5
    # `draftsmith generate` drafts over the same cut vocabulary, still the target's greedy output
    from draftsmith.inference import generate

    prompt = ["generate.prompt=Say 7 twice.", "generate.max_new_tokens=16", "generate.compare=true"]
    printed = io.StringIO()
    said = generate.run(compose([*cut, *prompt]), out=printed)
    assert said["draft_vocab_size"] == 64 and said["identical"]
    assert "drafting over 64 tokens" in printed.getvalue()

    # the same EAGLE-3 eval on a compiled target: every method runs the compiled forward, still
    # lossless, in its own results folder next to the eager one
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    compiled = evaluate.run(compose([*overrides, "eval.compile=true", "tracking=none"]))
    assert counters["stats"]["unique_graphs"] > graphs  # something was really compiled
    assert compiled["eval"]["compile"] and compiled["mismatch"]["checked"]
    assert compiled["mismatch"]["prompts"] == 0
    assert compiled["tokens"]["speculative"] == compiled["tokens"]["vanilla"] > 0
    assert len(list((out / "eval").glob("*-compiled/results.json"))) == 1

    # with a prompt-lookup branch in every tree: still lossless, in its own results folder
    grafted = evaluate.run(compose([*overrides, "tree.lookup=3", "tracking=none"]))
    assert grafted["tree"]["lookup"] == 3 and grafted["mismatch"]["checked"]
    assert grafted["mismatch"]["prompts"] == 0
    (folder,) = (out / "eval").glob("*-n16-lookup3-limit3-new16-T0-*")
    report = (folder / "results.md").read_text()
    assert "prompt-lookup branch of 3" in report and "ms (target forward " in report
    assert "**eagle3** (its own draft vocabulary of 128 tokens) on " in report
    # the presets' branch, its length by the match's: lossless too, and named in results.md
    by_match = ["tree.lookup=0", "tree.lookup_by_match=[2,3,6]", "tracking=none"]
    grafted = evaluate.run(compose([*overrides, *by_match]))
    assert grafted["tree"]["lookup_by_match"] == [2, 3, 6] and grafted["mismatch"]["checked"]
    assert grafted["mismatch"]["prompts"] == 0
    (folder,) = (out / "eval").glob("*-n16-lookup2-3-6-limit3-new16-T0-*")
    report = (folder / "results.md").read_text()
    assert "prompt-lookup branch of 2/3/6 tokens by match length" in report

    # in bf16 eval packs the target's and the head's linear weights (where oneDNN has bf16
    # kernels) and decodes the same tokens as with the weights as loaded
    from draftsmith.packed import packing_available

    bf16 = [*overrides, "dtype=bfloat16", "eval.baselines=[vanilla]", "tracking=none"]
    packed = evaluate.run(compose(bf16))
    plain = evaluate.run(compose([*bf16, "target.pack_linears=false", "eval.tag=plain"]))
    assert plain["machine"]["packed_linears"] == 0
    if packing_available():
        assert packed["machine"]["packed_linears"] > 0
    assert packed["tau"] == plain["tau"] and packed["tokens"] == plain["tokens"]
    assert packed["mismatch"]["prompts"] == plain["mismatch"]["prompts"]


def test_outputs_made_from_an_input_made_again_are_made_again(tmp_path: Path, fake_hub) -> None:
    """Lineage: a training deleted and trained again (as a refusal suggests) leaves an eval and
    an export of the earlier head, which `draftsmith run` makes again, also in a later
    invocation, rather than report them as the new head's; data prepared again makes the
    features, head, eval and export again; a killed training's checkpoints of features collected
    again are not resumed."""
    import shutil

    from draftsmith.train import loop

    data = tmp_path / "data.jsonl"
    rows = [{"prompt": f"Say {i} twice.", "response": f"{i} {i}."} for i in range(30)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = [f"runs_dir={tmp_path}/runs", "experiment=tiny", f"data.path={data}"]
    common += ["train.max_steps=2", "eval.limit=1", "eval.max_new_tokens=4"]
    common += ["eval.baselines=[]", "export=sglang", "tracking=none"]
    prompts = tmp_path / "prompts.jsonl"  # its own benchmark: the fast suite fetches no asset
    prompts.write_text(json.dumps({"prompt": "Say 1 twice."}) + "\n")
    common += [f"eval.benchmark={prompts}"]
    out = tmp_path / "runs" / "tiny"

    def statuses(*extra: str) -> list[str]:
        return [r["status"] for r in run(compose([*common, *extra]))["stages"]]

    def lineage() -> tuple:
        train = json.loads((out / "train" / "summary.json").read_text())
        (results,) = (out / "eval").glob("*/results.json")
        exports = json.loads((out / "export" / "made_from.json").read_text())
        return train["made"], json.loads(results.read_text())["head"]["made"], exports

    assert statuses() == ["done"] * 5
    made, evaluated, exported = lineage()
    assert evaluated == made and list(exported.values()) == [made]
    shutil.rmtree(out / "train")
    assert statuses("stages=[train]") == ["already complete"] * 2 + ["done"] + ["not selected"] * 2
    assert statuses() == ["already complete"] * 3 + ["done"] * 2  # the earlier head's: again
    made, evaluated, exported = lineage()
    assert evaluated == made and list(exported.values()) == [made]
    assert statuses() == ["already complete"] * 5

    # the data edited (same lengths) and prepared again: collected again, not resumed from the
    # shards of the earlier data
    def shards() -> list[str]:
        index = json.loads((out / "collect" / "index.json").read_text())
        return [s["sha256"] for split in index["splits"].values() for s in split["shards"]]

    before = shards()
    data.write_text(data.read_text().replace('."}', '!"}'))
    # edited in place under the same data.path: other data, refused before anything runs
    with pytest.raises(ValueError, match=r"prepare was made with other settings \(data.sha256"):
        run(compose(common))
    shutil.rmtree(out / "prepare")
    assert statuses() == ["done"] * 5
    assert not set(before) & set(shards())
    assert lineage()[0] != made  # the finished head trained again on the new features
    index = json.loads((out / "collect" / "index.json").read_text())
    prepared = json.loads((out / "prepare" / "stats.json").read_text())
    assert index["inputs"] == prepared["made"] != None  # noqa: E711
    # a time-boxed training, then the features collected again: not resumed from its checkpoints
    shutil.rmtree(out / "train")
    assert statuses("train.stop_after=1")[2] == "stopped at step 1 (train.stop_after)"
    stopped = json.loads((out / "train" / "stopped.json").read_text())  # for a launcher to read
    assert (stopped["steps"], stopped["seconds_before_resume"]) == (1, 0.0)
    shutil.rmtree(out / "collect")
    assert statuses("stages=[collect]")[1] == "done"
    with pytest.raises(ValueError, match="checkpoints were trained on collect output made again"):
        loop.run(compose([*common, "resume=true"]))
    assert statuses() == ["already complete"] * 2 + ["done"] * 3
    assert not (out / "train" / "stopped.json").exists()  # finished since
    settings = json.loads((out / "train" / "settings.json").read_text())
    assert settings["inputs"] == json.loads((out / "collect" / "index.json").read_text())["made"]
    # the README's `draftsmith export format=... out=<folder>`: another folder, the run's
    # export folder not made yet; its lineage is kept all the same
    from draftsmith import export

    shutil.rmtree(out / "export")
    served = ["format=native", f"out={tmp_path}/served"]
    export.run(compose([*common, *served]))
    assert (tmp_path / "served" / "model.safetensors").exists()
    assert statuses(*served) == ["already complete"] * 5
    # the data file moved away after it was prepared: nothing to compare, nothing to redo
    data.unlink()
    assert statuses(*served) == ["already complete"] * 5
    # a benchmark file edited in place after its eval: measured again
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"prompt": "Say 3 twice."}) + "\n")
    assert statuses(f"eval.benchmark={bench}")[3] == "done"
    assert statuses(f"eval.benchmark={bench}")[3] == "already complete"
    bench.write_text(json.dumps({"prompt": "Say 4 twice."}) + "\n")
    assert statuses(f"eval.benchmark={bench}")[3] == "done"
    (file_results,) = (out / "eval").glob("bench-*/results.json")
    # a hub benchmark: measured again once its branch moved to another commit
    first = fake_hub.push("acme/bench", [{"prompt": "Say 5 twice."}])
    assert statuses("eval.benchmark=acme/bench")[3] == "done"
    assert statuses("eval.benchmark=acme/bench")[3] == "already complete"
    moved = fake_hub.push("acme/bench", [{"prompt": "Say 6 twice."}])
    assert statuses("eval.benchmark=acme/bench")[3] == "done"
    # named by the id's last part and where it is: not the file's folder of the same name
    (results,) = set((out / "eval").glob("bench-*/results.json")) - {file_results}
    assert json.loads(results.read_text())["benchmark_sha256"] == moved
    # pinned to the first commit by a tag (another eval setting): measured again, on that commit
    fake_hub.refs["acme/bench", "v1"] = first
    assert statuses("eval.benchmark=acme/bench", "eval.revision=v1")[3] == "done"
    assert json.loads(results.read_text())["benchmark_sha256"] == first
    assert statuses(f"eval.benchmark={bench}")[3] == "already complete"  # the file's stand
    with pytest.raises(ValueError, match=r"revision v1: .*bench.jsonl is read from this machine"):
        statuses(f"eval.benchmark={bench}", "eval.revision=v1")


def test_a_hub_target_run_records_the_commit_it_read(tmp_path: Path, hub_target: Path) -> None:
    """`draftsmith run` on a hub target: every stage loads the commit its default branch is at
    and records it (prepare's and train's settings, collect's index, the eval's results); the
    branch moved on since, the earlier outputs are another target's: prepare refuses its own, and
    the eval's results no longer count as measured."""
    from draftsmith.inference.results import changed_settings

    data = tmp_path / "data.jsonl"
    rows = [{"prompt": f"Say {i} twice.", "response": f"{i} {i}."} for i in range(30)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Say 1 twice."}) + "\n")
    overrides = [f"runs_dir={tmp_path}/runs", "experiment=tiny", "target.path=acme/tiny"]
    overrides += [f"data.path={data}", f"eval.benchmark={prompts}", "eval.baselines=[]"]
    overrides += ["train.max_steps=2", "eval.limit=1", "eval.max_new_tokens=4"]
    overrides += ["stages=[prepare,collect,train,eval]", "tracking=none"]
    statuses = [r["status"] for r in run(compose(overrides))["stages"]]
    assert statuses == ["done"] * 4 + ["not selected"]  # (no export)
    out = tmp_path / "runs" / "tiny"
    (results,) = (out / "eval").glob("*/results.json")
    recorded = {
        "prepare": json.loads((out / "prepare" / "settings.json").read_text())["target.revision"],
        "collect": json.loads((out / "collect" / "index.json").read_text())["target_revision"],
        "train": json.loads((out / "train" / "settings.json").read_text())["target.revision"],
        "eval": json.loads(results.read_text())["target_revision"],
    }
    assert recorded == dict.fromkeys(recorded, "a" * 40)
    cfg = compose(overrides)

    def changes() -> list[str]:
        return changed_settings(
            json.loads(results.read_text()), cfg, cfg.tree, cfg.resolved_head_path()
        )

    assert not changes()
    (hub_target / "refs" / "main").write_text("b" * 40)
    assert changes() == [f"target.revision: {'a' * 40} -> {'b' * 40}"]
    with pytest.raises(ValueError, match=r"prepare was made with other settings \(target.revision"):
        run(compose(overrides))
    # the commit the refusal names goes on with the target the run began with
    statuses = [
        r["status"] for r in run(compose([*overrides, f"target.revision={'a' * 40}"]))["stages"]
    ]
    assert statuses == ["already complete"] * 4 + ["not selected"]


def test_summary_prints_only_what_was_measured() -> None:
    """An eval without baselines (the quick preset) reports tau, no speedup or mismatch count."""
    e = {
        "eval": {"benchmark": "mt-bench"},
        "prompts": 80,
        "machine": {"dtype": "bfloat16"},
        "tau": 1.5,
        "speedup": {},
        "mismatch": {"checked": False, "prompts": 0},
    }
    text = _markdown({"run": "q", "stages": [], "eval": e})
    assert "tau 1.50" in text and "speedup" not in text and "mismatch" not in text
    e |= {"speedup": {"vs_vanilla": 1.1}, "mismatch": {"checked": True, "prompts": 3}}
    text = _markdown({"run": "q", "stages": [], "eval": e})
    assert "speedup over vanilla 1.10x" in text and "greedy mismatches 3/80" in text
    # the data line says whose answers the head learns and whether prepare skipped rows
    data = {
        "rows": {"train": 9},
        "tokens": {"train": 900},
        "masked_tokens": {"train": 500},
        "source": {"skipped": {}},
        "skipped": {},
    }
    line = "data: 9 training conversations, 900 tokens (500 under the loss mask)\n"
    assert line in _markdown({"run": "q", "stages": [], "data": data})
    data |= {"regenerated": True, "regenerated_rows": {"heldout": 2, "train": 8}}
    data |= {"source": {"skipped": {"unknown role": 2}}, "skipped": {"no assistant turn": 1}}
    assert (
        "(500 under the loss mask); the target regenerated the answers of 8 conversations; "
        "3 rows skipped (prepare/stats.json names them)"
    ) in _markdown({"run": "q", "stages": [], "data": data})


def test_sweep_summary_marks_missing_baselines(tmp_path: Path) -> None:
    """The eval folder's sweep table prints '-' for a baseline that was not run, never 'nan'."""
    from draftsmith.inference.report import write_sweep_summary

    for name, speedup in (("a", {}), ("b", {"vs_vanilla": 1.25, "vs_lookup": 0.9})):
        run_dir = tmp_path / name
        run_dir.mkdir()
        result = {
            "tree": {"kind": "dynamic", "depth": 5, "top_k": 4, "total_tokens": 12},
            "eval": {"temperature": 0.0},
            "tau": 1.5,
            "speedup": speedup,
        }
        (run_dir / "results.json").write_text(json.dumps(result))
    write_sweep_summary(tmp_path)
    rows = (tmp_path / "summary.md").read_text().splitlines()[2:]
    assert rows[0].endswith("| 1.50 | - | - |") and rows[1].endswith("| 1.50 | 1.25x | 0.90x |")
    assert (tmp_path / "tree_sweep.png").exists()


def test_divergence_summary_tells_near_ties_from_overruns() -> None:
    """A mismatch with a top-2 gap is numerics evidence; one without ran past vanilla's end."""
    from draftsmith.inference.report import divergence_summary

    details = [{"top2_gap": 0.125}, {"top2_gap": 0.0625}, {"top2_gap": None}]
    assert divergence_summary(details) == (
        " Largest top-2 logit gap where one starts: 0.125."
        " 1 ran on past the end of vanilla's output."
    )
    assert divergence_summary([]) == ""


def test_eval_heads_must_not_repeat_a_run() -> None:
    """A run named twice would share one entry of the rotation; refused before any model loads."""
    from draftsmith.inference.eval import evaluate

    with pytest.raises(ValueError, match="repeats a run"):
        evaluate(compose(["run_name=a", "eval.heads=[b,a]"]))


def test_an_export_format_the_head_lacks_is_refused_before_anything_runs(tmp_path: Path) -> None:
    """The default export (sglang) serves no Hydra head: refused before prepare, not after
    training; leaving export out of the stages, or a format the head has, runs. So is a tree the
    eval could not decode with."""
    overrides = [f"runs_dir={tmp_path}", "experiment=tiny", "head=hydra"]
    with pytest.raises(ValueError, match="format=sglang does not serve hydra heads .*native"):
        run(compose(overrides))
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
    nothing = run(compose([*overrides, "format=native", "stages=[]"]))
    assert [r["status"] for r in nothing["stages"]] == ["not selected"] * 5
    # so is a tree deeper than its heads (the tiny preset's dynamic tree drafts 5 deep), which
    # only the eval would find
    with pytest.raises(ValueError, match="tree.depth: .*hydra head has 4 heads"):
        run(compose([*overrides, "format=native"]))
    # and a tree that would not verify drawn children exactly at the eval's temperature
    t1 = ["format=native", "eval.temperature=1", "tree.depth=4"]
    with pytest.raises(ValueError, match="tree.adaptive=true sizes each tree"):
        run(compose([*overrides, *t1, "tree.adaptive=true"]))
    with pytest.raises(ValueError, match="tree.verify=traversal decides whole subtrees"):
        run(compose([*overrides, *t1, "tree.verify=traversal"]))
    assert not (tmp_path / "tiny" / "prepare").exists()


def test_online_wandb_without_credentials_is_refused_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W&B itself raises only when training starts its run, after prepare and collect. The
    command runs in its own process, as a user's would: W&B keeps credentials per process, and
    other tests' runs have been here."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    runs = tmp_path / "runs"
    command = ["run", f"runs_dir={runs}", "experiment=tiny", "tracking=wandb"]
    done = subprocess.run(
        [sys.executable, "-m", "draftsmith.cli", *command], capture_output=True, text=True
    )
    assert done.returncode == 1
    assert re.search("tracking=wandb logs online.*WANDB_MODE=offline", done.stderr)
    assert "Traceback" not in done.stderr  # the message alone
    assert not (runs / "tiny" / "prepare").exists()  # (Hydra's own .hydra/ files are there)


def test_a_training_stopped_early_is_not_reported_done(tmp_path: Path, monkeypatch) -> None:
    """`train.stop_after` ends an invocation before the head exists: the summary says where it
    stopped, and the stages after it, which read the head, wait for the training to finish."""
    from draftsmith.inference import eval as evaluate
    from draftsmith.train import loop

    stopped = {"steps": 4, "stopped_early": True, "seconds_before_resume": 0.0}
    monkeypatch.setattr(loop, "run", lambda cfg: stopped)
    monkeypatch.setattr(evaluate, "run", lambda cfg: pytest.fail("eval ran without a head"))
    cfg = compose(
        [f"runs_dir={tmp_path}", "experiment=tiny", "stages=[train,eval]", "tracking=none"]
    )
    (tmp_path / "tiny").mkdir()  # the real stage makes its run's folder
    rows = run(cfg)["stages"]
    status = {r["stage"]: r["status"] for r in rows}
    assert status["train"] == "stopped at step 4 (train.stop_after)"
    assert status["eval"] == "waiting for train" and status["export"] == "not selected"


def test_resumed_training_reports_its_whole_time(tmp_path: Path, monkeypatch) -> None:
    """A training resumed from a checkpoint reports the seconds its earlier invocations spent on
    the steps it kept, plus its own (the stage minutes of `draftsmith run` and the results)."""
    from draftsmith.train import loop

    def resumed(cfg):
        assert cfg.resume  # continued from the checkpoint, not started again
        return {"steps": 8, "seconds_before_resume": 600.0}

    monkeypatch.setattr(loop, "run", resumed)
    common = [f"runs_dir={tmp_path}", "experiment=tiny", "stages=[train]", "tracking=none"]
    cfg = compose(common)
    # a training killed after a checkpoint: its settings recorded when it began
    (tmp_path / "tiny" / "train" / "checkpoints").mkdir(parents=True)
    (tmp_path / "tiny" / "train" / "checkpoints" / "latest").write_text("step4")
    record(dataclasses.replace(cfg, stage="train"), "train")
    # other settings would go on from its checkpoints: refused before anything runs
    with pytest.raises(ValueError, match=r"train.lr: .* -> 0.5.*delete"):
        run(compose([*common, "train.lr=0.5"]))
    (train,) = [r for r in run(cfg)["stages"] if r["stage"] == "train"]
    recorded = json.loads((tmp_path / "tiny" / "stage_seconds.json").read_text())["train"]
    assert train["status"] == "done" and 600.0 <= train["seconds"] == recorded < 660.0
