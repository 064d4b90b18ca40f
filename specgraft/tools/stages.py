"""A run of named stages that resumes: each finished stage leaves a marker, a resumed run reuses it.

A stage's marker (``MARKERS/NAME.json``) holds its key (the settings its
result depends on, chained to the previous stage's key), its outputs, the
files it made and its time. A resumed run reuses a stage whose key is
unchanged and whose files are all there; a stage that runs again invalidates
every stage after it. An interrupted stage knows (``continue_partial``) that
the partial work it left was started with the same settings.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence


@dataclass
class StageResult:
    outputs: dict[str, Any]  # what later stages read (paths, names, sizes)
    summary: str  # the stage's line
    artifacts: list[str] = field(default_factory=list)  # files and directories a resumed run needs to find again


@dataclass(frozen=True)
class Stage:
    """``run(outputs of the stages before it, continue_partial)``; ``key()``: the settings its result depends on."""

    name: str
    key: Callable[[], dict[str, Any]]
    run: Callable[[dict[str, Any], bool], StageResult]


class StageFailed(RuntimeError):
    """A stage raised; carries the stage's name and how long it ran."""

    def __init__(self, stage: str, seconds: float, cause: BaseException) -> None:
        super().__init__(f"stage {stage!r} failed after {duration(seconds)}: {type(cause).__name__}: {cause}")
        self.stage = stage
        self.seconds = seconds
        self.cause = cause


def run_stages(
    stages: Sequence[Stage], markers: Path, *, resume: bool, echo: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run (or, with ``resume``, reuse) every stage in order; return the merged outputs of all of them.

    Raises:
        StageFailed: a stage raised (KeyboardInterrupt included); finished stages keep their markers.
    """
    markers.mkdir(parents=True, exist_ok=True)
    names = [stage.name for stage in stages]
    outputs: dict[str, Any] = {}
    key: dict[str, Any] = {}
    rerun = not resume
    for number, stage in enumerate(stages, start=1):
        key = {"previous": key, **stage.key()}
        marker = markers / f"{stage.name}.json"
        label = f"[{number}/{len(stages)}] {stage.name:<6}"
        done = read_marker(marker)
        missing = [p for p in (done or {}).get("artifacts", []) if not Path(p).exists()]
        if not rerun and done is not None and done["key"] == key and not missing:
            outputs.update(done["outputs"])
            echo(f"{label} reused (took {duration(done['seconds'])} in an earlier run): {done['summary']}")
            continue
        if not rerun and done is not None:
            why = f"{missing[0]} is gone" if missing else "its settings changed"
            echo(f"{label} {why} since the earlier run: running it again, and every stage after it")
        rerun = True
        for later in names[number - 1 :]:
            (markers / f"{later}.json").unlink(missing_ok=True)
        started = markers / f"{stage.name}.started.json"
        # An interrupted stage may continue its partial work only if it was started with these settings.
        continue_partial = resume and (read_marker(started) or {}).get("key") == key
        started.write_text(json.dumps({"stage": stage.name, "key": key}, indent=2) + "\n")
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            result = stage.run(outputs, continue_partial)
        except (Exception, KeyboardInterrupt) as err:
            raise StageFailed(stage.name, time.perf_counter() - start, err) from err
        seconds = time.perf_counter() - start
        outputs.update(result.outputs)
        marker.write_text(json.dumps(
            {"stage": stage.name, "key": key, "seconds": round(seconds, 1),
             "cpu_seconds": round(time.process_time() - cpu_start, 1), "outputs": result.outputs,
             "artifacts": result.artifacts, "summary": result.summary},
            indent=2,
        ) + "\n")
        echo(f"{label} {duration(seconds):>6}  {result.summary}")
    return outputs


def read_marker(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def duration(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 60 else f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
