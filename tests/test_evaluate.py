"""The trainer's evaluation: the simulated tau is what a greedy chain of that depth commits, without generating."""

from __future__ import annotations

import pytest
import torch
from toy_train import greedy_examples

from specgraft.heads import load_drafter
from specgraft.heads.loading import drafter_from_spec
from specgraft.train.evaluate import depth_accuracy, greedy_path
from specgraft.tree import Chain


def free_running_accepted(drafter, target, prefix: list[int], depth: int) -> int:
    """What greedy verification accepts of the drafter's own greedy chain after ``prefix``: its leading tokens
    that equal the target's greedy continuation (the chain is drafted freely, not forced onto that path)."""
    with torch.inference_mode():
        out = target.forward(
            torch.tensor([prefix]), target.new_cache(), torch.arange(len(prefix))[None],
            hidden_layers=tuple(drafter.hidden_layers),
        )
        root = int(out.logits[0, -1].argmax())
        state = drafter.start(torch.tensor(prefix), {i: h[0] for i, h in out.hidden.items()})
        tree = state.propose(root, Chain(depth), depth)
    drafted = tree.tokens[1:].tolist()  # a chain: node d is depth d
    path = greedy_path(target, prefix + [root], depth)
    accepted = 0
    while accepted < len(drafted) and drafted[accepted] == path[accepted]:
        accepted += 1
    return accepted


@pytest.mark.parametrize("depth", [1, 3, 5])
def test_simulated_tau_equals_what_free_running_greedy_chains_commit(stories, trained_eagle, depth):
    drafter = load_drafter(trained_eagle, stories)
    sequences = [e["input_ids"] for e in greedy_examples(stories, count=6, length=40)]
    # positions=2 cuts each sequence at 2 and at len - 2; one sequence per call pins the cuts down.
    accepted = []
    for seq in sequences:
        accepted += [free_running_accepted(drafter, stories, seq[:cut], depth) for cut in (2, len(seq) - 2)]
    expected = 1 + sum(accepted) / len(accepted)
    result = depth_accuracy(drafter, stories, sequences, depth=5, positions=2, chain_depth=depth)
    assert result["simulated_tau"] == pytest.approx(expected)
    assert 0 < sum(accepted) < depth * len(accepted), accepted  # some chains are cut short, some accepted
    assert len(result["top1"]) == 5  # the per-depth accuracies keep their own depth


def test_a_drafter_that_is_the_target_simulates_every_chain_accepted(stories):
    sequences = [e["input_ids"] for e in greedy_examples(stories, count=3, length=24)]
    result = depth_accuracy(drafter_from_spec("self", stories), stories, sequences, depth=3, positions=3, chain_depth=4)
    assert result["simulated_tau"] == 5.0
    assert result["top1"] == [1.0] * 4
