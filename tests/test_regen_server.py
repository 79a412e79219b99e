"""Regeneration by OpenAI-compatible servers (data.regen.engine=server), against a stand-in server
in a thread that serves `/v1/models` and `/v1/completions` by running the tiny target through
transformers' `generate`, as vLLM runs a model: the answers equal the in-process engine's, chunk
for chunk; a prompt the server refuses is dropped alone and logged; a server that stops
answering stops the stage and the same command continues from the chunks already written."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from pipeline import regeneration_run

from draftsmith.conf.schema import RegenConfig
from draftsmith.config import compose
from draftsmith.target import load_tokenizer, stop_token_ids
from draftsmith.tokenize import ConversationTokenizer
from draftsmith.train import prepare
from draftsmith.train.regen_server import ServerError
from draftsmith.train.regenerate import generate_answers


class StandIn:
    """A completions server over `target` on a free local port; records every request body.
    Refuses (HTTP 400) prompts longer than `max_prompt`, vLLM's extra keys when `strict` (422),
    and answers 503 once `fail_after` requests have been served."""

    def __init__(
        self, target, tokenizer, max_prompt: int | None = None, strict=False, usage=True
    ) -> None:
        self.target, self.tokenizer, self.max_prompt = target, tokenizer, max_prompt
        self.strict = strict  # OpenAI's own keys only, text prompts (as `transformers serve`)
        self.usage = usage  # False: `usage: null` in replies, as some servers send
        self.requests: list[dict] = []
        self.fail_after: int | None = None
        self.generate = generate_answers  # a test may give the target's answers itself
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet test output
                pass

            def reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self.reply(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self.reply(*server.complete(body))

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/v1"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def complete(self, body: dict) -> tuple[int, dict]:
        with self.lock:  # one generation at a time, as one GPU would
            if self.fail_after is not None and len(self.requests) >= self.fail_after:
                return 503, {"error": {"message": "engine restarting"}}
            self.requests.append(body)
            prompts = body["prompt"]
            if self.strict and {"top_k", "stop_token_ids"} & set(body):
                return 422, {"detail": "Unexpected fields in the request: {'top_k', ...}"}
            if self.max_prompt and any(len(p) > self.max_prompt for p in prompts):
                return 400, {"error": {"message": f"context length is {self.max_prompt}"}}
            sampling = {
                "max_new_tokens": body["max_tokens"],
                "temperature": body["temperature"],
                "top_p": body["top_p"],
                "top_k": max(body["top_k"], 0),
            }
            cfg = RegenConfig(engine="generate", batch_size=len(prompts), **sampling)
            answers = self.generate(self.target, self.tokenizer, prompts, cfg)
        skip = body["skip_special_tokens"]
        choices = [
            {"index": i, "text": self.tokenizer.decode(a, skip_special_tokens=skip)}
            for i, a in enumerate(answers)
        ]
        # in reverse: a client must order the answers by index, not by arrival
        usage = {"completion_tokens": sum(map(len, answers))} if self.usage else None
        return 200, {"object": "text_completion", "choices": choices[::-1], "usage": usage}

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def data(tmp_path: Path) -> list[str]:
    return regeneration_run(tmp_path)


def chunks(cfg) -> dict[str, list[dict]]:
    """{split/chunk name: its conversations} of a run's regeneration."""
    folder = Path(cfg.stage_dir("prepare"), "regen")
    return {
        f"{path.parent.name}/{path.name}": [json.loads(x) for x in path.read_text().splitlines()]
        for path in sorted(folder.glob("*/chunk_*.jsonl"))
    }


def server_run(data: list[str], name: str, servers: list[StandIn], *more: str):
    urls = ",".join(s.url for s in servers)
    overrides = [*data, f"run_name={name}", "data.regen.engine=server", "data.regen.batch_size=5"]
    return compose([*overrides, f"data.regen.servers=[{urls}]", *more])


def test_servers_answer_as_the_target_does_in_process(
    data, tiny_target, tiny_tokenizer, monkeypatch
) -> None:
    local = compose([*data, "run_name=local"])
    prepare.run(local)
    servers = [StandIn(tiny_target, tiny_tokenizer) for _ in range(2)]
    try:
        # the server engine never loads the target's weights
        monkeypatch.setattr(prepare, "load_target", lambda *a, **k: pytest.fail("loaded"))
        served = server_run(data, "served", servers)
        stats = prepare.run(served)
    finally:
        for s in servers:
            s.close()
    assert chunks(served) == chunks(local) and len(chunks(local)) == 5
    assert (
        stats["rows"]
        == json.loads(Path(local.stage_dir("prepare"), "stats.json").read_text())["rows"]
    )
    requests = [r for s in servers for r in s.requests]
    assert all(s.requests for s in servers)  # spread over both
    assert all(1 <= len(r["prompt"]) <= 5 and r["model"] == "tiny" for r in requests)
    stops = stop_token_ids(tiny_target, tiny_tokenizer)
    # every key sent, neutral ones too, so no server-side default changes the answers
    assert {(r["temperature"], r["top_k"], r["repetition_penalty"]) for r in requests} == {
        (0.0, -1, 1.0)
    }
    assert all(r["stop_token_ids"] == stops for r in requests)


def test_a_refused_prompt_is_dropped_alone_and_logged(data, tiny_target, tiny_tokenizer) -> None:
    local = compose([*data, "run_name=local"])
    prepare.run(local)
    answered = [c for rows in chunks(local).values() for c in rows]
    # the server refuses second turns longer than the median: some of each batch, not all
    renderer = ConversationTokenizer(load_tokenizer("tiny-random-llama"))
    second = sorted(len(renderer.prompt_ids(c["messages"][:3])) for c in answered)
    limit = second[len(second) // 2]
    server = StandIn(tiny_target, tiny_tokenizer, max_prompt=limit, usage=False)
    try:
        served = server_run(data, "served", [server])
        prepare.run(served)
    finally:
        server.close()
    mine_all = [c for rows in chunks(served).values() for c in rows]
    assert len(mine_all) == len(answered)  # every conversation kept its first exchange
    cut = 0
    for conv, mine in zip(answered, mine_all):
        assert conv["id"] == mine["id"]
        refused = len(renderer.prompt_ids(conv["messages"][:3])) > limit
        # a refused turn ends its conversation, keeping the exchange answered before it
        assert mine["messages"] == conv["messages"][: 2 if refused else 4]
        cut += refused
    assert 0 < cut < len(answered)
    log = Path(served.stage_dir("prepare"), "regen", "train", "stats.jsonl").read_text()
    assert "server refused the prompt" in log and f"context length is {limit}" in log


def test_a_server_that_stops_answering_stops_the_stage_and_it_continues(
    data, tiny_target, tiny_tokenizer, monkeypatch
) -> None:
    monkeypatch.setattr("time.sleep", lambda seconds: None)  # the retries' backoff
    server = StandIn(tiny_target, tiny_tokenizer)
    try:
        cfg = server_run(data, "served", [server], "data.regen.batch_size=32")
        prepare.run(cfg)
        everything = len(server.requests)
        # the same data from scratch, the server failing after the first chunks
        cfg = server_run(data, "again", [server], "data.regen.batch_size=32")
        server.requests.clear()
        server.fail_after = 3
        with pytest.raises(ServerError, match=f"{server.url}/completions: HTTP 503"):
            prepare.run(cfg)
        kept = chunks(cfg)
        assert 0 < len(kept) < 5
        server.requests.clear()
        server.fail_after = None
        prepare.run(cfg)
        assert 0 < len(server.requests) < everything  # only the chunks not written before
    finally:
        server.close()
    # nobody listens on a closed port: retried, then the stage names the server
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    cfg = compose(
        [*data, "run_name=down", "data.regen.engine=server"]
        + [f"data.regen.servers=[http://127.0.0.1:{port}/v1]", "data.regen.server_model=tiny"]
    )
    with pytest.raises(ServerError, match=f"127.0.0.1:{port}/v1/completions") as down:
        prepare.run(cfg)
    # said as it is: down, not of another dialect
    assert "Connection refused" in str(down.value) and "one-token" not in str(down.value)
    with pytest.raises(ValueError, match="data.regen.servers"):
        compose([*data, "data.regen.engine=server"])


def test_a_server_of_another_dialect_stops_the_stage_at_once(
    data, tiny_target, tiny_tokenizer
) -> None:
    server = StandIn(tiny_target, tiny_tokenizer, strict=True)
    try:
        cfg = server_run(data, "strict", [server])
        with pytest.raises(ServerError, match="refused a one-token request.*vLLM's"):
            prepare.run(cfg)
    finally:
        server.close()
    assert len(server.requests) == 1 and chunks(cfg) == {}  # no prompt was sent, none dropped
