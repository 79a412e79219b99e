"""Tree-verified decoding on a benchmark -> tau, per-depth acceptance, speedup (`draftsmith eval`).

Vanilla decoding (transformers `generate`), prompt-lookup assisted generation and speculative
decoding run interleaved prompt by prompt in one process (the order rotates per prompt), so the
speedups are ratios measured side by side. Greedy speculative outputs are compared with vanilla
token for token; each divergence is reported with the target's top-2 logit gap where it starts.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith.conf.schema import Config
from draftsmith.conversations import read_conversations
from draftsmith.heads import TargetInfo, TargetParts, load_head
from draftsmith.inference.decoder import DecodeStats, SpecDecoder
from draftsmith.inference.report import write_report, write_sweep_summary
from draftsmith.inference.verify import Sampling
from draftsmith.target import load_target, load_tokenizer, target_name, torch_dtype
from draftsmith.tracking import Tracker


def benchmark_prompts(cfg: Config, tokenizer) -> list[list[int]]:
    """First user turn of each benchmark row, rendered with the target's chat template."""
    source = cfg.eval.benchmark
    if source == "heldout":
        source = f"{cfg.input_dir('prepare')}/heldout.jsonl"
        if not Path(source).exists():
            raise FileNotFoundError(
                f"{source}: run `draftsmith prepare run_name={cfg.run_name}` "
                "first (it writes the held-out conversations)"
            )
    conversations, report = read_conversations(source, limit=cfg.eval.limit)
    if not conversations:
        raise ValueError(f"benchmark {source!r} has no usable prompts ({report.summary()})")
    prompts = []
    for conv in conversations:
        messages = [{"role": "user", "content": conv.user_prompts()[0]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        prompts.append(list(ids))
    return prompts


def _top2_gap(target, sequence: list[int], position: int) -> float:
    """Target logit gap between its top-2 tokens when predicting sequence[position]."""
    with torch.no_grad():
        logits = target(torch.tensor([sequence[:position]])).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def machine_info(cfg: Config) -> dict:
    import transformers

    import draftsmith

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": torch.get_num_threads(),
        "device": cfg.device,
        "dtype": cfg.dtype,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "draftsmith": draftsmith.__version__,
    }


def evaluate(cfg: Config) -> dict:
    """Run the benchmark and return the results dict (also written to disk)."""
    tokenizer = load_tokenizer(cfg.target.path, cfg.target.trust_remote_code)
    target = load_target(cfg.target.path, cfg.dtype, cfg.device, cfg.target.trust_remote_code)
    info = TargetInfo.from_hf_config(target.config, target_name(cfg.target.path))
    head_path = cfg.resolved_head_path()
    head = load_head(head_path, info).to(device=cfg.device, dtype=torch_dtype(cfg.dtype))
    head.bind(TargetParts.from_model(target)).eval()
    decoder = SpecDecoder(target, head, cfg.tree)
    prompts = benchmark_prompts(cfg, tokenizer)
    e = cfg.eval
    sampling = Sampling(e.temperature, e.top_p, e.top_k)
    eos = {tokenizer.eos_token_id}
    gen_kwargs = {
        "max_new_tokens": e.max_new_tokens,
        "do_sample": not sampling.greedy,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    if not sampling.greedy:
        gen_kwargs.update(temperature=e.temperature, top_p=e.top_p, top_k=e.top_k)
    methods = ["speculative", *e.baselines]
    seconds = dict.fromkeys(methods, 0.0)
    tokens = dict.fromkeys(methods, 0)
    stats = DecodeStats()
    mismatches = []
    for index, prompt in enumerate(tqdm(prompts, desc=f"eval {e.benchmark}", unit="prompt")):
        outputs: dict[str, list[int]] = {}
        order = methods[index % len(methods) :] + methods[: index % len(methods)]
        for method in order:
            torch.manual_seed(cfg.seed + index)
            t0 = time.perf_counter()
            if method == "speculative":
                generator = torch.Generator().manual_seed(cfg.seed + index)
                out, prompt_stats = decoder.generate(
                    prompt, e.max_new_tokens, sampling, eos, generator=generator
                )
                stats.add(prompt_stats)
            else:
                target.set_attn_implementation("sdpa")
                extra = {"prompt_lookup_num_tokens": e.lookup_tokens} if method == "lookup" else {}
                ids = torch.tensor([prompt], device=cfg.device)
                with torch.no_grad():
                    out = target.generate(ids, **gen_kwargs, **extra)[0, len(prompt) :].tolist()
            seconds[method] += time.perf_counter() - t0
            tokens[method] += len(out)
            outputs[method] = out
        if (
            sampling.greedy
            and "vanilla" in outputs
            and outputs["speculative"] != outputs["vanilla"]
        ):
            spec, ref = outputs["speculative"], outputs["vanilla"]
            first = next(
                (i for i, (a, b) in enumerate(zip(spec, ref)) if a != b), min(len(spec), len(ref))
            )
            gap = _top2_gap(target, prompt + ref, len(prompt) + first) if first < len(ref) else None
            mismatches.append({"prompt": index, "first_divergence": first, "top2_gap": gap})
    rate = {m: tokens[m] / max(seconds[m], 1e-9) for m in methods}
    results = {
        "machine": machine_info(cfg),
        "target": info.name,
        "head": {"name": head.name, "path": head_path},
        "tree": vars(cfg.tree),
        "eval": vars(e),
        "prompts": len(prompts),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": rate,
        "speedup": {f"vs_{m}": rate["speculative"] / rate[m] for m in e.baselines},
        "tau": stats.tau,
        "depth_acceptance": stats.depth_acceptance(),
        "draft_seconds": stats.draft_seconds,
        "verify_seconds": stats.verify_seconds,
        "verify_forwards": stats.forwards,
        "mismatch": {
            "checked": sampling.greedy and "vanilla" in e.baselines,
            "prompts": len(mismatches),
            "rate": len(mismatches) / len(prompts),
            "details": mismatches,
        },
    }
    return results


def eval_tag(cfg: Config) -> str:
    t = cfg.tree
    tag = cfg.eval.tag or f"{cfg.eval.benchmark}-{t.kind}-d{t.depth}-k{t.top_k}-n{t.total_tokens}"
    return f"{tag}-T{cfg.eval.temperature:g}-{cfg.dtype}"


def run(cfg: Config) -> dict:
    """Stage entry point: evaluate, then write JSON + markdown + plots under runs/<run>/eval/."""
    results = evaluate(cfg)
    out = Path(cfg.stage_dir("eval")) / Path(eval_tag(cfg)).name
    write_report(results, out)
    write_sweep_summary(out.parent)
    if cfg.tracking == "wandb":
        tracker = Tracker(out, "wandb", f"{cfg.run_name}-eval-{out.name}", cfg)
        flat = {
            "tau": results["tau"],
            **{f"speedup/{k}": v for k, v in results["speedup"].items()},
            **{f"tokens_per_second/{k}": v for k, v in results["tokens_per_second"].items()},
            **{f"acceptance/depth_{d + 1}": a for d, a in enumerate(results["depth_acceptance"])},
        }
        tracker.log(flat, 0)
        tracker.artifact(out, f"{cfg.run_name}-eval", kind="results")
        tracker.finish()
    print(json.dumps({k: results[k] for k in ("tau", "speedup", "tokens_per_second")}, indent=2))
    print(f"results: {out}/results.json, {out}/results.md")
    return results
