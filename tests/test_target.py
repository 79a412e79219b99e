"""Target loading: the tiny random target is deterministic and real; missing assets name the fix."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from draftsmith.assets import AssetError
from draftsmith.errors import InputError
from draftsmith.features import FeatureCapture
from draftsmith.target import compile_target, load_target, load_tokenizer
from draftsmith.tiny import TINY_NAME, tiny_target_path
from draftsmith.train.engine import init_distributed


def test_tiny_target_is_deterministic(make_tiny, tiny_target_dir: Path) -> None:
    a, b = make_tiny(), make_tiny()
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() == (
        tiny_target_dir / "model.safetensors"
    ).read_bytes()


def test_a_target_without_sdpa_attention_loads_with_eager(make_tiny) -> None:
    # Gemma 2 softcaps its attention logits, which transformers runs eagerly only
    target = load_target(str(make_tiny(architecture="Gemma2", head_dim=16)))
    assert target.config._attn_implementation == "eager"


def test_an_image_text_target_loads_with_its_processors_template(make_tiny) -> None:
    """Qwen2.5-VL: transformers builds no causal LM of it, so the image-text model is the
    target; its template is in the processor's chat_template.json, which its tokenizer does
    not load."""
    from test_speculative import ARCHITECTURES

    from draftsmith.tiny import CHATML_TEMPLATE

    config = ARCHITECTURES["Qwen2_5_VL"]
    folder = make_tiny(architecture="Qwen2_5_VL", chat_template=None, **config)
    assert load_tokenizer(str(folder)).chat_template is None
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": CHATML_TEMPLATE}))
    assert load_tokenizer(str(folder)).chat_template == CHATML_TEMPLATE
    assert type(load_target(str(folder))).__name__ == "Qwen2_5_VLForConditionalGeneration"


@pytest.mark.parametrize("architecture", ["Llama", "Granite", "Gemma2", "GPT2", "Gemma3"])
def test_a_target_loads_without_its_layers(
    make_tiny, architecture: str, caplog, monkeypatch
) -> None:
    """Training on collected features reads the target's embeddings, final norm and lm_head
    only: built without its layers (a logit scale, a softcap, GPT-2's names, an image-text
    model), the target keeps the checkpoint's tensors, its own forward passes the parts' logit
    check, they give the whole model's logits, and transformers warns of none of the skipped
    layer tensors."""
    from test_speculative import ARCHITECTURES

    from draftsmith.features import decoder_layers
    from draftsmith.heads import TargetParts

    folder = str(make_tiny(architecture=architecture, **ARCHITECTURES.get(architecture, {})))
    whole = load_target(folder)
    # transformers' loggers write through its own handler, bound to the stderr of import time
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)
    ends = load_target(folder, layers=False)
    assert caplog.records == []
    assert len(decoder_layers(ends)) == 0 and len(decoder_layers(whole)) == 4
    parts = TargetParts.from_model(ends).check(ends)
    hidden = torch.randn(2, 5, whole.get_input_embeddings().embedding_dim)  # [B, T, H]
    torch.testing.assert_close(parts.logits(hidden), TargetParts.from_model(whole).logits(hidden))


def test_a_target_missing_a_tensor_loads_whole_when_asked_without_layers(make_tiny) -> None:
    """A checkpoint lacking (under the names transformers looks for) a tensor the model keeps
    loads whole, with transformers' own report of it (here its lm_head, which it initialises
    at random), rather than without its layers."""
    from safetensors.torch import load_file, save_file

    from draftsmith.features import decoder_layers

    folder = str(make_tiny())
    weights = load_file(f"{folder}/model.safetensors")
    weights["renamed"] = weights.pop("lm_head.weight")
    save_file(weights, f"{folder}/model.safetensors", metadata={"format": "pt"})
    assert len(decoder_layers(load_target(folder, layers=False))) == 4


def test_tiny_target_loads_with_chat_template(tiny_target, tiny_tokenizer) -> None:
    text = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "héllo"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n"
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tiny_tokenizer.decode(ids) == text
    assert not any(p.requires_grad for p in tiny_target.parameters())
    with torch.no_grad():
        logits = tiny_target(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tiny_tokenizer))
    # peaked, non-degenerate next-token distributions (few greedy ties)
    assert logits.softmax(-1).max(-1).values.mean() > 0.05


@pytest.mark.parametrize("batch", [1, 3])
def test_lm_head_reads_row_major_rows(tiny_target, batch: int) -> None:
    """generate()'s prefill slices hidden[:, -1:] for the lm_head; that view keeps the parent's
    strides (non-contiguous for batch > 1, "contiguous" but not row-major for batch 1), and
    torch's bf16 matmul with a frozen weight then takes a path ~20x slower."""
    seen = []
    head = tiny_target.get_output_embeddings()
    handle = head.register_forward_hook(lambda m, args, out: seen.append(args[0].stride()))
    try:
        ids = torch.randint(3, 200, (batch, 7))
        with torch.no_grad():
            last = tiny_target(ids, logits_to_keep=1).logits  # [B, 1, V]
            full = tiny_target(ids).logits  # [B, 7, V]
    finally:
        handle.remove()
    hidden = tiny_target.config.hidden_size
    assert seen == [(hidden, hidden, 1), (7 * hidden, hidden, 1)]
    torch.testing.assert_close(last[:, 0], full[:, -1])


def test_uncached_asset_names_the_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    with pytest.raises(AssetError, match="draftsmith assets fetch smollm2-135m-instruct"):
        load_target("smollm2-135m-instruct")
    with pytest.raises(AssetError, match="data, not a target"):
        load_tokenizer("sharegpt")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine reaches device=cuda")
def test_an_unreachable_cuda_device_names_the_setting() -> None:
    with pytest.raises(InputError, match=r"device=cuda: torch .* sees 0 CUDA devices.*device=cpu"):
        load_target("tiny-random-llama", device="cuda")
    with pytest.raises(InputError, match=r"device=cuda:0: torch .* sees 0 CUDA devices"):
        init_distributed("cuda")  # training's first step, before any target loads


def test_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    """A target folder that is not there, or not a whole checkpoint, is named with what is
    wrong."""
    with pytest.raises(AssetError, match="could not load target .*: no such folder"):
        load_target(str(tmp_path / "nowhere"))
    # the tokenizer, which the eval loads first, said "Repo id must be in the form ..."
    with pytest.raises(AssetError, match="could not load target .*: no such folder"):
        load_tokenizer(str(tmp_path / "nowhere"))
    # a folder missing the weights: what it lacks, not "not a local folder ... the hub"
    folder = tmp_path / "no_weights"
    shutil.copytree(tiny_target_path(), folder, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(AssetError, match=r"no_weights' from its folder: .*no file named model"):
        load_target(str(folder))


def test_compiled_target_captures_the_layers_each_head_asks_for() -> None:
    """A compiled target keeps its forward hooks honest: an EAGLE-3 head hooking other layers
    after an EAGLE-1 head still reads its own layers (dynamo recompiles instead of replaying the
    first head's graph), with the same features as the eager target."""
    eager, compiled = load_target(TINY_NAME), load_target(TINY_NAME)
    compile_target(compiled)
    for aux_layers, length in (([], 7), ([1], 9), ([1], 11), ([], 5)):
        ids = torch.randint(0, 200, (1, length))
        seen = []
        for model in (eager, compiled):
            with torch.no_grad(), FeatureCapture(model, aux_layers) as capture:
                model(input_ids=ids)
                seen.append((capture.hidden, capture.aux))
        (hidden, aux), (hidden_c, aux_c) = seen
        torch.testing.assert_close(hidden_c, hidden)
        if aux_layers:
            torch.testing.assert_close(aux_c, aux)


def test_checkpoint_generation_defaults_are_not_applied(make_tiny, tiny_target_dir: Path) -> None:
    """A checkpoint's generation_config.json (here a repetition penalty, an n-gram ban and
    sampling defaults, as Qwen2.5 and others ship) does not change how transformers' generate
    decodes the loaded target: the baselines and regeneration decode as the speculative decoder
    does, plain greedy unless draftsmith's own sampling keys say otherwise."""
    import json

    from draftsmith.inference.verify import Sampling, generate_kwargs

    folder = make_tiny()
    config = folder / "generation_config.json"
    settings = json.loads(config.read_text()) if config.exists() else {}
    settings |= {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "do_sample": True}
    settings |= {"temperature": 0.6, "top_k": 20}
    config.write_text(json.dumps(settings))
    tokenizer = load_tokenizer(str(folder))
    ids = torch.tensor([[5, 6, 7, 8]])
    models = [load_target(str(path)) for path in (folder, tiny_target_dir)]
    kwargs = generate_kwargs(tokenizer, Sampling(), 30, [tokenizer.eos_token_id])
    outputs = [m.generate(ids, **kwargs) for m in models]
    assert outputs[0].tolist() == outputs[1].tolist()
    # the special tokens stay
    assert models[0].generation_config.eos_token_id == tokenizer.eos_token_id


def test_timed_decodes_of_a_compiled_target_never_compile() -> None:
    """Inside the eval's timed decodes a call pattern the warm-up did not meet runs eagerly (no
    new graph, so no minutes of compiling billed to one method), with the eager outputs."""
    from torch._dynamo.utils import counters

    from draftsmith.inference.eval import _no_compiling

    eager, compiled = load_target(TINY_NAME), load_target(TINY_NAME)
    compile_target(compiled)
    ids = torch.randint(0, 200, (1, 6))
    with torch.no_grad():
        compiled(input_ids=ids, use_cache=False)  # the warm-up's pattern
        graphs = counters["stats"]["unique_graphs"]
        with _no_compiling(True):
            unseen = compiled(input_ids=ids, use_cache=True, output_hidden_states=True)
        assert counters["stats"]["unique_graphs"] == graphs
        torch.testing.assert_close(unseen.logits, eager(input_ids=ids).logits)
        compiled(input_ids=ids, use_cache=True, output_hidden_states=True)  # outside: compiles
    assert counters["stats"]["unique_graphs"] > graphs
