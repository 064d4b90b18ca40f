"""Trees sized by expected goodput: how much each row speculates is the engine's decision, per step, across the batch.

Speculation spends compute on guesses; under load there is none to spare. For
the rows whose tree policy is `Adaptive`, each step the `GoodputController`:

1. plans how deep each row drafts, before drafting: d levels pay when the
   tokens they are expected to add (the chance the row's accepted path
   reaches each) beat their price in tokens of the step's goodput without
   speculation (one token per row per step at this batch, a step being its
   forward and its work beyond, O below): the drafter's
   d levels, d more tokens in the forward, the tree's fixed costs (P and W
   below), and catching up, in the drafter's next round, every token the row
   commits (a head with a cache runs them first). Now and then a row probes
   as deep as it may draft, its likeliest path verified whole, at most `PROBE_SHARE` of
   its steps' worth (a tenth of it where no depth could repay even if
   accepted whole), so that depths that stopped paying (or never paid
   yet) are learned again, each with the others;
2. selects, after drafting and across every row at once, the candidate nodes
   to verify: the set maximising expected committed tokens per second,
   sum over rows of (1 + the estimates of its selected nodes) / (T(N) + O + P + W R),
   N the tokens verified, T the target's forward time at N packed tokens, O
   the step's work beyond its forward and drafting (planning, commits, and
   whatever handles the tokens between steps: a server's streaming), R the
   rows verifying a tree, P what the first tree adds to the forward (a
   masked forward; packed, its row also leaves the one-token rows' single
   attention call; a chain verified alone runs unmasked and adds nothing) and
   W the work a tree adds (selection, masks, acceptance, gathers); O and W are
   fitted to the time from each step's start to the next's, less its forward
   and drafting. Nodes enter by decreasing estimate
   and an estimate never exceeds its parent's, so a selected node's parent is
   always selected;
3. learns, after verifying (a drafter from `LEARN_EVERY` verified trees at
   a time, in one pass; a row at once): a node's estimate is its drafter's
   path probability (``exp`` of its cumulative draft log-prob, what EAGLE-2
   ranks by) calibrated per drafter and depth against what was accepted; a tree
   without probabilities (prompt lookup) uses its row's running acceptance by
   depth, calibrated the same way (selection keeps the rows that were lucky
   lately, so the raw rates run high). T is measured once with a few timed
   forwards, made never to decrease with more tokens (`specgraft.infer.adaptive.step_cost`),
   and rescaled by the forward times steps observe (P from those with trees
   against those without); a drafter's cost per row, a fixed part plus a
   part per level (prompt lookup pays once for any depth, a head once per
   level) plus a part per token caught up, is fitted to the times its rounds
   take.

In a closed batch (`generate_batch`: no request will join) the scheduler
offers the plan only the rows with the most tokens left (`Scheduler._critical`):
the batch ends with its longest row, so another row's tokens shorten nothing.

Everything a choice reads was settled before the step's verification:
committed history (what was accepted before) and this step's draft scores.
Like any dynamic tree, the choice is then lossless.

Shape legend: N verified tokens, D depth.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Sequence

import torch

from specgraft.infer.adaptive.step_cost import StepCost, plane, plane_terms, step_cost
from specgraft.model import Target
from specgraft.model.staging import staged
from specgraft.tree import Tree, cut_trees, read_lists

# Pseudo-counts of the priors: a calibration starts at factor 1 (trust the drafter's probabilities) and a row's
# reach at its drafter's, each worth this many observations.
PRIOR_WEIGHT = 4.0
ROW_MEMORY = 32.0  # steps verified to a depth a row's reach there counts before both counts halve
DRAFTER_MEMORY = 128.0  # the same for a drafter's reach over all its rows (the prior of a row's) and its siblings' split
DRAFT_MEMORY = 32  # draft rounds over which the fit of a drafter's cost decays (by 1/e)
# Steps a row plans no draft before its own counts halve: stale evidence drifts back to its drafter's reach, so a row
# that two early misses silenced drafts again where its drafter pays (the probes alone came too rarely for that).
QUIET_HALVING = 8
REACH_PRIOR = 0.5  # P(the accepted path reaches depth 1) before anything was observed; depth d: this ** d
CALIBRATION_MEMORY = 200.0  # predicted acceptances a depth's calibration sums before both halve
# A drafter's observations (draft rounds, verified trees) between re-pricings of its plans: each moves its statistics
# a little, and a row that drafts every step would otherwise price every depth again every step.
REPRICE_EVERY = 8
# Now and then a row probes as deep as it may draft, its likeliest path verified whole, so that its acceptance at
# every depth is learned (a row that never drafts a depth never learns that it now pays): probes cost at most this
# share of its steps. Not one level deeper than planned: where a draft's fixed costs outweigh one level's worth (prompt
# lookup on stories260K at batch 1: 0.47 tokens for a level, 0.70 for six, copied in one call), a row planning none
# learned only depth 1, which never paid, and a few unlucky first trees (depth 3: 0 of 11) kept its drafter from
# drafting for good (1.4% of steps drafted, 0.98x of plain, against 28% and 1.01x with probes this deep). The share
# counts the probe's catching up on the tokens its row committed since it last drafted (see `_plan_row`).
PROBE_SHARE = 0.01
# ... and a tenth of it where no depth's price is below its depth in tokens: none could repay even if every node were
# accepted, so its probes only time the drafter again (the load moves prices). EAGLE on stories260K at batch 1, a level
# at 1.4 tokens, probed every 141 steps: 1% of its time, a third of what it kept below plain.
SURE_LOSS_PROBE_SHARE = PROBE_SHARE / 10
GOLDEN = (math.sqrt(5) - 1) / 2  # row keys times this, modulo 1, spread the rows' probe phases evenly
# Verified trees their drafters learn from in one pass, once this many are queued, and at least a step's (the rows of
# the last selection: their accepted paths read back in one copy), or a row leaves: a drafter's
# calibration and reach by depth, node by node, cost a drafting row 10-15 us a drafted step in place (stories260K,
# prompt lookup at batch 1: the forward leaves Python's caches cold, and a pass over several runs warm after its
# first). A row's own reach is learned at once (see `GoodputController.observe_step`).
LEARN_EVERY = 4
# drafter -> what it taught any controller (calibration, reach, cost): learned once per process, not per scheduler.
_DRAFTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class Calibration:
    """Accepted over predicted by depth, for estimates of one kind: recent steps weigh more as the text moves on."""

    predicted: list[float] = field(default_factory=list)  # [d - 1]: sum of the raw estimates verified at depth d
    accepted: list[float] = field(default_factory=list)  # [d - 1]: how many of them were accepted
    memory: float = CALIBRATION_MEMORY  # predicted at a depth before both of its sums halve
    version: int = 0  # moves with every observation: `factors` is read again only then
    _factors: tuple[int, list[float]] = field(default_factory=lambda: (-1, []), repr=False)  # (version, `factors`)

    def factor(self, depth: int) -> float:
        """accepted / predicted at ``depth``, pulled toward 1 by `PRIOR_WEIGHT` pseudo-counts (1 where unobserved)."""
        return self.factors(depth)[depth - 1]

    def factors(self, depth: int) -> list[float]:
        """[d - 1]: `factor` at every depth d up to ``depth`` at least, kept until the next observation (a drafting
        row's plan and selection read every depth each step; the calibration moves once per learning pass)."""
        version, factors = self._factors
        if version != self.version or len(factors) < depth:
            factors = [(a + PRIOR_WEIGHT) / (p + PRIOR_WEIGHT) for a, p in zip(self.accepted, self.predicted)]
            factors += [1.0] * (depth - len(factors))
            self._factors = (self.version, factors)
        return factors

    def observe(self, depth: int, raw: float, accepted: float) -> None:
        """``raw`` predicted and ``accepted`` accepted at ``depth`` (see `observe_levels`)."""
        self.observe_levels([0.0] * (depth - 1) + [raw], [0.0] * (depth - 1) + [accepted])

    def observe_levels(self, raw: list[float], accepted: list[float]) -> None:
        """``raw[d - 1]`` predicted and ``accepted[d - 1]`` accepted at every depth d from 1 (a tree's nodes summed by
        depth; a depth with neither is left as it is), in one call."""
        self.version += 1
        predicted, sums, memory = self.predicted, self.accepted, self.memory
        while len(predicted) < len(raw):
            predicted.append(0.0)
            sums.append(0.0)
        for i, (r, a) in enumerate(zip(raw, accepted)):
            if r or a:
                p, x = predicted[i] + r, sums[i] + a
                # halve both past the memory: recent steps weigh more as the text moves on
                predicted[i], sums[i] = (p / 2, x / 2) if p > memory else (p, x)


@dataclass
class DrafterStats:
    """What one drafter taught the controller: calibration of its probabilities and its cost, by depth."""

    # Its path probabilities' calibration; and, for trees without probabilities (prompt lookup), that of its rows'
    # running reach, which runs high where selection keeps the rows that were lucky lately.
    probability: Calibration = field(default_factory=Calibration)
    rates: Calibration = field(default_factory=Calibration)
    # Over its trees without probabilities, whose siblings split a depth's reach evenly (prompt lookup's matches):
    # by depth, the trees (as predicted) and the sum of 1 / their nodes there (as accepted), so that its factor is
    # the share of a level's reach its likeliest node holds (1 for a chain): a plan of one node a level counts on that
    # much (stories260K, prompt lookup at batch 1: plans counting the whole reach drafted tries whose siblings
    # selection then cut, every one).
    split: Calibration = field(default_factory=lambda: Calibration(memory=DRAFTER_MEMORY))
    reach: list[float] = field(default_factory=list)  # [d - 1]: P(the accepted path reaches d | verified to d)
    hits: list[float] = field(default_factory=list)  # [d - 1]: recent steps verified to d whose path reached d
    seen: list[float] = field(default_factory=list)  # [d - 1]: recent steps verified to d (see `DRAFTER_MEMORY`)
    # Decaying sums over its rounds (see `DRAFT_MEMORY`) of (1, levels, behind, seconds per row) and their products,
    # for `cost_line`'s plane: weight, x, z, y, xx, xz, zz, xy, zy.
    moments: list[float] = field(default_factory=lambda: [0.0] * 9)
    version: int = 0  # moves with cost and reach (see `moved`): a plan priced at an older version is priced again
    moves: int = 0  # observations of its cost or reach so far
    # Moves with any drafter's version and any row's counts (`RowState._pull`): a plan made at the same count has seen
    # nothing learned since.
    changes: ClassVar[int] = 0
    warm: bool = False  # a round was timed already: the first (cold: first calls allocate) is not its cost
    # depth -> [verified nodes, sum of the estimates selection used, how many were accepted]: the calibration curve.
    curve: dict[int, list[float]] = field(default_factory=dict)
    _line: tuple[int, tuple[float, float, float]] = field(default=(-1, (0.0, 0.0, 0.0)), repr=False)  # (moves, fit)

    @property
    def measured(self) -> bool:
        return self.moments[0] > 0

    def moved(self) -> None:
        """Its cost or reach moved: plans priced on the old ones are priced again."""
        self.version += 1
        DrafterStats.changes += 1

    def observed(self) -> None:
        """A round's cost or a tree's reach was observed: plans are priced again at the first and then at every
        `REPRICE_EVERY`-th (pricing a drafter's depths took 15-25 us, every step a row drafted)."""
        self.moves += 1
        if self.version == 0 or self.moves % REPRICE_EVERY == 0:
            self.moved()

    def observe_cost(self, levels: int, seconds_per_row: float, behind: float = 0.0) -> None:
        """A round drafted ``levels`` deep for rows that had ``behind`` committed tokens (a mean) not yet drafted
        from (a drafter with a cache runs them first) and took ``seconds_per_row``."""
        keep = 1 - 1 / DRAFT_MEMORY
        terms = plane_terms(float(levels), float(behind), seconds_per_row)
        self.moments = [keep * m + v for m, v in zip(self.moments, terms)]
        self.observed()

    def cost_of(self, levels: int, behind: float = 0.0) -> float:
        """Seconds of drafting one row ``levels`` deep, ``behind`` committed tokens since it last drafted."""
        if levels <= 0:
            return 0.0
        fixed, per_level, per_behind = self.cost_line()
        return max(fixed + per_level * levels, 0.0) + per_behind * behind

    def cost_line(self) -> tuple[float, float, float]:
        """(fixed, per level, per token behind) seconds of drafting one row: least squares over its rounds, fitted
        once per observation (a plan prices every depth on it)."""
        if self._line[0] != self.moves:
            self._line = (self.moves, self._fit())
        return self._line[1]

    def _fit(self) -> tuple[float, float, float]:
        """`cost_line`'s fit.

        A row that drafted a few steps ago has a few tokens to catch up; one idle for long, its whole stretch
        (SmolLM2's EAGLE-3 head: 5 ms a round from 2 tokens behind, 10 ms from 120). The fixed part may be
        negative: a head's second level, over a wider frontier, cost more than its first (5.8 ms for depth 1,
        12.3-13.4 ms for depth 2 from a token behind), and held at zero it priced the first level 17% over
        its cost. Rounds all of one depth cannot tell the fixed part from the levels': it is then put on the
        levels; rounds all as far behind carry no per-token part.
        """
        fit = plane(self.moments)
        if fit is None:
            return 0.0, 0.0, 0.0
        (mx, mz, my), (vxx, vxz, vzz), (cxy, czy) = fit
        per_behind = 0.0
        levels_vary = vxx >= 0.05 and mx > 0
        if levels_vary and vzz > 1e-9 and vxx * vzz - vxz * vxz > 1e-9 * vxx * vzz:
            det = vxx * vzz - vxz * vxz
            slope, per_behind = (cxy * vzz - czy * vxz) / det, (czy * vxx - cxy * vxz) / det
        elif vzz > 1e-9:  # one depth: the part of each round that is not the tokens behind goes on its levels
            per_behind, slope = czy / vzz, 0.0
        else:
            slope = cxy / vxx if levels_vary else 0.0
        per_behind, slope = max(per_behind, 0.0), max(slope, 0.0)
        rest = my - per_behind * mz
        if not levels_vary:
            return 0.0, max(rest, 0.0) / max(mx, 1.0), per_behind
        return rest - slope * mx, slope, per_behind

    def calibration_curve(self) -> list[dict[str, float]]:
        """By depth: nodes verified, their mean estimate when selected, and the fraction accepted (the two agree
        when the controller is calibrated)."""
        return [{"depth": d, "nodes": int(n), "estimated": total / n, "observed": hits / n}
                for d, (n, total, hits) in sorted(self.curve.items()) if n]

    def reach_at(self, depth: int) -> float:
        return self.reach[depth - 1] if depth <= len(self.reach) else REACH_PRIOR**depth

    def observe_split(self, counts: list[int]) -> None:
        """A drafted tree without probabilities: ``counts[d]`` its nodes at depth d (``counts[0]``, the root's, is
        not read)."""
        self.split.observe_levels([1.0] * (len(counts) - 1), [1 / n for n in counts[1:]])  # nodes at every depth to its deepest

    def count_reach(self, accepted: int, verified_depth: int) -> None:
        """A step verified to ``verified_depth`` accepted ``accepted`` draft tokens: counted over its recent steps by
        depth (an EMA of weight 0.2 wandered 0.13-0.41 around SmolLM2's EAGLE-3 0.23). A pass of trees counts each and
        settles the reach once (`settle_reach`)."""
        count_reach(self.hits, self.seen, accepted, verified_depth, DRAFTER_MEMORY)

    def settle_reach(self) -> None:
        """Its reach by depth from the counts, pulled toward `REACH_PRIOR` by `PRIOR_WEIGHT` pseudo-steps."""
        self.reach = [(h + PRIOR_WEIGHT * REACH_PRIOR**d) / (n + PRIOR_WEIGHT)
                      for d, (h, n) in enumerate(zip(self.hits, self.seen), start=1)]


@dataclass
class RowState:
    """One generation's running acceptance by depth, seeded from its drafter's."""

    reach: list[float] = field(default_factory=list)  # [d - 1]: P(accepted path reaches d | verified to d)
    # (the prices, the deepest allowed, the depth planned, steps between probes): valid while the first two hold.
    plan: tuple[Any, int, int, float] | None = None
    # Times on the controller's clock (its plans so far): the row's last probe, when its own counts last moved, and
    # the first step at which a probe or a halving of those counts is due (see `schedule`). A row that neither
    # drafts nor is due costs its step one comparison.
    probed: int = 0
    quieted: int = 0
    wake: float = 0.0
    # The share of the wait for its first probe served before it joined, spread over rows by their keys: rows that
    # end sooner than a probe's wait (stories260K, prompt lookup at batch 1: 64 steps against 70) probe all the same.
    lead: float = 0.0

    hits: list[float] = field(default_factory=list)  # [d - 1]: recent steps verified to d whose accepted path reached d
    seen: list[float] = field(default_factory=list)  # [d - 1]: recent steps verified to d

    def reach_at(self, depth: int, drafter: DrafterStats) -> float:
        return self.reach[depth - 1] if depth <= len(self.reach) else drafter.reach_at(depth)

    def observe(self, accepted: int, verified_depth: int, drafter: DrafterStats, now: int) -> None:
        """Its reach by depth: its own recent hits, pulled toward its drafter's by `PRIOR_WEIGHT` pseudo-steps (a few
        rejections do not silence a row; `ROW_MEMORY` recent steps a depth count before older ones halve), at
        ``now`` on the controller's clock."""
        count_reach(self.hits, self.seen, accepted, verified_depth, ROW_MEMORY)
        self.plan, self.quieted = None, now
        self._pull(drafter)

    def forget(self, drafter: DrafterStats, now: int) -> None:
        """Halve its own counts (see `QUIET_HALVING`) at ``now``: its reach moves halfway back to its drafter's."""
        self.hits = [h / 2 for h in self.hits]
        self.seen = [n / 2 for n in self.seen]
        self.plan, self.quieted = None, now
        self._pull(drafter)

    def schedule(self, best: int, max_depth: int, every: float) -> None:
        """When it next needs the controller's attention, planned ``best`` of ``max_depth`` levels: its next probe
        (``every`` steps after its last, while it plans less than it may draft) or, while it plans no draft but has
        counts of its own, their next halving."""
        probe = self.next_probe(every) if best < max_depth else math.inf
        quiet = self.quieted + QUIET_HALVING if best == 0 and self.seen else math.inf
        self.wake = min(probe, quiet)

    def next_probe(self, every: float) -> float:
        """The step its next probe is due at, ``every`` steps between probes (its first sooner by its ``lead``)."""
        return self.probed + every * (1 - self.lead)

    def _pull(self, drafter: DrafterStats) -> None:
        DrafterStats.changes += 1
        self.reach = [(h + PRIOR_WEIGHT * drafter.reach_at(d)) / (n + PRIOR_WEIGHT)
                      for d, (h, n) in enumerate(zip(self.hits, self.seen), start=1)]


def _stands(composition: int | None, depths: dict[int, int]) -> int | None:
    """The rows' name a plan of these depths stands for (see `GoodputController.standing`): theirs where it drafts no
    row, else none."""
    return composition if composition is not None and not any(depths.values()) else None


def summed_by_depth(values: Sequence[float], depth: list[int], levels: int) -> list[float]:
    """[d - 1]: the sum of ``values`` over a tree's nodes at depth d, for d from 1 to ``levels`` (the root's is not
    read)."""
    sums = [0.0] * levels
    for i in range(1, len(depth)):
        sums[depth[i] - 1] += values[i]
    return sums


def count_reach(hits: list[float], seen: list[float], accepted: int, verified_depth: int, memory: float) -> None:
    """Count a step verified to ``verified_depth`` that accepted ``accepted`` draft tokens, at every depth it verified
    ([d - 1]: steps whose path reached d, steps verified to d); a depth's counts halve past ``memory`` steps."""
    for d in range(1, verified_depth + 1):
        if d > len(seen):
            hits.append(0.0)
            seen.append(0.0)
        hits[d - 1] += accepted >= d
        seen[d - 1] += 1
        if seen[d - 1] > memory:
            hits[d - 1] /= 2
            seen[d - 1] /= 2


@dataclass
class Candidate:
    """One row's drafted tree as selection sees it."""

    key: int  # the row's handle
    drafter: Any  # the row's loaded drafter (its statistics are keyed by it)
    tree: Tree
    adaptive: bool  # False: verified whole (its nodes are fixed costs and gains)


class GoodputController:
    """Plans draft depths, selects the nodes to verify, and learns acceptance and costs (see the module doc).

    Args:
        target: the target whose forward the cost curve times (measured on first use).
        row_by_row: the engine verifies every row in a forward of its own (Hugging Face's forward, no packing).
    """

    def __init__(self, target: Target, row_by_row: bool = False) -> None:
        self.target = target
        self.row_by_row = row_by_row
        self.cost: StepCost | None = None
        self.rows: dict[int, RowState] = {}
        self.clock = 0  # plans made: the steps rows count between their probes and halvings
        self.selected_last: int = 0  # draft nodes the last selection kept, over every row
        self.probes: set[int] = set()  # rows probing this step: a level more drafted, its likeliest path verified
        self.estimated: dict[int, list[float]] = {}  # row -> the estimates of the nodes selection kept this step
        self.rates: dict[int, list[float]] = {}  # row -> the raw rates of those nodes, if its tree has no probabilities
        # Verified trees their drafters did not learn from yet, with what selection expected of them (see `learn`).
        self.queued: list[tuple[Any, Tree, torch.Tensor, list[float] | None, list[float] | None]] = []
        self.selected_rows = 0  # rows of the last selection: a step's trees are learned together, their paths read once
        # id(drafter) -> (inputs, price by levels, per token caught up, reach prior): `plan`'s prices (see `_prices`).
        self.priced: dict[int, tuple[tuple, list[float], float, list[float]]] = {}
        self._known: dict[int, tuple[Any, DrafterStats]] = {}  # id(drafter) -> (drafter, its stats)
        # The last plan, while it holds (see `plan`): (the first step a row of it is due, its inputs, rows, depths, the
        # rows' name it stands for where it drafts no row (see `standing`), else None).
        self._memo: tuple[float, tuple, Sequence, dict[int, int], int | None] | None = None

    def step_cost(self) -> StepCost:
        """T(N), measured on first use and shared by every controller over the same target (it is the machine's)."""
        if self.cost is None:
            self.cost = step_cost(self.target)
        return self.cost

    @staticmethod
    def stats(drafter: Any) -> DrafterStats:
        """What ``drafter`` taught so far (shared by every controller in the process)."""
        stats = _DRAFTERS.get(drafter)
        if stats is None:
            stats = _DRAFTERS[drafter] = DrafterStats()
        return stats

    def _stats(self, drafter: Any) -> DrafterStats:
        """`stats`, through a plain dict: a weak dictionary's lookup costs a few microseconds a call, every step."""
        known = self._known.get(id(drafter))
        if known is None or known[0] is not drafter:
            known = self._known[id(drafter)] = (drafter, self.stats(drafter))
        return known[1]

    def row(self, key: int) -> RowState:
        row = self.rows.get(key)
        if row is None:  # its clocks start at the step before its first: that step is its first since either event
            row = self.rows[key] = RowState(probed=self.clock - 1, quieted=self.clock - 1, lead=key * GOLDEN % 1.0)
        return row

    def forget(self, key: int) -> None:
        """A row left: what is queued is learned now (its drafter's statistics keep it)."""
        if self.queued:
            self.learn()
        self.rows.pop(key, None)
        self.estimated.pop(key, None)
        self.rates.pop(key, None)

    # ------------------------------------------------------------------ 1. plan

    def standing(self, composition: int, batch: int) -> dict[int, int] | None:
        """The last plan again, as `plan` would give it, where it drafted no row: the step's rows are the plan's (the
        caller's same ``composition`` says so) and nothing `plan` reads moved (batch, prices, learning, no row due).
        None otherwise: call `plan`.

        Under load no row drafts and most steps plan nothing new; answered here, a step builds no list of its rows
        for `plan` to compare."""
        memo = self._memo
        if memo is None or memo[4] != composition or self.clock + 1 >= memo[0]:
            return None
        if memo[1] != (batch, self.cost.price_point(), DrafterStats.changes):
            return None
        self.clock += 1
        return memo[3]

    def plan(self, rows: Sequence[tuple[int, Any, int]], batch: int, composition: int | None = None) -> dict[int, int]:
        """How deep each adaptive row drafts: key -> depth (0: not at all).

        A row drafts the depth that maximises its expected tokens less what the drafting, the extra forward
        tokens and the scheduler's work on a tree cost at the step's goodput without speculation. Now and then a
        row probes as deep as it may (listed in ``probes``: its likeliest path verified whole; see `PROBE_SHARE`).
        A drafter whose cost was never measured drafts one level: enough to measure it.

        A step whose rows, batch, prices and learning are those of a plan that probed nothing, before any of its
        rows is due, gets that plan (the same dict: read it, do not change it); under load, where no row drafts,
        that is most steps, and a step's planning costs a few comparisons.

        Args:
            rows: (key, drafter, the deepest it may draft) of each adaptive row.
            batch: rows in the step (every one verifies at least its root).
            composition: the caller's name for these rows, each at the deepest its tree may draft: a plan that
                drafts none of them stands for later steps of the same name (see `standing`). None: no such name.
        """
        cost = self.step_cost()
        self.clock += 1
        clock, states = self.clock, self.rows
        inputs = (batch, cost.price_point(), DrafterStats.changes)
        memo = self._memo
        if memo is not None and clock < memo[0] and memo[1] == inputs and memo[2] == rows:
            if memo[4] != composition:  # it stands for this name alone, if any (see `standing`)
                self._memo = memo[:4] + (_stands(composition, memo[3]),)
            return memo[3]  # a plan is memoised only where nothing probed: ``probes`` is empty still
        depths: dict[int, int] = {}
        self.probes = set()
        due = math.inf  # the first step at which one of these rows needs planning again
        prices: dict[int, tuple | None] = {}  # id(drafter) -> its prices this step (None: its cost is unmeasured)
        # (id(prices), max_depth) -> the plan of the rows with no counts of their own (their drafter's reach: one plan
        # serves them all; 16 such rows planned one by one at every move of the prices cost 200 us a move)
        fresh: dict[tuple[int, int], tuple] = {}
        for key, drafter, max_depth in rows:
            priced = prices.get(id(drafter), False)
            if priced is False or (priced is not None and len(priced[3]) < max_depth):
                priced = prices[id(drafter)] = self._prices(drafter, batch, max_depth, cost)
            if priced is None:
                depths[key] = min(1, max_depth)
                continue
            row = states.get(key) or self.row(key)
            plan = row.plan
            if plan is None or plan[0] is not priced or plan[1] != max_depth:  # something moved: plan again
                shared = (id(priced), max_depth) if not row.reach else None
                plan = fresh.get(shared) if shared else None
                if plan is None:
                    plan = self._plan_row(row, drafter, priced, max_depth)
                    if shared:
                        fresh[shared] = plan
                row.plan = plan
                row.schedule(plan[2], max_depth, plan[3])
            depths[key] = plan[2]
            if clock >= row.wake:
                self._wake(key, row, drafter, plan, depths)
            due = min(due, row.wake)
        # Kept only where nothing probes and every drafter was timed (one never timed drafts at once, to be).
        kept = not self.probes and None not in prices.values()
        self._memo = (due, inputs, rows, depths, _stands(composition, depths)) if kept else None
        return depths

    def _wake(self, key: int, row: RowState, drafter: Any, plan: tuple, depths: dict[int, int]) -> None:
        """A row's due events (see `RowState.schedule`): its counts halve after `QUIET_HALVING` steps without a draft
        (planned again next step, from counts halfway back to its drafter's); it probes as deep as it may draft
        after its steps between probes (the probe's share of steps, see `PROBE_SHARE`; its first wait shortened by
        its `RowState.lead`)."""
        _, max_depth, best, every = plan
        clock = self.clock
        if best == 0 and row.seen and clock - row.quieted >= QUIET_HALVING:
            row.forget(self._stats(drafter), clock)
        if best < max_depth and clock >= row.next_probe(every):
            row.probed, row.lead = clock, 0.0
            depths[key] = max_depth
            self.probes.add(key)
        row.schedule(best, max_depth, every)

    def _plan_row(self, row: RowState, drafter: Any, priced: tuple, max_depth: int) -> tuple[Any, int, int, float]:
        """(prices, max_depth, the depth whose expected tokens less price is largest, steps between probes): read
        off the row's reach and its drafter's statistics alone."""
        _, levels, per_token, prior = priced
        stats = self._stats(drafter)
        reach, rates, shares = row.reach, stats.rates.factors(max_depth), stats.split.factors(max_depth)
        best, best_net, committed = 0, 0.0, 1.0
        for d in range(1, max_depth + 1):
            # expected tokens (a running reach, calibrated as selection's rates are, of which a level's likeliest
            # node holds its share) ...
            committed += (reach[d - 1] if d <= len(reach) else prior[d - 1]) * rates[d - 1] * shares[d - 1]
            # ... less the price of d levels and of catching up every token committed, as a row drafting each step does
            net = committed - 1.0 - levels[d] - per_token * committed
            if net > best_net:
                best, best_net = d, net
        price = levels[max_depth] - levels[best]  # of the levels a probe drafts beyond the plan (see `PROBE_SHARE`)
        sure_loss = all(levels[d] - levels[best] >= d - best for d in range(best + 1, max_depth + 1))
        # A probe also catches the row up on every token committed since it last drafted, about one a step between
        # probes: at a share no greater than that catching up alone, the row does not probe at this batch
        share = SURE_LOSS_PROBE_SHARE if sure_loss else PROBE_SHARE
        every = price / (share - per_token) if share > per_token else math.inf
        return priced, max_depth, best, every

    def _prices(self, drafter: Any, batch: int, max_depth: int, cost: StepCost) -> tuple | None:
        """A drafter's prices at this batch, in tokens of plain goodput: (inputs, [d]: drafting and verifying d levels,
        catching up one committed token, reach prior by depth), or None while its cost is unmeasured.

        d levels cost their drafting, the d tokens they add to the forward (on T's curve after the batch's roots:
        priced as if no other row drafted, as under load) and a tree's fixed costs; its reach by depth stands in
        for a row's depths not observed yet. Priced again only when the batch, the drafter's statistics or
        `StepCost.price_point` moved (or a deeper prior is asked for)."""
        stats = self._stats(drafter)
        if not stats.measured:
            return None
        inputs = (batch, cost.price_point(), stats.version)
        priced = self.priced.get(id(drafter))
        if priced is None or priced[0] != inputs or len(priced[3]) < max_depth:
            base = cost(batch)
            goodput = batch / (base + cost.overhead(batch))  # committed tokens per second of plain decoding at this batch
            # A row that drafts verifies a tree: the scheduler's work beyond the tokens, and the forward's tree penalty
            # (priced whole for each row: what drafting must repay where no other row drafts, as under load).
            fixed = cost.per_drafted + (0.0 if self.chains_unmasked(batch) else cost.tree_penalty(batch, packed=True))
            prior = [stats.reach_at(d) for d in range(1, max(max_depth, len(stats.reach)) + 1)]
            levels = [0.0] + [goodput * (fixed + stats.cost_of(d) + cost(batch + d) - base)
                              for d in range(1, len(prior) + 2)]
            priced = self.priced[id(drafter)] = inputs, levels, goodput * stats.cost_line()[2], prior
        return priced

    def chains_unmasked(self, batch: int) -> bool:
        """Whether a chain verifies without the tree penalty: a row verified alone (a batch of one, or every row
        on its own cache) runs a chain as causal tokens; packed beside others, any row of more than one token
        leaves the one-token rows' single attention call."""
        return self.row_by_row or batch == 1

    def observe_draft(self, drafter: Any, rows: int, levels: int, seconds: float, behind: float = 0.0) -> None:
        """A drafter's proposals for ``rows`` rows, ``levels`` deep (at least 1: a lookup that found nothing worked
        all the same), ``behind`` committed tokens a row (a mean) since each last drafted, took ``seconds`` (a
        drafter's first round, cold, is not its cost)."""
        stats = self._stats(drafter)
        if rows and levels and stats.warm:
            stats.observe_cost(levels, seconds / rows, behind)
        stats.warm = True

    # ------------------------------------------------------------------ 2. select

    def estimates(self, candidate: Candidate) -> list[float]:
        """Each node's chance to be on the accepted path (index 0, the root: 1), never above its parent's."""
        return self._estimates(candidate)[0]

    def _estimates(self, candidate: Candidate) -> tuple[list[float], list[float] | None, list[int] | None]:
        """`estimates`; for a tree without probabilities, each node's raw rate (its row's reach at its depth, shared
        among siblings) before calibration, and its nodes by depth ([d]); None for a tree with probabilities (its
        raw is in its scores)."""
        tree = candidate.tree
        if tree.num_nodes == 1:
            return [1.0], None, None
        stats = self._stats(candidate.drafter)
        depth = tree.depth_list
        scores = tree.score_list
        if any(scores[1:]):  # the drafter's own path probabilities, calibrated by depth
            parents, out = tree.parent_list, [1.0] * tree.num_nodes
            factors = stats.probability.factors(tree.max_depth)
            for i in range(1, tree.num_nodes):
                out[i] = min(out[parents[i]], 1.0, math.exp(scores[i]) * factors[depth[i] - 1])
            return out, None, None
        # No probabilities (prompt lookup): the row's running acceptance by depth, shared among siblings, calibrated.
        row = self.row(candidate.key)
        counts = [0] * (tree.max_depth + 1)
        for d in depth:
            counts[d] += 1
        factors = stats.rates.factors(tree.max_depth)
        # [d]: a depth's raw rate, each of its nodes (its row's reach shared), and that calibrated, never above a
        # shallower depth's (a node's parent is one level up: its estimate is the least of its depths')
        shared, capped, least = [1.0], [1.0], 1.0
        for d in range(1, len(counts)):
            rate = row.reach_at(d, stats) / counts[d]
            shared.append(rate)
            least = min(least, rate * factors[d - 1])
            capped.append(least)
        return [capped[d] for d in depth], [shared[d] for d in depth], counts

    def select(self, candidates: Sequence[Candidate]) -> dict[int, Tree]:
        """The trees to verify: each adaptive row's tree cut to the nodes that maximise expected tokens per second.

        Fixed rows' trees are verified whole, and probes (see `PROBE_SHARE`) the path to their likeliest deepest
        node: their nodes count as given costs and gains.
        """
        cost = self.step_cost()
        rows = len(candidates)
        tokens, expected = rows, float(rows)
        pool: list[tuple[float, int, int, int]] = []  # (-estimate, depth, row index, node) of adaptive nodes
        estimates: dict[int, list[float]] = {}  # row index -> its nodes' estimates
        rates: dict[int, list[float]] = {}  # row index -> its nodes' raw rates (trees without probabilities)
        read_lists([c.tree for c in candidates])  # every tree's structure and scores, one copy to the host
        if self.probes:
            candidates = self._probe(candidates)
        # Each row verifying a tree costs the scheduler's work on it; the first tree of the step (the first that
        # branches, where chains run unmasked), the forward's penalty.
        chains_free = self.chains_unmasked(rows)
        fixed, paid = 0, False  # fixed rows verifying a tree; whether one of them pays the penalty
        for r, c in enumerate(candidates):
            tree = c.tree
            if tree.num_nodes == 1:
                continue
            est, rate, counts = self._estimates(c)
            estimates[r] = est
            if rate is not None:
                rates[r] = rate
                self._stats(c.drafter).observe_split(counts)
            if not c.adaptive:
                tokens += tree.num_nodes - 1
                expected += sum(est) - 1.0
                fixed += 1
                paid = paid or not (chains_free and tree.is_chain)
                continue
            depth = tree.depth_list
            pool += [(-est[i], depth[i], r, i) for i in range(1, tree.num_nodes)]
        pool.sort()  # by estimate, parents before children on ties
        penalty = cost.tree_penalty(tokens, packed=not chains_free)
        per_drafted = cost.per_drafted
        extra = cost.overhead(rows) + per_drafted * fixed + (penalty if paid else 0.0)
        times = cost.span(tokens, len(pool))  # [k]: T(tokens + k)
        best_k, best = 0, expected / (times[0] + extra)
        gained, opened, levels = expected, set(), set()
        for k, (neg, depth, r, _) in enumerate(pool, start=1):
            gained -= neg
            if r not in opened:  # this row's first node: it now verifies a tree
                opened.add(r)
                extra += per_drafted
            if not paid:  # its first tree that needs a mask: where chains run unmasked, a row's second node of a level
                if not chains_free or (r, depth) in levels:
                    paid = True
                    extra += penalty
                else:
                    levels.add((r, depth))
            rate = gained / (times[k] + extra)
            if rate > best:
                best_k, best = k, rate
        keep: dict[int, list[int]] = {r: [0] for r, c in enumerate(candidates) if c.adaptive}
        for _, _, r, node in pool[:best_k]:
            keep[r].append(node)
        self.selected_last, self.selected_rows = best_k, rows
        trees, cuts = {}, {}
        for r, c in enumerate(candidates):
            if not c.adaptive:
                trees[c.key] = c.tree
                continue
            kept = sorted(keep[r])
            if len(kept) > 1:  # what selection expected of each verified node: the calibration curve, the rates'
                self.estimated[c.key] = [estimates[r][i] for i in kept]
                if r in rates:
                    self.rates[c.key] = [rates[r][i] for i in kept]
            if len(kept) == c.tree.num_nodes:
                trees[c.key] = c.tree
            else:
                cuts[c.key] = c.tree, kept
        trees.update(zip(cuts, cut_trees(list(cuts.values()), staged)))  # (their indices staged in one copy)
        return {c.key: trees[c.key] for c in candidates}

    def _probe(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        """Each probing row's tree cut to the path to its likeliest deepest node, verified whole (fixed): a chain
        teaches a level's reach as a plan of one node a level counts on it, and verifies unmasked where a row runs
        alone (SmolLM2, batch 1: a head's probe of 2 levels, 4 nodes under a mask, took 88 ms against 39 for a chain
        of 2). The paths are walked up the host's parent lists, and the cuts staged together."""
        out, cuts = list(candidates), {}
        for r, candidate in enumerate(candidates):
            if candidate.key not in self.probes:
                continue
            tree = candidate.tree
            if tree.num_nodes == 1 or tree.is_chain:
                out[r] = replace(candidate, adaptive=False)
                continue
            estimates, depth, parents = self.estimates(candidate), tree.depth_list, tree.parent_list
            node = max((i for i in range(tree.num_nodes) if depth[i] == tree.max_depth), key=lambda i: estimates[i])
            path = [node]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            cuts[r] = tree, path[::-1]
        for r, tree in zip(cuts, cut_trees(list(cuts.values()), staged)):
            out[r] = replace(candidates[r], tree=tree, adaptive=False)
        return out

    # ------------------------------------------------------------------ 3. learn

    def observe_times(
        self, tokens: int, forward: float, masked: bool, rows: int, drafted: int, overhead: float | None
    ) -> None:
        """A step's times, in one call a step (two calls and their checks cost a step where no row drafts more than
        its plan): its target forward over ``tokens`` packed tokens took ``forward`` seconds (``tokens`` 0: no one
        forward), ``masked`` if it paid for trees (see `chains_unmasked`); over ``rows`` rows, ``drafted`` of which
        verified a tree, it took ``overhead`` seconds beyond its forward and its drafting, from its start to the next
        step's (see `StepCost.observe_overhead`; None: not timed, a row joined or left)."""
        cost = self.cost
        if cost is not None:
            if tokens:
                cost.observe(tokens, forward, trees=masked, packed=not self.chains_unmasked(rows))
            if overhead is not None:
                cost.observe_overhead(rows, drafted, overhead)

    def observe_step(self, key: int, drafter: Any, tree: Tree, accepted_path: torch.Tensor) -> None:
        """A verified tree and the path accepted from it: the row's reach at once; its drafter's calibration by depth
        and reach queued, with what selection expected of the tree, and learned with the others' once `LEARN_EVERY`
        are (see `learn`).

        A row's own reach moves its next plan: lookup's matches come in runs, and a row that read its hits and
        misses four drafted steps late kept 0.97x of plain at batch 1 on stories260K, against 1.01x."""
        if tree.num_nodes == 1:
            return
        self.row(key).observe(accepted_path.numel() - 1, tree.max_depth, self._stats(drafter), self.clock)
        self.queued.append((drafter, tree, accepted_path, self.rates.pop(key, None), self.estimated.pop(key, None)))
        if len(self.queued) >= max(LEARN_EVERY, self.selected_rows):
            self.learn()

    def learn(self) -> None:
        """Learn from every verified tree queued by `observe_step`, in the order they were verified: each drafter's
        calibrations a tree at a time, its reach by depth settled once from the pass's counts."""
        queued, self.queued = self.queued, []
        if not queued:
            return
        paths = torch.cat([entry[2] for entry in queued]).tolist()  # every accepted path: one copy to the host
        read_lists([entry[1] for entry in queued])
        at, learned = 0, {}
        for drafter, tree, path, rates, estimated in queued:
            learned[id(drafter)] = self._learn(drafter, tree, paths[at : at + path.numel()], rates, estimated)
            at += path.numel()
        for stats in learned.values():
            stats.settle_reach()

    def _learn(self, drafter: Any, tree: Tree, accepted_path: list[int], rates: list[float] | None,
               estimated: list[float] | None) -> DrafterStats:
        """One tree's lessons, its nodes summed by depth ([d - 1]: a verified tree has nodes at every depth to its
        deepest); its drafter's reach counted, not settled (see `learn`)."""
        stats = self._stats(drafter)
        on_path = set(accepted_path)
        scores, depth, levels = tree.score_list, tree.depth_list, tree.max_depth
        hits = [0.0] * levels  # [d - 1]: its nodes at depth d on the accepted path (at most one)
        for i in on_path:
            if i:
                hits[depth[i] - 1] = 1.0
        if any(scores[1:]):
            stats.probability.observe_levels(summed_by_depth([math.exp(x) for x in scores], depth, levels), hits)
        if rates is not None and len(rates) == tree.num_nodes:  # the rates selection read, against what was accepted
            stats.rates.observe_levels(summed_by_depth(rates, depth, levels), hits)
        if estimated is not None and len(estimated) == tree.num_nodes:
            for i in range(1, tree.num_nodes):
                point = stats.curve.setdefault(depth[i], [0, 0.0, 0])
                point[0] += 1
                point[1] += estimated[i]
                point[2] += i in on_path
        stats.count_reach(len(on_path) - 1, levels)
        stats.observed()
        return stats
