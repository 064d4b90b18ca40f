"""The candidate tree: one frozen value per speculative step.

Node 0 is the root: the last committed token, which the target has not yet
run. Every other node is a draft token. Nodes are stored parents-first
(``parents[i] < i``), so masks and paths are plain tensor ops.

Shape legend: N nodes, V vocabulary.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import torch

ROOT_PARENT = -1  # the root's parent index: it has none
# Trees of up to this many nodes derive their ancestor masks from one int64 per node (a 25-node trie: 18 us, against
# 76 us for a matrix product per level); larger ones, by those products.
ANCESTOR_BITS = 63


@dataclass(frozen=True)
class Tree:
    """A candidate tree, node 0 being the root.

    Attributes:
        tokens: (N,) token id of each node.
        parents: (N,) index of each node's parent; ``ROOT_PARENT`` for node 0.
        depth: (N,) distance from the root (root = 0).
        scores: (N,) cumulative draft log-probability of the path to the node (root = 0).
        q: (N, V) the draft distribution each node's token was sampled from
            (row 0, the root's, is unused), or None when children were chosen
            deterministically (top-k): verification then treats them as point masses.
        without_replacement: siblings were drawn without replacement from q.
        ancestors: (N, N) bool ancestor mask (see `ancestor_mask`) from a builder that grew it with the
            tree (`TreeBuilder`): the structure is then the builder's to keep, and only shapes are checked.
            None: derived from ``parents`` on first use, after the structure is checked.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    scores: torch.Tensor
    q: torch.Tensor | None = None
    without_replacement: bool = False
    ancestors: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        for name in ("parents", "depth", "scores"):
            if getattr(self, name).shape != (n,):
                raise ValueError(f"Tree.{name} has shape {tuple(getattr(self, name).shape)}, expected ({n},)")
        if self.q is not None and self.q.shape[0] != n:
            raise ValueError(f"Tree.q has {self.q.shape[0]} rows for {n} nodes")
        if self.ancestors is not None:
            if self.ancestors.shape != (n, n):
                raise ValueError(f"Tree.ancestors has shape {tuple(self.ancestors.shape)}, expected ({n}, {n})")
            return  # a builder's tree: checking the structure per level would cost more than the step's forward
        parents = self.parent_list  # a few dozen ints: checked in Python faster than by tensor ops
        if n == 0 or parents[0] != ROOT_PARENT:
            raise ValueError("Tree needs a root at node 0 with parent -1")
        if any(p >= i for i, p in enumerate(parents)):
            raise ValueError("Tree nodes must be stored parents-first (parents[i] < i)")
        if any(p < 0 for p in parents[1:]):
            raise ValueError("only node 0 may be a root")

    @classmethod
    def root_only(cls, token: int | torch.Tensor, device: torch.device | str = "cpu") -> Tree:
        """The tree of plain decoding: the root and nothing to verify. Every plain row asks for one every step, so
        each is made once per token and device and shared, read-only (5-7 us a row a step before, here).

        ``token`` may be a (1,) tensor already on the device (the engine's last choice for the row): the tree then
        holds it as it is, and nothing is copied to the device.
        """
        if isinstance(token, torch.Tensor):
            return _known(cls, token, *_root_structure(token.device), parent_list=[ROOT_PARENT], depth_list=[0],
                          score_list=[0.0])
        return _root_only(int(token), torch.device(device))

    @classmethod
    def chain(cls, tokens: torch.Tensor, scores: torch.Tensor, q: torch.Tensor | None = None) -> Tree:
        """A chain of ``tokens`` (N,) (the root first), its structure shared by every chain of that length: a batched
        drafter's chains are views of its tensors, their structure known without reading anything back."""
        parents, depth, ancestors = _chain_structure(tokens.shape[0], tokens.device)
        if q is not None and q.shape[0] != tokens.shape[0]:
            raise ValueError(f"Tree.q has {q.shape[0]} rows for {tokens.shape[0]} nodes")
        n = tokens.shape[0]
        return _known(cls, tokens, parents, depth, scores, ancestors, q=q, parent_list=list(range(-1, n - 1)),
                      depth_list=list(range(n)))

    @classmethod
    def from_host(
        cls, tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, ancestor_bits: torch.Tensor, *,
        parent_list: list[int], depth_list: list[int],
    ) -> Tree:
        """A tree built on the host (a prompt-lookup trie), its tensors copied already with its ancestors as one
        int each (bit j of node i: j is i or one of its ancestors; all 0 past `ANCESTOR_BITS` nodes, derived then),
        its structure's lists kept: the structure is checked on the host, nothing is read back for it."""
        n = len(parent_list)
        tree = _known(cls, tokens, parents, depth, _zero_scores(n, tokens.device), None,
                      parent_list=parent_list, depth_list=depth_list, score_list=[0.0] * n)
        tree.__post_init__()  # checks the lists: parents first, one root
        if n <= ANCESTOR_BITS:
            tree.__dict__["_ancestor_bits"] = ancestor_bits  # read only where a mask is needed (not for a chain)
        return tree

    def to(self, device: torch.device | str) -> Tree:
        if self.tokens.device == torch.device(device):
            return self
        q = None if self.q is None else self.q.to(device)
        return Tree(
            self.tokens.to(device), self.parents.to(device), self.depth.to(device), self.scores.to(device), q,
            self.without_replacement, self.ancestor_mask().to(device),
        )

    @cached_property
    def num_nodes(self) -> int:  # read a few times a row a step: once from the tensor's shape
        return self.tokens.shape[0]

    @property
    def num_draft_tokens(self) -> int:
        """Nodes proposed by the drafter (the root is not a proposal)."""
        return self.num_nodes - 1

    @cached_property
    def parent_list(self) -> list[int]:
        """``parents`` as a list, read once: the controller, selection and cuts walk a tree's structure in Python
        (a few dozen ints), where each read of a tensor costs microseconds."""
        return self.parents.tolist()

    @cached_property
    def depth_list(self) -> list[int]:
        """``depth`` as a list, read once (see `parent_list`)."""
        return self.depth.tolist()

    @cached_property
    def score_list(self) -> list[float]:
        """``scores`` as a list, read once (see `parent_list`)."""
        return self.scores.tolist()

    @cached_property
    def max_depth(self) -> int:
        return max(self.depth_list)

    @property
    def depth_bound(self) -> int:
        """At least the tree's depth, never read from the device: its depth where its host lists are known (a
        chain's, a trie's), else what its builder bounded it by (a device-grown tree's levels), else N - 1."""
        if "depth_list" in self.__dict__:
            return self.max_depth
        return self.__dict__.get("_depth_bound", self.num_nodes - 1)

    @cached_property
    def is_chain(self) -> bool:
        """True when node i's parent is i - 1 throughout: plain causal attention suffices. Read off `parent_list`: as
        tensor ops it cost 12 us a tree, and every verified tree asks."""
        return all(p == i - 1 for i, p in enumerate(self.parent_list) if i)

    def ancestor_mask(self) -> torch.Tensor:
        """(N, N) bool: ``[i, j]`` is True when j is i or one of i's ancestors."""
        return self.ancestors if self.ancestors is not None else self._derived_ancestors

    @cached_property
    def _derived_ancestors(self) -> torch.Tensor:
        parents, device = self.parent_list, self.tokens.device
        n = len(parents)
        bits = self.__dict__.get("_ancestor_bits")  # staged with the tree (see `from_host`)
        if bits is not None:
            return (bits[:, None] >> torch.arange(n, device=device)) & 1 == 1
        if n <= ANCESTOR_BITS:  # each node's ancestors as the bits of one int, read off its parent's: one tensor op
            bits = ancestor_bits(parents)
            return (torch.tensor(bits, device=device)[:, None] >> torch.arange(n, device=device)) & 1 == 1
        eye = torch.eye(n, dtype=torch.bool, device=device)
        # step[i, j]: j is i's parent. Reach ancestors one generation at a time.
        step = torch.zeros(n, n, dtype=torch.float32, device=device)
        step[torch.arange(1, n), self.parents[1:]] = 1.0
        mask, reach = eye.clone(), eye.float()
        for _ in range(self.max_depth):
            reach = reach @ step  # (N, N): ancestor one generation further up
            mask |= reach.bool()
        return mask

    def leaves(self) -> torch.Tensor:
        """Indices of nodes with no children, in storage order."""
        is_parent = torch.zeros(self.num_nodes, dtype=torch.bool, device=self.tokens.device)
        is_parent[self.parents[1:]] = True
        return (~is_parent).nonzero().flatten()

    def path_to(self, node: int) -> torch.Tensor:
        """Node indices from the root down to ``node`` (inclusive)."""
        return self.ancestor_mask()[node].nonzero().flatten()  # parents-first order = root-first

    def paths(self) -> list[torch.Tensor]:
        """Every root-to-leaf path as node indices, root first."""
        anc = self.ancestor_mask()
        return [anc[leaf].nonzero().flatten() for leaf in self.leaves().tolist()]

    def children(self, node: int) -> torch.Tensor:
        return (self.parents == node).nonzero().flatten()


ROOT_TREES = 8192  # one-node trees kept (one per token and device): the tokens a run meets most, a few MB


LISTS = ("parent_list", "depth_list", "score_list")


def read_lists(trees: Sequence[Tree]) -> None:
    """Read the parents, depths and scores of every tree in ``trees`` not read yet, in one copy to the host for all
    (a step's trees: read a tree at a time, each list is a sync of its own), into their `parent_list`, `depth_list`
    and `score_list`."""
    todo = [(tree, name) for tree in trees for name in LISTS if name not in tree.__dict__]
    if not todo:
        return
    tensors = {"parent_list": "parents", "depth_list": "depth", "score_list": "scores"}
    ints = [(tree, name) for tree, name in todo if name != "score_list"]  # then the scores: a cast for each kind
    floats = [(tree, name) for tree, name in todo if name == "score_list"]
    parts = [torch.cat([getattr(tree, tensors[name]) for tree, name in kind]).double() for kind in (ints, floats) if kind]
    values = (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist()
    at = 0
    for tree, name in ints + floats:
        n = tree.num_nodes
        tree.__dict__[name] = values[at : at + n] if name == "score_list" else [int(v) for v in values[at : at + n]]
        at += n


@functools.cache
def _root_structure(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(parents, depth, scores, ancestors) of a one-node tree on ``device``."""
    return (
        torch.tensor([ROOT_PARENT], device=device),
        torch.zeros(1, dtype=torch.long, device=device),
        torch.zeros(1, device=device),
        torch.ones(1, 1, dtype=torch.bool, device=device),
    )


@functools.lru_cache(maxsize=64)
def _zero_scores(n: int, device: torch.device) -> torch.Tensor:
    """(n,) zeros: the scores of a tree built on the host, made once per size and device (a tree never writes them)."""
    return torch.zeros(n, device=device)


def ancestor_bits(parents: list[int]) -> list[int]:
    """Each node's ancestors (itself included) as the set bits of one int, read off its parent's (parents first)."""
    bits = [0] * len(parents)
    for i, p in enumerate(parents):
        bits[i] = (bits[p] if p >= 0 else 0) | 1 << i
    return bits


def _known(cls: type[Tree], tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, scores: torch.Tensor,
           ancestors: torch.Tensor | None, q: torch.Tensor | None = None, **lists: list[int]) -> Tree:
    """A tree of a structure made and checked once (a root alone, a chain): its fields set without the checks of
    ``__init__`` (a root-only tree a row a step: 1.4 us here against 2.1), its structure's host lists with it."""
    tree = object.__new__(cls)
    tree.__dict__.update(tokens=tokens, parents=parents, depth=depth, scores=scores, q=q, without_replacement=False,
                         ancestors=ancestors, **lists)
    return tree


@functools.lru_cache(maxsize=64)
def _chain_structure(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(parents, depth, ancestors) of an ``n``-node chain on ``device``."""
    depth = torch.arange(n, device=device)
    return depth - 1, depth, torch.ones(n, n, dtype=torch.bool, device=device).tril()


@functools.lru_cache(maxsize=ROOT_TREES)
def _root_only(token: int, device: torch.device) -> Tree:
    parents, depth, scores, ancestors = _root_structure(device)
    return _known(Tree, torch.tensor([token], device=device), parents, depth, scores, ancestors,
                  parent_list=[ROOT_PARENT], depth_list=[0], score_list=[0.0])

