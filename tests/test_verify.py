"""Greedy tree verification on hand-built trees and logits, and the prompt-lookup drafter's tries."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specgraft.heads.prompt_lookup import PromptLookup
from specgraft.infer.verify import greedy_accept, greedy_accept_chains, greedy_accept_packed, greedy_accept_tree
from specgraft.tree import ROOT_PARENT, Tree

VOCAB = 10


def make_tree(parents: list[int], tokens: list[int]) -> Tree:
    depth = []
    for i, p in enumerate(parents):
        depth.append(0 if i == 0 else depth[p] + 1)
    return Tree(
        tokens=torch.tensor(tokens),
        parents=torch.tensor(parents),
        depth=torch.tensor(depth),
        scores=torch.zeros(len(tokens)),
    )


def target_logits(argmax: list[int], vocab: int = VOCAB) -> torch.Tensor:
    """(N, V) logits whose argmax at node i is ``argmax[i]`` (runner-up tokens get distinct smaller values)."""
    logits = torch.linspace(-1.0, 0.0, vocab).repeat(len(argmax), 1)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    return logits


# --- greedy_accept --------------------------------------------------------------------------


@st.composite
def random_tree_and_choices(draw, max_nodes: int = 12):
    """A random parents-first tree over a 3-token vocabulary (so paths often match) and the target's choices."""
    n = draw(st.integers(1, max_nodes))
    parents = [ROOT_PARENT] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    choices = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    return make_tree(parents, tokens), choices


@settings(max_examples=60, deadline=None)
@given(st.lists(random_tree_and_choices(), min_size=1, max_size=5), st.integers(0, 3))
def test_packed_greedy_acceptance_equals_each_tree_alone(cases, extra_width):
    """Trees packed one after another, decided together on the device: each one's path, next token and path tokens
    are `greedy_accept`'s for that tree alone (ties between equal-depth survivors resolved alike)."""
    trees = [tree for tree, _ in cases]
    width = 1 + max(t.max_depth for t in trees) + extra_width  # the tightest width the engine passes, and wider
    result = greedy_accept_packed(torch.cat([t.tokens for t in trees]), torch.cat([t.parents for t in trees]),
                                  torch.cat([t.depth for t in trees]), torch.tensor([c for _, cs in cases for c in cs]),
                                  len(trees), width)
    assert result.shape == (len(trees), 2 + 2 * width)
    alone = [greedy_accept_tree(tree, torch.tensor(choices), width) for tree, choices in cases]  # the lone row's form
    assert torch.equal(torch.stack(alone), result)
    for (tree, choices), row in zip(cases, result.tolist()):
        alone = greedy_accept(tree, target_logits(choices))
        count = row[0]
        assert row[2 : 2 + count] == alone.path.tolist()
        assert row[1] == alone.next_token
        assert row[2 + width : 2 + width + count] == tree.tokens[alone.path].tolist()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(2, 6), st.data())
def test_chains_of_one_length_accept_as_packed_trees_do(rows, n, data):
    """`greedy_accept_chains` (the step's form for chains of one length) gives `greedy_accept_packed`'s rows."""
    tokens = torch.tensor(data.draw(st.lists(st.integers(0, 2), min_size=rows * n, max_size=rows * n))).view(rows, n)
    choice = torch.tensor(data.draw(st.lists(st.integers(0, 2), min_size=rows * n, max_size=rows * n))).view(rows, n)
    chain = make_tree([ROOT_PARENT, *range(n - 1)], [0] * n)
    packed = greedy_accept_packed(tokens.flatten(), chain.parents.repeat(rows), chain.depth.repeat(rows), choice.flatten(),
                                  rows, n)
    assert torch.equal(greedy_accept_chains(tokens, choice), packed)


def test_accepts_a_whole_chain_and_adds_the_bonus_token():
    #   0:9 ── 1:1 ── 2:2 ── 3:3          target: 9→1, 1→2, 2→3, 3→4
    tree = make_tree([ROOT_PARENT, 0, 1, 2], [9, 1, 2, 3])
    result = greedy_accept(tree, target_logits([1, 2, 3, 4]))
    assert result.path.tolist() == [0, 1, 2, 3]
    assert result.next_token == 4


def test_rejection_at_depth_one_keeps_the_root_and_corrects():
    #   0:9 ── 1:1 ── 2:2                 target after root says 7, not 1
    tree = make_tree([ROOT_PARENT, 0, 1], [9, 1, 2])
    result = greedy_accept(tree, target_logits([7, 2, 3]))
    assert result.path.tolist() == [0]
    assert result.next_token == 7


def test_rejection_mid_chain_stops_there_and_corrects():
    #   0:9 ── 1:1 ── 2:2 ── 3:3          target: 9→1, 1→5 (rejects node 2)
    tree = make_tree([ROOT_PARENT, 0, 1, 2], [9, 1, 2, 3])
    result = greedy_accept(tree, target_logits([1, 5, 3, 4]))
    assert result.path.tolist() == [0, 1]
    assert result.next_token == 5


def test_root_only_tree_commits_the_target_token():
    result = greedy_accept(Tree.root_only(9), target_logits([6]))
    assert result.path.tolist() == [0]
    assert result.next_token == 6


def test_picks_the_deeper_of_two_matching_branches():
    #   0:9 ── 1:1 ─┬─ 2:2                target: 9→1, 1→3, 3→4, 4→6
    #               └─ 3:3 ── 4:4
    # both branches match through node 1; only the lower one matches further
    tree = make_tree([ROOT_PARENT, 0, 1, 1, 3], [9, 1, 2, 3, 4])
    result = greedy_accept(tree, target_logits([1, 3, 0, 4, 6]))
    assert result.path.tolist() == [0, 1, 3, 4]
    assert result.next_token == 6


def test_picks_the_deeper_branch_when_it_is_stored_first():
    #   0:9 ── 1:1 ─┬─ 2:3 ── 3:4         same shape, the matching branch stored before the dead end
    #               └─ 4:2
    tree = make_tree([ROOT_PARENT, 0, 1, 2, 1], [9, 1, 3, 4, 2])
    result = greedy_accept(tree, target_logits([1, 3, 4, 6, 0]))
    assert result.path.tolist() == [0, 1, 2, 3]
    assert result.next_token == 6


def test_branch_matching_only_below_a_rejected_node_is_not_accepted():
    #   0:9 ─┬─ 1:1                       target: 9→1 (node 1 accepted, a leaf), 1→8
    #        └─ 2:2 ── 3:3 ── 4:4         node 2 rejected, though 3 and 4 match the target below it
    tree = make_tree([ROOT_PARENT, 0, 0, 2, 3], [9, 1, 2, 3, 4])
    result = greedy_accept(tree, target_logits([1, 8, 3, 4, 5]))
    assert result.path.tolist() == [0, 1]
    assert result.next_token == 8


def test_only_the_sibling_equal_to_the_target_token_is_accepted():
    #   0:9 ─┬─ 1:1                       siblings have distinct tokens: only 2 equals the argmax
    #        ├─ 2:2
    #        └─ 3:3
    tree = make_tree([ROOT_PARENT, 0, 0, 0], [9, 1, 2, 3])
    result = greedy_accept(tree, target_logits([2, 5, 6, 7]))
    assert result.path.tolist() == [0, 2]
    assert result.next_token == 6


def test_next_token_is_read_from_logits_at_the_last_accepted_node():
    # the bonus comes from the accepted leaf's row, not from the last row of the tree
    #   0:9 ─┬─ 1:1 ── 2:2                target: 9→3, 3→7; the rows of 1 and 2 say otherwise
    #        └─ 3:3
    tree = make_tree([ROOT_PARENT, 0, 1, 0], [9, 1, 2, 3])
    result = greedy_accept(tree, target_logits([3, 2, 0, 7]))
    assert result.path.tolist() == [0, 3]
    assert result.next_token == 7


# --- greedy_accept against a reference walk on random trees --------------------------------

SMALL_VOCAB = 4  # small, so random drafts match the target often


@st.composite
def trees_with_logits(draw) -> tuple[Tree, torch.Tensor]:
    """A random tree whose siblings carry distinct tokens, and random target logits for it."""
    n = draw(st.integers(min_value=1, max_value=14))
    parents, tokens = [ROOT_PARENT], [draw(st.integers(0, SMALL_VOCAB - 1))]
    used: dict[int, set[int]] = {}
    for i in range(1, n):
        open_parents = [p for p in range(i) if len(used.get(p, ())) < SMALL_VOCAB]
        p = draw(st.sampled_from(open_parents))
        free = sorted(set(range(SMALL_VOCAB)) - used.get(p, set()))
        t = draw(st.sampled_from(free))
        used.setdefault(p, set()).add(t)
        parents.append(p)
        tokens.append(t)
    argmax = draw(st.lists(st.integers(0, SMALL_VOCAB - 1), min_size=n, max_size=n))
    return make_tree(parents, tokens), target_logits(argmax, SMALL_VOCAB)


def reference_greedy(tree: Tree, logits: torch.Tensor) -> tuple[list[int], int]:
    """Walk down from the root, following the child equal to the target's argmax while there is one."""
    node, path = 0, [0]
    while True:
        want = int(logits[node].argmax())
        nxt = [c for c in range(tree.num_nodes) if int(tree.parents[c]) == node and int(tree.tokens[c]) == want]
        if not nxt:
            return path, want
        node = nxt[0]
        path.append(node)


@settings(deadline=None)
@given(trees_with_logits())
def test_greedy_accept_matches_the_reference_walk(case):
    tree, logits = case
    result = greedy_accept(tree, logits)
    assert (result.path.tolist(), result.next_token) == reference_greedy(tree, logits)


# --- PromptLookup ---------------------------------------------------------------------------


def lookup(history: list[int], **kwargs):
    """A prompt-lookup state over ``history`` (one generation's)."""
    return PromptLookup(**kwargs).start(torch.tensor(history, dtype=torch.long), {})


def test_trie_merges_continuations_with_a_shared_prefix():
    # suffix [5] occurs at positions 4 and 0; both continuations start with 7
    drafter = lookup([5, 7, 6, 1, 5, 7, 8, 9], max_ngram=1, num_tokens=3)
    tree = drafter.propose(5, None, max_depth=8)
    #   5 ── 7 ─┬─ 8 ── 9     (after position 4, the most recent match)
    #           └─ 6 ── 1     (after position 0)
    assert tree.tokens.tolist() == [5, 7, 8, 9, 6, 1]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 1, 4]
    assert tree.depth.tolist() == [0, 1, 2, 3, 2, 3]


def test_identical_continuations_become_one_branch():
    drafter = lookup([3, 4, 5, 3, 4, 5], max_ngram=1, num_tokens=2)
    tree = drafter.propose(3, None, max_depth=8)
    assert tree.tokens.tolist() == [3, 4, 5]
    assert tree.is_chain


def test_most_recent_match_comes_first():
    drafter = lookup([4, 1, 4, 2], max_ngram=1, num_tokens=1)
    tree = drafter.propose(4, None, max_depth=8)
    assert tree.tokens.tolist() == [4, 2, 1]  # 2 followed the later 4, 1 the earlier one


def test_max_matches_keeps_only_the_most_recent():
    drafter = lookup([4, 1, 4, 2, 4, 3], max_ngram=1, num_tokens=1, max_matches=2)
    tree = drafter.propose(4, None, max_depth=8)
    assert tree.tokens.tolist() == [4, 3, 2]


def test_longest_ngram_is_preferred_over_a_more_recent_shorter_one():
    # suffix [1, 2]: the 2-gram occurred at position 0 (then 7); the 1-gram [2] also at 4 (then 8)
    history = [1, 2, 7, 5, 2, 8, 1]
    tree = lookup(history, max_ngram=2, num_tokens=1).propose(2, None, max_depth=8)
    assert tree.tokens.tolist() == [2, 7]


def test_shorter_ngram_is_used_when_the_longer_one_has_no_match():
    history = [1, 2, 7, 5, 2, 8, 1]
    tree = lookup(history, max_ngram=1, num_tokens=1).propose(2, None, max_depth=8)
    assert tree.tokens.tolist() == [2, 8, 7]


def test_min_ngram_forbids_shorter_matches():
    # only the 1-gram [3] matches; min_ngram=2 refuses it
    tree = lookup([3, 9, 4], max_ngram=3, min_ngram=2, num_tokens=2).propose(3, None, max_depth=8)
    assert tree.tokens.tolist() == [3]


def test_no_match_gives_a_root_only_tree():
    tree = lookup([1, 2, 3], max_ngram=3, num_tokens=4).propose(4, None, max_depth=8)
    assert tree.tokens.tolist() == [4]
    assert tree.parents.tolist() == [ROOT_PARENT]


def test_empty_history_gives_a_root_only_tree():
    tree = lookup([], max_ngram=3, num_tokens=4).propose(4, None, max_depth=8)
    assert tree.tokens.tolist() == [4]


def test_num_tokens_caps_depth():
    history = [6, 1, 2, 3, 4, 5]
    tree = lookup(history, max_ngram=1, num_tokens=3).propose(6, None, max_depth=10)
    assert tree.tokens.tolist() == [6, 1, 2, 3]


def test_max_depth_caps_depth():
    history = [6, 1, 2, 3, 4, 5]
    tree = lookup(history, max_ngram=1, num_tokens=8).propose(6, None, max_depth=2)
    assert tree.tokens.tolist() == [6, 1, 2]
    assert tree.max_depth == 2


def test_max_depth_zero_gives_a_root_only_tree():
    tree = lookup([6, 1, 2], max_ngram=1, num_tokens=8).propose(6, None, max_depth=0)
    assert tree.tokens.tolist() == [6]


def test_continuation_stops_at_the_end_of_the_history():
    # the match at position 2 is followed by one token only
    tree = lookup([9, 9, 5, 1], max_ngram=1, num_tokens=4, max_matches=1).propose(5, None, max_depth=8)
    assert tree.tokens.tolist() == [5, 1, 5]


def test_tries_proposed_together_equal_each_proposed_alone_with_their_ancestors():
    """`propose_batch` stages every row's trie in one copy: each equals the row's own `propose`, ancestors too;
    commits given as host lists (as the engine reads them back) extend the history as tensors do."""
    from specgraft.heads.base import DraftRequest

    lookup = PromptLookup(max_matches=3)
    histories = [[5, 6, 7, 5, 6, 8, 5, 6, 9, 5], [5, 1, 5, 2, 5, 3, 7], [9, 9, 9]]
    together, alone = ([lookup.start(torch.tensor(h), {}) for h in histories] for _ in range(2))
    for listed, tensor in zip(together, alone):
        listed.commit_listed([6, 7])
        tensor.commit(torch.tensor([6, 7]), {})
    requests = [DraftRequest(state, 5, None, 4) for state in together]
    trees = lookup.propose_batch(requests)
    assert not trees[1].is_chain and trees[2].num_nodes == 1  # a branching trie and a root alone among them
    for tree, state in zip(trees, alone):
        expected = state.propose(5, None, 4)
        assert tree.tokens.tolist() == expected.tokens.tolist() and tree.parent_list == expected.parent_list
        assert tree.depth.tolist() == expected.depth.tolist() == tree.depth_list
        assert torch.equal(tree.ancestor_mask(), make_tree(expected.parent_list, expected.tokens.tolist()).ancestor_mask())
    assert [s.history for s in together] == [s.history for s in alone]


def test_commit_extends_the_history_searched():
    drafter = lookup([1, 2], max_ngram=1, num_tokens=1)
    assert drafter.propose(3, None, max_depth=4).num_nodes == 1
    drafter.commit(torch.tensor([3, 4]), {})
    tree = drafter.propose(3, None, max_depth=4)  # history is now [1, 2, 3, 4]
    assert tree.tokens.tolist() == [3, 4]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(min_ngram=0),
        dict(max_ngram=2, min_ngram=3),
        dict(max_ngram=0),
        dict(num_tokens=0),
        dict(max_matches=0),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        PromptLookup(**kwargs)


def reference_continuations(history: list[int], root: int, depth: int, max_ngram: int, min_ngram: int, max_matches: int):
    """The definition, by brute force: continuations after the most recent matches of the longest suffix."""
    seq = history + [root]
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        ends = [s + n for s in range(len(history) - n + 1) if seq[s : s + n] == seq[-n:]]
        if ends:
            return [seq[e : e + depth] for e in ends[::-1][:max_matches]]
    return []


@pytest.mark.parametrize("seed", range(6))
def test_prompt_lookup_index_agrees_with_a_full_scan_as_the_history_grows(seed):
    """The n-gram index, extended commit by commit, proposes what scanning the whole history would."""
    from specgraft.heads.prompt_lookup import _trie

    gen = torch.Generator().manual_seed(seed)
    settings = dict(max_ngram=3, min_ngram=1, max_matches=3)
    history = torch.randint(0, 5, (6,), generator=gen).tolist()
    state = PromptLookup(num_tokens=4, **settings).start(torch.tensor(history), {})
    for _ in range(40):
        root = int(torch.randint(0, 5, (1,), generator=gen))
        want = _trie(root, reference_continuations(history, root, 4, **settings))
        got = state.propose(root, None, max_depth=4)
        assert (got.tokens.tolist(), got.parents.tolist()) == (want.tokens.tolist(), want.parents.tolist())
        step = [root] + torch.randint(0, 5, (int(torch.randint(0, 3, (1,), generator=gen)),), generator=gen).tolist()
        state.commit(torch.tensor(step), {})
        history += step


# --- sample_accept_chain: the exact rule on a chain, every draw made up front on the device --------------------


def chain_law(p: torch.Tensor, q: torch.Tensor | None, drafted: list[int]) -> dict[tuple, float]:
    """The committed tokens' exact law after a chain whose drafts are drawn from ``q[1:]`` level by level (or fixed
    ``drafted`` point masses when q is None), enumerated from the rule: x_i kept with probability
    min(1, p_{i-1}(x_i) / q_i(x_i)), the first rejected level's token from norm(max(p - q, 0)) there, a bonus
    from the last p; point masses: each level's token from p, the path going on while it equals the draft."""
    import itertools

    n, vocab = p.shape
    law: dict[tuple, float] = {}
    drafts = itertools.product(range(vocab), repeat=n - 1) if q is not None else [tuple(drafted)]
    for xs in drafts:
        weight = 1.0 if q is None else float(torch.prod(torch.stack([q[i + 1, x] for i, x in enumerate(xs)])))
        alive = weight
        for level in range(n):
            x = xs[level] if level < n - 1 else None
            if x is None:
                after = p[level]  # the bonus
                keep = 0.0
            elif q is None:
                keep = float(p[level, x])
                after = p[level].clone()
                after[x] = 0.0  # the token drawn where it is not the draft (unnormalised: weights)
            else:
                keep = min(1.0, float(p[level, x] / q[level + 1, x]))
                residual = (p[level] - q[level + 1]).clamp(min=0.0)
                after = residual / residual.sum() * (1 - keep) if residual.sum() > 1e-6 else p[level] * (1 - keep)
            for y in range(vocab):
                if float(after[y]) > 0:
                    key = tuple(xs[:level]) + (y,)
                    law[key] = law.get(key, 0.0) + alive * float(after[y])
            alive *= keep
    return law


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled-q", "point-masses"])
def test_a_chain_accepted_on_the_device_commits_the_targets_law(sampled):
    """`sample_accept_chain` against the rule's law enumerated over every draft, whose first token is p's own."""
    from collections import Counter

    from specgraft.infer.verify import sample_accept_chain
    from specgraft.tools.exactness import fit
    from specgraft.tree import Sampling

    gen = torch.Generator().manual_seed(0)
    vocab, drafted = 4, [1, 3, 0]
    p = torch.softmax(torch.randn(4, vocab, generator=gen) * 1.5, -1)
    q = torch.cat([torch.zeros(1, vocab), torch.softmax(torch.randn(3, vocab, generator=gen) * 1.5, -1)]) if sampled else None
    law = chain_law(p, q, drafted)
    assert sum(law.values()) == pytest.approx(1.0)
    first = [sum(v for k, v in law.items() if k[0] == y) for y in range(vocab)]
    assert first == pytest.approx(p[0].tolist(), abs=1e-6)  # the first committed token follows the target
    sampling = Sampling(temperature=1.0).seeded(7)
    draft_rng = torch.Generator().manual_seed(8)
    counts = Counter()
    for _ in range(20000):
        xs = [int(torch.multinomial(q[i + 1], 1, generator=draft_rng)) for i in range(3)] if sampled else drafted
        tree = make_tree([-1, 0, 1, 2], [2] + xs)
        tree = Tree(tree.tokens, tree.parents, tree.depth, tree.scores, q)
        row = sample_accept_chain(tree, p, sampling, width=6).tolist()
        count = row[0]
        assert row[2 : 2 + count] == list(range(count)) and row[8 : 8 + count] == [2] + xs[: count - 1]
        counts[tuple(xs[: count - 1]) + (row[1],)] += 1
    result = fit(counts, law)
    assert result.passed, result
