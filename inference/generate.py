"""One prompt decoded speculatively, streamed as it is verified (`draftsmith generate`).

    draftsmith generate run_name=quick generate.prompt="Name three prime numbers."
    draftsmith generate run_name=quick 'generate.prompt="Hi, who are you?"' generate.compare=true
    cat question.txt | draftsmith generate head_path=exported/native generate.prompt=-

(Hydra reads an unquoted comma as a list, so a prompt holding one is quoted once more inside the
override, or piped in with `generate.prompt=-`.)

The prompt becomes the first user turn of a new chat (the target's chat template); this run's
head (or `head_path`) drafts with the `tree` settings, on the target exactly as `draftsmith eval`
decodes (dtype, packed weights, `eval.draft_vocab_size`). Text is printed as each verification
step commits it, then the tokens, tau and tokens/s. `generate.compare=true` also decodes with the
target alone (transformers `generate`, the same sampling) for its speed next to the speculative
one and, at temperature 0, says whether the two outputs are identical. `generate.system` and
`generate.tools` (function schemas) go in the prompt as a served request has them. One prompt is an
illustration, not a benchmark: `draftsmith eval` measures tau and speedups over a benchmark,
interleaved.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import torch
from transformers import TextStreamer

from draftsmith.conf.schema import Config
from draftsmith.conversations import RowError, parse_tools
from draftsmith.errors import InputError, MissingInput
from draftsmith.inference.decoder import DecodeStats, SpecDecoder
from draftsmith.inference.eval import first_divergence
from draftsmith.inference.loading import decoding_head, decoding_target, draft_vocabulary
from draftsmith.inference.prompts import chat_prompt
from draftsmith.inference.verify import Sampling, generate_kwargs
from draftsmith.target import stop_token_ids, target_tokenizer


class TextStream(TextStreamer):
    """transformers' TextStreamer (it holds back text a later token may still change, such as
    an unfinished multi-byte character) writing to `out` instead of stdout; `put` takes the
    decoder's chunks of token ids."""

    def __init__(self, tokenizer, out: TextIO) -> None:
        super().__init__(tokenizer, skip_special_tokens=True)
        self.out = out

    def __call__(self, tokens: list[int]) -> None:
        self.put(torch.tensor(tokens))

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.out.write(text + ("\n" if stream_end else ""))
        self.out.flush()


def read_tools(value: str) -> list[dict] | None:
    """`generate.tools`: function schemas from the JSON text itself (it opens with `[` or `{`,
    and is told from a path by that, as target.chat_template's text by its tags: a long text
    is no valid file name), or from the JSON file it names."""
    if not value:
        return None
    text = value
    if not value.lstrip().startswith(("[", "{")):
        path = Path(value).expanduser()
        if not path.is_file():
            raise MissingInput(f"generate.tools={value!r}: no such file (or JSON text)")
        text = path.read_text()
    try:
        return parse_tools(text)
    except RowError as error:
        raise InputError(f"generate.tools={value!r}: {error} (a JSON file or text)") from None


def run(cfg: Config, out: TextIO | None = None) -> dict:
    """Decode `generate.prompt`, stream it to `out` (stdout); returns the text, token ids and
    measures."""
    out = out or sys.stdout  # looked up per call: a redirected stdout is the one written to
    g = cfg.generate
    text = sys.stdin.read().strip() if g.prompt == "-" else g.prompt
    if not text.strip():
        raise InputError(
            'generate.prompt is empty: pass generate.prompt="your message" (quoted again '
            "for Hydra if it holds a comma), or generate.prompt=- to read it from stdin"
        )
    cfg.tree.refuse_drawn(g.temperature)  # before the target loads, as eval
    tokenizer = target_tokenizer(cfg.target)
    target, info, parts, _ = decoding_target(cfg)
    head, _ = decoding_head(cfg, cfg.resolved_head_path(), info, parts)
    # as eval decodes it: a head drafting through the target's lm_head may be cut to the most
    # frequent answer tokens (eval.draft_vocab_size; the config refuses it for other heads)
    vocab = draft_vocabulary(cfg, info)  # [Vd] target ids, or None
    decoder = SpecDecoder(target, head, cfg.tree, vocab)
    sampling = Sampling(g.temperature, g.top_p, g.top_k)
    system = [{"role": "system", "content": g.system}] if g.system else None
    tools = read_tools(g.tools)
    kwargs = cfg.target.chat_template_kwargs
    template = cfg.data.template
    prompt = chat_prompt(tokenizer, text, system, kwargs, tools, template)
    # a template that leaves the tools out would have the target answer without them, silently
    if tools and prompt == chat_prompt(tokenizer, text, system, kwargs, None, template):
        raise InputError(
            f"generate.tools={g.tools!r}: the chat template does not render tools "
            "(target.chat_template=<file> can give one that does)"
        )
    stops = stop_token_ids(target, tokenizer)
    ids = torch.tensor([prompt], device=cfg.device)

    def speculative(
        max_new_tokens: int, stream: Callable[[list[int]], None] | None = None
    ) -> tuple[list[int], DecodeStats]:
        generator = torch.Generator().manual_seed(cfg.seed)
        return decoder.generate(prompt, max_new_tokens, sampling, stops, stream, generator)

    def plain(max_new_tokens: int) -> list[int]:
        torch.manual_seed(cfg.seed)
        kwargs = generate_kwargs(tokenizer, sampling, max_new_tokens, stops)
        with torch.no_grad():
            return target.generate(ids, **kwargs)[0, len(prompt) :].tolist()

    if g.compare:  # the first forwards of a model pay one-off costs (oneDNN kernel choice)
        speculative(4)
        plain(4)
    stream = TextStream(tokenizer, out)
    t0 = time.perf_counter()
    tokens, stats = speculative(g.max_new_tokens, stream)
    seconds = time.perf_counter() - t0
    stream.end()
    own_vocab = head.own_vocab_size  # EAGLE-3's; None for a head drafting from the target's
    result = {
        "prompt": prompt,  # token ids, as the chat template rendered them
        "text": tokenizer.decode(tokens, skip_special_tokens=True),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": len(tokens) / seconds,
        "tau": stats.tau,
        "depth_acceptance": stats.depth_acceptance(),
        "draft_vocab_size": 0 if vocab is None else vocab.numel(),
        "head_draft_vocab_size": own_vocab,  # as eval's results.json head entry
        "nodes_per_forward": stats.nodes_per_forward,
    }
    own = f" with its own {own_vocab}-token draft vocabulary" if own_vocab else ""
    extra = "" if vocab is None else f", drafting over {vocab.numel()} tokens"
    if cfg.tree.adaptive:
        extra += f", adaptive: {result['nodes_per_forward']:.1f} nodes per forward"
    lines = [
        f"{len(tokens)} tokens in {seconds:.2f} s ({result['tokens_per_second']:.1f} tokens/s), "
        f"tau {stats.tau:.2f} over {stats.forwards} verification forwards ({head.name} head"
        f"{own}, {cfg.tree.kind} tree, {cfg.dtype}{extra})"
    ]
    if g.compare:
        t0 = time.perf_counter()
        reference = plain(g.max_new_tokens)
        vanilla_seconds = time.perf_counter() - t0
        rate = len(reference) / vanilla_seconds
        result.update(vanilla_tokens=reference, vanilla_tokens_per_second=rate)
        lines.append(
            f"target alone: {len(reference)} tokens at {rate:.1f} tokens/s; speculative "
            f"{result['tokens_per_second'] / rate:.2f}x"
        )
        if sampling.greedy:
            result["identical"] = tokens == reference
            lines.append(_agreement(tokens, reference, cfg.dtype))
    out.write("\n".join(lines) + "\n")
    return result


def _agreement(tokens: list[int], reference: list[int], dtype: str) -> str:
    if tokens == reference:
        return "identical to the target's own greedy output"
    note = (
        " (in float32 this is a bug: please report it)"
        if dtype == "float32"
        else f" ({dtype}: a near-tie of the target's top-2 logits can flip)"
    )
    first = first_divergence(tokens, reference)  # where one differs, or the shorter one ends
    return f"differs from the target's own greedy output at token {first}{note}"
