"""The verification forward at static shapes (`specgraft.model.captured`): the packed forward's results, exactly
the engine's output, and padding that touches nothing but the scratch row. On CPU it runs eager; tests/test_cuda.py
replays it as CUDA graphs."""

from __future__ import annotations

import random

import pytest
import torch

from test_engine_api import hf_generate
from test_scheduler import (
    BRANCHING_TREE, ROW_FILTERS, ROW_TEMPERATURES, SAMPLING_LENGTH, Driver, Told, enumerated, with_random_head,
)

import specgraft as sg
from specgraft.infer import Drafted
from specgraft.model import Segment
from specgraft.model.captured import SLOT_BUCKET, CapturedForward, Recomputed, Shape, bucket, slot_bucket


@pytest.fixture(scope="module")
def captured(stories):
    """stories260K over the same weights, its batched verification forward run at static shapes."""
    return sg.Target(stories.model, stories.tokenizer, "stories260K-captured", capture=True)


def random_step(rng: random.Random, rows: int, vocab: int, plain: bool = False):
    """Segments over a random subset of ``rows`` (out of order): one-token rows, chains and trees; their tokens.
    ``plain``: every row, one token each (plain decoding)."""
    held = list(range(rows)) if plain else rng.sample(range(rows), rng.randint(1, rows))
    segments, tokens = [], []
    for row in held:
        size = 1 if plain else rng.choice([1, 1, 2, 4, 5, 8, 9])  # a tree as wide as its bucket, and narrower ones
        visible = None
        if size > 1 and rng.random() < 0.7:  # a tree: every node sees the root, itself and one random earlier node
            visible = torch.eye(size, dtype=torch.bool)
            visible[:, 0] = True
            for node in range(2, size):
                visible[node, rng.randrange(1, node)] = True
        segments.append(Segment(row, size, visible))
        tokens.append(torch.tensor([rng.randrange(vocab) for _ in range(size)]))
    return segments, torch.cat(tokens)


def test_the_static_forward_gives_the_packed_forwards_logits_states_and_cache(stories):
    fast, rows, rng = stories.fast, 6, random.Random(0)
    packed = fast.new_batched_cache(rows, 700)
    static = fast.new_batched_cache(rows, 700, scratch=True)
    forward = CapturedForward(fast, static)
    for row in range(rows):  # prompts of 3 to 300 tokens: several slot buckets
        n = rng.randint(3, 300)
        ids = torch.tensor([[rng.randrange(stories.vocab_size) for _ in range(n)]])
        for pool in (packed, static):
            fast.forward(ids, pool.acquire(row)[1], torch.arange(n)[None])
    shapes = set()
    for _ in range(8):
        segments, tokens = random_step(rng, rows, stories.vocab_size)
        want, want_states = fast.forward_packed(tokens, packed, segments, (0, 3, -1))
        got, states = forward(tokens, segments, (0, 3, -1))
        assert got.shape == want.shape and set(states) == {0, 3, -1}
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        for layer in want_states:
            torch.testing.assert_close(states[layer], want_states[layer], rtol=1e-4, atol=1e-4)
        shapes.add((bucket(len(tokens)), bucket(max(seg.size for seg in segments))))
    assert static.lengths(rows) == packed.lengths(rows)
    for row in range(rows):
        held = len(packed.views[row])
        torch.testing.assert_close(static.kv[:, :, row, :, :held], packed.kv[:, :, row, :, :held], rtol=1e-4, atol=1e-5)
    assert len(shapes) > 2 and forward.graphs.eager == 8 and forward.graphs.captures == forward.graphs.replays == 0  # CPU


def test_replays_read_each_steps_inputs_and_hand_out_outputs_of_their_own(stories):
    """The capture-and-replay bookkeeping, with graphs emulated: every replay sees its own step's tokens, positions,
    slots and tree masks (copied into the graph's buffers), what it returns is never rewritten by a later replay, and
    shapes beyond `most_graphs` run eager."""
    fast, rows, rng = stories.fast, 5, random.Random(1)
    packed = fast.new_batched_cache(rows, 400)
    static = fast.new_batched_cache(rows, 400, scratch=True)
    forward = CapturedForward(fast, static, most_graphs=3, recorder=Recomputed())
    for row in range(rows):  # every row under 256 slots throughout: shapes differ by tokens and tree width only
        n = rng.randint(20, 100)
        ids = torch.tensor([[rng.randrange(stories.vocab_size) for _ in range(n)]])
        for pool in (packed, static):
            fast.forward(ids, pool.acquire(row)[1], torch.arange(n)[None])
    returned = []
    for step in range(14):
        segments, tokens = random_step(rng, rows, stories.vocab_size, plain=step % 2 == 0)
        want, want_states = fast.forward_packed(tokens, packed, segments, (2,))
        got, states = forward(tokens, segments, (2,))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(states[2], want_states[2], rtol=1e-4, atol=1e-4)
        returned.append((got, got.clone(), states[2], states[2].clone()))
    for got, kept, state, kept_state in returned:  # no later replay wrote into what an earlier step was handed
        assert torch.equal(got, kept) and torch.equal(state, kept_state)
    graphs = forward.graphs
    assert graphs.captures == len(graphs) == 3
    assert graphs.replays >= 6 and graphs.eager > 0 and graphs.captures + graphs.replays + graphs.eager == 14
    stats = forward.stats()
    assert stats["graphs"] == stats["captures"] == 3 and stats["capture_seconds"] > 0


def test_padding_writes_only_the_scratch_row_and_each_token_its_own_slot(stories):
    fast = stories.fast
    pool = fast.new_batched_cache(3, 300, scratch=True)
    forward = CapturedForward(fast, pool)
    for row, n in enumerate((5, 40, 17)):
        fast.forward(torch.arange(1, n + 1)[None], pool.acquire(row)[1], torch.arange(n)[None])
    before = pool.kv.clone()
    segments = [Segment(2, 3), Segment(0, 1), Segment(1, 1)]  # 5 tokens, padded to 8: 3 padding tokens
    forward(torch.tensor([7, 8, 9, 10, 11]), segments)
    changed = (pool.kv != before).any(dim=(0, 1, 3, 5))  # (rows + scratch, slots)
    written = torch.zeros_like(changed)
    written[2, 17:20] = written[0, 5] = written[1, 40] = True
    assert torch.equal(changed[:3], written[:3])  # every real token wrote its own slot, nothing else moved
    assert changed[3].any()  # the padding went to the scratch row
    assert pool.rows == 3 and pool.scratch_row == 3 and pool.lengths(3) == [6, 41, 20]
    with pytest.raises(RuntimeError, match="all 3 rows"):
        pool.acquire()  # the scratch row is never handed out


def test_shapes_are_buckets_of_tokens_tree_width_and_slots(stories):
    assert [bucket(n) for n in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]
    most = 3 * SLOT_BUCKET - 10  # a pool's slots
    assert [slot_bucket(w, most) for w in (1, SLOT_BUCKET, SLOT_BUCKET + 1, 3 * SLOT_BUCKET)] == [
        SLOT_BUCKET, SLOT_BUCKET, 2 * SLOT_BUCKET, most]
    assert Shape(8, 4, 256, ()) == Shape(8, 4, 256, ()) != Shape(8, 4, 256, (1,))


def test_capture_needs_the_fast_path_and_a_scratch_row(stories):
    with pytest.raises(ValueError, match="capture=True needs the fast path"):
        sg.Target(stories.model, stories.tokenizer, "hf", fast=False, capture=True)
    with pytest.raises(ValueError, match="scratch row"):
        CapturedForward(stories.fast, stories.fast.new_batched_cache(2, 64))


def test_a_captured_target_gives_every_drafter_kind_the_targets_greedy_output(captured, dev_prompts, trained_eagle):
    """Plain rows, prompt lookup, a trained EAGLE head's chains and dynamic trees and Medusa's static tree in one
    scheduler over the captured target, and a lone row (which verifies through the same static forward)."""
    eagle = sg.load_drafter(trained_eagle, captured)
    drafters = {"lookup": sg.PromptLookup(), "eagle": eagle, "medusa": with_random_head(captured, "medusa_static").drafter}
    rows = [("none", None), ("lookup", sg.Chain(4)), ("eagle", sg.Chain(4)),
            ("eagle", sg.DynamicTree(top_k=4, depth=5, budget=16)), ("medusa", sg.StaticTree(BRANCHING_TREE))]
    prompts = [captured.encode(p) for p in dev_prompts[20 : 20 + len(rows)]]
    budgets = [40, 33, 48, 29, 37]
    sched = sg.Scheduler(captured, drafters, max_batch_size=len(rows))
    driver = Driver(sched)
    handles = [sched.submit(p, n, drafter=name, tree=tree, eos_token_id=()) for p, n, (name, tree) in zip(prompts, budgets, rows)]
    driver.run(*handles)
    for handle, prompt, n, (name, _) in zip(handles, prompts, budgets, rows):
        assert driver.result(handle).token_ids == hf_generate(captured, prompt, n, eos_token_id=None), name
    assert driver.result(handles[2]).stats.mean_accepted_length > 2.0  # the trained head accepted deep paths
    lone = sg.SpeculativeGenerator(captured, eagle, tree=sg.Chain(4)).generate(prompts[0], 30, eos_token_id=())
    assert lone.token_ids == hf_generate(captured, prompts[0], 30, eos_token_id=None)
    assert captured.captured.graphs.eager > 0 and captured.captured.pool.scratch_row is not None


def test_sampled_rows_through_a_captured_target_follow_their_own_distributions():
    """A sampled chain and a sampled tree beside plain sampling, each row setting with its own temperature and
    filter: every one fits its exactly enumerated distribution through the static forward."""
    from collections import Counter

    from conftest import tiny_causal_lm

    from specgraft.tools.exactness import fit

    models = []
    for seed in (0, 5):
        model = tiny_causal_lm("llama", vocab_size=6, seed=seed)
        with torch.no_grad():
            model.lm_head.weight.div_(10.0)  # soft distributions: every token keeps real mass
        models.append(model)
    target = sg.load_target(models[0], capture=True)
    draft = sg.DraftModel(models[1], target)
    trees = [sg.Chain(3, draw="sample"), sg.StaticTree([[0], [1], [0, 0], [1, 0], [0, 0, 0]], draw="sample"), None,
             sg.Chain(2, draw="sample")]
    sched = sg.Scheduler(target, {"draft": draft}, max_batch_size=24, max_len=16)
    driver = Driver(sched)
    prompts = ([0, 1, 2, 0, 1], [3, 4, 5], [1, 1, 2, 2], [5, 0, 3, 2, 4, 1])
    settings = [dict(temperature=t, **f) for t, f in zip(ROW_TEMPERATURES, ROW_FILTERS)]
    torch.manual_seed(13)
    counts = [Counter() for _ in settings]
    for _ in range(1600 // 6):  # 1,600 samples per row setting
        handles = [(i % 4, sched.submit(prompts[i % 4], max_new_tokens=SAMPLING_LENGTH, eos_token_id=(),
                                        drafter="none" if trees[i % 4] is None else "draft", tree=trees[i % 4],
                                        **settings[i % 4])) for i in range(24)]
        while not sched.idle:
            driver.step()
        for i, handle in handles:
            counts[i][tuple(driver.result(handle).token_ids)] += 1
    assert target.captured.graphs.eager == sched.counters.verify_forwards == sched.counters.steps
    for counter, prompt, temperature, filters in zip(counts, prompts, ROW_TEMPERATURES, ROW_FILTERS):
        result = fit(counter, enumerated(target, prompt, temperature, filters))
        assert result.passed, f"T={temperature} {filters}: {result}"


def test_the_environment_turns_capture_on_where_load_target_is_not_told(stories, monkeypatch):
    from conftest import STORIES

    monkeypatch.setenv("SPECGRAFT_CAPTURE", "1")
    assert sg.load_target(STORIES).capture and not sg.load_target(STORIES, capture=False).capture
    monkeypatch.setenv("SPECGRAFT_CAPTURE", "yes")
    with pytest.raises(ValueError, match="SPECGRAFT_CAPTURE='yes' must be 0 or 1"):
        sg.load_target(STORIES)


def eager_levels(monkeypatch) -> None:
    """Feature drafters' forwards over a pool's rows at their exact shapes, eager, even beside a captured target."""
    from specgraft.heads.draft_levels import DraftLevels
    from specgraft.heads.feature_drafter import FeatureDrafter

    monkeypatch.setattr(FeatureDrafter, "levels", lambda self, rows: None if rows is None else DraftLevels(self.head, rows))


TREES = {  # each request's tree, by its index: chains of several depths, or a tree of levels of several nodes
    "chains": lambda k: sg.Chain([4, 2, 3, 4, 1, 3, 2, 4, 3][k]),
    "dynamic": lambda k: sg.DynamicTree(top_k=3, depth=4, budget=8),
    "static": lambda k: sg.StaticTree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
}


def drafted_run(sched: sg.Scheduler, drafter: str, prompts, budgets, trees, options) -> tuple[list, list]:
    """Each request's tokens and every step's drafted trees (request, tokens, parents), ``sched`` running the
    requests (prompt, budget, tree) with ``drafter``, each seeded by its place."""
    told = Told()
    sched.add_observer(told)
    driver = Driver(sched)
    handles = [sched.submit(p, n, drafter=drafter, tree=tree, eos_token_id=(), seed=k, **options)
               for k, (p, n, tree) in enumerate(zip(prompts, budgets, trees))]
    driver.run(*handles)
    drafted = [[(h, tree.tokens.tolist(), tree.parents.tolist()) for h, tree in r.trees.items()]
               for r in told.records if isinstance(r, Drafted)]
    return [driver.result(h).token_ids for h in handles], drafted


@pytest.mark.parametrize("trees", TREES)
@pytest.mark.parametrize("options", [{}, {"temperature": 0.8, "top_k": 20}], ids=["greedy", "sampled"])
def test_captured_draft_levels_draft_what_eager_levels_draft(captured, trained_eagle, dev_prompts, monkeypatch, options, trees):
    """EAGLE trees whose levels replay captured graphs (emulated here: a replay computes again from the graph's own
    buffers) draft every step what levels run eager at their exact shapes draft, so each request gets the same
    tokens: requests of unequal lengths through 5 rows, so later ones draft in rows out of order beside rows that
    draft nothing; chains of several depths, and dynamic and static trees (several nodes a level, each seeing its
    own ancestors), the same target (captured) under both."""
    from specgraft.heads.draft_levels import DraftLevels

    target = captured
    prompts = [target.encode(p) for p in dev_prompts[30:39]]
    budgets = [30, 7, 22, 12, 26, 9, 17, 5, 21]

    def run(captured: bool):
        eagle = sg.load_drafter(trained_eagle, target)
        sched = sg.Scheduler(target, {"eagle": eagle}, max_batch_size=5)
        if captured:
            eagle.pool_levels = DraftLevels(eagle.head, sched.draft_pools["eagle"], static=True, recorder=Recomputed())
        tree_of = [TREES[trees](k) for k in range(len(prompts))]
        return *drafted_run(sched, "eagle", prompts, budgets, tree_of, options), eagle.pool_levels

    with monkeypatch.context() as eager:
        eager_levels(eager)
        want, want_drafted, _ = run(False)
    got, drafted, levels = run(True)
    assert got == want and drafted == want_drafted
    assert sum(len(tokens) > 3 for step in drafted for _, tokens, _ in step) > 10  # trees deeper than two levels
    graphs = levels.graphs
    assert graphs.captures == len(graphs) > 0 and graphs.replays > 3 * graphs.captures and graphs.eager == 0


def test_a_captured_round_pads_to_a_power_of_two_of_rows_and_leaves_the_rows_it_pads_as_they_were(
    captured, trained_eagle, dev_prompts, monkeypatch
):
    """Rows 0 and 2 draft chains while rows 1 and 3 are held by generations that do not draft now: the captured round
    runs 4 rows (rows 1 and 3 pad), drafts what the eager round of 3 rows drafts, and leaves every other row's length
    and committed keys and values as they were."""
    from specgraft.heads.base import DraftRequest
    from specgraft.heads.draft_levels import DraftLevels
    from specgraft.heads.feature_drafter import FeatureRound

    target = captured
    prompts = [torch.tensor(target.encode(p)) for p in dev_prompts[10:14]]
    batches = []
    original = FeatureRound.chains
    monkeypatch.setattr(FeatureRound, "chains", lambda round_: batches.append(round_.batch) or original(round_))

    def drafted(captured: bool):
        eagle = sg.load_drafter(trained_eagle, target)
        pool = eagle.new_rows(5, 256)
        if captured:
            eagle.pool_levels = DraftLevels(eagle.head, pool, static=True, recorder=Recomputed())
        requests = {}
        for row, ids in enumerate(prompts[:4]):
            out = target.forward(ids[None], target.new_cache(), torch.arange(len(ids))[None], hidden_layers=eagle.hidden_layers)
            state = eagle.start(ids, {i: h[0] for i, h in out.hidden.items()}, cache=pool.acquire(row)[1])
            requests[row] = DraftRequest(state, int(out.logits[0, -1].argmax()), sg.Chain(3), 3, None, row)
        eagle.propose_batch([requests[0], requests[2], requests[1], requests[3]], pool)  # every row drafts once
        before = pool.kv.clone(), pool.lengths(5)
        if not captured:
            eager_levels(monkeypatch)
        trees = eagle.propose_batch([requests[0], requests[2]], pool)
        monkeypatch.undo() if not captured else None
        return [t.tokens.tolist() for t in trees], before, pool

    want, _, _ = drafted(False)
    monkeypatch.setattr(FeatureRound, "chains", lambda round_: batches.append(round_.batch) or original(round_))
    got, (kv, lengths), pool = drafted(True)
    assert got == want and batches[-1] == 4 and batches[1] == 3  # captured: padded to 4 rows; eager: 3
    assert pool.lengths(5) == lengths
    for row in (1, 3):  # (layers, 2, rows, Hkv, slots, D)
        assert torch.equal(pool.kv[:, :, row, :, : lengths[row]], kv[:, :, row, :, : lengths[row]])


@pytest.mark.parametrize("options", [{}, {"temperature": 0.8, "top_k": 20}], ids=["greedy", "sampled"])
def test_captured_dflash_blocks_draft_what_eager_blocks_draft(captured, trained_dflash, dev_prompts, monkeypatch, options):
    """A DFlash head's blocks over the pool's rows, replayed from captured graphs (emulated here), draft every step
    what the eager blocks draft: 9 requests of unequal lengths through 5 rows (rows out of order, beside rows that
    draft nothing), chains of several depths (the lm_head over as many slots) and a static tree, the same captured
    target under both, a trained head (a random one's near-ties flip with the last bit of a padded width's sums).
    Each pool's blocks are captured where the target captures, not for an uncaptured target."""
    from conftest import uncaptured
    from test_step_counts import depth_drafter

    from specgraft.heads import as_drafter
    from specgraft.heads.dflash import DFlashBlocks, DFlashDrafter

    def trained(target):
        return as_drafter(trained_dflash[0].head, target)

    target = captured
    prompts = [target.encode(p) for p in dev_prompts[21:30]]
    budgets, depths = [30, 7, 22, 12, 26, 9, 17, 5, 21], [3, 2, 3, 1, 3, 2, 2, 3, 1]
    trees = [sg.Chain(d) for d in depths[:-2]] + [sg.StaticTree([[0], [1], [0, 0]])] * 2

    def run(captured: bool):
        dflash = trained(target)
        sched = sg.Scheduler(target, {"dflash": dflash}, max_batch_size=5)
        if captured:
            dflash.pool_blocks = DFlashBlocks(dflash.head, sched.draft_pools["dflash"], recorder=Recomputed())
        return *drafted_run(sched, "dflash", prompts, budgets, trees, options), dflash.pool_blocks

    with monkeypatch.context() as eager:
        eager.setattr(DFlashDrafter, "blocks", lambda self, rows: None)
        want, want_drafted, _ = run(False)
    got, drafted, blocks = run(True)
    assert got == want and drafted == want_drafted
    assert sum(len(tokens) > 2 for step in drafted for _, tokens, _ in step) > 10
    graphs = blocks.graphs
    assert graphs.captures == len(graphs) > 1 and graphs.replays > 3 * graphs.captures and graphs.eager == 0

    dflash = trained(target)
    pool = dflash.new_rows(5, 64)
    assert dflash.blocks(pool) is dflash.blocks(pool) and dflash.blocks(None) is None
    assert dflash.blocks(pool).batch(3) == 4 and dflash.blocks(pool).batch(5) == 5  # a power of two, or the pool's
    assert dflash.blocks(dflash.new_rows(5, 64)) is not dflash.blocks(pool)  # another pool: graphs of its own
    assert trained(uncaptured(target)).blocks(pool) is None
    dynamic = depth_drafter("dflash", target)  # a head of its own, its rope made one that follows the positions
    dynamic.head.rotary.rope_type = "dynamic"
    assert dynamic.blocks(pool) is None
    with pytest.raises(ValueError, match="rope type 'dynamic'"):
        DFlashBlocks(dynamic.head, pool)


@pytest.mark.parametrize("options", [{}, {"temperature": 0.8, "top_k": 20}], ids=["greedy", "sampled"])
def test_captured_medusa_heads_draft_what_eager_heads_draft(captured, dev_prompts, options):
    """Medusa's heads replayed from captured graphs (emulated here), their rows padded to a power of two, draft
    every step what the eager heads draft: 7 requests of unequal lengths through 5 rows, chains of several depths
    (as many heads) and a static tree. The graphs are made where the target captures, dropped when the drafter
    adopts new heads, and never made for an uncaptured target."""
    from conftest import uncaptured
    from test_step_counts import depth_drafter

    from specgraft.model.captured import GraphSet

    target = captured
    prompts = [target.encode(p) for p in dev_prompts[30:37]]
    budgets, trees = [24, 7, 19, 12, 26, 9, 17], [sg.Chain(d) for d in (3, 2, 3, 1, 2)] + [sg.StaticTree(BRANCHING_TREE)] * 2

    def run(target, graphs):
        medusa = depth_drafter("medusa", target)
        medusa.graphs = graphs
        sched = sg.Scheduler(target, {"medusa": medusa}, max_batch_size=5)
        return *drafted_run(sched, "medusa", prompts, budgets, trees, options), medusa

    want, want_drafted, eager = run(uncaptured(target), None)
    got, drafted, medusa = run(target, GraphSet(Recomputed()))
    assert got == want and drafted == want_drafted and eager.graphs is None
    assert sum(len(tokens) > 2 for step in drafted for _, tokens, _ in step) > 10
    graphs = medusa.graphs
    assert graphs.captures == len(graphs) > 1 and graphs.replays > 3 * graphs.captures and graphs.eager == 0

    fresh, states = depth_drafter("medusa", target), [torch.randn(target.config.hidden_size) for _ in range(3)]
    want = eager.heads_logp(states, 2)
    assert fresh.heads_logp(states, 2).shape == want.shape == (2, 3, target.config.vocab_size)
    assert fresh.draft_graphs is fresh.graphs and fresh.graphs.recorder is None and fresh.graphs.eager == 1  # CPU
    fresh.graphs = GraphSet(Recomputed())
    assert torch.allclose(fresh.heads_logp(states, 2), want, atol=1e-5)
    assert list(fresh.graphs.graphs) == [(4, 2, torch.float32)]  # 3 rows padded to 4
    fresh.adopt(depth_drafter("medusa", target))
    assert fresh.graphs is None  # new heads: the old graphs read the old weights


def test_a_drafter_captures_its_levels_where_its_target_captures(captured, trained_eagle):
    """Levels over a pool's rows are static and captured when the target is (eager off CUDA), one set per pool and
    head; none for a lone row's own cache; eager at exact shapes for an uncaptured target or a rope whose
    frequencies follow the positions."""
    from conftest import uncaptured

    from specgraft.heads.draft_levels import DraftLevels

    target = captured
    eagle = sg.load_drafter(trained_eagle, target)
    pool = eagle.new_rows(2, 64)
    levels = eagle.levels(pool)
    assert levels.static and levels.graphs.recorder is None and eagle.levels(pool) is levels
    assert eagle.levels(None) is None and levels.batch(3) == 2 and DraftLevels(eagle.head, pool).batch(1) == 1
    assert eagle.levels(eagle.new_rows(4, 64)).batch(3) == 4  # a power of two of the rows, at most the pool's
    assert eagle.levels(eagle.new_rows(2, 64)) is not levels  # another pool: graphs of its own
    eager = sg.load_drafter(trained_eagle, uncaptured(target)).levels(pool)
    assert not eager.static and eager.graphs is None
    rotary = eagle.head.fast().rotary
    rotary.rope_type = "dynamic"  # (this drafter's own head, loaded for this test)
    assert not eagle.levels(eagle.new_rows(2, 64)).static
    with pytest.raises(ValueError, match="rope type 'dynamic'"):
        DraftLevels(eagle.head, pool, static=True)
