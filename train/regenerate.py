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
  (ids "bos-0", "bos-1", ...).

Output is a jsonl of records in `specgraft.train.data`'s normalised form,
appended and flushed batch by batch, so `load_records` reads it back and an
interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch
from tqdm.auto import tqdm

from specgraft.target import Target
from specgraft.train.data import detect_format, normalize_record, prompt_ids


@dataclass
class RegenerateSummary:
    """written: records added this run; skipped: already in the file; too_long: no room in the context."""

    path: Path
    written: int = 0
    skipped: int = 0
    too_long: int = 0


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
    seed: int = 0,
    resume: bool = True,
    num_from_bos: int = 0,
    progress: bool = True,
) -> RegenerateSummary:
    """Write the target's own replies / continuations for every input to ``out_path`` (jsonl).

    Args:
        target: the frozen target; needs a tokenizer.
        records_or_prompts: raw or normalised records (any `load_records`
            format) or prompt strings (ids "0", "1", ... by position).
        max_new_tokens: most tokens per reply or continuation; generation also stops at EOS.
        temperature: sampling temperature; 0 means greedy.
        top_p: nucleus sampling threshold (1.0 = off).
        batch_size: sequences per `generate` call.
        seed: torch seed for the whole run (the caller's RNG state is left as it was).
        resume: skip ids already in ``out_path`` (a truncated last line from a
            crash is removed); False starts the file afresh.
        num_from_bos: extra samples from BOS alone.
        progress: show a tqdm bar.

    Raises:
        ValueError: bad sampling settings, no tokenizer, no BOS for
            ``num_from_bos``, duplicate ids, or a corrupt line before the end of ``out_path``.
    """
    _check_settings(target, max_new_tokens, temperature, top_p, batch_size, num_from_bos)
    out_path = Path(out_path)
    jobs = _jobs(target, records_or_prompts, num_from_bos)
    done = _finished_ids(out_path) if resume else set()
    if not resume:
        out_path.unlink(missing_ok=True)
    pending = [job for job in jobs if job.id not in done]
    summary = RegenerateSummary(path=out_path, skipped=len(jobs) - len(pending))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    settings = _generation_settings(target, max_new_tokens, temperature, top_p)
    with (
        out_path.open("a", encoding="utf-8") as out,
        tqdm(total=len(jobs), initial=summary.skipped, desc="regenerate", unit="rec", disable=not progress) as bar,
        torch.random.fork_rng(devices=_rng_devices(target.device), device_type=target.device.type),
    ):
        torch.manual_seed(seed)
        for start in range(0, len(pending), batch_size):
            batch = pending[start : start + batch_size]
            _run_batch(target, batch, settings)
            for job in batch:
                record = job.result(target.tokenizer)
                if record is None:
                    summary.too_long += 1
                    continue
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
                summary.written += 1
            out.flush()
            bar.update(len(batch))
    return summary


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


# ---------------------------------------------------------------- jobs


@dataclass
class _TextJob:
    """A continuation of ``prompt`` (token ids); done after one generation."""

    id: str
    prompt: list[int]
    reply: list[int] | None = None
    stopped: bool = False

    def next_prompt(self, tokenizer) -> list[int] | None:
        return None if self.reply is not None or self.stopped else self.prompt

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

    def _next_slot(self) -> int | None:
        return next((i for i, turn in enumerate(self.turns) if turn is None), None)

    def next_prompt(self, tokenizer) -> list[int] | None:
        slot = self._next_slot()
        return None if slot is None or self.stopped else prompt_ids(self.turns[:slot], tokenizer)

    def take(self, reply: list[int], tokenizer) -> None:
        content = tokenizer.decode(reply, skip_special_tokens=True).strip()
        self.turns[self._next_slot()] = {"role": "assistant", "content": content}

    def result(self, tokenizer) -> dict | None:
        """The conversation up to its last written reply (later turns are dropped if the context ran out)."""
        slot = self._next_slot()
        turns = self.turns if slot is None else self.turns[:slot]
        if not any(turn["role"] == "assistant" for turn in turns):
            return None
        return {"id": self.id, "messages": turns}


def _jobs(target: Target, inputs: Iterable[dict | str], num_from_bos: int) -> list[_TextJob | _ChatJob]:
    tokenizer = target.tokenizer
    jobs: list[_TextJob | _ChatJob] = []
    for index, item in enumerate(inputs):
        if isinstance(item, str):
            jobs.append(_TextJob(str(index), target.encode(item)))
            continue
        fmt = detect_format(item)
        if fmt is None:
            raise ValueError(f"input {index}: cannot tell the format (keys: {sorted(item)})")
        try:
            record = normalize_record(item, fmt, index=index)
        except ValueError as err:
            raise ValueError(f"input {index}: {err}") from None
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


# ---------------------------------------------------------------- resume


def _finished_ids(path: Path) -> set[str]:
    """Ids already written to ``path``; a torn last line (a crash mid-write) is cut off the file."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    complete, _, tail = data.rpartition(b"\n")
    ids = set()
    for number, line in enumerate(complete.split(b"\n") if complete else [], start=1):
        if line.strip():
            ids.add(_line_id(path, number, line))
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
    kwargs: dict = field(default_factory=dict)


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
    return _Settings(max_new_tokens, target.max_context, pad_id, eos_ids, kwargs)


def _run_batch(target: Target, batch: Sequence[_TextJob | _ChatJob], settings: _Settings) -> None:
    """Generate rounds until every job in the batch is done (a conversation takes one round per reply)."""
    tokenizer = target.tokenizer
    while True:
        active, prompts = [], []
        for job in batch:
            prompt = job.next_prompt(tokenizer)
            if prompt is None:
                continue
            if len(prompt) + settings.max_new_tokens > settings.max_context:
                job.stopped = True
                continue
            active.append(job)
            prompts.append(prompt)
        if not active:
            return
        for job, reply in zip(active, _generate_batch(target, prompts, settings)):
            job.take(reply, tokenizer)


def _generate_batch(target: Target, prompts: Sequence[Sequence[int]], settings: _Settings) -> list[list[int]]:
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
    out = target.model.generate(
        input_ids=input_ids.to(target.device), attention_mask=attention_mask.to(target.device), **settings.kwargs
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
