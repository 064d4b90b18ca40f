"""Hardware-aware tree sizing: the selection maths on hand-made inputs, and the measurements on a real target."""

from __future__ import annotations

import json
import time

import pytest
import torch

import specgraft as sg
from conftest import DEV_PROMPTS, STORIES
from specgraft.infer.adaptive.sizing import TreeChoice, best_first_paths, interpolate, size_tree
from specgraft.tools.tune import (
    measure_acceptance,
    measure_one_token,
    measure_step_costs,
    measure_verify_cost,
    shortlist,
    tree_spec,
    tune,
)
from specgraft.tree.policies import tree_from_spec
from specgraft.tree import Chain, DynamicTree, StaticTree, parse_tree_spec

ACCEPTANCE = [[0.6, 0.15, 0.05], [0.5, 0.1], [0.45, 0.1], [0.4]]


def test_best_first_takes_nodes_in_value_order():
    chosen = best_first_paths(ACCEPTANCE, 6)
    assert [p for _, p in chosen] == [(0,), (0, 0), (1,), (0, 0, 0), (1, 0), (0, 1)]
    assert [round(v, 4) for v, _ in chosen] == [0.6, 0.3, 0.15, 0.135, 0.075, 0.06]


def test_best_first_result_is_a_tree():
    paths = {p for _, p in best_first_paths(ACCEPTANCE, 12)}
    for p in paths:
        assert len(p) == 1 or p[:-1] in paths  # parent kept
        assert p[-1] == 0 or p[:-1] + (p[-1] - 1,) in paths  # better sibling kept


def test_free_verification_grows_the_tree_and_costly_verification_keeps_plain_decoding():
    free = {1: 1.0, 64: 1.0}
    big, _ = size_tree(ACCEPTANCE, free, draft_cost_per_depth=0.0)
    assert len(big.choices) == len(best_first_paths(ACCEPTANCE, 63))
    costly = {1: 1.0, 2: 3.0, 64: 50.0}
    plain, _ = size_tree(ACCEPTANCE, costly, draft_cost_per_depth=0.5)
    assert plain.choices == [] and plain.speedup == 1.0


def test_engine_overhead_is_paid_per_step_relative_to_a_plain_step():
    verify = {1: 1.0, 2: 1.2, 64: 3.0}
    free_engine, _ = size_tree(ACCEPTANCE, verify, 0.1)
    _, candidates = size_tree(ACCEPTANCE, verify, 0.1, step_overhead=0.5, plain_step=1.25)
    one = candidates[1]  # one draft node at depth 1
    assert one.relative_cost == pytest.approx(1.0 + (1.2 - 1.0 + 0.1 + 0.5) / 1.25)
    assert one.expected_tokens == pytest.approx(1.6)
    # Overhead per step favours fewer, more valuable steps: the pick never shrinks in expected tokens.
    with_overhead, _ = size_tree(ACCEPTANCE, verify, 0.1, step_overhead=0.5, plain_step=1.0)
    assert with_overhead.speedup < free_engine.speedup
    assert with_overhead.expected_tokens >= free_engine.expected_tokens
    heavy, _ = size_tree(ACCEPTANCE, verify, 0.1, step_overhead=5.0)
    assert heavy.choices == []  # so costly that plain decoding wins
    with pytest.raises(ValueError, match="plain_step must be positive"):
        size_tree(ACCEPTANCE, verify, 0.1, plain_step=0.0)


def test_expected_tokens_count_the_bonus_token():
    best, candidates = size_tree([[1.0], [1.0]], {1: 1.0, 8: 1.0}, 0.0)
    assert best.expected_tokens == 3.0  # two certain drafts and the target's own token


def test_interpolation_is_piecewise_linear():
    assert interpolate({1: 1.0, 5: 2.0}, 3) == 1.5 and interpolate({1: 1.0, 5: 2.0}, 9) == 2.0


def test_tree_spec_files(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps({"kind": "dynamic", "top_k": 4, "depth": 5, "budget": 20}))
    (tmp_path / "s.json").write_text(json.dumps({"kind": "static", "choices": [[0], [1], [0, 0]]}))
    assert parse_tree_spec(str(tmp_path / "d.json")) == DynamicTree(4, 5, 20)
    assert parse_tree_spec(str(tmp_path / "s.json")) == StaticTree([[0], [1], [0, 0]])
    (tmp_path / "bad.json").write_text(json.dumps({"kind": "dynamic", "top_k": 4}))
    with pytest.raises(ValueError, match="depth"):
        parse_tree_spec(str(tmp_path / "bad.json"))


def test_self_drafting_is_always_accepted_at_rank_zero(stories, dev_prompts):
    prompts = [stories.encode(p) for p in dev_prompts[:2]]
    acceptance = measure_acceptance(stories, sg.DraftModel(stories, stories), prompts, depth=4, max_new_tokens=24)
    assert all(row[0] == 1.0 and sum(row[1:]) == 0.0 for row in acceptance)


def test_verify_cost_curve_is_cached(stories, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = measure_verify_cost(stories, sizes=(1, 4), repeats=2)
    assert first[1] == 1.0 and first[4] > 0
    cached = json.loads((tmp_path / "specgraft" / "verify_cost.json").read_text())
    assert len(cached) == 1
    assert measure_verify_cost(stories, sizes=(1, 4), repeats=2) == first  # read back, not re-measured


class SlowCommit:
    """A drafter whose per-step bookkeeping (commit) takes a known extra time."""

    def __init__(self, drafter, seconds: float) -> None:
        self.drafter, self.seconds = drafter, seconds
        self.hidden_layers = drafter.hidden_layers

    def start(self, prompt_ids, hidden):
        return SlowCommitState(self.drafter.start(prompt_ids, hidden), self.seconds)


class SlowCommitState:
    def __init__(self, state, seconds: float) -> None:
        self.state, self.seconds = state, seconds

    def __getattr__(self, name):
        return getattr(self.state, name)

    def commit(self, tokens, hidden, path=None) -> None:
        time.sleep(self.seconds)
        self.state.commit(tokens, hidden, path)

    def commit_listed(self, tokens) -> None:  # how the engine commits to a host-side state (prompt lookup's)
        time.sleep(self.seconds)
        self.state.commit_listed(tokens)


def test_step_overhead_measures_the_engine_work_beyond_forward_and_draft(stories, dev_prompts):
    prompt = stories.encode(dev_prompts[0])
    cache = stories.new_cache()
    stories.forward(torch.tensor([prompt]), cache, torch.arange(len(prompt))[None])
    one_token = sorted(measure_one_token(stories, cache) for _ in range(9))[4]  # median seconds
    _, fast = measure_step_costs(stories, sg.PromptLookup(), prompt, {1: 1.0, 2: 1.0}, 0.0, steps=5)
    plain_step, slow = measure_step_costs(stories, SlowCommit(sg.PromptLookup(), 0.02), prompt, {1: 1.0, 2: 1.0}, 0.0, steps=5)
    assert plain_step >= 1.0
    # 20 ms per step is ~30 one-token forwards of this target: the measurement must see it (a quarter of it,
    # at least: the forward timed right after a sleep runs on cold caches, which shrinks the ratio).
    assert slow - fast > 0.25 * 0.02 / one_token


def test_tune_returns_a_runnable_tree(stories, dev_prompts, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    prompts = [stories.encode(p) for p in dev_prompts[:2]]
    result = tune(stories, sg.PromptLookup(), prompts, depth=3, max_new_tokens=16)
    tree = tree_from_spec(result.dynamic_spec())
    out = sg.SpeculativeGenerator(stories, sg.DraftModel(stories, stories), tree=tree).generate(prompts[0], max_new_tokens=16)
    ref = stories.model.generate(torch.tensor([prompts[0]]), do_sample=False, max_new_tokens=16)[0, len(prompts[0]):].tolist()
    assert out.token_ids == ref


def test_tune_with_a_node_count_writes_the_most_valuable_tree_of_that_size(stories, dev_prompts, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    prompts = [stories.encode(p) for p in dev_prompts[:2]]
    result = tune(stories, sg.DraftModel(stories, stories), prompts, depth=3, max_new_tokens=16, nodes=5)
    assert len(result.best.choices) == 5
    assert result.best.choices == [list(p) for _, p in best_first_paths(result.acceptance, 5)]
    tree = StaticTree(result.static_spec()["choices"])
    out = sg.SpeculativeGenerator(stories, sg.DraftModel(stories, stories), tree=tree).generate(prompts[0], max_new_tokens=16)
    ref = stories.model.generate(torch.tensor([prompts[0]]), do_sample=False, max_new_tokens=16)[0, len(prompts[0]):].tolist()
    assert out.token_ids == ref
    with pytest.raises(ValueError, match="nodes must be >= 1"):
        tune(stories, sg.PromptLookup(), prompts, nodes=0)


def test_shortlist_keeps_the_predicted_fastest_tree_of_each_depth():
    a, b = TreeChoice([[0]], 1.6, 2.0, 1), TreeChoice([[0], [1]], 1.7, 2.5, 1)
    c, d = TreeChoice([[0], [0, 0]], 2.1, 3.0, 2), TreeChoice([[0], [0, 0], [1]], 2.2, 3.6, 2)
    plain = TreeChoice([], 1.0, 1.0, 0)
    assert shortlist([plain, a, b, c, d]) == [a, c]


def test_tree_spec_of_a_choice():
    choice = TreeChoice([[0], [1], [0, 0], [0, 1]], 2.0, 2.0, 2)
    assert tree_spec(choice, "dynamic") == {"kind": "dynamic", "top_k": 2, "depth": 2, "budget": 4}
    assert tree_spec(choice, "static") == {"kind": "static", "choices": [[0], [1], [0, 0], [0, 1]]}
    with pytest.raises(ValueError, match="tree kind must be"):
        tree_spec(choice, "spiral")


def test_a_dynamic_pick_that_is_one_top1_path_is_written_as_a_chain(tmp_path):
    path = TreeChoice([[0], [0, 0], [0, 0, 0]], 2.5, 2.0, 3)
    assert tree_spec(path, "dynamic") == {"kind": "chain", "depth": 3}
    assert tree_spec(path, "static") == {"kind": "static", "choices": [[0], [0, 0], [0, 0, 0]]}
    assert tree_spec(TreeChoice([[0], [1]], 1.8, 2.0, 1), "dynamic")["kind"] == "dynamic"
    (tmp_path / "c.json").write_text(json.dumps(tree_spec(path, "dynamic")))
    assert parse_tree_spec(str(tmp_path / "c.json")) == Chain(3)
    with pytest.raises(ValueError, match="a chain tree needs 'depth'"):
        tree_from_spec({"kind": "chain"})


def test_tune_keeps_the_fastest_timed_tree(stories, dev_prompts, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    prompts = [stories.encode(p) for p in dev_prompts[:2]]
    result = tune(stories, sg.DraftModel(stories, stories), prompts, depth=3, max_new_tokens=16, kind="static")
    trees = [tree for tree, _ in result.measured]
    assert trees[0] is None  # plain decoding is timed too
    assert trees[1:] == [tree_spec(c, "static") for c in shortlist(result.candidates)]
    fastest = max(result.measured[1:], key=lambda pair: pair[1])[0]
    assert result.spec() == fastest


def test_tune_tree_command_writes_the_spec_and_what_it_timed(stories, tmp_path, monkeypatch, capsys):
    from specgraft.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    out = tmp_path / "tree.json"
    argv = ["tune-tree", "--target", str(STORIES), "--drafter", "self", "--prompts", str(DEV_PROMPTS),
            "--limit", "2", "--max-new-tokens", "12", "--depth", "3", "--threads", "1", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["kind"] in ("dynamic", "chain") and report["timed"][0]["tree"] == "plain"
    chosen = {k: report[k] for k in ("kind", "top_k", "depth", "budget") if k in report}
    assert chosen in [t["tree"] for t in report["timed"][1:]]
    assert parse_tree_spec(str(out)) == tree_from_spec(chosen)
    assert "chosen:" in capsys.readouterr().out
