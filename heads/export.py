"""Export a head directory for vLLM, SGLang, the official EAGLE code or the Medusa code, and check the result.

specgraft's weight names already follow the official checkpoints, so an
export is explicit surgery: copy the tensors, rename the few that a format
names differently, write the config fields that engine reads, then validate
the written directory against what that engine's loader expects. Both engines
skip some unknown weight names without a word (SGLang any, vLLM an unexpected
``*.bias``), so a misnamed tensor would start a server that accepts nothing:
`validate_export` refuses missing, renamed and stray keys, wrong shapes and
wrong config fields.

| head   | --to vllm                    | --to sglang          | --to eagle (SafeAILab) | --to medusa   |
|--------|------------------------------|----------------------|------------------------|---------------|
| eagle3 | method "eagle3"              | EAGLE3               | EAGLE-3 layout         | -             |
| eagle  | method "eagle", no fc bias   | EAGLE, fc bias always| EAGLE-1 layout         | -             |
| medusa | method "medusa", vLLM <= 0.32| - (no Medusa)        | -                      | FasterDecoding|
| dflash | method "dflash"              | DFLASH (same files)  | -                      | -             |

EAGLE-3 taps: specgraft names HF ``hidden_states`` indices (the input of
decoder layer i). vLLM's top-level ``eagle_aux_hidden_state_layer_ids`` use
the same indices; SGLang's ``eagle_config.eagle_aux_hidden_state_layer_ids``
name layer *outputs* (it captures id + 1). Both engines capture each layer
once and concatenate in layer order, so taps must be distinct and fc's three
input blocks are reordered to ascending taps.

DFlash: ``dflash_config.target_layer_ids`` name layer outputs in specgraft,
z-lab's code, vLLM and SGLang alike (each engine adds 1 itself), so the ids
are written as they are. z-lab concatenates the captured layers in list order,
the engines in layer order: the export writes them ascending and reorders
fc's input blocks to match, which means the same to all three.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from specgraft.heads.checkpoint import SIDECAR, check_target, read_head_dir, umask_mode
from specgraft.heads.dflash import default_target_layer_ids
from specgraft.heads.eagle import layer_config
from specgraft.heads.eagle3 import default_aux_layers
from specgraft.specs import EXPORT_FORMATS as FORMATS
from specgraft.model import Target

SUPPORTED = {
    "eagle3": ("vllm", "sglang", "eagle"),
    "eagle": ("vllm", "sglang", "eagle"),
    "medusa": ("vllm", "medusa"),
    "dflash": ("vllm", "sglang"),  # no official EAGLE or Medusa code runs a block drafter
}
ARCHITECTURES = {  # (head type, format) -> config "architectures"
    ("eagle3", "vllm"): ["LlamaForCausalLMEagle3"],  # vLLM registry alias of Eagle3LlamaForCausalLM
    ("eagle3", "sglang"): ["LlamaForCausalLMEagle3"],
    ("eagle3", "eagle"): ["LlamaForCausalLMEagle3"],
    ("eagle", "vllm"): ["LlamaForCausalLM"],  # vLLM's EAGLEConfig turns it into EagleLlamaForCausalLM
    ("eagle", "sglang"): ["LlamaForCausalLMEagle"],  # SGLang picks the draft class from this name
    ("eagle", "eagle"): ["LlamaForCausalLM"],
    ("medusa", "vllm"): ["MedusaModel"],
    ("dflash", "vllm"): ["DFlashDraftModel"],  # vLLM maps it to DFlashQwen3ForCausalLM
    ("dflash", "sglang"): ["DFlashDraftModel"],  # SGLang's EntryClass
}
MEDUSA_REPO_WEIGHTS = "medusa_lm_head.safetensors"
# Config switches of EAGLE variants specgraft's heads do not implement; an export never sets them.
UNSUPPORTED_VARIANTS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "attention_bias", "bias")
MIDLAYER_NORMS = ("input_layernorm", "hidden_norm", "post_attention_layernorm")  # EAGLE-3's midlayer norms
# dflash_config switches of DFlash variants specgraft's head does not implement (causal blocks, sliding windows,
# attention sinks, the Domino projector): value -> whether it turns the variant on.
DFLASH_VARIANTS = {
    "causal": bool, "use_swa": bool, "attention_sink_bias": bool, "shift_label": bool, "pure_draft_prefix_len": bool,
    "projector_type": lambda v: v is not None, "use_aux_hidden_state": lambda v: v is False,
}


def dflash_variants(dflash_config: dict[str, Any]) -> list[str]:
    """The `DFLASH_VARIANTS` keys that ``dflash_config`` turns on."""
    return [k for k, is_on in DFLASH_VARIANTS.items() if k in dflash_config and is_on(dflash_config[k])]


def weights_file(head_type: str, fmt: str) -> str:
    return MEDUSA_REPO_WEIGHTS if (head_type, fmt) == ("medusa", "medusa") else "model.safetensors"


# -- what a directory must hold ---------------------------------------------------------------------


def llama_layer_tensors(prefix: str, cfg: dict[str, Any], qkv_in: int, input_norm: bool) -> dict[str, tuple]:
    """Shapes of one Llama decoder layer's tensors whose q/k/v read ``qkv_in`` features."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {
        f"{prefix}.self_attn.q_proj.weight": (q, qkv_in),
        f"{prefix}.self_attn.k_proj.weight": (kv, qkv_in),
        f"{prefix}.self_attn.v_proj.weight": (kv, qkv_in),
        f"{prefix}.self_attn.o_proj.weight": (h, q),
        f"{prefix}.mlp.gate_proj.weight": (inter, h),
        f"{prefix}.mlp.up_proj.weight": (inter, h),
        f"{prefix}.mlp.down_proj.weight": (h, inter),
        f"{prefix}.post_attention_layernorm.weight": (h,),
    }
    if input_norm:
        shapes[f"{prefix}.input_layernorm.weight"] = (h,)
    return shapes


def expected_tensors(head_type: str, fmt: str, cfg: dict[str, Any]) -> dict[str, tuple]:
    """name -> shape (floating point) or (shape, dtype) of every tensor the exported config implies."""
    if head_type == "eagle3":
        h, v, d = cfg["hidden_size"], cfg["vocab_size"], cfg["draft_vocab_size"]
        shapes = {"fc.weight": (h, 3 * cfg.get("target_hidden_size", h))}
        shapes |= llama_layer_tensors("midlayer", cfg, 2 * h, input_norm=False)
        shapes |= {f"midlayer.{n}.weight": (h,) for n in MIDLAYER_NORMS}
        shapes |= {"norm.weight": (h,), "lm_head.weight": (d, h)}
        # vLLM >= 0.33 has no draft_id_to_target_id when the draft vocabulary is the target's: a d2t fails to load.
        if fmt == "eagle" or d < v:
            shapes |= {"d2t": ((d,), torch.int64), "t2d": ((v,), torch.bool)}
        return shapes
    if head_type == "eagle":
        h = cfg["hidden_size"]
        shapes = {"fc.weight": (h, 2 * h)}
        has_bias = {"vllm": False, "sglang": True, "eagle": cfg.get("bias")}[fmt]
        if has_bias:
            shapes["fc.bias"] = (h,)
        for i in range(cfg["num_hidden_layers"]):  # EAGLE's layer 0 has no input norm
            shapes |= llama_layer_tensors(f"layers.{i}", cfg, h, input_norm=i > 0)
        return shapes
    if head_type == "dflash":
        h, hd = cfg["hidden_size"], cfg["head_dim"]
        shapes = {"fc.weight": (h, len(cfg["dflash_config"]["target_layer_ids"]) * h),
                  "hidden_norm.weight": (h,), "norm.weight": (h,)}
        for i in range(cfg["num_hidden_layers"]):  # Qwen3 layers: q_norm / k_norm over each head
            shapes |= llama_layer_tensors(f"layers.{i}", cfg, h, input_norm=True)
            shapes |= {f"layers.{i}.self_attn.{n}.weight": (hd,) for n in ("q_norm", "k_norm")}
        return shapes
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    if fmt == "vllm":
        k, n = cfg["num_heads"], cfg["num_hidden_layers"]
        return {f"blocks.{i}.layers.{l}.{p}": (h, h) if p == "weight" else (h,)
                for i in range(k) for l in range(n) for p in ("weight", "bias")} | {
            f"lm_heads.{i}.weight": (v, h) for i in range(k)}
    k, n = cfg["medusa_num_heads"], cfg["medusa_num_layers"]  # FasterDecoding: Sequential(ResBlock * n, Linear)
    return {f"{i}.{l}.linear.{p}": (h, h) if p == "weight" else (h,)
            for i in range(k) for l in range(n) for p in ("weight", "bias")} | {
        f"{i}.{n}.weight": (v, h) for i in range(k)}


def head_type_of(fmt: str, cfg: dict[str, Any]) -> str:
    """Which head an exported config describes, from the fields each format is recognised by."""
    if fmt == "medusa" or cfg.get("model_type") == "medusa":
        return "medusa"
    if "dflash_config" in cfg or cfg.get("architectures") == ["DFlashDraftModel"]:
        return "dflash"
    if cfg.get("architectures") == ["LlamaForCausalLMEagle3"]:
        return "eagle3"
    return "eagle"


def _config_problems(head_type: str, fmt: str, cfg: dict[str, Any], num_target_layers: int | None) -> list[str]:
    """Config fields the engine reads, checked against what that engine expects of this head."""
    problems = []

    def need(key, value=None):
        if key not in cfg:
            problems.append(f"config.json lacks {key!r}")
        elif value is not None and cfg[key] != value:
            problems.append(f"config.json {key!r} is {cfg[key]!r}, expected {value!r}")

    if head_type == "medusa" and fmt == "medusa":
        for key in ("medusa_num_heads", "medusa_num_layers", "base_model_name_or_path", "hidden_size", "vocab_size"):
            need(key)
        need("medusa_fc_bias", True)  # read by vLLM <= 0.32, which also loads this layout
        return problems
    if head_type == "medusa":
        need("model_type", "medusa")
        need("architectures", ARCHITECTURES["medusa", fmt])
        need("medusa_fc_bias", True)  # vLLM builds the block layers without bias unless told
        for key in ("hidden_size", "vocab_size", "num_heads", "num_hidden_layers"):
            need(key)
        # vLLM's MedusaConfig renames every key holding "num" and "heads"/"layers": keep only the two it expects.
        clashing = sorted(k for k in cfg if "num" in k and k not in ("num_heads", "num_hidden_layers"))
        if clashing:
            problems.append(f"config.json keys {clashing} would be renamed by vLLM's MedusaConfig")
        return problems
    if head_type == "dflash":
        return problems + _dflash_config_problems(cfg, num_target_layers)
    need("architectures", ARCHITECTURES[head_type, fmt])
    need("model_type", "llama")
    need("tie_word_embeddings", False)  # SGLang ties a tied draft's lm_head to its embedding
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "max_position_embeddings", "rope_theta", "vocab_size", "num_hidden_layers"):
        need(key)
    for key in UNSUPPORTED_VARIANTS:
        if cfg.get(key) and not (key == "bias" and (head_type, fmt) == ("eagle", "eagle")):
            problems.append(f"config.json sets {key!r}: not how specgraft's {head_type} head computes")
    if head_type == "eagle":
        if fmt == "eagle" and not isinstance(cfg.get("bias"), bool):
            problems.append("config.json lacks a boolean 'bias' (the official EAGLE code defaults it to true)")
        return problems
    need("num_hidden_layers", 1)
    need("draft_vocab_size")
    if cfg.get("num_aux_hidden_states", 3) != 3:
        problems.append(f"config.json 'num_aux_hidden_states' is {cfg['num_aux_hidden_states']}, specgraft fuses 3")
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    n = num_target_layers
    if fmt == "vllm":  # HF hidden_states indices; index 0 has no residual on older vLLM, index N is post-norm in HF
        problems += _tap_problems("eagle_aux_hidden_state_layer_ids", top, 1, None if n is None else n - 1)
        if nested is not None:
            problems.append("config.json has eagle_config.eagle_aux_hidden_state_layer_ids: vLLM reads them "
                            "as HF indices, SGLang as layer outputs; keep only the top-level field")
    elif fmt == "sglang":  # layer-output indices: SGLang captures id + 1
        problems += _tap_problems("eagle_config.eagle_aux_hidden_state_layer_ids", nested, 0,
                                  None if n is None else n - 2)
        if top is not None:
            problems.append("config.json has a top-level eagle_aux_hidden_state_layer_ids: vLLM would read them, "
                            "SGLang ignores them; keep only eagle_config's")
    else:  # the official code taps the inputs of layers 2, N // 2 and N - 3, fixed
        if top is not None or nested is not None:
            problems.append("config.json names tapped layers: the official EAGLE code taps 2, N//2, N-3 regardless")
        if n is not None and len(set(default_aux_layers(n))) != 3:
            problems.append(f"the official EAGLE taps {default_aux_layers(n)} of a {n}-layer target are not distinct")
    return problems


def _dflash_config_problems(cfg: dict[str, Any], num_target_layers: int | None) -> list[str]:
    """The fields z-lab's code, vLLM and SGLang read of a DFlash draft (the same for both engines)."""
    problems = []
    for key, value in (("architectures", ["DFlashDraftModel"]), ("model_type", "qwen3"), ("hidden_act", "silu"),
                       ("attention_bias", False), ("tie_word_embeddings", False)):
        if cfg.get(key) != value:
            problems.append(f"config.json {key!r} is {cfg.get(key)!r}, expected {value!r}")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "max_position_embeddings", "rope_theta", "vocab_size", "num_hidden_layers"):
        if key not in cfg:
            problems.append(f"config.json lacks {key!r}")
    dflash = cfg.get("dflash_config")
    if not isinstance(dflash, dict):
        return problems + ["config.json lacks 'dflash_config' (mask_token_id, target_layer_ids, block_size)"]
    n = cfg.get("num_target_layers")  # SGLang warns if it differs from the running target's
    if not isinstance(n, int):
        problems.append(f"config.json 'num_target_layers' is {n!r}, expected the target's layer count")
    elif num_target_layers is not None and n != num_target_layers:
        problems.append(f"config.json 'num_target_layers' is {n}, the target has {num_target_layers}")
    n = num_target_layers if num_target_layers is not None else n
    mask, vocab = dflash.get("mask_token_id"), cfg.get("vocab_size")
    if not isinstance(mask, int) or not isinstance(vocab, int) or not 0 <= mask < vocab:
        problems.append(f"config.json dflash_config.mask_token_id is {mask!r}, expected an id below vocab_size {vocab!r}")
    # Layer outputs: id N - 1 is HF's final-norm output, which neither engine captures.
    problems += _tap_problems("dflash_config.target_layer_ids", dflash.get("target_layer_ids"), 0,
                              None if not isinstance(n, int) else n - 2, count=None)
    size = dflash.get("block_size")
    if not isinstance(size, int) or size < 2:
        problems.append(f"config.json dflash_config.block_size is {size!r}, expected an int >= 2")
    elif cfg.get("block_size") != size:  # z-lab reads the top-level field, SGLang dflash_config's
        problems.append(f"config.json 'block_size' {cfg.get('block_size')!r} differs from dflash_config's {size}")
    if cfg.get("layer_types") != ["full_attention"] * cfg.get("num_hidden_layers", 0):
        problems.append(f"config.json 'layer_types' is {cfg.get('layer_types')!r}, expected 'full_attention' for "
                        f"every layer (specgraft's DFlash has no sliding window)")
    on = dflash_variants(dflash)
    if on:
        problems.append(f"config.json dflash_config sets {on}: not how specgraft's dflash head computes")
    return problems


def _tap_problems(field: str, ids, low: int, high: int | None, count: int | None = 3) -> list[str]:
    if (not isinstance(ids, list) or not ids or (count is not None and len(ids) != count)
            or not all(isinstance(i, int) for i in ids)):
        return [f"config.json {field} is {ids!r}, expected {count or 'a list of'} layer ids"]
    if ids != sorted(set(ids)):
        return [f"config.json {field} {ids} must be distinct and ascending (engines capture each layer once, in order)"]
    if ids[0] < low or (high is not None and ids[-1] > high):
        return [f"config.json {field} {ids} must lie in [{low}, {high}]"]
    return []


def _vocab_map_problems(tensors: dict[str, torch.Tensor], cfg: dict[str, Any]) -> list[str]:
    """d2t[d] is the offset from draft id d to its target id; t2d marks exactly those target ids."""
    if "d2t" not in tensors or "t2d" not in tensors or tensors["d2t"].dim() != 1:
        return []
    targets = torch.arange(tensors["d2t"].shape[0]) + tensors["d2t"]
    if targets.min() < 0 or targets.max() >= cfg["vocab_size"] or targets.unique().numel() != targets.numel():
        return ["d2t maps draft ids outside the target vocabulary or two draft ids to one target id"]
    if not torch.equal(tensors["t2d"].nonzero().flatten(), targets.sort().values):
        return ["t2d does not mark exactly the target ids that d2t maps to"]
    return []


def validate_export(out_dir: str | Path, fmt: str, num_target_layers: int | None = None) -> None:
    """Raise ValueError listing everything in ``out_dir`` that the ``fmt`` loader would not take as intended.

    Checks: config.json fields the engine reads, one weights file, every
    expected tensor present with its shape and dtype, no stray tensor,
    EAGLE-3's tapped layers and vocabulary maps, and DFlash's ``dflash_config``.
    ``num_target_layers`` (default: from the config's ``specgraft_target``)
    bounds the tapped layers.
    """
    out = Path(out_dir)
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; expected one of {FORMATS}")
    config_file = out / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{out} is not a {fmt} export: {config_file} is missing")
    cfg = json.loads(config_file.read_text())
    head_type = head_type_of(fmt, cfg)
    if num_target_layers is None:
        num_target_layers = (cfg.get("specgraft_target") or {}).get("num_hidden_layers")
    problems = _config_problems(head_type, fmt, cfg, num_target_layers)
    name = weights_file(head_type, fmt)
    others = sorted(p.name for p in out.iterdir() if p.suffix in (".safetensors", ".bin", ".pt") and p.name != name)
    if others:  # vLLM loads every *.safetensors it finds; the official codes prefer a .bin / .pt
        problems.append(f"stray weight files {others}: the engine could load them instead of, or beside, {name}")
    if not (out / name).is_file():
        problems.append(f"{name} is missing")
    elif not problems:  # shapes follow from the config, so only check them once the config is sound
        tensors = load_file(str(out / name))
        expected = expected_tensors(head_type, fmt, cfg)
        missing, stray = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        if missing:
            problems.append(f"missing tensors {missing}")
        if stray:
            problems.append(f"stray tensors {stray} (an engine skips or rejects unknown names)")
        for key in sorted(set(expected) & set(tensors)):
            shape, dtype = expected[key] if isinstance(expected[key][0], tuple) else (expected[key], None)
            t = tensors[key]
            if tuple(t.shape) != shape:
                problems.append(f"{key} has shape {tuple(t.shape)}, the config implies {shape}")
            elif dtype is not None and t.dtype != dtype:
                problems.append(f"{key} is {t.dtype}, expected {dtype}")
            elif dtype is None and not t.is_floating_point():
                problems.append(f"{key} is {t.dtype}, expected floating point")
        if head_type == "medusa" and fmt == "medusa" and cfg["medusa_num_layers"] > 1:
            problems += _shared_block_problems(tensors, cfg["medusa_num_heads"], cfg["medusa_num_layers"])
        problems += _vocab_map_problems(tensors, cfg)
    if problems:
        raise ValueError(f"{out} is not a valid {fmt} export of this {head_type} head:\n  - " + "\n  - ".join(problems))


def _shared_block_problems(tensors: dict[str, torch.Tensor], heads: int, layers: int) -> list[str]:
    """The Medusa code repeats one ResBlock object (``[ResBlock(h)] * n``): every layer of a head must be equal."""
    return [
        f"head {i}: layer {l} differs from layer 0, but the Medusa code shares one ResBlock across a head's layers"
        for i in range(heads) for l in range(1, layers) for p in ("weight", "bias")
        if not torch.equal(tensors[f"{i}.{l}.linear.{p}"], tensors[f"{i}.0.linear.{p}"])
    ][:1]


# -- export ---------------------------------------------------------------------------------------


def draft_llama_fields(target_config, num_layers: int) -> dict[str, Any]:
    """LlamaConfig fields of the draft layers, exactly as specgraft builds them (`layer_config`)."""
    llama = layer_config(target_config, num_layers)
    rope = dict(llama.rope_parameters)
    theta = rope.pop("rope_theta")
    return {
        "model_type": "llama",
        "hidden_size": llama.hidden_size,
        "intermediate_size": llama.intermediate_size,
        "num_attention_heads": llama.num_attention_heads,
        "num_key_value_heads": llama.num_key_value_heads,
        "head_dim": llama.head_dim,
        "num_hidden_layers": num_layers,
        "hidden_act": llama.hidden_act,
        "rms_norm_eps": llama.rms_norm_eps,
        "max_position_embeddings": llama.max_position_embeddings,
        # transformers 4 style, which the engines read; transformers 5 folds them into rope_parameters.
        "rope_theta": theta,
        "rope_scaling": None if rope.get("rope_type", "default") == "default" else rope,
        "tie_word_embeddings": False,
    }


def _target_config(target: Target | str | Path | None, signature: dict[str, Any], where: str):
    """The target's transformers config: from a loaded target (fingerprint checked) or a path (sizes checked)."""
    if isinstance(target, Target):
        check_target(signature, target, where)
        return target.config
    from transformers import AutoConfig

    source = str(target) if target is not None else signature.get("name")
    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise ValueError(f"{where}: cannot read the target's config from {source!r} ({err}); pass target=") from None
    text = getattr(config, "text_config", None) or config
    actual = {"hidden_size": text.hidden_size, "num_hidden_layers": text.num_hidden_layers}
    wrong = [f"{k}: head expects {signature[k]}, {source} has {v}" for k, v in actual.items() if signature.get(k) != v]
    if wrong:
        raise ValueError(f"{where} was trained for another target: " + "; ".join(wrong))
    return text


def _eagle3_export(head_cfg, signature, tensors, target_config, fmt) -> tuple[dict, dict]:
    n, h, v = signature["num_hidden_layers"], signature["hidden_size"], signature["vocab_size"]
    taps = list(head_cfg.aux_layers or default_aux_layers(n))
    if len(set(taps)) != 3:
        raise ValueError(f"EAGLE-3 taps {taps} repeat a layer: vLLM and SGLang capture each layer once, so fc "
                         f"would get fewer than 3 states; train with distinct head.aux_layers")
    if fmt == "eagle" and sorted(taps) != sorted(default_aux_layers(n)):
        raise ValueError(f"the official EAGLE code always taps {default_aux_layers(n)}, this head taps {taps}; "
                         f"export --to vllm or --to sglang, which name the tapped layers")
    if fmt != "eagle" and not (1 <= min(taps) and max(taps) <= n - 1):
        raise ValueError(f"EAGLE-3 taps {taps} must lie in [1, {n - 1}]: engines cannot capture the embedding "
                         f"(SGLang) or HF's post-norm index {n}")
    order = sorted(range(3), key=lambda i: taps[i])  # engines concatenate the taps in layer order
    out = dict(tensors)
    out["fc.weight"] = torch.cat([tensors["fc.weight"].split(h, dim=1)[i] for i in order], dim=1)
    d = tensors["lm_head.weight"].shape[0]
    if fmt != "eagle" and d == v:
        if tensors["d2t"].any():
            raise ValueError("a full draft vocabulary must map draft id d to target id d (d2t all zero)")
        del out["d2t"], out["t2d"]  # vLLM >= 0.33 refuses a d2t here; SGLang needs none
    cfg = {"architectures": ARCHITECTURES["eagle3", fmt], **draft_llama_fields(target_config, 1),
           "vocab_size": v, "draft_vocab_size": d}
    ids = [taps[i] for i in order]
    if fmt == "vllm":
        cfg |= {"eagle_aux_hidden_state_layer_ids": ids, "norm_before_residual": False}
    elif fmt == "sglang":
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids], "use_aux_hidden_state": True}
    return cfg, out


def _eagle_export(head_cfg, signature, tensors, target_config, fmt) -> tuple[dict, dict]:
    out = dict(tensors)
    bias = out.get("fc.bias")
    if fmt == "vllm" and bias is not None:
        if bias.any():
            raise ValueError("vLLM's EAGLE-1 drafter (EagleLlamaForCausalLM) builds fc without a bias and drops "
                             "fc.bias (0.33 silently); export --to sglang or --to eagle, or train with "
                             "head.fc_bias: false")
        del out["fc.bias"]  # an all-zero bias is the same function
    if fmt == "sglang" and bias is None:
        out["fc.bias"] = torch.zeros(signature["hidden_size"])  # SGLang's fc always has a bias: load a zero one
    cfg = {"architectures": ARCHITECTURES["eagle", fmt], **draft_llama_fields(target_config, head_cfg.num_layers),
           "vocab_size": signature["vocab_size"]}
    if fmt == "eagle":
        cfg["bias"] = bias is not None  # the official code reads fc's bias from here (default true)
    return cfg, out


def _dflash_export(head_cfg, signature, tensors, target_config, fmt) -> tuple[dict, dict]:
    n, h = signature["num_hidden_layers"], signature["hidden_size"]
    ids = list(head_cfg.target_layer_ids or default_target_layer_ids(n, head_cfg.num_layers))
    if head_cfg.mask_token_id is None:  # DFlashHead records the id it resolved; only a hand-written config lacks it
        raise ValueError("the head config names no mask_token_id; set head.mask_token_id to the id it was trained with")
    order = sorted(range(len(ids)), key=lambda i: ids[i])  # the engines concatenate captured layers in layer order
    out = dict(tensors)
    out["fc.weight"] = torch.cat([tensors["fc.weight"].split(h, dim=1)[i] for i in order], dim=1)
    layers, size = head_cfg.num_layers, head_cfg.block_size
    cfg = {"architectures": ARCHITECTURES["dflash", fmt], **draft_llama_fields(target_config, layers),
           "model_type": "qwen3",  # DFlash's draft layers are Qwen3 layers (q_norm / k_norm)
           "attention_bias": False, "layer_types": ["full_attention"] * layers, "use_sliding_window": False,
           "sliding_window": None, "vocab_size": signature["vocab_size"], "num_target_layers": n,
           "block_size": size,  # z-lab reads this one, SGLang dflash_config's first: both say the same
           "dflash_config": {"mask_token_id": head_cfg.mask_token_id, "target_layer_ids": sorted(ids), "block_size": size}}
    return cfg, out


def _medusa_export(head_cfg, signature, tensors, fmt) -> tuple[dict, dict]:
    k, n = head_cfg.num_heads, head_cfg.num_layers
    h, v = signature["hidden_size"], signature["vocab_size"]
    if fmt == "vllm":
        return {"model_type": "medusa", "architectures": ARCHITECTURES["medusa", "vllm"], "hidden_size": h,
                "vocab_size": v, "num_heads": k, "num_hidden_layers": n, "medusa_fc_bias": True}, dict(tensors)
    out = {}
    for i in range(k):  # blocks.{i}.layers.{l}.* -> {i}.{l}.linear.*; lm_heads.{i} -> {i}.{n} (after the n blocks)
        for l in range(n):
            out[f"{i}.{l}.linear.weight"] = tensors[f"blocks.{i}.layers.{l}.weight"]
            out[f"{i}.{l}.linear.bias"] = tensors[f"blocks.{i}.layers.{l}.bias"]
        out[f"{i}.{n}.weight"] = tensors[f"lm_heads.{i}.weight"]
    assert len(out) == len(tensors), "every Medusa tensor is renamed exactly once"
    if _shared_block_problems(out, k, n):
        raise ValueError(f"the Medusa code shares one ResBlock across a head's {n} layers; this head's layers "
                         f"differ, so export --to vllm (separate layers) or train with head.num_layers: 1")
    # hidden_size, vocab_size and medusa_fc_bias are not read by the Medusa code (it sizes from the base model);
    # with them vLLM <= 0.32 serves this layout too (it maps {i}.{l}.linear.* itself).
    return {"medusa_num_heads": k, "medusa_num_layers": n, "base_model_name_or_path": signature["name"],
            "hidden_size": h, "vocab_size": v, "medusa_fc_bias": True}, out


def export_head(head_dir: str | Path, fmt: str, out_dir: str | Path, target: Target | str | Path | None = None) -> Path:
    """Write the head in ``head_dir`` as a ``fmt`` checkpoint in ``out_dir`` (new or empty), validated, with a README.

    Args:
        fmt: "vllm", "sglang", "eagle" (official EAGLE repository) or "medusa" (Medusa repository);
            DFlash heads go to vllm or sglang, which read the same directory.
        target: the loaded target (its embedding fingerprint is checked), a path or hub id whose config
            is read, or None to read the config of the target named in the head's config. Only EAGLE
            and DFlash heads need it (their draft layers copy the target's attention and MLP sizes and RoPE).

    Raises:
        ValueError: a format this head cannot be served in, a head that the format cannot express
            (duplicate or non-default taps, an fc bias for vLLM, distinct Medusa layers for the Medusa
            code), a non-empty ``out_dir``, or an output that fails `validate_export`.
    """
    head_dir, out = Path(head_dir), Path(out_dir)
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; expected one of {FORMATS}")
    if (head_dir / SIDECAR).is_file():
        raise ValueError(f"{head_dir} is a distilled draft model, already a transformers directory: serve it as a "
                         f"draft model (vLLM method 'draft_model', SGLang STANDALONE); nothing to export")
    head_cfg, signature, tensors = read_head_dir(head_dir)
    if fmt not in SUPPORTED.get(head_cfg.type, ()):
        why = {("medusa", "sglang"): " (SGLang has no Medusa drafter)",
               ("dflash", "eagle"): " (the official EAGLE code has no block drafter)",
               ("dflash", "medusa"): " (the Medusa code has no block drafter)"}.get((head_cfg.type, fmt), "")
        raise ValueError(f"{head_cfg.type} heads cannot be exported --to {fmt}{why}; "
                         f"supported: {', '.join(SUPPORTED.get(head_cfg.type, ()))}")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty; export into a new directory")
    if head_cfg.type == "medusa":
        cfg, out_tensors = _medusa_export(head_cfg, signature, tensors, fmt)
    else:
        target_config = _target_config(target, signature, f"head {head_dir}")
        build = {"eagle3": _eagle3_export, "eagle": _eagle_export, "dflash": _dflash_export}[head_cfg.type]
        cfg, out_tensors = build(head_cfg, signature, tensors, target_config, fmt)
    dtypes = {t.dtype for t in out_tensors.values() if t.is_floating_point()}
    dtype = str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else "float32"
    cfg |= {"torch_dtype": dtype, "specgraft_target": signature}  # provenance; engines keep unknown fields as attributes
    if head_cfg.type == "dflash":
        cfg["dtype"] = dtype  # transformers 5's name, which the published DFlash configs use

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    tmp.chmod(umask_mode(0o777))  # mkdtemp makes it 0700: the export must be readable as a plain mkdir's would be
    try:  # write beside out_dir, validate, then move into place: a refused export leaves nothing behind
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        tensors_out = {k: t.detach().cpu().contiguous() for k, t in out_tensors.items()}
        save_file(tensors_out, str(tmp / weights_file(head_cfg.type, fmt)), metadata={"format": "pt"})
        validate_export(tmp, fmt, signature["num_hidden_layers"])
        (tmp / "README.md").write_text(_readme(head_cfg, signature, cfg, fmt, out))
        for f in tmp.iterdir():  # safetensors writes 0600 whatever the umask
            f.chmod(umask_mode(0o666))
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


# -- README ---------------------------------------------------------------------------------------


def _serve_command(head_type: str, fmt: str, target: str, out: Path, cfg: dict[str, Any]) -> str:
    if fmt == "vllm":
        method = {"eagle3": "eagle3", "eagle": "eagle", "medusa": "medusa", "dflash": "dflash"}[head_type]
        # Medusa proposes one token per head, DFlash block_size - 1 (slot 0 is the committed token)
        tokens = cfg["block_size"] - 1 if head_type == "dflash" else cfg.get("num_heads", 5)
        spec = json.dumps({"method": method, "model": str(out), "num_speculative_tokens": tokens})
        return f"vllm serve {target} --speculative-config '{spec}'"
    if fmt == "sglang" and head_type == "dflash":
        return (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
                f"--speculative-draft-model-path {out} --speculative-num-draft-tokens {cfg['block_size']}")
    if fmt == "sglang":
        algorithm = "EAGLE3" if head_type == "eagle3" else "EAGLE"
        return (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {algorithm} "
                f"--speculative-draft-model-path {out} --speculative-num-steps 5 --speculative-eagle-topk 8 "
                f"--speculative-num-draft-tokens 32")
    if fmt == "eagle":
        return (f"python -c \"from eagle.model.ea_model import EaModel; EaModel.from_pretrained("
                f"base_model_path='{target}', ea_model_path='{out}', use_eagle3={head_type == 'eagle3'}, "
                f"total_token=-1)\"")
    return f"python -m medusa.inference.cli --model {out}"


NOTES = {
    ("eagle3", "vllm"): "Tapped layers: top-level `eagle_aux_hidden_state_layer_ids`, HF hidden_states indices "
    "(inputs of those decoder layers), as vLLM reads them. Do not serve the `--to sglang` export with vLLM: from "
    "0.33 vLLM falls back to `eagle_config`'s ids without SGLang's +1 and would tap the wrong layers.",
    ("eagle3", "sglang"): "Tapped layers: `eagle_config.eagle_aux_hidden_state_layer_ids`, layer-output indices "
    "(SGLang captures id + 1), one less than specgraft's HF indices.",
    ("eagle3", "eagle"): "The official EAGLE code taps the inputs of layers 2, N//2 and N-3 itself. Older "
    "versions of it read only `pytorch_model.bin`; specgraft never writes pickles, so convert with "
    "`torch.save(safetensors.torch.load_file('model.safetensors'), 'pytorch_model.bin')` if needed.",
    ("eagle", "vllm"): "vLLM's EAGLE-1 drafter has no fc bias: V1 (every release through 0.33.0) builds fc "
    "without one and drops or rejects `fc.bias`; only the removed V0 engine took one (`eagle_fc_bias`). "
    "This export carries none (the head's bias was zero or absent).",
    ("eagle", "sglang"): "SGLang's EAGLE drafter always has an fc bias (zeros here if the head has none).",
    ("eagle", "eagle"): "`bias` in config.json says whether fc has a bias (the official code defaults it to true). "
    "Older versions of the official code read only `pytorch_model.bin`; specgraft never writes pickles.",
    ("medusa", "vllm"): "Medusa runs on vLLM up to 0.32.x (removed in 0.33.0). `medusa_fc_bias: true` is "
    "required: without it vLLM builds the residual blocks without biases and skips them.",
    ("medusa", "medusa"): "FasterDecoding's own inference code reads `medusa_lm_head.pt`; its training script, TGI "
    "and TensorRT-LLM read `medusa_lm_head.safetensors`. specgraft never writes pickles. vLLM <= 0.32 also "
    "serves this directory (`hidden_size`, `vocab_size` and `medusa_fc_bias` are here for it).",
    ("dflash", "vllm"): "`dflash_config.target_layer_ids` name layer outputs (vLLM captures id + 1), ascending. "
    "No embedding or lm_head: the target's are used. The `--to sglang` export holds the same files.",
    ("dflash", "sglang"): "`dflash_config.target_layer_ids` name layer outputs (SGLang captures id + 1), ascending. "
    "`--speculative-num-draft-tokens` is the block size. No embedding or lm_head: the target's are used. "
    "The `--to vllm` export holds the same files.",
}


def _readme(head_cfg, signature, cfg, fmt, out: Path) -> str:
    return (
        f"# specgraft {head_cfg.type} head, exported for {fmt}\n\n"
        f"Draft head for `{signature['name']}` (hidden {signature['hidden_size']}, vocab {signature['vocab_size']}, "
        f"{signature['num_hidden_layers']} layers). Checked by `specgraft.heads.export.validate_export`.\n\n"
        f"```bash\n{_serve_command(head_cfg.type, fmt, signature['name'], out, cfg)}\n```\n\n"
        f"{NOTES[head_cfg.type, fmt]}\n\n"
        f"Back into specgraft: `specgraft import-head {out} --format {head_cfg.type} OUT --target {signature['name']}`\n"
    )
