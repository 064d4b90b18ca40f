"""The composite drafter: prompt lookup first, a head where lookup finds nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from test_engine_api import hf_generate

import specgraft as sg
from specgraft.heads import Composite, drafter_from_spec
from specgraft.specs import check_drafter
from specgraft.heads.composite import CompositeState
from specgraft.tools.bench import drafter_label, spec_label

TREE = sg.DynamicTree(top_k=4, depth=4, budget=12)


class Counting:
    """A drafter wrapper counting the trees its states propose that hold more than the root."""

    def __init__(self, inner) -> None:
        self.inner, self.hidden_layers, self.drafted = inner, inner.hidden_layers, 0

    def start(self, prompt_ids, hidden):
        state, outer = self.inner.start(prompt_ids, hidden), self

        class State:
            def propose(self, *args, **kwargs):
                tree = state.propose(*args, **kwargs)
                outer.drafted += tree.num_nodes > 1
                return tree

            def commit(self, tokens, hidden, path=None):
                state.commit(tokens, hidden, path)

            def cache_tokens(self):
                return state.cache_tokens()

        return State()


@pytest.fixture(scope="module")
def story_prompts(stories, dev_prompts) -> list[list[int]]:
    # A repeated sentence gives lookup matches; the rest of each story is the head's.
    return [stories.encode(p + " " + p) for p in dev_prompts[:4]]


def test_lookup_then_a_trained_head_is_greedy_identical_and_both_draft(stories, story_prompts, trained_eagle):
    lookup = Counting(sg.PromptLookup(max_matches=1))
    head = Counting(sg.load_drafter(trained_eagle, stories))
    gen = sg.SpeculativeGenerator(stories, Composite(lookup, head), tree=TREE)
    plain = sg.SpeculativeGenerator(stories, None)
    for ids in story_prompts:
        out = gen.generate(ids, max_new_tokens=48)
        assert out.token_ids == plain.generate(ids, max_new_tokens=48).token_ids
        assert out.token_ids == hf_generate(stories, ids, 48)
    assert lookup.drafted > 0 and head.drafted > 0, (lookup.drafted, head.drafted)


class Depths(Counting):
    """A drafter wrapper recording the depth of every tree its states propose."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.depths: list[int] = []

    def start(self, prompt_ids, hidden):
        state = super().start(prompt_ids, hidden)
        propose = state.propose

        def recorded(*args, **kwargs):
            tree = propose(*args, **kwargs)
            self.depths.append(int(tree.depth.max()))
            return tree

        state.propose = recorded
        return state


def test_lookup_drafts_no_deeper_than_the_tree_policy(stories, story_prompts):
    first = Depths(sg.PromptLookup(num_tokens=8, max_matches=1))
    gen = sg.SpeculativeGenerator(stories, Composite(first, sg.PromptLookup(max_matches=1)), tree=sg.Chain(3))
    gen.generate(story_prompts[0], max_new_tokens=32)
    assert first.depths and max(first.depths) == 3  # lookup had 8 tokens to copy; the chain caps it at 3


def test_first_depth_lets_lookup_copy_deeper_than_a_one_token_head_tree(stories, story_prompts, trained_eagle):
    first = Depths(sg.PromptLookup(num_tokens=8, max_matches=1))
    head = Depths(sg.load_drafter(trained_eagle, stories))
    gen = sg.SpeculativeGenerator(stories, Composite(first, head, first_depth=3), tree=sg.Chain(1))
    for ids in story_prompts:
        assert gen.generate(ids, max_new_tokens=40).token_ids == hf_generate(stories, ids, 40)
    assert max(first.depths) == 3 and max(head.depths) == 1  # lookup to its own cap, the head to the chain's


def test_the_depth_in_the_spec_reaches_the_composite(stories, trained_eagle):
    drafter = drafter_from_spec(f"prompt-lookup:3+{trained_eagle}", stories)
    assert isinstance(drafter, Composite) and drafter.first_depth == 3 and drafter.first.max_matches == 1
    assert drafter_from_spec(f"prompt-lookup+{trained_eagle}", stories).first_depth is None
    assert spec_label(f"prompt-lookup:3+{trained_eagle}") == f"prompt-lookup:3+{drafter_label(Path(trained_eagle))}"


@pytest.mark.parametrize("depth", ["0", "x", "", "-1"])
def test_a_lookup_depth_that_is_not_a_positive_number_is_refused_before_loading(depth):
    with pytest.raises(ValueError, match=f"after 'prompt-lookup:' comes a number of tokens >= 1, got '{depth}'"):
        check_drafter(f"prompt-lookup:{depth}+self")


def test_a_composite_first_depth_below_one_is_refused():
    with pytest.raises(ValueError, match="first_depth must be >= 1"):
        Composite(sg.PromptLookup(), sg.PromptLookup(), first_depth=0)


def test_a_batch_with_the_composite_equals_each_prompt_alone(stories, story_prompts, trained_eagle):
    gen = sg.SpeculativeGenerator(stories, drafter_from_spec(f"prompt-lookup+{trained_eagle}", stories), tree=TREE)
    budgets = [40, 24, 56, 32]
    outs = gen.generate_batch(story_prompts, max_new_tokens=budgets, temperature=[0.0, 0.8, 0.0, 1.0], seed=[0, 1, 2, 3])
    for ids, budget, out, temperature, seed in zip(story_prompts, budgets, outs, [0.0, 0.8, 0.0, 1.0], range(4)):
        alone = gen.generate(ids, max_new_tokens=budget, temperature=temperature, seed=seed)
        assert out.token_ids == alone.token_ids
    assert outs[0].token_ids == hf_generate(stories, story_prompts[0], 40)


def test_the_spec_builds_lookup_with_one_match_then_the_drafter(stories, trained_eagle):
    drafter = drafter_from_spec(f"prompt-lookup+{trained_eagle}", stories)
    assert isinstance(drafter, Composite) and isinstance(drafter.first, sg.PromptLookup)
    assert drafter.first.max_matches == 1 and drafter.hidden_layers == drafter.then.hidden_layers
    assert isinstance(drafter_from_spec("prompt-lookup+self", stories).then, sg.DraftModel)


@pytest.mark.parametrize("spec", ["prompt-lookup+none", "prompt-lookup+prompt-lookup", "prompt-lookup:2+prompt-lookup:3+self"])
def test_a_composite_of_nothing_or_of_lookup_twice_is_refused_before_loading(spec):
    with pytest.raises(ValueError, match="after 'prompt-lookup\\+' comes 'self', 'layer-skip:LAYERS' or a drafter directory"):
        check_drafter(spec)


def test_a_composite_of_a_missing_directory_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-head.*does not exist"):
        check_drafter(f"prompt-lookup+{tmp_path / 'no-such-head'}")


def test_the_state_commits_to_both_and_sums_their_caches(stories):
    ids = stories.encode("Once upon a time there was a cat.")
    root = next(t for t in range(stories.vocab_size) if t not in ids)  # no match: the draft model drafts
    composite = Composite(sg.PromptLookup(max_matches=1), sg.DraftModel(stories, stories))
    state = composite.start(torch.tensor(ids), {})
    assert isinstance(state, CompositeState)
    assert state.propose(root, sg.Chain(2), 2).num_nodes == 3
    state.commit(torch.tensor([root]), {})
    assert state.first.history == ids + [root] and state.then.length == len(ids) + 1
    assert state.cache_tokens() == state.first.cache_tokens() + state.then.cache_tokens() > 0
