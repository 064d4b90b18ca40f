#!/usr/bin/env python3
"""What a decoding step launches besides its captured forward, counted on a CPU.

    python benchmarks/captured_counts.py --target ../shared/models/stories260K --drafter runs/eagle-stories260k/head \\
        --tree chain:4 --tree dynamic:4,5,16

A CUDA graph replays the target's whole verification forward in one launch; what else a step launches (drafting,
acceptance, the copies into and out of the graph's buffers) still counts on a GPU. Here the replay is emulated: a
recorder whose replay computes the forward again from the graph's own buffers with the counter switched off, so the
counts are a captured step's, less its one replay. A feature head's roots' forward and tree levels over the pool's rows,
a DFlash head's blocks and Medusa's heads replay their own graphs (`specgraft.heads.draft_levels`,
`specgraft.heads.dflash`, `specgraft.heads.medusa`), emulated the same way. Prints kernels / syncs a step
(`specgraft.tools.step_counts`) for plain decoding and each tree, at batch 1 and 16, captured and packed (the
default), and how many steps replayed the target's forward and how many levels replayed.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils._python_dispatch import _disable_current_modes

import specgraft as sg
from specgraft.heads.dflash import DFlashBlocks
from specgraft.heads.draft_levels import DraftLevels
from specgraft.model.captured import CapturedForward, GraphSet, Recomputed
from specgraft.tools.step_counts import count_steps

WARM_STEPS, COUNTED_STEPS = 6, 10


def counts(target, drafter, tree: str | None, batch: int, captured: bool) -> tuple[float, float, int, int]:
    """Kernels and syncs a steady step of ``batch`` rows, the counted steps that replayed, and the levels that did."""
    sched = sg.Scheduler(target, {"d": drafter} if drafter is not None else {}, max_batch_size=batch)
    if captured:
        target.captured = CapturedForward(target.fast, sched.pool, recorder=Recomputed(around=_disable_current_modes))
        recorder = Recomputed(around=_disable_current_modes)
        if hasattr(drafter, "levels"):  # a feature head: its forwards over the pool's rows
            drafter.pool_levels = DraftLevels(drafter.head, sched.draft_pools["d"], static=True, recorder=recorder)
        elif hasattr(drafter, "blocks"):  # DFlash: its blocks over the pool's rows
            drafter.pool_blocks = DFlashBlocks(drafter.head, sched.draft_pools["d"], recorder=recorder)
        elif hasattr(drafter, "heads_logp"):  # Medusa: its heads over the rows' states
            drafter.graphs = GraphSet(recorder)
    levels = getattr(drafter, "draft_graphs", None) if captured else None
    for k in range(batch):
        sched.submit(f"Once upon a time {k} the cat sat on the mat and the cat", max_new_tokens=200, eos_token_id=(),
                     drafter="d" if drafter is not None else "none", tree=sg.parse_tree_spec(tree) if tree else None)
    for _ in range(WARM_STEPS):  # every shape of the counted steps captured first
        sched.step()
    replays = target.captured.graphs.replays if captured else 0
    level_replays = levels.replays if levels is not None else 0
    c = count_steps(sched.step, COUNTED_STEPS)
    return (c.kernels_per_step, c.syncs_per_step, (target.captured.graphs.replays - replays) if captured else 0,
            levels.replays - level_replays if levels is not None else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", default=None, help="a trained head directory (default: plain decoding only)")
    parser.add_argument("--tree", action="append", default=[], help="a tree spec for the drafter (repeatable)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = sg.load_target(args.target, capture=True, small_rows="linear")
    drafter = sg.load_drafter(args.drafter, target) if args.drafter else None
    print(f"| method | batch | captured: kernels / syncs a step (forward replays of {COUNTED_STEPS}, level replays) | packed |")
    print("|---|---:|---:|---:|")
    for name, d, tree in [("plain", None, None)] + [(f"{args.drafter} {t}", drafter, t) for t in args.tree]:
        for batch in (1, 16):
            kernels, syncs, replays, levels = counts(target, d, tree, batch, captured=True)
            target.capture, target.captured = False, None
            packed = counts(target, d, tree, batch, captured=False)
            target.capture = True
            print(f"| {name} | {batch} | {kernels:,.0f} / {syncs:.1f} ({replays}, {levels}) | {packed[0]:,.0f} / {packed[1]:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
