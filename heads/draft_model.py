"""An independent small causal LM as the drafter (the classic two-model setup).

The draft model keeps its own KV cache of the committed sequence. Each round
it runs the tokens committed since the last round plus the root, then the
tree nodes a policy expands, with tree attention. Afterwards the cache is
cropped back to the committed sequence: nothing computed from a draft token
survives the round.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel

from specgraft.target import Target, load_model
from specgraft.tree import Tree, TreePolicy, additive_mask
from specgraft.tree.draw import DraftSampler


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
        self.device = target.device
        self.committed = torch.zeros(0, dtype=torch.long, device=self.device)
        self.cache = self.model.new_cache()

    def reset(self, prompt_ids: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        self.committed = prompt_ids.flatten().to(self.device)
        self.cache = self.model.new_cache()

    def commit(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        self.committed = torch.cat([self.committed, tokens.flatten().to(self.device)])

    def cache_tokens(self) -> int:
        return len(self.cache)

    def propose(
        self, root_token: int, policy: TreePolicy, max_depth: int, sampler: DraftSampler | None = None
    ) -> Tree:
        if max_depth < 1:
            return Tree.root_only(root_token, self.device)
        round_ = _DraftRound(self, root_token)
        try:
            return policy.grow(round_.step, root_token, max_depth=max_depth, device=self.device, sampler=sampler)
        finally:
            self.cache.crop(min(len(self.cache), len(self.committed)))  # roll back every draft position


class _DraftRound:
    """The draft model's state while one tree grows: which node sits in which cache slot."""

    def __init__(self, drafter: DraftModel, root_token: int) -> None:
        self.drafter = drafter
        self.root_token = root_token
        self.slot_nodes: list[int] = []  # tree nodes in cache order, after the committed prefix
        self.logp: dict[int, torch.Tensor] = {}  # node -> (V,) draft log-probs of its next token

    def step(self, tree: Tree, frontier: torch.Tensor) -> torch.Tensor:
        """(F,) frontier nodes -> (F, V) draft log-probabilities for their children."""
        new = [n for n in frontier.tolist() if n not in self.logp]
        if 0 in new:
            self._run_root()
            new.remove(0)
        if new:
            self._run_nodes(tree, new)
        return torch.stack([self.logp[n] for n in frontier.tolist()])

    def _run_root(self) -> None:
        """Catch the cache up on committed tokens, then run the root: plain causal attention."""
        d = self.drafter
        start = len(d.cache)
        ids = torch.cat([d.committed[start:], torch.tensor([self.root_token], device=d.device)])
        positions = torch.arange(start, start + len(ids), device=d.device)
        out = d.model.forward(ids[None], d.cache, positions[None])
        self.logp[0] = out.logits[0, -1].log_softmax(-1)
        self.slot_nodes.append(0)

    def _run_nodes(self, tree: Tree, nodes: list[int]) -> None:
        d = self.drafter
        idx = torch.tensor(nodes, device=d.device)
        prefix = len(d.committed)
        columns = torch.tensor(self.slot_nodes + nodes, device=d.device)
        visible = torch.cat(
            [
                torch.ones(len(nodes), prefix, dtype=torch.bool, device=d.device),
                tree.ancestor_mask()[idx][:, columns],  # (F, slots + F): ancestors and self only
            ],
            dim=1,
        )
        out = d.model.forward(
            tree.tokens[idx][None], d.cache, (prefix + tree.depth[idx])[None], additive_mask(visible, d.model.dtype)
        )
        for i, node in enumerate(nodes):
            self.logp[node] = out.logits[0, i].log_softmax(-1)
        self.slot_nodes.extend(nodes)
