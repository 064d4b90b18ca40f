"""T(N), what a target forward over N packed tokens costs on this machine: timed once per target, then learned.

The goodput controller (`specgraft.infer.adaptive.goodput`) prices every draft level and every verified node in
seconds of the target's forward; this module owns those seconds. `StepCost.measure` times a few forwards at start-up (in
passes up and down the sizes, the fastest of each, made never to decrease with more tokens: `rising_times`); the
steps' own forwards then rescale it (the machine's load moves), teach the penalty a tree adds to a forward (a row
alone's, and packed beside one-token rows), and fit the step's work beyond its forward per step, per row and per
row verifying a tree (`plane`: least squares over decaying sums). `step_cost` shares one per target.

Shape legend: N packed tokens.
"""

from __future__ import annotations

import bisect
import statistics
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from specgraft.infer.adaptive.clock import DeviceClock
from specgraft.model import Target
from specgraft.tree import ROOT_PARENT, Tree, tree_attention_mask, tree_position_ids

# Step costs are learned as exponential moving averages with this weight on the newest observation.
EMA = 0.2
# Token counts at which T(N) is timed at start-up; larger N are extrapolated along the last segment.
COST_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
COST_PREFIX = 64  # cached tokens before the timed forwards
COST_REPEATS = 4  # timed forwards per size at least; the fastest counts
COST_SECONDS = 0.25  # ... and more, while the passes over the sizes took less than this (a fast target)
COST_MAX_PASSES = 64
# Observed forwards per move of T(N)'s scale, and steps per refit of their work beyond the forward: a refit and the
# plans it moves cost a row 8-10 us a step at 8 (stories260K, batch 1: 1.3% of a 680 us step), 1-2 us at 32.
RESCALE_EVERY = 32
# Steps over which the fit of a tree's scheduler work decays (by 1/e): rows that draft can be a few percent of the
# steps, and a memory of 40 steps (EMA per fold) held a handful of them (stories260K, batch 1, prompt lookup: 205 us
# fitted against 142 us between the drafted steps' mean and the others').
OVERHEAD_MEMORY = 256
# Packed forwards with trees per move of ``StepCost.packed_ratio`` (the first ones set it): under load they are a few
# steps in a hundred, and at `RESCALE_EVERY` a batch drafted for dozens of steps at a level priced at a third to a
# half of its cost before the first move (SmolLM2, batch 16: 8 tokens drafted on 33 of 148 steps, 128 ms against 86).
PACKED_EVERY = 8
# T's scale and the work of a tree move a little every `RESCALE_EVERY` steps; plans are priced again only once either
# moved by this share (of the scale; of T(1) for the work), so a row that plans no draft keeps its plan for many steps.
PRICE_TOLERANCE = 0.02
_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> its StepCost, measured once


@dataclass
class StepCost:
    """T(N): seconds of a target forward over N packed tokens, measured once and rescaled by what steps observe."""

    points: dict[int, float]
    scale: float = 1.0
    # A forward that pays for trees takes this much longer than its tokens alone, a step the curve of causal tokens
    # cannot hold. A row alone verifies a branching tree under a mask (stories260K: a masked tree of 4 took 1.04-1.16
    # times 4 causal tokens, three start-ups; SmolLM2 1.00-1.38, five): ``tree_ratio``, timed once at start-up
    # (``trees_seen``). Packed, any row of more than one token also leaves the one SDPA call of the one-token rows
    # (16 rows: 2.06 ms with one chain of 2 against 1.66 ms without, benchmarks/tree_in_batch.py), and the forward's
    # tokens sit on a curve timed on one row: ``packed_ratio``, read as ``tree_ratio`` until the first `PACKED_EVERY`
    # packed forwards with trees set it (SmolLM2 at batch 16: 8 drafted tokens took a forward of 128 ms against 86,
    # +50% where the curve said +15-20%; timed at start-up on 8 rows after 64 tokens it came out at 1.01-1.05). Each
    # is then learned from the forwards of its kind with trees, against ``scale``.
    tree_ratio: float = 1.0
    trees_seen: bool = False  # tree_ratio was timed or observed: later forwards move it by `EMA` (else they set it)
    packed_ratio: float = 1.0
    packed_seen: bool = False  # packed_ratio was observed (until then the penalty of a packed tree reads tree_ratio)
    # (tokens, seconds) of forwards since the last rescale: without trees, with trees on a row alone, and packed.
    observed: list[tuple[int, float]] = field(default_factory=list)
    observed_trees: list[tuple[int, float]] = field(default_factory=list)
    observed_packed: list[tuple[int, float]] = field(default_factory=list)
    # A step's time beyond its forward and its drafting (planning, selection, tree masks, acceptance, gathers, commits,
    # and whatever runs between steps: a generator's or a server's handling of the tokens), fitted to observed steps as
    # per_step + per_row * rows + per_drafted * rows verifying a tree (see `observe_overhead`). Every token a step
    # commits is bought with its whole time, so this prices speculation as much as the forward does.
    per_step: float = 0.0
    per_row: float = 0.0
    per_drafted: float = 0.0
    # Decaying sums of that fit (see `OVERHEAD_MEMORY`; the layout of `plane`), and the steps since the last fit,
    # (rows, drafted, seconds), folded in every `RESCALE_EVERY` steps (a step appends a tuple: it costs nothing more).
    moments: list[float] = field(default_factory=lambda: [0.0] * 9)
    recent: list[tuple[int, int, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._xs = sorted(self.points)
        self._ys = [self.points[x] for x in self._xs]
        self._base: dict[int, float] = {}  # n -> T(n) at scale 1, as read off the points (selection asks per node)
        self._curve: tuple[float, list[float]] = (self.scale, [])  # (scale, [n]: T(n) at it): `span`'s list
        self._priced_at = self._checked = (self.scale, self.tree_ratio, self.packed_ratio, self.per_step, self.per_row,
                                           self.per_drafted)

    def price_point(self) -> tuple[float, ...]:
        """(scale, tree ratio, packed ratio, work per step, per row, per drafted row) as plans were last priced: held
        until one moves by `PRICE_TOLERANCE` (the works: of T(1))."""
        now = (self.scale, self.tree_ratio, self.packed_ratio, self.per_step, self.per_row, self.per_drafted)
        held = self._priced_at
        if now == self._checked:  # nothing moved since the last check (they move every `RESCALE_EVERY` steps)
            return held
        self._checked = now
        work = PRICE_TOLERANCE * self._ys[0] * self.scale
        if (abs(now[0] - held[0]) > PRICE_TOLERANCE * held[0]
                or any(abs(a - b) > PRICE_TOLERANCE for a, b in zip(now[1:3], held[1:3]))
                or any(abs(a - b) > work for a, b in zip(now[3:], held[3:]))):
            self._priced_at = now
        return self._priced_at

    def overhead(self, rows: int) -> float:
        """Seconds of a step over ``rows`` rows beyond its forward, where no row drafts (see ``per_step``)."""
        return max(self.per_step + self.per_row * rows, 0.0)

    def tree_penalty(self, n: int, packed: bool = False) -> float:
        """Seconds a forward over ``n`` tokens takes longer when some row in it verifies a tree: a row alone's
        (``tree_ratio``), or ``packed`` beside others (``packed_ratio``, once observed)."""
        return self(n) * max((self.packed_ratio if packed and self.packed_seen else self.tree_ratio) - 1.0, 0.0)

    @classmethod
    def measure(cls, target: Target) -> StepCost:
        """A few timed forwards: N tokens after `COST_PREFIX` cached ones, for every size of `COST_SIZES` the
        context holds (once per target: a batch size met later needs no new measurement)."""
        cached = min(COST_PREFIX, target.max_context // 2)  # a short context (a test's tiny model) keeps room for N
        room = target.max_context - cached
        sizes = [n for n in COST_SIZES if n <= room] or [1]
        device = target.device
        prefix = (torch.arange(cached, device=device) * 31 + 5) % target.vocab_size
        cache = target.new_cache()
        target.forward(prefix[None], cache, torch.arange(cached, device=device)[None])
        inputs = {n: (_filler(target, n), torch.arange(cached, cached + n, device=device)[None]) for n in sizes}
        times: dict[int, list[float]] = {n: [] for n in sizes}
        # Every size once per pass, the passes in turn: a burst of load on the machine slows one pass, whose times the
        # other passes' beat, rather than every repeat of the sizes timed meanwhile (timed size after size, 1-4 tokens
        # once took 1.7 times their time and flattened the curve: more tokens looked free). Passes run up and down the
        # sizes in turn: a forward right after a much larger one runs cold (1 token after 256: 10-20% slower).
        # A fast target's passes go on for `COST_SECONDS`: bursts of load last longer than a few of its passes.
        started, rep = time.perf_counter(), 0
        while rep <= COST_REPEATS or (rep < COST_MAX_PASSES and time.perf_counter() - started < COST_SECONDS):
            for n in sizes if rep % 2 == 0 else reversed(sizes):
                if rep > 3 and n > 16:  # large N, slow to time, vary little: three times (after a warm-up)
                    continue
                ids, positions = inputs[n]
                times[n].append(_timed(lambda: target.forward(ids[None], cache, positions), cache, cached, target.device))
            rep += 1
        points = {n: min(t[1:]) for n, t in times.items()}
        return cls(rising_times(points), tree_ratio=_tree_ratio(target, cache, cached), trees_seen=True)

    def __call__(self, n: int) -> float:
        base = self._base.get(n)
        if base is None:
            base = self._base[n] = self._unscaled(n)
        return base * self.scale

    def span(self, start: int, count: int) -> list[float]:
        """[k]: T(start + k) for k in 0..count, off a list kept until the scale moves (selection reads T at every
        node count it weighs: a call a node cost 6 us a drafted step at batch 1)."""
        scale, curve = self._curve
        end = start + count + 1
        if scale != self.scale or len(curve) < end:
            # read again at a new scale as far as asked; at the same scale grown by doubling (read a few times in all)
            size = end if scale != self.scale else max(end, 2 * len(curve))
            curve = [self(n) for n in range(size)]
            self._curve = (self.scale, curve)
        return curve[start:end]

    def _unscaled(self, n: int) -> float:
        """T(n) at scale 1: along the segment between the measured sizes about n, or the last one beyond them."""
        xs, ys = self._xs, self._ys
        if n <= xs[0]:
            base = ys[0]
        elif n >= xs[-1]:  # beyond the last measured size: along the last segment (linear layers grow with N)
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else ys[-1] / xs[-1]
            base = ys[-1] + slope * (n - xs[-1])
        else:
            i = bisect.bisect_left(xs, n)  # xs[i - 1] < n <= xs[i]
            base = ys[i - 1] + (ys[i] - ys[i - 1]) * (n - xs[i - 1]) / (xs[i] - xs[i - 1])
        return base

    def observe_overhead(self, rows: int, drafted: int, seconds: float) -> None:
        """A step over ``rows`` rows, ``drafted`` of which verified a tree, took ``seconds`` beyond its forward and its
        drafting (from its start to the next step's): fit ``per_step``, ``per_row`` and ``per_drafted`` (least
        squares over decaying sums, refitted every `RESCALE_EVERY` steps: plans priced on it are reused between).

        Steps all of one batch size cannot tell the work per step from the work per row: it is then put on the
        rows; steps where no row or every row verified a tree, the work of a tree from a row's: on the rows.
        """
        recent = self.recent
        recent.append((rows, drafted, seconds))
        if len(recent) < RESCALE_EVERY:
            return
        sums = [sum(terms) for terms in zip(*(plane_terms(r, d, y) for r, d, y in recent))]
        recent.clear()
        decay = (1 - 1 / OVERHEAD_MEMORY) ** RESCALE_EVERY
        self.moments = [decay * m + v for m, v in zip(self.moments, sums)]
        fit = plane(self.moments)
        if fit is None:
            return
        (mr, md, my), (vrr, vrd, vdd), (cry, cdy) = fit
        rows_vary, drafted_vary = vrr > 1e-9, vdd > 1e-9 and vrr * vdd - vrd * vrd > 1e-6 * vrr * vdd
        if rows_vary and drafted_vary:
            det = vrr * vdd - vrd * vrd
            per_row, per_drafted = (cry * vdd - cdy * vrd) / det, (cdy * vrr - cry * vrd) / det
        elif rows_vary:  # trees' work not apart from the rows' (none, or as many as the rows): on the rows
            per_row, per_drafted = cry / vrr, 0.0
        else:  # one batch size: what is not the trees' work goes on its rows
            per_row, per_drafted = 0.0, (cdy / vdd if vdd > 1e-9 else 0.0)
        self.per_drafted = max(per_drafted, 0.0)
        rest = my - self.per_drafted * md  # the mean step's work that is not its trees'
        if rows_vary:
            self.per_row, self.per_step = per_row, rest - per_row * mr
        else:
            self.per_row, self.per_step = rest / max(mr, 1.0), 0.0

    def observe(self, n: int, seconds: float, trees: bool = False, packed: bool = False) -> None:
        """A step's forward over ``n`` tokens took ``seconds``; ``trees``: it paid for trees (a mask, or packed rows
        of more than one token; see `GoodputController.chains_unmasked`), ``packed`` beside other rows.

        Every `RESCALE_EVERY` forwards of a kind (`PACKED_EVERY` packed ones with trees), the curve's scale moves toward
        their median observed / predicted (the machine's load moves; a scale that holds between moves lets plans be
        reused), a tree's forwards predicted with their kind's ratio; and that ratio moves toward their median observed
        / predicted without it (set outright by the first ones where it was not timed at start-up: a packed one never
        is).
        """
        packed = trees and packed
        observed = (self.observed_packed if packed else self.observed_trees) if trees else self.observed
        observed.append((n, seconds))
        if len(observed) < (PACKED_EVERY if packed else RESCALE_EVERY):
            return
        base = [(self(m) / self.scale, t) for m, t in observed]  # (T at scale 1, seconds)
        observed.clear()
        if trees:  # the median: a forward's first trees run cold
            seen = self.packed_seen if packed else self.trees_seen
            a = EMA if seen else 1.0
            learned = statistics.median(t / (p * self.scale) for p, t in base)
            if packed:
                self.packed_seen, self.packed_ratio = True, (1 - a) * self.packed_ratio + a * learned
            else:
                self.trees_seen, self.tree_ratio = True, (1 - a) * self.tree_ratio + a * learned
        ratio = (self.packed_ratio if packed else self.tree_ratio) if trees else 1.0
        # The median, as for trees: the machine's load moves the scale, a forward preempted once does not (one such
        # among eight moved their mean by an eighth of its delay, and plans were priced again every few dozen steps).
        self.scale = (1 - EMA) * self.scale + EMA * statistics.median(t / (p * ratio) for p, t in base)


def _tree_ratio(target: Target, cache: Any, cached: int) -> float:
    """A row's tree of 4 as the engine verifies one (its mask made, then a masked forward) over 4 causal tokens,
    timed in turns after ``cached`` tokens, the fastest of each (a ratio of times taken apart moved by half with the
    machine's load)."""
    device = target.device
    tokens = _filler(target, 4)
    star = Tree(tokens=tokens, parents=torch.tensor([ROOT_PARENT, 0, 0, 0], device=device),
                depth=torch.tensor([0, 1, 1, 1], device=device), scores=torch.zeros(4, device=device))
    causal = torch.arange(cached, cached + 4, device=device)[None]

    def tree() -> None:
        mask = tree_attention_mask(star, cached, target.dtype)
        target.forward(tokens[None], cache, tree_position_ids(star, cached), mask)

    tree_times, causal_times = [], []
    for _ in range(2 * COST_REPEATS + 1):
        tree_times.append(_timed(tree, cache, cached, target.device))
        causal_times.append(_timed(lambda: target.forward(tokens[None], cache, causal), cache, cached, target.device))
    return max(min(tree_times[1:]) / min(causal_times[1:]), 1.0)  # the first of each warms up


def _filler(target: Target, n: int) -> torch.Tensor:
    """``n`` token ids spread over the vocabulary, for forwards timed on no particular text: [n]."""
    return (torch.arange(n, device=target.device) * 7919 + 11) % target.vocab_size


def _timed(forward: Callable[[], object], cache: Any, cached: int, device: torch.device) -> float:
    """Seconds the device works on ``forward`` (`DeviceClock`: on a GPU its kernels, not their launches); then the
    cache is cropped back to its ``cached`` tokens."""
    clock = DeviceClock(device)
    start = clock.mark()
    forward()
    elapsed = clock.seconds(start, clock.mark())
    cache.crop(cached)
    return elapsed


def rising_times(points: dict[int, float]) -> dict[int, float]:
    """The timed points made never to decrease with more tokens: what verifying N tokens costs, read
    conservatively.

    A forward's time against its tokens climbs in steps with the kernels' choice of blocking: on SmolLM2, 1 and
    2 tokens took 38 ms, 3 and 4 took 50-52 (at 64, 120 and 300 cached tokens alike). A lower convex hull, read
    here before, priced 3 tokens at 40 ms, so plans and probes two levels deep cost a quarter of a forward more
    than they were priced. Points that dip below a smaller size's (16 tokens once as fast as 12) take that
    size's time: noise in a point now costs speculation, never throughput (each point is the fastest of several
    passes, see `StepCost.measure`).
    """
    out, floor = {}, 0.0
    for x in sorted(points):
        floor = out[x] = max(points[x], floor)
    return out


def plane_terms(x: float, z: float, y: float) -> tuple[float, ...]:
    """One observation's terms in `plane`'s layout, (1, x, z, y, xx, xz, zz, xy, zy): what its sums add."""
    return 1.0, x, z, y, x * x, x * z, z * z, x * y, z * y


def plane(moments: list[float]) -> tuple[tuple[float, float, float], tuple[float, float, float],
                                         tuple[float, float]] | None:
    """Means (x, z, y), variances (xx, xz, zz) and covariances (xy, zy) of weighted sums laid out as
    (weight, x, z, y, xx, xz, zz, xy, zy): the least squares plane y = a + b x + c z reads off them (None: no weight)."""
    w, sx, sz, sy, sxx, sxz, szz, sxy, szy = moments
    if w <= 0:
        return None
    mx, mz, my = sx / w, sz / w, sy / w
    return ((mx, mz, my), (sxx / w - mx * mx, sxz / w - mx * mz, szz / w - mz * mz),
            (sxy / w - mx * my, szy / w - mz * my))


def step_cost(target: Target) -> StepCost:
    """The target's T(N), measured on first use and shared by every controller over it (it is the machine's)."""
    cost = _COSTS.get(target)
    if cost is None:
        cost = _COSTS[target] = StepCost.measure(target)
    return cost


def forget_step_cost(target: Target) -> None:
    """Measure ``target``'s T(N) again at its next use (a test's fresh start-up)."""
    _COSTS.pop(target, None)
