"""Online features: the frozen target's view of a training batch, computed as the head trains.

The target runs whole right-padded sequences once, causally, without a KV
cache (``Target.forward`` is for cached decoding; training wants every
position at once). Its hidden states and logits are constants to the head:
no gradient flows into the target.

Shape legend: B sequences, T positions, V vocabulary, H hidden.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from specgraft.heads.base import TrainBatch
from specgraft.target import Target


def target_batch(target: Target, batch: Mapping[str, torch.Tensor], hidden_layers: Sequence[int]) -> TrainBatch:
    """Run the frozen target over a collated batch and package what a head trains on.

    Args:
        target: the frozen target.
        batch: ``input_ids`` (B, T) right-padded, ``attention_mask`` (B, T) 1 for real tokens,
            ``loss_mask`` (B, T) 1 where a token should be learned.
        hidden_layers: HF ``hidden_states`` indices the head reads (0 = embeddings,
            num_layers = after the final norm).

    Returns:
        A `TrainBatch` on the target's device: hidden (B, T, H) per layer in the
        target's dtype, target_logits (B, T, V) in float32.

    Raises:
        ValueError: a hidden layer index outside 0..num_layers, or a missing batch key.
    """
    missing = [k for k in ("input_ids", "attention_mask", "loss_mask") if k not in batch]
    if missing:
        raise ValueError(f"batch lacks {missing}; a training collate returns input_ids, attention_mask and loss_mask")
    bad = [i for i in hidden_layers if not 0 <= i <= target.num_layers]
    if bad:
        raise ValueError(
            f"hidden layers {bad} are out of range for {target.name!r}: HF hidden_states indices run 0..{target.num_layers}"
        )
    device = target.device
    input_ids = batch["input_ids"].to(device)
    attention_mask = batch["attention_mask"].to(device)
    # no_grad rather than inference_mode: inference tensors cannot be saved for the head's backward.
    with torch.no_grad():
        # Right padding keeps positions 0..len-1 for the real tokens, so the default position ids are right,
        # and the 2D padding mask combined with causal masking hides the pads from every real token.
        out = target.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            output_hidden_states=bool(hidden_layers),
            use_cache=False,
        )
    hidden = {i: out.hidden_states[i] for i in hidden_layers}
    return TrainBatch(
        input_ids=input_ids,
        loss_mask=batch["loss_mask"].to(device=device, dtype=torch.float32),
        hidden=hidden,
        target_logits=out.logits.float(),
    )


class OfflineFeatures:
    """Target features computed once per example, kept in CPU memory, reused every later epoch.

    For small targets, where the target's forward dominates each step and the
    features fit in memory (stories260K: 256 tokens x 64 floats per sequence).
    Large targets train online: their features would need terabytes.

    Target logits are not stored ((T, V) per sequence is the largest tensor);
    they are recomputed from the final hidden state with the target's output
    layer, which the first batch checks against the full forward (a model that
    scales or caps its logits fails that check with a clear error).

    Shape legend: B sequences, T positions, V vocabulary, H hidden.
    """

    def __init__(self, target: Target, hidden_layers: Sequence[int]) -> None:
        self.target = target
        self.requested = tuple(hidden_layers)
        self.final = target.num_layers  # HF hidden_states index after the final norm: the logits' input
        self.layers = tuple(sorted(set(self.requested) | {self.final}))
        self.store: dict[int, dict[int, torch.Tensor]] = {}  # example index -> layer -> (T_i, H) on CPU
        self._checked = False

    def __call__(self, indices: Sequence[int], batch: Mapping[str, torch.Tensor]) -> TrainBatch:
        """The `TrainBatch` of ``batch``, whose rows are dataset examples ``indices``."""
        missing = [row for row, index in enumerate(indices) if index not in self.store]
        if missing:
            self._compute([indices[row] for row in missing], {k: v[missing] for k, v in batch.items()})
        device = self.target.device
        b, t = batch["input_ids"].shape
        hidden = {}
        for layer in self.layers:
            rows = [self.store[index][layer] for index in indices]
            padded = rows[0].new_zeros(b, t, rows[0].shape[-1])  # (B, T, H); padding stays zero and is masked
            for row, states in enumerate(rows):
                padded[row, : states.shape[0]] = states
            hidden[layer] = padded.to(device)
        with torch.no_grad():
            logits = self._logits(hidden[self.final])
        return TrainBatch(
            input_ids=batch["input_ids"].to(device),
            loss_mask=batch["loss_mask"].to(device=device, dtype=torch.float32),
            hidden={layer: hidden[layer] for layer in self.requested},
            target_logits=logits,
        )

    def _logits(self, final_hidden: torch.Tensor) -> torch.Tensor:
        return self.target.model.get_output_embeddings()(final_hidden).float()  # (B, T, V)

    def _compute(self, indices: Sequence[int], batch: Mapping[str, torch.Tensor]) -> None:
        features = target_batch(self.target, batch, self.layers)
        if not self._checked:
            with torch.no_grad():
                rebuilt = self._logits(features.hidden[self.final])
            tol = 1e-4 if self.target.dtype == torch.float32 else 2e-2
            real = batch["attention_mask"].to(rebuilt.device).bool()
            if not torch.allclose(rebuilt[real], features.target_logits[real], rtol=tol, atol=tol):
                raise ValueError(
                    f"training.features=offline: the logits of {self.target.name!r} are not its output layer applied "
                    "to its last hidden state (scaled or capped logits?); use training.features=online"
                )
            self._checked = True
        lengths = batch["attention_mask"].sum(dim=1).tolist()
        for row, index in enumerate(indices):
            n = int(lengths[row])
            self.store[index] = {layer: features.hidden[layer][row, :n].cpu() for layer in self.layers}
