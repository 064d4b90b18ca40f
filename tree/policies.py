"""Tree policies: how a drafter's step function grows a candidate tree.

A step function takes the tree grown so far and the indices of frontier
nodes to expand, and returns the drafter's log-probabilities for each
frontier node's next token, shape (F, V). A policy decides which children
to keep. Policies never see a model: drafters never see a tree shape.

A policy's growth is a generator, `levels`: it yields (tree so far,
frontier) and is sent the frontier's (F, V) log-probs, level by level, and
returns the finished tree. `grow` drives one growth with a step function;
`grow_together` drives several at once, so a drafter can run one forward
per level for many sequences' trees. A policy that only has `grow` still
works everywhere, one tree at a time.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator, Protocol, Sequence

import torch

from specgraft.specs import (
    TREE_OBJECTS, AdaptiveSpec, ChainSpec, DynamicSpec, StaticFileSpec, TreeSpec, parse_tree, tree_objects,
)
from specgraft.tree.draw import Picked, check_draw, pick_children
from specgraft.tree.sampling import Sampling
from specgraft.tree.tree import ROOT_PARENT, Tree

StepFn = Callable[[Tree, torch.Tensor], torch.Tensor]
# A tree growing level by level: yields (tree so far, frontier (F,)), is sent (F, V) log-probs, returns the tree.
Growth = Generator[tuple[Tree, torch.Tensor], torch.Tensor, Tree]
# Several growths' requests of one level, (index, tree, frontier) each -> each one's (F, V) log-probs, in order.
StepAllFn = Callable[[list[tuple[int, Tree, torch.Tensor]]], list[torch.Tensor]]


class TreePolicy(Protocol):
    """Anything that grows a tree from a root token and a step function.

    Chain, StaticTree and DynamicTree also offer ``levels`` (the same growth as a
    `Growth`), which lets `grow_together` grow them beside other trees.
    """

    max_depth: int

    def grow(
        self,
        step: StepFn,
        root_token: int,
        max_depth: int | None = None,
        device: torch.device | str = "cpu",
        sampling: Sampling | None = None,
    ) -> Tree:
        """Grow a tree; ``sampling`` None or greedy draws every child top-k."""


def drive(growth: Growth, step: StepFn) -> Tree:
    """Run one growth to its tree, answering each level with ``step``."""
    try:
        asked = next(growth)
        while True:
            asked = growth.send(step(*asked))
    except StopIteration as done:
        return done.value


class Levelled:
    """A policy whose growth is a `Growth` (``levels``): ``grow`` drives it with one step function.

    Chain, StaticTree, DynamicTree and Adaptive share this ``grow``; `grow_together` drives their ``levels``.
    """

    def grow(
        self,
        step: StepFn,
        root_token: int,
        max_depth: int | None = None,
        device: torch.device | str = "cpu",
        sampling: Sampling | None = None,
    ) -> Tree:
        """Grow a tree; ``sampling`` None or greedy draws every child top-k."""
        return drive(self.levels(root_token, max_depth, device, sampling), step)


def grow_together(growths: Sequence[Growth], step_all: StepAllFn) -> list[Tree]:
    """Run several growths level by level: one ``step_all`` call per level answers every growth still growing.

    Growths of different depths finish at different levels; the others go on without them.
    """
    trees: list[Tree | None] = [None] * len(growths)
    waiting: dict[int, tuple[Tree, torch.Tensor]] = {}

    def advance(i: int, logp: torch.Tensor | None) -> None:
        try:
            waiting[i] = growths[i].send(logp)  # send(None) starts a growth
        except StopIteration as done:
            trees[i] = done.value

    for i in range(len(growths)):
        advance(i, None)
    while waiting:
        asked = [(i, tree, frontier) for i, (tree, frontier) in waiting.items()]
        waiting.clear()
        for (i, _, _), logp in zip(asked, step_all(asked), strict=True):
            advance(i, logp)
    return trees


# A batched drafter's step for chains: (R,) the tokens just drafted, one a row -> (R, V) log-probs of their children.
ChainStepFn = Callable[[torch.Tensor], torch.Tensor]


def grow_chains(
    roots: torch.Tensor, logp: torch.Tensor, step: ChainStepFn, policies: Sequence[Chain], max_depths: Sequence[int],
    samplings: Sequence[Sampling | None],
) -> list[Tree]:
    """Every row's `Chain` at once, level by level: one ``step`` a level for all rows, nothing read back.

    Each row drafts as its Chain's ``levels`` would alone (the same picks, and a sampled row's RNG drawn the same
    times: a row whose chain is shorter than the longest takes the shared top-1 beyond it, which its tree drops).

    Args:
        roots: (R,) the rows' root tokens. logp: (R, V) the drafter's log-probs after each root.
        step: the next level's log-probs after the tokens just drafted.
        policies, max_depths, samplings: each row's chain, the deepest it may draft, and its sampling.
    """
    depths = [min(p.depth, m) for p, m in zip(policies, max_depths, strict=True)]
    sampled = [s is not None and not s.greedy and p.draw != "top-k" for p, s in zip(policies, samplings)]
    tokens, logq, q = [], [], []  # per level: (R,) picks, (R,) their log-probs, (R, V) each row's q where sampled
    for level in range(max(depths)):
        top_logp, top = (x[:, 0] for x in logp.topk(1, dim=-1))  # (R,): every top-k row's pick, as `pick_children`
        drawing = [r for r in range(len(depths)) if sampled[r] and level < depths[r]]
        picks, logps, level_q = (top, top_logp, None) if not drawing else _draw_rows(logp, top, top_logp, drawing, policies, samplings)
        tokens.append(picks)
        logq.append(logps)
        q.append(level_q)
        if level + 1 < max(depths):
            logp = step(picks)
    chains = torch.stack([roots, *tokens], 1)  # (R, D + 1)
    scores = torch.cat([torch.zeros_like(logq[0])[:, None], torch.stack(logq, 1).float().cumsum(1)], 1)
    deepest = max((d for d, s in zip(depths, sampled) if s), default=0)  # every level below it drew for some row
    if deepest:  # (R, deepest + 1, V): each row's q by level, the root's row unused (zeros)
        q_rows = torch.stack(q[:deepest], 1)
        q_rows = torch.cat([q_rows.new_zeros(q_rows.shape[0], 1, q_rows.shape[2]), q_rows], 1)
    return [Tree.chain(chains[r, : depth + 1], scores[r, : depth + 1], q_rows[r, : depth + 1] if sampled[r] else None)
            for r, depth in enumerate(depths)]


def _draw_rows(
    logp: torch.Tensor, top: torch.Tensor, top_logp: torch.Tensor, drawing: Sequence[int], policies: Sequence[Chain],
    samplings: Sequence[Sampling | None],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chain level's picks where some rows draw: (R,) tokens (the others' top-1), (R,) their draft log-probs,
    and (R, V) each drawing row's q (another row's is a filtered q it does not use).

    q comes from one `Sampling.probs` call over every row for each filter setting the drawing rows use (filters
    work row by row, so each row's q is the one it gets alone); only the draw runs a row at a time, with the row's
    own RNG: the one draw `pick_children` makes for it alone.
    """
    by_filters: dict[Sampling, torch.Tensor] = {}
    for r in drawing:
        by_filters.setdefault(samplings[r], None)  # Samplings compare by their filters, not their RNGs
    for sampling in by_filters:
        by_filters[sampling] = sampling.probs(logp)  # (R, V)
    first = next(iter(by_filters.values()))
    chosen = set(drawing)
    q = first if len(by_filters) == 1 else torch.stack(
        [by_filters[samplings[r]][r] if r in chosen else first[r] for r in range(logp.shape[0])])
    picks = list(top.split(1))
    for r in drawing:
        picks[r] = samplings[r].draw(q[r : r + 1], 1, replacement=policies[r].draw == "sample")[0]  # (1,)
    picks = torch.cat(picks)
    drawn = q.gather(1, picks[:, None]).log()  # (R, 1): log q of each pick
    logps = [drawn[r] if r in chosen else top_logp[r : r + 1] for r in range(logp.shape[0])]
    return picks, torch.cat(logps), q


class TreeBuilder:
    """Appends nodes level by level and freezes them into a `Tree`."""

    def __init__(self, root_token: int, device: torch.device | str = "cpu") -> None:
        self.device = device
        self.tokens: list[torch.Tensor] = [torch.tensor([root_token], device=device)]
        self.parents: list[torch.Tensor] = [torch.tensor([ROOT_PARENT], device=device)]
        self.depth: list[torch.Tensor] = [torch.zeros(1, dtype=torch.long, device=device)]
        self.scores: list[torch.Tensor] = [torch.zeros(1, device=device)]
        self.q: list[torch.Tensor] = []  # (n, V) blocks, one row per drafted node
        self.without_replacement = False
        self.ancestors = torch.ones(1, 1, dtype=torch.bool, device=device)  # (N, N), grown with each add
        self.num_nodes = 1
        self._tree: Tree | None = Tree.root_only(root_token, device)

    def add(
        self, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, q: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Append children (parents must already exist); returns their node indices.

        q: (n, V) the distribution each child was sampled from, or None (top-k).
        """
        if (q is None) != (not self.q) and self.num_nodes > 1:
            raise ValueError("a tree's children are either all sampled (with q) or all top-k (without)")
        if q is not None:
            self.q.append(q)
        n_new = tokens.shape[0]
        # A child sees what its parent sees, and itself.
        rows = torch.cat([self.ancestors[parents], torch.eye(n_new, dtype=torch.bool, device=tokens.device)], dim=1)
        self.ancestors = torch.cat([torch.nn.functional.pad(self.ancestors, (0, n_new)), rows])  # (N + n, N + n)
        parent_depth = torch.cat(self.depth)[parents]
        self.tokens.append(tokens)
        self.parents.append(parents)
        self.depth.append(parent_depth + 1)
        self.scores.append(scores.float())
        start = self.num_nodes
        self.num_nodes += tokens.shape[0]
        self._tree = None
        return torch.arange(start, self.num_nodes, device=tokens.device)

    def add_picked(self, parents: torch.Tensor, picked: Picked, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Append the children `pick_children` chose for frontier ``parents`` (F,), k per parent.

        keep: (F, k) bool selecting which of the k children to keep per parent (all by default).
        """
        keep = torch.ones_like(picked.tokens, dtype=torch.bool) if keep is None else keep
        rows = keep.nonzero()[:, 0]  # parent row of each kept child, parents-first order
        q = None if picked.q is None else picked.q[rows]
        scores = self.tree().scores[parents[rows]] + picked.logq[keep]
        return self.add(picked.tokens[keep], parents[rows], scores, q)

    def tree(self) -> Tree:
        if self._tree is None:
            q = None
            if self.q:
                first = self.q[0]
                q = torch.cat([torch.zeros(1, first.shape[-1], dtype=first.dtype, device=first.device), *self.q])
            self._tree = Tree(
                tokens=torch.cat(self.tokens),
                parents=torch.cat(self.parents),
                depth=torch.cat(self.depth),
                scores=torch.cat(self.scores),
                q=q,
                without_replacement=self.without_replacement,
                ancestors=self.ancestors,
            )
        return self._tree



@dataclass(frozen=True)
class Chain(Levelled):
    """A single path of ``depth`` drafts.

    Greedy decoding takes the drafter's top-1 token at each step. When sampling,
    ``draw="sample"`` (the default) draws each token from q, as in the
    speculative sampling papers; ``draw="top-k"`` keeps the top-1 token as a
    point mass.
    """

    depth: int = 5
    draw: str = "sample"

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"Chain depth must be >= 1, got {self.depth}")
        check_draw(self.draw)

    @property
    def max_depth(self) -> int:
        return self.depth

    def levels(
        self, root_token: int, max_depth: int | None = None, device: torch.device | str = "cpu",
        sampling: Sampling | None = None,
    ) -> Growth:
        depth = self.depth if max_depth is None else min(self.depth, max_depth)
        builder = TreeBuilder(root_token, device)
        last = torch.zeros(1, dtype=torch.long, device=device)
        for _ in range(depth):
            logp = yield builder.tree(), last  # (1, V)
            last = builder.add_picked(last, pick_children(logp, 1, self.draw, sampling))
        return builder.tree()


@dataclass(frozen=True)
class StaticTree(Levelled):
    """A fixed tree shape in Medusa's format: a list of paths of sibling ranks.

    ``[[0], [1], [0, 0]]`` keeps the drafter's top-2 tokens after the root and
    the top-1 token after the first of them. Every prefix of a path must be
    listed too. When sampling, ``draw`` says how the children of a node are
    chosen: ``top-k`` (default; point masses), ``sample`` or
    ``sample-without-replacement`` (as many draws from q as the shape has
    children there). Sampled ranks only order a node's children: its m
    listed ranks take its first m draws, so ``[[1]]`` draws like ``[[0]]``.
    """

    choices: tuple[tuple[int, ...], ...]
    draw: str = "top-k"
    _levels: tuple = field(init=False, repr=False, compare=False)

    def __init__(self, choices: Sequence[Sequence[int]], draw: str = "top-k") -> None:
        object.__setattr__(self, "draw", check_draw(draw))
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
    def from_file(cls, path: str | Path, draw: str = "top-k") -> StaticTree:
        """Read a JSON list of paths, or an object with a "choices" list."""
        return cls.from_spec(_read_json(path), f"tree file {path}", draw)

    @classmethod
    def from_spec(cls, data: Any, where: str = "tree spec", draw: str = "top-k") -> StaticTree:
        """A parsed list of paths, or an object with a "choices" list."""
        if isinstance(data, dict):
            data = data.get("choices")
        if not isinstance(data, list) or not all(isinstance(c, list) for c in data):
            raise ValueError(f"{where} must hold a list of paths like [[0], [0, 0], [1]]")
        bad = next((c for c in data if not all(isinstance(r, int) and not isinstance(r, bool) for r in c)), None)
        if bad is not None:
            raise ValueError(f"{where}: path {bad} must hold integer sibling ranks, like [0, 1]")
        try:
            return cls(data, draw=draw)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None

    def levels(
        self, root_token: int, max_depth: int | None = None, device: torch.device | str = "cpu",
        sampling: Sampling | None = None,
    ) -> Growth:
        builder = TreeBuilder(root_token, device)
        sampled = sampling is not None and not sampling.greedy and self.draw != "top-k"
        builder.without_replacement = sampled and self.draw == "sample-without-replacement"
        node_of: dict[tuple[int, ...], int] = {(): 0}
        for level in self._levels[: max_depth if max_depth is not None else None]:
            # A parent whose q had fewer tokens than draws (without replacement) was never added, nor its subtree.
            level = [(parent, ranks) for parent, ranks in level if parent in node_of]
            if not level:
                break
            frontier = torch.tensor([node_of[parent] for parent, _ in level], device=device)
            # Which of a parent's k picks each listed rank keeps. Top-k picks are point masses: rank r is
            # the (r+1)-th most likely token, gaps and all. Sampled picks are verified in draw order, the
            # i-th against q less the siblings drawn before it (without replacement; q itself with it). A
            # draw kept behind a dropped one came from q less the dropped token as well, which the rule
            # never sees, so a parent's m sampled children are its first m draws, ranks in order.
            slots = [range(len(ranks)) if sampled else ranks for _, ranks in level]
            k = max(max(s) for s in slots) + 1
            logp = yield builder.tree(), frontier  # (F, V)
            picked = pick_children(logp, k, self.draw, sampling)  # (F, <=k)
            keep = torch.zeros_like(picked.tokens, dtype=torch.bool)
            for row, s in enumerate(slots):
                keep[row, [j for j in s if j < keep.shape[1]]] = True
            idx = builder.add_picked(frontier, picked, keep)  # parents first, draws in order within a parent
            kept_paths = [
                parent + (r,) for (parent, ranks), s in zip(level, slots) for r, j in zip(ranks, s) if j < keep.shape[1]
            ]
            node_of.update(zip(kept_paths, idx.tolist()))
        return builder.tree()


# A batched drafter's step for level-grown trees: (R, K) frontier tokens, each with its parent's place in the frontier
# run before (None: the root's children) -> (R, K, V) log-probs of their children (`FeatureRound._level`).
FrontierStepFn = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class _StaticFrame:
    """A `StaticTree` cut to a depth, laid out for `grow_static`: its nodes level by level, in `levels`' order."""

    levels: tuple[tuple[torch.Tensor, torch.Tensor, int], ...]  # per level: each node's parent's place in the last
    # frontier, padded with 0 to `width` ((max(F, K),)), each node's rank (F,), and how many ranks the top-k must hold
    width: int  # K: the widest frontier a step runs (levels 1 .. depth - 1)
    sizes: tuple[int, ...]  # nodes up to each depth, root included
    parents: torch.Tensor  # (N,)
    depth: torch.Tensor  # (N,)
    ancestors: torch.Tensor  # (N, N)
    is_chain: bool


@functools.lru_cache(maxsize=64)
def _static_frame(policy: StaticTree, depth: int, device: torch.device) -> _StaticFrame:
    """``policy``'s nodes to ``depth``, made once per policy, depth and device (every step of every row reads it)."""
    frontier: dict[tuple[int, ...], int] = {(): 0}  # path -> its place in the frontier run last (the root's: 0)
    node_of, parents, depths, levels, sizes = {(): 0}, [ROOT_PARENT], [0], [], [1]
    for level in policy._levels[:depth]:
        places, ranks, here = [], [], {}
        for parent, parent_ranks in level:  # parents first, ranks in order within a parent: as `levels` adds them
            for rank in parent_ranks:
                here[parent + (rank,)] = len(places)
                places.append(frontier[parent])
                ranks.append(rank)
                node_of[parent + (rank,)] = len(parents)
                parents.append(node_of[parent])
                depths.append(len(parent) + 1)
        levels.append((places, ranks))
        sizes.append(len(parents))
        frontier = here
    width = max([len(places) for places, _ in levels[:-1]] or [1])
    ancestors = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for node in range(len(parents)):
        at = node
        while at != ROOT_PARENT:
            ancestors[node, at] = True
            at = parents[at]
    levels = tuple((torch.tensor(places + [0] * (width - len(places)), device=device), torch.tensor(ranks, device=device),
                    max(ranks) + 1) for places, ranks in levels)
    return _StaticFrame(levels, width, tuple(sizes), torch.tensor(parents, device=device),
                        torch.tensor(depths, device=device), ancestors.to(device), parents == list(range(-1, len(parents) - 1)))


def grow_static(
    roots: torch.Tensor, logp: torch.Tensor, step: FrontierStepFn, policy: StaticTree, depths: Sequence[int]
) -> tuple[list[Tree], int]:
    """Every row's top-k `StaticTree` at once, on the device: the same trees as its ``levels`` alone, nothing read
    back. Returns the trees and K, the frontier width each level's ``step`` ran.

    The shape is every row's, so only tokens and scores are per row: each level takes, for every node, its listed
    rank of its parent's top-k children, for all rows in one gather. Each level's frontier is padded to the widest
    level's K (copies of its first node, never anyone's parent), so the drafter's slots stay K a level. A row whose
    tree is shallower than the deepest keeps its first levels' nodes (nodes are stored level by level).

    Args:
        roots: (R,) root tokens. logp: (R, V) the drafter's log-probs after each root.
        step: the next level's (R, K, V) log-probs, or (R, 1, V) where every frontier node's children come from one
            distribution (a drafter whose depths do not depend on the parent).
        depths: each row's depth (the policy's, cut to what it may draft).
    """
    deepest, device = max(depths), logp.device
    frame = _static_frame(policy, deepest, device)
    width = frame.width
    tokens, scores = [roots[:, None]], [torch.zeros(len(depths), 1, device=device)]
    came_from = None  # the frontier run next: each node's parent's place in the frontier run before (None: the root)
    for level, (at, rank, k) in enumerate(frame.levels):
        if level:  # the last level's nodes, padded to K, through the drafter: their children's log-probs
            pad = width - tokens[-1].shape[1]
            run = tokens[-1] if not pad else torch.cat([tokens[-1], tokens[-1][:, :1].expand(-1, pad)], dim=1)
            logp = step(run, came_from)  # (R, K, V)
        top, child = (logp if level else logp[:, None]).topk(k, dim=-1)  # (R, K or 1, k)
        if level and top.shape[1] == 1:  # one distribution for every frontier node (a depth's: Medusa, DFlash)
            top, child = top.expand(-1, width, -1), child.expand(-1, width, -1)
        parent = at[: len(rank)]  # (F,)
        tokens.append(child[:, parent, rank])  # (R, F): each node's rank among its parent's children
        scores.append(scores[-1][:, parent] + top[:, parent, rank].float())
        came_from = at.expand(len(depths), -1) if level else None  # padding nodes: node 0's place, never read
    tokens, scores = torch.cat(tokens, dim=1), torch.cat(scores, dim=1)  # (R, N)
    trees = []
    for r, depth in enumerate(depths):
        n = frame.sizes[depth]
        tree = object.__new__(Tree)
        tree.__dict__.update(tokens=tokens[r, :n], parents=frame.parents[:n], depth=frame.depth[:n], scores=scores[r, :n],
                             q=None, without_replacement=False, ancestors=frame.ancestors[:n, :n],
                             is_chain=frame.is_chain, _depth_bound=depth)
        trees.append(tree)
    return trees, width


def parse_tree_spec(spec: str | TreeSpec) -> TreePolicy:
    """``chain:5``, ``static:FILE.json`` (Medusa-style paths), ``dynamic:TOP_K,DEPTH,BUDGET`` (EAGLE-2),
    or a ``FILE.json`` tree spec (as `specgraft tune-tree` writes), as a policy (`specgraft.specs` parses)."""
    return policy_from_spec(parse_tree(spec))


def policy_from_spec(spec: TreeSpec) -> TreePolicy:
    """The policy a parsed tree spec describes; the spec's file, if it names one, is read here."""
    from specgraft.tree.adaptive import Adaptive
    from specgraft.tree.dynamic import DynamicTree

    if isinstance(spec, ChainSpec):
        return Chain(depth=spec.depth)
    if isinstance(spec, DynamicSpec):
        return DynamicTree(top_k=spec.top_k, depth=spec.depth, budget=spec.budget)
    if isinstance(spec, AdaptiveSpec):
        return Adaptive(max_depth=spec.max_depth, max_nodes=spec.max_nodes)
    if isinstance(spec, StaticFileSpec):
        return StaticTree.from_file(spec.path)
    return tree_from_file(spec.path)


def tree_from_file(path: str | Path) -> TreePolicy:
    """A tree spec file: ``{"kind": "dynamic", "top_k", "depth", "budget"}``, ``{"kind": "chain", "depth"}``,
    ``{"kind": "adaptive", "max_depth", "max_nodes"}``, or static paths (a list, or ``{"kind": "static", "choices"}``)."""
    return tree_from_spec(_read_json(path), where=f"tree file {path}")


def tree_from_spec(data: Any, where: str = "tree spec") -> TreePolicy:
    """A tree spec's parsed JSON (see `tree_from_file`) as a policy."""
    from specgraft.tree.adaptive import Adaptive
    from specgraft.tree.dynamic import DynamicTree

    kind = data.get("kind") if isinstance(data, dict) else None
    if kind is not None and kind not in TREE_OBJECTS:
        raise ValueError(f"{where}: unknown kind {kind!r}; a tree object is one of {tree_objects()}, "
                         "or a list of paths like [[0], [0, 0], [1]]")

    def count(key: str) -> int:
        if key not in data:
            raise ValueError(f"a {kind} tree needs {key!r}")
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key!r} must be an integer, got {value!r}")
        return value

    try:
        if kind == "dynamic":
            return DynamicTree(top_k=count("top_k"), depth=count("depth"), budget=count("budget"))
        if kind == "chain":
            return Chain(depth=count("depth"))
        if kind == "adaptive":
            return Adaptive(max_depth=count("max_depth"), max_nodes=count("max_nodes"))
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    return StaticTree.from_spec(data, where)


def _read_json(path: str | Path) -> Any:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tree file {path} does not exist")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"tree file {path} is not valid JSON: {err}") from None
