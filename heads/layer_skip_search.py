"""Which layers should `LayerSkip` leave out? A greedy search on calibration prompts (Draft&Verify, SWIFT).

1. The target writes its own greedy continuation of each calibration prompt:
   the tokens a draft must guess while the target decodes greedily.
2. Greedy growth: starting from no skipped layer, each round tries every
   remaining layer, scores the draft's top-1 agreement with the target on
   those continuations (teacher-forced: one forward over all the sequences
   packed together), and skips the layer whose loss hurts agreement least.
   A round reuses the residual stream of the set it grows from up to each
   candidate's layer, so a candidate costs only the layers after it; after
   the first round only the ``shortlist`` layers that scored best in the
   previous round are tried again (a layer that hurt then rarely helps later).
3. Every set on that path gets an expected speed-up for chains of depth
   1..``max_depth``, from its agreement ``a`` and its draft cost ``c`` (one
   draft forward over one target forward, counted in weights read: decoding a
   token on CPU reads every weight once), treating tokens as independent:

       speed-up = (1 + a + ... + a^depth) / (depth * c + verify_cost)

   ``verify_cost`` is a verification forward of depth + 1 tokens in target
   forwards (about 1.0 for up to 4 tokens on the fast path's CPU kernels).
   The best skipped set by that estimate is the answer (even when no set is
   expected to beat plain decoding: the estimate says so); the whole path is reported.

Everything is deterministic: argmax and ties go to the lowest index.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from specgraft.specs import LayerSkipSpec
from specgraft.model import Target
from specgraft.model.fast_llama import FastLlama, rms_norm


@dataclass(frozen=True)
class SkipCandidate:
    """One skipped set on the search path, scored."""

    skip: tuple[int, ...]
    agreement: float  # draft top-1 == the target's greedy token, over the calibration continuations
    draft_cost: float  # one draft forward / one target forward, in weights read
    depth: int  # chain depth with the best expected speed-up
    expected_tokens: float  # tau of that chain if each draft token agrees independently with probability `agreement`
    expected_speedup: float  # against plain decoding, by the module's formula

    @property
    def spec(self) -> str:
        """The --drafter value that builds this drafter, e.g. ``layer-skip:12-19``."""
        return str(LayerSkipSpec(tuple(self.skip)))


@dataclass
class LayerSkipSearch:
    """The search's answer (``best``) and the greedy path it was chosen from (one more layer per entry)."""

    best: SkipCandidate
    path: list[SkipCandidate] = field(default_factory=list)
    positions: int = 0  # calibration tokens scored per candidate


def search_layer_skip(
    target: Target,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 32,
    max_skip: int | None = None,
    min_agreement: float = 0.3,
    candidates: Sequence[int] | None = None,
    max_depth: int = 3,
    verify_cost: float = 1.0,
    shortlist: int | None = 8,
) -> LayerSkipSearch:
    """Choose the layers to skip on ``prompts`` (token ids) by greedy growth; see the module doc.

    Args:
        target: a target on the fast path.
        prompts: calibration prompts as token ids (chat-templated if the target chats).
        max_new_tokens: tokens of the target's greedy continuation scored per prompt.
        max_skip: most layers skipped (default: half the layers).
        min_agreement: stop growing once the best candidate's agreement falls below this.
        candidates: layers the search may skip (default: all).
        max_depth: deepest chain the speed-up estimate considers.
        verify_cost: target forwards one verification of up to ``max_depth`` + 1 tokens costs.
        shortlist: layers tried per round after the first (None: every remaining layer, every round).

    Raises:
        ValueError: no fast path, no prompts, or bad ``candidates``.
    """
    fast = target.fast
    if fast is None:
        raise ValueError(f"search_layer_skip needs the fast path (FastLlama), which target {target.name!r} does not run")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("search_layer_skip needs at least one non-empty calibration prompt")
    n = fast.num_layers
    pool = list(range(n)) if candidates is None else sorted(candidates)
    if any(isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < n for c in pool) or len(set(pool)) < len(pool):
        raise ValueError(f"candidates={list(candidates)}: need distinct layer indices of the target's {n} layers (0..{n - 1})")
    if shortlist is not None and shortlist < 1:
        raise ValueError(f"shortlist={shortlist} must be >= 1 (or None: try every layer each round)")
    max_skip = min(n // 2 if max_skip is None else max_skip, len(pool), n - 1)
    eos = set(target.eos_token_ids)

    sequences = [list(p) + _greedy_continuation(fast, list(p), max_new_tokens, eos) for p in prompts]
    batch = _Packed.of(sequences, [len(p) for p in prompts], target.device)
    sizes = _layer_sizes(fast)
    head = fast.lm_head.numel()

    def scored(skip: tuple[int, ...], agreement: float) -> SkipCandidate:
        cost = (sum(s for i, s in enumerate(sizes) if i not in skip) + head) / (sum(sizes) + head)
        options = []
        for depth in range(1, max_depth + 1):
            tokens = sum(agreement**i for i in range(depth + 1))
            options.append((tokens / (depth * cost + verify_cost), -depth, tokens))
        speedup, neg_depth, tokens = max(options)
        return SkipCandidate(skip, agreement, cost, -neg_depth, tokens, speedup)

    with torch.inference_mode():
        skip: tuple[int, ...] = ()
        path = [scored(skip, batch.agreement(fast, batch.inputs(fast, skip)[n]))]
        while len(skip) < max_skip:
            inputs = batch.inputs(fast, skip)  # layer -> its input under `skip`; n -> the output
            tried = {}
            for layer in pool:
                rest = [i for i in range(layer + 1, n) if i not in skip]
                tried[layer] = batch.agreement(fast, _run(fast, inputs[layer], rest, batch))
            if not tried:
                break
            ranked = sorted(tried, key=lambda layer: (-tried[layer], layer))  # best first; ties: the lower layer
            skip = tuple(sorted(skip + (ranked[0],)))
            path.append(scored(skip, tried[ranked[0]]))
            if tried[ranked[0]] < min_agreement:
                break
            pool = sorted(ranked[1 : 1 + shortlist] if shortlist else ranked[1:])
    # Skipping nothing is on the path as the reference (agreement 1.0 at the cost of a whole forward), never the answer.
    best = max(path[1:] or path, key=lambda c: c.expected_speedup)
    return LayerSkipSearch(best=best, path=path, positions=batch.scored.numel())


def _greedy_continuation(fast: FastLlama, ids: list[int], count: int, eos: set[int]) -> list[int]:
    """The target's own greedy tokens after ``ids`` (up to ``count``, through an end-of-sequence token)."""
    cache = fast.new_cache(max_len=len(ids) + count)
    device = fast.embed.device
    logits, _ = fast.forward(torch.tensor([ids], device=device), cache, torch.arange(len(ids), device=device)[None], last_only=True)
    out: list[int] = []
    while len(out) < count:
        token = int(logits[0, -1].argmax())
        out.append(token)
        if token in eos or len(out) == count:
            break
        position = torch.tensor([[len(ids) + len(out) - 1]], device=device)
        logits, _ = fast.forward(torch.tensor([[token]], device=device), cache, position)
    return out


@dataclass
class _Packed:
    """Calibration sequences packed into one row: a block-diagonal causal mask keeps them apart.

    tokens, positions: (1, T); mask: (T, T) bool, True = visible; scored: (P,) rows whose
    next token is a continuation token; labels: (P,) those tokens.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    scored: torch.Tensor
    labels: torch.Tensor

    @classmethod
    def of(cls, sequences: list[list[int]], prompt_lengths: list[int], device) -> _Packed:
        total = sum(map(len, sequences))
        mask = torch.zeros(total, total, dtype=torch.bool)
        tokens, positions, scored, labels, start = [], [], [], [], 0
        for seq, prompt in zip(sequences, prompt_lengths):
            size = len(seq)
            mask[start : start + size, start : start + size] = torch.ones(size, size, dtype=torch.bool).tril()
            tokens += seq
            positions += range(size)
            scored += range(start + prompt - 1, start + size - 1)  # row t predicts token t + 1
            labels += seq[prompt:]
            start += size
        as_tensor = lambda values: torch.tensor(values, device=device)  # noqa: E731
        return cls(as_tensor([tokens]), as_tensor([positions]), mask.to(device), as_tensor(scored), as_tensor(labels))

    def inputs(self, fast: FastLlama, skip: tuple[int, ...]) -> dict[int, torch.Tensor]:
        """Each layer's input under ``skip`` (a skipped layer's is the next kept one's), and index n -> the output."""
        kept = [i for i in range(fast.num_layers) if i not in skip]
        states: dict[int, torch.Tensor] = {}
        x = fast.embed[self.tokens]  # (1, T, H)
        sub = fast.subset(kept)
        out = sub.run_layers(x, sub.new_cache(self.tokens.shape[1]), self.positions, self.mask, set(range(len(kept))), states)
        by_layer = {layer: states[j] for j, layer in enumerate(kept)}
        by_layer[fast.num_layers] = out
        for layer in range(fast.num_layers - 1, -1, -1):
            by_layer.setdefault(layer, by_layer[layer + 1])
        return by_layer

    def agreement(self, fast: FastLlama, out: torch.Tensor) -> float:
        """Fraction of scored rows where the final (1, T, H) states' top-1 is the target's token."""
        h = rms_norm(out[0, self.scored], fast.final_norm, fast.eps)  # (P, H)
        logits = fast.linear(h, fast.lm_head, fast.lm_head_bias)  # (P, V)
        return float((logits.argmax(-1) == self.labels).float().mean())


def _run(fast: FastLlama, x: torch.Tensor, layers: list[int], batch: _Packed) -> torch.Tensor:
    """Decoder ``layers`` over (1, T, H) inputs ``x``, fresh attention over the packed sequences."""
    if not layers:
        return x
    sub = fast.subset(layers)
    return sub.run_layers(x, sub.new_cache(x.shape[1]), batch.positions, batch.mask)


def _layer_sizes(fast: FastLlama) -> list[int]:
    """Weights one decoder layer reads per token (its projections), per layer."""
    return [sum(w.numel() for w in (l.q, l.k, l.v, l.o, l.gate, l.up, l.down)) for l in fast.layers]  # noqa: E741
