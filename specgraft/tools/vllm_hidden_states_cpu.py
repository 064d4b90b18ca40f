"""vLLM's ExampleHiddenStatesConnector for its CPU build: the same files, copied without CUDA. Run by vLLM, not specgraft.

vLLM 0.32's connector for the ``extract_hidden_states`` speculative method moves a finished request's states off the
GPU on a CUDA stream into pinned memory (``_submit_async_write``, example_hidden_states_connector.py:383-409);
on the CPU build that fails at ``torch.empty_like(..., pin_memory=True)``: "pin_memory=True requires a CUDA or
other accelerator backend". This subclass replaces that method alone: it reads the same slots of the same cache
with vLLM's own ``extract_from_kv_cache`` and writes the same two tensors, under the same lock, synchronously.
Everything else (which states are cached, where, the file name, which tokens) is vLLM's. tests/test_vllm.py uses it
to check what `specgraft.train.vllm_records` imports from vLLM; on a GPU, use vLLM's own connector.

On the CPU build, send one call's requests all greedy or all sampled: there, a batch that mixes them under any
speculative method (ngram too; plain decoding is unaffected) gives the greedy requests other tokens than plain
decoding, token id 0 among them.

vLLM loads it by module path, so this file's directory must be on vLLM's ``sys.path`` (it is, for
`vllm_worker.py`, which lives beside it)::

    kv_transfer_config = {"kv_connector": "CPUHiddenStatesConnector",
                          "kv_connector_module_path": "vllm_hidden_states_cpu", "kv_role": "kv_producer",
                          "kv_connector_extra_config": {"shared_storage_path": DIR}}
"""

from __future__ import annotations

import fcntl
import os

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, PendingSave, extract_from_kv_cache,
)


class _Copied:
    """The copy's completion event, as vLLM polls it (``get_finished``): a copy on the CPU is done when made."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        # The request's slots, block by block (as vLLM's method computes them).
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size).reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()  # (T, L, H)
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)  # taken when the request arrived (wait_for_save)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        self._req_copy_events[pending.req_id] = _Copied()
        self._write_tensors(tensors, _Copied(), pending.filename, lock_fd)  # writes, then releases the lock
