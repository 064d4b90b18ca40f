"""Kernels and host syncs a step, counted (specgraft.tools.step_counts), and the budgets the engine keeps.

On a GPU a host sync drains the launch queue and every kernel costs a launch;
neither shows in a CPU timing, so the step is held to counts here.
"""

from __future__ import annotations

import pytest
import torch

from specgraft.infer.scheduler import Scheduler
from specgraft.tools.step_counts import OpCounter, count_steps

# Budgets a step keeps (DESIGN.md, "Shaped for the GPU"): plain decoding reads the rows' choices back once and stages
# the packed forward's index lists once; its kernels do not grow with the batch beyond this factor.
PLAIN_SYNCS = 2
KERNEL_GROWTH = 1.5
STEPS = 8


def counted(work) -> tuple[int, int]:
    with OpCounter() as counter:
        work()
    return counter.counts.kernels, counter.counts.syncs


@pytest.mark.parametrize("read", [
    lambda x: x[0].item(), lambda x: int(x[1]), lambda x: float(x[1]), lambda x: x.tolist(), lambda x: x.cpu(),
    lambda x: x.numpy(), lambda x: x.nonzero(), lambda x: torch.tensor([1, 2]), lambda x: x[[0, 2]],
    lambda x: x.unique(), lambda x: x.masked_select(x > 100), lambda x: x.repeat_interleave(x.long().abs() % 2),
], ids=["item", "int", "float", "tolist", "cpu", "numpy", "nonzero", "tensor-from-list", "list-index", "unique",
        "masked_select", "repeat_interleave"])
@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_each_host_read_counts_one_sync(read, inference):
    with torch.inference_mode(inference):  # the engine runs under inference mode, where reads dispatch otherwise
        x = torch.arange(4.0)
        assert counted(lambda: read(x))[1] == 1


def test_a_boolean_mask_index_is_a_sync_and_an_integer_index_is_not():
    x, index = torch.arange(6.0), torch.tensor([0, 3])
    assert counted(lambda: x[x > 2])[1] == 1  # its output size is the mask's count, read on the host
    assert counted(lambda: x[index])[1] == 0
    assert counted(lambda: x.argmax(-1, keepdim=True))[1] == 0


def test_views_and_allocations_are_not_kernels_and_ops_are():
    x = torch.arange(8.0)
    assert counted(lambda: (x.view(2, 4).t(), x[1:], x.unsqueeze(0), torch.empty(3), x.new_empty(2))) == (0, 0)
    assert counted(lambda: x * 2 + 1) == (2, 0)
    assert counted(lambda: torch.zeros(3)) == (1, 0)  # a fill is a kernel


def test_sync_sites_name_the_project_line_and_the_patches_are_undone():
    from specgraft.tree import Tree

    original = torch.Tensor.tolist
    with OpCounter() as counter:
        Tree.root_only(7).children(0)  # `children` reads its matches through nonzero
    assert torch.Tensor.tolist is original
    assert any(site.startswith("nonzero @ tree/tree.py:") for site in counter.counts.sites), counter.counts.where()


def steady(target, batch: int, drafters: dict | None = None, prompt: str = "Once upon a time", **options) -> Scheduler:
    """A scheduler whose ``batch`` rows are all admitted and decoding (their prefills are behind)."""
    scheduler = Scheduler(target, drafters, max_batch_size=batch)
    for k in range(batch):
        scheduler.submit(f"{prompt} {k}", max_new_tokens=5 * STEPS + 8, eos_token_id=(), **options)
    scheduler.step()
    scheduler.step()
    return scheduler


@pytest.fixture(scope="session")
def stories(stories):
    """The default path's counts: the verification forward packed, even where SPECGRAFT_CAPTURE=1 captures it."""
    from conftest import uncaptured

    return uncaptured(stories)


def assert_syncs(target, budget: int, drafters: dict | None = None, **options) -> None:
    """At batch 16 a decoding step syncs at most ``budget`` times, and a lone row's at most `ALONE_SYNCS` (the
    failure names where it synced)."""
    for batch, most in ((1, min(budget, ALONE_SYNCS)), (16, budget)):
        counts = count_steps(steady(target, batch, drafters, **options).step, STEPS)
        assert counts.syncs_per_step <= most, f"batch {batch}: {counts.syncs_per_step} a step\n{counts.where()}"


def decoded(target, drafters: dict, requests: list[dict], rows: int, prompts: list[str]) -> list[list[int]]:
    """Each request's tokens, the requests (``prompts[k]`` each) run through ``rows`` rows together."""
    import specgraft as sg

    scheduler = Scheduler(target, drafters, max_batch_size=rows)
    handles = [scheduler.submit(prompt, eos_token_id=(), **options) for prompt, options in zip(prompts, requests)]
    tokens = {h: [] for h in handles}
    while not scheduler.idle:
        for event in scheduler.step():
            if isinstance(event, sg.Tokens):
                tokens[event.handle] += event.token_ids
    return [tokens[h] for h in handles]


def assert_each_as_alone(target, drafters: dict, requests: list[dict], rows: int, prompt: str) -> None:
    """Run together through ``rows`` rows, each request's tokens equal its run alone."""
    prompts = [f"{prompt} {k}" for k in range(len(requests))]
    together = decoded(target, drafters, requests, rows, prompts)
    for k, options in enumerate(requests):
        assert together[k] == decoded(target, drafters, [options], 1, prompts[k : k + 1])[0], f"request {k} ({options})"


@pytest.mark.parametrize("options", [
    {},
    {"temperature": 0.7, "top_k": 20, "seed": 1},
    {"banned_token_ids": (5, 9)},
], ids=["greedy", "sampled", "banned"])
def test_plain_decoding_syncs_at_most_twice_a_step(stories, options):
    assert_syncs(stories, PLAIN_SYNCS, **options)


# A batched drafter's chain step: the round's metadata staged once, the target forward's once, the choices read once.
CHAIN_SYNCS = 4
# A lone row's step: its draft's metadata staged, its choices read back (its forward needs no packing).
ALONE_SYNCS = 2


# A static tree of Medusa's format, branching at the first two levels.
STATIC_CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]


def tree_policy(tree: str):
    """A spec's policy, or the static tree above for "static" (a static spec names a file)."""
    import specgraft as sg

    return sg.StaticTree(STATIC_CHOICES) if tree == "static" else sg.parse_tree_spec(tree)


@pytest.mark.parametrize("tree", ["chain:4", "dynamic:4,5,16", "static"])
def test_eagle_dynamic_static_trees_and_chains_sync_at_most_four_times_a_step(stories, trained_eagle, tree):
    """EAGLE-2's dynamic tree grows, ranks and is cut on the device for every row (`grow_dynamic`), a static tree
    picks its ranks there (`grow_static`), and both are accepted there with the chains (`greedy_accept_packed`)."""
    import specgraft as sg

    drafters = {"eagle": sg.load_drafter(trained_eagle, stories)}
    assert_syncs(stories, CHAIN_SYNCS, drafters, drafter="eagle", tree=tree_policy(tree))


@pytest.mark.parametrize("options", [{}, {"temperature": 0.8, "top_k": 20}], ids=["greedy", "sampled"])
def test_eagle_chains_sync_at_most_four_times_a_step(stories, trained_eagle, options):
    """The whole draft of every row (all levels) runs on the device, and so does acceptance, greedy or exact
    sampling (`sample_accept_chain`); only the rows' paths and next tokens come back."""
    import specgraft as sg

    drafters = {"eagle": sg.load_drafter(trained_eagle, stories)}
    assert_syncs(stories, CHAIN_SYNCS, drafters, drafter="eagle", tree=sg.Chain(4), seed=3, **options)


def depth_drafter(kind: str, target):
    """A Medusa or DFlash drafter of random heads (the counts do not depend on what is accepted)."""
    from specgraft.heads import as_drafter, build_head
    from specgraft.heads.configs import DFlashConfig, MedusaConfig

    torch.manual_seed(0)
    config = MedusaConfig(num_heads=3) if kind == "medusa" else DFlashConfig(block_size=4)
    return as_drafter(build_head(config, target).eval(), target)


SAMPLED = {"temperature": 0.8, "top_k": 20}


@pytest.mark.parametrize(("drafter", "tree", "options"), [
    (None, None, {}), (None, None, SAMPLED), ("eagle", "chain:4", {}), ("eagle", "chain:4", SAMPLED),
    ("eagle", "dynamic:4,5,16", {}), ("eagle", "static", {}), ("medusa", "chain:3", {}), ("dflash", "chain:3", {}),
], ids=["plain", "plain-sampled", "eagle-chain", "eagle-chain-sampled", "eagle-dynamic", "eagle-static", "medusa",
        "dflash"])
def test_kernels_do_not_grow_with_the_batch(stories, trained_eagle, drafter, tree, options):
    """No loop over rows launches work but each sampled row's draws with its own RNG: plain decoding, greedy or
    sampled (each filter setting's probabilities for all rows at once); EAGLE's draft rounds (the roots' catch-up
    placed by staged indices, each level one forward) with their acceptance (sampled chains of one length accepted
    together); Medusa's and DFlash's drafts; and the verification forward's masks and positions for every row.
    (Prompt lookup's tries, of unequal shapes, verify beside each other at batch 16 in a forward that gathers its
    queries into a grid, against a lone row's plainer forward: on this 5-layer target about 1.55x batch 1.)"""
    import specgraft as sg

    made = {"eagle": lambda: sg.load_drafter(trained_eagle, stories),
            "medusa": lambda: depth_drafter("medusa", stories), "dflash": lambda: depth_drafter("dflash", stories)}
    drafters = {} if drafter is None else {drafter: made[drafter]()}
    options = {**options, "seed": 3} if drafter is None else dict(drafter=drafter, tree=tree_policy(tree), seed=3, **options)
    one = count_steps(steady(stories, 1, drafters, **options).step, STEPS)
    sixteen = count_steps(steady(stories, 16, drafters, **options).step, STEPS)
    assert sixteen.kernels_per_step <= KERNEL_GROWTH * one.kernels_per_step, (
        f"{sixteen.kernels_per_step:.0f} kernels a step at batch 16 against {one.kernels_per_step:.0f} at batch 1: "
        f"{sixteen.ops.most_common(8)}"
    )


def test_plain_rows_beside_tree_rows_decode_as_each_alone(stories, trained_eagle):
    """Rows whose next tokens are chosen together (plain, greedy and sampled) in the steps where other rows verify
    trees: each row's tokens equal the same request run alone."""
    import specgraft as sg

    drafter = sg.load_drafter(trained_eagle, stories)
    requests = [
        dict(drafter="none"), dict(drafter="eagle", tree=sg.Chain(3)), dict(drafter="none", temperature=0.8, seed=3),
        dict(drafter="none", banned_token_ids=(11,)), dict(drafter="eagle", tree=sg.Chain(2), temperature=0.9, seed=4),
    ]
    assert_each_as_alone(stories, {"eagle": drafter}, [{**r, "max_new_tokens": 24} for r in requests], len(requests),
                         "Tom had a red ball")


def test_chains_drafted_together_in_rows_out_of_order_decode_as_each_alone(stories, trained_eagle):
    """Requests of different lengths through 3 rows: later ones take the rows earlier ones freed, so the drafting
    rows stand out of order and some held rows draft nothing; sampled chains beside greedy ones of other depths.
    Each request's tokens equal its run alone."""
    import specgraft as sg

    drafter = sg.load_drafter(trained_eagle, stories)
    requests = [
        dict(max_new_tokens=30, tree=sg.Chain(4)), dict(max_new_tokens=6, tree=sg.Chain(2)),
        dict(max_new_tokens=12, tree=sg.Chain(3), temperature=0.8, seed=5), dict(max_new_tokens=20, tree=sg.Chain(1)),
        dict(max_new_tokens=9, tree=sg.Chain(3), temperature=1.0, seed=6, top_k=8),
    ]
    assert_each_as_alone(stories, {"eagle": drafter}, [{**r, "drafter": "eagle"} for r in requests], 3, "One day")


# An adaptive tree's step: a chain's, its trees' structure and scores read once for the controller's selection, and
# its cuts' indices staged once.
ADAPTIVE_SYNCS = CHAIN_SYNCS + 2
# Forward times (seconds against packed tokens) under which adaptive rows draft, and selection cuts their trees: a row
# alone keeps a few of its 16 candidates ("few"); 16 rows keep a few dozen of their 256, and a row alone all 16 ("many").
CUTTING_COSTS = {"few": {1: 1.0, 4: 1.05, 8: 1.3, 16: 2.0, 1024: 130.0}, "many": {1: 1.0, 24: 1.02, 40: 1.6, 1024: 130.0}}


def test_eagle_adaptive_trees_sync_at_most_six_times_a_step_and_their_kernels_do_not_grow_with_the_batch(
        stories, trained_eagle, monkeypatch):
    """Adaptive rows draft their candidates as one dynamic tree (`grow_dynamic`, each row to its planned depth); the
    controller reads every tree's structure and scores in one copy, cuts them with their indices staged in one, and
    reads the accepted paths it learns from in one."""
    import specgraft as sg
    from specgraft.infer.adaptive import GoodputController
    from specgraft.infer.adaptive.step_cost import StepCost

    drafters = {"eagle": sg.load_drafter(trained_eagle, stories)}

    def counted_steps(batch: int, cost: str) -> tuple[object, list[int]]:
        def step_cost(self):
            if self.cost is None:
                self.cost = StepCost(CUTTING_COSTS[cost])
            return self.cost

        monkeypatch.setattr(GoodputController, "step_cost", step_cost)
        scheduler = steady(stories, batch, drafters, drafter="eagle", tree=sg.Adaptive())
        select, cut = scheduler.controller.select, []

        def selecting(candidates):
            trees = select(candidates)
            cut.append(sum(trees[c.key].num_nodes < c.tree.num_nodes for c in candidates))
            return trees

        scheduler.controller.select = selecting
        return count_steps(scheduler.step, STEPS), cut

    for batch, cost, most in ((1, "few", ADAPTIVE_SYNCS - 2), (16, "many", ADAPTIVE_SYNCS)):
        counts, cut = counted_steps(batch, cost)
        assert counts.syncs_per_step <= most, f"batch {batch}: {counts.syncs_per_step} a step\n{counts.where()}"
        assert len(cut) == STEPS and all(cut), cut  # every step drafted, and cut trees (their indices staged)
    alone, cut = counted_steps(1, "many")  # the same prices: every step drafts, its row's tree verified whole
    assert len(cut) == STEPS and not any(cut)
    assert counts.kernels_per_step <= KERNEL_GROWTH * alone.kernels_per_step, (
        counts.kernels_per_step, alone.kernels_per_step)


def test_prompt_lookup_syncs_at_most_four_times_a_step(stories):
    """Lookup searches its history on the host, fed the step's tokens as read back, and stages every row's trie in
    one copy."""
    import specgraft as sg

    assert_syncs(stories, CHAIN_SYNCS, {"lookup": sg.PromptLookup()}, prompt="Once upon a time the cat sat on the mat",
                 drafter="lookup", tree=sg.Chain(4))


@pytest.mark.parametrize("tree", ["chain:3", "static"])
@pytest.mark.parametrize("kind", ["medusa", "dflash"])
def test_depth_drafters_chains_and_static_trees_sync_at_most_four_times_a_step(stories, kind, tree):
    """Medusa's heads and DFlash's block draft every depth at once; their chains and static trees are picked on the
    device for all rows (random heads: the counts do not depend on what is accepted)."""
    assert_syncs(stories, CHAIN_SYNCS, {kind: depth_drafter(kind, stories)}, drafter=kind, tree=tree_policy(tree))


def test_counting_a_bench_methods_steps_sizes_its_rows_to_the_prompts(stories):
    """`count_decoding` (the bench's kernel and sync columns) holds rows of the prompts' length plus the new tokens,
    not the scheduler's default length (a 7.5 GB pool for SmolLM2 at batch 32 beside the bench's own)."""
    import specgraft as sg
    from specgraft.tools.step_counts import count_decoding

    gen = sg.SpeculativeGenerator(stories, None)
    made = []
    scheduler = gen.scheduler
    gen.scheduler = lambda **kwargs: made.append(scheduler(**kwargs)) or made[-1]
    prompts = [stories.encode("Once upon a time"), stories.encode("The little dog ran")]
    counts = count_decoding(gen, prompts, max_new_tokens=6)
    assert counts.steps > 0 and counts.kernels_per_step > 0
    assert [s.max_len for s in made] == [max(map(len, prompts)) + 6]
