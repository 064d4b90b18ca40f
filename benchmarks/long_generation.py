"""Per-token cost early and late in one long generation: does any step's work grow with the output?

    python benchmarks/long_generation.py --target ../shared/models/stories260K \
        --drafter runs/eagle-stories260k/head --tokens 3000 --window 500

Runs plain decoding and each drafter for ``--tokens`` tokens (EOS disabled)
and prints the mean milliseconds per token over the first and the last
``--window`` tokens, in total and outside the model forwards (the target's
forward and the draft head's step, where attention over a longer cache costs
more by nature). Bookkeeping that re-copies or re-decodes the whole output
makes the "outside" column grow. A target whose context is shorter than ``--tokens``
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


def token_times(gen: sg.SpeculativeGenerator, prompt: str, tokens: int, stop: list[str]) -> tuple[list[float], ...]:
    """Per generated token: seconds in total, seconds outside the model forwards, and its share of a step."""
    in_model = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                in_model[0] += time.perf_counter() - start
        return wrapper

    forward = sg.Target.forward
    sg.Target.forward = timed(forward)  # the target's, and a draft model's (a Target too)
    head = getattr(gen.drafter, "head", None)
    if head is not None:
        head.draft_step = timed(type(head).draft_step.__get__(head))
    try:
        totals: list[float] = []
        outside: list[float] = []
        steps: list[float] = []
        last = time.perf_counter()
        for chunk in gen.stream(prompt, max_new_tokens=tokens, eos_token_id=(), stop=stop or None):
            now = time.perf_counter()
            n = len(chunk.token_ids)
            if n:
                totals.extend([(now - last) / n] * n)
                outside.extend([(now - last - in_model[0]) / n] * n)
                steps.extend([1 / n] * n)  # a step's tokens share it: a window's sum is its step count
            in_model[0] = 0.0
            last = now
        return totals, outside, steps
    finally:
        sg.Target.forward = forward
        if head is not None:
            del head.draft_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", action="append", default=[], help="drafter spec (repeatable); plain always runs")
    parser.add_argument("--tree", default="dynamic:8,6,48", help="tree for the drafters")
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--window", type=int, default=500)
    parser.add_argument("--prompt", default="Once upon a time")
    parser.add_argument("--stop", action="append", default=[], help="stop strings checked every token (use one that "
                        "never occurs, e.g. 'zebra!', to time the check over the whole run)")
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
        times, outside, steps = token_times(gen, args.prompt, args.tokens, args.stop)
        row = {"drafter": spec, "tokens": len(times), "tau_first": args.window / sum(steps[: args.window]),
               "tau_last": args.window / sum(steps[-args.window :]),
               "outside_per_step_first_ms": sum(outside[: args.window]) / sum(steps[: args.window]) * 1e3,
               "outside_per_step_last_ms": sum(outside[-args.window :]) / sum(steps[-args.window :]) * 1e3}
        for name, values in (("total", times), ("outside", outside)):
            first, last = statistics.fmean(values[: args.window]), statistics.fmean(values[-args.window :])
            row |= {f"{name}_first_ms": first * 1e3, f"{name}_last_ms": last * 1e3, f"{name}_ratio": last / first}
        rows.append(row)
    w = args.window
    print(f"| drafter | tokens | ms/token first {w} / last {w} | last/first | outside the forwards, ms/token "
          f"first / last | last/first | outside, ms/step first / last | tau first / last |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['drafter']} | {r['tokens']} | {r['total_first_ms']:.3f} / {r['total_last_ms']:.3f} | {r['total_ratio']:.2f} "
              f"| {r['outside_first_ms']:.3f} / {r['outside_last_ms']:.3f} | {r['outside_ratio']:.2f} "
              f"| {r['outside_per_step_first_ms']:.3f} / {r['outside_per_step_last_ms']:.3f} | {r['tau_first']:.2f} / {r['tau_last']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
