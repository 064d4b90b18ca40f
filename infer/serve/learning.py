"""Serving a head that learns: the server's side of ``specgraft serve --learn NAME``.

A learner process (`specgraft.train.learner`) fine-tunes the head on the traffic the server records and publishes
each better version (`specgraft.heads.published`). `HeadWatcher` polls the publications, loads each new version on a
thread of its own (never the engine's), and hands it to the engine, which swaps it in between two steps
(`Engine.adopt`): no step drafts with half a head, and exactness never depends on the head. A learner that crashed
publishes nothing more, and the last version serves on.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from specgraft.heads import load_drafter
from specgraft.heads.published import current
from specgraft.infer.serve.engine import Engine
from specgraft.model import Target

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often the publications are read


class HeadWatcher:
    """Swaps drafter ``name``'s weights for each version published in ``directory`` (see the module's docstring).

    Args:
        engine: the serving engine.
        target: the served target (the versions are loaded for it).
        name: the learning drafter.
        directory: where the learner publishes.
        poll_s: seconds between reads of ``directory``.
    """

    def __init__(self, engine: Engine, target: Target, name: str, directory: str | Path, *, poll_s: float = POLL_S) -> None:
        self.engine, self.target, self.name, self.directory = engine, target, name, Path(directory)
        self.poll_s = poll_s
        self.version = 0  # the last version handed to the engine (0: the head loaded at start)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"specgraft-watch-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def check(self) -> bool:
        """Read the publications once; hand a new version to the engine. True if one was handed."""
        try:
            published = current(self.directory)
        except ValueError as err:
            log.error("%s", err)
            return False
        if published is None or published.version <= self.version:
            return False
        self.version = published.version  # (a version that fails to load is not tried again)
        try:
            drafter = load_drafter(published.head, self.target)
        except Exception as err:  # a version that does not load leaves the one serving
            log.error("drafter %r keeps its weights: version %d (%s) did not load: %s", self.name, published.version,
                      published.head, err)
            return False
        self.engine.adopt(self.name, drafter, published.version, published.simulated_tau)
        log.info("drafter %r: version %d (held-out simulated tau %s) swapped in", self.name, published.version,
                 published.simulated_tau)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.check()
