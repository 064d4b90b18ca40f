"""A small independent draft LM distilled from the target by logit matching.

The classic two-model setup of the speculative decoding papers, and the
benchmark's fair baseline: a causal LM of the target's architecture with
fewer layers, trained by KL(target || draft) on the same data as the heads,
and saved as an ordinary transformers model directory, so `DraftModel` and
transformers' assisted generation (``assistant_model=``) both load it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from specgraft.heads.base import TrainBatch
from specgraft.heads.configs import DistillConfig
from specgraft.model import Target

SIZE_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")


class DistilledDraft(nn.Module):
    """Wraps a small causal LM; ``hidden_layers`` is empty: it learns from the target's logits only."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, config: DistillConfig, target: Target) -> None:
        super().__init__()
        self.config = config
        lm_config = copy.deepcopy(target.config)
        lm_config.num_hidden_layers = config.num_layers
        for field in SIZE_FIELDS:
            if getattr(config, field) is not None:
                setattr(lm_config, field, getattr(config, field))
        if getattr(lm_config, "layer_types", None):
            lm_config.layer_types = lm_config.layer_types[: config.num_layers]
        self.model = AutoModelForCausalLM.from_config(lm_config, attn_implementation="sdpa").to(target.device)
        self._init_from_target(target)

    @torch.no_grad()
    def _init_from_target(self, target: Target) -> None:
        """Start from the target's embedding, final norm, lm_head and first layers wherever shapes agree."""
        theirs = target.model.state_dict()
        ours = self.model.state_dict()
        copied = {k: theirs[k] for k, v in ours.items() if k in theirs and theirs[k].shape == v.shape}
        self.model.load_state_dict(copied, strict=False)

    def loss(self, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """KL(target || draft) per position, averaged over trained positions."""
        logits = self.model(input_ids=batch.input_ids).logits  # right padding: causal attention never sees it
        t = self.config.temperature
        target_logp = (batch.target_logits.float() / t).log_softmax(-1)
        draft_logp = (logits.float() / t).log_softmax(-1)
        kl = (target_logp.exp() * (target_logp - draft_logp)).sum(-1)  # (B, T)
        # Position t predicts t + 1: learn it where token t + 1 is a trained token.
        mask = torch.cat([batch.loss_mask[:, 1:], batch.loss_mask.new_zeros(batch.loss_mask.shape[0], 1)], 1).float()
        denom = mask.sum().clamp(min=1.0)
        loss = (kl * mask).sum() / denom
        top1 = ((draft_logp.argmax(-1) == target_logp.argmax(-1)).float() * mask).sum() / denom
        return loss, {"loss": float(loss.detach()), "top1": float(top1)}

    def save(self, out_dir: Path, target: Target) -> None:
        """An ordinary transformers model directory (plus the target's tokenizer)."""
        self.model.save_pretrained(out_dir, safe_serialization=True)
        if target.tokenizer is not None:
            target.tokenizer.save_pretrained(out_dir)
