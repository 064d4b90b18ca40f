"""Learning while serving: fine-tune a head on the traffic a server records, and publish each better version.

`specgraft serve --learn NAME` runs this in a process of its own (``specgraft learn``; it may run on another
machine that sees the recording). It works in rounds: once ``every`` more generations are recorded, it fine-tunes
the version serving (``training.init_from``) on the whole recording (its held-out generations fixed by their hash,
`specgraft.train.mix.split_recorded`) with the base config's original data as ``data.original_share`` of the mix,
each round a ``specgraft train`` of its own (a crash or a kill loses that round only), the recording's small shards
merged first (`compact_recording`). The trainer keeps the head
with the best simulated tau on the held-out traffic, the initial head's included; a round whose best is a fine-tuned
step is published (`specgraft.heads.published`) and the server swaps it in between two steps. A round that does not
beat the version serving publishes nothing. Rounds run one after another, never beside serving's own thread.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from specgraft.heads.checkpoint import read_head_config
from specgraft.heads.published import Published, current, publish
from specgraft.train.recording import Recording, compact_recording

log = logging.getLogger(__name__)

EVERY = 64  # recorded generations between rounds
POLL_S = 5.0
EVAL_FRACTION = 0.1  # of the recorded generations, held out to judge each round


def round_config(base: dict[str, Any] | None, target: str, head: str | Path, record: str | Path, output_dir: Path,
                 *, threads: int | None = None) -> dict[str, Any]:
    """A round's training config: ``base`` (a recipe for the head, whose data becomes the original share) or, with
    none, the head's own config with the recording alone; fine-tuning from ``head`` into ``output_dir``."""
    if base is None:
        head_config, _ = read_head_config(Path(head) / "config.json")
        base = {"head": dataclasses.asdict(head_config), "data": {}, "training": {}}
    cfg = json.loads(json.dumps(base))  # a deep copy
    cfg.setdefault("target", {})["path"] = target
    data = cfg.setdefault("data", {})
    data["recorded"] = [str(record)]
    if not data.get("eval_fraction"):  # (absent or 0: a round needs held-out traffic to judge it)
        data["eval_fraction"] = EVAL_FRACTION
    training = cfg.setdefault("training", {})
    training.update(init_from=str(head), output_dir=str(output_dir), resume="never", save_every=0, features="online")
    if threads:
        training["num_threads"] = threads
    training.pop("features_dir", None)  # (online: the recorded rows read their states; the original share runs)
    return cfg


@dataclasses.dataclass
class Learner:
    """The learner's loop (see the module's docstring).

    Args:
        target: the served target's path.
        head: the head the server loaded (version 0).
        record: the server's recording directory.
        out: where rounds run and versions are published (the server's ``--learn-dir``).
        config: a recipe for the head: its data is the original share, its training settings the rounds'.
        every: recorded generations between rounds.
        threads: torch threads of a round.
        train: runs one round's config file (default: ``specgraft train`` in a process of its own).
    """

    target: str
    head: str
    record: str
    out: str
    config: str | None = None
    every: int = EVERY
    threads: int | None = 1
    train: Callable[[Path], int] | None = None

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out)
        self.base = yaml.safe_load(Path(self.config).read_text()) if self.config else None
        self.serving: Published = current(self.out_dir) or Published(0, str(self.head))
        self.learned_from = self.serving.generations  # recorded generations when the version serving was made

    def recorded(self) -> int:
        try:
            return len(Recording(self.record))
        except FileNotFoundError:  # the server has not started recording yet
            return 0

    def run(self, *, rounds: int | None = None, poll_s: float = POLL_S) -> None:
        """Wait for traffic and learn from it, ``rounds`` rounds (None: until killed)."""
        done = 0
        while rounds is None or done < rounds:
            count = self.recorded()
            if count - self.learned_from < self.every:
                time.sleep(poll_s)
                continue
            self.round(count)
            done += 1

    def round(self, count: int) -> Published | None:
        """One round over the ``count`` generations recorded now; the version published (None: it did not beat
        the one serving, or it failed)."""
        version = self.serving.version + 1
        merged = compact_recording(self.record)  # (no round reads it now; what the server writes meanwhile is new files)
        if merged:
            log.info("compacted the recording: %d small shards merged", merged)
        run_dir = self.out_dir / "rounds" / f"r{version:04d}-{count}"
        run_dir.mkdir(parents=True, exist_ok=True)
        config_file = run_dir / "config.yaml"
        cfg = round_config(self.base, self.target, self.serving.head, self.record, run_dir / "run", threads=self.threads)
        config_file.write_text(yaml.safe_dump(cfg, sort_keys=False))
        log.info("round for version %d: %d recorded generations, from version %d (%s)", version, count,
                 self.serving.version, self.serving.head)
        status = (self.train or _specgraft_train)(config_file)
        self.learned_from = count  # (a failed round waits for more traffic before the next)
        if status != 0:
            log.error("round for version %d failed (exit %d): version %d serves on; see %s", version, status,
                      self.serving.version, run_dir)
            return None
        best_dir = run_dir / "run" / "best"
        if not (best_dir / "best.json").is_file():  # (no held-out evaluation ran)
            log.error("round for version %d kept no best head: version %d serves on; see %s", version,
                      self.serving.version, run_dir)
            return None
        best = json.loads((best_dir / "best.json").read_text())
        initial = _initial_tau(run_dir / "run" / "metrics.jsonl")
        if best["step"] == 0:
            log.info("round for version %d: no step beat version %d on the held-out traffic (simulated tau %.4g)",
                     version, self.serving.version, best["simulated_tau"])
            return None
        self.serving = publish(best_dir, self.out_dir, version, simulated_tau=best["simulated_tau"],
                               previous_simulated_tau=initial, generations=count)
        log.info("published version %d: held-out simulated tau %.4g (version %d: %s)", version,
                 best["simulated_tau"], version - 1, initial)
        return self.serving


def _initial_tau(metrics: Path) -> float | None:
    """The initial head's held-out simulated tau (its step-0 evaluation) in a run's metrics."""
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if record.get("step") == 0 and "eval/simulated_tau" in record:
            return record["eval/simulated_tau"]
    return None


def _specgraft_train(config_file: Path) -> int:
    """``specgraft train`` of a round's config in a process of its own; a learner stopped meanwhile stops it too."""
    with open(config_file.with_name("train.log"), "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "specgraft.cli", "train", str(config_file)],
                                stdout=log_file, stderr=subprocess.STDOUT)
        try:
            return proc.wait()
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
