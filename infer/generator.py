"""SpeculativeGenerator: the library's face over the one step path.

Each step the drafter grows a tree from the last committed token (the root),
the target runs every node in one forward with tree attention, an acceptance
rule picks the path it agrees with, and the target's cache and the drafter
keep only that path. That step is `Scheduler.step`: ``generate``,
``stream`` and ``generate_batch`` all drive it, on one row or many; there is
no second loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from specgraft.heads.base import Drafter
from specgraft.infer.events import Event, Failed, Finished, GenerationOutput, Tokens
from specgraft.infer.request import Prompt, check_prompt
from specgraft.infer.scheduler import NO_DRAFTER, Scheduler
from specgraft.infer.stats import GenerationStats
from specgraft.infer.verify import AcceptRule, sample_accept
from specgraft.model import Target
from specgraft.tree import Chain, TreePolicy

# The name a generator's own drafter has in the pool of the schedulers it builds.
GENERATOR_DRAFTER = "drafter"
# Options whose natural value is already a sequence: per-prompt values are a list of such values.
SEQUENCE_OPTIONS = ("stop", "eos_token_id", "banned_token_ids")


@dataclass
class StreamChunk:
    """Tokens committed by one step (after stop rules) and their text; ``stats`` on the last chunk only."""

    token_ids: list[int]
    text: str
    stats: GenerationStats | None = None


class SpeculativeGenerator:
    """Generates with a frozen target, faster by drafting and verifying trees.

    Args:
        target: the frozen target from `load_target`.
        drafter: any `Drafter`; None decodes plainly (one target call per token)
            through the same loop, as our own baseline.
        tree: how the drafter's tree grows (`Chain`, `StaticTree`, ...).
        acceptance: the acceptance rule when sampling: `sample_accept` (default:
            output follows the target exactly) or `lossy_typical_accept`, Medusa's
            LOSSY typical acceptance, which changes the output distribution for
            speed and reports ``stats.lossless == False``.
    """

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None = None,
        tree: TreePolicy | None = None,
        *,
        acceptance: AcceptRule = sample_accept,
    ) -> None:
        if not isinstance(target, Target):
            raise TypeError(f"target must be a specgraft Target (use sg.load_target), got {type(target).__name__}")
        if drafter is not None and not isinstance(drafter, Drafter):
            raise TypeError(f"drafter {type(drafter).__name__} does not implement the Drafter protocol")
        if not callable(acceptance):
            raise TypeError(f"acceptance must be an acceptance rule such as sample_accept, got {acceptance!r}")
        self.target = target
        self.drafter = drafter
        self.tree = tree if tree is not None else Chain(depth=5)
        self.acceptance = acceptance
        self._spare: Scheduler | None = None  # the last call's idle scheduler, reused while it is big enough

    def scheduler(self, max_batch_size: int = 16, max_len: int | None = None) -> Scheduler:
        """A continuous-batching scheduler whose requests use this generator's drafter, tree and acceptance
        unless they name others (see `Scheduler`)."""
        name = NO_DRAFTER if self.drafter is None else GENERATOR_DRAFTER
        return Scheduler(
            self.target, {name: self.drafter}, max_batch_size=max_batch_size, max_len=max_len,
            default_drafter=name, default_tree=self.tree, default_acceptance=self.acceptance,
        )

    def generate(self, prompt: Prompt, max_new_tokens: int = 128, **options: Any) -> GenerationOutput:
        """Generate a completion; takes the same options as `stream` (the same steps, without per-step text)."""
        for event in self._run(prompt, max_new_tokens, text=False, **options):
            if isinstance(event, Finished):
                return event.output
        raise AssertionError("the generation ended without an output")

    def stream(self, prompt: Prompt, max_new_tokens: int = 128, **options: Any) -> Iterator[StreamChunk]:
        """Yield committed tokens step by step with their text; the last chunk carries the stats.

        Takes the options of `specgraft.infer.request.new_request` (temperature,
        top_k, top_p, min_p, banned_token_ids, seed, eos_token_id, stop, ...).
        The last chunk's text reconciles the streamed text with one full
        decode, releasing any held-back text.
        """
        streamed = ""
        for event in self._run(prompt, max_new_tokens, text=True, **options):
            if isinstance(event, Tokens):
                streamed += event.text
                yield StreamChunk(token_ids=event.token_ids, text=event.text)
            elif isinstance(event, Finished):
                yield StreamChunk(token_ids=[], text=event.output.text[len(streamed):], stats=event.output.stats)

    def generate_batch(
        self, prompts: Sequence[Prompt], max_new_tokens: int | Sequence[int] = 128, **options: Any
    ) -> list[GenerationOutput]:
        """Generate a completion for each prompt, all of them advancing together step by step.

        Each option (as `generate` takes them) is one value for every prompt or a
        list with one value per prompt; see `per_prompt_options`.

        Raises:
            Exception: the error of the first generation that failed (the others still ran to the end).
        """
        split = per_prompt_options(len(prompts), max_new_tokens=max_new_tokens, **options)
        checked = [check_prompt(self.target, prompt) for prompt in prompts]
        sched = self._take(len(prompts), self._rows_len(checked, [o["max_new_tokens"] for o in split]))
        sched.closed = True  # no request joins these: speculation pays only where it shortens the longest row
        ended: dict[int, Event] = {}
        try:
            handles = [sched.submit(ids, **opts) for ids, opts in zip(checked, split)]
            while not sched.idle:
                ended.update((e.handle, e) for e in sched.step() if isinstance(e, (Finished, Failed)))
        finally:
            self._give_back(sched)
        failed = next((ended[h] for h in handles if isinstance(ended[h], Failed)), None)
        if failed is not None:
            raise failed.error
        return [ended[h].output for h in handles]

    def _run(self, prompt: Prompt, max_new_tokens: int, *, text: bool, **options: Any) -> Iterator[Event]:
        """One generation's events on a scheduler of one row sized to it; a failure raises its error."""
        checked = check_prompt(self.target, prompt)
        sched = self._take(1, self._rows_len([checked], [max_new_tokens]))
        sched.closed = False
        try:
            sched.submit(checked, max_new_tokens, text=text, **options)  # bad options raise here
            while not sched.idle:
                for event in sched.step():
                    if isinstance(event, Failed):
                        raise event.error
                    yield event
        finally:
            self._give_back(sched)  # where the caller stopped reading a stream, its rows are freed

    def reserve(self, rows: int, max_len: int) -> None:
        """Allocate now the scheduler the next calls run on: ``rows`` rows of ``max_len`` tokens (prompt + new) at
        least, kept while calls fit in it. Its KV pool is zeroed once, here rather than in the first call that needs
        it (SmolLM2-135M, 16 rows of 400 slots: 1 GB, 0.4 s; a timed run or a latency-bound first request)."""
        self._give_back(self._take(rows, max(1, min(max_len, self.target.max_context))))

    def _take(self, rows: int, max_len: int) -> Scheduler:
        """The idle scheduler of the last call, if it has the rows and slots, else a new one sized to them.

        Reused, a scheduler keeps its pools (allocated once), its goodput controller's prices and its drafters'
        checks: on stories260K at batch 1 a call's setup took 0.21-0.25 ms plain and 0.33 ms with an adaptive
        EAGLE head in a fresh scheduler, 0.15 and 0.16 ms in the last one. Taken, not shared: a stream read
        alongside (or another thread's call) builds its own.
        """
        sched, self._spare = self._spare, None
        if sched is None or sched.max_batch_size < rows or sched.max_len < max_len:
            sched = self.scheduler(max_batch_size=max(1, rows), max_len=max_len)
        return sched

    def _give_back(self, sched: Scheduler) -> None:
        """Keep ``sched`` for the next call, first freeing whatever of an interrupted call still runs or waits."""
        for handle in [*sched.running, *(r.handle for r in sched.queued)]:
            sched.cancel(handle)
        self._spare = sched

    def _rows_len(self, prompts: Sequence, budgets: Sequence) -> int:
        """Slots a scheduler's rows need for these generations (their requests check the numbers themselves)."""
        need = [len(p.ids) + n for p, n in zip(prompts, budgets) if isinstance(n, int) and not isinstance(n, bool)]
        return max(1, min(max(need, default=1), self.target.max_context))


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
