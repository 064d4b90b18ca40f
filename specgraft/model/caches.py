"""The KV caches, one protocol: what the target adapter, the fast forward and the engine share.

Every cache has ``len`` (filled slots), ``crop(length)`` (rollback: drop slots
from ``length`` on), ``keep(prefix_len, rows)`` (commit an accepted tree path:
keep the prefix plus those rows, gathered contiguously) and ``layer_kv(i)``;
caches a forward writes through add ``extend`` (take slots for new tokens)
and ``update`` (write one layer's keys/values there).

- `KVCache`: over transformers' `DynamicCache`, for Hugging Face's forward.
- `StaticKVCache`: preallocated buffers written at explicit slots (gpt-fast
  style), for `FastLlama`; rollback moves a counter.
- `BatchedKVCache`: rows of preallocated slots for many sequences, a length
  per row; each row is a `StaticKVCache` view. A forward over rows 0..B-1
  padded to one width writes every row at its own slots (`extend` /
  `update`: a draft head's batched levels); a packed forward writes each
  listed row's own tokens, concatenated (`extend_packed` / `write_packed`:
  the engine's verification, where a plain row costs one token).

Shape legend: B batch (rows in a forward), R rows, T new tokens, S cached
slots, C buffer capacity, Hkv key/value heads, D head_dim.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

FIRST_ALLOCATION = 256  # slots a StaticKVCache allocates on its first write (at least what it needs); doubled when full


class KVCache:
    """One owner for a model's key/value cache, with explicit lengths.

    Wraps transformers' `DynamicCache` (per layer ``keys``/``values`` of shape
    (B, kv_heads, S, head_dim)) and adds the two edits speculation needs:
    `keep` for committing an accepted tree path and `crop` for rollback.
    """

    def __init__(self) -> None:
        self.hf = DynamicCache()

    def __len__(self) -> int:
        return self.hf.get_seq_length()

    def crop(self, length: int) -> None:
        """Drop every position from ``length`` on."""
        if not 0 <= length <= len(self):
            raise ValueError(f"cannot crop a cache of {len(self)} positions to {length}")
        for layer in self.hf.layers:
            if layer.is_initialized:
                layer.keys = layer.keys[:, :, :length]
                layer.values = layer.values[:, :, :length]

    def keep(self, prefix_len: int, rows: torch.Tensor, listed: list[int] | None = None) -> None:
        """Keep the first ``prefix_len`` positions plus ``prefix_len + rows`` (B, K), contiguously.

        This is the commit of an accepted path: tree nodes are written after
        the prefix in tree order, the accepted ones are gathered behind the
        prefix and everything else is dropped. (``listed``: as `StaticKVCache.keep`.)
        """
        rows = rows if rows.dim() == 2 else rows[None]
        for layer in self.hf.layers:
            if not layer.is_initialized:
                continue
            b, h, _, d = layer.keys.shape
            index = (prefix_len + rows)[:, None, :, None].expand(b, h, rows.shape[1], d)  # (B, kv_heads, K, hd)
            kept_k = layer.keys.gather(2, index)
            kept_v = layer.values.gather(2, index)
            layer.keys = torch.cat([layer.keys[:, :, :prefix_len], kept_k], dim=2)
            layer.values = torch.cat([layer.values[:, :, :prefix_len], kept_v], dim=2)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of one layer, each (B, kv_heads, S, head_dim)."""
        entry = self.hf.layers[layer]
        return entry.keys, entry.values


class StaticKVCache:
    """Preallocated key/value buffers written at explicit slots, with a length counter; rollback is free.

    Storage is one tensor ``kv`` of shape (layers, 2, B, Hkv, C, D), allocated on
    the first write (when B is known) and doubled when a write needs more room,
    up to ``max_len`` slots. Slots are not positions: the nodes of a tree share
    positions but each has its own slot.

    The interface is `KVCache`'s: ``len``, ``crop``, ``keep``,
    ``layer_kv``; plus `extend` and `update`, which a forward uses to write.

    Args:
        num_layers, kv_heads, head_dim: the model's cache geometry.
        max_len: most slots this cache may hold; a write beyond it raises.
        dtype, device: of the buffers (the model's).
    """

    def __init__(
        self, num_layers: int, kv_heads: int, head_dim: int, *, max_len: int,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    ) -> None:
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.max_len, self.dtype, self.device = max_len, dtype, torch.device(device)
        self.kv: torch.Tensor | None = None  # (layers, 2, B, Hkv, C, D) once written
        self.keys: list[torch.Tensor] = []  # per layer a (B, Hkv, C, D) view of kv
        self.values: list[torch.Tensor] = []
        self.length = 0

    def __len__(self) -> int:
        return self.length

    @property
    def capacity(self) -> int:
        return 0 if self.kv is None else self.kv.shape[4]

    def extend(self, batch: int, new: int) -> int:
        """Count ``new`` more slots as filled (growing the buffers if needed) and return the first of them."""
        start, end = self.length, self.length + new
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {start} slots held + {new} new exceed max_len {self.max_len}")
        if self.kv is not None and self.kv.shape[2] != batch:
            raise ValueError(f"this KV cache holds batch {self.kv.shape[2]}, got a forward of batch {batch}")
        if end > self.capacity:
            self._grow(batch, end)
        self.length = end
        return start

    def update(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write (B, Hkv, T, D) keys/values at slots [start, start + T); return (keys, values) of slots [0, start + T)."""
        t = keys.shape[2]
        k, v = self.keys[layer], self.values[layer]  # (B, Hkv, C, D); narrow is the cheapest slice on the hot path
        k.narrow(2, start, t).copy_(keys)
        v.narrow(2, start, t).copy_(values)
        return k.narrow(2, 0, start + t), v.narrow(2, 0, start + t)

    def crop(self, length: int) -> None:
        """Drop every slot from ``length`` on (only the counter moves)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        self.length = length

    def keep(self, prefix_len: int, rows: torch.Tensor, listed: list[int] | None = None) -> None:
        """Keep slots [0, prefix_len) plus ``prefix_len + rows``, gathered contiguously behind the prefix.

        Args:
            prefix_len: slots before the tree, kept as they are.
            rows: (K,) or (B, K) increasing tree rows (relative to the prefix) to keep, e.g. an accepted path.
            listed: the (K,) rows as host ints where the caller read them already (else they are read here).
        """
        rows = rows if rows.dim() == 2 else rows[None]  # (B or 1, K)
        listed = [listed] if listed is not None else rows.tolist()  # a few paths of a few rows: checked on the host
        k = rows.shape[1]
        if not 0 <= prefix_len <= self.length:
            raise ValueError(f"keep: prefix_len {prefix_len} outside a cache of {self.length} positions")
        if any(not 0 <= r < self.length - prefix_len for path in listed for r in path):
            raise ValueError(f"keep: rows {listed} outside the {self.length - prefix_len} slots after the prefix")
        # A path that is already contiguous (plain decoding, a fully accepted chain) needs no move.
        if any(path != list(range(k)) for path in listed):
            self._gather(prefix_len, rows.to(self.device))
        self.length = prefix_len + k

    @torch.inference_mode()
    def _gather(self, prefix_len: int, rows: torch.Tensor) -> None:
        layers, _, b, h, _, d = self.kv.shape
        k = rows.shape[1]
        index = (prefix_len + rows).expand(b, k)  # (B, K)
        # Read every kept row before writing any: rows[i] >= i, so sources and targets may overlap.
        kept = self.kv.gather(4, index[None, None, :, None, :, None].expand(layers, 2, b, h, k, d))  # (layers, 2, B, Hkv, K, D)
        self.kv[:, :, :, :, prefix_len:prefix_len + k] = kept

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of one layer, each (B, Hkv, S, D): views, valid until the next write grows the buffers."""
        if self.kv is None:
            empty = torch.zeros(1, self.kv_heads, 0, self.head_dim, dtype=self.dtype, device=self.device)
            return empty, empty
        return self.keys[layer][:, :, :self.length], self.values[layer][:, :, :self.length]

    def _grow(self, batch: int, needed: int) -> None:
        capacity = max(needed, FIRST_ALLOCATION if self.kv is None else 2 * self.capacity)
        capacity = min(capacity, self.max_len)
        kv = torch.zeros(
            self.num_layers, 2, batch, self.kv_heads, capacity, self.head_dim, dtype=self.dtype, device=self.device
        )
        if self.kv is not None:
            kv[:, :, :, :, :self.length] = self.kv[:, :, :, :, :self.length]
        self.kv = kv
        self.keys, self.values = list(kv[:, 0]), list(kv[:, 1])


class BatchedKVCache:
    """Rows of KV slots shared by the sequences of a batch (see the module doc).

    Args:
        num_layers, kv_heads, head_dim: the model's cache geometry.
        rows: most sequences held at once.
        max_len: slots per row (prompt, generated tokens and one tree).
        scratch: one more row after those, never acquired: a forward at static shapes writes its padding tokens'
            keys/values there (`specgraft.model.captured`).
    """

    def __init__(
        self, num_layers: int, kv_heads: int, head_dim: int, *, rows: int, max_len: int,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", scratch: bool = False,
    ) -> None:
        self.max_len = max_len
        self.scratch_row = rows if scratch else None
        self.kv = torch.zeros(num_layers, 2, rows + scratch, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.views: list[StaticKVCache | None] = [None] * rows  # the sequence cache in each row, None when free
        # Each row's storage views, (kv, keys by layer, values by layer), made on its first acquire: a sequence takes a
        # row per request, and splitting a row's layers anew cost 10 us of a 17 us acquire (stories260K's head).
        self._row_views: list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]] | None] = [None] * rows
        self._slots: torch.Tensor | None = None  # (B, Hkv, T, D) write index of the forward in progress
        self._width = 0  # slots the forward in progress attends over: max start + T

    @property
    def rows(self) -> int:
        """Rows a sequence may take (the scratch row is not one)."""
        return len(self.views)

    def acquire(self, row: int | None = None) -> tuple[int, StaticKVCache]:
        """A free row (the lowest, or ``row``) and an empty single-sequence cache over it.

        Raises:
            RuntimeError: every row is taken, or ``row`` is.
        """
        if row is None:
            row = next((r for r, view in enumerate(self.views) if view is None), None)
            if row is None:
                raise RuntimeError(f"all {self.rows} rows of the batched KV cache are in use")
        elif self.views[row] is not None:
            raise RuntimeError(f"row {row} of the batched KV cache is in use")
        layers, _, _, heads, slots, dim = self.kv.shape
        view = StaticKVCache(layers, heads, dim, max_len=slots, dtype=self.kv.dtype, device=self.kv.device)
        views = self._row_views[row]
        if views is None:
            kv = self.kv[:, :, row : row + 1]  # (layers, 2, 1, Hkv, C, D): writes land in the shared storage
            views = self._row_views[row] = (kv, list(kv[:, 0]), list(kv[:, 1]))
        view.kv, keys, values = views
        view.keys, view.values = list(keys), list(values)  # copies of the lists: a cache never shares its own
        self.views[row] = view
        return row, view

    def release(self, row: int) -> None:
        """Free a row for the next sequence (its slots are overwritten, never read again)."""
        self.views[row] = None

    def lengths(self, batch: int) -> list[int]:
        """Filled slots of rows 0..batch-1 (0 for a free row)."""
        return [0 if view is None else len(view) for view in self.views[:batch]]

    # -- the interface a batched forward writes through (FastLlama.begin_step / attention) ----------
    def extend(self, batch: int, new: int) -> torch.Tensor:
        """Give rows 0..batch-1 ``new`` more slots each, after their own lengths; returns each row's first (B,)."""
        starts = self.lengths(batch)
        self.grow(batch, new)
        start = torch.tensor(starts, device=self.kv.device)
        self._width = max(starts) + new
        self._slots = self.slot_index(start, new)
        return start

    def slot_index(self, starts: torch.Tensor, new: int) -> torch.Tensor:
        """(B, Hkv, T, D) scatter index of ``new`` tokens a row from each row's (B,) first slot (`write_rows`)."""
        _, _, _, heads, _, dim = self.kv.shape
        index = starts[:, None] + torch.arange(new, device=starts.device)  # (B, T) slot of each new token
        return index[:, None, :, None].expand(starts.shape[0], heads, new, dim)

    def grow(self, batch: int, new: int) -> int:
        """`extend`'s bookkeeping alone: rows 0..batch-1 held ``new`` more slots each; returns the longest row's length
        after (a static forward computes the slots on the device itself: `specgraft.model.captured.StaticRows`).

        Raises:
            ValueError: a row that would overflow its slots.
        """
        longest = max(self.lengths(batch))
        if longest + new > self.kv.shape[4]:
            raise ValueError(f"batched KV cache overflow: a row holds {longest} slots + {new} new > {self.kv.shape[4]}")
        for view in self.views[:batch]:
            if view is not None:
                view.extend(1, new)
        return longest + new

    def update(self, layer: int, start: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write (B, Hkv, T, D) keys/values at each row's slots from `extend`; return slots [0, max start + T) of rows 0..B-1."""
        return self.write_rows(layer, self._slots, keys, values, self._width)

    def write_rows(
        self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write (B, Hkv, T, D) keys/values of rows 0..B-1 at ``slots`` (their (B, Hkv, T, D) index); return the rows'
        first ``width`` slots."""
        b = keys.shape[0]
        k_all, v_all = self.kv[layer, 0, :b], self.kv[layer, 1, :b]  # (B, Hkv, C, D)
        k_all.scatter_(2, slots, keys)
        v_all.scatter_(2, slots, values)
        return k_all[:, :, :width], v_all[:, :, :width]

    @property
    def nbytes(self) -> int:
        """Bytes of the whole allocation (every row's slots)."""
        return self.kv.numel() * self.kv.element_size()

    # -- the interface a packed forward writes through (`FastLlama.forward_packed`) ---------------------
    def extend_packed(self, rows: list[int], sizes: list[int]) -> list[int]:
        """Give each of ``rows`` (held, distinct) ``sizes[i]`` more slots after its own length; returns their first slots.

        Raises:
            ValueError: a row that is free, or one that would overflow its slots.
        """
        starts = []
        for row, size in zip(rows, sizes, strict=True):
            view = self.views[row]
            if view is None:
                raise ValueError(f"row {row} of the batched KV cache is free: acquire it before a forward")
            starts.append(view.extend(1, size))
        return starts

    def write_packed(self, layer: int, rows: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write packed (N, Hkv, D) keys/values of one layer, token i at row ``rows[i]``, slot ``slots[i]``."""
        self.kv[layer, 0][rows, :, slots] = keys
        self.kv[layer, 1][rows, :, slots] = values

