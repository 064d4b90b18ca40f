"""Continuous batching: many generations advancing together, joining and leaving between steps.

A server submits requests as they arrive and calls `Scheduler.step` in a
loop; each step advances every running generation by one speculative step
and returns the tokens each committed. A new generation is prefilled in its
own forward when it joins (its first token comes from that step); one that
finishes or is cancelled leaves at once and frees its cache rows. Every
generation owns its state (target cache, drafter state, sampler, stop rule,
stats), so rows never see each other; loaded weights are shared.

Today each running generation's step runs its own target forward, one after
another; the API is the one a batched forward sits behind.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from specgraft.infer.stopping import StopRule

if TYPE_CHECKING:
    from specgraft.infer.generator import Decoding, GenerationOutput, Prompt, SpeculativeGenerator

# Options whose natural value is already a sequence: per-prompt values are a list of such values.
SEQUENCE_OPTIONS = ("stop", "eos_token_id", "banned_token_ids")


@dataclass
class _Sequence:
    """One submitted generation: its decoding state, stop rule and the tokens kept so far."""

    decoding: Decoding
    rule: StopRule
    token_ids: list[int] = field(default_factory=list)


class Scheduler:
    """Runs many generations of one `SpeculativeGenerator` step by step.

    Args:
        generator: supplies the target, drafter, tree and option validation.
        max_batch_size: most generations running at once; more wait in a queue, first come first served.

    Usage::

        sched = gen.scheduler(max_batch_size=16)
        h = sched.submit("Once upon a time", max_new_tokens=64, temperature=0.7, seed=1)
        while not sched.finished(h):
            new_tokens = sched.step()          # {handle: tokens committed by this step}
        out = sched.result(h)                  # a GenerationOutput, handed over once
    """

    def __init__(self, generator: SpeculativeGenerator, *, max_batch_size: int = 16) -> None:
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
        self.generator = generator
        self.max_batch_size = max_batch_size
        self.queued: OrderedDict[int, _Sequence] = OrderedDict()
        self.running: OrderedDict[int, _Sequence] = OrderedDict()
        self.done: dict[int, GenerationOutput] = {}
        self.failed: dict[int, Exception] = {}  # a row whose step raised: only that generation fails
        self._next_handle = 0

    def submit(self, prompt: Prompt, max_new_tokens: int = 128, **options: Any) -> int:
        """Queue a generation; returns its handle. Bad options raise here, before anything runs."""
        decoding, rule = self.generator._begin(prompt, max_new_tokens, **options)
        handle = self._next_handle
        self._next_handle += 1
        self.queued[handle] = _Sequence(decoding, rule)
        return handle

    def step(self) -> dict[int, list[int]]:
        """Admit queued generations into free rows, advance every running one once.

        Returns the tokens each generation committed in this step (a newly
        admitted one: its first token, from its prefill). Finished generations
        leave the batch within the step. A generation whose step raises (a
        drafter failing on its input) leaves too, and `result` re-raises its
        error: one generation's fault never stops the others.
        """
        while self.queued and len(self.running) < self.max_batch_size:
            handle, seq = self.queued.popitem(last=False)
            self.running[handle] = seq
        committed: dict[int, list[int]] = {}
        for handle, seq in list(self.running.items()):
            try:
                kept = seq.decoding.advance(seq.rule)
            except Exception as err:  # any error of this row's own step: isolate it, keep serving the others
                del self.running[handle]
                self.failed[handle] = err
                continue
            seq.token_ids.extend(kept)
            committed[handle] = kept
            if seq.rule.done:
                del self.running[handle]
                self.done[handle] = self._output(seq)
        return committed

    def finished(self, handle: int) -> bool:
        """Whether the generation has finished or failed (its result is waiting). Unknown handles raise KeyError."""
        self._check(handle)
        return handle in self.done or handle in self.failed

    def result(self, handle: int) -> GenerationOutput:
        """The finished generation's output, handed over once (the handle is then forgotten).

        Raises:
            Exception: the error a failed generation's step raised.
        """
        self._check(handle)
        if handle in self.failed:
            raise self.failed.pop(handle)
        if handle not in self.done:
            raise ValueError(f"generation {handle} has not finished: step() until finished({handle})")
        return self.done.pop(handle)

    def cancel(self, handle: int) -> None:
        """Stop a queued or running generation now and free its rows; its handle is forgotten."""
        self._check(handle)
        for table in (self.queued, self.running, self.done, self.failed):
            table.pop(handle, None)

    def tokens(self, handle: int) -> list[int]:
        """The tokens a queued or running generation has kept so far."""
        self._check(handle)
        seq = self.queued.get(handle) or self.running.get(handle)
        if seq is not None:
            return list(seq.token_ids)
        return list(self.done[handle].token_ids) if handle in self.done else []

    @property
    def idle(self) -> bool:
        """Nothing queued or running."""
        return not self.queued and not self.running

    def _check(self, handle: int) -> None:
        if not any(handle in table for table in (self.queued, self.running, self.done, self.failed)):
            raise KeyError(f"unknown generation handle {handle!r} (never submitted, cancelled, or its result was taken)")

    def _output(self, seq: _Sequence) -> GenerationOutput:
        from specgraft.infer.generator import GenerationOutput

        return GenerationOutput(
            token_ids=seq.token_ids, text=self.generator.target.decode(seq.token_ids), stats=seq.decoding.recorder.finish()
        )


def per_prompt_options(count: int, **options: Any) -> list[dict[str, Any]]:
    """Split options into one dict per prompt: each is one value for all, or a list of ``count`` values.

    ``stop``, ``eos_token_id`` and ``banned_token_ids`` take sequences as a single
    value, so for them only a list whose items are themselves lists (or None)
    is read as one value per prompt.

    Raises:
        ValueError: a per-prompt list whose length is not the number of prompts.
    """
    split = [dict() for _ in range(count)]
    for key, value in options.items():
        if _per_prompt(key, value):
            if len(value) != count:
                raise ValueError(f"option {key!r} has {len(value)} values for {count} prompts: give one value or one per prompt")
            for opts, v in zip(split, value):
                opts[key] = v
        else:
            for opts in split:
                opts[key] = value
    return split


def _per_prompt(key: str, value: Any) -> bool:
    if not isinstance(value, (list, tuple)):
        return False
    if key in SEQUENCE_OPTIONS:
        return len(value) > 0 and all(v is None or isinstance(v, (list, tuple)) for v in value)
    return True
