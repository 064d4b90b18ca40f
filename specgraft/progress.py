"""How a long loop shows its progress: a tqdm bar on a terminal, a plain line now and then anywhere else.

Redirected to a file or a pipe, a tqdm bar is hundreds of carriage-return frames that a log reader sees as
lines. So every loop asks `progress_bar` for its display, and only a terminal gets a bar; a log gets one line
every `PLAIN_EVERY_S` seconds and one when the loop ends::

    for prompt in progress_bar(prompts, desc="bench", unit="prompt"):
        ...
    with progress_bar(total=steps, desc="train", unit="step") as bar:
        bar.update(1)
        bar.set_postfix(loss="2.31")

`quiet_libraries` turns off the bars libraries draw on their own (transformers' "Loading weights" at every
model load, datasets' "Generating train split"); the command line calls it once at start.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Iterable, Iterator

PLAIN_EVERY_S = 30.0  # a line per half minute: a 10-minute loop writes 20 lines, a 5-second one only its last


def on_terminal() -> bool:
    """Whether stderr (where progress goes) is a terminal that redraws a bar in place."""
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def progress_bar(iterable: Iterable | None = None, *, total: float | None = None, desc: str, unit: str = "it",
             initial: float = 0, enabled: bool = True, leave: bool = True):
    """A progress display over ``iterable`` (or driven by ``update``): tqdm's on a terminal, else `PlainProgress`.

    Args:
        iterable: yielded through unchanged; ``total`` defaults to its length.
        total, desc, unit, initial, leave: as tqdm's (``leave=False``: nothing stays when the loop ends).
        enabled: False shows nothing at all (e.g. on every rank but the first).
    """
    if enabled and on_terminal():
        from tqdm.auto import tqdm

        return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, leave=leave)
    return PlainProgress(iterable, total=total, desc=desc, unit=unit, initial=initial, enabled=enabled, leave=leave)


class PlainProgress:
    """The part of tqdm's interface our loops use, written as whole lines to stderr every ``every_s`` seconds."""

    def __init__(self, iterable: Iterable | None = None, *, total: float | None = None, desc: str, unit: str = "it",
                 initial: float = 0, enabled: bool = True, leave: bool = True, every_s: float = PLAIN_EVERY_S) -> None:
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.n = self.shown = initial
        self.enabled, self.leave, self.every_s = enabled, leave, every_s
        self.postfix = ""
        self.start = self.last = time.monotonic()
        self.closed = False

    def __iter__(self) -> Iterator:
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self._line(now)

    def set_postfix(self, **values: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def refresh(self) -> None:
        """tqdm redraws here; a log waits for the next line."""

    def write(self, text: str) -> None:
        """A message of the loop's own (tqdm.write's destination, stdout); shown whatever ``enabled`` says."""
        print(text, flush=True)

    def close(self) -> None:
        if not self.closed and self.leave and self.n != self.shown:
            self._line(time.monotonic())
        self.closed = True

    def _line(self, now: float) -> None:
        self.last, self.shown = now, self.n
        if not self.enabled:
            return
        done = f"{self.n:g}/{self.total:g}" if self.total else f"{self.n:g}"
        share = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        elapsed = int(now - self.start)
        text = f"{self.desc}: {done} {self.unit}{share}, {elapsed // 60}m{elapsed % 60:02d}s"
        print(text + (f", {self.postfix}" if self.postfix else ""), file=sys.stderr, flush=True)


def quiet_libraries() -> None:
    """No progress bars from transformers (one at every model load) or datasets; hub downloads keep theirs on
    a terminal, where a download of gigabytes needs one."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' bars and, through it, the hub's
    if on_terminal():
        from huggingface_hub.utils import enable_progress_bars

        enable_progress_bars()
    from datasets.utils import logging as datasets_logging

    datasets_logging.disable_progress_bar()  # "Generating train split" at every data load
