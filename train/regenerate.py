"""Self-distillation: the target answers every user turn itself.

Multi-turn aware (turn j is answered with the target's own earlier answers in context), batched
(length-sorted, left-padded batches that drop rows as they end; or transformers' `generate` /
continuous batching; or OpenAI-compatible servers running the target: regen_server.py), greedy
or sampled, stopping at EOS. Work is written in chunks of rows (`chunk_00000_<digest>.jsonl`,
atomically); a rerun skips finished chunks. The digest covers the chunk's conversation ids, the
target and the generation settings, so a rerun with other data (limit, seed, chunk_rows) or
settings regenerates instead of reusing stale answers. Rows whose prompt cannot be rendered or is
too long, or whose reply the template cannot write back as the target wrote it, are logged with
the reason and dropped, never silently. A conversation with tool results is answered up to its
first one: the results answer the original calls, not the target's (whose reply there may be a
call of its own, as its template writes it); the turns after it are dropped and counted.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

from draftsmith.conf.schema import RegenConfig
from draftsmith.conversations import Conversation, Turn
from draftsmith.errors import InputError
from draftsmith.files import write_text_atomic
from draftsmith.inference.verify import Sampling, draw, generate_kwargs
from draftsmith.target import cache_kwarg, stop_token_ids
from draftsmith.tokenize import ConversationTokenizer, TemplateError
from draftsmith.train.regen_server import ServerClient, ServerError

# why a reply `ConversationTokenizer.read_reply` cannot read is dropped
UNREADABLE = "the reply is in no form the template writes back (gpt-oss's calls)"


def _sampling(cfg: RegenConfig) -> Sampling:
    return Sampling(cfg.temperature, cfg.top_p, cfg.top_k)


def _generate_kwargs(target, tokenizer, cfg: RegenConfig) -> dict:
    stops = stop_token_ids(target, tokenizer)
    return generate_kwargs(tokenizer, _sampling(cfg), cfg.max_new_tokens, stops)


def _left_padded(target, tokenizer, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), both [B, W]: prompts right-aligned so every row's next token is
    at the same column."""
    device = next(target.parameters()).device
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def _generate_hf(target, tokenizer, prompts: list[list[int]], cfg: RegenConfig) -> list[list]:
    """transformers `generate` over one left-padded batch (every row runs until the last ends)."""
    ids, mask = _left_padded(target, tokenizer, prompts)
    kwargs = _generate_kwargs(target, tokenizer, cfg)
    with torch.no_grad():
        out = target.generate(input_ids=ids, attention_mask=mask, **kwargs)
    return out[:, ids.shape[1] :].tolist()


@torch.no_grad()
def _generate_dropping(target, tokenizer, prompts: list[list[int]], cfg: RegenConfig) -> list:
    """Decode one left-padded batch, dropping each row from the batch and its KV cache as soon
    as it emits EOS. `generate` keeps stepping finished rows until the longest answer ends,
    which made it 1.23x slower on 32 ShareGPT first turns (scripts/bench_data.py)."""
    ids, mask = _left_padded(target, tokenizer, prompts)  # [B, W]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, W]: left pads do not shift positions
    sampling = _sampling(cfg)
    cache = DynamicCache(config=target.config)
    kv = {cache_kwarg(target): cache}
    rows = torch.arange(len(prompts), device=ids.device)  # [b] prompt index of each live row
    answers: list[list[int]] = [[] for _ in prompts]
    stops = torch.tensor(stop_token_ids(target, tokenizer), device=ids.device)  # [s]
    step_ids, step_pos = ids, positions
    for _ in range(cfg.max_new_tokens):
        logits = (
            target(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=step_pos,
                **kv,
                use_cache=True,
                logits_to_keep=1,
            )
            .logits[:, -1]
            .float()
        )  # [b, V]
        if not sampling.greedy:
            token = draw(sampling.probs(logits))  # [b]
        else:
            token = logits.argmax(-1)  # [b]
        for row, t in zip(rows.tolist(), token.tolist()):
            answers[row].append(t)
        # [b]: rows still going
        live = ~torch.isin(token, stops)
        if not live.all():
            keep = live.nonzero().squeeze(1)  # [b']
            if keep.numel() == 0:
                break
            cache.batch_select_indices(keep)
            rows, mask, token = rows[keep], mask[keep], token[keep]
            step_pos = step_pos[keep]
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)  # [b, W + step]
        step_ids, step_pos = token[:, None], step_pos[:, -1:] + 1  # [b, 1]
    return answers


def _generate_continuous(target, tokenizer, prompts: list[list[int]], cfg: RegenConfig) -> list:
    """transformers `generate_batch`: continuous batching, a finished row's slot is refilled at
    once, so no step is spent on rows that already ended (up to batch_size rows at a time)."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    if not prompts:
        return []
    # a KV cache for the rows in flight: left to itself, transformers sizes it by 60% of the
    # machine's RAM on CPU (14 GiB here, whatever else runs: beside other processes, an OOM kill)
    config = ContinuousBatchingConfig(
        max_requests_per_batch=cfg.batch_size, max_batch_tokens=cfg.max_batch_tokens
    )
    pages = -(-(max(map(len, prompts)) + cfg.max_new_tokens) // config.page_size)  # per row
    config.num_blocks = min(cfg.batch_size, len(prompts)) * pages
    with torch.no_grad():
        results = target.generate_batch(
            prompts,
            generation_config=GenerationConfig(**_generate_kwargs(target, tokenizer, cfg)),
            continuous_batching_config=config,
        )
    outputs = list(results.values())  # generate_batch returns them in input order
    failed = [o.request_id for o in outputs if o.error is not None]
    if len(outputs) != len(prompts) or failed:
        raise RuntimeError(
            f"continuous batching returned {len(outputs)}/{len(prompts)} answers, failed: "
            f"{failed[:5]}; retry with data.regen.engine=padded"
        )
    return [o.generated_tokens for o in outputs]


def generate_answers(
    target, tokenizer, prompts: list[list[int]], cfg: RegenConfig, progress: tqdm | None = None
) -> list[list]:
    """New tokens for every prompt, cut before the first stop id (target.stop_token_ids);
    `progress` advances by answered prompts."""
    batched = {"padded": _generate_dropping, "generate": _generate_hf}
    if cfg.engine == "continuous":
        rows = _generate_continuous(target, tokenizer, prompts, cfg)
        if progress is not None:
            progress.update(len(prompts))
    elif cfg.engine in batched:
        rows = []
        for start in range(0, len(prompts), cfg.batch_size):
            chunk = prompts[start : start + cfg.batch_size]
            rows += batched[cfg.engine](target, tokenizer, chunk, cfg)
            if progress is not None:
                progress.update(len(chunk))
    else:
        raise InputError(f"data.regen.engine={cfg.engine!r} decodes no token ids in process")
    stops = set(stop_token_ids(target, tokenizer))
    return [row[: _first_stop(row, stops)] for row in rows]


def answer_texts(
    target,
    renderer: ConversationTokenizer,
    prompts: list[list[int]],
    cfg: RegenConfig,
    progress: tqdm | None = None,
) -> tuple[list[str | ServerError | None], int]:
    """Every prompt's answer as a message's text (or the error a server refused it with, or
    None: a reply the template cannot write back, `ConversationTokenizer.read_reply`) and the
    new tokens, from the engine `cfg` names."""
    tokenizer = renderer.tokenizer
    if cfg.engine == "server":
        # with their special tokens where the template's format writes reasoning in them
        client = ServerClient(cfg, stop_token_ids(target, tokenizer), renderer.reads_thinking)
        answers, produced = client.answers(prompts, progress)
        read = renderer.read_reply
        return [a if isinstance(a, ServerError) else read(a) for a in answers], produced
    answers = generate_answers(target, tokenizer, prompts, cfg, progress)
    return [renderer.reply_text(answer) for answer in answers], sum(map(len, answers))


def _first_stop(row: list[int], stops: set[int]) -> int:
    """Index of the first stop id in `row`, or len(row)."""
    return next((i for i, token in enumerate(row) if token in stops), len(row))


def regenerate_chunk(
    target,
    tokenizer,
    renderer: ConversationTokenizer,
    conversations: list[Conversation],
    cfg: RegenConfig,
    failures: list[str],
) -> tuple[list[Conversation], int]:
    """Answer every user turn of every conversation; returns (new conversations, new tokens)."""
    # keep system and user turns up to the first tool result; assistant turns are rewritten
    work = [[t for t in _before_tool_results(c) if t.role != "assistant"] for c in conversations]
    done: list[list[Turn]] = [[] for _ in conversations]
    cursor = [0] * len(conversations)  # next turn of `work[i]` to copy
    alive = set(range(len(conversations)))
    produced = 0
    # user turns is an upper bound: turns past a too-long prompt are never answered
    user_turns = sum(t.role == "user" for turns in work for t in turns)
    bar = tqdm(total=user_turns, desc="answer turns", unit="turn", leave=False)
    while alive:
        pending = []  # (row, prompt ids) of rows that still have a user turn to answer
        for i in sorted(alive):
            turns = work[i]
            while cursor[i] < len(turns) and turns[cursor[i]].role != "user":
                done[i].append(turns[cursor[i]])
                cursor[i] += 1
            if cursor[i] >= len(turns):
                alive.discard(i)
                continue
            done[i].append(turns[cursor[i]])
            cursor[i] += 1
            messages = [t.to_message() for t in done[i]]
            try:
                prompt = renderer.prompt_ids(messages, conversations[i].tools)
            except TemplateError as err:
                failures.append(f"{conversations[i].label}: {err}")
                alive.discard(i)
                done[i] = []
                continue
            if len(prompt) > cfg.max_prompt_len:
                failures.append(
                    f"{conversations[i].label}: prompt of {len(prompt)} tokens > "
                    f"max_prompt_len {cfg.max_prompt_len}"
                )
                alive.discard(i)
                done[i] = done[i][:-1]  # keep the turns answered so far
                continue
            pending.append((i, prompt))
        pending.sort(key=lambda item: len(item[1]))  # length buckets: little padding per batch
        answers, tokens = answer_texts(target, renderer, [p for _, p in pending], cfg, bar)
        produced += tokens
        for (i, _), answer in zip(pending, answers):
            if answer is None or isinstance(answer, ServerError):  # as a prompt too long
                why = UNREADABLE if answer is None else f"server refused the prompt: {answer}"
                failures.append(f"{conversations[i].label}: {why}")
                alive.discard(i)
                done[i] = done[i][:-1]
                continue
            done[i].append(Turn("assistant", answer))
    bar.close()
    result = [
        Conversation(c.id, turns, tools=c.tools, where=c.where)
        for c, turns in zip(conversations, done)
        if any(t.role == "assistant" for t in turns)
    ]
    return result, produced


def _before_tool_results(conversation: Conversation) -> list[Turn]:
    """The turns before the conversation's first tool result (all of them if it has none)."""
    turns = conversation.turns
    return turns[: next((i for i, t in enumerate(turns) if t.role == "tool"), len(turns))]


def chunk_path(
    folder: Path,
    index: int,
    chunk: list[Conversation],
    target,
    cfg: RegenConfig,
    template_kwargs: dict | None = None,
    template: str | None = None,
) -> Path:
    """Where chunk `index` lives; the name changes whenever its inputs do (see module doc),
    `template_kwargs` (target.chat_template_kwargs) and `template` (target.chat_template's
    digest), which change the prompts, included."""
    settings = (cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.max_prompt_len)
    # each only when set, so chunks written before it existed keep their names
    if cfg.top_k:
        settings += (cfg.top_k,)
    if template_kwargs:
        settings += (json.dumps(template_kwargs, sort_keys=True),)
    if template:
        settings += (template,)
    key = [getattr(target.config, "_name_or_path", ""), *map(str, settings), *(c.id for c in chunk)]
    digest = hashlib.sha256("\n".join(key).encode()).hexdigest()[:12]
    return folder / f"chunk_{index:05d}_{digest}.jsonl"


def regenerate(
    target,
    tokenizer,
    renderer: ConversationTokenizer,
    conversations: list[Conversation],
    cfg: RegenConfig,
    folder: Path,
    template: str | None = None,
) -> list[Conversation]:
    """Resumable regeneration into `folder/chunk_*.jsonl`; returns all regenerated conversations
    (`template`: target.chat_template's digest, if set)."""
    folder.mkdir(parents=True, exist_ok=True)
    chunks = [
        conversations[i : i + cfg.chunk_rows] for i in range(0, len(conversations), cfg.chunk_rows)
    ]
    out: list[Conversation] = []
    where = {c.id: c.where for c in conversations}  # read back from a chunk: named as read
    failures: list[str] = []
    tokens, seconds = 0, 0.0
    for index, chunk in enumerate(tqdm(chunks, desc="regenerate", unit="chunk")):
        path = chunk_path(folder, index, chunk, target, cfg, renderer.template_kwargs, template)
        if not path.exists():
            t0 = time.perf_counter()
            new, produced = regenerate_chunk(target, tokenizer, renderer, chunk, cfg, failures)
            seconds += time.perf_counter() - t0
            tokens += produced
            write_text_atomic(path, "".join(json.dumps(c.to_row()) + "\n" for c in new))
        for line in path.read_text().splitlines():
            row = json.loads(line)  # as Conversation.to_row wrote it
            turns = [Turn(**message) for message in row["messages"]]
            out.append(
                Conversation(row["id"], turns, tools=row.get("tools"), where=where[row["id"]])
            )
    # answered up to their first tool result, the turns after it dropped (module doc)
    cut = sum(len(_before_tool_results(c)) < len(c.turns) for c in conversations)
    stats = {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / max(seconds, 1e-9),
        "failures": failures,
        "cut_at_tool_results": cut,
    }
    with open(folder / "stats.jsonl", "a") as f:
        f.write(json.dumps(stats) + "\n")
    if failures:
        print(f"regenerate: {len(failures)} rows skipped or cut short, e.g. {failures[:3]}")
    if cut:
        print(f"regenerate: {cut} conversations answered up to their first tool result")
    return out
