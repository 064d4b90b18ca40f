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

import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specgraft.tree.policies import Growth, Levelled, TreeBuilder
from specgraft.tree.sampling import Sampling
from specgraft.tree.tree import ANCESTOR_BITS, LISTS, ROOT_PARENT, Tree, ancestor_bits


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


# A batched drafter's step for dynamic trees: (R, k) the frontier's tokens and (R, k) each one's parent's place in the
# last frontier (None: the root's children) -> (R, k, V) log-probs of their children.
DynamicStepFn = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


def grow_dynamic(
    roots: torch.Tensor, logp: torch.Tensor, step: DynamicStepFn, policy: DynamicTree, depths: Sequence[int],
    depth_at: torch.Tensor | None = None,
) -> list[Tree]:
    """Every row's `DynamicTree` at once, on the device: the same trees as its ``levels`` alone, nothing read back.

    Each level expands every row's ``top_k`` frontier nodes in one ``step`` (one drafter forward for all rows),
    keeps each row's best ``top_k`` children as its next frontier, and after the last level every row keeps its
    ``budget`` best nodes (a stable sort by score: nodes are stored level by level, so a parent, never scored below
    its child, is ranked first on ties, as `rerank`). A row whose tree is shallower than the deepest runs the
    levels below it as padding, never kept. Rows' trees are views of batched tensors; their structure is not read
    back (`Tree.is_chain` is False: a tree verified with its mask, exact for any shape).

    Args:
        roots: (R,) root tokens. logp: (R, V) the drafter's log-probs after each root.
        depths: each row's depth (its policy's, cut to what it may draft).
        depth_at: ``depths`` on the device already (a caller's staged copy), else copied here where they differ.
    """
    k, rows, deepest, device = policy.top_k, len(depths), max(depths), logp.device
    score, token = logp.topk(k, dim=-1)  # (R, k) the root's children: the first frontier, best first
    tokens, parents, scores, depth = [roots[:, None], token], [torch.full((rows, 1), ROOT_PARENT, device=device)], [
        torch.zeros(rows, 1, device=device), score.float()], [torch.zeros(rows, 1, dtype=torch.long, device=device)]
    parents.append(torch.zeros(rows, k, dtype=torch.long, device=device))
    depth.append(torch.ones(rows, k, dtype=torch.long, device=device))
    frontier, frontier_score, frontier_token = torch.arange(1, k + 1, device=device).expand(rows, k), score.float(), token
    came_from, count = None, 1 + k  # each frontier node's place in the last frontier; nodes so far
    if len(set(depths)) == 1:  # rows' own depths, where they differ
        depth_at = None
    elif depth_at is None:
        depth_at = torch.tensor(list(depths), device=device)
    for level in range(2, deepest + 1):
        top, child = step(frontier_token, came_from).topk(k, dim=-1)  # (R, k, k): each frontier node's children
        child_score = (frontier_score[:, :, None] + top.float()).flatten(1)  # (R, k * k) cumulative
        if depth_at is not None:  # a row's levels below its depth: padding, ranked last and never kept
            child_score = child_score.masked_fill((depth_at < level)[:, None], -torch.inf)
        tokens.append(child.flatten(1))
        parents.append(frontier.repeat_interleave(k, dim=1))
        scores.append(child_score)
        depth.append(torch.full((rows, k * k), level, device=device))
        best = child_score.topk(k, dim=-1).indices  # (R, k)
        frontier, came_from = count + best, best // k
        frontier_score, frontier_token = child_score.gather(1, best), child.flatten(1).gather(1, best)
        count += k * k
    tokens, parents, scores, depth = (torch.cat(x, dim=1) for x in (tokens, parents, scores, depth))  # (R, N)
    sizes = [1 + min(policy.budget, k + (d - 1) * k * k) for d in depths]  # each row's kept nodes, root included
    if max(sizes) < count:  # the budget cuts: each row's best nodes, then in storage order (parents first)
        order = scores[:, 1:].sort(dim=1, descending=True, stable=True).indices[:, : max(sizes) - 1] + 1
        keep = torch.cat([torch.zeros(rows, 1, dtype=torch.long, device=device), order], dim=1).sort(dim=1).values
        index = torch.full((rows, count), ROOT_PARENT, device=device).scatter_(
            1, keep, torch.arange(max(sizes), device=device).expand(rows, -1))
        kept_parents = parents.gather(1, keep)
        parents = torch.where(kept_parents < 0, ROOT_PARENT, index.gather(1, kept_parents.clamp(min=0)))
        tokens, scores, depth = tokens.gather(1, keep), scores.gather(1, keep), depth.gather(1, keep)
    width = parents.shape[1]
    hops = torch.where(parents < 0, torch.arange(width, device=device), parents)  # a root points at itself
    walk = [torch.arange(width, device=device).expand(rows, -1)]
    for _ in range(deepest):
        walk.append(hops.gather(1, walk[-1]))
    ancestors = torch.zeros(rows, width, width, dtype=torch.bool, device=device)
    ancestors.scatter_(2, torch.stack(walk, dim=2), True)  # (R, N, N): each node's own column and its ancestors'
    trees = []
    for r, n in enumerate(sizes):
        tree = object.__new__(Tree)
        tree.__dict__.update(tokens=tokens[r, :n], parents=parents[r, :n], depth=depth[r, :n], scores=scores[r, :n],
                             q=None, without_replacement=False, ancestors=ancestors[r, :n, :n], is_chain=False,
                             _depth_bound=depths[r])
        trees.append(tree)
    return trees


def rerank(tree: Tree, budget: int) -> Tree:
    """The root plus the ``budget`` best draft nodes by cumulative score, parents ranked before children on ties."""
    if tree.num_draft_tokens <= budget:
        return tree
    scores, depth = tree.score_list, tree.depth_list  # read once: indexing tensors per key is slow
    # Sort by score (descending), then depth (ascending): a parent is never ranked below its child.
    order = sorted(range(1, tree.num_nodes), key=lambda i: (-scores[i], depth[i]))
    keep = torch.tensor(sorted([0] + order[:budget]), device=tree.tokens.device)
    return subtree(tree, keep)


def subtree(tree: Tree, keep: torch.Tensor | Sequence[int]) -> Tree:
    """The nodes ``keep`` (sorted, root included, closed under parents) re-indexed parents-first (`cut_trees`)."""
    return cut_trees([(tree, keep)])[0]


Stage = Callable[..., list[torch.Tensor]]  # (device, *lists of ints) -> each list as a (len,) int64 tensor there


def _stage(device: torch.device, *lists: list[int]) -> list[torch.Tensor]:
    flat = torch.tensor([x for values in lists for x in values], dtype=torch.long, device=device)
    return list(flat.split([len(values) for values in lists]))


def cut_trees(cuts: Sequence[tuple[Tree, torch.Tensor | Sequence[int]]], stage: Stage | None = None) -> list[Tree]:
    """Each tree cut to its ``keep`` nodes (sorted, root included, closed under parents), re-indexed parents-first.

    The structure is read and re-indexed in Python from the trees' host lists (`read_lists` reads a step's trees in
    one copy): a few dozen ints a tree, where a chain of small tensor ops took 35 us a tree. A cut to the first n
    nodes is views; the others' node indices, parents, depths and ancestor bits go to the device in one copy for
    all (``stage``: the engine's staging, pinned and non-blocking on a GPU; default one tensor), and their tokens and
    scores are gathered there in one call each: no read back, one copy, and launches that do not grow with the trees.
    """
    out: list[Tree | None] = [None] * len(cuts)
    general = []  # (place, tree, kept, remapped parents, depths, ancestor bits)
    for place, (tree, keep) in enumerate(cuts):
        kept = keep.tolist() if isinstance(keep, torch.Tensor) else list(keep)
        n = len(kept)
        lists = tree.__dict__
        if kept[-1] == n - 1:  # the first n nodes (sorted and distinct: 0..n-1), closed under parents as stored parents-first
            # views, no new tensors: a chain's cut, the most common, in 8 us where it was 20
            cut = _with_lists(tree, tree.tokens[:n], tree.parents[:n], tree.depth[:n], tree.scores[:n],
                              None if tree.q is None else tree.q[:n],
                              None if tree.ancestors is None else tree.ancestors[:n, :n],
                              **{name: lists[name][:n] for name in LISTS if name in lists})
            out[place] = cut
            continue
        parents = tree.parent_list
        new_index = {old: new for new, old in enumerate(kept)}
        remapped = [ROOT_PARENT if parents[i] < 0 else new_index.get(parents[i], -2) for i in kept]
        if -2 in remapped:
            raise ValueError("subtree: a kept node's parent was dropped")
        depth = tree.depth_list
        bits = ancestor_bits(remapped) if n <= ANCESTOR_BITS else []
        general.append((place, tree, kept, remapped, [depth[i] for i in kept], bits))
    if general:
        device = general[0][1].tokens.device
        offsets = itertools.accumulate((g[1].num_nodes for g in general), initial=0)
        picked = [at + i for g, at in zip(general, offsets) for i in g[2]]  # every cut's nodes in the trees' concatenation
        index, *tensors = (stage or _stage)(device, picked, *(x for g in general for x in g[2:]))
        sizes = [len(g[2]) for g in general]
        tokens = torch.cat([g[1].tokens for g in general]).index_select(0, index).split(sizes)
        scores = torch.cat([g[1].scores for g in general]).index_select(0, index).split(sizes)
        for k, (place, tree, kept, remapped, depth_, bits) in enumerate(general):
            own, parents_t, depth_t, bits_t = tensors[4 * k : 4 * k + 4]
            cut = _with_lists(tree, tokens[k], parents_t, depth_t, scores[k],
                              None if tree.q is None else tree.q.index_select(0, own), None,
                              parent_list=remapped, depth_list=depth_)
            if "score_list" in tree.__dict__:
                cut.__dict__["score_list"] = [tree.score_list[i] for i in kept]
            if bits:
                cut.__dict__["_ancestor_bits"] = bits_t  # (see `Tree.from_host`)
            out[place] = cut
    return out


def _with_lists(tree: Tree, tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, scores: torch.Tensor,
                q: torch.Tensor | None, ancestors: torch.Tensor | None, **lists: list) -> Tree:
    """A cut of ``tree``: its tensors given, the host lists known of it kept (its structure checked on them, as
    `Tree` checks it; a tree with ``ancestors`` is a builder's, only its shapes are)."""
    cut = Tree.__new__(Tree)
    cut.__dict__.update(tokens=tokens, parents=parents, depth=depth, scores=scores, q=q,
                        without_replacement=tree.without_replacement, ancestors=ancestors, **lists)
    cut.__post_init__()
    return cut
