"""A lean forward for Llama-family targets, over the Hugging Face model's own weights.

Why: on small models and CPUs the Hugging Face forward spends most of a step
in Python (mask building, cache bookkeeping, output capturing): 2.7 ms for one
token of stories260K against 0.97 ms for a plain static-cache forward. The
engine runs one target forward per step, so this is the floor under every
drafter's speed-up.

What: the same maths as ``LlamaForCausalLM`` (and Mistral, Qwen2 with q/k/v
biases, Qwen3 with q/k norms and a separate head_dim): embeddings, RMSNorm,
RoPE, grouped-query attention through ``scaled_dot_product_attention`` with
an explicit additive mask, SiLU MLP, final norm, lm_head. It holds references
to the HF model's parameters (no copies), so it sees in-place weight updates
and ``model.to(...)``; it takes RoPE from the model's own rotary module, so
every rope type (default, linear, llama3, yarn, dynamic, ...) stays exact.

`StaticKVCache` is the cache it writes: per-layer key/value buffers allocated
once and written at slots passed in (gpt-fast style), so rollback is moving a
counter and committing a tree path is one in-place gather.

Shape legend: B batch, T new tokens, S cached slots, L = S + T, C buffer
capacity, H hidden, Hq query heads, Hkv key/value heads, D head_dim, V vocab.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specgraft.model.caches import FIRST_ALLOCATION, BatchedKVCache, StaticKVCache
from specgraft.model.small_rows import (
    SmallRowChoice, key as product_key, pack, packed_linear, small_row_choice, transposed_linear,
)
from specgraft.model.staging import staged

# Architectures whose forward `FastLlama` reproduces exactly. Subclasses are
# refused: they may override any part of the forward.
FAST_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Attention backends with plain softmax attention; flex/flash are left to HF.
FAST_ATTENTION = ("sdpa", "eager")
# Rope types whose frequencies change with the sequence length: the rotary module
# must see every forward's positions instead of a precomputed table.
DYNAMIC_ROPE = ("dynamic", "longrope")


def unsupported_reason(model: nn.Module) -> str | None:
    """Why `FastLlama` cannot run ``model`` exactly, or None when it can."""
    import transformers

    name = type(model).__name__
    if name not in FAST_ARCHITECTURES or type(model) is not getattr(transformers, name, None):
        return f"{name} is not one of the fast-path architectures ({', '.join(FAST_ARCHITECTURES)})"
    config = model.config
    if config._attn_implementation not in FAST_ATTENTION:
        return f"{name} uses attn_implementation={config._attn_implementation!r}; the fast path replaces {FAST_ATTENTION} only"
    if config.hidden_act not in ("silu", "swish"):
        return f"{name} uses hidden_act={config.hidden_act!r}; the fast path implements SiLU only"
    quantization = getattr(config, "quantization_config", None)
    # A GGUF checkpoint is de-quantized to plain float weights as it loads; only its config keeps the label.
    if quantization is not None and getattr(quantization, "quant_method", None) != "gguf":
        return f"{name} is quantized; the fast path runs plain weights only"
    linears = [model.lm_head]
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    wrapped = [type(m).__name__ for m in linears if type(m) is not nn.Linear]
    if wrapped or type(model.model.embed_tokens) is not nn.Embedding:
        kinds = ", ".join(sorted(set(wrapped))) or "embeddings"
        return f"{name} has wrapped layers ({kinds}, e.g. adapters); the fast path reads plain weights"
    if any(hasattr(m, "_hf_hook") for m in model.modules()):
        return f"{name} is dispatched with accelerate hooks (device_map / offload); the fast path would bypass them"
    return None


@dataclass
class Step:
    """What every layer of one forward shares, from `FastLlama.begin_step`."""

    start: int  # the new tokens' first cache slot: they fill [start, start + T)
    cos: torch.Tensor  # (B, T, 1, D)
    sin: torch.Tensor  # (B, T, 1, D), first half negated (see `rope`)
    mask: torch.Tensor | None  # (B or 1, 1, T, L) additive or boolean, or (T, L); None: causal or one token
    causal: bool  # no mask, several new tokens and an empty cache: SDPA's is_causal


@dataclass(frozen=True)
class Segment:
    """One row's new tokens in a packed forward (`FastLlama.forward_packed`).

    Attributes:
        row: the row of the batched cache the tokens belong to.
        size: T, how many new tokens.
        visible: (T, T) bool, which of the row's new tokens each sees (a tree's ancestor mask, itself
            included); None: causal. Every new token sees all of its row's cached slots, and sits at the position
            after them plus its depth: how many of the row's new tokens it sees, less itself.
    """

    row: int
    size: int
    visible: torch.Tensor | None = None


# What one more SDPA call costs, in multiply-adds of queries by keys (query x slot x query heads x head_dim): the
# attention work of a call's padding is weighed against it when rows are grouped into calls (`_spans`). On this CPU
# a call costs ~15 us of dispatch and slicing, about what 128 slots of SmolLM2's 9 x 64 channels take; on a GPU a
# launch outweighs any padding a batch brings (an estimate: never measured there), so rows share one call.
CALL_MACS = {"cpu": 128 * 576}
GPU_CALL_MACS = 1 << 30


@dataclass(frozen=True)
class _Span:
    """One SDPA call of a packed forward: pool rows [lo, hi), each row's queries padded to ``widest``.

    Attributes:
        mask: (G, 1, T, width) additive; what each padded query sees of the span's slots [0, width).
        fill: (G * T,) the packed token each cell of the query grid takes (a padding cell: any of the span's, its
            output dropped); None when the span's tokens lie in the packed order already, from ``offset`` on.
        order: (N,) each packed token's cell, where this span is the forward's only one and moves its tokens.
        grid, columns: where each member token sits in the grid, and its index in the packed N, where others
            share the forward and this span moves its tokens.
    """

    lo: int
    hi: int
    widest: int
    width: int
    mask: torch.Tensor
    offset: int
    fill: torch.Tensor | None
    order: torch.Tensor | None
    grid: torch.Tensor | None
    columns: torch.Tensor | None


def _spans(order: Sequence[int], rows: Sequence[int], sizes: Sequence[int], starts: Sequence[int], call: float) -> list[list[int]]:
    """Segments (taken in pool-row order) cut into runs that share an SDPA call, each padded to its widest row.

    A run's work is (rows it spans) x widest x (slots its longest row sees), plus ``call`` for the call itself; a
    segment joins the run before it when that costs no more than a call of its own (rows of unequal lengths would
    otherwise pad every short row to the longest: decoding 32 MT-bench prompts attended 4x the slots they hold).
    """
    runs: list[list[int]] = []
    lo = widest = width = 0
    for i in order:
        t, w = sizes[i], starts[i] + sizes[i]
        if runs:
            now = (rows[runs[-1][-1]] + 1 - lo) * widest * width
            joined = (rows[i] + 1 - lo) * max(widest, t) * max(width, w)
            if joined <= now + call + t * w:
                runs[-1].append(i)
                widest, width = max(widest, t), max(width, w)
                continue
        runs.append([i])
        lo, widest, width = rows[i], t, w
    return runs


class PackedAttention:
    """How every layer of one packed forward writes its keys/values and attends, in a few SDPA calls.

    Built once per forward: each row's slots (taken from the pool), the write index of every token, and the rows
    cut into spans (`_spans`): runs of pool rows that share one SDPA call over the slots the span's longest row
    sees, each row's queries padded to the span's widest (a padding query, or a row of the span outside the
    forward, sees one slot and its output is dropped). Plain decoding over rows of like lengths is one call; a
    tree beside one-token rows, or rows of very unequal lengths, take calls of their own where the padding would
    cost more than the call. One call over every row's keys concatenated, with a block mask, grows with the
    square of the batch, and flex_attention on this CPU costs more than both (benchmarks/packed_attention.py).

    Shape legend: N packed tokens, R pool rows, S slots, G rows in a span, T its widest row, Hq / Hkv heads,
    D head_dim.
    """

    def __init__(self, pool: BatchedKVCache, segments: Sequence[Segment], device: torch.device, channels: int) -> None:
        self.pool = pool
        sizes = [seg.size for seg in segments]
        rows = [seg.row for seg in segments]
        starts = pool.extend_packed(rows, sizes)
        offsets = [0]
        for size in sizes[:-1]:
            offsets.append(offsets[-1] + size)
        token_rows = [row for row, n in zip(rows, sizes) for _ in range(n)]  # (N,) each token's pool row and slot
        token_slots = [slot for start, n in zip(starts, sizes) for slot in range(start, start + n)]
        call = CALL_MACS.get(device.type, GPU_CALL_MACS) / channels
        runs = _spans(sorted(range(len(segments)), key=rows.__getitem__), rows, sizes, starts, call)
        # Every index list the layers need is built on the host first, then staged in one copy (`staged`).
        seen, trees, tree_at, fills, orders, grids, columns, shapes = [], [], [], [], [], [], [], []
        for run in runs:
            lo, hi = rows[run[0]], rows[run[-1]] + 1
            widest, width = max(sizes[i] for i in run), max(starts[i] + sizes[i] for i in run)
            # Each query sees its row's cached slots (a one-token row: its own slot too); a row of the span outside
            # the run sees slot 0, and so do padding queries beyond that (their output is dropped).
            base = len(seen)
            seen += [1] * (hi - lo)
            grid, column = [], []
            for i in run:  # where each member's token sits in the (G * T) query grid, and in the packed N
                seen[base + rows[i] - lo] = starts[i] + (sizes[i] == 1)
                r, n = rows[i] - lo, sizes[i]
                grid += range(r * widest, r * widest + n)
                column += range(offsets[i], offsets[i] + n)
                if n > 1:
                    trees.append(i)
                    tree_at.append(base + rows[i] - lo)
            # The packed order already is the padded one (every row of the span, in turn, all of one size): no moves.
            in_place = column == list(range(column[0], column[0] + (hi - lo) * widest)) and grid == list(range(len(grid)))
            alone = len(runs) == 1  # the forward's only call: it holds every token
            fill, order = [], []
            if not in_place:  # each grid cell's token (padding: the span's first), and each token's cell
                fill, order = [column[0]] * ((hi - lo) * widest), [0] * len(column) if alone else []
                for cell, token in zip(grid, column):
                    fill[cell] = token
                    if alone:
                        order[token] = cell
            fills.append(fill)
            orders.append(order)
            grids.append([] if in_place or alone else grid)
            columns.append([] if in_place or alone else column)
            shapes.append((lo, hi, widest, width, base, column[0], in_place, alone))
        # A drawn tree's tokens (a segment with its own visibility): where each sits in the packed N and in the trees'
        # (M * T) block, and its row's first slot; its position is that slot plus its depth, read off the block.
        widest = max(sizes)
        drawn = [(m, i) for m, i in enumerate(trees) if segments[i].visible is not None]
        drawn_tokens = [offsets[i] + j for _, i in drawn for j in range(sizes[i])]
        drawn_cells = [m * widest + j for m, i in drawn for j in range(sizes[i])]
        drawn_starts = [starts[i] for _, i in drawn for _ in range(sizes[i])]
        staged_lists = staged(device, token_rows, token_slots, seen, [starts[i] for i in trees], tree_at, drawn_tokens,
                              drawn_cells, drawn_starts, *fills, *orders, *grids, *columns)
        self.rows, self.slots, seen_at, tree_starts, tree_rows = staged_lists[:5]
        drawn_at, cells_at, drawn_starts_at = staged_lists[5:8]
        per_span = [staged_lists[8 + k * len(runs) : 8 + (k + 1) * len(runs)] for k in range(4)]  # fills, orders, ...
        # A causal segment's token sits at its slot: (N,) RoPE positions, the drawn trees' set below.
        self.positions = self.slots
        # One (rows of every span, T, room) visibility for all spans, each span's mask cut from it.
        dtype = pool.kv.dtype
        room = max([shape[3] for shape in shapes] + [starts[i] + widest for i in trees])
        visible = torch.arange(room, device=device) < seen_at[:, None, None]  # (sum G, 1, room)
        visible = visible.expand(len(seen), widest, room).clone()
        if trees:  # each tree's (T, T) visibility into its own slots [start, start + T), all rows in one scatter
            block = causal(widest, device).expand(len(trees), widest, widest)  # chains: no work a row
            if drawn:
                block = block.clone()
                for m, i in drawn:
                    block[m, : sizes[i], : sizes[i]] = segments[i].visible
                depth = block.sum(-1).view(-1)[cells_at] - 1  # a node sees its ancestors and itself
                self.positions = self.slots.index_put((drawn_at,), drawn_starts_at + depth)
            at = tree_starts[:, None, None] + torch.arange(widest, device=device)
            visible[tree_rows] = visible[tree_rows].scatter(2, at.expand(-1, widest, -1), block)
        masks = additive(visible[:, None], dtype)  # (sum G, 1, T, room)
        self.spans = [
            _Span(lo, hi, t, width, masks[base : base + hi - lo, :, :t, :width].contiguous(), offset,
                  None if in_place else fill, None if in_place or not alone else order,
                  None if in_place or alone else grid, None if in_place or alone else column)
            for (lo, hi, t, width, base, offset, in_place, alone), fill, order, grid, column in zip(shapes, *per_span)
        ]

    def attend(self, model: FastLlama, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write layer ``layer``'s packed keys/values (1, Hkv, N, D) and attend with (1, Hq, N, D) queries -> (1, N, Hq * D)."""
        self.pool.write_packed(layer, self.rows, self.slots, k[0].transpose(0, 1), v[0].transpose(0, 1))  # (N, Hkv, D)
        keys, values = self.pool.kv[layer, 0], self.pool.kv[layer, 1]  # (R, Hkv, S, D)
        heads, n, dim = q.shape[1], q.shape[2], q.shape[3]
        tokens = q[0].transpose(0, 1)  # (N, Hq, D)
        out = None
        for span in self.spans:
            g, t = span.hi - span.lo, span.widest
            # (G * T, Hq, D): in place, or each cell's token gathered (padding cells repeat one; dropped after)
            grouped = tokens[span.offset : span.offset + g * t] if span.fill is None else tokens[span.fill]
            grouped = grouped.view(g, t, heads, dim).transpose(1, 2)  # (G, Hq, T, D)
            result = model._attend(grouped, keys[span.lo : span.hi, :, : span.width], values[span.lo : span.hi, :, : span.width],
                                   span.mask)  # (G, Hq, T, D)
            result = result.transpose(1, 2).reshape(g * t, heads, dim)  # (G * T, Hq, D)
            if len(self.spans) == 1:  # the forward's one call: every token, in order already or gathered back
                out = result if span.fill is None else result[span.order]
                return out.reshape(1, n, heads * dim)
            if out is None:
                out = tokens.new_empty(n, heads, dim)
            if span.fill is None:
                out[span.offset : span.offset + g * t] = result
            else:
                out[span.columns] = result[span.grid]
        return out.view(1, n, heads * dim)


def folded_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Grouped-query SDPA with each key/value head's group of query heads folded into its query rows: (B, Hq, T, D)
    queries over (B, Hkv, L, D) keys/values -> (B, Hq, T, D), the kernel reading each head's keys once for its group
    and never a copy of them (HF's repeat_kv copies every layer's keys and values Hq / Hkv times).

    Query head h reads key/value head h // G (G = Hq / Hkv), so the heads of a group are adjacent: (B, Hkv, G * T, D)
    with row j * T + t holding head j of the group at query t, and the (B or 1, 1, T, L) or (T, L) mask repeated G
    times along the rows (one query a row: it broadcasts as it is). One query a row, SmolLM2, 32 rows of 100-250
    slots on this CPU: 3-4% faster than SDPA's own enable_gqa.
    """
    b, heads, t, dim = q.shape
    group = heads // keys.shape[1]
    folded = q.reshape(b, keys.shape[1], group * t, dim)  # (B, Hkv, G * T, D)
    if mask is not None and t > 1:
        mask = mask if mask.dim() == 4 else mask[None, None]  # (B or 1, 1, T, L)
        rows, _, _, slots = mask.shape
        mask = mask[:, :, None].expand(rows, 1, group, t, slots).reshape(rows, 1, group * t, slots)  # (B or 1, 1, G * T, L)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scale)  # (B, Hkv, G * T, D)
    return out.view(b, heads, t, dim)


@functools.lru_cache(maxsize=64)
def causal(size: int, device: torch.device) -> torch.Tensor:
    """(T, T) bool lower triangle: a chain's visibility, made once per size and device (never written: expand or
    clone it)."""
    return torch.ones(size, size, dtype=torch.bool, device=device).tril()


def additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as SDPA's additive float mask: 0 where visible, the dtype's minimum elsewhere (measured ~4 us
    a call faster than the bool mask on this CPU)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, torch.finfo(dtype).min)


@dataclass
class _Layer:
    """References to one decoder layer's HF parameters (None where the model has no such weight)."""

    input_norm: torch.Tensor | None  # None: no input norm (EAGLE's draft layer)
    q: torch.Tensor
    q_bias: torch.Tensor | None
    k: torch.Tensor
    k_bias: torch.Tensor | None
    v: torch.Tensor
    v_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3: RMSNorm over D of each query head
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate: torch.Tensor
    gate_bias: torch.Tensor | None
    up: torch.Tensor
    up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


@dataclass(frozen=True)
class _Packed:
    """A weight's packed copy, and what the weight was when packed: a weight changed since (in place, or by
    ``model.to``) runs F.linear, never a stale copy."""

    weight: torch.Tensor
    packed: torch.Tensor
    data_ptr: int
    version: int

    def of(self, weight: torch.Tensor) -> bool:
        return weight is self.weight and weight.data_ptr() == self.data_ptr and weight._version == self.version


def _layer(layer: nn.Module) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return _Layer(
        input_norm=getattr(layer.input_layernorm, "weight", None),
        q=attn.q_proj.weight, q_bias=attn.q_proj.bias,
        k=attn.k_proj.weight, k_bias=attn.k_proj.bias,
        v=attn.v_proj.weight, v_bias=attn.v_proj.bias,
        o=attn.o_proj.weight, o_bias=attn.o_proj.bias,
        q_norm=None if q_norm is None else q_norm.weight,
        k_norm=None if k_norm is None else k_norm.weight,
        post_norm=layer.post_attention_layernorm.weight,
        gate=mlp.gate_proj.weight, gate_bias=mlp.gate_proj.bias,
        up=mlp.up_proj.weight, up_bias=mlp.up_proj.bias,
        down=mlp.down_proj.weight, down_bias=mlp.down_proj.bias,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in float32, round to the input dtype, then scale."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.rms_norm(x, weight.shape, weight, eps)  # one op, the same two float32 roundings as below
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` with rotate_half(x) * sin = roll(x, D/2) * (sin with its first half negated)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class FastLlama:
    """The forward of a Llama-family HF model (or of a draft head's decoder layers) without HF's per-call machinery.

    Built by `from_model` (a whole causal LM) or `for_layers` (a head's layers, no embedding or lm_head).

    Args:
        config: the HF config the layers were built from (sizes, head_dim, rms_norm_eps).
        layers: Llama-family decoder layers; their q/k/v, o, MLP and norm weights are read, not copied.
        rotary: the model's rotary embedding module.
        model: the whole HF model, or None for a head's layers.
        products: more weights the caller multiplies by through `linear` (a head's fc and lm_head), so that their
            shapes take the measured forms too.
    """

    def __init__(
        self, *, config, layers: Sequence[nn.Module], rotary: nn.Module, model: nn.Module | None = None,
        products: Sequence[torch.Tensor] = (),
    ) -> None:
        self.model = model
        self.products = tuple(products)  # weights beyond the layers' that `linear` multiplies by (a head's fc, lm_head)
        self.num_layers = len(layers)
        self.num_heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scale = self.head_dim**-0.5
        self.eps = config.rms_norm_eps
        self.embed = self.final_norm = self.lm_head = self.lm_head_bias = None
        if model is not None:
            self.embed = model.model.embed_tokens.weight  # (V, H)
            self.final_norm = model.model.norm.weight
            self.lm_head, self.lm_head_bias = model.lm_head.weight, model.lm_head.bias  # tied: the same tensor as embed
        self.layers = [_layer(layer) for layer in layers]
        self.rotary = rotary
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # (P, D) cos, signed sin
        self.small_rows = SmallRowChoice()  # F.linear everywhere until `choose_small_rows`
        self.packed: dict[int, _Packed] = {}  # id(weight) -> its packed copy, for the shapes that take that form
        self._taps: dict[tuple[int, ...], frozenset[int]] = {(): frozenset()}  # see `taps`

    def taps(self, hidden_layers: tuple[int, ...]) -> frozenset[int]:
        """The layer indices whose states ``hidden_layers`` (HF hidden_states indices, negative from the end) ask for,
        checked once per tuple: a drafted row's every verification asks the same few (1-2 us a forward otherwise)."""
        wanted = self._taps.get(hidden_layers)
        if wanted is None:
            count = self.num_layers + 1
            if any(not -count <= i < count for i in hidden_layers):
                raise IndexError(
                    f"hidden_layers {tuple(hidden_layers)}: a {self.num_layers}-layer model has hidden states 0..{self.num_layers}"
                )
            wanted = self._taps[hidden_layers] = frozenset(i % count for i in hidden_layers)
        return wanted

    def choose_small_rows(self, mode: str | None = None) -> SmallRowChoice:
        """Measure (or pin, see `small_row_choice`) which form each of this model's weight shapes runs in, and keep
        the packed copies of the shapes that take the packed form."""
        weights = self._product_weights()
        choice, packed = small_row_choice(weights, mode)
        return self._keep(choice, weights, packed)

    def share_small_rows(self, choice: SmallRowChoice, owner: FastLlama | None = None) -> SmallRowChoice:
        """Take another model's choice, measured on this machine (a draft's shapes shared with its target take the
        same forms), packing this model's own weights of the shapes it packs; a weight that is one of ``owner``'s
        (the same storage: an EAGLE head's view of its target's lm_head) takes the owner's packed copy instead of
        a second one."""
        weights = self._product_weights()
        taken = {(o, i) for (o, i, _), form in choice.forms.items() if form == "packed"}
        theirs = {} if owner is None else {(p.data_ptr, tuple(p.weight.shape)): p.packed
                                           for p in owner.packed.values() if p.of(p.weight)}  # fresh ones only
        packed = {}
        for shape, mats in weights.items():
            if shape in taken:
                packs = [theirs.get((w.data_ptr(), shape)) for w in mats]
                packs = [pack(w) if p is None else p for w, p in zip(mats, packs)]
                if all(p is not None for p in packs):
                    packed[shape] = packs
        return self._keep(choice, weights, packed)

    def _product_weights(self) -> dict[tuple[int, int], list[torch.Tensor]]:
        """Every weight this model multiplies by, once each (a tied lm_head is the embeddings), by shape."""
        weights: dict[tuple[int, int], list[torch.Tensor]] = {}
        mats = ([self.lm_head] if self.lm_head is not None else []) + list(self.products)
        for layer in self.layers:
            mats += [layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down]
        for w in {id(w): w for w in mats}.values():
            weights.setdefault(tuple(w.shape), []).append(w)
        return weights

    def _keep(self, choice: SmallRowChoice, weights: dict, packed: dict) -> SmallRowChoice:
        self.small_rows = choice
        self.packed = {id(w): _Packed(w, p, w.data_ptr(), w._version)
                       for shape, packs in packed.items() for w, p in zip(weights[shape], packs)}
        return choice

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear`` (x (..., K) @ weight (N, K).T + bias), or the same product in the form this machine ran
        fastest for this shape and row count (`specgraft.model.small_rows`)."""
        if not self.small_rows.forms:
            return F.linear(x, weight, bias)
        form = self.small_rows.forms.get(product_key(weight, x.numel() // x.shape[-1]))
        if form == "transposed":
            return transposed_linear(x, weight, bias)
        if form == "packed":
            packed = self.packed.get(id(weight))
            if packed is not None and packed.of(weight):
                return packed_linear(x, packed.packed, bias)
        return F.linear(x, weight, bias)

    @classmethod
    def from_model(cls, model: nn.Module) -> FastLlama:
        """The whole forward of ``model``: a LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM or
        Qwen3ForCausalLM with sdpa or eager attention.

        Raises:
            ValueError: the model is not one `unsupported_reason` accepts.
        """
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"no fast path: {reason}")
        layers = model.model.layers[: model.config.num_hidden_layers]
        return cls(config=model.config, layers=layers, rotary=model.model.rotary_emb, model=model)

    @classmethod
    def for_layers(
        cls, layers: Sequence[nn.Module], config, rotary: nn.Module, products: Sequence[torch.Tensor] = ()
    ) -> FastLlama:
        """Only the decoder math over given Llama decoder layers (a draft head's), for `run_layers`; ``products``
        are the head's other weights it multiplies by through `linear`.

        A layer that is not a plain Llama block (EAGLE-3's midlayer) composes `begin_step`,
        `attention` and `mlp` itself; its q/k/v, o, MLP and norm weights are read here all the same.
        """
        return cls(config=config, layers=layers, rotary=rotary, products=products)

    def subset(self, layers: Sequence[int]) -> FastLlama:
        """The same model running only decoder ``layers`` (increasing indices), for self-speculative drafting.

        Embeddings, final norm, lm_head and every kept layer's weights are the
        same tensors (nothing is copied); cache layer j of the result holds
        decoder layer ``layers[j]``.
        """
        sub = copy.copy(self)
        sub.layers = [self.layers[i] for i in layers]
        sub.num_layers = len(sub.layers)
        return sub

    def new_cache(self, max_len: int) -> StaticKVCache:
        weight = self.layers[0].q
        return StaticKVCache(
            self.num_layers, self.kv_heads, self.head_dim, max_len=max_len, dtype=weight.dtype, device=weight.device
        )

    def new_batched_cache(self, rows: int, max_len: int, scratch: bool = False) -> BatchedKVCache:
        """Rows of ``max_len`` slots for a batch of sequences, each row a `StaticKVCache` view (`BatchedKVCache.acquire`);
        ``scratch`` adds a row a captured forward pads into."""
        weight = self.layers[0].q
        return BatchedKVCache(
            self.num_layers, self.kv_heads, self.head_dim, rows=rows, max_len=max_len, dtype=weight.dtype,
            device=weight.device, scratch=scratch,
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: StaticKVCache,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        hidden_layers: tuple[int, ...] = (),
        last_only: bool = False,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run (B, T) new tokens after the cache's slots; return logits (B, T or 1, V) and the requested hidden states.

        ``attention_mask`` is (B or 1, 1, T, S + T) additive (or boolean, True = visible);
        None means causal over the cache and the new tokens. ``hidden_layers``
        are HF hidden_states indices: 0 the embeddings, i the input of decoder
        layer i, num_layers the output of the final norm; negative ones count
        from the end as in HF's tuple.
        """
        wanted = self.taps(hidden_layers)
        x = F.embedding(input_ids, self.embed)  # (B, T, H)
        states: dict[int, torch.Tensor] = {}
        x = self.run_layers(x, cache, position_ids, attention_mask, wanted, states)
        x = rms_norm(x, self.final_norm, self.eps)  # (B, T, H)
        if self.num_layers in wanted:
            states[self.num_layers] = x
        if last_only:
            x = x[:, -1:]
        logits = self.linear(x, self.lm_head, self.lm_head_bias)  # (B, T or 1, V)
        return logits, {i: states[i % (self.num_layers + 1)] for i in hidden_layers} if hidden_layers else {}

    def run_layers(
        self,
        x: torch.Tensor,
        cache: StaticKVCache,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        wanted: set[int] = frozenset(),
        states: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The decoder layers over (B, T, H) inputs after the cache's slots; inputs of ``wanted`` layers go to ``states``."""
        step = self.begin_step(x, cache, position_ids, attention_mask)
        for i, layer in enumerate(self.layers):
            if states is not None and i in wanted:
                states[i] = x
            h = x if layer.input_norm is None else rms_norm(x, layer.input_norm, self.eps)
            x = x + self.attention(i, layer, h, cache, step)
            h = rms_norm(x, layer.post_norm, self.eps)
            x = x + self.mlp(layer, h)
        return x

    def begin_step(
        self, x: torch.Tensor, cache: StaticKVCache, position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> Step:
        """Take cache slots for (B, T, ...) new inputs and compute what every layer's `attention` then shares.

        Args:
            x: the new inputs; only their batch, length, dtype and device are read.
            cache: gets T more slots (see `StaticKVCache.extend`).
            position_ids: (B or 1, T) RoPE positions of the new inputs.
            attention_mask: as in `forward`; None means causal over the cache and the new inputs.
        """
        b, t = x.shape[:2]
        start = cache.extend(b, t)  # new tokens take slots [start, start + t)
        cos, sin = self._rope(x, position_ids, cache.max_len)  # (B, T, 1, D) each
        mask, causal = attention_mask, False
        if mask is None and t > 1:
            if start == 0:
                causal = True
            else:  # query i sees every cached slot and new tokens 0..i
                mask = torch.ones(t, start + t, dtype=torch.bool, device=x.device).tril(start)  # (T, L)
        return Step(start, cos, sin, mask, causal)

    def attention(self, index: int, layer: _Layer, h: torch.Tensor, cache: StaticKVCache, step: Step) -> torch.Tensor:
        """Layer ``index``'s attention block on its (B, T, K) normed input -> (B, T, H), writing its keys/values.

        K is whatever width the layer's q/k/v projections read: H in a Llama layer, 2H in EAGLE-3's midlayer.
        No residual is added.
        """
        b, t, _ = h.shape
        q, k, v = self._project(layer, h, step.cos, step.sin)
        keys, values = cache.update(index, step.start, k, v)  # (B, Hkv, L, D) each
        out = self._attend(q, keys, values, step.mask, causal=step.causal)  # (B, Hq, T, D)
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)  # (B, T, Hq * D)
        return self.linear(out, layer.o, layer.o_bias)  # (B, T, H)

    def _project(
        self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (B, Hq, T, D) and keys, values (B, Hkv, T, D) of (B, T, K) normed inputs, RoPE applied."""
        b, t, _ = h.shape
        q = self.linear(h, layer.q, layer.q_bias).view(b, t, self.num_heads, self.head_dim)  # (B, T, Hq, D)
        k = self.linear(h, layer.k, layer.k_bias).view(b, t, self.kv_heads, self.head_dim)  # (B, T, Hkv, D)
        v = self.linear(h, layer.v, layer.v_bias).view(b, t, self.kv_heads, self.head_dim)
        if layer.q_norm is not None:  # Qwen3 normalises each head before RoPE
            q = rms_norm(q, layer.q_norm, self.eps)
            k = rms_norm(k, layer.k_norm, self.eps)
        return rope(q, cos, sin).transpose(1, 2), rope(k, cos, sin).transpose(1, 2), v.transpose(1, 2)

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, causal: bool = False
    ) -> torch.Tensor:
        """SDPA of (B, Hq, T, D) queries over (B, Hkv, L, D) keys/values under ``mask`` -> (B, Hq, T, D).

        On CPU SDPA groups the query heads itself (enable_gqa), fastest with a mask, and one query a row folds a
        group's heads into query rows (`folded_attention`); CUDA's fused kernels take enable_gqa only without a
        mask, so there a masked forward folds too (rather than repeat every key and value for each head).
        """
        gqa = self.num_heads != self.kv_heads
        if gqa and not causal and (q.shape[2] == 1 or (mask is not None and q.device.type != "cpu")):
            return folded_attention(q, keys, values, mask, self.scale)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=gqa)

    @torch.inference_mode()
    def forward_packed(
        self,
        input_ids: torch.Tensor,
        pool: BatchedKVCache,
        segments: Sequence[Segment],
        hidden_layers: tuple[int, ...] = (),
        logits_at: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run several rows' new tokens, concatenated, in one forward: logits (N, V) and hidden states (N, H).

        The linear layers see (N, H), every row's tokens and no padding; attention runs per row over that
        row's slots (`PackedAttention`). Token order: segment by segment, as ``segments`` lists them. A token's
        RoPE position is its row's length before the forward plus its depth in the segment (`Segment`).

        Args:
            input_ids: (N,) the segments' tokens, concatenated.
            pool: the rows' cache; each segment's row gets its tokens' slots after its own length.
            segments: one per row, N tokens in all.
            hidden_layers: as in `forward`.
            logits_at: (M,) the tokens whose logits are wanted (a prefill wants each prompt's last): logits (M, V).
        """
        self.taps(hidden_layers)  # checked before the pool's rows grow
        x = F.embedding(input_ids, self.embed)[None]  # (1, N, H)
        packed = PackedAttention(pool, segments, x.device, self.num_heads * self.head_dim)
        cos, sin = self._rope(x, packed.positions[None], pool.max_len)  # (1, N, 1, D)
        return self.packed_layers(x, cos, sin, packed, hidden_layers, logits_at)

    def packed_layers(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention, hidden_layers: tuple[int, ...] = (),
        logits_at: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The decoder layers, final norm and lm_head over (1, N, H) packed inputs: logits (N, or M at ``logits_at``,
        V) and the ``hidden_layers``' states (N, H).

        ``attention`` writes each layer's keys/values and attends, ``attend(model, layer, q, k, v)`` -> (1, N, Hq * D):
        a `PackedAttention`, or a captured forward's static grid (`specgraft.model.captured`). ``cos``, ``sin``:
        (1, N, 1, D).
        """
        wanted = self.taps(hidden_layers)
        states: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in wanted:
                states[i] = x[0]
            h = x if layer.input_norm is None else rms_norm(x, layer.input_norm, self.eps)
            q, k, v = self._project(layer, h, cos, sin)  # (1, Hq, N, D), (1, Hkv, N, D) x 2
            out = attention.attend(self, i, q, k, v)  # (1, N, Hq * D)
            x = x + self.linear(out, layer.o, layer.o_bias)
            x = x + self.mlp(layer, rms_norm(x, layer.post_norm, self.eps))
        x = rms_norm(x, self.final_norm, self.eps)  # (1, N, H)
        if self.num_layers in wanted:
            states[self.num_layers] = x[0]
        if logits_at is not None:
            x = x[:, logits_at]  # (1, M, H)
        logits = self.linear(x, self.lm_head, self.lm_head_bias)[0]  # (N or M, V)
        return logits, {i: states[i % (self.num_layers + 1)] for i in hidden_layers} if hidden_layers else {}

    def mlp(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        """Layer's SiLU MLP on its (B, T, H) normed input -> (B, T, H); no residual is added."""
        gate = F.silu(self.linear(h, layer.gate, layer.gate_bias))  # (B, T, I)
        return self.linear(gate * self.linear(h, layer.up, layer.up_bias), layer.down, layer.down_bias)  # (B, T, H)

    def _rope(self, x: torch.Tensor, position_ids: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin at each position, (B, T, 1, D), from the model's own rotary module.

        Static rope types read a table that the module computed once, for every position below ``slots`` (the
        cache's: a token's position never exceeds its slot), grown when a larger cache comes, so no forward reads
        its positions back from the device (vLLM keeps such a table for the model's whole context); dynamic ones
        ask the module every time, as HF does.
        """
        if self.rotary.rope_type in DYNAMIC_ROPE:
            cos, sin = self.rotary(x, position_ids)  # (B, T, D)
            return cos[:, :, None], self._sign(sin)[:, :, None]
        table = self._rope_table
        if table is None or table[0].shape[0] < slots or table[0].dtype != x.dtype or table[0].device != x.device:
            size = max(slots, FIRST_ALLOCATION, 0 if table is None else table[0].shape[0])
            cos, sin = self.rotary(x, torch.arange(size, device=x.device)[None])  # (1, P, D)
            table = self._rope_table = (cos[0], self._sign(sin[0]))
        return table[0][position_ids][:, :, None], table[1][position_ids][:, :, None]

    @staticmethod
    def _sign(sin: torch.Tensor) -> torch.Tensor:
        """sin with its first half negated, so that rotate_half(x) * sin == roll(x, D/2) * signed sin."""
        half = sin.shape[-1] // 2
        return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
