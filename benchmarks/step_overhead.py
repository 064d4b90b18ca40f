"""Where one scheduler step's time goes, at several batch sizes: draft, verification forward, commits, the rest.

    python benchmarks/step_overhead.py --target ../shared/models/stories260K \
        --drafter runs/eagle-stories260k/head --tree chain:4 --batch-sizes 1,16

Each part of `Scheduler.step` is timed by wrapping the function that does it:
``draft`` is `Scheduler._draft` (every row's tree, batch drafters once per
drafter); ``verify inputs`` is `Scheduler._verify` less the target's forward
inside it (segments, masks, packing); ``forward`` is the target forward that
verifies (`Target.forward_packed`, or `Target.forward` for one row);
``commit`` is `Scheduler._commit` (acceptance, KV commits, drafter commits,
stop rules, stats, events). "other" is the step's remaining time: the
scheduler's own Python. "beyond forward+draft" is everything but the forward
and the draft: the engine's per-step cost. Figures are per step, medians over
steps; prefill steps (a row joining) are left out.

With ``--tree adaptive`` the goodput controller's work (planning, selection,
learning, its timings: every `GoodputController` call the scheduler makes)
is also timed. It runs inside the parts above (planning in ``draft``,
learning in ``commit``, selection in "other"), and mostly on the steps where
a row drafts, so it is reported as a mean per step beside the medians: at
batch 1 the steps without a tree would otherwise hide it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import specgraft as sg
from specgraft.heads import drafter_from_spec
from specgraft.infer import GoodputController

PARTS = ("draft", "verify inputs", "forward", "commit")
# What the scheduler asks of the goodput controller (learning runs inside `observe_step`).
CONTROLLER_CALLS = ("standing", "plan", "select", "observe_draft", "observe_step", "observe_times", "forget")


def instrument(spent: dict[str, float]) -> None:
    """Wrap each part's function so its time adds up into ``spent`` (forwards only while verifying)."""
    verifying = [False]

    def wrap(owner, name: str, part: str | None) -> None:
        original = getattr(owner, name)

        def timed(*args, __original=original, **kwargs):
            if part is None and not verifying[0]:
                return __original(*args, **kwargs)
            key = part or "forward"
            if part == "verify inputs":
                verifying[0] = True
            start = time.perf_counter()
            try:
                return __original(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start
                if part == "verify inputs":
                    verifying[0] = False

        setattr(owner, name, timed)

    wrap(sg.Scheduler, "_draft", "draft")
    wrap(sg.Scheduler, "_verify", "verify inputs")
    wrap(sg.Scheduler, "_commit", "commit")
    wrap(sg.Target, "forward", None)
    wrap(sg.Target, "forward_packed", None)
    for name in CONTROLLER_CALLS:
        wrap(GoodputController, name, "controller")


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
            spent["verify inputs"] -= spent["forward"]  # the forward ran inside _verify
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
