"""Training data: read conversations and texts, tokenize them with loss masks, batch them.

Records come in four formats and leave in one normalised form:

| format     | raw record                                              | roles                        |
|------------|---------------------------------------------------------|------------------------------|
| `sharegpt` | ``{"conversations": [{"from": ..., "value": ...}]}``     | human/user, gpt/assistant, system |
| `openai`   | ``{"messages": [{"role": ..., "content": ...}]}``        | user, assistant, system      |
| `turns`    | ``{"turns": ["...", ...]}`` (MT-Bench, Spec-Bench)       | every turn is a user turn    |
| `text`     | ``{"text": "..."}``                                       | none                         |
| `question` | ``{"question": "...", "answer": "..."}`` (GSM8K)          | question user, answer (optional) assistant |

Normalised: ``{"id": str, "messages": [{"role", "content"}, ...]}`` or
``{"id": str, "text": str}``. The id is the record's ``id`` (else
``question_id``, else its 0-based index in its file), always as a string so
ids from different sources compare and serialise alike. `regenerate` writes
this same form, so its output reads back here.

Loss masks align with ``input_ids``: ``loss_mask[t] == 1`` means token ``t``
is a prediction target (predicted from the tokens before it). Heads shift as
they need.

Conversations are rendered with the tokenizer's own chat template when it
has one; only the assistant turns are trained (the span from the end of the
generation prompt through the template's end-of-turn marker). Without a chat
template this plain template is used::

    {BOS, if the tokenizer adds one}system: {content}\\n
    user: {content}\\n
    assistant: {content}\\n

The generation prompt is ``assistant:`` with no trailing space (most
tokenizers attach the space to the next word, so a prompt ending in a space
asks for an unnatural token). The trained span of an assistant turn starts
right after ``assistant:`` and includes its closing newline, which plays the
part of a chat template's end-of-turn token.

A template that rewrites earlier turns once later ones follow (Qwen3 drops
old reasoning) has no single sequence with every turn as the model saw it:
`tokenize_examples` then makes one example per assistant turn.
"""

from __future__ import annotations

import logging
import random
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch

log = logging.getLogger(__name__)

FORMATS = ("sharegpt", "openai", "turns", "text", "question")
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
LOCAL_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz", ".parquet")
PLAIN_GENERATION_PROMPT = "assistant:"


class Records(list):
    """A list of normalised records that also says what was left out.

    ``skipped`` counts malformed records dropped under ``on_error="skip"``;
    ``errors`` holds their messages (file, index, what is wrong).
    """

    def __init__(self, records=(), errors: Sequence[str] = ()) -> None:
        super().__init__(records)
        self.errors = list(errors)

    @property
    def skipped(self) -> int:
        return len(self.errors)


# ---------------------------------------------------------------- reading


def load_records(
    source: str | Path, *, split: str = "train", format: str = "auto", on_error: str = "raise"
) -> Records:
    """Read every record of a local file, a folder of files, or a hub dataset, normalised.

    Args:
        source: a .json/.jsonl(.gz)/.parquet file, a folder holding such files
            (each read and detected on its own), or a hub dataset name.
        split: the hub split to read; a local file is read whole.
        format: one of `FORMATS`, or "auto" to detect each file's format from
            its first record. Under "auto", a file that starts in the
            normalised form (``messages`` or ``text``) may mix the two, as
            regenerated data does.
        on_error: "raise" stops at the first malformed record; "skip" drops
            it and counts it in ``Records.skipped`` (and logs a warning).

    Raises:
        FileNotFoundError: a local path that does not exist, or a folder without data files.
        ValueError: a malformed record, naming the file, the record index and what is wrong.
    """
    if format != "auto" and format not in FORMATS:
        raise ValueError(f"format={format!r} is not one of auto, {', '.join(FORMATS)}")
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error={on_error!r} must be 'raise' or 'skip'")
    records = Records()
    for name, rows in _read_sources(source, split):
        _normalise_file(name, rows, format, on_error, records)
    if records.skipped:
        log.warning("skipped %d malformed records from %s; first: %s", records.skipped, source, records.errors[0])
    return records


def _read_sources(source: str | Path, split: str):
    """Yield (name for errors, list of raw rows) per file, read with `datasets`."""
    import datasets

    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(LOCAL_SUFFIXES))
        if not files:
            raise FileNotFoundError(f"{path} holds no data files ({', '.join(LOCAL_SUFFIXES)})")
        for file in files:
            yield str(file), _read_local(file)
    elif path.is_file():
        yield str(path), _read_local(path)
    elif _looks_local(str(source)):
        raise FileNotFoundError(f"data source {str(source)!r} does not exist")
    else:
        yield f"{source}[{split}]", datasets.load_dataset(str(source), split=split).to_list()


def _looks_local(source: str) -> bool:
    return source.startswith((".", "/", "~")) or source.endswith(LOCAL_SUFFIXES)


def _read_local(path: Path) -> list[dict]:
    """Rows of one local file. A throwaway cache dir: a rewritten file is never served stale."""
    import datasets

    builder = "parquet" if path.name.endswith(".parquet") else "json"
    with tempfile.TemporaryDirectory(prefix="specgraft-data-") as cache:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache, keep_in_memory=True)
        return ds.to_list()


def _normalise_file(name: str, rows: list[dict], format: str, on_error: str, out: Records) -> None:
    file_format = format if format != "auto" else _first_format(rows)
    for index, row in enumerate(rows):
        try:
            fmt = file_format
            if format == "auto" and fmt in ("openai", "text"):
                fmt = "openai" if _has(row, "messages") else "text"
            if fmt is None:
                raise ValueError(f"cannot tell the format: no {_format_keys()} field (keys: {sorted(_keys(row))})")
            out.append(normalize_record(row, fmt, index=index))
        except ValueError as err:
            message = f"{name}: record {index}: {err}"
            if on_error == "raise":
                raise ValueError(message) from None
            out.errors.append(message)


def _first_format(rows: list[dict]) -> str | None:
    for row in rows:
        fmt = detect_format(row)
        if fmt is not None:
            return fmt
    return None


_FORMAT_KEYS = {"sharegpt": "conversations", "openai": "messages", "turns": "turns", "text": "text", "question": "question"}


def _format_keys() -> str:
    return "/".join(_FORMAT_KEYS.values())


def _has(row: Any, key: str) -> bool:
    """A key counts only when set: `datasets` fills keys missing from one row with None."""
    return isinstance(row, dict) and row.get(key) is not None


def _keys(row: Any) -> list[str]:
    return [k for k, v in row.items() if v is not None] if isinstance(row, dict) else []


def detect_format(record: dict) -> str | None:
    """The format a raw record is in (see `FORMATS`), or None if it has none of their fields."""
    for fmt, key in _FORMAT_KEYS.items():
        if _has(record, key):
            return fmt
    return None


def normalize_record(record: dict, format: str, *, index: int = 0) -> dict:
    """One raw record in the normalised form; ``index`` is its id when it carries none.

    Raises:
        ValueError: saying which field is missing, has the wrong type, or holds an unknown role.
    """
    if not isinstance(record, dict):
        raise ValueError(f"a record must be a JSON object, got {type(record).__name__}")
    out: dict[str, Any] = {"id": _record_id(record, index)}
    if format == "text":
        out["text"] = _field(record, "text", str)
    elif format == "turns":
        turns = _field(record, "turns", list)
        out["messages"] = [{"role": "user", "content": _string(t, f"turns[{i}]")} for i, t in enumerate(turns)]
    elif format == "question":
        out["messages"] = [{"role": "user", "content": _field(record, "question", str)}]
        if record.get("answer") is not None:
            out["messages"].append({"role": "assistant", "content": _string(record["answer"], "field 'answer'")})
    elif format == "sharegpt":
        turns = _field(record, "conversations", list)
        out["messages"] = _messages(turns, "conversations", "from", "value", SHAREGPT_ROLES)
    elif format == "openai":
        turns = _field(record, "messages", list)
        out["messages"] = _messages(turns, "messages", "role", "content", {r: r for r in ROLES})
    else:
        raise ValueError(f"format={format!r} is not one of {', '.join(FORMATS)}")
    if "messages" in out and not out["messages"]:
        raise ValueError("the conversation is empty")
    return out


def _record_id(record: dict, index: int) -> str:
    for key in ("id", "question_id"):
        if record.get(key) is not None:
            return str(record[key])
    return str(index)


def _field(record: dict, key: str, kind: type) -> Any:
    if record.get(key) is None:
        raise ValueError(f"missing field {key!r} (keys: {sorted(_keys(record))})")
    value = record[key]
    if not isinstance(value, kind):
        raise ValueError(f"field {key!r} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a string, got {type(value).__name__}")
    return value


def _messages(turns: list, key: str, role_key: str, text_key: str, roles: dict[str, str]) -> list[dict]:
    messages = []
    for i, turn in enumerate(turns):
        where = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise ValueError(f"{where} must be an object, got {type(turn).__name__}")
        if turn.get(role_key) is None or turn.get(text_key) is None:
            missing = role_key if turn.get(role_key) is None else text_key
            raise ValueError(f"{where} is missing {missing!r}")
        role = _string(turn[role_key], f"{where}.{role_key}")
        if role not in roles:
            raise ValueError(f"{where} has unknown role {role!r}; expected one of {', '.join(roles)}")
        messages.append({"role": roles[role], "content": _string(turn[text_key], f"{where}.{text_key}")})
    return messages


# ---------------------------------------------------------------- tokenizing


class HistoryRewritten(ValueError):
    """The chat template renders earlier turns differently once later ones follow (Qwen3 drops old reasoning)."""


def tokenize_record(record: dict, tokenizer, max_length: int, *, last_turn_only: bool = False) -> dict[str, list[int]]:
    """Token ids and loss mask of one normalised record, cut to ``max_length`` tokens.

    Text: every token but the first is trained (the first has nothing to be
    predicted from). Conversations: only assistant turns are trained (only
    the final one with ``last_turn_only``), found by rendering each
    conversation prefix and mapping its character span to tokens through the
    tokenizer's offsets, so a token merged across a turn boundary is still
    placed exactly.

    Raises:
        ValueError: max_length < 1, a record in neither form, or a slow
            tokenizer (no offsets).
        HistoryRewritten: a chat template that rewrites earlier turns (its
            prefixes are not prefixes of the whole); `tokenize_examples`
            splits such a conversation by turn.
    """
    if max_length < 1:
        raise ValueError(f"max_length={max_length} must be at least 1")
    if record.get("text") is not None:
        ids = list(tokenizer(record["text"])["input_ids"])
        mask = [0] + [1] * (len(ids) - 1) if ids else []
    elif record.get("messages") is not None:
        ids, mask = _tokenize_messages(record, tokenizer, last_turn_only)
    else:
        raise ValueError(
            f"record {record.get('id')!r} has neither 'messages' nor 'text'; normalise it with load_records"
        )
    return {"input_ids": ids[:max_length], "loss_mask": mask[:max_length]}


def tokenize_examples(record: dict, tokenizer, max_length: int) -> list[dict]:
    """The training examples of one record: itself, or one per assistant turn when the template rewrites history.

    Some chat templates (Qwen3's) render an earlier assistant turn without
    its reasoning once a later user turn follows, so the whole conversation
    is not one sequence the model ever sees. Each assistant turn then becomes
    its own example, ``messages[: i + 1]`` trained on turn i only: exactly
    the prompt the model reads at inference when it writes that turn, plus
    the turn. Ids become ``"{id}/{i}"``.
    """
    try:
        return [{"id": record.get("id"), **tokenize_record(record, tokenizer, max_length)}]
    except HistoryRewritten:
        pass
    messages = record["messages"]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0]
    log.info("record %r: the chat template rewrites earlier turns; split into %d examples", record.get("id"), len(turns))
    return [
        {
            "id": f"{record.get('id')}/{i}",
            **tokenize_record({**record, "messages": messages[: i + 1]}, tokenizer, max_length, last_turn_only=True),
        }
        for i in turns
    ]


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_plain(messages: Sequence[dict]) -> str:
    """The plain template of the module docstring, without BOS (the tokenizer adds it)."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


def render_conversation(messages: Sequence[dict], tokenizer, *, add_generation_prompt: bool = False) -> str:
    """The text of a conversation: the tokenizer's chat template, else the plain template."""
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
    return render_plain(messages) + (PLAIN_GENERATION_PROMPT if add_generation_prompt else "")


def prompt_ids(messages: Sequence[dict], tokenizer) -> list[int]:
    """Token ids asking for the next assistant turn after ``messages``.

    A chat template carries its own BOS in its text, so special tokens are
    not added again (as `apply_chat_template(tokenize=True)` does); the plain
    template relies on the tokenizer's own BOS behaviour.
    """
    text = render_conversation(messages, tokenizer, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=not has_chat_template(tokenizer))["input_ids"])


def _tokenize_messages(record: dict, tokenizer, last_turn_only: bool = False) -> tuple[list[int], list[int]]:
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"tokenizer {type(tokenizer).__name__} is not a fast tokenizer; loss masks need its offsets")
    messages = record["messages"]
    full = render_conversation(messages, tokenizer)
    trained = [len(messages) - 1] if last_turn_only else range(len(messages))
    spans = [_assistant_span(record, i, full, tokenizer) for i in trained if messages[i]["role"] == "assistant" and i > 0]
    enc = tokenizer(full, add_special_tokens=not has_chat_template(tokenizer), return_offsets_mapping=True)
    mask = [int(any(a < end and b > start for start, end in spans)) for a, b in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def _assistant_span(record: dict, i: int, full: str, tokenizer) -> tuple[int, int]:
    """Character span [start, end) of assistant turn ``i``: after its generation prompt, through its end marker.

    An assistant turn at index 0 answers nothing and is not trained.
    """
    before = render_conversation(record["messages"][:i], tokenizer, add_generation_prompt=True)
    through = render_conversation(record["messages"][: i + 1], tokenizer)
    for prefix, what in ((before, f"messages[:{i}] with the generation prompt"), (through, f"messages[:{i + 1}]")):
        if not full.startswith(prefix):
            raise HistoryRewritten(
                f"record {record.get('id')!r}: the chat template renders {what} as text that is not a prefix of the "
                "whole conversation (it rewrites earlier turns), so assistant spans cannot be located"
            )
    return len(before), len(through)


# ---------------------------------------------------------------- batching


def collate(examples: Sequence[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch.

    Returns input_ids (B, T) long, attention_mask (B, T) long, loss_mask (B, T)
    float with 0 on padding. Padding is masked, so its id is never a target.
    """
    if not examples:
        raise ValueError("cannot collate an empty batch")
    width = max(len(e["input_ids"]) for e in examples)
    batch = len(examples)
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)  # (B, T)
    loss_mask = torch.zeros((batch, width), dtype=torch.float32)  # (B, T)
    for row, example in enumerate(examples):
        n = len(example["input_ids"])
        if len(example["loss_mask"]) != n:
            raise ValueError(f"example {row}: {n} input_ids but {len(example['loss_mask'])} loss_mask entries")
        input_ids[row, :n] = torch.as_tensor(example["input_ids"], dtype=torch.long)
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.as_tensor(example["loss_mask"], dtype=torch.float32)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


class TokenizedDataset(torch.utils.data.Dataset):
    """Normalised records tokenized once, up front.

    Examples with no trained token (a prompt-only conversation, a text of one
    token) are dropped and counted in ``dropped``: they would only add zeros
    to a batch's loss denominator.
    """

    def __init__(self, records: Sequence[dict], tokenizer, max_length: int) -> None:
        self.examples: list[dict] = []
        self.dropped = 0
        for record in records:
            for example in tokenize_examples(record, tokenizer, max_length):
                if sum(example["loss_mask"]) == 0:
                    self.dropped += 1
                    continue
                self.examples.append(example)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict:
        return self.examples[index]


def train_eval_split(items: Sequence, eval_fraction: float, *, seed: int = 0) -> tuple[list, list]:
    """Split into (train, eval) by a seeded shuffle; each part keeps the input order.

    ``round(eval_fraction * n)`` items go to eval, at least one when the
    fraction is positive and there are two or more items.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction={eval_fraction} must be in [0, 1)")
    n = len(items)
    n_eval = round(eval_fraction * n)
    if eval_fraction > 0 and n >= 2:
        n_eval = min(max(n_eval, 1), n - 1)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    held_out = set(order[:n_eval])
    train = [item for i, item in enumerate(items) if i not in held_out]
    evaluation = [item for i, item in enumerate(items) if i in held_out]
    return train, evaluation


def subsample(items: Sequence, fraction: float, *, seed: int = 0) -> list:
    """The first ``round(fraction * n)`` items of a seeded shuffle (at least one), in their input order.

    Subsets for smaller fractions lie inside those for larger ones, so a data-scaling series trains on
    nested slices of one data set rather than on unrelated samples.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction={fraction} must be in (0, 1]")
    if fraction == 1.0:
        return list(items)
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    kept = set(order[: max(round(fraction * len(items)), 1)])
    return [item for i, item in enumerate(items) if i in kept]
