"""Acceptance rules: which tree path the target keeps.

Pure tensor functions over a `Tree` and the target's logits at every node.
Greedy and sampling live in separate functions, never behind a mode string:
greedy decoding always takes `greedy_accept`; a sampling generation takes
the stochastic rule it was given (`AcceptRule`): `sample_accept`, exact, by
default, or `lossy_typical_accept`, which says it is lossy in its name and
in the stats (`is_lossless`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specgraft.tree import Sampling, Tree


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
    if tree.num_nodes == 1:  # plain decoding: nothing to compare; the target's choice is the next token
        return Acceptance(path=root_path(logits.device), next_token=int(logits[0].argmax()))
    choice = logits.argmax(dim=-1)  # (N,) target's token after each node
    if tree.is_chain:  # plain decoding and chains: the first mismatch ends the path, no mask needed
        agree = (tree.tokens[1:] == choice[:-1]).tolist()
        kept = agree.index(False) if False in agree else len(agree)
        return Acceptance(path=torch.arange(kept + 1, device=choice.device), next_token=int(choice[kept]))
    match = torch.ones(tree.num_nodes, dtype=torch.bool, device=choice.device)
    match[1:] = tree.tokens[1:] == choice[tree.parents[1:]]
    # alive[i]: every node on i's path (itself included) matches.
    alive = ~(tree.ancestor_mask() & ~match[None]).any(dim=1)  # (N,)
    best = int(torch.where(alive, tree.depth, -1).argmax())
    return Acceptance(path=tree.ancestor_mask()[best].nonzero().flatten(), next_token=int(choice[best]))


def greedy_accept_packed(
    tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, choice: torch.Tensor, rows: int, width: int
) -> torch.Tensor:
    """`greedy_accept` for every tree of a packed forward at once, on the device: one result to read back.

    The trees lie one after another (each root first, ``parents`` local to its tree), node j's target choice
    ``choice[j]``. A node survives when its token equals the choice at its parent and its parent survives; each
    tree's deepest survivor (the first in storage order among equals) ends its path. Survival is carried down by
    pointer jumping (log2 of the depth in passes), so the launches do not grow with the rows.

    Args:
        tokens, parents, depth, choice: (N,) the packed trees' tokens, local parents, depths and target argmaxes.
        rows: the number of trees. width: at least the deepest tree's depth + 1.

    Returns:
        (rows, 2 + 2 * width) int64: per tree its accepted path's length K (root included), the next token, then
        the path's K local node indices root first and its K tokens, each padded to ``width`` (padding repeats
        the last node and token).
    """
    if width == 1:  # roots alone (plain decoding): each row's choice is its next token
        return torch.stack([torch.ones_like(tokens), choice, torch.zeros_like(tokens), tokens], dim=1)
    n = tokens.shape[0]
    index = torch.arange(n, device=tokens.device)
    is_root = parents < 0
    if rows == 1:
        tree, start = torch.zeros_like(index), torch.zeros(1, dtype=torch.long, device=tokens.device)
        up = torch.where(is_root, index, parents)
    else:
        tree = is_root.long().cumsum(0) - 1  # (N,) each node's tree
        start = torch.zeros(rows, dtype=torch.long, device=tokens.device).scatter_reduce(
            0, tree, index, "amin", include_self=False)
        up = torch.where(is_root, index, parents + start[tree])  # (N,) global parent; a root points at itself
    alive = is_root | (tokens == choice[up])
    hops = up
    for _ in range(max(width - 1, 1).bit_length()):  # after k passes each node has checked 2^k ancestors
        alive = alive & alive[hops]
        hops = hops[hops]
    # Deepest survivor, the first in storage order among equals: the largest depth * N + (N - 1 - j).
    key = torch.where(alive, depth * n + (n - 1 - index), -1)
    best_key = torch.full((rows,), -1, dtype=torch.long, device=tokens.device).scatter_reduce(0, tree, key, "amax")
    best = n - 1 - best_key % n  # (R,) global index of each tree's deepest survivor
    kept = best_key // n  # its depth: the path holds kept + 1 nodes
    walk = [best]  # best, its parent, ... up to the root (which then repeats)
    for _ in range(width - 1):
        walk.append(up[walk[-1]])
    walk = torch.stack(walk, 1)  # (R, width)
    back = (kept[:, None] - torch.arange(width, device=tokens.device)).clamp(min=0)  # root first, then padding
    path = walk.gather(1, back)  # (R, width) global nodes, root first
    return torch.cat([(kept + 1)[:, None], choice[best][:, None], path - start[:, None], tokens[path]], dim=1)


def greedy_accept_chains(tokens: torch.Tensor, choice: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """`greedy_accept_packed` for R chains of N nodes each, in a dozen launches (pointer jumping and walks are a tree's
    work): each keeps its first nodes while they match the target's choice at the node before.

    Args:
        tokens, choice: (R, N) each chain's tokens, root first, and the target's argmax at each of its nodes.
        width: at least N (default N): the rows' padding.

    Returns:
        (R, 2 + 2 * width) int64, `greedy_accept_packed`'s rows.
    """
    kept = (tokens[:, 1:] == choice[:, :-1]).long().cumprod(1).sum(1)  # (R,) matching drafts before the first miss
    return _chain_rows(kept, choice, tokens, tokens.shape[1] if width is None else width)


def _chain_rows(kept: torch.Tensor, nexts: torch.Tensor, tokens: torch.Tensor, width: int) -> torch.Tensor:
    """(R, 2 + 2 * width) rows of chains that keep their first ``kept`` (R,) drafts: the path's length K, the token
    after it (``nexts`` (R, N): the one each node would give), the path's nodes 0..K-1 and tokens, padded."""
    path = torch.minimum(torch.arange(width, device=tokens.device), kept[:, None])  # 0..K-1, then K-1 repeated
    return torch.cat([(kept + 1)[:, None], nexts.gather(1, kept[:, None]), path, tokens.gather(1, path)], 1)


def greedy_accept_tree(tree: Tree, choice: torch.Tensor, width: int) -> torch.Tensor:
    """`greedy_accept_packed` for one tree, in fewer launches (a lone row's step pays each on a small model): a chain
    is `greedy_accept_chains`' one row; a tree reads its ancestor mask.

    Returns:
        (2 + 2 * width,) int64, a row of `greedy_accept_packed`'s result.
    """
    n, tokens = tree.num_nodes, tree.tokens
    if tree.is_chain:
        return greedy_accept_chains(tokens[None], choice[None], width)[0]
    match = torch.cat([torch.ones(1, dtype=torch.bool, device=tokens.device), tokens[1:] == choice[tree.parents[1:]]])
    ancestors = tree.ancestor_mask()
    alive = ~(ancestors & ~match).any(dim=1)  # every node on its path matches
    nodes = torch.arange(n, device=tokens.device)
    best = torch.where(alive, tree.depth * n + (n - 1 - nodes), -1).argmax()[None]  # deepest, first among equals
    kept = tree.depth[best][0]  # (indexed by a (1,) tensor: a 0-d index would be read on the host)
    on_path = torch.where(ancestors[best][0], nodes, n).sort().values  # the path's nodes first, root first
    path = on_path[torch.minimum(torch.arange(width, device=tokens.device), kept)]
    last = path.gather(0, kept[None])  # (1,) the path's last node: the target's choice there comes next
    return torch.cat([(kept + 1)[None], choice[last], path, tokens[path]])


@functools.cache
def root_path(device: torch.device) -> torch.Tensor:
    """(1,) the path of a root alone, shared read-only (every plain row, every step)."""
    return torch.zeros(1, dtype=torch.long, device=device)


# Below this mass a residual max(p - q, 0) is rounding noise, not a distribution.
EMPTY_RESIDUAL = 1e-6

# A stochastic acceptance rule: (tree, p (N, V) after the generation's filters, its Sampling) -> the path kept.
AcceptRule = Callable[[Tree, torch.Tensor, Sampling], Acceptance]


def target_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """(N, V) the target's p as every stochastic acceptance reads it: the generation's filters, the very ones the
    draft's q went through (one function for both sides, and one place p is made)."""
    return sampling.probs(logits)


def accept(tree: Tree, logits: torch.Tensor, sampling: Sampling, rule: AcceptRule) -> Acceptance:
    """The path a generation keeps: `greedy_accept` under greedy decoding, else ``rule`` on the filtered p."""
    if sampling.greedy:
        return greedy_accept(tree, sampling.ban(logits))
    return rule(tree, target_probs(logits, sampling), sampling)


def accept_chains(trees: Sequence[Tree], logits: Sequence[torch.Tensor], samplings: Sequence[Sampling]) -> torch.Tensor:
    """`sample_accept_chains` on the target's filtered p at the nodes of sampled chains of one length, one filter
    setting and one kind of draft (all sampled, or all top-k): (G, 2 + 2 * N), as that returns."""
    p = target_probs(stacked(logits), samplings[0])  # (G, N, V): the filters work row by row
    q = None if trees[0].q is None else stacked([tree.q for tree in trees])
    tokens = stacked([tree.tokens for tree in trees])
    return sample_accept_chains(tokens, q, p, samplings, tokens.shape[1])


def stacked(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(tensors)``, a view where there is one (a lone row's step pays each launch)."""
    return tensors[0][None] if len(tensors) == 1 else torch.stack(list(tensors))


def sample_accept(tree: Tree, p: torch.Tensor, sampling: Sampling) -> Acceptance:
    """Exact tree speculative sampling: the committed tokens follow p, whatever the drafter did.

    Walk down from the root. At each node with p_cur = p[node]:
    - top-k children (tree.q is None) are point masses: draw x ~ p_cur; if a
      child carries x, move to it; otherwise x is the correction (x ~ p_cur
      conditioned on matching no child is exactly norm(p_cur without them)).
    - sampled children (SpecInfer): try them in order; accept child x with
      probability min(1, p_cur(x) / q(x)); on rejection p_cur <- norm(max(p_cur - q, 0))
      and, when drawn without replacement (Sequoia), q loses x and is renormalised.
      If all are rejected the correction comes from p_cur.
    A leaf accepted at the end earns a bonus token from its full p.

    Args:
        tree: N nodes; tree.q (N, V) when children were sampled.
        p: (N, V) target distributions after the generation's filters.
        sampling: the generation's; its RNG draws every token.
    """
    node = 0
    path = [0]
    children = _children_lists(tree)
    while True:
        kids = children[node]
        p_cur = p[node]
        if not kids:
            return _done(path, sampling.draw_one(p_cur), p.device)
        if tree.q is None:
            x = sampling.draw_one(p_cur)
            match = [k for k in kids if int(tree.tokens[k]) == x]
            if not match:
                return _done(path, x, p.device)
            node = match[0]
        else:
            child, correction = _multi_round(tree, kids, p_cur, sampling)
            if child is None:
                return _done(path, correction, p.device)
            node = child
        path.append(node)


def sample_accept_chain(tree: Tree, p: torch.Tensor, sampling: Sampling, width: int) -> torch.Tensor:
    """`sample_accept` on one chain, on the device (`sample_accept_chains` of one row): (2 + 2 * width,)."""
    q = None if tree.q is None else tree.q[None]
    return sample_accept_chains(tree.tokens[None], q, p[None], [sampling], width)[0]


def sample_accept_chains(
    tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, samplings: Sequence[Sampling], width: int
) -> torch.Tensor:
    """`sample_accept` on G chains of N nodes, on the device: every draw made at once, nothing read back.

    The sequential rule stops at the first rejection; here every level's test and every level's fallback draw are
    made up front and the first rejection picks among them, so each committed token follows the same law (the
    draws past the first rejection are independent of it and are dropped). Top-k chains (point masses): one draw
    from each node's p, the path kept while the draws match. Sampled chains: x_i is kept with probability
    min(1, p_{i-1}(x_i) / q_i(x_i)); the first rejected level's token comes from norm(max(p - q, 0)) there (p
    itself where that residual is empty); a chain kept whole earns a token from its last p. The chains share every
    kernel but their draws: each chain's come from its own RNG, in the order it draws alone (uniforms, then tokens).

    Args:
        tokens: (G, N) the chains' tokens, root first. q: (G, N, V) the distributions their tokens were sampled from
            (the root's row unused), or None for top-k chains. p: (G, N, V) target distributions after each chain's
            filters. samplings: each chain's; its RNG draws.
        width: at least N: the result's padding, as `greedy_accept_packed`'s rows.

    Returns:
        (G, 2 + 2 * width) int64, a chain a row: the path's length K, the next token, the path's K nodes (0..K-1)
        and tokens, padded.
    """
    n = tokens.shape[1]
    if q is None:
        draws = stacked([s.draw(row)[:, 0] for s, row in zip(samplings, p)])  # (G, N) one draw from each node's p
        kept = (draws[:, :-1] == tokens[:, 1:]).long().cumprod(1).sum(1)  # (G,)
    else:
        q, drafted = q[:, 1:], tokens[:, 1:, None]  # (G, N - 1, V), (G, N - 1, 1)
        ratio = (p[:, :-1].gather(2, drafted) / q.gather(2, drafted))[..., 0].clamp(max=1.0)  # (G, N - 1)
        u = stacked([torch.rand(n - 1, generator=s.generator, device=p.device) for s in samplings])
        kept = (u < ratio).long().cumprod(1).sum(1)
        residual = (p[:, :-1] - q).clamp(min=0.0)
        mass = residual.sum(-1, keepdim=True)
        fallback = torch.where(mass > EMPTY_RESIDUAL, residual / mass.clamp(min=EMPTY_RESIDUAL), p[:, :-1])
        laws = torch.cat([fallback, p[:, -1:]], 1)  # (G, N, V): level i's correction, then the bonus
        draws = stacked([s.draw(row)[:, 0] for s, row in zip(samplings, laws)])  # (G, N)
    return _chain_rows(kept, draws, tokens, width)


def _multi_round(tree: Tree, kids: list[int], p_cur: torch.Tensor, sampling: Sampling) -> tuple[int | None, int | None]:
    """SpecInfer's rule over sampled siblings: (the accepted child, None), or (None, the correction token)."""
    p_orig = p_cur
    q = tree.q[kids[0]]
    for kid in kids:
        x = int(tree.tokens[kid])
        if not tree.without_replacement:
            q = tree.q[kid]
        ratio = torch.clamp(p_cur[x] / q[x], max=1.0)
        if float(torch.rand((), generator=sampling.generator, device=p_cur.device)) < float(ratio):
            return kid, None
        residual = (p_cur - q).clamp(min=0.0)
        mass = float(residual.sum())
        p_cur = residual / mass if mass > EMPTY_RESIDUAL else p_orig  # empty residual: fall back to p
        if tree.without_replacement:
            q = q.index_fill(0, torch.tensor([x], device=q.device), 0.0)
            q_mass = float(q.sum())
            if q_mass <= 0.0:
                break
            q = q / q_mass
    return None, sampling.draw_one(p_cur)


def lossy(rule: AcceptRule) -> AcceptRule:
    """Mark an acceptance rule whose output does not follow the target's distribution (`is_lossless`)."""
    rule.lossless = False
    return rule


def is_lossless(rule: AcceptRule) -> bool:
    """False for a rule marked `lossy`: the stats of every generation it accepts for say so."""
    return getattr(rule, "lossless", True)


@lossy
def lossy_typical_accept(
    tree: Tree, p: torch.Tensor, sampling: Sampling, threshold: float = 0.09, alpha: float = 0.3
) -> Acceptance:
    """LOSSY (Medusa's typical acceptance): output does not follow the target's distribution.

    A node survives when p(token) > min(threshold, alpha * exp(-H(p))) at its
    parent, as do all its ancestors; the deepest survivor wins and the next
    token is sampled from p there. Only used when asked for
    (``SpeculativeGenerator(..., acceptance=lossy_typical_accept)``), and with temperature > 0.
    """
    entropy = -(p * p.clamp(min=1e-30).log()).sum(-1)  # (N,)
    bar = torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy))
    match = torch.ones(tree.num_nodes, dtype=torch.bool, device=p.device)
    parents = tree.parents[1:]
    match[1:] = p[parents, tree.tokens[1:]] > bar[parents]
    alive = ~(tree.ancestor_mask() & ~match[None]).any(dim=1)
    best = int(torch.where(alive, tree.depth, -1).argmax())  # the longest surviving candidate, as Medusa
    return Acceptance(path=tree.ancestor_mask()[best].nonzero().flatten(), next_token=sampling.draw_one(p[best]))


def _children_lists(tree: Tree) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in range(tree.num_nodes)]
    for child, parent in enumerate(tree.parents.tolist()[1:], start=1):
        children[parent].append(child)
    return children


def _done(path: list[int], token: int, device: torch.device) -> Acceptance:
    return Acceptance(path=torch.tensor(path, device=device), next_token=token)
