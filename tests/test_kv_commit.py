"""KV-cache commit: after every step the caches hold exactly the committed sequence.

A `Request`'s invariant: between steps the target's cache holds every
committed token but the root (the last committed token, which the next
step's forward runs first). The cache must equal what a fresh prefill of
that sequence computes, so nothing from a rejected draft token survives and
the accepted nodes sit at contiguous positions. A `DraftModel` must roll its
own cache back to the committed sequence after every proposal.

Also unit tests of `KVCache.keep` and `KVCache.crop` on hand-made tensors.
"""

from __future__ import annotations

import pytest
import torch
from conftest import filled_cache, numbered_kv, tiny_causal_lm

import specgraft as sg
from specgraft.infer import Scheduler, Tokens
from specgraft.model import KVCache, Target
from specgraft.tree import ROOT_PARENT, Tree

TOL = 1e-5
NEW_TOKENS = 40
PROMPTS = (0, 7, 23)  # a few dev prompts
BRANCHING_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]


# --------------------------------------------------------------------------- helpers


def fresh_prefill(model: Target, seq: list[int]) -> KVCache:
    cache = model.new_cache()
    ids = torch.tensor([seq], device=model.device)
    model.forward(ids, cache, torch.arange(len(seq), device=model.device)[None])
    return cache


def kv_difference(cache: KVCache, reference: KVCache, num_layers: int) -> float:
    """Largest |difference| over every layer's keys and values, in units of the tensor's scale; shapes must agree.

    The scale is max(1, largest |entry|) of the reference tensor. stories260K's
    keys reach ~26 in magnitude, where float32 rounding of a differently shaped
    (but equivalent) forward already moves entries by ~1e-5: Hugging Face's own
    incremental decoding differs from a fresh prefill by 9.5e-6 there. A wrong
    entry (a rejected token's KV, a shifted position) differs by O(1).
    """
    worst = 0.0
    for layer in range(num_layers):
        for got, want, kind in zip(cache.layer_kv(layer), reference.layer_kv(layer), ("keys", "values")):
            assert got.shape == want.shape, f"layer {layer} {kind}: shape {tuple(got.shape)} != {tuple(want.shape)}"
            if want.numel():
                scale = max(1.0, float(want.abs().max()))
                worst = max(worst, float((got - want).abs().max()) / scale)
    return worst


class RecordingDrafter:
    """Wraps a `DraftModel`; right after each proposal records its cache length and committed length."""

    def __init__(self, inner: sg.DraftModel) -> None:
        self.inner = inner
        self.hidden_layers = inner.hidden_layers
        self.after_propose: list[tuple[int, int]] = []  # (len(draft cache), committed tokens)

    def start(self, prompt_ids, hidden):
        return RecordingState(self.inner.start(prompt_ids, hidden), self.after_propose)


class RecordingState:
    def __init__(self, inner, after_propose: list[tuple[int, int]]) -> None:
        self.inner, self.after_propose = inner, after_propose

    def propose(self, root_token, policy, max_depth, *args, **kwargs):
        tree = self.inner.propose(root_token, policy, max_depth, *args, **kwargs)
        self.after_propose.append((len(self.inner.cache), self.inner.length))
        return tree

    def commit(self, tokens, hidden, path=None):
        self.inner.commit(tokens, hidden, path)

    def cache_tokens(self):
        return self.inner.cache_tokens()


class OracleDrafter:
    """Knows the target's greedy continuation and hides it in the second branch of every level.

    At each depth the first child is a wrong token (with a decoy child carrying
    the next right token, unreachable because its parent is rejected) and the
    second child is the right token. The accepted path therefore runs through
    non-contiguous tree rows, so committing it needs a real gather.
    """

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, continuation: list[int], vocab_size: int, depth: int = 4) -> None:
        self.ref, self.vocab, self.depth = continuation, vocab_size, depth
        self.generated = 0

    def start(self, prompt_ids, hidden):
        """One generation at a time: the oracle is its own state."""
        self.generated = 1  # the root chosen by prefill
        return self

    def commit(self, tokens, hidden, path=None):
        self.generated += len(tokens)  # the path (root first) plus the next root

    def cache_tokens(self):
        return 0

    def propose(self, root_token, policy, max_depth, *args, **kwargs):
        assert root_token == self.ref[self.generated - 1]
        tokens, parents, depth = [root_token], [ROOT_PARENT], [0]
        right_parent = 0
        for d in range(1, min(self.depth, max_depth - 1) + 1):
            k = self.generated + d - 1
            if k + 1 >= len(self.ref):
                break
            right, nxt = self.ref[k], self.ref[k + 1]
            wrong = (right + 1) % self.vocab
            tokens += [wrong, right, nxt]
            parents += [right_parent, right_parent, len(tokens) - 3]  # decoy child hangs under the wrong node
            depth += [d, d, d + 1]
            right_parent = len(tokens) - 2
        return Tree(
            tokens=torch.tensor(tokens),
            parents=torch.tensor(parents),
            depth=torch.tensor(depth),
            scores=torch.zeros(len(tokens)),
        )


def drive(target: Target, drafter, policy, prompt: list[int], new_tokens: int = NEW_TOKENS, on_step=None):
    """Run one generation through the scheduler step by step; after every step check the target's cache.

    Returns (the generated tokens, (tokens committed, draft tokens proposed) of each verification step).
    """
    name = "none" if drafter is None else "drafter"
    sched = Scheduler(target, {name: drafter}, max_batch_size=1, default_drafter=name, default_tree=policy)
    sched.submit(prompt, new_tokens, eos_token_id=())
    request = sched.queued[-1]  # the generation's own state, kept after it ends
    generated: list[int] = []

    def check(when: str) -> None:
        assert request.root == generated[-1], when
        expected = prompt + generated[:-1]  # every committed token but the root
        assert len(request.cache) == len(expected), f"{when}: cache holds {len(request.cache)}, expected {len(expected)}"
        diff = kv_difference(request.cache, fresh_prefill(target, expected), target.num_layers)
        assert diff < TOL, f"{when}: target KV differs from a fresh prefill by {diff:.2e} (relative to scale)"

    steps, drafted = [], 0
    while not sched.idle:
        generated += [t for e in sched.step() if isinstance(e, Tokens) for t in e.token_ids]
        recorder = request.recorder
        steps.append((recorder.step_tokens[-1], recorder.draft_tokens - drafted))
        drafted = recorder.draft_tokens
        check(f"after step {len(steps)}" + (" (the prefill's too)" if len(steps) == 1 else ""))
        if on_step is not None:
            on_step(request, generated)
    return generated, steps


@pytest.fixture(scope="module")
def stories_prompts(stories, dev_prompts) -> dict[int, list[int]]:
    return {i: stories.encode(dev_prompts[i]) for i in PROMPTS}


@pytest.fixture(scope="module")
def random_draft(stories) -> Target:
    return sg.DraftModel(tiny_causal_lm("llama", vocab_size=stories.vocab_size, seed=3), stories).model


def hf_greedy(target: Target, prompt: list[int], n: int) -> list[int]:
    x = torch.tensor([prompt])
    out = target.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n, eos_token_id=None)
    return out[0, len(prompt):].tolist()


# --------------------------------------------------------------------------- target cache after every step


@pytest.mark.parametrize("prompt", PROMPTS)
def test_target_cache_equals_fresh_prefill_after_every_step_with_self_draft_static_tree(stories, stories_prompts, prompt):
    generated, results = drive(
        stories, sg.DraftModel(stories, stories), sg.StaticTree(BRANCHING_TREE), stories_prompts[prompt]
    )
    assert generated == hf_greedy(stories, stories_prompts[prompt], len(generated))
    assert any(committed > 2 for committed, _ in results)  # deep paths were committed (rows gathered past siblings)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_target_cache_equals_fresh_prefill_after_every_step_with_rejecting_random_draft(
    stories, stories_prompts, random_draft, prompt
):
    generated, results = drive(
        stories, sg.DraftModel(random_draft, stories), sg.StaticTree(BRANCHING_TREE), stories_prompts[prompt]
    )
    assert generated == hf_greedy(stories, stories_prompts[prompt], len(generated))
    assert any(committed - 1 < drafted for committed, drafted in results)  # drafts were rejected


@pytest.mark.parametrize("prompt", PROMPTS)
def test_target_cache_equals_fresh_prefill_after_every_step_with_prompt_lookup(stories, stories_prompts, prompt):
    generated, _ = drive(stories, sg.PromptLookup(), None, stories_prompts[prompt])
    assert generated == hf_greedy(stories, stories_prompts[prompt], len(generated))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_target_cache_equals_fresh_prefill_when_accepted_path_skips_rejected_siblings(stories, stories_prompts, prompt):
    ids = stories_prompts[prompt]
    reference = hf_greedy(stories, ids, NEW_TOKENS)
    oracle = OracleDrafter(reference, stories.vocab_size, depth=4)
    generated, results = drive(stories, oracle, None, ids)
    assert generated == reference
    # every step accepted every right token (the second child of each level), plus the target's own
    expected, done = [], 1
    while done < NEW_TOKENS:
        max_depth = NEW_TOKENS - done - 1
        expected.append(min(4, max_depth - 1) + 1 if max_depth >= 2 else 1)
        done += expected[-1]
    assert [committed for committed, _ in results] == expected


# --------------------------------------------------------------------------- the draft model's own cache


@pytest.mark.parametrize("draft", ["self", "random"])
def test_draft_model_cache_is_rolled_back_to_the_committed_length_after_every_proposal(
    stories, stories_prompts, random_draft, draft
):
    inner = sg.DraftModel(stories if draft == "self" else random_draft, stories)
    recorder = RecordingDrafter(inner)
    drive(stories, recorder, sg.StaticTree(BRANCHING_TREE), stories_prompts[PROMPTS[0]])
    assert recorder.after_propose, "the draft model never proposed"
    assert all(cache == committed for cache, committed in recorder.after_propose), recorder.after_propose


@pytest.mark.parametrize("draft", ["self", "random"])
def test_draft_model_cache_holds_only_committed_tokens_after_every_step(stories, stories_prompts, random_draft, draft):
    drafter = sg.DraftModel(stories if draft == "self" else random_draft, stories)
    prompt = stories_prompts[PROMPTS[1]]
    problems = []

    def check(request, generated):
        committed = prompt + generated[:-1]
        state = request.draft
        n = len(state.cache)
        # tokens the draft state holds, then those the scheduler keeps for it (the root alone: `specgraft.infer.held`)
        owed = state.pending + request.deferred_roots
        if n + len(owed) != len(committed) or owed != committed[n:]:
            problems.append(f"after {len(generated)} tokens: the draft's cached + pending tokens differ from the target's")
        if n > len(committed):
            problems.append(f"draft cache holds {n} positions, only {len(committed)} are committed")
            return
        diff = kv_difference(state.cache, fresh_prefill(drafter.model, committed[:n]), drafter.model.num_layers)
        if diff >= TOL:
            problems.append(f"draft cache differs from a fresh prefill of the committed tokens by {diff:.2e}")

    drive(stories, drafter, sg.StaticTree(BRANCHING_TREE), prompt, on_step=check)
    assert problems == []


class _DraftNothing:
    """A tree policy that decides no speculation pays off this step: it returns the root alone."""

    max_depth = 1

    def grow(self, step, root_token, max_depth=None, device="cpu", sampling=None):
        return Tree.root_only(root_token, device)


def test_draft_model_with_a_policy_that_drafts_nothing_decodes_like_plain_decoding(stories, stories_prompts):
    ids = stories_prompts[PROMPTS[0]]
    gen = sg.SpeculativeGenerator(stories, sg.DraftModel(stories, stories), tree=_DraftNothing())
    out = gen.generate(ids, max_new_tokens=16, eos_token_id=())
    assert out.token_ids == hf_greedy(stories, ids, 16)


# --------------------------------------------------------------------------- KVCache unit tests


def hand_made_cache(batch: int = 2, heads: int = 3, length: int = 7, dim: int = 4, layers: int = 2):
    """A KVCache holding `numbered_kv`, and those raw tensors."""
    cache = KVCache()
    raw = numbered_kv(batch, heads, length, dim, layers)
    for layer, (keys, values) in enumerate(raw):
        cache.hf.update(keys.clone(), values.clone(), layer)
    return cache, raw


# The contract both caches keep (transformers' DynamicCache behind KVCache, and the fast path's StaticKVCache).
@pytest.fixture(params=["KVCache", "StaticKVCache"])
def make_cache(request):
    return {"KVCache": hand_made_cache, "StaticKVCache": filled_cache}[request.param]


def test_an_empty_kv_cache_has_no_positions():
    assert len(KVCache()) == 0


def test_cache_len_counts_positions(make_cache):
    cache, _ = make_cache(length=7)
    assert len(cache) == 7


def test_keep_gathers_each_batch_rows_own_positions_behind_the_prefix(make_cache):
    cache, raw = make_cache(batch=2, length=9)
    prefix = 3
    rows = torch.tensor([[0, 2, 5], [0, 1, 4]])  # per batch row, relative to the prefix
    cache.keep(prefix, rows)
    assert len(cache) == prefix + 3
    for layer, (keys, values) in enumerate(raw):
        got_k, got_v = cache.layer_kv(layer)
        for b in range(2):
            positions = list(range(prefix)) + (prefix + rows[b]).tolist()
            assert torch.equal(got_k[b], keys[b][:, positions]), f"layer {layer} batch {b} keys"
            assert torch.equal(got_v[b], values[b][:, positions]), f"layer {layer} batch {b} values"


def test_keep_with_one_dimensional_rows_applies_to_every_batch_row(make_cache):
    cache, raw = make_cache(batch=2, length=8)
    cache.keep(2, torch.tensor([0, 3, 5]))
    positions = [0, 1, 2, 5, 7]
    for layer, (keys, values) in enumerate(raw):
        got_k, got_v = cache.layer_kv(layer)
        assert torch.equal(got_k, keys[:, :, positions])
        assert torch.equal(got_v, values[:, :, positions])


def test_keep_of_the_root_alone_drops_every_tree_node(make_cache):
    cache, raw = make_cache(batch=2, length=6)
    cache.keep(4, torch.tensor([0]))
    assert len(cache) == 5
    for layer, (keys, values) in enumerate(raw):
        got_k, got_v = cache.layer_kv(layer)
        assert torch.equal(got_k, keys[:, :, :5])
        assert torch.equal(got_v, values[:, :, :5])


def test_keep_leaves_the_prefix_untouched_with_an_empty_prefix(make_cache):
    cache, raw = make_cache(batch=2, length=5)
    cache.keep(0, torch.tensor([[4, 1], [2, 3]]))
    keys, values = raw[1]
    got_k, got_v = cache.layer_kv(1)
    assert torch.equal(got_k[0], keys[0][:, [4, 1]])
    assert torch.equal(got_k[1], keys[1][:, [2, 3]])
    assert torch.equal(got_v[1], values[1][:, [2, 3]])


def test_crop_drops_every_position_from_length_on_in_every_layer(make_cache):
    cache, raw = make_cache(batch=2, length=7)
    cache.crop(4)
    assert len(cache) == 4
    for layer, (keys, values) in enumerate(raw):
        got_k, got_v = cache.layer_kv(layer)
        assert torch.equal(got_k, keys[:, :, :4])
        assert torch.equal(got_v, values[:, :, :4])


def test_crop_to_the_current_length_changes_nothing(make_cache):
    cache, raw = make_cache(length=7)
    cache.crop(7)
    assert torch.equal(cache.layer_kv(0)[0], raw[0][0])
    assert torch.equal(cache.layer_kv(1)[1], raw[1][1])


def test_crop_to_zero_empties_the_cache(make_cache):
    cache, _ = make_cache(length=7)
    cache.crop(0)
    assert len(cache) == 0
    assert cache.layer_kv(0)[0].shape == (2, 3, 0, 4)


def test_crop_beyond_the_length_raises_value_error_naming_both():
    cache, _ = hand_made_cache(length=7)
    with pytest.raises(ValueError, match=r"7 positions to 8"):
        cache.crop(8)
    assert len(cache) == 7


def test_crop_to_a_negative_length_raises_value_error():
    cache, _ = hand_made_cache(length=7)
    with pytest.raises(ValueError, match="-1"):
        cache.crop(-1)
    assert len(cache) == 7
