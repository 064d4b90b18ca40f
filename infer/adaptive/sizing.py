"""Hardware-aware tree sizing: pick the tree that commits the most tokens per second.

Inputs, both measured (see ``specgraft.tools.tune``):

- ``acceptance[d][r]``: probability that the drafter's rank-r token at depth d
  is the one verification keeps, given its parent was kept (the positional
  acceptance model of Sequoia). Under greedy verification exactly one token
  is kept, so the events for different ranks are exclusive and the value of
  a node is the product of its path's acceptance probabilities.
- ``verify_cost[n]``: the target's forward time for n tree nodes relative to
  one token, and ``draft_cost_per_depth``: one draft round relative to it.
- ``plain_step``: one plain decoding step (forward plus the engine's own
  work) and ``step_overhead``: what a speculative step spends beyond its
  forward and draft rounds (verification, commits, masks), both relative to
  one token's forward. On a small target these are not negligible: they
  decide whether speculation pays at all.

With node values that never increase down a path or across sibling ranks,
the best tree of n nodes is the n most valuable nodes (Sequoia's dynamic
program reduces to best-first selection under this model), so every size is
evaluated and the fastest kept.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class TreeChoice:
    """A sized tree and its model-predicted figures."""

    choices: list[list[int]]  # Medusa-style paths of sibling ranks
    expected_tokens: float  # committed tokens per step (accepted drafts + the target's own)
    relative_cost: float  # step time relative to one plain decoding step
    depth: int

    @property
    def speedup(self) -> float:
        """Predicted tokens per second relative to plain decoding."""
        return self.expected_tokens / self.relative_cost


def best_first_paths(acceptance: Sequence[Sequence[float]], budget: int) -> list[tuple[float, tuple[int, ...]]]:
    """The ``budget`` most valuable nodes as (value, rank path), in the order they were chosen.

    A node's value is its parent's times the acceptance of its (depth, rank);
    a node becomes a candidate once its parent and its next-better sibling are chosen.
    """
    heap: list[tuple[float, tuple[int, ...], float]] = []  # (-value, path, parent value)
    if acceptance and acceptance[0]:
        heap.append((-acceptance[0][0], (0,), 1.0))
    chosen = []
    while heap and len(chosen) < budget:
        neg, path, parent_value = heapq.heappop(heap)
        chosen.append((-neg, path))
        depth, rank = len(path), path[-1]
        ranks = acceptance[depth - 1]
        if rank + 1 < len(ranks):
            heapq.heappush(heap, (-parent_value * ranks[rank + 1], path[:-1] + (rank + 1,), parent_value))
        if depth < len(acceptance) and acceptance[depth]:
            heapq.heappush(heap, (neg * acceptance[depth][0], path + (0,), -neg))
    return chosen


def size_tree(
    acceptance: Sequence[Sequence[float]],
    verify_cost: dict[int, float],
    draft_cost_per_depth: float,
    max_nodes: int | None = None,
    *,
    step_overhead: float = 0.0,
    plain_step: float = 1.0,
) -> tuple[TreeChoice, list[TreeChoice]]:
    """The fastest tree under the measured costs, and the prediction for every size tried.

    A tree of n draft nodes and depth D costs, in plain decoding steps,
    ``1 + (verify_cost[n + 1] - 1 + draft_cost_per_depth * D + step_overhead) / plain_step``.

    Args:
        acceptance: per depth, per sibling rank, the probability the node is kept given its parent.
        verify_cost: nodes verified (root included) -> forward time relative to one token;
            sizes between measured points are interpolated linearly.
        draft_cost_per_depth: one draft round's time relative to one target token.
        max_nodes: largest tree considered (default: the largest measured size - 1).
        step_overhead: a speculative step's extra engine work, relative to one target token.
        plain_step: one plain decoding step relative to one target token (>= 1: the forward and its bookkeeping).
    """
    if plain_step <= 0:
        raise ValueError(f"plain_step must be positive, got {plain_step}")
    sizes = sorted(verify_cost)
    if not sizes or sizes[0] != 1:
        raise ValueError("verify_cost must include the one-token forward (n = 1)")
    limit = min(max_nodes or sizes[-1] - 1, sizes[-1] - 1)
    nodes = best_first_paths(acceptance, limit)
    candidates = [TreeChoice([], 1.0, 1.0, 0)]  # plain decoding
    value_sum, depth = 0.0, 0
    for n, (value, path) in enumerate(nodes, start=1):
        value_sum += value
        depth = max(depth, len(path))
        cost = 1.0 + (interpolate(verify_cost, n + 1) - 1.0 + draft_cost_per_depth * depth + step_overhead) / plain_step
        candidates.append(TreeChoice([list(p) for _, p in nodes[:n]], 1.0 + value_sum, cost, depth))
    return max(candidates, key=lambda c: c.speedup), candidates


def interpolate(points: dict[int, float], n: int) -> float:
    """Piecewise-linear value at n from measured points (clamped beyond the last one)."""
    xs = sorted(points)
    if n <= xs[0]:
        return points[xs[0]]
    for lo, hi in zip(xs, xs[1:]):
        if n <= hi:
            return points[lo] + (points[hi] - points[lo]) * (n - lo) / (hi - lo)
    return points[xs[-1]]
