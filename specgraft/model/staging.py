"""Host-built index lists on the device, in one copy a step.

A step knows many small things on the host (each row's slots, lengths,
offsets). Built as a tensor apiece, each is a copy from pageable memory that
blocks the host on a GPU; staged together they are one copy, from pinned
memory without blocking.
"""

from __future__ import annotations

import torch


def staged(device: torch.device, *lists: list[int]) -> list[torch.Tensor]:
    """``lists`` as (len,) int64 tensors on ``device``, views of one tensor copied there once."""
    flat = [x for values in lists for x in values]
    if device.type == "cuda":
        tensor = torch.tensor(flat, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)
    else:
        tensor = torch.tensor(flat, dtype=torch.long, device=device)
    return list(tensor.split([len(values) for values in lists]))
