"""How many torch threads a model runs with: the one place that chooses.

torch's default (one thread per core) is the wrong choice for small models on a
CPU: each op is too short to split, and on a shared machine the threads wait on
each other. Measured on a 2-core CPU, plain greedy decoding:

- shared with other jobs (load average 8-9), median of 3 interleaved runs:
  stories260K 454 tokens/s on one thread against 7.0 on two; SmolLM2-135M
  (float32, 32 tokens) 7.6 against 1.1;
- otherwise idle, 3 interleaved runs each: stories260K 2,540-2,600 tokens/s on
  one thread against 2,420-2,470 on two; SmolLM2-135M 33-34 against 49-52.

So a tiny model runs on one thread, and a larger one on the cores that are idle
when it loads (sampled from /proc/stat over a fraction of a second; where that
cannot be read, one per core this process may use). No torch import at module
level: the CLI's flags read this module.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

# One thread is fastest below this many parameters whatever the load: 260K measured
# so, idle or shared; 135M gains from a second idle core. Nothing between 2.2M (the
# quickstart's demo target, one thread) and 135M was measured; the line sits between.
ONE_THREAD_BELOW = 10_000_000
IDLE_SAMPLE_S = 0.2  # how long /proc/stat is watched for idle cores


@dataclass(frozen=True)
class ThreadChoice:
    """A thread count (None: torch's setting is left alone) and why, for reports."""

    threads: int | None
    why: str


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no affinity call
        return os.cpu_count() or 1


def idle_cores(window_s: float = IDLE_SAMPLE_S) -> float | None:
    """Cores idle over the next ``window_s`` seconds, machine-wide (Linux /proc/stat), or None where unreadable.

    The calling thread sleeps meanwhile, so its own process counts only for threads it runs elsewhere.
    """

    def snapshot() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        return fields[3] + fields[4], sum(fields)

    try:
        idle0, total0 = snapshot()
        time.sleep(window_s)
        idle1, total1 = snapshot()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    return (idle1 - idle0) / (total1 - total0) * (os.cpu_count() or 1)


def choose_threads(num_params: int, device_type: str = "cpu", requested: int | str | None = "auto") -> ThreadChoice:
    """The thread count for a model of ``num_params`` on ``device_type``.

    Args:
        requested: "auto" picks from the model's size and the machine (an
            ``OMP_NUM_THREADS`` in the environment wins, as the user's own
            choice); a positive int is used as given; None keeps torch's setting.

    Raises:
        ValueError: ``requested`` is neither "auto", None nor a positive int.
    """
    if requested is None:
        return ThreadChoice(None, "torch's setting kept")
    if requested != "auto":
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"threads must be 'auto', None or a positive int, got {requested!r}")
        return ThreadChoice(requested, "as requested")
    if device_type != "cpu":
        return ThreadChoice(None, f"torch's setting kept: the model runs on {device_type}")
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return ThreadChoice(int(os.environ["OMP_NUM_THREADS"]), "auto: OMP_NUM_THREADS")
    size = f"{num_params / 1e6:.1f}M parameters"
    if num_params < ONE_THREAD_BELOW:
        return ThreadChoice(1, f"auto: {size}, under {ONE_THREAD_BELOW / 1e6:.0f}M run fastest on one thread")
    cores = available_cores()
    idle = idle_cores()
    if idle is None:
        return ThreadChoice(cores, f"auto: {size}, one thread per available core ({cores})")
    threads = max(1, min(cores, round(idle)))
    return ThreadChoice(threads, f"auto: {size}, one thread per idle core ({idle:.1f} of {cores} idle)")


def apply_threads(model, requested: int | str | None = "auto") -> ThreadChoice:
    """Set torch's thread count for ``model`` (a torch module) as `choose_threads` decides; return the choice."""
    import torch

    first = next(model.parameters(), None)
    device_type = first.device.type if first is not None else "cpu"
    choice = choose_threads(sum(p.numel() for p in model.parameters()), device_type, requested)
    if choice.threads is not None:
        torch.set_num_threads(choice.threads)
    return choice
