"""Where one scheduler step's time goes, at several batch sizes: draft, verification forward, commits, the rest.

    python benchmarks/step_overhead.py --target ../shared/models/stories260K \
        --drafter runs/eagle-stories260k/head --tree chain:4 --batch-sizes 1,16

Each part of `Scheduler.step` is read from the scheduler's step-observer hook
(`specgraft.infer.StepObserver`): ``draft`` is `Drafted.seconds` (every row's
tree, batch drafters once per drafter, the goodput controller's plan
included); ``forward`` is `Verified.forward_seconds`, the target forward(s)
that verify (packed: the tokens' concatenation and `Target.forward_packed`;
one row: its mask, positions and `Target.forward`); ``verify inputs`` is the
rest of `Verified.seconds` (segments, masks, packing); ``commit`` is
`Committed.seconds` (every row's commit: acceptance where not read for the
batch at once, KV commits, drafter commits, stop rules, stats, events).
"other" is the step's remaining time: the scheduler's own Python (the
controller's selection and the batch's one acceptance read among it).
"beyond forward+draft" is everything but the forward and the draft: the
engine's per-step cost. Figures are per step, medians over steps; prefill
steps (a row joining) are left out.

With ``--tree adaptive`` the goodput controller's work (planning, selection,
learning, its timings: every `GoodputController` call the scheduler makes)
is also timed, by wrapping those public methods. It runs inside the parts
above (planning in ``draft``, learning in ``commit``, selection in "other"),
and mostly on the steps where a row drafts, so it is reported as a mean per
step beside the medians: at batch 1 the steps without a tree would otherwise
hide it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import specgraft as sg
from specgraft.heads import drafter_from_spec
from specgraft.infer import Committed, Drafted, GoodputController, StepObserver, Verified

PARTS = ("draft", "verify inputs", "forward", "commit")
# What the scheduler asks of the goodput controller (learning runs inside `observe_step`).
CONTROLLER_CALLS = ("standing", "plan", "select", "observe_draft", "observe_step", "observe_times", "forget")


class StepParts(StepObserver):
    """Each step's parts into ``spent``, as the scheduler tells them."""

    def __init__(self, spent: dict[str, float]) -> None:
        self.spent = spent

    def drafted(self, step: Drafted) -> None:
        self.spent["draft"] += step.seconds

    def verified(self, step: Verified) -> None:
        self.spent["forward"] += step.forward_seconds
        self.spent["verify inputs"] += step.seconds - step.forward_seconds

    def committed(self, step: Committed) -> None:
        self.spent["commit"] += step.seconds


def time_the_controller(spent: dict[str, float]) -> None:
    """Wrap the goodput controller's methods the scheduler calls, so that their time adds up into ``spent``."""

    def wrap(name: str) -> None:
        original = getattr(GoodputController, name)

        def timed(*args, __original=original, **kwargs):
            start = time.perf_counter()
            try:
                return __original(*args, **kwargs)
            finally:
                spent["controller"] += time.perf_counter() - start

        setattr(GoodputController, name, timed)

    for name in CONTROLLER_CALLS:
        wrap(name)


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
    target = sg.load_target(args.target, threads=args.threads)
    prompts = [json.loads(line)["turns"][0] for line in open(args.prompts) if line.strip()]
    gen = sg.SpeculativeGenerator(target, drafter_from_spec(args.drafter, target), tree=sg.parse_tree_spec(args.tree))
    gen.generate_batch(prompts[:2], max_new_tokens=8)  # warm-up
    spent: dict[str, float] = defaultdict(float)
    time_the_controller(spent)
    rows = []
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        sched = gen.scheduler(max_batch_size=b)
        sched.add_observer(StepParts(spent))
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
            per_step["beyond forward+draft"].append(total - spent["forward"] - spent["draft"])
            per_step["controller"].append(spent["controller"])
        while not sched.idle:
            sched.step()
        row = {"batch_size": b, "steps": len(per_step["total"])}
        row.update({part: statistics.median(v) * 1e3 for part, v in per_step.items() if part != "controller"})
        row["controller (mean)"] = statistics.fmean(per_step["controller"]) * 1e3
        rows.append(row)
    names = [*PARTS, "other", "total", "beyond forward+draft", "controller (mean)"]
    print("| batch | steps | " + " | ".join(f"{n} ms" for n in names) + " |")
    print("|---|---|" + "---|" * len(names))
    for r in rows:
        print(f"| {r['batch_size']} | {r['steps']} | " + " | ".join(f"{r[n]:.3f}" for n in names) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
