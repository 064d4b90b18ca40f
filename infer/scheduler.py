"""The one batch engine: every running generation advanced by one step, in one target forward.

A generation joins between steps: its prompt is prefilled (its first
token) in one packed forward with the others joining at that step (a few
thousand tokens at most; Hugging Face's forward: one prompt a forward),
then it takes part in that same step's verification. One that finishes,
fails or is cancelled leaves at once and frees its rows. Each generation carries its own drafter (by name, from the
scheduler's pool of loaded drafters), tree, sampling, acceptance rule, stop
rule and stats (`Request`), so generations with different `speculative`
settings share every step.

One step:

1. Draft, grouped by drafter: a `BatchDrafter` (Medusa, EAGLE, EAGLE-3)
   grows all its rows' trees at once, its neural work run once per tree level
   for every row, in the rows of its own draft pool; other drafters (prompt
   lookup, a draft model, layer skip, a composite) draft row by row. A row
   with speculation off, or no room left to draft, is its root alone.
2. Verify: one target forward over every row's nodes, packed (`Segment`s: a
   plain row costs one token, not the widest tree's width), each row
   attending over its own slots of the KV pool with its own tree mask.
3. Accept and commit, row by row: the row's acceptance rule picks a path, its
   cache row and its drafter keep only that path, its stop rule cuts the
   tokens, and a `Tokens` event reports them.

Observers (`add_observer`, `specgraft.infer.observer`) are told what each of
the three did and, last, that the step is done: measurements and /metrics read
the step there. `step` itself is admit, advance, leave: queued generations
take free rows (`_admit`), the running ones take one step (`_advance`), and
those that finished leave (`_leave_finished`).

Memory is allocated once, at construction: the KV pool (rows x kv heads x
slots x head_dim per layer, a length per row) and one draft pool per loaded
`BatchDrafter`, whatever the number of drafter or tree settings requests use.
A row of each holds ``max_len`` tokens and a headroom for the step's tree (the
KV pool's ``tree_slots``, the draft pools' ``draft_slots``); `submit` refuses
a tree that would not fit either, so none overflows mid-generation.

Targets without the fast path (Hugging Face's forward) verify row by row,
each generation with a cache of its own: transformers' caches hold one
length for the whole batch.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Hashable, Mapping, TypeVar

import torch

from specgraft.heads.base import BatchDrafter, Drafter, DraftRequest
from specgraft.heads.composite import Composite
from specgraft.heads.prompt_lookup import PromptLookup
from specgraft.infer.adaptive import Candidate, GoodputController
from specgraft.infer.adaptive.clock import DeviceClock, Mark
from specgraft.infer.detokenize import continuation_text
from specgraft.infer.events import Event, Failed, Finished, GenerationOutput, Tokens
from specgraft.infer.held import HeldStates
from specgraft.infer.observer import (
    Admitted, Committed, Drafted, Left, RowCommit, StepObserver, StepObservers, Stepped, Verified,
)
from specgraft.infer.request import Prompt, Request, new_request
from specgraft.infer.verify import (
    Acceptance, AcceptRule, accept, accept_chains, greedy_accept_chains, greedy_accept_packed, greedy_accept_tree,
    root_path, sample_accept, stacked,
)
from specgraft.model import TREE_SLOTS, BatchedKVCache, Segment, Target
from specgraft.tree import (
    Adaptive, Chain, DynamicTree, Sampling, StaticTree, Tree, TreePolicy, read_lists, tree_attention_mask,
    tree_position_ids,
)

T = TypeVar("T")
# Default cap on a row's tokens: rows x slots are allocated up front (16 rows of a 30-layer model's
# 8K context would take gigabytes); pass max_len to go further.
DEFAULT_MAX_LEN = 4096
# Prompts joining together run in one packed forward of at most this many tokens (vLLM batches up to 2048-8192
# tokens a step by default) ...
PREFILL_TOKENS = 2048
# ... and at most this many mask cells (rows x the longest prompt, squared: 16 MiB of float32 mask), so a long
# prompt beside short ones does not pad them all to its length; a prompt beyond either runs alone.
PREFILL_CELLS = 1 << 22
NO_DRAFTER = "none"  # the pool's name for speculation off: every scheduler has it
# Bytes of forwards' states held for rows' draft states (their commits of the root alone) before every row gives what
# it kept and the forwards are let go (see `specgraft.infer.held`): about 4,800 rows of SmolLM2's three EAGLE-3 taps
# in float32, 64,000 of stories260K's one. Counted in rows (1,024), every row gave every 64 steps at batch 16: on
# stories260K, where an EAGLE row never drafts there, 9 us a step of the 40 its rows cost beyond plain decoding.
HELD_BYTES = 32 * 2**20
# ... or rows, whichever comes first: a drafter that reads no states (prompt lookup) holds no bytes, yet its rows' kept
# roots and the list of held forwards grow a step at a time (a server's rows that never all leave at once).
HELD_ROWS = 65536
# A step's work beyond its forward and drafting counts at most this many times them in the controller's fit: one
# pause (a garbage collection, a server thread holding the interpreter) must not price a memory of steps.
OVERHEAD_CLIP = 2.0
# Steps timed before the controller is told, in one loop: told one by one, each step paid its calls in place, where the
# forward leaves Python's caches cold (EAGLE adaptive on stories260K at batch 1, never drafting: 3 us of a 690 us step).
TIMINGS_TOLD_EVERY = 16
# Of the steps where no row verified a tree, one in this many is timed for the controller: under load most steps are
# such and alike, and the fits each timed step feeds (T's scale, the work beyond the forward) cost 2.5 us a step there.
UNDRAFTED_TIMED_EVERY = 4


@dataclass
class EngineCounters:
    """What the scheduler did, summed over its life (the server's /metrics reads them).

    ``verify_forwards`` counts target forwards that verified (one per step on
    the fast path; one per row on Hugging Face's forward), ``prefill_forwards``
    those that ran prompts (one for the prompts that join together). The spec-decode
    counters follow vLLM's: a draft is one row's step that verified at least
    one draft token; ``accepted_per_position[i]`` counts drafts whose accepted
    path reached depth i + 1.
    """

    steps: int = 0
    verify_forwards: int = 0
    prefill_forwards: int = 0
    adaptive_selected: int | None = None  # draft nodes the goodput controller kept in the last step (None: no adaptive row)
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, draft_tokens: int, accepted: int) -> None:
        if not draft_tokens:
            return
        self.drafts += 1
        self.draft_tokens += draft_tokens
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < accepted:
            self.accepted_per_position += [0] * (accepted - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1


@dataclass
class Chosen:
    """A row's acceptance decided with the others' (see `Scheduler._choose_together`): the path (a device view),
    as host ints too, the tokens it commits (the path's drafts, then the next token) and that token as a (1,)
    device view."""

    accepted: Acceptance
    path: list[int]
    committed: list[int]
    next_tensor: torch.Tensor


@dataclass(slots=True)
class RowForward:
    """A row's part of its step's verification forward (see `Scheduler._verify`)."""

    logits: torch.Tensor  # (N_r, V) at the row's tree nodes
    hidden: dict[int, torch.Tensor]  # layer -> its forward's states: every packed row's (N, H), or one row's (1, N, H)
    start: int  # the row's first node there (see `_row_states`)


@dataclass(frozen=True)
class PackedForward:
    """The step's packed forward, which greedy rows accept from together (see `Scheduler._choose_together`)."""

    logits: torch.Tensor  # (N, V)
    tokens: torch.Tensor  # (N,) every row's tree tokens, one row after another
    handles: list[int]  # its rows, in order


@dataclass(frozen=True)
class Part:
    """Rows accepted together in one result of `Scheduler._choose_together`'s one read: ``width`` 0, each row's next
    token alone (roots alone); else `greedy_accept_packed`'s rows of ``2 + 2 * width`` values."""

    result: torch.Tensor
    handles: list[int]
    width: int


@dataclass(frozen=True)
class StepTiming:
    """A timed step as the goodput controller learns from it, told at a later step's start (see
    `Scheduler._tell_timings`), once its work beyond its forward and drafting is done."""

    begun: float  # its start (perf_counter)
    rows: int  # rows it advanced
    drafted: int  # of them, rows that verified a tree
    busy: float  # seconds of its forward and drafting
    changes: int  # rows joined and left before it (`Scheduler._changes` then)
    forward_tokens: int  # its forward's tokens (0: Hugging Face's forward, row by row, not timed as one)
    forward_seconds: float
    masked: bool  # its forward paid for trees (a mask; packed, rows leaving the one-token call)
    ended: float = 0.0  # the next step's start
    changes_after: int = -1  # rows joined and left before the next step began

    def overhead(self) -> float | None:
        """Its work beyond its forward and drafting (at most `OVERHEAD_CLIP` times them); None if a row joined or
        left before the next step (a prefill is no step's work)."""
        if self.changes_after != self.changes:
            return None
        return min(self.ended - self.begun - self.busy, OVERHEAD_CLIP * self.busy)


class Scheduler:
    """Runs many generations step by step, each with its own drafter, tree and options.

    Args:
        target: the frozen target.
        drafters: name -> loaded drafter, the pool requests pick from by name (``"none"`` is
            always there: speculation off). More can join with `add_drafter`.
        max_batch_size: most generations running at once (rows of the KV pool); more wait in a
            queue, first come first served.
        max_len: most tokens (prompt + new) of one generation: the slots each row holds beside one
            tree. Default: the target's context, at most `DEFAULT_MAX_LEN`.
        tree_slots: the slots each row of the KV pool holds beyond ``max_len`` for the tree it verifies: the most
            nodes, root included, of any tree it admits (`most_tree_nodes`; a larger one is refused at `submit`).
            A server passes its largest admitted tree's; the default, `TREE_SLOTS`, suits any tree of a few
            hundred nodes.
        draft_slots: the slots each row of a batch drafter's draft pool holds beyond ``max_len`` for drafting
            a tree: the most any tree it admits takes there (`most_draft_slots`: EAGLE's root and every level's
            frontier, (depth - 1) x top_k + 1 for a dynamic tree; a larger one is refused at `submit`). A row's
            catch-up takes none of them: a round that would pad rows past their slots catches the rows furthest
            behind up alone first (`FeatureDrafter.rounds`). Default: ``tree_slots``.
        default_drafter, default_tree, default_acceptance: what `submit` uses when a request names none.
        closed: no request will be submitted once those queued are admitted (`generate_batch`'s batch): the
            batch then ends with its longest row, so while none waits, an `Adaptive` row that is ahead of the
            longest does not draft (see `_critical`).

    Usage::

        sched = Scheduler(target, {"eagle": sg.load_drafter("runs/eagle/head", target)}, max_batch_size=16)
        a = sched.submit("Once upon a time", max_new_tokens=64, drafter="eagle", tree=sg.Chain(4))
        b = sched.submit("One day", max_new_tokens=64, temperature=0.7, seed=1)   # speculation off
        while not sched.idle:
            for event in sched.step():          # Tokens, then Finished (or Failed), per generation
                ...

    Measurements and metrics watch the steps through `add_observer`, never by wrapping the methods below.
    """

    def __init__(
        self,
        target: Target,
        drafters: Mapping[str, Drafter | None] | None = None,
        *,
        max_batch_size: int = 16,
        max_len: int | None = None,
        tree_slots: int = TREE_SLOTS,
        draft_slots: int | None = None,
        default_drafter: str = NO_DRAFTER,
        default_tree: TreePolicy | None = None,
        default_acceptance: AcceptRule = sample_accept,
        closed: bool = False,
    ) -> None:
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
        self.max_len = max_len or min(target.max_context, DEFAULT_MAX_LEN)
        if not 1 <= self.max_len <= target.max_context:
            raise ValueError(f"max_len={max_len} must lie in [1, {target.max_context}] (the target's context)")
        if isinstance(tree_slots, bool) or not isinstance(tree_slots, int) or tree_slots < 1:
            raise ValueError(f"tree_slots must be a positive integer (a tree's root takes one), got {tree_slots!r}")
        draft_slots = tree_slots if draft_slots is None else draft_slots
        if isinstance(draft_slots, bool) or not isinstance(draft_slots, int) or draft_slots < 1:
            raise ValueError(f"draft_slots must be a positive integer (a tree's root takes one), got {draft_slots!r}")
        self.target = target
        self.max_batch_size = max_batch_size
        self.tree_slots = tree_slots
        self.draft_slots = draft_slots
        self.pool = target.new_batched_cache(max_batch_size, self.max_len + tree_slots)  # None: row by row
        self.drafters: dict[str, Drafter | None] = {NO_DRAFTER: None}
        self.draft_pools: dict[str, BatchedKVCache | None] = {}  # batch drafters' rows (None: one keeps no cache)
        for name, drafter in (drafters or {}).items():
            self.add_drafter(name, drafter)
        if default_drafter not in self.drafters:
            raise ValueError(f"default_drafter {default_drafter!r} is not loaded: loaded are {', '.join(self.drafters)}")
        self.default_drafter = default_drafter
        self.default_tree = default_tree if default_tree is not None else Chain(depth=5)
        self.default_acceptance = default_acceptance
        self.queued: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.counters = EngineCounters()
        self.controller: GoodputController | None = None  # made when a request first asks for an Adaptive tree
        self.closed = closed
        self.observers = StepObservers()  # told what each step did (see `add_observer`)
        self._forward_seconds = 0.0  # the last step's target forward(s), which the controller times apart
        self._forward_spans: list[tuple[Mark, Mark]] = []  # their marks (`DeviceClock`), read after the readback
        self._clock = DeviceClock(target.device)
        self._forward_tokens = 0  # the tokens of that forward, where it was one (0: Hugging Face's, row by row)
        self._forward_masked = False  # that forward paid for trees (a mask; packed, rows leaving the one-token call)
        self._adaptive_rows = False  # the step has rows whose trees the controller sizes
        self._draft_seconds = 0.0  # the last step's drafting on this thread's CPU clock, which the controller prices apart
        # The last step, timed, until the next step's start: its work beyond the forward and drafting is timed then
        self._last_step: StepTiming | None = None
        self._timings: list[StepTiming] = []  # steps timed since the controller was last told (`_tell_timings`)
        self._changes = 0  # rows joined and left so far
        self._held = HeldStates()  # the forwards whose roots rows keep for their draft states (`specgraft.infer.held`)
        self._next_handle = 0
        self._packed: PackedForward | None = None  # the last step's packed forward (None: row by row)

    # ------------------------------------------------------------------ the pool

    def add_drafter(self, name: str, drafter: Drafter | None) -> None:
        """Load ``drafter`` into the pool as ``name`` (a batch drafter's draft pool is allocated now, once).

        Raises:
            ValueError: ``name`` already names another drafter.
            TypeError: an object that is not a `Drafter`.
        """
        if name in self.drafters:
            if self.drafters[name] is not drafter:
                raise ValueError(f"drafter name {name!r} is taken by another drafter")
            return
        if drafter is not None and not isinstance(drafter, Drafter):
            raise TypeError(f"drafter {type(drafter).__name__} does not implement the Drafter protocol")
        self.drafters[name] = drafter
        if self.pool is not None and isinstance(drafter, BatchDrafter):
            self.draft_pools[name] = drafter.new_rows(self.max_batch_size, self.max_len + self.draft_slots)

    def adopt(self, name: str, drafter: Drafter) -> None:
        """Drafter ``name`` drafts with ``drafter``'s weights from the next step on (a new version of its head, loaded
        beforehand: its `adopt`). Call between steps: a step drafts with one version throughout. Exactness does not
        depend on it: verification decides every token, whatever the draft.

        Raises:
            KeyError: ``name`` is not loaded.
            TypeError: a drafter that cannot take new weights (only heads do).
            ValueError: weights of another shape (the drafter's `adopt` names the fields).
        """
        if name not in self.drafters or self.drafters[name] is None:
            raise KeyError(f"no drafter {name!r} to give new weights: loaded are {', '.join(self.drafters)}")
        take = getattr(self.drafters[name], "adopt", None)
        if take is None:
            raise TypeError(f"drafter {name!r} ({type(self.drafters[name]).__name__}) cannot take new weights")
        take(drafter)

    @property
    def pool_bytes(self) -> int:
        """Bytes of the target's KV pool (0 on Hugging Face's forward, whose caches grow per generation)."""
        return 0 if self.pool is None else self.pool.nbytes

    @property
    def draft_pool_bytes(self) -> int:
        """Bytes of the loaded batch drafters' draft pools."""
        return sum(p.nbytes for p in self.draft_pools.values() if p is not None)

    # ------------------------------------------------------------------ observers

    def add_observer(self, observer: StepObserver) -> None:
        """Tell ``observer`` what each step does from the next step on: its `drafted`, `verified`, `committed` and
        `stepped` (see `specgraft.infer.observer`).

        An observer naming ``layers`` is also told of every row admitted and leaving from then on, with the states
        of those layers at each token a row keeps.

        Raises:
            TypeError: an object that does not subclass `StepObserver`.
            ValueError: a layer outside the target's hidden states (0 the embeddings .. num_layers the final norm's).
        """
        bad = [i for i in getattr(observer, "layers", ()) if not 0 <= i <= self.target.num_layers]
        if bad:
            raise ValueError(f"observer layers {bad}: {self.target.name!r} has hidden states 0..{self.target.num_layers}")
        self.observers.add(observer)

    def remove_observer(self, observer: StepObserver) -> None:
        """Stop telling ``observer`` (ValueError if it was never added)."""
        self.observers.remove(observer)

    # ------------------------------------------------------------------ requests

    def submit(
        self,
        prompt: Prompt,
        max_new_tokens: int = 128,
        *,
        drafter: str | None = None,
        tree: TreePolicy | None = None,
        acceptance: AcceptRule | None = None,
        text: bool = False,
        **options: Any,
    ) -> int:
        """Queue a generation; returns its handle. Bad options raise here, before anything runs.

        Args:
            drafter: the name of a loaded drafter (see `add_drafter`); ``"none"`` decodes plainly.
            tree: how its drafter grows trees.
            acceptance: the stochastic acceptance rule (`sample_accept`, exact; or `lossy_typical_accept`).
            (None: the scheduler's defaults for each of the three.)
            text: report the text each step released in its `Tokens` event.
            options: as `new_request` takes them (temperature, top_k, top_p, min_p, banned_token_ids,
                seed, eos_token_id, stop, ...).

        Raises:
            KeyError: an unknown drafter name (the message lists the loaded ones).
            ValueError: a bad option, or a tree larger than a row of the KV pool or of the drafter's draft pool holds.
        """
        drafter = self.default_drafter if drafter is None else drafter
        if drafter not in self.drafters:
            raise KeyError(f"unknown drafter {drafter!r}: loaded are {', '.join(self.drafters)}")
        tree = self.default_tree if tree is None else tree
        nodes = most_tree_nodes(self.drafters[drafter], tree)
        if self.pool is not None and nodes is not None and nodes > self.tree_slots:
            raise ValueError(f"drafter {drafter!r} with tree {tree!r} verifies up to {nodes} nodes, more than the "
                             f"{self.tree_slots} slots each row of this scheduler's KV pool holds for a tree")
        slots = most_draft_slots(self.drafters[drafter], tree)
        room = self.draft_slots if self.draft_pools.get(drafter) is not None else TREE_SLOTS  # (a state's own cache)
        if slots is not None and slots > room:
            raise ValueError(f"drafter {drafter!r} with tree {tree!r} drafts into up to {slots} slots of its draft "
                             f"cache, more than the {room} each row holds for drafting a tree (a tree drafted a level "
                             f"at a time takes its root and every level's frontier: 1 + (depth - 1) x top_k for a "
                             f"dynamic tree)")
        request = new_request(
            self.target, self._next_handle, prompt, max_new_tokens, max_len=self.max_len, drafter_name=drafter,
            drafter=self.drafters[drafter], tree=tree,
            acceptance=self.default_acceptance if acceptance is None else acceptance, text=text, **options,
        )
        self._next_handle += 1
        if isinstance(request.tree, Adaptive) and self.controller is None:
            self.controller = GoodputController(self.target, row_by_row=self.pool is None)
        self.queued.append(request)
        return request.handle

    def prepare_adaptive(self) -> GoodputController:
        """The goodput controller, made now and its T(N) timed: a server whose default tree is `Adaptive` pays the
        few timed forwards at start-up, not in its first request."""
        if self.controller is None:
            self.controller = GoodputController(self.target, row_by_row=self.pool is None)
        self.controller.step_cost()
        return self.controller

    def cancel(self, handle: int) -> None:
        """Stop a queued or running generation now and free its rows; it emits no more events.

        Raises:
            KeyError: a handle that is neither queued nor running (never submitted, or already ended).
        """
        if handle in self.running:
            self._leave(self.running[handle])
            return
        for request in self.queued:
            if request.handle == handle:
                self.queued.remove(request)
                return
        raise KeyError(f"generation {handle!r} is neither queued nor running (never submitted, or already ended)")

    @property
    def idle(self) -> bool:
        """Nothing queued or running."""
        return not self.queued and not self.running

    # ------------------------------------------------------------------ the step

    def step(self) -> list[Event]:
        """Admit queued generations into free rows, then advance every running one by one step.

        Returns what happened, in order: a newly admitted generation's first
        token (its prefill) and then its first step's tokens, as two `Tokens`
        events; every other running generation's step tokens; a `Finished`
        for each that ended; a `Failed` for each whose own work raised (a
        drafter failing on its input, say): it leaves, the others go on.
        """
        events: list[Event] = []
        self._admit(events)
        live = [r for r in self.running.values() if not r.rule.done]
        if live:
            begun = time.perf_counter()
            rows = self._advance(live, events, begun)
            if self.observers:
                self.observers.stepped(Stepped(self.counters.steps, rows, time.perf_counter() - begun))
        self._leave_finished(events)
        if not self.running:  # idle: the controller has heard of every step it timed, and no state is held
            if self._timings:
                self._tell_timings()
            self._held.let_go()
        return events

    # ------------------------------------------------------------------ admit

    def _admit(self, events: list[Event]) -> None:
        """Queued generations take the free rows, first come first served; their prompts run in few forwards."""
        joining = []
        while self.queued and len(self.running) < self.max_batch_size:
            request = self.queued.popleft()
            self.running[request.handle] = request
            self._changes += 1
            joining.append(request)
        for group in self._prefill_groups(joining):
            if len(group) == 1:
                self._isolated(group[0], events, lambda request=group[0]: self._prefill(request, events))
            else:
                self._prefill_together(group, events)

    def _prefill_groups(self, joining: list[Request]) -> list[list[Request]]:
        """Joining generations cut, in order, into groups whose prompts share one packed forward: at most
        `PREFILL_TOKENS` tokens and `PREFILL_CELLS` mask cells a group (rows x the longest prompt, squared). Without
        a batched cache (Hugging Face's forward) each is its own."""
        groups: list[list[Request]] = []
        tokens = longest = 0
        for request in joining:
            n = len(request.prompt_ids)
            if (self.pool is not None and groups and tokens + n <= PREFILL_TOKENS
                    and (len(groups[-1]) + 1) * max(longest, n) ** 2 <= PREFILL_CELLS):
                groups[-1].append(request)
                tokens, longest = tokens + n, max(longest, n)
            else:
                groups.append([request])
                tokens, longest = n, n
        return groups

    def _layers(self, request: Request) -> tuple[int, ...]:
        """The hidden layers a generation's prefill returns: its drafter's, and the observers' where it is recorded."""
        recorded = self.observers.layers if request.record else ()
        return tuple(sorted({*request.hidden_layers, *recorded}))

    def _prefill(self, request: Request, events: list[Event]) -> None:
        """Take rows and run the prompt alone; the target's choice after it is the root (the first token)."""
        if self.pool is not None:
            if request.row is None:
                request.row, request.cache = self.pool.acquire()
        else:
            request.cache = self.target.new_cache()
        ids = request.prompt_ids[None]  # (1, S)
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        self.counters.prefill_forwards += 1
        out = self.target.forward(ids, request.cache, positions, hidden_layers=self._layers(request), last_only=True)
        self._started(request, out.logits[0, -1], {i: h[0] for i, h in out.hidden.items()}, events)

    def _prefill_together(self, group: list[Request], events: list[Event]) -> None:
        """Run several prompts in one packed forward (each causal over its own row), then start each generation.

        A forward that raises is undone (the rows emptied) and each prompt runs alone, so a failure is its own
        generation's."""
        for request in group:
            request.row, request.cache = self.pool.acquire()
        sizes = [len(r.prompt_ids) for r in group]
        device = group[0].prompt_ids.device
        layers = tuple(sorted({i for r in group for i in self._layers(r)}))
        self.counters.prefill_forwards += 1
        try:
            out = self.target.forward_packed(
                torch.cat([r.prompt_ids for r in group]), self.pool, [Segment(r.row, n) for r, n in zip(group, sizes)],
                layers,
                logits_at=torch.tensor(list(itertools.accumulate(sizes)), device=device) - 1,
            )
        except Exception:
            for request in group:
                request.cache.crop(0)
                self._isolated(request, events, lambda request=request: self._prefill(request, events))
            return
        for k, (request, start) in enumerate(zip(group, itertools.accumulate(sizes, initial=0))):
            hidden = {i: out.hidden[i][start : start + sizes[k]] for i in self._layers(request)}  # (S, H) each
            self._isolated(request, events, lambda request=request, hidden=hidden, k=k: self._started(
                request, out.logits[k], hidden, events))

    def _started(self, request: Request, last: torch.Tensor, hidden: dict[int, torch.Tensor], events: list[Event]) -> None:
        """A generation whose prompt ran: observers see it, its drafter starts on the prompt's states (S, H), and the
        target's choice after the prompt, from its logits ``last`` (V,), is the root (the first token)."""
        if self.observers.layers:
            recorded = self.observers.layers if request.record else ()
            states = _copied({i: hidden[i] for i in recorded}) if recorded else None
            self.observers.admitted(Admitted(request, states))
        if request.drafter is not None:
            own = {i: hidden[i] for i in request.hidden_layers}  # (not the states only observers read)
            draft_pool = self.draft_pools.get(request.drafter_name)
            if draft_pool is not None:
                request.draft_row, draft_cache = draft_pool.acquire()
                request.draft = request.drafter.start(request.prompt_ids, own, cache=draft_cache)
            else:
                request.draft = request.drafter.start(request.prompt_ids, own)
            request.behind = len(request.prompt_ids)
            request.draft_kv = request.draft.cache_tokens()
        sampling = request.sampling
        request.root = int(sampling.ban(last).argmax()) if sampling.greedy else sampling.draw_one(sampling.probs(last))
        request.recorder.first_token()
        request.recorder.observe_kv(len(request.cache))
        self._emit(request, request.rule.accept([request.root]), events)

    # ------------------------------------------------------------------ advance

    def _advance(self, live: list[Request], events: list[Event], begun: float) -> int:
        """One speculative step for every live row, begun at ``begun``: draft, one verification forward, per-row
        commits; the observers are told at each. Returns the rows that reached verification."""
        last, self._last_step = self._last_step, None
        if last is not None:  # the last step, timed now that its work beyond the forward and drafting is done
            self._timings.append(replace(last, ended=begun, changes_after=self._changes))
            if len(self._timings) >= TIMINGS_TOLD_EVERY:
                self._tell_timings()
        self.counters.steps += 1
        step, observers = self.counters.steps, self.observers
        for request in live:
            request.recorder.begin_step()
        self._draft_seconds = 0.0
        timed = self.controller is not None and self.controller.cost is not None
        draft_from = time.perf_counter()
        trees = self._draft(live, events)
        drafting = time.perf_counter() - draft_from
        live = [r for r in live if r.handle in trees]
        if not live:
            return 0
        self._forward_spans, self._forward_tokens, self._forward_masked = [], 0, False
        drafted = [r for r in live if r.drafted and trees[r.handle].num_nodes > 1]  # rows verifying a tree
        if self.controller is not None:
            self.counters.adaptive_selected = None if not self._adaptive_rows else 0
            if any(r.adaptive for r in drafted):  # else nothing to cut
                trees = self.controller.select([Candidate(r.handle, r.drafter, trees[r.handle], r.adaptive) for r in live])
                self.counters.adaptive_selected = self.controller.selected_last
                drafted = [r for r in drafted if trees[r.handle].num_nodes > 1]
        if observers:
            observers.drafted(Drafted(step, tuple(live), trees, self.counters.adaptive_selected, drafting))
        prefixes = {r.handle: len(r.cache) for r in live}
        forwards, verify_from = self.counters.verify_forwards, time.perf_counter()
        verified = self._verify(live, trees, prefixes, events)
        verifying = time.perf_counter() - verify_from
        chosen = self._choose_together([r for r in live if r.handle in verified], trees, verified)
        # The forward's device seconds, read now that the choice's readback waited for it (see `DeviceClock`)
        self._forward_seconds = sum(self._clock.seconds(start, end) for start, end in self._forward_spans)
        if observers:
            tokens = sum(trees[h].num_nodes for h in verified)
            observers.verified(Verified(step, self.counters.verify_forwards - forwards, tokens, verifying,
                                        self._forward_seconds))
        commit_from, commits = time.perf_counter(), []
        for request in live:
            if request.handle in verified:
                forward, tree, prefix = verified[request.handle], trees[request.handle], prefixes[request.handle]
                commit = self._isolated(request, events, lambda: self._commit(
                    request, tree, prefix, forward, events, chosen.get(request.handle)))
                if commit is not None:  # (None too where no one observes)
                    commits.append(commit)
        if observers:
            observers.committed(Committed(step, tuple(commits), time.perf_counter() - commit_from))
        if self._held.bytes >= HELD_BYTES or self._held.rows >= HELD_ROWS:  # every row gives what it kept: let go
            self._give_held(events)
        if timed and (drafted or step % UNDRAFTED_TIMED_EVERY == 0):
            # (a step that timed the target's cost curve, seconds once per target, is no step's work) observed from
            # the next step's start (see `_tell_timings`): its forward (where it was one: Hugging Face's, row by
            # row, is not timed as one) and, if no row joined or left between, its work beyond
            busy = self._forward_seconds + self._draft_seconds
            self._last_step = StepTiming(begun, len(live), len(drafted), busy, self._changes, self._forward_tokens,
                                         self._forward_seconds, self._forward_masked)
        return len(live)

    def _tell_timings(self) -> None:
        """Tell the controller the steps timed so far (see `TIMINGS_TOLD_EVERY`), in order: each one's forward and, if
        no row joined or left before the next step began, its work beyond its forward and drafting."""
        timings, self._timings = self._timings, []
        for step in timings:
            self.controller.observe_times(step.forward_tokens, step.forward_seconds, step.masked, step.rows,
                                          step.drafted, step.overhead())

    def _draft(self, live: list[Request], events: list[Event]) -> dict[int, Tree]:
        """Each row's tree: batch drafters once per drafter for all their rows, other drafters row by row."""
        trees: dict[int, Tree] = {}
        together: dict[str, list[tuple[Request, DraftRequest]]] = {}
        caught_up: dict[str, float] = {}  # batch drafter -> seconds its rows' states took to take the roots they kept
        planned: dict[int, int] = {}  # adaptive rows: how deep the goodput controller lets each draft
        self._adaptive_rows = False
        remaining = [r.rule.remaining() for r in live]
        if self.controller is not None:
            # The last plan, where it drafted no row and stands for these rows (the same rows joined and left so far)
            standing = self.controller.standing(self._changes, len(live))
            if standing is not None:
                planned = standing
            else:
                critical = self._critical(remaining)
                # (handle, drafter, the deepest it may draft) of every adaptive row: its tree's depth, not what it has
                # left (cut below), so that a row's last steps keep the plan of the steps before (see `plan`)
                rows = [(r, left >= critical) for r, left in zip(live, remaining) if r.adaptive and r.draft is not None]
                adaptive = [(r.handle, r.drafter, r.tree.max_depth if whole else 0) for r, whole in rows]
                if adaptive:  # a plan of rows none of which `_critical` cut stands for them while it drafts none
                    composition = self._changes if all(whole for _, whole in rows) else None
                    planned = self.controller.plan(adaptive, batch=len(live), composition=composition)
            self._adaptive_rows = bool(planned)
        for request, left in zip(live, remaining):
            left -= 1  # draft tokens it may still use
            max_depth = min(planned.get(request.handle, left), left)  # never more than is left
            request.drafted = request.draft is not None and max_depth >= 1
            if not request.drafted:
                root = request.root if request.root_tensor is None else request.root_tensor
                trees[request.handle] = Tree.root_only(root, self.target.device)
                continue
            # Giving a row's state the roots it kept is its drafter's catching up (see `_observe_draft`): a prompt
            # lookup row that gave a hundred roots in its step's overhead priced its drafted steps out of drafting
            start = time.thread_time()
            if request.deferred and not self._isolated(request, events, lambda: self._give_deferred(request)):
                continue  # its state failed the commits it was owed: it left
            if request.drafter_name in self.draft_pools:
                draft = DraftRequest(request.draft, request.root, request.tree, max_depth, request.sampling,
                                     request.draft_row or 0, request.root_tensor)
                together.setdefault(request.drafter_name, []).append((request, draft))
                caught_up[request.drafter_name] = caught_up.get(request.drafter_name, 0.0) + time.thread_time() - start
            else:
                tree = self._isolated(request, events, lambda: request.draft.propose(
                    request.root, request.tree, max_depth, request.sampling))
                self._observe_draft(request.drafter, [request], [tree], start)
                if tree is not None:
                    trees[request.handle] = tree.to(self.target.device)
        for name, group in together.items():
            start = time.thread_time()
            drafted = self._draft_together(name, group, events)
            trees.update(drafted)
            self._observe_draft(self.drafters[name], [r for r, _ in group], list(drafted.values()),
                                start - caught_up[name])
        return trees

    def _critical(self, remaining: list[int]) -> int:
        """The fewest tokens an `Adaptive` row may have left and still draft: the most any live row has left (of
        ``remaining``, every live row's), in a closed batch that no request waits to join; else 0 (every row).

        A closed batch's steps run until its longest row ends, and a row that ends sooner frees its row for no
        one: its speculation would shorten nothing while its trees cost every row's step. The longest rows (the
        slowest so far, all of them at first) are the ones whose tokens shorten the batch.
        """
        if not self.closed or self.queued:
            return 0
        return max(remaining)

    def _observe_draft(
        self, drafter: Drafter, rows: list[Request], trees: list[Tree | None], start: float
    ) -> None:
        """Tell the controller what drafting these trees for these rows cost (per row, level of the trees drafted
        and token the rows were behind); the rows are caught up now. ``start``: this thread's CPU clock when the
        drafting began.

        The drafter's cost is timed on this thread's CPU clock (a server's HTTP thread holding the GIL meanwhile is
        not the drafter's cost), and so is the drafting the step's overhead leaves out: the waits for the interpreter
        that drafting lets in (a server's streaming, run while this thread holds none of it) stay in the step's
        overhead, on the rows that drafted. Served on stories260K at concurrency 4, prompt lookup drafted 6.4 tokens
        a draft for 1.1 accepted and kept 0.94x of speculation off while those waits were priced nowhere.
        """
        seconds = time.thread_time() - start
        self._draft_seconds += seconds
        if self.controller is not None:
            read_lists([t for t in trees if t is not None])  # (one copy to the host for all: selection reads them too)
            levels = max((t.max_depth for t in trees if t is not None), default=0)
            behind = sum(r.behind for r in rows) / len(rows)
            self.controller.observe_draft(drafter, len(trees), max(levels, 1), seconds, behind)
        for request in rows:
            request.behind = 0

    def _draft_together(self, name: str, group: list[tuple[Request, DraftRequest]], events: list[Event]) -> dict[int, Tree]:
        """A batch drafter's trees for its rows, in one go. If it raises, the rows draft again one by one,
        so that only a row whose own draft fails leaves."""
        drafter = self.drafters[name]
        try:
            proposed = drafter.propose_batch([draft for _, draft in group], self.draft_pools[name])
            return {r.handle: tree.to(self.target.device) for (r, _), tree in zip(group, proposed, strict=True)}
        except Exception:  # whose fault is unknown: each row drafts alone, isolated
            trees = {}
            for request, draft in group:
                tree = self._isolated(request, events, lambda: drafter.propose_batch([draft], self.draft_pools[name])[0])
                if tree is not None:
                    trees[request.handle] = tree.to(self.target.device)
            return trees

    def _verify(
        self, live: list[Request], trees: dict[int, Tree], prefixes: dict[int, int], events: list[Event]
    ) -> dict[int, RowForward]:
        """Every live row's part of the forward at its tree's nodes: its logits, and its forward's states (every row's
        of a packed forward, (N, H), or the (1, N, H) output of a row alone), which a row takes its part of only when
        it must (see `_row_states`).

        One forward over all rows, packed; a single row runs on its own cache row (the same maths without
        the packing) unless the target captures its packed forward; Hugging Face's forward runs each row on its
        own cache.
        """
        self._packed = None
        if self.pool is None or (len(live) == 1 and not self.target.capture):
            verified = {}
            for request in live:
                tree, prefix = trees[request.handle], prefixes[request.handle]

                def forward(request=request, tree=tree, prefix=prefix):
                    mask = None if tree.is_chain else tree_attention_mask(tree, prefix, self.target.dtype)
                    layers = (tuple(sorted({*request.hidden_layers, *self.observers.layers})) if self.observers.layers
                              else request.hidden_layers)
                    out = self.target.forward(tree.tokens[None], request.cache, tree_position_ids(tree, prefix), mask,
                                              hidden_layers=layers)
                    return RowForward(out.logits[0], out.hidden, 0)  # (1, N, H) each

                self.counters.verify_forwards += 1
                start = self._clock.mark()
                result = self._isolated(request, events, forward)
                self._forward_spans.append((start, self._clock.mark()))
                if result is not None:
                    verified[request.handle] = result
                    if self.pool is not None:  # one row: the step's one forward
                        self._forward_tokens, self._forward_masked = tree.num_nodes, not tree.is_chain
            return verified
        segments, tokens = [], []
        for request in live:  # each token's position follows from its row's length and its tree (`Segment`)
            tree = trees[request.handle]
            segments.append(Segment(request.row, tree.num_nodes, None if tree.is_chain else tree.ancestor_mask()))
            tokens.append(tree.tokens)
        layers = tuple(sorted({i for r in live for i in r.hidden_layers} | set(self.observers.layers)))
        self.counters.verify_forwards += 1
        start = self._clock.mark()
        packed = torch.cat(tokens)
        out = self.target.forward_packed(packed, self.pool, segments, layers)
        self._packed = PackedForward(out.logits, packed, [r.handle for r in live])
        self._forward_spans.append((start, self._clock.mark()))
        self._forward_tokens = sum(s.size for s in segments)
        self._forward_masked = self._forward_tokens > len(segments)
        # Each row's logits as views made in one call (a slice a row cost 3-4 us each, 16 rows a step); its states
        # are sliced only where it commits them now (see `_commit`)
        sizes = [s.size for s in segments]
        logits, starts = out.logits.split(sizes), itertools.accumulate(sizes, initial=0)
        return {request.handle: RowForward(logits[k], out.hidden, start)
                for (k, request), start in zip(enumerate(live), starts)}

    def _choose_together(
        self, rows: list[Request], trees: dict[int, Tree], verified: dict[int, RowForward]
    ) -> dict[int, Chosen]:
        """The accepted paths of every row that can be decided on the device together, read back in one copy: greedy
        rows without banned ids (`greedy_accept_packed`, every tree shape), sampled chains under the exact rule
        (`accept_chains`, those of one length and filter setting together), and the other rows verifying their root
        alone (their next tokens chosen together under each filter setting, each drawn with its row's RNG). Each
        row's next token stays on the device too, for its next root-only tree (see `Tree.root_only`). The other rows
        (sampled trees, banned ids, a lossy rule) accept in their own commits; so do all, if this fails."""
        greedy = [r for r in rows if r.sampling.greedy and not r.sampling.banned_token_ids]
        wanted = {r.handle for r in greedy}  # the rows decided here, by handle
        roots = [r for r in rows if trees[r.handle].num_nodes == 1 and r.handle not in wanted]
        chains = [r for r in rows if not r.sampling.greedy and r.acceptance is sample_accept
                  and trees[r.handle].num_nodes > 1 and trees[r.handle].is_chain]
        if not greedy and not roots and not chains:
            return {}
        try:
            parts: list[Part] = []
            if greedy:
                packed = self._packed
                if packed is not None and len(greedy) > 1:  # the whole packed forward at once (its other rows unread)
                    group = [trees[h] for h in packed.handles]
                    parts.append(_greedy_part(packed.tokens, group, packed.logits.argmax(-1), packed.handles))
                else:  # row by row (one row's forward, or Hugging Face's forward per row)
                    for r in greedy:
                        tree = trees[r.handle]
                        choice = verified[r.handle].logits.argmax(-1)
                        parts.append(_greedy_part(tree.tokens, [tree], choice, [r.handle]))
            for group in _grouped(chains, lambda r: (r.sampling, trees[r.handle].num_nodes, trees[r.handle].q is None)):
                result = accept_chains([trees[r.handle] for r in group], [verified[r.handle].logits for r in group],
                                       [r.sampling for r in group])  # (G, 2 + 2 N)
                parts.append(Part(result, [r.handle for r in group], trees[group[0].handle].num_nodes))
            for group in _grouped(roots, lambda r: r.sampling):
                logits = stacked([verified[r.handle].logits[0] for r in group])  # (G, V)
                parts.append(Part(_choose_roots([r.sampling for r in group], logits), [r.handle for r in group], 0))
            flat = [part.result.flatten() for part in parts]
            flat = flat[0] if len(flat) == 1 else torch.cat(flat)
            values = flat.tolist()  # the step's one read of the rows' choices
        except Exception:  # whose fault is unknown: each row accepts in its own commit
            return {}
        chosen, at = {}, 0
        wanted.update(r.handle for r in [*chains, *roots])
        for part in parts:
            result, handles, width = part.result, part.handles, part.width
            size = 2 + 2 * width if width else 1
            for k, handle in enumerate(handles):
                if handle not in wanted:
                    continue
                row = values[at + k * size : at + (k + 1) * size]
                if not width:  # a root alone: the row's choice is its next token
                    chosen[handle] = Chosen(Acceptance(root_path(result.device), row[0]), [0], row, result[k : k + 1])
                    continue
                count, next_token = row[0], row[1]
                table = result.view(len(handles), size)  # a row a handle
                chosen[handle] = Chosen(Acceptance(table[k, 2 : 2 + count], next_token), row[2 : 2 + count],
                                        row[3 + width : 2 + width + count] + [next_token], table[k, 1:2])
            at += result.numel()
        return chosen

    def _commit(
        self, request: Request, tree: Tree, prefix: int, forward: RowForward, events: list[Event],
        chosen: Chosen | None = None,
    ) -> RowCommit | None:
        """Accept a path of the verified tree, keep only it (target cache row and drafter), report its tokens.
        ``forward``: the row's part of the step's forward (see `_verify`). ``chosen``: the path where it was decided
        already (see `_choose_together`). Returns what the row did, for the step's observers (None: none observe)."""
        if request.drafted:
            request.draft_kv = request.draft.cache_tokens()
        kv_peak = prefix + tree.num_nodes + request.draft_kv
        if chosen is None:
            accepted = accept(tree, forward.logits, request.sampling, request.acceptance)
            request.root_tensor = None
            listed = None
        else:
            accepted, listed, request.root_tensor = chosen.accepted, chosen.path, chosen.next_tensor
        count = accepted.path.numel()
        if tree.is_chain:  # the accepted path is its first nodes, in their slots already: a crop, no gather
            request.cache.crop(prefix + count)
            path = slice(0, count)
        else:
            request.cache.keep(prefix, accepted.path, listed)  # rows of the accepted nodes, root first
            path = accepted.path
        whole = tree.is_chain and count == tree.num_nodes  # every node (a root alone): no views to take
        tokens = tree.tokens if whole else tree.tokens[path]
        committed = chosen.committed if chosen is not None else tokens[1:].tolist() + [accepted.next_token]
        if request.draft is not None:
            if whole and not request.drafted:  # the root alone, its drafter's state not needed before it drafts
                rows = self._forward_tokens or tree.num_nodes  # its forward's (Hugging Face's: a row a forward)
                request.deferred.append(self._held.keep(forward.hidden, rows, forward.start, not request.deferred))
                request.deferred_roots.append(request.root)
            else:
                self._give_deferred(request)
                on_host = getattr(request.draft, "commit_listed", None)  # a drafter whose state lives on the host
                if on_host is not None:
                    on_host([request.root, *committed[:-1]])  # the path's tokens, read back with the step's choices
                else:
                    states = _row_states(forward.hidden, request.hidden_layers, forward.start, tree.num_nodes)
                    request.draft.commit(tokens, states if whole else {i: h[path] for i, h in states.items()},
                                         accepted.path if request.drafted else None)
                request.draft_kv = request.draft.cache_tokens()
            request.behind += count
        request.root = accepted.next_token
        if self.controller is not None and tree.num_nodes > 1:
            self.controller.observe_step(request.handle, request.drafter, tree, accepted.path)
        self.counters.observe(tree.num_draft_tokens, len(committed) - 1)
        kept = request.rule.accept(committed)
        request.recorder.end_step(len(committed), len(kept), tree.num_draft_tokens, kv_peak)
        self._emit(request, kept, events)
        if not self.observers:
            return None
        if self.observers.layers and request.record:
            states = _copied(_row_states(forward.hidden, self.observers.layers, forward.start, tree.num_nodes),
                             None if whole else path)
            return RowCommit(request.handle, tree.num_draft_tokens, len(committed) - 1, len(kept), tokens, states)
        return RowCommit(request.handle, tree.num_draft_tokens, len(committed) - 1, len(kept))

    def _give_deferred(self, request: Request) -> bool:
        """Give the row's draft state the roots it kept (see `specgraft.infer.held`), joined into one commit; True."""
        rows, request.deferred = request.deferred, []
        roots, request.deferred_roots = request.deferred_roots, []
        if rows:
            on_host = getattr(request.draft, "commit_listed", None)  # (see `_commit`)
            if on_host is None:
                states = self._held.gather(rows, request.hidden_layers, self.target.device)
            self._held.release()  # (the forwards are let go if it was the last row to keep roots there)
            if on_host is not None:
                on_host(roots)
            else:
                request.draft.commit(torch.tensor(roots, device=self.target.device), states)
            request.draft_kv = request.draft.cache_tokens()
        return True

    def _give_held(self, events: list[Event]) -> None:
        """Every row gives the roots it kept (see `specgraft.infer.held`), and so the held forwards are let go."""
        for request in list(self.running.values()):
            if request.deferred and not request.rule.done:
                self._isolated(request, events, lambda: self._give_deferred(request))
        # the forwards are let go as the last row gives (or, one that ended this step, leaves: see `_leave`)

    def _emit(self, request: Request, kept: list[int], events: list[Event]) -> None:
        request.token_ids.extend(kept)
        text = ""
        if request.text is not None:
            text = request.text.text[request.released:]
            request.released = len(request.text.text)
        events.append(Tokens(request.handle, kept, text))

    def _isolated(self, request: Request, events: list[Event], work: Callable[[], T]) -> T | None:
        """Run one generation's own work; if it raises, that generation alone fails and leaves (None)."""
        try:
            return work()
        except Exception as err:  # any error of this row's own work: isolate it, keep serving the others
            if request.handle in self.running:
                self._leave(request)
                events.append(Failed(request.handle, err))
            return None

    # ------------------------------------------------------------------ leave

    def _leave_finished(self, events: list[Event]) -> None:
        """Every generation its stop rule ended leaves, with its whole output."""
        for request in list(self.running.values()):
            if request.rule.done:
                self._leave(request, finished=True)
                output = GenerationOutput(
                    request.token_ids, continuation_text(self.target.decode, request.text_context, request.token_ids),
                    request.recorder.finish(),
                )
                events.append(Finished(request.handle, output))

    def _leave(self, request: Request, finished: bool = False) -> None:
        """Take a generation out of the running batch and free its rows. ``finished``: its stop rule ended it."""
        if self.running.pop(request.handle, None) is not None and self.observers.layers:
            self.observers.left(Left(request.handle, finished))
        self._changes += 1
        if request.deferred:  # what it kept is given to no one
            self._held.release()
        if self.controller is not None:
            self.controller.forget(request.handle)
        if request.row is not None:
            self.pool.release(request.row)
            request.row = None
        if request.draft_row is not None:
            self.draft_pools[request.drafter_name].release(request.draft_row)
            request.draft_row = None


def most_tree_nodes(drafter: Drafter | None, tree: TreePolicy) -> int | None:
    """The most nodes, root included, that one step of ``drafter`` growing ``tree`` verifies (None: a policy this
    does not know the size of). Prompt lookup copies a trie of its matches whatever the policy's shape; a composite
    drafts with one of its two drafters a step."""
    if drafter is None:
        return 1
    if isinstance(drafter, PromptLookup):
        return 1 + drafter.max_matches * drafter.num_tokens
    if isinstance(drafter, Composite):
        first, then = most_tree_nodes(drafter.first, tree), most_tree_nodes(drafter.then, tree)
        return None if first is None or then is None else max(first, then)
    drafts = (tree.depth if isinstance(tree, Chain) else len(tree.choices) if isinstance(tree, StaticTree)
              else tree.budget if isinstance(tree, DynamicTree) else tree.max_nodes if isinstance(tree, Adaptive)
              else None)
    return None if drafts is None else 1 + drafts


def most_draft_slots(drafter: Drafter | None, tree: TreePolicy) -> int | None:
    """The most slots beyond a row's committed tokens that one step of ``drafter`` growing ``tree`` takes in a batch
    drafter's draft cache (`BatchDrafter.draft_slots`: its row of the draft pool, or a state's own cache), 0 where
    it keeps none (None: a policy it cannot bound). A composite drafts with one of its two drafters a step."""
    if isinstance(drafter, Composite):
        first, then = most_draft_slots(drafter.first, tree), most_draft_slots(drafter.then, tree)
        return None if first is None or then is None else max(first, then)
    return drafter.draft_slots(tree) if isinstance(drafter, BatchDrafter) else 0


def _greedy_part(tokens: torch.Tensor, trees: list[Tree], choice: torch.Tensor, handles: list[int]) -> Part:
    """Greedy acceptance of ``trees`` (packed one after another, ``tokens`` and the target's ``choice`` (N,) at
    each node) as `Scheduler._choose_together` reads it: roots alone need only their choices (width 0), trees
    `greedy_accept_packed`'s rows."""
    width = 1 + max(t.depth_bound for t in trees)  # a path's most nodes: the walks and passes go no deeper
    if width == 1:
        return Part(choice, handles, 0)
    if len(trees) == 1:
        return Part(greedy_accept_tree(trees[0], choice, width), handles, width)
    if all(t.num_nodes == width and t.is_chain for t in trees):  # chains of one length (their structure is read)
        return Part(greedy_accept_chains(tokens.view(-1, width), choice.view(-1, width)), handles, width)
    parents, depth = torch.cat([t.parents for t in trees]), torch.cat([t.depth for t in trees])
    return Part(greedy_accept_packed(tokens, parents, depth, choice, len(trees), width), handles, width)


def _choose_roots(samplings: list[Sampling], logits: torch.Tensor) -> torch.Tensor:
    """(G,) the next tokens of rows that share a filter setting, after their roots' (G, V) logits, left on the
    device: the filters applied to all at once (they work row by row), each row's draw made with its own RNG."""
    sampling = samplings[0]
    if sampling.greedy:
        return sampling.ban(logits).argmax(-1)
    draws = [s.draw(row[None])[0] for s, row in zip(samplings, sampling.probs(logits))]  # (1,) each
    return draws[0] if len(draws) == 1 else torch.cat(draws)


def _grouped(rows: list[Request], key: Callable[[Request], Hashable]) -> list[list[Request]]:
    """``rows`` in groups of equal ``key``, each in the rows' order (Samplings compare by filters, not RNGs)."""
    groups: dict[Hashable, list[Request]] = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    return list(groups.values())


def _copied(states: dict[int, torch.Tensor], path: torch.Tensor | slice | None = None) -> dict[int, torch.Tensor]:
    """States an observer keeps past the step (at ``path``'s positions, or all): every layer's copied out of the
    forward's buffers into one tensor, so that holding them holds no forward."""
    joined = torch.stack(list(states.values()))  # (L, n, H)
    if path is not None:
        joined = joined[:, path]
    return dict(zip(states, joined.unbind(0)))


def _row_states(hidden: dict[int, torch.Tensor], layers: tuple[int, ...], start: int, n: int) -> dict[int, torch.Tensor]:
    """A row's ``n`` states from ``start`` in its forward's (see `Scheduler._verify`): layer -> (n, H)."""
    return {i: hidden[i][0] if hidden[i].dim() == 3 else hidden[i][start : start + n] for i in layers}
