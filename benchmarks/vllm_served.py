#!/usr/bin/env python3
"""`specgraft serve` against `vllm serve`, plain and speculative, in one interleaved `specgraft bench --server` run.

Starts the servers on 127.0.0.1, all on the same target: specgraft's, with ``--head`` loaded as drafter ``head``
and ``--tree`` (default adaptive) as its default tree, so requests switch speculation on and off; vLLM's plain; and
one vLLM server per ``--vllm-chain`` K with the head exported to it as a chain of K tokens. Then every concurrency
level runs each mode in turn, ``--rounds`` times, on the same prompts (see `specgraft.tools.bench_server`), and the
servers are stopped. specgraft runs on ``--threads`` (1: one core); vLLM binds to ``--vllm-core``.

    python benchmarks/vllm_served.py --target ~/.cache/specgraft/models/SmolLM2-135M-Instruct \\
        --head runs/smollm2-135m-eagle3-half/head --vllm-chain 1,3 --prompts ../shared/data/mt_bench_question.jsonl \\
        --limit 32 --max-new-tokens 64 --concurrency 1,4,16,64 --rounds 2 --out runs/vllm-served
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import specgraft as sg
from specgraft.tools.vllm_engine import VLLMServer, free_port, speculative_config, vllm_draft_dir

START_TIMEOUT_S = 600.0


def wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"specgraft serve exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1.0)
    sys.exit(f"specgraft serve did not answer /health within {START_TIMEOUT_S:.0f} s; see {log}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--head", required=True, help="a trained specgraft head directory")
    parser.add_argument("--tree", default="adaptive", help="specgraft's default tree for the head")
    parser.add_argument("--vllm-chain", default="1", help="vLLM's num_speculative_tokens: a server for each (comma list)")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--limit", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-batch-size", type=int, default=64, help="both engines' most sequences at once")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vllm-core", type=int, default=0)
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="each vLLM server's KV cache (VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    target = sg.load_target(args.target, threads=args.threads)
    exported = args.out / "vllm-head"
    shutil.rmtree(exported, ignore_errors=True)
    kind, draft_dir = vllm_draft_dir(args.head, exported, target)
    del target  # the servers load their own copies
    depths = [int(k) for k in args.vllm_chain.split(",")]
    vllm_args = ["--max-num-seqs", str(args.max_batch_size)]

    port = free_port()
    ours_log = args.out / "specgraft-serve.log"
    ours = subprocess.Popen(
        [sys.executable, "-m", "specgraft.cli", "serve", "--target", args.target, "--drafter", f"head={args.head}",
         "--default-drafter", "head", "--tree", args.tree, "--max-batch-size", str(args.max_batch_size),
         "--threads", str(args.threads), "--port", str(port)],
        stdout=open(ours_log, "w"), stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, ours, ours_log)
        with contextlib.ExitStack() as stack:
            common = dict(core=args.vllm_core, kv_cache_gib=args.kv_cache_gib)
            servers = [("plain", stack.enter_context(VLLMServer(args.target, vllm_args, log=args.out / "vllm-plain.log",
                                                                 **common)))]
            for k in depths:
                spec = ["--speculative-config", json.dumps(speculative_config(kind, draft_dir, k))]
                server = VLLMServer(args.target, [*vllm_args, *spec], log=args.out / f"vllm-chain{k}.log", **common)
                servers.append((f"{kind}-chain{k}", stack.enter_context(server)))
            bench = [sys.executable, "-m", "specgraft.cli", "bench", "--server", url, "--drafter", "head",
                     *[f"--vllm-server={label}={server.url}" for label, server in servers],
                     "--prompts", args.prompts, "--limit", str(args.limit), "--max-new-tokens", str(args.max_new_tokens),
                     "--concurrency", args.concurrency, "--rounds", str(args.rounds), "--out", str(args.out)]
            return subprocess.run(bench).returncode
    finally:
        ours.terminate()
        ours.wait(60)


if __name__ == "__main__":
    sys.exit(main())
