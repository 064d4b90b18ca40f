"""Target features online: the frozen target's view of a training batch, computed on every step.

`target_batch`: the target runs whole right-padded sequences once, causally,
without a KV cache (``Target.forward`` is for cached decoding; training wants
every position at once), on every batch of every epoch. The offline cache
(`specgraft.train.feature_cache`) stores the same features on disk instead.

Features are constants to the head either way: no gradient flows into the target.

Shape legend: B sequences, T positions, V vocabulary, H hidden.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from specgraft.heads.base import TrainBatch
from specgraft.model import Target


def check_layers(target: Target, hidden_layers: Sequence[int]) -> None:
    bad = [i for i in hidden_layers if not 0 <= i <= target.num_layers]
    if bad:
        raise ValueError(
            f"hidden layers {bad} are out of range for {target.name!r}: HF hidden_states indices run 0..{target.num_layers}"
        )


def target_batch(
    target: Target, batch: Mapping[str, torch.Tensor], hidden_layers: Sequence[int], logits: bool = True
) -> TrainBatch:
    """Run the frozen target over a collated batch and package what a head trains on.

    Args:
        target: the frozen target.
        batch: ``input_ids`` (B, T) right-padded, ``attention_mask`` (B, T) 1 for real tokens,
            ``loss_mask`` (B, T) 1 where a token should be learned.
        hidden_layers: HF ``hidden_states`` indices the head reads (0 = embeddings,
            num_layers = after the final norm).
        logits: keep the target's logits (False for a head that trains on tokens alone: the output layer then
            runs on the last position only, and ``target_logits`` is None).

    Returns:
        A `TrainBatch` on the target's device: hidden (B, T, H) per layer in the
        target's dtype, target_logits (B, T, V) in float32.

    Raises:
        ValueError: a hidden layer index outside 0..num_layers, or a missing batch key.
    """
    missing = [k for k in ("input_ids", "attention_mask", "loss_mask") if k not in batch]
    if missing:
        raise ValueError(f"batch lacks {missing}; a training collate returns input_ids, attention_mask and loss_mask")
    check_layers(target, hidden_layers)
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
            logits_to_keep=0 if logits else 1,  # 0: every position's logits
        )
    hidden = {i: out.hidden_states[i] for i in hidden_layers}
    return TrainBatch(
        input_ids=input_ids,
        loss_mask=batch["loss_mask"].to(device=device, dtype=torch.float32),
        hidden=hidden,
        target_logits=out.logits.float() if logits else None,
    )
