"""DFlash: the official layout, one maths for training and drafting, exact drafting alone and batched."""

from __future__ import annotations

import pytest
import torch

import specgraft as sg
from specgraft.heads import DFlashDrafter, as_drafter, build_head, load_drafter, load_head, save_head
from specgraft.heads.base import TrainBatch
from specgraft.heads.configs import DFlashConfig
from specgraft.heads.dflash import context_visibility, default_target_layer_ids, sample_anchors
from conftest import tiny_causal_lm

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def target():
    return sg.load_target(tiny_causal_lm("llama", vocab_size=97, seed=3, layers=4))


def random_head(target, **config):
    head = build_head(DFlashConfig(mask_token_id=96, **config), target).eval()
    torch.manual_seed(0)
    for p in head.parameters():
        p.data.normal_(0, 0.3)
    return head


def test_official_layer_ids_and_weight_names(target):
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab's Qwen3-8B heads
    assert default_target_layer_ids(36, 1) == [18]
    head = build_head(DFlashConfig(num_layers=2, target_layer_ids=[0, 2], mask_token_id=96), target)
    assert head.hidden_layers == (1, 3)  # layer outputs are HF hidden_states[id + 1]
    layer = {f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
    layer |= {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"}
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {f"layers.{i}.{n}.weight" for i in (0, 1) for n in layer}
    assert set(head.state_dict()) == expected  # no embedding, no lm_head: the target's are used
    assert head.fc.in_features == 2 * target.config.hidden_size and head.fc.bias is None


def test_bad_taps_and_a_missing_mask_token_are_named(target):
    with pytest.raises(ValueError, match="target_layer_ids"):
        build_head(DFlashConfig(target_layer_ids=[3], mask_token_id=0), target)  # 3 is the final-norm output here
    with pytest.raises(ValueError, match="mask_token_id"):
        build_head(DFlashConfig(), target)  # no tokenizer to pick one from
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        build_head(DFlashConfig(mask_token_id=97), target)


def test_anchors_are_trained_positions_and_blocks_see_only_their_past(target):
    torch.manual_seed(0)
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0, 0]]).float()
    anchors, keep = sample_anchors(loss_mask, count=8)
    assert anchors.shape == (2, 4)  # row 0 has 4 valid anchors (2..5), row 1 two (0, 1)
    assert anchors[0].tolist() == [2, 3, 4, 5] and keep[0].all()
    assert anchors[1, :2].tolist() == [0, 1] and keep[1].tolist() == [True, True, False, False]
    sees = context_visibility(anchors, keep, context=8)  # (B, A, S)
    assert sees[0, 1].nonzero().flatten().tolist() == [0, 1, 2]  # the block at anchor 3 sees positions 0..2
    assert sees[0, 0].nonzero().flatten().tolist() == [0, 1]
    assert not sees[1, 2:].any()  # padding blocks see no context


def test_blocks_never_see_each_other(target):
    """A block's output depends on its own slots and visible context only: changing another block changes nothing."""
    head = random_head(target, block_size=3)
    s = 6
    context = torch.randn(1, s, target.config.hidden_size)
    cos_c, sin_c = head.rope(context, torch.arange(s)[None])
    kv = [head.context_kv(0, context, cos_c, sin_c)]
    x = torch.randn(1, 2, 3, target.config.hidden_size)
    positions = torch.tensor([[2, 3, 4, 4, 5, 6]])
    cos, sin = head.rope(x, positions)
    cos, sin = cos.view(1, 2, 3, -1), sin.view(1, 2, 3, -1)
    sees = context_visibility(torch.tensor([[2, 4]]), torch.tensor([[True, True]]), s)
    out = head.run_block(x, cos, sin, kv, sees)
    x2, context2 = x.clone(), context.clone()
    x2[0, 1] += 1.0  # the other block
    context2[0, 2:] += 1.0  # context at or after the first anchor
    kv2 = [head.context_kv(0, context2, cos_c, sin_c)]
    out2 = head.run_block(x2, cos, sin, kv2, sees)
    assert torch.allclose(out[0, 0], out2[0, 0], atol=1e-6)
    assert not torch.allclose(out[0, 1], out2[0, 1], atol=1e-3)


def written_out_block(head, x, cos, sin, kv, sees):
    """`run_block` for one layer written out block by block and head by head: the reference it must equal."""
    layer, (ctx_k, ctx_v) = head.layers[0], kv[0]
    attn, eps, d = layer.self_attn, head.eps, head.head_dim
    outs = []
    for blk in range(x.shape[1]):
        xb = x[0, blk]  # (K, H)
        h = sg.model.rms_norm(xb, layer.input_layernorm.weight, eps)
        q = sg.model.rms_norm((h @ attn.q_proj.weight.T).view(-1, head.num_heads, d), attn.q_norm.weight, eps)
        k = sg.model.rms_norm((h @ attn.k_proj.weight.T).view(-1, head.num_kv, d), attn.k_norm.weight, eps)
        v = (h @ attn.v_proj.weight.T).view(-1, head.num_kv, d)
        rot = lambda t: t * cos[0, blk][:, None] + torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1) * sin[0, blk][:, None]
        q, k = rot(q), rot(k)
        seen = sees[0, blk]
        heads = []
        for n in range(head.num_heads):
            kv_head = n // (head.num_heads // head.num_kv)
            keys = torch.cat([ctx_k[0, kv_head][seen], k[:, kv_head]])
            values = torch.cat([ctx_v[0, kv_head][seen], v[:, kv_head]])
            heads.append(torch.softmax(q[:, n] @ keys.T / d**0.5, -1) @ values)
        xb = xb + torch.cat(heads, -1) @ attn.o_proj.weight.T
        xb = xb + layer.mlp(sg.model.rms_norm(xb, layer.post_attention_layernorm.weight, eps))
        outs.append(sg.model.rms_norm(xb, head.norm.weight, eps))
    return torch.stack(outs)[None]


def test_block_attention_equals_it_written_out(target):
    """The fused masked attention over [context ; all blocks] is each block's own attention over its visible context
    and its slots (grouped-query heads, q_norm / k_norm, RoPE), as the official layer computes it."""
    head = random_head(target, block_size=4, num_layers=1)
    s = 7
    context = torch.randn(1, s, target.config.hidden_size)
    cos_c, sin_c = head.rope(context, torch.arange(s)[None])
    kv = [head.context_kv(0, context, cos_c, sin_c)]
    x = torch.randn(1, 3, 4, target.config.hidden_size)
    anchors = torch.tensor([[1, 3, 6]])
    cos, sin = head.rope(x, (anchors[..., None] + torch.arange(4)).view(1, -1))
    cos, sin = cos.view(1, 3, 4, -1), sin.view(1, 3, 4, -1)
    sees = context_visibility(anchors, torch.tensor([[True, True, True]]), s)
    with torch.no_grad():
        assert torch.allclose(head.run_block(x, cos, sin, kv, sees), written_out_block(head, x, cos, sin, kv, sees), atol=1e-5)


def test_loss_trains_every_slot(target):
    head = random_head(target, block_size=4, num_anchors=6).train()
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
    batch = TrainBatch(ids, torch.ones(2, 20), {i: out.hidden_states[i] for i in head.hidden_layers}, out.logits)
    loss, metrics = head.loss(batch)
    loss.backward()
    assert torch.isfinite(loss) and head.fc.weight.grad is not None and head.layers[0].self_attn.q_norm.weight.grad is not None
    assert {"slot1_top1", "slot2_top1", "slot3_top1"} <= set(metrics)
    soft, _ = build_head(DFlashConfig(mask_token_id=96, labels="target", block_size=4), target).loss(batch)
    assert torch.isfinite(soft)


def training_view(head, target, ids: torch.Tensor, anchor: int) -> torch.Tensor:
    """Slots 1.. of the block at ``anchor`` as training computes them: (K - 1, V) log-probs."""
    with torch.no_grad():
        out = target.model(input_ids=ids[None], output_hidden_states=True)
        batch = {i: out.hidden_states[i] for i in head.hidden_layers}
        context = head.fuse(batch)
        s, k = ids.numel(), head.block_size
        cos, sin = head.rope(context, torch.arange(s)[None])
        kv = [head.context_kv(i, context, cos, sin) for i in range(len(head.layers))]
        block = torch.full((1, 1, k), head.config.mask_token_id)
        block[0, 0, 0] = ids[anchor]
        x = head.embed(block)
        bcos, bsin = head.rope(x[:, 0], anchor + torch.arange(k)[None])
        sees = context_visibility(torch.tensor([[anchor]]), torch.tensor([[True]]), s)
        return head.logits(head.run_block(x, bcos[:, None], bsin[:, None], kv, sees)[0, 0, 1:]).log_softmax(-1)


class Capture:
    """A policy that records the distribution of every depth the drafter offers, and drafts nothing."""

    def __init__(self, depth: int) -> None:
        self.depth, self.max_depth, self.seen = depth, depth, []

    def grow(self, step, root_token, max_depth=None, device="cpu", sampling=None):
        n = max_depth  # a chain: node d at depth d
        tree = sg.Tree(torch.full((n,), 5), torch.arange(-1, n - 1), torch.arange(n), torch.zeros(n))
        self.seen = step(tree, torch.arange(n))
        return sg.Tree.root_only(root_token)


def test_drafting_after_commits_is_trainings_block(target):
    """The drafter's block after a prompt and two commits is the block training computes at that anchor."""
    head = random_head(target, block_size=5)
    ids = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden = target.model(input_ids=ids[None], output_hidden_states=True).hidden_states
    taps = {i: hidden[i][0] for i in head.hidden_layers}
    state = DFlashDrafter(head, target).start(ids[:5], {i: h[:5] for i, h in taps.items()})
    state.commit(ids[5:8], {i: h[5:8] for i, h in taps.items()})
    capture = Capture(4)
    state.propose(int(ids[8]), capture, 4)  # drafts the context of positions 0..7 (three of them new)
    state.commit(ids[8:10], {i: h[8:10] for i, h in taps.items()})
    again = Capture(4)
    state.propose(int(ids[10]), again, 4)
    assert torch.allclose(capture.seen, training_view(head, target, ids, 8), atol=1e-5)
    assert torch.allclose(again.seen, training_view(head, target, ids, 10), atol=1e-5)


def test_one_forward_for_every_row_equals_each_alone(target):
    """Rows of one batched cache at different lengths draft what each would alone."""
    head = random_head(target, block_size=4)
    drafter = DFlashDrafter(head, target)
    rows = drafter.new_rows(3, 64)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (n,), generator=gen) for n in (3, 9, 6)]
    states, alone = [], []
    for row, ids in enumerate(prompts):
        with torch.no_grad():
            hidden = target.model(input_ids=ids[None], output_hidden_states=True).hidden_states
        taps = {i: hidden[i][0] for i in head.hidden_layers}
        states.append(drafter.start(ids, taps, cache=rows.acquire(row)[1]))
        alone.append(drafter.start(ids, taps))
    requests = [sg.heads.base.DraftRequest(s, 7, sg.Chain(3), 3, row=r) for r, s in enumerate(states)]
    together = drafter.block_logp([requests[0], requests[2]], rows)  # rows 0 and 2: not consecutive
    together_all = drafter.block_logp(requests, rows)
    for i, r in ((0, 0), (1, 2)):
        single = drafter.block_logp([sg.heads.base.DraftRequest(alone[r], 7, sg.Chain(3), 3)], None)[0]
        assert torch.allclose(together[i], single, atol=1e-5)
        assert torch.allclose(together_all[r], single, atol=1e-5)
    assert rows.lengths(3) == [3, 9, 6]  # the blocks left nothing in the cache


def test_only_the_slots_a_tree_reaches_are_drafted(target):
    """A shallower tree gets the same distributions for its depths, the whole block having run: fewer slots
    through the lm_head, never different ones."""
    head = random_head(target, block_size=6)
    drafter = DFlashDrafter(head, target)
    ids = torch.randint(0, 96, (7,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        hidden = target.model(input_ids=ids[None], output_hidden_states=True).hidden_states
    state = drafter.start(ids, {i: hidden[i][0] for i in head.hidden_layers})
    request = sg.heads.base.DraftRequest
    full = drafter.block_logp([request(state, 7, sg.Chain(5), 5)], None)[0]
    assert full.shape[0] == 5
    for policy, max_depth, depth in ((sg.Chain(2), 5, 2), (sg.Chain(5), 3, 3), (sg.Chain(9), 9, 5)):
        part = drafter.block_logp([request(state, 7, policy, max_depth)], None)[0]
        assert part.shape[0] == depth
        assert torch.allclose(part, full[:depth], atol=1e-6)


@pytest.mark.parametrize("tree", [sg.Chain(5), sg.DynamicTree(top_k=3, depth=5, budget=12), sg.Adaptive()],
                         ids=["chain", "dynamic", "adaptive"])
def test_random_dflash_keeps_greedy_output_identical(target, tree):
    drafter = as_drafter(random_head(target, block_size=6), target)
    prompt = [1, 4, 8, 15, 16, 23]
    ref = target.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40, eos_token_id=None)[0, 6:].tolist()
    out = sg.SpeculativeGenerator(target, drafter, tree=tree).generate(prompt, max_new_tokens=40, eos_token_id=())
    assert out.token_ids == ref


def test_dflash_checkpoint_round_trip(target, tmp_path):
    head = random_head(target, num_layers=2, target_layer_ids=[0, 2], block_size=7)
    save_head(head, tmp_path / "h", target)
    loaded = load_head(tmp_path / "h", target)
    assert loaded.hidden_layers == (1, 3) and loaded.config.mask_token_id == 96 and loaded.block_size == 7
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), head.state_dict().values()))
    assert isinstance(load_drafter(tmp_path / "h", target), DFlashDrafter)


# -- the real target ------------------------------------------------------------------------------------------


def test_stories_mask_token_is_unk(stories):
    head = build_head(DFlashConfig(), stories)
    assert head.config.mask_token_id == stories.tokenizer.unk_token_id == 0


def hf_greedy(target, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    refs = []
    for ids in prompts:
        x = torch.tensor([ids])
        out = target.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new_tokens)
        refs.append(out[0, len(ids):].tolist())
    return refs


def test_trained_dflash_drafts_what_it_learned_exactly(stories, trained_dflash):
    drafter, learned = trained_dflash
    prompts = [ids[:10] for ids in learned]
    chain = sg.SpeculativeGenerator(stories, drafter, tree=sg.Chain(5))
    outputs = [chain.generate(ids, max_new_tokens=48) for ids in prompts]
    assert [o.token_ids for o in outputs] == hf_greedy(stories, prompts, 48)
    tau = sum(len(o.token_ids) for o in outputs) / sum(o.stats.target_calls for o in outputs)
    assert tau > 3.0  # one draft forward, several tokens accepted (a random head gets about 1.0)


def test_trained_dflash_matches_hf_greedy_on_every_dev_prompt_alone_and_batched(stories, dev_prompts, trained_dflash):
    drafter, learned = trained_dflash
    prompts = [stories.encode(p) for p in dev_prompts] + [ids[:10] for ids in learned[:8]]
    assert len(prompts) >= 28
    refs = hf_greedy(stories, prompts, NEW_TOKENS)
    chain = sg.SpeculativeGenerator(stories, drafter, tree=sg.Chain(5))
    assert [chain.generate(ids, max_new_tokens=NEW_TOKENS).token_ids for ids in prompts] == refs
    tree = sg.SpeculativeGenerator(stories, drafter, tree=sg.DynamicTree(top_k=2, depth=5, budget=10))
    assert [o.token_ids for o in tree.generate_batch(prompts, max_new_tokens=NEW_TOKENS)] == refs
    adaptive = sg.SpeculativeGenerator(stories, drafter, tree=sg.Adaptive(max_depth=5))
    assert [o.token_ids for o in adaptive.generate_batch(prompts[:12], max_new_tokens=NEW_TOKENS)] == refs[:12]
