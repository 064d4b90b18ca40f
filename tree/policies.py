"""Tree policies: how a drafter's step function grows a candidate tree.

A step function takes the tree grown so far and the indices of frontier
nodes to expand, and returns the drafter's log-probabilities for each
frontier node's next token, shape (F, V). A policy decides which children
to keep. Policies never see a model: drafters never see a tree shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, Sequence

import torch

from specgraft.tree.tree import ROOT_PARENT, Tree

StepFn = Callable[[Tree, torch.Tensor], torch.Tensor]


class TreePolicy(Protocol):
    """Anything that grows a tree from a root token and a step function."""

    max_depth: int

    def grow(
        self, step: StepFn, root_token: int, max_depth: int | None = None, device: torch.device | str = "cpu"
    ) -> Tree: ...


class TreeBuilder:
    """Appends nodes level by level and freezes them into a `Tree`."""

    def __init__(self, root_token: int, device: torch.device | str = "cpu") -> None:
        self.device = device
        self.tokens: list[torch.Tensor] = [torch.tensor([root_token], device=device)]
        self.parents: list[torch.Tensor] = [torch.tensor([ROOT_PARENT], device=device)]
        self.depth: list[torch.Tensor] = [torch.zeros(1, dtype=torch.long, device=device)]
        self.scores: list[torch.Tensor] = [torch.zeros(1, device=device)]
        self.num_nodes = 1
        self._tree: Tree | None = Tree.root_only(root_token, device)

    def add(self, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Append children (parents must already exist); returns their node indices."""
        parent_depth = torch.cat(self.depth)[parents]
        self.tokens.append(tokens)
        self.parents.append(parents)
        self.depth.append(parent_depth + 1)
        self.scores.append(scores.float())
        start = self.num_nodes
        self.num_nodes += tokens.shape[0]
        self._tree = None
        return torch.arange(start, self.num_nodes, device=tokens.device)

    def tree(self) -> Tree:
        if self._tree is None:
            self._tree = Tree(
                tokens=torch.cat(self.tokens),
                parents=torch.cat(self.parents),
                depth=torch.cat(self.depth),
                scores=torch.cat(self.scores),
            )
        return self._tree



@dataclass(frozen=True)
class Chain:
    """A single path: the drafter's top-1 token at each of ``depth`` steps."""

    depth: int = 5

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"Chain depth must be >= 1, got {self.depth}")

    @property
    def max_depth(self) -> int:
        return self.depth

    def grow(
        self, step: StepFn, root_token: int, max_depth: int | None = None, device: torch.device | str = "cpu"
    ) -> Tree:
        depth = self.depth if max_depth is None else min(self.depth, max_depth)
        builder = TreeBuilder(root_token, device)
        last = torch.zeros(1, dtype=torch.long, device=device)
        for _ in range(depth):
            logp = step(builder.tree(), last)  # (1, V)
            score, token = logp.max(dim=-1)
            last = builder.add(token, last, builder.tree().scores[last] + score)
        return builder.tree()


@dataclass(frozen=True)
class StaticTree:
    """A fixed tree shape in Medusa's format: a list of paths of sibling ranks.

    ``[[0], [1], [0, 0]]`` keeps the drafter's top-2 tokens after the root and
    the top-1 token after the first of them. Every prefix of a path must be
    listed too.
    """

    choices: tuple[tuple[int, ...], ...]
    _levels: tuple = field(init=False, repr=False, compare=False)

    def __init__(self, choices: Sequence[Sequence[int]]) -> None:
        paths = tuple(sorted({tuple(int(r) for r in c) for c in choices}, key=lambda p: (len(p), p)))
        if not paths:
            raise ValueError("StaticTree needs at least one path")
        for path in paths:
            if not path or min(path) < 0:
                raise ValueError(f"StaticTree path {list(path)} must be non-empty ranks >= 0")
            if len(path) > 1 and path[:-1] not in paths:
                raise ValueError(f"StaticTree path {list(path)} is listed without its prefix {list(path[:-1])}")
        object.__setattr__(self, "choices", paths)
        object.__setattr__(self, "_levels", self._plan(paths))

    @staticmethod
    def _plan(paths: tuple[tuple[int, ...], ...]) -> tuple:
        """Per depth: (parent paths to expand, for each parent the ranks of its children)."""
        levels = []
        for depth in range(1, max(len(p) for p in paths) + 1):
            kids: dict[tuple[int, ...], list[int]] = {}
            for p in paths:
                if len(p) == depth:
                    kids.setdefault(p[:-1], []).append(p[-1])
            levels.append(tuple((parent, tuple(sorted(ranks))) for parent, ranks in kids.items()))
        return tuple(levels)

    @property
    def max_depth(self) -> int:
        return len(self._levels)

    @classmethod
    def from_file(cls, path: str | Path) -> StaticTree:
        """Read a JSON list of paths, or an object with a "choices" list."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tree file {path} does not exist")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"tree file {path} is not valid JSON: {err}") from None
        if isinstance(data, dict):
            data = data.get("choices")
        if not isinstance(data, list) or not all(isinstance(c, list) for c in data):
            raise ValueError(f"tree file {path} must hold a list of paths like [[0], [0, 0], [1]]")
        return cls(data)

    def grow(
        self, step: StepFn, root_token: int, max_depth: int | None = None, device: torch.device | str = "cpu"
    ) -> Tree:
        builder = TreeBuilder(root_token, device)
        node_of: dict[tuple[int, ...], int] = {(): 0}
        for level in self._levels[: max_depth if max_depth is not None else None]:
            frontier = torch.tensor([node_of[parent] for parent, _ in level], device=device)
            k = max(max(ranks) for _, ranks in level) + 1
            logp = step(builder.tree(), frontier)  # (F, V)
            top_logp, top_tok = logp.topk(k, dim=-1)  # (F, k)
            rows = torch.tensor([i for i, (_, ranks) in enumerate(level) for _ in ranks], device=device)
            ranks = torch.tensor([r for _, rs in level for r in rs], device=device)
            scores = builder.tree().scores[frontier[rows]] + top_logp[rows, ranks]
            idx = builder.add(top_tok[rows, ranks], frontier[rows], scores)
            for (parent, rs), node in zip(((p, r) for p, rr in level for r in rr), idx.tolist()):
                node_of[parent + (rs,)] = node
        return builder.tree()


def parse_tree_spec(spec: str) -> Chain | StaticTree:
    """``chain:5`` or ``static:FILE.json`` (a list of Medusa-style paths)."""
    kind, _, arg = spec.partition(":")
    if kind == "chain" and arg.isdigit():
        return Chain(depth=int(arg))
    if kind == "static" and arg:
        return StaticTree.from_file(arg)
    raise ValueError(f"unknown tree spec {spec!r}: expected 'chain:DEPTH' or 'static:FILE.json'")
