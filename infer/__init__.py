"""The engine: verification, KV commit, stop rules, stats and the decode loop."""

from specgraft.infer.generator import Decoding, GenerationOutput, SpeculativeGenerator, StreamChunk
from specgraft.infer.sampling import SamplingPolicy
from specgraft.infer.scheduler import Scheduler
from specgraft.infer.stats import GenerationStats, percentile
from specgraft.infer.stopping import StopRule
from specgraft.infer.verify import Acceptance, greedy_accept

__all__ = [
    "Acceptance",
    "Decoding",
    "GenerationOutput",
    "GenerationStats",
    "SamplingPolicy",
    "Scheduler",
    "SpeculativeGenerator",
    "StopRule",
    "StreamChunk",
    "greedy_accept",
    "percentile",
]
