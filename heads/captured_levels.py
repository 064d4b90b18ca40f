"""A feature head's draft forwards at static shapes, captured once per size as CUDA graphs: a round's roots' forward
and its chain levels.

Why: once the target's verification forward replays as one graph (`specgraft.model.captured`), drafting is most of
a speculative step's launches (EAGLE chain:4 at batch 16 on stories260K: about 270 of 286 counted), and each level of
a chain is one small forward of the head, its mask, its lm_head and a log-softmax: some 40-80 launches for a few
microseconds of work each, and so is a round's first forward (each row's catch-up pairs and its root). Both are
made static as the target's forward is: the first B rows of the draft pool (a power of two, `FeatureRound` pads its
rows to it), the first W slots of each (a bucket of `SLOT_BUCKET`), the mask built inside the forward from each
row's numbers (its first new slot, how many committed pairs it sees, where its tree starts). The rows' host
bookkeeping (`BatchedKVCache.grow`) runs outside the graph, every call. A roots' forward is captured for each width
T of its widest catch-up (a few: the deepest chain's accepted tokens, plus one).

Tree levels (dynamic and static trees) run eager.

Shape legend: B pool rows in the round, T pairs a row, W slots attended (bucket), H hidden, V vocabulary.
"""

from __future__ import annotations

import torch

from specgraft.model import BatchedKVCache
from specgraft.model.captured import (
    MOST_GRAPHS, CudaGraphs, GraphSet, Recomputed, StaticRows, default_recorder, held_rope_table, slot_bucket,
)
from specgraft.model.fast_llama import additive


class CapturedLevels:
    """`FeatureRound`'s roots' forward and chain levels over one draft pool, one graph per (B, W) and per (B, T, W).

    Args:
        head: a feature head (EAGLE, EAGLE-3): its ``draft_step`` and ``draft_logp``, its ``fast()`` forward.
        pool: the draft rows (`FeatureDrafter.new_rows`); the graphs hold its addresses.
        recorder, most_graphs: as `GraphSet`'s (default: CUDA graphs on CUDA, eager elsewhere).

    Raises:
        ValueError: a head whose rope frequencies follow each forward's positions (a captured level reads a table).
    """

    def __init__(
        self, head, pool: BatchedKVCache, recorder: CudaGraphs | Recomputed | None = None, most_graphs: int = MOST_GRAPHS,
    ) -> None:
        self.table = held_rope_table(head.fast(), pool, "a captured level")  # what every graph's positions read
        self.head, self.pool = head, pool
        device = pool.kv.device
        self.graphs = GraphSet(default_recorder(device) if recorder is None else recorder, most_graphs)
        # 0, 1, ... past any level a row's slots allow: a level's number as a tensor is a slice, not a copy from the host
        self.numbers = torch.arange(pool.max_len + 2, device=device)

    def __call__(
        self, features: torch.Tensor, tokens: torch.Tensor, base: torch.Tensor, held: torch.Tensor,
        lengths: torch.Tensor, level: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Chain level ``level`` (2 onwards) for pool rows 0..B-1, as `FeatureRound._level` runs it: (B, 1, H)
        parent outputs and (B, 1) tokens; (B,) each row's first tree slot, 1 where held, committed pairs ->
        (B, 1, H) outputs and (B, V) their children's draft log-probs. Each held row takes one slot."""
        b = features.shape[0]
        width = slot_bucket(self.pool.grow(b, 1), self.pool.max_len)
        # (4 B + 1,) the level's numbers: tokens, tree starts, held, committed pairs; the level itself
        index = torch.cat([tokens.view(b), base, held, lengths, self.numbers[level : level + 1]])
        return self.graphs((b, width), lambda index, features: self._run(width, index, features), index, features)

    def roots(
        self, features: torch.Tensor, tokens: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, ends: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A round's first forward for pool rows 0..B-1, as `FeatureRound._run_roots` runs it: (B, T, H) features and
        (B, T) tokens of each row's pairs (padded); (B,) each row's first new slot, committed pairs and its root
        pair's cell in the (B * T) grid -> (B, H) each root's output and (B, V) its children's draft log-probs. Each
        held row takes T slots."""
        b, t = tokens.shape
        width = slot_bucket(self.pool.grow(b, t), self.pool.max_len)
        index = torch.cat([starts, lengths, ends])  # (3 B,)
        run = lambda index, features, tokens: self._roots(width, index, features, tokens)  # noqa: E731
        return self.graphs(("roots", b, t, width), run, index, features, tokens)

    def _roots(
        self, width: int, index: torch.Tensor, features: torch.Tensor, tokens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The roots' forward itself, every shape static: pair j of a row sits at its first new slot + j (its
        position too) and sees the row's committed pairs and its pairs up to it; padding sees its own slot only."""
        b, t = tokens.shape
        starts, lengths, ends = index.view(3, b)
        new = torch.arange(t, device=index.device)
        slots = starts[:, None] + new  # (B, T)
        columns = torch.arange(width, device=index.device)
        count = (lengths - starts).clamp(min=0)  # (B,) a row's pairs (none where it drafts nothing)
        visible = ((columns <= slots[:, :, None]) & (new < count[:, None])[:, :, None]) | (columns == slots[:, :, None])
        mask = additive(visible[:, None], features.dtype)  # (B, 1, T, W)
        out = self.head.draft_step(features, tokens, slots, mask, StaticRows(self.pool, starts, width))  # (B, T, H)
        last = out.reshape(b * t, out.shape[-1])[ends]  # (B, H)
        return last, self.head.draft_logp(last).float().log_softmax(-1)

    def _run(self, width: int, index: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The level itself, every shape static. A node sees its row's committed pairs and the chain's slots up to its
        own new one (a row that drafts nothing: its first tree slot; its output is dropped)."""
        b = features.shape[0]
        tokens, first, held, lengths = index[: 4 * b].view(4, b)
        level = index[4 * b :]  # (1,)
        end, slot, positions = first + level - 1, first + (level - 2) * held, lengths + level - 2  # (B,) each
        columns = torch.arange(width, device=index.device)
        # (B, W); a row's new slot is the last of its tree's (a row that drafts nothing: its first tree slot)
        visible = (columns < lengths[:, None]) | ((columns >= first[:, None]) & (columns < end[:, None]))
        mask = additive(visible[:, None, None], features.dtype)  # (B, 1, 1, W)
        out = self.head.draft_step(features, tokens[:, None], positions[:, None], mask, StaticRows(self.pool, slot, width))
        return out, self.head.draft_logp(out[:, 0]).float().log_softmax(-1)

