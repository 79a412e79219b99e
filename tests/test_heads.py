"""Draft heads: shapes and parameter counts, gradients, masks, golden values, TTT == drafting,
vocab mapping, persistence and target checks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from draftsmith.features import extract_features
from draftsmith.heads import HEADS, HeadBatch, TargetInfo, TargetParts, build_head, load_head
from draftsmith.heads.base import predicts_assistant_token, shifted
from draftsmith.heads.eagle3 import default_aux_layers
from draftsmith.heads.vocab import build_vocab_mapping, count_tokens

CONFIGS = {
    "eagle1": {"name": "eagle1", "ttt_steps": 2, "feature_noise": 0.0},
    "eagle3": {"name": "eagle3", "draft_vocab_size": 96, "ttt_steps": 3},
    "medusa": {"name": "medusa", "num_heads": 3, "num_layers": 2},
    "hydra": {"name": "hydra", "num_heads": 3, "num_layers": 1},
}


@pytest.fixture(scope="module")
def info(tiny_target) -> TargetInfo:
    return TargetInfo.from_hf_config(tiny_target.config, "tiny")


@pytest.fixture(scope="module")
def batch(tiny_target, info: TargetInfo) -> HeadBatch:
    g = torch.Generator().manual_seed(1)
    B, T = 3, 24
    ids = torch.randint(3, info.vocab_size, (B, T), generator=g)
    lengths = torch.tensor([24, 20, 17])
    hidden, aux = extract_features(tiny_target, ids, aux_layers=default_aux_layers(4))
    mask = torch.zeros(B, T)
    mask[:, 6:] = 1  # the "assistant" part
    return HeadBatch(ids, mask, hidden, aux, lengths)


def make(name: str, info: TargetInfo, tiny_target, **overrides):
    torch.manual_seed(0)
    head = build_head({**CONFIGS[name], **overrides}, info)
    return head.bind(TargetParts.from_model(tiny_target))


def test_registry_covers_every_head() -> None:
    assert set(HEADS) == set(CONFIGS) == {"eagle1", "eagle3", "medusa", "hydra"}
    with pytest.raises(ValueError, match="unknown head"):
        build_head({"name": "nope"}, None)  # type: ignore[arg-type]


def test_parameter_counts_match_formulas(info: TargetInfo, tiny_target) -> None:
    H, inter, V = info.hidden_size, info.intermediate_size, info.vocab_size
    q = info.num_attention_heads * info.head_dim
    kv = info.num_key_value_heads * info.head_dim

    def attention(inp: int) -> int:
        return inp * q + 2 * inp * kv + q * H

    mlp = 3 * H * inter
    counts = {
        name: sum(p.numel() for p in make(name, info, tiny_target).parameters()) for name in CONFIGS
    }
    assert counts["eagle1"] == 2 * H * H + attention(H) + mlp + H  # fc, layer (no input norm)
    assert counts["eagle3"] == 3 * H * H + attention(2 * H) + mlp + 4 * H + 96 * H
    assert counts["medusa"] == 3 * 2 * (H * H + H)  # K heads x L blocks, shared lm_head
    assert counts["hydra"] == 3 * (H * H + H) + sum((k + 2) * H * H for k in range(3))
    own = make("medusa", info, tiny_target, own_lm_head=True)
    assert sum(p.numel() for p in own.parameters()) == counts["medusa"] + 3 * H * V


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_metrics_and_gradients_reach_head_only(name, info, tiny_target, batch) -> None:
    head = make(name, info, tiny_target)
    loss, metrics = head.loss(batch)
    assert torch.isfinite(loss) and loss.item() > 0
    steps = CONFIGS[name].get("ttt_steps", CONFIGS[name].get("num_heads"))
    assert [f"acc_{i}" in metrics for i in range(steps)] == [True] * steps
    assert metrics["sim_tau"] >= 1.0
    loss.backward()
    grads = [p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters()]
    assert all(grads), [n for (n, _), g in zip(head.named_parameters(), grads) if not g]
    assert all(p.grad is None for p in tiny_target.parameters())
    assert not any(k.startswith(("embed", "parts")) for k in head.state_dict())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_all_zero_loss_mask_gives_zero_loss(name, info, tiny_target, batch) -> None:
    empty = HeadBatch(
        batch.input_ids, torch.zeros_like(batch.loss_mask), batch.hidden, batch.aux, batch.lengths
    )
    loss, metrics = make(name, info, tiny_target).loss(empty)
    assert loss.item() == 0.0 and not torch.isnan(loss)
    assert metrics["acc_0"] == 0.0


# Fixed-seed losses of fresh heads on the fixed batch: catches silent numeric drift.
GOLDEN = {"eagle1": 1.9696263, "eagle3": 3.8169332, "medusa": 10.150672, "hydra": 15.149435}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_golden_loss(name, info, tiny_target, batch) -> None:
    loss, _ = make(name, info, tiny_target).loss(batch)
    assert loss.item() == pytest.approx(GOLDEN[name], rel=1e-4)


def test_top_tokens_in_blocks_match_full_argmax(tiny_target, monkeypatch) -> None:
    """Blocks of a few rows (as the real vocab gets) give the argmax of the full logits."""
    from draftsmith.heads import base

    parts = TargetParts.from_model(tiny_target)
    monkeypatch.setattr(base, "BLOCK_ELEMENTS", 5 * parts.vocab_size)  # 5-row blocks
    hidden = torch.randn(3, 7, tiny_target.config.hidden_size)  # [B, T, H]
    expected = parts.logits(hidden).argmax(-1)  # [B, T]
    assert torch.equal(parts.top_tokens(hidden), expected)


@pytest.mark.parametrize(
    ("architecture", "scaling"),
    [("Granite", {"logits_scaling": 8.0}), ("Cohere", {"logit_scale": 0.25})],
)
def test_target_parts_give_the_models_own_logits(architecture, scaling, make_tiny) -> None:
    """Models that scale their lm_head's output: heads learn and rank drafts at that temperature."""
    from draftsmith.features import FeatureCapture
    from draftsmith.target import load_target

    target = load_target(str(make_tiny(architecture=architecture, **scaling)))
    ids = torch.randint(3, 200, (1, 9))
    with FeatureCapture(target) as capture, torch.no_grad():
        logits = target(input_ids=ids).logits  # [1, 9, V]
    parts = TargetParts.from_model(target)
    assert parts.logit_scale != 1.0
    torch.testing.assert_close(parts.logits(capture.hidden), logits)
    torch.testing.assert_close(
        parts.restricted(torch.arange(5)).logits(capture.hidden), logits[..., :5]
    )
    assert parts.check(target) is parts
    # parts that miss the model's transform are refused before anything trains on them
    unscaled = dataclasses.replace(parts, logit_scale=1.0)
    with pytest.raises(ValueError, match="logits are not lm_head"):
        unscaled.check(target)


@pytest.mark.parametrize("name", ["eagle1", "eagle3", "medusa"])
def test_loss_in_blocks_matches_one_block(name, info, tiny_target, batch, monkeypatch) -> None:
    """Vocab-sized work in blocks of a few rows (as the real vocab gets) gives the same loss and
    gradients as one block over all rows (what the tiny vocab gets by default)."""
    from draftsmith.heads import base

    def loss_and_grads() -> tuple[float, list[torch.Tensor]]:
        head = make(name, info, tiny_target)
        loss, _ = head.loss(batch)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in head.parameters() if p.grad is not None]

    whole, whole_grads = loss_and_grads()
    monkeypatch.setattr(base, "BLOCK_ELEMENTS", 5 * info.vocab_size)  # 5-row blocks (Vd: more)
    blocked, blocked_grads = loss_and_grads()
    assert blocked == pytest.approx(whole, rel=1e-5)
    for a, b in zip(blocked_grads, whole_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_frozen_logits_soft_ce_matches_autograd(tiny_target) -> None:
    """The gradient taken in forward (chunked, through the frozen lm_head) == plain autograd."""
    from draftsmith.heads.base import distill_selected

    parts = TargetParts.from_model(tiny_target)
    g = torch.Generator().manual_seed(3)
    H = tiny_target.config.hidden_size
    draft = torch.randn(37, H, generator=g, requires_grad=True)  # [M, H]
    goal = torch.randn(37, H, generator=g)  # [M, H]
    loss, correct = distill_selected(draft, goal, parts.lm_head, parts, chunk=8)
    (2.5 * loss).backward()
    ref_draft = draft.detach().clone().requires_grad_(True)
    probs = torch.softmax(parts.logits(goal).float(), -1)  # [M, V]
    logits = parts.lm_head(ref_draft).float()
    ref = -(probs * torch.log_softmax(logits, -1)).sum()
    (2.5 * ref).backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert correct.item() == (logits.argmax(-1) == probs.argmax(-1)).sum().item()
    torch.testing.assert_close(draft.grad, ref_draft.grad, rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for p in parts.lm_head.parameters())


@pytest.mark.parametrize("name", ["eagle1", "eagle3"])
def test_ttt_steps_equal_chain_drafting(name, info, tiny_target, batch) -> None:
    """Unrolled training step i at anchor t == drafting i tokens ahead from position t."""
    head = make(name, info, tiny_target, ttt_steps=3).eval()
    steps = [h.detach() for h in head.unroll(batch, 3)]
    row, anchor = 0, 9
    with torch.no_grad():
        cache = head.new_cache()
        aux = batch.aux[row : row + 1, : anchor + 1]
        features = head.feature_input(batch.hidden[row : row + 1, : anchor + 1], aux)
        ids = batch.input_ids[row : row + 1]
        positions = torch.arange(anchor + 1)[None]
        out = head.step(features, ids[:, 1 : anchor + 2], positions, cache)
        torch.testing.assert_close(out[0, :], steps[0][row, : anchor + 1], rtol=1e-4, atol=1e-5)
        hidden = out[:, -1:]
        for i in range(1, 3):
            token = ids[:, anchor + i + 1 : anchor + i + 2]
            hidden = head.step(hidden, token, torch.tensor([[anchor + i]]), cache)
            torch.testing.assert_close(hidden[0, 0], steps[i][row, anchor], rtol=1e-4, atol=1e-5)


def test_vocab_mapping_offsets_and_membership() -> None:
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 2])
    d2t, t2d = build_vocab_mapping(counts, 4)
    target_ids = torch.arange(4) + d2t
    assert target_ids.tolist() == [0, 2, 3, 5]  # the 4 most frequent, ascending
    assert t2d.tolist() == [True, False, True, True, False, True, False, False]
    assert (d2t >= 0).all() and t2d[target_ids].all() and int(t2d.sum()) == 4
    ids = torch.tensor([[0, 2, 2, 7]])
    assert count_tokens(ids, torch.tensor([[0, 1, 1, 1]]), 8).tolist() == [0, 0, 2, 0, 0, 0, 0, 1]
    with pytest.raises(ValueError):
        build_vocab_mapping(counts, 9)


def test_eagle3_reduced_vocab_maps_draft_ids(info, tiny_target, batch) -> None:
    head = make("eagle3", info, tiny_target)
    head.set_vocab(count_tokens(batch.input_ids, batch.loss_mask, info.vocab_size))
    ids = head.draft_token_ids()
    assert torch.equal(head.to_target_ids(torch.arange(96)), ids)
    assert head.t2d[ids].all() and int(head.t2d.sum()) == 96


@pytest.mark.parametrize("name", ["medusa", "hydra"])
def test_parallel_heads_reduced_loss_vocab(name, info, tiny_target, batch) -> None:
    """With draft_vocab_size, head k's loss is the soft-CE against the target's distribution
    renormalised over the vocabulary, at anchors whose target top-1 is in it; anchors outside
    still count as misses. The full vocabulary gives the unrestricted loss."""
    counts = count_tokens(batch.input_ids, batch.loss_mask, info.vocab_size)
    full = make(name, info, tiny_target)
    same = make(name, info, tiny_target, draft_vocab_size=info.vocab_size)
    same.set_vocab(counts)
    assert same.loss(batch)[0].item() == pytest.approx(full.loss(batch)[0].item(), rel=1e-5)
    head = make(name, info, tiny_target, draft_vocab_size=48)
    head.set_vocab(counts)
    loss, metrics = head.loss(batch)
    ids = head.in_vocab.nonzero().squeeze(-1)  # [48]
    assert ids.numel() == 48
    parts = head.parts
    normed = parts.norm(batch.hidden)  # [B, T, H]
    top = parts.logits(batch.hidden).argmax(-1)  # [B, T] full-vocab top-1
    expected = 0.0
    with torch.no_grad():
        for k in range(3):
            select = predicts_assistant_token(batch, k + 2)
            keep = select & head.in_vocab[shifted(top, k + 1)]
            path = torch.stack([shifted(batch.input_ids, j + 1) for j in range(k + 1)], -1)[keep]
            states = head.head_states(k, normed[keep], path)  # [M, H]
            log_q = torch.log_softmax(parts.head_logits(states)[:, ids], -1)
            p = torch.softmax(parts.logits(shifted(batch.hidden, k + 1)[keep])[:, ids], -1)
            expected += 0.8**k * float(-(p * log_q).sum() / select.sum())
            hits = ids[log_q.argmax(-1)] == shifted(top, k + 1)[keep]
            assert metrics[f"acc_{k}"] == pytest.approx(float(hits.sum() / select.sum()))
            assert 0 < keep.sum() < select.sum()  # the mask does cut (the test is not vacuous)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()
    assert all(p.grad is not None for p in head.parameters())
    with pytest.raises(ValueError, match="own_lm_head"):
        make(name, info, tiny_target, draft_vocab_size=48, own_lm_head=True)


def test_hydra_fuses_aux_layers(info, tiny_target, batch) -> None:
    """With aux_layers, Hydra's feature is norm(h) + fc(each aux layer RMS-normalised); fc starts
    at zero, so a fresh fused head computes what the plain head does, and training reaches fc."""
    plain = make("hydra", info, tiny_target)
    fused = make("hydra", info, tiny_target, aux_layers=default_aux_layers(4))
    loss = fused.loss(batch)[0]
    assert loss.item() == pytest.approx(plain.loss(batch)[0].item(), rel=1e-6)
    loss.backward()
    assert fused.fc.weight.grad.abs().sum() > 0
    with torch.no_grad():
        fused.fc.weight.normal_()
    eps = info.rms_norm_eps
    split = batch.aux.split(info.hidden_size, -1)  # the layers' states, [B, T, H] each
    layers = [a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + eps) for a in split]
    expected = fused.parts.norm(batch.hidden) + torch.cat(layers, -1) @ fused.fc.weight.T
    torch.testing.assert_close(fused.feature_input(batch.hidden, batch.aux), expected)
    assert fused.loss(batch)[0].item() != pytest.approx(plain.loss(batch)[0].item(), rel=1e-3)
    with pytest.raises(ValueError, match="needs their features"):
        fused.feature_input(batch.hidden, None)
    with pytest.raises(ValueError, match="out of range"):
        make("hydra", info, tiny_target, aux_layers=[0, 5])


def test_hydra_prefix_attention(info, tiny_target, batch) -> None:
    """Hydra++'s prefix attention starts as the identity (a fresh head's loss is the plain
    head's), is reached by training, and at inference its KV cache fed position by position in
    uneven blocks (as commits do) gives the features the training pass computes causally."""
    plain = make("hydra", info, tiny_target)
    head = make("hydra", info, tiny_target, prefix_attention=True)
    loss = head.loss(batch)[0]
    assert loss.item() == pytest.approx(plain.loss(batch)[0].item(), rel=1e-6)
    loss.backward()
    assert head.context.self_attn.o_proj.weight.grad.abs().sum() > 0
    assert plain.new_cache() is None
    with torch.no_grad():
        for p in head.context.parameters():
            p.normal_(0, 0.05)
        row = batch.hidden[1:2]  # [1, T, H]
        full = head.sequence_features(row, None)  # [1, T, H]
        assert not torch.allclose(full, plain.sequence_features(row, None))
        cache, pieces, start = head.new_cache(), [], 0
        for size in (5, 1, 3, 2, 4):
            pieces.append(head.sequence_features(row[:, start : start + size], None, cache))
            start += size
        torch.testing.assert_close(torch.cat(pieces, 1), full[:, :start], rtol=1e-4, atol=1e-5)
        # the context reaches back: changing the first position changes the last feature
        moved = row.clone()
        moved[:, 0] += 1.0
        assert not torch.allclose(head.sequence_features(moved, None)[:, 8], full[:, 8])


def test_medusa_heads_share_no_parameter(info, tiny_target) -> None:
    head = make("medusa", info, tiny_target)
    pointers = [p.data_ptr() for p in head.parameters()]
    assert len(pointers) == len(set(pointers)) == 3 * 2 * 2


def test_medusa_own_lm_heads_train_as_the_shared_one(info, tiny_target, batch) -> None:
    """Medusa-1's own lm_heads take the loss by plain autograd over [M, V] logits, not the
    frozen lm_head's chunked path: started from the target's lm_head, they give the shared
    head's loss, accuracies and block gradients, and get gradients of their own."""
    shared = make("medusa", info, tiny_target)
    own = make("medusa", info, tiny_target, own_lm_head=True)
    own.blocks.load_state_dict(shared.blocks.state_dict())
    with torch.no_grad():
        for lm_head in own.lm_heads:
            lm_head.weight.copy_(TargetParts.from_model(tiny_target).lm_head.weight)
    (loss, metrics), (own_loss, own_metrics) = shared.loss(batch), own.loss(batch)
    assert own_loss.item() == pytest.approx(loss.item(), rel=1e-5)
    assert own_metrics == pytest.approx(metrics)
    loss.backward()
    own_loss.backward()
    for a, b in zip(shared.blocks.parameters(), own.blocks.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6)
    assert all(float(h.weight.grad.abs().sum()) > 0 for h in own.lm_heads)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_load_identical_and_target_check(
    name, info, tiny_target, batch, tmp_path: Path, make_tiny
) -> None:
    head = make(name, info, tiny_target)
    with torch.no_grad():  # make weights non-trivial (Medusa blocks start at zero)
        for p in head.parameters():
            p.add_(0.01 * torch.randn_like(p))
    head.save(tmp_path / "head")
    loaded = load_head(tmp_path / "head", info).bind(TargetParts.from_model(tiny_target))
    head.eval(), loaded.eval()
    with torch.no_grad():
        assert head.loss(batch)[0].item() == loaded.loss(batch)[0].item()
    other = TargetInfo.from_hf_config(
        __import__("transformers").AutoConfig.from_pretrained(make_tiny(hidden_size=32))
    )
    with pytest.raises(ValueError, match="hidden_size: head has 64, target has 32"):
        load_head(tmp_path / "head", other)


def test_training_batches_go_to_the_heads_device(tiny_target, monkeypatch) -> None:
    """Batches are built on the CPU (collated shards, online features); the head's forward,
    which the training engine calls, moves them to the device of the head's weights (a rank's
    GPU in a CUDA run; here the meta device), leaving absent parts absent."""
    info = TargetInfo.from_hf_config(tiny_target.config)
    head = build_head({"name": "medusa"}, info).to("meta")
    seen: list[HeadBatch] = []
    monkeypatch.setattr(head, "loss", lambda batch: seen.append(batch) or (None, {}))
    ids = torch.zeros(1, 4, dtype=torch.long)  # [B, T]
    head(HeadBatch(ids, torch.ones(1, 4), torch.zeros(1, 4, info.hidden_size), target_top=ids))
    (batch,) = seen
    assert {t.device.type for t in (batch.input_ids, batch.loss_mask, batch.hidden)} == {"meta"}
    assert batch.target_top.device.type == "meta" and batch.aux is None and batch.lengths is None
