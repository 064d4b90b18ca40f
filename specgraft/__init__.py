"""specgraft: lossless speculative decoding with trained draft heads and tree verification.

    import specgraft as sg
    target = sg.load_target("path/or/hub-id")
    gen = sg.SpeculativeGenerator(target, sg.PromptLookup(), tree=sg.Chain(depth=5))
    print(gen.generate("Once upon a time", max_new_tokens=64).text)

The names below load on first use (PEP 562), so `import specgraft.cli` and
`specgraft --help` do not pay for torch and transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specgraft.lazy import lazy_exports

if TYPE_CHECKING:
    from specgraft.heads import Composite, DraftModel, Drafter, LayerSkip, PromptLookup, load_drafter, search_layer_skip
    from specgraft.infer import (
        Failed, Finished, GenerationOutput, GenerationStats, Scheduler, SpeculativeGenerator, StreamChunk, Tokens,
        lossy_typical_accept, sample_accept,
    )
    from specgraft.model import KVCache, Target, load_target
    from specgraft.tree import Adaptive, Chain, DynamicTree, Sampling, StaticTree, Tree, parse_tree_spec

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    **dict.fromkeys(
        ("Composite", "DraftModel", "Drafter", "LayerSkip", "PromptLookup", "load_drafter", "search_layer_skip"),
        "specgraft.heads",
    ),
    **dict.fromkeys(
        ("Failed", "Finished", "GenerationOutput", "GenerationStats", "Scheduler", "SpeculativeGenerator", "StreamChunk",
         "Tokens", "lossy_typical_accept", "sample_accept"),
        "specgraft.infer",
    ),
    **dict.fromkeys(("KVCache", "Target", "load_target"), "specgraft.model"),
    **dict.fromkeys(("Adaptive", "Chain", "DynamicTree", "Sampling", "StaticTree", "Tree", "parse_tree_spec"), "specgraft.tree"),
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
