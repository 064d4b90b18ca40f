"""Acceptance rules: which tree path the target keeps.

Pure tensor functions over a `Tree` and the target's logits at every node.
Greedy and sampling live in separate functions, never behind a mode string.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgraft.tree import Tree


@dataclass(frozen=True)
class Acceptance:
    """path: (K,) accepted node indices, root first. next_token: the target's own token after the path."""

    path: torch.Tensor
    next_token: int


def greedy_accept(tree: Tree, logits: torch.Tensor) -> Acceptance:
    """Longest root-to-node path whose every token equals the target's argmax at its parent.

    Rule: node i survives when tokens[i] == argmax(logits[parent(i)]) and its
    parent survives. The deepest survivor ends the path; the target's argmax
    there is the bonus (or correction) token, so every step commits >= 1 token.

    Args:
        tree: N nodes, node 0 the root.
        logits: (N, V) target logits at each node.
    """
    choice = logits.argmax(dim=-1)  # (N,) target's token after each node
    match = torch.ones(tree.num_nodes, dtype=torch.bool, device=choice.device)
    match[1:] = tree.tokens[1:] == choice[tree.parents[1:]]
    # alive[i]: every node on i's path (itself included) matches.
    alive = ~(tree.ancestor_mask() & ~match[None]).any(dim=1)  # (N,)
    best = int(torch.where(alive, tree.depth, -1).argmax())
    return Acceptance(path=tree.ancestor_mask()[best].nonzero().flatten(), next_token=int(choice[best]))
