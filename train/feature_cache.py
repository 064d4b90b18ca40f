"""The offline feature cache: the target's features for a training set, on disk, read back with no forward.

`extract_features`, then `FeatureCache`: the target runs once per
example, ahead of training, and the hidden states a head reads go to disk as
sharded safetensors; training reads them back memory-mapped, with no target
forward. Worth it when the target's forward dominates a step (many epochs,
several heads on one dataset). The cache directory::

    manifest.json              stored layers and dtype, example count, each shard's example range,
                               fingerprints of the tokenized data and of the target
    shard-00000.safetensors    examples [start, stop): one (N, H) tensor "layer.{i}" per stored layer,
    shard-00001.safetensors    the examples' rows concatenated in index order; their lengths in the metadata

Logits are not stored: (T, V) per sequence is the largest tensor by far.
The final-norm hidden state (HF index num_layers) is stored instead, and the
target's output layer rebuilds the logits at load exactly as its forward
computes them (extraction checks this on its first batch, so a model that
scales or caps its logits is refused). Offline features are bitwise the
online ones for a batch padded alike; otherwise they differ in the last bits,
as the target's own output for a sequence does with the width it is padded to.

Size: total tokens x stored layers x H x bytes per element; the stored
layers are the head's plus the final one (`estimate_bytes`). Each shard is
written to a temporary file and renamed, so a shard file is complete or
absent; a rerun skips complete shards (resume) and refuses a cache made for
other data, another target, other layers or another dtype, naming the
difference.

The online batch it stands for is `specgraft.train.features.target_batch`.

Shape legend: B sequences, T positions, V vocabulary, H hidden, N tokens of a shard.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from array import array
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from specgraft.config import TrainConfig
from specgraft.heads.base import TrainBatch
from specgraft.heads.checkpoint import atomic_write, target_signature
from specgraft.model import Target
from specgraft.model.target import DTYPES
from specgraft.progress import progress_bar
from specgraft.train.features import check_layers

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
SHARD_NAME = "shard-{:05d}.safetensors"
SHARD_BYTES = 1 << 30  # default shard size: a shard is assembled in CPU memory before it is written
TARGET_KEYS = ("hidden_size", "vocab_size", "num_hidden_layers", "embedding_fingerprint", "dtype")


def features_dir(cfg: TrainConfig) -> Path:
    """Where a training config keeps its feature cache: ``training.features_dir``, else ``output_dir/features``."""
    t = cfg.training
    return Path(t.features_dir) if t.features_dir else Path(t.output_dir) / "features"


def stored_layers(target: Target, hidden_layers: Sequence[int]) -> tuple[int, ...]:
    """The layers a cache for ``hidden_layers`` stores: those, plus the final one the logits are rebuilt from."""
    check_layers(target, hidden_layers)
    return tuple(sorted(set(hidden_layers) | {target.num_layers}))


def estimate_bytes(num_tokens: int, num_layers: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Tensor bytes of a cache: tokens (summed over examples) x stored layers x H x bytes per element.

    Each shard file adds its safetensors header (8 bytes + a JSON of tensor names, offsets and metadata).
    """
    return num_tokens * num_layers * hidden_size * dtype.itemsize


def data_fingerprint(examples: Sequence[Mapping[str, Any]]) -> str:
    """A hash of the examples' token ids, in order: the cache is indexed by example position."""
    digest = hashlib.sha256()
    for example in examples:
        ids = array("q", example["input_ids"])
        digest.update(struct.pack("<q", len(ids)))  # the length delimits examples: [1, 2], [3] != [1], [2, 3]
        digest.update(ids.tobytes())
    return digest.hexdigest()[:16]


def _target_identity(target: Target) -> dict[str, Any]:
    """`target_signature` plus the dtype the target runs in (a bf16 target's features are not an fp32 one's)."""
    return {**target_signature(target), "dtype": str(target.dtype).removeprefix("torch.")}


@dataclass(frozen=True)
class Manifest:
    """What a cache holds; ``manifest.json`` on disk."""

    layers: tuple[int, ...]  # HF hidden_states indices stored, ascending; the last is the final-norm state
    dtype: str  # storage dtype, a key of DTYPES
    hidden_size: int
    num_examples: int
    num_tokens: int
    shards: tuple[tuple[int, int], ...]  # each shard's example range [start, stop)
    data_fingerprint: str
    target: dict[str, Any]  # `_target_identity` of the target that computed it

    @property
    def key(self) -> str:
        """Written into every shard, so a shard left by another cache in the same directory is never trusted.

        The target's name is left out: the same weights loaded from another path make the same features.
        """
        target = {key: self.target.get(key) for key in TARGET_KEYS}
        ident = json.dumps([self.data_fingerprint, target, self.layers, self.dtype, self.shards], sort_keys=True)
        return hashlib.sha256(ident.encode()).hexdigest()[:16]

    @property
    def estimate_bytes(self) -> int:
        return estimate_bytes(self.num_tokens, len(self.layers), self.hidden_size, DTYPES[self.dtype])

    def to_json(self) -> str:
        shards = [{"file": SHARD_NAME.format(i), "start": a, "stop": b} for i, (a, b) in enumerate(self.shards)]
        fields = {"format": FORMAT_VERSION, **dataclasses.asdict(self), "shards": shards}
        return json.dumps(fields, indent=2) + "\n"

    @classmethod
    def read(cls, path: Path) -> "Manifest":
        """Raises FileNotFoundError when ``path/manifest.json`` is absent, ValueError when it is unreadable."""
        file = path / MANIFEST
        if not file.is_file():
            raise FileNotFoundError(
                f"no feature cache at {path} ({MANIFEST} is missing): run `specgraft extract-features CONFIG`, "
                "or train with training.features=offline, which extracts it first"
            )
        try:
            raw = json.loads(file.read_text())
            version = raw.pop("format", None)
            if version != FORMAT_VERSION:
                raise ValueError(f"format {version!r} is not {FORMAT_VERSION}")
            raw["layers"] = tuple(raw["layers"])
            raw["shards"] = tuple((s["start"], s["stop"]) for s in raw["shards"])
            return cls(**raw)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{file} is not a specgraft feature manifest ({err}); delete {path} to extract again") from None

    def mismatches(
        self,
        target: Target,
        *,
        layers: Sequence[int],
        fingerprint: str | None = None,
        num_examples: int | None = None,
        dtype: str | None = None,
    ) -> list[str]:
        """What differs between this cache and a run: the target, the data, missing layers, the storage dtype."""
        problems = []
        actual = _target_identity(target)
        for key in TARGET_KEYS:
            if self.target.get(key) != actual[key]:
                problems.append(
                    f"target {key}: the cache has {self.target.get(key)!r} (from {self.target.get('name')!r}), "
                    f"this run's target has {actual[key]!r} (from {actual['name']!r})"
                )
        if fingerprint is not None and (fingerprint, num_examples) != (self.data_fingerprint, self.num_examples):
            problems.append(
                f"data: the cache holds {self.num_examples} examples with token fingerprint {self.data_fingerprint}, "
                f"this run has {num_examples} with {fingerprint}"
            )
        missing = sorted(set(layers) - set(self.layers))
        if missing:
            problems.append(f"layers: the cache stores hidden states {list(self.layers)}, the head also needs {missing}")
        if dtype is not None and dtype != self.dtype:
            problems.append(f"dtype: the cache stores {self.dtype}, training.feature_dtype asks for {dtype}")
        return problems


def _refuse(path: Path, problems: list[str]) -> None:
    if problems:
        raise ValueError(
            f"the feature cache {path} was made for another run: " + "; ".join(problems)
            + f". Delete {path}, or set training.features_dir to another directory"
        )


def _shard_is_complete(path: Path, start: int, stop: int, key: str) -> bool:
    """A shard file exists only complete (atomic rename); its metadata says which cache and range it holds."""
    if not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except SafetensorError:
        return False  # unreadable: computed again
    return meta.get("key") == key and (meta.get("start"), meta.get("stop")) == (str(start), str(stop))


@dataclass(frozen=True)
class ExtractionSummary:
    """written: shard files computed by this call; skipped: complete ones found from an earlier call."""

    path: Path
    written: tuple[str, ...]
    skipped: tuple[str, ...]
    estimate_bytes: int


def extract_features(
    cfg: TrainConfig,
    target: Target,
    examples: Sequence[Mapping[str, Any]],
    hidden_layers: Sequence[int],
    out_dir: str | Path,
    *,
    shard_size: int | None = None,
    batch_size: int | None = None,
    progress: bool = True,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] = lambda: None,
) -> ExtractionSummary:
    """Write (or complete) the feature cache of ``examples`` for a head reading ``hidden_layers``.

    Prints the size estimate first, then computes the shards not yet on disk. Under several ranks
    every rank calls this: rank 0 writes the manifest, ``barrier`` lets the others read it, and rank
    r computes shards r, r + world_size, ... (the caller waits for all of them before reading).

    Args:
        cfg: the training config; reads ``training.feature_dtype`` (None: the target's dtype),
            ``training.feature_layers`` (stored too, for other heads sharing the cache)
            and ``training.micro_batch_size`` (the default ``batch_size``).
        target: the frozen target.
        examples: tokenized examples (``input_ids`` and ``loss_mask`` lists), indexed as the trainer indexes them.
        hidden_layers: HF hidden_states indices the head reads; the final one is stored too.
        out_dir: the cache directory (`features_dir` of a config).
        shard_size: examples per shard; None: about `SHARD_BYTES` of features per shard. An existing
            cache keeps its own layout.
        batch_size: sequences per target forward; None: ``training.micro_batch_size``.
        progress: show progress (`specgraft.progress`).

    Raises:
        ValueError: no examples, a layer out of range, logits that are not the output layer of the
            final hidden state, or an existing cache made for other data / target / layers / dtype.
    """
    if len(examples) == 0:
        raise ValueError("no examples: nothing to extract features for")
    out_dir = Path(out_dir)
    dtype = cfg.training.feature_dtype or str(target.dtype).removeprefix("torch.")
    extra = cfg.training.feature_layers
    bad = [i for i in extra if not 0 <= i <= target.num_layers]
    if bad:
        raise ValueError(
            f"training.feature_layers {bad} are out of range for {target.name!r}: "
            f"HF hidden_states indices run 0..{target.num_layers}"
        )
    layers = stored_layers(target, [*hidden_layers, *extra])
    if rank == 0:
        manifest = _manifest_for(out_dir, target, examples, layers, dtype, shard_size, world_size)
    barrier()
    if rank != 0:  # rank 0's manifest, checked against this rank's data as rank 0 checked it
        manifest = _manifest_for(out_dir, target, examples, layers, dtype, shard_size, world_size)
    names = [SHARD_NAME.format(i) for i in range(len(manifest.shards))]
    mine = [i for i in range(len(names)) if i % world_size == rank]
    for i in mine:  # a killed extraction's half-written shards (each shard has one writer)
        for leftover in out_dir.glob(f".{names[i]}.*.tmp"):
            leftover.unlink()
    done = [_shard_is_complete(out_dir / n, a, b, manifest.key) for n, (a, b) in zip(names, manifest.shards)]
    if rank == 0:
        print(
            f"feature cache {out_dir}: {manifest.num_examples} examples, {manifest.num_tokens} tokens x "
            f"{len(manifest.layers)} layers {list(manifest.layers)} x {manifest.hidden_size} hidden x "
            f"{DTYPES[manifest.dtype].itemsize} bytes ({manifest.dtype}) = {_human(manifest.estimate_bytes)} "
            f"in {len(names)} shards ({sum(done)} already complete)" + (f", over {world_size} ranks" if world_size > 1 else ""),
            flush=True,
        )
    batch_size = batch_size or cfg.training.micro_batch_size
    total = sum(manifest.shards[i][1] - manifest.shards[i][0] for i in mine)
    initial = sum(manifest.shards[i][1] - manifest.shards[i][0] for i in mine if done[i])
    written = []
    bar = progress_bar(total=total, initial=initial, desc="extract features", unit="seq", enabled=progress and rank == 0)
    with bar:
        for i in mine:
            name, (start, stop), complete = names[i], manifest.shards[i], done[i]
            if complete:
                continue
            tensors = _extract_shard(target, examples[start:stop], manifest, batch_size, check_logits=not written, bar=bar)
            lengths = [len(example["input_ids"]) for example in examples[start:stop]]
            metadata = {"key": manifest.key, "start": str(start), "stop": str(stop), "lengths": json.dumps(lengths)}
            atomic_write(out_dir / name, lambda tmp: save_file(tensors, tmp, metadata=metadata))
            written.append(name)
    skipped = tuple(names[i] for i in mine if done[i])
    return ExtractionSummary(out_dir, tuple(written), skipped, manifest.estimate_bytes)


def _manifest_for(
    out_dir: Path,
    target: Target,
    examples: Sequence[Mapping[str, Any]],
    layers: tuple[int, ...],
    dtype: str,
    shard_size: int | None,
    world_size: int = 1,
) -> Manifest:
    """The existing manifest if it fits this run (it may store more layers), else a new one written to disk
    (with at least one shard per rank).

    Raises:
        ValueError: an existing manifest for other data, another target, without ``layers`` or in another dtype.
    """
    lengths = [len(example["input_ids"]) for example in examples]
    fingerprint = data_fingerprint(examples)
    if (out_dir / MANIFEST).is_file():
        manifest = Manifest.read(out_dir)
        _refuse(out_dir, manifest.mismatches(
            target, layers=layers, fingerprint=fingerprint, num_examples=len(examples), dtype=dtype
        ))
        return manifest
    hidden_size = int(target.config.hidden_size)
    per_example = estimate_bytes(sum(lengths), len(layers), hidden_size, DTYPES[dtype]) / len(examples)
    size = shard_size or max(1, int(SHARD_BYTES // max(per_example, 1)))
    size = min(size, -(-len(examples) // world_size))  # every rank gets shards to write
    manifest = Manifest(
        layers=layers,
        dtype=dtype,
        hidden_size=hidden_size,
        num_examples=len(examples),
        num_tokens=sum(lengths),
        shards=tuple((a, min(a + size, len(examples))) for a in range(0, len(examples), size)),
        data_fingerprint=fingerprint,
        target=_target_identity(target),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / MANIFEST, lambda tmp: Path(tmp).write_text(manifest.to_json()))
    return manifest


def _extract_shard(
    target: Target,
    examples: Sequence[Mapping[str, Any]],
    manifest: Manifest,
    batch_size: int,
    *,
    check_logits: bool,
    bar: Any,
) -> dict[str, torch.Tensor]:
    """One shard's tensors: "layer.{i}" -> (N, H), the examples' rows concatenated in order."""
    from specgraft.train.data import collate

    lengths = [len(example["input_ids"]) for example in examples]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    dtype = DTYPES[manifest.dtype]
    out = {layer: torch.empty(offsets[-1], manifest.hidden_size, dtype=dtype) for layer in manifest.layers}  # (N, H)
    order = sorted(range(len(examples)), key=lambda i: -lengths[i])  # longest first: little padding per batch
    for first in range(0, len(order), batch_size):
        chunk = order[first : first + batch_size]
        # Pads are masked from attention and never stored, so any id serves.
        batch = collate([examples[i] for i in chunk], pad_token_id=0)
        hidden = _hidden_states(target, batch, manifest.layers, check_logits=check_logits and first == 0)
        for layer in manifest.layers:
            states = hidden[layer].to(device="cpu", dtype=dtype)  # (B, T, H): one transfer per batch
            for row, i in enumerate(chunk):
                out[layer][offsets[i] : offsets[i + 1]] = states[row, : lengths[i]]
        bar.update(len(chunk))
    return {f"layer.{layer}": value for layer, value in out.items()}


def _hidden_states(
    target: Target, batch: Mapping[str, torch.Tensor], layers: Sequence[int], *, check_logits: bool
) -> dict[int, torch.Tensor]:
    """The target's hidden states (B, T, H) at ``layers`` for a right-padded batch.

    With ``check_logits``, also checks on the first row that the target's logits are its output layer
    applied to the final hidden state, which is how `FeatureCache` rebuilds them (a model that scales
    or caps its logits is refused).
    """
    device = target.device
    attention_mask = batch["attention_mask"].to(device)
    with torch.no_grad():
        out = target.model(
            input_ids=batch["input_ids"].to(device),
            attention_mask=attention_mask,
            output_hidden_states=True,
            use_cache=False,
            logits_to_keep=0 if check_logits else 1,  # (B, T, V) logits only when they are checked
        )
        if check_logits:
            real = attention_mask[0].bool()  # one row: (T, V) float32 copies stay small for large vocabularies
            rebuilt = _logits(target, out.hidden_states[target.num_layers][0, real])
            tol = 1e-4 if target.dtype == torch.float32 else 2e-2
            if not torch.allclose(rebuilt, out.logits[0, real].float(), rtol=tol, atol=tol):
                raise ValueError(
                    f"training.features=offline: the logits of {target.name!r} are not its output layer applied "
                    "to its last hidden state (scaled or capped logits?); use training.features=online"
                )
    return {layer: out.hidden_states[layer] for layer in layers}


def _logits(target: Target, final_hidden: torch.Tensor) -> torch.Tensor:
    """(B, T, H) final-norm hidden states -> (B, T, V) float32 logits, as the target's forward computes them."""
    return target.model.get_output_embeddings()(final_hidden).float()


def _human(size: int) -> str:
    """Bytes in binary units: 1536 -> '1.5 KiB'."""
    value, unit = float(size), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"


@dataclass(frozen=True)
class CacheFiles:
    """Where a cache's rows lie: what it holds, its shard files in example order, and the key each shard carries."""

    manifest: Manifest
    shards: tuple[Path, ...]
    key: str


class FeatureCache:
    """Reads a feature cache in place of running the target: ``cache.batch(indices, batch)`` is a `TrainBatch`.

    Shards are opened on first use and memory-mapped (safetensors ``safe_open``): only the rows of the
    requested examples are read. Hidden states come back in the target's dtype on its device, zero at
    padding (which every loss masks); logits are rebuilt from the final layer with the target's output layer.

    Args:
        path: the cache directory.
        target: the frozen target; must be the one the cache was extracted from.
        hidden_layers: HF hidden_states indices the head reads.
        examples: the training examples, when given, must be the ones the cache was extracted for.
        logits: rebuild the target's logits (False for a head that trains on tokens alone: its batches carry
            ``target_logits=None``, and the final layer is read only if the head reads it).
        files: the manifest and shards to read where they are not ``path``'s own (a recording of served traffic,
            `specgraft.train.recording`).
        prefixes: a batch's example may be the first tokens of the cache's (a recorded generation cut to
            ``data.max_length``); else its length must be the cache's.

    Raises:
        FileNotFoundError: no manifest, or missing shards (an interrupted extraction: rerun it, it resumes).
        ValueError: a cache for another target, other data, or without the requested layers.
    """

    def __init__(
        self,
        path: str | Path,
        target: Target,
        hidden_layers: Sequence[int],
        *,
        examples: Sequence[Mapping[str, Any]] | None = None,
        logits: bool = True,
        files: CacheFiles | None = None,
        prefixes: bool = False,
    ) -> None:
        self.path = Path(path)
        self.target = target
        self.requested = tuple(hidden_layers)
        self.logits = logits
        self.prefixes = prefixes
        if files is None:
            manifest = Manifest.read(self.path)
            names = [SHARD_NAME.format(i) for i in range(len(manifest.shards))]
            files = CacheFiles(manifest, tuple(self.path / name for name in names), manifest.key)
            missing = [name for name in names if not (self.path / name).is_file()]
            if missing:
                raise FileNotFoundError(
                    f"the feature cache {self.path} is incomplete: {len(missing)} of {len(names)} shards "
                    f"are missing ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); "
                    "rerun `specgraft extract-features CONFIG` (it resumes)"
                )
        self.manifest, self._files, self._key = files.manifest, files.shards, files.key
        needed = stored_layers(target, self.requested)
        fingerprint = data_fingerprint(examples) if examples is not None else None
        _refuse(self.path, self.manifest.mismatches(
            target, layers=needed, fingerprint=fingerprint, num_examples=None if examples is None else len(examples)
        ))
        self.layers = needed if logits else self.requested  # the ones read: the head's, and the final one for logits
        self._starts = [start for start, _ in self.manifest.shards]
        self._open: dict[int, tuple[Any, list[int]]] = {}  # shard -> (safe_open handle, row offsets)

    def __len__(self) -> int:
        return self.manifest.num_examples

    def _rows(self, index: int) -> tuple[Any, int, int]:
        """The open shard holding example ``index``, and the example's first row and length in it."""
        if not 0 <= index < self.manifest.num_examples:
            raise IndexError(f"example {index} is not in the feature cache {self.path} ({self.manifest.num_examples} examples)")
        shard = bisect_right(self._starts, index) - 1
        if shard not in self._open:
            file = self._files[shard]
            handle = safe_open(str(file), framework="pt")
            meta = handle.metadata() or {}
            if meta.get("key") != self._key:
                raise ValueError(f"{file} belongs to another feature cache than {self.path / MANIFEST}; delete it and rerun extraction")
            offsets = [0]
            for n in json.loads(meta["lengths"]):
                offsets.append(offsets[-1] + n)
            self._open[shard] = (handle, offsets)
        handle, offsets = self._open[shard]
        i = index - self._starts[shard]
        return handle, offsets[i], offsets[i + 1] - offsets[i]

    def batch(self, indices: Sequence[int], batch: Mapping[str, torch.Tensor]) -> TrainBatch:
        """The `TrainBatch` of a collated ``batch`` whose rows are examples ``indices``.

        Raises:
            ValueError: an example whose length in the cache is not its length in the batch (other data).
        """
        b, t = batch["input_ids"].shape
        lengths = batch["attention_mask"].sum(dim=1).tolist()
        storage = DTYPES[self.manifest.dtype]
        hidden = {layer: torch.zeros(b, t, self.manifest.hidden_size, dtype=storage) for layer in self.layers}  # (B, T, H)
        for row, index in enumerate(indices):
            handle, first, n = self._rows(index)
            if self.prefixes and lengths[row] < n:
                n = lengths[row]
            if n != lengths[row]:
                raise ValueError(
                    f"example {index} has {n} tokens in the feature cache {self.path} but {lengths[row]} in this batch: "
                    "the cache was extracted for other data"
                )
            for layer in self.layers:
                hidden[layer][row, :n] = handle.get_slice(f"layer.{layer}")[first : first + n]
        device = self.target.device
        hidden = {layer: h.to(device).to(self.target.dtype) for layer, h in hidden.items()}
        logits = None
        if self.logits:
            with torch.no_grad():
                logits = _logits(self.target, hidden[self.target.num_layers])  # (B, T, V)
        return TrainBatch(
            input_ids=batch["input_ids"].to(device),
            loss_mask=batch["loss_mask"].to(device=device, dtype=torch.float32),
            hidden={layer: hidden[layer] for layer in self.requested},
            target_logits=logits,
        )
