"""Fine-tuning on served traffic: recorded generations, mixed with a share of the original data.

A head fine-tuned on recorded traffic alone drifts toward it and forgets what it drafted well before; a share of
its original data in every epoch (``data.original_share``) keeps it (replay, as continual learning calls it). The
recorded examples carry their states (`specgraft.train.recording`), so only the original share runs the target
(online, or from its offline cache); `MixedFeatures` gives every row of a batch its states from its own source.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from specgraft.heads.base import TrainBatch
from specgraft.model import Target
from specgraft.train.recording import Recording

FeatureSource = Callable[[Sequence[int], Mapping[str, torch.Tensor]], TrainBatch]  # (indices, collated batch)
RECORDED = "recorded"  # an example's key: (recording, index in it), for examples that came from a recording


def recorded_examples(recordings: Sequence[Recording], max_length: int) -> list[dict[str, Any]]:
    """Every recorded generation as a training example, cut to ``max_length`` tokens, tagged with where its states
    are (``example["recorded"] = (recording, i)``: that recording's example i, so that training reads the very
    recording read here, whatever a server recording into its directory added since). Generations with nothing
    trained left after the cut are dropped."""
    out = []
    for recording in recordings:
        for i, example in enumerate(recording.examples()):
            ids, mask = example["input_ids"][:max_length], example["loss_mask"][:max_length]
            if any(mask):
                out.append({"input_ids": ids, "loss_mask": mask, RECORDED: (recording, i)})
    return out


def split_recorded(examples: Sequence[dict], eval_fraction: float) -> tuple[list[dict], list[dict]]:
    """(train, held-out) of recorded examples, each held out by a hash of its tokens: a recording that grows keeps
    its held-out generations held out (a learner's later rounds never train on what its earlier ones were judged
    by), and about ``eval_fraction`` of them; at least the lowest hash's where ``eval_fraction`` > 0 and there are
    two or more (a short recording still judges its rounds)."""
    keys = [int.from_bytes(hashlib.sha256(array("q", e["input_ids"]).tobytes()).digest()[:8], "little") for e in examples]
    bound = eval_fraction * 2**64
    if eval_fraction > 0 and len(examples) >= 2 and min(keys) >= bound:
        bound = min(keys) + 1
    train = [e for e, key in zip(examples, keys) if key >= bound]
    heldout = [e for e, key in zip(examples, keys) if key < bound]
    return train, heldout


def with_original_share(recorded: list[dict], original: Sequence[dict], share: float, *, seed: int = 0) -> list[dict]:
    """``recorded`` and as many ``original`` examples (drawn without replacement, seeded) as make them ``share`` of
    the whole, or every original one if there are fewer: recorded first, then the original ones."""
    if not 0.0 <= share < 1.0:
        raise ValueError(f"data.original_share must lie in [0, 1), got {share}")
    wanted = min(len(original), round(share / (1.0 - share) * len(recorded)))
    picked = sorted(random.Random(seed).sample(range(len(original)), wanted))
    return list(recorded) + [original[i] for i in picked]


class MixedFeatures:
    """Features of a batch mixing recorded and original examples: each row's from its own source.

    Args:
        examples: the training examples the trainer's indices refer to.
        recorded: a recording -> its states as a feature source (`recorded_features`), for the recordings that
            ``example["recorded"]`` names.
        original: the features of the other examples: a function of (indices, collated batch), the indices the
            positions of those examples among the non-recorded ones, in order (what an offline cache of them holds).
    """

    def __init__(self, examples: Sequence[Mapping[str, Any]], recorded: Callable[[Recording], FeatureSource],
                 original: FeatureSource) -> None:
        self.sources = [original]
        numbers: dict[int, int] = {}  # id of a recording -> its source
        self.route: list[tuple[int, int]] = []  # example -> (source, index in it)
        count = 0
        for example in examples:
            if RECORDED in example:
                recording, i = example[RECORDED]
                if id(recording) not in numbers:
                    numbers[id(recording)] = len(self.sources)
                    self.sources.append(recorded(recording))
                self.route.append((numbers[id(recording)], i))
            else:
                self.route.append((0, count))
                count += 1

    def batch(self, indices: Sequence[int], batch: Mapping[str, torch.Tensor]) -> TrainBatch:
        groups: dict[int, list[int]] = {}  # source -> the batch's rows from it
        for row, index in enumerate(indices):
            groups.setdefault(self.route[index][0], []).append(row)
        parts = []
        for source, rows in groups.items():
            picked = torch.tensor(rows)
            sub = {key: value[picked] for key, value in batch.items()}  # (rows, T): the batch's width kept
            parts.append((picked, self.sources[source]([self.route[indices[r]][1] for r in rows], sub)))
        if len(parts) == 1:
            return parts[0][1]
        return _joined(parts, len(indices))


def _joined(parts: list[tuple[torch.Tensor, TrainBatch]], size: int) -> TrainBatch:
    """One batch of ``size`` rows from parts holding some of its rows each, every part as wide as the batch."""
    first = parts[0][1]

    def join(get: Callable[[TrainBatch], torch.Tensor]) -> torch.Tensor:
        like = get(first)
        out = like.new_empty((size, *like.shape[1:]))
        for rows, part in parts:
            out[rows.to(out.device)] = get(part).to(out.dtype)
        return out

    return TrainBatch(
        input_ids=join(lambda b: b.input_ids),
        loss_mask=join(lambda b: b.loss_mask),
        hidden={layer: join(lambda b, layer=layer: b.hidden[layer]) for layer in first.hidden},
        target_logits=None if first.target_logits is None else join(lambda b: b.target_logits),
    )


def open_recordings(paths: Sequence[str | Path]) -> list[Recording]:
    """The recordings of ``data.recorded``, refused (naming the key and the directory) where one is absent or empty."""
    recordings = []
    for path in paths:
        try:
            recording = Recording(path)
        except FileNotFoundError as err:
            raise FileNotFoundError(f"data.recorded: {err}") from None
        if len(recording) == 0:
            raise ValueError(f"data.recorded: {path} holds no recorded request yet")
        recordings.append(recording)
    return recordings


def recorded_features(target: Target, hidden_layers: Sequence[int], logits: bool) -> Callable[[Recording], FeatureSource]:
    """A recording -> its states as a feature source (its generations may be cut to ``data.max_length``)."""
    return lambda recording: recording.features(target, hidden_layers, logits=logits, prefixes=True).batch
