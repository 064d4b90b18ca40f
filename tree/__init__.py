"""Pure tree logic (torch only, never transformers): trees, masks, positions, policies."""

from specgraft.tree.adaptive import Adaptive
from specgraft.tree.dynamic import DynamicTree, cut_trees, subtree
from specgraft.tree.mask import additive_mask, tree_attention_mask, tree_position_ids
from specgraft.tree.policies import (
    Chain, Growth, StaticTree, TreeBuilder, TreePolicy, grow_chains, grow_together, parse_tree_spec, policy_from_spec,
    tree_from_spec,
)
from specgraft.tree.sampling import Sampling
from specgraft.tree.tree import ROOT_PARENT, Tree, read_lists

__all__ = [
    "ROOT_PARENT",
    "Adaptive",
    "Chain",
    "DynamicTree",
    "Growth",
    "Sampling",
    "StaticTree",
    "Tree",
    "TreeBuilder",
    "TreePolicy",
    "additive_mask",
    "cut_trees",
    "grow_chains",
    "grow_together",
    "parse_tree_spec",
    "policy_from_spec",
    "read_lists",
    "subtree",
    "tree_attention_mask",
    "tree_from_spec",
    "tree_position_ids",
]
