"""Benchmark prompts: the prompt sets we read (Spec-Bench / MT-bench, HumanEval, GSM8K, text) and how a
target sees a prompt (its chat template when it has one). Shared by the offline bench, `bench --server`,
`tune-tree` and quickstart.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specgraft.model import Target


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    text: str


def _open_text(path: Path):
    """Text lines of a plain or gzip file (detected by magic bytes, so a .jsonl.gz renamed still reads)."""
    with path.open("rb") as raw:
        gz = raw.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rt", encoding="utf-8") if gz else path.open(encoding="utf-8")


def _record_prompt(record: Any, where: str, number: int) -> BenchPrompt:
    """One JSON record of a known prompt set; the format is told by its keys."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "turns" in record:  # Spec-Bench / MT-bench: benchmark the first turn
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0]:
            raise ValueError(f"{where}: 'turns' must be a non-empty list of strings")
        return BenchPrompt(str(record.get("question_id", number)), str(record.get("category", "unknown")), turns[0])
    for key, category, id_key in (("prompt", "humaneval", "task_id"), ("question", "gsm8k", None), ("text", "text", "id")):
        if key in record:
            text = record[key]
            if not isinstance(text, str) or not text:
                raise ValueError(f"{where}: {key!r} must be a non-empty string")
            return BenchPrompt(str(record.get(id_key, number) if id_key else number), category, text)
    raise ValueError(
        f"{where}: unknown record format with keys {sorted(record)}; expected 'turns' (Spec-Bench / MT-bench), "
        "'prompt' (HumanEval), 'question' (GSM8K) or 'text' (training-data text records)"
    )


def read_prompt_file(path: str | Path, limit: int | None = None, per_category: int | None = None) -> list[BenchPrompt]:
    """Prompts of a Spec-Bench / MT-bench, HumanEval (.jsonl or .jsonl.gz), GSM8K or ``{"text"}`` file, or plain text.

    The format comes from the records: a file whose first non-blank line is a
    JSON object (or whose name ends in .jsonl / .jsonl.gz) is JSON lines, and
    each record's keys say which prompt set it is; anything else is plain text,
    one prompt per line. Categories come from the records ('turns' sets), or are
    'humaneval', 'gsm8k' or 'text'. ``{"id", "text"}`` records (the training
    data's text form) make calibration prompts apart from the evaluation set.
    ``per_category`` keeps the first N prompts of each category (a fixed
    subset of Spec-Bench's 13), then ``limit`` the first N of those.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a malformed line, named as FILE:LINE.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist")
    for name, value in (("limit", limit), ("per_category", per_category)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    with _open_text(path) as f:
        lines = [(n, line.rstrip("\n")) for n, line in enumerate(f, start=1) if line.strip()]
    json_lines = path.name.endswith((".jsonl", ".jsonl.gz")) or (bool(lines) and lines[0][1].lstrip().startswith("{"))
    prompts = []
    for number, line in lines if per_category else lines[:limit]:
        if not json_lines:
            prompts.append(BenchPrompt(str(number), "text", line))
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err})") from None
        prompts.append(_record_prompt(record, f"{path}:{number}", number))
    if per_category:
        taken: Counter[str] = Counter()
        kept = []
        for prompt in prompts:
            taken[prompt.category] += 1
            if taken[prompt.category] <= per_category:
                kept.append(prompt)
        prompts = kept[:limit]
    if not prompts:
        raise ValueError(f"prompts file {path} holds no prompts")
    return prompts


def encode_prompt(target: Target, text: str) -> list[int]:
    """Token ids the target sees: the user turn in its chat template when it has one, else the raw text.

    Templates carry their own special tokens, so templated text is not given
    the tokenizer's BOS a second time.
    """
    tokenizer = target.tokenizer
    if tokenizer is None:
        raise ValueError(f"target {target.name!r} has no tokenizer, so text prompts cannot be encoded")
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return [int(i) for i in ids]
    return target.encode(text)
