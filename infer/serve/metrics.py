"""What `specgraft serve` exposes at /metrics (Prometheus text): load, tokens, target calls, tau, latencies,
the engine's steps and verification forwards, vLLM's spec-decode counters, and the KV pool's size.

The step counts come from the scheduler's step-observer hook (`specgraft.infer.observer`), as any observer's do."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specgraft.infer.observer import Committed, Drafted, Stepped, Verified
from specgraft.infer.scheduler import Scheduler
from specgraft.infer.serve.engine import EngineObserver
from specgraft.infer.stats import GenerationStats

# Buckets for TTFT and inter-token latency: from a tiny model's sub-millisecond steps up to a queued request's seconds.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SELECTED_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)  # draft tokens kept in a step: none (plain) up to a big batch


class Metrics(EngineObserver):
    """Prometheus metrics in a registry of this server's own (two servers in one process never mix).

    The spec-decode counters carry vLLM's names (``vllm:spec_decode_num_drafts`` ...) under our prefix:
    a draft is one row's step that verified at least one draft token; accepted tokens per position
    count the drafts whose accepted path reached that depth (label ``position``, from 0).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._calls, self._committed = 0, 0.0  # totals behind the tau gauge
        r = self.registry
        self.requests = Counter("specgraft_requests", "Requests by HTTP status (499: client went away)", ["status"], registry=r)
        self.generated = Counter("specgraft_generated_tokens", "Tokens generated", registry=r)
        self.target_calls = Counter("specgraft_target_calls", "Target forward passes per generation, prefill included",
                                    registry=r)
        self.decode_calls = Counter("specgraft_decode_target_calls", "Verification steps per generation (after prefill)",
                                    registry=r)
        self.committed_tokens = Counter("specgraft_committed_tokens", "Tokens committed by those decode passes",
                                        registry=r)
        self.mean_accepted = Gauge("specgraft_mean_accepted_length", "Committed tokens per decode target call (tau)", registry=r)
        self.running = Gauge("specgraft_running_sequences", "Generations holding cache rows", registry=r)
        self.queued = Gauge("specgraft_queued_sequences", "Generations waiting for a row", registry=r)
        self.ttft = Histogram("specgraft_time_to_first_token_seconds", "Time to first token, queueing included",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specgraft_inter_token_latency_seconds", "Step time / tokens the step committed",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.steps = Counter("specgraft_engine_steps", "Engine steps that advanced running generations", registry=r)
        self.verify_forwards = Counter(
            "specgraft_engine_verify_forwards",
            "Target forwards that verified drafts: one per step on the fast path, one per row on Hugging Face's forward",
            registry=r,
        )
        self.drafts = Counter("specgraft_spec_decode_num_drafts", "Row steps that verified draft tokens", registry=r)
        self.draft_tokens = Counter("specgraft_spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.accepted_tokens = Counter("specgraft_spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_per_position = Counter(
            "specgraft_spec_decode_num_accepted_tokens_per_pos", "Drafts whose accepted path reached this depth",
            ["position"], registry=r,
        )
        self.adaptive_selected = Histogram(
            "specgraft_adaptive_selected_draft_tokens", "Draft tokens the goodput controller kept for verification "
            "in a step, over every adaptive row", buckets=SELECTED_BUCKETS, registry=r,
        )
        self.kv_pool_bytes = Gauge("specgraft_kv_pool_bytes", "Bytes of the target's KV pool, allocated at start",
                                   registry=r)
        self.draft_pool_bytes = Gauge("specgraft_draft_pool_bytes", "Bytes of the batch drafters' draft KV pools",
                                      registry=r)
        # Heads that learn while serving (serve --learn): each version's number, held-out tau and live acceptance
        self.head_version = Gauge("specgraft_head_version", "The version a learning drafter drafts with (0: as loaded)",
                                  ["drafter"], registry=r)
        self.head_heldout_tau = Gauge("specgraft_head_heldout_simulated_tau", "Simulated tau of that version on the "
                                      "held-out recorded traffic, as its learner measured it", ["drafter"], registry=r)
        self.version_draft_tokens = Counter("specgraft_head_draft_tokens", "Draft tokens verified, by drafter version",
                                            ["drafter", "version"], registry=r)
        self.version_accepted_tokens = Counter("specgraft_head_accepted_tokens", "Draft tokens accepted, by drafter "
                                               "version", ["drafter", "version"], registry=r)
        self._versions: dict[str, int] = {}  # learning drafter -> its version
        self._drafter_of: dict[int, str] = {}  # the last step's rows of learning drafters: handle -> drafter

    def started(self, scheduler: Scheduler) -> None:
        self.kv_pool_bytes.set(scheduler.pool_bytes)
        self.draft_pool_bytes.set(scheduler.draft_pool_bytes)

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
        self.committed_tokens.inc(committed)
        self._calls += stats.target_calls  # only the engine thread reports finished generations
        self._committed += committed
        self.mean_accepted.set(self._committed / self._calls if self._calls else 0.0)

    def load(self, running: int, queued: int) -> None:
        self.running.set(running)
        self.queued.set(queued)

    def adopted(self, name: str, version: int, heldout_tau: float | None) -> None:
        self._versions[name] = version
        self.head_version.labels(name).set(version)
        if heldout_tau is not None:
            self.head_heldout_tau.labels(name).set(heldout_tau)

    def learning(self, name: str) -> None:
        """Count ``name``'s acceptance by version from now on (version 0: the head it was loaded with)."""
        self.adopted(name, self._versions.get(name, 0), None)

    # ------------------------------------------------------------------ the scheduler's steps (engine thread)

    def drafted(self, step: Drafted) -> None:
        if step.selected is not None:
            self.adaptive_selected.observe(step.selected)
        if self._versions:
            self._drafter_of = {r.handle: r.drafter_name for r in step.rows if r.drafter_name in self._versions}

    def verified(self, step: Verified) -> None:
        if step.forwards:
            self.verify_forwards.inc(step.forwards)

    def committed(self, step: Committed) -> None:
        """vLLM's spec-decode counters, summed over the step's rows first (one increment a metric a step)."""
        drafts = draft_tokens = accepted = 0
        reached: list[int] = []  # [i]: drafts whose accepted path reached depth i + 1
        for row in step.rows:
            if not row.draft_tokens:  # not a draft: its root alone
                continue
            learner = self._drafter_of.get(row.handle) if self._versions else None
            if learner is not None:
                version = str(self._versions[learner])
                self.version_draft_tokens.labels(learner, version).inc(row.draft_tokens)
                self.version_accepted_tokens.labels(learner, version).inc(row.accepted)
            drafts += 1
            draft_tokens += row.draft_tokens
            accepted += row.accepted
            reached += [0] * (row.accepted - len(reached))
            for i in range(row.accepted):
                reached[i] += 1
        if not drafts:
            return
        self.drafts.inc(drafts)
        self.draft_tokens.inc(draft_tokens)
        if accepted:
            self.accepted_tokens.inc(accepted)
        for position, count in enumerate(reached):
            self.accepted_per_position.labels(str(position)).inc(count)

    def stepped(self, step: Stepped) -> None:
        self.steps.inc()
