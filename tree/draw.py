"""How a policy picks a node's children from the drafter's distribution.

- ``top-k``: the k most likely tokens, deterministically. Verification treats
  them as point masses, so any drafter distribution stays exact.
- ``sample``: k independent draws from q (SpecInfer's multi-round rule).
- ``sample-without-replacement``: k distinct draws (Sequoia's variant: q
  loses each rejected token during verification).

Under greedy decoding there is no sampler and every draw is top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

DRAWS = ("top-k", "sample", "sample-without-replacement")


class DraftSampler(Protocol):
    """Turns draft log-probs into the distribution q actually sampled (same filters as the target's p)."""

    generator: torch.Generator

    def probs(self, logits: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Picked:
    """tokens, logq: (F, k) chosen children and their draft log-probs. q: (F, V) or None for top-k."""

    tokens: torch.Tensor
    logq: torch.Tensor
    q: torch.Tensor | None


def check_draw(draw: str) -> str:
    if draw not in DRAWS:
        raise ValueError(f"draw={draw!r} is not one of {', '.join(DRAWS)}")
    return draw


def pick_children(logp: torch.Tensor, k: int, draw: str, sampler: DraftSampler | None) -> Picked:
    """Choose k children for each of F frontier nodes from (F, V) draft log-probs."""
    if sampler is None or draw == "top-k":
        top_logp, top_tok = logp.topk(k, dim=-1)
        return Picked(top_tok, top_logp, None)
    q = sampler.probs(logp)  # (F, V), filters applied as for the target
    support = int((q > 0).sum(dim=-1).min())
    replacement = draw == "sample"
    if not replacement and k > support:
        k = support  # fewer distinct tokens than asked for: draw them all
    tokens = torch.multinomial(q, k, replacement=replacement, generator=sampler.generator)  # (F, k)
    return Picked(tokens, q.gather(-1, tokens).log(), q)
