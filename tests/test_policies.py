"""Tree policies (Chain, StaticTree, parse_tree_spec) grown with a fake, deterministic drafter."""

from __future__ import annotations

import json
import math

import pytest
import torch

from specgraft.tree import Chain, Sampling, StaticTree, Tree, parse_tree_spec

# The fake drafter's next-token distribution, keyed by the current node's token (vocabulary of 5).
# No ties, so each row's ranking is unambiguous:
#   after 0: 1 (.60)  2 (.25)  3 (.07)  0 (.05)  4 (.03)
#   after 1: 2 (.70)  4 (.12)  0 (.10)  1 (.05)  3 (.03)
#   after 2: 3 (.50)  4 (.30)  2 (.10)  1 (.08)  0 (.02)
#   after 3: 4 (.45)  0 (.35)  1 (.11)  2 (.06)  3 (.03)
#   after 4: 0 (.55)  3 (.20)  1 (.15)  4 (.07)  2 (.03)
PROBS = torch.tensor(
    [
        [0.05, 0.60, 0.25, 0.07, 0.03],
        [0.10, 0.05, 0.70, 0.03, 0.12],
        [0.02, 0.08, 0.10, 0.50, 0.30],
        [0.35, 0.11, 0.06, 0.03, 0.45],
        [0.55, 0.15, 0.03, 0.20, 0.07],
    ]
)
LOGP = PROBS.log()


def lp(prev: int, token: int) -> float:
    """log q(token | prev) as the fake drafter reports it."""
    return math.log(PROBS[prev, token].item())


class FakeStep:
    """A step function that looks only at each frontier node's token, and records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[int]]] = []  # (nodes in the tree so far, frontier)

    def __call__(self, tree: Tree, frontier: torch.Tensor) -> torch.Tensor:
        self.calls.append((tree.num_nodes, frontier.tolist()))
        return LOGP[tree.tokens[frontier]]  # (F, V)


def assert_scores(tree: Tree, expected: list[float]) -> None:
    assert tree.scores.tolist() == pytest.approx(expected, abs=1e-5)


# --- Chain ----------------------------------------------------------------------------------


def test_chain_drafts_top1_tokens():
    tree = Chain(depth=3).grow(FakeStep(), root_token=0)
    assert tree.tokens.tolist() == [0, 1, 2, 3]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.depth.tolist() == [0, 1, 2, 3]
    assert tree.is_chain


def test_chain_scores_are_cumulative_log_probs():
    tree = Chain(depth=3).grow(FakeStep(), root_token=0)
    first = lp(0, 1)
    second = first + lp(1, 2)
    third = second + lp(2, 3)
    assert_scores(tree, [0.0, first, second, third])


def test_chain_steps_once_per_depth_from_the_last_node():
    step = FakeStep()
    Chain(depth=3).grow(step, root_token=0)
    assert step.calls == [(1, [0]), (2, [1]), (3, [2])]


def test_chain_max_depth_caps_growth():
    step = FakeStep()
    tree = Chain(depth=5).grow(step, root_token=4, max_depth=2)
    assert tree.tokens.tolist() == [4, 0, 1]
    assert len(step.calls) == 2


def test_chain_max_depth_above_depth_does_not_extend_it():
    tree = Chain(depth=2).grow(FakeStep(), root_token=0, max_depth=10)
    assert tree.num_nodes == 3


def test_chain_max_depth_zero_gives_root_only():
    step = FakeStep()
    tree = Chain(depth=3).grow(step, root_token=2, max_depth=0)
    assert tree.tokens.tolist() == [2]
    assert step.calls == []


def test_chain_reports_its_max_depth():
    assert Chain(depth=7).max_depth == 7


@pytest.mark.parametrize("depth", [0, -1])
def test_chain_rejects_depth_below_one(depth):
    with pytest.raises(ValueError, match="depth must be >= 1"):
        Chain(depth=depth)


# --- StaticTree -----------------------------------------------------------------------------

CHOICES = [[0], [1], [0, 0], [0, 1], [1, 0]]
#   root 0 ─┬─ [0] → 1 ─┬─ [0,0] → 2
#           │           └─ [0,1] → 4
#           └─ [1] → 2 ─── [1,0] → 3


def test_static_tree_tokens_parents_depths():
    tree = StaticTree(CHOICES).grow(FakeStep(), root_token=0)
    assert tree.tokens.tolist() == [0, 1, 2, 2, 4, 3]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2]


def test_static_tree_scores_are_cumulative_log_probs():
    tree = StaticTree(CHOICES).grow(FakeStep(), root_token=0)
    a, b = lp(0, 1), lp(0, 2)
    assert_scores(tree, [0.0, a, b, a + lp(1, 2), a + lp(1, 4), b + lp(2, 3)])


def test_static_tree_steps_once_per_depth_with_the_frontier():
    step = FakeStep()
    StaticTree(CHOICES).grow(step, root_token=0)
    # depth 1 expands the root; depth 2 expands both depth-1 nodes, in node order
    assert step.calls == [(1, [0]), (3, [1, 2])]


def test_static_tree_frontier_skips_nodes_without_children():
    step = FakeStep()
    tree = StaticTree([[0], [1], [2], [1, 0], [1, 0, 0]]).grow(step, root_token=0)
    assert step.calls == [(1, [0]), (4, [2]), (5, [4])]
    assert tree.tokens.tolist() == [0, 1, 2, 3, 3, 4]
    assert tree.parents.tolist() == [-1, 0, 0, 0, 2, 4]


def test_static_tree_order_of_choices_does_not_matter():
    shuffled = [[1, 0], [0, 1], [1], [0, 0], [0]]
    a = StaticTree(CHOICES).grow(FakeStep(), root_token=0)
    b = StaticTree(shuffled).grow(FakeStep(), root_token=0)
    assert a.tokens.tolist() == b.tokens.tolist()
    assert a.parents.tolist() == b.parents.tolist()


def test_static_tree_max_depth_caps_growth():
    step = FakeStep()
    tree = StaticTree(CHOICES).grow(step, root_token=0, max_depth=1)
    assert tree.tokens.tolist() == [0, 1, 2]
    assert tree.parents.tolist() == [-1, 0, 0]
    assert len(step.calls) == 1


def test_static_tree_max_depth_zero_gives_root_only():
    step = FakeStep()
    tree = StaticTree(CHOICES).grow(step, root_token=3, max_depth=0)
    assert tree.tokens.tolist() == [3]
    assert step.calls == []


def test_static_tree_reports_its_max_depth():
    assert StaticTree(CHOICES).max_depth == 2
    assert StaticTree([[0], [0, 0], [0, 0, 0]]).max_depth == 3


def seeded(seed: int) -> Sampling:
    """Sampling over the fake drafter's log-probs, no filters, with its own RNG."""
    return Sampling(temperature=1.0).seeded(seed)


def test_static_tree_top_k_keeps_gapped_ranks_by_rank():
    # after 0: ranks 0, 1, 2 are tokens 1, 2, 3; greedy decoding (no sampling) is top-k whatever the draw
    for draw, sampling in (("top-k", seeded(0)), ("sample-without-replacement", None)):
        tree = StaticTree([[0], [2], [2, 1]], draw=draw).grow(FakeStep(), root_token=0, sampling=sampling)
        assert tree.tokens.tolist() == [0, 1, 3, 0], draw  # after 3: rank 1 is token 0
        assert tree.parents.tolist() == [-1, 0, 0, 2], draw


@pytest.mark.parametrize("draw", ["sample", "sample-without-replacement"])
def test_static_tree_sampled_children_are_the_first_draws_in_rank_order(draw):
    # A sampled rank only orders siblings: gaps would keep a draw verified against the wrong q.
    for seed in range(20):
        gapped = StaticTree([[1], [3], [3, 2]], draw=draw).grow(FakeStep(), root_token=0, sampling=seeded(seed))
        dense = StaticTree([[0], [1], [1, 0]], draw=draw).grow(FakeStep(), root_token=0, sampling=seeded(seed))
        assert gapped.tokens.tolist() == dense.tokens.tolist(), seed
        assert gapped.parents.tolist() == dense.parents.tolist() == [-1, 0, 0, 2]
        assert torch.equal(gapped.q, dense.q)


def test_static_tree_without_replacement_drops_the_subtrees_of_draws_q_cannot_make():
    # After 0, q has one token once the fake drafter's log-probs are cut to their top 1.
    class TopOne(Sampling):
        def probs(self, logits):
            return torch.zeros_like(logits).scatter(-1, logits.argmax(-1, keepdim=True), 1.0)

    tree = StaticTree([[0], [1], [1, 0]], draw="sample-without-replacement").grow(
        FakeStep(), root_token=0, sampling=TopOne(temperature=1.0).seeded(0)
    )
    assert tree.tokens.tolist() == [0, 1]
    assert tree.parents.tolist() == [-1, 0]


def test_static_tree_rejects_path_without_its_prefix():
    with pytest.raises(ValueError, match=r"without its prefix \[1\]"):
        StaticTree([[0], [1, 0]])


def test_static_tree_rejects_no_paths():
    with pytest.raises(ValueError, match="at least one path"):
        StaticTree([])


def test_static_tree_rejects_empty_path():
    with pytest.raises(ValueError, match="non-empty"):
        StaticTree([[0], []])


def test_static_tree_rejects_negative_rank():
    with pytest.raises(ValueError, match=">= 0"):
        StaticTree([[0], [-1]])


def test_static_tree_from_file_reads_a_json_list(tmp_path):
    path = tmp_path / "tree.json"
    path.write_text(json.dumps(CHOICES))
    assert StaticTree.from_file(path) == StaticTree(CHOICES)


def test_static_tree_from_file_reads_a_choices_object(tmp_path):
    path = tmp_path / "tree.json"
    path.write_text(json.dumps({"choices": CHOICES}))
    assert StaticTree.from_file(str(path)) == StaticTree(CHOICES)


def test_static_tree_from_file_names_a_missing_file(tmp_path):
    path = tmp_path / "absent.json"
    with pytest.raises(FileNotFoundError, match="absent.json"):
        StaticTree.from_file(path)


def test_static_tree_from_file_names_a_file_with_bad_json(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("[[0], [1")
    with pytest.raises(ValueError, match="broken.json is not valid JSON"):
        StaticTree.from_file(path)


@pytest.mark.parametrize("content", [{"paths": [[0]]}, [0, 1], "[[0]]"])
def test_static_tree_from_file_rejects_json_that_is_not_a_list_of_paths(tmp_path, content):
    path = tmp_path / "odd.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match="must hold a list of paths"):
        StaticTree.from_file(path)


# --- parse_tree_spec ------------------------------------------------------------------------


def test_parse_chain_spec():
    assert parse_tree_spec("chain:5") == Chain(depth=5)


def test_parse_static_spec(tmp_path):
    path = tmp_path / "tree.json"
    path.write_text(json.dumps(CHOICES))
    assert parse_tree_spec(f"static:{path}") == StaticTree(CHOICES)


def test_parse_static_spec_with_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        parse_tree_spec(f"static:{tmp_path / 'absent.json'}")


@pytest.mark.parametrize("spec", ["foo", "chain:x", "chain:", "chain", "chain:-1", "static:", "dynamic:8"])
def test_parse_rejects_unknown_specs(spec):
    with pytest.raises(ValueError, match="unknown tree spec"):
        parse_tree_spec(spec)


def test_parse_chain_of_depth_zero_is_an_error():
    with pytest.raises(ValueError, match="depth must be >= 1"):
        parse_tree_spec("chain:0")


# --- growing several trees together -----------------------------------------------------------


def test_grow_together_asks_once_per_level_and_each_tree_equals_growing_it_alone():
    from specgraft.tree import DynamicTree, grow_together

    policies = [Chain(depth=3), StaticTree(CHOICES), DynamicTree(top_k=2, depth=2, budget=4), Chain(depth=1)]
    roots = [0, 2, 4, 1]
    calls: list[list[int]] = []

    def step_all(asked):
        calls.append([i for i, _, _ in asked])
        return [LOGP[tree.tokens[frontier]] for _, tree, frontier in asked]

    together = grow_together([p.levels(r) for p, r in zip(policies, roots)], step_all)
    assert calls == [[0, 1, 2, 3], [0, 1, 2], [0]]  # the depth-1 chain stops after level 1, the others after theirs
    for policy, root, tree in zip(policies, roots, together):
        alone = policy.grow(FakeStep(), root_token=root)
        assert tree.tokens.tolist() == alone.tokens.tolist() and tree.parents.tolist() == alone.parents.tolist()
        assert tree.scores.tolist() == alone.scores.tolist()


def test_a_growth_of_depth_zero_returns_the_root_without_asking():
    from specgraft.tree import grow_together

    (tree,) = grow_together([Chain(depth=3).levels(7, max_depth=0)], lambda asked: pytest.fail("asked for a level"))
    assert tree.tokens.tolist() == [7]


@pytest.mark.parametrize("choices", [[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]], [[0], [0, 0], [0, 0, 0]],
                                     [[1], [0], [1, 2], [1, 2, 0]]], ids=["branching", "chain", "gapped ranks"])
def test_static_trees_grown_by_depth_for_all_rows_equal_each_rows_tree_grown_alone(choices):
    """A drafter whose depths do not depend on the parent (Medusa, DFlash): `grow_by_depth` grows every row's top-k
    static tree at once (`grow_static`); each row's tree equals the one `StaticTree.grow` grows for it alone, rows of
    different depths included."""
    from specgraft.heads.base import DraftRequest, grow_by_depth

    rows, depth, vocab = 4, 3, 11
    logp = torch.randn(rows, depth, vocab, generator=torch.Generator().manual_seed(0)).log_softmax(-1)  # (R, D, V)
    policy = StaticTree(choices)
    requests = [DraftRequest(None, 3 + r, policy, max_depth, None, r) for r, max_depth in enumerate((3, 1, 2, 3))]
    together = grow_by_depth(requests, logp)
    for request, row_logp, tree in zip(requests, logp, together):
        alone = policy.grow(lambda t, frontier, row_logp=row_logp: row_logp[t.depth[frontier]], request.root_token,
                            max_depth=min(request.max_depth, policy.max_depth))
        assert tree.tokens.tolist() == alone.tokens.tolist() and tree.parents.tolist() == alone.parents.tolist()
        assert tree.depth.tolist() == alone.depth.tolist()
        assert torch.equal(tree.ancestor_mask(), alone.ancestor_mask())
        assert torch.allclose(tree.scores, alone.scores)
