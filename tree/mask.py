"""Attention masks and positions for verifying a tree in one forward pass.

The target sees the committed prefix fully and, among tree nodes, only a
node's ancestors and itself. Masks are additive floats in the model's dtype:
a boolean 4D mask is silently wrong under eager attention.
"""

from __future__ import annotations

import torch

from specgraft.tree.tree import Tree


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(T, K) bool -> (1, 1, T, K) float: 0 where visible, the dtype's minimum elsewhere."""
    blocked = torch.full(visible.shape, torch.finfo(dtype).min, dtype=dtype, device=visible.device)
    return blocked.masked_fill(visible, 0.0)[None, None]


def tree_attention_mask(tree: Tree, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
    """(1, 1, N, prefix_len + N) additive mask for a forward over all tree nodes."""
    n = tree.num_nodes
    prefix = torch.ones(n, prefix_len, dtype=torch.bool, device=tree.tokens.device)
    return additive_mask(torch.cat([prefix, tree.ancestor_mask()], dim=1), dtype)


def tree_position_ids(tree: Tree, prefix_len: int) -> torch.Tensor:
    """(1, N) positions: a node at depth d sits d places after the root at ``prefix_len``."""
    return (prefix_len + tree.depth)[None]


def batched_tree_inputs(
    trees: list[Tree | None], prefix_lens: list[int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, positions and mask for verifying one tree per row in one forward.

    Row b's T new tokens (its N_b nodes, then padding up to the widest tree)
    take cache slots [prefix_b, prefix_b + T); the keys span slots
    [0, max prefix + T). A node sees its row's prefix, its ancestors and itself;
    a padding query sees only itself (its output is never read), and nothing of
    another row's slots or of stale slots past the row's own is visible. A row
    without a tree (None: a free row) is padding only.

    Returns:
        tokens: (B, T) node tokens; padding holds token 0 (masked, never read).
        positions: (B, T) prefix_b + depth; padding sits at prefix_b.
        mask: (B, 1, T, max(prefix_lens) + T) additive float in ``dtype``.
    """
    real = [tree for tree in trees if tree is not None]
    device = real[0].tokens.device
    b, t = len(trees), max(tree.num_nodes for tree in real)
    width = max(prefix_lens) + t
    tokens = torch.zeros(b, t, dtype=torch.long, device=device)
    positions = torch.tensor(prefix_lens, device=device)[:, None].repeat(1, t)
    visible = torch.zeros(b, t, width, dtype=torch.bool, device=device)
    pad = torch.arange(t, device=device)
    for row, (tree, prefix) in enumerate(zip(trees, prefix_lens)):
        n = 0 if tree is None else tree.num_nodes
        if n:
            tokens[row, :n] = tree.tokens
            positions[row, :n] = prefix + tree.depth
            visible[row, :n, :prefix] = True
            visible[row, :n, prefix : prefix + n] = tree.ancestor_mask()
        visible[row, pad[n:], prefix + pad[n:]] = True
    blocked = torch.full(visible.shape, torch.finfo(dtype).min, dtype=dtype, device=device)
    return tokens, positions, blocked.masked_fill(visible, 0.0)[:, None]
