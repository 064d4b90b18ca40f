"""Drafters: anything that proposes candidate trees for the target to verify.

Trainable heads are built from a typed config with `build_head`, saved with
`save_head`, and loaded for generation with `load_drafter` (`heads/loading.py`).

The names below load on first use (PEP 562): `specgraft.heads.configs`, which a
config file's validation reads, imports no torch.
"""

from __future__ import annotations

from specgraft.lazy import lazy_exports

# public name -> the module that defines it
_EXPORTS = {
    **dict.fromkeys(('Drafter', 'TrainBatch', 'TrainableHead'), "specgraft.heads.base"),
    **dict.fromkeys(('SIDECAR', 'check_target', 'read_head_dir', 'save_head'), "specgraft.heads.checkpoint"),
    "Composite": "specgraft.heads.composite",
    **dict.fromkeys(('DFlashConfig', 'DistillConfig', 'Eagle3Config', 'EagleConfig', 'HeadConfig', 'MedusaConfig'), "specgraft.heads.configs"),
    **dict.fromkeys(('DFlashDrafter', 'DFlashHead'), "specgraft.heads.dflash"),
    "DistilledDraft": "specgraft.heads.distill",
    "DraftModel": "specgraft.heads.draft_model",
    **dict.fromkeys(('EagleDrafter', 'EagleHead'), "specgraft.heads.eagle"),
    **dict.fromkeys(('Eagle3Drafter', 'Eagle3Head'), "specgraft.heads.eagle3"),
    **dict.fromkeys(('export_head', 'validate_export'), "specgraft.heads.export"),
    "FeatureDrafter": "specgraft.heads.feature_drafter",
    "import_head": "specgraft.heads.importer",
    "LayerSkip": "specgraft.heads.layer_skip",
    **dict.fromkeys(('LayerSkipSearch', 'search_layer_skip'), "specgraft.heads.layer_skip_search"),
    **dict.fromkeys(('as_drafter', 'build_head', 'drafter_from_spec', 'load_drafter', 'load_head', 'load_head_weights'), "specgraft.heads.loading"),
    **dict.fromkeys(('MedusaDrafter', 'MedusaHeads'), "specgraft.heads.medusa"),
    "PromptLookup": "specgraft.heads.prompt_lookup",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


__all__ = [
    "Composite",
    "DFlashConfig",
    "DFlashDrafter",
    "DFlashHead",
    "DistilledDraft",
    "DraftModel",
    "Drafter",
    "Eagle3Drafter",
    "Eagle3Head",
    "EagleConfig",
    "EagleDrafter",
    "EagleHead",
    "FeatureDrafter",
    "HeadConfig",
    "LayerSkip",
    "LayerSkipSearch",
    "MedusaDrafter",
    "MedusaHeads",
    "PromptLookup",
    "TrainBatch",
    "TrainableHead",
    "as_drafter",
    "build_head",
    "drafter_from_spec",
    "export_head",
    "import_head",
    "load_drafter",
    "load_head",
    "load_head_weights",
    "save_head",
    "search_layer_skip",
    "validate_export",
]
