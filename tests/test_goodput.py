"""Trees sized by expected goodput: the controller's arithmetic against hand-worked cases, and `Adaptive` trees
exact end to end (greedy identity and enumerated distributions), alone and beside fixed trees."""

from __future__ import annotations

import math
import time
from collections import Counter

import pytest
import torch

import specgraft as sg
from specgraft.infer import Committed, StepObserver
from specgraft.infer.adaptive.goodput import Candidate, DrafterStats, GoodputController
from specgraft.infer.adaptive.step_cost import PACKED_EVERY, RESCALE_EVERY, StepCost, forget_step_cost
from specgraft.tree import ROOT_PARENT, Tree

from test_engine_api import hf_generate
from test_scheduler import SAMPLING_LENGTH, Driver, enumerated, small_vocab_pair  # noqa: F401 (fixture)


def tree_of(parents: list[int], logp: list[float] | None = None, tokens: list[int] | None = None) -> Tree:
    depth = []
    for p in parents:
        depth.append(0 if p == ROOT_PARENT else depth[p] + 1)
    scores = [0.0] * len(parents) if logp is None else logp
    return Tree(
        tokens=torch.tensor(tokens or list(range(len(parents)))), parents=torch.tensor(parents),
        depth=torch.tensor(depth), scores=torch.tensor(scores),
    )


class Drafter:  # a stand-in drafter: statistics are keyed by the drafter object
    hidden_layers = ()


def controller(cost: dict[int, float]) -> GoodputController:
    ctl = GoodputController(target=None)
    ctl.cost = StepCost(cost)
    return ctl


def with_quarter_second_levels(ctl: GoodputController) -> Drafter:
    """A drafter whose every level costs 0.25 s (no fixed part) and reaches depth 1 three times in ten, depth 2 once."""
    d = Drafter()
    stats = ctl.stats(d)
    stats.observe_cost(1, 0.25)
    stats.observe_cost(2, 0.5)
    stats.reach = [0.3, 0.1]
    return d


# --------------------------------------------------------------------------- the arithmetic


def test_the_device_clock_on_a_cpu_is_the_host_clock():
    """A CPU's forward runs while the host waits: its seconds are the host's (a GPU's: tests/test_cuda.py)."""
    import time

    from specgraft.infer.adaptive.clock import DeviceClock

    clock = DeviceClock("cpu")
    start = clock.mark()
    time.sleep(0.01)
    end = clock.mark()
    assert isinstance(start, float) and clock.seconds(start, end) == end - start >= 0.01


def test_step_cost_interpolates_extrapolates_and_follows_observed_times():
    cost = StepCost({1: 1.0, 4: 2.5, 8: 4.5})
    assert cost(1) == 1.0 and cost(2) == pytest.approx(1.5) and cost(6) == pytest.approx(3.5)
    assert cost(12) == pytest.approx(6.5)  # beyond 8: the last segment's slope (0.5 a token)
    for _ in range(RESCALE_EVERY - 1):  # steps twice as slow as predicted: the curve holds until a full set
        cost.observe(4, 5.0)
    assert cost.scale == 1.0
    cost.observe(4, 5.0)  # then moves a fifth of the way
    assert cost.scale == pytest.approx(1.2) and cost(4) == pytest.approx(3.0)
    for seconds in [3.0] * (RESCALE_EVERY - 1) + [30.0]:  # one forward of a set preempted: the scale holds
        cost.observe(4, seconds)
    assert cost.scale == pytest.approx(1.2)
    assert cost.span(2, 3) == pytest.approx([cost(n) for n in (2, 3, 4, 5)])  # selection's run of T
    for _ in range(RESCALE_EVERY):
        cost.observe(4, 6.0)
    assert cost.scale > 1.2 and cost.span(1, 10) == pytest.approx([cost(n) for n in range(1, 12)])


def test_a_steps_work_beyond_its_forward_is_fitted_per_step_per_row_and_per_drafted_row():
    cost = StepCost({1: 1.0, 64: 1.0})
    for step in range(4 * RESCALE_EVERY):  # 2 ms a step, 1 ms a row, 0.5 ms more a row that verified a tree
        rows, drafted = 4 + step % 3, step % 4
        cost.observe_overhead(rows, drafted, 0.002 + 0.001 * rows + 0.0005 * drafted)
    assert (cost.per_step, cost.per_row, cost.per_drafted) == pytest.approx((0.002, 0.001, 0.0005), rel=1e-3)
    assert cost.overhead(10) == pytest.approx(0.012)
    one_size = StepCost({1: 1.0, 64: 1.0})
    for step in range(4 * RESCALE_EVERY):  # one batch size: its steps' work goes on its rows, the trees' apart
        one_size.observe_overhead(4, step % 2, 0.006 + 0.0005 * (step % 2))
    assert (one_size.per_step, one_size.per_row, one_size.per_drafted) == pytest.approx((0.0, 0.0015, 0.0005))
    assert one_size.overhead(4) == pytest.approx(0.006)


def test_a_steps_work_beyond_its_forward_prices_trees_in_selection_and_plans():
    """Verifying a token costs a whole forward (T(2) = 2 T(1)): a node accepted half the time does not pay on the
    forward alone, but does once every step also spends two forwards' time on work beyond it; a tree's own work
    takes it back."""
    ctl, d = controller({1: 1.0, 2: 2.0, 3: 3.0}), Drafter()
    chain = tree_of([-1, 0], logp=[0.0, math.log(0.5)])
    assert ctl.select([Candidate(0, d, chain, True)])[0].num_nodes == 1  # 1.5 tokens in 2 s against 1 in 1 s
    ctl.cost.per_row = 2.0
    assert ctl.select([Candidate(0, d, chain, True)])[0].num_nodes == 2  # 1.5 in 4 s against 1 in 3 s
    ctl.cost.per_drafted = 1.0  # a tree's work costs a whole forward more
    assert ctl.select([Candidate(0, d, chain, True)])[0].num_nodes == 1  # 1.5 in 5 s
    stats = GoodputController.stats(d)
    stats.reach = [0.5]
    for _ in range(4):
        stats.observe_cost(1, 0.0)  # drafting is free
    ctl.cost.per_row, ctl.cost.per_drafted = 0.0, 0.0
    assert ctl.plan([(0, d, 1)], batch=1) == {0: 0}
    ctl.cost.per_row = 2.0
    ctl.cost.price_point()
    assert ctl.plan([(0, d, 1)], batch=1) == {0: 1}


def test_rows_with_no_counts_of_their_own_share_the_plan_each_would_get_alone():
    """Fresh rows are planned once for all (their drafter's reach); a row with counts of its own is planned apart."""
    d = Drafter()
    stats = GoodputController.stats(d)
    stats.reach = [0.9, 0.8, 0.7]
    for _ in range(4):
        stats.observe_cost(1, 0.0)  # drafting is free: deep trees pay while the reach is high
    cost = {1: 1.0, 4: 1.0, 8: 1.4}  # at batch 4 each level a row drafts costs 0.4 tokens
    ctl = controller(cost)
    for _ in range(8):  # row 3 missed at every depth, eight times
        ctl.row(3).observe(0, 3, stats, ctl.clock)
    together = ctl.plan([(k, d, 3) for k in range(4)], batch=4)
    alone = [controller(cost).plan([(k, d, 3)], batch=4)[k] for k in range(3)]
    assert [together[k] for k in range(3)] == alone and alone[0] > 0
    assert together[3] == 0  # its own misses: no level pays


def test_forwards_with_trees_teach_the_tree_penalty_apart_from_the_scale():
    cost = StepCost({1: 1.0, 64: 1.0})  # a flat curve: 1 s at any size
    assert cost.tree_penalty(16) == 0.0  # no forward with a tree seen: no penalty
    for _ in range(RESCALE_EVERY):
        cost.observe(16, 1.0)
        cost.observe(17, 1.3, trees=True)  # a tree in the batch: 30% longer
    assert cost.tree_ratio == pytest.approx(1.3) and cost.scale == pytest.approx(1.0)
    assert cost.tree_penalty(16) == pytest.approx(0.3)
    for _ in range(RESCALE_EVERY * 60):  # the machine slows down twofold: both kinds of forward take twice as long
        cost.observe(16, 2.0)
        cost.observe(17, 2.6, trees=True)
    assert cost.scale == pytest.approx(2.0, rel=1e-2) and cost.tree_ratio == pytest.approx(1.3, rel=1e-2)
    assert cost.tree_penalty(16) == pytest.approx(0.6, rel=1e-2)


def test_packed_forwards_with_trees_set_their_own_penalty_quickly_and_leave_a_row_alones():
    """A tree beside other rows costs what it costs there (the one-token rows leave their single attention call, the
    tokens sit on a curve timed on one row), not what a row alone's masked tree costs: the first `PACKED_EVERY`
    packed forwards with trees set its ratio outright, and each ratio learns from its own kind of forward."""
    cost = StepCost({1: 1.0, 64: 1.0}, tree_ratio=1.1, trees_seen=True)
    assert cost.tree_penalty(16, packed=True) == pytest.approx(0.1)  # none observed yet: a row alone's ratio stands in
    for _ in range(PACKED_EVERY - 1):
        cost.observe(17, 1.5, trees=True, packed=True)
    assert not cost.packed_seen and cost.tree_penalty(16, packed=True) == pytest.approx(0.1)
    cost.observe(17, 1.5, trees=True, packed=True)  # the eighth: half a forward more than its tokens
    assert cost.packed_seen and cost.packed_ratio == pytest.approx(1.5)
    assert cost.tree_penalty(16, packed=True) == pytest.approx(0.5) and cost.tree_penalty(16) == pytest.approx(0.1)
    assert cost.tree_ratio == pytest.approx(1.1) and cost.scale == pytest.approx(1.0)  # a row alone's, the scale: kept
    for _ in range(PACKED_EVERY):
        cost.observe(17, 1.2, trees=True, packed=True)
    assert cost.packed_ratio == pytest.approx(0.8 * 1.5 + 0.2 * 1.2)  # seen: later ones move it by EMA
    scale = cost.scale  # (those forwards, 1.2 s against 1.44 predicted, moved it)
    for _ in range(RESCALE_EVERY):
        cost.observe(3, 1.3 * scale, trees=True)  # a row alone's trees move its own ratio only
    assert cost.tree_ratio == pytest.approx(0.8 * 1.1 + 0.2 * 1.3) and cost.packed_ratio == pytest.approx(1.44)


def test_a_learned_packed_penalty_prices_trees_beside_other_rows_and_not_a_branch_alone():
    ctl, d = controller({1: 1.0, 64: 1.0}), Drafter()  # verifying is free but for the penalty
    ctl.cost.packed_ratio, ctl.cost.packed_seen = 1.5, True  # beside other rows the first tree adds half a forward
    weak = tree_of([-1, 0, 1], logp=[0.0, math.log(0.6), math.log(0.3)])
    fork = tree_of([-1, 0, 0], logp=[0.0, math.log(0.6), math.log(0.3)])
    plain = Candidate(9, d, tree_of([-1]), True)
    assert ctl.select([Candidate(0, d, weak, True), plain])[0].num_nodes == 1  # 2.9 tokens in 1.5 s lose to 2 in 1
    assert ctl.select([Candidate(0, d, fork, True)])[0].num_nodes == 3  # alone, a branch pays tree_ratio (1.0): none
    stats = ctl.stats(d)
    for _ in range(10):
        stats.observe_cost(1, 0.01)
    stats.reach = [0.9]
    assert ctl.plan([(0, d, 1), (1, d, 1)], batch=2) == {0: 0, 1: 0}  # 0.9 tokens do not repay half a forward each
    assert ctl.plan([(0, d, 1)], batch=1) == {0: 1}  # alone, a chain runs unmasked


def test_selection_pays_the_tree_penalty_once_a_step_and_plans_price_it_whole():
    ctl, d = controller({1: 1.0, 64: 1.0}), Drafter()  # verifying is free but for the penalty
    ctl.cost.tree_ratio = 1.5  # the first tree adds half a forward
    plain = Candidate(9, d, tree_of([-1]), True)
    strong = tree_of([-1, 0, 1], logp=[0.0, math.log(0.9), math.log(0.8)])
    weak = tree_of([-1, 0, 1], logp=[0.0, math.log(0.6), math.log(0.3)])
    assert ctl.select([Candidate(0, d, strong, True), plain])[0].num_nodes == 3  # 3.7 tokens in 1.5 s beat 2 in 1
    assert ctl.select([Candidate(0, d, weak, True), plain])[0].num_nodes == 1  # 2.9 in 1.5 s do not
    two = ctl.select([Candidate(0, d, weak, True), Candidate(1, d, weak, True)])  # 3.8 in 1.5 s: the penalty is shared
    assert [t.num_nodes for t in two.values()] == [3, 3]
    assert ctl.select([Candidate(0, d, weak, True)])[0].num_nodes == 3  # alone: 1.9 tokens in 1.5 s beat 1 in 1
    stats = ctl.stats(d)
    for _ in range(10):
        stats.observe_cost(1, 0.01)
        stats.observe_cost(2, 0.02)
    stats.reach = [0.9]
    assert ctl.plan([(0, d, 1), (1, d, 1)], batch=2) == {0: 0, 1: 0}  # 0.9 tokens do not repay half a forward each
    ctl.cost.tree_ratio = 1.0
    assert ctl.plan([(0, d, 1), (1, d, 1)], batch=2) == {0: 1, 1: 1}


def test_a_chain_verified_alone_runs_unmasked_and_pays_no_tree_penalty():
    """A row verified alone runs a chain as causal tokens: only a branch (or a packed batch) pays the penalty."""
    ctl, d = controller({1: 1.0, 64: 1.0}), Drafter()  # verifying is free but for the penalty
    ctl.cost.tree_ratio = 1.5  # a tree adds half a forward
    weak = tree_of([-1, 0, 1], logp=[0.0, math.log(0.3), math.log(0.1)])  # 0.4 tokens: not worth half a forward
    fork = tree_of([-1, 0, 0], logp=[0.0, math.log(0.3), math.log(0.1)])
    assert ctl.select([Candidate(0, d, weak, True)])[0].num_nodes == 3  # alone, a chain: 1.4 tokens in 1 s
    assert ctl.select([Candidate(0, d, fork, True)])[0].num_nodes == 2  # its second branch would pay the penalty
    packed = ctl.select([Candidate(0, d, weak, True), Candidate(1, d, tree_of([-1]), True)])
    assert packed[0].num_nodes == 1  # packed beside another row: 2.4 tokens in 1.5 s lose to 2 in 1
    assert ctl.select([Candidate(0, d, fork, False)])[0].num_nodes == 3  # a fixed branching tree is verified whole
    stats = ctl.stats(d)
    for _ in range(10):
        stats.observe_cost(1, 0.01)
        stats.observe_cost(2, 0.02)
    stats.reach = [0.3]
    assert ctl.plan([(0, d, 1)], batch=1) == {0: 1}  # alone: 0.3 tokens repay 0.01 s of drafting
    assert ctl.plan([(0, d, 1), (1, d, 1)], batch=2) == {0: 0, 1: 0}  # packed: not half a forward
    by_row = GoodputController(target=None, row_by_row=True)  # every row on its own cache: chains always unmasked
    by_row.cost = ctl.cost
    assert by_row.plan([(0, d, 1), (1, d, 1)], batch=2) == {0: 1, 1: 1}
    assert [t.num_nodes for t in by_row.select([Candidate(0, d, weak, True), Candidate(1, d, weak, True)]).values()] == [3, 3]


def test_a_drafters_cost_is_fitted_apart_from_the_tokens_it_catches_up_and_plans_price_those_per_commit():
    """A head with a cache runs the tokens committed since it last drafted first: rows idle for long (probes) cost
    more a round than rows drafting every step, and a plan must price the steady round."""
    stats = DrafterStats()
    for behind in (2, 120, 3, 60, 2, 90) * 10:  # 5 ms a round and 0.04 ms a token behind, at depth 1 only
        stats.observe_cost(1, 0.005 + 0.00004 * behind, behind)
    fixed, per_level, per_behind = stats.cost_line()
    assert fixed == 0.0 and per_level == pytest.approx(0.005) and per_behind == pytest.approx(0.00004)
    for levels, behind in ((1, 2), (3, 50), (2, 100), (4, 3)) * 10:  # then 2 ms fixed and 3 ms a level as well
        stats.observe_cost(levels, 0.002 + 0.003 * levels + 0.00004 * behind, behind)
    assert stats.cost_line() == pytest.approx((0.002, 0.003, 0.00004), rel=0.02)
    assert stats.cost_of(2, 10) == pytest.approx(0.0084, rel=0.02)
    wider = DrafterStats()  # a second level over a wider frontier costs more than the first: the line starts below 0
    for levels, seconds in ((1, 0.0058), (2, 0.0124), (1, 0.0058), (1, 0.0058)) * 10:
        wider.observe_cost(levels, seconds, 1.0)
    assert wider.cost_line()[0] < 0 and wider.cost_of(1) == pytest.approx(0.0058) and wider.cost_of(2) == pytest.approx(0.0124)
    # Priced at 1 token a second, on a flat T: a level costs 0.2 tokens, and each token committed 0.1 to catch up.
    ctl, d = controller({1: 1.0, 64: 1.0}), Drafter()
    head = ctl.stats(d)
    for levels, behind in ((1, 2), (2, 2), (1, 10), (2, 6)) * 10:
        head.observe_cost(levels, 0.1 * behind + 0.2 * levels, behind)
    head.reach = [0.5, 0.45]
    # depth 1: 0.5 - 0.2 - 0.1 x 1.5 = 0.15; depth 2: 0.95 - 0.4 - 0.1 x 1.95 = 0.355
    assert ctl.plan([(0, d, 2)], batch=1) == {0: 2}
    head.reach = [0.5, 0.22]  # depth 2: 0.72 - 0.4 - 0.172 = 0.148, below depth 1 (without catching up: 0.32 > 0.3)
    head.moved()
    assert ctl.plan([(0, d, 2)], batch=1) == {0: 1}


def test_plans_count_on_the_share_of_a_levels_reach_its_likeliest_node_holds_where_siblings_split_it():
    """Prompt lookup's trie splits a depth's reach among its siblings: selection keeps one node of a level cheaply,
    so a plan counts on that node's share, learned from the trees selection saw."""
    ctl, d = controller({1: 1.0, 64: 1.0}), Drafter()  # verifying is free: a level costs its drafting
    stats = ctl.stats(d)
    for levels in (1, 2) * 10:
        stats.observe_cost(levels, 0.2 * levels)  # 0.2 tokens a level
    stats.reach = [0.3]
    assert ctl.plan([(0, d, 1)], batch=1) == {0: 1}  # no tree seen yet: the whole reach, 0.3 > 0.2
    three = tree_of([-1, 0, 0, 0], tokens=[5, 6, 7, 8])  # three matches disagree at depth 1
    for _ in range(20):
        ctl.select([Candidate(0, d, three, True)])
    assert stats.split.factor(1) == pytest.approx((20 / 3 + 4) / (20 + 4))
    stats.moved()
    assert ctl.plan([(0, d, 1)], batch=1) == {0: 0}  # 0.3 x 0.44 < 0.2
    assert stats.split.factor(2) == 1.0  # never split: whole


def test_a_drafters_reach_counts_its_recent_steps_from_a_prior():
    from specgraft.infer.adaptive.goodput import DRAFTER_MEMORY, PRIOR_WEIGHT, REACH_PRIOR

    stats = DrafterStats()
    for step in range(40):  # depth 1 reached every fourth step, depth 2 never
        stats.count_reach(1 if step % 4 == 0 else 0, 2)
    stats.settle_reach()
    assert stats.reach_at(1) == pytest.approx((10 + PRIOR_WEIGHT * REACH_PRIOR) / (40 + PRIOR_WEIGHT))
    assert stats.reach_at(2) == pytest.approx(PRIOR_WEIGHT * REACH_PRIOR**2 / (40 + PRIOR_WEIGHT))
    assert stats.reach_at(3) == REACH_PRIOR**3  # never verified: the prior
    for _ in range(int(DRAFTER_MEMORY) * 4):  # the text moves on: every step reaches depth 1 now
        stats.count_reach(1, 1)
    stats.settle_reach()
    assert stats.reach_at(1) > 0.95  # old steps halved away


def test_timed_points_are_read_as_timed_steps_and_all_and_never_cheaper_for_more_tokens():
    from specgraft.infer.adaptive.step_cost import rising_times

    # SmolLM2 at batch 1 (ms): 1 and 2 tokens run one kernel, 3 and 4 another; 16 tokens timed faster than 12
    timed = {1: 38.0, 2: 38.5, 3: 52.0, 4: 50.0, 8: 55.0, 12: 70.0, 16: 66.0, 24: 80.0}
    curve = rising_times(timed)
    assert curve == {1: 38.0, 2: 38.5, 3: 52.0, 4: 52.0, 8: 55.0, 12: 70.0, 16: 70.0, 24: 80.0}
    cost = StepCost(curve)
    assert cost(3) - cost(2) == pytest.approx(13.5)  # the step to a third token is priced whole, not along a slope
    assert cost(14) == pytest.approx(70.0) and cost(20) == pytest.approx(75.0)


def test_the_step_cost_is_timed_within_a_short_context():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=40)
    target = sg.load_target(LlamaForCausalLM(config).eval())
    cost = StepCost.measure(target)  # 40 positions: 20 cached, then N up to 20
    assert max(cost.points) == 16 and all(b >= a for a, b in zip(cost._ys, cost._ys[1:]))
    assert cost.trees_seen and cost.tree_ratio >= 1.0  # a masked tree of 4 timed too: the ratio's starting point


def test_selection_keeps_every_node_when_verifying_is_free_and_none_when_each_token_costs_a_forward():
    chain = tree_of([-1, 0, 1], logp=[0.0, -0.1, -0.3])
    d = Drafter()
    flat = controller({1: 1.0, 64: 1.0}).select([Candidate(0, d, chain, True)])
    assert flat[0].num_nodes == 3
    linear = controller({1: 1.0, 64: 64.0}).select([Candidate(0, d, chain, True)])
    assert linear[0].num_nodes == 1  # a node accepted with p < 1 adds less than the forward it costs


def test_selection_takes_the_best_nodes_across_rows_and_keeps_parents_before_children():
    # Row 0: a confident chain; row 1: a doubtful one. T: 1 for 2 tokens, then 1 + 0.25 per token: worth a node
    # only if it is accepted with p > 0.25 x (tokens so far) / T, roughly.
    d = Drafter()
    sure = tree_of([-1, 0, 1], logp=[0.0, -0.05, -0.1])
    doubt = tree_of([-1, 0, 1], logp=[0.0, -2.0, -4.0])
    ctl = controller({1: 1.0, 2: 1.0, 6: 2.0, 64: 17.5})
    trees = ctl.select([Candidate(0, d, sure, True), Candidate(1, d, doubt, True)])
    assert trees[0].num_nodes == 3 and trees[1].num_nodes == 1
    assert ctl.selected_last == 2
    # A child can never be kept without its parent, even when calibration would rank it above it.
    stats = ctl.stats(d)
    for _ in range(50):
        stats.probability.observe(2, 0.05, True)  # depth-2 nodes were always accepted: calibrated up to 1
    est = ctl.estimates(Candidate(0, d, sure, True))
    assert est[2] <= est[1] <= 1.0


def test_fixed_rows_are_verified_whole_and_their_tokens_count_in_the_cost():
    d = Drafter()
    fixed = tree_of([-1, 0, 1, 2])
    adaptive = tree_of([-1, 0], logp=[0.0, -0.5])
    ctl = controller({1: 1.0, 5: 1.0, 6: 1.6, 64: 60.0})
    trees = ctl.select([Candidate(0, d, fixed, False), Candidate(1, d, adaptive, True)])
    assert trees[0] is fixed and trees[1].num_nodes == 1  # the 6th token would cost 0.6 of a forward for p = 0.61


def test_trees_without_probabilities_use_the_rows_running_acceptance_shared_among_siblings():
    d = Drafter()
    lookup = tree_of([-1, 0, 0, 1], tokens=[5, 6, 7, 8])  # two branches at depth 1, scores all zero
    ctl = controller({1: 1.0})
    row = ctl.row(0)
    row.observe(2, 2, ctl.stats(d), now=ctl.clock)  # a step that reached depth 2
    est = ctl.estimates(Candidate(0, d, lookup, True))
    depth1 = row.reach_at(1, ctl.stats(d))
    assert est[1] == est[2] == pytest.approx(depth1 / 2) and est[3] <= est[1]


def test_estimates_without_probabilities_are_each_depths_calibrated_rate_capped_by_every_ancestors():
    d = Drafter()
    # depth 1: one node; depth 2: three (split three ways, below depth 3's one); depth 3: one, under node 2
    lookup = tree_of([-1, 0, 1, 1, 1, 2], tokens=[5, 6, 7, 8, 9, 10])
    ctl = controller({1: 1.0})
    stats, row = ctl.stats(d), ctl.row(0)
    for accepted in (3, 3, 1, 3, 0, 3):
        row.observe(accepted, 3, stats, now=ctl.clock)
    stats.rates.observe(2, 1.0, 0.5)  # depth 2's rates ran high: its calibration halves them, about
    est = ctl.estimates(Candidate(0, d, lookup, True))
    factors = stats.rates.factors(3)
    rate = [1.0] + [row.reach_at(k, stats) / n * factors[k - 1] for k, n in ((1, 1), (2, 3), (3, 1))]
    expected = [1.0] * lookup.num_nodes  # node by node: its depth's rate, never above its parent's estimate
    for i, (parent, depth) in enumerate(zip(lookup.parent_list, lookup.depth_list)):
        if i:
            expected[i] = min(expected[parent], 1.0, rate[depth])
    assert est == pytest.approx(expected) and est[5] < rate[3]  # depth 3 capped by depth 2's split


def test_plan_drafts_the_depth_whose_expected_tokens_best_repay_its_cost_at_plain_goodput():
    d = Drafter()
    ctl = controller({1: 1.0, 2: 1.02, 4: 1.06, 8: 1.2, 64: 8.0})
    stats = ctl.stats(d)
    assert ctl.plan([(0, d, 6)], batch=1) == {0: 1}  # never measured: one level, to measure it
    stats.observe_cost(1, 0.01)
    stats.observe_cost(2, 0.02)  # two depths fit the cost's parts: nothing fixed, 0.01 s a level
    assert stats.cost_of(3) == pytest.approx(0.03)
    stats.reach = [0.9, 0.8, 0.6, 0.3, 0.1]
    # goodput 1 token a second; a level costs 0.01 and its token on T's curve (0.02 up to 4 tokens, then 0.035): the
    # net gain peaks at depth 5 (depth 6 adds 0.5 ** 6 < 0.045).
    assert ctl.plan([(0, d, 6)], batch=1) == {0: 5}
    d2 = Drafter()
    slow = ctl.stats(d2)
    slow.observe_cost(1, 0.5)
    slow.observe_cost(2, 1.0)  # half a forward a level: 0.9, 0.8, 0.6, 0.3 less 0.52-0.535 a level peaks at depth 3
    slow.reach = stats.reach
    assert ctl.plan([(1, d2, 6)], batch=1) == {1: 3}
    assert ctl.plan([(1, d2, 6)], batch=8) == {1: 0}  # 8 rows: goodput 6.7 tokens a second; no depth pays


def test_a_plan_holds_until_what_it_read_moves_and_then_is_made_again():
    """Steps that change nothing a plan read reuse it; a drafter's cost, a row's counts, the rows themselves or T's
    scale moving make it again."""

    def costs(stats: DrafterStats, per_level: float) -> None:  # rounds of 1 and 2 levels until the fit is per_level
        for _ in range(40):
            stats.observe_cost(1, per_level)
            stats.observe_cost(2, 2 * per_level)

    d = Drafter()
    ctl = controller({1: 1.0, 2: 1.02, 4: 1.06, 8: 1.2, 64: 8.0})  # batch 1: 1 token a second; 0.02 s a token more
    stats = ctl.stats(d)
    stats.reach = [0.9, 0.8, 0.6]
    costs(stats, 1.0)  # a level costs a second: no depth pays
    assert ctl.plan([(0, d, 3)], batch=1) == {0: 0}
    assert ctl.plan([(0, d, 3)], batch=1) == {0: 0}
    costs(stats, 0.3)  # 0.32 tokens a level: every depth pays
    assert ctl.plan([(0, d, 3)], batch=1) == {0: 3}
    for _ in range(40):  # the row's own misses at every depth: its reach falls below the price
        ctl.row(0).observe(0, 3, stats, now=ctl.clock)
    assert ctl.plan([(0, d, 3)], batch=1) == {0: 0}
    assert ctl.plan([(0, d, 3), (1, d, 3)], batch=1) == {0: 0, 1: 3}  # a new row starts from its drafter's reach

    slow = Drafter()
    costs(ctl.stats(slow), 1.0)
    ctl.stats(slow).reach = [0.9]
    assert ctl.plan([(2, slow, 1)], batch=1) == {2: 0}
    for _ in range(RESCALE_EVERY * 40):  # the target's forwards now take 100 times as long: drafting costs little beside
        ctl.cost.observe(1, 100.0)
    assert ctl.plan([(2, slow, 1)], batch=1) == {2: 1}


def test_calibration_learns_accepted_over_predicted_by_depth_from_a_prior_of_one():
    stats = DrafterStats()
    assert stats.probability.factor(1) == 1.0
    for _ in range(40):
        stats.probability.observe(1, 0.8, accepted=False)
        stats.probability.observe(1, 0.8, accepted=True)
    assert stats.probability.factor(1) == pytest.approx((40 + 4) / (64 + 4))


def test_the_rates_of_trees_without_probabilities_are_calibrated_by_what_selection_kept_and_was_accepted():
    ctl, d = controller({1: 1.0, 64: 1.0}), Drafter()  # verifying is free: every node is kept
    lookup = tree_of([-1, 0, 1], tokens=[5, 6, 7])  # prompt lookup's chain: no probabilities
    for step in range(60):
        ctl.row(0).reach = [0.8, 0.6]  # a row that claims 0.8 (selection kept it for its luck) ...
        trees = ctl.select([Candidate(0, d, lookup, True)])
        assert trees[0].num_nodes == 3
        ctl.observe_step(0, d, trees[0], torch.tensor([0, 1] if step % 4 == 0 else [0]))  # ... reaches depth 1 a quarter
    stats = ctl.stats(d)
    factor = (15 + 4) / (60 * 0.8 + 4)  # accepted over the raw rates selection read, pulled toward 1 by 4
    assert stats.rates.factor(1) == pytest.approx(factor)
    assert stats.rates.factor(2) == pytest.approx(4 / (60 * 0.6 + 4))  # depth 2 was never reached
    assert stats.probability.factor(1) == 1.0  # path probabilities are calibrated apart
    ctl.row(0).reach = [0.8, 0.6]
    est = ctl.estimates(Candidate(0, d, lookup, True))
    assert est[1] == pytest.approx(0.8 * factor) and est[2] <= est[1]


@pytest.mark.parametrize("token_seconds", [1.0, 0.5])
def test_a_row_that_does_not_draft_probes_its_likeliest_path_as_deep_as_it_may_draft_at_its_budgeted_share_of_steps(
    token_seconds,
):
    from specgraft.infer.adaptive.goodput import PROBE_SHARE, SURE_LOSS_PROBE_SHARE

    # each forward token costs a forward (or half one): no depth pays
    ctl = controller({1: 1.0, 64: 1.0 + 63 * token_seconds})
    d = with_quarter_second_levels(ctl)
    plans = []
    steps = 320 if token_seconds < 1 else 3000
    for _ in range(steps):
        plans.append(ctl.plan([(0, d, 2)], batch=1)[0])
        if plans[-1]:
            assert ctl.probes == {0}
            chain = tree_of([-1, 0, 1], logp=[0.0, math.log(0.3), math.log(0.1)])
            assert ctl.select([Candidate(0, d, chain, True)])[0].num_nodes == 3  # a probe is verified whole
            # ... as the path to its likeliest deepest node, where the tree branches: a chain, unmasked alone
            branching = tree_of([-1, 0, 0, 1, 2], logp=[0.0, *map(math.log, (0.3, 0.6, 0.15, 0.12))])
            probe = ctl.select([Candidate(0, d, branching, True)])[0]
            assert probe.tokens.tolist() == [0, 1, 3] and probe.is_chain
    # A level's price: goodput 1 token/s x (0.25 s + one more forward token, 1 s) = 1.25 tokens, more than a level
    # accepted whole could repay: probes of both levels (2.5 tokens) spend a tenth of 1%. At 0.75 tokens a level (a
    # forward token half a second) 1%.
    price = 2 * (0.25 + token_seconds)
    every = math.ceil(price / (PROBE_SHARE if price < 2 else SURE_LOSS_PROBE_SHARE))
    assert [i for i, p in enumerate(plans) if p] == list(range(every - 1, steps, every))
    assert set(plans) == {0, 2}
    chain = tree_of([-1, 0], logp=[0.0, math.log(0.3)])
    assert ctl.select([Candidate(0, d, chain, True)])[0].num_nodes == 1  # not probing: cut as selection says


def test_a_probe_teaches_the_depths_that_pay_only_together_and_the_row_then_drafts_them():
    """A draft's fixed costs (the scheduler's work on a tree, the drafter's call) can make one level a loss where
    several pay (prompt lookup copies many tokens for the price of one): a probe one level deeper than a plan of none
    never learned that. A probe verifies as deep as the row may draft, and every depth's reach is learned."""
    ctl, d = controller({1: 1.0, 64: 1.0 + 63 * 0.05}), Drafter()  # a forward token: 0.05 of a forward
    ctl.cost.per_drafted = 1.2  # the work on any tree: more than one token accepted repays
    stats = ctl.stats(d)
    for levels in (1, 4):
        stats.observe_cost(levels, 0.01)  # drafting costs the same at any depth
    stats.reach = [0.3, 0.1, 0.02, 0.02]  # what a few unlucky first trees taught: no depth pays
    planned = []
    for step in range(800):
        depths = ctl.plan([(0, d, 4)], batch=1)
        planned.append(depths[0])
        if depths[0]:
            chain = tree_of([-1, 0, 1, 2, 3], logp=[0.0] * 5)  # no probabilities: prompt lookup's
            tree = ctl.select([Candidate(0, d, chain, True)])[0]
            ctl.observe_step(0, d, tree, torch.arange(tree.num_nodes))  # every copied token was right
    # Probes, four deep, every 141 steps (1.41 tokens at 1% of the steps); the drafter learns their reach four trees
    # at a time (`LEARN_EVERY`), and then the row drafts all four levels every step
    assert [i for i, p in enumerate(planned[:600]) if p][:4] == [140, 281, 422, 563]
    assert set(planned) == {0, 4} and all(planned[600:])


@pytest.mark.parametrize("behind_seconds", [0.002, 0.02])
def test_a_probe_is_priced_with_catching_up_the_tokens_its_row_committed_since_it_last_drafted(behind_seconds):
    """A probe's draft runs the tokens committed since the row last drafted first (a head's cache, lookup's index),
    about one a step between probes: that catching up counts in the probe's share, and where it alone costs more
    than the share, the row does not probe at this batch (stories260K, prompt lookup at batch 4: probes budgeted at
    1% cost 2.5% of the throughput before)."""
    from specgraft.infer.adaptive.goodput import PROBE_SHARE

    ctl, d = controller({1: 1.0, 64: 1.0 + 63 * 0.5}), Drafter()
    stats = ctl.stats(d)
    stats.observe_cost(1, 0.25, behind=0.0)
    stats.observe_cost(2, 0.5, behind=0.0)
    stats.observe_cost(2, 0.5 + 10 * behind_seconds, behind=10.0)  # a level 0.25 s, a token behind behind_seconds
    stats.reach = [0.3, 0.1]
    plans = [ctl.plan([(0, d, 2)], batch=1)[0] for _ in range(1000)]
    per_token = ctl.priced[id(d)][2]
    assert per_token == pytest.approx(behind_seconds)  # goodput: a token a second
    price = 2 * (0.25 + 0.5)
    probes = [i for i, p in enumerate(plans) if p]
    if per_token < PROBE_SHARE:
        every = math.ceil(price / (PROBE_SHARE - per_token))  # 188 steps, not 150
        assert probes == list(range(every - 1, 1000, every))
    else:
        assert probes == []


def test_rows_shorter_than_a_probes_wait_probe_all_the_same_at_phases_spread_by_their_keys():
    """Each row probes on its own clock; one that joined would wait a whole ``every`` for its first probe, and rows
    that end sooner (a 64-token generation against 70 steps) would never probe, nor their drafter learn again."""
    from specgraft.infer.adaptive.goodput import PROBE_SHARE

    ctl = controller({1: 1.0, 64: 1.0 + 63 * 0.5})
    d = with_quarter_second_levels(ctl)
    every = 1.5 / PROBE_SHARE  # both levels at 0.75 tokens each
    probed = []
    for key in range(40):  # rows one after another, each for half a wait
        plans = [ctl.plan([(key, d, 2)], batch=1)[key] for _ in range(int(every / 2))]
        probed.append(sum(1 for p in plans if p))
        ctl.forget(key)
    assert set(probed) == {0, 1} and 15 <= sum(probed) <= 25  # about half of them, once each


def test_a_plan_that_drafts_no_row_stands_for_its_rows_until_a_row_is_due_or_what_it_read_moves():
    """Steps that take the standing plan where there is one plan as steps that plan every time, probes included;
    a plan stands only for the rows' name it was made for, where it drafts none, while its inputs hold."""
    def make():
        ctl = controller({1: 1.0, 64: 64.0})  # a level costs 1.25 tokens: no depth pays
        return ctl, with_quarter_second_levels(ctl)

    (every_step, d1), (standing, d2) = make(), make()
    planned, taken, plans = [], [], 0
    for _ in range(3000):
        planned.append(dict(every_step.plan([(0, d1, 2), (1, d1, 2)], batch=2, composition=7)))
        depths = standing.standing(7, batch=2)
        if depths is None:
            plans += 1
            depths = standing.plan([(0, d2, 2), (1, d2, 2)], batch=2, composition=7)
        taken.append(dict(depths))
    # a probe of both levels (2.5 tokens) every 2,500 steps, each row on its own clock: row 0's at its end, row 1's
    # first after the share of the wait its key leaves (1 - 0.618)
    probes = [(i, key) for i, plan in enumerate(planned) for key, depth in plan.items() if depth]
    assert taken == planned and probes == [(954, 1), (2499, 0)]
    assert plans <= 6  # the first plan, and around each probe: the plan before it stands no further than it
    assert standing.clock == every_step.clock == 3000

    ctl, d = make()
    rows = [(0, d, 4)]
    assert ctl.plan(rows, batch=1, composition=3) == {0: 0}
    assert ctl.standing(3, batch=1) == {0: 0}
    assert ctl.standing(4, batch=1) is None  # other rows
    assert ctl.standing(3, batch=2) is None  # another batch
    ctl.cost.scale = 1.5  # the prices move
    assert ctl.standing(3, batch=1) is None
    assert ctl.plan(rows, batch=1) == {0: 0} and ctl.standing(3, batch=1) is None  # made for no name: stands for none
    assert ctl.plan(rows, batch=1, composition=3) == {0: 0} and ctl.standing(3, batch=1) == {0: 0}  # memoised, named
    ctl.stats(d).reach = [0.9, 0.9]
    ctl.stats(d).moved()  # its drafter learned
    assert ctl.standing(3, batch=1) is None
    ctl.cost = StepCost({1: 1.0, 64: 1.0})  # and verifying became free: a level pays
    assert ctl.plan(rows, batch=1, composition=3)[0] > 0 and ctl.standing(3, batch=1) is None  # it drafts: no standing


def test_a_row_silenced_by_early_misses_drifts_back_to_its_drafters_reach_and_drafts_again():
    from specgraft.infer.adaptive.goodput import QUIET_HALVING

    ctl, d = controller({1: 1.0, 64: 1.0}), Drafter()  # verifying is free; goodput 1 token a second
    stats = ctl.stats(d)
    stats.observe_cost(1, 0.5)
    stats.observe_cost(2, 1.0)  # half a second a level: a level must reach 0.5 tokens
    stats.reach = [0.7]
    assert ctl.plan([(0, d, 1)], batch=1) == {0: 1}
    row = ctl.row(0)
    for _ in range(4):  # four misses: (0 + 4 x 0.7) / (4 + 4) = 0.35
        row.observe(0, 1, stats, now=ctl.clock)
    row.plan = None
    plans = [ctl.plan([(0, d, 1)], batch=1)[0] for _ in range(2 * QUIET_HALVING + 1)]
    assert plans[:-1] == [0] * (2 * QUIET_HALVING)  # halved once: 2.8 / (2 + 4) = 0.47, still short
    assert plans[-1] == 1  # halved twice: 2.8 / (1 + 4) = 0.56


def test_the_calibration_curve_pairs_what_selection_expected_with_what_was_accepted():
    ctl, d = controller({1: 1.0, 64: 1.0}), Drafter()  # verifying is free: every node is kept
    for accepted in ([0, 1], [0, 1, 2], [0]):
        chain = tree_of([-1, 0, 1], logp=[0.0, math.log(0.8), math.log(0.4)])
        trees = ctl.select([Candidate(7, d, chain, True)])
        ctl.observe_step(7, d, trees[7], torch.tensor(accepted))
    ctl.learn()  # three trees queued: fewer than a pass
    curve = ctl.stats(d).calibration_curve()
    assert [(p["depth"], p["nodes"], p["observed"]) for p in curve] == [(1, 3, 2 / 3), (2, 3, 1 / 3)]
    assert curve[0]["estimated"] == pytest.approx(0.8, abs=0.05) and curve[1]["estimated"] == pytest.approx(0.4, abs=0.05)


def test_drafters_learn_a_pass_of_trees_at_a_time_rows_at_once_and_as_one_by_one_would(monkeypatch):
    """A drafter learns from verified trees `LEARN_EVERY` at a time (or when a row leaves), with what selection
    expected of each when it was selected, and its statistics end as learning tree by tree leaves them; a row's
    own counts move at once (its next plan reads them)."""
    import specgraft.infer.adaptive.goodput as goodput

    accepted = [[0, 1], [0], [0, 1, 2], [0, 1], [0], [0], [0, 1, 2]]

    def run(every: int) -> tuple[GoodputController, Drafter, list[int], list[tuple[list[float], list[float]]]]:
        monkeypatch.setattr(goodput, "LEARN_EVERY", every)
        ctl, d, learned, counts = controller({1: 1.0, 64: 1.0}), Drafter(), [], []
        lookup = tree_of([-1, 0, 1], tokens=[5, 6, 7])  # rates, no probabilities
        chain = tree_of([-1, 0, 1], logp=[0.0, math.log(0.8), math.log(0.4)])
        for step, path in enumerate(accepted):
            for key, tree in ((7, chain), (8, lookup)):
                # what selection expected of the nodes it kept (here as given, not read off learning as it went)
                ctl.estimated[key] = [1.0, 0.7 - step / 20, 0.3]
                if key == 8:
                    ctl.rates[key] = [1.0, 0.9, 0.5 + step / 30]
                ctl.observe_step(key, d, tree, torch.tensor(path))
            learned.append(sum(p["nodes"] for p in ctl.stats(d).calibration_curve()))
            counts.append((list(ctl.row(8).hits), list(ctl.row(8).seen)))  # the row's own: moved at once
        ctl.forget(7)  # a row leaves: every tree queued is learned
        assert not ctl.queued
        return ctl, d, learned, counts

    one, d1, learned1, counts1 = run(1)
    four, d4, learned4, counts4 = run(4)
    assert counts4 == counts1 and counts1[0] == ([1.0, 0.0], [1.0, 1.0])
    assert learned1 == [4 * (step + 1) for step in range(len(accepted))]  # each tree, two nodes, at once
    assert learned4 == [0, 8, 8, 16, 16, 24, 24]  # four trees (two steps of two rows) at a time, then the rest ...
    assert sum(p["nodes"] for p in four.stats(d4).calibration_curve()) == 28  # ... when a row left
    s1, s4 = one.stats(d1), four.stats(d4)
    for a, b in zip(s4.calibration_curve(), s1.calibration_curve(), strict=True):
        assert a == pytest.approx(b)
    assert s4.reach == pytest.approx(s1.reach) and len(s1.reach) == 2
    def factors(s):
        return [s.probability.factor(1), s.probability.factor(2), s.rates.factor(1), s.rates.factor(2)]

    assert factors(s4) == pytest.approx(factors(s1))


# --------------------------------------------------------------------------- exact end to end


@pytest.fixture
def pruning_cost(monkeypatch):
    """A cost curve that keeps some candidates and drops others, so verification sees cut trees."""
    # Seconds in a forward: cheap up to 4 tokens, then 0.06-0.09 a token; drafting costs a few ms a level (measured).
    monkeypatch.setattr(GoodputController, "step_cost", lambda self: StepCost({1: 1.0, 4: 1.05, 8: 1.3, 16: 2.0, 1024: 130.0}))


@pytest.mark.parametrize("tree", [sg.Adaptive(top_k=1, max_depth=5, max_nodes=5), sg.Adaptive(max_depth=5, max_nodes=12)],
                         ids=["chain-shaped", "branching"])
def test_adaptive_trees_alone_and_beside_fixed_ones_equal_hf_greedy(stories, dev_prompts, trained_eagle, pruning_cost, tree):
    eagle = sg.load_drafter(trained_eagle, stories)
    drafters = {"eagle": eagle, "lookup": sg.PromptLookup(), "both": sg.Composite(sg.PromptLookup(max_matches=1), eagle)}
    rows = [("eagle", tree), ("lookup", tree), ("both", tree), ("eagle", sg.Chain(4)), ("none", None), ("eagle", tree)]
    prompts = [stories.encode(p) for p in dev_prompts[30 : 30 + len(rows)]]
    sched = sg.Scheduler(stories, drafters, max_batch_size=4)  # six rows through four: rows join as others leave
    driver = Driver(sched)
    handles = [sched.submit(p, 40, drafter=name, tree=t, eos_token_id=()) for p, (name, t) in zip(prompts, rows)]
    drafted, verified = [], []  # draft nodes of the adaptive rows' trees before and after each selection
    select = sched.controller.select

    def recording(candidates):
        trees = select(candidates)
        drafted.append(sum(c.tree.num_draft_tokens for c in candidates if c.adaptive))
        verified.append(sum(trees[c.key].num_draft_tokens for c in candidates if c.adaptive))
        return trees

    sched.controller.select = recording
    driver.run(*handles)
    assert sched.counters.verify_forwards == sched.counters.steps
    for handle, prompt, (name, t) in zip(handles, prompts, rows):
        assert driver.result(handle).token_ids == hf_generate(stories, prompt, 40, eos_token_id=None), name
    assert sum(verified) > 0 and any(v < d for v, d in zip(verified, drafted))  # cut trees were verified
    alone = sg.SpeculativeGenerator(stories, eagle, tree=tree).generate(prompts[0], 40, eos_token_id=())
    assert alone.token_ids == driver.result(handles[0]).token_ids
    assert alone.stats.mean_accepted_length > 1.5  # alone, the head's nodes were really verified


def test_rows_idle_for_many_steps_draft_exactly_when_they_resume(stories, dev_prompts, trained_eagle, monkeypatch):
    """An idle row's commits wait as views and are folded every `PENDING_COMMITS`; drafting resumes from them exactly."""
    from specgraft.heads.feature_drafter import PENDING_COMMITS

    eagle = sg.load_drafter(trained_eagle, stories)
    steps = [0]

    def idle_then_deep(self, rows, batch, composition=None):  # no drafting for more steps than a state keeps pending, then 4 levels
        steps[0] += 1
        return {key: 0 if steps[0] <= PENDING_COMMITS + 5 else min(4, deepest) for key, _, deepest in rows}

    monkeypatch.setattr(GoodputController, "plan", idle_then_deep)
    prompts = [stories.encode(p) for p in dev_prompts[:2]]
    sched = sg.Scheduler(stories, {"eagle": eagle}, max_batch_size=2)
    driver = Driver(sched)
    handles = [sched.submit(p, PENDING_COMMITS + 30, drafter="eagle", tree=sg.Adaptive(), eos_token_id=()) for p in prompts]
    driver.run(*handles)
    for handle, prompt in zip(handles, prompts):
        assert driver.result(handle).token_ids == hf_generate(stories, prompt, PENDING_COMMITS + 30, eos_token_id=None)
    assert sched.counters.accepted_tokens > 0  # after the idle stretch the head's drafts were accepted


def test_a_closed_batch_drafts_only_its_longest_rows_while_no_request_waits(stories, dev_prompts, monkeypatch):
    """A closed batch ends with its longest row: a row with fewer tokens left is planned no draft (exactly)."""
    planned = []

    def recording(self, rows, batch, composition=None):  # the deepest each adaptive row may draft, as the scheduler offers it
        planned.append({key: deepest for key, _, deepest in rows})
        return {key: min(2, deepest) for key, _, deepest in rows}

    monkeypatch.setattr(GoodputController, "plan", recording)
    prompts = [stories.encode(p) for p in dev_prompts[:3]]
    for closed, rows in ((True, 3), (False, 3), (True, 2)):  # the last: a request waits for a free row
        sched = sg.Scheduler(stories, {"lookup": sg.PromptLookup()}, max_batch_size=rows, closed=closed)
        driver = Driver(sched)
        handles = [sched.submit(p, n, drafter="lookup", tree=sg.Adaptive(), eos_token_id=())
                   for p, n in zip(prompts, (6, 12, 12))]
        planned.clear()
        driver.run(*handles)
        first = planned[0]  # the first step: 5 tokens left for the short row, 11 for the others
        if closed and rows == 3:
            assert first[handles[0]] == 0 and first[handles[1]] > 0 and first[handles[2]] > 0
        else:
            assert first[handles[0]] > 0 and first[handles[1]] > 0
        for handle, prompt, n in zip(handles, prompts, (6, 12, 12)):
            assert driver.result(handle).token_ids == hf_generate(stories, prompt, n, eos_token_id=None)


class Guesses:
    """A drafter that proposes the same chain of guesses whatever the text (verification keeps what is right)."""

    hidden_layers = ()

    def start(self, prompt_ids, hidden):
        return self

    def commit(self, tokens, hidden, path=None):
        pass

    def cache_tokens(self):
        return 0

    def propose(self, root_token, policy, max_depth, sampling=None):
        return tree_of(list(range(-1, max_depth)), tokens=[root_token] + [7] * max_depth)


def draft_every(monkeypatch, period: int, levels: int) -> list[int]:
    """Plans that draft ``levels`` levels on every ``period``-th step and nothing between, verified whole; returns
    the step counter (its [0]: steps planned so far)."""
    steps = [0]

    def plan(self, rows, batch, composition=None):
        steps[0] += 1
        return {key: levels if steps[0] % period == 0 else 0 for key, _, _ in rows}

    monkeypatch.setattr(GoodputController, "plan", plan)
    monkeypatch.setattr(GoodputController, "select", lambda self, candidates: {c.key: c.tree for c in candidates})
    monkeypatch.setattr(GoodputController, "step_cost", lambda self: StepCost({1: 1.0}))
    return steps


class Committing(StepObserver):
    """Calls ``told`` with each step's `Committed`."""

    def __init__(self, told) -> None:
        self.told = told

    def committed(self, step: Committed) -> None:
        self.told(step)


def test_the_scheduler_reports_tokens_behind_each_round_and_which_forwards_paid_for_trees(stories, monkeypatch):
    """A draft round is timed with the tokens its rows were behind (the prompt, then every commit since their last
    round); a forward is reported masked only when it paid for trees: a chain alone runs causal, a batch packed
    with a tree pays (on the packed path; a captured forward masks every one)."""
    from conftest import uncaptured

    stories = uncaptured(stories)
    steps, rounds, forwards = draft_every(monkeypatch, 3, levels=2), [], []
    monkeypatch.setattr(GoodputController, "observe_draft",
                        lambda self, d, rows, levels, s, behind: rounds.append((steps[0], behind)))
    monkeypatch.setattr(GoodputController, "observe_times",  # at the next step's start, of the step before
                        lambda self, tokens, seconds, masked, rows, drafted, overhead: forwards.append((rows, tokens, masked)))
    prompt = stories.encode("the cat sat on the mat and the cat sat on the mat and the cat sat on the")
    for batch in (1, 2):
        sched = sg.Scheduler(stories, {"guesses": Guesses()}, max_batch_size=batch)
        driver = Driver(sched)
        commits = []  # (steps planned so far, tokens a row kept in its step)
        sched.add_observer(Committing(lambda step: commits.extend((steps[0], row.kept) for row in step.rows)))
        steps[0], rounds[:], forwards[:] = 0, [], []
        handles = [sched.submit(prompt, 16, drafter="guesses", tree=sg.Adaptive(), eos_token_id=()) for _ in range(batch)]
        sched.controller.cost = StepCost({1: 1.0})  # timed: steps are observed
        driver.run(*handles)
        if batch == 1:
            # every third step drafts but the last (a row with one token left drafts nothing, whatever is planned)
            assert [r for r, _ in rounds] == [r for r in range(3, steps[0] + 1, 3) if r < steps[0]]
            # the first round (step 3): the prompt and the first token (its prefill's) plus steps 1 and 2's commits
            expected = [len(prompt) + sum(n for step, n in commits if step < 3)]
            expected += [sum(n for step, n in commits if r - 3 <= step < r) for r, _ in rounds[1:]]
            assert [behind for _, behind in rounds] == pytest.approx(expected)
            chains = [masked for rows, tokens, masked in forwards if tokens > rows]
            assert chains and not any(chains)  # chains alone: causal, no mask
        else:
            assert any(masked for rows, tokens, masked in forwards if tokens > rows)
        assert all(not masked for rows, tokens, masked in forwards if tokens == rows)


def test_steps_that_verify_no_tree_are_timed_one_in_a_few_and_every_other_step_is(stories, monkeypatch):
    from specgraft.infer.scheduler import UNDRAFTED_TIMED_EVERY

    draft_every(monkeypatch, 3, levels=2)
    told = []
    monkeypatch.setattr(GoodputController, "observe_times",
                        lambda self, tokens, seconds, masked, rows, drafted, overhead: told.append((tokens, drafted)))
    sched = sg.Scheduler(stories, {"guesses": Guesses()}, max_batch_size=1)
    trees = {}  # step -> whether its row verified a tree
    sched.add_observer(Committing(lambda step: trees.update({step.step: step.rows[0].draft_tokens > 0})))
    handle = sched.submit(stories.encode("the cat sat on the mat and the cat"), 40, drafter="guesses", tree=sg.Adaptive(),
                          eos_token_id=())
    sched.controller.cost = StepCost({1: 1.0})  # timed: steps are observed
    Driver(sched).run(handle)
    last = sched.counters.steps  # told at the next step's start: none came
    expected = [(int(trees[s]), int(trees[s])) for s in range(1, last) if trees[s] or s % UNDRAFTED_TIMED_EVERY == 0]
    assert [(int(tokens > 1), drafted) for tokens, drafted in told] == expected
    assert sum(trees.values()) >= 5 and len(expected) < last - 10


class Recorder(Guesses):
    """`Guesses` that keeps every commit it is given: (tokens, the target's last hidden state of each, path)."""

    def __init__(self, layer: int) -> None:
        self.hidden_layers, self.commits = (layer,), []

    def commit(self, tokens, hidden, path=None):
        self.commits.append((tokens.tolist(), hidden[self.hidden_layers[0]].clone(), path))


def assert_given_in_order_once(target, recorder: Recorder, prompt: list[int], generated: list[int]) -> None:
    """The draft state got the generation's tokens in order, each once (all but the last few), with the target's
    states at its layer there, as one forward over the whole text computes them."""
    layer = recorder.hidden_layers[0]
    committed = [t for tokens, _, _ in recorder.commits for t in tokens]
    assert committed == generated[:len(committed)] and len(committed) >= len(generated) - 4
    ids = torch.tensor(prompt + generated)
    out = target.forward(ids[None], target.new_cache(), torch.arange(len(ids))[None], hidden_layers=(layer,))
    states = torch.cat([h for _, h, _ in recorder.commits])
    torch.testing.assert_close(states, out.hidden[layer][0, len(prompt) : len(prompt) + len(committed)],
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("batch", [1, 2])
def test_a_row_that_does_not_draft_gives_its_commits_when_it_next_drafts_as_one(stories, monkeypatch, batch):
    """Its draft state gets the steps' tokens and target states in order, each once, joined in one commit before it
    next proposes (or once `HELD_BYTES` of the forwards' states are held); the commit of a step it drafted carries
    that step's path."""
    from specgraft.infer import scheduler as scheduler_module

    draft_every(monkeypatch, 5, levels=1)
    row_bytes = stories.config.hidden_size * 4  # a token's states at one layer, in float32
    monkeypatch.setattr(scheduler_module, "HELD_BYTES", 3 * batch * row_bytes)  # three forwards of roots alone
    layer = stories.num_layers
    recorders = [Recorder(layer) for _ in range(batch)]
    sched = sg.Scheduler(stories, {f"r{i}": r for i, r in enumerate(recorders)}, max_batch_size=batch)
    driver = Driver(sched)
    prompts = [stories.encode(text) for text in ("Once upon a time, there was a little dog", "The sun was hot")]
    handles = [sched.submit(prompts[i], 23, drafter=f"r{i}", tree=sg.Adaptive(), eos_token_id=()) for i in range(batch)]
    driver.run(*handles)
    for handle, recorder, prompt in zip(handles, recorders, prompts):  # rows of different texts: each its own states
        assert_given_in_order_once(stories, recorder, prompt, driver.result(handle).token_ids)
        sizes = [len(tokens) for tokens, _, _ in recorder.commits]
        with_path = [path is not None for _, _, path in recorder.commits]
        # between rounds: the four plain steps' roots, given as one commit of 3 (the cap) and one of 1 before the
        # round; a drafted step's commit carries its path
        assert with_path[:4] == [False, False, True, False] and sizes[:2] == [3, 1]
        assert all(n <= 3 or path for n, path in zip(sizes, with_path))


def test_rows_keep_their_roots_beside_rows_of_other_layers_or_none_and_rows_that_join_later(stories, monkeypatch):
    """The held forwards serve rows of different layers, a drafter that reads none, and a row that joined after the
    others began: each draft state gets its own tokens and states at its own layer, in order, each once."""
    from specgraft.infer import scheduler as scheduler_module

    draft_every(monkeypatch, 5, levels=1)
    row_bytes = stories.config.hidden_size * 4  # a token's states at one layer, in float32
    monkeypatch.setattr(scheduler_module, "HELD_BYTES", 10 * 2 * row_bytes)  # every three or four forwards (two layers)
    last, early = Recorder(stories.num_layers), Recorder(2)
    late = Recorder(1)  # a layer no other row reads: the forwards before it joined hold none of it
    sched = sg.Scheduler(stories, {"last": last, "early": early, "late": late, "guesses": Guesses()}, max_batch_size=4)
    driver = Driver(sched)
    texts = {"last": "Once upon a time, there was a little dog", "early": "The sun was hot", "guesses": "A cat",
             "late": "Tom and Sue went to the park"}
    prompts = {name: stories.encode(text) for name, text in texts.items()}
    handles = {name: sched.submit(prompts[name], 21, drafter=name, tree=sg.Adaptive(), eos_token_id=())
               for name in ("last", "early", "guesses")}
    held = []  # bytes of states held after each step
    for _ in range(6):
        driver.step()
        held.append(sched._held.bytes)
    handles["late"] = sched.submit(prompts["late"], 21, drafter="late", tree=sg.Adaptive(), eos_token_id=())
    while not all(driver.finished(h) for h in handles.values()):
        driver.step()
        held.append(sched._held.bytes)
    # let go when every row has given (all draft on every fifth step), or at the cap; never beyond a forward past it
    # (four rows, three layers)
    cap = 10 * 2 * row_bytes
    assert held[4] == 0 and held.count(0) >= 4 and max(held) < cap + 4 * 3 * row_bytes and max(held) >= 6 * 2 * row_bytes
    for name, recorder in (("last", last), ("early", early), ("late", late)):
        assert_given_in_order_once(stories, recorder, prompts[name], driver.result(handles[name]).token_ids)
    assert not sched._held  # idle: nothing held


def test_rows_whose_drafter_reads_no_states_keep_their_roots_to_a_cap_in_rows(stories, monkeypatch):
    """A drafter that reads no states holds no bytes, yet its rows' kept roots and the held forwards grow a step at a
    time: past `HELD_ROWS` rows every row gives what it kept and the forwards are let go."""
    from specgraft.infer import scheduler as scheduler_module

    draft_every(monkeypatch, 1000, levels=1)  # no row drafts
    monkeypatch.setattr(scheduler_module, "HELD_ROWS", 6)
    sched = sg.Scheduler(stories, {"guesses": Guesses()}, max_batch_size=2)
    driver = Driver(sched)
    handles = [sched.submit(stories.encode(text), 20, drafter="guesses", tree=sg.Adaptive(), eos_token_id=())
               for text in ("Once upon a time", "The sun was hot")]
    held = []
    while not all(driver.finished(h) for h in handles):
        driver.step()
        held.append((sched._held.rows, len(sched._held.forwards)))
    assert max(rows for rows, _ in held) == 4 and max(forwards for _, forwards in held) == 2  # given at 6: two a step
    assert held.count((0, 0)) >= 5 and not sched._held


def test_commits_folded_in_runs_draft_as_one_commit_of_them_all(stories, trained_eagle):
    """Forty one-token commits (folded at `PENDING_COMMITS` and at the round) draft the tree one commit of all forty does."""
    eagle = sg.load_drafter(trained_eagle, stories)
    prompt = stories.encode("Once upon a time, there was a little dog")
    ids = torch.tensor(prompt + hf_generate(stories, prompt, 48, eos_token_id=None))
    prompt, rest = ids[:6], ids[6:46]  # the prompt's start; forty committed tokens
    out = stories.forward(ids[None], stories.new_cache(), torch.arange(len(ids))[None], hidden_layers=eagle.hidden_layers)
    hidden = {i: h[0] for i, h in out.hidden.items()}
    one_by_one = eagle.start(prompt, {i: h[:6] for i, h in hidden.items()})
    at_once = eagle.start(prompt, {i: h[:6] for i, h in hidden.items()})
    for j in range(6, 46):
        one_by_one.commit(ids[j : j + 1], {i: h[j : j + 1] for i, h in hidden.items()})
    at_once.commit(rest, {i: h[6:46] for i, h in hidden.items()})
    assert len(one_by_one.pending) < len(rest)  # a fold happened before the round
    a, b = (s.propose(int(ids[46]), sg.Chain(4), 4) for s in (one_by_one, at_once))
    assert a.tokens.tolist() == b.tokens.tolist()
    torch.testing.assert_close(a.scores, b.scores)


def test_a_state_computes_its_prompts_features_when_a_round_first_reads_them(stories, trained_eagle, monkeypatch):
    """A row the engine never lets draft never runs its head's feature map over its prompt (EAGLE-3: a layer over
    three taps of every prompt token); its first round maps the prompt and the commits since in one call."""
    eagle = sg.load_drafter(trained_eagle, stories)
    mapped: list[int] = []
    real = eagle.head.draft_features
    monkeypatch.setattr(eagle.head, "draft_features", lambda hidden: mapped.append(len(next(iter(hidden.values()))))
                        or real(hidden))
    ids = torch.tensor(stories.encode("Once upon a time, there was a little dog"))
    out = stories.forward(ids[None], stories.new_cache(), torch.arange(len(ids))[None], hidden_layers=eagle.hidden_layers)
    hidden = {i: h[0] for i, h in out.hidden.items()}
    state = eagle.start(ids[:6], {i: h[:6] for i, h in hidden.items()})
    state.commit(ids[6:8], {i: h[6:8] for i, h in hidden.items()})
    assert mapped == []
    state.propose(int(ids[8]), sg.Chain(2), 2)
    assert mapped[0] == 8  # the prompt's 6 and the 2 committed, in one call


def test_adaptive_rows_sampled_beside_fixed_ones_follow_their_own_distributions(small_vocab_pair, monkeypatch):  # noqa: F811
    """Adaptive trees (point masses, cut by the controller) among sampled chains, each row its own temperature."""
    from specgraft.tools.exactness import fit

    # 0.02 s a token: with 24 rows a node is worth verifying above a chance of about a third, so some are cut.
    monkeypatch.setattr(GoodputController, "step_cost", lambda self: StepCost({1: 1.0, 1024: 21.46}))
    target, draft = small_vocab_pair
    drafters = {"draft": draft, "lookup": sg.PromptLookup(max_ngram=2, num_tokens=3)}
    settings = [
        ("draft", sg.Adaptive(max_depth=3, max_nodes=6), 1.0, {}),
        ("draft", sg.Adaptive(top_k=1, max_depth=3, max_nodes=3), 0.7, {"top_k": 3}),
        ("lookup", sg.Adaptive(max_depth=3, max_nodes=4), 1.3, {}),
        ("draft", sg.Chain(3, draw="sample"), 1.0, {"top_p": 0.8}),
    ]
    prompts = ([0, 1, 2, 0, 1], [3, 4, 5], [2, 4, 2, 4, 2], [5, 0, 3, 2, 0, 3])
    sched = sg.Scheduler(target, drafters, max_batch_size=24, max_len=16)
    driver = Driver(sched)
    verified, cut = [0], [0]  # draft nodes of adaptive rows the controller kept, and those it dropped
    torch.manual_seed(13)
    counts = [Counter() for _ in settings]
    for _ in range(2400 // 6):
        handles = []
        for i in range(24):
            name, tree, temperature, filters = settings[i % 4]
            handles.append((i % 4, sched.submit(prompts[i % 4], max_new_tokens=SAMPLING_LENGTH, drafter=name, tree=tree,
                                                eos_token_id=(), temperature=temperature, **filters)))
        if not hasattr(sched.controller, "recording"):
            chosen = sched.controller.select

            def recording(candidates, chosen=chosen):
                trees = chosen(candidates)
                kept = sum(trees[c.key].num_draft_tokens for c in candidates if c.adaptive)
                verified[0] += kept
                cut[0] += sum(c.tree.num_draft_tokens for c in candidates if c.adaptive) - kept
                return trees

            sched.controller.select, sched.controller.recording = recording, True
        while not sched.idle:
            driver.step()
        for i, handle in handles:
            counts[i][tuple(driver.result(handle).token_ids)] += 1
    assert verified[0] > 1000  # adaptive rows really verified drafts (cut to what the controller kept)
    assert cut[0] > 100  # and the controller cut candidates
    for counter, prompt, (name, tree, temperature, filters) in zip(counts, prompts, settings):
        result = fit(counter, enumerated(target, prompt, temperature, filters))
        assert result.passed, f"{name} {tree} T={temperature} {filters}: {result}"


def test_a_steps_work_is_timed_from_its_start_to_the_next_steps_less_its_forward_and_drafting(stories, monkeypatch):
    """The overhead fit sees each step's time up to the next step's start, less its forward and drafting: work
    between steps (a server's streaming) counts; the step that timed the cost curve (seconds, once) does not, nor
    a stretch over which rows joined or left."""
    import specgraft.infer.scheduler as scheduler_module

    measured = StepCost.measure

    def slow_measure(target):  # timing the curve takes 50 ms
        time.sleep(0.05)
        return measured(target)

    reports = []
    monkeypatch.setattr(StepCost, "measure", staticmethod(slow_measure))
    monkeypatch.setattr(scheduler_module, "OVERHEAD_CLIP", 1e9)
    monkeypatch.setattr(GoodputController, "observe_times",
                        lambda self, tokens, f, masked, rows, drafted, s: s is None or reports.append(s))
    forget_step_cost(stories)
    sched = sg.Scheduler(stories, {"guesses": Guesses()}, max_batch_size=2)
    handles = [sched.submit(stories.encode("Once upon a time"), 12, drafter="guesses", tree=sg.Adaptive(),
                            eos_token_id=()) for _ in range(2)]
    steps = 0
    while not sched.idle:
        sched.step()
        steps += 1
        time.sleep(0.01)  # 10 ms between steps: the caller's work, part of every step's time
    assert handles and reports
    assert all(0.01 <= s < 0.04 for s in reports)  # the 10 ms counted, the 50 ms timing not
    assert len(reports) < steps - 1  # not the step that timed, nor those over which a row left


class WaitingGuesses(Guesses):
    """`Guesses` that wait 20 ms for the interpreter (as while a server's HTTP thread holds it) before proposing."""

    def propose(self, root_token, policy, max_depth, sampling=None):
        time.sleep(0.02)
        return super().propose(root_token, policy, max_depth, sampling)


def test_waits_while_drafting_are_the_drafted_steps_work_not_the_drafters_cost(stories, monkeypatch):
    """A drafter is priced on this thread's CPU clock, and so is the drafting a step's overhead leaves out: time it
    spent waiting (a server's streaming holding the interpreter) is the work of the steps that drafted."""
    draft_every(monkeypatch, period=2, levels=2)
    costs, overheads = [], []
    monkeypatch.setattr(GoodputController, "observe_draft", lambda self, drafter, rows, levels, s, behind=0.0: costs.append(s))
    monkeypatch.setattr(GoodputController, "observe_times",
                        lambda self, tokens, f, masked, rows, drafted, s: s is None or overheads.append((drafted, s)))
    monkeypatch.setattr("specgraft.infer.scheduler.OVERHEAD_CLIP", 1e9)
    sched = sg.Scheduler(stories, {"waits": WaitingGuesses()}, max_batch_size=1)
    sched.submit(stories.encode("Once upon a time"), 12, drafter="waits", tree=sg.Adaptive(), eos_token_id=())
    sched.controller.cost = StepCost({1: 1.0})  # timed: steps are observed
    while not sched.idle:
        sched.step()
    assert costs and all(s < 0.01 for s in costs)  # the 20 ms waits are not the drafter's cost ...
    assert any(d for d, _ in overheads) and all(s >= 0.02 for d, s in overheads if d)  # ... but its steps' work
    assert all(s < 0.02 for d, s in overheads if not d)
