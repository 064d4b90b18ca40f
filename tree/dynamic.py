"""EAGLE-2 dynamic trees: grow where the drafter is confident, keep the best nodes overall.

Each round expands the ``top_k`` frontier nodes with the highest cumulative
draft log-probability into ``top_k`` children each; the best ``top_k`` of
those children form the next frontier. After ``depth`` rounds, the
``budget`` nodes with the highest cumulative log-probability over everything
drafted become the tree. Cumulative log-probabilities never increase along a
path, so ranking parents before children on ties keeps the tree connected.
Children are chosen top-k (point masses when sampling), as in EAGLE-2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specgraft.tree.policies import Growth, Levelled, TreeBuilder
from specgraft.tree.sampling import Sampling
from specgraft.tree.tree import ROOT_PARENT, Tree


@dataclass(frozen=True)
class DynamicTree(Levelled):
    """EAGLE-2's tree: ``top_k`` children per expanded node, ``depth`` rounds, ``budget`` draft nodes kept."""

    top_k: int = 8
    depth: int = 6
    budget: int = 48

    def __post_init__(self) -> None:
        for name in ("top_k", "depth", "budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"DynamicTree {name} must be >= 1, got {getattr(self, name)}")

    @property
    def max_depth(self) -> int:
        return self.depth

    def levels(
        self, root_token: int, max_depth: int | None = None, device: torch.device | str = "cpu",
        sampling: Sampling | None = None,
    ) -> Growth:
        depth = self.depth if max_depth is None else min(self.depth, max_depth)
        builder = TreeBuilder(root_token, device)
        frontier = torch.zeros(1, dtype=torch.long, device=device)
        for _ in range(depth):
            logp = yield builder.tree(), frontier  # (F, V)
            top_logp, top_tok = logp.topk(self.top_k, dim=-1)  # (F, k)
            scores = builder.tree().scores[frontier][:, None] + top_logp  # (F, k) cumulative
            children = builder.add(top_tok.flatten(), frontier.repeat_interleave(self.top_k), scores.flatten())
            best = scores.flatten().topk(min(self.top_k, children.numel())).indices
            frontier = children[best]
        return rerank(builder.tree(), self.budget)


def rerank(tree: Tree, budget: int) -> Tree:
    """The root plus the ``budget`` best draft nodes by cumulative score, parents ranked before children on ties."""
    if tree.num_draft_tokens <= budget:
        return tree
    scores, depth = tree.scores.tolist(), tree.depth.tolist()  # read once: indexing tensors per key is slow
    # Sort by score (descending), then depth (ascending): a parent is never ranked below its child.
    order = sorted(range(1, tree.num_nodes), key=lambda i: (-scores[i], depth[i]))
    keep = torch.tensor(sorted([0] + order[:budget]), device=tree.tokens.device)
    return subtree(tree, keep)


def subtree(tree: Tree, keep: torch.Tensor | Sequence[int]) -> Tree:
    """The nodes ``keep`` (sorted, root included, closed under parents) re-indexed parents-first.

    Read and re-indexed in Python, made as one tensor: a few dozen ints, where a chain of small tensor ops took
    35 us a tree (the goodput controller cuts trees every step).
    """
    kept = keep.tolist() if isinstance(keep, torch.Tensor) else list(keep)
    n = len(kept)
    if kept[-1] == n - 1:  # the first n nodes (sorted and distinct: 0..n-1), closed under parents as stored parents-first
        # views, no new tensors: a chain's cut, the most common, in 8 us where it was 20
        cut = Tree(tokens=tree.tokens[:n], parents=tree.parents[:n], depth=tree.depth[:n], scores=tree.scores[:n],
                   q=None if tree.q is None else tree.q[:n], without_replacement=tree.without_replacement,
                   ancestors=None if tree.ancestors is None else tree.ancestors[:n, :n])
        cut.__dict__["depth_list"] = tree.depth_list[:n]
        return cut
    parents = tree.parent_list
    new_index = {old: new for new, old in enumerate(kept)}
    remapped = [ROOT_PARENT if parents[i] < 0 else new_index.get(parents[i], -2) for i in kept]
    if -2 in remapped:
        raise ValueError("subtree: a kept node's parent was dropped")
    tokens, depth, scores = tree.tokens.tolist(), tree.depth_list, tree.scores.tolist()
    depth_ = [depth[i] for i in kept]
    tokens_, parents_, depth_t = torch.tensor([[tokens[i] for i in kept], remapped, depth_],
                                              dtype=tree.tokens.dtype, device=tree.tokens.device).unbind()
    cut = Tree(
        tokens=tokens_,
        parents=parents_,
        depth=depth_t,
        scores=torch.tensor([scores[i] for i in kept], dtype=tree.scores.dtype, device=tree.scores.device),
        q=None if tree.q is None else tree.q[kept],
        without_replacement=tree.without_replacement,
    )
    cut.__dict__["depth_list"] = depth_  # read off the lists at hand (see `Tree.depth_list`)
    return cut
