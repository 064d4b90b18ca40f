"""Targets the fast path does not cover run on Hugging Face's forward, and stay exact.

Greedy identity to ``model.generate(do_sample=False)`` through the whole
engine for tiny random GPT-2, GPT-NeoX, Phi-3 and Gemma models, a Llama
with adapter-wrapped projections, and the real stories260K with
``fast=False``: plain decoding, prompt lookup on a
chain, the target drafting for itself on a branching static tree, and
head-shaped drafters with random weights (Medusa everywhere; EAGLE where
the target's config has the Llama-shaped fields its draft layer is built
from). Then `load_target`'s refusals: a family whose attention ignores the
4D tree mask, and forwards that ignore the KV cache they are handed (the
failure a renamed cache keyword causes: transformers 5.24 renamed
``past_key_values`` to ``cache``, and a forward silently drops a name it
does not know).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn
from conftest import NON_LLAMA_ARCHS, STORIES, tiny_causal_lm
from test_architectures import STATIC_TREE, VOCAB, _check, greedy_references
from test_engine_api import hf_generate
from test_greedy_identity import BRANCHING_TREE, _mismatches
from transformers import GPT2LMHeadModel, RwkvConfig, RwkvForCausalLM

import specgraft as sg
import specgraft.model.target as target_module
from specgraft.heads import EagleConfig, MedusaConfig, build_head, save_head
from specgraft.model import CACHE_KEYWORDS, cache_keyword, installed_cache_keyword

MEDUSA_HEADS = 4  # head k drafts depth k + 1, and STATIC_TREE / BRANCHING_TREE reach depth 4
EAGLE_TREE = sg.DynamicTree(top_k=4, depth=4, budget=12)
STORIES_PROMPTS = 10  # of the 40 dev prompts: the full sweep runs on the fast path in test_greedy_identity
STORIES_NEW_TOKENS = 96


def _random_head_drafter(config: MedusaConfig | EagleConfig, target: sg.Target, out_dir, seed: int) -> sg.Drafter:
    """A head of ``config``'s shape with random weights, saved and loaded back the way users load trained heads."""
    head = build_head(config, target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    save_head(head, out_dir, target)
    return sg.load_drafter(out_dir, target)


def _eagle_fits(config) -> bool:
    """EAGLE's draft layer is a Llama layer sized from the target's config: it needs intermediate_size."""
    return getattr(config, "intermediate_size", None) is not None


# -- tiny non-Llama families, and a Llama the fast path cannot read ---------------------------------


class _LowRankAdapter(nn.Module):
    """A LoRA-shaped wrapper: the frozen linear plus a random rank-2 update (what adapter libraries insert)."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def _hf_path_model(arch: str):
    """A tiny family from conftest, or "llama-adapter": a Llama whose attention projections are adapter-wrapped."""
    if arch != "llama-adapter":
        return tiny_causal_lm(arch, vocab_size=VOCAB, seed=0)
    model = tiny_causal_lm("llama", vocab_size=VOCAB, seed=0)
    torch.manual_seed(1)
    for layer in model.model.layers:
        layer.self_attn.q_proj = _LowRankAdapter(layer.self_attn.q_proj)
        layer.self_attn.v_proj = _LowRankAdapter(layer.self_attn.v_proj)
    return model.eval()


@pytest.fixture(scope="module", params=NON_LLAMA_ARCHS + ("llama-adapter",))
def family_case(request):
    """(arch, target on HF's forward, {prompt seed: (prompt ids, HF greedy continuation)})."""
    model = _hf_path_model(request.param)
    target = sg.load_target(model)
    assert target.fast is None  # "auto" leaves these on Hugging Face's forward
    refs = greedy_references(model)
    return request.param, target, refs


def test_family_plain_decoding_matches_hf_greedy(family_case):
    _, target, refs = family_case
    assert _check(sg.SpeculativeGenerator(target, None), refs) == {}


def test_family_prompt_lookup_chain_matches_hf_greedy(family_case):
    _, target, refs = family_case
    assert _check(sg.SpeculativeGenerator(target, sg.PromptLookup(), tree=sg.Chain(4)), refs) == {}


def test_family_self_draft_static_tree_matches_hf_greedy(family_case):
    _, target, refs = family_case
    gen = sg.SpeculativeGenerator(target, sg.DraftModel(target, target), tree=sg.StaticTree(STATIC_TREE))
    assert _check(gen, refs) == {}


def test_family_random_medusa_head_matches_hf_greedy(family_case, tmp_path):
    _, target, refs = family_case
    drafter = _random_head_drafter(MedusaConfig(num_heads=MEDUSA_HEADS), target, tmp_path / "medusa", seed=1)
    assert _check(sg.SpeculativeGenerator(target, drafter, tree=sg.StaticTree(STATIC_TREE)), refs) == {}


def test_family_random_eagle_head_matches_hf_greedy(family_case, tmp_path):
    arch, target, refs = family_case
    if not _eagle_fits(target.config):
        pytest.skip(f"{arch}'s config has no intermediate_size to size EAGLE's Llama draft layer; Medusa covers it")
    drafter = _random_head_drafter(EagleConfig(), target, tmp_path / "eagle", seed=2)
    assert _check(sg.SpeculativeGenerator(target, drafter, tree=EAGLE_TREE), refs) == {}


def test_eagle_runs_on_most_families():
    # The skip above must stay the exception: EAGLE covers every family here but GPT-2.
    fits = [arch for arch in NON_LLAMA_ARCHS if _eagle_fits(_hf_path_model(arch).config)]
    assert fits == [arch for arch in NON_LLAMA_ARCHS if arch != "gpt2"]


def test_an_eagle_head_for_a_config_it_cannot_size_is_refused_by_name():
    target = sg.load_target(_hf_path_model("gpt2"))
    with pytest.raises(ValueError, match="GPT2Config has no intermediate_size.*use a Medusa head"):
        build_head(EagleConfig(), target)


# -- stories260K on Hugging Face's forward ---------------------------------------------------------


@pytest.fixture(scope="module")
def stories_hf(dev_prompts):
    """(stories260K with fast=False, prompt ids, HF greedy continuations) on the first dev prompts."""
    if not STORIES.is_dir():
        pytest.skip(f"../shared assets are absent ({STORIES} not found)")
    target = sg.load_target(STORIES, fast=False)
    assert target.fast is None
    prompt_ids = [target.encode(p) for p in dev_prompts[:STORIES_PROMPTS]]
    return target, prompt_ids, [hf_generate(target, ids, STORIES_NEW_TOKENS) for ids in prompt_ids]


def _stories_sweep(target: sg.Target, drafter: sg.Drafter | None, prompt_ids, tree=None) -> list[list[int]]:
    gen = sg.SpeculativeGenerator(target, drafter, **({} if tree is None else {"tree": tree}))
    return [gen.generate(ids, max_new_tokens=STORIES_NEW_TOKENS).token_ids for ids in prompt_ids]


def test_stories_hf_forward_plain_decoding_matches_hf_greedy(stories_hf):
    target, prompt_ids, refs = stories_hf
    assert _mismatches(_stories_sweep(target, None, prompt_ids), refs) == []


def test_stories_hf_forward_prompt_lookup_chain_matches_hf_greedy(stories_hf):
    target, prompt_ids, refs = stories_hf
    assert _mismatches(_stories_sweep(target, sg.PromptLookup(), prompt_ids, sg.Chain(4)), refs) == []


def test_stories_hf_forward_self_draft_static_tree_matches_hf_greedy(stories_hf):
    target, prompt_ids, refs = stories_hf
    outputs = _stories_sweep(target, sg.DraftModel(target, target), prompt_ids, sg.StaticTree(BRANCHING_TREE))
    assert _mismatches(outputs, refs) == []


def test_stories_hf_forward_random_medusa_head_matches_hf_greedy(stories_hf, tmp_path):
    target, prompt_ids, refs = stories_hf
    drafter = _random_head_drafter(MedusaConfig(num_heads=MEDUSA_HEADS), target, tmp_path / "medusa", seed=3)
    assert _mismatches(_stories_sweep(target, drafter, prompt_ids, sg.StaticTree(BRANCHING_TREE)), refs) == []


def test_stories_hf_forward_random_eagle_head_matches_hf_greedy(stories_hf, tmp_path):
    target, prompt_ids, refs = stories_hf
    drafter = _random_head_drafter(EagleConfig(), target, tmp_path / "eagle", seed=4)
    assert _mismatches(_stories_sweep(target, drafter, prompt_ids, EAGLE_TREE), refs) == []


# -- the cache keyword ----------------------------------------------------------------------------


class _TakesCache:
    def forward(self, input_ids, cache=None): ...


class _TakesPastKeyValues:
    def forward(self, input_ids, past_key_values=None): ...


class _PassesKwargsOn:
    def forward(self, *args, **kwargs): ...


class _TakesNoCache:
    def forward(self, input_ids, attention_mask=None): ...


def test_cache_keyword_is_read_from_the_forward_signature():
    assert cache_keyword(_TakesCache) == "cache"
    assert cache_keyword(_TakesPastKeyValues) == "past_key_values"


def test_a_forward_that_passes_kwargs_on_gets_the_installed_transformers_keyword():
    assert cache_keyword(_PassesKwargsOn) == installed_cache_keyword() in CACHE_KEYWORDS


def test_a_forward_that_cannot_take_a_cache_is_refused_by_name():
    with pytest.raises(TypeError, match="_TakesNoCache.forward takes no KV cache keyword"):
        cache_keyword(_TakesNoCache)


def test_hf_models_get_the_keyword_their_forward_names():
    target = sg.load_target(tiny_causal_lm("gpt2", vocab_size=VOCAB))
    assert target.cache_keyword == installed_cache_keyword()


# -- what load_target refuses ---------------------------------------------------------------------


def test_a_family_whose_attention_ignores_4d_masks_is_refused_at_load():
    # RWKV is recurrent: its forward takes attention_mask and ignores it, so a tree's siblings would see each other.
    torch.manual_seed(0)
    config = RwkvConfig(
        vocab_size=VOCAB, hidden_size=32, attention_hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        context_length=256, attn_implementation="eager",
    )
    with pytest.raises(ValueError, match=r"RwkvForCausalLM\) ignores custom 4D attention masks"):
        sg.load_target(RwkvForCausalLM(config).eval())


class _CachelessGPT2(GPT2LMHeadModel):
    """GPT-2 that drops the cache it is handed and runs without one (what a renamed keyword does)."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        for name in CACHE_KEYWORDS:
            kwargs.pop(name, None)
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)


class _WriteOnlyCacheGPT2(GPT2LMHeadModel):
    """GPT-2 that appends new keys and values to the cache it is handed but never attends to what it held."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        given = kwargs.pop(installed_cache_keyword())
        fresh = transformers.DynamicCache()
        kwargs[installed_cache_keyword()] = fresh
        if attention_mask is not None:  # the tree mask's columns for the cached prefix have no keys here
            attention_mask = attention_mask[..., -input_ids.shape[1]:]
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        for i, layer in enumerate(fresh.layers):
            given.update(layer.keys, layer.values, i)
        return out


class _MaskDroppingGPT2(GPT2LMHeadModel):
    """GPT-2 that honours a 4D mask on a fresh cache but falls back to causal attention once the cache holds tokens."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        if kwargs[installed_cache_keyword()].get_seq_length() > 0:
            attention_mask = None
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)


def _tiny_gpt2_as(model_cls: type[GPT2LMHeadModel]) -> GPT2LMHeadModel:
    reference = tiny_causal_lm("gpt2", vocab_size=VOCAB)
    model = model_cls(reference.config)
    model.load_state_dict(reference.state_dict())
    return model.eval()


def test_a_model_that_ignores_its_cache_is_refused_at_load_naming_the_transformers_version():
    message = rf"under transformers {transformers.__version__}.*left 0 positions in the KV cache"
    with pytest.raises(ValueError, match=message):
        sg.load_target(_tiny_gpt2_as(_CachelessGPT2))


def test_a_cache_passed_under_a_keyword_the_forward_swallows_is_refused_at_load(monkeypatch):
    # The drift itself: a name the forward does not know lands in **kwargs and the model runs cacheless.
    monkeypatch.setattr(target_module, "cache_keyword", lambda module_class: "kv_cache")
    message = rf"under transformers {transformers.__version__}, cache passed as kv_cache="
    with pytest.raises(ValueError, match=message):
        sg.load_target(tiny_causal_lm("gpt2", vocab_size=VOCAB))


def test_a_model_that_writes_its_cache_but_never_reads_it_is_refused_at_load():
    message = rf"transformers {transformers.__version__}.*through the KV cache differs.*does not attend to what its"
    with pytest.raises(ValueError, match=message):
        sg.load_target(_tiny_gpt2_as(_WriteOnlyCacheGPT2))


def test_a_model_that_drops_the_tree_mask_once_cached_is_refused_at_load():
    with pytest.raises(ValueError, match="ignores the 4D mask once a KV cache is in play"):
        sg.load_target(_tiny_gpt2_as(_MaskDroppingGPT2))


def test_the_subclassed_gpt2_used_above_loads_when_it_does_not_misbehave():
    # The refusals above come from the misbehaviour, not from subclassing or weight copying.
    class PlainGPT2(GPT2LMHeadModel):
        pass

    assert sg.load_target(_tiny_gpt2_as(PlainGPT2)).fast is None
