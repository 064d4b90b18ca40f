"""Where one scheduler step's time goes, at several batch sizes: draft, mask building, target forward, commits.

    python benchmarks/step_overhead.py --target ../shared/models/stories260K \
        --drafter runs/eagle-stories260k/head --tree chain:4 --batch-sizes 1,8

Each part of `Scheduler.step` is timed by wrapping the function that does it
(`Decoding.propose` and the scheduler's batched `_propose_together` for the draft phase, `batched_tree_inputs` for masks and
padding, `Target.forward_rows` / `Target.forward` for the target, and
`Decoding.commit` + `Decoding.record` for acceptance, KV commits, drafter
commits and stop rules). "other" is the step's remaining time: the
scheduler's own Python. Figures are per step, medians over steps; prefill
steps (a row joining) are left out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch

import specgraft as sg
import specgraft.infer.scheduler as scheduler_module
from specgraft.heads import drafter_from_spec
from specgraft.infer.generator import Decoding

PARTS = {  # part -> the functions whose time it sums
    "draft": [(Decoding, "propose"), (scheduler_module.Scheduler, "_propose_together")],
    "inputs+mask": [(scheduler_module, "batched_tree_inputs")],
    "forward": [(sg.Target, "forward_rows")],
    "commit": [(Decoding, "commit")],
    "stop+stats": [(Decoding, "record")],
}


def instrument(spent: dict[str, float]) -> None:
    """Wrap each part's function so its time adds up into ``spent``."""
    for part, functions in PARTS.items():
        for owner, name in functions:
            original = getattr(owner, name)

            def timed(*args, __original=original, __part=part, **kwargs):
                start = time.perf_counter()
                try:
                    return __original(*args, **kwargs)
                finally:
                    spent[__part] += time.perf_counter() - start

            setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", default="none")
    parser.add_argument("--tree", default="chain:4")
    parser.add_argument("--prompts", default="../shared/data/story_prompts_dev.jsonl")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = sg.load_target(args.target)
    prompts = [json.loads(line)["turns"][0] for line in open(args.prompts) if line.strip()]
    gen = sg.SpeculativeGenerator(target, drafter_from_spec(args.drafter, target), tree=sg.parse_tree_spec(args.tree))
    gen.generate_batch(prompts[:2], max_new_tokens=8)  # warm-up
    spent: dict[str, float] = defaultdict(float)
    instrument(spent)
    rows = []
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        sched = gen.scheduler(max_batch_size=b)
        for prompt in prompts[:b]:
            sched.submit(prompt, max_new_tokens=args.max_new_tokens, eos_token_id=())
        sched.step()  # prefills
        per_step: dict[str, list[float]] = defaultdict(list)
        while len(sched.running) == b:  # full batches only
            spent.clear()
            start = time.perf_counter()
            sched.step()
            total = time.perf_counter() - start
            for part in PARTS:
                per_step[part].append(spent[part])
            per_step["other"].append(total - sum(spent[p] for p in PARTS))
            per_step["total"].append(total)
        while not sched.idle:
            sched.step()
        row = {"batch_size": b, "steps": len(per_step["total"])}
        row.update({part: statistics.median(v) * 1e3 for part, v in per_step.items()})
        rows.append(row)
    names = [*PARTS, "other", "total"]
    print("| batch | steps | " + " | ".join(f"{n} ms" for n in names) + " | beyond forward+draft |")
    print("|---|---|" + "---|" * len(names) + "---|")
    for r in rows:
        beyond = r["total"] - r["forward"] - r["draft"]
        print(f"| {r['batch_size']} | {r['steps']} | " + " | ".join(f"{r[n]:.2f}" for n in names) + f" | {beyond:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
