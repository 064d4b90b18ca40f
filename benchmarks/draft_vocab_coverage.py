#!/usr/bin/env python3
"""How much of the training data's target tokens an EAGLE-3 draft vocabulary of the top K tokens covers.

EAGLE-3 drafts over the K most frequent target tokens of its training data
(d2t / t2d); a token outside them can never be drafted, so coverage caps
acceptance. Counted as the trainer counts: the trained (assistant) tokens of
the tokenized records. The top K is chosen on one half of the records and
measured on the other (held-out), because in-sample coverage reaches 100% as
soon as K exceeds the distinct tokens seen.

    python benchmarks/draft_vocab_coverage.py --target ~/.cache/specgraft/models/SmolLM2-135M-Instruct \\
        --data runs/data/smollm2-135m-gsm8k-magpie.jsonl --sizes 1024 2048 4096 8192 16384
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from transformers import AutoTokenizer

from specgraft.train.data import load_records, tokenize_record


def counts(records: list[dict], tokenizer, max_length: int) -> torch.Tensor:
    """Per-token counts of the trained tokens of ``records``."""
    total = torch.zeros(len(tokenizer), dtype=torch.long)
    for record in records:
        example = tokenize_record(record, tokenizer, max_length)
        ids = torch.tensor(example["input_ids"])[torch.tensor(example["loss_mask"]).bool()]
        total += torch.bincount(ids, minlength=len(tokenizer))
    return total


def coverage(chosen_from: torch.Tensor, measured_on: torch.Tensor, k: int) -> float:
    """Fraction of ``measured_on``'s tokens among the k most frequent of ``chosen_from``."""
    top = torch.topk(chosen_from, min(k, int((chosen_from > 0).sum()))).indices  # only tokens actually seen
    return float(measured_on[top].sum() / measured_on.sum())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="model directory (its tokenizer and chat template are used)")
    parser.add_argument("--data", required=True, help="training records (e.g. the regenerate output)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32000])
    parser.add_argument("--max-length", type=int, default=512, help="data.max_length of the recipe")
    parser.add_argument("--out", default=None, help="JSON written here (default: beside --data)")
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(Path(args.target).expanduser())
    records = list(load_records(args.data))
    random.Random(0).shuffle(records)
    groups = {"all": records}
    self_written = [r for r in records if str(r["id"]).startswith("self-")]
    if 0 < len(self_written) < len(records):
        groups["self-instruct"] = self_written
        groups["prompt file"] = [r for r in records if not str(r["id"]).startswith("self-")]
    report = {"data": args.data, "records": len(records), "groups": {}}
    print("| records | tokens (choose / measure) | distinct | " + " | ".join(f"K={k}" for k in args.sizes) + " |")
    print("|---|---|---|" + "---|" * len(args.sizes))
    for name, group in groups.items():
        a, b = counts(group[::2], tokenizer, args.max_length), counts(group[1::2], tokenizer, args.max_length)
        held_out = {k: coverage(a, b, k) for k in args.sizes}
        report["groups"][name] = {
            "records": len(group), "tokens": [int(a.sum()), int(b.sum())], "distinct": int(((a + b) > 0).sum()),
            "held_out_coverage": held_out,
        }
        print(f"| {name} ({len(group)}) | {int(a.sum())} / {int(b.sum())} | {int(((a + b) > 0).sum())} | "
              + " | ".join(f"{held_out[k]:.3f}" for k in args.sizes) + " |")
    out = Path(args.out or Path(args.data).with_suffix(".coverage.json"))
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
