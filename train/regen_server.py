"""Regeneration by OpenAI-compatible servers that run the target (`data.regen.engine=server`): vLLM,
SGLang or TensorRT-LLM's `trtllm-serve`, as SpecForge's and speculators' regeneration scripts use
them, for targets and datasets one process would take days over.

Prompts go to `/v1/completions` as token ids, rendered here with the chat template the loss masks
are built with, so a server's own template (or a thinking-mode default) cannot change what the
target is asked. Every sampling key is sent, neutral ones too: vLLM fills keys a request leaves out
from the checkpoint's generation_config.json (a repetition penalty, a top-k), which the in-process
engines drop as well (draftsmith.target). Batches of `batch_size` prompts are spread round-robin
over `data.regen.servers`, two requests in flight per server. A request that fails (no connection,
a 5xx, a timeout) is retried with backoff, then the stage stops naming the server (finished chunks
stay; the same command continues). A server's first request is a one-token one: a server that
refuses it (another dialect, a wrong model name) stops the stage at once. Then a batch a server
rejects (4xx: a prompt past its context length, say) is retried prompt by prompt, so only the
prompts it refuses are dropped, each logged with the server's reason. The target's weights are
never loaded for this engine: its name and stop ids come from its config files (`served_target`).
"""

from __future__ import annotations

import functools
import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from draftsmith.conf.schema import RegenConfig
from draftsmith.errors import InputError
from draftsmith.target import resolve_target_path, special_tokens_only

RETRIES = 3  # after the first attempt, waiting 1, 2, 4 s


class ServerError(InputError):
    """A server refused a request (`status`, its reply) or never answered it (status None)."""

    def __init__(self, url: str, status: int | None, reason: str) -> None:
        self.status, self.reply = status, f"{f'HTTP {status}: ' if status else ''}{reason}"
        super().__init__(f"{url}: {self.reply}")

    @property
    def refused(self) -> bool:
        """The server answered that this request cannot be served (4xx): retrying is futile."""
        return self.status is not None and 400 <= self.status < 500


@dataclass
class ServedTarget:
    """What regeneration reads of a target that servers run: its config (`_name_or_path` names
    the chunks) and generation config (stop ids)."""

    config: Any
    generation_config: Any


def served_target(
    name_or_path: str, trust_remote_code: bool = False, revision: str | None = None
) -> ServedTarget:
    from transformers import AutoConfig, GenerationConfig

    path = resolve_target_path(name_or_path, revision)
    config = AutoConfig.from_pretrained(
        path, trust_remote_code=trust_remote_code, revision=revision
    )
    try:
        generation = GenerationConfig.from_pretrained(path, revision=revision)
    except OSError:  # no generation_config.json: the model config's special tokens
        generation = GenerationConfig.from_model_config(config)
    return ServedTarget(config, special_tokens_only(generation))


def _request(url: str, payload: dict | None, timeout: float) -> dict:
    """POST `payload` (GET without one) as JSON; the reply's JSON. Sends $OPENAI_API_KEY as a
    bearer token when set (`vllm serve --api-key`)."""
    headers = {"Content-Type": "application/json"}
    if os.environ.get("OPENAI_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data, headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as err:
        raise ServerError(url, err.code, err.read().decode(errors="replace")[:500]) from None
    except (urllib.error.URLError, OSError, json.JSONDecodeError) as err:
        raise ServerError(url, None, str(getattr(err, "reason", err))) from None


@functools.lru_cache
def _served_model(server: str, timeout: float) -> str:
    """The first model a server lists (`/v1/models`): what it runs when it runs one."""
    models = _request(f"{server}/models", None, timeout).get("data") or []
    if not models:
        raise ServerError(f"{server}/models", None, "lists no model; set data.regen.server_model")
    return models[0]["id"]


# (server, server_model) -> the model name requests use, once a one-token request passed
_READY: dict[tuple[str, str | None], str] = {}


class ServerClient:
    def __init__(self, cfg: RegenConfig, stop_ids: list[int], special_tokens: bool = False) -> None:
        self.cfg, self.stop_ids = cfg, stop_ids
        self.special_tokens = special_tokens  # answers keep them (gpt-oss's reasoning format)
        self.servers = [s.rstrip("/") for s in cfg.servers]

    def _model(self, server: str) -> str:
        """The server's name for the target. The first time, a one-token request checks that
        the server takes these requests at all (vLLM's dialect of /v1/completions: token-id
        prompts, top_k, stop_token_ids, ...), so a server that does not stops the stage at once
        instead of refusing every prompt one by one."""
        key = (server, self.cfg.server_model)
        if key not in _READY:
            model = self.cfg.server_model or _served_model(server, self.cfg.server_timeout)
            try:
                self._post(server, self._payload(model, [self.stop_ids[:1]], max_tokens=1))
            except ServerError as err:
                if not err.refused:  # down or failing: said as it is
                    raise
                raise ServerError(
                    f"{server}/completions",
                    None,
                    f"refused a one-token request ({err.reply}); the server engine speaks vLLM's "
                    "/v1/completions (token-id prompts, top_k, stop_token_ids), as vLLM, SGLang "
                    "and trtllm-serve do",
                ) from None
            _READY[key] = model
        return _READY[key]

    def _payload(self, model: str, prompts: list[list[int]], max_tokens: int | None = None) -> dict:
        c = self.cfg
        return {
            "model": model,
            "prompt": prompts,
            "max_tokens": max_tokens or c.max_new_tokens,
            "temperature": c.temperature,
            "top_p": c.top_p,
            "top_k": c.top_k or -1,  # -1: no top-k (vLLM, SGLang)
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "stop_token_ids": self.stop_ids,
            "skip_special_tokens": not self.special_tokens,
        }

    def _post(self, server: str, payload: dict) -> dict:
        """A completions request, retried while the failure may pass (not a refusal)."""
        url, timeout = f"{server}/completions", self.cfg.server_timeout
        for attempt in range(RETRIES):
            try:
                return _request(url, payload, timeout)
            except ServerError as err:
                if err.refused:
                    raise
                time.sleep(2**attempt)
        return _request(url, payload, timeout)  # the last attempt: its failure stops the stage

    def _complete(self, server: str, prompts: list[list[int]]) -> tuple[list[str], int]:
        """Answers in prompt order and the new tokens."""
        url = f"{server}/completions"
        reply = self._post(server, self._payload(self._model(server), prompts))
        choices = sorted(reply.get("choices", []), key=lambda c: c["index"])
        if [c["index"] for c in choices] != list(range(len(prompts))):
            raise ServerError(url, None, f"{len(choices)} answers to {len(prompts)} prompts")
        produced = (reply.get("usage") or {}).get("completion_tokens", 0)  # null on some servers
        return [c["text"] for c in choices], produced

    def _batch(self, server: str, prompts: list[list[int]]) -> tuple[list, int]:
        """`_complete`, and a refused batch prompt by prompt: each answer, or the error that
        refused that prompt."""
        try:
            return self._complete(server, prompts)
        except ServerError as err:
            if not err.refused:
                raise
            if len(prompts) == 1:
                return [err], 0
        answers, produced = [], 0
        for prompt in prompts:
            [answer], n = self._batch(server, [prompt])
            answers.append(answer)
            produced += n
        return answers, produced

    def answers(
        self, prompts: list[list[int]], progress: tqdm | None = None
    ) -> tuple[list[str | ServerError], int]:
        """Every prompt's answer (or the server's refusal) and the new tokens, in prompt order."""
        size = self.cfg.batch_size
        batches = [prompts[i : i + size] for i in range(0, len(prompts), size)]
        answers: list[str | ServerError] = []
        produced = 0
        with ThreadPoolExecutor(max_workers=2 * len(self.servers)) as pool:
            pending = [
                pool.submit(self._batch, self.servers[k % len(self.servers)], batch)
                for k, batch in enumerate(batches)
            ]
            for future, batch in zip(pending, batches):
                done, n = future.result()
                answers += done
                produced += n
                if progress is not None:
                    progress.update(len(batch))
        return answers, produced
