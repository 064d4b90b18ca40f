"""Bookkeeping shared by drafters that run a model over the tree as it grows.

While a tree grows, the drafter's cache holds its committed prefix, then the
root, then every expanded node in the order it ran. A new frontier node may
see the prefix and, among tree slots, only its ancestors and itself. This
class tracks which node sits in which slot and builds that visibility; the
drafter supplies how to run the root and a batch of nodes.
"""

from __future__ import annotations

from typing import Callable

import torch

from specgraft.tree import Tree

# run_nodes(tree, nodes (F,), visible (F, prefix + slots + F) bool, positions (F,)) -> (F, V) logits
RunNodes = Callable[[Tree, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DraftRound:
    """One tree's worth of drafting. ``prefix``: cache positions before the root's slot."""

    def __init__(self, prefix: int, run_root: Callable[[], torch.Tensor], run_nodes: RunNodes, device) -> None:
        self.prefix = prefix
        self.run_root = run_root
        self.run_nodes = run_nodes
        self.device = device
        self.slot_nodes: list[int] = []  # tree nodes in cache order after the prefix
        self.logp: dict[int, torch.Tensor] = {}  # node -> (V,) draft log-probs of its children
        # The tokens from the root down to each node that ran -> its slot after the prefix. Keyed by tokens, not
        # node index: a policy may re-index its tree when it finishes (EAGLE-2's rerank), and a node's keys and
        # values depend only on its token and its ancestors'.
        self.slot_of_path: dict[tuple[int, ...], int] = {}

    def step(self, tree: Tree, frontier: torch.Tensor) -> torch.Tensor:
        """(F,) frontier nodes -> (F, V) draft log-probabilities for their children."""
        wanted = frontier.tolist()
        new = [n for n in dict.fromkeys(wanted) if n not in self.logp]
        if 0 in new:
            self.logp[0] = self.run_root().float().log_softmax(-1)
            self._ran(tree, [0])
            new.remove(0)
        if new:
            idx = torch.tensor(new, device=self.device)
            columns = torch.tensor(self.slot_nodes + new, device=self.device)
            visible = torch.cat(
                [
                    torch.ones(len(new), self.prefix, dtype=torch.bool, device=self.device),
                    tree.ancestor_mask()[idx][:, columns],  # (F, slots + F): ancestors and self only
                ],
                dim=1,
            )
            logp = self.run_nodes(tree, idx, visible, self.prefix + tree.depth[idx]).float().log_softmax(-1)
            self.logp.update(zip(new, logp))
            self._ran(tree, new)
        return torch.stack([self.logp[n] for n in wanted])

    def _ran(self, tree: Tree, nodes: list[int]) -> None:
        tokens = tree.tokens.tolist()
        for node in nodes:
            path = tuple(tokens[i] for i in tree.path_to(node).tolist())
            self.slot_of_path[path] = len(self.slot_nodes)
            self.slot_nodes.append(node)
