"""How a policy picks a node's children from the drafter's distribution.

- ``top-k``: the k most likely tokens, deterministically. Verification treats
  them as point masses, so any drafter distribution stays exact.
- ``sample``: k independent draws from q (SpecInfer's multi-round rule).
- ``sample-without-replacement``: k distinct draws (Sequoia's variant: q
  loses each rejected token during verification).

Under greedy decoding (no `Sampling`, or a greedy one) every draw is top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgraft.tree.sampling import Sampling

DRAWS = ("top-k", "sample", "sample-without-replacement")


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


def pick_children(logp: torch.Tensor, k: int, draw: str, sampling: Sampling | None) -> Picked:
    """Choose k children for each of F frontier nodes from (F, V) draft log-probs."""
    if sampling is None or sampling.greedy or draw == "top-k":
        top_logp, top_tok = logp.topk(k, dim=-1)
        return Picked(top_tok, top_logp, None)
    q = sampling.probs(logp)  # (F, V), filters applied as for the target
    replacement = draw == "sample"
    if not replacement:
        support = int((q > 0).sum(dim=-1).min())  # read only where it matters: drawing without replacement
        k = min(k, support)  # fewer distinct tokens than asked for: draw them all
    tokens = sampling.draw(q, k, replacement=replacement)  # (F, k)
    return Picked(tokens, q.gather(-1, tokens).log(), q)
