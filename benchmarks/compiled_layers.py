#!/usr/bin/env python3
"""Does torch.compile pay for the target's forward on this CPU? A decoding step, eager against compiled.

    python benchmarks/compiled_layers.py --target ~/.cache/specgraft/models/SmolLM2-135M-Instruct \\
        --prompts ../shared/data/mt_bench_question.jsonl --batch-sizes 1,8,32

Each batch size prefills its prompts into a pool, then times plain decoding steps (one token a row, one packed
forward) in two forms over the same weights, both with every product on oneDNN's packed weights:

- ``eager``: `FastLlama.forward_packed` as the engine runs it;
- ``compiled``: the same forward with each layer's work before attention (RMSNorm, q/k/v products, RoPE) and
  after it (o product, residual, RMSNorm, SiLU MLP, residual) compiled by inductor (``torch.compile``, dynamic
  shapes, or static with ``--static``), attention left eager (`PackedAttention`, whose calls depend on the rows).
  Inductor cannot lower a packed weight that is a graph input, so the product is an opaque custom op inside
  the compiled graphs (vLLM's CPU build instead freezes the weights into one graph of the whole model).

Prints ms a step (median of ``--steps``), the first call's seconds (the compile), and the largest difference of
the two forms' logits.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import specgraft as sg
from specgraft.model import FastLlama, Segment
from specgraft.model.fast_llama import PackedAttention, rms_norm, rope
from specgraft.model.small_rows import packed_linear
from specgraft.tools.prompts import encode_prompt, read_prompt_file


@torch.library.custom_op("specgraft_bench::packed_linear", mutates_args=())
def opaque_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """`packed_linear`, opaque to inductor."""
    return packed_linear(x, packed)


@opaque_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


class Compiled:
    """A packed forward of ``fast`` with each layer's work around attention compiled."""

    def __init__(self, fast: FastLlama, dynamic: bool) -> None:
        self.fast = fast
        self.packs = {id(p.weight): p.packed for p in fast.packed.values()}
        self.before = torch.compile(self._before, dynamic=dynamic, fullgraph=True)
        self.after = torch.compile(self._after, dynamic=dynamic, fullgraph=True)

    def _before(self, x, norm, q, k, v, cos, sin):
        fast, n = self.fast, x.shape[1]
        h = rms_norm(x, norm, fast.eps)
        q = opaque_linear(h, q, fast.num_heads * fast.head_dim).view(1, n, fast.num_heads, fast.head_dim)
        k = opaque_linear(h, k, fast.kv_heads * fast.head_dim).view(1, n, fast.kv_heads, fast.head_dim)
        v = opaque_linear(h, v, fast.kv_heads * fast.head_dim).view(1, n, fast.kv_heads, fast.head_dim)
        return rope(q, cos, sin).transpose(1, 2), rope(k, cos, sin).transpose(1, 2), v.transpose(1, 2)

    def _after(self, x, attended, o, post_norm, gate, up, down, inner: int):
        x = x + opaque_linear(attended, o, x.shape[-1])
        h = rms_norm(x, post_norm, self.fast.eps)
        return x + opaque_linear(F.silu(opaque_linear(h, gate, inner)) * opaque_linear(h, up, inner), down, x.shape[-1])

    @torch.inference_mode()
    def forward_packed(self, input_ids, pool, segments) -> torch.Tensor:
        fast, packs = self.fast, self.packs
        x = F.embedding(input_ids, fast.embed)[None]  # (1, N, H)
        attention = PackedAttention(pool, segments, x.device, fast.num_heads * fast.head_dim)
        cos, sin = fast._rope(x, attention.positions[None], pool.max_len)
        for i, layer in enumerate(fast.layers):
            q, k, v = self.before(x, layer.input_norm, packs[id(layer.q)], packs[id(layer.k)], packs[id(layer.v)], cos, sin)
            attended = attention.attend(fast, i, q, k, v)
            x = self.after(x, attended, packs[id(layer.o)], layer.post_norm, packs[id(layer.gate)], packs[id(layer.up)],
                           packs[id(layer.down)], layer.gate.shape[0])
        return packed_linear(rms_norm(x, fast.final_norm, fast.eps), packs[id(fast.lm_head)])[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--static", action="store_true", help="compile for each shape instead of dynamic shapes")
    args = parser.parse_args()
    target = sg.load_target(args.target, threads=1, small_rows="packed")
    fast = target.fast
    if not fast.packed:
        raise SystemExit("no packed weights here (oneDNN unavailable): nothing to compare")
    compiled = Compiled(fast, dynamic=not args.static)
    eager = lambda ids, pool, segments: fast.forward_packed(ids, pool, segments)[0]  # noqa: E731
    prompts = [torch.tensor(encode_prompt(target, p.text)) for p in read_prompt_file(args.prompts)]
    print("| batch | eager, ms a step | compiled, ms a step | compiled / eager | first compiled call, s | max |logit diff| |")
    print("|---:|---:|---:|---:|---:|---:|")
    for b in map(int, args.batch_sizes.split(",")):
        pool = fast.new_batched_cache(b, 1024)
        rows, lengths = [], []
        for ids in prompts[:b]:
            row, cache = pool.acquire()
            fast.forward(ids[None], cache, torch.arange(len(ids))[None], last_only=True)
            rows.append(row)
            lengths.append(len(ids))
        tokens = torch.randint(0, fast.embed.shape[0], (b,), generator=torch.Generator().manual_seed(0))

        def step(forward) -> tuple[torch.Tensor, float]:
            start = time.perf_counter()
            logits = forward(tokens, pool, [Segment(r, 1) for r in rows])
            seconds = time.perf_counter() - start
            for r, length in zip(rows, lengths):  # the same slots again: both forms decode from the same cache
                pool.views[r].crop(length)
            return logits, seconds

        first = step(compiled.forward_packed)[1]
        diff = float((step(compiled.forward_packed)[0] - step(eager)[0]).abs().max())
        times = {"eager": [], "compiled": []}
        for _ in range(args.steps):  # alternating, so drift touches both alike
            times["eager"].append(step(eager)[1])
            times["compiled"].append(step(compiled.forward_packed)[1])
        e, c = (statistics.median(times[k]) * 1e3 for k in ("eager", "compiled"))
        print(f"| {b} | {e:.1f} | {c:.1f} | {c / e:.2f}x | {first:.1f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
