"""The fast Llama-family forward against Hugging Face's, and its static KV cache.

Each case runs the same calls on two `Target`s over one HF model, one on
`FastLlama` (``fast=True``) and one on HF's forward (``fast=False``), and
compares logits, the requested hidden states and the caches: prefill, one
token after a cache, a causal chunk after a cache, a tree with a 4D additive
mask, then after ``keep`` of a non-contiguous path and after ``crop``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import STORIES, filled_cache, tiny_causal_lm
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import specgraft as sg
from specgraft.model import FastLlama, StaticKVCache, fast_llama, small_rows, unsupported_reason
from specgraft.model import KVCache, Target
from specgraft.tree import additive_mask

TOL = 1e-5
VOCAB = 97
# A 6-node tree after the cache: node -> parent (-1: the root). The accepted path 0 -> 2 -> 5 skips rows 1, 3, 4.
TREE_PARENTS = [-1, 0, 0, 1, 2, 2]
ACCEPTED = [0, 2, 5]


class Pair:
    """A fast and an HF target over one model, each with its own cache, driven in lockstep."""

    def __init__(self, model, small_rows: str = "linear") -> None:
        self.fast = sg.load_target(model, fast=True, small_rows=small_rows)
        self.hf = sg.load_target(model, fast=False)
        assert self.fast.fast is not None and self.hf.fast is None
        self.caches = (self.fast.new_cache(), self.hf.new_cache())
        n = self.fast.num_layers
        self.layers = (0, 1, n // 2, n - 1, n, -1)  # HF hidden_states indices, the final norm twice

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask=None, last_only: bool = False) -> float:
        """Run both; return the largest |difference| over logits and hidden states (shapes must agree)."""
        fast = self.fast.forward(ids, self.caches[0], positions, mask, self.layers, last_only)
        hf = self.hf.forward(ids, self.caches[1], positions, mask, self.layers, last_only)
        assert fast.logits.dtype == torch.float32 and fast.logits.shape == hf.logits.shape
        assert fast.hidden.keys() == hf.hidden.keys()
        pairs = [(fast.logits, hf.logits)] + [(fast.hidden[i], hf.hidden[i]) for i in self.layers]
        for got, want in pairs:
            assert got.shape == want.shape
        return max(float((got - want).abs().max()) for got, want in pairs)

    def kv_difference(self) -> float:
        fast, hf = self.caches
        assert len(fast) == len(hf)
        worst = 0.0
        for layer in range(self.fast.num_layers):
            for got, want in zip(fast.layer_kv(layer), hf.layer_kv(layer)):
                assert got.shape == want.shape
                worst = max(worst, float((got - want).abs().max()))
        return worst

    def keep(self, prefix: int, rows: torch.Tensor) -> None:
        for cache in self.caches:
            cache.keep(prefix, rows)

    def crop(self, length: int) -> None:
        for cache in self.caches:
            cache.crop(length)

    def __len__(self) -> int:
        return len(self.caches[0])


def tree_mask(prefix: int, parents: list[int], dtype: torch.dtype) -> torch.Tensor:
    """(1, 1, N, prefix + N) additive mask: the prefix and each node's ancestors and itself."""
    n = len(parents)
    visible = torch.zeros(n, prefix + n, dtype=torch.bool)
    visible[:, :prefix] = True
    for node in range(n):
        ancestor = node
        while ancestor >= 0:
            visible[node, prefix + ancestor] = True
            ancestor = parents[ancestor]
    return additive_mask(visible, dtype)


def tree_depths(parents: list[int]) -> torch.Tensor:
    depth = []
    for parent in parents:
        depth.append(0 if parent < 0 else depth[parent] + 1)
    return torch.tensor(depth)


def _model(name: str):
    if name == "stories":
        if not STORIES.is_dir():
            pytest.skip(f"../shared assets are absent ({STORIES} not found)")
        return sg.load_target(STORIES, fast=False).model
    if name == "llama-eager":
        model = tiny_causal_lm("llama", vocab_size=VOCAB, seed=1)
        model.set_attn_implementation("eager")
        return model
    return tiny_causal_lm(name, vocab_size=VOCAB, seed=1)


CASES = ["stories", "llama", "llama-eager", "mistral", "qwen2", "qwen3", "llama-small-rows", "qwen2-small-rows",
         "llama-packed", "qwen2-packed", "qwen3-packed"]


@pytest.fixture(params=CASES)
def pair(request) -> Pair:
    name = request.param
    if name.endswith("-small-rows"):  # every few-row product takes the transposed form, as it may on a real CPU
        return Pair(_model(name.removesuffix("-small-rows")), small_rows="transposed")
    if name.endswith("-packed"):  # every product runs over oneDNN's packed weights, as it may on a real CPU
        if small_rows.pack(torch.zeros(2, 2)) is None:
            pytest.skip("this torch build packs no weights (no oneDNN)")
        return Pair(_model(name.removesuffix("-packed")), small_rows="packed")
    return Pair(_model(name))


def _ids(pair: Pair, n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, pair.fast.vocab_size, (batch, n), generator=g)


# --------------------------------------------------------------------------- forward equals HF's


def test_prefill_matches_hf(pair):
    assert pair.forward(_ids(pair, 24), torch.arange(24)[None]) < TOL
    assert pair.kv_difference() < TOL


def test_prefill_last_only_matches_hf(pair):
    assert pair.forward(_ids(pair, 24), torch.arange(24)[None], last_only=True) < TOL


def test_single_token_after_a_cache_matches_hf(pair):
    pair.forward(_ids(pair, 24), torch.arange(24)[None])
    for step in range(3):
        assert pair.forward(_ids(pair, 1, seed=step + 1), torch.tensor([[24 + step]])) < TOL
    assert pair.kv_difference() < TOL


def test_causal_chunk_after_a_cache_matches_hf(pair):
    """T > 1 new tokens after a non-empty cache with no mask: causal over cache and chunk."""
    pair.forward(_ids(pair, 24), torch.arange(24)[None])
    assert pair.forward(_ids(pair, 7, seed=1), torch.arange(24, 31)[None]) < TOL
    assert pair.kv_difference() < TOL


def test_tree_with_4d_mask_matches_hf(pair):
    pair.forward(_ids(pair, 24), torch.arange(24)[None])
    mask = tree_mask(24, TREE_PARENTS, pair.fast.dtype)
    positions = (24 + tree_depths(TREE_PARENTS))[None]
    assert pair.forward(_ids(pair, len(TREE_PARENTS), seed=2), positions, mask) < TOL


@pytest.mark.parametrize("parents", [[-1, 0], [-1, 0, 0], [-1, 0, 1, 1]], ids=["2", "3", "4"])
def test_trees_of_two_to_four_nodes_match_hf(pair, parents):
    """2-4 rows: sizes `FastLlama.linear` may compute as ``weight @ x.T`` on CPU (1 row is every decode step)."""
    pair.forward(_ids(pair, 24), torch.arange(24)[None])
    mask = tree_mask(24, parents, pair.fast.dtype)
    positions = (24 + tree_depths(parents))[None]
    assert pair.forward(_ids(pair, len(parents), seed=2), positions, mask) < TOL
    assert pair.kv_difference() < TOL


@pytest.mark.parametrize("queries", [1, 5])
@pytest.mark.parametrize("mask", ["none", "bool", "additive-one-row-for-all", "2d"])
def test_folded_attention_equals_attention_over_keys_repeated_for_each_head(queries, mask):
    """GQA with each group of query heads folded into its key/value head's rows (what a masked forward on CUDA and
    one query a row on CPU run) against HF's way: keys and values repeated for each query head."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(queries)
    b, heads, kv_heads, slots, dim = 3, 8, 2, 11, 16
    q = torch.randn(b, heads, queries, dim, generator=gen)
    k, v = torch.randn(b, kv_heads, slots, dim, generator=gen), torch.randn(b, kv_heads, slots, dim, generator=gen)
    visible = torch.rand(b, 1, queries, slots, generator=gen) > 0.4
    visible[..., 0] = True  # every query sees something
    attn = {"none": None, "bool": visible, "additive-one-row-for-all": fast_llama.additive(visible[:1], torch.float32),
            "2d": visible[0, 0]}[mask]
    if attn is None and queries > 1:
        pytest.skip("no mask with several queries is the causal path, which is not folded")
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=attn, scale=0.3)
    got = fast_llama.folded_attention(q, k, v, attn, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_takes_the_chosen_form_per_shape_and_rows_and_each_equals_f_linear(rows, bias, monkeypatch):
    torch.manual_seed(rows)
    weight, other = torch.randn(300, 256), torch.randn(256, 256)
    b = torch.randn(300) if bias else None
    x = torch.randn(1, rows, 256)
    want = torch.nn.functional.linear(x, weight, b)
    fast = FastLlama.for_layers([], LlamaConfig(hidden_size=256, num_attention_heads=4), rotary=None)
    # Injected: the transposed form measured faster for 300x256 at 2 and 4 rows, the packed one at 3 and above 4.
    forms = {(300, 256, 2): "transposed", (300, 256, 4): "transposed", (300, 256, 3): "packed",
             (300, 256, small_rows.MANY): "packed"}
    fast.small_rows = small_rows.SmallRowChoice(forms, how="injected")
    packed = small_rows.pack(weight)
    if packed is not None:
        fast.packed = {id(weight): fast_llama._Packed(weight, packed, weight.data_ptr(), weight._version)}
    calls = {"transposed": [], "packed": []}
    for form in calls:
        real = getattr(small_rows, f"{form}_linear")
        monkeypatch.setattr(fast_llama, f"{form}_linear", lambda *a, real=real, form=form: calls[form].append(a) or real(*a))
    got = fast.linear(x, weight, b)
    assert got.shape == want.shape == (1, rows, 300) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    wanted = {"transposed": int(rows in (2, 4)), "packed": int(rows in (3, 5, 9) and packed is not None)}
    assert {form: len(c) for form, c in calls.items()} == wanted
    fast.linear(torch.randn(rows, 256), other)  # another shape: never chosen, so F.linear
    assert {form: len(c) for form, c in calls.items()} == wanted
    torch.testing.assert_close(small_rows.transposed_linear(x, weight, b), want, rtol=1e-5, atol=1e-4)
    if packed is not None:
        torch.testing.assert_close(small_rows.packed_linear(x, packed, b), want, rtol=1e-5, atol=1e-4)


def test_a_weight_changed_after_packing_runs_f_linear_never_its_stale_copy():
    weight = torch.randn(300, 256)
    packed = small_rows.pack(weight)
    if packed is None:
        pytest.skip("this torch build packs no weights (no oneDNN)")
    fast = FastLlama.for_layers([], LlamaConfig(hidden_size=256, num_attention_heads=4), rotary=None)
    fast.small_rows = small_rows.SmallRowChoice({(300, 256, small_rows.MANY): "packed"}, how="injected")
    fast.packed = {id(weight): fast_llama._Packed(weight, packed, weight.data_ptr(), weight._version)}
    x = torch.randn(8, 256)
    torch.testing.assert_close(fast.linear(x, weight), x @ weight.T, rtol=1e-5, atol=1e-4)
    weight.mul_(2)  # in place: the packed copy no longer holds this weight
    torch.testing.assert_close(fast.linear(x, weight), x @ weight.T, rtol=1e-5, atol=1e-4)
    weight.data = torch.randn(300, 256)  # replaced, as model.to(...) does
    torch.testing.assert_close(fast.linear(x, weight), x @ weight.T, rtol=1e-5, atol=1e-4)


def test_the_choice_keeps_another_form_only_where_it_measured_faster_and_the_fastest_of_them():
    timings = {
        (10, 8, 1): {"linear": 1.0, "transposed": 2.0, "packed": 1.5},
        (10, 8, 2): {"linear": 2.0, "transposed": 1.0, "packed": 1.5},
        (10, 8, 3): {"linear": 1.5, "transposed": 1.5},  # a tie keeps F.linear
        (10, 8, small_rows.MANY): {"linear": 3.0, "packed": 2.0},
        (4, 4, 2): {"linear": 0.3, "transposed": 0.2, "packed": 0.1},
    }
    chosen = small_rows.choose(timings)
    assert chosen == {(10, 8, 2): "transposed", (10, 8, small_rows.MANY): "packed", (4, 4, 2): "packed"}
    # On any machine, then, every product runs at the fastest measured time, and never slower than F.linear.
    assert all(forms[chosen.get(k, "linear")] == min(forms.values()) for k, forms in timings.items())


def test_auto_measures_every_shape_at_one_to_four_rows_and_many_and_pins_are_named(monkeypatch):
    model = tiny_causal_lm("llama", vocab_size=VOCAB, seed=1)
    target = sg.load_target(model, small_rows="auto", threads=1)
    shapes = {tuple(w.shape) for w in [model.lm_head.weight] + [
        m.weight for layer in model.model.layers for m in (layer.self_attn.q_proj, layer.self_attn.k_proj,
        layer.self_attn.v_proj, layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]}
    choice = target.small_rows
    rows = (*range(1, small_rows.SMALL_ROWS + 1), small_rows.MANY)
    assert set(choice.timings) == {(o, i, r) for o, i in shapes for r in rows}
    assert choice.forms == small_rows.choose(choice.timings) and "measured here" in choice.describe()
    packs = small_rows.pack(model.lm_head.weight) is not None
    for (o, i, r), timed in choice.timings.items():
        assert set(timed) == {"linear"} | ({"transposed"} if r <= small_rows.SMALL_ROWS else set()) | ({"packed"} if packs else set())
        assert all(t > 0 for t in timed.values())
    # Packed copies are kept for exactly the shapes that take the packed form somewhere.
    taken = {(o, i) for (o, i, _), form in choice.forms.items() if form == "packed"}
    assert {tuple(p.weight.shape) for p in target.fast.packed.values()} == taken
    monkeypatch.setenv(small_rows.ENV, "transposed")
    pinned = sg.load_target(model, threads=1).small_rows
    assert set(pinned.forms.values()) == {"transposed"} and len(pinned.forms) == len(shapes) * small_rows.SMALL_ROWS
    assert small_rows.ENV in pinned.describe()
    if packs:
        monkeypatch.setenv(small_rows.ENV, "packed")
        target = sg.load_target(model, threads=1)
        assert set(target.small_rows.forms.values()) == {"packed"} and len(target.small_rows.forms) == len(shapes) * len(rows)
        assert len(target.fast.packed) == len({id(w) for w in model.parameters() if w.dim() == 2}) - (
            model.lm_head.weight is not model.model.embed_tokens.weight)  # every product weight; not the embeddings
    monkeypatch.setenv(small_rows.ENV, "fastest")
    with pytest.raises(ValueError, match="SPECGRAFT_SMALL_ROWS='fastest' must be one of auto, linear, transposed, packed"):
        sg.load_target(model, threads=1)
    with pytest.raises(ValueError, match="small_rows='fast'"):
        sg.load_target(model, small_rows="fast")


def test_decoding_after_keep_of_a_non_contiguous_path_matches_hf(pair):
    pair.forward(_ids(pair, 24), torch.arange(24)[None])
    pair.forward(_ids(pair, 6, seed=2), (24 + tree_depths(TREE_PARENTS))[None], tree_mask(24, TREE_PARENTS, pair.fast.dtype))
    pair.keep(24, torch.tensor(ACCEPTED))
    assert len(pair) == 24 + len(ACCEPTED)
    assert pair.kv_difference() < TOL
    # the next step: a chain of 3 after the committed path, then a single token
    assert pair.forward(_ids(pair, 3, seed=3), torch.arange(27, 30)[None]) < TOL
    assert pair.forward(_ids(pair, 1, seed=4), torch.tensor([[30]])) < TOL


def test_keep_equals_a_fresh_prefill_of_the_kept_tokens(pair):
    """After keep, the fast cache holds what a fresh prefill of the committed sequence computes.

    Relative to the tensor's scale: a differently shaped but equivalent forward
    moves stories260K's keys (up to ~26) by ~1e-5 in float32; a wrong row is O(1).
    """
    prompt = _ids(pair, 24)
    tree = _ids(pair, 6, seed=2)
    fast = pair.fast
    cache = fast.new_cache()
    fast.forward(prompt, cache, torch.arange(24)[None])
    fast.forward(tree, cache, (24 + tree_depths(TREE_PARENTS))[None], tree_mask(24, TREE_PARENTS, fast.dtype))
    cache.keep(24, torch.tensor(ACCEPTED))
    fresh = fast.new_cache()
    fast.forward(torch.cat([prompt, tree[:, ACCEPTED]], dim=1), fresh, torch.arange(27)[None])
    for layer in range(fast.num_layers):
        for got, want in zip(cache.layer_kv(layer), fresh.layer_kv(layer)):
            assert float((got - want).abs().max()) / max(1.0, float(want.abs().max())) < TOL


def test_decoding_after_crop_matches_hf(pair):
    pair.forward(_ids(pair, 24), torch.arange(24)[None])
    pair.forward(_ids(pair, 5, seed=1), torch.arange(24, 29)[None])
    pair.crop(20)
    assert len(pair) == 20 and pair.kv_difference() < TOL
    assert pair.forward(_ids(pair, 4, seed=5), torch.arange(20, 24)[None]) < TOL
    assert pair.forward(_ids(pair, 1, seed=6), torch.tensor([[24]])) < TOL


def test_batch_of_two_matches_hf(pair):
    pair.forward(_ids(pair, 12, batch=2), torch.arange(12)[None].expand(2, 12))
    assert pair.forward(_ids(pair, 1, seed=1, batch=2), torch.tensor([[12], [12]])) < TOL
    mask = tree_mask(13, TREE_PARENTS, pair.fast.dtype)
    positions = (13 + tree_depths(TREE_PARENTS))[None].expand(2, -1)
    assert pair.forward(_ids(pair, 6, seed=2, batch=2), positions, mask) < TOL
    pair.keep(13, torch.tensor([[0, 2, 5], [0, 1, 3]]))
    assert pair.kv_difference() < TOL
    assert pair.forward(_ids(pair, 1, seed=3, batch=2), torch.tensor([[16], [16]])) < TOL


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ],
    ids=lambda r: r["rope_type"],
)
def test_scaled_rope_types_match_hf(rope):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_parameters={"rope_theta": 10000.0, **rope},
        attn_implementation="sdpa",
    )
    pair = Pair(LlamaForCausalLM(config).eval())
    assert pair.fast.model.model.rotary_emb.rope_type == rope["rope_type"]
    assert pair.forward(_ids(pair, 150), torch.arange(150)[None]) < TOL
    assert pair.forward(_ids(pair, 1, seed=1), torch.tensor([[200]])) < TOL


def test_the_fast_path_sees_in_place_weight_updates():
    """It references the HF parameters, no copies: a changed weight changes both paths alike."""
    pair = Pair(_model("llama"))
    with torch.no_grad():
        pair.fast.model.model.layers[0].mlp.down_proj.weight.mul_(3.0)
    assert pair.forward(_ids(pair, 10), torch.arange(10)[None]) < TOL


def test_out_of_range_hidden_layer_is_an_error():
    target = sg.load_target(_model("llama"), fast=True)
    with pytest.raises(IndexError, match="hidden_layers"):
        target.forward(torch.tensor([[5]]), target.new_cache(), torch.tensor([[0]]), hidden_layers=(3,))


def test_a_cache_of_the_other_path_is_refused():
    target = sg.load_target(_model("llama"), fast=True)
    with pytest.raises(TypeError, match="new_cache"):
        target.forward(torch.tensor([[5]]), KVCache(), torch.tensor([[0]]))


# --------------------------------------------------------------------------- which path runs


def tiny_gpt2():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=1, n_head=2, attn_implementation="sdpa")
    return GPT2LMHeadModel(config).eval()


def test_auto_chooses_the_fast_path_for_llama_family():
    for arch in ("llama", "mistral", "qwen2", "qwen3"):
        target = sg.load_target(tiny_causal_lm(arch, vocab_size=VOCAB))
        assert target.fast is not None, arch
        assert isinstance(target.new_cache(), StaticKVCache)
        assert target.model.__class__.__name__.endswith("ForCausalLM")  # Target.model stays the HF model


def test_auto_keeps_hf_for_an_unsupported_architecture():
    target = sg.load_target(tiny_gpt2())
    assert target.fast is None
    assert isinstance(target.new_cache(), KVCache)
    assert "GPT2LMHeadModel" in unsupported_reason(target.model)


def test_auto_keeps_hf_for_a_subclass_and_for_flex_attention():
    class Patched(LlamaForCausalLM):
        pass

    model = tiny_causal_lm("llama", vocab_size=VOCAB)
    patched = Patched(model.config).eval()
    assert Target(patched).fast is None
    model.config._attn_implementation = "flex_attention"
    assert "flex_attention" in unsupported_reason(model)


def test_fast_true_on_an_unsupported_architecture_names_it():
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        sg.load_target(tiny_gpt2(), fast=True)


def test_fast_false_keeps_hf_and_a_bad_value_is_refused():
    model = tiny_causal_lm("llama", vocab_size=VOCAB)
    assert sg.load_target(model, fast=False).fast is None
    with pytest.raises(ValueError, match="fast="):
        sg.load_target(model, fast="yes")


def test_fast_path_generates_what_hf_generate_does():
    model = tiny_causal_lm("qwen3", vocab_size=VOCAB)
    ids = [5, 9, 13, 40, 7]
    x = torch.tensor([ids])
    want = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=30, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):].tolist()
    target = sg.load_target(model)
    assert target.fast is not None
    got = sg.SpeculativeGenerator(target, sg.PromptLookup()).generate(ids, max_new_tokens=30, eos_token_id=()).token_ids
    assert got == want


# --------------------------------------------------------------------------- StaticKVCache units


def test_static_cache_len_and_layer_kv_of_an_empty_cache():
    cache = StaticKVCache(2, 3, 4, max_len=16)
    assert len(cache) == 0
    keys, values = cache.layer_kv(1)
    assert keys.shape == (1, 3, 0, 4) and values.shape == (1, 3, 0, 4)


def test_static_cache_keep_of_a_contiguous_path_only_drops_the_rest():
    cache, raw = filled_cache(batch=1, length=8)
    cache.keep(4, torch.tensor([0, 1]))
    assert len(cache) == 6
    assert torch.equal(cache.layer_kv(0)[0], raw[0][0][:, :, :6])


def test_static_cache_keep_refuses_rows_past_the_filled_slots():
    cache, _ = filled_cache(length=8)
    with pytest.raises(ValueError, match="rows"):
        cache.keep(4, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="prefix_len"):
        cache.keep(9, torch.tensor([0]))


def test_static_cache_crop_moves_the_counter_and_new_writes_overwrite():
    cache, raw = filled_cache(batch=1, length=8)
    cache.crop(5)
    assert len(cache) == 5
    assert torch.equal(cache.layer_kv(1)[0], raw[1][0][:, :, :5])
    start = cache.extend(1, 1)
    assert start == 5
    cache.update(0, start, torch.full((1, 3, 1, 4), 7.0), torch.full((1, 3, 1, 4), 8.0))
    assert torch.equal(cache.layer_kv(0)[0][:, :, 5], torch.full((1, 3, 4), 7.0))
    cache.crop(0)
    assert len(cache) == 0 and cache.layer_kv(0)[0].shape == (1, 3, 0, 4)


@pytest.mark.parametrize("length", [-1, 9])
def test_static_cache_crop_outside_the_filled_slots_is_an_error(length):
    cache, _ = filled_cache(length=8)
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(length)


def test_static_cache_refuses_to_exceed_max_len():
    cache, _ = filled_cache(length=8, max_len=10)
    cache.extend(2, 2)  # exactly full
    with pytest.raises(ValueError, match="max_len 10"):
        cache.extend(2, 1)


def test_target_cache_overflow_past_the_context_is_a_clear_error():
    target = sg.load_target(_model("llama"), fast=True)
    cache = target.new_cache()
    too_long = torch.zeros(1, cache.max_len + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="overflow"):
        target.forward(too_long, cache, torch.zeros_like(too_long))


def test_static_cache_grows_and_keeps_its_contents():
    cache, raw = filled_cache(batch=1, length=8, max_len=2000)
    first = cache.capacity
    start = cache.extend(1, first)  # past the first allocation
    assert cache.capacity >= 8 + first
    assert torch.equal(cache.layer_kv(1)[0][:, :, :8], raw[1][0])
    assert start == 8 and len(cache) == 8 + first


def test_static_cache_refuses_another_batch_size():
    cache, _ = filled_cache(batch=2, length=4)
    with pytest.raises(ValueError, match="batch"):
        cache.extend(1, 1)


def test_the_tree_attention_check_runs_against_the_fast_path(monkeypatch):
    """load_target's mask check sees the forward that will run: a fast path that dropped masks is refused."""
    forward = FastLlama.forward

    def ignoring_masks(self, ids, cache, positions, mask=None, *args):
        return forward(self, ids, cache, positions, None, *args)

    monkeypatch.setattr(FastLlama, "forward", ignoring_masks)
    with pytest.raises(ValueError, match="ignores custom 4D attention masks"):
        sg.load_target(_model("llama"), fast=True)


# --------------------------------------------------------------------------- packed forwards: rows side by side

PACKED_RTOL = 4e-6  # float32 rounding relative to the largest value compared (see `close` below)
# (pool row, prompt length, tree parents or None for one plain token) of each segment, in packed order.
LAYOUTS = {
    "plain rows and trees": [(0, 9, None), (1, 5, TREE_PARENTS), (2, 12, None), (3, 7, [-1, 0, 1])],
    "trees of one size": [(0, 6, [-1, 0, 0, 1]), (1, 11, [-1, 0, 1, 2]), (2, 4, [-1, 0, 0, 0])],
    "rows apart, a chain": [(4, 8, None), (1, 3, [-1, 0, 1, 2, 3]), (6, 10, None)],
    "plain rows before a tree": [(0, 9, None), (1, 9, None), (2, 9, None), (3, 9, TREE_PARENTS)],
    "trees of two sizes padded together": [(0, 10, [-1, 0, 0, 1]), (1, 9, [-1, 0, 1])],
    "rows of unequal lengths": [(0, 40, None), (1, 3, None), (2, 4, None), (3, 45, None), (5, 2, [-1, 0, 0])],
    "rows out of pool order": [(3, 5, None), (1, 6, None), (2, 30, [-1, 0, 1]), (0, 7, None), (4, 8, None)],
}
# What an SDPA call costs against padding (`CALL_MACS`), so every layout runs as one call, as this machine's cost
# cuts it, and with every row that pads another in a call of its own.
CALLS = {"one call": 1 << 40, "measured": None, "free calls": 0}


@pytest.mark.parametrize("calls", list(CALLS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_rows_match_hf_run_one_by_one(pair, layout, calls, monkeypatch):
    """One packed forward over several pool rows' trees equals HF's forward of each row alone, cache and all, however
    its rows are cut into attention calls."""
    if CALLS[calls] is not None:
        monkeypatch.setitem(fast_llama.CALL_MACS, "cpu", CALLS[calls])
    segments, tokens, references = [], [], []
    pool = pair.fast.new_batched_cache(7, 64)
    for seed, (row, length, parents) in enumerate(LAYOUTS[layout]):
        parents = parents or [-1]
        prompt, tree = _ids(pair, length, seed=seed), _ids(pair, len(parents), seed=100 + seed)[0]
        _, view = pool.acquire(row)
        pair.fast.forward(prompt, view, torch.arange(length)[None])
        is_chain = parents == list(range(-1, len(parents) - 1))
        visible = None if is_chain else tree_mask(0, parents, torch.float32)[0, 0] == 0
        segments.append(sg.model.Segment(row, len(parents), visible))
        tokens.append(tree)
        hf_cache = pair.hf.new_cache()
        pair.hf.forward(prompt, hf_cache, torch.arange(length)[None])
        ref = pair.hf.forward(tree[None], hf_cache, (length + tree_depths(parents))[None],
                              tree_mask(length, parents, torch.float32), pair.layers)
        references.append((ref, hf_cache, view))
    out = pair.fast.forward_packed(torch.cat(tokens), pool, segments, pair.layers)  # positions: the rows' own

    def close(got: torch.Tensor, want: torch.Tensor) -> bool:
        # Rows share the products of a packed forward, so their sums run in another order: float32 rounding of
        # the largest value (stories260K's logits near 12 differ by 1.05e-5), not a fixed 1e-5.
        return float((got - want).abs().max()) <= max(TOL, PACKED_RTOL * float(want.abs().max()))

    offset = 0
    for segment, (ref, hf_cache, view) in zip(segments, references):
        part = slice(offset, offset + segment.size)
        assert close(out.logits[part], ref.logits[0])
        for i in pair.layers:
            assert close(out.hidden[i][part], ref.hidden[i][0]), i
        assert len(view) == len(hf_cache)
        for layer in range(pair.fast.num_layers):
            for got, want in zip(view.layer_kv(layer), hf_cache.layer_kv(layer)):
                assert close(got, want)
        offset += segment.size


def test_rows_share_an_attention_call_where_padding_costs_less_than_the_call():
    """`_spans` by hand: one-token rows after 40, 3, 4 and 45 cached slots, in pool-row order."""
    order, rows, sizes, starts = [0, 1, 2, 3], [0, 1, 2, 3], [1, 1, 1, 1], [40, 3, 4, 45]
    # Free calls: padding row 1 to row 0's 41 slots (2 x 41 = 82) costs more than its own 4: every row alone.
    assert fast_llama._spans(order, rows, sizes, starts, call=0) == [[0], [1], [2], [3]]
    # A call worth 50 slots: 82 <= 41 + 50 + 4, then 3 x 41 <= 82 + 50 + 5, then 4 x 46 <= 123 + 50 + 46.
    assert fast_llama._spans(order, rows, sizes, starts, call=50) == [[0, 1, 2, 3]]
    # The two short rows share a call; the long ones pad nothing alone.
    assert fast_llama._spans([1, 2, 0, 3], [1, 2, 0, 3], [1, 1, 1, 1], [3, 4, 40, 45], call=10) == [[1, 2], [0], [3]]


@pytest.mark.parametrize(("layout", "calls", "spans", "moved"), [
    ("rows of unequal lengths", "one call", 1, True),  # a tree in the call: the one-token rows pad to its width
    ("rows of unequal lengths", "free calls", 5, False),
    ("plain rows before a tree", "free calls", 2, False),  # the three plain rows pad nothing together
    ("rows out of pool order", "one call", 1, True),
])
def test_packed_attention_cuts_rows_into_calls(pair, layout, calls, spans, moved, monkeypatch):
    """How `PackedAttention` cuts a layout into SDPA calls, and whether a call must move its tokens into a padded grid
    (the numbers themselves are held by test_packed_rows_match_hf_run_one_by_one)."""
    monkeypatch.setitem(fast_llama.CALL_MACS, "cpu", CALLS[calls])
    pool = pair.fast.new_batched_cache(7, 64)
    segments = []
    for row, length, parents in LAYOUTS[layout]:
        pool.acquire(row)[1].extend(1, length)
        segments.append(sg.model.Segment(row, len(parents or [-1])))
    packed = fast_llama.PackedAttention(pool, segments, torch.device("cpu"),
                                         pair.fast.fast.num_heads * pair.fast.fast.head_dim)
    assert len(packed.spans) == spans
    assert any(span.fill is not None for span in packed.spans) == moved


def test_a_draft_model_beside_a_packed_target_packs_its_own_weights_and_keeps_the_greedy_output():
    if small_rows.pack(torch.zeros(2, 2)) is None:
        pytest.skip("this torch build packs no weights (no oneDNN)")
    target = sg.load_target(tiny_causal_lm("llama", vocab_size=VOCAB, seed=1), small_rows="packed")
    draft = sg.DraftModel(tiny_causal_lm("llama", vocab_size=VOCAB, seed=3), target)
    own = {id(w) for w in draft.model.model.parameters()}
    assert draft.model.fast.packed and set(draft.model.fast.packed) <= own  # its own weights, none of the target's
    assert draft.model.small_rows is target.small_rows
    prompt = [5, 17, 42, 8, 9, 60]
    plain = sg.SpeculativeGenerator(target, None).generate(prompt, max_new_tokens=24).token_ids
    drafted = sg.SpeculativeGenerator(target, draft, tree=sg.Chain(3)).generate(prompt, max_new_tokens=24).token_ids
    assert drafted == plain and len(plain) == 24


@pytest.mark.parametrize("config", ["eagle", "eagle3"])
def test_a_feature_head_beside_a_packed_target_takes_its_forms_and_keeps_the_greedy_output(config):
    """An EAGLE or EAGLE-3 head drafting for a packed target multiplies by its own packed weights where its shapes are
    the target's, takes the target's packed lm_head rather than packing it again, and the output stays the
    target's greedy output."""
    if small_rows.pack(torch.zeros(2, 2)) is None:
        pytest.skip("this torch build packs no weights (no oneDNN)")
    from specgraft.heads import Eagle3Config, EagleConfig, as_drafter, build_head

    target = sg.load_target(tiny_causal_lm("llama", vocab_size=VOCAB, seed=1, layers=4), small_rows="packed")
    head_config = EagleConfig() if config == "eagle" else Eagle3Config(draft_vocab_size=VOCAB)
    head = build_head(head_config, target).eval()
    drafter = as_drafter(head, target)
    fast, theirs = head.fast(), {id(p.packed) for p in target.fast.packed.values()}
    own = {id(w) for w in head.parameters()} | {id(b) for b in head.buffers()}
    assert fast.packed and set(fast.packed) <= own  # the head's weights ...
    lm_head = head.lm_head_weight if config == "eagle" else head.lm_head.weight
    assert id(lm_head) in fast.packed  # ... its lm_head among them
    if config == "eagle":  # the target's own lm_head, seen through a buffer: the target's packed copy, not a second
        assert id(fast.packed[id(lm_head)].packed) in theirs
    else:  # its own lm_head: its own copy; and the midlayer's o / MLP weights of the target's shapes packed too
        assert id(fast.packed[id(lm_head)].packed) not in theirs
        assert id(fast.layers[0].o) in fast.packed
    prompt = [5, 17, 42, 8, 9, 60]
    plain = sg.SpeculativeGenerator(target, None).generate(prompt, max_new_tokens=24).token_ids
    drafted = sg.SpeculativeGenerator(target, drafter, tree=sg.Chain(3)).generate(prompt, max_new_tokens=24).token_ids
    assert drafted == plain and len(plain) == 24
