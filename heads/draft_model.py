"""An independent small causal LM as the drafter (the classic two-model setup).

Each generation's `DraftModelState` keeps its own KV cache of the committed
sequence over the shared draft model. Each round
it runs the tokens committed since the last round plus the root, then the
tree nodes a policy expands, with tree attention. Afterwards the cache is
cropped back to the committed sequence: nothing computed from a draft token
survives the round.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel

from specgraft.heads.draft_round import DraftRound
from specgraft.model import Target, load_model
from specgraft.tree import Sampling, Tree, TreePolicy, additive_mask


class DraftModel:
    """Drafts with a small LM that shares the target's vocabulary.

    Args:
        path_or_model: a model directory, hub id, built `PreTrainedModel`, or a loaded `Target`.
        target: the frozen target; the draft runs on its device and dtype.

    Raises:
        ValueError: the draft's vocabulary size differs from the target's.
    """

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, path_or_model: str | Path | PreTrainedModel | Target, target: Target) -> None:
        if isinstance(path_or_model, Target):
            self.model = path_or_model
        else:
            self.model = load_model(path_or_model, dtype=target.dtype, device=target.device, role="draft model")
        if self.model.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft model vocabulary ({self.model.vocab_size}) does not match the target's ({target.vocab_size}); "
                "a draft must share the target's tokenizer"
            )
        if self.model.fast is not None and self.model is not target and target.fast is not None:
            # The target's products were measured on this machine; the shapes the draft shares with it (a distilled
            # draft has the target's layer shapes) take the same form.
            self.model.fast.share_small_rows(target.fast.small_rows)
        self.device = target.device

    def start(self, prompt_ids: torch.Tensor, hidden: dict[int, torch.Tensor]) -> DraftModelState:
        return DraftModelState(self.model, prompt_ids.flatten().tolist())


class DraftModelState:
    """One generation's draft cache and the committed tokens it has not run yet."""

    def __init__(self, model: Target, committed: list[int]) -> None:
        self.model = model
        self.device = model.device
        self.cache = model.new_cache()
        self.length = len(committed)  # committed tokens
        self.pending = committed  # the committed tokens after the cache's, oldest first
        self.peak = 0

    def commit(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], path: torch.Tensor | None = None) -> None:
        self.pending.extend(tokens.flatten().tolist())
        self.length += tokens.numel()
        self.peak = len(self.cache)

    def cache_tokens(self) -> int:
        return self.peak

    def propose(
        self, root_token: int, policy: TreePolicy, max_depth: int, sampling: Sampling | None = None
    ) -> Tree:
        if max_depth < 1:
            return Tree.root_only(root_token, self.device)
        round_ = DraftRound(self.length, lambda: self._run_root(root_token), self._run_nodes, self.device)
        try:
            return policy.grow(round_.step, root_token, max_depth=max_depth, device=self.device, sampling=sampling)
        finally:
            self.peak = len(self.cache)
            self.cache.crop(min(len(self.cache), self.length))  # roll back every draft position
            self.pending = self.pending[len(self.pending) - (self.length - len(self.cache)) :]

    def _run_root(self, root_token: int) -> torch.Tensor:
        """Catch the cache up on committed tokens, then run the root: plain causal attention."""
        start = len(self.cache)
        ids = torch.tensor(self.pending + [root_token], device=self.device)
        positions = torch.arange(start, start + len(ids), device=self.device)
        return self.model.forward(ids[None], self.cache, positions[None]).logits[0, -1]

    def _run_nodes(self, tree: Tree, nodes: torch.Tensor, visible: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        mask = additive_mask(visible, self.model.dtype)
        return self.model.forward(tree.tokens[nodes][None], self.cache, positions[None], mask).logits[0]
