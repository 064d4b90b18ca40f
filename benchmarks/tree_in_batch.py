"""What one row's tree adds to a packed verification forward of one-token rows.

    python benchmarks/tree_in_batch.py --target ../shared/models/stories260K --batch-sizes 1,4,16

A packed forward whose rows are all one token attends in one SDPA call, in place
(`PackedAttention`); the first row that verifies more than its root leaves that
path for every row of the step. The goodput controller prices this as the
forward's tree penalty (`StepCost.tree_ratio`); this script measures it: the
median time of the whole forward (`Target.forward_packed`) for rows of 60-100
cached tokens, 1 thread, with every row one token, one row a chain of 2 or 4,
and every row a chain of 2, the mixes timed in turn.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import specgraft as sg
from specgraft.model import Segment


def mixes(batch: int) -> dict[str, list[int]]:
    """Name -> tokens per row."""
    return {
        "plain": [1] * batch,
        "one chain of 2": [2] + [1] * (batch - 1),
        "one chain of 4": [4] + [1] * (batch - 1),
        "every row a chain of 2": [2] * batch,
    }


def time_forward(target: sg.Target, pool, rows: list, sizes: list[int]) -> float:
    """Seconds of one packed forward with ``sizes[i]`` new tokens on row i; the rows are cropped back after."""
    lengths = [len(cache) for _, cache in rows]
    segments = [Segment(row, n, None) for (row, _), n in zip(rows, sizes)]  # no visibility given: causal chains
    tokens = torch.cat([torch.full((n,), 5) for n in sizes])
    start = time.perf_counter()
    target.forward_packed(tokens, pool, segments, ())
    elapsed = time.perf_counter() - start
    for (_, cache), length in zip(rows, lengths):
        cache.crop(length)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = sg.load_target(args.target)
    generator = torch.Generator().manual_seed(0)
    print("| rows | " + " | ".join(mixes(1)) + " |")
    print("|---:|" + "---:|" * len(mixes(1)))
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        pool = target.new_batched_cache(batch, 256)
        rows = [pool.acquire() for _ in range(batch)]
        for i, (_, cache) in enumerate(rows):
            n = 60 + (i * 7) % 40
            ids = torch.randint(0, target.vocab_size, (1, n), generator=generator)
            target.forward(ids, cache, torch.arange(n)[None])
        times: dict[str, list[float]] = {name: [] for name in mixes(batch)}
        for _ in range(args.repeats):
            for name, sizes in mixes(batch).items():
                times[name].append(time_forward(target, pool, rows, sizes))
        print(f"| {batch} | " + " | ".join(f"{statistics.median(t) * 1e3:.3f} ms" for t in times.values()) + " |")


if __name__ == "__main__":
    main()
