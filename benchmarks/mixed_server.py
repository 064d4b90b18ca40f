"""A served batch where requests ask for different `speculative` settings: what does one odd stream cost the rest?

    python benchmarks/mixed_server.py --target ../shared/models/stories260K \
        --drafter eagle=runs/eagle-stories260k/head --rounds 3 --out runs/bench-mixed

Starts `specgraft serve` (a subprocess on a free 127.0.0.1 port) and keeps
``--concurrency`` streaming greedy requests in flight, ``--requests`` each
per stream slot. Each mix decides what slot 0 asks for; every other slot
asks for speculation off:

- ``plain``: slot 0 off too (the baseline);
- ``lookup``: slot 0 asks for prompt lookup, ``num_speculative_tokens`` 8;
- ``eagle``: slot 0 asks for the ``--drafter`` head on ``chain:8`` (only with ``--drafter``).

Mixes run interleaved, ``--rounds`` times; the figure is the total
completion tokens/s of all slots over the round's wall time, and each mix's
ratio to ``plain`` from the same round (median over rounds). Greedy text is
the same whatever slot 0 asks for, so every mix does the same work but
slot 0's drafting and verification.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one(client: httpx.AsyncClient, prompt: str, max_tokens: int, speculative: dict) -> tuple[int, str]:
    """Stream one greedy completion; (completion tokens, text)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "speculative": speculative}
    tokens, text = 0, ""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text += "".join(c.get("text", "") for c in chunk.get("choices", []))
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens, text


async def run_mix(url: str, prompts: list[str], args: argparse.Namespace, special: dict) -> tuple[float, int, list[str]]:
    """(total tokens/s, tokens, texts in slot-major order) of one mix."""
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as client:
        async def slot(i: int) -> list[tuple[int, str]]:
            spec = special if i == 0 else {"drafter": "none"}
            return [await one(client, prompts[(i * args.requests + j) % len(prompts)], args.max_tokens, spec)
                    for j in range(args.requests)]

        start = time.perf_counter()
        results = await asyncio.gather(*(slot(i) for i in range(args.concurrency)))
        wall = time.perf_counter() - start
    tokens = sum(n for r in results for n, _ in r)
    return tokens / wall, tokens, [t for r in results for _, t in r]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", default=None, help="NAME=HEAD_DIR of a trained head for the eagle mix")
    parser.add_argument("--prompts", default="../shared/data/story_prompts_dev.jsonl")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=3, help="requests per stream slot, one after another")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="directory for results.json")
    args = parser.parse_args()
    prompts = [json.loads(line)["turns"][0] for line in open(args.prompts) if line.strip()]
    mixes = {"plain": {"drafter": "none"}, "lookup": {"drafter": "prompt-lookup", "num_speculative_tokens": 8}}
    command = [str(Path(sys.executable).parent / "specgraft"), "serve", "--target", args.target, "--host", "127.0.0.1",
               "--max-batch-size", str(args.concurrency), "--default-drafter", "none"]
    if args.drafter:
        name = args.drafter.split("=", 1)[0]
        mixes["eagle"] = {"drafter": name, "tree": "chain:8"}
        command += ["--drafter", args.drafter]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(command + ["--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start: {server.stderr.read().decode()[-2000:]}")
            time.sleep(0.5)
        asyncio.run(run_mix(url, prompts, argparse.Namespace(**{**vars(args), "requests": 1}), mixes["plain"]))  # warm-up
        rounds, reference = [], None
        for r in range(args.rounds):
            row = {}
            for name, special in mixes.items():
                speed, tokens, texts = asyncio.run(run_mix(url, prompts, args, special))
                reference = reference or texts
                if texts != reference:
                    print(f"round {r} mix {name}: greedy text differs from the plain mix", file=sys.stderr)
                row[name] = {"tokens_per_s": speed, "tokens": tokens}
                print(f"round {r} {name:6s}: {speed:8.1f} tokens/s ({tokens} tokens)", file=sys.stderr)
            rounds.append(row)
    finally:
        server.terminate()
        server.wait(30)
    summary = {name: statistics.median(row[name]["tokens_per_s"] / row["plain"]["tokens_per_s"] for row in rounds)
               for name in mixes}
    print(json.dumps({"vs_plain_median": summary}, indent=2))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "results.json").write_text(json.dumps(
            {"settings": vars(args), "rounds": rounds, "vs_plain_median": summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
