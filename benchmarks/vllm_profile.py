#!/usr/bin/env python3
"""Where a batch's time goes, specgraft against vLLM: torch's profiler around one greedy batch in each engine.

Both decode the same ``--batch-size`` prompts (chat-templated, EOS ignored) for ``--max-new-tokens`` tokens,
after one untimed batch each. specgraft runs in this process on ``--threads``; vLLM (from .venv-vllm, bound to
``--vllm-core``) runs its own profiler in its worker, which writes its op table into ``--out``. Prints each
engine's wall time and its ops by self CPU time (vLLM's read from its worker's trace); writes ``specgraft_ops.txt``
and ``vllm_ops.txt``.

    python benchmarks/vllm_profile.py --target ~/.cache/specgraft/models/SmolLM2-135M-Instruct \\
        --prompts ../shared/data/mt_bench_question.jsonl --batch-size 32 --max-new-tokens 32 --out runs/profile-b32
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

import torch

import specgraft as sg
from specgraft.tools.prompts import encode_prompt, read_prompt_file
from specgraft.tools.vllm_engine import VLLMEngine

ROWS = 25  # ops shown per engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vllm-core", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    target = sg.load_target(args.target, threads=args.threads)
    prompts = [encode_prompt(target, p.text) for p in read_prompt_file(args.prompts, args.batch_size)]
    if len(prompts) < args.batch_size:
        parser.error(f"--prompts holds {len(prompts)} prompts, fewer than --batch-size {args.batch_size}")

    generator = sg.SpeculativeGenerator(target, None)
    generator.generate_batch(prompts, max_new_tokens=args.max_new_tokens, eos_token_id=())  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        start = time.perf_counter()
        generator.generate_batch(prompts, max_new_tokens=args.max_new_tokens, eos_token_id=())
        ours = time.perf_counter() - start
    table = profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=ROWS)
    (args.out / "specgraft_ops.txt").write_text(table)
    print(f"specgraft: {ours:.2f} s for {args.batch_size} x {args.max_new_tokens} tokens "
          f"({args.batch_size * args.max_new_tokens / ours:.1f} tokens/s)\n{table}")

    config = {"profiler": "torch", "torch_profiler_dir": str((args.out / "vllm").resolve()),
              "torch_profiler_with_stack": False}  # as specgraft's profile above: ops only
    with VLLMEngine(args.target, core=args.vllm_core, max_model_len=max(map(len, prompts)) + args.max_new_tokens,
                    profiler_config=config, log=args.out / "vllm-worker.log") as engine:
        engine.generate(prompts, args.max_new_tokens)  # warm-up
        engine.profile(start=True)
        call = engine.generate(prompts, args.max_new_tokens)
        engine.profile(start=False)
    traces = sorted((args.out / "vllm").glob("*.pt.trace.json.gz"))
    ops = self_times(traces[-1]) if traces else {}
    total = sum(ops.values())
    lines = [f"{'Name':>60s}  {'Self CPU %':>10s}  {'Self CPU':>10s}"]
    lines += [f"{name[:60]:>60s}  {100 * t / total:9.2f}%  {t / 1e6:9.3f}s"
              for name, t in sorted(ops.items(), key=lambda kv: -kv[1])[:ROWS]]
    lines.append(f"Self CPU time total: {total / 1e6:.3f}s")
    (args.out / "vllm_ops.txt").write_text("\n".join(lines) + "\n")
    print(f"vLLM {engine.version}: {call.wall_s:.2f} s ({args.batch_size * args.max_new_tokens / call.wall_s:.1f} "
          f"tokens/s, profiled); ops of its worker's trace {traces[-1] if traces else '(none written)'}:")
    print("\n".join(lines))


def self_times(trace: Path) -> dict[str, float]:
    """Self time (us) of each op name in a torch profiler trace: an op's duration less its nested ops', per thread."""
    events = [e for e in json.loads(gzip.open(trace).read())["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    totals: dict[str, float] = {}
    by_thread: dict[tuple, list[dict]] = {}
    for e in events:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for e in thread:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                stack[-1]["_children"] = stack[-1].get("_children", 0.0) + e["dur"]
            stack.append(e)
        for e in thread:
            totals[e["name"]] = totals.get(e["name"], 0.0) + e["dur"] - e.get("_children", 0.0)
    return totals


if __name__ == "__main__":
    main()
