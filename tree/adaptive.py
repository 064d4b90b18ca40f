"""`Adaptive`: a tree the engine sizes each step by expected goodput.

The policy grows the candidates as EAGLE-2 does (``top_k`` children per
expanded node, the best ranked by cumulative draft log-probability), at most
``max_depth`` deep and ``max_nodes`` nodes. How much of that is drafted and
verified is not the policy's decision: the engine plans each row's draft
depth before drafting and selects, across the whole batch, the candidate
nodes worth a place in the step's forward (`specgraft.infer.adaptive`). Alone,
outside an engine that sizes it, it is that dynamic tree.

Children are top-k, so under sampling every node is verified as a point
mass, and any parent-closed subset the engine keeps stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgraft.tree.dynamic import DynamicTree
from specgraft.tree.policies import Growth, Levelled
from specgraft.tree.sampling import Sampling


@dataclass(frozen=True)
class Adaptive(Levelled):
    """Candidates of at most ``max_depth`` levels and ``max_nodes`` draft nodes, ``top_k`` children per expansion
    (``top_k=1``: a chain)."""

    max_depth: int = 6
    max_nodes: int = 16
    top_k: int = 4

    def __post_init__(self) -> None:
        for name in ("max_depth", "max_nodes", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"Adaptive {name} must be >= 1, got {getattr(self, name)}")

    @property
    def candidates(self) -> DynamicTree:
        return DynamicTree(top_k=self.top_k, depth=self.max_depth, budget=self.max_nodes)

    def levels(
        self, root_token: int, max_depth: int | None = None, device: torch.device | str = "cpu",
        sampling: Sampling | None = None,
    ) -> Growth:
        return self.candidates.levels(root_token, max_depth, device, sampling)
