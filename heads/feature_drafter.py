"""Drafting in the target's feature space, shared by EAGLE and EAGLE-3.

Pair i joins a feature of committed position i with the next token t_{i+1}.
Each generation's `FeatureDraftState` keeps a draft KV cache of the pairs of
its committed tokens: the pairs committed since the last round (at the
first, the prompt's) run with the root's pair at the start of the next.
Then each tree level runs one pair per frontier node (its parent's
predicted feature, its own token) with tree attention. Between
rounds the cache holds only pairs of committed tokens and true features;
the root's pair is run again next round, so proposing twice without a
commit stays correct.

Many generations draft together (`FeatureDrafter.propose_batch`): their
caches are rows of one `BatchedKVCache` (a scheduler's, from `new_rows`),
and each tree level is one forward over every row's new pairs, padded to the
widest, each row at its own slots and positions with a mask of its own. One
generation alone takes the same path with one row over its own cache. A round
that would pad a row past its slots first catches the rows furthest behind up
alone, each over its own row (`FeatureDrafter.rounds`): a row then takes at
most `FeatureDrafter.draft_slots` of its tree beyond its committed tokens.

A head plugs in with six methods: ``hidden_layers``, ``draft_features(hidden)``
(target states -> (n, H) features), ``new_draft_cache(max_len)``,
``new_draft_rows(rows, max_len)``, ``draft_step(features, tokens, positions,
mask, cache)`` -> (B, T, H) outputs, and ``draft_logp(outputs)`` -> (.., V)
scores over the target vocabulary.

Shape legend: B rows in a forward, T new pairs per row, W attended slots, H hidden, V vocabulary.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from specgraft.heads.base import DraftRequest, shared_top_k_static
from specgraft.heads.draft_levels import DraftLevels
from specgraft.model import TREE_SLOTS, BatchedKVCache, StaticKVCache, Target
from specgraft.model.captured import GraphSet
from specgraft.model.fast_llama import DYNAMIC_ROPE
from specgraft.model.staging import staged
from specgraft.tree import (
    Adaptive, Chain, DynamicTree, Sampling, StaticTree, Tree, TreePolicy, grow_chains, grow_together,
)
from specgraft.tree.dynamic import grow_dynamic
from specgraft.tree.policies import grow_static


# Commits a state holds as views of their steps' forward outputs before folding them into features: a row that
# does not draft for many steps pins at most this many outputs.
PENDING_COMMITS = 32


class FeatureDrafter:
    """The `Drafter` of a feature-space head (EAGLE, EAGLE-3): shared weights, a state per generation."""

    def __init__(self, head, target: Target) -> None:
        self.head = head  # not put in eval mode here: the trainer's evaluator may share the module
        if target.fast is not None:  # the head's shapes that its target's take the target's measured forms
            head.fast().share_small_rows(target.fast.small_rows, owner=target.fast)
        self.hidden_layers = head.hidden_layers
        self.device = target.device
        self.max_len = target.max_context + TREE_SLOTS
        self.target = target  # whose ``capture`` says whether draft forwards over a pool's rows are captured
        self.pool_levels: DraftLevels | None = None  # the last pool's (a static form's graphs hold its addresses)

    @property
    def draft_graphs(self) -> GraphSet | None:
        """The graphs of the captured draft forwards over the last pool (None: none captured there), for reports."""
        return None if self.pool_levels is None else self.pool_levels.graphs

    def new_rows(self, rows: int, max_len: int) -> BatchedKVCache:
        return self.head.new_draft_rows(rows, max_len)

    def levels(self, rows: BatchedKVCache | None) -> DraftLevels | None:
        """The roots' forwards and tree levels over ``rows`` (None: a lone row's own cache), static and captured
        where the target captures (not for a rope whose frequencies follow the positions), eager elsewhere."""
        if rows is None:
            return None
        static = self.target.capture and getattr(self.head.fast().rotary, "rope_type", None) not in DYNAMIC_ROPE
        kept = self.pool_levels
        if kept is None or kept.pool is not rows or kept.head is not self.head or kept.static != static:
            self.pool_levels = DraftLevels(self.head, rows, static=static)
        return self.pool_levels

    def draft_slots(self, policy: TreePolicy) -> int | None:
        """The root's pair and a slot per node of every level's frontier: 1 + (depth - 1) x the widest frontier
        (`frontier_width`). The catch-up takes none beyond committed tokens: a round that would pad rows past their
        slots catches its rows up alone first (`FeatureDrafter.rounds`)."""
        width = frontier_width(policy, policy.max_depth)
        return None if width is None else 1 + (policy.max_depth - 1) * width

    @torch.inference_mode()
    def start(
        self, prompt_ids: torch.Tensor, hidden: dict[int, torch.Tensor], cache: StaticKVCache | None = None
    ) -> FeatureDraftState:
        cache = cache if cache is not None else self.head.new_draft_cache(self.max_len)
        return FeatureDraftState(self, prompt_ids.flatten().to(self.device), hidden, cache)

    @torch.inference_mode()
    def propose_batch(self, requests: Sequence[DraftRequest], rows: BatchedKVCache | None = None) -> list[Tree]:
        if len(requests) > 1 and not all(hasattr(r.policy, "levels") for r in requests):
            return [self.propose_batch([r], rows)[0] for r in requests]  # a policy with only `grow`: one by one
        if rows is not None:
            rounds = self.rounds(requests, rows)
            if len(rounds) > 1:  # trees whose levels padded to each other's would overflow: a round each
                trees = {}
                for group in rounds:
                    trees.update(zip(group, self.propose_batch([requests[i] for i in group], rows)))
                return [trees[i] for i in range(len(requests))]
        round_ = FeatureRound(self.head, requests, rows, self.levels(rows))
        try:
            round_.run_roots()
            if all(type(r.policy) is Chain for r in requests):  # every level of every row on the device
                return round_.chains()
            if FeatureDrafter.rows_dynamic(requests, rows):
                return round_.dynamic()
            if FeatureDrafter.rows_static(requests, rows):
                return round_.static()
            if len(requests) == 1 and not hasattr(requests[0].policy, "levels"):
                r = requests[0]
                step = lambda tree, frontier: round_.step([(0, tree, frontier)])[0]  # noqa: E731
                return [r.policy.grow(step, r.root_token, max_depth=r.max_depth, device=self.device, sampling=r.sampling)]
            growths = [r.policy.levels(r.root_token, r.max_depth, self.device, r.sampling) for r in requests]
            return grow_together(growths, round_.step)
        finally:
            round_.rollback()

    def rounds(self, requests: Sequence[DraftRequest], rows: BatchedKVCache) -> list[list[int]]:
        """The requests (their indices) grouped into rounds that fit every row's slots: one round, unless it would not.

        A round writes every row up to its highest request's (`FeatureRound`): the roots' forward pads each to the
        round's widest catch-up (a row's pairs committed since it last drafted, and its root's), and each level to
        its widest frontier (`level_slots`), so a row holding ``len`` slots reaches len + widest catch-up + levels.
        Where that overflows, the request furthest behind first catches up alone over its own row (writing no other
        row), until the round fits or every request is its root alone; then, if the requests' trees differ (each
        level padded to the widest of them), each tree drafts in a round of its own. A row holds at most ``max_len``
        tokens, so rows of ``max_len`` + `draft_slots` of every request's tree fit each such round.
        """
        everyone = [list(range(len(requests)))]
        levels = level_slots(requests)
        if levels is None:  # a policy whose levels it does not know: as it comes
            return everyone
        batch = max(r.row for r in requests) + 1
        while True:
            lengths = rows.lengths(batch)
            behind = [r.state.length - lengths[r.row] for r in requests]  # each row's pairs: its catch-up and root
            if max(lengths) + max(behind) + levels <= rows.max_len:
                return everyone
            furthest = max(range(len(requests)), key=behind.__getitem__)
            if behind[furthest] <= 1:
                break
            self._catch_up_alone(requests[furthest])
        groups: list[list[int]] = []  # requests by tree, in order
        for i, request in enumerate(requests):
            group = next((g for g in groups if requests[g[0]].policy == request.policy), None)
            if group is None:
                groups.append([i])
            else:
                group.append(i)
        return groups

    def _catch_up_alone(self, request: DraftRequest) -> None:
        """Run the pairs ``request``'s state committed since its last round into its cache over its own row alone (a
        round of its root by itself, on its row's view: no other row is written), keeping only those pairs."""
        round_ = FeatureRound(self.head, [replace(request, row=0)], None, None)  # (row 0 of the one-row forward)
        try:
            round_.run_roots()
        finally:
            round_.rollback()

    @staticmethod
    def rows_dynamic(requests: Sequence[DraftRequest], rows: BatchedKVCache | None) -> bool:
        """Whether `FeatureRound.dynamic` grows these requests' trees: one `DynamicTree` for all (an `Adaptive`
        tree's candidates are one), in a batched cache; each row to its own depth (the engine's plan)."""
        policy = grown_dynamic(requests[0].policy)
        return rows is not None and policy is not None and all(grown_dynamic(r.policy) == policy for r in requests)

    @staticmethod
    def rows_static(requests: Sequence[DraftRequest], rows: BatchedKVCache | None) -> bool:
        """Whether `FeatureRound.static` grows these requests' trees: one `StaticTree` for all, each child its rank of
        the top-k (greedy rows, or a top-k draw), in a batched cache."""
        return rows is not None and shared_top_k_static(requests)

    def adopt(self, other: "FeatureDrafter") -> None:
        """Draft with ``other``'s head from now on: a new version of this one's (same type and shapes), loaded and
        prepared beforehand (`load_drafter`). One assignment, so a caller between steps swaps the whole head at once.

        Running generations keep their states: their draft caches hold the previous head's keys and values for the
        tokens before the swap, which the new head attends to as its own. Their drafts may be weaker until they end,
        never wrong: verification decides every token, whatever the draft.

        Raises:
            ValueError: a head of another type or shape (naming the fields), or one that reads other target layers.
        """
        from specgraft.heads.loading import check_new_version

        if not isinstance(other, FeatureDrafter):
            raise ValueError(f"a {type(self.head).__name__} drafter cannot adopt a {type(other).__name__}")
        check_new_version(self.head, other.head)
        self.head = other.head


def grown_dynamic(policy: TreePolicy) -> DynamicTree | None:
    """The `DynamicTree` that ``policy``'s levels grow: its own, or an `Adaptive` tree's candidates (the engine cuts
    them after drafting); None for any other policy."""
    if type(policy) is DynamicTree:
        return policy
    return policy.candidates if type(policy) is Adaptive else None


def frontier_width(policy: TreePolicy, depth: int) -> int | None:
    """The most nodes one level of ``policy``'s tree, cut to ``depth``, runs through the head for a row: a chain's
    one node, a dynamic or adaptive tree's ``top_k``, a static tree's widest level above its deepest (to which
    `FeatureRound.static` pads every level). None: a policy whose levels this does not know."""
    if isinstance(policy, Chain):
        return 1
    if isinstance(policy, (DynamicTree, Adaptive)):
        return policy.top_k
    if isinstance(policy, StaticTree):
        return max(_static_widths(policy)[: depth - 1], default=1)
    return None


@functools.lru_cache(maxsize=64)
def _static_widths(policy: StaticTree) -> tuple[int, ...]:
    """A static tree's nodes at each depth from 1."""
    depths = [len(path) for path in policy.choices]
    return tuple(depths.count(d) for d in range(1, policy.max_depth + 1))


def level_slots(requests: Sequence[DraftRequest]) -> int | None:
    """The slots a round's levels take in every row it writes: level l (2 .. the deepest tree's depth) runs, for every
    row, the widest frontier of the trees deeper than l - 1 (`FeatureRound` pads a level's rows to it). Trees of one
    policy take (depth - 1) x its frontier; trees of several may take more than any one of them. None: a policy
    `frontier_width` does not know."""
    deepest: dict[int, tuple[TreePolicy, int]] = {}  # each policy's deepest request (a shallower one's levels pad less)
    for request in requests:
        policy, depth = request.policy, request.max_depth
        known = deepest.get(id(policy))
        if known is None or depth > known[1]:
            deepest[id(policy)] = policy, depth
    widest_at: dict[int, int] = {}  # depth (cut to what a row may draft) -> the widest frontier of trees that deep
    for policy, depth in deepest.values():
        depth = min(depth, policy.max_depth)
        width = frontier_width(policy, depth)
        if width is None:
            return None
        widest_at[depth] = max(width, widest_at.get(depth, 0))
    depths = sorted(widest_at, reverse=True)
    slots = widest = 0
    for depth, shallower in zip(depths, [*depths[1:], 1]):  # levels shallower + 1 .. depth run the trees this deep
        widest = max(widest, widest_at[depth])
        slots += (depth - shallower) * widest
    return slots


class FeatureDraftState:
    """One generation's feature-space drafting: its draft KV cache and the pairs not yet in it.

    Invariant: ``features`` holds f_j and ``next_tokens`` holds t_j for the
    committed positions j the cache has not consumed (f from ``len(cache)``,
    t from ``len(cache) + 1``), so a commit appends only its own rows and
    each round runs only the new pairs: no step copies the whole history.
    """

    def __init__(
        self, drafter: FeatureDrafter, prompt_ids: torch.Tensor, hidden: dict[int, torch.Tensor], cache: StaticKVCache
    ) -> None:
        self.drafter = drafter
        self.cache = cache  # pair i in slot i
        self.length = len(prompt_ids)  # n: committed tokens t_0 .. t_{n-1}
        self.peak = 0
        # The prompt's pairs (f_i, t_{i+1}) wait, like any commit, for the first round's catch-up: a row the
        # engine never lets draft (its tree sized to nothing under load) never runs them, nor even its features
        # (EAGLE-3's fuse of three layers over the whole prompt: 16 SmolLM2 prompts took 2% of a 7 s batch).
        self._features: torch.Tensor | None = None  # (n - len(cache), H): f_{len(cache)} .. f_{n-1}, once read
        self._next_tokens = prompt_ids[1:]  # t_{len(cache)+1} .. t_{n-1}
        # Commits since the last round, turned into features in one go when a round reads them: a row that
        # does not draft for many steps (its tree sized to nothing under load) pays no per-step copies. The first
        # is the prompt's states (its tokens are in ``_next_tokens`` already).
        self.pending: list[tuple[torch.Tensor, dict[int, torch.Tensor]]] = [(prompt_ids[:0], hidden)]

    def commit(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], path: torch.Tensor | None = None) -> None:
        # Views, not copies: each keeps its step's forward output alive, so a long run of them is folded early.
        self.pending.append((tokens, hidden))
        self.length += tokens.numel()
        if len(self.pending) >= PENDING_COMMITS:
            self._flush()

    @property
    def features(self) -> torch.Tensor:
        """(pending, H) f_j of the committed positions j the cache has not consumed."""
        self._flush()
        return self._features

    @property
    def next_tokens(self) -> torch.Tensor:
        """t_j of the committed positions the cache has not consumed (one fewer than ``features``)."""
        self._flush()
        return self._next_tokens

    def consume(self, count: int) -> None:
        """The first ``count`` pending pairs are in the cache now: drop them."""
        self._flush()
        self._features, self._next_tokens = self._features[count:], self._next_tokens[count:]

    @torch.inference_mode()
    def _flush(self) -> None:
        """Fold the pending commits into ``features`` and ``next_tokens`` (one feature computation for all)."""
        if not self.pending:
            return
        tokens, hidden = zip(*self.pending)
        self.pending = []
        joined = {layer: torch.cat([h[layer] for h in hidden]).to(self.drafter.device) for layer in hidden[0]}
        features = self.drafter.head.draft_features(joined)
        self._features = features if self._features is None else torch.cat([self._features, features])
        self._next_tokens = torch.cat([self._next_tokens, *tokens]).to(self.drafter.device)  # each (K,): no reshapes

    def cache_tokens(self) -> int:
        return self.peak

    def propose(
        self, root_token: int, policy: TreePolicy, max_depth: int, sampling: Sampling | None = None
    ) -> Tree:
        if max_depth < 1:
            return Tree.root_only(root_token, self.drafter.device)
        return self.drafter.propose_batch([DraftRequest(self, root_token, policy, max_depth, sampling)])[0]


@torch.inference_mode()
def fold_together(states: Sequence[FeatureDraftState], roots: Sequence[torch.Tensor], head) -> tuple[torch.Tensor,
                                                                                                       torch.Tensor]:
    """Every state's pending pairs, its commits folded for all states at once: (sum n, H) features and (sum n,) tokens,
    each state's in turn, its root's token last. One feature computation and two concatenations for the round, where
    each state folding its own took a few launches a row; each state keeps views of its part (``features``,
    ``next_tokens``), as its own fold would have left them."""
    device = roots[0].device
    first = head.hidden_layers[0]
    counts = [sum(h[first].shape[0] for _, h in s.pending) for s in states]  # each state's new pairs: a state a token
    pending = [h for s in states for _, h in s.pending]
    new: Sequence[torch.Tensor] = ()
    if pending:
        joined = {layer: torch.cat([h[layer] for h in pending]).to(device) for layer in head.hidden_layers}
        new = head.draft_features(joined).split(counts)
    feature_pieces, token_pieces, sizes = [], [], []
    for k, (state, root) in enumerate(zip(states, roots)):
        old = [] if state._features is None else [state._features]
        feature_pieces += old + ([new[k]] if pending else [])
        token_pieces += [state._next_tokens, *(t.to(device) for t, _ in state.pending), root]
        sizes.append(sum(piece.shape[0] for piece in old) + counts[k])
        state.pending = []
    features, tokens = torch.cat(feature_pieces), torch.cat(token_pieces)
    at = 0
    for state, size in zip(states, sizes):
        state._features, state._next_tokens = features[at : at + size], tokens[at : at + size - 1]
        at += size
    return features, tokens


@dataclass
class _Pairs:
    """One row's new pairs in a forward: T_i of them, and what each query sees before the row's new slots.

    Query j sees slots [0, ``sees_prefix[j]``), the earlier slots in ``sees_slots[j]`` and its own.
    """

    nodes: list[int]  # the tree node of each pair (a root forward: only its last pair, the root's, is a node)
    features: torch.Tensor  # (T_i, H)
    tokens: torch.Tensor  # (T_i,)
    positions: torch.Tensor  # (T_i,)
    sees_prefix: torch.Tensor  # (T_i,)
    sees_slots: torch.Tensor | None  # (T_i, N) slot of each visible tree node, -1 where none; None: no tree slots
    is_root: bool


class FeatureRound:
    """One draft round of several states over one cache: the roots' forward, then one forward per tree level.

    Tracks, per request, which tree node sits in which slot, the head's output
    at each node (its children's input feature) and the node's draft log-probs.
    """

    def __init__(
        self, head, requests: Sequence[DraftRequest], rows: BatchedKVCache | None, levels: DraftLevels | None,
    ) -> None:
        if rows is None and len(requests) != 1:
            raise ValueError(f"{len(requests)} requests need the batched cache whose rows their states' caches are")
        self.head, self.requests, self.rows = head, list(requests), rows
        self.levels = levels  # the roots' forward and the tree levels over ``rows`` (eager, or static and captured)
        # Rows 0..batch-1 run, those without a request padding (static: a power of two of them, the graphs serving
        # every batch up to it)
        self.batch = 1 if rows is None else self.levels.batch(max(r.row for r in requests) + 1)
        self.cache = rows if rows is not None else requests[0].state.cache
        self.lengths = self._lengths()  # every row's committed slots, restored by `rollback`
        self.roots: list[torch.Tensor] = []  # each request's (1,) root token on the device
        # (starts, held, lengths, rows): (B,) each row's slots before the round, 1 where held, its state's committed
        # tokens (0: no request), and (R,) each request's row; staged once for the round's forwards (a batched cache's)
        self.meta: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.max_depths: torch.Tensor | None = None  # (R,) each request's max_depth, staged with ``meta``
        self._base: torch.Tensor | None = None  # (B,) each row's slots after the roots' forward (see `_level`)
        self.outputs: list[dict[int, torch.Tensor]] = [{} for _ in requests]  # node -> (H,) head output
        self.slots: list[dict[int, int]] = [{} for _ in requests]  # node -> its slot in the row's cache
        self.logp: list[dict[int, torch.Tensor]] = [{} for _ in requests]  # node -> (V,) its children's log-probs

    def run_roots(self) -> None:
        """Every request's first forward: the pairs committed since its last round, then its root's."""
        if self.rows is None:
            self._run({i: self._root_pairs(i) for i in range(len(self.requests))})
            return
        lengths = [0] * self.batch
        for request in self.requests:
            lengths[request.row] = request.state.length
        held = [int(view is not None) for view in self.rows.views[: self.batch]]
        sizes = [r.state.length - self.lengths[r.row] for r in self.requests]  # each row's pairs: catch-up and root
        width = max(sizes)
        places = [r.row * width + j for r, n in zip(self.requests, sizes) for j in range(n)]  # in the (B * T) grid
        ends = [0] * self.batch  # each row's root pair in that grid (a row without a request: cell 0)
        for r, n in zip(self.requests, sizes):
            ends[r.row] = r.row * width + n - 1
        *self.meta, self.max_depths, places, ends = staged(
            self.rows.kv.device, self.lengths, held, lengths, [r.row for r in self.requests],
            [r.max_depth for r in self.requests], places, ends)
        self.meta = tuple(self.meta)
        self._run_roots(sizes, places, ends)

    def _run_roots(self, sizes: list[int], places: torch.Tensor, ends: torch.Tensor) -> None:
        """Every request's catch-up pairs and root in one forward over the batched cache, every row's pairs placed by
        the indices staged with the round's metadata (no work a row): pair j of a row sits at its next slot j,
        position start + j, and sees the cache and the row's pairs up to it; padding sees its own slot only
        (`DraftLevels.roots`, which replays a graph over a captured pool's rows)."""
        starts, held, lengths, _ = self.meta
        states, width = [r.state for r in self.requests], max(sizes)
        for request in self.requests:
            root = request.root_tensor
            self.roots.append(torch.tensor([request.root_token], device=places.device) if root is None else root)
        features, tokens = fold_together(states, self.roots, self.head)  # (sum n, H), (sum n,)
        b, hidden = self.batch, features.shape[-1]
        grid_features = features.new_zeros(b * width, hidden).index_copy_(0, places, features).view(b, width, hidden)
        grid_tokens = tokens.new_zeros(b * width).index_copy_(0, places, tokens).view(b, width)  # padding: token 0
        last, logp = self.levels.roots(grid_features, grid_tokens, starts, lengths, ends)  # (B, H), (B, V)
        for i, (request, n) in enumerate(zip(self.requests, sizes)):  # as `_record` keeps a root's forward
            self.outputs[i][0], self.logp[i][0] = last[request.row], logp[request.row]
            self.slots[i][0] = self.lengths[request.row] + n - 1

    def chains(self) -> list[Tree]:
        """Every request's `Chain` after `run_roots`: `grow_chains` picks each level's tokens on the device and
        `_level` runs them (a frontier of one node a row, its parent the last level's), every row in one forward a
        level, nothing read back."""
        n = len(self.requests)
        roots, logp = torch.cat(self.roots), torch.stack([self.logp[i][0] for i in range(n)])  # (R,), (R, V)
        state = {"level": 1, "outputs": torch.stack([self.outputs[i][0] for i in range(n)])[:, None], "seen": None}
        first = self._lengths()  # every row's slots before the first level: node d of a chain sits at first + d - 1
        only = torch.zeros(n, 1, dtype=torch.long, device=roots.device)  # each node's parent: the last level's node

        def step(tokens: torch.Tensor) -> torch.Tensor:
            state["level"] += 1
            return self._level(state, tokens[:, None], None if state["level"] == 2 else only)[:, 0]

        trees = grow_chains(roots, logp, step, [r.policy for r in self.requests], [r.max_depth for r in self.requests],
                            [r.sampling for r in self.requests])
        for i, (request, tree) in enumerate(zip(self.requests, trees)):
            self.slots[i].update((d, first[request.row] + d - 1) for d in range(1, tree.num_nodes))
        return trees

    def dynamic(self) -> list[Tree]:
        """Every request's `DynamicTree` after `run_roots` (one policy for all, a batched cache): `grow_dynamic`
        ranks and keeps nodes on the device and `_level` runs each level's frontier, every row's ``top_k``
        nodes in one forward, nothing read back."""
        policy = grown_dynamic(self.requests[0].policy)
        depth_at = self.max_depths.clamp(max=policy.depth)  # (rows of several depths: the staged copy of theirs)
        return self._by_levels(policy.depth, lambda *grown: (
            grow_dynamic(*grown[:3], policy, grown[3], depth_at=depth_at), policy.top_k))

    def static(self) -> list[Tree]:
        """Every request's top-k `StaticTree` after `run_roots` (one policy for all, a batched cache): `grow_static`
        picks each level's ranks on the device and `_level` runs its frontier, padded to the widest, in one forward."""
        policy = self.requests[0].policy
        return self._by_levels(policy.max_depth, lambda *grown: grow_static(*grown[:3], policy, grown[3]))

    def _by_levels(self, deepest: int, grow) -> list[Tree]:
        """Trees grown on the device by ``grow(roots, logp, step, depths) -> (trees, K)``, each of its levels' K-node
        frontiers run by ``step`` (`_level`) for every row in one forward; rows are cut to ``deepest``."""
        n = len(self.requests)
        depths = [min(deepest, r.max_depth) for r in self.requests]
        roots, logp = torch.cat(self.roots), torch.stack([self.logp[i][0] for i in range(n)])  # (R,), (R, V)
        state = {"level": 1, "outputs": torch.stack([self.outputs[i][0] for i in range(n)])[:, None], "seen": None}
        first = self._lengths()

        def step(tokens: torch.Tensor, came_from: torch.Tensor | None) -> torch.Tensor:
            state["level"] += 1
            return self._level(state, tokens, came_from)  # (R, K, V)

        trees, width = grow(roots, logp, step, depths)
        for i, (request, depth) in enumerate(zip(self.requests, depths)):
            # The slots its levels took, for its peak (`rollback` counts them): keyed -1, -2, ..., no node's index,
            # as the frontiers that ran are not the tree's nodes once it is cut
            self.slots[i].update((-1 - j, first[request.row] + j) for j in range((depth - 1) * width))
        return trees

    def _level(self, state: dict, tokens: torch.Tensor, came_from: torch.Tensor | None) -> torch.Tensor:
        """One level of every request's tree (a dynamic tree's, or a chain's: a frontier of one): (R, k) frontier
        tokens, each with its parent's place in the last frontier (None: the root) -> (R, k, V) their children's draft
        log-probs (their (R, k, H) outputs go to ``state``). Over a batched cache the level runs in `DraftLevels.level`
        (which replays a graph over a captured pool's rows): here each node's parent output and the tree slots it
        sees (its ancestors' among the frontiers run before, and its own), rows without a request padding."""
        b, k = self.batch, tokens.shape[1]
        level = state["level"]  # the level whose children this forward scores: its frontier is at depth level - 1
        if self.rows is None:  # one chain over its own cache, its pairs contiguous: causal, no mask
            position = torch.full((1, 1), self.requests[0].state.length + level - 2, device=tokens.device)
            parent = state["outputs"] if came_from is None else state["outputs"].gather(
                1, came_from[:, :, None].expand(-1, -1, state["outputs"].shape[-1]))
            state["outputs"] = self.head.draft_step(parent, tokens, position, None, self.cache)
            return self.head.draft_logp(state["outputs"]).float().log_softmax(-1)
        starts, held, lengths, rows = self.meta
        if level == 2:
            self._base = starts + (max(self._lengths()) - max(self.lengths)) * held  # the roots' forward's T
        parent_out = state["outputs"]  # (R, k or 1, H) the last frontier's outputs (the root's at first)
        chain = k == 1  # a chain's node sees every tree slot before it: its ancestors are all the nodes run
        tree_seen = None  # a chain's: every tree slot before it (see below)
        if came_from is None or chain:
            features = parent_out.expand(-1, k, -1)
        else:  # each node sees what its parent saw, and its parent
            features = parent_out.gather(1, came_from[:, :, None].expand(-1, -1, parent_out.shape[-1]))
        if not chain:
            seen = torch.zeros(len(self.requests), k, 0, dtype=torch.bool, device=tokens.device) if came_from is None else (
                torch.cat([state["seen"].gather(1, came_from[:, :, None].expand(-1, -1, state["seen"].shape[-1])),
                           torch.nn.functional.one_hot(came_from, k).bool()], dim=2))
            state["seen"] = seen  # (R, k, (level - 2) * k) over the tree slots run before
            own = torch.eye(k, dtype=torch.bool, device=tokens.device).expand(len(self.requests), -1, -1)
            tree_seen = torch.cat([seen, own], dim=2)  # (R, k, (level - 1) * k): tree slots from base
        in_order = [r.row for r in self.requests] == list(range(b))
        if not in_order:  # rows of the pool that draft nothing now pad: they see their own slot, outputs dropped
            if tree_seen is not None:
                pad = torch.zeros(b, k, dtype=torch.bool, device=tokens.device)
                pad = pad[:, :, None].expand(-1, -1, tree_seen.shape[2]).clone()
                tree_seen = pad.index_copy(0, rows, tree_seen)
            features = features.new_zeros(b, k, features.shape[-1]).index_copy(0, rows, features)
            tokens = tokens.new_zeros(b, k).index_copy(0, rows, tokens)
        out, logp = self.levels.level(features, tokens, self._base, held, lengths, level, tree_seen)  # (B, k, H), (B, k, V)
        state["outputs"] = out if in_order else out.index_select(0, rows)
        return logp if in_order else logp.index_select(0, rows)

    def step(self, asked: list[tuple[int, Tree, torch.Tensor]]) -> list[torch.Tensor]:
        """`grow_together`'s step: one forward for every asked request's new frontier nodes."""
        wanted = [(i, tree, frontier.tolist()) for i, tree, frontier in asked]
        new = {i: [n for n in dict.fromkeys(nodes) if n not in self.logp[i]] for i, _, nodes in wanted}
        pairs = {i: self._node_pairs(i, tree, new[i]) for i, tree, _ in wanted if new[i]}
        if pairs:
            self._run(pairs)
        return [torch.stack([self.logp[i][n] for n in nodes]) for i, _, nodes in wanted]

    def rollback(self) -> None:
        """Keep committed pairs only (nothing from a draft survives) in every row the round touched."""
        kept = dict(enumerate(self.lengths))
        for i, request in enumerate(self.requests):
            state = request.state
            state.peak = state.length - 1 + len(self.slots[i])
            if 0 in self.slots[i]:  # the root's forward ran: the pairs before the root's are now cached
                consumed = state.length - 1 - self.lengths[request.row]
                state.consume(consumed)
                kept[request.row] = state.length - 1
        views = self.rows.views[: self.batch] if self.rows is not None else [self.cache]
        for row, view in enumerate(views):
            if view is not None:
                view.crop(kept[row])

    def _lengths(self) -> list[int]:
        return self.rows.lengths(self.batch) if self.rows is not None else [len(self.cache)]

    def _root_pairs(self, i: int) -> _Pairs:
        """The pairs of tokens committed since the cache's last, then the root's pair: causal over the cache."""
        request = self.requests[i]
        state, start = request.state, self.lengths[request.row]
        root = request.root_tensor
        root = torch.tensor([request.root_token], device=state.next_tokens.device) if root is None else root
        self.roots.append(root)
        tokens = torch.cat([state.next_tokens, root])
        positions = torch.arange(start, state.length, device=tokens.device)  # pair j at position j
        return _Pairs([0], state.features, tokens, positions, positions + 1, None, is_root=True)

    def _node_pairs(self, i: int, tree: Tree, nodes: list[int]) -> _Pairs:
        """Frontier nodes' pairs (parent's output, own token): each sees the committed pairs and its ancestors."""
        state, device = self.requests[i].state, tree.tokens.device
        idx = torch.tensor(nodes, device=device)
        slot_of = torch.full((tree.num_nodes,), -1, dtype=torch.long, device=device)
        slot_of[list(self.slots[i])] = torch.tensor(list(self.slots[i].values()), device=device)
        ancestors = tree.ancestor_mask()[idx]  # (F, N): a node's own column has no slot yet (-1)
        sees_slots = torch.where(ancestors, slot_of[None], -1)
        features = torch.stack([self.outputs[i][p] for p in tree.parents[idx].tolist()])  # (F, H)
        committed = torch.full((len(nodes),), state.length - 1, device=device)  # pairs 0 .. n-2
        return _Pairs(nodes, features, tree.tokens[idx], state.length - 1 + tree.depth[idx], committed, sees_slots, False)

    def _run(self, pairs: dict[int, _Pairs]) -> None:
        """One forward over the given requests' pairs (rows without any: padding), then record nodes and log-probs."""
        starts = self._lengths()
        first = next(iter(pairs.values()))
        b, t, device = self.batch, max(len(p.tokens) for p in pairs.values()), first.features.device
        if self.rows is None and first.is_root:  # one row's catch-up and root: causal over its own cache, no mask
            out = self.head.draft_step(first.features[None], first.tokens[None], first.positions[None], None, self.cache)
            self._record(pairs, starts, out)
            return
        width = max(starts) + t
        features = first.features.new_zeros(b, t, first.features.shape[-1])
        tokens = torch.zeros(b, t, dtype=torch.long, device=device)  # padding: token 0, masked, never read
        first_slot = torch.tensor(starts, device=device)[:, None]  # (B, 1): the row's new pairs take the next T slots
        positions = first_slot.repeat(1, t)  # (B, T); padding sits at its first slot's index
        columns, new = torch.arange(width, device=device), torch.arange(t, device=device)
        visible = columns == (first_slot + new)[:, :, None]  # (B, T, W) its own slot (padding: only it)
        for i, p in pairs.items():
            row, n = self.requests[i].row, len(p.tokens)
            features[row, :n], tokens[row, :n], positions[row, :n] = p.features, p.tokens, p.positions
            visible[row, :n] |= columns[None] < p.sees_prefix[:, None]
            if p.sees_slots is not None:
                query, node = (p.sees_slots >= 0).nonzero(as_tuple=True)
                visible[row, query, p.sees_slots[query, node]] = True
        mask = torch.full(visible.shape, torch.finfo(features.dtype).min, dtype=features.dtype, device=device)
        mask = mask.masked_fill(visible, 0.0)[:, None]  # (B, 1, T, W) additive
        out = self.head.draft_step(features, tokens, positions, mask, self.cache)  # (B, T, H)
        self._record(pairs, starts, out)

    def _record(self, pairs: dict[int, _Pairs], starts: list[int], out: torch.Tensor) -> None:
        """Each request's new nodes: their outputs (B, T, H) rows, cache slots and children's log-probs."""
        # The root's forward reads only its last pair (the root's); a level's reads every pair.
        read = {i: range(len(p.tokens) - 1, len(p.tokens)) if p.is_root else range(len(p.tokens)) for i, p in pairs.items()}
        picked = torch.cat([out[self.requests[i].row, cols.start : cols.stop] for i, cols in read.items()])  # (sum, H)
        logp = self.head.draft_logp(picked).float().log_softmax(-1).split([len(c) for c in read.values()])
        for (i, cols), row_logp in zip(read.items(), logp):
            row = self.requests[i].row
            for node, col, lp in zip(pairs[i].nodes, cols, row_logp):
                self.outputs[i][node] = out[row, col]
                self.slots[i][node] = starts[row] + col
                self.logp[i][node] = lp
