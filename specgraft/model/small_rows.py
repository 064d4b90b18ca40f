"""Few-row products on CPU: which of two forms each weight shape runs, chosen by measurement on this machine.

Verifying a few draft tokens multiplies a few rows by every weight of the
target. Reading the weights dominates, so n rows should cost about one row,
but BLAS builds differ: on the machine the first constants came from, MKL ran
``x @ W.T`` (``F.linear``) for 2-4 rows at up to 3x its one-row time (the
49K x 576 lm_head: 6.7 ms for 1 row, 13.4 ms for 2) and ``W @ x.T`` at about
the one-row time (4.5 ms for 2 rows); on another 2-core machine of the same
kind ``F.linear`` ran a 1536 x 576 weight on one row in 0.152 ms and the
transposed form (padded to two rows) in 0.356 ms, so constants tuned on the
first made plain decoding 0.92x Hugging Face's on the second.

So nothing is assumed: when a target loads, the fast path times each of its
weight shapes at 1 to `SMALL_ROWS` rows both ways, through the model's own
weights (every layer's copy of a shape in turn, so no weight stays in the
caches between calls, as in a forward), and keeps the faster form per
(shape, rows) (`SmallRowChoice`). A form is kept only where it measured
faster than ``F.linear``, so plain decoding is never slower than with
``F.linear`` everywhere, up to timing noise. ``SPECGRAFT_SMALL_ROWS`` (or
``load_target(small_rows=...)``) pins ``linear`` or ``transposed`` instead,
for tests and comparisons.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

SMALL_ROWS = 4  # the row counts measured: 1 to this (a verified chain or small tree; prompts run F.linear)
REPEATS = 2  # timed passes per (shape, rows, form); the least disturbed one counts
# A pass cycles through at most this many bytes of a shape's weights: more than a CPU's caches hold, so each
# product streams its weight from memory as in a forward, and few enough that a 135M model measures in under a second.
PASS_BYTES = 64 << 20
MODES = ("auto", "linear", "transposed")
ENV = "SPECGRAFT_SMALL_ROWS"  # pins the mode where load_target is not told one

Key = tuple[int, int, int]  # (out features, in features, rows)


@dataclass(frozen=True)
class SmallRowChoice:
    """Which (shape, rows) products run as ``weight @ x.T``; every other product runs ``F.linear``.

    Attributes:
        transposed: (out, in, rows) keys that take the transposed form.
        timings: (out, in, rows) -> (F.linear, W @ x.T) seconds of one product with a weight streamed from
            memory, where measured.
        how: how the choice was made, for reports.
    """

    transposed: frozenset[Key] = frozenset()
    timings: Mapping[Key, tuple[float, float]] = field(default_factory=dict)
    how: str = "F.linear everywhere (not measured)"

    def describe(self) -> str:
        """One line for reports: the choice, then where the transposed form runs."""
        if not self.transposed:
            return self.how
        shapes: dict[tuple[int, int], list[int]] = {}
        for out, inp, rows in sorted(self.transposed):
            shapes.setdefault((out, inp), []).append(rows)
        where = "; ".join(f"{o}x{i} at {','.join(map(str, r))} rows" for (o, i), r in shapes.items())
        return f"{self.how}: W @ x.T for {where}, F.linear elsewhere"

    def to_dict(self) -> dict:
        """The choice and its timings as JSON reports keep them (milliseconds per product)."""
        return {
            "choice": self.describe(),
            "how": self.how,
            "transposed": [list(k) for k in sorted(self.transposed)],
            "timings_ms": {f"{o}x{i}@{r}": [round(a * 1e3, 4), round(b * 1e3, 4)] for (o, i, r), (a, b) in sorted(self.timings.items())},
        }


def choose(timings: Mapping[Key, tuple[float, float]]) -> frozenset[Key]:
    """The (shape, rows) whose transposed form measured faster than ``F.linear``: never the slower form."""
    return frozenset(key for key, (plain, transposed) in timings.items() if transposed < plain)


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as ``weight @ x.T``: the weights read once for all rows.

    Results agree with ``F.linear`` within float32 rounding (another summation order).
    """
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])  # (rows, K)
    if rows % 2:  # an odd column count ran slower than one more where this form was first measured: pad a zero row
        flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
    # contiguous: SDPA's fused CPU kernel and the next product want row-major rows.
    out = torch.mm(weight, flat.t()).t()[:rows].contiguous()  # (rows, N)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


@torch.inference_mode()
def measure(weights: Mapping[tuple[int, int], Sequence[torch.Tensor]], repeats: int = REPEATS) -> dict[Key, tuple[float, float]]:
    """(out, in, rows) -> seconds per product of each form at 1 to SMALL_ROWS rows: the fastest of ``repeats``
    passes over ``weights[(out, in)]`` (up to `PASS_BYTES` of them), divided by the products in a pass.

    The two forms alternate pass by pass, so a burst of load from other work hits both alike.
    """
    timings: dict[Key, tuple[float, float]] = {}
    for (out, inp), mats in weights.items():
        mats = mats[: max(1, PASS_BYTES // (mats[0].numel() * mats[0].element_size()))]
        for rows in range(1, SMALL_ROWS + 1):
            x = torch.randn(rows, inp, dtype=mats[0].dtype, device=mats[0].device)
            best = [float("inf"), float("inf")]
            for timed in range(repeats + (rows == 1)):  # a shape's first pass warms it up, untimed
                for form, product in enumerate((F.linear, transposed_linear)):
                    start = time.perf_counter()
                    for w in mats:
                        product(x, w)
                    if timed or rows > 1:
                        best[form] = min(best[form], time.perf_counter() - start)
            timings[(out, inp, rows)] = (best[0] / len(mats), best[1] / len(mats))  # per product
    return timings


def small_row_choice(weights: Mapping[tuple[int, int], Sequence[torch.Tensor]], mode: str | None = None) -> SmallRowChoice:
    """The choice for a model whose weights of each (out, in) shape are ``weights[(out, in)]``.

    ``mode``: "auto" measures (on CPU; elsewhere F.linear everywhere), "linear" and "transposed" pin one
    form for every small-row product; None reads ``SPECGRAFT_SMALL_ROWS`` (default "auto").

    Raises:
        ValueError: an unknown mode (naming where it came from).
    """
    where = "small_rows"
    if mode is None:
        mode, where = os.environ.get(ENV, "auto"), ENV
    if mode not in MODES:
        raise ValueError(f"{where}={mode!r} must be one of {', '.join(MODES)}")
    if mode == "linear":
        return SmallRowChoice(how=f"F.linear everywhere (pinned by {where})")
    keys = frozenset((o, i, r) for o, i in weights for r in range(1, SMALL_ROWS + 1))
    if mode == "transposed":
        return SmallRowChoice(keys, how=f"W @ x.T at 1-{SMALL_ROWS} rows (pinned by {where})")
    first = next((mats[0] for mats in weights.values() if mats), None)
    if first is None or first.device.type != "cpu":
        return SmallRowChoice(how="F.linear everywhere (not a CPU: nothing measured)")
    start = time.perf_counter()
    timings = measure(weights)
    chosen = choose(timings)
    how = f"measured here in {time.perf_counter() - start:.2f} s at {torch.get_num_threads()} thread(s)"
    return SmallRowChoice(chosen, timings, how if chosen else f"F.linear everywhere ({how})")
