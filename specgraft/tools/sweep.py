"""A bench's sweep over values (batch sizes, concurrency levels) that a Ctrl-C may cut short: what finished is kept.

    sweep = Sweep("batch_sizes", "batch size", [1, 2, 4])
    with sweep.keep_finished(lambda: results_of(rows)):
        for b in sweep.given:
            rows += measure(b)
            sweep.done.append(b)

A Ctrl-C after the first value finished raises `SweepInterrupted`, carrying the results of the values that
finished, marked interrupted (``settings.interrupted``; ``settings[key]`` the values that finished,
``settings[key + "_given"]`` all of them); before that, the KeyboardInterrupt goes on as it was. The command
line writes what it carries and says so in one line (`SweepInterrupted.where`), or that nothing was written
(`nothing_written`); `interrupted_note` is the line the markdown reports open with.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C during a sweep after at least one of its values finished: ``results`` holds those."""

    def __init__(self, results: dict[str, Any], key: str, noun: str) -> None:
        settings = results["settings"]
        super().__init__(f"interrupted after {noun}s {settings[key]} of {settings[key + '_given']}")
        self.results, self.noun = results, noun

    def where(self, out_dir: str | Path) -> str:
        """The one line a command ends with once ``results`` is written to ``out_dir``."""
        return (f"specgraft bench: {self}; the {self.noun}s that finished are in {Path(out_dir) / 'results.json'} "
                "(and results.md)")


def nothing_written(noun: str) -> str:
    """The one line a command ends with when a Ctrl-C came before any ``noun`` finished."""
    return f"specgraft bench: interrupted before any {noun} finished; nothing written"


def interrupted_note(settings: Mapping[str, Any], key: str, noun: str) -> list[str]:
    """The markdown report's opening note for an interrupted sweep (no lines for one that ran to its end)."""
    if not settings.get("interrupted"):
        return []
    return [f"Interrupted (Ctrl-C): {noun}s {settings[key]} of {settings[key + '_given']} finished.", ""]


@dataclass
class Sweep:
    """The values a bench sweeps, in order, and those that finished (the caller appends each to ``done``)."""

    key: str  # the settings key that lists the values: "batch_sizes", "concurrency"
    noun: str  # one value, in words: "batch size", "concurrency level"
    given: list[int]
    done: list[int] = field(default_factory=list)

    @contextlib.contextmanager
    def keep_finished(self, results: Callable[[], dict[str, Any]]) -> Iterator[None]:
        """Run the body; a Ctrl-C in it after a value finished becomes `SweepInterrupted` carrying ``results()``
        (which must cover the values in ``done`` only), marked interrupted.

        Raises:
            SweepInterrupted: Ctrl-C after the first value finished.
            KeyboardInterrupt: Ctrl-C before it.
        """
        try:
            yield
        except KeyboardInterrupt:
            if not self.done:
                raise
            kept = results()
            kept["settings"].update({"interrupted": True, self.key: list(self.done),
                                     self.key + "_given": list(self.given)})
            raise SweepInterrupted(kept, self.key, self.noun) from None
