"""The same engine on a GPU (``device="cuda"``): batched and single generations equal HF greedy there.

Marked ``cuda`` and skipped without a CUDA device; run ``pytest -m cuda`` on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch
from conftest import STORIES

import specgraft as sg

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]

BRANCHING_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


@pytest.fixture(scope="module")
def cuda_stories():
    if not STORIES.is_dir():
        pytest.skip(f"../shared assets are absent ({STORIES} not found)")
    return sg.load_target(STORIES, device="cuda")


def hf_greedy(target: sg.Target, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids], device="cuda")
    out = target.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n, eos_token_id=None)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("kind", ["plain", "prompt_lookup", "self_tree"])
def test_batched_generation_on_cuda_equals_hf_greedy(cuda_stories, dev_prompts, kind):
    drafter = {"plain": None, "prompt_lookup": sg.PromptLookup(), "self_tree": sg.DraftModel(cuda_stories, cuda_stories)}[kind]
    gen = sg.SpeculativeGenerator(cuda_stories, drafter, tree=sg.StaticTree(BRANCHING_TREE))
    prompts = [cuda_stories.encode(p) for p in dev_prompts[:6]]
    budgets = [40, 17, 33, 48, 9, 25]
    outs = gen.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=())
    for ids, n, out in zip(prompts, budgets, outs):
        want = hf_greedy(cuda_stories, ids, n)
        assert out.token_ids == want
        assert gen.generate(ids, max_new_tokens=n, eos_token_id=()).token_ids == want


def test_adaptive_trees_on_cuda_equal_hf_greedy(cuda_stories, dev_prompts):
    """The goodput controller's path on a GPU: T(N) timed there, adaptive rows beside fixed and plain ones, exact."""
    drafters = {"lookup": sg.PromptLookup(), "self": sg.DraftModel(cuda_stories, cuda_stories)}
    rows = [("lookup", sg.Adaptive()), ("self", sg.Adaptive(max_depth=4, max_nodes=8)), ("self", sg.Chain(3)),
            ("none", None), ("lookup", sg.Adaptive(max_depth=3, max_nodes=3))]
    sched = sg.Scheduler(cuda_stories, drafters, max_batch_size=4)
    prompts = [cuda_stories.encode(p) for p in dev_prompts[:len(rows)]]
    handles = {sched.submit(p, 32, drafter=name, tree=tree, eos_token_id=()): p for p, (name, tree) in zip(prompts, rows)}
    outputs = {}
    while not sched.idle:
        for event in sched.step():
            if isinstance(event, sg.Finished):
                outputs[event.handle] = event.output.token_ids
            assert not isinstance(event, sg.Failed), event
    assert sched.controller is not None and sched.controller.cost is not None  # timed on this device
    for handle, prompt in handles.items():
        assert outputs[handle] == hf_greedy(cuda_stories, prompt, 32)


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "captured"])
def test_dflash_blocks_on_cuda_equal_hf_greedy(cuda_stories, dev_prompts, capture):
    """DFlash's context cache and block forward on a GPU, rows of one batched draft cache, exact; beside a captured
    target, the blocks replay graphs of their own."""
    from specgraft.heads import as_drafter, build_head
    from specgraft.heads.configs import DFlashConfig

    target = sg.load_target(STORIES, device="cuda", capture=True) if capture else cuda_stories
    torch.manual_seed(0)
    head = build_head(DFlashConfig(block_size=6, target_layer_ids=[0, 2, 3]), target).eval()
    drafter = as_drafter(head, target)
    gen = sg.SpeculativeGenerator(target, drafter, tree=sg.DynamicTree(top_k=2, depth=5, budget=10))
    prompts = [target.encode(p) for p in dev_prompts[:6]]
    outputs = gen.generate_batch(prompts, max_new_tokens=32, eos_token_id=())
    for out, prompt in zip(outputs, prompts):
        assert out.token_ids == hf_greedy(target, prompt, 32)
    if capture:
        graphs = drafter.pool_blocks.graphs
        assert graphs.captures > 0 and graphs.eager == 0 and graphs.replays > graphs.captures


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "captured"])
def test_medusa_heads_on_cuda_equal_hf_greedy(cuda_stories, dev_prompts, capture):
    """Medusa's heads on a GPU, a static tree and chains, exact; beside a captured target, the heads replay graphs
    of their own (one per power of two of rows and heads drafted)."""
    from specgraft.heads import as_drafter, build_head
    from specgraft.heads.configs import MedusaConfig

    target = sg.load_target(STORIES, device="cuda", capture=True) if capture else cuda_stories
    torch.manual_seed(0)
    drafter = as_drafter(build_head(MedusaConfig(num_heads=3), target).eval(), target)
    prompts = [target.encode(p) for p in dev_prompts[:6]]
    for tree in (sg.StaticTree(BRANCHING_TREE), sg.Chain(2)):
        outputs = sg.SpeculativeGenerator(target, drafter, tree=tree).generate_batch(prompts, max_new_tokens=32,
                                                                                     eos_token_id=())
        for out, prompt in zip(outputs, prompts):
            assert out.token_ids == hf_greedy(target, prompt, 32)
    if capture:
        graphs = drafter.draft_graphs
        assert graphs.captures > 1 and graphs.eager == 0 and graphs.replays > graphs.captures
    else:
        assert drafter.draft_graphs is None


@pytest.mark.parametrize("tree", ["chain:4", "dynamic:4,5,16"])
def test_eagle_on_cuda_equals_hf_greedy_within_the_sync_budgets(cuda_stories, trained_eagle, dev_prompts, tree):
    """The GPU-shaped step where it matters: EAGLE's batched draft, the packed verification and the acceptance on the
    device give HF's greedy tokens on CUDA, and a step there syncs no more than on the CPU (docs/engine.md)."""
    from test_step_counts import CHAIN_SYNCS, PLAIN_SYNCS, assert_syncs

    eagle = sg.load_drafter(trained_eagle, cuda_stories)
    policy = sg.parse_tree_spec(tree)
    gen = sg.SpeculativeGenerator(cuda_stories, eagle, tree=policy)
    prompts = [cuda_stories.encode(p) for p in dev_prompts[:6]]
    budgets = [40, 17, 33, 48, 9, 25]
    for ids, n, out in zip(prompts, budgets, gen.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=())):
        assert out.token_ids == hf_greedy(cuda_stories, ids, n)
    assert_syncs(cuda_stories, PLAIN_SYNCS)
    assert_syncs(cuda_stories, CHAIN_SYNCS, {"eagle": eagle}, drafter="eagle", tree=policy)


@pytest.mark.parametrize("draft_vocab", [None, 24], ids=["full-vocab", "draft-vocab"])
def test_eagle3_on_cuda_equals_hf_greedy(cuda_stories, dev_prompts, draft_vocab):
    """EAGLE-3's three taps, fused on the device, its 2H-input layer and (reduced) vocabulary, drafting dynamic trees
    for a batch: HF's greedy tokens (an untrained head drafts badly; exactness does not depend on it)."""
    from specgraft.heads import as_drafter, build_head
    from specgraft.heads.configs import Eagle3Config

    torch.manual_seed(0)
    head = build_head(Eagle3Config(draft_vocab_size=draft_vocab), cuda_stories).eval()
    gen = sg.SpeculativeGenerator(cuda_stories, as_drafter(head, cuda_stories), tree=sg.DynamicTree(top_k=3, depth=4, budget=12))
    prompts = [cuda_stories.encode(p) for p in dev_prompts[:6]]
    budgets = [40, 17, 33, 48, 9, 25]
    for ids, n, out in zip(prompts, budgets, gen.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=())):
        assert out.token_ids == hf_greedy(cuda_stories, ids, n)


BF16_TIE = 0.125  # logits: bf16 keeps 8 significant bits, so two logits near 10 this close may swap with the batch shape


def assert_equal_up_to_a_bf16_tie(target: sg.Target, prompt: list[int], got: list[int], want: list[int]) -> None:
    """``got`` equals ``want``, or first departs from it where the target's two best logits (recomputed in one
    forward) are ``got``'s and ``want``'s tokens within `BF16_TIE`: a bf16 forward over other row counts (a verified
    chain, a batch) rounds differently, so such a tie may break either way; a wrong draft accepted never looks so."""
    if got == want:
        return
    i = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
    ids = torch.tensor([prompt + want[:i]], device=target.device)
    logits = target.model(ids).logits[0, -1].float()
    top = logits.topk(2)
    assert set(top.indices.tolist()) == {got[i], want[i]}, (i, got[i], want[i], top)
    assert float(top.values[0] - top.values[1]) < BF16_TIE, (i, top)


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("tree", ["chain:4", "dynamic:4,5,16"])
def test_bf16_speculation_on_cuda_equals_the_engines_own_bf16_greedy(trained_eagle, dev_prompts, tree, capture):
    """A bf16 target with the trained EAGLE head (cast to bf16 at load): speculative rows give the tokens plain
    decoding of the same bf16 target gives, one row and a batch, up to a bf16 tie (`assert_equal_up_to_a_bf16_tie`),
    with the verification forward eager or captured per size."""
    if not STORIES.is_dir():
        pytest.skip(f"../shared assets are absent ({STORIES} not found)")
    target = sg.load_target(STORIES, device="cuda", dtype="bfloat16", capture=capture)
    eagle = sg.load_drafter(trained_eagle, target)
    assert next(eagle.head.parameters()).dtype == torch.bfloat16
    prompts = [target.encode(p) for p in dev_prompts[:6]]
    budgets = [40, 17, 33, 48, 9, 25]
    plain = sg.SpeculativeGenerator(target, None)
    spec = sg.SpeculativeGenerator(target, eagle, tree=sg.parse_tree_spec(tree))
    batched = zip(plain.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=()),
                  spec.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=()))
    for ids, n, (want, got) in zip(prompts, budgets, batched):
        assert_equal_up_to_a_bf16_tie(target, ids, got.token_ids, want.token_ids)
        alone = spec.generate(ids, max_new_tokens=n, eos_token_id=()).token_ids
        assert_equal_up_to_a_bf16_tie(target, ids, alone, plain.generate(ids, max_new_tokens=n, eos_token_id=()).token_ids)


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled-q", "point-masses"])
def test_a_chain_accepted_on_cuda_commits_the_targets_law(sampled):
    """`sample_accept_chain` with p, q, the tree and the RNG on the GPU, against the rule's law enumerated over every
    draft (tests/test_verify.py's test on the CPU, fewer draws)."""
    from collections import Counter

    from test_verify import chain_law, make_tree

    from specgraft.infer.verify import sample_accept_chain
    from specgraft.tools.exactness import fit
    from specgraft.tree import Sampling, Tree

    gen = torch.Generator().manual_seed(0)
    vocab, drafted = 4, [1, 3, 0]
    p = torch.softmax(torch.randn(4, vocab, generator=gen) * 1.5, -1)
    q = torch.cat([torch.zeros(1, vocab), torch.softmax(torch.randn(3, vocab, generator=gen) * 1.5, -1)]) if sampled else None
    law = chain_law(p, q, drafted)
    sampling = Sampling(temperature=1.0).seeded(7, device="cuda")
    draft_rng = torch.Generator().manual_seed(8)
    counts = Counter()
    for _ in range(6000):
        xs = [int(torch.multinomial(q[i + 1], 1, generator=draft_rng)) for i in range(3)] if sampled else drafted
        tree = make_tree([-1, 0, 1, 2], [2] + xs)
        tree = Tree(tree.tokens.cuda(), tree.parents.cuda(), tree.depth.cuda(), tree.scores.cuda(),
                    None if q is None else q.cuda())
        row = sample_accept_chain(tree, p.cuda(), sampling, width=6).tolist()
        count = row[0]
        counts[tuple(xs[: count - 1]) + (row[1],)] += 1
    result = fit(counts, law)
    assert result.passed, result


def test_the_device_clock_times_kernels_not_their_launches():
    """What the goodput controller prices trees with on a GPU: the seconds a forward's kernels run, read from
    events after the step's readback, where the host clock would see only their launches."""
    import time

    from specgraft.infer.adaptive.clock import DeviceClock

    clock = DeviceClock("cuda")
    torch.cuda.synchronize()
    host = time.perf_counter()
    start = clock.mark()
    torch.cuda._sleep(100_000_000)  # a kernel that spins ~0.05-0.1 s
    end = clock.mark()
    launched = time.perf_counter() - host
    seconds = clock.seconds(start, end)
    assert seconds > 0.01 and seconds > 5 * launched


@pytest.mark.parametrize("tree", ["chain:4", "dynamic:4,5,16"])
def test_a_captured_target_on_cuda_replays_its_graphs_and_equals_hf_greedy(trained_eagle, dev_prompts, tree):
    """load_target(capture=True) on CUDA: each step's verification replays a graph captured for its shape (tokens,
    tree width, slots), and the output is HF's greedy, batched and alone; the same batch again captures nothing new."""
    from test_step_counts import CHAIN_SYNCS, assert_syncs

    target = sg.load_target(STORIES, device="cuda", capture=True)
    eagle = sg.load_drafter(trained_eagle, target)
    policy = sg.parse_tree_spec(tree)
    gen = sg.SpeculativeGenerator(target, eagle, tree=policy)
    prompts = [target.encode(p) for p in dev_prompts[:6]]
    budgets = [40, 17, 33, 48, 9, 25]
    first = gen.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=())
    for ids, n, out in zip(prompts, budgets, first):
        assert out.token_ids == hf_greedy(target, ids, n)
    captured = target.captured.graphs
    assert captured.captures > 0 and captured.eager == 0 and len(captured) == captured.captures
    levels = eagle.pool_levels.graphs  # the draft forwards (roots', chain and tree levels) replay graphs of their own
    assert levels.captures > 0 and levels.eager == 0
    level_captures = levels.captures
    captures, replays = captured.captures, captured.replays
    again = gen.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=())  # the same steps: every shape replays
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert captured.captures == captures and captured.replays > replays + 4 and captured.eager == 0
    assert levels.captures == level_captures and levels.replays > level_captures
    lone = gen.generate(prompts[3], max_new_tokens=48, eos_token_id=())
    assert lone.token_ids == hf_greedy(target, prompts[3], 48)
    assert_syncs(target, CHAIN_SYNCS, {"eagle": eagle}, drafter="eagle", tree=policy)

