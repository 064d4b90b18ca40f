"""The serving engine: one background thread stepping the one `Scheduler`.

Torch work is synchronous, so it runs on one thread of its own while the HTTP
side (asyncio) stays responsive. The HTTP side hands a `Job` over through a
thread-safe command queue; the engine thread submits it to the scheduler
(whatever its drafter, tree or sampling: every request shares every step),
steps the scheduler while anything runs, and posts each event of a job
(`Tokens`, then `Finished` or `Failed`) into the job's asyncio queue with
``loop.call_soon_threadsafe``. Cancels are applied before the next step, so
a cancelled generation's rows are freed within one step.

At most ``max_batch_size`` generations run at once (the scheduler's rows),
admitted first come first served; at most ``max_queue`` more wait, and a job
beyond that is refused (`QueueFull`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from specgraft.heads.base import Drafter
from specgraft.infer.events import Event, Failed, Finished, Tokens
from specgraft.infer.observer import StepObserver
from specgraft.infer.request import PromptIds
from specgraft.infer.scheduler import Scheduler
from specgraft.infer.stats import GenerationStats
from specgraft.model import TREE_SLOTS, Target
from specgraft.tree import TreePolicy

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # how long an idle engine sleeps between looks at its command queue
UNSUBMITTED = -1  # the handle of a job the scheduler never took


class QueueFull(Exception):
    """Every row is busy and the wait queue is full: the caller should retry later (HTTP 503)."""


class EngineError(Exception):
    """Why the engine ended a job itself: ``status`` 400 for options it refused, 503 at shutdown, 500 on a crash."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Job:
    """One request as the engine sees it; its events arrive in ``events`` on the HTTP side's loop.

    ``drafter_key`` names the drafter in the scheduler's pool (loaded there on first use);
    ``drafter_name`` and ``tree_label`` are what the request's stats report.
    """

    drafter_key: str
    drafter: Drafter | None
    tree: TreePolicy
    prompt: PromptIds
    max_new_tokens: int
    options: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    drafter_name: str = "none"
    tree_label: str | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted_at: float = field(default_factory=time.perf_counter)
    handle: int = UNSUBMITTED  # the scheduler's, once submitted
    generated: int = 0  # tokens posted so far
    ended: bool = False

    def post(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the HTTP side's loop has closed: nobody is left to tell
            pass


class EngineObserver(StepObserver):
    """What the engine reports as it runs (the server's metrics implement it); every method is a no-op here.

    It observes the scheduler's steps too (`StepObserver`: drafted, verified, committed, stepped), added to the
    engine's scheduler at start, and told on the engine thread.
    """

    def started(self, scheduler: Scheduler) -> None: ...

    def first_token(self, seconds: float) -> None: ...

    def tokens(self, count: int, seconds_each: float) -> None: ...

    def finished(self, stats: GenerationStats) -> None: ...

    def load(self, running: int, queued: int) -> None: ...

    def adopted(self, name: str, version: int, heldout_tau: float | None) -> None: ...


class Engine:
    """The scheduler and the thread that steps it.

    Args:
        target: the loaded target.
        drafters: name -> loaded drafter (shared by every request; weights load once per server).
            More drafters that keep no draft pool (prompt lookup settings) load as requests name them.
        max_batch_size: most generations running at once: the rows of the KV pool, allocated here.
        max_queue: most generations waiting for a row; more are refused with `QueueFull`.
        max_len: most tokens (prompt + new) of a request (see `Scheduler`).
        tree_slots: the KV pool's slots a row beyond ``max_len`` for the tree it verifies (see `Scheduler`).
        draft_slots: the draft pools' slots a row beyond ``max_len`` for drafting a tree (see `Scheduler`; None:
            ``tree_slots``).
        observer: receives load and latency reports, and the scheduler's steps (metrics).
    """

    def __init__(
        self,
        target: Target,
        drafters: Mapping[str, Drafter | None] | None = None,
        *,
        max_batch_size: int = 16,
        max_queue: int = 256,
        max_len: int | None = None,
        tree_slots: int = TREE_SLOTS,
        draft_slots: int | None = None,
        observer: EngineObserver | None = None,
    ) -> None:
        if max_batch_size < 1 or max_queue < 0:
            raise ValueError(f"max_batch_size ({max_batch_size}) must be >= 1 and max_queue ({max_queue}) >= 0")
        self.scheduler = Scheduler(target, drafters, max_batch_size=max_batch_size, max_len=max_len,
                                   tree_slots=tree_slots, draft_slots=draft_slots)
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.observer = observer or EngineObserver()
        self.jobs: dict[int, Job] = {}  # by scheduler handle
        self.commands: queue.SimpleQueue[tuple[str, Job | None]] = queue.SimpleQueue()
        self.wake = threading.Event()
        self.lock = threading.Lock()
        self.in_flight = 0  # jobs accepted and not yet ended, counted at once on the HTTP side
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="specgraft-engine", daemon=True)
        self.crashed: BaseException | None = None
        if observer is not None:  # (the no-op one would only make the scheduler build records for no one)
            self.scheduler.add_observer(observer)
        self.observer.started(self.scheduler)

    def describe(self) -> str:
        """What was allocated at start: the KV pool (and the batch drafters' draft pools), for the start-up log."""
        sched = self.scheduler
        if sched.pool is None:
            return (f"KV caches: per generation (Hugging Face's forward), up to {self.max_batch_size} generations "
                    f"of {sched.max_len} tokens")
        layers, _, _, heads, slots, dim = sched.pool.kv.shape
        scratch = " and a scratch row for the captured forward's padding" if sched.pool.scratch_row is not None else ""
        line = (f"KV pool: {sched.pool.rows} rows{scratch} x {slots} slots ({sched.max_len} tokens + {sched.tree_slots} "
                f"for a tree) x {layers} layers x "
                f"{heads} kv heads x {dim} dims, {sched.pool.kv.dtype}: {sched.pool_bytes / 2**20:,.1f} MiB")
        pooled = [name for name, pool in sched.draft_pools.items() if pool is not None]  # (Medusa, lookup: none)
        if pooled:
            line += (f"; draft pools ({', '.join(pooled)}): {sched.max_len + sched.draft_slots} slots a row "
                     f"({sched.max_len} tokens + {sched.draft_slots} for drafting a tree), "
                     f"{sched.draft_pool_bytes / 2**20:,.1f} MiB")
        return line

    # ------------------------------------------------------------------ HTTP side (any thread)

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        """Hand a job to the engine thread; its events then arrive in ``job.events``.

        Raises:
            QueueFull: ``max_batch_size`` running and ``max_queue`` waiting already, or the engine is stopping.
        """
        with self.lock:
            if self.stopping or self.in_flight >= self.max_batch_size + self.max_queue:
                raise QueueFull("the server is shutting down" if self.stopping else
                                f"{self.in_flight} requests in flight: {self.max_batch_size} running and "
                                f"{self.max_queue} queued at most")
            self.in_flight += 1
        self.commands.put(("submit", job))
        self.wake.set()

    def adopt(self, name: str, drafter: Drafter, version: int, heldout_tau: float | None = None) -> None:
        """Drafter ``name`` takes ``drafter``'s weights (loaded by the caller, off the engine thread) between two
        steps (`Scheduler.adopt`); the observer hears of ``version`` then. A drafter that refuses them is logged and
        keeps its own."""
        self.commands.put(("adopt", (name, drafter, version, heldout_tau)))
        self.wake.set()

    def cancel(self, job: Job) -> None:
        """Stop a job (its client went away); the engine frees its rows before its next step."""
        self.commands.put(("cancel", job))
        self.wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new jobs, fail the ones still in flight (503), and end the engine thread."""
        with self.lock:
            self.stopping = True
        self.commands.put(("stop", None))
        self.wake.set()
        if self.thread.is_alive():
            self.thread.join(timeout)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            while self._apply_commands():
                self._report_load()
                if self.scheduler.idle:
                    self.wake.wait(IDLE_WAIT_S)
                    self.wake.clear()
                    continue
                self._step()
        except BaseException as err:  # the loop itself broke: fail every job rather than leave clients hanging
            self.crashed = err
            with self.lock:
                self.stopping = True
            self._fail_all(EngineError(500, f"engine stopped: {type(err).__name__}: {err}"))
            raise
        self._fail_all(EngineError(503, "the server shut down before this request finished"))
        self._report_load()

    def _fail_all(self, error: EngineError) -> None:
        """End every job still known or still in the command queue with ``error``."""
        while True:
            try:
                kind, job = self.commands.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                self._end(job, Failed(job.handle, error))
        for job in list(self.jobs.values()):
            self._end(job, Failed(job.handle, error))

    def _apply_commands(self) -> bool:
        """Apply queued submits and cancels; False once told to stop."""
        while True:
            try:
                kind, job = self.commands.get_nowait()
            except queue.Empty:
                return True
            if kind == "stop":
                return False
            if kind == "submit":
                self._submit(job)
            elif kind == "adopt":
                name, drafter, version, tau = job
                try:
                    self.scheduler.adopt(name, drafter)
                except (KeyError, TypeError, ValueError) as err:
                    log.error("drafter %r keeps its weights: version %d refused: %s", name, version, err)
                    continue
                self.observer.adopted(name, version, tau)
            elif kind == "cancel" and not job.ended:
                if job.handle in self.jobs:
                    self.scheduler.cancel(job.handle)
                self._forget(job)

    def _submit(self, job: Job) -> None:
        try:
            self.scheduler.add_drafter(job.drafter_key, job.drafter)
            job.handle = self.scheduler.submit(job.prompt, job.max_new_tokens, drafter=job.drafter_key, tree=job.tree,
                                               text=True, **job.options)
        except (KeyError, ValueError, TypeError, NotImplementedError) as err:  # options refused: that request's 400
            self._end(job, Failed(job.handle, EngineError(400, str(err.args[0]) if err.args else str(err))))
            return
        except Exception as err:  # anything else failing in one request's setup fails that request only
            self._end(job, Failed(job.handle, EngineError(500, f"{type(err).__name__}: {err}")))
            return
        self.jobs[job.handle] = job

    def _step(self) -> None:
        started = time.perf_counter()
        events = self.scheduler.step()  # (the observer hears of its step from the scheduler)
        now = time.perf_counter()
        for event in events:
            job = self.jobs.get(event.handle)
            if job is None:
                continue
            if isinstance(event, Tokens):
                if not event.token_ids:
                    continue
                if job.generated == 0:  # its prefill: time to first token, queue wait included
                    self.observer.first_token(now - job.submitted_at)
                else:
                    self.observer.tokens(len(event.token_ids), (now - started) / len(event.token_ids))
                job.generated += len(event.token_ids)
                job.post(event)
            elif isinstance(event, Finished):
                self.observer.finished(event.output.stats)
                self._end(job, event)
            else:  # this generation's own step failed (the scheduler isolated it): its client gets a 500, the log why
                log.error("request %s failed in a step (the others go on)", job.handle, exc_info=event.error)
                error = EngineError(500, f"generation failed: {type(event.error).__name__}: {event.error}")
                self._end(job, Failed(event.handle, error))

    def _end(self, job: Job, event: Event) -> None:
        if job.ended:
            return
        job.post(event)
        self._forget(job)

    def _forget(self, job: Job) -> None:
        if job.ended:
            return
        job.ended = True
        self.jobs.pop(job.handle, None)
        with self.lock:
            self.in_flight -= 1

    def _report_load(self) -> None:
        self.observer.load(len(self.scheduler.running), len(self.scheduler.queued))
