"""Exact speculative sampling, proven statistically against enumerated distributions.

The target is a Markov LM over 6 tokens that honours KV caches and 4D masks
(tests/markov_lm.py), so the probability of every 3-token continuation is
known in closed form. Each configuration draws continuations through the
full engine and must fit that distribution (chi-square p > 0.001 and TV
under a bound derived from the sample size). A deliberately wrong rule must
fail the same test. The default run covers every drafter kind, temperature
and filter at least once, at 5,000 draws each (TV bound ~0.04-0.08), and the
acceptance function directly at 20,000 (gapped sibling ranks through
StaticTree); ``-m slow`` runs the same default grid at 20,000 draws (bound
~0.02-0.04; CI runs it) and the full grid.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import specgraft as sg
import specgraft.infer.verify as verify_module
from specgraft.heads.dflash import DFlashDrafter, DFlashDraftState
from specgraft.tree import Sampling
from specgraft.tools.exactness import fit
from specgraft.infer.verify import Acceptance, sample_accept
from markov_lm import exact_distribution, markov_target

VOCAB = 6
LENGTH = 3
SAMPLES = 20_000  # draws through the engine under -m slow
ENGINE_SAMPLES = 5_000  # the default run's draws through the engine: the negative controls fail at TV 0.31 / 0.81 here
PROMPT = [0, 1, 2, 0, 1]  # repeats, so prompt lookup finds n-gram matches to draft from

TARGET = markov_target(VOCAB, seed=0)
DRAFT = markov_target(VOCAB, seed=1)  # a different table: drafts are often rejected


class BlockDraft(DFlashDrafter):
    """DFlash's drafting without its network: one call gives every depth's distribution at once, from the root
    token alone (a random table per block slot), never from the tokens drafted above it. The trees come from
    `DFlashDrafter.propose_batch` itself."""

    def __init__(self, block_size: int = 4, seed: int = 2) -> None:
        self.hidden_layers, self.device = (), torch.device("cpu")
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.randn(block_size - 1, VOCAB, VOCAB, generator=gen) * 1.5  # (slot, root, next)

    def new_rows(self, rows: int, max_len: int) -> None:
        return None

    def start(self, prompt_ids, hidden, cache=None) -> DFlashDraftState:
        return DFlashDraftState(self, cache, hidden)

    def block_logp(self, requests, rows) -> torch.Tensor:
        return torch.stack([self.table[:, r.root_token] for r in requests]).log_softmax(-1)  # (B, K - 1, V)


DRAFTERS = {
    "draft-model sampled chain": lambda: (sg.DraftModel(DRAFT, TARGET), sg.Chain(3, draw="sample")),
    "draft-model top-k tree": lambda: (
        sg.DraftModel(DRAFT, TARGET),
        sg.StaticTree([[0], [1], [2], [0, 0], [0, 1], [1, 0]], draw="top-k"),
    ),
    "draft-model sampled tree (SpecInfer)": lambda: (
        sg.DraftModel(DRAFT, TARGET),
        sg.StaticTree([[0], [1], [2], [0, 0], [0, 1], [1, 0]], draw="sample"),
    ),
    "draft-model sampled tree without replacement (Sequoia)": lambda: (
        sg.DraftModel(DRAFT, TARGET),
        sg.StaticTree([[0], [1], [2], [0, 0], [0, 1], [1, 0]], draw="sample-without-replacement"),
    ),
    "prompt lookup": lambda: (sg.PromptLookup(max_ngram=2, num_tokens=3), None),
    "block drafter sampled chain": lambda: (BlockDraft(), sg.Chain(3, draw="sample")),
    "block drafter top-k tree": lambda: (BlockDraft(), sg.StaticTree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], draw="top-k")),
    # lookup's point masses where the history matches, the draft model's sampled chain elsewhere
    "composite: lookup then draft model": lambda: (
        sg.Composite(sg.PromptLookup(max_ngram=2, min_ngram=2, max_matches=1), sg.DraftModel(DRAFT, TARGET)),
        sg.Chain(3, draw="sample"),
    ),
}
# Sibling ranks with gaps at both depths, for every draw kind (a sampled rank only orders its siblings).
GAPPED = [[1], [3], [1, 0], [1, 2], [3, 1]]
for _draw in ("top-k", "sample", "sample-without-replacement"):
    DRAFTERS[f"draft-model gapped tree, {_draw}"] = lambda draw=_draw: (
        sg.DraftModel(DRAFT, TARGET), sg.StaticTree(GAPPED, draw=draw)
    )
FILTERS = {"no filter": {}, "top-k 3": {"top_k": 3}, "top-p 0.8": {"top_p": 0.8}}
TEMPERATURES = (0.5, 1.0, 1.5)


def sample_continuations(
    drafter_name: str, temperature: float, filters: dict, n: int = SAMPLES, acceptance=sg.sample_accept
) -> Counter:
    drafter, tree = DRAFTERS[drafter_name]()
    gen = sg.SpeculativeGenerator(TARGET, drafter, tree=tree, acceptance=acceptance)
    torch.manual_seed(1234)  # unseeded generations draw their seeds from torch's global RNG
    counts: Counter = Counter()
    for _ in range(n):
        out = gen.generate(PROMPT, max_new_tokens=LENGTH, temperature=temperature, **filters)
        counts[tuple(out.token_ids)] += 1
    return counts


def exact(temperature: float, filters: dict) -> dict:
    return exact_distribution(TARGET.model, PROMPT, LENGTH, Sampling(temperature=temperature, **filters).probs)


# Every drafter, temperature and filter appears at least once in the default run; gapped trees run
# through the engine only under -m slow (test_gapped_ranks_... covers them by default).
DEFAULT_GRID = [
    ("draft-model sampled chain", 1.0, "top-p 0.8"),
    ("draft-model top-k tree", 0.5, "top-k 3"),
    ("draft-model sampled tree (SpecInfer)", 1.5, "no filter"),
    ("draft-model sampled tree without replacement (Sequoia)", 1.0, "top-k 3"),
    ("prompt lookup", 1.5, "top-p 0.8"),
    ("block drafter sampled chain", 1.0, "top-k 3"),
    ("block drafter top-k tree", 0.5, "no filter"),
    ("composite: lookup then draft model", 0.5, "no filter"),
]
FULL_GRID = [(d, t, f) for d in DRAFTERS for t in TEMPERATURES for f in FILTERS]


def assert_fits(drafter_name: str, temperature: float, filter_name: str, n: int) -> None:
    """``n`` continuations through the engine fit the enumerated distribution."""
    filters = FILTERS[filter_name]
    result = fit(sample_continuations(drafter_name, temperature, filters, n=n), exact(temperature, filters))
    assert result.passed, f"{drafter_name}, T={temperature}, {filter_name}, n={n}: {result}"


@pytest.mark.parametrize("drafter_name,temperature,filter_name", DEFAULT_GRID)
def test_speculative_samples_follow_the_target_distribution(drafter_name, temperature, filter_name):
    assert_fits(drafter_name, temperature, filter_name, ENGINE_SAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("drafter_name,temperature,filter_name", DEFAULT_GRID)
def test_speculative_samples_follow_the_target_distribution_at_full_power(drafter_name, temperature, filter_name):
    assert_fits(drafter_name, temperature, filter_name, SAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("drafter_name,temperature,filter_name", [c for c in FULL_GRID if c not in DEFAULT_GRID])
def test_speculative_samples_follow_the_target_distribution_full_grid(drafter_name, temperature, filter_name):
    assert_fits(drafter_name, temperature, filter_name, SAMPLES)


def test_plain_sampling_follows_the_target_distribution():
    gen = sg.SpeculativeGenerator(TARGET, None)
    torch.manual_seed(99)
    counts = Counter(tuple(gen.generate(PROMPT, max_new_tokens=LENGTH, temperature=1.0).token_ids) for _ in range(5000))
    result = fit(counts, exact(1.0, {}))
    assert result.passed, str(result)


# Sibling ranks with gaps, drawn without replacement, through StaticTree and sample_accept directly.
# Before the fix, [[1]] kept the second of two distinct draws but verified it as if drawn from q:
# the first committed token was off p by TV 0.032 ([[1]]) and 0.028 ([[0], [2]]), far beyond
# the bound at 20,000 draws (0.019).
GAP_Q = torch.tensor([0.4, 0.3, 0.2, 0.1])  # the drafter's q at the root
GAP_P = torch.tensor([0.1, 0.2, 0.3, 0.4])  # the target's p at the root: what the first token must follow
GAP_DRAWS = 20_000


def first_committed_tokens(choices: list[list[int]], draw: str, n: int = GAP_DRAWS) -> Counter:
    """The first token each of n verification steps commits, q and p fixed at every node."""
    sampling = Sampling(temperature=1.0).seeded(5)  # probs(log q) = q
    policy = sg.StaticTree(choices, draw=draw)
    counts: Counter = Counter()
    for _ in range(n):
        tree = policy.grow(lambda tree, frontier: GAP_Q.log().expand(len(frontier), -1), root_token=0, sampling=sampling)
        result = sample_accept(tree, GAP_P.expand(tree.num_nodes, -1), sampling)
        first = int(tree.tokens[result.path[1]]) if len(result.path) > 1 else result.next_token
        counts[(first,)] += 1
    return counts


@pytest.mark.parametrize("choices", [[[1]], [[0], [2]]])
def test_gapped_ranks_drawn_without_replacement_commit_tokens_from_p(choices):
    result = fit(first_committed_tokens(choices, "sample-without-replacement"), {(t,): float(GAP_P[t]) for t in range(4)})
    assert result.passed, f"StaticTree({choices}, sample-without-replacement): {result}"


def _accept_without_ratio(tree, p, sampling) -> Acceptance:
    """WRONG on purpose: take the first child at every level, never testing p/q."""
    path = [0]
    while True:
        kids = (tree.parents == path[-1]).nonzero().flatten().tolist()
        if not kids:
            return Acceptance(torch.tensor(path), sampling.draw_one(p[path[-1]]))
        path.append(kids[0])


def test_negative_control_wrong_rule_fails_the_same_test():
    counts = sample_continuations("draft-model sampled chain", 1.0, {}, n=ENGINE_SAMPLES, acceptance=_accept_without_ratio)
    result = fit(counts, exact(1.0, {}))
    assert not result.passed, f"the test has no power: a wrong rule passed with {result}"
    assert result.p_value < 1e-6 and result.tv > result.tv_bound


def test_negative_control_filter_on_one_side_only_fails(monkeypatch):
    """Filtering q but not p (a known bug in the wild) breaks exactness, and the test sees it."""

    def unfiltered_p(logits, sampling):
        return Sampling(temperature=sampling.temperature).probs(logits)  # WRONG: top-k dropped

    monkeypatch.setattr(verify_module, "target_probs", unfiltered_p)  # where every acceptance makes p
    result = fit(sample_continuations("draft-model sampled chain", 1.0, {"top_k": 2}, n=ENGINE_SAMPLES), exact(1.0, {"top_k": 2}))
    assert not result.passed, f"the test has no power: one-sided filtering passed with {result}"
