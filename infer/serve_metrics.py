"""What `specgraft serve` exposes at /metrics (Prometheus text): load, tokens, target calls, tau, latencies."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specgraft.infer.engine import EngineObserver
from specgraft.infer.stats import GenerationStats

# Buckets for TTFT and inter-token latency: from a tiny model's sub-millisecond steps up to a queued request's seconds.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics(EngineObserver):
    """Prometheus metrics in a registry of this server's own (two servers in one process never mix)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._calls, self._committed = 0, 0.0  # totals behind the tau gauge
        r = self.registry
        self.requests = Counter("specgraft_requests", "Requests by HTTP status (499: client went away)", ["status"], registry=r)
        self.generated = Counter("specgraft_generated_tokens", "Tokens generated", registry=r)
        self.target_calls = Counter("specgraft_target_calls", "Target forward passes, prefill included", registry=r)
        self.decode_calls = Counter("specgraft_decode_target_calls", "Target forward passes after prefill", registry=r)
        self.committed = Counter("specgraft_committed_tokens", "Tokens committed by those decode passes", registry=r)
        self.mean_accepted = Gauge("specgraft_mean_accepted_length", "Committed tokens per decode target call (tau)", registry=r)
        self.running = Gauge("specgraft_running_sequences", "Generations holding cache rows", registry=r)
        self.queued = Gauge("specgraft_queued_sequences", "Generations waiting for a row", registry=r)
        self.ttft = Histogram("specgraft_time_to_first_token_seconds", "Time to first token, queueing included",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specgraft_inter_token_latency_seconds", "Step time / tokens the step committed",
                             buckets=LATENCY_BUCKETS, registry=r)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def tokens(self, count: int, seconds_each: float) -> None:
        for _ in range(count):
            self.itl.observe(seconds_each)

    def finished(self, stats: GenerationStats) -> None:
        self.generated.inc(stats.new_tokens)
        self.target_calls.inc(stats.target_calls + 1)
        self.decode_calls.inc(stats.target_calls)
        committed = stats.mean_accepted_length * stats.target_calls
        self.committed.inc(committed)
        self._calls += stats.target_calls  # only the engine thread reports finished generations
        self._committed += committed
        self.mean_accepted.set(self._committed / self._calls if self._calls else 0.0)

    def load(self, running: int, queued: int) -> None:
        self.running.set(running)
        self.queued.set(queued)
