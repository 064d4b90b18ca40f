"""Head export (vLLM, SGLang, official EAGLE, Medusa, DFlash) and import: exact names, validation, round trips, official layouts."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import specgraft as sg
from specgraft.heads import build_head, export_head, import_head, load_drafter, save_head, validate_export
from specgraft.heads.configs import DFlashConfig, Eagle3Config, EagleConfig, MedusaConfig
from specgraft.heads.eagle3 import default_aux_layers
from specgraft.cli import main
from specgraft.tree import TreeBuilder
from conftest import tiny_causal_lm

RUNS = Path(__file__).resolve().parents[1] / "runs"
MIDLAYER_NAMES = {
    f"midlayer.{n}.weight"
    for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj", "input_layernorm", "hidden_norm", "post_attention_layernorm")
}


@pytest.fixture(scope="module")
def tiny():
    """8 layers: EAGLE-3's default taps 2, 4, 5 are distinct (fewer layers repeat one)."""
    return sg.load_target(tiny_causal_lm("llama", vocab_size=97, seed=3, layers=8))


def perturbed_head(config, target, seed=0):
    """A fresh head with every weight moved off its initialisation; EAGLE-3 also gets a sparse draft vocabulary."""
    head = build_head(config, target).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        if isinstance(config, Eagle3Config) and config.draft_vocab_size:
            head.set_draft_vocab(torch.rand(target.vocab_size, generator=gen), target)
            head.lm_head.weight.add_(torch.randn(head.lm_head.weight.shape, generator=gen) * 0.05)
    return head


def saved(config, target, path, seed=0) -> Path:
    return save_head(perturbed_head(config, target, seed), path, target)


class RecordChain:
    """A greedy chain that records the draft distribution at every depth."""

    max_depth = 16  # a TreePolicy's depth; `draft` asks for fewer

    def __init__(self):
        self.logps = []

    def grow(self, step, root_token, max_depth=None, device="cpu", sampling=None):
        builder = TreeBuilder(root_token, device)
        last = torch.zeros(1, dtype=torch.long)
        for _ in range(max_depth):
            logp = step(builder.tree(), last)[0]
            self.logps.append(logp)
            token = logp.argmax()
            last = builder.add(token[None], last, builder.tree().scores[last] + logp[token])
        return builder.tree()


def draft(drafter, target, prompt, depth=4):
    """(drafted tokens, (depth, V) draft log-probs) after prefilling ``prompt``."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
    state = drafter.start(ids[0], {i: out.hidden_states[i][0] for i in drafter.hidden_layers})
    recorder = RecordChain()
    tree = state.propose(int(out.logits[0, -1].argmax()), recorder, depth)
    return tree.tokens.tolist(), torch.stack(recorder.logps)


def assert_same_drafts(dir_a, dir_b, target, prompts=([1, 4, 8, 15, 16], [1, 30, 2, 7]), tol=1e-6):
    a, b = load_drafter(dir_a, target), load_drafter(dir_b, target)
    for prompt in prompts:
        tokens_a, logp_a = draft(a, target, prompt)
        tokens_b, logp_b = draft(b, target, prompt)
        assert tokens_a == tokens_b
        # 1e-6, relative as well: unsorted EAGLE-3 taps reorder fc's input blocks, so its sums round differently.
        torch.testing.assert_close(logp_a, logp_b, atol=tol, rtol=tol)
    runs = [sg.SpeculativeGenerator(target, d, tree=sg.Chain(4)).generate(prompts[0], max_new_tokens=24, eos_token_id=())
            for d in (a, b)]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].stats.accept_length_histogram == runs[1].stats.accept_length_histogram


# -- exact names and config fields ---------------------------------------------------------------

EAGLE3 = Eagle3Config(draft_vocab_size=40)


def test_eagle3_vllm_names_and_fields(tiny, tmp_path):
    out = export_head(saved(EAGLE3, tiny, tmp_path / "h"), "vllm", tmp_path / "x", tiny)
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "README.md"}
    assert set(load_file(out / "model.safetensors")) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | MIDLAYER_NAMES
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 40 and cfg["vocab_size"] == 97 and cfg["tie_word_embeddings"] is False
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # HF indices, as vLLM reads them
    assert "eagle_config" not in cfg and cfg["norm_before_residual"] is False
    assert (cfg["head_dim"], cfg["num_key_value_heads"], cfg["rope_theta"]) == (8, 2, 10000.0)
    tensors = load_file(out / "model.safetensors")
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert "--speculative-config '{\"method\": \"eagle3\"" in (out / "README.md").read_text()


def test_eagle3_sglang_names_layer_outputs(tiny, tmp_path):
    out = export_head(saved(EAGLE3, tiny, tmp_path / "h"), "sglang", tmp_path / "x", tiny)
    assert set(load_file(out / "model.safetensors")) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | MIDLAYER_NAMES
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    assert "eagle_aux_hidden_state_layer_ids" not in cfg  # vLLM would read a top-level field as HF indices
    assert "--speculative-algorithm EAGLE3 --speculative-draft-model-path" in (out / "README.md").read_text()


def test_eagle3_full_vocabulary_exports_no_vocab_maps_for_engines(tiny, tmp_path):
    head_dir = saved(Eagle3Config(), tiny, tmp_path / "h")
    for fmt in ("vllm", "sglang"):  # vLLM 0.33 has no draft_id_to_target_id then and rejects a d2t
        out = export_head(head_dir, fmt, tmp_path / fmt, tiny)
        assert set(load_file(out / "model.safetensors")) == {"fc.weight", "norm.weight", "lm_head.weight"} | MIDLAYER_NAMES
    out = export_head(head_dir, "eagle", tmp_path / "eagle", tiny)
    assert {"d2t", "t2d"} <= set(load_file(out / "model.safetensors"))  # the official trainer always saves them


def test_eagle3_official_layout(tiny, tmp_path):
    out = export_head(saved(EAGLE3, tiny, tmp_path / "h"), "eagle", tmp_path / "x", tiny)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 40
    assert "eagle_aux_hidden_state_layer_ids" not in cfg and "eagle_config" not in cfg  # official taps are fixed


def eagle1_names(layers, bias):
    names = {"fc.weight"} | ({"fc.bias"} if bias else set())
    for i in range(layers):
        names |= {f"layers.{i}.{n}.weight" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                    "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                    "mlp.down_proj", "post_attention_layernorm")}
        names |= {f"layers.{i}.input_layernorm.weight"} if i else set()  # EAGLE's layer 0 has no input norm
    return names


@pytest.mark.parametrize("fmt, arch, bias", [
    ("vllm", "LlamaForCausalLM", False), ("sglang", "LlamaForCausalLMEagle", True), ("eagle", "LlamaForCausalLM", False),
])
def test_eagle1_names_and_fields(tiny, tmp_path, fmt, arch, bias):
    out = export_head(saved(EagleConfig(num_layers=2, fc_bias=False), tiny, tmp_path / "h"), fmt, tmp_path / "x", tiny)
    tensors = load_file(out / "model.safetensors")
    assert set(tensors) == eagle1_names(2, bias)
    if bias:  # SGLang's fc always has a bias: a head without one exports a zero bias
        assert not tensors["fc.bias"].any()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [arch] and cfg["num_hidden_layers"] == 2 and cfg["vocab_size"] == 97
    assert cfg.get("bias", False) is False and ("bias" in cfg) == (fmt == "eagle")


def test_eagle1_official_layout_keeps_the_fc_bias(tiny, tmp_path):
    out = export_head(saved(EagleConfig(fc_bias=True), tiny, tmp_path / "h"), "eagle", tmp_path / "x", tiny)
    assert set(load_file(out / "model.safetensors")) == eagle1_names(1, bias=True)
    assert json.loads((out / "config.json").read_text())["bias"] is True


def test_medusa_vllm_names_and_fields(tiny, tmp_path):
    out = export_head(saved(MedusaConfig(num_heads=3, num_layers=2), tiny, tmp_path / "h"), "vllm", tmp_path / "x")
    assert set(load_file(out / "model.safetensors")) == {
        f"blocks.{h}.layers.{l}.{p}" for h in range(3) for l in range(2) for p in ("weight", "bias")
    } | {f"lm_heads.{h}.weight" for h in range(3)}
    cfg = json.loads((out / "config.json").read_text())
    assert {k: cfg[k] for k in ("model_type", "architectures", "hidden_size", "vocab_size", "num_heads",
                                "num_hidden_layers", "medusa_fc_bias")} == {
        "model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": 32, "vocab_size": 97,
        "num_heads": 3, "num_hidden_layers": 2, "medusa_fc_bias": True}
    assert '"method": "medusa"' in (out / "README.md").read_text() and '"num_speculative_tokens": 3' in (out / "README.md").read_text()


def test_medusa_repository_names_and_fields(tiny, tmp_path):
    out = export_head(saved(MedusaConfig(num_heads=2), tiny, tmp_path / "h"), "medusa", tmp_path / "x")
    assert {p.name for p in out.iterdir()} == {"config.json", "medusa_lm_head.safetensors", "README.md"}
    assert set(load_file(out / "medusa_lm_head.safetensors")) == {
        "0.0.linear.weight", "0.0.linear.bias", "0.1.weight", "1.0.linear.weight", "1.0.linear.bias", "1.1.weight"}
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["medusa_num_heads"], cfg["medusa_num_layers"], cfg["base_model_name_or_path"]) == (2, 1, tiny.name)
    assert (cfg["hidden_size"], cfg["vocab_size"], cfg["medusa_fc_bias"]) == (32, 97, True)  # for vLLM <= 0.32


# -- the validator refuses tampered directories --------------------------------------------------

# The tiny target has no tokenizer, so DFlash heads name their mask id (an id it never generates: 96 of 97).
DFLASH = DFlashConfig(num_layers=2, block_size=4, target_layer_ids=[5, 1], mask_token_id=96)

CASES = [("eagle3", EAGLE3, "vllm"), ("eagle3", EAGLE3, "sglang"), ("eagle3", EAGLE3, "eagle"),
         ("eagle", EagleConfig(fc_bias=False), "vllm"), ("eagle", EagleConfig(fc_bias=True), "sglang"), ("eagle", EagleConfig(fc_bias=True), "eagle"),
         ("medusa", MedusaConfig(num_heads=2), "vllm"), ("medusa", MedusaConfig(num_heads=2), "medusa"),
         ("dflash", DFLASH, "vllm"), ("dflash", DFLASH, "sglang")]


def rewrite_weights(out: Path, edit) -> None:
    name = next(p for p in out.iterdir() if p.suffix == ".safetensors")
    tensors = load_file(name)
    edit(tensors)
    save_file(tensors, name)


@pytest.mark.parametrize("head_type, config, fmt", CASES, ids=[f"{t}-{f}" for t, _, f in CASES])
def test_validator_refuses_a_missing_or_renamed_key(tiny, tmp_path, head_type, config, fmt):
    out = export_head(saved(config, tiny, tmp_path / "h"), fmt, tmp_path / "x", tiny)
    validate_export(out, fmt)  # as written
    first, second = sorted(load_file(next(p for p in out.iterdir() if p.suffix == ".safetensors")))[:2]
    rewrite_weights(out, lambda t: t.pop(first))
    with pytest.raises(ValueError, match=f"missing tensors \\['{first}'\\]"):
        validate_export(out, fmt)
    renamed = second.replace("weight", "wieght") if "weight" in second else second + "_renamed"
    rewrite_weights(out, lambda t: t.__setitem__(renamed, t.pop(second)))
    with pytest.raises(ValueError, match=f"stray tensors \\['{renamed}'\\]"):
        validate_export(out, fmt)


def test_validator_refuses_wrong_shapes_fields_and_files(tiny, tmp_path):
    out = export_head(saved(EAGLE3, tiny, tmp_path / "h"), "vllm", tmp_path / "x", tiny)
    config_file = out / "config.json"
    cfg = json.loads(config_file.read_text())
    rewrite_weights(out, lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"][:30]))
    with pytest.raises(ValueError, match=r"lm_head.weight has shape \(30, 32\), the config implies \(40, 32\)"):
        validate_export(out, "vllm")
    moved = dict(cfg, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4]})
    del moved["eagle_aux_hidden_state_layer_ids"]
    config_file.write_text(json.dumps(moved))
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids is None"):
        validate_export(out, "vllm")
    config_file.write_text(json.dumps(dict(cfg, num_hidden_layers=2)))
    with pytest.raises(ValueError, match="'num_hidden_layers' is 2, expected 1"):
        validate_export(out, "vllm")
    config_file.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="eagle_config.eagle_aux_hidden_state_layer_ids is None"):
        validate_export(out, "sglang")  # a vLLM export is not an SGLang one
    config_file.write_text(json.dumps(dict(cfg, eagle_aux_hidden_state_layer_ids=[4, 2, 5])))
    with pytest.raises(ValueError, match="distinct and ascending"):
        validate_export(out, "vllm")
    config_file.write_text(json.dumps(cfg))
    (out / "extra.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="stray weight files"):
        validate_export(out, "vllm")


def test_validator_refuses_a_medusa_config_vllm_would_misread(tiny, tmp_path):
    out = export_head(saved(MedusaConfig(num_heads=2), tiny, tmp_path / "h"), "vllm", tmp_path / "x")
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(cfg, medusa_fc_bias=False, num_attention_heads=4)))
    with pytest.raises(ValueError, match=r"medusa_fc_bias(.|\n)*\['num_attention_heads'\]"):
        validate_export(out, "vllm")


# -- exports that cannot be served are refused -----------------------------------------------------


def test_refused_exports_name_the_reason(tiny, tmp_path):
    medusa = saved(MedusaConfig(), tiny, tmp_path / "medusa")
    with pytest.raises(ValueError, match="SGLang has no Medusa drafter"):
        export_head(medusa, "sglang", tmp_path / "a")
    with pytest.raises(ValueError, match="cannot be exported --to eagle"):
        export_head(medusa, "eagle", tmp_path / "a")
    with pytest.raises(ValueError, match="builds fc without a bias"):
        export_head(saved(EagleConfig(fc_bias=True), tiny, tmp_path / "biased"), "vllm", tmp_path / "a", tiny)
    with pytest.raises(ValueError, match=r"official EAGLE code always taps \(2, 4, 5\)"):
        export_head(saved(Eagle3Config(aux_layers=[1, 3, 6]), tiny, tmp_path / "taps"), "eagle", tmp_path / "a", tiny)
    with pytest.raises(ValueError, match="repeat a layer"):
        export_head(saved(Eagle3Config(aux_layers=[2, 2, 5]), tiny, tmp_path / "dup"), "vllm", tmp_path / "a", tiny)
    with pytest.raises(ValueError, match=r"must lie in \[1, 7\]"):
        export_head(saved(Eagle3Config(aux_layers=[0, 3, 5]), tiny, tmp_path / "emb"), "sglang", tmp_path / "a", tiny)
    with pytest.raises(ValueError, match="shares one ResBlock"):
        export_head(saved(MedusaConfig(num_layers=2), tiny, tmp_path / "deep"), "medusa", tmp_path / "a")
    dflash = saved(DFLASH, tiny, tmp_path / "dflash")
    for fmt in ("eagle", "medusa"):
        with pytest.raises(ValueError, match=f"dflash heads cannot be exported --to {fmt} .*no block drafter"):
            export_head(dflash, fmt, tmp_path / "a", tiny)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ValueError, match="not empty"):
        export_head(medusa, "vllm", tmp_path / "full")
    assert not (tmp_path / "a").exists()  # a refused export leaves nothing behind
    other = sg.load_target(tiny_causal_lm("llama", vocab_size=97, seed=4, layers=8))
    with pytest.raises(ValueError, match="embedding_fingerprint"):
        export_head(saved(EAGLE3, tiny, tmp_path / "e3"), "vllm", tmp_path / "b", other)


# -- round trips: export, import, identical drafts -----------------------------------------------------

ROUND_TRIPS = [
    (EAGLE3, "vllm"), (EAGLE3, "sglang"), (EAGLE3, "eagle"),
    (Eagle3Config(aux_layers=[5, 1, 3]), "vllm"),  # unsorted taps: fc's input blocks are reordered
    (Eagle3Config(aux_layers=[6, 2, 3], draft_vocab_size=50), "sglang"),
    (EagleConfig(fc_bias=False), "vllm"), (EagleConfig(num_layers=2, fc_bias=True), "sglang"), (EagleConfig(), "eagle"),
    (MedusaConfig(num_heads=3, num_layers=2), "vllm"), (MedusaConfig(num_heads=3), "medusa"),
]


@pytest.mark.parametrize("config, fmt", ROUND_TRIPS, ids=[f"{c.type}-{f}-{i}" for i, (c, f) in enumerate(ROUND_TRIPS)])
def test_round_trip_keeps_drafts_identical(tiny, tmp_path, config, fmt):
    head_dir = saved(config, tiny, tmp_path / "h", seed=7)
    out = export_head(head_dir, fmt, tmp_path / fmt, tiny)
    back = import_head(out, config.type, tmp_path / "back", tiny)  # every layout of a head type imports as that type
    assert_same_drafts(head_dir, back, tiny)
    before, after = load_file(head_dir / "model.safetensors"), load_file(back / "model.safetensors")
    taps = getattr(config, "aux_layers", None)
    reordered = taps is not None and taps != sorted(taps)
    assert set(before) == set(after)
    assert reordered or all(torch.equal(before[k], after[k]) for k in before)  # otherwise bit for bit


STORIES_TRIPS = [(Eagle3Config(aux_layers=[1, 2, 3], draft_vocab_size=200), "vllm"),
                 (Eagle3Config(aux_layers=[1, 2, 4]), "sglang"),
                 (EagleConfig(fc_bias=False), "vllm"), (EagleConfig(fc_bias=True), "eagle"),
                 (MedusaConfig(num_heads=3), "vllm"), (MedusaConfig(num_heads=2), "medusa"),
                 (DFlashConfig(block_size=4, target_layer_ids=[3, 0], mask_token_id=0), "sglang")]


@pytest.mark.parametrize("config, fmt", STORIES_TRIPS, ids=[f"{c.type}-{f}" for c, f in STORIES_TRIPS])
def test_round_trip_on_stories260k(stories, tmp_path, config, fmt):
    head_dir = saved(config, stories, tmp_path / "h", seed=3)
    out = export_head(head_dir, fmt, tmp_path / fmt, stories)
    assert_same_drafts(head_dir, import_head(out, config.type, tmp_path / "back", stories), stories,
                       prompts=([1, 403, 407, 261], [1, 40, 9]))


def test_stories260k_default_eagle3_taps_repeat_a_layer(stories, tmp_path):
    head_dir = saved(Eagle3Config(), stories, tmp_path / "h")  # 5 layers: 2, 5 // 2, 5 - 3 = 2, 2, 2
    for fmt in ("vllm", "sglang", "eagle"):
        with pytest.raises(ValueError, match="repeat a layer"):
            export_head(head_dir, fmt, tmp_path / fmt, stories)


def test_export_reads_the_target_config_from_a_path(stories, tmp_path):
    """Exporting needs only the target's config: a path, or none (the head names its target)."""
    head_dir = saved(Eagle3Config(aux_layers=[1, 2, 4]), stories, tmp_path / "h")
    configs = []
    for i, target in enumerate((stories, str(stories.name), None)):
        out = export_head(head_dir, "sglang", tmp_path / f"x{i}", target)
        configs.append(json.loads((out / "config.json").read_text()))
    assert configs[0] == configs[1] == configs[2]
    assert (configs[0]["intermediate_size"], configs[0]["head_dim"], configs[0]["rms_norm_eps"]) == (172, 8, 1e-5)


def trained_heads():
    heads = sorted(p.parent for p in RUNS.glob("*/head/config.json"))
    return heads or [pytest.param(None, marks=pytest.mark.skip(reason=f"no trained heads under {RUNS}/*/head yet"))]


@pytest.mark.parametrize("head_dir", trained_heads(), ids=lambda p: p.parent.name if p else "none")
def test_trained_heads_round_trip(head_dir, tmp_path):
    cfg = json.loads((head_dir / "config.json").read_text())
    if "head" not in cfg:
        pytest.skip(f"{head_dir} is not a specgraft head directory (a distilled draft model is not exported)")
    name = cfg["target"]["name"]
    if not Path(name).is_dir():
        pytest.skip(f"{head_dir} drafts for {name!r}, which is not on this machine")
    target = sg.load_target(name)
    head_type, n = cfg["head"]["type"], cfg["target"]["num_hidden_layers"]
    formats = {"medusa": ("vllm", "medusa"), "eagle": ("sglang", "eagle"), "eagle3": ("vllm", "sglang"),
               "dflash": ("vllm", "sglang")}[head_type]
    taps = cfg["head"].get("aux_layers") or list(default_aux_layers(n))
    if head_type == "eagle3" and (len(set(taps)) != 3 or not 1 <= min(taps) <= max(taps) <= n - 1):
        with pytest.raises(ValueError, match="repeat a layer|must lie in"):
            export_head(head_dir, "vllm", tmp_path / "vllm", target)
        pytest.skip(f"{head_dir} taps HF layers {taps} of {n}: engines capture neither repeats nor index 0 or {n}")
    for fmt in formats:
        out = export_head(head_dir, fmt, tmp_path / fmt, target)
        assert_same_drafts(head_dir, import_head(out, head_type, tmp_path / f"back-{fmt}", target), target)


# -- official checkpoints -------------------------------------------------------------------------


def official_eagle3(target, path: Path, draft_vocab=40, seed=0, pickled=True) -> Path:
    """An EAGLE-3 checkpoint in the official layout, built from the documented names with random weights."""
    gen = torch.Generator().manual_seed(seed)
    h, v, inter, hd = 32, target.vocab_size, 64, 8

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.1

    ids = torch.randperm(v, generator=gen)[:draft_vocab].sort().values
    state = {
        "fc.weight": rand(h, 3 * h),
        "midlayer.self_attn.q_proj.weight": rand(4 * hd, 2 * h), "midlayer.self_attn.k_proj.weight": rand(2 * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(2 * hd, 2 * h), "midlayer.self_attn.o_proj.weight": rand(h, 4 * hd),
        "midlayer.mlp.gate_proj.weight": rand(inter, h), "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
        "midlayer.hidden_norm.weight": 1 + rand(h), "midlayer.input_layernorm.weight": 1 + rand(h),
        "midlayer.post_attention_layernorm.weight": 1 + rand(h), "norm.weight": 1 + rand(h),
        "lm_head.weight": rand(draft_vocab, h) * 20,  # sharp enough that greedy drafts are not ties
        "d2t": ids - torch.arange(draft_vocab), "t2d": torch.zeros(v, dtype=torch.bool).index_fill(0, ids, True),
    }
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu", "hidden_size": h,
        "intermediate_size": inter, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "float16",
        "vocab_size": v, "draft_vocab_size": draft_vocab,
    }))
    if pickled:
        torch.save({k: t.half() if t.is_floating_point() else t for k, t in state.items()}, path / "pytorch_model.bin")
    else:
        save_file(state, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("pickled", [True, False], ids=["pytorch_model.bin", "model.safetensors"])
def test_official_eagle3_checkpoint_drafts_losslessly(tiny, tmp_path, pickled):
    src = official_eagle3(tiny, tmp_path / "official", pickled=pickled)
    head_dir = import_head(src, "eagle3", tmp_path / "head", tiny)
    drafter = load_drafter(head_dir, tiny)
    assert drafter.hidden_layers == (2, 4, 5)  # no ids in the official config: EAGLE-3's default taps
    prompt = [1, 4, 8, 15, 16]
    ref = tiny.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40, eos_token_id=None)[0, 5:].tolist()
    for tree in (sg.Chain(4), sg.StaticTree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])):
        out = sg.SpeculativeGenerator(tiny, drafter, tree=tree).generate(prompt, max_new_tokens=40, eos_token_id=())
        assert out.token_ids == ref
    head = load_drafter(head_dir, tiny).head
    official = load_file(src / "model.safetensors") if not pickled else torch.load(src / "pytorch_model.bin", weights_only=True)
    assert torch.equal(head.d2t.cpu(), official["d2t"]) and torch.equal(head.t2d.cpu(), official["t2d"])
    # And out again: the vLLM export carries the same tensors under the same names.
    exported = load_file(export_head(head_dir, "vllm", tmp_path / "vllm", tiny) / "model.safetensors")
    assert set(exported) == set(official)


def test_engine_tap_conventions_import_to_the_same_layers(tiny, tmp_path):
    src = official_eagle3(tiny, tmp_path / "src", pickled=False)
    cfg = json.loads((src / "config.json").read_text())
    for name, extra, taps in [("vllm", {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}, (1, 3, 6)),
                              ("sglang", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 5]}}, (1, 3, 6)),
                              ("both", {"eagle_aux_hidden_state_layer_ids": [1, 3, 6],
                                        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 5]}}, (1, 3, 6))]:
        (src / "config.json").write_text(json.dumps(cfg | extra))
        assert load_drafter(import_head(src, "eagle3", tmp_path / name, tiny), tiny).hidden_layers == taps
    (src / "config.json").write_text(json.dumps(cfg | {"eagle_aux_hidden_state_layer_ids": [1, 3, 6],
                                                       "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}}))
    with pytest.raises(ValueError, match="disagree"):
        import_head(src, "eagle3", tmp_path / "bad", tiny)


def test_official_eagle1_checkpoint_with_embedding_and_inv_freq(tiny, tmp_path):
    head = perturbed_head(EagleConfig(fc_bias=True), tiny)
    state = dict(head.state_dict())
    state["embed_tokens.weight"] = tiny.model.get_input_embeddings().weight.detach().clone()
    state["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # old transformers saved it; not learned
    src = tmp_path / "official"
    src.mkdir()
    torch.save(state, src / "pytorch_model.bin")
    (src / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 32,
                                                 "num_hidden_layers": 1, "bias": True, "vocab_size": 97}))
    back = import_head(src, "eagle", tmp_path / "back", tiny)
    assert_same_drafts(save_head(head, tmp_path / "orig", tiny), back, tiny)
    state["embed_tokens.weight"] = torch.randn(97, 32)
    torch.save(state, src / "pytorch_model.bin")
    with pytest.raises(ValueError, match="embed_tokens.weight .* is not target"):
        import_head(src, "eagle", tmp_path / "other", tiny)


class NotATensor:
    """Pickled by reference: loading it would run this module's code."""


def test_pickles_that_need_code_execution_are_refused(tiny, tmp_path):
    src = official_eagle3(tiny, tmp_path / "src")
    state = torch.load(src / "pytorch_model.bin", weights_only=True)
    torch.save(state | {"payload": NotATensor()}, src / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model.bin: refusing to load a pickle that needs code execution"):
        import_head(src, "eagle3", tmp_path / "head", tiny)
    assert not (tmp_path / "head").exists()


def test_imports_name_what_does_not_fit(tiny, tmp_path):
    src = official_eagle3(tiny, tmp_path / "src", pickled=False)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(cfg | {"norm_before_residual": True}))
    with pytest.raises(ValueError, match="norm_before_residual"):
        import_head(src, "eagle3", tmp_path / "a", tiny)
    (src / "config.json").write_text(json.dumps(cfg | {"intermediate_size": 128}))
    with pytest.raises(ValueError, match="intermediate_size: checkpoint has 128, the target implies 64"):
        import_head(src, "eagle3", tmp_path / "a", tiny)
    (src / "config.json").write_text(json.dumps(cfg))
    state = load_file(src / "model.safetensors")
    state["midlayer.hiden_norm.weight"] = state.pop("midlayer.hidden_norm.weight")
    save_file(state, str(src / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['midlayer.hidden_norm.weight'\], unexpected \['midlayer.hiden_norm.weight'\]"):
        import_head(src, "eagle3", tmp_path / "a", tiny)
    wider = sg.load_target(tiny_causal_lm("llama", vocab_size=101, seed=3, layers=8))
    out = export_head(saved(MedusaConfig(), tiny, tmp_path / "m"), "vllm", tmp_path / "mv")
    with pytest.raises(ValueError, match="vocab_size: head expects 97, target has 101"):
        import_head(out, "medusa", tmp_path / "a", wider)


# -- DFlash ----------------------------------------------------------------------------------------

DFLASH_LAYER = {f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")} | {
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"}
DFLASH_PROMPTS = ([1, 4, 8, 15, 16], [1, 30, 2, 7], [5, 9, 9, 40, 3, 12])


def dflash_names(layers: int) -> set[str]:
    """The official checkpoint's names: no "model." prefix, no embedding, no lm_head."""
    return {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{n}.weight" for i in range(layers) for n in DFLASH_LAYER}


@pytest.fixture(scope="module")
def fitted_dflash(tiny, tmp_path_factory) -> Path:
    """DFLASH fitted for a second to the tiny target's greedy text: on DFLASH_PROMPTS it drafts some blocks the
    target accepts and some it rejects (a random head, even at std 0.3, has every draft rejected)."""
    from toy_train import fit, greedy_examples

    torch.manual_seed(0)
    head = fit(build_head(replace(DFLASH, num_anchors=16), tiny), tiny, greedy_examples(tiny, 8, 40), steps=100, lr=1e-2)
    return save_head(head, tmp_path_factory.mktemp("dflash") / "head", tiny)


def assert_same_generations(dir_a: Path, dir_b: Path, target) -> list[int]:
    """Greedy generations of every prompt: the same tokens, accepted in the same steps. Returns the histogram."""
    a, b = load_drafter(dir_a, target), load_drafter(dir_b, target)
    total = [0] * 4  # Chain(3): a step commits 1 to 4 tokens
    for prompt in DFLASH_PROMPTS:
        runs = [sg.SpeculativeGenerator(target, d, tree=sg.Chain(3)).generate(prompt, max_new_tokens=24, eos_token_id=())
                for d in (a, b)]
        assert runs[0].token_ids == runs[1].token_ids
        histogram = runs[0].stats.accept_length_histogram
        assert histogram == runs[1].stats.accept_length_histogram
        for length, steps in enumerate(histogram):
            total[length] += steps
    return total


def test_dflash_engine_names_and_fields(tiny, tmp_path):
    head_dir = saved(DFLASH, tiny, tmp_path / "h")
    outs = {fmt: export_head(head_dir, fmt, tmp_path / fmt, tiny) for fmt in ("vllm", "sglang")}
    for fmt, out in outs.items():
        validate_export(out, fmt)
        assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "README.md"}
        assert set(load_file(out / "model.safetensors")) == dflash_names(2)
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
        assert cfg["dflash_config"] == {"mask_token_id": 96, "target_layer_ids": [1, 5], "block_size": 4}  # ascending
        assert (cfg["block_size"], cfg["num_target_layers"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (4, 8, 2, 97)
        assert cfg["layer_types"] == ["full_attention"] * 2 and cfg["tie_word_embeddings"] is False
        assert (cfg["head_dim"], cfg["num_key_value_heads"], cfg["hidden_act"], cfg["attention_bias"]) == (8, 2, "silu", False)
    # Both engines read the same directory; only the README's serve command differs.
    assert (outs["vllm"] / "config.json").read_text() == (outs["sglang"] / "config.json").read_text()
    exported, ours = load_file(outs["vllm"] / "model.safetensors"), load_file(head_dir / "model.safetensors")
    assert all(torch.equal(exported[k], load_file(outs["sglang"] / "model.safetensors")[k]) for k in exported)
    # Engines concatenate the captured layers in layer order: fc's blocks for ids [5, 1] are swapped.
    assert torch.equal(exported["fc.weight"], torch.cat(ours["fc.weight"].split(32, dim=1)[::-1], dim=1))
    assert all(torch.equal(exported[k], ours[k]) for k in ours if k != "fc.weight")
    assert '"method": "dflash"' in (outs["vllm"] / "README.md").read_text()
    assert '"num_speculative_tokens": 3' in (outs["vllm"] / "README.md").read_text()
    assert ("--speculative-algorithm DFLASH" in (outs["sglang"] / "README.md").read_text()
            and "--speculative-num-draft-tokens 4" in (outs["sglang"] / "README.md").read_text())


@pytest.mark.parametrize("field, value, message", [
    ("architectures", ["LlamaForCausalLMEagle3"], "'architectures' is \\['LlamaForCausalLMEagle3'\\], expected \\['DFlashDraftModel'\\]"),
    ("mask_token_id", 97, "dflash_config.mask_token_id is 97, expected an id below vocab_size 97"),
    ("mask_token_id", None, "dflash_config.mask_token_id is None"),
    ("target_layer_ids", [1, 7], "target_layer_ids \\[1, 7\\] must lie in \\[0, 6\\]"),
    ("target_layer_ids", [5, 1], "distinct and ascending"),
    ("target_layer_ids", [1, 1], "distinct and ascending"),
    ("block_size", 1, "dflash_config.block_size is 1, expected an int >= 2"),
    ("block_size", 5, "'block_size' 4 differs from dflash_config's 5"),
    ("causal", True, "dflash_config sets \\['causal'\\]"),
    ("layer_types", ["full_attention", "sliding_attention"], "'layer_types' is"),
    ("num_target_layers", 6, "'num_target_layers' is 6, the target has 8"),
])
def test_validator_refuses_wrong_dflash_fields(tiny, tmp_path, field, value, message):
    out = export_head(saved(DFLASH, tiny, tmp_path / "h"), "sglang", tmp_path / "x", tiny)
    cfg = json.loads((out / "config.json").read_text())
    if field in ("architectures", "layer_types", "num_target_layers"):  # top-level fields
        cfg[field] = value
    elif value is None:  # a missing field
        del cfg["dflash_config"][field]
    else:
        cfg["dflash_config"][field] = value
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        validate_export(out, "sglang")


def test_validator_refuses_a_dflash_fc_for_other_layers(tiny, tmp_path):
    out = export_head(saved(DFLASH, tiny, tmp_path / "h"), "vllm", tmp_path / "x", tiny)
    rewrite_weights(out, lambda t: t.__setitem__("fc.weight", torch.cat([t["fc.weight"]] * 2, dim=1)[:, :96].contiguous()))
    with pytest.raises(ValueError, match=r"fc.weight has shape \(32, 96\), the config implies \(32, 64\)"):
        validate_export(out, "vllm")


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_dflash_round_trip_drafts_the_same(tiny, fitted_dflash, tmp_path, fmt):
    back = import_head(export_head(fitted_dflash, fmt, tmp_path / fmt, tiny), "dflash", tmp_path / "back", tiny)
    config = json.loads((back / "config.json").read_text())["head"]
    assert (config["target_layer_ids"], config["mask_token_id"], config["block_size"]) == ([1, 5], 96, 4)
    # fc's input blocks were reordered to ascending ids; a fitted head's larger sums round a little further apart.
    assert_same_drafts(fitted_dflash, back, tiny, tol=1e-5)
    histogram = assert_same_generations(fitted_dflash, back, tiny)
    assert histogram[0] > 0 and sum(histogram[1:]) > 0  # drafts rejected and accepted: the comparison is not vacuous


def official_dflash(target, path: Path, ids=(1, 3, 5), layout="model.safetensors") -> Path:
    """A DFlash checkpoint as z-lab publishes it (Qwen3-8B-b16's config fields), bf16 random weights.

    ``layout``: "model.safetensors", "model. prefix" (vLLM's internal names, with copies of the target's
    embedding and lm_head) or "sharded" (two files and an index).
    """
    gen = torch.Generator().manual_seed(0)
    reference = build_head(DFlashConfig(num_layers=2, block_size=4, target_layer_ids=list(ids) or None, mask_token_id=96), target)
    state = {k: (torch.randn(t.shape, generator=gen) * 0.3).bfloat16() for k, t in reference.state_dict().items()}
    if layout == "model. prefix":
        state = {f"model.{k}": t for k, t in state.items()}
        state["model.embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach().bfloat16()
        state["lm_head.weight"] = target.model.get_output_embeddings().weight.detach().bfloat16()
    path.mkdir(parents=True)
    if layout == "sharded":
        names = sorted(state)
        shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for file, keys in shards.items():
            save_file({k: state[k] for k in keys}, str(path / file))
        index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file(state, str(path / "model.safetensors"))
    dflash = {"mask_token_id": 96} | ({"target_layer_ids": list(ids)} if ids else {})
    (path / "config.json").write_text(json.dumps({
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3", "block_size": 4, "dflash_config": dflash, "num_target_layers": 8,
        "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None, "max_position_embeddings": 256,
        "vocab_size": 97, "tie_word_embeddings": False, "layer_types": ["full_attention"] * 2, "sliding_window": None,
        "use_sliding_window": False, "max_window_layers": 2, "dtype": "bfloat16", "use_cache": True,
    }))
    return path


@pytest.mark.parametrize("layout", ["model.safetensors", "model. prefix", "sharded"])
def test_official_dflash_checkpoint_drafts_like_its_weights(tiny, tmp_path, layout):
    src = official_dflash(tiny, tmp_path / "official", layout=layout)
    head_dir = import_head(src, "dflash", tmp_path / "head", tiny)
    assert load_drafter(head_dir, tiny).hidden_layers == (2, 4, 6)  # layer outputs 1, 3, 5: HF hidden_states + 1
    weights = {k.removeprefix("model."): t.float() for f in src.glob("model*.safetensors") for k, t in load_file(f).items()}
    weights = {k: t for k, t in weights.items() if k not in ("embed_tokens.weight", "lm_head.weight")}  # the target's
    head = build_head(DFlashConfig(num_layers=2, block_size=4, target_layer_ids=[1, 3, 5], mask_token_id=96), tiny).eval()
    head.load_state_dict(weights, strict=True)
    reference = save_head(head, tmp_path / "reference", tiny)
    assert_same_drafts(reference, head_dir, tiny)
    assert_same_generations(reference, head_dir, tiny)


def test_official_dflash_defaults(tiny, tmp_path):
    """No target_layer_ids: z-lab's spread for the draft's layer count; no block_size anywhere: 16."""
    src = official_dflash(tiny, tmp_path / "src", ids=())
    cfg = json.loads((src / "config.json").read_text())
    del cfg["block_size"]
    (src / "config.json").write_text(json.dumps(cfg))
    head = json.loads((import_head(src, "dflash", tmp_path / "head", tiny) / "config.json").read_text())["head"]
    assert (head["target_layer_ids"], head["block_size"]) == ([1, 5], 16)  # default_target_layer_ids(8, 2)
    (src / "config.json").write_text(json.dumps(cfg | {"target_layer_ids": [2, 6]}))  # SGLang also reads the top level
    head = json.loads((import_head(src, "dflash", tmp_path / "top", tiny) / "config.json").read_text())["head"]
    assert head["target_layer_ids"] == [2, 6]


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["dflash_config"].pop("mask_token_id"), "dflash_config.mask_token_id is None"),
    (lambda c: c["dflash_config"].update(causal=True), "dflash_config.causal=True"),
    (lambda c: c["dflash_config"].update(use_swa=True), "dflash_config.use_swa=True"),
    (lambda c: c.update(layer_types=["full_attention", "sliding_attention"], sliding_window=8),
     "layer_types=\\['sliding_attention'\\]"),
    (lambda c: c.update(use_sliding_window=True, sliding_window=8), "use_sliding_window=true with sliding_window=8"),
    (lambda c: c["dflash_config"].update(block_size=8), "'block_size': 4} disagree"),
    (lambda c: c.update(num_target_layers=6), "num_target_layers 6, but target .* has 8 layers"),
    (lambda c: c.update(intermediate_size=128), "intermediate_size: checkpoint has 128, the target implies 64"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[1, 3, 7]), "target_layer_ids \\[1, 3, 7\\] must be distinct"),
], ids=["no-mask", "causal", "swa", "sliding-layers", "use-sliding-window", "block-sizes", "target-layers", "sizes", "ids"])
def test_dflash_imports_name_what_does_not_fit(tiny, tmp_path, edit, message):
    src = official_dflash(tiny, tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        import_head(src, "dflash", tmp_path / "head", tiny)
    assert not (tmp_path / "head").exists()


def test_dflash_import_refuses_another_targets_lm_head(tiny, tmp_path):
    src = official_dflash(tiny, tmp_path / "src", layout="model. prefix")
    state = load_file(src / "model.safetensors")
    state["lm_head.weight"] = torch.randn(97, 32).bfloat16()
    save_file(state, str(src / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.weight \\(97, 32\\) is not target .*'s lm_head"):
        import_head(src, "dflash", tmp_path / "head", tiny)


# -- command line ---------------------------------------------------------------------------------


def test_command_line_export_and_import(tiny, tmp_path, capsys, monkeypatch):
    head_dir = saved(MedusaConfig(num_heads=2), tiny, tmp_path / "h")
    assert main(["export", str(head_dir), "--to", "vllm", str(tmp_path / "x")]) == 0
    assert "vllm serve" in capsys.readouterr().out
    monkeypatch.setattr("specgraft.model.load_target", lambda *a, **k: tiny)  # the tiny target has no directory
    assert main(["import-head", str(tmp_path / "x"), "--format", "medusa", str(tmp_path / "back"), "--target", "tiny"]) == 0
    assert_same_drafts(head_dir, tmp_path / "back", tiny)


def test_command_line_dflash_export_and_import(tiny, fitted_dflash, tmp_path, capsys, monkeypatch):
    tiny.config.save_pretrained(tmp_path / "target")  # export reads only the target's config
    assert main(["export", str(fitted_dflash), "--to", "sglang", str(tmp_path / "x"), "--target", str(tmp_path / "target")]) == 0
    assert "--speculative-algorithm DFLASH" in capsys.readouterr().out
    monkeypatch.setattr("specgraft.model.load_target", lambda *a, **k: tiny)  # the tiny target has no directory
    assert main(["import-head", str(tmp_path / "x"), "--format", "dflash", str(tmp_path / "back"), "--target", "tiny"]) == 0
    assert_same_generations(fitted_dflash, tmp_path / "back", tiny)
