"""EAGLE-3: a drafter fed by three fused target layers, trained on its own predictions.

The target's hidden states at HF ``hidden_states`` indices ``aux_layers``
(default 2, N // 2, N - 3: inputs of those decoder layers) are concatenated
and fused by ``fc`` (3H -> H, no bias). One decoder layer ("midlayer")
reads [input_layernorm(embedding), hidden_norm(h)] (2H wide) in q/k/v; a
final norm and the head's own lm_head over a reduced draft vocabulary give
the next token. From the second draft step on, h is the midlayer's own
previous output (fc is skipped). Training unrolls ``ttt_length`` steps on the
head's own outputs (training-time test): step j at column i sits at position
i + j and sees the real prefix (step-0 pairs at columns <= i) plus its own
earlier steps at column i.

Training runs the modules (`forward`, `loss`); drafting runs the same maths
over the same weights through `specgraft.model.fast_llama` (`draft_forward`, with a
`StaticKVCache`), without transformers' per-call machinery.

Draft vocabulary: the ``draft_vocab_size`` most frequent target tokens in the
training data; ``d2t[d]`` is the offset from draft id d to its target id and
``t2d`` marks target ids in the draft vocabulary (official buffer names).

Shape legend: B batch, T columns, H hidden, V target vocab, D draft vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from specgraft.heads.base import TrainBatch
from specgraft.heads.configs import Eagle3Config
from specgraft.heads.feature_drafter import FeatureDrafter
from specgraft.heads.eagle import layer_config
from specgraft.model import FastLlama, StaticKVCache, rms_norm
from specgraft.model import BatchedKVCache, KVCache, Target
from specgraft.tree import additive_mask


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's taps: HF hidden_states indices 2, N // 2 and N - 3."""
    return (2, num_layers // 2, num_layers - 3)


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read 2H-wide inputs; keys/values go to an explicit cache."""

    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads, self.num_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        h = config.hidden_size
        self.q_proj = nn.Linear(2 * h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(B, T, 2H) -> q (B, nh, T, hd), k and v (B, nkv, T, hd), rotary applied."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q (B, nh, T, hd) over k, v (B, nkv, S, hd) with an additive (.., T, S) mask -> (B, T, H)."""
        b, _, t, _ = q.shape
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Eagle3Head(nn.Module):
    """fc + midlayer + norm + lm_head over the draft vocabulary."""

    def __init__(self, config: Eagle3Config, target: Target) -> None:
        super().__init__()
        self.config = config
        n = target.num_layers
        self.hidden_layers = tuple(config.aux_layers) if config.aux_layers else default_aux_layers(n)
        bad = [i for i in self.hidden_layers if not 0 <= i <= n]
        if bad or len(self.hidden_layers) != 3:
            raise ValueError(f"aux_layers {list(self.hidden_layers)} must be 3 HF hidden_states indices in [0, {n}]")
        llama = layer_config(target.config, 1)
        hidden, vocab = target.config.hidden_size, target.vocab_size
        draft_vocab = config.draft_vocab_size or vocab
        if draft_vocab > vocab:
            raise ValueError(f"draft_vocab_size {draft_vocab} exceeds the target's vocabulary of {vocab}")
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.midlayer = nn.Module()
        self.midlayer.self_attn = Eagle3Attention(llama)
        self.midlayer.mlp = LlamaMLP(llama)
        self.midlayer.input_layernorm = LlamaRMSNorm(hidden, eps=llama.rms_norm_eps)
        self.midlayer.hidden_norm = LlamaRMSNorm(hidden, eps=llama.rms_norm_eps)
        self.midlayer.post_attention_layernorm = LlamaRMSNorm(hidden, eps=llama.rms_norm_eps)
        self.norm = LlamaRMSNorm(hidden, eps=llama.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.layer_config = llama
        self.rotary = LlamaRotaryEmbedding(llama)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool))
        self.t2d[:draft_vocab] = True
        # The target's frozen input embedding: shared, not trained, not saved.
        self.register_buffer("embed_weight", target.model.get_input_embeddings().weight.detach(), persistent=False)
        with torch.no_grad():  # start the draft lm_head from the target's rows of the draft vocabulary
            self.lm_head.weight.copy_(target.model.get_output_embeddings().weight[:draft_vocab].float())
        self.to(target.device)

    # -- draft vocabulary ---------------------------------------------------------------------------
    @property
    def draft_ids(self) -> torch.Tensor:
        """(D,) target id of each draft id."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def set_draft_vocab(self, token_counts: torch.Tensor, target: Target) -> None:
        """Keep the D most frequent target tokens (ties to the lower id), sorted by id."""
        d = self.d2t.shape[0]
        ids = token_counts.float().topk(d).indices.sort().values.to(self.d2t.device)
        self.d2t.copy_(ids - torch.arange(d, device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True
        self.lm_head.weight.copy_(target.model.get_output_embeddings().weight[ids.to(target.device)].float())

    def to_target_logp(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """(..., D) draft logits -> (..., V) log-probs, -inf outside the draft vocabulary."""
        logp = draft_logits.float().log_softmax(-1)
        full = logp.new_full((*logp.shape[:-1], self.t2d.shape[0]), -torch.inf)
        return full.index_copy(-1, self.draft_ids, logp)

    # -- the layer --------------------------------------------------------------------------------
    def fuse(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """Target states at the three taps -> (.., H) fused feature."""
        return self.fc(torch.cat([hidden[i].to(self.fc.weight.dtype) for i in self.hidden_layers], dim=-1))

    def layer_inputs(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T, H) feature and (B, T) tokens -> (B, T, 2H) normed [embedding, feature]."""
        emb = F.embedding(tokens, self.embed_weight).to(h.dtype)
        return torch.cat([self.midlayer.input_layernorm(emb), self.midlayer.hidden_norm(h)], dim=-1)

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual over the fed feature, then the MLP block: the midlayer's output."""
        x = h + attn
        return x + self.midlayer.mlp(self.midlayer.post_attention_layernorm(x))

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Final norm and the draft lm_head, as plain ops (HF's RMSNorm maths): training and drafting share them."""
        return F.linear(rms_norm(out, self.norm.weight, self.norm.variance_epsilon), self.lm_head.weight)

    def forward(
        self,
        h: torch.Tensor,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: KVCache,
    ) -> torch.Tensor:
        """One step on (B, T) new pairs after the cached ones: (B, T, H) midlayer outputs."""
        x = self.layer_inputs(h, tokens)
        cos, sin = self.rotary(x, position_ids)
        q, k, v = self.midlayer.self_attn.project(x, cos, sin)
        k, v = cache.hf.update(k, v, 0)
        return self.finish(h, self.midlayer.self_attn.attend(q, k, v, attention_mask))

    def fast(self) -> FastLlama:
        """The lean inference path over the midlayer's own weights (shared, so training updates show)."""
        if getattr(self, "_fast", None) is None:
            self._fast = FastLlama.for_layers([self.midlayer], self.layer_config, self.rotary,
                                              products=(self.fc.weight, self.lm_head.weight))
        return self._fast

    @torch.inference_mode()
    def draft_forward(
        self,
        h: torch.Tensor,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: StaticKVCache,
    ) -> torch.Tensor:
        """`forward` for drafting: the same maths without transformers' per-call machinery.

        ``attention_mask`` None means causal over the cached pairs and the new ones.
        """
        fast = self.fast()
        layer = fast.layers[0]  # the midlayer; its input_norm is input_layernorm (of the embedding)
        h = h.to(layer.q.dtype)  # (B, T, H)
        emb = F.embedding(tokens, self.embed_weight).to(h.dtype)  # (B, T, H)
        x = torch.cat(
            [rms_norm(emb, layer.input_norm, fast.eps), rms_norm(h, self.midlayer.hidden_norm.weight, fast.eps)], dim=-1
        )  # (B, T, 2H), as `layer_inputs`
        step = fast.begin_step(x, cache, position_ids, attention_mask)
        out = h + fast.attention(0, layer, x, cache, step)  # the residual is over h, not the 2H input (`finish`)
        return out + fast.mlp(layer, rms_norm(out, layer.post_norm, fast.eps))  # (B, T, H)

    # -- the FeatureDrafter interface --------------------------------------------------------------
    def draft_features(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        # Committed pairs feed fc(fused taps) (`fuse`, its product in the form this machine runs fastest); tree
        # nodes feed the midlayer's outputs.
        fused = torch.cat([hidden[i].to(self.fc.weight.dtype) for i in self.hidden_layers], dim=-1)
        return self.fast().linear(fused, self.fc.weight, self.fc.bias)

    def new_draft_cache(self, max_len: int) -> StaticKVCache:
        return self.fast().new_cache(max_len)

    def new_draft_rows(self, rows: int, max_len: int) -> BatchedKVCache:
        return self.fast().new_batched_cache(rows, max_len)

    def draft_step(self, h, tokens, positions, mask, cache) -> torch.Tensor:
        return self.draft_forward(h, tokens, positions, mask, cache)

    def draft_logp(self, out: torch.Tensor) -> torch.Tensor:
        normed = rms_norm(out, self.norm.weight, self.norm.variance_epsilon)  # `draft_logits`, its product in the
        return self.to_target_logp(self.fast().linear(normed, self.lm_head.weight))  # form this machine runs fastest

    # -- training-time test -----------------------------------------------------------------------
    def loss(self, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Sum over steps j of loss_decay ** j x cross-entropy against the target on the draft vocabulary."""
        ids = batch.input_ids
        b, t = ids.shape
        cols = t - 1  # column i holds pair (f_i, t_{i+1})
        attn = self.midlayer.self_attn
        h = self.fuse({i: batch.hidden[i][:, :cols] for i in self.hidden_layers})  # (B, C, H)
        keys, values = [], []
        # The target's distribution restricted to the draft vocabulary and renormalised, once for all steps
        # (softmax of the kept logits: the same as renormalising the kept probabilities).
        target_p_all = batch.target_logits.index_select(-1, self.draft_ids).float().softmax(-1)  # (B, T, D)
        in_vocab = self.t2d[batch.target_logits.argmax(-1)]  # (B, T): target's choice is draftable
        total = h.new_zeros(())
        metrics: dict[str, float] = {}
        for j in range(self.config.ttt_length):
            if j + 1 >= t:
                break
            # Step j at column i: token t_{i+1+j} at position i + j; columns whose token lies past the end are padding.
            tok = torch.cat([ids[:, 1 + j :], ids.new_zeros(b, j)], dim=1)[:, :cols]
            x = self.layer_inputs(h, tok)
            positions = (torch.arange(cols, device=ids.device) + j)[None].expand(b, -1)
            cos, sin = self.rotary(x, positions)
            q, k, v = attn.project(x, cos, sin)
            keys.append(k)
            values.append(v)
            mask = additive_mask(ttt_visibility(cols, j, ids.device), q.dtype)
            out = self.finish(h, attn.attend(q, torch.cat(keys, 2), torch.cat(values, 2), mask))
            # Output at column i predicts t_{i+2+j}: the target's distribution at position i+1+j.
            target_p = torch.cat([target_p_all[:, 1 + j :], target_p_all.new_zeros(b, j, target_p_all.shape[-1])], 1)[:, :cols]
            valid = torch.arange(cols, device=ids.device) + 2 + j < t  # (C,)
            label_mask = torch.cat([batch.loss_mask[:, 2 + j :], batch.loss_mask.new_zeros(b, 2 + j)], 1)[:, :cols]
            draftable = torch.cat([in_vocab[:, 1 + j :], in_vocab.new_zeros(b, j)], 1)[:, :cols]
            mask_j = label_mask.float() * valid.float() * draftable.float()
            denom = mask_j.sum().clamp(min=1.0)
            logp = self.draft_logits(out).float().log_softmax(-1)
            ce = -(target_p * logp).sum(-1)
            total = total + self.config.loss_decay**j * (ce * mask_j).sum() / denom
            metrics[f"step{j}_top1"] = float(((logp.argmax(-1) == target_p.argmax(-1)).float() * mask_j).sum() / denom)
            h = out  # the next step feeds on this step's output
        metrics["loss"] = float(total.detach())
        return total, metrics


def ttt_visibility(cols: int, step: int, device) -> torch.Tensor:
    """(C, (step + 1) C) bool: step ``step`` at column i sees step-0 columns <= i and steps 1..step at column i."""
    causal = torch.ones(cols, cols, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(cols, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * step, dim=1)


Eagle3Drafter = FeatureDrafter  # an Eagle3Head drafts through the shared feature-space drafter
