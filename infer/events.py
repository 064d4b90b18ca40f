"""What the engine's loop emits: typed events, one kind per thing that happened to a generation.

`Scheduler.step` returns a list of them; `SpeculativeGenerator` turns them
into chunks and outputs, the serving engine into HTTP responses. Nothing
dispatches on a union of lists and stats.
"""

from __future__ import annotations

from dataclasses import dataclass

from specgraft.infer.stats import GenerationStats


@dataclass
class GenerationOutput:
    token_ids: list[int]  # generated ids only, prompt excluded
    text: str  # one full decode of token_ids ("" without a tokenizer)
    stats: GenerationStats


@dataclass
class Tokens:
    """Tokens a generation kept in one step (after stop rules): its prefill's first token, or a verification's.

    ``text``: the text those tokens released, from the generation's incremental
    detokenizer, when it was submitted with ``text=True`` (else "").
    """

    handle: int
    token_ids: list[int]
    text: str = ""


@dataclass
class Finished:
    """The generation ended (budget, end of sequence or stop string): its whole output. Its last event."""

    handle: int
    output: GenerationOutput


@dataclass
class Failed:
    """The generation's own work raised ``error``; it left the batch, the others go on. Its last event."""

    handle: int
    error: Exception


Event = Tokens | Finished | Failed
