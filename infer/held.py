"""The forwards' states that rows keep their roots in, until they next draft: the scheduler's deferred commits.

A row that does not draft (its tree sized to nothing under load, most rows most steps) would otherwise pay its
draft state's commit every step: its states' views and a call. It keeps its root and its row's index in the held
states instead, two ints (`Request.deferred_roots`, `Request.deferred`), and gives them all as one commit when it
next drafts (every `DraftState` keeps a run of commits as it keeps one commit of them all), its states gathered
from the held forwards' join in one indexing a layer. The forwards are let go once no row keeps a root, or, by the
scheduler, after `HELD_BYTES` of them or `HELD_ROWS` rows (every row then gives what it kept). EAGLE on
stories260K, never drafting, over plain (medians of paired blocks of steps): 26 us a step at batch 16 and 8 at
batch 1, against 42-50 and 12 us keeping a tuple a row a step (its tokens, every row's states split apart, its row
there), given 32 at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class HeldForward:
    """One held forward: its states (layer -> (N, H) or (1, N, H)), None once copied into the join, over N rows."""

    states: dict[int, torch.Tensor] | None
    rows: int


class HeldStates:
    """The held forwards, their rows and bytes, their join, and how many rows keep roots in them."""

    def __init__(self) -> None:
        self.let_go()

    def let_go(self) -> None:
        """Let every held forward go: no row keeps a root of them."""
        self.forwards: list[HeldForward] = []
        self.rows = 0  # rows of every forward held so far (a kept root's index is below this)
        self.base = 0  # the rows before the last forward's: a root kept there has this plus its start there
        self.bytes = 0
        self.last: dict[int, torch.Tensor] | None = None  # the last forward held
        self.holders = 0  # rows that kept roots not given yet: none, and the forwards are let go
        # The join of the forwards (see `joined`): layer -> (capacity, H) buffer, and the forwards and rows in it
        self._joined: dict[int, torch.Tensor] = {}
        self._joined_forwards = self._joined_rows = 0

    def __bool__(self) -> bool:
        return bool(self.forwards)

    def keep(self, hidden: dict[int, torch.Tensor], rows: int, start: int, first: bool) -> int:
        """A row keeps its root: the index of its states among the held ones. ``hidden``: its forward's states over
        ``rows`` tokens (held now if no row of it kept its root yet), the row's from ``start``; ``first``: the row
        keeps no other root yet."""
        if hidden is not self.last:
            self._hold(hidden, rows)
        if first:
            self.holders += 1
        return self.base + start

    def _hold(self, hidden: dict[int, torch.Tensor], rows: int) -> None:
        self.forwards.append(HeldForward(hidden, rows))
        self.last = hidden
        self.base = self.rows
        self.rows += rows
        for states in hidden.values():
            self.bytes += states.nbytes

    def gather(self, indices: list[int], layers: tuple[int, ...], device: torch.device) -> dict[int, torch.Tensor]:
        """The states kept at ``indices`` (as `keep` returned them), at ``layers``: layer -> (len(indices), H)."""
        joined, at = self.joined(), torch.tensor(indices, device=device)
        return {i: joined[i][at] for i in layers}

    def joined(self) -> dict[int, torch.Tensor]:
        """The held forwards' states joined: layer -> (rows, H), a row's index there as `keep` returned it.

        Each forward is copied into the join once, at the first give after it was held, and then let go: a give
        copies only the forwards held since the last (joined anew at every give, a batch whose rows drafted now and
        then copied every held row again each time). A forward without some layer (no row in it reads that layer)
        leaves rows of nothing there, which no row reads."""
        joined = self._joined
        for forward in self.forwards[self._joined_forwards:]:
            rows, at = forward.rows, self._joined_rows
            for i, h in forward.states.items():
                flat = h.reshape(rows, -1)
                buffer = joined.get(i)
                if buffer is None or buffer.shape[0] < at + rows:  # grown by doubling: a row is copied O(1) times
                    capacity = max(at + rows, 2 * (0 if buffer is None else buffer.shape[0]))
                    grown = flat.new_empty(capacity, flat.shape[1])
                    if buffer is not None:
                        grown[:at] = buffer[:at]
                    joined[i] = buffer = grown
                buffer[at : at + rows] = flat
            forward.states = None
            self._joined_rows += rows
        self._joined_forwards = len(self.forwards)
        return joined

    def release(self) -> None:
        """A row gave (or dropped, leaving) every root it kept: once no row keeps one, the forwards are let go."""
        self.holders -= 1
        if not self.holders:
            self.let_go()
