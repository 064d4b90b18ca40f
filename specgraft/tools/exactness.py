"""Statistical check that speculative sampling follows the target's distribution.

With a small top-k, the joint distribution of the next few tokens is
enumerable from the target itself. We sample continuations plainly and
speculatively and compare each sample set to that exact distribution with a
chi-square test and total variation. The same goodness-of-fit code backs the
test suite's proofs of exactness.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import torch

from specgraft.progress import progress_bar

MIN_EXPECTED = 5.0  # chi-square wants about 5 expected counts per bin; rarer outcomes are pooled
DELTA = 1e-3  # chance that an exact sampler exceeds the TV bound
P_VALUE_FLOOR = 1e-3  # chi-square p-values below this fail


@dataclass
class Fit:
    """Goodness of fit of n samples to an exact distribution."""

    p_value: float
    tv: float
    tv_bound: float
    n: int

    @property
    def passed(self) -> bool:
        return self.p_value > P_VALUE_FLOOR and self.tv < self.tv_bound

    def __str__(self) -> str:
        return f"n={self.n} chi2 p={self.p_value:.4g} TV={self.tv:.4f} (bound {self.tv_bound:.4f})"


def tv_bound(probs: Sequence[float], n: int, delta: float = DELTA) -> float:
    """A bound an exact sampler's empirical TV stays under with probability >= 1 - delta.

    E[TV] <= 1/2 sum_i sqrt(p_i (1 - p_i) / n) (Jensen on each |count_i/n - p_i|);
    one sample moves TV by at most 1/n, so McDiarmid adds sqrt(ln(1/delta) / (2n)).
    """
    mean = 0.5 * sum(math.sqrt(p * (1 - p) / n) for p in probs)
    return mean + math.sqrt(math.log(1 / delta) / (2 * n))


def chi2_sf(stat: float, dof: int) -> float:
    """Survival function of the chi-square distribution: Q(dof / 2, stat / 2)."""
    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def fit(samples: Counter, exact: dict[tuple, float]) -> Fit:
    """Chi-square (rare outcomes pooled) and total variation of samples against ``exact``."""
    n = sum(samples.values())
    unexpected = sum(c for s, c in samples.items() if s not in exact)
    tv = 0.5 * (sum(abs(samples.get(s, 0) / n - p) for s, p in exact.items()) + unexpected / n)
    bound = tv_bound(list(exact.values()), n)
    stat, bins, pooled_obs, pooled_exp = 0.0, 0, unexpected, 0.0
    for s, p in exact.items():
        if n * p >= MIN_EXPECTED:
            stat += (samples.get(s, 0) - n * p) ** 2 / (n * p)
            bins += 1
        else:
            pooled_obs += samples.get(s, 0)
            pooled_exp += n * p
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        bins += 1
    elif pooled_obs:  # outcomes of probability zero occurred: certainly not exact
        return Fit(0.0, tv, bound, n)
    return Fit(chi2_sf(stat, bins - 1), tv, bound, n)


def enumerate_continuations(target, prompt_ids: Sequence[int], length: int, sampling) -> dict[tuple[int, ...], float]:
    """Exact P(x_1..x_L | prompt) under ``sampling``'s filters for every continuation with nonzero mass.

    Each prefix costs one target forward, so keep the support small (top-k).
    """
    dist: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, mass in dist.items():
            ids = torch.tensor([list(prompt_ids) + list(prefix)], device=target.device)
            out = target.forward(ids, target.new_cache(), torch.arange(ids.shape[1], device=ids.device)[None], last_only=True)
            probs = sampling.probs(out.logits[0, -1]).double().cpu()
            for token in probs.nonzero().flatten().tolist():
                grown[prefix + (token,)] = mass * float(probs[token])
        dist = grown
    return dist


def rule(tests: int) -> str:
    """What each line's figures test and when one fails, with the chance that an exact sampler fails anyway."""
    per_test = P_VALUE_FLOOR + DELTA  # the chi-square floor or the TV bound, each crossed with at most this chance
    return (
        "Each prompt's continuations are sampled twice and compared with the exact distribution enumerated from "
        "the target: 'plain' is the target sampling alone (a calibration of the test itself: it fails only by "
        "chance, or if the enumeration is wrong), 'speculative' is the drafter and tree under test. A sample set "
        f"fails when its chi-square p-value is at most {P_VALUE_FLOOR:g} or its total variation exceeds the bound an "
        f"exact sampler stays under with probability {1 - DELTA:g}. A p-value above {P_VALUE_FLOOR:g} is a pass, "
        f"however small. By the union bound, an exact sampler fails any of these {tests} tests with probability at "
        f"most {min(1.0, tests * per_test):.3g}."
    )


@dataclass
class PromptReport:
    prompt: str
    outcomes: int  # continuations with nonzero probability
    plain: Fit
    speculative: Fit
    mean_accepted_length: float

    @property
    def passed(self) -> bool:
        return self.plain.passed and self.speculative.passed


def check_exactness(
    generator,
    prompts: Sequence[str | Sequence[int]],
    *,
    samples: int = 2000,
    length: int = 3,
    temperature: float = 1.0,
    top_k: int = 4,
    top_p: float = 1.0,
    seed: int = 0,
) -> list[PromptReport]:
    """Sample ``samples`` continuations of each prompt plainly and speculatively and test both.

    Args:
        generator: a `SpeculativeGenerator` (its target and drafter are checked).
        length: tokens per continuation; top_k ** length outcomes at most.
    """
    from specgraft.infer import SpeculativeGenerator
    from specgraft.tree import Sampling

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for a sampling check, got {temperature}")
    target = generator.target
    plain = SpeculativeGenerator(target, None)
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    options = dict(max_new_tokens=length, temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=())
    torch.manual_seed(seed)
    reports = []
    for prompt in prompts:
        ids = target.encode(prompt) if isinstance(prompt, str) else list(prompt)
        exact = enumerate_continuations(target, ids, length, sampling)
        counts = {"plain": Counter(), "speculative": Counter()}
        taus = []
        for _ in progress_bar(range(samples), desc=f"sampling {str(prompt)[:30]!r}", leave=False):
            counts["plain"][tuple(plain.generate(ids, **options).token_ids)] += 1
            out = generator.generate(ids, **options)
            counts["speculative"][tuple(out.token_ids)] += 1
            taus.append(out.stats.mean_accepted_length)
        reports.append(
            PromptReport(
                prompt=prompt if isinstance(prompt, str) else target.decode(ids),
                outcomes=len(exact),
                plain=fit(counts["plain"], exact),
                speculative=fit(counts["speculative"], exact),
                mean_accepted_length=sum(taus) / len(taus),
            )
        )
    return reports
