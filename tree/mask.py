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
    mask = torch.zeros(1, 1, n, prefix_len + n, dtype=dtype, device=tree.tokens.device)  # the prefix: all visible
    mask[0, 0, :, prefix_len:].masked_fill_(~tree.ancestor_mask(), torch.finfo(dtype).min)
    return mask


def tree_position_ids(tree: Tree, prefix_len: int) -> torch.Tensor:
    """(1, N) positions: a node at depth d sits d places after the root at ``prefix_len``."""
    return (prefix_len + tree.depth)[None]
