"""The serving engine without HTTP: one thread, a scheduler per drafter choice, a row cap over all of them."""

from __future__ import annotations

import asyncio

import pytest

import specgraft as sg
from specgraft.infer.engine import Config, Engine, EngineObserver, Failed, Finished, Job, QueueFull, Tokens

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


def test_rows_are_capped_over_every_drafter_choice_and_each_output_is_exact(stories, dev_prompts):
    observer = PeakLoad()
    engine = Engine(stories, max_batch_size=2, max_queue=4, observer=observer)
    lookup, chain = sg.PromptLookup(), sg.Chain(4)
    choices = [(Config("prompt-lookup", "default"), lookup), (Config("none", "none"), None)]
    prompts = dev_prompts[:6]

    async def scenario() -> list[tuple[list[int], Finished | Failed]]:
        loop = asyncio.get_running_loop()
        jobs = [
            Job(config=config, drafter=drafter, tree=chain, prompt_ids=stories.encode(p), max_new_tokens=TOKENS,
                options={"eos_token_id": ()}, loop=loop)
            for p, (config, drafter) in zip(prompts, choices * 3)
        ]
        for job in jobs:  # not started yet: 2 rows + 4 waiting fill it
            engine.submit(job)
        with pytest.raises(QueueFull, match="6 requests in flight"):
            engine.submit(Job(config=choices[0][0], drafter=lookup, tree=chain, prompt_ids=[1], max_new_tokens=1,
                              options={}, loop=loop))
        engine.start()
        return [await collect(job) for job in jobs]

    try:
        results = asyncio.run(scenario())
    finally:
        engine.stop()
    assert observer.peak_running == 2
    plain = sg.SpeculativeGenerator(stories, None)
    for prompt, (tokens, end) in zip(prompts, results):
        assert isinstance(end, Finished) and end.stats.new_tokens == TOKENS
        assert tokens == plain.generate(prompt, max_new_tokens=TOKENS, eos_token_id=()).token_ids
    assert engine.in_flight == 0 and not engine.schedulers  # idle schedulers are dropped


def test_refused_options_fail_that_job_with_400(stories):
    engine = Engine(stories, max_batch_size=2, max_queue=2)

    async def scenario() -> tuple[list[int], Finished | Failed]:
        job = Job(config=Config("none", "none"), drafter=None, tree=sg.Chain(4), prompt_ids=[1, 403],
                  max_new_tokens=4, options={"presence_penalty": 0.5}, loop=asyncio.get_running_loop())
        engine.start()
        engine.submit(job)
        return await collect(job)

    try:
        tokens, end = asyncio.run(scenario())
    finally:
        engine.stop()
    assert tokens == [] and isinstance(end, Failed) and end.status == 400 and "presence_penalty" in end.message
