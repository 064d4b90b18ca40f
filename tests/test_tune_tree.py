"""Hardware-aware tree sizing: the selection maths on hand-made inputs, and the measurements on a real target."""

from __future__ import annotations

import json

import pytest
import torch

import specgraft as sg
from specgraft.infer.tune import measure_acceptance, measure_verify_cost, tune
from specgraft.tree import DynamicTree, StaticTree, parse_tree_spec
from specgraft.tree.optimize import best_first_paths, interpolate, size_tree

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


def test_tune_returns_a_runnable_tree(stories, dev_prompts, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    prompts = [stories.encode(p) for p in dev_prompts[:2]]
    result = tune(stories, sg.PromptLookup(), prompts, depth=3, max_new_tokens=16)
    tree = DynamicTree(**{k: v for k, v in result.dynamic_spec().items() if k != "kind"})
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
