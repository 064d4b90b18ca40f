"""The continuous-batching scheduler and generate_batch: many generations, each exactly as if alone."""

from __future__ import annotations

from collections import defaultdict

import pytest

from test_engine_api import hf_generate

import specgraft as sg
from specgraft.infer import (
    Committed, Drafted, Failed, Finished, StepObserver, Stepped, Tokens, Verified, per_prompt_options,
)

BRANCHING_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def make(target, kind: str) -> sg.SpeculativeGenerator:
    if kind == "plain":
        return sg.SpeculativeGenerator(target, None)
    if kind == "prompt_lookup":
        return sg.SpeculativeGenerator(target, sg.PromptLookup(), tree=sg.Chain(4))
    if kind == "self_tree":
        return sg.SpeculativeGenerator(target, sg.DraftModel(target, target), tree=sg.StaticTree(BRANCHING_TREE))
    raise KeyError(kind)


class Driver:
    """Steps a scheduler and files its events by generation, as the serving engine and generate_batch do."""

    def __init__(self, sched: sg.Scheduler) -> None:
        self.sched = sched
        self.ended: dict[int, Finished | Failed] = {}

    def step(self) -> dict[int, list[int]]:
        """One step; the tokens each generation kept in it (a joining one: its prefill's, then its step's)."""
        kept: dict[int, list[int]] = defaultdict(list)
        for event in self.sched.step():
            if isinstance(event, Tokens):
                kept[event.handle] += event.token_ids
            else:
                assert event.handle not in self.ended, "a generation ended twice"
                self.ended[event.handle] = event
        return dict(kept)

    def finished(self, handle: int) -> bool:
        return handle in self.ended

    def result(self, handle: int):
        event = self.ended[handle]
        if isinstance(event, Failed):
            raise event.error
        return event.output

    def run(self, *handles: int) -> None:
        while not all(self.finished(h) for h in handles):
            self.step()


@pytest.fixture(scope="module")
def prompts(dev_prompts) -> list[str]:
    return dev_prompts[:5]


@pytest.mark.parametrize("kind", ["plain", "prompt_lookup", "self_tree"])
def test_generate_batch_equals_each_prompt_alone(stories, prompts, kind):
    gen = make(stories, kind)
    budgets = [12, 40, 25, 33, 7]
    stops = [None, ["big"], None, None, None]
    outs = gen.generate_batch(prompts, max_new_tokens=budgets, stop=stops)
    for prompt, budget, stop, out in zip(prompts, budgets, stops, outs):
        alone = gen.generate(prompt, max_new_tokens=budget, stop=stop)
        assert out.token_ids == alone.token_ids
        assert out.text == alone.text
        assert out.stats.accept_length_histogram == alone.stats.accept_length_histogram


def test_calls_reuse_one_scheduler_and_leave_nothing_behind_when_interrupted(stories, prompts):
    """A generator keeps its last call's scheduler (pools, controller) while it is big enough; a call that raised
    or a stream dropped midway leaves no row taken and no request queued for the next call."""
    gen = sg.SpeculativeGenerator(stories, sg.PromptLookup(), tree=sg.Adaptive())
    reference = [o.token_ids for o in gen.generate_batch(prompts[:3], max_new_tokens=12)]
    sched = gen._spare
    assert [o.token_ids for o in gen.generate_batch(prompts[:2], max_new_tokens=12)] == reference[:2]
    assert gen._spare is sched
    with pytest.raises(ValueError, match="temperature"):  # the second request is refused, the first was queued
        gen.generate_batch(prompts[:3], max_new_tokens=12, temperature=[0.0, -1.0, 0.0])
    assert gen._spare is sched and sched.idle
    stream = gen.stream(prompts[0], max_new_tokens=12)
    next(stream)
    stream.close()  # dropped after its first step: its rows are freed
    assert gen._spare is sched and sched.idle and sched.pool.lengths(3) == [0, 0, 0]
    assert [o.token_ids for o in gen.generate_batch(prompts[:3], max_new_tokens=12)] == reference
    gen.generate_batch(prompts[:4], max_new_tokens=4)  # more rows than it has: a new one
    assert gen._spare is not sched and gen._spare.max_batch_size == 4
    gen.reserve(6, 10**9)  # allocated now, its slots capped at the target's context, and the next call runs on it
    reserved = gen._spare
    assert reserved.max_batch_size == 6 and reserved.max_len == stories.max_context
    assert [o.token_ids for o in gen.generate_batch(prompts[:3], max_new_tokens=12)] == reference
    assert gen._spare is reserved


def test_generate_batch_samples_each_row_with_its_own_options(stories, prompts):
    gen = make(stories, "self_tree")
    temperatures, seeds = [0.0, 0.7, 1.0, 1.3], [1, 2, 3, 4]
    outs = gen.generate_batch(prompts[:4], max_new_tokens=24, temperature=temperatures, seed=seeds, eos_token_id=())
    for prompt, t, s, out in zip(prompts, temperatures, seeds, outs):
        assert out.token_ids == gen.generate(prompt, max_new_tokens=24, temperature=t, seed=s, eos_token_id=()).token_ids


def test_step_reports_each_generations_new_tokens_and_they_add_up(stories, prompts):
    gen = make(stories, "prompt_lookup")
    sched = gen.scheduler(max_batch_size=2)
    driver = Driver(sched)
    handles = [sched.submit(p, max_new_tokens=16, eos_token_id=()) for p in prompts[:3]]
    seen = {h: [] for h in handles}
    first = driver.step()
    assert set(first) == set(handles[:2])  # the third waits for a free row
    # a joining row: its first token (from its prefill), then its first speculative step's tokens
    assert all(len(tokens) >= 2 for tokens in first.values())
    for h, tokens in first.items():
        seen[h] += tokens
    while not all(driver.finished(h) for h in handles):
        assert len(sched.running) <= 2
        for h, tokens in driver.step().items():
            seen[h] += tokens
    for h, prompt in zip(handles, prompts):
        out = driver.result(h)
        assert out.token_ids == seen[h] == gen.generate(prompt, max_new_tokens=16, eos_token_id=()).token_ids
    assert sched.idle


class Told(StepObserver):
    """Every record a scheduler tells, in order."""

    def __init__(self) -> None:
        self.records: list[Drafted | Verified | Committed | Stepped] = []

    def drafted(self, step: Drafted) -> None:
        self.records.append(step)

    def verified(self, step: Verified) -> None:
        self.records.append(step)

    def committed(self, step: Committed) -> None:
        self.records.append(step)

    def stepped(self, step: Stepped) -> None:
        self.records.append(step)


def test_step_observers_are_told_each_step_once_in_order_with_its_counts(stories, prompts):
    """Drafted, Verified, Committed, Stepped, once each a step, in that order; what they count adds up to the
    scheduler's counters, the tokens each row kept and the trees it verified."""
    gen = make(stories, "prompt_lookup")
    sched = gen.scheduler(max_batch_size=2)
    told = Told()
    sched.add_observer(told)
    driver = Driver(sched)
    handles = [sched.submit(p, max_new_tokens=n, eos_token_id=()) for p, n in zip(prompts, (20, 9, 14))]
    calls = 0
    while not all(driver.finished(h) for h in handles):
        driver.step()
        calls += 1
    assert sched.counters.steps == calls  # every call advanced rows: one step each
    kinds = [type(r) for r in told.records]
    assert kinds == [Drafted, Verified, Committed, Stepped] * calls
    assert [r.step for r in told.records] == [step for step in range(1, calls + 1) for _ in range(4)]
    kept = dict.fromkeys(handles, 0)
    for drafted, verified, committed, stepped in zip(*[iter(told.records)] * 4):
        trees = drafted.trees
        handles_now = [r.handle for r in drafted.rows]
        assert sorted(trees) == sorted(handles_now) and [r.handle for r in committed.rows] == handles_now
        assert stepped.rows == len(handles_now) <= 2 and drafted.selected is None  # (no adaptive row)
        assert verified.forwards == 1  # one packed forward (or one row's)
        assert verified.tokens == sum(tree.num_nodes for tree in trees.values())
        assert verified.seconds >= verified.forward_seconds > 0 and stepped.seconds > drafted.seconds >= 0
        for row in committed.rows:
            assert row.draft_tokens == trees[row.handle].num_nodes - 1
            assert 0 <= row.accepted <= row.draft_tokens and 0 < row.kept <= row.accepted + 1
            kept[row.handle] += row.kept
    for h in handles:  # all but the first token, its prefill's
        assert kept[h] == len(driver.result(h).token_ids) - 1
    rows = [row for r in told.records if isinstance(r, Committed) for row in r.rows]
    assert sum(r.draft_tokens for r in rows) == sched.counters.draft_tokens > 0
    assert sum(r.accepted for r in rows) == sched.counters.accepted_tokens > 0
    assert sum(r.forwards for r in told.records if isinstance(r, Verified)) == sched.counters.verify_forwards

    sched.remove_observer(told)
    told.records.clear()
    driver.run(sched.submit(prompts[0], max_new_tokens=4, eos_token_id=()))
    assert told.records == []
    with pytest.raises(TypeError, match="StepObserver"):
        sched.add_observer(object())


def test_cancel_frees_the_row_and_leaves_the_others_unaffected(stories, prompts):
    gen = make(stories, "self_tree")
    sched = gen.scheduler(max_batch_size=2)
    driver = Driver(sched)
    a = sched.submit(prompts[0], max_new_tokens=30, eos_token_id=())
    b = sched.submit(prompts[1], max_new_tokens=30, eos_token_id=())
    c = sched.submit(prompts[2], max_new_tokens=30, eos_token_id=())
    driver.step()
    driver.step()
    sched.cancel(a)
    assert a not in sched.running and len(sched.running) == 1
    with pytest.raises(KeyError, match="neither queued nor running"):
        sched.cancel(a)
    assert a not in driver.step()  # a cancelled generation emits nothing more
    assert c in sched.running  # the freed row was taken by the waiting generation
    driver.run(b, c)
    assert not driver.finished(a)
    for h, prompt in ((b, prompts[1]), (c, prompts[2])):
        assert driver.result(h).token_ids == gen.generate(prompt, max_new_tokens=30, eos_token_id=()).token_ids


def test_unknown_handles_drafters_and_bad_options_are_refused(stories, prompts):
    sched = make(stories, "plain").scheduler()
    with pytest.raises(KeyError, match="neither queued nor running"):
        sched.cancel(7)
    with pytest.raises(KeyError, match="unknown drafter 'eagle': loaded are none"):
        sched.submit(prompts[0], max_new_tokens=8, drafter="eagle")
    with pytest.raises(ValueError, match="max_new_tokens"):
        sched.submit(prompts[0], max_new_tokens=0)
    with pytest.raises(ValueError, match="max_batch_size"):
        make(stories, "plain").scheduler(max_batch_size=0)
    assert sched.idle  # nothing refused was queued


def test_per_prompt_options_take_one_value_or_one_per_prompt():
    split = per_prompt_options(2, temperature=[0.0, 0.5], top_k=5, stop=["a", "b"], eos_token_id=[[1], None])
    assert split == [
        {"temperature": 0.0, "top_k": 5, "stop": ["a", "b"], "eos_token_id": [1]},
        {"temperature": 0.5, "top_k": 5, "stop": ["a", "b"], "eos_token_id": None},
    ]
    with pytest.raises(ValueError, match="'seed' has 3 values for 2 prompts"):
        per_prompt_options(2, seed=[1, 2, 3])


def test_a_free_row_between_running_rows_is_padding_only(stories, prompts):
    """Cancel the middle of three rows: rows 0 and 2 keep verifying together, each exactly as alone."""
    gen = make(stories, "self_tree")
    sched = gen.scheduler(max_batch_size=3)
    driver = Driver(sched)
    a, b, c = (sched.submit(p, max_new_tokens=36, eos_token_id=()) for p in prompts[:3])
    driver.step()
    sched.cancel(b)
    assert sched.pool.views[1] is None and sched.pool.views[0] is not None and sched.pool.views[2] is not None
    driver.run(a, c)
    for h, prompt in ((a, prompts[0]), (c, prompts[2])):
        out = driver.result(h)
        alone = gen.generate(prompt, max_new_tokens=36, eos_token_id=())
        assert out.token_ids == alone.token_ids
        assert out.stats.accept_length_histogram == alone.stats.accept_length_histogram


@pytest.fixture(scope="module")
def eight(stories, dev_prompts):
    """8 prompts of different lengths, budgets and stop rules; some end early on EOS or a stop string."""
    prompts = [stories.encode(p) for p in dev_prompts[8:16]]
    budgets = [48, 20, 64, 33, 41, 12, 57, 28]
    refs = [hf_generate(stories, p, n, eos_token_id=None) for p, n in zip(prompts, budgets)]
    eos = [None] * 8
    eos[2] = [refs[2][30]]  # EOS partway through: the reference ends at its first occurrence
    stops = [None] * 8
    stops[4] = [stories.decode(refs[4])[20:26]]
    return prompts, budgets, eos, stops


def with_random_head(target, kind: str):
    import torch

    from specgraft.heads import as_drafter, build_head
    from specgraft.heads.configs import Eagle3Config, EagleConfig, MedusaConfig

    config, tree = {
        "eagle_dynamic": (EagleConfig(), sg.DynamicTree(top_k=4, depth=5, budget=16)),
        "eagle3_static": (Eagle3Config(), sg.StaticTree(BRANCHING_TREE)),
        "medusa_static": (MedusaConfig(num_heads=3), sg.StaticTree(BRANCHING_TREE)),
    }[kind]
    head = build_head(config, target).eval()
    gen = torch.Generator().manual_seed(0)
    for p in head.parameters():
        p.data.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return sg.SpeculativeGenerator(target, as_drafter(head, target), tree=tree)


@pytest.mark.parametrize(
    "kind", ["plain", "prompt_lookup", "self_tree", "trained_eagle_dynamic", "eagle_dynamic", "medusa_static"]
)
def test_a_batch_of_eight_equals_batch_one_and_hf_greedy(stories, eight, kind, request):
    prompts, budgets, eos, stops = eight
    if kind == "trained_eagle_dynamic":  # conftest's tiny trained head: deep accepted paths in every row
        head = sg.load_drafter(request.getfixturevalue("trained_eagle"), stories)
        gen = sg.SpeculativeGenerator(stories, head, tree=sg.DynamicTree(top_k=4, depth=5, budget=16))
    elif kind in ("plain", "prompt_lookup", "self_tree"):
        gen = make(stories, kind)
    else:
        gen = with_random_head(stories, kind)
    eos_opts = [() if e is None else e for e in eos]
    outs = gen.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=eos_opts, stop=stops)
    for i, out in enumerate(outs):
        alone = gen.generate(prompts[i], max_new_tokens=budgets[i], eos_token_id=eos_opts[i], stop=stops[i])
        assert out.token_ids == alone.token_ids, f"row {i}"
        assert out.stats.accept_length_histogram == alone.stats.accept_length_histogram, f"row {i}"
        ref = hf_generate(stories, prompts[i], budgets[i], eos_token_id=eos[i])
        if stops[i]:
            assert stops[i][0] in stories.decode(out.token_ids) and out.token_ids == ref[: len(out.token_ids)]
        else:
            assert out.token_ids == ref, f"row {i}"
    assert len(outs[2].token_ids) < budgets[2] and len(outs[4].token_ids) < budgets[4]  # really ended early
    if kind == "trained_eagle_dynamic":
        taus = sorted(round(out.stats.mean_accepted_length, 2) for out in outs)
        assert taus[len(taus) // 2] > 2.0, taus  # the head really drafts: deep paths accepted in most rows


def batch_drafter_case(target, kind: str, request) -> sg.SpeculativeGenerator:
    if kind == "trained_eagle":
        drafter = sg.load_drafter(request.getfixturevalue("trained_eagle"), target)
        return sg.SpeculativeGenerator(target, drafter, tree=sg.DynamicTree(top_k=4, depth=5, budget=16))
    return with_random_head(target, kind)


@pytest.mark.parametrize("kind", ["trained_eagle", "eagle3_static", "medusa_static"])
def test_mixed_rows_drafted_together_each_equal_their_run_alone(stories, prompts, kind, request, monkeypatch):
    """Greedy rows beside sampling rows with their own filters, budgets that cap some rows' depth (down to plain
    decoding at the end), and a cancelled row: one batched draft call per step serves them all."""
    from specgraft.heads.base import BatchDrafter

    gen = batch_drafter_case(stories, kind, request)
    assert isinstance(gen.drafter, BatchDrafter)
    sizes = []
    propose_batch = type(gen.drafter).propose_batch
    monkeypatch.setattr(type(gen.drafter), "propose_batch", lambda self, reqs, rows=None: (
        sizes.append(len(reqs)), propose_batch(self, reqs, rows))[1])
    options = [
        dict(max_new_tokens=40),
        dict(max_new_tokens=30, temperature=0.8, top_k=20, seed=1),
        dict(max_new_tokens=5),  # drafts shallower as its budget runs out, then decodes plainly
        dict(max_new_tokens=35, temperature=1.0, top_p=0.9, seed=2),
        dict(max_new_tokens=40),  # cancelled after two steps
    ]
    sched = gen.scheduler(max_batch_size=5)
    driver = Driver(sched)
    handles = [sched.submit(p, eos_token_id=(), **o) for p, o in zip(prompts, options)]
    driver.step()
    driver.step()
    sched.cancel(handles[4])
    driver.run(*handles[:4])
    assert sizes[:2] == [5, 5] and 1 <= max(sizes[2:]) <= 4  # every drafting row in one call, the cancelled one gone
    for h, prompt, opts in zip(handles, prompts, options[:4]):
        out, alone = driver.result(h), gen.generate(prompt, eos_token_id=(), **opts)
        assert out.token_ids == alone.token_ids
        if "temperature" not in opts:
            assert out.token_ids == hf_generate(stories, stories.encode(prompt), opts["max_new_tokens"], eos_token_id=None)


@pytest.mark.parametrize("kind", ["trained_eagle", "eagle3_static", "medusa_static"])
def test_a_batched_draft_grows_each_rows_tree_as_it_grows_alone(stories, prompts, kind, request):
    """Rows with different policies and depths (a grow-only policy included) drafted in one call: each row's tree is
    the one its state proposes alone, and every row's draft cache holds only committed pairs afterwards."""
    from specgraft.heads.base import DraftRequest
    from specgraft.tree import TreeBuilder

    class GrowOnlyChain:  # a policy without `levels`: drafted on its own, through the same code
        max_depth = 2

        def grow(self, step, root_token, max_depth=None, device="cpu", sampling=None):
            builder, last = TreeBuilder(root_token, device), torch.zeros(1, dtype=torch.long)
            for _ in range(min(2, max_depth or 2)):
                logp = step(builder.tree(), last)
                last = builder.add(logp.argmax(-1), last, builder.tree().scores[last] + logp.max(-1).values)
            return builder.tree()

    import torch

    gen = batch_drafter_case(stories, kind, request)
    rows = gen.drafter.new_rows(4, 256)
    policies = [sg.Chain(3), sg.DynamicTree(top_k=3, depth=4, budget=10), sg.StaticTree(BRANCHING_TREE), GrowOnlyChain()]
    prefilled = []  # (state, root, prompt length) of each row, as the scheduler's prefill leaves them
    for i, prompt in enumerate(prompts[:4]):
        ids = torch.tensor(stories.encode(prompt))
        out = stories.forward(ids[None], stories.new_cache(), torch.arange(len(ids))[None],
                              hidden_layers=gen.drafter.hidden_layers, last_only=True)
        hidden = {layer: h[0] for layer, h in out.hidden.items()}
        cache = {} if rows is None else {"cache": rows.acquire(i)[1]}
        prefilled.append((gen.drafter.start(ids, hidden, **cache), int(out.logits[0, -1].argmax()), len(ids)))
    for policies_now in (policies, policies[:3]):  # with a grow-only policy among them, and all growing together
        requests = [DraftRequest(state, root, p, 1 + i, None, i) for i, ((state, root, _), p) in enumerate(zip(prefilled, policies_now))]
        together = gen.drafter.propose_batch(requests, rows)
        for r, tree in zip(requests, together):
            alone = r.state.propose(r.root_token, r.policy, r.max_depth)
            assert tree.tokens.tolist() == alone.tokens.tolist() and tree.parents.tolist() == alone.parents.tolist()
            assert torch.allclose(tree.scores, alone.scores, atol=1e-4)
            assert tree.max_depth <= r.max_depth
        if rows is not None:
            assert rows.lengths(4) == [n - 1 for _, _, n in prefilled]  # committed pairs only


@pytest.mark.parametrize("kind", ["trained_eagle", "eagle3_static"])
@pytest.mark.parametrize("budget", [10, 60], ids=["cut", "whole"])
def test_dynamic_trees_grown_on_the_device_equal_each_rows_tree_alone(stories, prompts, kind, budget, request):
    """Rows sharing one `DynamicTree`, of different depths, in pool rows out of order beside a held row that does not
    draft: every level of every row in one forward, ranked and cut on the device (`grow_dynamic`). Each row's tree
    is the one its state grows alone, node for node, with its ancestors; only committed pairs stay cached."""
    gen = batch_drafter_case(stories, kind, request)
    rows, requests, lengths = held_rows_drafting(stories, prompts, gen, sg.DynamicTree(top_k=3, depth=4, budget=budget))
    assert_each_tree_as_alone(requests, gen.drafter.propose_batch(requests, rows), rows, lengths)


def held_rows_drafting(stories, prompts, gen, policy):
    """Five pool rows, prefilled out of order; four draft with ``policy`` at depths 4, 2, 3 and 1, the fifth is held
    but drafts nothing. Returns the rows, the four requests and each drafting row's committed pairs."""
    import torch

    from specgraft.heads.base import DraftRequest

    rows = gen.drafter.new_rows(5, 256)
    requests, lengths = [], {}
    for row, prompt, depth in zip((3, 0, 2, 4, 1), prompts[:4] + prompts[:1], (4, 2, 3, 1, 0)):
        ids = torch.tensor(stories.encode(prompt))
        out = stories.forward(ids[None], stories.new_cache(), torch.arange(len(ids))[None],
                              hidden_layers=gen.drafter.hidden_layers, last_only=True)
        state = gen.drafter.start(ids, {i: h[0] for i, h in out.hidden.items()}, cache=rows.acquire(row)[1])
        if depth:  # the last row is held but drafts nothing this round
            requests.append(DraftRequest(state, int(out.logits[0, -1].argmax()), policy, depth, None, row))
            lengths[row] = len(ids) - 1
    return rows, requests, lengths


def assert_each_tree_as_alone(requests, together, rows, lengths) -> None:
    """Each request's tree drafted together is the one its state grows alone, node for node, with its ancestors; only
    committed pairs stay cached."""
    import torch

    for r, tree in zip(requests, together):
        alone = r.state.propose(r.root_token, r.policy, r.max_depth)
        assert tree.tokens.tolist() == alone.tokens.tolist() and tree.parents.tolist() == alone.parents.tolist()
        assert tree.depth.tolist() == alone.depth.tolist()
        assert torch.equal(tree.ancestor_mask(), alone.ancestor_mask())
        assert torch.allclose(tree.scores, alone.scores, atol=1e-4)
        assert tree.is_chain == alone.is_chain or not tree.is_chain
    assert [rows.lengths(5)[row] for row in lengths] == list(lengths.values())  # committed pairs only


@pytest.mark.parametrize("kind", ["trained_eagle", "eagle3_static"])
@pytest.mark.parametrize("choices", [[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]],
                                     [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], [[1], [0], [1, 2], [1, 2, 0]]],
                         ids=["branching", "chain", "gapped ranks"])
def test_static_trees_grown_on_the_device_equal_each_rows_tree_alone(stories, prompts, kind, choices, request):
    """Rows sharing one top-k `StaticTree`, of different depths, in pool rows out of order beside a held row that does
    not draft: every level of every row in one forward, each node its rank of its parent's top-k picked on the
    device (`grow_static`). Each row's tree is the one its state grows alone, node for node, with its ancestors;
    only committed pairs stay cached."""
    from specgraft.heads.feature_drafter import FeatureRound

    gen = batch_drafter_case(stories, kind, request)
    rows, requests, lengths = held_rows_drafting(stories, prompts, gen, sg.StaticTree(choices))
    grown, static = [], FeatureRound.static
    with pytest.MonkeyPatch.context() as patch:  # the batched path really runs
        patch.setattr(FeatureRound, "static", lambda self: grown.append(1) or static(self))
        together = gen.drafter.propose_batch(requests, rows)
    assert grown == [1]
    assert_each_tree_as_alone(requests, together, rows, lengths)


@pytest.mark.parametrize("kind", ["trained_eagle", "eagle3_static"])
def test_batched_feature_drafts_score_each_node_as_a_causal_run_of_its_path(stories, prompts, kind, request):
    """The reference: each node's score is the draft log-prob of its path run pair by pair, causally, on a fresh
    cache; rows of different lengths drafted together (tree masks, padding, per-row slots) must give exactly it."""
    import torch

    from specgraft.heads.base import DraftRequest

    gen = batch_drafter_case(stories, kind, request)
    drafter, head = gen.drafter, gen.drafter.head
    rows = drafter.new_rows(3, 256)
    requests, references = [], []
    for row, prompt in enumerate(prompts[:3]):
        ids = torch.tensor(stories.encode(prompt))
        out = stories.forward(ids[None], stories.new_cache(), torch.arange(len(ids))[None], hidden_layers=head.hidden_layers)
        hidden = {i: h[0] for i, h in out.hidden.items()}
        root = int(out.logits[0, -1].argmax())
        state = drafter.start(ids, hidden, cache=rows.acquire(row)[1])
        requests.append(DraftRequest(state, root, sg.StaticTree(BRANCHING_TREE), 3, None, row))
        references.append((head.draft_features(hidden), torch.cat([ids[1:], torch.tensor([root])])))

    @torch.inference_mode()
    def causal_score(features, tokens, path: list[int]) -> float:
        cache, n = head.new_draft_cache(256), len(tokens)
        h = head.draft_step(features[None], tokens[None], torch.arange(n)[None], None, cache)[:, -1:]
        score = 0.0
        for depth, token in enumerate(path):
            score += float(head.draft_logp(h[0, -1]).float().log_softmax(-1)[token])
            h = head.draft_step(h, torch.tensor([[token]]), torch.tensor([[n + depth]]), None, cache)
        return score

    trees = drafter.propose_batch(requests, rows)
    for tree, (features, tokens) in zip(trees, references):
        assert tree.num_nodes == 1 + len(BRANCHING_TREE)
        for node in range(1, tree.num_nodes):
            path = tree.tokens[tree.path_to(node)[1:]].tolist()
            assert float(tree.scores[node]) == pytest.approx(causal_score(features, tokens, path), abs=1e-4), node


def overflowing_rounds(monkeypatch) -> list[Exception]:
    """What batched feature drafting raises from now on (a draft row overflowing; the scheduler then drafts each row
    alone, and a row whose own round overflows fails)."""
    from specgraft.heads.feature_drafter import FeatureDrafter

    raised, propose_batch = [], FeatureDrafter.propose_batch

    def spied(self, requests, rows=None):
        try:
            return propose_batch(self, requests, rows)
        except Exception as err:
            raised.append(err)
            raise

    monkeypatch.setattr(FeatureDrafter, "propose_batch", spied)
    return raised


def beside_a_long_row(stories, sched, late: list[int], late_tokens: int, joins_at: int, *, first_tree=None,
                      late_tree=None) -> None:
    """Row 0 runs to the end of its ``sched.max_len`` tokens; ``late`` joins (row 1) once row 0's draft row holds
    ``joins_at`` slots. Both must decode as plain greedy decoding does (trees None: the scheduler's default)."""
    driver, pool = Driver(sched), sched.draft_pools["eagle"]
    first = stories.encode("Once upon a time")
    a = sched.submit(first, sched.max_len - len(first), eos_token_id=(), tree=first_tree)
    while pool.lengths(1)[0] < joins_at:
        driver.step()
    b = sched.submit(late, late_tokens, eos_token_id=(), tree=late_tree)
    driver.run(a, b)
    for handle, prompt, tokens in ((a, first, sched.max_len - len(first)), (b, late, late_tokens)):
        assert driver.result(handle).token_ids == hf_generate(stories, prompt, tokens, eos_token_id=None), handle


def test_a_row_joining_far_behind_a_long_row_catches_up_alone_within_its_trees_headroom(
        stories, dev_prompts, trained_eagle, monkeypatch):
    """A draft round pads every row it writes to its widest catch-up (the pairs a row committed since it last
    drafted: its whole prompt when it joins), then its levels. The draft pool holds a row 200 tokens and the tree's
    17 slots (4 levels of top_k 4, and the root's), no fixed 1,024: a 60-token prompt joining beside a row 165 slots
    in would overflow the long row (165 + 60 + 16 > 217), and alone too (its own round pads row 0 as well), so it
    would fail. It catches up alone over its own row first; no round overflows and both rows stay greedy-exact."""
    eagle = sg.load_drafter(trained_eagle, stories)
    tree = sg.DynamicTree(top_k=4, depth=5, budget=16)
    assert eagle.draft_slots(tree) == 1 + 4 * 4 == 17
    sched = sg.Scheduler(stories, {"eagle": eagle}, max_batch_size=2, max_len=200, tree_slots=17,
                         default_drafter="eagle", default_tree=tree)
    assert sched.draft_pools["eagle"].kv.shape[4] == 200 + 17
    raised = overflowing_rounds(monkeypatch)
    late = stories.encode(" ".join(dev_prompts))[:60]
    beside_a_long_row(stories, sched, late, 20, joins_at=165)
    assert raised == []


def test_trees_whose_levels_padded_to_each_others_overflow_draft_in_a_round_each(stories, trained_eagle, monkeypatch):
    """A dynamic tree one level of 16 wide (17 draft slots) and a chain of 16 (16) each fit the rows' 17 slots of
    headroom; drafted together, every level runs the wider frontier of the two (16 + 14 x 1 = 30 slots), which a row
    near its end cannot hold. Each tree drafts in a round of its own: none overflows, both rows stay greedy-exact."""
    from specgraft.heads.base import DraftRequest
    from specgraft.heads.feature_drafter import level_slots

    eagle = sg.load_drafter(trained_eagle, stories)
    wide, deep = sg.DynamicTree(top_k=16, depth=2, budget=16), sg.Chain(16)
    assert (eagle.draft_slots(wide), eagle.draft_slots(deep)) == (17, 16)
    assert level_slots([DraftRequest(None, 0, wide, 16), DraftRequest(None, 0, deep, 16)]) == 16 + 14
    sched = sg.Scheduler(stories, {"eagle": eagle}, max_batch_size=2, max_len=200, tree_slots=17,
                         default_drafter="eagle")
    raised = overflowing_rounds(monkeypatch)
    beside_a_long_row(stories, sched, stories.encode("One day"), 150, joins_at=150, first_tree=wide, late_tree=deep)
    assert raised == []


def test_one_batch_mixing_every_drafter_kind_equals_each_alone_and_hf_greedy(stories, dev_prompts, trained_eagle):
    """Plain, prompt lookup, a trained EAGLE head on a chain and on a dynamic tree, Medusa on a static tree, a draft
    model and the composite, as rows of one scheduler: one verification forward per step serves them all, and every
    row's output and acceptance histogram are the ones it gets alone (and HF's greedy text)."""
    from conftest import tiny_causal_lm

    eagle = sg.load_drafter(trained_eagle, stories)
    drafters = {
        "lookup": sg.PromptLookup(),
        "eagle": eagle,
        "medusa": with_random_head(stories, "medusa_static").drafter,
        "draft": sg.DraftModel(tiny_causal_lm("llama", vocab_size=stories.vocab_size, seed=3), stories),
        "composite": sg.Composite(sg.PromptLookup(max_matches=1), eagle),
    }
    rows = [
        ("none", None), ("lookup", sg.Chain(4)), ("eagle", sg.Chain(4)), ("eagle", sg.DynamicTree(top_k=4, depth=5, budget=16)),
        ("medusa", sg.StaticTree(BRANCHING_TREE)), ("draft", sg.Chain(3)), ("composite", sg.Chain(3)),
    ]
    prompts = [stories.encode(p) for p in dev_prompts[20 : 20 + len(rows)]]
    budgets = [40, 33, 48, 29, 37, 24, 44]
    sched = sg.Scheduler(stories, drafters, max_batch_size=len(rows))
    driver = Driver(sched)
    handles = [sched.submit(p, n, drafter=name, tree=tree, eos_token_id=()) for p, n, (name, tree) in zip(prompts, budgets, rows)]
    driver.run(*handles)
    counters = sched.counters
    assert counters.verify_forwards == counters.steps  # one packed forward per step, whatever each row drafts
    alone_steps = 0
    for handle, prompt, n, (name, tree) in zip(handles, prompts, budgets, rows):
        out = driver.result(handle)
        alone = sg.SpeculativeGenerator(stories, drafters.get(name), tree=tree).generate(prompt, n, eos_token_id=())
        assert out.token_ids == alone.token_ids == hf_generate(stories, prompt, n, eos_token_id=None), name
        assert out.stats.accept_length_histogram == alone.stats.accept_length_histogram, name
        alone_steps += alone.stats.target_calls
    assert counters.steps < alone_steps / 3  # the rows really shared their steps
    assert driver.result(handles[2]).stats.mean_accepted_length > 2.0  # the trained head accepted deep paths


def test_the_hugging_face_forward_verifies_row_by_row_with_the_same_output(prompts):
    from conftest import STORIES

    target = sg.load_target(STORIES, fast=False)
    gen = make(target, "self_tree")
    sched = gen.scheduler(max_batch_size=3)
    assert sched.pool is None  # no batched cache over transformers' caches
    outs = gen.generate_batch(prompts[:3], max_new_tokens=[16, 24, 9], eos_token_id=())
    for prompt, n, out in zip(prompts, [16, 24, 9], outs):
        assert out.token_ids == gen.generate(prompt, max_new_tokens=n, eos_token_id=()).token_ids


# --------------------------------------------------------------------------- exact sampling, many rows at once

SAMPLING_VOCAB, SAMPLING_LENGTH = 6, 3
ROW_TEMPERATURES = (0.5, 1.0, 1.5, 1.0)  # one batch of 4 rows, each with its own temperature (and filter)
ROW_FILTERS = ({}, {"top_k": 3}, {}, {"top_p": 0.8})


@pytest.fixture(scope="module")
def small_vocab_pair():
    """A fast-path target over 6 tokens with soft, enumerable distributions, and a different draft model."""
    import torch
    from conftest import tiny_causal_lm

    models = []
    for seed in (0, 5):
        model = tiny_causal_lm("llama", vocab_size=SAMPLING_VOCAB, seed=seed)
        with torch.no_grad():
            model.lm_head.weight.div_(10.0)  # undo most of the builder's sharpening: every token keeps real mass
        models.append(model)
    target = sg.load_target(models[0])
    assert target.fast is not None  # rows are verified together on the fast path
    return target, sg.DraftModel(models[1], target)


def enumerated(target, prompt: list[int], temperature: float, filters: dict) -> dict[tuple[int, ...], float]:
    """P(x_1..x_L | prompt) for every continuation, from the target's own forward and the sampling filters."""
    import torch

    from specgraft.tree import Sampling

    policy = Sampling(temperature=temperature, **filters)
    probs: dict[tuple[int, ...], float] = {}

    def walk(seq: tuple[int, ...], p: float) -> None:
        if len(seq) == SAMPLING_LENGTH:
            probs[seq] = p
            return
        with torch.no_grad():
            logits = target.model(torch.tensor([prompt + list(seq)])).logits[0, -1].float()
        for token, q in enumerate(policy.probs(logits).tolist()):
            if q > 0:
                walk(seq + (token,), p * q)

    walk((), 1.0)
    return probs


@pytest.mark.parametrize("tree", ["chain", "tree"])
def test_rows_sampled_together_follow_their_own_distributions(small_vocab_pair, tree):
    """32 rows per step (the 4 row settings, 8 times over) through one scheduler, wave after wave."""
    from collections import Counter

    import torch

    from specgraft.tools.exactness import fit

    target, draft = small_vocab_pair
    policy = sg.Chain(3, draw="sample") if tree == "chain" else sg.StaticTree([[0], [1], [0, 0], [1, 0], [0, 0, 0]], draw="sample")
    sched = sg.SpeculativeGenerator(target, draft, tree=policy).scheduler(max_batch_size=32, max_len=16)
    driver = Driver(sched)
    prompts = ([0, 1, 2, 0, 1], [3, 4, 5], [1, 1, 2, 2], [5, 0, 3, 2, 4, 1])  # rows differ, so a mix-up shows
    settings = [dict(temperature=t, **f) for t, f in zip(ROW_TEMPERATURES, ROW_FILTERS)]
    torch.manual_seed(7)  # unseeded rows draw their seeds from torch's global RNG
    counts = [Counter() for _ in settings]
    for _ in range(2400 // 8):  # 2,400 samples per row setting
        handles = [
            (i % 4, sched.submit(prompts[i % 4], max_new_tokens=SAMPLING_LENGTH, eos_token_id=(), **settings[i % 4]))
            for i in range(32)
        ]
        while not sched.idle:
            driver.step()
        for i, handle in handles:
            counts[i][tuple(driver.result(handle).token_ids)] += 1
    for counter, prompt, temperature, filters in zip(counts, prompts, ROW_TEMPERATURES, ROW_FILTERS):
        result = fit(counter, enumerated(target, prompt, temperature, filters))
        assert result.passed, f"T={temperature} {filters}: {result}"


def test_rows_with_different_drafters_and_temperatures_in_one_step_follow_their_own_distributions(small_vocab_pair):
    """Plain, a sampled chain, a sampled tree, prompt lookup and the composite, each with its own temperature and
    filter, 5 x 6 rows a step: every row setting fits its enumerated distribution."""
    from collections import Counter

    import torch

    from specgraft.tools.exactness import fit

    target, draft = small_vocab_pair
    drafters = {"draft": draft, "lookup": sg.PromptLookup(max_ngram=2, num_tokens=3),
                "composite": sg.Composite(sg.PromptLookup(max_ngram=2, min_ngram=2, max_matches=1), draft)}
    settings = [  # (drafter, tree, temperature, filters)
        ("none", None, 0.5, {}),
        ("draft", sg.Chain(3, draw="sample"), 1.0, {"top_k": 3}),
        ("draft", sg.StaticTree([[0], [1], [0, 0], [1, 0], [0, 0, 0]], draw="sample"), 1.5, {}),
        ("lookup", sg.Chain(3), 1.0, {"top_p": 0.8}),
        ("composite", sg.Chain(3, draw="sample"), 0.7, {}),
    ]
    prompts = ([0, 1, 2, 0, 1], [3, 4, 5], [1, 1, 2, 2], [5, 0, 3, 2, 0, 3], [2, 4, 2, 4, 2])  # lookup finds repeats
    sched = sg.Scheduler(target, drafters, max_batch_size=30, max_len=16)
    driver = Driver(sched)
    torch.manual_seed(11)  # unseeded rows draw their seeds from torch's global RNG
    counts = [Counter() for _ in settings]
    for _ in range(2400 // 6):  # 2,400 samples per row setting
        handles = []
        for i in range(30):
            name, tree, temperature, filters = settings[i % 5]
            handles.append((i % 5, sched.submit(prompts[i % 5], max_new_tokens=SAMPLING_LENGTH, drafter=name, tree=tree,
                                                eos_token_id=(), temperature=temperature, **filters)))
        while not sched.idle:
            driver.step()
        for i, handle in handles:
            counts[i][tuple(driver.result(handle).token_ids)] += 1
    assert sched.counters.verify_forwards == sched.counters.steps
    for counter, prompt, (name, _, temperature, filters) in zip(counts, prompts, settings):
        result = fit(counter, enumerated(target, prompt, temperature, filters))
        assert result.passed, f"{name} T={temperature} {filters}: {result}"


class _FailsOn(sg.PromptLookup):
    """Prompt lookup that raises on prompts holding one token: a drafter failing on one generation's input."""

    def __init__(self, token: int) -> None:
        super().__init__()
        self.token = token

    def start(self, prompt_ids, hidden):
        if self.token in prompt_ids.tolist():
            raise RuntimeError("drafter failed")
        return super().start(prompt_ids, hidden)


def test_a_failing_generation_leaves_alone_and_result_raises_its_error(stories, prompts):
    gen = sg.SpeculativeGenerator(stories, _FailsOn(511), tree=sg.Chain(4))
    sched = gen.scheduler(max_batch_size=4)
    driver = Driver(sched)
    good = sched.submit(prompts[0], max_new_tokens=12, eos_token_id=())
    bad = sched.submit([1, 403, 511], max_new_tokens=12, eos_token_id=())
    driver.run(good, bad)
    with pytest.raises(RuntimeError, match="drafter failed"):
        driver.result(bad)
    assert driver.result(good).token_ids == gen.generate(prompts[0], max_new_tokens=12, eos_token_id=()).token_ids
    assert sched.idle


class _ProposeFailsOnce:
    """Prompt lookup whose state raises in its second proposal: a drafter failing mid-generation."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, fail_prompt_token: int) -> None:
        self.inner, self.token = sg.PromptLookup(), fail_prompt_token

    def start(self, prompt_ids, hidden):
        state = self.inner.start(prompt_ids, hidden)
        if self.token not in prompt_ids.tolist():
            return state
        calls = []

        class Failing:
            def propose(self, *args, **kwargs):
                calls.append(1)
                if len(calls) == 2:
                    raise RuntimeError("drafter failed mid-way")
                return state.propose(*args, **kwargs)

            def commit(self, tokens, hidden, path=None):
                state.commit(tokens, hidden, path)

            def cache_tokens(self):
                return 0

        return Failing()


def test_a_generation_failing_in_a_batched_step_frees_its_row_and_the_batch_goes_on(stories, prompts):
    gen = sg.SpeculativeGenerator(stories, _ProposeFailsOnce(511), tree=sg.Chain(4))
    sched = gen.scheduler(max_batch_size=3)
    driver = Driver(sched)
    a = sched.submit(prompts[0], max_new_tokens=20, eos_token_id=())
    bad = sched.submit([1, 403, 511], max_new_tokens=20, eos_token_id=())
    c = sched.submit(prompts[1], max_new_tokens=20, eos_token_id=())
    driver.step()
    driver.step()  # the bad row's second proposal raises inside the batched step
    assert driver.finished(bad) and sched.pool.views[1] is None
    with pytest.raises(RuntimeError, match="mid-way"):
        driver.result(bad)
    driver.run(a, c)
    for h, prompt in ((a, prompts[0]), (c, prompts[1])):
        assert driver.result(h).token_ids == gen.generate(prompt, max_new_tokens=20, eos_token_id=()).token_ids


# --------------------------------------------------------------------------- prompts joining together


def test_prompts_joining_together_run_in_one_forward_and_each_continues_as_alone(stories, dev_prompts, trained_eagle):
    """Six prompts admitted at one step share one packed prefill (each causal over its own row); every row's first
    token, its drafter's start (EAGLE reads the prompt's states) and its whole output are those of HF's greedy."""
    eagle = sg.load_drafter(trained_eagle, stories)
    prompts = [stories.encode(p) for p in dev_prompts[8:14]]
    assert len(prompts) == 6
    sched = sg.Scheduler(stories, {"eagle": eagle}, max_batch_size=6)
    driver = Driver(sched)
    tree = sg.DynamicTree(top_k=4, depth=5, budget=16)
    handles = [sched.submit(p, 24, drafter="eagle" if i % 2 else "none", tree=tree if i % 2 else None,
                            eos_token_id=()) for i, p in enumerate(prompts)]
    driver.step()
    assert sched.counters.prefill_forwards == 1
    driver.run(*handles)
    for handle, prompt in zip(handles, prompts):
        assert driver.result(handle).token_ids == hf_generate(stories, prompt, 24, eos_token_id=None)
    assert sched.counters.prefill_forwards == 1
    for handle, prompt in zip(handles[1::2], prompts[1::2]):  # the head drafts from the packed prefill's states
        alone = sg.SpeculativeGenerator(stories, eagle, tree=tree).generate(prompt, 24, eos_token_id=())
        assert driver.result(handle).stats.accept_length_histogram == alone.stats.accept_length_histogram
    assert max(driver.result(h).stats.mean_accepted_length for h in handles[1::2]) > 2.0


def test_prefill_groups_keep_to_their_token_and_mask_budgets(stories, dev_prompts, monkeypatch):
    import specgraft.infer.scheduler as scheduler

    prompts = [stories.encode(p) for p in dev_prompts[14:20]]
    assert len(prompts) == 6
    sched = sg.Scheduler(stories, max_batch_size=6)
    requests = [sched.running.get(sched.submit(p, 4, eos_token_id=())) for p in prompts]  # queued, not admitted
    queued = list(sched.queued)
    sizes = [len(r.prompt_ids) for r in queued]
    monkeypatch.setattr(scheduler, "PREFILL_TOKENS", sizes[0] + sizes[1])  # the first two fit, the third does not
    groups = sched._prefill_groups(queued)
    assert [len(g) for g in groups][0] == 2 and sum(len(g) for g in groups) == 6
    assert all(sum(len(r.prompt_ids) for r in g) <= sizes[0] + sizes[1] for g in groups)
    assert [r for g in groups for r in g] == queued  # in order
    monkeypatch.setattr(scheduler, "PREFILL_CELLS", min(sizes) ** 2)  # less than any two rows' masks: each alone
    assert [len(g) for g in sched._prefill_groups(queued)] == [1] * 6
    assert requests == [None] * 6


def test_a_packed_prefill_that_raises_is_undone_and_each_prompt_runs_alone(stories, dev_prompts, monkeypatch):
    prompts = [stories.encode(p) for p in dev_prompts[20:23]]
    assert len(prompts) == 3
    packed = stories.forward_packed

    def failing(*args, logits_at=None, **kwargs):
        if logits_at is not None:
            raise RuntimeError("out of memory")
        return packed(*args, **kwargs)

    monkeypatch.setattr(stories, "forward_packed", failing)
    sched = sg.Scheduler(stories, max_batch_size=3)
    driver = Driver(sched)
    handles = [sched.submit(p, 16, eos_token_id=()) for p in prompts]
    driver.run(*handles)
    assert sched.counters.prefill_forwards == 1 + 3  # the packed one, then one a prompt
    for handle, prompt in zip(handles, prompts):
        assert driver.result(handle).token_ids == hf_generate(stories, prompt, 16, eos_token_id=None)
