"""The serving engine without HTTP: one thread stepping one scheduler, every drafter choice in the same steps."""

from __future__ import annotations

import asyncio

import pytest

import specgraft as sg
from specgraft.infer import Failed, Finished, Tokens, check_prompt
from specgraft.infer.serve import Engine, EngineObserver, Job, Metrics, QueueFull
from specgraft.model import TREE_SLOTS

TOKENS = 12


class PeakLoad(EngineObserver):
    def __init__(self) -> None:
        self.peak_running = 0

    def load(self, running: int, queued: int) -> None:
        self.peak_running = max(self.peak_running, running)


async def collect(job: Job) -> tuple[list[int], Finished | Failed]:
    tokens: list[int] = []
    while True:
        event = await asyncio.wait_for(job.events.get(), 60)
        if not isinstance(event, Tokens):
            return tokens, event
        tokens += event.token_ids


def job(target, prompt, drafter_key: str, drafter, loop, **options) -> Job:
    return Job(drafter_key=drafter_key, drafter=drafter, tree=sg.Chain(4), prompt=check_prompt(target, prompt),
               max_new_tokens=options.pop("max_new_tokens", TOKENS), options=options, loop=loop)


def test_rows_are_capped_over_every_drafter_choice_and_each_output_is_exact(stories, dev_prompts):
    observer = PeakLoad()
    lookup = sg.PromptLookup()
    engine = Engine(stories, {"prompt-lookup": lookup}, max_batch_size=2, max_queue=4, observer=observer)
    choices = [("prompt-lookup", lookup), ("none", None)]
    prompts = dev_prompts[:6]

    async def scenario() -> list[tuple[list[int], Finished | Failed]]:
        loop = asyncio.get_running_loop()
        jobs = [job(stories, p, key, drafter, loop, eos_token_id=()) for p, (key, drafter) in zip(prompts, choices * 3)]
        for j in jobs:  # not started yet: 2 rows + 4 waiting fill it
            engine.submit(j)
        with pytest.raises(QueueFull, match="6 requests in flight"):
            engine.submit(job(stories, [1], "prompt-lookup", lookup, loop, max_new_tokens=1))
        engine.start()
        return [await collect(j) for j in jobs]

    try:
        results = asyncio.run(scenario())
    finally:
        engine.stop()
    assert observer.peak_running == 2
    plain = sg.SpeculativeGenerator(stories, None)
    for prompt, (tokens, end) in zip(prompts, results):
        assert isinstance(end, Finished) and end.output.stats.new_tokens == TOKENS
        assert tokens == plain.generate(prompt, max_new_tokens=TOKENS, eos_token_id=()).token_ids
    counters = engine.scheduler.counters
    # Lookup and plain rows shared every step: one verification forward each, whatever the mix of drafters.
    assert counters.steps > 0 and counters.verify_forwards == counters.steps
    assert engine.in_flight == 0 and engine.scheduler.idle


def test_refused_options_fail_that_job_with_400(stories):
    engine = Engine(stories, max_batch_size=2, max_queue=2)

    async def scenario() -> tuple[list[int], Finished | Failed]:
        j = job(stories, [1, 403], "none", None, asyncio.get_running_loop(), max_new_tokens=4, presence_penalty=0.5)
        engine.start()
        engine.submit(j)
        return await collect(j)

    try:
        tokens, end = asyncio.run(scenario())
    finally:
        engine.stop()
    assert tokens == [] and isinstance(end, Failed)
    assert end.error.status == 400 and "presence_penalty" in str(end.error)


def test_the_kv_pool_is_allocated_once_whatever_the_drafters(stories, trained_eagle):
    eagle = sg.load_drafter(trained_eagle, stories)
    one = Engine(stories, {"prompt-lookup": sg.PromptLookup()}, max_batch_size=4)
    four = Engine(stories, {"prompt-lookup": sg.PromptLookup(), "eagle": eagle, "self": sg.DraftModel(stories, stories),
                            "lookup-eagle": sg.Composite(sg.PromptLookup(), eagle)}, max_batch_size=4)
    layers, heads, dim = stories.num_layers, stories.config.num_key_value_heads, stories.fast.head_dim
    slots = one.scheduler.max_len + TREE_SLOTS
    rows = 4 + stories.capture  # a captured forward's pool keeps a scratch row for its padding
    assert one.scheduler.pool_bytes == four.scheduler.pool_bytes == layers * 2 * rows * heads * slots * dim * 4
    assert one.scheduler.draft_pool_bytes == 0 < four.scheduler.draft_pool_bytes  # the EAGLE head's draft rows
    assert "KV pool: 4 rows" in one.describe() and "draft pools (eagle)" in four.describe()


def test_metrics_read_the_scheduler_steps_from_its_observer_hook_and_agree_with_its_counters(stories, dev_prompts):
    """/metrics' step counts come from the step-observer hook: summed over a run they are the scheduler's own
    counters (what /metrics exported before the hook), and an adaptive row's selections are observed once a step."""
    metrics = Metrics()
    sched = sg.Scheduler(stories, {"prompt-lookup": sg.PromptLookup()}, max_batch_size=2)
    sched.add_observer(metrics)
    trees = (sg.Chain(4), sg.Adaptive(), sg.Chain(2))
    for prompt, tree in zip(dev_prompts, trees):
        sched.submit(prompt, 24, drafter="prompt-lookup", tree=tree, eos_token_id=())
    while not sched.idle:
        sched.step()
    counters = sched.counters
    value = metrics.registry.get_sample_value
    assert value("specgraft_engine_steps_total") == counters.steps
    assert value("specgraft_engine_verify_forwards_total") == counters.verify_forwards
    assert value("specgraft_spec_decode_num_drafts_total") == counters.drafts > 0
    assert value("specgraft_spec_decode_num_draft_tokens_total") == counters.draft_tokens
    assert value("specgraft_spec_decode_num_accepted_tokens_total") == counters.accepted_tokens > 0
    per_position = [value("specgraft_spec_decode_num_accepted_tokens_per_pos_total", {"position": str(i)})
                    for i in range(len(counters.accepted_per_position))]
    assert per_position == counters.accepted_per_position
    assert 0 < value("specgraft_adaptive_selected_draft_tokens_count") <= counters.steps
