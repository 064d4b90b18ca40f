"""The packed forward at static shapes, captured once per size as a CUDA graph.

Why: on a GPU a large target's step is launch-bound when it runs op by op (about 1,230 launches a forward for
Llama-3.1-8B in bf16, each ~5 us); a CUDA graph replays them all in one launch, as vLLM's and SGLang's captured
decode and verify steps do. A graph holds fixed shapes and addresses, so this forward is `PackedAttention`'s made
static:

- the packed tokens are padded to a bucket of N (padding writes its keys/values to the pool's scratch row);
- every pool row's queries sit in one (R, T) grid, T the widest row's tokens padded to a bucket, and attend over the
  rows' first W slots (a bucket of `SLOT_BUCKET`) in one SDPA call a layer;
- the mask is built inside the forward from per-row numbers (how many cached slots a row sees, where its tree
  starts) and a (R, T, T) block of tree visibilities, copied into the graph's own buffers before each replay.

A step's shapes pick its graph (`Shape`); the first call of a shape runs it and captures it, later calls replay it
and copy the outputs out. Off CUDA nothing is captured: the same static forward runs eager, which is what the tests
compare with the packed forward (it pads more than `PackedAttention`, so on a CPU it is slower).

Shape legend: N packed tokens, Np padded, R pool rows with the scratch row, T a row's queries (bucket), W slots
attended (bucket), H hidden, Hq / Hkv heads, D head_dim, V vocab.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Hashable, Sequence, TypeVar

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves, tree_map

from specgraft.model.caches import BatchedKVCache
from specgraft.model.fast_llama import DYNAMIC_ROPE, FastLlama, Segment, additive, causal
from specgraft.model.staging import staged

SLOT_BUCKET = 256  # W grows by this many slots: a graph serves every step whose rows hold at most W slots
MOST_GRAPHS = 64  # graphs kept per pool; a step of a shape beyond them runs the static forward eager


def default_recorder(device: torch.device) -> CudaGraphs | None:
    """CUDA graphs on a CUDA device; elsewhere none (captured functions run eager)."""
    return CudaGraphs(device) if device.type == "cuda" else None


def held_rope_table(fast: FastLlama, pool: BatchedKVCache, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``fast``'s RoPE table over every slot of ``pool``, in its dtype, for a captured forward to hold: a later, larger
    cache may grow the model's table, never the one a graph reads.

    Raises:
        ValueError: a rope type whose frequencies follow each forward's positions (naming ``what`` refuses it).
    """
    if fast.rotary.rope_type in DYNAMIC_ROPE:
        raise ValueError(f"rope type {fast.rotary.rope_type!r} computes its frequencies from each forward's "
                         f"positions; {what} reads a fixed table")
    device = pool.kv.device
    fast._rope(torch.zeros(1, 1, 1, dtype=pool.kv.dtype, device=device), torch.zeros(1, 1, dtype=torch.long, device=device),
               pool.max_len)
    return fast._rope_table


def bucket(n: int) -> int:
    """The next power of two at or above ``n`` (token counts and a row's queries)."""
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class Shape:
    """What a graph is captured for: Np padded tokens, T queries a row, W slots, and the hidden layers it returns."""

    tokens: int
    width: int
    slots: int
    layers: tuple[int, ...]


Outputs = tuple[torch.Tensor, dict[int, torch.Tensor]]  # logits (Np, V), hidden layer -> (Np, H)
T = TypeVar("T")  # what a captured function returns: tensors, in tuples, lists or dicts


class CudaGraphs:
    """How a `GraphSet` records a function once and replays it: CUDA graphs, sharing one memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.memory = None  # the graphs' shared memory pool, made with the first

    def warm_up(self, run: Callable[[], T]) -> T:
        """Run once on a side stream, as capture wants (this run is the call's own work: its results are returned)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            outputs = run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        return outputs

    def capture(self, run: Callable[[], T]) -> tuple[Callable[[], None], T]:
        """Record ``run``'s kernels without running them; returns the replay and the outputs every replay rewrites."""
        graph = torch.cuda.CUDAGraph()
        if self.memory is None:
            self.memory = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.memory):
            outputs = run()
        return graph.replay, outputs


class Recomputed:
    """What CUDA graphs do, done by computing again, where there are none (tests, counts on a CPU): a replay runs the
    captured function on the graph's own buffers and writes its results into the capture's outputs. ``around`` is
    a context each replay runs in (one that hides it from a counter, say)."""

    def __init__(self, around: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
        self.around = around

    def warm_up(self, run: Callable[[], T]) -> T:
        return run()

    def capture(self, run: Callable[[], T]) -> tuple[Callable[[], None], T]:
        outputs = run()  # a graph only records here; running writes what the warm-up wrote, with the same values

        def replay() -> None:
            with self.around():
                for kept, new in zip(tree_leaves(outputs), tree_leaves(run()), strict=True):
                    kept.copy_(new)

        return replay, outputs


@dataclass
class _Graph:
    """One captured key: its input buffers, the replay, and its outputs (rewritten by every replay)."""

    inputs: tuple[torch.Tensor, ...]
    replay: Callable[[], None]
    outputs: Any


class GraphSet:
    """Functions captured once per key and replayed: the bookkeeping every captured forward shares.

    A key's first call runs the function (warmed up on a side stream) and captures it over copies of its inputs;
    later calls copy their inputs into those buffers, replay, and hand out copies of the outputs (a later replay
    rewrites the graph's own). Without a recorder, or past ``most_graphs``, calls run eager.
    """

    def __init__(self, recorder: CudaGraphs | Recomputed | None, most_graphs: int = MOST_GRAPHS) -> None:
        self.recorder, self.most_graphs = recorder, most_graphs
        self.graphs: dict[Hashable, _Graph] = {}
        self.captures = self.replays = self.eager = 0  # calls that captured a graph, replayed one, or ran eager
        self.capture_seconds = 0.0  # host time of the capturing calls, warm-ups included: the first calls' cost

    def __len__(self) -> int:
        return len(self.graphs)

    def stats(self) -> dict[str, int | float]:
        """What the calls did so far, for reports: graphs captured, replays, eager runs, seconds capturing."""
        return {"graphs": len(self.graphs), "captures": self.captures, "replays": self.replays, "eager": self.eager,
                "capture_seconds": round(self.capture_seconds, 3)}

    def __call__(self, key: Hashable, run: Callable[..., T], *inputs: torch.Tensor) -> T:
        """``run(*inputs)``'s results, by ``key``'s graph (captured on its first call) or eager."""
        graph = self.graphs.get(key)
        if graph is not None:
            for buffer, value in zip(graph.inputs, inputs, strict=True):
                buffer.copy_(value)
            graph.replay()
            self.replays += 1
            return tree_map(torch.clone, graph.outputs)
        if self.recorder is None or len(self.graphs) >= self.most_graphs:
            self.eager += 1
            return run(*inputs)
        begun = time.perf_counter()
        outputs = self.recorder.warm_up(lambda: run(*inputs))
        buffers = tuple(value.clone() for value in inputs)
        # Capturing records the kernels without running them: what the warm-up wrote (cache slots) stays.
        replay, captured = self.recorder.capture(lambda: run(*buffers))
        self.graphs[key] = _Graph(buffers, replay, captured)
        self.captures += 1
        self.capture_seconds += time.perf_counter() - begun
        return outputs


class CapturedForward:
    """`FastLlama.forward_packed` over one pool at static shapes, one CUDA graph per `Shape` (see the module doc).

    Args:
        fast: the target's forward; its weights are read where they are, so they must not move once captured.
        pool: the batched cache the rows live in; it must have a scratch row (``BatchedKVCache(scratch=True)``).
        most_graphs: graphs kept; a shape beyond them runs eager.
        recorder: what captures and replays (default: `CudaGraphs` on CUDA, none elsewhere: every call eager).

    Raises:
        ValueError: a pool without a scratch row, or a rope type whose frequencies follow the sequence length.
    """

    def __init__(
        self, fast: FastLlama, pool: BatchedKVCache, most_graphs: int = MOST_GRAPHS, recorder: CudaGraphs | Recomputed | None = None,
    ) -> None:
        if pool.scratch_row is None:
            raise ValueError("a captured forward needs a pool with a scratch row (BatchedKVCache(scratch=True)): "
                             "padding tokens write their keys/values there")
        self.fast, self.pool, self.most_graphs = fast, pool, most_graphs
        self.device = pool.kv.device
        self.cos, self.sin = held_rope_table(fast, pool, "a captured forward")  # (P, D) each, P >= the pool's slots
        self.graphs = GraphSet(default_recorder(self.device) if recorder is None else recorder, most_graphs)

    def stats(self) -> dict[str, int | float]:
        """What the forwards did so far, for reports: graphs captured, replays, eager runs, seconds capturing."""
        return self.graphs.stats()

    @torch.inference_mode()
    def __call__(
        self, input_ids: torch.Tensor, segments: Sequence[Segment], hidden_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`FastLlama.forward_packed`'s work and results: logits (N, V) and hidden states (N, H), packed."""
        pool, rows_total = self.pool, self.pool.kv.shape[2]
        sizes, rows = [seg.size for seg in segments], [seg.row for seg in segments]
        starts = pool.extend_packed(rows, sizes)
        n = sum(sizes)
        shape = Shape(bucket(n), bucket(max(sizes)), slot_bucket(max(s + z for s, z in zip(starts, sizes)), pool.max_len),
                      tuple(hidden_layers))
        np_, t, scratch = shape.tokens, shape.width, pool.scratch_row
        token_rows = [row for row, size in zip(rows, sizes) for _ in range(size)] + [scratch] * (np_ - n)
        token_slots = [s for start, size in zip(starts, sizes) for s in range(start, start + size)] + [0] * (np_ - n)
        cells = [row * t + j for row, size in zip(rows, sizes) for j in range(size)] + [scratch * t] * (np_ - n)
        seen, tree_starts = [1] * rows_total, [0] * rows_total  # a row outside the forward sees slot 0 (dropped)
        for row, start, size in zip(rows, starts, sizes):
            seen[row] = start + (size == 1)  # a one-token row sees its own slot; a tree's block covers its tokens
            tree_starts[row] = start
        padding = input_ids.new_zeros(np_ - n)
        meta = staged(self.device, token_rows, token_slots, cells, seen, tree_starts)  # one copy
        index = torch.cat([input_ids, padding, *meta])
        block = causal(t, self.device).expand(rows_total, t, t).clone()  # chains and one-token rows draw nothing
        for seg, row in zip(segments, rows):
            if seg.visible is not None:
                block[row, : seg.size, : seg.size] = seg.visible
        logits, hidden = self._forward(shape, index, block)
        return logits[:n], {i: h[:n] for i, h in hidden.items()}


    def _forward(self, shape: Shape, index: torch.Tensor, block: torch.Tensor) -> Outputs:
        """Replay ``shape``'s graph on these inputs, capture it on its first call, or run eager (no graphs here, or
        past `most_graphs`). Outputs are the caller's own."""
        return self.graphs(shape, lambda index, block: self._run(shape, index, block), index, block)

    def _run(self, shape: Shape, index: torch.Tensor, block: torch.Tensor) -> Outputs:
        """The forward itself, every shape static: logits (Np, V) and the requested hidden states (Np, H)."""
        fast, kv = self.fast, self.pool.kv
        np_, t, w = shape.tokens, shape.width, shape.slots
        r = kv.shape[2]
        ids, token_rows, token_slots, cells = index[: 4 * np_].view(4, np_)
        seen, tree_starts = index[4 * np_ :].view(2, r)
        x = F.embedding(ids, fast.embed)[None]  # (1, Np, H)
        # A token's position: its row's first new slot plus its depth (what it sees of the row's block, less itself).
        positions = tree_starts[token_rows] + block.sum(-1).view(-1)[cells] - 1
        cos, sin = self.cos[positions][None, :, None], self.sin[positions][None, :, None]  # (1, Np, 1, D)
        # What each row's query t' sees of slots [0, W): its cached slots, and its tree's block from its start on.
        columns = torch.arange(w, device=kv.device)
        relative = columns - tree_starts[:, None]  # (R, W)
        in_tree = block.gather(2, relative.clamp(0, t - 1)[:, None].expand(r, t, w))  # (R, T, W)
        visible = (columns < seen[:, None])[:, None] | (in_tree & ((relative >= 0) & (relative < t))[:, None])
        grid = _GridAttention(self.pool, token_rows, token_slots, cells, additive(visible[:, None], kv.dtype), t, w)
        return fast.packed_layers(x, cos, sin, grid, shape.layers)


@dataclass(frozen=True)
class _GridAttention:
    """Attention of a static forward: each token's keys/values written at its row and slot (padding: the scratch
    row), every pool row's queries in one (R, T) grid over slots [0, W), one SDPA call a layer."""

    pool: BatchedKVCache
    rows: torch.Tensor  # (Np,) each token's pool row
    slots: torch.Tensor  # (Np,) and slot
    cells: torch.Tensor  # (Np,) its cell in the (R * T) query grid
    mask: torch.Tensor  # (R, 1, T, W) additive
    width: int  # T
    seen: int  # W

    def attend(self, model: FastLlama, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write layer ``layer``'s (1, Hkv, Np, D) keys/values and attend with (1, Hq, Np, D) queries -> (1, Np, Hq * D)."""
        self.pool.write_packed(layer, self.rows, self.slots, k[0].transpose(0, 1), v[0].transpose(0, 1))
        kv = self.pool.kv
        r, t, (heads, n, dim) = kv.shape[2], self.width, q.shape[1:]
        grid = q.new_zeros(r * t, heads, dim)
        grid[self.cells] = q[0].transpose(0, 1)  # (R * T, Hq, D); padding tokens all land in the scratch row's cell
        out = model._attend(grid.view(r, t, heads, dim).transpose(1, 2), kv[layer, 0, :, :, : self.seen],
                            kv[layer, 1, :, :, : self.seen], self.mask)  # (R, Hq, T, D)
        return out.transpose(1, 2).reshape(r * t, heads, dim)[self.cells].reshape(1, n, heads * dim)


class StaticRows:
    """Rows 0..B-1 of a `BatchedKVCache` as a static forward writes and reads them (`FastLlama.begin_step`'s and
    `attention`'s cache): each row's T new slots from its (B,) first one, a tensor on the device, and the first W
    slots attended, W fixed. The host's bookkeeping (`BatchedKVCache.grow`) is the caller's, outside the graph."""

    def __init__(self, pool: BatchedKVCache, starts: torch.Tensor, width: int) -> None:
        self.pool, self.starts, self.width, self.max_len = pool, starts, width, pool.max_len
        self._slots: torch.Tensor | None = None

    def extend(self, batch: int, new: int) -> torch.Tensor:
        self._slots = self.pool.slot_index(self.starts, new)
        return self.starts

    def update(self, layer: int, start: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write (B, Hkv, T, D) keys/values at each row's new slots; return the rows' first W slots."""
        return self.pool.write_rows(layer, self._slots, keys, values, self.width)


def slot_bucket(width: int, most: int) -> int:
    """W for rows that hold ``width`` slots: a multiple of `SLOT_BUCKET`, at most ``most``."""
    return min(most, -(-width // SLOT_BUCKET) * SLOT_BUCKET)
