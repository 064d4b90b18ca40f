"""Medusa-1 heads: K small heads on the target's last hidden state.

Head k reads the hidden state at position t (after the target's final norm,
HF ``hidden_states[-1]``) and predicts the token at t + 2 + k: position t + 1
is the target's own next token, the root of the tree. Every head is a stack
of residual blocks ``x + SiLU(W x + b)`` with W zero-initialised (so a fresh
head starts as the target's own lm_head) and its own vocabulary projection
copied from the target's lm_head. Each head owns separate blocks (the
reference code shares one block object between layers by mistake).

Weight names follow vLLM's Medusa: ``blocks.{h}.layers.{l}.weight/bias``,
``lm_heads.{h}.weight``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from typing import Sequence

from specgraft.heads.base import DraftRequest, TrainBatch, grow_by_depth
from specgraft.heads.configs import MedusaConfig
from specgraft.model import BatchedKVCache, Target
from specgraft.model.captured import GraphSet, bucket, default_recorder
from specgraft.tree import Sampling, Tree, TreePolicy


class MedusaBlock(nn.Module):
    """``num_layers`` residual SiLU layers; zero weights make it the identity at start."""

    def __init__(self, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers))
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    """K heads over the target's final hidden state. forward: (..., H) -> (K, ..., V) logits."""

    def __init__(self, config: MedusaConfig, hidden_size: int, vocab_size: int, num_target_layers: int) -> None:
        super().__init__()
        self.config = config
        self.hidden_layers = (num_target_layers,)  # HF hidden_states[-1]: after the final norm
        self.blocks = nn.ModuleList(MedusaBlock(hidden_size, config.num_layers) for _ in range(config.num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(config.num_heads))

    @classmethod
    def for_target(cls, config: MedusaConfig, target: Target) -> MedusaHeads:
        """Fresh heads whose projections start as copies of the target's lm_head."""
        heads = cls(config, target.config.hidden_size, target.vocab_size, target.num_layers)
        weight = target.model.get_output_embeddings().weight.detach()
        for lm_head in heads.lm_heads:
            lm_head.weight.data.copy_(weight.float())
        return heads.to(target.device)

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """(..., H) -> (K', ..., V) logits of the first ``num_heads`` heads (None: all K).

        Each head reads its own V x H projection, the size of the target's lm_head: a step that drafts
        to depth d runs only the first d heads.
        """
        pairs = list(zip(self.blocks, self.lm_heads))[:num_heads]
        return torch.stack([lm(block(hidden)) for block, lm in pairs])

    def loss(self, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Cross-entropy of head k against the token 2 + k ahead, weighted loss_decay ** k."""
        hidden = batch.hidden[self.hidden_layers[0]].float()  # (B, T, H)
        logits = self(hidden)  # (K, B, T, V)
        total = hidden.new_zeros(())
        metrics = {}
        for k in range(self.config.num_heads):
            shift = 2 + k
            if shift >= hidden.shape[1]:
                break
            pred = logits[k, :, :-shift]  # (B, T - shift, V)
            labels = batch.input_ids[:, shift:]
            mask = batch.loss_mask[:, shift:].float()
            ce = F.cross_entropy(pred.transpose(1, 2), labels, reduction="none")  # (B, T - shift)
            denom = mask.sum().clamp(min=1.0)
            total = total + self.config.loss_decay**k * (ce * mask).sum() / denom
            metrics[f"head{k}_top1"] = float(((pred.argmax(-1) == labels).float() * mask).sum() / denom)
        metrics["loss"] = float(total.detach())
        return total, metrics


class MedusaDrafter:
    """Drafts with Medusa heads: depth d's distribution is head d - 1's, whatever the parent.

    A `BatchDrafter`: the heads run once per step for all rows, on their stacked hidden states. Where the target
    captures, so do the heads: one graph per power of two of rows and heads drafted (`heads_logp`).
    """

    def __init__(self, heads: MedusaHeads, target: Target) -> None:
        self.heads = heads  # not put in eval mode here: the trainer's evaluator may share the module
        self.hidden_layers = heads.hidden_layers
        self.target = target  # whose ``capture`` says whether the heads' forward is captured
        self.graphs: GraphSet | None = None  # the captured forwards of these heads (`adopt` drops them)

    @property
    def draft_graphs(self) -> GraphSet | None:
        """The graphs of the heads' captured forwards (None: none captured), for reports."""
        return self.graphs

    def new_rows(self, rows: int, max_len: int) -> None:
        return None  # no draft cache: a state is the target's last hidden state

    def draft_slots(self, policy: TreePolicy) -> int:
        return 0  # (no draft cache)

    def start(self, prompt_ids: torch.Tensor, hidden: dict[int, torch.Tensor], cache: None = None) -> MedusaDraftState:
        return MedusaDraftState(self, hidden[self.hidden_layers[0]][-1])

    @torch.inference_mode()
    def propose_batch(self, requests: Sequence[DraftRequest], rows: BatchedKVCache | None = None) -> list[Tree]:
        depths = [min(r.max_depth, r.policy.max_depth, self.heads.config.num_heads) for r in requests]
        logp = self.heads_logp([request.state.last_hidden for request in requests], max(depths))  # (K', B, V)
        return grow_by_depth(requests, logp.transpose(0, 1))  # policies cap a request's depth at their own

    def heads_logp(self, hidden: list[torch.Tensor], num_heads: int) -> torch.Tensor:
        """(num_heads, B, V) draft log-probs from B rows' (H,) hidden states: head k drafts depth k + 1. Where the
        target captures, the rows are padded to a power of two (copies of the first, whose outputs are dropped) and the forward replays a graph of
        that size, so a captured step launches the heads as one graph, as it does its target."""
        dtype = next(self.heads.parameters()).dtype  # the target's, as loaded; float32 while training

        def run(states: torch.Tensor) -> torch.Tensor:
            return self.heads(states.to(dtype), num_heads=num_heads).float().log_softmax(-1)

        if not self.target.capture:
            return run(torch.stack(hidden))
        if self.graphs is None:
            self.graphs = GraphSet(default_recorder(hidden[0].device))
        rows = len(hidden)
        states = torch.stack(hidden + hidden[:1] * (bucket(rows) - rows))  # padding rows repeat the first: no fill
        return self.graphs((states.shape[0], num_heads, states.dtype), run, states)[:, :rows]

    def adopt(self, other: MedusaDrafter) -> None:
        """Draft with ``other``'s heads from now on: a new version of these (same config and target layer), loaded
        beforehand (`load_drafter`). One assignment, so a caller between steps swaps all K heads at once.

        Running generations keep their states: a state holds only the target's hidden state and this drafter (never
        the heads), so its next draft runs the new heads.

        Raises:
            ValueError: heads of another type or shape (naming the fields), or ones that read another target layer.
        """
        from specgraft.heads.loading import check_new_version

        if not isinstance(other, MedusaDrafter):
            raise ValueError(f"a Medusa drafter cannot adopt a {type(other).__name__}")
        check_new_version(self.heads, other.heads)
        self.heads, self.graphs = other.heads, None  # graphs read the weights they were captured over


class MedusaDraftState:
    """One generation's Medusa state: the target's hidden state at its last cached token."""

    def __init__(self, drafter: MedusaDrafter, last_hidden: torch.Tensor) -> None:
        self.drafter = drafter
        self.last_hidden = last_hidden  # (H,)

    def commit(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], path: torch.Tensor | None = None) -> None:
        self.last_hidden = hidden[self.drafter.hidden_layers[0]][-1]

    def cache_tokens(self) -> int:
        return 0

    def propose(
        self, root_token: int, policy: TreePolicy, max_depth: int, sampling: Sampling | None = None
    ) -> Tree:
        if max_depth < 1:
            return Tree.root_only(root_token, self.last_hidden.device)
        return self.drafter.propose_batch([DraftRequest(self, root_token, policy, max_depth, sampling)])[0]
