"""Versions of a head published while it serves: what a learner writes and a server swaps in.

A directory of versions::

    v0001/ v0002/ ...   each a whole head directory (config.json, model.safetensors), renamed into place complete
    current.json        the version to serve: its number, its directory, its held-out tau; replaced atomically

A version directory is copied under a temporary name and renamed, and ``current.json`` is written to a temporary file
and renamed after it, so a reader sees the last version published whole, whenever the writer was killed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specgraft.heads.checkpoint import atomic_write

CURRENT = "current.json"


@dataclass(frozen=True)
class Published:
    """One published version of a head."""

    version: int
    head: str  # its directory
    simulated_tau: float | None = None  # on the held-out recorded traffic, as the learner measured it
    previous_simulated_tau: float | None = None  # the version before it, on the same held-out traffic
    generations: int = 0  # recorded generations it learned from (held-out ones included)


def publish(head_dir: str | Path, directory: str | Path, version: int, **info: Any) -> Published:
    """Copy the head in ``head_dir`` into ``directory`` as ``version`` and make it the current one."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"v{version:04d}"
    partial = directory / f".v{version:04d}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(head_dir, partial)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    published = Published(version, str(final), **info)
    text = json.dumps(dataclasses.asdict(published), indent=2) + "\n"
    atomic_write(directory / CURRENT, lambda tmp: Path(tmp).write_text(text))
    return published


def current(directory: str | Path) -> Published | None:
    """The version ``directory`` serves now (None: none published yet).

    Raises:
        ValueError: an unreadable ``current.json`` (never one a publisher left half-written: it is renamed whole).
    """
    file = Path(directory) / CURRENT
    if not file.is_file():
        return None
    try:
        return Published(**json.loads(file.read_text()))
    except (json.JSONDecodeError, TypeError) as err:
        raise ValueError(f"{file} is not a published head version ({err})") from None
