"""The continuous-batching scheduler and generate_batch: many generations, each exactly as if alone."""

from __future__ import annotations

import pytest

import specgraft as sg
from specgraft.infer.scheduler import per_prompt_options

BRANCHING_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def make(target, kind: str) -> sg.SpeculativeGenerator:
    if kind == "plain":
        return sg.SpeculativeGenerator(target, None)
    if kind == "prompt_lookup":
        return sg.SpeculativeGenerator(target, sg.PromptLookup(), tree=sg.Chain(4))
    if kind == "self_tree":
        return sg.SpeculativeGenerator(target, sg.DraftModel(target, target), tree=sg.StaticTree(BRANCHING_TREE))
    raise KeyError(kind)


@pytest.fixture(scope="module")
def prompts(dev_prompts) -> list[str]:
    return dev_prompts[:5]


@pytest.mark.parametrize("kind", ["plain", "prompt_lookup", "self_tree"])
def test_generate_batch_equals_each_prompt_alone(stories, prompts, kind):
    gen = make(stories, kind)
    budgets = [12, 40, 25, 33, 7]
    stops = [None, ["big"], None, None, None]
    outs = gen.generate_batch(prompts, max_new_tokens=budgets, stop=stops)
    for prompt, budget, stop, out in zip(prompts, budgets, stops, outs):
        alone = gen.generate(prompt, max_new_tokens=budget, stop=stop)
        assert out.token_ids == alone.token_ids
        assert out.text == alone.text
        assert out.stats.accept_length_histogram == alone.stats.accept_length_histogram


def test_generate_batch_samples_each_row_with_its_own_options(stories, prompts):
    gen = make(stories, "self_tree")
    temperatures, seeds = [0.0, 0.7, 1.0, 1.3], [1, 2, 3, 4]
    outs = gen.generate_batch(prompts[:4], max_new_tokens=24, temperature=temperatures, seed=seeds, eos_token_id=())
    for prompt, t, s, out in zip(prompts, temperatures, seeds, outs):
        assert out.token_ids == gen.generate(prompt, max_new_tokens=24, temperature=t, seed=s, eos_token_id=()).token_ids


def test_step_reports_each_generations_new_tokens_and_they_add_up(stories, prompts):
    gen = make(stories, "prompt_lookup")
    sched = gen.scheduler(max_batch_size=2)
    handles = [sched.submit(p, max_new_tokens=16, eos_token_id=()) for p in prompts[:3]]
    seen = {h: [] for h in handles}
    first = sched.step()
    assert set(first) == set(handles[:2])  # the third waits for a free row
    assert all(len(tokens) == 1 for tokens in first.values())  # a joining row's first token, from its prefill
    for h, tokens in first.items():
        seen[h] += tokens
    while not all(sched.finished(h) for h in handles):
        assert len(sched.running) <= 2
        for h, tokens in sched.step().items():
            seen[h] += tokens
    for h, prompt in zip(handles, prompts):
        out = sched.result(h)
        assert out.token_ids == seen[h] == gen.generate(prompt, max_new_tokens=16, eos_token_id=()).token_ids
    assert sched.idle


def test_cancel_frees_the_row_and_leaves_the_others_unaffected(stories, prompts):
    gen = make(stories, "self_tree")
    sched = gen.scheduler(max_batch_size=2)
    a = sched.submit(prompts[0], max_new_tokens=30, eos_token_id=())
    b = sched.submit(prompts[1], max_new_tokens=30, eos_token_id=())
    c = sched.submit(prompts[2], max_new_tokens=30, eos_token_id=())
    sched.step()
    sched.step()
    sched.cancel(a)
    assert a not in sched.running and len(sched.running) == 1
    with pytest.raises(KeyError, match="unknown generation handle"):
        sched.finished(a)
    sched.step()
    assert c in sched.running  # the freed row was taken by the waiting generation
    while not (sched.finished(b) and sched.finished(c)):
        sched.step()
    for h, prompt in ((b, prompts[1]), (c, prompts[2])):
        assert sched.result(h).token_ids == gen.generate(prompt, max_new_tokens=30, eos_token_id=()).token_ids


def test_result_before_finishing_and_bad_options_are_refused(stories, prompts):
    sched = make(stories, "plain").scheduler()
    h = sched.submit(prompts[0], max_new_tokens=8)
    with pytest.raises(ValueError, match="has not finished"):
        sched.result(h)
    with pytest.raises(ValueError, match="max_new_tokens"):
        sched.submit(prompts[0], max_new_tokens=0)
    with pytest.raises(ValueError, match="max_batch_size"):
        make(stories, "plain").scheduler(max_batch_size=0)


def test_per_prompt_options_take_one_value_or_one_per_prompt():
    split = per_prompt_options(2, temperature=[0.0, 0.5], top_k=5, stop=["a", "b"], eos_token_id=[[1], None])
    assert split == [
        {"temperature": 0.0, "top_k": 5, "stop": ["a", "b"], "eos_token_id": [1]},
        {"temperature": 0.5, "top_k": 5, "stop": ["a", "b"], "eos_token_id": None},
    ]
    with pytest.raises(ValueError, match="'seed' has 3 values for 2 prompts"):
        per_prompt_options(2, seed=[1, 2, 3])


class _FailsOn(sg.PromptLookup):
    """Prompt lookup that raises on prompts holding one token: a drafter failing on one generation's input."""

    def __init__(self, token: int) -> None:
        super().__init__()
        self.token = token

    def start(self, prompt_ids, hidden):
        if self.token in prompt_ids.tolist():
            raise RuntimeError("drafter failed")
        return super().start(prompt_ids, hidden)


def test_a_failing_generation_leaves_alone_and_result_raises_its_error(stories, prompts):
    gen = sg.SpeculativeGenerator(stories, _FailsOn(511), tree=sg.Chain(4))
    sched = gen.scheduler(max_batch_size=4)
    good = sched.submit(prompts[0], max_new_tokens=12, eos_token_id=())
    bad = sched.submit([1, 403, 511], max_new_tokens=12, eos_token_id=())
    while not (sched.finished(good) and sched.finished(bad)):
        sched.step()
    with pytest.raises(RuntimeError, match="drafter failed"):
        sched.result(bad)
    assert sched.result(good).token_ids == gen.generate(prompts[0], max_new_tokens=12, eos_token_id=()).token_ids
    assert sched.idle
