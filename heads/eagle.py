"""EAGLE-1/2 feature drafter: autoregression in the target's feature space.

Pair i joins the target's feature f_i (its last hidden state, after the
final norm) with the embedding of the next token t_{i+1}; one Llama decoder
layer over the pairs predicts f_{i+1}, and the target's own lm_head turns a
predicted feature into the distribution of t_{i+2}. While drafting, a node's
pair is (predicted feature of its parent, its own token), so the drafter
walks a tree with tree attention over its own KV cache; between steps that
cache keeps only pairs made of committed tokens and true target features.

Weight names follow the official EAGLE checkpoints: ``fc.*``, ``layers.0.*``
(no input norm on that layer). The target's embedding and lm_head are used,
frozen, and never saved with the head.

Shape legend: B batch, T pairs, H hidden, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from specgraft.heads.base import TrainBatch
from specgraft.heads.configs import EagleConfig
from specgraft.heads.feature_drafter import FeatureDrafter
from specgraft.model import FastLlama, StaticKVCache
from specgraft.model import BatchedKVCache, KVCache, Target, cache_keyword
from specgraft.tree import additive_mask


# What a Llama draft layer is sized from; GPT-2-style configs name them otherwise (n_embd, n_inner).
LAYER_SIZE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "max_position_embeddings", "vocab_size")


def layer_config(target_config, num_layers: int) -> LlamaConfig:
    """A Llama config for the draft layers, sized like the target (head_dim read, never derived).

    Raises:
        ValueError: the target's config lacks a size a Llama layer needs (naming it).
    """
    missing = [key for key in LAYER_SIZE_KEYS if getattr(target_config, key, None) is None]
    if missing:
        raise ValueError(
            f"{type(target_config).__name__} has no {', '.join(missing)}: an EAGLE draft layer is a Llama layer "
            "sized from the target's config; use a Medusa head for this target"
        )
    head_dim = getattr(target_config, "head_dim", None) or target_config.hidden_size // target_config.num_attention_heads
    rope = getattr(target_config, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": getattr(target_config, "rope_theta", 10000.0),
    }
    return LlamaConfig(
        hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size,
        num_attention_heads=target_config.num_attention_heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", target_config.num_attention_heads),
        head_dim=head_dim,
        num_hidden_layers=num_layers,
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6),
        max_position_embeddings=target_config.max_position_embeddings,
        rope_parameters=rope,
        vocab_size=target_config.vocab_size,
        attn_implementation="sdpa",
    )


class EagleHead(nn.Module):
    """fc(2H -> H) over [embedding, feature], then decoder layers: predicts the next feature."""

    def __init__(self, config: EagleConfig, target: Target) -> None:
        super().__init__()
        self.config = config
        self.hidden_layers = (target.num_layers,)  # HF hidden_states[-1]: after the final norm
        hidden = target.config.hidden_size
        llama = layer_config(target.config, config.num_layers)
        self.fc = nn.Linear(2 * hidden, hidden, bias=config.fc_bias)
        self.layers = nn.ModuleList(LlamaDecoderLayer(llama, layer_idx=i) for i in range(config.num_layers))
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE: the fused input is not normed again
        self.layer_config = llama
        self.rotary = LlamaRotaryEmbedding(llama)
        # The target's frozen embedding and lm_head: shared, not trained, not saved.
        self.register_buffer("embed_weight", target.model.get_input_embeddings().weight.detach(), persistent=False)
        self.register_buffer("lm_head_weight", target.model.get_output_embeddings().weight.detach(), persistent=False)
        self.to(target.device)

    def forward(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """(B, T, H) features and (B, T) next tokens -> (B, T, H) predicted next features."""
        x = self.fc(torch.cat([F.embedding(tokens, self.embed_weight).to(features.dtype), features], dim=-1))
        if attention_mask is None:  # plain causal attention over the new pairs, after any cached ones
            past = len(cache) if cache is not None else 0
            t = tokens.shape[1]
            visible = torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(past)
            attention_mask = additive_mask(visible, x.dtype)
        position_embeddings = self.rotary(x, position_ids)
        for layer in self.layers:
            x = layer(
                x,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=cache is not None,
                position_embeddings=position_embeddings,
                **{cache_keyword(LlamaDecoderLayer): cache.hf if cache is not None else None},
            )
        return x

    def fast(self) -> FastLlama:
        """The lean inference path over this head's own layer weights (shared, so training updates show)."""
        if getattr(self, "_fast", None) is None:
            self._fast = FastLlama.for_layers(self.layers, self.layer_config, self.rotary,
                                              products=(self.fc.weight, self.lm_head_weight))
        return self._fast

    @torch.inference_mode()
    def draft_forward(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: StaticKVCache,
    ) -> torch.Tensor:
        """`forward` for drafting: the same maths without transformers' per-call machinery."""
        features = features.to(self.fc.weight.dtype)
        emb = F.embedding(tokens, self.embed_weight).to(features.dtype)
        fast = self.fast()
        x = fast.linear(torch.cat([emb, features], dim=-1), self.fc.weight, self.fc.bias)
        return fast.run_layers(x, cache, position_ids, attention_mask)

    # -- the FeatureDrafter interface --------------------------------------------------------------
    def draft_features(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        return hidden[self.hidden_layers[0]].to(self.fc.weight.dtype)

    def new_draft_cache(self, max_len: int) -> StaticKVCache:
        return self.fast().new_cache(max_len)

    def new_draft_rows(self, rows: int, max_len: int) -> BatchedKVCache:
        return self.fast().new_batched_cache(rows, max_len)

    def draft_step(self, features, tokens, positions, mask, cache) -> torch.Tensor:
        return self.draft_forward(features, tokens, positions, mask, cache)

    def draft_logp(self, out: torch.Tensor) -> torch.Tensor:
        if out.dtype != self.lm_head_weight.dtype:
            return self.logits(out)
        return self.fast().linear(out, self.lm_head_weight)  # `logits`, in the form this machine runs fastest

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return features @ self.lm_head_weight.to(features.dtype).T

    def loss(self, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """SmoothL1 on the next feature + token_loss_weight x cross-entropy against the target's distribution."""
        f = batch.hidden[self.hidden_layers[0]].detach()  # (B, T, H)
        b, t, _ = f.shape
        inputs = f[:, :-1]
        if self.training and self.config.noise > 0:
            inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * self.config.noise  # U(-noise, noise), EAGLE
        positions = torch.arange(t - 1, device=f.device)[None].expand(b, -1)
        pred = self(inputs, batch.input_ids[:, 1:], positions)  # (B, T-1, H): predicted f_1 .. f_{T-1}
        # Pair i predicts f_{i+1}, whose lm_head gives t_{i+2}: learn it where t_{i+2} is a trained token.
        mask = torch.cat([batch.loss_mask[:, 2:], batch.loss_mask.new_zeros(b, 1)], dim=1).float()  # (B, T-1)
        denom = mask.sum().clamp(min=1.0)
        feature_loss = (F.smooth_l1_loss(pred, f[:, 1:], reduction="none").mean(-1) * mask).sum() / denom
        target_p = batch.target_logits[:, 1:].float().softmax(-1)
        draft_logp = self.logits(pred).float().log_softmax(-1)
        token_loss = (-(target_p * draft_logp).sum(-1) * mask).sum() / denom
        loss = self.config.feature_loss_weight * feature_loss + self.config.token_loss_weight * token_loss
        top1 = ((draft_logp.argmax(-1) == target_p.argmax(-1)).float() * mask).sum() / denom
        return loss, {"loss": float(loss.detach()), "feature_loss": float(feature_loss.detach()), "token_loss": float(token_loss.detach()), "top1": float(top1)}


EagleDrafter = FeatureDrafter  # an EagleHead drafts through the shared feature-space drafter
