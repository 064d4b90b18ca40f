"""EAGLE-2 dynamic trees: invariants on random drafters, and exactness through the engine."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specgraft as sg
from specgraft.tree import DynamicTree, Tree, parse_tree_spec
from specgraft.tree.dynamic import rerank, subtree

VOCAB = 12


def random_step(seed: int):
    """A drafter whose distribution depends on the node's whole path (hashed), reproducibly."""

    def step(tree: Tree, frontier: torch.Tensor) -> torch.Tensor:
        rows = []
        for node in frontier.tolist():
            path = tuple(tree.tokens[tree.path_to(node)].tolist())
            gen = torch.Generator().manual_seed(hash((seed, path)) % 2**31)
            rows.append((torch.randn(VOCAB, generator=gen) * 2).log_softmax(-1))
        return torch.stack(rows)

    return step


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    top_k=st.integers(1, 4),
    depth=st.integers(1, 5),
    budget=st.integers(1, 30),
)
def test_dynamic_tree_invariants(seed, top_k, depth, budget):
    tree = DynamicTree(top_k=top_k, depth=depth, budget=budget).grow(random_step(seed), root_token=0)
    assert tree.num_draft_tokens <= budget
    assert tree.max_depth <= depth
    # Connected: every kept node's parent is kept (Tree validates parents-first, non-negative parents).
    assert int(tree.parents[0]) == -1 and bool((tree.parents[1:] >= 0).all())
    assert bool((tree.depth[1:] == tree.depth[tree.parents[1:]] + 1).all())
    # Scores never increase along a path.
    assert bool((tree.scores[1:] <= tree.scores[tree.parents[1:]] + 1e-6).all())
    for node in range(tree.num_nodes):
        assert tree.children(node).numel() <= top_k


def test_dynamic_tree_keeps_the_best_nodes_of_the_full_expansion():
    policy = DynamicTree(top_k=3, depth=3, budget=7)
    full = DynamicTree(top_k=3, depth=3, budget=10_000).grow(random_step(5), root_token=0)
    kept = policy.grow(random_step(5), root_token=0)
    best = sorted(full.scores[1:].tolist(), reverse=True)[:7]
    assert sorted(kept.scores[1:].tolist(), reverse=True) == best


def test_dynamic_tree_expands_only_the_top_k_frontier():
    calls = []
    step = random_step(1)

    def counting(tree, frontier):
        calls.append(frontier.numel())
        return step(tree, frontier)

    DynamicTree(top_k=4, depth=3, budget=100).grow(counting, root_token=0)
    assert calls == [1, 4, 4]


def test_rerank_prefers_parents_on_ties():
    tree = Tree(
        tokens=torch.tensor([0, 1, 2, 3]),
        parents=torch.tensor([-1, 0, 1, 0]),
        depth=torch.tensor([0, 1, 2, 1]),
        scores=torch.tensor([0.0, -1.0, -1.0, -1.0]),  # node 2 ties its parent
    )
    kept = rerank(tree, 2)
    assert kept.tokens.tolist() == [0, 1, 3]


def test_subtree_refuses_an_orphan():
    tree = Tree(tokens=torch.tensor([0, 1, 2]), parents=torch.tensor([-1, 0, 1]), depth=torch.tensor([0, 1, 2]), scores=torch.zeros(3))
    try:
        subtree(tree, torch.tensor([0, 2]))
    except ValueError as err:
        assert "parent" in str(err)
    else:
        raise AssertionError("an orphaned node was kept")


@settings(max_examples=60, deadline=None)
@given(parents=st.lists(st.integers(0, 10_000), min_size=1, max_size=14), picks=st.lists(st.booleans(), min_size=15, max_size=15),
       with_q=st.booleans(), prefix=st.integers(0, 15))
def test_subtree_keeps_exactly_the_kept_nodes_reindexed(parents, picks, with_q, prefix):
    """Any kept set closed under parents, the first nodes (a chain's cut, taken as views) as any other: tokens,
    parents, depths, scores, q and ancestor masks are those of the kept nodes, re-indexed in order."""
    parents = [-1] + [p % (i + 1) for i, p in enumerate(parents)]  # node i + 1's parent among 0..i
    n = len(parents)
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    tree = Tree(tokens=torch.arange(n) * 7 + 3, parents=torch.tensor(parents), depth=torch.tensor(depth),
                scores=-torch.arange(n, dtype=torch.float32) / 3, q=torch.rand(n, 5) if with_q else None)
    kept = list(range(min(prefix, n) or 1)) if prefix % 2 else [0]
    if not prefix % 2:
        for i in range(1, n):  # nodes whose parent is kept, as chosen
            if picks[i] and parents[i] in kept:
                kept.append(i)
    for source in (tree, Tree(tree.tokens, tree.parents, tree.depth, tree.scores, tree.q, ancestors=tree.ancestor_mask())):
        cut = subtree(source, kept)
        index = {old: new for new, old in enumerate(kept)}
        assert cut.tokens.tolist() == [int(tree.tokens[i]) for i in kept]
        assert cut.parent_list == [-1] + [index[parents[i]] for i in kept[1:]]
        assert cut.depth.tolist() == cut.depth_list == [depth[i] for i in kept]
        assert cut.scores.tolist() == [float(tree.scores[i]) for i in kept]
        assert cut.q is None if not with_q else torch.equal(cut.q, tree.q[kept])
        rebuilt = Tree(cut.tokens.clone(), cut.parents.clone(), cut.depth.clone(), cut.scores.clone())
        assert torch.equal(cut.ancestor_mask(), rebuilt.ancestor_mask())


def random_tree(rng, n: int) -> Tree:
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    return Tree(tokens=torch.tensor(rng.integers(0, 100, n)), parents=torch.tensor(parents), depth=torch.tensor(depth),
                scores=-torch.tensor(rng.random(n), dtype=torch.float32))


def closed_set(rng, tree: Tree) -> list[int]:
    kept = [0]
    for i in range(1, tree.num_nodes):
        if tree.parent_list[i] in kept and rng.random() < 0.6:
            kept.append(i)
    return kept


@pytest.mark.parametrize("read_first", [False, True], ids=["lists-unread", "lists-read"])
def test_cutting_many_trees_at_once_equals_cutting_each_alone_with_one_copy_to_the_device(read_first):
    """`cut_trees` (a step's cuts, the controller's) stages every general cut's lists in one copy and gathers tokens
    and scores for all at once; each cut equals `subtree`'s of its tree alone, its host lists included."""
    import numpy as np

    from specgraft.tree import cut_trees, read_lists

    rng = np.random.default_rng(0)
    trees = [random_tree(rng, int(rng.integers(1, 14))) for _ in range(12)]
    keeps = [closed_set(rng, t) for t in trees]
    keeps[0] = list(range(trees[0].num_nodes))  # a cut to the first nodes: views
    if read_first:
        read_lists(trees)
        assert all(t.score_list == t.scores.tolist() and t.parent_list == t.parents.tolist() for t in trees)
    copies = []

    def stage(device, *lists):
        copies.append(lists)
        flat = torch.tensor([x for values in lists for x in values], dtype=torch.long, device=device)
        return list(flat.split([len(values) for values in lists]))

    cuts = cut_trees(list(zip(trees, keeps)), stage)
    assert len(copies) == 1
    for tree, kept, cut in zip(trees, keeps, cuts):
        alone = subtree(tree, kept)
        for name in ("tokens", "parents", "depth", "scores"):
            assert torch.equal(getattr(cut, name), getattr(alone, name)), name
        assert cut.parent_list == alone.parent_list and cut.depth_list == alone.depth_list
        assert cut.score_list == alone.scores.tolist()
        assert torch.equal(cut.ancestor_mask(), alone.ancestor_mask())


def test_parse_dynamic_spec():
    assert parse_tree_spec("dynamic:8,6,48") == DynamicTree(top_k=8, depth=6, budget=48)


def test_dynamic_tree_keeps_greedy_output_identical(stories, dev_prompts):
    gen = sg.SpeculativeGenerator(stories, sg.DraftModel(stories, stories), tree=DynamicTree(top_k=4, depth=5, budget=20))
    for prompt in dev_prompts[:4]:
        ids = stories.encode(prompt)
        ref = stories.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=64)[0, len(ids):].tolist()
        out = gen.generate(ids, max_new_tokens=64)
        assert out.token_ids == ref
        assert out.stats.mean_accepted_length > 5.0  # the target drafting for itself: every chain accepted


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), top_k=st.integers(1, 4), depth=st.integers(1, 5), budget=st.integers(1, 30))
def test_builder_ancestors_equal_a_fresh_computation(seed, top_k, depth, budget):
    """Trees from the builder skip validation and carry an incrementally grown mask: both must be right."""
    grown = DynamicTree(top_k=top_k, depth=depth, budget=10_000).grow(random_step(seed), root_token=0)
    fresh = Tree(tokens=grown.tokens, parents=grown.parents, depth=grown.depth, scores=grown.scores)  # validates
    assert torch.equal(grown.ancestor_mask(), fresh.ancestor_mask())
    kept = DynamicTree(top_k=top_k, depth=depth, budget=budget).grow(random_step(seed), root_token=0)
    assert torch.equal(kept.ancestor_mask(), Tree(kept.tokens, kept.parents, kept.depth, kept.scores).ancestor_mask())
