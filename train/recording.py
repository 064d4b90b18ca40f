"""Served traffic as training data: the tokens a server generated and the target's states at them, on disk.

A `TrafficRecorder` observes a running `Scheduler` (its step-observer hook, `specgraft.infer.observer`): for every
generation that finishes it keeps the tokens the target ran (the prompt, then each token it generated but the last,
which no forward ran) and the states its verification forwards computed at them, at the layers the loaded heads
train on plus the final one the logits are rebuilt from. No forward is added: the states are those the serving
forwards computed. `Recording` reads a recording directory back as training examples and a `FeatureCache`::

    recording.json                   what every shard stores: layers, dtype, hidden size, the target's identity
    records-{run}-{n:06d}.safetensors  whole generations, written by one recorder run (``run``: its start, in ns):
                                     "input_ids" (N,), "layer.{i}" (N, H) per stored layer, the generations'
                                     rows concatenated; their lengths and prompt lengths in the metadata
                                     (and the files they came from, for one `vllm_records` imported)

The engine's thread copies finished generations into a shard's tensors (whenever the writer is idle, so that what
finishes meanwhile joins the next shard) and a thread of its own writes the file, to a temporary file renamed into
place (torch ops on a second thread would run a thread team of their own beside the engine's): a shard is whole or
absent, so a server killed at any moment loses the generations not yet written (those running, and those finished
in the last moments), never a shard. Several servers may record into one directory, each with its own ``run``.

A server at low load writes a shard a finished request or so; `compact_recording` merges small shards into
larger ones (the learner does before each round). A merged shard names the shards it replaces in its metadata, and
readers skip those, so a compaction killed between writing the merged shard and removing its sources loses and
doubles nothing.

A training example is a generation's tokens, its generated ones trained on (``loss_mask`` 1), its prompt not.
A request sent with ``record=False`` (the server's ``store: false``) is not recorded.

Shape legend: N tokens of a shard, H hidden, L stored layers, S a prompt's tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from specgraft.heads.checkpoint import atomic_write
from specgraft.infer.observer import Admitted, Committed, Left, StepObserver, Stepped
from specgraft.model import Target
from specgraft.model.target import DTYPES
from specgraft.train.feature_cache import (
    TARGET_KEYS, CacheFiles, FeatureCache, Manifest, _target_identity, data_fingerprint, stored_layers,
)

INFO = "recording.json"
FORMAT_VERSION = 1
SHARD_PATTERN = "records-*.safetensors"
SHARD_BYTES = 256 * 2**20  # most feature bytes a shard gathers while the writer is busy


@dataclass(frozen=True)
class RecordingInfo:
    """What every shard of a recording stores; ``recording.json`` on disk."""

    layers: tuple[int, ...]  # HF hidden_states indices, ascending; the last is the final-norm state
    dtype: str  # storage dtype, a key of DTYPES
    hidden_size: int
    target: dict[str, Any]  # the target's identity (`feature_cache._target_identity`)

    @property
    def key(self) -> str:
        """Written into every shard: a shard of another recording (other layers, dtype or target) is never read."""
        target = {key: self.target.get(key) for key in TARGET_KEYS}
        ident = json.dumps([target, self.layers, self.dtype], sort_keys=True)
        return hashlib.sha256(ident.encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT_VERSION, **dataclasses.asdict(self)}, indent=2) + "\n"

    @classmethod
    def read(cls, path: Path) -> "RecordingInfo":
        """Raises FileNotFoundError when ``path/recording.json`` is absent, ValueError when it is unreadable."""
        file = path / INFO
        if not file.is_file():
            raise FileNotFoundError(f"no recording at {path} ({INFO} is missing): record one with "
                                    "`specgraft serve --record DIR`")
        try:
            raw = json.loads(file.read_text())
            if raw.pop("format", None) != FORMAT_VERSION:
                raise ValueError(f"format is not {FORMAT_VERSION}")
            return cls(layers=tuple(raw["layers"]), dtype=raw["dtype"], hidden_size=int(raw["hidden_size"]),
                       target=dict(raw["target"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{file} is not a specgraft recording ({err})") from None


def recording_info(target: Target, hidden_layers: Sequence[int], dtype: str | None = None) -> RecordingInfo:
    """What a recording for heads reading ``hidden_layers`` of ``target`` stores (the final layer too)."""
    dtype = dtype or str(target.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise ValueError(f"recording dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return RecordingInfo(stored_layers(target, hidden_layers), dtype, int(target.config.hidden_size),
                         _target_identity(target))


def prepare_recording(directory: Path, info: RecordingInfo, writer: str) -> None:
    """Make ``directory`` a recording of ``info``: write its ``recording.json``, or check the one there matches.

    Raises:
        ValueError: the directory records other layers, another dtype or another target (``writer`` names who
            meant to write into it, in the message).
    """
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / INFO).is_file():
        existing = RecordingInfo.read(directory)
        if existing.key != info.key:
            raise ValueError(
                f"{directory} records {list(existing.layers)} in {existing.dtype} for "
                f"{existing.target.get('name')!r}; {writer} records {list(info.layers)} in "
                f"{info.dtype} for {info.target.get('name')!r}: record into another directory"
            )
    else:
        atomic_write(directory / INFO, lambda tmp: Path(tmp).write_text(info.to_json()))


def shard_name(run: str, number: int) -> str:
    """A shard's file name: a writer's ``run`` (unique to it) and the shard's number in that run."""
    return f"records-{run}-{number:06d}.safetensors"


def write_shard(file: Path, info: RecordingInfo, input_ids: torch.Tensor, states: Mapping[int, torch.Tensor],
                lengths: Sequence[int], prompt_lengths: Sequence[int], *, sources: Sequence[str] = (),
                replaces: Sequence[str] = ()) -> None:
    """Write one shard of the recording ``info`` describes, whole or not at all (a temporary file renamed).

    Args:
        file: the shard's path (`shard_name` in the recording's directory).
        input_ids: (N,) the generations' tokens, concatenated.
        states: layer -> (N, H) for every layer of ``info``, stored in its dtype.
        lengths: each generation's tokens, in order (they sum to N).
        prompt_lengths: each generation's prompt tokens (not trained on).
        sources: what the generations were read from, kept in the metadata (`vllm_records` reads it back).
        replaces: the names of the shards this one merges (`compact_recording`): readers skip them.
    """
    save_shard(file, *shard_contents(info, input_ids, states, lengths, prompt_lengths, sources=sources,
                                     replaces=replaces))


def shard_contents(info: RecordingInfo, input_ids: torch.Tensor, states: Mapping[int, torch.Tensor],
                   lengths: Sequence[int], prompt_lengths: Sequence[int], *, sources: Sequence[str] = (),
                   replaces: Sequence[str] = ()) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A shard's tensors (on the CPU, in the recording's dtype) and metadata (see `write_shard`)."""
    if sum(lengths) != input_ids.shape[0] or len(lengths) != len(prompt_lengths):
        raise ValueError(f"{len(lengths)} lengths summing to {sum(lengths)} and {len(prompt_lengths)} prompt lengths "
                         f"for {input_ids.shape[0]} tokens")
    tensors = {"input_ids": input_ids.cpu()}
    for layer in info.layers:
        tensors[f"layer.{layer}"] = states[layer].to(device="cpu", dtype=DTYPES[info.dtype]).contiguous()
    metadata = {"key": info.key, "lengths": json.dumps(list(lengths)),
                "prompt_lengths": json.dumps(list(prompt_lengths))}
    if sources:
        metadata["sources"] = json.dumps(list(sources))
    if replaces:
        metadata["replaces"] = json.dumps(list(replaces))
    return tensors, metadata


def save_shard(file: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    """The file of a shard's contents, whole or not at all. No tensor op: a writer thread calls it (a torch op there
    would start a thread team of its own beside the engine's, and cost the engine a quarter of its speed here)."""
    atomic_write(file, lambda tmp: save_file(dict(tensors), tmp, metadata=dict(metadata)))


@dataclass
class _Generation:
    """One running generation's recorded tokens and states so far, in order (device tensors until written)."""

    prompt_length: int
    tokens: list[torch.Tensor] = field(default_factory=list)  # (n,) each
    states: list[Mapping[int, torch.Tensor]] = field(default_factory=list)  # layer -> (n, H) each


class TrafficRecorder(StepObserver):
    """Records every generation a scheduler finishes into ``directory`` (see the module's docstring).

    Attach with ``scheduler.add_observer(recorder)``; `close` writes what finished and stops the writer.

    Args:
        directory: the recording directory (made if absent; an existing one must record the same layers, dtype and
            target, or it is refused naming the difference).
        target: the served target.
        hidden_layers: the layers the heads that will learn from the traffic read (the final one is added).
        dtype: storage dtype (None: the target's).

    Raises:
        ValueError: a directory recorded for another target, other layers or another dtype.
    """

    def __init__(self, directory: str | Path, target: Target, hidden_layers: Sequence[int], *,
                 dtype: str | None = None) -> None:
        self.directory = Path(directory)
        self.info = recording_info(target, hidden_layers, dtype)
        self.layers = self.info.layers
        prepare_recording(self.directory, self.info, "this server")
        self.run = f"{time.time_ns():x}"
        self._handed = 0  # shards handed to the writer
        self.shards_written = 0
        self.generations_written = 0
        self.error: BaseException | None = None  # the writer's failure: recording stops, serving goes on
        self._running: dict[int, _Generation] = {}
        self._pending: list[_Generation] = []  # finished, not yet handed to the writer
        self._idle = threading.Event()  # the writer has nothing to write
        self._idle.set()
        self._shards: queue.SimpleQueue[tuple[Path, dict, dict, int] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="specgraft-recorder", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ the engine's thread

    def admitted(self, row: Admitted) -> None:
        if row.states is not None:
            generation = _Generation(len(row.request.prompt_ids))
            generation.tokens.append(row.request.prompt_ids)
            generation.states.append(row.states)
            self._running[row.request.handle] = generation

    def committed(self, step: Committed) -> None:
        for commit in step.rows:
            generation = self._running.get(commit.handle)
            if generation is not None and commit.states is not None:
                generation.tokens.append(commit.tokens)
                generation.states.append(commit.states)

    def left(self, row: Left) -> None:
        generation = self._running.pop(row.handle, None)
        # (a generation that ended at its first token ran no token of its own: nothing to learn)
        if generation is not None and row.finished and len(generation.tokens) > 1 and self.error is None:
            self._pending.append(generation)
            self._hand_over()

    def stepped(self, step: Stepped) -> None:
        if self._pending:
            self._hand_over()

    def close(self, timeout: float | None = None) -> None:
        """Write every finished generation and stop the writer (its thread is joined). Call it from the thread that
        steps the scheduler, or once it stopped."""
        self._hand_over(force=True)
        self._shards.put(None)
        self._writer.join(timeout)

    def _hand_over(self, force: bool = False) -> None:
        """The finished generations as one shard's contents, made on this thread (a memory copy), for the writer to
        write: whenever it is idle (or ``force``), so that what finishes while it writes joins the next shard."""
        if not self._pending or self.error is not None:
            return
        waiting = sum(t.numel() for g in self._pending for t in g.tokens) * len(self.layers) * self.info.hidden_size
        if not (force or self._idle.is_set() or waiting * DTYPES[self.info.dtype].itemsize >= SHARD_BYTES):
            return
        generations, self._pending = self._pending, []
        tokens = [torch.cat(g.tokens) for g in generations]
        states = {layer: torch.cat([s[layer] for g in generations for s in g.states]) for layer in self.layers}
        contents = shard_contents(self.info, torch.cat(tokens), states, [len(t) for t in tokens],
                                  [g.prompt_length for g in generations])
        self._idle.clear()
        self._shards.put((self.directory / shard_name(self.run, self._handed), *contents, len(generations)))
        self._handed += 1

    # ------------------------------------------------------------------ the writer's thread

    def _write_loop(self) -> None:
        while (item := self._shards.get()) is not None:
            file, tensors, metadata, count = item
            try:
                save_shard(file, tensors, metadata)
                self.shards_written += 1
                self.generations_written += count
            except Exception as err:  # a full disk, say: recording stops, serving goes on
                self.error = err
            self._idle.set()


@dataclass(frozen=True)
class _Shard:
    file: Path
    lengths: tuple[int, ...]
    prompt_lengths: tuple[int, ...]
    metadata: Mapping[str, str]


class Recording:
    """A recording directory read back: its generations as training examples, and their states as a `FeatureCache`.

    Shards are read in name order (a run's in the order written); a temporary file a killed writer left is not
    a shard, a shard that a merged one replaces is skipped (``replaced``: left by a killed compaction), and a
    shard of another recording is refused.

    Raises:
        FileNotFoundError: no ``recording.json`` in ``path``.
        ValueError: an unreadable shard, or one recorded for other layers, dtype or target.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.info = RecordingInfo.read(self.path)
        shards: list[_Shard] = []
        for file in sorted(self.path.glob(SHARD_PATTERN)):
            try:
                with safe_open(str(file), framework="pt") as f:
                    meta = f.metadata() or {}
            except SafetensorError as err:
                raise ValueError(f"{file} is not a readable shard ({err})") from None
            if meta.get("key") != self.info.key:
                raise ValueError(f"{file} was recorded for other layers, dtype or target than {self.path / INFO}")
            shards.append(_Shard(file, tuple(json.loads(meta["lengths"])), tuple(json.loads(meta["prompt_lengths"])),
                                 meta))
        replaced = {name for shard in shards for name in json.loads(shard.metadata.get("replaces", "[]"))}
        self.shards = [shard for shard in shards if shard.file.name not in replaced]
        self.replaced = [shard.file for shard in shards if shard.file.name in replaced]

    def __len__(self) -> int:
        return sum(len(shard.lengths) for shard in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(sum(shard.lengths) for shard in self.shards)

    def examples(self) -> list[dict[str, list[int]]]:
        """Every generation as a training example, in recorded order: ``input_ids``, and ``loss_mask`` 1 at the
        tokens it generated (not at its prompt's)."""
        out = []
        for shard in self.shards:
            with safe_open(str(shard.file), framework="pt") as f:
                ids = f.get_tensor("input_ids").tolist()
            at = 0
            for n, prompt in zip(shard.lengths, shard.prompt_lengths):
                out.append({"input_ids": ids[at : at + n], "loss_mask": [0] * prompt + [1] * (n - prompt)})
                at += n
        return out

    def features(self, target: Target, hidden_layers: Sequence[int], *, logits: bool = True,
                 prefixes: bool = False) -> FeatureCache:
        """The recorded states as a `FeatureCache` over `examples` (same order; ``prefixes``: a batch may hold the
        first tokens of an example, cut to a length).

        Raises:
            ValueError: a recording made with another target, or without ``hidden_layers``.
        """
        starts, at = [], 0
        for shard in self.shards:
            starts.append((at, at + len(shard.lengths)))
            at += len(shard.lengths)
        manifest = Manifest(
            layers=self.info.layers, dtype=self.info.dtype, hidden_size=self.info.hidden_size, num_examples=len(self),
            num_tokens=self.num_tokens, shards=tuple(starts), data_fingerprint="", target=self.info.target,
        )
        files = CacheFiles(manifest, tuple(shard.file for shard in self.shards), self.info.key)
        return FeatureCache(self.path, target, hidden_layers, logits=logits, files=files, prefixes=prefixes)


def compact_recording(directory: str | Path, *, max_bytes: int = SHARD_BYTES) -> int:
    """Merge ``directory``'s shards smaller than ``max_bytes`` into shards of up to ``max_bytes`` (runs of
    consecutive ones, in name order), each written whole before its sources are removed; remove the sources a killed
    compaction left. The shards a server is writing meanwhile are new files, left for the next compaction; a reader
    must not run meanwhile (the learner compacts between its rounds). Returns the shards removed.
    """
    recording = Recording(directory)
    removed = 0
    for file in recording.replaced:
        file.unlink(missing_ok=True)
        removed += 1
    run = f"{time.time_ns():x}"
    groups: list[list[_Shard]] = [[]]
    for shard in recording.shards:
        size = shard.file.stat().st_size
        if size >= max_bytes:
            groups.append([])
            continue
        if groups[-1] and sum(s.file.stat().st_size for s in groups[-1]) + size > max_bytes:
            groups.append([])
        groups[-1].append(shard)
    for number, group in enumerate(g for g in groups if len(g) > 1):
        tensors: dict[str, list[torch.Tensor]] = {}
        sources: list[str] = []
        for shard in group:
            with safe_open(str(shard.file), framework="pt") as f:
                for key in f.keys():
                    tensors.setdefault(key, []).append(f.get_tensor(key))
            sources += json.loads(shard.metadata.get("sources", "[]"))
        write_shard(
            recording.path / shard_name(run, number), recording.info, torch.cat(tensors.pop("input_ids")),
            {layer: torch.cat(tensors[f"layer.{layer}"]) for layer in recording.info.layers},
            [n for shard in group for n in shard.lengths], [n for shard in group for n in shard.prompt_lengths],
            sources=sources, replaces=[shard.file.name for shard in group],
        )
        for shard in group:
            shard.file.unlink()
            removed += 1
    return removed
