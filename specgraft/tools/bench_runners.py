"""The offline bench's methods: our engine, and transformers' generate timed the way we time ourselves.

A `Runner` is one benchmarked method; `baseline_runner` builds the baselines
``--baselines`` names (plain decoding, HF greedy, HF prompt lookup, HF
assisted generation).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from transformers.generation.streamers import BaseStreamer

from specgraft.heads import Drafter
from specgraft.infer import GenerationStats, SpeculativeGenerator, percentile
from specgraft.model import Target, load_model
from specgraft.specs import BASELINE_KINDS
from specgraft.tree import TreePolicy

STATS_KEYS = tuple(f.name for f in dataclasses.fields(GenerationStats))
# What a streamer can see of HF generate: chunk sizes and their times. Not draft tokens, not the KV cache.
HF_NOT_MEASURED = ("draft_tokens_per_token", "kv_cache_tokens_peak")
# HF prompt lookup: tokens copied per match. 10 is the value in transformers' docs and the PLD paper's repo.
HF_PLD_NUM_TOKENS = 10
# Neutral values for the generation_config fields that change greedy output, so a model's shipped
# defaults (e.g. repetition_penalty=1.05 in some instruct models) cannot make HF differ from plain argmax.
HF_GREEDY = dict(do_sample=False, repetition_penalty=1.0, no_repeat_ngram_size=0, min_length=0, min_new_tokens=0)


def hf_sampling(temperature: float) -> dict[str, Any]:
    """HF ``generate`` options that sample from the same distribution as our ``temperature=`` alone.

    ``top_k=0`` and ``top_p=1.0`` switch off the filters a model's generation_config may ship
    (transformers' own default is top_k=50), so every method draws from softmax(logits / T).
    """
    if temperature <= 0:
        return dict(HF_GREEDY)
    return {**HF_GREEDY, "do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0, "min_p": None}


@dataclass
class Runner:
    """One benchmarked method: ``generate(prompt_ids, max_new_tokens) -> (new token ids, stats dict)``.

    ``measured`` names the stats keys the method really measures; the others are None.
    """

    name: str
    generate: Callable[[list[int], int], tuple[list[int], dict[str, Any]]]
    source: str = "specgraft"
    measured: tuple[str, ...] = STATS_KEYS
    generator: SpeculativeGenerator | None = None  # our engine's, whose steps the bench also counts


def engine_runner(
    name: str, target: Target, drafter: Drafter | None, tree: TreePolicy | None, temperature: float = 0.0
) -> Runner:
    """Our engine with a drafter (None: plain decoding, one target call per token); greedy at temperature 0."""
    gen = SpeculativeGenerator(target, drafter, tree=tree)

    def generate(ids: list[int], max_new_tokens: int) -> tuple[list[int], dict[str, Any]]:
        out = gen.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature)
        return out.token_ids, out.stats.to_dict()

    return Runner(name, generate, generator=gen)


class ChunkClock(BaseStreamer):
    """A `generate` streamer that stamps each chunk of new tokens, to measure HF the way we measure ourselves.

    transformers streams the prompt once, then the tokens of each target
    forward as one chunk (one token for greedy search, accepted drafts plus
    one for assisted decoding), so chunk sizes are tokens per target call.
    Cost: one clock read and one append per chunk.
    """

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.prompt_seen = False
        self.times: list[float] = []
        self.sizes: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.sizes.append(int(value.numel()))

    def end(self) -> None:
        pass

    def stats(self, new_tokens: int) -> dict[str, Any]:
        """GenerationStats keys by our definitions; the first chunk is HF's prefill call."""
        if not self.sizes:
            return {**GenerationStats(new_tokens=new_tokens).to_dict(), **dict.fromkeys(HF_NOT_MEASURED)}
        after = self.sizes[1:]  # tokens of each target call after the prefill call
        histogram = [0] * max(after, default=0)
        for n in after:
            histogram[n - 1] += 1
        latencies: list[float] = []
        for i, n in enumerate(after, start=1):
            latencies.extend([(self.times[i] - self.times[i - 1]) / n] * n)
        latencies = sorted(latencies) or [0.0]
        decode_time = self.times[-1] - self.times[0]
        return {
            "new_tokens": new_tokens,
            "target_calls": len(after),
            "mean_accepted_length": sum(after) / len(after) if after else None,  # None: no call after the prefill
            "accept_length_histogram": histogram,
            "draft_tokens_per_token": None,
            "ttft_s": self.times[0] - self.start,
            "tokens_per_s": sum(after) / decode_time if decode_time > 0 else 0.0,
            "itl_p50_s": percentile(latencies, 0.5),
            "itl_p99_s": percentile(latencies, 0.99),
            "kv_cache_tokens_peak": None,
            "lossless": True,
        }


def hf_runner(name: str, target: Target, temperature: float = 0.0, **generate_options: Any) -> Runner:
    """transformers' ``generate`` on the target's model, timed by a `ChunkClock`; greedy at temperature 0."""
    model = target.model
    pad = model.generation_config.pad_token_id
    if pad is None and target.eos_token_ids:
        generate_options.setdefault("pad_token_id", target.eos_token_ids[0])  # silences HF's per-call warning

    @torch.inference_mode()
    def generate(ids: list[int], max_new_tokens: int) -> tuple[list[int], dict[str, Any]]:
        input_ids = torch.tensor([ids], device=target.device)
        clock = ChunkClock()
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
            streamer=clock, **hf_sampling(temperature), **generate_options,
        )
        tokens = out[0, len(ids):].tolist()
        return tokens, clock.stats(len(tokens))

    measured = tuple(k for k in STATS_KEYS if k not in HF_NOT_MEASURED)
    return Runner(name, generate, source="transformers", measured=measured)


def parse_baseline(spec: str) -> tuple[str, str | None]:
    """(kind, assistant path) of one ``--baselines`` entry; errors name the entry and the choices."""
    kind, sep, arg = spec.strip().partition(":")
    if kind == "hf-assisted":
        if not arg:
            raise ValueError(f"baseline {spec!r}: hf-assisted needs a model directory, as 'hf-assisted:PATH'")
        if not Path(arg).expanduser().is_dir():
            raise FileNotFoundError(f"baseline {spec!r}: assistant model directory {arg!r} does not exist")
        return kind, arg
    if kind in ("plain", "hf", "hf-pld") and not sep:
        return kind, None
    raise ValueError(f"unknown baseline {spec!r}: choose from {', '.join(BASELINE_KINDS)}")


def drafter_label(path: Path) -> str:
    """A drafter directory's name; a training run's ``RUN/head`` is called after the run."""
    path = path.expanduser().resolve()
    return path.parent.name if path.name == "head" else path.name


def baseline_runner(spec: str, target: Target, temperature: float = 0.0) -> Runner:
    """The runner of one baseline spec (see `parse_baseline`); the assistant model loads here."""
    kind, path = parse_baseline(spec)
    if kind == "plain":
        return engine_runner("plain", target, None, None, temperature)
    if kind == "hf":
        return hf_runner("hf", target, temperature)
    if kind == "hf-pld":
        return hf_runner("hf-pld", target, temperature, prompt_lookup_num_tokens=HF_PLD_NUM_TOKENS)
    assistant = load_model(path, dtype=target.dtype, device=target.device, role="assistant model")
    if assistant.vocab_size != target.vocab_size:
        raise ValueError(
            f"baseline {spec!r}: the assistant's vocabulary ({assistant.vocab_size}) differs from the target's "
            f"({target.vocab_size}); HF assisted generation is benchmarked with a shared tokenizer only"
        )
    return hf_runner(f"hf-assisted:{drafter_label(Path(path))}", target, temperature, assistant_model=assistant.model)
