#!/usr/bin/env python3
"""Where a batch's time goes, specgraft against vLLM: torch's profiler around one greedy batch in each engine.

Both decode the same ``--batch-size`` prompts (chat-templated, EOS ignored) for ``--max-new-tokens`` tokens,
after one untimed batch each. specgraft runs in this process on ``--threads``; vLLM (from .venv-vllm, bound to
``--vllm-core``) runs its own profiler in its worker, which writes its op table into ``--out``. Prints each
engine's wall time and its ops by self CPU time; writes ``specgraft_ops.txt`` and vLLM's table beside it.

    python benchmarks/vllm_profile.py --target ~/.cache/specgraft/models/SmolLM2-135M-Instruct \\
        --prompts ../shared/data/mt_bench_question.jsonl --batch-size 32 --max-new-tokens 32 --out runs/profile-b32
"""

from __future__ import annotations

import argparse
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

    config = {"profiler": "torch", "torch_profiler_dir": str((args.out / "vllm").resolve())}
    with VLLMEngine(args.target, core=args.vllm_core, max_model_len=max(map(len, prompts)) + args.max_new_tokens,
                    profiler_config=config, log=args.out / "vllm-worker.log") as engine:
        engine.generate(prompts, args.max_new_tokens)  # warm-up
        engine.profile(start=True)
        call = engine.generate(prompts, args.max_new_tokens)
        engine.profile(start=False)
    print(f"vLLM {engine.version}: {call.wall_s:.2f} s ({args.batch_size * args.max_new_tokens / call.wall_s:.1f} "
          f"tokens/s, profiled); its op table: {sorted((args.out / 'vllm').glob('*.txt'))}")
    for path in sorted((args.out / "vllm").glob("*.txt")):
        print("\n".join(path.read_text().splitlines()[: ROWS + 4]))


if __name__ == "__main__":
    main()
