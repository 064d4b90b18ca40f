"""Seconds of the device's work, read without a sync of its own.

The host clock times what the host waits for. On a CPU that is the work; on a GPU kernels run after their launch,
so the host's seconds around a forward are its launches, and a controller pricing trees with them would find every
forward nearly free. There a span is two CUDA events recorded on the stream around the work, and its seconds are
read once the step's own readback has waited for them (vLLM and SGLang time their steps the same way).
"""

from __future__ import annotations

import time

import torch

Mark = float | torch.cuda.Event  # what `DeviceClock.mark` returns: the host clock, or an event on the stream


class DeviceClock:
    """Marks around device work, and the seconds between two of them."""

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"

    def mark(self) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def seconds(start: Mark, end: Mark) -> float:
        """Seconds from ``start`` to ``end``; on a GPU it waits for ``end``, which a step reads after its readback
        (so it waits for nothing there)."""
        if isinstance(start, float):
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3
