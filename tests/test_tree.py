"""Tree, masks and positions: hand-drawn 4-node trees, then properties of random trees."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specgraft.tree import ROOT_PARENT, Tree, tree_attention_mask, tree_position_ids
from specgraft.tree.tree import ANCESTOR_BITS

# Hand-drawn trees. Node tokens are 10 + index so tokens and indices never coincide.
#
#   fork:  0 ─┬─ 1 ── 3        chain: 0 ── 1 ── 2 ── 3
#             └─ 2


def make_tree(parents: list[int], tokens: list[int] | None = None, q: torch.Tensor | None = None) -> Tree:
    """A tree from its parent list (parents-first), depths computed by walking up."""
    depth = []
    for i, p in enumerate(parents):
        depth.append(0 if i == 0 else depth[p] + 1)
    n = len(parents)
    return Tree(
        tokens=torch.tensor(tokens if tokens is not None else [10 + i for i in range(n)]),
        parents=torch.tensor(parents),
        depth=torch.tensor(depth),
        scores=torch.zeros(n),
        q=q,
    )


@pytest.fixture
def fork() -> Tree:
    return make_tree([ROOT_PARENT, 0, 0, 1])


@pytest.fixture
def chain() -> Tree:
    return make_tree([ROOT_PARENT, 0, 1, 2])


def as_lists(tensors: list[torch.Tensor]) -> list[list[int]]:
    return [t.tolist() for t in tensors]


# --- hand-drawn: the fork -------------------------------------------------------------------


def test_fork_ancestor_mask(fork):
    expected = torch.tensor(
        [
            [1, 0, 0, 0],  # root sees itself
            [1, 1, 0, 0],  # 1: root, itself
            [1, 0, 1, 0],  # 2: root, itself (not its sibling 1)
            [1, 1, 0, 1],  # 3: root, 1, itself (not 2)
        ],
        dtype=torch.bool,
    )
    assert torch.equal(fork.ancestor_mask(), expected)


def test_fork_leaves(fork):
    assert fork.leaves().tolist() == [2, 3]


def test_fork_paths(fork):
    assert as_lists(fork.paths()) == [[0, 2], [0, 1, 3]]


def test_fork_path_to(fork):
    assert fork.path_to(0).tolist() == [0]
    assert fork.path_to(1).tolist() == [0, 1]
    assert fork.path_to(2).tolist() == [0, 2]
    assert fork.path_to(3).tolist() == [0, 1, 3]


def test_fork_children(fork):
    assert fork.children(0).tolist() == [1, 2]
    assert fork.children(1).tolist() == [3]
    assert fork.children(2).tolist() == []
    assert fork.children(3).tolist() == []


def test_fork_is_not_chain(fork):
    assert fork.is_chain is False


def test_fork_max_depth(fork):
    assert fork.max_depth == 2


def test_fork_counts(fork):
    assert fork.num_nodes == 4
    assert fork.num_draft_tokens == 3


def test_fork_attention_mask_with_prefix(fork):
    lo = torch.finfo(torch.float32).min
    expected = torch.tensor(
        [
            # prefix   tree: 0    1    2    3
            [0.0, 0.0, 0.0, lo, lo, lo],
            [0.0, 0.0, 0.0, 0.0, lo, lo],
            [0.0, 0.0, 0.0, lo, 0.0, lo],
            [0.0, 0.0, 0.0, 0.0, lo, 0.0],
        ]
    )[None, None]
    mask = tree_attention_mask(fork, prefix_len=2, dtype=torch.float32)
    assert mask.dtype == torch.float32
    assert torch.equal(mask, expected)


def test_fork_position_ids(fork):
    assert tree_position_ids(fork, prefix_len=7).tolist() == [[7, 8, 8, 9]]


# --- hand-drawn: the chain ------------------------------------------------------------------


def test_chain_ancestor_mask_is_lower_triangular(chain):
    expected = torch.tensor(
        [
            [1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 0],
            [1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(chain.ancestor_mask(), expected)


def test_chain_leaves(chain):
    assert chain.leaves().tolist() == [3]


def test_chain_paths(chain):
    assert as_lists(chain.paths()) == [[0, 1, 2, 3]]


def test_chain_path_to(chain):
    assert chain.path_to(2).tolist() == [0, 1, 2]


def test_chain_children(chain):
    assert [chain.children(i).tolist() for i in range(4)] == [[1], [2], [3], []]


def test_chain_is_chain(chain):
    assert chain.is_chain is True


def test_chain_max_depth(chain):
    assert chain.max_depth == 3


def test_chain_position_ids(chain):
    assert tree_position_ids(chain, prefix_len=0).tolist() == [[0, 1, 2, 3]]


def test_star_is_not_chain():
    # root with three children: every node's parent is 0, not i - 1
    assert make_tree([ROOT_PARENT, 0, 0, 0]).is_chain is False


# --- root only ------------------------------------------------------------------------------


def test_root_only_tree():
    tree = Tree.root_only(42)
    assert tree.tokens.tolist() == [42]
    assert tree.num_nodes == 1
    assert tree.num_draft_tokens == 0
    assert tree.max_depth == 0
    assert tree.is_chain is True
    assert tree.leaves().tolist() == [0]
    assert as_lists(tree.paths()) == [[0]]
    assert torch.equal(tree.ancestor_mask(), torch.tensor([[True]]))


def test_root_only_mask_sees_prefix_and_itself():
    mask = tree_attention_mask(Tree.root_only(3), prefix_len=3, dtype=torch.float16)
    assert mask.shape == (1, 1, 1, 4)
    assert torch.equal(mask, torch.zeros(1, 1, 1, 4, dtype=torch.float16))


# --- validation -----------------------------------------------------------------------------


def test_rejects_parent_stored_after_child():
    with pytest.raises(ValueError, match="parents-first"):
        Tree(
            tokens=torch.tensor([0, 1, 2]),
            parents=torch.tensor([ROOT_PARENT, 2, 0]),  # node 1's parent is node 2
            depth=torch.tensor([0, 2, 1]),
            scores=torch.zeros(3),
        )


def test_rejects_node_that_is_its_own_parent():
    with pytest.raises(ValueError, match="parents-first"):
        Tree(
            tokens=torch.tensor([0, 1]),
            parents=torch.tensor([ROOT_PARENT, 1]),
            depth=torch.tensor([0, 1]),
            scores=torch.zeros(2),
        )


@pytest.mark.parametrize("root_parent", [0, 1, -2])
def test_rejects_root_with_wrong_parent(root_parent):
    with pytest.raises(ValueError, match="root"):
        Tree(
            tokens=torch.tensor([0, 1]),
            parents=torch.tensor([root_parent, 0]),
            depth=torch.tensor([0, 1]),
            scores=torch.zeros(2),
        )


def test_rejects_second_root():
    with pytest.raises(ValueError, match="root"):
        Tree(
            tokens=torch.tensor([0, 1, 2]),
            parents=torch.tensor([ROOT_PARENT, 0, ROOT_PARENT]),
            depth=torch.tensor([0, 1, 0]),
            scores=torch.zeros(3),
        )


def test_rejects_empty_tree():
    with pytest.raises(ValueError, match="root"):
        Tree(
            tokens=torch.zeros(0, dtype=torch.long),
            parents=torch.zeros(0, dtype=torch.long),
            depth=torch.zeros(0, dtype=torch.long),
            scores=torch.zeros(0),
        )


@pytest.mark.parametrize("field", ["parents", "depth", "scores"])
def test_rejects_field_with_wrong_length(field):
    fields = dict(
        tokens=torch.tensor([0, 1, 2]),
        parents=torch.tensor([ROOT_PARENT, 0, 0]),
        depth=torch.tensor([0, 1, 1]),
        scores=torch.zeros(3),
    )
    fields[field] = fields[field][:2]
    with pytest.raises(ValueError, match=f"Tree.{field} has shape"):
        Tree(**fields)


def test_rejects_q_with_wrong_rows():
    with pytest.raises(ValueError, match="Tree.q has 3 rows for 4 nodes"):
        make_tree([ROOT_PARENT, 0, 0, 1], q=torch.full((3, 5), 0.2))


def test_accepts_q_with_one_row_per_node():
    tree = make_tree([ROOT_PARENT, 0, 0, 1], q=torch.full((4, 5), 0.2))
    assert tree.q.shape == (4, 5)


# --- properties of random trees -------------------------------------------------------------

MAX_NODES = 16
VOCAB = 50


@st.composite
def random_trees(draw) -> Tree:
    """Any tree of up to MAX_NODES nodes stored parents-first, with random tokens."""
    n = draw(st.integers(min_value=1, max_value=MAX_NODES))
    parents = [ROOT_PARENT] + [draw(st.integers(min_value=0, max_value=i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
    return make_tree(parents, tokens)


def naive_ancestors(tree: Tree, node: int) -> list[int]:
    """The node and its ancestors, root first, by walking up the parent pointers."""
    chain = [node]
    while tree.parents[chain[-1]].item() != ROOT_PARENT:
        chain.append(int(tree.parents[chain[-1]]))
    return chain[::-1]


def naive_leaves(tree: Tree) -> list[int]:
    parents = set(tree.parents.tolist())
    return [i for i in range(tree.num_nodes) if i not in parents]


@settings(deadline=None)
@given(random_trees())
def test_every_node_sees_exactly_its_ancestors_and_itself(tree):
    n = tree.num_nodes
    expected = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        expected[i, naive_ancestors(tree, i)] = True
    assert torch.equal(tree.ancestor_mask(), expected)


@settings(deadline=None, max_examples=30)
@given(st.data())
def test_ancestor_masks_are_exact_on_both_sides_of_the_bit_width(data):
    """Trees of up to `ANCESTOR_BITS` nodes derive the mask from one int64 a node, larger ones by matrix products:
    both give exactly each node's ancestors, the chain filling every bit included."""
    n = data.draw(st.integers(min_value=ANCESTOR_BITS - 2, max_value=ANCESTOR_BITS + 2))
    chain = data.draw(st.booleans())
    parents = [ROOT_PARENT] + [i - 1 if chain else data.draw(st.integers(0, i - 1)) for i in range(1, n)]
    tree = make_tree(parents, [0] * n)
    expected = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        expected[i, naive_ancestors(tree, i)] = True
    assert torch.equal(tree.ancestor_mask(), expected)


@settings(deadline=None)
@given(
    random_trees(),
    st.integers(min_value=0, max_value=20),
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
)
def test_additive_mask_is_zero_exactly_where_visible(tree, prefix_len, dtype):
    n = tree.num_nodes
    mask = tree_attention_mask(tree, prefix_len, dtype)
    assert mask.shape == (1, 1, n, prefix_len + n)
    assert mask.dtype == dtype
    visible = torch.zeros(n, prefix_len + n, dtype=torch.bool)
    visible[:, :prefix_len] = True  # the committed prefix is fully visible
    for i in range(n):
        visible[i, [prefix_len + j for j in naive_ancestors(tree, i)]] = True
    expected = torch.where(visible, torch.tensor(0.0, dtype=dtype), torch.tensor(torch.finfo(dtype).min, dtype=dtype))
    assert torch.equal(mask[0, 0], expected)


@settings(deadline=None)
@given(random_trees(), st.integers(min_value=0, max_value=100))
def test_positions_are_prefix_plus_depth(tree, prefix_len):
    expected = [[prefix_len + len(naive_ancestors(tree, i)) - 1 for i in range(tree.num_nodes)]]
    assert tree_position_ids(tree, prefix_len).tolist() == expected


@settings(deadline=None)
@given(random_trees())
def test_leaves_are_the_nodes_without_children(tree):
    assert tree.leaves().tolist() == naive_leaves(tree)


@settings(deadline=None)
@given(random_trees())
def test_paths_reconstruct_the_tokens_of_each_leaf(tree):
    paths = tree.paths()
    assert len(paths) == len(naive_leaves(tree))
    for path, leaf in zip(paths, naive_leaves(tree)):
        walk = naive_ancestors(tree, leaf)
        assert path.tolist() == walk
        assert tree.tokens[path].tolist() == tree.tokens[walk].tolist()


@settings(deadline=None)
@given(random_trees())
def test_every_node_lies_on_some_path(tree):
    on_a_path = set()
    for path in tree.paths():
        on_a_path.update(path.tolist())
    assert on_a_path == set(range(tree.num_nodes))


@settings(deadline=None)
@given(random_trees())
def test_path_to_matches_the_walk_up_the_parents(tree):
    for i in range(tree.num_nodes):
        assert tree.path_to(i).tolist() == naive_ancestors(tree, i)


@settings(deadline=None)
@given(random_trees())
def test_children_are_the_nodes_naming_their_parent(tree):
    for i in range(tree.num_nodes):
        assert tree.children(i).tolist() == [j for j in range(1, tree.num_nodes) if int(tree.parents[j]) == i]


@settings(deadline=None)
@given(random_trees())
def test_is_chain_iff_every_parent_is_the_previous_node(tree):
    expected = all(int(tree.parents[i]) == i - 1 for i in range(1, tree.num_nodes))
    assert tree.is_chain is expected
