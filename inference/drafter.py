"""Adapters that let the tree builders draft with any head (the `Expander` protocol).

EagleDrafter: autoregressive heads. Committed pairs (target feature of position j, token j+1)
live in the head's KV cache; tree nodes are appended per depth with a mask that shows each node
the committed entries, its drafted ancestors and itself, then cropped away before the next
commit (the accepted tokens are re-committed with the target's true features).
ParallelDrafter: Medusa/Hydra. Every depth is proposed from one target feature (the anchor,
of the state that predicted the root); Hydra also reads each node's path tokens, and with prefix
attention keeps a KV cache of the committed positions' features.

Both can draft over a reduced vocabulary (`vocab`, target ids): a head that scores through the
target's full lm_head then reads Vd x H weights per expansion instead of V x H (49k x 576 for
SmolLM2: 56 MB in bf16), as EAGLE-3 does with its own draft vocabulary. Verification is
unchanged, so decoding stays exact; only tokens outside the subset can no longer be drafted.
"""

from __future__ import annotations

import copy

import torch

from draftsmith.errors import InputError
from draftsmith.heads import DraftHead
from draftsmith.heads.autoregressive import AutoregressiveHead
from draftsmith.inference.tree import Tree


def drafting_view(head: DraftHead, vocab: torch.Tensor | None) -> DraftHead:
    """`head` itself, or (with `vocab` [Vd] target ids) a shallow copy sharing its weights whose
    target lm_head has only the `vocab` rows (the caller's head stays bound as it was)."""
    if vocab is None:
        return head
    if not head.drafts_with_target_lm_head:
        raise InputError(
            f"the {head.name} head drafts over its own vocabulary; a reduced draft vocabulary "
            "applies to heads that draft through the target's lm_head (eagle1, medusa, hydra)"
        )
    view = copy.copy(head)  # shares parameters and buffers; only the bound parts differ
    return view.bind(head.parts.restricted(vocab))


class _Drafter:
    """Trees (tokens, parents, masks, scores) live on the CPU and the head on its own device: a
    drafter hands the head its inputs on that device and returns log-probs on the CPU."""

    def __init__(self, head: DraftHead, vocab: torch.Tensor | None) -> None:
        self.head = drafting_view(head, vocab)
        self.device = next(head.parameters()).device
        # [Vd] target ids (CPU), or None: the head's own vocabulary
        self.vocab = None if vocab is None else vocab.cpu()

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of draft ids, both on the CPU."""
        if self.vocab is not None:
            return self.vocab[draft_ids]
        return self.head.to_target_ids(draft_ids.to(self.device)).cpu()


class EagleDrafter(_Drafter):
    def __init__(self, head: AutoregressiveHead, vocab: torch.Tensor | None = None) -> None:
        super().__init__(head, vocab)
        self.max_depth: int | None = None
        self.reset()

    def reset(self) -> None:
        self.cache = self.head.new_cache()
        self.committed = 0  # committed pairs = positions 0..committed-1 in the draft cache
        self.root_hidden: torch.Tensor | None = None  # [1, H] output of the last committed pair
        self.node_hidden = torch.empty(0)
        self.fed = torch.zeros(0, dtype=torch.long)  # tree nodes in the cache, in cache order

    def commit(
        self, hidden: torch.Tensor, aux: torch.Tensor | None, next_tokens: torch.Tensor
    ) -> None:
        """Append M pairs: features [1, M, H] (aux [1, M, kH]) of positions committed.. with the
        tokens that follow them [1, M]."""
        self.cache.crop(self.committed)
        M = next_tokens.shape[1]
        positions = torch.arange(self.committed, self.committed + M, device=self.device)[None]
        out = self.head.step(
            self.head.feature_input(hidden, aux), next_tokens, positions, self.cache
        )
        self.committed += M
        self.root_hidden = out[:, -1]
        self.fed = torch.zeros(0, dtype=torch.long)

    def root_logprobs(self) -> torch.Tensor:
        return torch.log_softmax(self.head.draft_logits(self.root_hidden)[0].float(), -1).cpu()

    def expand(self, nodes: torch.Tensor, tree: Tree) -> torch.Tensor:
        parents = tree.parents[nodes]
        if self.node_hidden.shape[0] < tree.size:  # grow the per-node output buffer
            grown = self.root_hidden.new_zeros(tree.size * 2, self.root_hidden.shape[-1])
            if self.node_hidden.numel():
                grown[: self.node_hidden.shape[0]] = self.node_hidden
            self.node_hidden = grown
        dev = self.device
        on_dev = parents.to(dev)  # [F], one transfer for both reads
        hidden_in = torch.where(
            (on_dev == 0)[:, None], self.root_hidden, self.node_hidden[on_dev.clamp_min(0)]
        )  # [F, H]
        F = nodes.numel()
        mask = torch.cat(
            [
                torch.ones(F, self.committed, dtype=torch.bool),
                tree.ancestors[nodes][:, self.fed],  # drafted ancestors already in the cache
                torch.eye(F, dtype=torch.bool),
            ],
            dim=1,
        )  # [F, cache + F]
        positions = (self.committed - 1 + tree.depths[nodes])[None]
        out = self.head.step(
            hidden_in[None],
            tree.tokens[nodes][None].to(dev),
            positions.to(dev),
            self.cache,
            mask.to(dev),
        )
        self.node_hidden[nodes.to(dev)] = out[0]
        self.fed = torch.cat([self.fed, nodes])
        return torch.log_softmax(self.head.draft_logits(out[0]).float(), dim=-1).cpu()


class ParallelDrafter(_Drafter):
    def __init__(self, head: DraftHead, vocab: torch.Tensor | None = None) -> None:
        super().__init__(head, vocab)
        self.max_depth = head.config.num_heads
        self.uses_path = getattr(head, "uses_path", False)
        self.root_token: torch.Tensor | None = None
        self.reset()

    def reset(self) -> None:
        self.anchor: torch.Tensor | None = None
        self.cache = self.head.new_cache()  # None: the head reads the last position only

    def commit(
        self, hidden: torch.Tensor, aux: torch.Tensor | None, next_tokens: torch.Tensor
    ) -> None:
        if self.cache is None:
            hidden, aux = hidden[:, -1:], None if aux is None else aux[:, -1:]
        # [1, H] of the last position, read by every depth
        self.anchor = self.head.sequence_features(hidden, aux, self.cache)[:, -1]
        self.root_token = next_tokens[:, -1:]  # [1, 1]

    def _logprobs(self, depth: int, count: int, path: torch.Tensor | None) -> torch.Tensor:
        if not self.uses_path:  # Medusa: the same proposal for every node of a depth
            logits = self.head.depth_logits(depth, self.anchor)
            return torch.log_softmax(logits.float(), -1).cpu().expand(count, -1)
        logits = self.head.depth_logits(depth, self.anchor.expand(count, -1), path.to(self.device))
        return torch.log_softmax(logits.float(), dim=-1).cpu()

    def root_logprobs(self) -> torch.Tensor:
        return self._logprobs(0, 1, self.root_token)[0]

    def expand(self, nodes: torch.Tensor, tree: Tree) -> torch.Tensor:
        depth = int(tree.depths[nodes[0]])
        path = tree.path_tokens(nodes) if self.uses_path else None
        return self._logprobs(depth, nodes.numel(), path)


def make_drafter(
    head: DraftHead, vocab: torch.Tensor | None = None
) -> EagleDrafter | ParallelDrafter:
    if head.kind == "autoregressive":
        return EagleDrafter(head, vocab)
    return ParallelDrafter(head, vocab)
