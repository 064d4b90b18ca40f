#!/usr/bin/env python3
"""Records/s of regeneration: specgraft's scheduler against HF `generate` in batches, and through `vllm serve`.

The runners answer the same prompts (a prompt file's first ``--prompts-count`` questions, as chat turns
under the target's template) with the same sampling settings, ``--batch-size`` rows (or requests in
flight) at a time. Runs alternate runner by runner for ``--repeats`` rounds, so a burst of load from other
jobs hits all alike; each round writes a fresh file. HF `generate` holds a batch until its longest reply
ends; the scheduler gives a finished row's slot to the next record at once. With ``--vllm``, vLLM's server
(from .venv-vllm, bound to ``--vllm-core``) answers as a regeneration endpoint would at scale.

    python benchmarks/regeneration_speed.py --target ~/.cache/specgraft/models/SmolLM2-135M-Instruct \\
        --prompts ../shared/data/gsm8k_train.jsonl --prompts-count 64 --batch-size 32 --threads 2 \\
        --out runs/regeneration_speed.json [--vllm --runners scheduler,vllm-serve]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

import specgraft as sg
from specgraft.train.data import load_records
from specgraft.train.endpoint import EndpointClient
from specgraft.train.regeneration import regenerate

RUNNERS = ("scheduler", "hf-generate", "vllm-serve")


def run_once(target, records: list[dict], runner: str, args: argparse.Namespace, out: Path,
             endpoint: EndpointClient | None = None) -> dict:
    fast = target.fast
    if runner == "hf-generate":
        target.fast = None  # regeneration takes HF generate's path, as for a target without the fast path
    try:
        start = time.perf_counter()
        summary = regenerate(
            target, records, out, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            batch_size=args.batch_size, seed=args.seed, resume=False, progress=False,
            endpoint=endpoint if runner == "vllm-serve" else None, concurrency=args.batch_size,
        )
        seconds = time.perf_counter() - start
    finally:
        target.fast = fast
    tokens = 0
    for line in out.read_text().splitlines():
        record = json.loads(line)
        tokens += sum(len(target.encode(m["content"])) for m in record["messages"] if m["role"] == "assistant")
    return {"runner": runner, "records": summary.written, "seconds": round(seconds, 2),
            "records_per_s": round(summary.written / seconds, 3), "reply_tokens_per_s": round(tokens / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--prompts", required=True, help="a prompt file regeneration reads ({'question'} lines, chat, ...)")
    parser.add_argument("--prompts-count", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-len", type=int, default=1024, help="vLLM's max_model_len (prompt + reply)")
    parser.add_argument("--runners", default="scheduler,hf-generate", help=f"comma list of {', '.join(RUNNERS)}")
    parser.add_argument("--vllm", action="store_true", help="start `vllm serve` on the target for the vllm-serve runner")
    parser.add_argument("--vllm-core", type=int, default=0, help="the CPU core vLLM binds its threads to")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runners = [r.strip() for r in args.runners.split(",") if r.strip()]
    unknown = sorted(set(runners) - set(RUNNERS))
    if unknown or ("vllm-serve" in runners) != args.vllm:
        parser.error(f"--runners {args.runners!r}: choose from {', '.join(RUNNERS)}; vllm-serve goes with --vllm")

    torch.set_num_threads(args.threads)
    target = sg.load_target(args.target, threads=args.threads)
    records = load_records(args.prompts)[: args.prompts_count]
    results = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        endpoint = None
        if args.vllm:
            from specgraft.tools.vllm_engine import VLLMServer

            # vLLM 0.32 on CPU stops its engine ("CPU Generator does not use offset") when a seeded sampled request's
            # prefill is chunked; regeneration seeds every request, so prefills run whole.
            flags = ["--max-num-seqs", str(args.batch_size), "--no-enable-chunked-prefill"]
            server = stack.enter_context(VLLMServer(args.target, flags, core=args.vllm_core, max_model_len=args.max_len))
            endpoint = EndpointClient(server.url, target.tokenizer)
        for round_ in range(args.repeats):
            for runner in runners:
                out = Path(tmp) / f"{runner}.jsonl"
                result = {"round": round_, **run_once(target, records, runner, args, out, endpoint)}
                print(json.dumps(result), flush=True)
                results.append(result)
    report = {"target": args.target, "machine": platform.processor() or platform.machine(), "args": vars(args) | {
        "out": str(args.out), "target": args.target}, "results": results}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
