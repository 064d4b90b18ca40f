"""DFlash: a block drafter that drafts ``block_size - 1`` tokens in one forward (z-lab, arXiv 2602.06036).

The context is the target's own view of the committed tokens: its hidden
states at ``target_layer_ids`` (layer outputs, HF ``hidden_states[id + 1]``),
concatenated, fused by ``fc`` and normed by ``hidden_norm``. Every decoder
layer projects that same context feature with its own ``k_proj`` / ``v_proj``
(k_norm, RoPE at the token's position); the context never runs through the
layers itself, so its keys and values are computed once per committed token
and kept in the draft cache across steps.

The block is the last committed token (the one the target has not run yet)
followed by ``block_size - 1`` mask tokens, embedded with the target's own
embedding at the next positions. It runs through Qwen3-style decoder layers
(q_norm / k_norm) whose queries see all of the context and the whole block,
itself included: no causal mask inside the block. The final norm and the
target's own lm_head turn block slot k into the distribution of the token k
places after the root; slot 0 (the root) predicts nothing. The block's keys
and values are never cached.

So a draft costs one forward whatever its depth, and depth d's distribution
does not depend on the tokens drafted above it: a tree from each slot's top-k
(or samples) is exact under any verification, as Medusa's is.

Training (`DFlashHead.loss`) samples anchors along each sequence; the block
after an anchor sees the context strictly before it (the anchor's own state
is what the target has not computed yet at inference) and its own block, no
other. Slot k's cross-entropy is weighted exp(-(k - 1) / gamma).

Weight names are the official checkpoint's: ``fc``, ``hidden_norm``,
``layers.N.*``, ``norm``; the target's embedding and lm_head are used, frozen,
and never saved.

Shape legend: B batch, S context positions, Q block slots (all blocks of a sequence while training), A anchors,
K block size, H hidden, Hq / Hkv heads, D head_dim, V vocabulary.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from specgraft.heads.base import DraftRequest, TrainBatch, grow_by_depth, root_tokens
from specgraft.heads.configs import DFlashConfig
from specgraft.heads.eagle import layer_config
from specgraft.model import TREE_SLOTS, BatchedKVCache, StaticKVCache, Target, rms_norm
from specgraft.model.captured import MOST_GRAPHS, CudaGraphs, GraphSet, Recomputed, bucket, default_recorder, slot_bucket
from specgraft.model.fast_llama import DYNAMIC_ROPE
from specgraft.model.staging import staged
from specgraft.tree import Sampling, Tree, TreePolicy

# Commits a state keeps as views of their steps' hidden states before joining them: a row that does not draft for
# many steps pins at most this many forward outputs.
PENDING_COMMITS = 32


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The official choice: one layer, the middle one; else ``num_draft_layers`` ids spread from 1 to N - 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def resolve_mask_token_id(target: Target) -> int:
    """An input id for the block's mask slots that the target never writes: the tokenizer's mask token, else the
    first embedding row past the tokenizer, else its unknown or padding token.

    Raises:
        ValueError: none of these exists (set ``head.mask_token_id``).
    """
    tok = target.tokenizer
    if tok is not None:
        if getattr(tok, "mask_token_id", None) is not None:
            return int(tok.mask_token_id)
        if len(tok) < target.vocab_size:
            return len(tok)
        for name in ("unk_token_id", "pad_token_id"):
            if getattr(tok, name, None) is not None:
                return int(getattr(tok, name))
    raise ValueError(
        f"target {target.name!r} has no mask, unused, unknown or padding token for DFlash's mask slots: "
        "set head.mask_token_id to an id the target never generates"
    )


class DFlashAttention(nn.Module):
    """Qwen3 attention weights (q_norm / k_norm over each head); the maths lives in `DFlashHead`."""

    def __init__(self, config) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, config.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=False)
        self.q_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)


class DFlashLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DFlashHead(nn.Module):
    """fc + hidden_norm over the fused target layers, non-causal decoder layers over the block, norm, the target's lm_head.

    One functional forward (`context_kv`, `run_block`) serves training and drafting, so the two cannot drift apart.
    """

    def __init__(self, config: DFlashConfig, target: Target) -> None:
        super().__init__()
        n = target.num_layers
        ids = list(config.target_layer_ids) if config.target_layer_ids else default_target_layer_ids(n, config.num_layers)
        # id n - 1 would be HF's final-norm output, which vLLM and SGLang do not capture.
        bad = [i for i in ids if not 0 <= i < n - 1]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(
                f"target_layer_ids {ids} must be distinct decoder-layer ids in [0, {n - 2}] of this {n}-layer target"
            )
        mask = config.mask_token_id if config.mask_token_id is not None else resolve_mask_token_id(target)
        if mask >= target.vocab_size:
            raise ValueError(f"mask_token_id {mask} is outside the target's vocabulary of {target.vocab_size}")
        self.config = replace(config, target_layer_ids=ids, mask_token_id=mask)  # the checkpoint records both
        self.hidden_layers = tuple(i + 1 for i in ids)  # HF hidden_states indices
        llama = layer_config(target.config, config.num_layers)
        hidden = target.config.hidden_size
        self.num_heads, self.num_kv, self.head_dim = llama.num_attention_heads, llama.num_key_value_heads, llama.head_dim
        self.eps = llama.rms_norm_eps
        self.fc = nn.Linear(len(ids) * hidden, hidden, bias=False)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=self.eps)
        self.layers = nn.ModuleList(DFlashLayer(llama) for _ in range(config.num_layers))
        self.norm = LlamaRMSNorm(hidden, eps=self.eps)
        self.rotary = LlamaRotaryEmbedding(llama)
        self.layer_config = llama
        # The target's frozen embedding and lm_head: shared, not trained, not saved.
        self.register_buffer("embed_weight", target.model.get_input_embeddings().weight.detach(), persistent=False)
        head = target.model.get_output_embeddings()
        self.register_buffer("lm_head_weight", head.weight.detach(), persistent=False)
        bias = getattr(head, "bias", None)
        self.register_buffer("lm_head_bias", None if bias is None else bias.detach(), persistent=False)
        self.to(target.device)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # -- the shared maths -------------------------------------------------------------------------
    def fuse(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """Target states at the taps -> (.., H) context feature: hidden_norm(fc(concatenation in tap order))."""
        dtype = self.fc.weight.dtype
        return self.hidden_norm(self.fc(torch.cat([hidden[i].to(dtype) for i in self.hidden_layers], dim=-1)))

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) positions -> cos, sin (B, T, D) from the target's rope settings."""
        return self.rotary(x, positions)

    def context_kv(
        self, layer: int, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s keys and values (B, Hkv, S, D) of (B, S, H) context features, RoPE applied to keys."""
        attn = self.layers[layer].self_attn
        b, s, _ = context.shape
        k = F.linear(context, attn.k_proj.weight).view(b, s, self.num_kv, self.head_dim)
        v = F.linear(context, attn.v_proj.weight).view(b, s, self.num_kv, self.head_dim)
        k = _rotate(rms_norm(k, attn.k_norm.weight, self.eps), cos, sin)
        return k.transpose(1, 2), v.transpose(1, 2)

    def run_block(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context: list[tuple[torch.Tensor, torch.Tensor]],
        sees: torch.Tensor | None,
    ) -> torch.Tensor:
        """The decoder layers over (B, A, K, H) blocks' embeddings -> (B, A, K, H) outputs after the final norm.

        Each block attends to the context positions ``sees`` allows and to all of its own slots, never to
        another block: one fused SDPA over [context ; every block] keys under that mask. Measured on this CPU
        (fwd + bwd of one layer, SmolLM2's and stories260K's shapes) 1.4-2.5x faster than scores written out per
        block, whose (.., A, K, S + K) tensors and their slices dominated a training step.

        Args:
            cos, sin: (B, A, K, D) at the block slots' positions.
            context: per layer, the context's keys and values (B, Hkv, S, D), from `context_kv` or the draft cache.
            sees: (B, A, S) bool, the context positions each block sees; None: all of them.
        """
        b, a, k_size, _ = x.shape
        mask = block_mask(sees, a, k_size, b, context[0][0].shape[2], x.device)
        cos, sin = cos.reshape(b, a * k_size, -1), sin.reshape(b, a * k_size, -1)
        for layer, (ctx_k, ctx_v) in zip(self.layers, context):
            attn = layer.self_attn
            h = rms_norm(x, layer.input_layernorm.weight, self.eps).view(b, a * k_size, -1)
            q = F.linear(h, attn.q_proj.weight).view(b, a * k_size, self.num_heads, self.head_dim)
            k = F.linear(h, attn.k_proj.weight).view(b, a * k_size, self.num_kv, self.head_dim)
            v = F.linear(h, attn.v_proj.weight).view(b, a * k_size, self.num_kv, self.head_dim)
            q = _rotate(rms_norm(q, attn.q_norm.weight, self.eps), cos, sin).transpose(1, 2)  # (B, Hq, A K, D)
            k = _rotate(rms_norm(k, attn.k_norm.weight, self.eps), cos, sin).transpose(1, 2)  # (B, Hkv, A K, D)
            keys, values = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v.transpose(1, 2)], dim=2)
            # Query head n * G + g reads key/value head n (grouped-query attention, as HF repeats them).
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv)
            out = out.transpose(1, 2).reshape(b, a, k_size, -1)  # (B, A, K, Hq * D)
            x = x + F.linear(out, attn.o_proj.weight)
            x = x + layer.mlp(rms_norm(x, layer.post_attention_layernorm.weight, self.eps))
        return rms_norm(x, self.norm.weight, self.eps)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """(.., H) block outputs -> (.., V) logits through the target's lm_head.

        Flattened to one (N, H) product first: F.linear on a non-contiguous (B, A, K, H) slice runs as a
        batched product against the weight broadcast per row, measured 20x slower on CPU for SmolLM2's lm_head.
        """
        bias = None if self.lm_head_bias is None else self.lm_head_bias.to(out.dtype)
        flat = out.reshape(-1, out.shape[-1])
        return F.linear(flat, self.lm_head_weight.to(out.dtype), bias).view(*out.shape[:-1], -1)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.embed_weight).to(self.fc.weight.dtype)

    # -- drafting -----------------------------------------------------------------------------------
    def new_cache(self, max_len: int) -> StaticKVCache:
        w = self.fc.weight
        return StaticKVCache(len(self.layers), self.num_kv, self.head_dim, max_len=max_len, dtype=w.dtype, device=w.device)

    def new_rows(self, rows: int, max_len: int) -> BatchedKVCache:
        w = self.fc.weight
        return BatchedKVCache(
            len(self.layers), self.num_kv, self.head_dim, rows=rows, max_len=max_len, dtype=w.dtype, device=w.device
        )

    # -- training -----------------------------------------------------------------------------------
    @property
    def uses_target_logits(self) -> bool:
        """Soft labels read the target's logits; token labels need only the tokens."""
        return self.config.labels != "tokens"

    def loss(self, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Weighted cross-entropy of every block slot k >= 1 against the token k places after its anchor."""
        ids, loss_mask = batch.input_ids, batch.loss_mask
        b, s = ids.shape
        k_size, device = self.block_size, ids.device
        anchors, keep = sample_anchors(loss_mask, self.config.num_anchors)  # (B, A)
        a = anchors.shape[1]
        offsets = torch.arange(k_size, device=device)
        slots = anchors[..., None] + offsets  # (B, A, K) the position of each block slot
        block = torch.full((b, a, k_size), self.config.mask_token_id, dtype=torch.long, device=device)
        block[..., 0] = ids.gather(1, anchors)
        context = self.fuse({i: batch.hidden[i].detach() for i in self.hidden_layers})  # (B, S, H)
        ctx_cos, ctx_sin = self.rope(context, torch.arange(s, device=device)[None].expand(b, -1))
        x = self.embed(block)  # (B, A, K, H)
        cos, sin = self.rope(x, slots.view(b, -1))
        kv = [self.context_kv(i, context, ctx_cos, ctx_sin) for i in range(len(self.layers))]
        sees = context_visibility(anchors, keep, s)
        out = self.run_block(x, cos.view(b, a, k_size, -1), sin.view(b, a, k_size, -1), kv, sees)  # (B, A, K, H)
        logp = self.logits(out[:, :, 1:]).float().log_softmax(-1)  # (B, A, K-1, V): slot k predicts position anchor + k
        at = slots[:, :, 1:].clamp(max=s - 1)  # (B, A, K-1)
        inside = slots[:, :, 1:] < s
        weight = keep[..., None] & inside
        weight = weight.float() * loss_mask.float().gather(1, at.reshape(b, -1)).view_as(at)
        depth_weight = torch.ones(k_size - 1, device=device)
        if self.config.loss_decay_gamma is not None:
            depth_weight = torch.exp(-torch.arange(k_size - 1, device=device).float() / self.config.loss_decay_gamma)
        labels = ids.gather(1, at.reshape(b, -1)).view_as(at)
        if self.config.labels == "tokens":
            ce = -logp.gather(-1, labels[..., None])[..., 0]
        else:  # the target's distribution of that position: its logits one position earlier
            target = batch.target_logits.gather(1, (at - 1).reshape(b, -1, 1).expand(-1, -1, logp.shape[-1]))
            ce = -(target.float().softmax(-1).view_as(logp) * logp).sum(-1)
        weighted = weight * depth_weight
        loss = (weighted * ce).sum() / weighted.sum().clamp(min=1e-6)
        metrics = {"loss": float(loss.detach())}
        hit = (logp.argmax(-1) == labels).float() * weight
        for k in range(k_size - 1):
            metrics[f"slot{k + 1}_top1"] = float(hit[:, :, k].sum() / weight[:, :, k].sum().clamp(min=1.0))
        return loss, metrics


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (B, T, heads, D) with (B, T, D) cos / sin (HF's rotate-half convention)."""
    cos, sin = cos[:, :, None], sin[:, :, None]
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def sample_anchors(loss_mask: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``count`` anchors per sequence, uniformly without replacement among positions p whose next token is
    trained (loss_mask[p] and loss_mask[p + 1]), ascending: (B, A) positions and (B, A) which are real (the rest pad)."""
    b, s = loss_mask.shape
    valid = torch.zeros_like(loss_mask, dtype=torch.bool)
    valid[:, :-1] = (loss_mask[:, :-1] > 0) & (loss_mask[:, 1:] > 0)
    width = max(1, min(count, int(valid.sum(1).max())))
    scores = torch.rand(b, s, device=loss_mask.device).masked_fill(~valid, 2.0)  # invalid positions sort last
    picked = scores.argsort(1)[:, :width]
    keep = valid.gather(1, picked)
    anchors = torch.where(keep, picked, torch.zeros_like(picked))
    order = torch.where(keep, anchors, s).argsort(1)  # real anchors ascending, padding last
    return anchors.gather(1, order), keep.gather(1, order)


def block_mask(
    sees: torch.Tensor | None, a: int, k_size: int, b: int, s: int, device: torch.device
) -> torch.Tensor | None:
    """(B, 1, A K, S + A K) bool: block slots see their block's context positions (``sees``, (B, A, S); None:
    all) and their own block's slots, no other block's. None where everything is visible (one block, no sees)."""
    if sees is None and a == 1:
        return None
    to_context = torch.ones(b, a, s, dtype=torch.bool, device=device) if sees is None else sees
    own = torch.eye(a, dtype=torch.bool, device=device).repeat_interleave(k_size, 0).repeat_interleave(k_size, 1)
    return torch.cat([to_context.repeat_interleave(k_size, 1), own.expand(b, -1, -1)], dim=2)[:, None]


def context_visibility(anchors: torch.Tensor, keep: torch.Tensor, context: int) -> torch.Tensor:
    """(B, A, S) bool: the block at an anchor sees the context positions before it (a padding block: none)."""
    return (torch.arange(context, device=anchors.device) < anchors[..., None]) & keep[..., None]


class DFlashDrafter:
    """The `BatchDrafter` of a DFlash head: every row's context catch-up and block in one forward a step."""

    def __init__(self, head: DFlashHead, target: Target) -> None:
        self.head = head  # not put in eval mode here: the trainer's evaluator may share the module
        self.hidden_layers = head.hidden_layers
        self.device = target.device
        self.max_len = target.max_context + TREE_SLOTS
        self.target = target  # whose ``capture`` says whether the blocks over a pool's rows are captured
        self.pool_blocks: DFlashBlocks | None = None  # the last pool's (its graphs hold that pool's addresses)

    def new_rows(self, rows: int, max_len: int) -> BatchedKVCache:
        return self.head.new_rows(rows, max_len)

    @property
    def draft_graphs(self) -> GraphSet | None:
        """The graphs of the captured blocks over the last pool (None: none captured there), for reports."""
        return None if self.pool_blocks is None else self.pool_blocks.graphs

    def blocks(self, rows: BatchedKVCache | None) -> DFlashBlocks | None:
        """The blocks over ``rows`` at static shapes, captured, where the target captures (None: eager, at the round's
        own shapes; always for a lone row's own cache or a rope whose frequencies follow the positions)."""
        if rows is None or not self.target.capture or self.head.rotary.rope_type in DYNAMIC_ROPE:
            return None
        kept = self.pool_blocks
        if kept is None or kept.pool is not rows or kept.head is not self.head:
            self.pool_blocks = DFlashBlocks(self.head, rows)
        return self.pool_blocks

    def draft_slots(self, policy: TreePolicy) -> int:
        """0: a row's cache holds the context of its committed tokens alone, each row's catch-up written into its own
        row; the block's keys and values are never cached."""
        return 0

    @torch.inference_mode()
    def start(
        self, prompt_ids: torch.Tensor, hidden: dict[int, torch.Tensor], cache: StaticKVCache | None = None
    ) -> DFlashDraftState:
        return DFlashDraftState(self, cache if cache is not None else self.head.new_cache(self.max_len), hidden)

    @torch.inference_mode()
    def propose_batch(self, requests: Sequence[DraftRequest], rows: BatchedKVCache | None = None) -> list[Tree]:
        if rows is None and len(requests) != 1:
            raise ValueError(f"{len(requests)} requests need the batched cache whose rows their states' caches are")
        return grow_by_depth(requests, self.block_logp(requests, rows))  # slot d drafts depth d, whatever the parent

    @torch.inference_mode()
    def block_logp(self, requests: Sequence[DraftRequest], rows: BatchedKVCache | None) -> torch.Tensor:
        """(B, D, V) draft log-probs of depths 1..D for every request: each row's context catch-up, then every
        row's block in one forward. D is the deepest any request drafts (at most K - 1): the whole block runs,
        as trained, but only the slots a tree can use go through the lm_head, most of a draft's cost for a
        large vocabulary (SmolLM2's 49K rows a slot)."""
        head = self.head
        depth = min(head.block_size - 1, max(min(r.max_depth, r.policy.max_depth) for r in requests))
        states, captured = [r.state for r in requests], self.blocks(rows)
        order = None if rows is None else [r.row for r in requests]  # each request's pool row
        if captured is not None:  # every pool row up to a power of two, in row order; rows without a request pad
            batch = captured.batch(max(order) + 1)
            lengths, by_row, rows_at = self._catch_up(states, rows, order, batch)
            self._hold_blocks(states)
            roots, in_order = root_tokens(requests, self.device), order == list(range(batch))
            if not in_order:
                roots = roots.new_zeros(batch).index_copy_(0, rows_at, roots)
            logp = captured(roots, by_row, max(lengths), depth)  # (B, D, V)
            return logp if in_order else logp.index_select(0, rows_at)
        lengths, lengths_at, _ = self._catch_up(states, rows, order)  # the root sits at context position `length`
        self._hold_blocks(states)
        width = max(lengths)
        context = [self._context(states, requests, rows, layer, width) for layer in range(len(head.layers))]
        return block_logp(head, root_tokens(requests, self.device), lengths_at, context, depth, min(lengths) != width)

    def adopt(self, other: DFlashDrafter) -> None:
        """Draft with ``other``'s head from now on: a new version of this one's (same config, so the same block, mask
        token and target layers), loaded beforehand (`load_drafter`). One assignment, so a caller between steps swaps
        the whole head at once.

        Running generations keep their states: their draft caches (and a scheduler's rows from `new_rows`, whose
        shapes the new head shares) hold the context keys and values the previous head projected for the tokens
        before the swap, which the new head attends to as its own; what they commit from then on the new head
        projects. Their drafts may be weaker until they end, never wrong: verification decides every token.

        Raises:
            ValueError: a head of another type or shape (naming the fields), or one that reads other target layers.
        """
        from specgraft.heads.loading import check_new_version

        if not isinstance(other, DFlashDrafter):
            raise ValueError(f"a DFlash drafter cannot adopt a {type(other).__name__}")
        check_new_version(self.head, other.head)
        self.head = other.head

    def _hold_blocks(self, states: list[DFlashDraftState]) -> None:
        """Each state's peak: its context after the catch-up and its block (`cache_tokens`, which stats report)."""
        for state in states:
            state.peak = len(state.cache) + self.head.block_size  # the block's keys and values, held for the forward

    def _catch_up(
        self, states: list[DFlashDraftState], pool: BatchedKVCache | None = None, rows: list[int] | None = None,
        batch: int = 0,
    ) -> tuple[list[int], torch.Tensor, torch.Tensor | None]:
        """Project the committed states no cache holds yet into every layer's context keys and values: over a pool
        (the states' caches its ``rows``), every row's in one write a layer; else the one state's own cache.

        Returns the states' context lengths after it, as a list and as a tensor staged in the same copy as the
        catch-up's positions: (R,), or with ``batch``, (batch,) by pool row (0: a row without a state) and the (R,)
        rows beside it (else None).
        """
        waiting = [(i, s.pending) for i, s in enumerate(states) if s.pending]
        for i, _ in waiting:
            states[i].pending = []
        sizes = [sum(h[self.hidden_layers[0]].shape[0] for h in parts) for _, parts in waiting]
        starts = [states[i].cache.extend(1, n) for (i, _), n in zip(waiting, sizes)]  # context position j: slot j
        lengths = [len(s.cache) for s in states]
        at = lengths
        if batch:
            at = [0] * batch
            for row, length in zip(rows, lengths):
                at[row] = length
        token_rows = [rows[i] for (i, _), n in zip(waiting, sizes) for _ in range(n)] if pool is not None else []
        positions, lengths_at, token_rows, rows_at = staged(
            self.device, [j for start, n in zip(starts, sizes) for j in range(start, start + n)], at, token_rows,
            rows if batch else [])
        rows_at = rows_at if batch else None
        if not waiting:
            return lengths, lengths_at, rows_at
        head = self.head
        # Every row's waiting commits joined in one copy a layer (not a join a row, then one of the rows).
        joined = {i: torch.cat([h[i] for _, parts in waiting for h in parts]).to(self.device) for i in self.hidden_layers}
        context = head.fuse(joined)[None]  # (1, N, H): every row's new positions, concatenated
        cos, sin = head.rope(context, positions[None])
        for layer in range(len(head.layers)):
            keys, values = head.context_kv(layer, context, cos, sin)  # (1, Hkv, N, D)
            if pool is not None:  # position j of a row sits at its slot j
                pool.write_packed(layer, token_rows, positions, keys[0].transpose(0, 1), values[0].transpose(0, 1))
            else:
                states[waiting[0][0]].cache.update(layer, starts[0], keys, values)
        return lengths, lengths_at, rows_at

    @staticmethod
    def _context(states, requests, rows: BatchedKVCache | None, layer: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s cached context keys and values of every request's row, (B, Hkv, W, D), padded to W."""
        if rows is None:
            return states[0].cache.layer_kv(layer)
        index = [r.row for r in requests]
        if index == list(range(index[0], index[0] + len(index))):  # consecutive rows: views, no copy
            kv = rows.kv[layer, :, index[0] : index[-1] + 1, :, :width]  # (2, B, Hkv, W, D)
            return kv[0], kv[1]
        index = torch.tensor(index, device=rows.kv.device)
        return rows.kv[layer, 0, :, :, :width].index_select(0, index), rows.kv[layer, 1, :, :, :width].index_select(0, index)


def block_logp(
    head: DFlashHead, roots: torch.Tensor, lengths: torch.Tensor, context: list[tuple[torch.Tensor, torch.Tensor]],
    depth: int, padded: bool,
) -> torch.Tensor:
    """(B,) root tokens, each row's (B,) context length and every layer's (B, Hkv, W, D) context keys and values ->
    (B, depth, V) draft log-probs of slots 1..depth of each row's block (the root, then mask tokens, at positions
    length, length + 1, ...). ``padded``: rows hold fewer than W positions, so each sees only its own."""
    k_size, device = head.block_size, roots.device
    blocks = torch.full((roots.shape[0], k_size), head.config.mask_token_id, dtype=torch.long, device=device)
    blocks[:, 0] = roots
    x = head.embed(blocks)[:, None]  # (B, 1, K, H): one block a row
    cos, sin = head.rope(x[:, 0], lengths[:, None] + torch.arange(k_size, device=device))
    sees = (torch.arange(context[0][0].shape[2], device=device) < lengths[:, None])[:, None] if padded else None
    out = head.run_block(x, cos[:, None], sin[:, None], context, sees)[:, 0]  # (B, K, H)
    return head.logits(out[:, 1 : depth + 1]).float().log_softmax(-1)  # slot k drafts depth k


class DFlashBlocks:
    """`block_logp` over a draft pool's first B rows and W context slots, at static shapes: B a power of two (a
    round pads its rows to it), W a bucket of `SLOT_BUCKET`; one graph per (B, W, depth), captured on its first
    call where a recorder captures (CUDA graphs on CUDA). Why: once the target's forward replays as one graph, a
    DFlash step's block (its embedding, every layer, the lm_head over the drafted slots) is most of what it
    launches; the catch-up, whose size varies with what each row committed, stays eager.

    Raises:
        ValueError: a rope whose frequencies follow each forward's positions.
    """

    def __init__(
        self, head: DFlashHead, pool: BatchedKVCache, recorder: CudaGraphs | Recomputed | None = None,
        most_graphs: int = MOST_GRAPHS,
    ) -> None:
        if head.rotary.rope_type in DYNAMIC_ROPE:
            raise ValueError(f"rope type {head.rotary.rope_type!r} computes its frequencies from each forward's "
                             "positions; a captured block runs at fixed shapes")
        self.head, self.pool = head, pool
        self.graphs = GraphSet(default_recorder(pool.kv.device) if recorder is None else recorder, most_graphs)

    def batch(self, rows: int) -> int:
        """The pool rows a round over rows 0..rows-1 runs: a power of two of them, at most the pool's."""
        return min(self.pool.rows, bucket(rows))

    def __call__(self, roots: torch.Tensor, lengths: torch.Tensor, longest: int, depth: int) -> torch.Tensor:
        """(B,) each pool row's root and context length (0: a row that pads), the longest -> (B, depth, V)."""
        b, width = roots.shape[0], slot_bucket(longest, self.pool.max_len)
        kv = self.pool.kv

        def run(index: torch.Tensor) -> torch.Tensor:
            roots, lengths = index.view(2, b)
            context = [(kv[layer, 0, :b, :, :width], kv[layer, 1, :b, :, :width]) for layer in range(kv.shape[0])]
            return block_logp(self.head, roots, lengths, context, depth, padded=True)

        return self.graphs((b, width, depth), run, torch.cat([roots, lengths]))


class DFlashDraftState:
    """One generation's DFlash state: its draft cache of context keys and values, and committed states not in it yet."""

    def __init__(self, drafter: DFlashDrafter, cache: StaticKVCache, hidden: dict[int, torch.Tensor]) -> None:
        self.drafter = drafter
        self.cache = cache  # context position j in slot j
        self.peak = 0
        # The prompt's states wait, like any commit, for the next draft: a row never let draft never projects them.
        self.pending: list[dict[int, torch.Tensor]] = [{i: hidden[i] for i in drafter.hidden_layers}]

    def commit(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], path: torch.Tensor | None = None) -> None:
        self.pending.append({i: hidden[i] for i in self.drafter.hidden_layers})
        if len(self.pending) >= PENDING_COMMITS:  # views keep their steps' outputs alive: join them into one
            self.pending = [self.take_pending()]

    def take_pending(self) -> dict[int, torch.Tensor] | None:
        """The committed states not yet in the cache, joined (layer -> (n, H)), and none left; None when none."""
        if not self.pending:
            return None
        joined = {i: torch.cat([h[i] for h in self.pending]) for i in self.drafter.hidden_layers}
        self.pending = []
        return joined

    def cache_tokens(self) -> int:
        return self.peak

    def propose(self, root_token: int, policy: TreePolicy, max_depth: int, sampling: Sampling | None = None) -> Tree:
        if max_depth < 1:
            return Tree.root_only(root_token, self.drafter.device)
        return self.drafter.propose_batch([DraftRequest(self, root_token, policy, max_depth, sampling)])[0]
