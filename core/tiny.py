"""A deterministic tiny random Llama target (or another architecture, for tests) with a real
byte-level tokenizer and a ChatML template.

Tests and smoke runs use it so the whole pipeline runs in seconds with no hub access:
`target=tiny-random-llama`. The folder is built once from a seed into the cache and is
byte-for-byte the same on every machine with the same torch version.
"""

from __future__ import annotations

from pathlib import Path

from filelock import FileLock

from draftsmith.files import staged_dir

TINY_NAME = "tiny-random-llama"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, as SmolLM2 renders it (without the default system prompt, to keep sequences short).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_byte_tokenizer(chat_template: str | None = CHATML_TEMPLATE):
    """A real fast tokenizer: 256 byte-level tokens + 3 specials (ids 0-2, as in SmolLM2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def build_tiny_target(
    out_dir: str | Path,
    seed: int = 0,
    num_layers: int = 4,
    hidden_size: int = 64,
    chat_template: str | None = CHATML_TEMPLATE,
    architecture: str = "Llama",
    **config_overrides,
) -> Path:
    """Write a seeded random causal LM + tokenizer to `out_dir` and return it: a Llama, or
    another transformers `architecture` of the same size (e.g. "Mistral", "Gemma3Text":
    `<architecture>Config`, built by AutoModelForCausalLM) with `config_overrides` (e.g. a
    sliding window), for the tests that decode other model families."""
    import torch
    import transformers

    from draftsmith.target import auto_model_class

    tokenizer = build_byte_tokenizer(chat_template)
    sizes = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    config = getattr(transformers, f"{architecture}Config")(**(sizes | config_overrides))
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = auto_model_class(config).from_config(config)
    # Larger-than-default init so the tiny model has peaked, non-degenerate next-token
    # distributions (near-uniform logits would make greedy decoding full of ties).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
        model.get_output_embeddings().weight.normal_(0.0, 0.35)
    torch.random.set_rng_state(generator_state)
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def tiny_target_path() -> Path:
    """The cached default tiny target, built on first use (locked, atomic)."""
    from draftsmith.assets import cache_root

    # The version suffix invalidates old cached builds when the recipe above changes.
    final = cache_root() / f"{TINY_NAME}-v1"
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if (final / "config.json").exists() and (final / "model.safetensors").exists():
            return final
        with staged_dir(final) as build:
            build_tiny_target(build)
    return final
