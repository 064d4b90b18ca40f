"""A feature head's batched draft forwards over a draft pool: a round's roots' forward and each tree level, eager at
exact shapes or static and captured once per size as CUDA graphs.

Why one home for both: a forward's mask is built from each row's numbers (its first new slot, how many committed
pairs it sees, where its tree starts, which earlier frontier nodes each node descends from), so the same function
runs at the round's exact widths (eager) or at fixed ones (static: the first B rows of the pool, a power of two that
`FeatureRound` pads its rows to, and the first W slots of each, a bucket of `SLOT_BUCKET`), where a CUDA graph
replays it. Once the target's verification forward replays as one graph (`specgraft.model.captured`), drafting is
most of a speculative step's launches: each level is one small forward of the head, its mask, its lm_head and a
log-softmax, some 40-80 launches for a few microseconds of work each. The rows' host bookkeeping
(`BatchedKVCache.grow`) runs outside the forward, every call.

Graphs: a roots' forward one per (B, T, W), T its widest catch-up (a few: the deepest chain's accepted tokens, plus
one); a chain's levels one per (B, W), the level a tensor input; a tree's (dynamic or static top-k) one per (B, k, W,
level), as a node's ancestry over the frontiers run before grows with its level.

Shape legend: B pool rows in the round, T pairs a row, k frontier nodes a row, W slots attended, H hidden,
V vocabulary.
"""

from __future__ import annotations

import torch

from specgraft.model import BatchedKVCache
from specgraft.model.captured import (
    MOST_GRAPHS, CudaGraphs, GraphSet, Recomputed, StaticRows, bucket, default_recorder, held_rope_table, slot_bucket,
)
from specgraft.model.fast_llama import additive


class DraftLevels:
    """`FeatureRound`'s forwards over one draft pool, eager or static (captured where a recorder captures).

    Args:
        head: a feature head (EAGLE, EAGLE-3): its ``draft_step`` and ``draft_logp``, its ``fast()`` forward.
        pool: the draft rows (`FeatureDrafter.new_rows`); a static form's graphs hold its addresses.
        static: fixed shapes, every call through one `GraphSet` (False: each call at its exact widths, eager).
        recorder, most_graphs: as `GraphSet`'s (default: CUDA graphs on CUDA, eager elsewhere).

    Raises:
        ValueError: a static form over a head whose rope frequencies follow each forward's positions (a static level
            reads a fixed table).
    """

    def __init__(
        self, head, pool: BatchedKVCache, static: bool = False, recorder: CudaGraphs | Recomputed | None = None,
        most_graphs: int = MOST_GRAPHS,
    ) -> None:
        self.head, self.pool, self.static = head, pool, static
        device = pool.kv.device
        self.graphs: GraphSet | None = None
        self.numbers: torch.Tensor | None = None
        if static:
            held_rope_table(head.fast(), pool, "a captured level")  # what every graph's positions read
            self.graphs = GraphSet(default_recorder(device) if recorder is None else recorder, most_graphs)
            # 0, 1, ... past any level a row's slots allow: a chain's level as an input is a slice, not a host copy
            self.numbers = torch.arange(pool.max_len + 2, device=device)

    def batch(self, rows: int) -> int:
        """The pool rows a round over rows 0..rows-1 runs: those, or a power of two of them (static)."""
        return min(self.pool.rows, bucket(rows)) if self.static else rows

    def roots(
        self, features: torch.Tensor, tokens: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, ends: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A round's first forward for pool rows 0..B-1: (B, T, H) features and (B, T) tokens of each row's pairs
        (padded); (B,) each row's first new slot, committed pairs and its root pair's cell in the (B * T) grid ->
        (B, H) each root's output and (B, V) its children's draft log-probs. Each held row takes T slots."""
        b, t = tokens.shape
        width = self._width(b, t)
        if self.graphs is None:
            return self._roots(width, starts, lengths, ends, features, tokens)
        # ((3 + T) B,) the forward's numbers: each row's first new slot, committed pairs, root cell; its tokens
        run = lambda index, features: self._roots(  # noqa: E731
            width, *index[: 3 * b].view(3, b), features, index[3 * b :].view(b, t))
        return self.graphs(("roots", b, t, width), run, torch.cat([starts, lengths, ends, tokens.view(-1)]), features)

    def level(
        self, features: torch.Tensor, tokens: torch.Tensor, base: torch.Tensor, held: torch.Tensor,
        lengths: torch.Tensor, level: int, seen: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tree level ``level`` (2 onwards) for pool rows 0..B-1: (B, k, H) parent outputs and (B, k) frontier tokens;
        (B,) each row's first tree slot, 1 where held, committed pairs; ``seen`` (B, k, (level - 1) k) which tree
        slots from the first each node sees (its ancestors' and its own), None for a chain (every one so far) ->
        (B, k, H) outputs and (B, k, V) their children's draft log-probs. Each held row takes k slots."""
        b, k = tokens.shape
        width = self._width(b, k)
        if self.graphs is None:
            return self._level(width, level, base, held, lengths, features, tokens, seen)
        # ((3 + k) B + 1,) the level's numbers: tree starts, held, committed pairs, tokens; the level itself, which a
        # chain's graph reads as an input (one graph serves all its levels) and a tree's holds (a graph a level, as
        # ``seen`` grows)
        index = torch.cat([base, held, lengths, tokens.view(-1), self.numbers[level : level + 1]])

        def run(index: torch.Tensor, features: torch.Tensor, *seen: torch.Tensor):
            numbers, tokens = index[: 3 * b].view(3, b), index[3 * b : (3 + k) * b].view(b, k)
            at = level if seen else index[(3 + k) * b :]
            return self._level(width, at, *numbers, features, tokens, seen[0] if seen else None)

        if seen is None:
            return self.graphs(("chain", b, width), run, index, features)
        return self.graphs(("tree", b, k, width, level), run, index, features, seen)

    def _width(self, b: int, new: int) -> int:
        """The slots a forward of ``new`` pairs a row attends, after the rows' bookkeeping: every slot up to the
        longest row's last new one (static: that, in a bucket)."""
        width = self.pool.grow(b, new)
        return slot_bucket(width, self.pool.max_len) if self.static else width

    def _roots(
        self, width: int, starts: torch.Tensor, lengths: torch.Tensor, ends: torch.Tensor, features: torch.Tensor,
        tokens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The roots' forward itself: pair j of a row sits at its first new slot + j (its position too) and sees the
        row's committed pairs and its pairs up to it; padding sees its own slot only."""
        b, t = tokens.shape
        new = torch.arange(t, device=tokens.device)
        slots = starts[:, None] + new  # (B, T)
        columns = torch.arange(width, device=tokens.device)
        count = (lengths - starts).clamp(min=0)  # (B,) a row's pairs (none where it drafts nothing)
        visible = ((columns <= slots[:, :, None]) & (new < count[:, None])[:, :, None]) | (columns == slots[:, :, None])
        mask = additive(visible[:, None], features.dtype)  # (B, 1, T, W)
        out = self.head.draft_step(features, tokens, slots, mask, StaticRows(self.pool, starts, width))  # (B, T, H)
        last = out.reshape(b * t, out.shape[-1])[ends]  # (B, H)
        return last, self.head.draft_logp(last).float().log_softmax(-1)

    def _level(
        self, width: int, level: int | torch.Tensor, base: torch.Tensor, held: torch.Tensor, lengths: torch.Tensor,
        features: torch.Tensor, tokens: torch.Tensor, seen: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The level itself (``level`` a number, or a (1,) tensor). Frontier node j at level l (its depth l - 1) sits
        at slot base + (l - 2) k + j, at position length + l - 2, and sees its row's committed pairs (slots
        [0, length)), the tree slots from base that ``seen`` gives it (a chain's node: every one so far) and its own.
        A row that drafts nothing (held 0) writes at its first tree slot; its outputs are dropped."""
        b, k = tokens.shape
        slot = base + held * ((level - 2) * k)  # (B,) each row's first new slot
        columns = torch.arange(width, device=tokens.device)
        offset = columns - base[:, None]  # (B, W) each column's place among the tree slots
        inside = ((offset >= 0) & (offset < (level - 1) * k))[:, None]  # (B, 1, W)
        if seen is not None:  # (B, k, W) the tree slots each node sees
            inside = inside & seen.gather(2, offset.clamp(0, seen.shape[2] - 1)[:, None].expand(-1, k, -1))
        own = columns == (slot[:, None] + torch.arange(k, device=tokens.device))[:, :, None]  # (B, k, W)
        visible = (columns < lengths[:, None])[:, None] | inside | own
        mask = additive(visible[:, None], features.dtype)  # (B, 1, k, W)
        positions = (lengths + (level - 2))[:, None].expand(-1, k)
        out = self.head.draft_step(features, tokens, positions, mask, StaticRows(self.pool, slot, width))  # (B, k, H)
        return out, self.head.draft_logp(out).float().log_softmax(-1)
