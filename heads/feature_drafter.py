"""Drafting in the target's feature space, shared by EAGLE and EAGLE-3.

Pair i joins a feature of committed position i with the next token t_{i+1}.
Each generation's `FeatureDraftState` keeps the committed features and tokens
its draft KV cache does not hold yet, runs those pairs plus the root's pair,
then one pair per tree node (its parent's predicted feature, its own token)
with tree attention. Between rounds the cache holds only pairs of committed
tokens and true features; the root's pair is run again next round, so
proposing twice without a commit stays correct.

A head plugs in with five methods: ``hidden_layers``, ``draft_features(hidden)``
(target states -> (n, H) features), ``new_draft_cache(max_len)``,
``draft_step(features, tokens, positions, mask, cache)`` -> (1, T, H) outputs,
and ``draft_logp(outputs)`` -> (.., V) scores over the target vocabulary.
"""

from __future__ import annotations

import torch

from specgraft.heads.draft_round import DraftRound
from specgraft.model import TREE_SLOTS, Target
from specgraft.tree import Tree, TreePolicy, additive_mask
from specgraft.tree.draw import DraftSampler


class FeatureDrafter:
    """The `Drafter` of a feature-space head (EAGLE, EAGLE-3): shared weights, a state per generation."""

    def __init__(self, head, target: Target) -> None:
        self.head = head  # not put in eval mode here: the trainer's evaluator may share the module
        self.hidden_layers = head.hidden_layers
        self.device = target.device
        self.max_len = target.max_context + TREE_SLOTS

    @torch.inference_mode()
    def start(self, prompt_ids: torch.Tensor, hidden: dict[int, torch.Tensor]) -> FeatureDraftState:
        return FeatureDraftState(self, prompt_ids.flatten().to(self.device), self.head.draft_features(hidden))


class FeatureDraftState:
    """One generation's feature-space drafting: its draft KV cache and the pairs not yet in it.

    Invariant: ``features`` holds f_j and ``next_tokens`` holds t_j for the
    committed positions j the cache has not consumed (f from ``len(cache)``,
    t from ``len(cache) + 1``), so a commit appends only its own rows and
    each round runs only the new pairs: no step copies the whole history.
    """

    def __init__(self, drafter: FeatureDrafter, prompt_ids: torch.Tensor, features: torch.Tensor) -> None:
        self.head = drafter.head
        self.device = drafter.device
        self.cache = self.head.new_draft_cache(drafter.max_len)  # pair i in slot i
        self.length = len(prompt_ids)  # n: committed tokens t_0 .. t_{n-1}
        self.features = features  # (n - len(cache), H): f_{len(cache)} .. f_{n-1}
        self.next_tokens = prompt_ids[1:]  # t_{len(cache)+1} .. t_{n-1}
        self.peak = 0

    @torch.inference_mode()
    def commit(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        self.features = torch.cat([self.features, self.head.draft_features(hidden)])
        self.next_tokens = torch.cat([self.next_tokens, tokens.flatten().to(self.device)])
        self.length += tokens.numel()
        self.peak = len(self.cache)

    def cache_tokens(self) -> int:
        return self.peak

    @torch.inference_mode()
    def propose(
        self, root_token: int, policy: TreePolicy, max_depth: int, sampler: DraftSampler | None = None
    ) -> Tree:
        if max_depth < 1:
            return Tree.root_only(root_token, self.device)
        n = self.length
        outputs: dict[int, torch.Tensor] = {}  # node -> (H,) the head's output at the node's pair

        def run_root() -> torch.Tensor:
            # Pairs (f_i, t_{i+1}) not yet cached, i = len(cache) .. n - 1; the last pairs f_{n-1} with the root.
            start = len(self.cache)
            next_tokens = torch.cat([self.next_tokens, torch.tensor([root_token], device=self.device)])
            positions = torch.arange(start, n, device=self.device)[None]
            out = self.head.draft_step(self.features[None], next_tokens[None], positions, None, self.cache)
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
            self.peak = len(self.cache)
            self._rollback(min(len(self.cache), n - 1))

    def _rollback(self, length: int) -> None:
        """Keep committed pairs only (nothing from a draft survives) and drop the rows the cache now holds."""
        consumed = length - (self.length - len(self.features))  # features the cache took this round
        self.cache.crop(length)
        self.features = self.features[consumed:]
        self.next_tokens = self.next_tokens[consumed:]
