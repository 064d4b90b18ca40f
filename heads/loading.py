"""Loading drafters: a head from its config or directory, any drafter from a spec (`specgraft.specs`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from torch import nn

from specgraft.heads.base import Drafter
from specgraft.heads.checkpoint import SIDECAR, check_target, read_head_config, read_head_dir
from specgraft.heads.composite import Composite
from specgraft.heads.configs import (
    LOSS_FIELDS, DFlashConfig, DistillConfig, Eagle3Config, EagleConfig, HeadConfig, MedusaConfig,
)
from specgraft.heads.dflash import DFlashDrafter, DFlashHead
from specgraft.heads.distill import DistilledDraft
from specgraft.heads.draft_model import DraftModel
from specgraft.heads.eagle import EagleHead
from specgraft.heads.eagle3 import Eagle3Head
from specgraft.heads.feature_drafter import FeatureDrafter
from specgraft.heads.layer_skip import LayerSkip
from specgraft.heads.medusa import MedusaDrafter, MedusaHeads
from specgraft.heads.prompt_lookup import PromptLookup
from specgraft.model import Target
from specgraft.specs import (
    CompositeSpec, DirectorySpec, DrafterSpec, LayerSkipSpec, NoDrafter, PromptLookupSpec, SelfSpec, check_drafter,
)


def build_head(config: MedusaConfig | EagleConfig | Eagle3Config | DFlashConfig | DistillConfig, target: Target) -> nn.Module:
    """A fresh trainable head for ``target`` (the builder receives the frozen target; it loads nothing)."""
    if isinstance(config, MedusaConfig):
        return MedusaHeads.for_target(config, target)
    if isinstance(config, EagleConfig):
        return EagleHead(config, target)
    if isinstance(config, Eagle3Config):
        return Eagle3Head(config, target)
    if isinstance(config, DFlashConfig):
        return DFlashHead(config, target)
    if isinstance(config, DistillConfig):
        return DistilledDraft(config, target)
    raise TypeError(f"unknown head config {type(config).__name__}")


def load_head(path: str | Path, target: Target) -> nn.Module:
    """A trained head module from a head directory, checked against ``target``."""
    config, signature, tensors = read_head_dir(path)
    check_target(signature, target, f"head {path}")
    head = build_head(config, target)
    missing, unexpected = head.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"{Path(path) / 'model.safetensors'} does not fit this {config.type} head: missing {missing}, unexpected {unexpected}")
    # In the target's dtype: a bf16 target's features, embeddings and output layer need no cast a call (the
    # output layer, shared with the target, would otherwise be copied whole at every draft level)
    return head.to(device=target.device, dtype=target.dtype).eval()


def load_head_weights(head: nn.Module, path: str | Path, target: Target, *, where: str) -> None:
    """Copy into ``head`` the weights of the head saved in ``path``, after checking that it is the same head.

    For fine-tuning (``training.init_from``): ``head`` is built from this run's config for ``target``, so
    the saved head must have its type and shape (`check_same_head`) and have been trained for ``target``.
    Persistent buffers come with the weights: EAGLE-3's draft vocabulary is the saved head's.

    Args:
        where: how errors name ``path``, e.g. ``training.init_from='runs/a/best'``.

    Raises:
        FileNotFoundError: ``path`` or one of its files is missing.
        ValueError: a head of another type or shape, or one trained for another target, naming the fields.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{where}: head directory {path} does not exist")
    distilled = (path / SIDECAR).is_file()  # a distilled draft: a transformers model directory and the sidecar
    if distilled:
        config, signature = read_head_config(path / SIDECAR)
    else:
        config, signature, tensors = read_head_dir(path)
    check_target(signature, target, where)
    check_same_head(config, head.config, where)
    if distilled:
        from transformers import AutoModelForCausalLM

        # from_pretrained restores what save_pretrained leaves out (a tied output layer) and reads shards
        tensors = {f"model.{k}": v for k, v in AutoModelForCausalLM.from_pretrained(path).state_dict().items()}
    missing, unexpected = head.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{where}: its weights do not fit this {config.type} head: missing {missing}, unexpected {unexpected}"
        )


def check_same_head(saved: HeadConfig, built: HeadConfig, where: str) -> None:
    """Raise naming every field in which the head config ``saved`` (at ``where``) differs from ``built``.

    Fields in `LOSS_FIELDS` only weigh the training loss, so a fine-tune may change them; the others decide
    the shapes or the meaning of the weights (sizes, depths, taps, the draft vocabulary's size).
    """
    if saved.type != built.type:
        raise ValueError(
            f"{where} holds a head of type {saved.type!r}, and this config's head.type is {built.type!r}: "
            "fine-tuning starts from a head of the same type"
        )
    theirs, ours = dataclasses.asdict(saved), dataclasses.asdict(built)
    wrong = [
        f"head.{k}: {theirs[k]!r} in the saved head, {v!r} in this config"
        for k, v in ours.items() if k not in LOSS_FIELDS and theirs[k] != v
    ]
    if wrong:
        free = sorted(LOSS_FIELDS & ours.keys())
        raise ValueError(
            f"{where} holds a {saved.type} head of another shape: " + "; ".join(wrong)
            + " (set them as the saved head has them" + (f"; only {', '.join(free)} may differ)" if free else ")")
        )


def check_new_version(head: nn.Module, new: nn.Module) -> None:
    """Raise unless ``new`` may replace the drafting head ``head`` between two steps (a drafter's ``adopt``): a head of
    its type and shape (`check_same_head`, naming the fields) that reads the same target layers, so the states its
    drafter's generations hold and the draft cache rows a scheduler allocated for it fit the new head too."""
    check_same_head(new.config, head.config, "the new head")
    if tuple(new.hidden_layers) != tuple(head.hidden_layers):
        raise ValueError(f"the new head reads target layers {list(new.hidden_layers)}, this one "
                         f"{list(head.hidden_layers)}")


def as_drafter(head: nn.Module, target: Target) -> Drafter:
    """The drafter view of a trainable head module (shares its weights)."""
    if isinstance(head, MedusaHeads):
        return MedusaDrafter(head, target)
    if isinstance(head, (EagleHead, Eagle3Head)):
        return FeatureDrafter(head, target)
    if isinstance(head, DFlashHead):
        return DFlashDrafter(head, target)
    if isinstance(head, DistilledDraft):
        return DraftModel(Target(head.model, target.tokenizer, "distilled draft"), target)
    raise TypeError(f"{type(head).__name__} is not a drafter")


def load_drafter(path: str | Path, target: Target) -> Drafter:
    """Any drafter directory: a specgraft head (Medusa, EAGLE, EAGLE-3, DFlash), a distilled draft model,
    or any other transformers causal LM sharing the target's vocabulary (an independent draft)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"drafter directory {path} does not exist")
    if (path / SIDECAR).is_file():  # a distilled draft: a transformers model directory
        check_target(json.loads((path / SIDECAR).read_text())["target"], target, f"draft model {path}")
        return DraftModel(path, target)
    config = path / "config.json"
    try:
        raw = json.loads(config.read_text()) if config.is_file() else {}
    except json.JSONDecodeError as err:
        raise ValueError(f"{config} is not valid JSON ({err})") from None
    if "model_type" in raw and "head" not in raw:
        return DraftModel(path, target)  # a transformers causal LM trained elsewhere
    return as_drafter(load_head(path, target), target)


def drafter_from_spec(spec: str | DrafterSpec, target: Target) -> Drafter | None:
    """The drafter a spec names (`specgraft.specs` has the grammar): None for ``none``; a `Composite` for
    ``prompt-lookup[:K]+X`` (the lookup takes one match, so the tree keeps the size its policy gives it).

    Raises:
        ValueError: a malformed spec. FileNotFoundError: a drafter directory it names is missing.
    """
    spec = check_drafter(spec)
    if isinstance(spec, NoDrafter):
        return None
    if isinstance(spec, PromptLookupSpec):
        return PromptLookup()
    if isinstance(spec, SelfSpec):
        return DraftModel(target, target)
    if isinstance(spec, LayerSkipSpec):
        return LayerSkip(target, skip=list(spec.skip))
    if isinstance(spec, CompositeSpec):
        return Composite(PromptLookup(max_matches=1), drafter_from_spec(spec.then, target), first_depth=spec.first_depth)
    assert isinstance(spec, DirectorySpec), spec
    return load_drafter(spec.path, target)
