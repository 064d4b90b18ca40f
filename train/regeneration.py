"""Self-distillation: the frozen target writes the training data its heads learn from.

A head trained on the target's own outputs learns the distribution it will
be verified against, not a dataset's. For each input:

- a conversation keeps its system and user turns, and the target writes
  the reply to each user turn given the conversation so far (its own
  earlier replies included). So every assistant turn is rewritten; a user
  turn left unanswered (a prompt-only record, two user turns in a row) gets
  a reply too; an assistant turn that answers no user turn (one before any
  user turn, a second in a row) is dropped;
- a text record or a plain prompt string gets a free continuation; the
  record's text is the prompt and continuation together;
- ``num_from_bos`` extra samples start from the tokenizer's BOS alone
  (ids "bos-0", "bos-1", ...);
- ``self_instruct`` extra conversations need no prompts at all (Magpie,
  Xu et al. 2024): the target is given its chat template up to where a
  user's words begin, samples the user turn itself, and then answers it
  (ids "self-0", "self-1", ...). A chat model's own questions follow the
  distribution its chat training gave it, so a chat target gets chat data
  without a dataset download.

User turns are deduplicated (after collapsing whitespace and case) and
length-filtered by token count; a self-written user turn must also end
within ``self_instruct_max_tokens``. Prompts of known evaluation sets and of
the run's own evaluation file are refused (`specgraft.train.heldout`).

The target runs in process, through specgraft's scheduler (``batch_size``
rows, a row refilled as soon as its reply ends; HF `generate` in batches for
a target without the fast path), or behind an OpenAI-compatible server
(``endpoint``, `specgraft.train.endpoint`: vLLM, SGLang, `specgraft serve`),
``concurrency`` requests in flight. Each record's rounds run one after
another.

Output is a jsonl of records in `specgraft.train.data`'s normalised form,
appended and flushed record by record, so
`load_records` reads it back and an interrupted run resumes where it
stopped: a record is in the file whole or not at all.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Sequence

import torch

from specgraft.model import Target
from specgraft.progress import progress_bar
from specgraft.train.data import detect_format, has_chat_template, normalize_record, prompt_ids
from specgraft.train.endpoint import EndpointClient, Sampling, request_seed
from specgraft.train.heldout import HeldOut, normalize

log = logging.getLogger(__name__)

# Self-written user turns sampled per conversation wanted, at most: a target that keeps repeating
# itself (duplicates) or rambling (unfinished turns) stops the run short, with a warning, not forever.
SELF_INSTRUCT_ATTEMPTS = 4
SELF_INSTRUCT_PREFIX = "self-"


@dataclass
class RegenerateSummary:
    """What one run did, by record.

    written: records added; skipped: already in the file (resume); too_long: no room in the
    context; duplicates: a user turn seen before; filtered: a user turn outside the token
    limits, or a self-written one that did not end within its limit.
    """

    path: Path
    written: int = 0
    skipped: int = 0
    too_long: int = 0
    duplicates: int = 0
    filtered: int = 0
    job_ids: list[str] = field(default_factory=list)  # every input's id in input order (all ranks'), for merging


# A model's generation_config may carry sampling defaults (top_k=50 is HF's
# global one; some models add repetition penalties). Self-distillation samples
# the target's own distribution, so every such knob is set to its no-op here.
_NEUTRAL = dict(repetition_penalty=1.0, no_repeat_ngram_size=0, min_new_tokens=0)
_NEUTRAL_SAMPLING = dict(top_k=0, min_p=0.0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0)


def regenerate(
    target: Target,
    records_or_prompts: Iterable[dict | str],
    out_path: str | Path,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    batch_size: int = 16,
    max_len: int | None = None,
    seed: int = 0,
    resume: bool = True,
    num_from_bos: int = 0,
    self_instruct: int = 0,
    self_instruct_max_tokens: int = 128,
    min_user_tokens: int = 1,
    max_user_tokens: int | None = None,
    dedupe: bool = True,
    held_out: HeldOut | None = None,
    max_prompts: int | None = None,
    progress: bool = True,
    endpoint: EndpointClient | None = None,
    concurrency: int = 16,
    rank: int = 0,
    world_size: int = 1,
) -> RegenerateSummary:
    """Write the target's own replies / continuations for every input to ``out_path`` (jsonl).

    Args:
        target: the frozen target; needs a tokenizer.
        records_or_prompts: raw or normalised records (any `load_records`
            format) or prompt strings (ids "0", "1", ... by position).
        max_new_tokens: most tokens per reply or continuation; generation also stops at EOS.
        temperature: sampling temperature; 0 means greedy.
        top_p: nucleus sampling threshold (1.0 = off).
        batch_size: rows generating at once in process.
        max_len: in process, most tokens (prompt + reply) of one row (KV for every row is allocated up front);
            None: the target's context, at most `DEFAULT_MAX_LEN`. A round that does not fit ends its record
            at its last reply (a record with none is counted ``too_long``).
        seed: of every request's sampler (with the record's id and round), and of HF `generate`'s run
            (the caller's RNG state is left as it was).
        resume: skip ids already in ``out_path`` (a truncated last line from a
            crash is removed); False starts the file afresh.
        num_from_bos: extra samples from BOS alone.
        self_instruct: conversations to add whose user turn the target writes
            itself (needs a chat template and temperature > 0).
        self_instruct_max_tokens: most tokens of a self-written user turn; one
            that has not ended by then is dropped (counted in ``filtered``).
        min_user_tokens, max_user_tokens: a record with a user turn outside
            these token counts is dropped (None: no upper limit).
        dedupe: drop a record whose user turns repeat an earlier record's
            (or one already in ``out_path``).
        held_out: evaluation prompts that must not be trained on; None: only
            the known evaluation sets of `specgraft.train.heldout`.
        max_prompts: answer only the first this many inputs that pass the
            filters (a CPU-sized slice of a large prompt file); None: all.
        progress: show progress (`specgraft.progress`).
        endpoint: generate through this OpenAI-compatible server instead of ``target.model`` (which is then
            not called: the target's tokenizer, context length and stop ids are all regeneration reads).
        concurrency: with ``endpoint``, requests in flight (``batch_size`` is then unused).
        rank, world_size: this process's slice of the inputs (rank, rank + world_size, ...) and share of
            ``self_instruct``, written to `shard_path` (ids of self-instructed records carry the rank); once
            every rank is done, one process calls `merge_shards`.

    Raises:
        ValueError: bad sampling settings, no tokenizer, no BOS for
            ``num_from_bos``, no chat template for ``self_instruct``, duplicate
            ids, an evaluation prompt among the inputs, or a corrupt line
            before the end of ``out_path``.
    """
    _check_settings(target, max_new_tokens, temperature, top_p, batch_size, num_from_bos)
    _check_self_instruct(target, self_instruct, self_instruct_max_tokens, temperature, min_user_tokens, max_user_tokens)
    if max_prompts is not None and max_prompts < 0:
        raise ValueError(f"max_prompts={max_prompts} must be >= 0")
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency} must be at least 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    out_path = Path(out_path)
    gate = _UserTurns(target.tokenizer, min_user_tokens, max_user_tokens, dedupe, held_out or HeldOut())
    summary = RegenerateSummary(path=out_path)
    jobs = _jobs(target, records_or_prompts, num_from_bos, gate, summary, max_prompts)  # refuses evaluation prompts
    summary.job_ids = [job.id for job in jobs]
    write_path, self_prefix = out_path, SELF_INSTRUCT_PREFIX
    if world_size > 1:  # this rank's slice, into its own shard; `merge_shards` joins them
        jobs, write_path = jobs[rank::world_size], shard_path(out_path, rank, world_size)
        self_prefix = f"{SELF_INSTRUCT_PREFIX}r{rank}-"
        self_instruct = self_instruct // world_size + int(rank < self_instruct % world_size)
    if not resume:
        out_path.unlink(missing_ok=True)
        write_path.unlink(missing_ok=True)
    done = _finished_ids(write_path) | _finished_ids(out_path, repair=rank == 0)
    if dedupe:  # self-written user turns are random: compare them with those of earlier runs too
        gate.remember(_existing_user_turns(out_path) + (_existing_user_turns(write_path) if world_size > 1 else []))
    pending = [job for job in jobs if job.id not in done]
    summary.skipped = len(jobs) - len(pending)
    self_done = sum(1 for i in done if i.startswith(self_prefix) and i[len(self_prefix):].isdigit())
    self_wanted = max(self_instruct - self_done, 0)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    settings = _generation_settings(target, max_new_tokens, temperature, top_p)
    total = len(jobs) + max(self_instruct, self_done)
    with (
        write_path.open("a", encoding="utf-8") as out,
        progress_bar(total=total, initial=summary.skipped + self_done, desc="regenerate", unit="rec", enabled=progress) as bar,
        torch.random.fork_rng(devices=_rng_devices(target.device), device_type=target.device.type),
    ):
        torch.manual_seed(seed + rank)  # HF generate's sampling; the other runners seed each request by its record

        def write(job: _Job) -> int:
            return _write([job], target.tokenizer, out, summary)

        def input_done(job: _Job) -> None:
            write(job)
            bar.update(1)  # written or dropped

        runner = _runner(target, settings, seed, batch_size, max_len, endpoint, concurrency)
        queue = iter(pending)
        runner.run(lambda: next(queue, None), input_done)
        if self_wanted:
            _self_instruct(
                runner, target, self_wanted, self_instruct_max_tokens, gate, done, write, bar, summary, self_prefix
            )
    return summary


def _write(batch: Sequence["_Job"], tokenizer, out, summary: RegenerateSummary) -> int:
    """Append the finished records of ``batch`` and count the others by why they were dropped; returns records written."""
    written = 0
    for job in batch:
        record = job.result(tokenizer)
        if record is None:
            reason = job.dropped or "too_long"  # a job stopped for lack of context says nothing else
            setattr(summary, reason, getattr(summary, reason) + 1)
            continue
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
        written += 1
    out.flush()
    summary.written += written
    return written


def _self_instruct(
    runner: "_Runner",
    target: Target,
    wanted: int,
    user_limit: int,
    gate: "_UserTurns",
    done: set[str],
    write: Callable[["_Job"], int],
    bar: Any,
    summary: RegenerateSummary,
    id_prefix: str = SELF_INSTRUCT_PREFIX,
) -> None:
    """Add ``wanted`` self-instructed conversations: a new one starts whenever a slot is free while the written
    and open ones are fewer than ``wanted`` (never an answer written in vain), under an attempt cap."""
    prefix, end_of_turn = user_turn_prefix(target.tokenizer)
    fresh_ids = (f"{id_prefix}{k}" for k in itertools.count() if f"{id_prefix}{k}" not in done)
    cap = wanted * SELF_INSTRUCT_ATTEMPTS
    count = {"sampled": 0, "written": 0, "open": 0}

    def next_job() -> _Job | None:  # asked again whenever a slot frees up: a dropped turn is sampled again
        if count["written"] + count["open"] >= wanted or count["sampled"] >= cap:
            return None
        count["sampled"] += 1
        count["open"] += 1
        return _SelfInstructJob(next(fresh_ids), prefix, end_of_turn, user_limit, gate)

    def ended(job: _Job) -> None:
        count["open"] -= 1
        written = write(job)
        count["written"] += written
        bar.update(written)

    runner.run(next_job, ended)
    if count["written"] < wanted:
        log.warning(
            "self_instruct: %d conversations short after sampling %d user turns (%d duplicates, %d outside the "
            "token limits or unfinished); a higher temperature or a longer self_instruct_max_tokens gives more",
            wanted - count["written"], count["sampled"], summary.duplicates, summary.filtered,
        )


def _check_settings(
    target: Target, max_new_tokens: int, temperature: float, top_p: float, batch_size: int, num_from_bos: int
) -> None:
    if target.tokenizer is None:
        raise ValueError(f"target {target.name!r} has no tokenizer; regeneration reads and writes text")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 is greedy)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    if num_from_bos < 0:
        raise ValueError(f"num_from_bos={num_from_bos} must be >= 0")
    if num_from_bos and target.tokenizer.bos_token_id is None:
        raise ValueError(f"num_from_bos={num_from_bos} needs a BOS token, and {target.name!r}'s tokenizer has none")


def _check_self_instruct(
    target: Target, count: int, user_limit: int, temperature: float, min_user: int, max_user: int | None
) -> None:
    if count < 0:
        raise ValueError(f"self_instruct={count} must be >= 0")
    if user_limit < 1:
        raise ValueError(f"self_instruct_max_tokens={user_limit} must be at least 1")
    if min_user < 1 or (max_user is not None and max_user < min_user):
        raise ValueError(f"min_user_tokens={min_user} and max_user_tokens={max_user}: need 1 <= min <= max")
    if not count:
        return
    if temperature == 0:
        raise ValueError(f"self_instruct={count} needs temperature > 0: greedy decoding writes one user turn only")
    if not has_chat_template(target.tokenizer):
        raise ValueError(
            f"self_instruct={count} needs a chat template (the target writes its user turn after the template's "
            f"user prefix), and {target.name!r}'s tokenizer has none"
        )


# ---------------------------------------------------------------- user turns


class _UserTurns:
    """The gate every user turn passes: not an evaluation prompt, within the token limits, not seen before."""

    def __init__(self, tokenizer, min_tokens: int, max_tokens: int | None, dedupe: bool, held_out: HeldOut) -> None:
        self.tokenizer = tokenizer
        self.min_tokens, self.max_tokens = min_tokens, max_tokens
        self.dedupe = dedupe
        self.held_out = held_out
        self.seen: set[tuple[str, ...]] = set()

    def remember(self, keys: Iterable[tuple[str, ...]]) -> None:
        self.seen.update(keys)

    def admit(self, turns: Sequence[str]) -> str | None:
        """None when a record with these user turns is kept (and remembered); else "duplicates" or "filtered"."""
        for turn in turns:
            n = len(self.tokenizer(turn, add_special_tokens=False)["input_ids"])
            if n < self.min_tokens or (self.max_tokens is not None and n > self.max_tokens):
                return "filtered"
        key = tuple(normalize(t) for t in turns)
        if self.dedupe:
            if key in self.seen:
                return "duplicates"
            self.seen.add(key)
        return None


def user_turn_prefix(tokenizer) -> tuple[list[int], str]:
    """The chat template up to where a user's words begin (token ids), and the text that ends a user turn.

    Found by rendering a one-turn conversation around a marker, so any template
    works, default system prompt included: for ChatML that is
    ``<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n`` and ``<|im_end|>``.
    """
    marker = "\x00USER\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    before, found, after = text.partition(marker)
    if not found or not before:
        raise ValueError("the chat template does not render the user's words after a prefix; self_instruct cannot use it")
    ids = list(tokenizer(before, add_special_tokens=False)["input_ids"])  # the template carries its own BOS
    return ids, after.strip() or after  # a turn closed by a bare newline ends at that newline


# ---------------------------------------------------------------- jobs


@dataclass
class _TextJob:
    """A continuation of ``prompt`` (token ids); done after one generation."""

    id: str
    prompt: list[int]
    reply: list[int] | None = None
    stopped: bool = False
    dropped: str | None = None

    def next_prompt(self, tokenizer) -> list[int] | None:
        return None if self.reply is not None or self.stopped else self.prompt

    def token_limit(self, max_new_tokens: int) -> int:
        return max_new_tokens

    def next_messages(self) -> list[dict] | None:
        return None  # a continuation is a completion, never a chat turn

    def take(self, reply: list[int], tokenizer) -> None:
        self.reply = reply

    def result(self, tokenizer) -> dict | None:
        if self.reply is None:
            return None
        return {"id": self.id, "text": tokenizer.decode(self.prompt + self.reply, skip_special_tokens=True)}


@dataclass
class _ChatJob:
    """A conversation whose assistant turns (None slots in ``turns``) are written one per round."""

    id: str
    turns: list[dict | None]
    stopped: bool = False
    dropped: str | None = None

    def _next_slot(self) -> int | None:
        return next((i for i, turn in enumerate(self.turns) if turn is None), None)

    def next_prompt(self, tokenizer) -> list[int] | None:
        slot = self._next_slot()
        return None if slot is None or self.stopped else prompt_ids(self.turns[:slot], tokenizer)

    def token_limit(self, max_new_tokens: int) -> int:
        return max_new_tokens

    def next_messages(self) -> list[dict] | None:
        """The conversation so far, for an endpoint's chat route (`next_prompt` is the same, templated)."""
        return self.turns[: self._next_slot()]

    def take(self, reply: list[int], tokenizer) -> None:
        content = tokenizer.decode(reply, skip_special_tokens=True).strip()
        self.turns[self._next_slot()] = {"role": "assistant", "content": content}

    def result(self, tokenizer) -> dict | None:
        """The conversation up to its last written reply (later turns are dropped if the context ran out)."""
        slot = self._next_slot()
        turns = self.turns if slot is None else self.turns[:slot]
        replies = [i for i, turn in enumerate(turns) if turn["role"] == "assistant"]
        if not replies:
            return None
        return {"id": self.id, "messages": turns[: replies[-1] + 1]}


@dataclass
class _SelfInstructJob:
    """Magpie: round 1 samples a user turn after the template's user prefix, round 2 answers it."""

    id: str
    prefix: list[int]
    end_of_turn: str  # the template's text after a user turn (ChatML: <|im_end|>); cut from the sample
    user_limit: int
    gate: _UserTurns
    user: str | None = None
    reply: str | None = None
    stopped: bool = False
    dropped: str | None = None

    def next_prompt(self, tokenizer) -> list[int] | None:
        if self.stopped or self.reply is not None:
            return None
        if self.user is None:
            return self.prefix
        return prompt_ids([{"role": "user", "content": self.user}], tokenizer)

    def token_limit(self, max_new_tokens: int) -> int:
        return self.user_limit if self.user is None else max_new_tokens

    def next_messages(self) -> list[dict] | None:
        """The user turn for the chat route once it is written; before, a completion at the template's prefix."""
        return None if self.user is None else [{"role": "user", "content": self.user}]

    def take(self, reply: list[int], tokenizer) -> None:
        text = tokenizer.decode(reply, skip_special_tokens=True)
        if self.user is not None:
            self.reply = text.strip()
            return
        # Generation stops at EOS (cut off already, so the reply is shorter than the limit) or, for a
        # template whose end of turn is plain text, at that text: either way the user turn ended.
        ended = len(reply) < self.user_limit
        if self.end_of_turn and self.end_of_turn in text:
            text, ended = text.partition(self.end_of_turn)[0], True
        text = text.strip()
        self.dropped = "filtered" if not ended or not text else self.gate.admit([text])
        if self.dropped is None:
            self.user = text
        else:
            self.stopped = True

    def result(self, tokenizer) -> dict | None:
        if self.reply is None:
            return None
        return {"id": self.id, "messages": [{"role": "user", "content": self.user}, {"role": "assistant", "content": self.reply}]}


_Job = _TextJob | _ChatJob | _SelfInstructJob


def _jobs(
    target: Target,
    inputs: Iterable[dict | str],
    num_from_bos: int,
    gate: _UserTurns,
    summary: RegenerateSummary,
    max_prompts: int | None = None,
) -> list[_Job]:
    """One job per input, in order: evaluation prompts are refused; duplicates and out-of-limit user turns
    are counted and left out (the same ones on every run, so resuming sees the same jobs)."""
    tokenizer = target.tokenizer
    jobs: list[_Job] = []
    for index, item in enumerate(inputs):
        if max_prompts is not None and len(jobs) == max_prompts:
            break
        if isinstance(item, str):
            record = {"id": str(index), "text": item}
        else:
            fmt = detect_format(item)
            if fmt is None:
                raise ValueError(f"input {index}: cannot tell the format (keys: {sorted(item)})")
            try:
                record = normalize_record(item, fmt, index=index)
            except ValueError as err:
                raise ValueError(f"input {index}: {err}") from None
        turns = [record["text"]] if "text" in record else [m["content"] for m in record["messages"] if m["role"] == "user"]
        for turn in turns:
            gate.held_out.check(turn, f"input {index} (id {record['id']!r})")
        dropped = gate.admit(turns) if turns else None
        if dropped is not None:
            setattr(summary, dropped, getattr(summary, dropped) + 1)
            continue
        if "text" in record:
            jobs.append(_TextJob(record["id"], target.encode(record["text"])))
        else:
            jobs.append(_ChatJob(record["id"], _reply_plan(record["messages"])))
    jobs += [_TextJob(f"bos-{k}", [tokenizer.bos_token_id]) for k in range(num_from_bos)]
    _check_unique([job.id for job in jobs])
    return jobs


def _reply_plan(messages: Sequence[dict]) -> list[dict | None]:
    """System and user turns kept; a None slot after each user turn for the reply the target will write."""
    plan: list[dict | None] = []
    for message in messages:
        if message["role"] == "assistant":
            continue
        plan.append(dict(message))
        if message["role"] == "user":
            plan.append(None)
    return plan


def _check_unique(ids: list[str]) -> None:
    seen: dict[str, int] = {}
    for position, job_id in enumerate(ids):
        if job_id in seen:
            raise ValueError(
                f"id {job_id!r} appears twice (inputs {seen[job_id]} and {position}); resume needs unique ids"
            )
        seen[job_id] = position


# ---------------------------------------------------------------- shards


def shard_path(out_path: str | Path, rank: int, world_size: int) -> Path:
    """Where rank ``rank`` of ``world_size`` writes its slice of ``out_path``'s records."""
    out_path = Path(out_path)
    return out_path.with_name(f"{out_path.name}.rank{rank}-of-{world_size}")


def merge_shards(out_path: str | Path, world_size: int, order: Sequence[str], dedupe: bool = False) -> int:
    """Append every shard's records missing from ``out_path`` in input order (``order``: the inputs' ids;
    self-instructed ones follow, by rank), then delete the shards. Returns the records appended.

    ``dedupe``: leave out a record whose user turns repeat an earlier one's. Each rank dedupes its own, and
    the inputs were deduped before they were split, so what remains are self-written turns two ranks both
    sampled; a rerun writes their replacements.

    Run by one process after every rank has finished. A crash part-way leaves the shards in place, and a
    rerun appends only what is still missing, so no record is lost or written twice.
    """
    out_path = Path(out_path)
    have = _finished_ids(out_path)
    position = {job_id: i for i, job_id in enumerate(order)}
    shards = [shard_path(out_path, rank, world_size) for rank in range(world_size)]
    found = []
    for rank, shard in enumerate(shards):
        _finished_ids(shard)  # repairs a torn last line
        if not shard.exists():
            continue
        for line in shard.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            if (record_id := str(record["id"])) not in have:
                have.add(record_id)
                found.append((position.get(record_id, len(order)), rank, len(found), line, _user_key(record)))
    kept, seen = [], set(_existing_user_turns(out_path)) if dedupe else None
    for *_, line, key in sorted(found):
        if seen is not None and key:
            if key in seen:
                continue
            seen.add(key)
        kept.append(line)
    if len(kept) < len(found):
        log.info("merge: %d records repeated another rank's user turns and were left out", len(found) - len(kept))
    with out_path.open("a", encoding="utf-8") as out:
        out.writelines(line + "\n" for line in kept)
        out.flush()
        os.fsync(out.fileno())
    for shard in shards:
        shard.unlink(missing_ok=True)
    return len(kept)


# ---------------------------------------------------------------- resume


def _existing_user_turns(path: Path) -> list[tuple[str, ...]]:
    """Dedupe keys of the records already in ``path`` (called after `_finished_ids` has repaired it)."""
    if not path.exists():
        return []
    keys = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a torn last line another process has still to repair
            continue
        if key := _user_key(record):
            keys.append(key)
    return keys


def _user_key(record: dict) -> tuple[str, ...]:
    """A written record's dedupe key: its user turns, normalised (empty for a text record)."""
    return tuple(normalize(m["content"]) for m in record.get("messages") or () if m.get("role") == "user")


def _finished_ids(path: Path, repair: bool = True) -> set[str]:
    """Ids already written to ``path``; a torn last line (a crash mid-write) is cut off the file (``repair``;
    else it is only left out: the file is another process's to repair)."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    complete, _, tail = data.rpartition(b"\n")
    ids = set()
    for number, line in enumerate(complete.split(b"\n") if complete else [], start=1):
        if line.strip():
            ids.add(_line_id(path, number, line))
    if tail.strip() and not repair:
        return ids
    if tail.strip():
        try:
            ids.add(_line_id(path, complete.count(b"\n") + 2 if complete else 1, tail))
            with path.open("ab") as out:
                out.write(b"\n")  # the record is whole, only its newline was lost
        except ValueError:
            with path.open("r+b") as out:
                out.truncate(len(data) - len(tail))
    return ids


def _line_id(path: Path, number: int, line: bytes) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path}: line {number} is not valid JSON ({err}); only a torn last line is repaired"
        ) from None
    if not isinstance(record, dict) or record.get("id") is None:
        raise ValueError(f"{path}: line {number} has no 'id'; is this a regenerate output file?")
    return str(record["id"])


# ---------------------------------------------------------------- generation


@dataclass
class _Settings:
    max_new_tokens: int
    max_context: int
    pad_id: int
    eos_ids: tuple[int, ...]
    kwargs: dict = field(default_factory=dict)  # HF generate's
    sampling: Sampling = field(default_factory=lambda: Sampling(temperature=1.0))  # an endpoint's


def _generation_settings(target: Target, max_new_tokens: int, temperature: float, top_p: float) -> _Settings:
    tokenizer = target.tokenizer
    # The model's stop ids (chat models list their end-of-turn token there) and the tokenizer's EOS.
    stops = [*target.eos_token_ids, tokenizer.eos_token_id]
    eos_ids = tuple(dict.fromkeys(i for i in stops if i is not None))
    # Padded positions are masked out, so any id works; the tokenizer's own pad, else EOS, else BOS, else 0.
    pad_id = next((i for i in (tokenizer.pad_token_id, *eos_ids, tokenizer.bos_token_id) if i is not None), 0)
    kwargs = dict(_NEUTRAL, max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=list(eos_ids) or None)
    if temperature == 0:
        kwargs.update(do_sample=False)
    else:
        kwargs.update(_NEUTRAL_SAMPLING, do_sample=True, temperature=temperature, top_p=top_p)
    return _Settings(max_new_tokens, target.max_context, pad_id, eos_ids, kwargs, Sampling(temperature, top_p))


def _next_round(job: _Job, tokenizer, settings: _Settings, room: int) -> tuple[list[int], int] | None:
    """The job's next prompt and its token limit; None when the job is done, or stopped for want of ``room``."""
    prompt = job.next_prompt(tokenizer)
    if prompt is None:
        return None
    limit = job.token_limit(settings.max_new_tokens)
    if len(prompt) + limit > room:
        job.stopped = True
        return None
    return prompt, limit


def _run_batch(target: Target, batch: Sequence[_Job], settings: _Settings) -> None:
    """Generate rounds until every job in the batch is done (a conversation takes one round per reply).

    Within a round, jobs are grouped by their token limit (a self-written user
    turn is shorter than a reply), one `generate` call per group.
    """
    while True:
        groups: dict[int, tuple[list[_Job], list[list[int]]]] = {}
        for job in batch:
            if (request := _next_round(job, target.tokenizer, settings, settings.max_context)) is not None:
                active, prompts = groups.setdefault(request[1], ([], []))
                active.append(job)
                prompts.append(request[0])
        if not groups:
            return
        for limit, (active, prompts) in groups.items():
            for job, reply in zip(active, _generate_batch(target, prompts, settings, limit)):
                job.take(reply, target.tokenizer)


def _generate_batch(
    target: Target, prompts: Sequence[Sequence[int]], settings: _Settings, max_new_tokens: int | None = None
) -> list[list[int]]:
    """New token ids per prompt, cut before the first EOS (padding after it goes too).

    Prompts are left-padded with an attention mask; HF `generate` derives
    position ids from the mask, so a padded row reads the same positions and
    keys as it would alone.
    """
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), settings.pad_id, dtype=torch.long)  # (B, S)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # (B, S)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    kwargs = settings.kwargs if max_new_tokens is None else {**settings.kwargs, "max_new_tokens": max_new_tokens}
    out = target.model.generate(
        input_ids=input_ids.to(target.device), attention_mask=attention_mask.to(target.device), **kwargs
    )  # (B, S + new)
    return [_until_eos(row, settings.eos_ids) for row in out[:, width:].tolist()]


def _until_eos(ids: list[int], eos_ids: Sequence[int]) -> list[int]:
    for i, token in enumerate(ids):
        if token in eos_ids:
            return ids[:i]
    return ids


def _rng_devices(device: torch.device) -> list[int]:
    """Accelerator RNGs to fork besides the CPU's (none on CPU)."""
    if device.type == "cpu":
        return []
    return [device.index if device.index is not None else 0]


# ---------------------------------------------------------------- runners


class _Runner(Protocol):
    def run(self, next_job: Callable[[], _Job | None], finished: Callable[[_Job], None]) -> None:
        """Jobs from ``next_job`` (None: none wanted now) to their ends, calling ``finished(job)`` as each ends, in
        the calling thread; a free slot asks ``next_job`` again, and the run ends when nothing is left running."""


def _runner(
    target: Target,
    settings: _Settings,
    seed: int,
    batch_size: int,
    max_len: int | None,
    endpoint: EndpointClient | None,
    concurrency: int,
) -> _Runner:
    """An endpoint's server; else specgraft's scheduler; else, for a target without the fast path (whose
    scheduler rows would run one by one), HF `generate` in batches."""
    if endpoint is not None:
        return _Remote(endpoint, target.tokenizer, settings, seed, concurrency)
    if target.fast is not None:
        return _Local(target, settings, seed, batch_size, max_len)
    return _Batched(target, settings, batch_size)


class _Local:
    """specgraft's own scheduler, ``batch_size`` rows: a row whose reply ends takes the next round or job at once
    (HF `generate` holds a batch until its longest row ends).

    Each request is seeded by its record and round, as an endpoint's are, so a record's sample does not depend
    on which rows share its steps (or on the rank that writes it). A row holds ``max_len`` tokens (default:
    the target's context, at most `DEFAULT_MAX_LEN`), allocated up front.
    """

    def __init__(self, target: Target, settings: _Settings, seed: int, batch_size: int, max_len: int | None) -> None:
        from specgraft.infer.scheduler import DEFAULT_MAX_LEN, Scheduler

        self.room = min(settings.max_context, max_len or DEFAULT_MAX_LEN)
        self.scheduler = Scheduler(target, max_batch_size=batch_size, max_len=self.room)
        self.tokenizer, self.settings, self.seed, self.batch_size = target.tokenizer, settings, seed, batch_size

    def run(self, next_job: Callable[[], _Job | None], finished: Callable[[_Job], None]) -> None:
        from specgraft.infer.events import Failed, Finished

        running: dict[int, tuple[_Job, int]] = {}  # scheduler handle -> (job, round)
        sampling = self.settings.sampling

        def advance(job: _Job, round_: int) -> None:
            request = _next_round(job, self.tokenizer, self.settings, self.room)
            if request is None:
                finished(job)
                return
            prompt, limit = request
            handle = self.scheduler.submit(
                prompt, limit, temperature=sampling.temperature, top_p=sampling.top_p,
                seed=request_seed(self.seed, job.id, round_), eos_token_id=self.settings.eos_ids,
            )
            running[handle] = (job, round_)

        def fill() -> None:
            while len(running) < self.batch_size and (job := next_job()) is not None:
                advance(job, 0)

        fill()
        while running:
            for event in self.scheduler.step():
                if isinstance(event, Failed):
                    raise event.error
                if isinstance(event, Finished):
                    job, round_ = running.pop(event.handle)
                    job.take(_until_eos(event.output.token_ids, self.settings.eos_ids), self.tokenizer)
                    advance(job, round_ + 1)
            fill()


class _Batched:
    """HF `generate`, ``batch_size`` jobs at a time, each batch run to its end (every round of every job)."""

    def __init__(self, target: Target, settings: _Settings, batch_size: int) -> None:
        self.target, self.settings, self.batch_size = target, settings, batch_size

    def run(self, next_job: Callable[[], _Job | None], finished: Callable[[_Job], None]) -> None:
        while batch := list(itertools.islice(iter(next_job, None), self.batch_size)):
            _run_batch(self.target, batch, self.settings)
            for job in batch:
                finished(job)


# ---------------------------------------------------------------- through an endpoint


class _Remote:
    """Runs jobs through an endpoint, ``concurrency`` requests in flight.

    Worker threads only send requests; every job's own logic (its next prompt,
    taking a reply, the user-turn gate, the tokenizer) runs in the calling
    thread, so nothing but the HTTP client is shared between threads.
    """

    def __init__(self, client: EndpointClient, tokenizer, settings: _Settings, seed: int, concurrency: int) -> None:
        self.client, self.tokenizer, self.settings = client, tokenizer, settings
        self.seed, self.concurrency = seed, concurrency
        self.chat = has_chat_template(tokenizer)

    def run(self, next_job: Callable[[], _Job | None], finished: Callable[[_Job], None]) -> None:
        inflight: dict[Future, tuple[_Job, int]] = {}
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="regenerate")

        def advance(job: _Job, round_: int) -> None:
            request = self._request(job)
            if request is None:
                finished(job)
                return
            call, args = request
            inflight[pool.submit(call, *args, request_seed(self.seed, job.id, round_))] = (job, round_)

        def fill() -> None:
            while len(inflight) < self.concurrency and (job := next_job()) is not None:
                advance(job, 0)

        try:
            fill()
            while inflight:
                ready, _ = wait(inflight, return_when=FIRST_COMPLETED)
                for future in ready:
                    job, round_ = inflight.pop(future)
                    job.take(_until_eos(future.result(), self.settings.eos_ids), self.tokenizer)
                    advance(job, round_ + 1)
                fill()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _request(self, job: _Job) -> tuple[Callable, tuple] | None:
        """The job's next request (a bound client method and its arguments but the seed), or None when it is done."""
        request = _next_round(job, self.tokenizer, self.settings, self.settings.max_context)
        if request is None:
            return None
        prompt, limit = request
        messages = job.next_messages() if self.chat else None
        if messages is not None:
            return self.client.chat, (messages, limit, self.settings.sampling)
        return self.client.complete, (prompt, limit, self.settings.sampling)
