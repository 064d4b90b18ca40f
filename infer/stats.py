"""GenerationStats: what one generation measured, with the keys of every JSON report."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    """See DESIGN.md's table; every field is a key of the JSON reports."""

    new_tokens: int = 0
    target_calls: int = 0  # target forward passes after prefill
    # tau and the histogram count what each verification committed, bonus included, before a stop rule
    # (EOS, stop string) cut the last step: they measure the drafter, not where the text ended.
    # tau: committed tokens per target call; 0.0 where no verification ran (an output of only EOS), so sums weighted
    # by target_calls stay right; reports give `tau` (None there) and print it with `format_tau` ("n/a (no steps)").
    mean_accepted_length: float = 0.0
    accept_length_histogram: list[int] = field(default_factory=list)  # [i] = steps committing i + 1 tokens
    draft_tokens_per_token: float = 0.0
    ttft_s: float = 0.0
    tokens_per_s: float = 0.0  # decode throughput: tokens after the first / time after the first
    itl_p50_s: float = 0.0
    itl_p99_s: float = 0.0
    kv_cache_tokens_peak: int = 0  # target + draft positions at the fullest moment
    lossless: bool = True

    @property
    def tau(self) -> float | None:
        """The mean accepted length, None where no verification step ran: there is no mean of nothing."""
        return self.mean_accepted_length if self.target_calls else None

    def to_dict(self) -> dict:
        """The JSON report's keys; ``mean_accepted_length`` is `tau` (null where no verification step ran)."""
        return {**asdict(self), "mean_accepted_length": self.tau}


NO_STEPS = "n/a (no steps)"  # a mean accepted length where no verification step ran


def format_tau(value: float | None, digits: int = 2) -> str:
    """A mean accepted length as text reports print it: `NO_STEPS` for None (no verification step ran)."""
    return NO_STEPS if value is None else f"{value:.{digits}f}"


class StatsRecorder:
    """Collects per-step events while a generation runs and reduces them to `GenerationStats`."""

    def __init__(self, lossless: bool = True) -> None:
        self.start = time.perf_counter()
        self.lossless = lossless
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.step_started = self.start
        self.new_tokens = 0
        self.step_tokens: list[int] = []
        self.draft_tokens = 0
        self.token_latencies: list[float] = []
        self.kv_peak = 0

    def first_token(self) -> None:
        self.first_token_at = self.last_token_at = time.perf_counter()
        self.new_tokens = 1

    def begin_step(self) -> None:
        self.step_started = time.perf_counter()

    def end_step(self, committed: int, emitted: int, draft_tokens: int, kv_tokens: int) -> None:
        """committed: tokens the step accepted; emitted: those kept after stop rules cut them."""
        now = time.perf_counter()
        self.step_tokens.append(committed)
        self.draft_tokens += draft_tokens
        self.kv_peak = max(self.kv_peak, kv_tokens)
        if emitted:
            # Every token of a step arrives at once: each waited step_time / emitted on average.
            self.token_latencies.extend([(now - self.step_started) / emitted] * emitted)
            self.new_tokens += emitted
            self.last_token_at = now

    def observe_kv(self, kv_tokens: int) -> None:
        self.kv_peak = max(self.kv_peak, kv_tokens)

    def finish(self) -> GenerationStats:
        histogram = [0] * max(self.step_tokens, default=0)
        for n in self.step_tokens:
            histogram[n - 1] += 1
        latencies = sorted(self.token_latencies) or [0.0]
        ttft = (self.first_token_at or time.perf_counter()) - self.start
        decode_time = (self.last_token_at or 0.0) - (self.first_token_at or 0.0)
        return GenerationStats(
            new_tokens=self.new_tokens,
            target_calls=len(self.step_tokens),
            mean_accepted_length=sum(self.step_tokens) / len(self.step_tokens) if self.step_tokens else 0.0,
            accept_length_histogram=histogram,
            draft_tokens_per_token=self.draft_tokens / self.new_tokens if self.new_tokens else 0.0,
            ttft_s=ttft,
            tokens_per_s=(self.new_tokens - 1) / decode_time if decode_time > 0 else 0.0,
            itl_p50_s=percentile(latencies, 0.5),
            itl_p99_s=percentile(latencies, 0.99),
            kv_cache_tokens_peak=self.kv_peak,
            lossless=self.lossless,
        )


def percentile(ordered: list[float], q: float) -> float:
    """Linear-interpolated percentile of a sorted list (numpy's default method)."""
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def quartiles(values: list[float], name: str) -> dict[str, float]:
    """``name``_p25, _p50 and _p75 of ``values`` (any order): a benchmark's paired ratios as it reports them."""
    ordered = sorted(values)
    return {f"{name}_p{round(q * 100)}": percentile(ordered, q) for q in (0.25, 0.5, 0.75)}
