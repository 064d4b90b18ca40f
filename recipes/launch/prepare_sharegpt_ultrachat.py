"""Write ShareGPT and UltraChat-200K as one local folder that a recipe's ``data.train`` can name.

EAGLE-3 trains on ShareGPT (~68K) + UltraChat-200K (~464K). A config's ``data.train`` is one source,
and a hub name is read with split ``train``, which UltraChat-200K lacks (its SFT split is
``train_sft``), so the two are written here to one folder, which `specgraft.train.data.load_records`
reads file by file:

    python recipes/launch/prepare_sharegpt_ultrachat.py --out runs/data/sharegpt-ultrachat
    specgraft regenerate recipes/llama3.1-8b/eagle3.yaml data.train=runs/data/sharegpt-ultrachat \\
        data.regenerate.output=runs/data/llama3.1-8b-instruct-sharegpt-ultrachat-t0.7-2048.jsonl

Each record keeps its source's format (ShareGPT ``conversations``, UltraChat ``messages``) with its id
prefixed by the source, so ids stay unique across the two (regeneration resumes by id). Regeneration
keeps only system and user turns, so the datasets' own answers do not matter. ``--first-turn-only``
keeps the first user turn (and a leading system turn) of each conversation: single-turn prompts, which
save tokens for targets whose chat template is not prefix-preserving (Qwen3: a multi-turn conversation
trains as one example per reply; see recipes/qwen3-8b/eagle3.yaml).

Sources: the dataset names and splits are SpecForge's (scripts/prepare_data.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Iterable, Iterator

SHAREGPT = ("Aeala/ShareGPT_Vicuna_unfiltered", "train")
ULTRACHAT = ("HuggingFaceH4/ultrachat_200k", "train_sft")
SHAREGPT_USER_ROLES = ("human", "user")


def sharegpt_records(rows: Iterable[dict], *, first_turn_only: bool = False, limit: int | None = None) -> Iterator[dict]:
    """ShareGPT rows as ``{"id": "sharegpt-<id>", "conversations": [...]}``; rows with no user turn are left out."""
    count = 0
    for index, row in enumerate(rows):
        if limit is not None and count >= limit:
            return
        turns = [t for t in row.get("conversations") or [] if isinstance(t, dict)]
        if first_turn_only:
            turns = _first_turn(turns, role_key="from", user_roles=SHAREGPT_USER_ROLES)
        if not any(t.get("from") in SHAREGPT_USER_ROLES for t in turns):
            continue
        count += 1
        yield {"id": f"sharegpt-{row.get('id', index)}", "conversations": turns}


def ultrachat_records(rows: Iterable[dict], *, first_turn_only: bool = False, limit: int | None = None) -> Iterator[dict]:
    """UltraChat rows as ``{"id": "ultrachat-<prompt_id>", "messages": [...]}``; rows with no user turn are left out."""
    count = 0
    for index, row in enumerate(rows):
        if limit is not None and count >= limit:
            return
        turns = [t for t in row.get("messages") or [] if isinstance(t, dict)]
        if first_turn_only:
            turns = _first_turn(turns, role_key="role", user_roles=("user",))
        if not any(t.get("role") == "user" for t in turns):
            continue
        count += 1
        yield {"id": f"ultrachat-{row.get('prompt_id', index)}", "messages": turns}


def _first_turn(turns: list[dict], *, role_key: str, user_roles: tuple[str, ...]) -> list[dict]:
    """Leading system turns and the first user turn."""
    kept = []
    for turn in turns:
        kept.append(turn)
        if turn.get(role_key) in user_roles:
            return kept
    return []


def write_jsonl(records: Iterable[dict], path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with path.open("w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            written += 1
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder to write sharegpt.jsonl and ultrachat.jsonl into")
    parser.add_argument("--first-turn-only", action="store_true", help="keep the first user turn of each conversation")
    parser.add_argument("--max-sharegpt", type=int, default=None, help="first N usable ShareGPT conversations (EAGLE used 68000)")
    parser.add_argument("--max-ultrachat", type=int, default=None, help="first N usable UltraChat conversations")
    parser.add_argument("--no-ultrachat", action="store_true", help="ShareGPT alone")
    args = parser.parse_args(argv)

    import datasets  # a project dependency; downloads on first use, cached by `datasets` afterwards

    out = Path(args.out)
    sources = [("sharegpt.jsonl", SHAREGPT, sharegpt_records, args.max_sharegpt)]
    if not args.no_ultrachat:
        sources.append(("ultrachat.jsonl", ULTRACHAT, ultrachat_records, args.max_ultrachat))
    for filename, (name, split), convert, limit in sources:
        rows = datasets.load_dataset(name, split=split)
        n = write_jsonl(convert(rows, first_turn_only=args.first_turn_only, limit=limit), out / filename)
        print(f"{name}[{split}]: {n} conversations -> {out / filename}")
    print(f"use it with: data.train={out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
