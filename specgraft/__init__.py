"""specgraft: lossless speculative decoding with trained draft heads and tree verification.

    import specgraft as sg
    target = sg.load_target("path/or/hub-id")
    gen = sg.SpeculativeGenerator(target, sg.PromptLookup(), tree=sg.Chain(depth=5))
    print(gen.generate("Once upon a time", max_new_tokens=64).text)
"""

from specgraft.heads import DraftModel, Drafter, PromptLookup, load_drafter
from specgraft.infer import GenerationOutput, GenerationStats, SpeculativeGenerator, StreamChunk
from specgraft.target import KVCache, Target, load_target
from specgraft.tree import Chain, DynamicTree, StaticTree, Tree, parse_tree_spec

__version__ = "0.1.0"

__all__ = [
    "Chain",
    "DraftModel",
    "Drafter",
    "DynamicTree",
    "GenerationOutput",
    "GenerationStats",
    "KVCache",
    "PromptLookup",
    "SpeculativeGenerator",
    "StaticTree",
    "StreamChunk",
    "Target",
    "Tree",
    "load_drafter",
    "load_target",
    "parse_tree_spec",
]
