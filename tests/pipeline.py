"""Helpers that build small inputs and a prepared + collected run on the tiny target, for stage
tests."""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.config import compose


def tiny_run(root: Path, rows: int = 40, extra: list[str] | None = None) -> list[str]:
    """Prepare and collect a tiny run under `root`; returns the overrides naming it."""
    data = root / "data.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"r{i}",
                    "messages": [
                        {"role": "user", "content": f"Count from {i} please."},
                        {
                            "role": "assistant",
                            "content": " ".join(str(i + j) for j in range(8 + i % 7)),
                        },
                    ],
                }
            )
            + "\n"
            for i in range(rows)
        )
    )
    overrides = [
        f"runs_dir={root}/runs",
        "run_name=t",
        "target=tiny-random-llama",
        f"data.path={data}",
        "data.heldout=6",
        "collect.shard_tokens=800",
        *(extra or []),
    ]
    from draftsmith.train import collect, prepare

    prepare.run(compose(overrides))
    collect.run(compose(overrides))
    return overrides


def regeneration_run(root: Path) -> list[str]:
    """Write 32 ShareGPT rows under `root` (30 of two exchanges, one with an unknown role, one
    question alone); returns the overrides that prepare them on the tiny target, regenerating
    every answer in chunks of 8 conversations."""
    rows = [
        {
            "id": f"r{i}",
            "conversations": [
                {"from": "human", "value": f"question {i}?"},
                {"from": "gpt", "value": f"answer {i}."},
                {"from": "human", "value": "more"},
                {"from": "gpt", "value": "ok " * (i % 5)},
            ],
        }
        for i in range(30)
    ]
    rows.append({"id": "bad", "conversations": [{"from": "alien", "value": "?"}]})
    rows.append({"id": "noasst", "conversations": [{"from": "human", "value": "only a question"}]})
    (root / "data.json").write_text(json.dumps(rows))
    return [
        f"runs_dir={root}/runs",
        "target=tiny-random-llama",
        f"data.path={root}/data.json",
        "data.regenerate=true",
        "data.heldout=4",
        "data.regen.max_new_tokens=8",
        "data.regen.chunk_rows=8",
    ]
