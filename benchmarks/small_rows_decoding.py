"""Plain decoding with each few-row product form against Hugging Face's `generate`, in one interleaved run.

    python benchmarks/small_rows_decoding.py --target ~/.cache/specgraft/models/SmolLM2-135M-Instruct \
        --prompts ../shared/data/mt_bench_question.jsonl --limit 8 --max-new-tokens 64

One model in memory, wrapped four ways: HF ``generate`` (greedy), and
specgraft's plain decoding with the few-row products pinned to ``F.linear``,
pinned to ``weight @ x.T`` (the fixed rule used before measuring), and
measured on this machine (``auto``, what `load_target` does). Each prompt (as
a chat turn when the tokenizer has a template) runs every method in turn,
the order rotating by one each prompt; the figure is the median over prompts
of new tokens / wall time, and each method's ratio to HF's from the same
prompts. Greedy outputs must all be equal. Plain decoding verifies one token
a step, so this measures the one-row products; `benchmarks/cost_curve.py
--small-rows ...` measures the 2-16 token verifications.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import specgraft as sg
from specgraft.tools.prompts import encode_prompt, read_prompt_file

FORMS = ("linear", "transposed", "auto")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--prompts", default="../shared/data/mt_bench_question.jsonl")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    base = sg.load_target(args.target, threads=args.threads, small_rows="linear")
    targets = {form: sg.load_target(base.model, tokenizer=base.tokenizer, threads=args.threads, small_rows=form)
               for form in FORMS}
    for form, target in targets.items():
        print(f"{form}: {target.small_rows.describe()}")
    prompts = [encode_prompt(base, p.text) for p in read_prompt_file(args.prompts, args.limit, None)]
    methods = {"hf": None, **{f"plain, {form}": sg.SpeculativeGenerator(t, None) for form, t in targets.items()}}
    speeds: dict[str, list[float]] = {name: [] for name in methods}
    outputs: dict[str, list[list[int]]] = {name: [] for name in methods}
    names = list(methods)
    for i, ids in enumerate(prompts):
        for name in names[i % len(names):] + names[: i % len(names)]:
            start = time.perf_counter()
            if methods[name] is None:
                x = torch.tensor([ids])
                out = base.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                          max_new_tokens=args.max_new_tokens, eos_token_id=None)
                tokens = out[0, len(ids):].tolist()
            else:
                tokens = methods[name].generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=()).token_ids
            speeds[name].append(len(tokens) / (time.perf_counter() - start))
            outputs[name].append(tokens)
    identical = all(outputs[name] == outputs["hf"] for name in names)
    rows = {name: statistics.median(v) for name, v in speeds.items()}
    print(f"greedy outputs identical: {identical}")
    print("| method | tokens/s (median) | vs HF generate |\n|---|---:|---:|")
    for name, speed in rows.items():
        print(f"| {name} | {speed:.2f} | {speed / rows['hf']:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens_per_s": rows, "per_prompt": speeds, "identical": identical,
                       "small_rows": {form: t.small_rows.to_dict() for form, t in targets.items()}}, f, indent=2)


if __name__ == "__main__":
    main()
