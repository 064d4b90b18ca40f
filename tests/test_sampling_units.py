"""Sampling policy, acceptance-rule edge cases and the goodness-of-fit maths, each against a reference."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chi2
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import specgraft as sg
from specgraft.tools.exactness import chi2_sf, fit
from specgraft.infer.request import check_prefix_free
from specgraft.infer.verify import sample_accept
from specgraft.tree import Sampling, Tree


def _hf_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return scores.softmax(-1)


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": 0.7},
        {"temperature": 1.3, "top_k": 5},
        {"temperature": 1.0, "top_p": 0.6},
        {"temperature": 0.9, "top_k": 10, "top_p": 0.8},
        {"temperature": 1.0, "min_p": 0.05},
    ],
)
def test_policy_matches_transformers_warpers(options):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3)) * 3
    ours = Sampling(**options).probs(logits)
    assert torch.allclose(ours, _hf_probs(logits, **options), atol=1e-6)
    assert torch.allclose(ours.sum(-1), torch.ones(4))


def test_policy_bans_tokens_and_renormalises():
    probs = Sampling(temperature=1.0, banned_token_ids=(0, 3)).probs(torch.zeros(5))
    assert probs[0] == 0 and probs[3] == 0
    assert torch.allclose(probs[[1, 2, 4]], torch.full((3,), 1 / 3))


@pytest.mark.parametrize(
    "options,name",
    [({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"min_p": 1.0}, "min_p")],
)
def test_policy_rejects_bad_options_naming_them(options, name):
    with pytest.raises(ValueError, match=name):
        Sampling(**options)


def test_prefix_dependent_penalties_are_refused():
    with pytest.raises(NotImplementedError, match="repetition_penalty"):
        check_prefix_free(1.2, 0.0)
    with pytest.raises(NotImplementedError, match="presence_penalty"):
        check_prefix_free(1.0, 0.5)


def _chain_tree(tokens, q):
    n = len(tokens)
    return Tree(
        tokens=torch.tensor(tokens),
        parents=torch.arange(-1, n - 1),
        depth=torch.arange(n),
        scores=torch.zeros(n),
        q=q,
    )


def test_identical_draft_and_target_always_accept():
    p = torch.tensor([[0.2, 0.5, 0.3], [0.6, 0.2, 0.2], [0.1, 0.1, 0.8]])
    q = torch.cat([torch.zeros(1, 3), p[:2]])  # q[i]: what node i was drawn from = p at its parent
    tree = _chain_tree([0, 1, 0], q)
    gen = Sampling(temperature=1.0).seeded(0)
    for _ in range(200):
        assert sample_accept(tree, p, gen).path.tolist() == [0, 1, 2]


def test_empty_residual_falls_back_to_p(monkeypatch):
    """A rejection whose residual max(p - q, 0) has only rounding-noise mass samples the correction from p."""
    p = torch.tensor([[0.5, 0.5], [0.5, 0.5]], dtype=torch.float64)
    p[0] = torch.tensor([0.5 - 1e-9, 0.5 + 1e-9], dtype=torch.float64)
    q = torch.tensor([[0.0, 0.0], [0.5, 0.5]], dtype=torch.float64)
    tree = _chain_tree([0, 0], q)
    # Force the rejection of node 1 (acceptance ratio 1 - 2e-9): a uniform draw just below 1.
    monkeypatch.setattr("specgraft.infer.verify.torch.rand", lambda *a, **k: torch.tensor(1.0 - 1e-12, dtype=torch.float64))
    gen = Sampling(temperature=1.0).seeded(0)
    corrections = Counter(sample_accept(tree, p, gen).next_token for _ in range(400))
    # The residual is [0, 2e-9]: renormalising it would always give token 1; p gives both.
    assert corrections[0] > 100 and corrections[1] > 100


def test_point_mass_children_correction_never_repeats_a_rejected_child():
    p = torch.tensor([[0.25, 0.25, 0.25, 0.25], [1.0, 0, 0, 0], [1.0, 0, 0, 0]])
    tree = Tree(
        tokens=torch.tensor([0, 1, 2]), parents=torch.tensor([-1, 0, 0]), depth=torch.tensor([0, 1, 1]), scores=torch.zeros(3)
    )
    gen = Sampling(temperature=1.0).seeded(1)
    firsts = Counter()
    for _ in range(8000):
        result = sample_accept(tree, p, gen)
        first = int(tree.tokens[result.path[1]]) if len(result.path) > 1 else result.next_token
        firsts[first] += 1
    fit_result = fit(Counter({(k,): v for k, v in firsts.items()}), {(t,): 0.25 for t in range(4)})
    assert fit_result.passed, str(fit_result)


@pytest.mark.parametrize("stat,dof", [(3.0, 1), (10.0, 5), (50.0, 40), (400.0, 300), (0.5, 12)])
def test_chi2_survival_matches_scipy(stat, dof):
    assert chi2_sf(stat, dof) == pytest.approx(chi2.sf(stat, dof), rel=1e-6)


def test_fit_flags_impossible_outcomes():
    result = fit(Counter({(0,): 50, (9,): 1}), {(0,): 1.0})
    assert not result.passed


def test_seeded_sampling_repeats_and_unseeded_differs():
    from markov_lm import markov_target

    target = markov_target(6, seed=0)
    gen = sg.SpeculativeGenerator(target, sg.DraftModel(markov_target(6, seed=1), target), tree=sg.Chain(3))
    runs = [gen.generate([0, 1], max_new_tokens=30, temperature=1.0, seed=7).token_ids for _ in range(2)]
    assert runs[0] == runs[1]
    others = {tuple(gen.generate([0, 1], max_new_tokens=30, temperature=1.0, seed=s).token_ids) for s in range(5)}
    assert len(others) > 1


def test_typical_acceptance_is_reported_lossy_and_needs_sampling():
    from markov_lm import markov_target

    target = markov_target(6, seed=0)
    gen = sg.SpeculativeGenerator(target, sg.DraftModel(target, target), tree=sg.Chain(3), acceptance=sg.lossy_typical_accept)
    out = gen.generate([0, 1], max_new_tokens=20, temperature=1.0, seed=0)
    assert out.stats.lossless is False and len(out.token_ids) == 20
    with pytest.raises(ValueError, match="typical"):
        gen.generate([0, 1], max_new_tokens=5, temperature=0.0)
    with pytest.raises(TypeError, match="acceptance"):  # a rule is a function now, never a mode string
        sg.SpeculativeGenerator(target, None, acceptance="typical")


def test_self_draft_at_temperature_one_is_always_accepted(stories, dev_prompts):
    """A draft identical to the target has q == p: every sampled chain is accepted, so tau = depth + 1."""
    gen = sg.SpeculativeGenerator(stories, sg.DraftModel(stories, stories), tree=sg.Chain(5))
    # 127 tokens after the first: 21 full steps of 6 and one last step of 1 (capped by max_new_tokens).
    taus = [gen.generate(p, max_new_tokens=128, temperature=1.0, seed=i).stats.mean_accepted_length for i, p in enumerate(dev_prompts[:5])]
    assert min(taus) >= 5.5, taus


def test_check_exactness_passes_on_stories260k_with_prompt_lookup(stories):
    from specgraft.tools.exactness import check_exactness

    gen = sg.SpeculativeGenerator(stories, sg.PromptLookup())
    reports = check_exactness(gen, ["Once upon a time, there was a girl. Once upon a time"], samples=400, length=2, top_k=4)
    assert reports[0].passed, f"{reports[0].plain} / {reports[0].speculative}"
    assert reports[0].outcomes == 16
