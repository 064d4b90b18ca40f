"""Greedy identity on architectures we have no weights for: tiny random Llama, Qwen2, Qwen3, Mistral.

Each drafter must reproduce ``model.generate(do_sample=False)`` token for
token, with end-of-sequence disabled on both sides so every run covers the
whole budget. Qwen3's config sets head_dim apart from hidden_size / heads.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_causal_lm

import specgraft as sg

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
VOCAB = 97
NEW_TOKENS = 48
PROMPT_SEEDS = (0, 1, 2)
STATIC_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]


def greedy_references(model) -> dict[int, tuple[list[int], list[int]]]:
    """Prompt seed -> (prompt ids, the model's own greedy continuation of NEW_TOKENS tokens, EOS disabled)."""
    refs = {}
    for seed in PROMPT_SEEDS:
        ids = _prompt(seed)
        x = torch.tensor([ids])
        out = model.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW_TOKENS,
            eos_token_id=None, pad_token_id=0,
        )
        refs[seed] = (ids, out[0, len(ids):].tolist())
        assert len(refs[seed][1]) == NEW_TOKENS  # EOS really is disabled in the reference
    return refs


def _prompt(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    length = 5 + seed * 4
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request):
    """(arch, target, {prompt seed: (prompt ids, HF greedy continuation)})."""
    arch = request.param
    model = tiny_causal_lm(arch, vocab_size=VOCAB, seed=0)
    if arch == "qwen3":  # the case this architecture is here for
        cfg = model.config
        assert cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size
    target = sg.load_target(model)
    refs = greedy_references(model)
    return arch, target, refs


def _check(gen: sg.SpeculativeGenerator, refs) -> dict[int, tuple[list[int], list[int]]]:
    """Prompt seed -> (got, want) for every prompt whose output differs."""
    wrong = {}
    for seed, (ids, want) in refs.items():
        got = gen.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=()).token_ids
        if got != want:
            wrong[seed] = (got, want)
    return wrong


def test_plain_decoding_matches_hf_greedy(arch_case):
    _, target, refs = arch_case
    assert _check(sg.SpeculativeGenerator(target, None), refs) == {}


def test_prompt_lookup_matches_hf_greedy(arch_case):
    _, target, refs = arch_case
    assert _check(sg.SpeculativeGenerator(target, sg.PromptLookup()), refs) == {}


def test_self_draft_chain_matches_hf_greedy(arch_case):
    _, target, refs = arch_case
    assert _check(sg.SpeculativeGenerator(target, sg.DraftModel(target, target), tree=sg.Chain(4)), refs) == {}


def test_self_draft_static_tree_matches_hf_greedy(arch_case):
    _, target, refs = arch_case
    gen = sg.SpeculativeGenerator(target, sg.DraftModel(target, target), tree=sg.StaticTree(STATIC_TREE))
    assert _check(gen, refs) == {}


def test_self_draft_chain_accepts_every_draft(arch_case):
    # The target drafting for itself must be accepted in full: a verification that
    # disagrees with the draft's own forward shows up as a shorter accepted length.
    _, target, refs = arch_case
    gen = sg.SpeculativeGenerator(target, sg.DraftModel(target, target), tree=sg.Chain(4))
    ids, _ = refs[PROMPT_SEEDS[0]]
    stats = gen.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=()).stats
    committed, done = [], 1  # per step: every draft the budget allows, plus the target's own token
    while done < NEW_TOKENS:
        committed.append(min(4, NEW_TOKENS - done - 1) + 1)
        done += committed[-1]
    assert stats.accept_length_histogram == [committed.count(n) for n in range(1, 6)]


def test_different_random_draft_model_matches_hf_greedy(arch_case):
    arch, target, refs = arch_case
    draft = sg.DraftModel(tiny_causal_lm(arch, vocab_size=VOCAB, seed=1, layers=1), target)
    gen = sg.SpeculativeGenerator(target, draft, tree=sg.StaticTree([[0], [1], [0, 0], [0, 0, 0]]))
    assert _check(gen, refs) == {}


def test_draft_model_of_another_architecture_matches_hf_greedy(arch_case):
    arch, target, refs = arch_case
    other = {"llama": "qwen3", "qwen2": "llama", "qwen3": "mistral", "mistral": "qwen2"}[arch]
    draft = sg.DraftModel(tiny_causal_lm(other, vocab_size=VOCAB, seed=2, layers=1), target)
    assert _check(sg.SpeculativeGenerator(target, draft, tree=sg.Chain(3)), refs) == {}
