"""Greedy speculative decoding is token-identical to the target's own greedy decoding.

The sweep runs every prompt of the dev set on the real stories260K target in
float32, 128 new tokens, and compares the generated ids with
``model.generate(do_sample=False)`` for plain decoding, prompt lookup, the
target drafting for itself (chain and branching static tree) and a random
small draft model that the target mostly rejects.

The Hugging Face reference is computed once per prompt for the whole module.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_causal_lm

import specgraft as sg

NEW_TOKENS = 128
BRANCHING_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]


@pytest.fixture(scope="module")
def prompt_ids(stories, dev_prompts) -> list[list[int]]:
    assert stories.dtype == torch.float32
    return [stories.encode(p) for p in dev_prompts]


@pytest.fixture(scope="module")
def hf_greedy(stories, prompt_ids) -> list[list[int]]:
    """The target's own greedy continuation of every dev prompt (generated part only)."""
    refs = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        out = stories.model.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW_TOKENS
        )
        refs.append(out[0, len(ids):].tolist())
    return refs


@pytest.fixture(scope="module")
def self_chain_outputs(stories, prompt_ids) -> list[sg.GenerationOutput]:
    """The target drafting for itself with Chain(5): used by the identity and the tau tests."""
    gen = sg.SpeculativeGenerator(stories, sg.DraftModel(stories, stories), tree=sg.Chain(5))
    return [gen.generate(ids, max_new_tokens=NEW_TOKENS) for ids in prompt_ids]


def _mismatches(outputs: list[list[int]], refs: list[list[int]]) -> list[str]:
    """One line per prompt whose output differs from the reference: where and how."""
    lines = []
    for i, (got, want) in enumerate(zip(outputs, refs, strict=True)):
        if got != want:
            at = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            lines.append(
                f"prompt {i}: lengths {len(got)} vs {len(want)}, first difference at token {at}: "
                f"got {got[at:at + 5]}, want {want[at:at + 5]}"
            )
    return lines


def _sweep(gen: sg.SpeculativeGenerator, prompt_ids: list[list[int]]) -> list[list[int]]:
    return [gen.generate(ids, max_new_tokens=NEW_TOKENS).token_ids for ids in prompt_ids]


def test_plain_decoding_matches_hf_greedy_on_every_dev_prompt(stories, prompt_ids, hf_greedy):
    gen = sg.SpeculativeGenerator(stories, None)
    assert _mismatches(_sweep(gen, prompt_ids), hf_greedy) == []


def test_prompt_lookup_matches_hf_greedy_on_every_dev_prompt(stories, prompt_ids, hf_greedy):
    gen = sg.SpeculativeGenerator(stories, sg.PromptLookup())
    assert _mismatches(_sweep(gen, prompt_ids), hf_greedy) == []


def test_self_draft_chain_matches_hf_greedy_on_every_dev_prompt(self_chain_outputs, hf_greedy):
    assert _mismatches([o.token_ids for o in self_chain_outputs], hf_greedy) == []


def test_self_draft_branching_static_tree_matches_hf_greedy_on_every_dev_prompt(stories, prompt_ids, hf_greedy):
    gen = sg.SpeculativeGenerator(stories, sg.DraftModel(stories, stories), tree=sg.StaticTree(BRANCHING_TREE))
    assert _mismatches(_sweep(gen, prompt_ids), hf_greedy) == []


def test_random_draft_model_matches_hf_greedy_on_every_dev_prompt(stories, prompt_ids, hf_greedy):
    draft = sg.DraftModel(tiny_causal_lm("llama", vocab_size=stories.vocab_size, seed=3), stories)
    gen = sg.SpeculativeGenerator(stories, draft, tree=sg.Chain(4))
    outputs = []
    rejected_steps = 0
    for ids in prompt_ids:
        out = gen.generate(ids, max_new_tokens=NEW_TOKENS)
        outputs.append(out.token_ids)
        rejected_steps += out.stats.accept_length_histogram[0]  # steps where the whole draft was rejected
    assert _mismatches(outputs, hf_greedy) == []
    assert rejected_steps > 0  # the random draft really was rejected, so the rejection path ran


def test_self_draft_chain5_accepts_at_least_5_5_tokens_per_call_on_every_dev_prompt(self_chain_outputs):
    low = {i: o.stats.mean_accepted_length for i, o in enumerate(self_chain_outputs) if o.stats.mean_accepted_length < 5.5}
    assert low == {}
