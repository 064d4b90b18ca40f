"""Import official EAGLE / EAGLE-3 / Medusa / DFlash checkpoints (and engine exports) as specgraft heads.

Reads ``model.safetensors`` or ``pytorch_model.bin`` (EAGLE), ``model.safetensors``
(DFlash), or ``medusa_lm_head.safetensors`` / ``.pt`` (Medusa), sharded or not; pickles go
through ``torch.load(weights_only=True)``, so a file that needs code execution
to load is refused. Surgery is explicit: each renamed or dropped tensor is
named below, every tensor the head needs must be present with the shape the
target implies, and anything else is an error. The result is saved with
`save_head`, checked against the target it was imported for.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from specgraft.heads.checkpoint import check_target, save_head
from specgraft.heads.configs import DFlashConfig, Eagle3Config, EagleConfig, MedusaConfig
from specgraft.heads.dflash import default_target_layer_ids
from specgraft.heads.eagle import layer_config
from specgraft.heads.eagle3 import default_aux_layers
from specgraft.heads.export import UNSUPPORTED_VARIANTS, dflash_variants
from specgraft.heads.loading import build_head
from specgraft.model import Target
from specgraft.specs import IMPORT_FORMATS

WEIGHT_FILES = {  # in the order the official loaders look for them
    "eagle": ("pytorch_model.bin", "model.safetensors"),
    "eagle3": ("pytorch_model.bin", "model.safetensors"),
    "medusa": ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "model.safetensors", "pytorch_model.bin"),
    "dflash": ("model.safetensors",),
}
DFLASH_BLOCK_SIZE = 16  # z-lab's and SGLang's default when a config names none
# Non-learned buffers some checkpoints carry (old transformers saved RoPE's inv_freq): dropped, recomputed.
DROPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_weights(src: Path, fmt: str) -> tuple[dict[str, torch.Tensor], Path]:
    """All tensors of the first weights file (or shard index) found, and that file."""
    for name in WEIGHT_FILES[fmt]:
        index = src / f"{name}.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [name]
        if all((src / f).is_file() for f in files):
            tensors = {}
            for f in files:
                tensors |= _load_tensors(src / f)
            return tensors, (index if index.is_file() else src / name)
    raise FileNotFoundError(f"{src} holds none of {', '.join(WEIGHT_FILES[fmt])} (or their .index.json shards)")


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return load_file(str(path))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise ValueError(f"{path}: refusing to load a pickle that needs code execution (torch.load weights_only=True "
                         f"rejected it: {reason}); convert it to safetensors where you trust its source") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} is not a flat state dict of tensors")
    return dict(state)


def _check_config(cfg: dict[str, Any], target: Target, num_layers: int, where: str) -> None:
    """The draft layers must be the ones specgraft builds for this target: same sizes, norm eps and RoPE."""
    llama = layer_config(target.config, num_layers)
    ours = {
        "hidden_size": llama.hidden_size, "intermediate_size": llama.intermediate_size,
        "num_attention_heads": llama.num_attention_heads, "num_key_value_heads": llama.num_key_value_heads,
        "head_dim": llama.head_dim, "rms_norm_eps": llama.rms_norm_eps, "vocab_size": target.vocab_size,
        "rope_theta": llama.rope_parameters["rope_theta"], "target_hidden_size": llama.hidden_size,
    }
    wrong = [f"{k}: checkpoint has {cfg[k]!r}, the target implies {v!r}" for k, v in ours.items()
             if cfg.get(k) is not None and cfg[k] != v]
    if cfg.get("hidden_act", "silu") != "silu":
        wrong.append(f"hidden_act: checkpoint has {cfg['hidden_act']!r}, specgraft's draft layers use 'silu'")
    if wrong:
        raise ValueError(f"{where} does not fit target {target.name!r}: " + "; ".join(wrong))


def _check_embedding(tensors: dict[str, torch.Tensor], target: Target, where: str) -> None:
    """A checkpoint may carry a copy of the target's embedding: it must be this target's; then it is dropped."""
    _drop_target_copy(tensors, "embed_tokens.weight", target.model.get_input_embeddings().weight, target, where)


def _drop_target_copy(tensors: dict[str, torch.Tensor], key: str, ours: torch.Tensor, target: Target, where: str) -> None:
    """Pop ``key`` if present, refusing it unless it is ``ours``, the target's own matrix of that name."""
    copy = tensors.pop(key, None)
    if copy is None:
        return
    ours = ours.detach().float().cpu()
    # fp16/bf16 copies differ from a float32 target by rounding, not by 1e-2 relative.
    if copy.shape != ours.shape or not torch.allclose(copy.float(), ours, rtol=1e-2, atol=1e-3):
        raise ValueError(f"{where}: {key} {tuple(copy.shape)} is not target {target.name!r}'s {key.removesuffix('.weight')} "
                         f"{tuple(ours.shape)}: the checkpoint was trained for another target")


def _eagle3_taps(cfg: dict[str, Any], n: int, where: str) -> list[int]:
    """HF hidden_states indices from vLLM's top-level ids (the same), SGLang's eagle_config ids (+ 1) or the default."""
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    from_nested = None if nested is None else [i + 1 for i in nested]  # SGLang / SpecForge name layer outputs
    if top is not None and from_nested is not None and sorted(top) != sorted(from_nested):
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids {top} (vLLM: HF indices) and eagle_config's "
                         f"{nested} (SGLang: layer outputs, HF index - 1) disagree; fix one")
    taps = sorted(top if top is not None else from_nested if from_nested is not None else default_aux_layers(n))
    if len(taps) != 3 or len(set(taps)) != 3 or not all(0 <= t <= n for t in taps):
        raise ValueError(f"{where}: tapped layers {taps} (HF indices) must be 3 distinct layers of the {n}-layer target")
    return taps  # engines concatenate the taps in layer order, so fc's input blocks are ascending


def _refuse_variants(cfg: dict[str, Any], where: str, allowed: tuple[str, ...] = ()) -> None:
    on = [k for k in UNSUPPORTED_VARIANTS if cfg.get(k) and k not in allowed]
    if (cfg.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        on.append("eagle_config.use_aux_hidden_state=false")
    if cfg.get("num_aux_hidden_states", 3) != 3:
        on.append(f"num_aux_hidden_states={cfg['num_aux_hidden_states']}")
    if on:
        raise ValueError(f"{where} uses EAGLE variants specgraft's heads do not implement: {on}")


def _t2d_of(d2t: torch.Tensor, vocab: int) -> torch.Tensor:
    """(V,) bool marking the target ids of the draft vocabulary; empty if d2t is not a map into it."""
    targets = torch.arange(d2t.shape[0]) + d2t.long()
    if targets.min() < 0 or targets.max() >= vocab or targets.unique().numel() != targets.numel():
        return torch.zeros(0, dtype=torch.bool)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[targets] = True
    return t2d


def _import_eagle3(cfg, tensors, target, where) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    _refuse_variants(cfg, where)
    if cfg.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{where}: {cfg['num_hidden_layers']} draft layers; specgraft's EAGLE-3 head has one midlayer")
    _check_config(cfg, target, 1, where)
    # speculators and vLLM-internal checkpoints name the midlayer layers.0.
    tensors = {("midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): t
               for k, t in tensors.items()}
    taps = _eagle3_taps(cfg, target.num_layers, where)
    v = target.vocab_size
    d = tensors["lm_head.weight"].shape[0] if "lm_head.weight" in tensors else v
    if cfg.get("draft_vocab_size", d) != d:
        raise ValueError(f"{where}: draft_vocab_size {cfg['draft_vocab_size']} but lm_head.weight has {d} rows")
    if "d2t" not in tensors:
        if d != v:
            raise ValueError(f"{where}: a draft vocabulary of {d} < {v} tokens needs d2t (draft id -> target id offsets)")
        tensors["d2t"] = torch.zeros(d, dtype=torch.long)  # the identity map
    t2d = _t2d_of(tensors["d2t"], v)
    if t2d.numel() == 0:
        raise ValueError(f"{where}: d2t maps draft ids outside the target vocabulary, or two to one target id")
    if "t2d" in tensors and not torch.equal(tensors["t2d"].bool(), t2d):
        raise ValueError(f"{where}: t2d does not mark exactly the target ids d2t maps to")
    tensors["t2d"] = t2d  # derived from d2t when absent (vLLM and SGLang never read it)
    return Eagle3Config(aux_layers=taps, draft_vocab_size=d), tensors


def _import_eagle(cfg, tensors, target, where) -> tuple[EagleConfig, dict[str, torch.Tensor]]:
    _refuse_variants(cfg, where, allowed=("bias",))  # the official EAGLE-1 "bias" is fc's
    num_layers = cfg.get("num_hidden_layers", 1)
    _check_config(cfg, target, num_layers, where)
    return EagleConfig(num_layers=num_layers, fc_bias="fc.bias" in tensors), tensors


def _import_medusa(cfg, tensors, target, where) -> tuple[MedusaConfig, dict[str, torch.Tensor]]:
    heads = cfg.get("medusa_num_heads", cfg.get("num_heads"))
    layers = cfg.get("medusa_num_layers", cfg.get("num_hidden_layers", 1))
    if heads is None:
        raise ValueError(f"{where}: config.json names no head count (medusa_num_heads or num_heads)")
    tensors = {k.removeprefix("medusa_heads."): t for k, t in tensors.items()}  # a prefix vLLM also strips
    if any(re.match(r"\d+\.\d+\.", k) for k in tensors):
        # FasterDecoding layout: head i is Sequential(ResBlock x layers, Linear): {i}.{l}.linear.* and {i}.{layers}.weight
        renamed = {}
        for k, t in tensors.items():
            m = re.fullmatch(r"(\d+)\.(\d+)\.(linear\.)?(weight|bias)", k)
            if m and m[3]:
                renamed[f"blocks.{m[1]}.layers.{m[2]}.{m[4]}"] = t
            elif m and int(m[2]) == layers and m[4] == "weight":
                renamed[f"lm_heads.{m[1]}.weight"] = t
            else:
                renamed[k] = t  # left for the unexpected-key check to name
        tensors = renamed
    elif not any(k.endswith(".bias") for k in tensors) and not cfg.get("medusa_fc_bias", False):
        for i in range(heads):  # vLLM layout without medusa_fc_bias: bias-free blocks are zero-bias blocks
            for l in range(layers):
                tensors[f"blocks.{i}.layers.{l}.bias"] = torch.zeros(target.config.hidden_size)
    return MedusaConfig(num_heads=heads, num_layers=layers), tensors


def _refuse_dflash_variants(cfg: dict[str, Any], where: str) -> None:
    """Causal blocks, sliding windows, sinks and the Domino projector change the maths; name the key that asks."""
    dflash = cfg.get("dflash_config") or {}
    on = [f"dflash_config.{k}={dflash[k]!r}" for k in dflash_variants(dflash)]
    on += [f"{k}=true" for k in ("is_causal", "attention_bias") if cfg.get(k)]
    sliding = [t for t in cfg.get("layer_types") or [] if t != "full_attention"]
    if sliding:
        on.append(f"layer_types={sorted(set(sliding))}")
    if cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None:  # Qwen3Config: sliding layers
        on.append(f"use_sliding_window=true with sliding_window={cfg['sliding_window']}")
    if on:
        raise ValueError(f"{where} uses DFlash variants specgraft's head does not implement: {on}")


def _import_dflash(cfg, tensors, target, where) -> tuple[DFlashConfig, dict[str, torch.Tensor]]:
    _refuse_dflash_variants(cfg, where)
    dflash = cfg.get("dflash_config") or {}
    layers = cfg.get("num_hidden_layers", 1)
    _check_config(cfg, target, layers, where)
    n = dflash.get("num_target_layers", cfg.get("num_target_layers"))
    if n is not None and n != target.num_layers:
        raise ValueError(f"{where}: num_target_layers {n}, but target {target.name!r} has {target.num_layers} layers")
    # Layer outputs, as specgraft names them: no shift (each engine adds 1 itself).
    ids = dflash.get("target_layer_ids", cfg.get("target_layer_ids")) or default_target_layer_ids(target.num_layers, layers)
    mask = dflash.get("mask_token_id")
    if not isinstance(mask, int):
        raise ValueError(f"{where}: config.json dflash_config.mask_token_id is {mask!r}; DFlash needs the id its "
                         f"mask slots were trained with (a token string alone cannot be resolved without the tokenizer)")
    sizes = {k: v for k, v in (("dflash_config.block_size", dflash.get("block_size")), ("block_size", cfg.get("block_size")))
             if v is not None}
    if len(set(sizes.values())) > 1:  # SGLang reads dflash_config's, z-lab the top-level one
        raise ValueError(f"{where}: {sizes} disagree; fix one")
    block_size = next(iter(sizes.values()), DFLASH_BLOCK_SIZE)
    # vLLM prefixes every name with "model."; the target's embedding and lm_head are shared, never the head's.
    tensors = {k.removeprefix("model."): t for k, t in tensors.items()}
    _check_embedding(tensors, target, where)
    _drop_target_copy(tensors, "lm_head.weight", target.model.get_output_embeddings().weight, target, where)
    config = DFlashConfig(num_layers=layers, block_size=block_size, target_layer_ids=list(ids), mask_token_id=mask)
    return config, tensors


def import_head(src: str | Path, fmt: str, out_dir: str | Path, target: Target) -> Path:
    """Convert the checkpoint in ``src`` (official layout or an engine export) into a specgraft head in ``out_dir``.

    Args:
        fmt: "eagle" (EAGLE-1/2), "eagle3", "medusa" or "dflash".
        target: the loaded target the head drafts for; its sizes shape the head and are checked.

    Raises:
        FileNotFoundError: no config.json or weights file in ``src``.
        ValueError: a pickle that needs code execution, a config or tensor that does not fit the
            target, a missing or unexpected tensor (each named), or an EAGLE or DFlash variant specgraft lacks.
    """
    src = Path(src)
    if fmt not in IMPORT_FORMATS:
        raise ValueError(f"unknown import format {fmt!r}; expected one of {IMPORT_FORMATS}")
    config_file = src / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} is missing")
    cfg = json.loads(config_file.read_text())
    tensors, weights = read_weights(src, fmt)
    where = f"{weights}"
    if "specgraft_target" in cfg:  # written by specgraft's export: the target it was trained for
        check_target(cfg["specgraft_target"], target, where)
    _check_embedding(tensors, target, where)
    dropped = sorted(k for k in tensors if k.endswith(DROPPED_SUFFIXES))
    for k in dropped:
        del tensors[k]
    build = {"eagle3": _import_eagle3, "eagle": _import_eagle, "medusa": _import_medusa, "dflash": _import_dflash}[fmt]
    head_cfg, tensors = build(cfg, tensors, target, where)
    head = build_head(head_cfg, target)
    expected = head.state_dict()
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    wrong = [f"{k} {tuple(tensors[k].shape)} (the target implies {tuple(expected[k].shape)})"
             for k in sorted(set(expected) & set(tensors)) if tensors[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        raise ValueError(f"{where} does not fit a {fmt} head for target {target.name!r}: missing {missing}, "
                         f"unexpected {unexpected}, wrong shapes {wrong}")
    head.load_state_dict({k: t.to(expected[k].dtype) for k, t in tensors.items()}, strict=True)
    card = f"Imported with `specgraft import-head` from `{src}` ({fmt}, {weights.name})."
    if dropped:
        card += f" Dropped non-learned buffers: {dropped}."
    return save_head(head, out_dir, target, card=card)


# -- command line (wired by specgraft/cli.py) -----------------------------------------------------
