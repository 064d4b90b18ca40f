"""Self-speculative layer skip: the target drafts with some of its own layers, and the output stays the target's."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

import specgraft as sg
from conftest import STORIES, needs_shared, tiny_causal_lm
from specgraft.cli import main
from specgraft.heads import drafter_from_spec
from specgraft.specs import format_layer_set, parse_layer_set
from specgraft.tools.exactness import fit
from specgraft.tree import Sampling

TREES = {
    "chain:3": lambda: sg.Chain(3),
    "static tree": lambda: sg.StaticTree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
    "dynamic tree": lambda: sg.DynamicTree(top_k=3, depth=4, budget=10),
}


@pytest.fixture(scope="module")
def tiny() -> sg.Target:
    return sg.load_target(tiny_causal_lm("llama", vocab_size=97, seed=5, layers=4))


def hf_greedy(target: sg.Target, prompt: list[int], n: int) -> list[int]:
    out = target.model.generate(
        torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("skip", [[], [1], [1, 2]])
def test_tiny_llama_greedy_equals_hf_greedy(tiny, skip, tree):
    prompt = [3, 14, 15, 9, 26]
    gen = sg.SpeculativeGenerator(tiny, sg.LayerSkip(tiny, skip=skip), tree=TREES[tree]())
    out = gen.generate(prompt, max_new_tokens=40, eos_token_id=())
    assert out.token_ids == hf_greedy(tiny, prompt, 40)


@needs_shared
@pytest.mark.parametrize("tree", TREES)
def test_stories_greedy_equals_plain_decoding(stories, dev_prompts, tree):
    plain = sg.SpeculativeGenerator(stories, None)
    gen = sg.SpeculativeGenerator(stories, sg.LayerSkip(stories, skip=[2]), tree=TREES[tree]())
    for prompt in dev_prompts[:2]:
        ids = stories.encode(prompt)
        out = gen.generate(ids, max_new_tokens=60)
        assert out.token_ids == plain.generate(ids, max_new_tokens=60).token_ids
        assert out.stats.mean_accepted_length > 1.2  # it really drafted and was accepted


@needs_shared
def test_stories_batched_scheduler_equals_plain_decoding(stories, dev_prompts):
    plain = sg.SpeculativeGenerator(stories, None)
    gen = sg.SpeculativeGenerator(stories, sg.LayerSkip(stories, skip=[1, 3]), tree=sg.Chain(3))
    prompts = [stories.encode(p) for p in dev_prompts[:3]] + [[1]]
    lengths = [50, 23, 64, 37]  # rows finish at different steps and leave the batch
    outs = gen.generate_batch(prompts, max_new_tokens=lengths)
    for prompt, n, out in zip(prompts, lengths, outs):
        assert out.token_ids == plain.generate(prompt, max_new_tokens=n).token_ids


def test_tiny_llama_batched_scheduler_equals_hf_greedy(tiny):
    prompts = [[3, 14, 15], [9, 2 + 24, 5, 35, 8, 9], [79]]
    gen = sg.SpeculativeGenerator(tiny, sg.LayerSkip(tiny, skip=[2]), tree=TREES["static tree"]())
    outs = gen.generate_batch(prompts, max_new_tokens=30, eos_token_id=())
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(tiny, prompt, 30)


def test_skipping_nothing_drafts_the_targets_own_tokens(tiny):
    """skip=[]: the draft is the target, so every greedy chain is accepted whole (tau = depth + 1)."""
    depth = 3
    gen = sg.SpeculativeGenerator(tiny, sg.LayerSkip(tiny, skip=[]), tree=sg.Chain(depth))
    out = gen.generate([3, 14, 15], max_new_tokens=1 + 10 * (depth + 1), eos_token_id=())  # prefill's token + 10 steps
    assert out.stats.mean_accepted_length == depth + 1
    assert out.stats.accept_length_histogram == [0] * depth + [10]


def test_sampling_follows_the_target_distribution():
    """Enumerated exactness on a 6-token tiny Llama: 3-token continuations through a sampled chain and a top-k tree."""
    target = sg.load_target(tiny_causal_lm("llama", vocab_size=6, seed=2, layers=3))
    with torch.no_grad():  # logits near +-20 would make the distribution nearly deterministic: soften them
        target.model.lm_head.weight.mul_(0.1)
    prompt, length, samples = [0, 1, 2, 0, 1], 3, 4000
    policy = Sampling(temperature=1.0, top_k=4)
    exact = {}
    for seq in itertools.product(range(6), repeat=length):
        with torch.no_grad():
            logits = target.model(torch.tensor([prompt + list(seq)])).logits[0, len(prompt) - 1 : -1].float()
        probs = policy.probs(logits)  # (length, V)
        p = float(torch.prod(probs[torch.arange(length), torch.tensor(seq)]))
        if p > 0:
            exact[seq] = p
    for tree in (sg.Chain(2, draw="sample"), sg.StaticTree([[0], [1], [0, 0]], draw="top-k")):
        gen = sg.SpeculativeGenerator(target, sg.LayerSkip(target, skip=[1]), tree=tree)
        counts = Counter(
            tuple(gen.generate(prompt, max_new_tokens=length, temperature=1.0, top_k=4, seed=s, eos_token_id=()).token_ids)
            for s in range(samples)
        )
        result = fit(counts, exact)
        assert result.passed, f"{tree}: {result}"


@pytest.mark.parametrize(
    "skip,message",
    [
        ([4], "layer 4 is out of range; the target has 4 layers (0..3)"),
        ([-1], "layer -1 is out of range"),
        ([1, 2, 1], "names layer 1 more than once"),
        ([0, 1, 2, 3], "skips all 4 layers of the target; keep at least one"),
        (["2"], "'2' is not a layer index"),
    ],
)
def test_bad_skip_sets_are_refused_naming_the_value(tiny, skip, message):
    with pytest.raises(ValueError, match="skip=") as err:
        sg.LayerSkip(tiny, skip=skip)
    assert message in str(err.value)


def test_a_target_without_the_fast_path_is_refused_with_its_reason():
    gpt2 = sg.load_target(tiny_causal_lm("gpt2", vocab_size=97, layers=2))
    with pytest.raises(ValueError, match="fast path.*GPT2LMHeadModel is not one of the fast-path architectures"):
        sg.LayerSkip(gpt2, skip=[0])
    slow = sg.load_target(tiny_causal_lm("llama", layers=2), fast=False)
    with pytest.raises(ValueError, match="loaded with fast=False"):
        sg.LayerSkip(slow, skip=[0])


def test_the_draft_shares_the_targets_weights(tiny):
    drafter = sg.LayerSkip(tiny, skip=[0, 2])
    layers = tiny.model.model.layers
    assert drafter.kept == (1, 3)
    assert [layer.q.data_ptr() for layer in drafter.fast.layers] == [layers[i].self_attn.q_proj.weight.data_ptr() for i in (1, 3)]
    assert drafter.fast.lm_head.data_ptr() == tiny.model.lm_head.weight.data_ptr()
    assert drafter.fast.embed.data_ptr() == tiny.model.model.embed_tokens.weight.data_ptr()


def test_layer_sets_parse_and_format():
    assert parse_layer_set("12-14,19") == [12, 13, 14, 19]
    assert parse_layer_set("") == []
    assert format_layer_set([19, 12, 13, 14]) == "12-14,19"
    for bad in ("3-1", "a", "1-b"):
        with pytest.raises(ValueError, match="layer set"):
            parse_layer_set(bad)


def test_drafter_spec_builds_a_layer_skip(tiny):
    drafter = drafter_from_spec("layer-skip:1-2", tiny)
    assert isinstance(drafter, sg.LayerSkip) and drafter.skip == (1, 2)
    with pytest.raises(ValueError, match="out of range"):
        drafter_from_spec("layer-skip:9", tiny)


def test_search_returns_a_valid_set_deterministically(tiny):
    prompts = [[3, 14, 15, 9], [26, 5, 35]]
    first = sg.search_layer_skip(tiny, prompts, max_new_tokens=12, max_skip=3, min_agreement=0.0)
    again = sg.search_layer_skip(tiny, prompts, max_new_tokens=12, max_skip=3, min_agreement=0.0)
    assert first == again
    assert [len(c.skip) for c in first.path] == [0, 1, 2, 3]  # one layer more per round
    assert all(set(a.skip) < set(b.skip) for a, b in zip(first.path, first.path[1:]))
    assert first.path[0].agreement == 1.0  # no layer skipped: the draft is the target
    assert first.best in first.path
    assert first.positions == 24
    sg.LayerSkip(tiny, skip=first.best.skip)  # a set the drafter accepts
    with pytest.raises(ValueError, match="candidates"):
        sg.search_layer_skip(tiny, prompts, candidates=[7])


@needs_shared
def test_search_on_stories_keeps_agreement_high_first(stories, dev_prompts):
    prompts = [stories.encode(p) for p in dev_prompts[:2]]
    result = sg.search_layer_skip(stories, prompts, max_new_tokens=16, max_skip=2, min_agreement=0.0)
    assert [len(c.skip) for c in result.path] == [0, 1, 2]
    assert result.path[1].agreement >= result.path[2].agreement - 0.1  # greedy: the harmless layer goes first


@needs_shared
def test_cli_generate_and_search(capsys, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["Once upon a time"]}\n{"turns": ["The dog ran"]}\n')
    assert main(["search-layer-skip", "--target", str(STORIES), "--prompts", str(prompts), "--max-new-tokens", "8",
                 "--max-skip", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "chosen: --drafter layer-skip:" in out and "top-1 agreement" in out
    assert main(["generate", "--target", str(STORIES), "--drafter", "layer-skip:2", "--tree", "chain:2",
                 "--prompt", "Once upon a time", "--max-new-tokens", "12", "--threads", "1"]) == 0
