"""The serving engine: one background thread stepping one `Scheduler` per drafter configuration.

Torch work is synchronous, so it runs on one thread of its own while the HTTP
side (asyncio) stays responsive. The HTTP side hands a `Job` over through a
thread-safe command queue; the engine thread submits it to the scheduler of
its (drafter, tree) configuration, steps every non-idle scheduler once per
round, and posts each step's tokens back into the job's asyncio queue with
``loop.call_soon_threadsafe``. Cancels are applied before the next round, so
a cancelled generation's cache rows are freed within one step.

Rows are capped across schedulers: at most ``max_batch_size`` generations run
at once, admitted first come first served whatever their drafter; at most
``max_queue`` more wait, and a job beyond that is refused (`QueueFull`).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from specgraft.heads.base import Drafter
from specgraft.infer.generator import SpeculativeGenerator
from specgraft.infer.scheduler import Scheduler
from specgraft.infer.stats import GenerationStats
from specgraft.model import Target
from specgraft.tree import TreePolicy

IDLE_WAIT_S = 0.05  # how long an idle engine sleeps between looks at its command queue


class QueueFull(Exception):
    """Every row is busy and the wait queue is full: the caller should retry later (HTTP 503)."""


@dataclass(frozen=True)
class Config:
    """A drafter choice: the drafter's name and its tree (``tree_key`` names the tree, e.g. ``chain:4``)."""

    drafter: str
    tree_key: str


@dataclass
class Tokens:
    """Tokens one step committed for a job; ``at`` is when the engine posted them."""

    token_ids: list[int]
    at: float


@dataclass
class Finished:
    stats: GenerationStats


@dataclass
class Failed:
    """The job failed: ``status`` 400 for options the engine refused, 500 for a fault in its step, 503 at shutdown."""

    status: int
    message: str


Event = Tokens | Finished | Failed


@dataclass
class Job:
    """One request as the engine sees it; events arrive in ``events`` on the HTTP side's loop."""

    config: Config
    drafter: Drafter | None
    tree: TreePolicy
    prompt_ids: list[int]
    max_new_tokens: int
    options: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted_at: float = field(default_factory=time.perf_counter)
    handle: int | None = None  # the scheduler's, once submitted
    generated: int = 0  # tokens posted so far
    ended: bool = False

    def post(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the HTTP side's loop has closed: nobody is left to tell
            pass


class EngineObserver:
    """What the engine reports as it runs (the server's metrics implement it); every method is a no-op here."""

    def first_token(self, seconds: float) -> None: ...

    def tokens(self, count: int, seconds_each: float) -> None: ...

    def finished(self, stats: GenerationStats) -> None: ...

    def load(self, running: int, queued: int) -> None: ...


class Engine:
    """Generators and schedulers for each configuration in use, stepped by one thread.

    A job brings its loaded drafter (shared: weights load once per server) and
    tree; jobs with equal `Config` share one scheduler.

    Args:
        target: the loaded target, shared by every generator.
        max_batch_size: most generations running at once, over all configurations.
        max_queue: most generations waiting for a row; more are refused with `QueueFull`.
        observer: receives load and latency reports (metrics).
    """

    def __init__(
        self,
        target: Target,
        *,
        max_batch_size: int = 16,
        max_queue: int = 256,
        observer: EngineObserver | None = None,
    ) -> None:
        if max_batch_size < 1 or max_queue < 0:
            raise ValueError(f"max_batch_size ({max_batch_size}) must be >= 1 and max_queue ({max_queue}) >= 0")
        self.target = target
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.observer = observer or EngineObserver()
        self.schedulers: dict[Config, Scheduler] = {}
        self.jobs: dict[tuple[Config, int], Job] = {}
        self.waiting: OrderedDict[int, Job] = OrderedDict()  # submitted, no row yet: first come first served
        self.commands: queue.SimpleQueue[tuple[str, Job]] = queue.SimpleQueue()
        self.wake = threading.Event()
        self.lock = threading.Lock()
        self.in_flight = 0  # jobs accepted and not yet ended, counted at once on the HTTP side
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="specgraft-engine", daemon=True)
        self.crashed: BaseException | None = None

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
                if not any(not s.idle for s in self.schedulers.values()):
                    self.wake.wait(IDLE_WAIT_S)
                    self.wake.clear()
                    continue
                self._admit()
                for config, sched in list(self.schedulers.items()):
                    if not sched.idle:
                        self._step(config, sched)
                    if sched.idle:  # rebuilt on demand: requests may name many trees over a server's life
                        del self.schedulers[config]
        except BaseException as err:  # the loop itself broke: fail every job rather than leave clients hanging
            self.crashed = err
            with self.lock:
                self.stopping = True
            self._fail_all(Failed(500, f"engine stopped: {type(err).__name__}: {err}"))
            raise
        self._fail_all(Failed(503, "the server shut down before this request finished"))
        self._report_load()

    def _fail_all(self, event: Failed) -> None:
        """End every job still known or still in the command queue with ``event``."""
        while True:
            try:
                kind, job = self.commands.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                self._end(job, event)
        for job in list(self.jobs.values()) + list(self.waiting.values()):
            self._end(job, event)

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
            elif kind == "cancel" and not job.ended:
                if job.handle is not None:
                    self.schedulers[job.config].cancel(job.handle)
                self._forget(job)

    def _submit(self, job: Job) -> None:
        sched = self.schedulers.get(job.config)
        if sched is None:
            gen = SpeculativeGenerator(self.target, job.drafter, tree=job.tree)
            sched = self.schedulers[job.config] = Scheduler(gen, max_batch_size=self.max_batch_size)
        try:
            job.handle = sched.submit(job.prompt_ids, job.max_new_tokens, **job.options)
        except (ValueError, TypeError, NotImplementedError) as err:  # options the engine refuses: that request's 400
            self._end(job, Failed(400, str(err)))
            return
        except Exception as err:  # anything else failing in one request's setup fails that request only
            self._end(job, Failed(500, f"{type(err).__name__}: {err}"))
            return
        self.jobs[(job.config, job.handle)] = job
        self.waiting[id(job)] = job

    def _admit(self) -> None:
        """Let each scheduler admit its share of free rows, oldest waiting jobs first, over all schedulers.

        A scheduler admits up to its ``max_batch_size``; setting it to its running
        count plus its share keeps the total under the engine's cap.
        """
        free = self.max_batch_size - sum(len(s.running) for s in self.schedulers.values())
        share = dict.fromkeys(self.schedulers, 0)
        for job in list(self.waiting.values()):
            if free <= 0:
                break
            share[job.config] += 1
            free -= 1
            del self.waiting[id(job)]
        for config, sched in self.schedulers.items():
            sched.max_batch_size = len(sched.running) + share[config]

    def _step(self, config: Config, sched: Scheduler) -> None:
        started = time.perf_counter()
        committed = sched.step()
        now = time.perf_counter()
        for handle, tokens in committed.items():
            job = self.jobs[(config, handle)]
            if not tokens:
                continue
            job.post(Tokens(tokens, now))
            if job.generated == 0:  # its prefill: time to first token, queue wait included
                self.observer.first_token(now - job.submitted_at)
            else:
                self.observer.tokens(len(tokens), (now - started) / len(tokens))
            job.generated += len(tokens)
        for (cfg, handle), job in list(self.jobs.items()):
            if cfg == config and sched.finished(handle):
                try:
                    out = sched.result(handle)
                except Exception as err:  # this generation's own step failed (Scheduler isolates it)
                    self._end(job, Failed(500, f"generation failed: {type(err).__name__}: {err}"))
                    continue
                self.observer.finished(out.stats)
                self._end(job, Finished(out.stats))

    def _end(self, job: Job, event: Event) -> None:
        if job.ended:
            return
        job.post(event)
        self._forget(job)

    def _forget(self, job: Job) -> None:
        if job.ended:
            return
        job.ended = True
        if job.handle is not None:
            self.jobs.pop((job.config, job.handle), None)
        self.waiting.pop(id(job), None)
        with self.lock:
            self.in_flight -= 1

    def _report_load(self) -> None:
        running = sum(len(s.running) for s in self.schedulers.values())
        self.observer.load(running, len(self.waiting))

