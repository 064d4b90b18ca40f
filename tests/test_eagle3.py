"""EAGLE-3: draft vocabulary maps, training-time-test masks, fused taps, and exact drafting."""

from __future__ import annotations

import pytest
import torch

import specgraft as sg
from specgraft.heads import Eagle3Drafter, as_drafter, build_head, load_head, save_head
from specgraft.heads.base import TrainBatch
from specgraft.heads.configs import Eagle3Config
from specgraft.heads.eagle3 import default_aux_layers, ttt_visibility
from specgraft.tree import additive_mask
from conftest import tiny_causal_lm


@pytest.fixture(scope="module")
def target():
    return sg.load_target(tiny_causal_lm("llama", vocab_size=97, seed=3, layers=4))


def test_default_taps_are_eagle3s():
    assert default_aux_layers(32) == (2, 16, 29)


def test_weight_names_follow_official_checkpoints(target):
    names = set(build_head(Eagle3Config(draft_vocab_size=40), target).state_dict())
    expected = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
        f"midlayer.{n}.weight"
        for n in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
            "hidden_norm", "input_layernorm", "post_attention_layernorm",
        )
    }
    assert names == expected


def test_qkv_read_twice_the_hidden_width_and_fc_three_times(target):
    head = build_head(Eagle3Config(), target)
    h = target.config.hidden_size
    assert head.midlayer.self_attn.q_proj.in_features == 2 * h
    assert head.fc.in_features == 3 * h and head.fc.bias is None


def test_d2t_t2d_round_trip(target):
    head = build_head(Eagle3Config(draft_vocab_size=10), target)
    counts = torch.zeros(97)
    frequent = torch.tensor([90, 3, 55, 7, 11, 60, 2, 81, 40, 13])
    counts[frequent] = torch.arange(10, 0, -1).float() * 100
    head.set_draft_vocab(counts, target)
    ids = frequent.sort().values
    assert torch.equal(head.draft_ids, ids)  # d + d2t[d] is the target id
    assert torch.equal(head.t2d.nonzero().flatten(), ids)  # t2d marks exactly those
    assert torch.equal(torch.arange(10) + head.d2t, head.t2d.nonzero().flatten())
    # Draft logits land on the right target ids; the rest is impossible.
    logp = head.to_target_logp(torch.arange(10).float())
    assert torch.isinf(logp[~head.t2d]).all() and int(logp.argmax()) == int(ids[-1])


def test_ttt_mask_step_sees_prefix_and_own_earlier_steps():
    vis = ttt_visibility(4, 2, "cpu")  # 4 columns, step 2: blocks [step0 | step1 | step2]
    assert vis.shape == (4, 12)
    for i in range(4):
        row = vis[i]
        assert row[:4].nonzero().flatten().tolist() == list(range(i + 1))  # real prefix up to column i
        assert row[4:8].nonzero().flatten().tolist() == [i]  # its own step 1
        assert row[8:12].nonzero().flatten().tolist() == [i]  # itself at step 2


def test_ttt_loss_trains_and_masks_undraftable_targets(target):
    head = build_head(Eagle3Config(draft_vocab_size=30, ttt_length=3), target).train()
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
    batch = TrainBatch(ids, torch.ones(2, 16), {i: out.hidden_states[i] for i in head.hidden_layers}, out.logits)
    loss, metrics = head.loss(batch)
    loss.backward()
    assert torch.isfinite(loss) and head.fc.weight.grad is not None
    assert {"step0_top1", "step1_top1", "step2_top1"} <= set(metrics)
    # With no target argmax in the draft vocabulary, nothing is learned.
    head.t2d.zero_()
    empty, _ = head.loss(batch)
    assert float(empty.detach()) == 0.0


def test_ttt_step0_matches_the_drafter_on_a_real_prefix(target):
    """Step 0 of training and the drafter's root step compute the same distribution."""
    head = build_head(Eagle3Config(ttt_length=1), target).eval()
    torch.manual_seed(0)
    for p in head.parameters():
        p.data.normal_(0, 0.1)
    ids = torch.tensor([[1, 7, 9, 22, 40, 5]])
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
    hidden = {i: out.hidden_states[i] for i in head.hidden_layers}
    state = Eagle3Drafter(head, target).start(ids[0, :5], {i: h[0, :5] for i, h in hidden.items()})
    logp_first = None

    class Capture:
        max_depth = 1

        def grow(self, step, root_token, max_depth=None, device="cpu", sampling=None):
            nonlocal logp_first
            tree = sg.Tree.root_only(root_token)
            logp_first = step(tree, torch.tensor([0]))[0]
            return tree

    state.propose(int(ids[0, 5]), Capture(), 1)
    # Training's view: column 4 pairs (f_4, t_5) and predicts t_6.
    h = head.fuse(hidden)[:, :5]
    x = head.layer_inputs(h, ids[:, 1:6])
    cos, sin = head.rotary(x, torch.arange(5)[None])
    q, k, v = head.midlayer.self_attn.project(x, cos, sin)
    from specgraft.tree import additive_mask

    o = head.finish(h, head.midlayer.self_attn.attend(q, k, v, additive_mask(ttt_visibility(5, 0, "cpu"), q.dtype)))
    expected = head.to_target_logp(head.draft_logits(o[0, -1]))
    assert torch.allclose(logp_first, expected, atol=1e-5)


def random_eagle3(target):
    head = build_head(Eagle3Config(draft_vocab_size=50), target).eval()
    torch.manual_seed(0)
    for p in head.parameters():
        p.data.normal_(0, 0.2)
    return head


def test_lean_draft_step_matches_the_module_forward(target):
    """draft_step (fast_llama, static cache) == forward (modules, HF cache): prefix, causal step, tree step."""
    head = random_eagle3(target)
    hidden = target.config.hidden_size
    lean, reference = head.new_draft_cache(64), sg.KVCache()
    tokens = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(1))
    feats = torch.randn(1, 12, hidden, generator=torch.Generator().manual_seed(2))

    def both(cols: slice, positions: list[int], visible: torch.Tensor, lean_mask: torch.Tensor | None):
        h, t, pos = feats[:, cols], tokens[:, cols], torch.tensor([positions])
        expected = head(h, t, pos, additive_mask(visible, h.dtype), reference)
        got = head.draft_step(h, t, pos, lean_mask, lean)
        assert len(lean) == len(reference)
        assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()

    # 5 causal pairs on an empty cache, then 3 causal pairs after them (no mask given: causal).
    both(slice(0, 5), list(range(5)), torch.ones(5, 5, dtype=torch.bool).tril(), None)
    both(slice(5, 8), [5, 6, 7], torch.ones(3, 8, dtype=torch.bool).tril(5), None)
    # A 4-node tree after the 8 pairs: root 0, children 1 and 2 of 0, 3 of 2; each sees the prefix and its ancestors.
    visible = torch.cat([torch.ones(4, 8, dtype=torch.bool), torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)], dim=1)
    both(slice(8, 12), [8, 9, 9, 10], visible, additive_mask(visible, feats.dtype))


def test_lean_draft_step_sees_weight_updates(target):
    """The lean path references the module's parameters: an in-place update (an optimizer step) shows at once."""
    head = random_eagle3(target)
    h, tokens, positions = torch.randn(1, 3, target.config.hidden_size), torch.tensor([[3, 5, 7]]), torch.arange(3)[None]
    before = head.draft_step(h, tokens, positions, None, head.new_draft_cache(8))
    with torch.no_grad():
        head.midlayer.self_attn.q_proj.weight.mul_(2)
        head.midlayer.hidden_norm.weight.add_(0.5)
    after = head.draft_step(h, tokens, positions, None, head.new_draft_cache(8))
    expected = head(h, tokens, positions, additive_mask(torch.ones(3, 3, dtype=torch.bool).tril(), h.dtype), sg.KVCache())
    assert not torch.allclose(after, before, atol=1e-3)
    assert torch.allclose(after, expected, atol=1e-5)


@pytest.mark.parametrize("tree", [sg.Chain(4), sg.DynamicTree(top_k=3, depth=4, budget=12)], ids=["chain", "dynamic"])
def test_random_eagle3_keeps_greedy_output_identical(target, tree):
    head = build_head(Eagle3Config(draft_vocab_size=50), target).eval()
    prompt = [1, 4, 8, 15, 16, 23]
    ref = target.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40, eos_token_id=None)[0, 6:].tolist()
    out = sg.SpeculativeGenerator(target, as_drafter(head, target), tree=tree).generate(prompt, max_new_tokens=40, eos_token_id=())
    assert out.token_ids == ref


def test_eagle3_checkpoint_round_trip(target, tmp_path):
    head = build_head(Eagle3Config(draft_vocab_size=20, aux_layers=[1, 2, 4]), target)
    head.set_draft_vocab(torch.arange(97).float(), target)
    save_head(head, tmp_path / "h", target)
    loaded = load_head(tmp_path / "h", target)
    assert loaded.hidden_layers == (1, 2, 4)
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    assert loaded.d2t.dtype == torch.long and loaded.t2d.dtype == torch.bool
