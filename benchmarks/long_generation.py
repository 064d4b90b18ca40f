"""Per-token cost early and late in one long generation: does any step's work grow with the output?

    python benchmarks/long_generation.py --target ../shared/models/stories260K \
        --drafter runs/eagle-stories260k/head --tokens 3000 --window 500

Runs plain decoding and each drafter for ``--tokens`` tokens (EOS disabled)
and prints the mean seconds per token over the first and the last
``--window`` tokens. Bookkeeping that re-copies or re-decodes the whole
output makes the last window slower; attention over a longer cache costs a
little more by nature. A target whose context is shorter than ``--tokens``
runs with its position limit raised (rotary positions extrapolate: the text
is meaningless past the trained context, the timing is not).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import specgraft as sg
from specgraft.heads import drafter_from_spec


def token_times(gen: sg.SpeculativeGenerator, prompt: str, tokens: int) -> list[float]:
    """Seconds per generated token: each step's time shared by the tokens it committed."""
    times: list[float] = []
    last = time.perf_counter()
    for chunk in gen.stream(prompt, max_new_tokens=tokens, eos_token_id=()):
        now = time.perf_counter()
        if chunk.token_ids:
            times.extend([(now - last) / len(chunk.token_ids)] * len(chunk.token_ids))
        last = now
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", action="append", default=[], help="drafter spec (repeatable); plain always runs")
    parser.add_argument("--tree", default="dynamic:8,6,48", help="tree for the drafters")
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--window", type=int, default=500)
    parser.add_argument("--prompt", default="Once upon a time")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    config = AutoConfig.from_pretrained(args.target)
    needed = args.tokens + 64
    if config.max_position_embeddings < needed:
        config.max_position_embeddings = needed
    model = AutoModelForCausalLM.from_pretrained(args.target, config=config, dtype=torch.float32)
    target = sg.load_target(model, tokenizer=sg.load_target(args.target).tokenizer)
    tree = sg.parse_tree_spec(args.tree)
    rows = []
    for spec in ["none", *args.drafter]:
        drafter = drafter_from_spec(spec, target)
        gen = sg.SpeculativeGenerator(target, drafter, tree=tree)
        gen.generate(args.prompt, max_new_tokens=32, eos_token_id=())  # warm-up
        times = token_times(gen, args.prompt, args.tokens)
        first = statistics.fmean(times[: args.window])
        last = statistics.fmean(times[-args.window :])
        rows.append({"drafter": spec, "tokens": len(times), "first_ms": first * 1e3, "last_ms": last * 1e3, "ratio": last / first})
    print(f"| drafter | tokens | first {args.window} ms/token | last {args.window} ms/token | last / first |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['drafter']} | {r['tokens']} | {r['first_ms']:.3f} | {r['last_ms']:.3f} | {r['ratio']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
