"""Kernels and host syncs per step, counted on any device (this CPU included).

On a GPU a step's time is its kernel launches (a few microseconds each) plus
the queue drained at every host sync; on this CPU neither shows in a timing,
so the engine is held to budgets by counting them. `OpCounter` is a
`TorchDispatchMode`: every aten op dispatched that is neither a view nor a
bare allocation counts as a kernel. A host sync is what makes the host wait
for the device, or the device for the host:

- a tensor's value read on the host: ``.item()``, ``int()``, ``float()``,
  ``bool()`` (aten's ``_local_scalar_dense``, or ``item`` under inference
  mode, where it is not decomposed), ``.tolist()``, ``.cpu()``,
  ``.numpy()`` (patched while counting: on a CPU tensor they dispatch nothing);
- an output whose shape depends on values: ``nonzero``, boolean-mask
  indexing, ``masked_select``, ``unique``, ``repeat_interleave`` without
  ``output_size``;
- a tensor built from Python data (``torch.tensor(list)``, indexing with a
  list): a copy from pageable host memory, which blocks.

Each sync is kept with the line of project code that caused it, so a budget
that fails says where.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# Ops that allocate without a kernel (a fill such as zeros or arange is one).
ALLOCATIONS = frozenset({
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
    aten.new_empty_strided.default,
})
# Ops whose output shape or value the host must wait for, whatever their arguments.
VALUE_READS = frozenset({
    aten._local_scalar_dense.default, aten.item.default, aten.nonzero.default, aten.masked_select.default, aten.equal.default,
    aten.is_nonzero.default, aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
    aten.lift_fresh.default,
})
# Ops that read an index tensor's values on the host when it is boolean.
INDEXING = frozenset({aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default})
# repeat_interleave with a tensor of repeats reads their sum, unless given output_size (the second is inference mode's).
REPEATS = frozenset({aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor})
PATCHED = ("tolist", "cpu", "numpy")  # Tensor methods that reach the host without dispatching on a CPU tensor
ROOT = Path(__file__).resolve().parents[2]  # the checkout
PROJECT = frozenset({"heads", "tree", "infer", "train", "specgraft", "benchmarks"})  # its code's folders
HERE = Path(__file__).resolve()


@dataclass
class Counts:
    """Kernels and host syncs counted over ``steps`` steps; ``sites``: each sync's op and project line."""

    kernels: int = 0
    syncs: int = 0
    steps: int = 0
    sites: Counter = field(default_factory=Counter)
    ops: Counter = field(default_factory=Counter)

    @property
    def kernels_per_step(self) -> float:
        return self.kernels / max(self.steps, 1)

    @property
    def syncs_per_step(self) -> float:
        return self.syncs / max(self.steps, 1)

    def where(self, most: int = 8) -> str:
        """The commonest sync sites, a line each (for a budget's failure message)."""
        return "\n".join(f"{n / max(self.steps, 1):7.2f}/step  {site}" for site, n in self.sites.most_common(most))


class OpCounter(TorchDispatchMode):
    """Counts kernels and host syncs of the torch work run inside it (see the module's docstring).

    Usage::

        with OpCounter() as counter:
            scheduler.step()
        counter.counts.kernels, counter.counts.syncs, counter.counts.where()
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts = Counts()
        self._saved: dict[str, Callable] = {}

    def __enter__(self) -> OpCounter:
        for name in PATCHED:
            original = self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._reading(name, original))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved = {}

    def _reading(self, name: str, original: Callable) -> Callable:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._sync(f"Tensor.{name}")
            return original(tensor, *args, **kwargs)
        return read

    def _sync(self, op: str) -> None:
        self.counts.syncs += 1
        self.counts.sites[f"{op} @ {_project_line()}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in VALUE_READS or (func in INDEXING and _bool_index(args)) or (
            func in REPEATS and kwargs.get("output_size") is None
        ):
            self._sync(str(func.overloadpacket.__name__))
        if func not in ALLOCATIONS and not func.is_view and func not in (aten._local_scalar_dense.default, aten.item.default):
            self.counts.kernels += 1
            self.counts.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **kwargs)


def count_steps(step: Callable[[], Any], steps: int) -> Counts:
    """Run ``step`` ``steps`` times under an `OpCounter`; the counts, per step through `Counts`."""
    with OpCounter() as counter:
        for _ in range(steps):
            step()
    counter.counts.steps = steps
    return counter.counts


def count_decoding(generator: Any, prompts: Sequence[list[int]], max_new_tokens: int) -> Counts:
    """Kernels and host syncs a decoding step of ``generator`` (a `SpeculativeGenerator`) over ``prompts`` decoded
    together, greedy: every step after the first (which admits the prompts and prefills them) to the end.

    The scheduler's rows hold what these prompts need, no more: at the target's default length its KV pool took
    7.5 GB for SmolLM2 at batch 32, beside the bench's own pools."""
    longest = max(len(ids) for ids in prompts) + max_new_tokens
    scheduler = generator.scheduler(max_batch_size=len(prompts), max_len=min(longest, generator.target.max_context))
    scheduler.closed = True
    for ids in prompts:
        scheduler.submit(ids, max_new_tokens, eos_token_id=())
    scheduler.step()
    steps = 0
    with OpCounter() as counter:
        while not scheduler.idle:
            scheduler.step()
            steps += 1
    counter.counts.steps = steps
    return counter.counts


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return isinstance(indices, (list, tuple)) and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices
    )


def _project_line() -> str:
    """``file:line`` of the innermost caller in the project's code (outside this file), else of the innermost
    caller outside torch."""
    frame = sys._getframe(2)
    fallback = None
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.is_absolute() and path.resolve() != HERE:
            try:
                relative = path.resolve().relative_to(ROOT)
            except ValueError:
                relative = None
            if relative is not None and relative.parts[0] in PROJECT:
                return f"{relative}:{frame.f_lineno}"
            if fallback is None and "torch" not in path.parts:
                fallback = f"{path.name}:{frame.f_lineno}"
        frame = frame.f_back
    return fallback or "?"
