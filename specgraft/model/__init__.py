"""How the target runs: the adapter over any Hugging Face causal LM, the lean Llama-family forward, the KV caches.

- `target`: `Target` (the one forward the engine needs), `load_target`, and the
  load-time checks that tree attention and the KV cache are exact.
- `fast_llama`: `FastLlama`, the same maths as Llama, Mistral, Qwen2 and Qwen3
  without Hugging Face's per-call machinery.
- `caches`: `KVCache`, `StaticKVCache` and `BatchedKVCache`, one protocol.
- `small_rows`: which form each weight shape's product takes (F.linear, W @ x.T, packed), measured on this machine.
"""

from specgraft.model.caches import BatchedKVCache, KVCache, StaticKVCache
from specgraft.model.fast_llama import FastLlama, Segment, rms_norm, unsupported_reason
from specgraft.model.small_rows import SmallRowChoice
from specgraft.model.target import (
    CACHE_KEYWORDS,
    TREE_SLOTS,
    ModelOutput,
    Target,
    cache_keyword,
    installed_cache_keyword,
    load_model,
    load_target,
)

__all__ = [
    "CACHE_KEYWORDS",
    "TREE_SLOTS",
    "BatchedKVCache",
    "FastLlama",
    "KVCache",
    "ModelOutput",
    "Segment",
    "SmallRowChoice",
    "StaticKVCache",
    "Target",
    "cache_keyword",
    "installed_cache_keyword",
    "load_model",
    "load_target",
    "rms_norm",
    "unsupported_reason",
]
