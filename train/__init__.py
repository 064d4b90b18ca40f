"""Training draft heads on a frozen target: data, self-distillation, features, the DeepSpeed loop, evaluation.

Entry points: ``specgraft train CONFIG.yaml`` (one process) and
``deepspeed --num_gpus N --module specgraft.train CONFIG.yaml`` (many).

The names below load on first use (PEP 562): `import specgraft.train.data` does not pay for the trainer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specgraft.lazy import lazy_exports

if TYPE_CHECKING:
    from specgraft.train.data import TokenizedDataset, collate, load_records, train_eval_split
    from specgraft.train.features import target_batch
    from specgraft.train.pipeline import run_feature_extraction, run_regeneration, run_training
    from specgraft.train.regeneration import regenerate

# public name -> the module that defines it
_EXPORTS = {
    **dict.fromkeys(("TokenizedDataset", "collate", "load_records", "train_eval_split"), "specgraft.train.data"),
    "target_batch": "specgraft.train.features",
    **dict.fromkeys(("run_feature_extraction", "run_regeneration", "run_training"), "specgraft.train.pipeline"),
    "regenerate": "specgraft.train.regeneration",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
