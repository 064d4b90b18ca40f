"""Typed configs of the trainable heads, validated by pydantic (unknown keys are errors).

Each head module builds from its config; the YAML ``head:`` section of a
training config is one of these, chosen by ``type``.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

STRICT = ConfigDict(extra="forbid")


@dataclass(config=STRICT)
class MedusaConfig:
    """Medusa-1: ``num_heads`` heads; head i reads the target's last hidden state at t and predicts token t + 2 + i."""

    type: Literal["medusa"] = "medusa"
    num_heads: int = Field(4, ge=1)
    num_layers: int = Field(1, ge=1)  # residual blocks per head (Medusa's medusa_num_layers)
    loss_decay: float = Field(0.8, gt=0.0, le=1.0)  # head i's loss weight is loss_decay ** i (Medusa paper)


@dataclass(config=STRICT)
class EagleConfig:
    """EAGLE-1/2 feature drafter: fc(2H -> H) over [embedding, feature], one decoder layer, the target's lm_head."""

    type: Literal["eagle"] = "eagle"
    num_layers: int = Field(1, ge=1)
    fc_bias: bool = False  # vLLM builds EAGLE's fc without a bias (SGLang takes either); EAGLE-1's Vicuna heads had one
    noise: float = Field(0.1, ge=0.0)  # U(-noise, noise) added to input features while training (EAGLE paper)
    feature_loss_weight: float = 1.0  # SmoothL1 on predicted features
    token_loss_weight: float = 0.1  # cross-entropy against the target's distribution (EAGLE's 0.1)


@dataclass(config=STRICT)
class Eagle3Config:
    """EAGLE-3: three fused target layers, one 2H-input decoder layer, own lm_head over a draft vocabulary."""

    type: Literal["eagle3"] = "eagle3"
    aux_layers: list[int] | None = None  # HF hidden_states indices; None: 2, N // 2, N - 3 (EAGLE-3)
    draft_vocab_size: int | None = Field(None, ge=1)  # None: the full target vocabulary
    ttt_length: int = Field(7, ge=1)  # training-time test unroll (EAGLE-3 / SpecForge default 7)
    loss_decay: float = Field(0.8, gt=0.0, le=1.0)  # step j's loss weight is loss_decay ** j


@dataclass(config=STRICT)
class DFlashConfig:
    """DFlash block drafter: non-causal decoder layers over a block of mask tokens, the target's fused states as context.

    ``target_layer_ids`` and ``mask_token_id`` follow the official ``dflash_config``: layer ids are 0-based
    decoder-layer *outputs* (HF ``hidden_states[id + 1]``); None picks the official defaults when the head is built
    and the checkpoint records what was picked.
    """

    type: Literal["dflash"] = "dflash"
    num_layers: int = Field(1, ge=1)  # draft decoder layers (z-lab's published heads: 5; SpecForge's default: 1)
    block_size: int = Field(16, ge=2)  # the last committed token and block_size - 1 mask tokens: drafts that many
    target_layer_ids: list[int] | None = None  # None: num_layers ids spread from 1 to N - 3 (one layer: N // 2)
    mask_token_id: int | None = Field(None, ge=0)  # None: the tokenizer's mask, else an unused row, else unk / pad
    num_anchors: int = Field(512, ge=1)  # blocks trained per sequence, at random anchors (SpecForge's default)
    loss_decay_gamma: float | None = Field(7.0, gt=0.0)  # block slot k weighs exp(-(k - 1) / gamma); None: all 1
    labels: Literal["tokens", "target"] = "tokens"  # cross-entropy against the data's tokens, or the target's distribution


@dataclass(config=STRICT)
class DistillConfig:
    """An independent small causal LM of the target's architecture, trained by KL to the target's distribution."""

    type: Literal["draft-model"] = "draft-model"
    num_layers: int = Field(1, ge=1)
    hidden_size: int | None = None  # None: the target's
    intermediate_size: int | None = None  # None: the target's
    num_attention_heads: int | None = None  # None: the target's
    num_key_value_heads: int | None = None  # None: the target's
    temperature: float = Field(1.0, gt=0.0)  # of the KL targets


# Fields that only weigh or shape the training loss. A head fine-tuned from another (`training.init_from`) may
# change them; every other field decides the shapes or the meaning of the weights and must match.
LOSS_FIELDS = frozenset({
    "loss_decay", "noise", "feature_loss_weight", "token_loss_weight", "ttt_length", "num_anchors",
    "loss_decay_gamma", "labels", "temperature",
})


HeadConfig = Annotated[Union[MedusaConfig, EagleConfig, Eagle3Config, DFlashConfig, DistillConfig], Field(discriminator="type")]
