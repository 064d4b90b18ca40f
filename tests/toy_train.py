"""Test-only training entry: the real `Trainer` with a toy head, launchable by a multi-process launcher.

    deepspeed --num_gpus 2 --master_port PORT tests/toy_train.py CONFIG.yaml [section.key=value ...]

The config's ``data.train`` is a JSON list of examples (``input_ids`` and
``loss_mask`` lists, see `greedy_examples`). After training, every rank
writes its own copy of the head to ``output_dir/rank{R}.safetensors``, so a
test can check that the ranks agree. Not collected by pytest (no test_ prefix).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from specgraft.heads.base import TrainBatch
from specgraft.heads.configs import MedusaConfig
from specgraft.model import Target


class ToyHead(nn.Module):
    """One linear layer on the target's last hidden state, predicting the next token.

    Like EAGLE it adds uniform noise to its input features while training, so
    an exact resume also depends on restoring each rank's RNG state.
    """

    noise = 0.05

    def __init__(self, target: Target, seed: int = 0) -> None:
        super().__init__()
        self.config = MedusaConfig(num_heads=1)  # any head config: save_head records it
        self.hidden_layers = (target.num_layers,)
        generator = torch.Generator().manual_seed(seed)
        self.proj = nn.Linear(target.config.hidden_size, target.vocab_size)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(self.proj.weight.shape, generator=generator) * 0.02)
            self.proj.bias.zero_()

    def loss(self, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        hidden = batch.hidden[self.hidden_layers[0]][:, :-1]  # (B, T-1, H)
        if self.training:
            hidden = hidden + (torch.rand_like(hidden) * 2 - 1) * self.noise
        logits = self.proj(hidden)  # (B, T-1, V)
        labels = batch.input_ids[:, 1:]  # (B, T-1)
        mask = batch.loss_mask[:, 1:]
        ce = F.cross_entropy(logits.float().transpose(1, 2), labels, reduction="none")  # (B, T-1)
        loss = (ce * mask).sum() / mask.sum().clamp(min=1.0)
        top1 = ((logits.argmax(-1) == labels).float() * mask).sum() / mask.sum().clamp(min=1.0)
        return loss, {"loss": loss.item(), "top1": top1.item()}


def greedy_examples(target: Target, count: int, length: int, seed: int = 0) -> list[dict]:
    """``count`` greedy continuations of BOS + a random token, ``length`` tokens each, all trained but the first."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(3, target.vocab_size, (count, 1), generator=generator)
    ids = torch.cat([torch.ones_like(starts), starts], dim=1)  # (count, 2): BOS, random token
    with torch.no_grad():
        out = target.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=length - 2, min_new_tokens=length - 2,
            do_sample=False, pad_token_id=0,
        )
    return [{"input_ids": row.tolist(), "loss_mask": [0] + [1] * (len(row) - 1)} for row in out]


def fit(head: nn.Module, target: Target, examples: list[dict], steps: int, lr: float) -> nn.Module:
    """Train ``head`` for ``steps`` full-batch AdamW steps on ``examples`` (seconds on a tiny target); returns it in eval mode."""
    from specgraft.train.features import target_batch

    head.train()
    batch = target_batch(target, collate(examples), head.hidden_layers)
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr)
    for _ in range(steps):
        loss, _ = head.loss(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval()


def collate(examples: list[dict], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """`specgraft.train.data.collate` when it exists, else a minimal right-padding collate."""
    try:
        from specgraft.train.data import collate as data_collate
    except ImportError:
        data_collate = None
    if data_collate is not None:
        return data_collate(examples, pad_token_id)
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), width))
    for row, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[row, :n] = torch.tensor(e["input_ids"])
        attention[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(e["loss_mask"], dtype=torch.float32)
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}


def main(argv: list[str] | None = None) -> int:
    import specgraft as sg
    from specgraft.config import load_config
    from specgraft.train.trainer import Trainer

    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--local_rank", type=int, default=None)  # passed by the deepspeed launcher; env has it too
    args = parser.parse_intermixed_args(argv)
    cfg = load_config(args.config, args.overrides)
    torch.set_num_threads(1)
    target = sg.load_target(cfg.target.path)
    data = json.loads(Path(cfg.data.train).read_text())
    trainer = Trainer(cfg, target=target, head=ToyHead(target), train_data=data, collate=partial(collate, pad_token_id=0))
    trainer.fit()
    rank = int(os.environ.get("RANK", 0))  # set by the launcher (a plain process is rank 0)
    tensors = {k: v.detach().float().contiguous() for k, v in trainer.head.state_dict().items()}
    save_file(tensors, str(Path(cfg.training.output_dir) / f"rank{rank}.safetensors"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
