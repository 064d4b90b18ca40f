"""How long one training step of a head costs on this machine, measured, so a minute budget becomes a step count."""

from __future__ import annotations

import time
from dataclasses import dataclass

# A trainer step costs this much more than the bare head step `measure_train_cost` times: reading the
# features back from the offline cache, rebuilding the target's logits, DeepSpeed's bookkeeping
# (measured on the demo target: 0.32 s against 0.26 s).
TRAINER_OVERHEAD = 1.25


@dataclass
class TrainStepCost:
    """Measured seconds: the target's forward over one micro-batch, and one head training step."""

    target_s: float
    step_s: float

    def steps_within(self, seconds: float, batches_per_epoch: int) -> int:
        """Optimizer steps that fit ``seconds`` after one feature-extraction pass over the data."""
        return max(1, int((seconds - batches_per_epoch * self.target_s) / (self.step_s * TRAINER_OVERHEAD)))


def measure_train_cost(target, examples: list[dict], micro_batch_size: int, repeats: int = 3) -> TrainStepCost:
    """Time the target over a micro-batch and a few EAGLE head steps (forward, backward, AdamW) on it."""
    import torch

    from specgraft.heads import build_head
    from specgraft.heads import EagleConfig
    from specgraft.train import collate
    from specgraft.train import target_batch

    pad = target.tokenizer.pad_token_id
    batch = collate(examples[:micro_batch_size], pad_token_id=pad if pad is not None else 0)
    head = build_head(EagleConfig(), target).train()
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-4)
    with torch.random.fork_rng():
        start = time.perf_counter()
        features = target_batch(target, batch, head.hidden_layers)
        target_s = time.perf_counter() - start
        times = []
        for _ in range(repeats + 1):  # the first step warms up allocators and kernels
            start = time.perf_counter()
            loss, _ = head.loss(features)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
    return TrainStepCost(target_s=target_s, step_s=min(times[1:]))
