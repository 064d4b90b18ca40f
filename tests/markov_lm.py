"""A tiny exactly-enumerable language model that honours caches, positions and 4D masks.

Its next-token logits are a fixed random table indexed by the last two tokens
a query can see. Visibility comes from the additive attention mask (or causal
order without one) over the tokens in the KV cache, so tree attention, KV
commits and rollbacks matter exactly as they do for a transformer, while the
distribution of any continuation can be written down in closed form.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import torch
from torch import nn
from transformers import DynamicCache

from specgraft.model import Target, installed_cache_keyword

START = -1  # context slot for "no token here yet"


class MarkovLM(nn.Module):
    def __init__(self, vocab_size: int = 6, seed: int = 0, sharpness: float = 1.5) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        # (V + 1, V + 1, V): previous-but-one token, previous token -> logits; index V stands for START.
        self.table = torch.randn(vocab_size + 1, vocab_size + 1, vocab_size, generator=gen) * sharpness
        self.lm_head = nn.Linear(1, vocab_size, bias=False)  # only so that Target can read V, device, dtype
        self.config = SimpleNamespace(
            num_hidden_layers=1, vocab_size=vocab_size, max_position_embeddings=4096, eos_token_id=None,
            is_encoder_decoder=False, _attn_implementation="sdpa", _name_or_path=f"markov-{seed}",
        )
        self.generation_config = None

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def next_logits(self, context: list[int]) -> torch.Tensor:
        v = self.table.shape[-1]
        a = context[-2] if len(context) >= 2 else v
        b = context[-1] if context else v
        return self.table[a, b]

    def forward(self, input_ids, position_ids, attention_mask=None, **kwargs) -> SimpleNamespace:
        # The cache comes under the keyword the installed transformers' own models take, and no other:
        # a double that took any name would hide a caller passing one real models swallow and ignore.
        keyword = installed_cache_keyword()
        if keyword not in kwargs:
            raise TypeError(
                f"MarkovLM.forward takes its cache as {keyword}=, as this transformers' models do; got {list(kwargs)}"
            )
        cache: DynamicCache = kwargs[keyword]
        t = input_ids.shape[1]
        keys = input_ids[:, None, :, None].float()  # (1, 1, T, 1): the token itself
        values = position_ids[:, None, :, None].float()  # (1, 1, T, 1): its position
        tokens, positions = cache.update(keys, values, 0)
        tokens, positions = tokens[0, 0, :, 0].long(), positions[0, 0, :, 0]  # (K,)
        k = tokens.shape[0]
        if attention_mask is None:
            visible = torch.arange(k)[None] <= torch.arange(k - t, k)[:, None]  # (T, K) causal
        else:
            visible = attention_mask[0, 0] == 0
        # The two latest visible tokens by position; a missing one reads as START (index V).
        v = self.table.shape[-1]
        ranked = torch.where(visible, positions[None], -1.0).topk(min(2, k), dim=-1)  # (T, <=2)
        latest = torch.where(ranked.values >= 0, tokens[ranked.indices], v)
        if latest.shape[1] == 1:
            latest = torch.cat([latest, torch.full_like(latest, v)], dim=1)
        return SimpleNamespace(logits=self.table[latest[:, 1], latest[:, 0]][None], hidden_states=None)


def markov_target(vocab_size: int = 6, seed: int = 0, sharpness: float = 1.5) -> Target:
    return Target(MarkovLM(vocab_size, seed, sharpness))


def exact_distribution(model: MarkovLM, prompt: list[int], length: int, probs) -> dict[tuple[int, ...], float]:
    """P(x_1..x_L | prompt) for every sequence, with ``probs`` turning logits into the sampled distribution."""
    v = model.table.shape[-1]
    dist = {}
    for seq in itertools.product(range(v), repeat=length):
        p, context = 1.0, list(prompt)
        for x in seq:
            p *= float(probs(model.next_logits(context))[x])
            context.append(x)
        if p > 0:
            dist[seq] = p
    return dist
