"""One drafter state per generation: interleaved generations over one generator never see each other.

Two ``stream()`` calls on one `SpeculativeGenerator`, advanced step by step
in turn, must each give exactly the tokens, the per-step accepted lengths and
the proposed trees of the same call run alone. Random heads accept little,
so the proposals themselves are compared: they depend on every piece of a
drafter's state (its caches, features, n-gram index).
"""

from __future__ import annotations

import pytest
import torch

import specgraft as sg
from specgraft.heads import as_drafter, build_head
from specgraft.heads.configs import Eagle3Config, EagleConfig, MedusaConfig

BRANCHING_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
NEW_TOKENS = 40


class RecordingDrafter:
    """Wraps a drafter; every state it starts records each tree it proposes (tokens and parents) here."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.hidden_layers = inner.hidden_layers
        self.trees: list[tuple[list[int], list[int]]] = []

    def start(self, prompt_ids, hidden):
        return RecordingState(self.inner.start(prompt_ids, hidden), self.trees)


class RecordingState:
    def __init__(self, inner, trees: list) -> None:
        self.inner, self.trees = inner, trees

    def propose(self, *args, **kwargs):
        tree = self.inner.propose(*args, **kwargs)
        self.trees.append((tree.tokens.tolist(), tree.parents.tolist()))
        return tree

    def commit(self, tokens, hidden, path=None):
        self.inner.commit(tokens, hidden, path)

    def cache_tokens(self):
        return self.inner.cache_tokens()


def random_head(config, target: sg.Target, seed: int = 0):
    head = build_head(config, target).eval()
    gen = torch.Generator().manual_seed(seed)
    for p in head.parameters():
        p.data.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return as_drafter(head, target)


def drafter_case(kind: str, target: sg.Target):
    if kind == "prompt_lookup":
        return sg.PromptLookup(max_ngram=2, num_tokens=4), sg.Chain(4)
    if kind == "self_tree":
        return sg.DraftModel(target, target), sg.StaticTree(BRANCHING_TREE)
    if kind == "eagle_dynamic":
        return random_head(EagleConfig(), target), sg.DynamicTree(top_k=3, depth=4, budget=12)
    if kind == "eagle3_chain":
        return random_head(Eagle3Config(aux_layers=[1, 2, 3]), target), sg.Chain(3)
    if kind == "composite":
        head = random_head(EagleConfig(), target)
        return sg.Composite(sg.PromptLookup(max_ngram=2, max_matches=1), head), sg.DynamicTree(top_k=3, depth=4, budget=12)
    if kind == "layer_skip_tree":
        return sg.LayerSkip(target, skip=[2]), sg.StaticTree(BRANCHING_TREE)
    if kind == "medusa_tree":
        return random_head(MedusaConfig(num_heads=3), target), sg.StaticTree(BRANCHING_TREE)
    raise KeyError(kind)


def run(stream, recorder: RecordingDrafter, record: dict) -> bool:
    """Advance one stream by one step, filing the chunk and any tree it proposed; False once finished."""
    before = len(recorder.trees)
    chunk = next(stream, None)
    if chunk is None:
        return False
    record["chunks"].append(chunk.token_ids)
    record["trees"].extend(recorder.trees[before:])
    if chunk.stats is not None:
        record["histogram"] = chunk.stats.accept_length_histogram
    return True


def new_record() -> dict:
    return {"chunks": [], "trees": [], "histogram": None}


@pytest.fixture(scope="module")
def prompts(stories, dev_prompts) -> list[list[int]]:
    return [stories.encode(dev_prompts[3]), stories.encode(dev_prompts[7])]


@pytest.mark.parametrize(
    "kind", ["prompt_lookup", "self_tree", "layer_skip_tree", "eagle_dynamic", "eagle3_chain", "medusa_tree", "composite"]
)
@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_interleaved_streams_equal_each_run_alone(stories, prompts, kind, temperature):
    drafter, tree = drafter_case(kind, stories)
    recorder = RecordingDrafter(drafter)
    gen = sg.SpeculativeGenerator(stories, recorder, tree=tree)
    options = [dict(temperature=temperature, seed=seed, eos_token_id=()) for seed in (11, 12)]

    alone = []
    for prompt, opts in zip(prompts, options):
        record, stream = new_record(), gen.stream(prompt, max_new_tokens=NEW_TOKENS, **opts)
        while run(stream, recorder, record):
            pass
        alone.append(record)

    together = [new_record(), new_record()]
    streams = [gen.stream(p, max_new_tokens=NEW_TOKENS, **o) for p, o in zip(prompts, options)]
    live = [True, True]
    while any(live):
        for i in (0, 1):
            if live[i]:
                live[i] = run(streams[i], recorder, together[i])

    for i in (0, 1):
        assert together[i]["chunks"] == alone[i]["chunks"], f"generation {i}: tokens or accepted lengths differ"
        assert together[i]["trees"] == alone[i]["trees"], f"generation {i}: proposed trees differ"
        assert together[i]["histogram"] == alone[i]["histogram"]
    assert alone[0]["trees"] and any(len(tokens) > 1 for tokens, _ in alone[0]["trees"])  # it really drafted


def test_a_drafter_start_gives_independent_states(stories, prompts):
    """Two states of one prompt-lookup drafter: committing to one leaves the other's proposals unchanged."""
    lookup = sg.PromptLookup(max_ngram=1, num_tokens=2)
    a = lookup.start(torch.tensor([5, 6, 7]), {})
    b = lookup.start(torch.tensor([5, 6, 7]), {})
    a.commit(torch.tensor([5, 9]), {})
    assert a.propose(5, None, max_depth=4).tokens.tolist() == [5, 9, 5, 6, 7]  # matches after 9 and after 6
    assert b.propose(5, None, max_depth=4).tokens.tolist() == [5, 6, 7]
