"""Drafting in the target's feature space, shared by EAGLE and EAGLE-3.

Pair i joins a feature of committed position i with the next token t_{i+1}.
The drafter keeps committed features and tokens, runs pairs not yet in its
KV cache plus the root's pair, then one pair per tree node (its parent's
predicted feature, its own token) with tree attention. Between rounds the
cache holds only pairs of committed tokens and true features; the root's pair
is run again next round, so proposing twice without a commit stays correct.

A head plugs in with five methods: ``hidden_layers``, ``draft_features(hidden)``
(target states -> (n, H) features), ``new_draft_cache(max_len)``,
``draft_step(features, tokens, positions, mask, cache)`` -> (1, T, H) outputs,
and ``draft_logp(outputs)`` -> (.., V) scores over the target vocabulary.
"""

from __future__ import annotations

import torch

from specgraft.heads.draft_round import DraftRound
from specgraft.target import Target
from specgraft.tree import Tree, TreePolicy, additive_mask
from specgraft.tree.draw import DraftSampler

TREE_SLOTS = 1024  # cache room beyond the context for one round's tree nodes


class FeatureDrafter:
    """The `Drafter` of a feature-space head (EAGLE, EAGLE-3)."""

    def __init__(self, head, target: Target) -> None:
        self.head = head  # not put in eval mode here: the trainer's evaluator may share the module
        self.hidden_layers = head.hidden_layers
        self.device = target.device
        self.max_len = target.max_context + TREE_SLOTS
        self.features = torch.zeros(0, target.config.hidden_size, device=self.device)  # (n, H) of committed positions
        self.tokens = torch.zeros(0, dtype=torch.long, device=self.device)  # (n,) committed t_0..t_{n-1}
        self.cache = head.new_draft_cache(self.max_len)  # pair i in slot i

    @torch.inference_mode()
    def reset(self, prompt_ids: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        self.features = self.head.draft_features(hidden)
        self.tokens = prompt_ids.flatten().to(self.device)
        self.cache = self.head.new_draft_cache(self.max_len)

    @torch.inference_mode()
    def commit(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        self.features = torch.cat([self.features, self.head.draft_features(hidden)])
        self.tokens = torch.cat([self.tokens, tokens.flatten().to(self.device)])

    def cache_tokens(self) -> int:
        return len(self.cache)

    @torch.inference_mode()
    def propose(
        self, root_token: int, policy: TreePolicy, max_depth: int, sampler: DraftSampler | None = None
    ) -> Tree:
        if max_depth < 1:
            return Tree.root_only(root_token, self.device)
        n = len(self.tokens)
        outputs: dict[int, torch.Tensor] = {}  # node -> (H,) the head's output at the node's pair

        def run_root() -> torch.Tensor:
            # Pairs (f_i, t_{i+1}) not yet cached; the last pairs f_{n-1} with the root.
            start = len(self.cache)
            next_tokens = torch.cat([self.tokens[start + 1 :], torch.tensor([root_token], device=self.device)])
            positions = torch.arange(start, n, device=self.device)[None]
            out = self.head.draft_step(self.features[start:n][None], next_tokens[None], positions, None, self.cache)
            outputs[0] = out[0, -1]
            return self.head.draft_logp(out[0, -1])

        def run_nodes(tree: Tree, nodes: torch.Tensor, visible: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            feats = torch.stack([outputs[p] for p in tree.parents[nodes].tolist()])[None]  # (1, F, H)
            mask = additive_mask(visible, feats.dtype)
            out = self.head.draft_step(feats, tree.tokens[nodes][None], positions[None], mask, self.cache)[0]
            outputs.update(zip(nodes.tolist(), out))
            return self.head.draft_logp(out)

        round_ = DraftRound(n - 1, run_root, run_nodes, self.device)
        try:
            return policy.grow(round_.step, root_token, max_depth=max_depth, device=self.device, sampler=sampler)
        finally:
            self.cache.crop(min(len(self.cache), n - 1))  # committed pairs only: nothing from a draft survives
