"""Medusa, EAGLE and distilled-draft heads: structure, losses, checkpoints, and exact drafting."""

from __future__ import annotations

import json

import pytest
import torch

import specgraft as sg
from specgraft.heads import EagleDrafter, as_drafter, build_head, load_drafter, load_head, save_head
from specgraft.heads.base import TrainBatch
from specgraft.heads.configs import DFlashConfig, DistillConfig, Eagle3Config, EagleConfig, MedusaConfig
from conftest import tiny_causal_lm


@pytest.fixture(scope="module")
def tiny_target():
    return sg.load_target(tiny_causal_lm("llama", vocab_size=97, seed=3))


def _batch(target, head, length=12, batch=2, seed=0):
    ids = torch.randint(0, target.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
    return TrainBatch(ids, torch.ones(batch, length), {i: out.hidden_states[i] for i in head.hidden_layers}, out.logits)


def test_medusa_weight_names_follow_vllm(tiny_target):
    heads = build_head(MedusaConfig(num_heads=3, num_layers=2), tiny_target)
    assert sorted(heads.state_dict()) == sorted(
        [f"blocks.{h}.layers.{l}.{p}" for h in range(3) for l in range(2) for p in ("weight", "bias")]
        + [f"lm_heads.{h}.weight" for h in range(3)]
    )


def test_medusa_heads_own_separate_blocks(tiny_target):
    heads = build_head(MedusaConfig(num_heads=2, num_layers=2), tiny_target)
    layers = [layer for block in heads.blocks for layer in block.layers]
    assert len({id(layer) for layer in layers}) == 4


def test_fresh_medusa_heads_equal_the_target_lm_head(tiny_target):
    heads = build_head(MedusaConfig(num_heads=2), tiny_target)
    hidden = torch.randn(5, tiny_target.config.hidden_size)
    expected = tiny_target.model.get_output_embeddings()(hidden)
    assert torch.allclose(heads(hidden), expected.expand(2, -1, -1), atol=1e-5)


def test_medusa_loss_weights_heads_by_decay(tiny_target):
    heads = build_head(MedusaConfig(num_heads=2, loss_decay=0.5), tiny_target)
    batch = _batch(tiny_target, heads)
    loss, metrics = heads.loss(batch)
    logits = heads(batch.hidden[heads.hidden_layers[0]])
    ce = [
        torch.nn.functional.cross_entropy(logits[k, :, : -(2 + k)].reshape(-1, logits.shape[-1]), batch.input_ids[:, 2 + k :].reshape(-1))
        for k in range(2)
    ]
    assert loss.item() == pytest.approx((ce[0] + 0.5 * ce[1]).item(), rel=1e-5)
    assert set(metrics) >= {"head0_top1", "head1_top1", "loss"}


def test_eagle_weight_names_follow_official_checkpoints(tiny_target):
    head = build_head(EagleConfig(), tiny_target)
    names = set(head.state_dict())
    assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight",
            "layers.0.post_attention_layernorm.weight"} <= names
    assert "fc.bias" not in names  # no bias by default: vLLM's EAGLE has none
    assert not any("input_layernorm" in n or "embed" in n or "lm_head" in n for n in names)
    assert "fc.bias" in build_head(EagleConfig(fc_bias=True), tiny_target).state_dict()


def test_eagle_loss_is_finite_and_backpropagates_into_the_head_only(tiny_target):
    head = build_head(EagleConfig(), tiny_target).train()
    loss, metrics = head.loss(_batch(tiny_target, head))
    loss.backward()
    assert torch.isfinite(loss) and head.fc.weight.grad is not None
    assert all(p.grad is None for p in tiny_target.model.parameters())
    assert set(metrics) >= {"feature_loss", "token_loss", "top1"}


def test_eagle_tree_drafting_matches_sequential_drafting(tiny_target):
    """A node's distribution must not depend on its siblings: tree attention equals running its path alone."""
    head = build_head(EagleConfig(), tiny_target).eval()
    torch.manual_seed(0)
    for p in head.parameters():
        p.data.normal_(0, 0.2)
    prompt = torch.tensor([1, 5, 9, 14])
    out = tiny_target.forward(prompt[None], tiny_target.new_cache(), torch.arange(4)[None], hidden_layers=head.hidden_layers)
    hidden = {i: h[0] for i, h in out.hidden.items()}
    state = EagleDrafter(head, tiny_target).start(prompt, hidden)
    tree = state.propose(7, sg.StaticTree([[0], [1], [0, 0], [1, 0], [1, 0, 0]]), 3)
    for path in tree.paths():
        chain = state.propose(7, ForcedPath(tree.tokens[path[1:]].tolist()), len(path) - 1)
        assert torch.equal(chain.tokens, tree.tokens[path])
        assert torch.allclose(chain.scores, tree.scores[path], atol=1e-5)


class ForcedPath:
    """Drafts exactly the given tokens (a chain) so its scores can be compared."""

    def __init__(self, tokens):
        self.tokens = tokens
        self.max_depth = len(tokens)

    def grow(self, step, root_token, max_depth=None, device="cpu", sampling=None):
        builder = sg.tree.TreeBuilder(root_token, device)
        last = torch.zeros(1, dtype=torch.long)
        for token in self.tokens:
            logp = step(builder.tree(), last)[0]
            last = builder.add(torch.tensor([token]), last, builder.tree().scores[last] + logp[token])
        return builder.tree()


@pytest.mark.parametrize("config", [MedusaConfig(num_heads=3), EagleConfig(), DistillConfig(num_layers=1)], ids=lambda c: c.type)
def test_random_heads_keep_greedy_output_identical(tiny_target, config):
    head = build_head(config, tiny_target).eval()
    torch.manual_seed(1)
    for p in head.parameters():
        p.data.add_(torch.randn_like(p) * 0.05)
    prompt = [1, 4, 8, 15, 16]
    ref = tiny_target.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40, eos_token_id=None)[0, 5:].tolist()
    for tree in (sg.Chain(3), sg.StaticTree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])):
        out = sg.SpeculativeGenerator(tiny_target, as_drafter(head, tiny_target), tree=tree).generate(
            prompt, max_new_tokens=40, eos_token_id=()
        )
        assert out.token_ids == ref


def test_medusa_runs_only_the_heads_a_tree_reaches(tiny_target):
    """Each head reads a projection the size of the target's lm_head: a depth-1 chain must not pay for the others."""
    heads = build_head(MedusaConfig(num_heads=3), tiny_target).eval()
    calls = [0, 0, 0]
    for k, lm in enumerate(heads.lm_heads):
        lm.register_forward_hook(lambda *_, k=k: calls.__setitem__(k, calls[k] + 1))
    prompt = [1, 4, 8, 15, 16]
    ref = tiny_target.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, eos_token_id=None)[0, 5:].tolist()
    for tree, used in ((sg.Chain(1), [1, 0, 0]), (sg.StaticTree([[0], [1], [0, 0]]), [1, 1, 0])):
        calls[:] = [0, 0, 0]
        out = sg.SpeculativeGenerator(tiny_target, as_drafter(heads, tiny_target), tree=tree).generate(
            prompt, max_new_tokens=12, eos_token_id=()
        )
        assert out.token_ids == ref
        assert [c > 0 for c in calls] == [bool(u) for u in used], (tree, calls)


def test_eagle_cache_holds_only_committed_pairs_after_each_step(tiny_target):
    head = build_head(EagleConfig(), tiny_target).eval()
    drafter = EagleDrafter(head, tiny_target)
    sched = sg.Scheduler(tiny_target, {"eagle": drafter}, max_batch_size=1, default_drafter="eagle",
                         default_tree=sg.StaticTree([[0], [1], [0, 0]]))
    handle = sched.submit([1, 2, 3], max_new_tokens=40, eos_token_id=())  # more than 7 steps can commit
    for _ in range(7):  # the prefill with a first step, then six steps
        sched.step()
        request = sched.running[handle]
        state = request.draft
        committed = len(request.cache)  # tokens before the root: the drafter's committed sequence
        assert state.length == committed
        # Only pairs of committed tokens stay: the root's pair (f_{n-1}, root) is run again next round.
        assert len(state.cache) <= committed - 1
        # Pending rows are exactly those the cache has not consumed: f_j from len(cache), t_j from len(cache) + 1.
        assert len(state.cache) + len(state.features) == committed
        assert len(state.cache) + 1 + len(state.next_tokens) == committed
        assert len(state.features) <= 1 + 4  # f_{n-1} and this step's accepted path: nothing re-copied


@pytest.mark.parametrize("config", [MedusaConfig(num_heads=2), EagleConfig()], ids=lambda c: c.type)
def test_head_checkpoint_round_trip(tiny_target, tmp_path, config):
    head = build_head(config, tiny_target)
    for p in head.parameters():
        p.data.normal_()
    save_head(head, tmp_path / "head", tiny_target, card="trained for a test")
    assert {f.name for f in (tmp_path / "head").iterdir()} == {"config.json", "model.safetensors", "README.md"}
    loaded = load_head(tmp_path / "head", tiny_target)
    for (name, a), (_, b) in zip(sorted(head.state_dict().items()), sorted(loaded.state_dict().items())):
        assert torch.equal(a.cpu(), b.cpu()), name
    assert "trained for a test" in (tmp_path / "head" / "README.md").read_text()


def test_distilled_draft_saves_a_transformers_directory(tiny_target, tmp_path):
    head = build_head(DistillConfig(num_layers=1), tiny_target)
    save_head(head, tmp_path / "draft", tiny_target)
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "draft").config.num_hidden_layers == 1
    assert isinstance(load_drafter(tmp_path / "draft", tiny_target), sg.DraftModel)


def test_head_on_a_different_target_is_refused(tiny_target, tmp_path):
    save_head(build_head(EagleConfig(), tiny_target), tmp_path / "head", tiny_target)
    other = sg.load_target(tiny_causal_lm("llama", vocab_size=97, seed=4))
    with pytest.raises(ValueError, match="embedding_fingerprint"):
        load_drafter(tmp_path / "head", other)
    wider = sg.load_target(tiny_causal_lm("llama", vocab_size=101, seed=3))
    with pytest.raises(ValueError, match="vocab_size: head expects 97, target has 101"):
        load_drafter(tmp_path / "head", wider)


def test_a_head_saved_beside_a_float32_target_loads_beside_the_same_target_in_bf16(tmp_path):
    model = tiny_causal_lm("llama", vocab_size=97, seed=3)
    save_head(build_head(EagleConfig(), sg.load_target(model)), tmp_path / "head", sg.load_target(model))
    bf16 = sg.load_target(tiny_causal_lm("llama", vocab_size=97, seed=3), dtype="bfloat16")
    drafter = load_drafter(tmp_path / "head", bf16)
    assert next(drafter.head.parameters()).dtype == torch.bfloat16
    other = sg.load_target(tiny_causal_lm("llama", vocab_size=97, seed=4), dtype="bfloat16")
    with pytest.raises(ValueError, match="embedding_fingerprint: .* \\(another embedding\\)"):
        load_drafter(tmp_path / "head", other)
    # A head saved before the norms were recorded is checked by its exact hash, which a bf16 cast changes.
    sidecar = next(p for p in (tmp_path / "head").iterdir() if p.suffix == ".json" and "target" in p.read_text())
    meta = json.loads(sidecar.read_text())
    del meta["target"]["embedding_norms"]
    sidecar.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="embedding_fingerprint"):
        load_drafter(tmp_path / "head", bf16)
    assert load_drafter(tmp_path / "head", sg.load_target(tiny_causal_lm("llama", vocab_size=97, seed=3))) is not None


def test_bad_head_directories_name_the_file(tiny_target, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_drafter(tmp_path / "nope", tiny_target)
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_drafter(tmp_path / "h", tiny_target)
    save_head(build_head(MedusaConfig(), tiny_target), tmp_path / "m", tiny_target)
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    raw["head"]["num_heads"] = "many"
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="num_heads"):
        load_drafter(tmp_path / "m", tiny_target)


def test_eagle_draft_path_matches_the_training_forward(tiny_target):
    """The lean drafting forward and the transformers-module forward compute the same features."""
    head = build_head(EagleConfig(num_layers=2), tiny_target).eval()
    torch.manual_seed(0)
    for p in head.parameters():
        p.data.normal_(0, 0.2)
    feats = torch.randn(1, 6, tiny_target.config.hidden_size)
    tokens = torch.randint(0, 97, (1, 6))
    positions = torch.arange(6)[None]
    reference = head(feats, tokens, positions)
    fast = head.draft_forward(feats, tokens, positions, None, head.fast().new_cache(64))
    assert torch.allclose(fast, reference, atol=1e-5)


@pytest.mark.parametrize("config", [MedusaConfig(num_heads=2), EagleConfig(), Eagle3Config(draft_vocab_size=40),
                                    DFlashConfig(block_size=4, mask_token_id=96)], ids=lambda c: c.type)
def test_a_head_loaded_beside_a_bf16_target_runs_in_bf16_and_keeps_greedy_output(tmp_path, config):
    """A head trained in float32 is loaded in its target's dtype (its output layer and embeddings stay the target's
    own tensors, never copied a call), and greedy output stays plain decoding's."""
    target = sg.load_target(tiny_causal_lm("llama", vocab_size=97, seed=3, layers=4), dtype="bfloat16")
    head = build_head(config, target)
    for p in head.parameters():
        p.data.normal_(0, 0.05)
    save_head(head.float(), tmp_path / "head", target)
    loaded = load_head(tmp_path / "head", target)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    if isinstance(config, EagleConfig):  # EAGLE drafts through the target's own output layer
        assert loaded.lm_head_weight.data_ptr() == target.model.get_output_embeddings().weight.data_ptr()
    prompt = [1, 4, 8, 15, 16]
    plain = sg.SpeculativeGenerator(target, None).generate(prompt, max_new_tokens=24, eos_token_id=())
    for tree in (sg.Chain(3), sg.StaticTree([[0], [1], [0, 0]])):
        out = sg.SpeculativeGenerator(target, as_drafter(loaded, target), tree=tree).generate(
            prompt, max_new_tokens=24, eos_token_id=())
        assert out.token_ids == plain.token_ids
