"""How each weight shape's product runs on CPU: one of three forms, chosen by measurement on this machine.

Every product of the target is ``F.linear`` (``x @ W.T``) unless this machine
ran another form faster for that weight shape and row count:

- ``transposed``, ``W @ x.T``, at 1 to `SMALL_ROWS` rows (a verified chain or
  small tree). Reading the weights dominates, so n rows should cost about one
  row, but BLAS builds differ: on one machine MKL ran ``F.linear`` for 2-4 rows
  at up to 3x its one-row time and ``W @ x.T`` at about the one-row time; on
  another of the same kind the transposed form was the slower.
- ``packed``, at any row count: oneDNN's linear over a copy of the weight
  reordered once, at load, into the blocked layout its kernels read
  (``torch.ops.mkldnn``; vLLM's CPU build multiplies the same way). On the
  machine it was added on, SmolLM2's products ran 1.3-2.1x faster packed from
  8 rows up (benchmarks/small_gemm.py prints them).

So nothing is assumed: when a target loads, the fast path times each of its
weight shapes in every form at 1 to `SMALL_ROWS` rows and at `MANY_ROWS`
(which stands for every count above `SMALL_ROWS`), through the model's own
weights (every layer's copy of a shape in turn, so no weight stays in the
caches between calls, as in a forward), and keeps the fastest form per
(shape, rows) (`SmallRowChoice`). A form is kept only where it measured
faster than ``F.linear``, so decoding is never slower than with ``F.linear``
everywhere, up to timing noise. A packed copy is kept only for shapes that
take it (it costs the weight's size again in memory). ``SPECGRAFT_SMALL_ROWS``
(or ``load_target(small_rows=...)``) pins ``linear``, ``transposed`` or
``packed`` instead, for tests and comparisons.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

SMALL_ROWS = 4  # the row counts measured one by one: 1 to this (a verified chain or small tree)
MANY = SMALL_ROWS + 1  # the key of every row count above SMALL_ROWS (wider trees, batches, prompts) ...
MANY_ROWS = 16  # ... timed at this many rows
REPEATS = 2  # timed passes per (shape, rows, form); the least disturbed one counts
# A pass cycles through at most this many bytes of a shape's weights: more than a CPU's caches hold, so each
# product streams its weight from memory as in a forward, and few enough that a 135M model measures in seconds.
PASS_BYTES = 64 << 20
MODES = ("auto", "linear", "transposed", "packed")
ENV = "SPECGRAFT_SMALL_ROWS"  # pins the mode where load_target is not told one

Key = tuple[int, int, int]  # (out features, in features, rows 1..SMALL_ROWS or MANY)


def key(weight: torch.Tensor, rows: int) -> Key:
    """The choice's key for ``rows`` rows times ``weight``."""
    return weight.shape[0], weight.shape[1], min(rows, MANY)


def _rows(rows: int) -> str:
    """A key's rows as reports print them."""
    return f">{SMALL_ROWS}" if rows == MANY else str(rows)


@dataclass(frozen=True)
class SmallRowChoice:
    """Which form each (shape, rows) product runs; every product not named runs ``F.linear``.

    Attributes:
        forms: (out, in, rows) -> "transposed" or "packed", where that form runs.
        timings: (out, in, rows) -> form -> seconds of one product with a weight streamed from memory, where measured.
        how: how the choice was made, for reports.
    """

    forms: Mapping[Key, str] = field(default_factory=dict)
    timings: Mapping[Key, Mapping[str, float]] = field(default_factory=dict)
    how: str = "F.linear everywhere (not measured)"

    def describe(self) -> str:
        """One line for reports: the choice, then where each other form runs."""
        if not self.forms:
            return self.how
        where: dict[str, dict[tuple[int, int], list[str]]] = {}
        for (out, inp, rows), form in sorted(self.forms.items()):
            where.setdefault(form, {}).setdefault((out, inp), []).append(_rows(rows))
        name = {"transposed": "W @ x.T", "packed": "packed"}
        parts = [f"{name[form]} for " + "; ".join(f"{o}x{i} at {','.join(r)} rows" for (o, i), r in shapes.items())
                 for form, shapes in where.items()]
        return f"{self.how}: {'; '.join(parts)}; F.linear elsewhere"

    def to_dict(self) -> dict:
        """The choice and its timings as JSON reports keep them (milliseconds per product)."""
        label = lambda k: f"{k[0]}x{k[1]}@{_rows(k[2])}"  # noqa: E731
        return {
            "choice": self.describe(),
            "how": self.how,
            "forms": {label(k): form for k, form in sorted(self.forms.items())},
            "timings_ms": {label(k): {form: round(s * 1e3, 4) for form, s in t.items()} for k, t in sorted(self.timings.items())},
        }


def choose(timings: Mapping[Key, Mapping[str, float]]) -> dict[Key, str]:
    """The (shape, rows) where another form measured faster than ``F.linear``, and the fastest such form: never a
    slower form (a tie keeps F.linear)."""
    chosen = {}
    for k, forms in timings.items():
        best = min(forms, key=lambda form: (forms[form], form != "linear"))
        if best != "linear":
            chosen[k] = best
    return chosen


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


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's reordered copy of ``weight`` (N, K) for `packed_linear`, or None where this build, device or dtype
    offers none."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        with torch.inference_mode():
            return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), MANY_ROWS)
    except RuntimeError:
        return None


def pack_shapes(weights: Mapping[tuple[int, int], Sequence[torch.Tensor]]) -> dict[tuple[int, int], list[torch.Tensor]]:
    """Each shape's weights packed (aligned with ``weights``), for the shapes whose every weight packs."""
    packed = {shape: [pack(w) for w in mats] for shape, mats in weights.items()}
    return {shape: packs for shape, packs in packed.items() if all(p is not None for p in packs)}


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` over ``packed = pack(weight)``; results agree within rounding (another
    summation order)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@torch.inference_mode()
def measure(
    weights: Mapping[tuple[int, int], Sequence[torch.Tensor]],
    packed: Mapping[tuple[int, int], Sequence[torch.Tensor]] | None = None,
    repeats: int = REPEATS,
) -> dict[Key, dict[str, float]]:
    """(out, in, rows) -> form -> seconds per product at 1 to SMALL_ROWS rows and at MANY_ROWS (key MANY): the
    fastest of ``repeats`` passes over ``weights[(out, in)]`` (up to `PASS_BYTES` of them, and their ``packed``
    copies where given), divided by the products in a pass.

    The forms alternate pass by pass, so a burst of load from other work hits each alike.
    """
    timings: dict[Key, dict[str, float]] = {}
    for (out, inp), mats in weights.items():
        mats = mats[: max(1, PASS_BYTES // (mats[0].numel() * mats[0].element_size()))]
        packs = list((packed or {}).get((out, inp), ()))[: len(mats)]
        for rows in (*range(1, SMALL_ROWS + 1), MANY):
            x = torch.randn(MANY_ROWS if rows == MANY else rows, inp, dtype=mats[0].dtype, device=mats[0].device)
            forms = {"linear": lambda: [F.linear(x, w) for w in mats]}
            if rows <= SMALL_ROWS:
                forms["transposed"] = lambda: [transposed_linear(x, w) for w in mats]
            if packs:
                forms["packed"] = lambda: [packed_linear(x, p) for p in packs]
            best = dict.fromkeys(forms, float("inf"))
            for timed in range(repeats + (rows == 1)):  # a shape's first pass warms it up, untimed
                for form, run in forms.items():
                    start = time.perf_counter()
                    run()
                    if timed or rows > 1:
                        best[form] = min(best[form], time.perf_counter() - start)
            timings[(out, inp, rows)] = {form: seconds / len(mats) for form, seconds in best.items()}  # per product
    return timings


def small_row_choice(
    weights: Mapping[tuple[int, int], Sequence[torch.Tensor]], mode: str | None = None
) -> tuple[SmallRowChoice, dict[tuple[int, int], list[torch.Tensor]]]:
    """The choice for a model whose weights of each (out, in) shape are ``weights[(out, in)]``, and the packed
    copies (aligned with ``weights``) of the shapes that take the packed form somewhere.

    ``mode``: "auto" measures (on CPU; elsewhere F.linear everywhere); "linear", "transposed" and "packed" pin one
    form for every product it applies to (transposed: 1 to SMALL_ROWS rows; packed: every row count, where oneDNN
    packs the weights); None reads ``SPECGRAFT_SMALL_ROWS`` (default "auto").

    Raises:
        ValueError: an unknown mode (naming where it came from).
    """
    where = "small_rows"
    if mode is None:
        mode, where = os.environ.get(ENV, "auto"), ENV
    if mode not in MODES:
        raise ValueError(f"{where}={mode!r} must be one of {', '.join(MODES)}")
    if mode == "linear":
        return SmallRowChoice(how=f"F.linear everywhere (pinned by {where})"), {}
    if mode == "transposed":
        forms = {(o, i, r): "transposed" for o, i in weights for r in range(1, SMALL_ROWS + 1)}
        return SmallRowChoice(forms, how=f"W @ x.T at 1-{SMALL_ROWS} rows (pinned by {where})"), {}
    first = next((mats[0] for mats in weights.values() if mats), None)
    if first is None or first.device.type != "cpu":
        return SmallRowChoice(how="F.linear everywhere (not a CPU: nothing measured)"), {}
    start = time.perf_counter()
    packed = pack_shapes(weights)
    if mode == "packed":
        forms = {(o, i, r): "packed" for o, i in packed for r in (*range(1, SMALL_ROWS + 1), MANY)}
        how = f"packed at every row count (pinned by {where})" if packed else f"F.linear everywhere (nothing packs here; {where})"
        return SmallRowChoice(forms, how=how), packed
    timings = measure(weights, packed)
    forms = choose(timings)
    how = f"measured here in {time.perf_counter() - start:.2f} s at {torch.get_num_threads()} thread(s)"
    taken = {(o, i) for (o, i, _), form in forms.items() if form == "packed"}
    return SmallRowChoice(forms, timings, how if forms else f"F.linear everywhere ({how})"), {
        shape: packs for shape, packs in packed.items() if shape in taken
    }
