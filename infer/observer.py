"""The scheduler's step-observer hook: what each step did, told at four fixed points of `Scheduler.step`.

    class Tally(StepObserver):
        def committed(self, step: Committed) -> None:
            print(step.step, sum(row.accepted for row in step.rows), "draft tokens accepted")

    sched.add_observer(Tally())

A step is one advance of the running rows (what `EngineCounters.steps` counts). In it, in this order:
`drafted` once every row has its tree, `verified` after the target's forward (once the rows' acceptance is read
back, so a GPU's forward is timed), `committed` after every row's
commit, and `stepped` last, once per step whatever happened (its rows 0 where no row had a tree to verify: the
three before are then not told). Admitting a row (its prefill) and finished rows leaving are no step's work.

Observers read; they never change the rows or trees they are shown, which the step goes on with. An observer that
raises stops the step, as a bug in the step would. The records are built only while an observer is attached: a
scheduler nobody observes pays for none of this.

An observer that names target ``layers`` (a traffic recorder) is also told, outside the steps, of each row that
is `admitted` (its prompt's states) and that `left`; every forward then computes those layers, and each row's
`RowCommit` carries the states at the tokens it kept. Rows submitted with ``record=False`` carry none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    import torch

    from specgraft.infer.request import Request
    from specgraft.tree import Tree


@dataclass(frozen=True, slots=True)
class Drafted:
    """Every row's tree, before verification: drafted, and cut by the goodput controller for `Adaptive` rows."""

    step: int  # the step's number (`EngineCounters.steps`, from 1)
    rows: tuple[Request, ...]  # the rows that verify in this step, in order, their state as drafting left it
    trees: Mapping[int, Tree]  # handle -> the tree the row verifies (its root alone where it did not draft)
    selected: int | None  # draft nodes the goodput controller kept over the adaptive rows (None: no adaptive row)
    seconds: float  # drafting (the controller's plan included; its selection after drafting is not)


@dataclass(frozen=True, slots=True)
class Verified:
    """The target's verification forward(s) over every row's tree."""

    step: int
    forwards: int  # target forwards that verified: one packed for every row, or one a row on Hugging Face's forward
    tokens: int  # tree nodes they ran, every row's root included
    seconds: float  # building the forward's inputs (segments, masks, positions) and running it
    forward_seconds: float  # the target's forward(s) alone: the device's seconds (`DeviceClock`; a GPU's kernels)


@dataclass(frozen=True, slots=True)
class RowCommit:
    """One row's outcome in a step."""

    handle: int
    draft_tokens: int  # draft nodes it verified (its tree less the root)
    accepted: int  # of them, those accepted: the tokens it committed less the target's own
    kept: int  # tokens it emitted, after its stop rule's cut (what its `Tokens` event carries)
    # Where observers name layers and the row records: the tokens the forward ran that it kept (its root, then the
    # accepted drafts: its cache's new positions), and their states, layer -> (n, H); else None
    tokens: torch.Tensor | None = None
    states: Mapping[int, torch.Tensor] | None = None


@dataclass(frozen=True, slots=True)
class Committed:
    """Every row's commit: its accepted path kept (target cache and draft state), its tokens cut and emitted."""

    step: int
    rows: tuple[RowCommit, ...]  # the rows whose commit succeeded, in order (a row that failed left instead)
    seconds: float  # the rows' commits (the acceptance read together for the batch before them is not)


@dataclass(frozen=True, slots=True)
class Stepped:
    """The step is done."""

    step: int
    rows: int  # rows that verified a tree (0: every row's drafting failed, and they left)
    seconds: float  # the whole advance, from the step's bookkeeping before drafting to after the last commit


@dataclass(frozen=True, slots=True)
class Admitted:
    """A row joined the batch: its prompt ran (told only where observers name layers)."""

    request: Request
    states: Mapping[int, torch.Tensor] | None  # layer -> (S, H) at the prompt's tokens; None: the row does not record


@dataclass(frozen=True, slots=True)
class Left:
    """A row left the batch (told only where observers name layers)."""

    handle: int
    finished: bool  # its stop rule ended it (False: cancelled, or its own work failed)


class StepObserver:
    """What a `Scheduler` tells about each step (see the module's docstring); every method is a no-op here, so an
    observer overrides only what it reads. Attach one with `Scheduler.add_observer`.

    ``layers``: HF hidden-state indices whose states the observer reads at every token a row keeps (empty: none, and
    it is told neither `admitted` nor `left`)."""

    layers: tuple[int, ...] = ()

    def admitted(self, row: Admitted) -> None: ...

    def left(self, row: Left) -> None: ...

    def drafted(self, step: Drafted) -> None: ...

    def verified(self, step: Verified) -> None: ...

    def committed(self, step: Committed) -> None: ...

    def stepped(self, step: Stepped) -> None: ...


class StepObservers(StepObserver):
    """A scheduler's observers as one: each call is passed to every observer, in the order they were added.
    False while empty, so the scheduler builds a record only ``if self.observers``."""

    def __init__(self) -> None:
        self._all: list[StepObserver] = []
        self.layers: tuple[int, ...] = ()  # every observer's layers, ascending (empty: none reads states)

    def add(self, observer: StepObserver) -> None:
        if not isinstance(observer, StepObserver):
            raise TypeError(f"a step observer subclasses StepObserver, got {type(observer).__name__}")
        self._all.append(observer)
        self._gather_layers()

    def remove(self, observer: StepObserver) -> None:
        self._all.remove(observer)
        self._gather_layers()

    def _gather_layers(self) -> None:
        self.layers = tuple(sorted({i for observer in self._all for i in observer.layers}))

    def __bool__(self) -> bool:
        return bool(self._all)

    def __iter__(self):
        return iter(self._all)

    def __len__(self) -> int:
        return len(self._all)

    def admitted(self, row: Admitted) -> None:
        for observer in self._all:
            if observer.layers:
                observer.admitted(row)

    def left(self, row: Left) -> None:
        for observer in self._all:
            if observer.layers:
                observer.left(row)

    def drafted(self, step: Drafted) -> None:
        for observer in self._all:
            observer.drafted(step)

    def verified(self, step: Verified) -> None:
        for observer in self._all:
            observer.verified(step)

    def committed(self, step: Committed) -> None:
        for observer in self._all:
            observer.committed(step)

    def stepped(self, step: Stepped) -> None:
        for observer in self._all:
            observer.stepped(step)
