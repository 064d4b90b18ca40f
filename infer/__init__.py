"""The engine: one scheduler and its step (verification, KV commit, stop rules, stats), its events.

The HTTP server over it is `specgraft.infer.serve`, which this package never imports."""

from specgraft.infer.adaptive import GoodputController, TreeChoice, interpolate, size_tree
from specgraft.infer.events import Event, Failed, Finished, GenerationOutput, Tokens
from specgraft.infer.generator import SpeculativeGenerator, StreamChunk, per_prompt_options
from specgraft.infer.observer import Admitted, Committed, Drafted, Left, RowCommit, StepObserver, Stepped, Verified
from specgraft.infer.request import PromptIds, check_prompt
from specgraft.infer.scheduler import NO_DRAFTER, EngineCounters, Scheduler
from specgraft.infer.stats import GenerationStats, format_tau, percentile, quartiles
from specgraft.infer.stopping import StopRule
from specgraft.infer.verify import Acceptance, AcceptRule, greedy_accept, is_lossless, lossy_typical_accept, sample_accept

__all__ = [
    "NO_DRAFTER",
    "Acceptance",
    "AcceptRule",
    "Admitted",
    "Committed",
    "Drafted",
    "EngineCounters",
    "Event",
    "Failed",
    "Finished",
    "GenerationOutput",
    "GenerationStats",
    "GoodputController",
    "Left",
    "PromptIds",
    "RowCommit",
    "Scheduler",
    "SpeculativeGenerator",
    "StepObserver",
    "Stepped",
    "StopRule",
    "StreamChunk",
    "Tokens",
    "TreeChoice",
    "Verified",
    "check_prompt",
    "format_tau",
    "greedy_accept",
    "interpolate",
    "is_lossless",
    "lossy_typical_accept",
    "per_prompt_options",
    "percentile",
    "quartiles",
    "sample_accept",
    "size_tree",
]
