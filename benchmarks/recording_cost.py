"""What recording served traffic costs: tokens/s with and without a `TrafficRecorder` on the same scheduler work.

    .venv/bin/python benchmarks/recording_cost.py --target DIR --drafter HEAD_DIR --prompts FILE \
        [--batch-sizes 1,16] [--rounds 2] [--max-new-tokens 64] [--out runs/recording-cost.json]

Each round runs, at each batch size, the same prompts greedily with the drafter (``--tree``, adaptive by default: a
fixed tree keeps the two runs' trees alike, where the adaptive one follows their timings) through one
scheduler, without and then with a recorder attached (the order alternating round to round), and times the whole
run, prefills included; the recorder writes its shards to a temporary directory. Outputs must be identical.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import specgraft as sg
from specgraft.infer import Tokens
from specgraft.specs import parse_tree
from specgraft.tools.prompts import encode_prompt, read_prompt_file
from specgraft.tree import policy_from_spec
from specgraft.train.recording import TrafficRecorder


def run(target, drafter, prompts, batch: int, new_tokens: int, recorder=None, tree=None) -> tuple[float, int, list]:
    """Seconds, generated tokens and outputs of ``prompts`` (token ids) through one scheduler of ``batch`` rows."""
    sched = sg.Scheduler(target, {"head": drafter}, max_batch_size=batch, default_drafter="head",
                         default_tree=tree or sg.Adaptive(), closed=True,
                         max_len=max(len(p) for p in prompts) + new_tokens)
    if recorder is not None:
        sched.add_observer(recorder)
    started = time.perf_counter()
    handles = [sched.submit(p, new_tokens) for p in prompts]
    out = {h: [] for h in handles}
    while not sched.idle:
        for event in sched.step():
            if isinstance(event, Tokens):
                out[event.handle].extend(event.token_ids)
    seconds = time.perf_counter() - started
    return seconds, sum(len(v) for v in out.values()), [out[h] for h in handles]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tree", default="adaptive", help="the drafter's tree (a fixed one keeps both runs' trees alike)")
    parser.add_argument("--threads", type=int, default=1, help="the engine's torch threads (default: %(default)s)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    target = sg.load_target(args.target, threads=args.threads)
    drafter = sg.load_drafter(args.drafter, target)
    tree = policy_from_spec(parse_tree(args.tree))
    prompts = [encode_prompt(target, p.text) for p in read_prompt_file(args.prompts, limit=args.limit)]
    results = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        cells = {"off": [], "on": []}
        reference = None
        for r in range(args.rounds):
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                with tempfile.TemporaryDirectory() as tmp:
                    recorder = TrafficRecorder(tmp, target, drafter.hidden_layers) if mode == "on" else None
                    seconds, tokens, outputs = run(target, drafter, prompts, batch, args.max_new_tokens, recorder, tree)
                    if recorder is not None:
                        recorder.close()
                        assert recorder.error is None, recorder.error
                reference = reference or outputs
                assert outputs == reference, "recording changed an output"
                cells[mode].append(tokens / seconds)
                print(f"batch {batch} round {r + 1} recording {mode}: {tokens / seconds:.2f} tokens/s", flush=True)
        off, on = sum(cells["off"]) / args.rounds, sum(cells["on"]) / args.rounds
        results.append({"batch": batch, "off_tokens_per_s": cells["off"], "on_tokens_per_s": cells["on"],
                        "ratio": on / off})
        print(f"batch {batch}: {off:.2f} -> {on:.2f} tokens/s with recording ({on / off:.3f}x)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
