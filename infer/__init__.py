"""The engine: verification, KV commit, stop rules, stats and the decode loop."""

from specgraft.infer.generator import Decoding, GenerationOutput, SpeculativeGenerator, StreamChunk
from specgraft.infer.scheduler import Scheduler
from specgraft.infer.stats import GenerationStats
from specgraft.infer.verify import Acceptance, greedy_accept

__all__ = [
    "Acceptance",
    "Decoding",
    "GenerationOutput",
    "GenerationStats",
    "Scheduler",
    "SpeculativeGenerator",
    "StreamChunk",
    "greedy_accept",
]
