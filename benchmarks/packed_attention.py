"""Packed verification against padded, and the attention forms a packed forward could use.

    python benchmarks/packed_attention.py --target ../shared/models/stories260K --batch-sizes 1,4,16,64

Two tables, medians of ``--repeats`` timed runs, 1 thread:

1. Attention alone, one layer of the target's shape (query heads, kv heads,
   head_dim), rows of 100-300 cached tokens, for three mixes of rows (all
   plain, one in four a tree of 8 nodes, all trees of 8), each form computing
   the same outputs (checked):
   - ``per-row``: one SDPA call per row over its own slots;
   - ``engine``: `PackedAttention` as the engine runs it (one padded call for
     every row, or for the one-token rows with the others alone, by its rule),
     writing the layer's new keys and values too;
   - ``padded``: one call over all rows, queries padded to the widest tree;
   - ``block-mask``: one call over every row's keys concatenated, a block mask;
   - ``flex``: torch's flex_attention with a block mask, where it compiles here.
   Masks and index tensors are built once per forward in each form (as a
   forward builds them once for all layers), so only per-layer work is timed.
2. The whole verification forward: packed (`Target.forward_packed`) against
   padded (every row's tree padded to the widest, one (B, T) forward with a
   per-row 4D mask, as the engine ran before), for the mixed rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import specgraft as sg
from specgraft.model import BatchedKVCache, FastLlama, Segment
from specgraft.model.fast_llama import PackedAttention

MIXES = ("plain", "mixed", "trees")
TREE_NODES = 8


class _Heads(FastLlama):
    """Only what `PackedAttention.attend` reads of a model: its heads and SDPA call."""

    def __init__(self, heads: int, kv_heads: int, dim: int) -> None:
        self.num_heads, self.kv_heads, self.head_dim, self.scale = heads, kv_heads, dim, dim**-0.5


def timed(fn, repeats: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sizes_of(mix: str, batch: int) -> list[int]:
    if mix == "plain":
        return [1] * batch
    if mix == "mixed":
        return [TREE_NODES if i % 4 == 0 else 1 for i in range(batch)]
    return [TREE_NODES] * batch


def random_trees(sizes: list[int], gen: torch.Generator) -> list[torch.Tensor]:
    """An (n, n) ancestor mask of a random tree per row (node i's parent drawn below i)."""
    masks = []
    for n in sizes:
        anc = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            anc[i] |= anc[int(torch.randint(0, i, (1,), generator=gen))]
        masks.append(anc)
    return masks


def attention_forms(heads: int, kv_heads: int, dim: int, sizes: list[int], lens: list[int], repeats: int,
                    with_flex: bool) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    b, n = len(sizes), sum(sizes)
    kv = torch.randn(2, b, kv_heads, max(lens) + TREE_NODES, dim, generator=gen)
    q = torch.randn(1, heads, n, dim, generator=gen)
    trees = random_trees(sizes, gen)
    offsets = [sum(sizes[:i]) for i in range(b)]
    gqa = heads != kv_heads
    # per row: (T, L) bool mask, None for one token
    row_masks = [None if t == 1 else torch.cat([torch.ones(t, L, dtype=torch.bool), m], 1) for t, L, m in zip(sizes, lens, trees)]

    def per_row(only=None):
        out = torch.empty_like(q)
        for r in only if only is not None else range(b):
            t, L, o = sizes[r], lens[r], offsets[r]
            out[:, :, o:o + t] = F.scaled_dot_product_attention(
                q[:, :, o:o + t], kv[0, r:r + 1, :, :L + t], kv[1, r:r + 1, :, :L + t], attn_mask=row_masks[r], enable_gqa=gqa)
        return out

    # The engine's own PackedAttention over a one-layer pool holding the same keys and values.
    pool = BatchedKVCache(1, kv_heads, dim, rows=b, max_len=kv.shape[3])
    pool.kv[0] = kv
    for r, L in enumerate(lens):
        pool.acquire(r)[1].extend(1, L)
    packed = PackedAttention(pool, [Segment(r, t, None if t == 1 else m) for r, (t, m) in enumerate(zip(sizes, trees))], q.device,
                             heads * dim)
    k_new = torch.cat([kv[0, r, :, L:L + t] for r, (t, L) in enumerate(zip(sizes, lens))], 1)[None]  # rewrite what is there
    v_new = torch.cat([kv[1, r, :, L:L + t] for r, (t, L) in enumerate(zip(sizes, lens))], 1)[None]
    model = _Heads(heads, kv_heads, dim)

    def engine():
        return packed.attend(model, 0, q, k_new, v_new).view(1, n, heads, dim).transpose(1, 2)

    t_max = max(sizes)
    w_pad = max(lens) + t_max
    vis = torch.zeros(b, t_max, w_pad, dtype=torch.bool)
    scatter = []
    for r in range(b):
        t, L = sizes[r], lens[r]
        vis[r, :t, :L] = True
        vis[r, :t, L:L + t] = trees[r]
        vis[r, torch.arange(t, t_max), L + torch.arange(t, t_max)] = True
        scatter += [r * t_max + j for j in range(t)]
    pad_mask, scatter = vis[:, None], torch.tensor(scatter)

    def padded():
        qp = q.new_zeros(heads, b * t_max, dim)
        qp[:, scatter] = q[0]
        qp = qp.view(heads, b, t_max, dim).transpose(0, 1)
        # padding queries sit at slots past their row's tree: this writes over nothing real in a benchmark
        res = F.scaled_dot_product_attention(qp, kv[0, :, :, :w_pad], kv[1, :, :, :w_pad], attn_mask=pad_mask, enable_gqa=gqa)
        return res.transpose(0, 1).reshape(heads, b * t_max, dim)[:, scatter][None]

    cat_k = torch.cat([kv[0, r, :, :lens[r] + sizes[r]] for r in range(b)], 1)[None]
    cat_v = torch.cat([kv[1, r, :, :lens[r] + sizes[r]] for r in range(b)], 1)[None]
    block = torch.zeros(n, cat_k.shape[2], dtype=torch.bool)
    col = 0
    for r in range(b):
        t, L, o = sizes[r], lens[r], offsets[r]
        block[o:o + t, col:col + L] = True
        block[o:o + t, col + L:col + L + t] = trees[r]
        col += L + t

    def block_mask():
        return F.scaled_dot_product_attention(q, cat_k, cat_v, attn_mask=block, enable_gqa=gqa)

    forms = {"per-row": per_row, "engine": engine, "padded": padded, "block-mask": block_mask}
    reference = per_row()
    for name, fn in forms.items():
        assert torch.allclose(fn(), reference, atol=1e-5), name
    result = {name: timed(fn, repeats) for name, fn in forms.items()}
    if with_flex:
        result["flex"] = flex_time(q, cat_k, cat_v, block, gqa, repeats)
    return result


def flex_time(q, k, v, block: torch.Tensor, gqa: bool, repeats: int) -> float | None:
    """flex_attention with ``block`` as its mask (compiled; None where it does not run here)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        dense = block

        def mask_mod(b, h, q_idx, kv_idx):
            return dense[q_idx, kv_idx]

        mask = create_block_mask(mask_mod, 1, 1, q.shape[2], k.shape[2], device="cpu")
        compiled = torch.compile(flex_attention)
        return timed(lambda: compiled(q, k, v, block_mask=mask, enable_gqa=gqa), repeats)
    except Exception as err:  # a missing compiler or an unsupported CPU path: report, do not fail the table
        print(f"flex_attention does not run here: {type(err).__name__}: {str(err)[:200]}")
        return None


def whole_forward(target: sg.Target, sizes: list[int], lens: list[int], repeats: int) -> tuple[float, float]:
    """(packed seconds, padded seconds) of one verification forward over rows with these tree sizes."""
    gen = torch.Generator().manual_seed(1)
    b = len(sizes)
    pool = target.new_batched_cache(b, max(lens) + 64)
    views = []
    for r, L in enumerate(lens):
        _, view = pool.acquire(r)
        ids = torch.randint(3, target.vocab_size, (1, L), generator=gen)
        target.forward(ids, view, torch.arange(L)[None])
        views.append(view)
    trees = random_trees(sizes, gen)
    tokens = torch.randint(3, target.vocab_size, (sum(sizes),), generator=gen)
    segments = [Segment(r, t, None if t == 1 else m) for r, (t, m) in enumerate(zip(sizes, trees))]

    def reset():
        for view, L in zip(views, lens):
            view.crop(L)

    def packed():
        target.forward_packed(tokens, pool, segments)
        reset()

    def padded():
        # The inputs are built every step, as the engine built them for its padded forward (and as the packed
        # forward builds its own), from the rows' trees and lengths.
        t_max, w = max(sizes), max(lens) + max(sizes)
        pad_tokens = torch.zeros(b, t_max, dtype=torch.long)
        pad_pos = torch.tensor(lens)[:, None].repeat(1, t_max)
        vis = torch.zeros(b, t_max, w, dtype=torch.bool)
        offset = 0
        for r, (t, L) in enumerate(zip(sizes, lens)):
            pad_tokens[r, :t] = tokens[offset:offset + t]
            pad_pos[r, :t] = L + depth[r]
            vis[r, :t, :L] = True
            vis[r, :t, L:L + t] = trees[r]
            vis[r, torch.arange(t, t_max), L + torch.arange(t, t_max)] = True
            offset += t
        pad_mask = torch.full(vis.shape, torch.finfo(target.dtype).min).masked_fill(vis, 0.0)[:, None]
        target.fast.forward(pad_tokens, pool, pad_pos, pad_mask)
        reset()

    return timed(packed, repeats), timed(padded, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--no-flex", action="store_true", help="skip flex_attention (it compiles for about 20 s)")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = sg.load_target(args.target, threads=1)
    fast = target.fast
    batches = [int(x) for x in args.batch_sizes.split(",")]
    lens_gen = torch.Generator().manual_seed(2)
    rows = []
    print(f"Attention forms, one layer of {target.name} ({fast.num_heads} query heads, {fast.kv_heads} kv heads, "
          f"head_dim {fast.head_dim}), ms:")
    print("| rows | batch | tokens | per-row | engine | padded | block-mask | flex |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for mix in MIXES:
        for b in batches:
            sizes = sizes_of(mix, b)
            lens = torch.randint(100, 300, (b,), generator=lens_gen).tolist()
            forms = attention_forms(fast.num_heads, fast.kv_heads, fast.head_dim, sizes, lens, args.repeats,
                                    with_flex=not args.no_flex and mix == "mixed" and b == 16)
            cells = " | ".join("-" if forms.get(k) is None else f"{forms[k] * 1e3:.3f}"
                               for k in ("per-row", "engine", "padded", "block-mask", "flex"))
            print(f"| {mix} | {b} | {sum(sizes)} | {cells} |")
            rows.append({"table": "attention", "mix": mix, "batch": b, "tokens": sum(sizes),
                         **{k: v for k, v in forms.items()}})
    print(f"\nWhole verification forward of {target.name}, one in four rows a tree of {TREE_NODES} nodes, ms:")
    print("| batch | tokens | packed | padded | padded / packed |")
    print("|---:|---:|---:|---:|---:|")
    for b in batches:
        sizes = sizes_of("mixed", b)
        lens = torch.randint(100, 300, (b,), generator=lens_gen).tolist()
        packed, padded = whole_forward(target, sizes, lens, args.repeats)
        print(f"| {b} | {sum(sizes)} | {packed * 1e3:.2f} | {padded * 1e3:.2f} | {padded / packed:.2f} |")
        rows.append({"table": "forward", "batch": b, "tokens": sum(sizes), "packed": packed, "padded": padded})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
