"""One KV cache for many sequences: rows of preallocated slots, a length per row.

Storage is one tensor (layers, 2, rows, kv_heads, slots, head_dim). Each
sequence that joins takes a free row and sees it as an ordinary
`StaticKVCache` (a view into the shared storage, with its own length), so its
prefill, its commits (`keep`) and its rollbacks are exactly the single-sequence
code. A batched verification forward writes every row at once, each at its
own first free slot (`extend` / `update` below, the interface `FastLlama`'s
layers write through), under a 4D mask per row that hides other rows'
padding and stale slots. Rows of finished or cancelled sequences are reused.

Shape legend: R rows, B rows in a forward (rows 0..B-1), T new tokens per row,
C slots per row, Hkv key/value heads, D head_dim.
"""

from __future__ import annotations

import torch

from specgraft.fast_llama import StaticKVCache


class BatchedKVCache:
    """Rows of KV slots shared by the sequences of a batch (see the module doc).

    Args:
        num_layers, kv_heads, head_dim: the model's cache geometry.
        rows: most sequences held at once.
        max_len: slots per row (prompt, generated tokens and one tree).
    """

    def __init__(
        self, num_layers: int, kv_heads: int, head_dim: int, *, rows: int, max_len: int,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    ) -> None:
        self.kv = torch.zeros(num_layers, 2, rows, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.views: list[StaticKVCache | None] = [None] * rows  # the sequence cache in each row, None when free
        self._slots: torch.Tensor | None = None  # (B, Hkv, T, D) write index of the forward in progress
        self._width = 0  # slots the forward in progress attends over: max start + T

    @property
    def rows(self) -> int:
        return self.kv.shape[2]

    def acquire(self) -> tuple[int, StaticKVCache]:
        """The lowest free row and an empty single-sequence cache over it.

        Raises:
            RuntimeError: every row is taken.
        """
        row = next((r for r, view in enumerate(self.views) if view is None), None)
        if row is None:
            raise RuntimeError(f"all {self.rows} rows of the batched KV cache are in use")
        layers, _, _, heads, slots, dim = self.kv.shape
        view = StaticKVCache(layers, heads, dim, max_len=slots, dtype=self.kv.dtype, device=self.kv.device)
        view.kv = self.kv[:, :, row : row + 1]  # (layers, 2, 1, Hkv, C, D): writes land in the shared storage
        view.keys, view.values = list(view.kv[:, 0]), list(view.kv[:, 1])
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
        slots = self.kv.shape[4]
        if max(starts) + new > slots:
            raise ValueError(f"batched KV cache overflow: a row holds {max(starts)} slots + {new} new > {slots}")
        for view in self.views[:batch]:
            if view is not None:
                view.extend(1, new)
        start = torch.tensor(starts, device=self.kv.device)
        self._width = max(starts) + new
        _, _, _, heads, _, dim = self.kv.shape
        index = start[:, None] + torch.arange(new, device=self.kv.device)  # (B, T) slot of each new token
        self._slots = index[:, None, :, None].expand(batch, heads, new, dim)
        return start

    def update(self, layer: int, start: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write (B, Hkv, T, D) keys/values at each row's slots from `extend`; return slots [0, max start + T) of rows 0..B-1."""
        b = keys.shape[0]
        k_all, v_all = self.kv[layer, 0, :b], self.kv[layer, 1, :b]  # (B, Hkv, C, D)
        k_all.scatter_(2, self._slots, keys)
        v_all.scatter_(2, self._slots, values)
        return k_all[:, :, : self._width], v_all[:, :, : self._width]
