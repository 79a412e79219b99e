"""Regenerate the README's results section and the archive's full tables from measured JSON
(never typed by hand).
Usage: python scripts/results_table.py [RUN_DIR ...] [--bench DIR] [--archive results]
                                       [--readme README.md]
Copies each RUN_DIR's summary.json (data, training budget), training curve, eval/*/results.json
and eval plots, and the bench folder's results, into the archive (`results/`, committed: run
folders live on machines that are wiped). Then writes every archived eval to
`results/README.md`, and the README section: the evals `results/headline.json` names (the heads
the recipe issue compares, trained on the same data and budget) with a plot of them, and a link to
the rest."""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.inference.report import output_tau
from draftsmith.inference.tree import branch_label

STAGES = ("prepare", "collect", "train", "eval")
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


# one column per benchmark and temperature in the comparison matrix, in this order
MATRIX = [(b, t) for b in ("mt-bench", "heldout", "humaneval") for t in (0.0, 1.0)]


def stage_minutes(stage: dict) -> str:
    """A stage's minutes in the budget table. A stage skipped because its output was complete ran
    in an earlier invocation, whose time is reported when it was kept (older summaries: 0 or None,
    shown as "reused"); a stage the run did not select did not run in it at all ("-")."""
    if stage["seconds"]:
        return f"{stage['seconds'] / 60:.1f}"
    return "-" if stage.get("status") == "not selected" else "reused"


@dataclass
class Tables:
    """The README tables' rows, gathered run by run."""

    budget: list[str] = field(default_factory=list)  # training budget rows
    evals: list[str] = field(default_factory=list)  # one row per eval
    matrix: dict[str, dict[tuple, float]] = field(default_factory=dict)  # tau by bench and T
    by_category: dict[str, dict[str, float]] = field(default_factory=dict)  # tau by category
    results: list[dict] = field(default_factory=list)  # each eval's results.json, row order

    def add(self, other: Tables) -> None:
        self.budget += other.budget
        self.evals += other.evals
        self.matrix |= other.matrix
        self.by_category |= other.by_category
        self.results += other.results


def run_rows(run: Path, only: Collection[str] | None = None) -> Tables:
    """The table rows of one archived run: its summary and every eval under it, or the evals
    whose folder `only` names."""
    summary = (
        json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    )
    tables = Tables()
    if summary:
        minutes = {r["stage"]: stage_minutes(r) for r in summary.get("stages", [])}
        data, train = summary.get("data", {}), summary.get("train", {})
        sim_tau = train.get("best_heldout_sim_tau")
        tables.budget.append(
            f"| {run.name} | {data.get('tokens', {}).get('train', '?')} | "
            f"{data.get('regenerated', '?')} | {train.get('steps', '?')} | "
            + (f"{sim_tau:.3f}" if sim_tau else "-")
            + " | "
            + " | ".join(minutes.get(s, "-") for s in STAGES)
            + " |"
        )
    for path in sorted(run.glob("eval/*/results.json")):
        if only is not None and path.parent.name not in only:
            continue
        r = json.loads(path.read_text())
        tables.results.append(r)
        t, e, s = r["tree"], r["eval"], r["speedup"]
        # a tagged eval (`eval.tag`, e.g. a later session's decoder on the run's head) is named
        # by its tag too, so it never reads as a second copy of the run's untagged row
        name = f"{run.name} ({e['tag']})" if e.get("tag") else run.name
        depth = " ".join(f"{a:.2f}" for a in r["depth_acceptance"][:6])
        m = r["mismatch"]
        mism = f"{m['prompts']}/{m.get('compared', r['prompts'])}" if m["checked"] else "-"
        tree = f"{t['kind']} d{t['depth']} k{t['top_k']} n{t['total_tokens']}"
        if branch := branch_label(t):  # the grafted prompt-lookup branch: lookup8, lookup4-8-8-15
            tree += f" +{branch}"
        if t.get("adaptive"):  # per-step sizes, ~this many nodes per forward on average
            tree += f" adaptive~{r['nodes_per_forward']:.1f}"
        if t.get("min_prob"):  # session 32's path-probability cut (not kept)
            tree += f" p{t['min_prob']:g}"
        if t.get("rank_temperature", 1.0) != 1.0:  # session 29's ranking experiment (not kept)
            tree += f" rt{t['rank_temperature']:g}"
        if r.get("draft_vocab_size"):  # drafted over a frequent-token subset of the target's
            tree += f" v{r['draft_vocab_size']}"
        if e.get("compile"):  # every method ran the torch.compile'd target
            tree += " compiled"
        if e.get("turns") == "all":  # every user turn, not the first alone
            tree += " all-turns"
        if e["temperature"] > 0 and t.get("sample_drafts"):  # children drawn, not the top k
            tree += " drawn"
        if e["temperature"] > 0 and t.get("verify") == "traversal":  # whole paths at once
            tree += " traversal"
        speed = {k: f"{s[k]:.2f}x" if k in s else "-" for k in ("vs_vanilla", "vs_lookup")}
        # tau-only evals (no baselines) may share the cores with other jobs: no speed reported
        tok_s = f"{r['tokens_per_second']['speculative']:.1f}" if s else "-"
        head = r["head"]["name"]
        if r["head"].get("draft_vocab_size"):  # its own draft vocabulary (recorded since s60)
            head += f" v{r['head']['draft_vocab_size']}"
        out = output_tau(r)  # None for evals from before per-prompt records
        out_cell = "-" if out is None else f"{out:.2f}"
        tables.evals.append(
            f"| {name} | {head} | {e['benchmark']} | {e['temperature']} | "
            f"{r['machine']['dtype']} | {tree} | {r['prompts']} | **{r['tau']:.2f}** | "
            f"{out_cell} | {depth} | "
            f"{tok_s} | {speed['vs_vanilla']} | "
            f"{speed['vs_lookup']} | {mism} |"
        )
        key = f"| {name} | {r['head']['name']} | {tree} |"
        tables.matrix.setdefault(key, {})[(e["benchmark"], float(e["temperature"]))] = r["tau"]
        if r.get("by_category"):  # evals since session 35, on benchmarks whose rows name one
            label = f"| {name} | {e['benchmark']} | {e['temperature']} | {tree} | {r['tau']:.2f} |"
            tables.by_category[label] = {k: c["tau"] for k, c in r["by_category"].items()}
    return tables


def row_cells(cells: dict, columns: list) -> str:
    """A table row's tau cells in `columns` order ("-" where that column was not measured)."""
    return "".join(f" {cells[c]:.2f} |" if c in cells else " - |" for c in columns)


def column(result: dict) -> tuple[str, float]:
    """An eval's (benchmark, temperature): its MATRIX column. The MATRIX reads first turns, as
    the recipe's goals do: an eval of every turn (`eval.turns=all`) is in none of its columns."""
    e = result["eval"]
    benchmark = e["benchmark"] + (" all-turns" if e.get("turns") == "all" else "")
    return benchmark, float(e["temperature"])


def matrix_ticks(ax, width: float) -> None:
    """Label `ax`'s x axis with the MATRIX columns (column j: lanes of `width` in j .. j + 0.8)."""
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(MATRIX))])
    ax.set_xticklabels([f"{b}\nT={t:g}" for b, t in MATRIX], fontsize=8)


def plot_taus(results: list[dict], out: Path) -> None:
    """Every eval's tau as one dot, by benchmark and temperature (the MATRIX columns), each head
    in its own lane: how far the archive's evals spread, and where each head's best lies (the
    tables say which eval each dot is)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = sorted({r["head"]["name"] for r in results})
    lane = 0.8 / max(len(heads), 1)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, head in enumerate(heads):
        mine = [r for r in results if r["head"]["name"] == head and column(r) in MATRIX]
        # spread within the lane by archive order, so a column's dots do not cover each other
        x = [MATRIX.index(column(r)) + i * lane + lane * (j % 7) / 8 for j, r in enumerate(mine)]
        ax.scatter(x, [r["tau"] for r in mine], s=12, alpha=0.6, label=f"{head} ({len(mine)})")
    matrix_ticks(ax, lane)
    ax.axhline(1.0, color="grey", lw=0.8)  # no speculation accepted: 1 token per target forward
    ax.set_ylabel("acceptance length tau (tokens per target forward)")
    ax.legend(fontsize=8, title="head (evals)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def taus_by_column(results: list[dict]) -> dict[tuple[str, float], float]:
    """tau of each eval (results.json contents) by its MATRIX column."""
    return {column(r): r["tau"] for r in results}


def plot_headline(evals: dict[str, list[dict]], out: Path) -> None:
    """The headline evals of each run (`evals`: run name -> results.json contents) side by side:
    tau by benchmark and temperature, and MT-bench T=0 acceptance by depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, depths) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(evals), 1)
    for i, (run, results) in enumerate(evals.items()):
        label = f"{results[0]['head']['name']} ({run})"
        tau = taus_by_column(results)
        x = [j + i * width for j in range(len(MATRIX))]
        bars.bar(x, [tau.get(c, float("nan")) for c in MATRIX], width, label=label)  # nan: no bar
        for r in results:
            if column(r) == MATRIX[0]:
                acc, speed = r["depth_acceptance"], r["speedup"]
                if speed:  # decoded beside the baselines
                    label += f": {speed['vs_vanilla']:.2f}x vanilla"
                    label += f", {speed['vs_lookup']:.2f}x lookup"
                depths.plot(range(1, len(acc) + 1), acc, marker="o", label=label)
                if r["tree"].get("lookup"):  # deeper drafts come from the lookup branch alone
                    depths.axvline(r["tree"]["depth"] + 0.5, color="grey", lw=0.8, ls=":")
    matrix_ticks(bars, width)
    bars.axhline(1.0, color="grey", lw=0.8)  # no speculation accepted
    bars.set_ylabel("acceptance length tau (tokens per target forward)")
    bars.legend(fontsize=8)
    depths.set_xlabel("draft depth (right of the dotted line: the prompt-lookup branch alone)")
    depths.set_ylabel("P(draft accepted | offered), MT-bench T=0")
    depths.set_ylim(0, 1)
    depths.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def archive(src: Path, dest: Path, patterns: tuple[str, ...]) -> None:
    """Copy the files matching `patterns` below `src` to the same places below `dest`."""
    for pattern in patterns:
        for path in src.glob(pattern):
            target = dest / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)


def eval_lines(tables: Tables) -> list[str]:
    """One row per eval."""
    return [
        "| run | head | benchmark | T | dtype | tree | prompts | tau | output tau | "
        "acceptance by depth | spec tok/s | vs vanilla | vs prompt lookup | greedy mismatches |",
        "|---|---|---|---:|---|---|---:|---:|---:|---|---:|---:|---:|---:|",
        *tables.evals,
        "",
    ]


def matrix_lines(tables: Tables) -> list[str]:
    """tau by benchmark and temperature, one row per run and tree."""
    return [
        "The same tau by benchmark and temperature, one row per run and tree:",
        "",
        "| run | head | tree | " + " | ".join(f"{b} T{t:g}" for b, t in MATRIX) + " |",
        "|---|---|---|" + "---:|" * len(MATRIX),
        *(key + row_cells(cells, MATRIX) for key, cells in tables.matrix.items()),
        "",
    ]


def category_lines(tables: Tables) -> list[str]:
    """tau by benchmark category, where the benchmark's rows name one."""
    if not tables.by_category:
        return []
    categories = sorted({name for cells in tables.by_category.values() for name in cells})
    return [
        "Tau by benchmark category (where the benchmark's rows name one):",
        "",
        "| run | benchmark | T | tree | all | " + " | ".join(categories) + " |",
        "|---|---|---:|---|---:|" + "---:|" * len(categories),
        *(label + row_cells(cells, categories) for label, cells in tables.by_category.items()),
        "",
    ]


def budget_lines(tables: Tables) -> list[str]:
    """One row per run: data, steps, held-out simulated tau and each stage's minutes."""
    return [
        "Training budget:",
        "",
        "| run | train tokens | regenerated | steps | held-out simulated tau | prepare min | "
        "collect min | train min | eval min |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
        *tables.budget,
        "",
    ]


# how every table reads, above both the README's and the archive's
INTRO = [
    "Measured on this 2-core CPU (no GPU); every number is read by `scripts/results_table.py`",
    "from the runs' JSON, archived with their plots in `results/`. Speedups are ratios measured",
    "interleaved in one process; max_new_tokens 128 unless the run says otherwise. Rows without",
    "baselines measured tau only (they may have shared the cores with other jobs, so they report",
    "no speed). `v<N>` after a head: its own draft vocabulary of N tokens (recorded since session",
    "60); in the tree column: drafting over the N most frequent answer tokens, chosen at eval",
    "(`eval.draft_vocab_size`). A tagged eval (`eval.tag`) is named `run (tag)`.",
    "",
]


def write_archive_page(store: Path) -> tuple[int, int]:
    """results/README.md: every archived eval, tau by category, every training budget, and the
    plot of every tau; returns (evals, runs)."""
    runs = sorted((store / "runs").glob("*"))
    everything = Tables()
    for run in runs:
        everything.add(run_rows(run))
    if everything.results:
        plot_taus(everything.results, store / "tau.png")
    evals = len(everything.evals)
    page = [
        "# Every archived eval",
        "",
        f"{evals} evals of {len(runs)} runs; the README shows the headline ones and says what",
        "they mean, [docs/experiments.md](../docs/experiments.md) how each run was made. "
        "Generated: do not edit.",
        "",
        *INTRO,
        *eval_lines(everything),
        "![tau of every eval above, by benchmark, temperature and head](tau.png)",
        "",
        *matrix_lines(everything),
        *category_lines(everything),
        *budget_lines(everything),
    ]
    (store / "README.md").write_text("\n".join(page))  # ends with an empty line: one newline
    return evals, len(runs)


def read_headline(store: Path) -> dict:
    """headline.json (about: its text; evals: {run: [eval folder, ...]}), every eval checked to
    be archived before anything is written (a typo must not drop a headline row silently, nor
    leave the archive page rewritten and the README not)."""
    path = store / "headline.json"
    if not path.exists():
        raise SystemExit(
            f"{path}: missing (the README's headline: about, evals {{run: [eval folder, ...]}})"
        )
    chosen = json.loads(path.read_text())
    for name, folders in chosen["evals"].items():
        missing = [f for f in folders if not (store / "runs" / name / "eval" / f).is_dir()]
        if missing:
            raise SystemExit(f"{path}: run {name}: eval folders not archived: {missing}")
    return chosen


def headline_lines(store: Path, chosen: dict) -> list[str]:
    """The README's tables of the evals `chosen` (read_headline) names, run by run in its order,
    its text above them, and their plot."""
    headline, results = Tables(), {}
    for name, folders in chosen["evals"].items():
        rows = run_rows(store / "runs" / name, set(folders))
        headline.add(rows)
        results[name] = rows.results
    plot_headline(results, store / "headline.png")
    return [
        chosen["about"],
        "",
        *eval_lines(headline),
        "The same tau by benchmark and temperature:",
        "",
        "| run | head | " + " | ".join(f"{b} T{t:g}" for b, t in MATRIX) + " |",
        "|---|---|" + "---:|" * len(MATRIX),
        *(
            f"| {name} | {rs[0]['head']['name']} |" + row_cells(taus_by_column(rs), MATRIX)
            for name, rs in results.items()
        ),
        "",
        *budget_lines(headline),
        f"![the headline evals side by side]({store.name}/headline.png)",
        "",
    ]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="*")
    p.add_argument("--bench", default=None, help="a bench folder (data/, train/) to archive")
    p.add_argument("--archive", default="results")
    p.add_argument("--readme", default="README.md")
    args = p.parse_args()
    store = Path(args.archive)
    for run in map(Path, args.runs):
        archive(
            run,
            store / "runs" / run.name,
            ("summary.json", "train/training.png", "eval/*/results.json", "eval/*/*.png"),
        )
    if args.bench:
        archive(Path(args.bench), store / "bench", ("*/results.json", "*/results.md"))
    chosen = read_headline(store)
    evals, runs = write_archive_page(store)
    lines = [
        BEGIN,
        "",
        *INTRO,
        *headline_lines(store, chosen),
        f"Every archived eval ({evals} evals of {runs} runs, with tau by MT-bench category and",
        f"every training budget): [{store.name}/README.md]({store.name}/README.md).",
        "",
    ]
    bench = store / "bench"
    for name, title in (
        ("data", "Data pipeline (`scripts/bench_data.py`)"),
        ("train", "Head training (`scripts/bench_train.py`)"),
    ):
        md = bench / name / "results.md"
        if md.exists():
            lines += [f"{title}:", "", md.read_text().strip(), ""]
    lines.append(END)
    readme = Path(args.readme)
    text = readme.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    readme.write_text(text[:start] + "\n".join(lines) + text[end:])
    print("\n".join(lines))


if __name__ == "__main__":
    main()
