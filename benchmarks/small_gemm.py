#!/usr/bin/env python3
"""Products on CPU: ``F.linear(x, W)`` against ``W @ x.T`` and oneDNN's packed weights, streamed from memory.

Why: verifying n draft tokens multiplies n rows by every weight of the target.
Reading the weights dominates on CPU, so n rows should cost about one row, but
BLAS builds differ in which form runs 2-4 rows near the one-row time, and
oneDNN's kernels over a weight packed once at load run many rows faster than
MKL's on some machines. The fast path measures the forms at load, per weight
shape and row count (`specgraft.model.small_rows`); this prints the same comparison for
SmolLM2-135M's shapes, with the form that choice keeps ("chosen"), at more
row counts. Each shape cycles through enough copies of the weight to defeat
the caches, as a 30-layer forward does.

    python benchmarks/small_gemm.py --threads 1 --rows 1 2 3 4 5 8 16 32 64
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from specgraft.model.small_rows import MANY, SMALL_ROWS, choose, pack, packed_linear, transposed_linear

# SmolLM2-135M's projections (out, in): gate/up, down, q/o, k/v, lm_head
SHAPES = [(1536, 576), (576, 1536), (576, 576), (192, 576), (49152, 576)]
STREAMED_BYTES = 200 << 20  # each shape cycles through this many bytes of weight copies


def per_call_ms(fn, weights: list[torch.Tensor], repeats: int) -> float:
    for w in weights[:2]:
        fn(w)
    start = time.perf_counter()
    for _ in range(repeats):
        for w in weights:
            fn(w)
    return (time.perf_counter() - start) / (repeats * len(weights)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| weight (out x in) | rows | F.linear ms | W @ x.T ms | packed ms | chosen |\n|---|---|---|---|---|---|")
    for out_f, in_f in SHAPES:
        copies = max(1, STREAMED_BYTES // (out_f * in_f * 4))
        weights = [torch.randn(out_f, in_f) for _ in range(copies)]
        packs = {id(p): p for p in map(pack, weights) if p is not None}
        for rows in args.rows:
            x = torch.randn(rows, in_f)
            timed = {"linear": per_call_ms(lambda w: F.linear(x, w), weights, args.repeats)}
            if rows <= SMALL_ROWS:
                timed["transposed"] = per_call_ms(lambda w: transposed_linear(x, w), weights, args.repeats)
            if packs:
                timed["packed"] = per_call_ms(lambda p: packed_linear(x, p), list(packs.values()), args.repeats)
            chosen = choose({(out_f, in_f, min(rows, MANY)): timed}).get((out_f, in_f, min(rows, MANY)), "linear")
            cells = " | ".join(f"{timed[form]:.3f}" if form in timed else "-" for form in ("linear", "transposed", "packed"))
            print(f"| {out_f} x {in_f} | {rows} | {cells} | {chosen} |")


if __name__ == "__main__":
    main()
