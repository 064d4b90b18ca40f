"""Greedy speed of the training-free drafters against HF generate, in one interleaved run.

    python benchmarks/greedy_drafters.py --target ../shared/models/stories260K \
        --prompts ../shared/data/story_prompts_dev.jsonl --max-new-tokens 128

Every method runs on every prompt in turn (after one warm-up pass), so load
on a shared machine hits them alike. Prints mean accepted length, aggregate
tokens/s (all new tokens / all wall time, prefill included, the same clock for
HF generate) and the ratio to HF generate; checks every output is identical.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers.utils import logging as hf_logging

import specgraft as sg


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--prompts", required=True, help="jsonl with 'turns' (Spec-Bench format)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()

    target = sg.load_target(args.target)
    prompts = [target.encode(json.loads(line)["turns"][0]) for line in open(args.prompts) if line.strip()]
    methods = {
        "plain": sg.SpeculativeGenerator(target, None),
        "prompt-lookup": sg.SpeculativeGenerator(target, sg.PromptLookup()),
        "draft-model(self) chain:5": sg.SpeculativeGenerator(target, sg.DraftModel(target, target), tree=sg.Chain(5)),
    }

    def hf(ids):
        out = target.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=args.max_new_tokens)
        return out[0, len(ids):].tolist(), None

    def ours(gen):
        return lambda ids: (lambda o: (o.token_ids, o.stats))(gen.generate(ids, max_new_tokens=args.max_new_tokens))

    runners = {"hf generate": hf, **{name: ours(gen) for name, gen in methods.items()}}
    for run in runners.values():  # warm-up
        run(prompts[0])
    totals = {name: [0, 0.0, 0, 0] for name in runners}  # tokens, seconds, target calls, tokens after first
    identical = True
    for ids in prompts:
        reference = None
        for name, run in runners.items():
            start = time.perf_counter()
            tokens, stats = run(ids)
            elapsed = time.perf_counter() - start
            reference = tokens if reference is None else reference
            identical &= tokens == reference
            t = totals[name]
            t[0] += len(tokens)
            t[1] += elapsed
            if stats is not None:
                t[2] += stats.target_calls
                t[3] += stats.new_tokens - 1
    hf_speed = totals["hf generate"][0] / totals["hf generate"][1]
    print(f"{'method':28s} {'tau':>6s} {'tokens/s':>9s} {'vs HF':>6s}")
    for name, (tokens, seconds, calls, after_first) in totals.items():
        tau = f"{after_first / calls:.2f}" if calls else "-"
        print(f"{name:28s} {tau:>6s} {tokens / seconds:9.1f} {tokens / seconds / hf_speed:6.2f}")
    print(f"greedy outputs identical to HF generate: {identical}")


if __name__ == "__main__":
    main()
