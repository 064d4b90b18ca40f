#!/usr/bin/env python3
"""T(n)/T(1): what verifying n draft tokens in one target forward costs, relative to one token.

On CPU verification is not free (DESIGN.md, performance rules), so the tree
budget should follow this curve. Each n runs a chain of n tokens with the
real 4D additive tree mask after ``--cached`` tokens already in the cache,
through `sg.load_target` (the fast path where the architecture has one).
Sizes are interleaved round by round, so a burst of load from other jobs
hits every n alike; the median of ``--repeats`` rounds is quoted, and the
ratios are what to compare across machines.

    python benchmarks/cost_curve.py --target ~/.cache/specgraft/models/SmolLM2-135M-Instruct \
        --threads 1 2 --lengths 1 2 3 4 6 8 16 --out runs/cost_curve.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import specgraft as sg
from specgraft.model import Target
from specgraft.tree import Tree, tree_attention_mask, tree_position_ids


def chain(n: int, vocab_size: int, device: torch.device) -> Tree:
    """n nodes, each the child of the one before: the mask of a verified draft chain."""
    steps = torch.arange(n, device=device)
    return Tree(
        tokens=(steps * 7919 + 11) % vocab_size,  # arbitrary ids; a forward costs the same for any
        parents=steps - 1,
        depth=steps,
        scores=torch.zeros(n, device=device),
    )


def measure(target: Target, lengths: list[int], cached: int, repeats: int) -> dict[int, list[float]]:
    """n -> forward seconds of each round (the warm-up round dropped)."""
    device = target.device
    prefix = (torch.arange(cached, device=device)[None] * 31 + 5) % target.vocab_size  # (1, S)
    cache = target.new_cache()
    target.forward(prefix, cache, torch.arange(cached, device=device)[None])
    trees = {n: chain(n, target.vocab_size, device) for n in lengths}
    masks = {n: tree_attention_mask(trees[n], cached, target.dtype) for n in lengths}  # (1, 1, n, S + n)
    times: dict[int, list[float]] = {n: [] for n in lengths}
    for round_ in range(repeats + 1):
        for n in lengths:
            tree = trees[n]
            start = time.perf_counter()
            target.forward(tree.tokens[None], cache, tree_position_ids(tree, cached), masks[n])
            elapsed = time.perf_counter() - start
            cache.crop(cached)
            if round_ > 0:
                times[n].append(elapsed)
    return times


def table(results: list[dict]) -> str:
    """Markdown: one row per n, T(n)/T(1) by median per thread count, and T(1) itself."""
    lengths = [int(n) for n in results[0]["median_s"]]
    head = "| n | " + " | ".join(f"T(n)/T(1), {r['threads']} thread{'s' * (r['threads'] > 1)}" for r in results) + " |"
    rule = "|---|" + "---|" * len(results)
    rows = [head, rule]
    for n in lengths:
        rows.append(f"| {n} | " + " | ".join(f"{r['ratio'][str(n)]:.2f}" for r in results) + " |")
    rows.append("| T(1), ms | " + " | ".join(f"{1000 * r['median_s'][str(lengths[0])]:.0f}" for r in results) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="model directory or hub id (loaded with sg.load_target)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1], help="torch.set_num_threads values to measure")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16], help="tokens verified at once")
    parser.add_argument("--cached", type=int, default=200, help="tokens already in the KV cache")
    parser.add_argument("--repeats", type=int, default=9, help="rounds per thread count (after one warm-up round)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--small-rows", default="auto", choices=["auto", "linear", "transposed"],
                        help="how the fast path's few-row products run: measured at each thread count, or pinned")
    parser.add_argument("--out", default="runs/cost_curve.json", help="JSON written here")
    args = parser.parse_args(argv)
    if 1 not in args.lengths:
        parser.error("--lengths must include 1: every figure is relative to T(1)")
    if min(args.lengths) < 1 or args.cached < 1 or args.repeats < 1:
        parser.error("--lengths, --cached and --repeats must be positive")
    lengths = sorted(set(args.lengths))

    target = sg.load_target(args.target, dtype=args.dtype)
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        choice = target.fast.choose_small_rows(args.small_rows) if target.fast is not None else target.small_rows
        print(f"{threads} thread(s): small-row products: {choice.describe()}")
        times = measure(target, lengths, args.cached, args.repeats)
        median = {n: statistics.median(ts) for n, ts in times.items()}
        results.append({
            "threads": threads,
            "median_s": {str(n): median[n] for n in lengths},
            "min_s": {str(n): min(times[n]) for n in lengths},
            "ratio": {str(n): median[n] / median[1] for n in lengths},
            "times_s": {str(n): times[n] for n in lengths},
            "small_rows": choice.to_dict(),
        })
    report = {
        "target": target.name,
        "fast_path": target.fast is not None,
        "dtype": args.dtype,
        "cached_tokens": args.cached,
        "repeats": args.repeats,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(results))
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
