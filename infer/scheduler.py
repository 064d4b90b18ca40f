"""Continuous batching: many generations advancing together, joining and leaving between steps.

A server submits requests as they arrive and calls `Scheduler.step` in a
loop; each step advances every running generation by one speculative step
and returns the tokens each committed. A new generation joins between steps:
its prompt is prefilled in its own forward (its first token), then it takes
part in that same step's verification. One that finishes or is cancelled
leaves at once and frees its cache row. Every generation owns its state
(target cache row, drafter state, sampler, stop rule, stats), so rows never
see each other; loaded weights are shared.

One step: every row's tree is drafted, then one target forward verifies
every row's tree over a `BatchedKVCache` (trees padded to the widest, a 4D
mask per row, positions per row), then each row accepts and commits its own
path. A `BatchDrafter` (Medusa, EAGLE, EAGLE-3) drafts all rows' trees
together, its head run once per tree level for every row (each row keeps its
own sampler, filters and depth), its draft caches rows of a batched cache of
its own beside the target's; other drafters (prompt lookup, a draft model)
draft row by row. Targets without the fast path (Hugging Face's forward)
draft and verify row by row instead: transformers' caches hold one length
for the whole batch.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

from specgraft.heads.base import BatchDrafter, DraftRequest
from specgraft.infer.stopping import StopRule
from specgraft.model import TREE_SLOTS
from specgraft.tree import Tree, batched_tree_inputs

if TYPE_CHECKING:
    from specgraft.infer.generator import Decoding, GenerationOutput, Prompt, SpeculativeGenerator

T = TypeVar("T")
# Default cap on a row's tokens: rows x slots are allocated up front (16 rows of a 30-layer model's
# 8K context would take gigabytes); pass max_len to go further.
DEFAULT_MAX_LEN = 4096
# Options whose natural value is already a sequence: per-prompt values are a list of such values.
SEQUENCE_OPTIONS = ("stop", "eos_token_id", "banned_token_ids")


@dataclass
class _Sequence:
    """One submitted generation: its decoding state, stop rule and the tokens kept so far."""

    decoding: Decoding
    rule: StopRule
    token_ids: list[int] = field(default_factory=list)
    row: int | None = None  # its row of the batched cache while running


class Scheduler:
    """Runs many generations of one `SpeculativeGenerator` step by step.

    Args:
        generator: supplies the target, drafter, tree and option validation.
        max_batch_size: most generations running at once; more wait in a queue, first come first served.
        max_len: most tokens (prompt + new) of one generation: the slots each cache row holds
            beside one tree. Default: the target's context, at most `DEFAULT_MAX_LEN`.

    Usage::

        sched = gen.scheduler(max_batch_size=16)
        h = sched.submit("Once upon a time", max_new_tokens=64, temperature=0.7, seed=1)
        while not sched.finished(h):
            new_tokens = sched.step()          # {handle: tokens committed by this step}
        out = sched.result(h)                  # a GenerationOutput, handed over once
    """

    def __init__(self, generator: SpeculativeGenerator, *, max_batch_size: int = 16, max_len: int | None = None) -> None:
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
        target = generator.target
        self.max_len = max_len or min(target.max_context, DEFAULT_MAX_LEN)
        if not 1 <= self.max_len <= target.max_context:
            raise ValueError(f"max_len={max_len} must lie in [1, {target.max_context}] (the target's context)")
        self.generator = generator
        self.max_batch_size = max_batch_size
        self.cache = target.new_batched_cache(max_batch_size, self.max_len + TREE_SLOTS)  # None: row by row
        drafter = generator.drafter
        # A drafter that drafts every row together, and its draft caches' rows (row r beside the target's row r).
        self.batch_drafter = drafter if self.cache is not None and isinstance(drafter, BatchDrafter) else None
        self.draft_rows = None if self.batch_drafter is None else drafter.new_rows(max_batch_size, self.max_len + TREE_SLOTS)
        self.queued: OrderedDict[int, _Sequence] = OrderedDict()
        self.running: OrderedDict[int, _Sequence] = OrderedDict()
        self.done: dict[int, GenerationOutput] = {}
        self.failed: dict[int, Exception] = {}  # a row whose step raised: only that generation fails
        self._next_handle = 0

    def submit(self, prompt: Prompt, max_new_tokens: int = 128, **options: Any) -> int:
        """Queue a generation; returns its handle. Bad options raise here, before anything runs."""
        decoding, rule = self.generator._begin(prompt, max_new_tokens, **options)
        if len(decoding.prompt_ids) + rule.max_new_tokens > self.max_len:
            raise ValueError(
                f"prompt ({len(decoding.prompt_ids)} tokens) + max_new_tokens ({rule.max_new_tokens}) exceeds "
                f"this scheduler's max_len of {self.max_len} tokens"
            )
        handle = self._next_handle
        self._next_handle += 1
        self.queued[handle] = _Sequence(decoding, rule)
        return handle

    def step(self) -> dict[int, list[int]]:
        """Admit queued generations into free rows, then advance every running one by one step.

        Returns the tokens each generation committed in this step (a newly
        admitted one: its first token, from its prefill, and its first
        step's). Finished generations leave the batch within the step. A
        generation whose own work raises (a drafter failing on its input, a
        refused option found late) leaves too, and `result` re-raises its
        error: one generation's fault never stops the others.
        """
        committed: dict[int, list[int]] = {}
        while self.queued and len(self.running) < self.max_batch_size:
            handle, seq = self.queued.popitem(last=False)
            if self.cache is not None:
                seq.row, seq.decoding.cache = self.cache.acquire()
                if self.draft_rows is not None:
                    _, seq.decoding.draft_cache = self.draft_rows.acquire(seq.row)
            self.running[handle] = seq
            kept = self._isolated(handle, lambda: seq.decoding.advance(seq.rule))  # prefill: the first token
            if kept is not None:
                committed[handle] = self._keep(seq, kept)
        live = [(h, seq) for h, seq in self.running.items() if not seq.rule.done]
        if self.cache is not None and live:
            for handle, kept in self._verify_together(live).items():
                committed[handle] = committed.get(handle, []) + kept
        else:
            for handle, seq in live:
                kept = self._isolated(handle, lambda: seq.decoding.advance(seq.rule))
                if kept is not None:
                    committed[handle] = committed.get(handle, []) + self._keep(seq, kept)
        for handle, seq in list(self.running.items()):
            if seq.rule.done:
                self._leave(handle)
                self.done[handle] = self._output(seq)
        return committed

    def _verify_together(self, live: list[tuple[int, _Sequence]]) -> dict[int, list[int]]:
        """One speculative step for every live row: each drafts its tree, one forward verifies them all."""
        target = self.generator.target
        trees, prefixes = {}, {}
        together: list[tuple[int, _Sequence, DraftRequest]] = []  # rows the batch drafter drafts in one go
        for handle, seq in live:
            seq.decoding.recorder.begin_step()
            max_depth = seq.rule.remaining() - 1
            request = seq.decoding.draft_request(max_depth, seq.row) if self.batch_drafter is not None else None
            if request is not None:
                together.append((handle, seq, request))
                continue
            tree = self._isolated(handle, lambda: seq.decoding.propose(max_depth))
            if tree is not None:
                prefixes[seq.row], trees[seq.row] = len(seq.decoding.cache), tree
        for (handle, seq, _), tree in zip(together, self._propose_together(together)):
            if tree is not None:
                prefixes[seq.row], trees[seq.row] = len(seq.decoding.cache), tree
        live = [(h, seq) for h, seq in live if h in self.running]
        if not live:
            return {}
        batch = max(trees) + 1  # rows 0..batch-1 run; free rows among them are padding only
        tokens, positions, mask = batched_tree_inputs(
            [trees.get(r) for r in range(batch)], [prefixes.get(r, 0) for r in range(batch)], target.dtype
        )
        out = target.forward_rows(tokens, self.cache, positions, mask, hidden_layers=live[0][1].decoding.hidden_layers)
        kept = {}
        for handle, seq in live:
            row, n = seq.row, trees[seq.row].num_nodes
            hidden = {i: h[row, :n] for i, h in out.hidden.items()}

            def finish(seq=seq, row=row, n=n, hidden=hidden) -> list[int]:
                result = seq.decoding.commit(trees[row], prefixes[row], out.logits[row, :n], hidden)
                return seq.decoding.record(seq.rule, result)

            tokens = self._isolated(handle, finish)
            if tokens is not None:
                kept[handle] = self._keep(seq, tokens)
        return kept

    def _propose_together(self, together: list[tuple[int, _Sequence, DraftRequest]]) -> list[Tree | None]:
        """The batch drafter's trees for these rows, in one go. If it raises, the rows draft again one by one,
        so that only a row whose own draft fails leaves (None)."""
        if not together:
            return []
        try:
            trees = self.batch_drafter.propose_batch([request for _, _, request in together], self.draft_rows)
        except Exception:  # whose fault is unknown: each row drafts alone, isolated
            return [self._isolated(h, lambda: seq.decoding.propose(request.max_depth)) for h, seq, request in together]
        return [tree.to(self.generator.target.device) for tree in trees]

    def _isolated(self, handle: int, work: Callable[[], T]) -> T | None:
        """Run one generation's own work; if it raises, that generation alone fails and leaves (None)."""
        try:
            return work()
        except Exception as err:  # any error of this row's own work: isolate it, keep serving the others
            self._leave(handle)
            self.failed[handle] = err
            return None

    @staticmethod
    def _keep(seq: _Sequence, tokens: list[int]) -> list[int]:
        seq.token_ids.extend(tokens)
        return tokens

    def _leave(self, handle: int) -> None:
        """Take a generation out of the running batch and free its cache row."""
        seq = self.running.pop(handle)
        if seq.row is not None:
            self.cache.release(seq.row)
            if self.draft_rows is not None:
                self.draft_rows.release(seq.row)
            seq.row = None

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
        if handle in self.running:
            self._leave(handle)
        for table in (self.queued, self.done, self.failed):
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
