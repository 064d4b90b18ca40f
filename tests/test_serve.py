"""`specgraft serve` started for real on a free 127.0.0.1 port, spoken to with the official `openai` client.

Every greedy answer must equal offline greedy decoding token for token, for
each drafter; bad input gets its 4xx while the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

import specgraft as sg
from specgraft.heads import load_drafter
from specgraft.infer.serve import chat_prompt_ids, create_app

from conftest import STORIES, ctrl_c_at_call, needs_shared
from serve_helpers import Boom, ServerThread, metric, spawn_server

openai = pytest.importorskip("openai")

pytestmark = needs_shared

MODEL = "stories260K"
TOKENS = 24
TIMEOUT_S = 60.0
BOOM_TOKEN = 511  # a token id no dev prompt holds: the Boom drafter fails on prompts with it


@pytest.fixture(scope="module")
def eagle_dir(trained_eagle):
    """A tiny trained EAGLE head (conftest's `trained_eagle`): it drafts well, and greedy output stays the target's."""
    return trained_eagle


@pytest.fixture(scope="module")
def server(eagle_dir):
    """A server with its own target (the test's offline target never shares a thread with it)."""
    target = sg.load_target(STORIES)
    drafters = {"eagle": load_drafter(eagle_dir, target), "boom": Boom(BOOM_TOKEN)}
    app = create_app(target, drafters, model_name=MODEL, default_tree=sg.Chain(4), max_batch_size=16, max_queue=128)
    running = ServerThread(app).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def plain(stories):
    return sg.SpeculativeGenerator(stories, None)


def spec(drafter: str) -> dict:
    return {"speculative": {"drafter": drafter}, "return_token_ids": True}


@pytest.mark.parametrize("drafter", ["prompt-lookup", "eagle", "none"])
def test_completion_equals_offline_greedy(client, plain, dev_prompts, drafter):
    prompt = dev_prompts[0]
    offline = plain.generate(prompt, max_new_tokens=TOKENS)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=TOKENS, temperature=0, extra_body=spec(drafter))
    choice = out.choices[0]
    assert choice.token_ids == offline.token_ids
    assert choice.text == offline.text
    # prompt + completion reads as one text, as vLLM's and OpenAI's completions do (no word glued to the prompt)
    assert prompt + choice.text == plain.target.decode(plain.target.encode(prompt) + choice.token_ids)
    assert out.usage.completion_tokens == len(offline.token_ids)
    assert out.usage.prompt_tokens == len(plain.target.encode(prompt))
    assert out.speculative_stats["drafter"] == drafter
    if drafter == "none":
        assert out.speculative_stats["target_calls"] == out.usage.completion_tokens


@pytest.mark.parametrize("drafter", ["prompt-lookup", "eagle", "none"])
def test_streamed_completion_equals_offline_greedy(client, plain, dev_prompts, drafter):
    prompt = dev_prompts[1]
    offline = plain.generate(prompt, max_new_tokens=TOKENS)
    chunks = list(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=spec(drafter),
    ))
    tokens = [t for c in chunks for choice in c.choices for t in (getattr(choice, "token_ids", None) or [])]
    assert tokens == offline.token_ids
    assert "".join(choice.text for c in chunks for choice in c.choices) == offline.text
    assert chunks[-1].usage.completion_tokens == len(offline.token_ids)
    stats = chunks[-1].speculative_stats  # the last chunk carries them, as the README says
    assert stats["drafter"] == drafter and chunks[-2].choices[0].finish_reason in ("length", "stop")
    without_usage = list(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=TOKENS, temperature=0, stream=True, extra_body=spec(drafter),
    ))
    assert without_usage[-1].speculative_stats == stats  # greedy: the same steps, the same stats
    assert without_usage[-1].choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("drafter", ["prompt-lookup", "eagle"])
def test_chat_equals_offline_greedy(client, plain, dev_prompts, drafter, stream):
    messages = [{"role": "user", "content": dev_prompts[2]}]
    offline = plain.generate(chat_prompt_ids(plain.target, messages), max_new_tokens=TOKENS)
    kwargs = dict(model=MODEL, messages=messages, max_completion_tokens=TOKENS, temperature=0, extra_body=spec(drafter))
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
    else:
        out = client.chat.completions.create(**kwargs)
        text = out.choices[0].message.content
        assert out.choices[0].token_ids == offline.token_ids
    assert text == offline.text


def test_no_speculation_gives_the_same_text_with_one_target_call_per_token(client, dev_prompts):
    args = dict(model=MODEL, prompt=dev_prompts[3], max_tokens=TOKENS, temperature=0)
    fast = client.completions.create(**args)  # the server default: prompt lookup
    plain = client.completions.create(**args, extra_body={"speculative": {"drafter": "none"}})
    assert plain.choices[0].text == fast.choices[0].text
    assert plain.speculative_stats["target_calls"] == plain.usage.completion_tokens
    k2 = client.completions.create(**args, extra_body={"speculative": {"drafter": "eagle", "num_speculative_tokens": 2}})
    tree = client.completions.create(**args, extra_body={"speculative": {"drafter": "eagle", "tree": [[0], [1], [0, 0]]}})
    assert k2.choices[0].text == tree.choices[0].text == fast.choices[0].text
    assert k2.speculative_stats["tree"] == repr(sg.Chain(2, draw="top-k"))  # greedy draws top-k whatever the policy's draw
    # the default drafter (prompt lookup) reports the trie it copies, not None
    assert fast.speculative_stats["tree"] == "prompt-lookup trie: up to 4 matches, at most 8 tokens deep"
    sampled = client.completions.create(**{**args, "temperature": 0.8, "seed": 1},
                                        extra_body={"speculative": {"drafter": "eagle", "num_speculative_tokens": 2}})
    assert sampled.speculative_stats["tree"] == repr(sg.Chain(2, draw="sample"))


def test_sampling_options_reach_the_engine_as_offline_sampling_takes_them(client, stories, dev_prompts):
    """A seeded sampled request equals the offline generation with the same drafter, tree and options."""
    prompt = dev_prompts[7]
    options = dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=7)
    offline = sg.SpeculativeGenerator(stories, sg.PromptLookup(num_tokens=3), tree=sg.Chain(4)).generate(
        prompt, max_new_tokens=TOKENS, **options)
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=TOKENS, temperature=0.8, top_p=0.9, seed=7,
        extra_body={"top_k": 20, "min_p": 0.05, "return_token_ids": True,
                    "speculative": {"drafter": "prompt-lookup", "num_speculative_tokens": 3}},
    )
    assert out.choices[0].token_ids == offline.token_ids


def test_chat_prompt_uses_the_targets_template_when_it_has_one(stories):
    import copy

    tokenizer = copy.deepcopy(stories.tokenizer)
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    messages = [{"role": "system", "content": "Tell stories."}, {"role": "user", "content": "A dog."}]
    ids = chat_prompt_ids(sg.Target(stories.model, tokenizer, "templated"), messages).ids.tolist()
    assert stories.decode(ids) == "system: Tell stories.\nuser: A dog.\nassistant:"
    assert chat_prompt_ids(stories, messages).ids.tolist() == stories.encode("Tell stories.\nA dog.")  # no template: texts joined


def test_stop_strings_end_the_text_before_them(client, plain, dev_prompts):
    prompt = dev_prompts[0]
    full = plain.generate(prompt, max_new_tokens=TOKENS).text
    stop = full.split()[3]
    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=TOKENS, temperature=0, stop=[stop], stream=stream)
        chunks = list(out) if stream else [out]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == full[: full.index(stop)]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health", timeout=5).json() == {"status": "ok"}
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    for name in ("specgraft_requests_total", "specgraft_generated_tokens_total", "specgraft_target_calls_total",
                 "specgraft_mean_accepted_length", "specgraft_running_sequences", "specgraft_queued_sequences",
                 "specgraft_time_to_first_token_seconds_bucket", "specgraft_inter_token_latency_seconds_bucket"):
        assert name in text


def test_a_failing_drafter_fails_only_its_request(server, client, plain, dev_prompts, caplog):
    with caplog.at_level("ERROR", logger="specgraft.infer.serve.engine"):
        bad = httpx.post(f"{server.url}/v1/completions", timeout=TIMEOUT_S, json={
            "model": MODEL, "prompt": [1, 403, BOOM_TOKEN], "max_tokens": 8, "speculative": {"drafter": "boom"}})
    assert bad.status_code == 500 and "drafter failure" in bad.json()["error"]["message"]
    [record] = [r for r in caplog.records if r.name == "specgraft.infer.serve.engine"]  # the server's log says why
    assert "failed in a step" in record.getMessage() and "drafter failure" in str(record.exc_info[1])
    good = client.completions.create(model=MODEL, prompt=dev_prompts[4], max_tokens=8, temperature=0,
                                     extra_body={"speculative": {"drafter": "boom"}})
    assert good.choices[0].text == plain.generate(dev_prompts[4], max_new_tokens=8).text


def test_the_tree_a_request_reports_is_the_one_it_used():
    from specgraft.infer.serve.server import Choice

    lookup = sg.PromptLookup(num_tokens=8)
    assert Choice("p", lookup, sg.Adaptive(max_depth=6), "p").tree_label(greedy=True) == (
        f"prompt-lookup trie: up to 4 matches, at most 6 tokens deep, sized each step by {sg.Adaptive(max_depth=6)!r}")
    assert Choice("n", None, sg.Adaptive(), "none").tree_label(greedy=True) is None  # speculation off
    static = sg.StaticTree([[0], [1]], draw="sample")
    assert Choice("e", object(), static, "e").tree_label(greedy=True) == repr(sg.StaticTree([[0], [1]], draw="top-k"))
    assert Choice("e", object(), static, "e").tree_label(greedy=False) == repr(static)
    assert Choice("e", object(), sg.Adaptive(), "e").tree_label(greedy=True) == repr(sg.Adaptive())


@pytest.mark.parametrize("text", ["bogus", "tree.json", "static:tree.json", "adaptive:3"])
def test_a_bad_request_tree_lists_every_form_a_request_may_use(text):
    from specgraft.infer.serve.server import HTTPError, request_tree
    from specgraft.specs import TREE_FORMS, TREE_OBJECTS

    with pytest.raises(HTTPError) as err:
        request_tree(text)
    for form, _, _, reads_a_file in TREE_FORMS:
        assert (f"'{form}'" in err.value.message) is not reads_a_file, form
    assert all(f'"kind": "{kind}"' in err.value.message for kind in TREE_OBJECTS)


def test_the_kv_pool_holds_a_row_the_largest_tree_the_server_admits_not_a_fixed_1024(stories):
    """A request's tree is at most MAX_TREE_NODES drafts (and a prompt lookup's trie of K <= 64 tokens, 4 matches, as
    many): with the default Adaptive tree (16 nodes) the headroom is 257 slots, root included, not 1,024."""
    from specgraft.infer.serve.protocol import MAX_SPECULATIVE_TOKENS, MAX_TREE_NODES
    from specgraft.infer.serve.server import tree_headroom
    from specgraft.model import TREE_SLOTS

    assert 4 * MAX_SPECULATIVE_TOKENS == MAX_TREE_NODES  # (the lookup's trie at a request's deepest K is as large)
    lookups = {"none": None, "prompt-lookup": sg.PromptLookup()}
    assert tree_headroom(lookups, sg.Adaptive()) == 1 + MAX_TREE_NODES == 257
    wide = sg.StaticTree([[i] for i in range(300)])  # a default tree larger than any request's
    assert tree_headroom(lookups, wide) == 257  # (prompt lookup ignores the tree's shape)
    assert tree_headroom({**lookups, "self": sg.DraftModel(stories, stories)}, wide) == 301
    assert tree_headroom({**lookups, "long": sg.PromptLookup(num_tokens=100, max_matches=5)}, sg.Chain(4)) == 501
    assert tree_headroom({**lookups, "pl+self": sg.Composite(sg.PromptLookup(), sg.DraftModel(stories, stories))},
                         sg.Adaptive(max_depth=8, max_nodes=400)) == 401
    app = create_app(stories, {}, default_tree=sg.Chain(4), max_batch_size=2)
    engine = app.state.specgraft.engine
    assert engine.scheduler.pool.kv.shape[4] == engine.scheduler.max_len + 257 < engine.scheduler.max_len + TREE_SLOTS
    assert "+ 257 for a tree" in engine.describe()


def test_the_draft_pools_hold_a_row_the_largest_tree_the_server_admits_not_a_fixed_1024(stories, eagle_dir):
    """An EAGLE row's drafting takes its root and a slot per node of every level's frontier beyond its tokens
    ((depth - 1) x top_k + 1 for a dynamic tree): the server's draft pools hold the KV pool's 257 slots a row for it
    (every chain a request may name, and a dynamic tree of (depth - 1) x top_k <= 256), or the default tree's where
    that takes more, not 1,024."""
    from specgraft.infer.serve.server import draft_headroom
    from specgraft.model import TREE_SLOTS

    eagle = load_drafter(eagle_dir, stories)
    app = create_app(stories, {"eagle": eagle}, default_tree=sg.Chain(4), max_batch_size=2)
    engine = app.state.specgraft.engine
    sched = engine.scheduler
    assert sched.draft_pools["eagle"].kv.shape[4] == sched.max_len + 257 < sched.max_len + TREE_SLOTS
    fixed = sg.Scheduler(stories, {"eagle": eagle}, max_batch_size=2)  # (a scheduler's default: `TREE_SLOTS`)
    assert sched.draft_pool_bytes * (sched.max_len + TREE_SLOTS) == fixed.draft_pool_bytes * (sched.max_len + 257)
    assert f"draft pools (eagle): {sched.max_len + 257} slots a row ({sched.max_len} tokens + 257 for drafting" in (
        engine.describe())
    wide = sg.DynamicTree(top_k=64, depth=8, budget=64)  # 65 nodes to verify, (8 - 1) x 64 + 1 = 449 to draft
    assert eagle.draft_slots(wide) == 449 and eagle.draft_slots(sg.Chain(64)) == 64
    assert draft_headroom({"eagle": eagle, "prompt-lookup": sg.PromptLookup()}, wide, 257) == 449
    assert draft_headroom({"prompt-lookup": sg.PromptLookup()}, wide, 257) == 257  # (no draft pool to hold it)
    sched = create_app(stories, {"eagle": eagle}, default_tree=wide, max_batch_size=2).state.specgraft.engine.scheduler
    assert sched.pool.kv.shape[4] == sched.max_len + 257 and sched.draft_pools["eagle"].kv.shape[4] == sched.max_len + 449


def test_the_scheduler_refuses_a_tree_whose_drafting_its_draft_rows_cannot_hold(stories, eagle_dir):
    """A dynamic tree of 256 drafts, 64 levels of 256 (dynamic:256,64,256), fits a row's 257 slots to verify but takes
    63 x 256 + 1 = 16,129 to draft: refused at submit, naming the drafter, the tree and both sizes, where it would
    overflow its draft row mid-generation. A composite's EAGLE state keeps a cache of its own, `TREE_SLOTS` beyond
    the context."""
    from specgraft.model import TREE_SLOTS

    eagle = load_drafter(eagle_dir, stories)
    sched = sg.Scheduler(stories, {"eagle": eagle, "pl+eagle": sg.Composite(sg.PromptLookup(), eagle)},
                         max_batch_size=1, tree_slots=257)
    assert sched.draft_slots == 257 and sched.draft_pools["eagle"].kv.shape[4] == sched.max_len + 257
    sched.submit("Once", 4, drafter="eagle", tree=sg.DynamicTree(top_k=64, depth=5, budget=256))  # 4 x 64 + 1 = 257
    sched.submit("Once", 4, drafter="eagle", tree=sg.StaticTree([[i] for i in range(256)]))  # one level: its root's
    huge = sg.DynamicTree(top_k=256, depth=64, budget=256)
    with pytest.raises(ValueError, match=r"drafter 'eagle' with tree DynamicTree\(top_k=256, depth=64, budget=256\) "
                                         r"drafts into up to 16129 slots of its draft cache, more than the 257"):
        sched.submit("Once", 4, drafter="eagle", tree=huge)
    narrow_below = sg.StaticTree([[i] for i in range(128)] + [[0, 0], [0, 0, 0], [0, 0, 0, 0]])  # 131 nodes to verify
    with pytest.raises(ValueError, match="up to 385 slots"):  # its 3 levels below the first each padded to its 128
        sched.submit("Once", 4, drafter="eagle", tree=narrow_below)
    with pytest.raises(ValueError, match=f"drafter 'pl\\+eagle' .* 16129 slots .* more than the {TREE_SLOTS}"):
        sched.submit("Once", 4, drafter="pl+eagle", tree=huge)
    assert len(sched.queued) == 2
    with pytest.raises(ValueError, match="draft_slots must be a positive integer"):
        sg.Scheduler(stories, max_batch_size=1, draft_slots=0)


def test_the_scheduler_refuses_a_tree_larger_than_its_rows_hold(stories):
    drafters = {"prompt-lookup": sg.PromptLookup(num_tokens=8), "self": sg.DraftModel(stories, stories)}
    sched = sg.Scheduler(stories, drafters, max_batch_size=1, tree_slots=20)
    assert sched.pool.kv.shape[4] == sched.max_len + 20
    sched.submit("Once", 4, drafter="none", tree=sg.Chain(40))  # speculation off verifies its root alone
    sched.submit("Once", 4, drafter="self", tree=sg.Chain(19))
    with pytest.raises(ValueError, match="verifies up to 33 nodes, more than the 20 slots"):
        sched.submit("Once", 4, drafter="prompt-lookup")  # 4 matches of 8 tokens, and the root
    with pytest.raises(ValueError, match="verifies up to 21 nodes, more than the 20 slots"):
        sched.submit("Once", 4, drafter="self", tree=sg.Chain(20))
    with pytest.raises(ValueError, match="tree_slots must be a positive integer"):
        sg.Scheduler(stories, max_batch_size=1, tree_slots=0)


def bad_requests() -> list[tuple[str, object, int, str]]:
    """(route, body, status, a word the message holds); a str body is sent as raw (malformed) JSON."""
    ok = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    return [
        ("completions", '{"prompt": "Once", ', 400, "malformed JSON"),
        ("completions", {**ok, "max_tokens": "many"}, 400, "max_tokens"),
        ("completions", {**ok, "temperature": "hot"}, 400, "temperature"),
        ("completions", {**ok, "speculative": {"drafter": "medusa"}}, 400, "prompt-lookup"),
        ("completions", {**ok, "speculative": {"drafter": "eagle", "tree": "static:/etc/passwd"}}, 400, "never a file"),
        ("completions", {**ok, "speculative": {"drafter": "eagle", "tree": {"kind": "static", "choices": [[i] for i in range(300)]}}},
         400, "too large"),
        ("completions", {**ok, "speculative": {"drafter": "eagle", "tree": "dynamic:256,64,256"}}, 400,
         "drafts into up to 16129 slots of its draft cache, more than the 257"),
        ("completions", {**ok, "speculative": {"drafter": "eagle", "num_speculative_tokens": 2, "tree": "chain:2"}}, 400, "not both"),
        ("completions", {**ok, "speculative": {"drafter": "eagle", "K": 2}}, 400, "speculative.K"),
        ("completions", {**ok, "max_tokens": 600}, 400, "+ max_tokens (600) exceeds the target's context of 512"),
        ("completions", {**ok, "max_tokens": "8"}, 400, "max_tokens"),  # strict, as OpenAI: no "8" -> 8
        ("completions", {**ok, "max_tokens": 8.0}, 400, "max_tokens"),
        ("completions", {**ok, "stream": 1}, 400, "stream"),
        ("completions", {**ok, "speculative": {"drafter": "eagle", "num_speculative_tokens": "2"}}, 400,
         "num_speculative_tokens"),
        ("chat/completions", {**chat, "max_completion_tokens": 600}, 400, "+ max_completion_tokens (600) exceeds"),
        ("completions", {**ok, "repetition_penalty": 1.3}, 400, "repetition_penalty"),
        ("completions", {**ok, "n": 2}, 400, "n=2"),
        ("completions", {**ok, "logprobs": 2}, 400, "logprobs"),
        ("completions", {**ok, "prompt": ""}, 400, "empty"),
        ("completions", {**ok, "model": "gpt-9"}, 404, "gpt-9"),
        ("chat/completions", {**chat, "messages": []}, 400, "messages"),
        ("chat/completions", {**chat, "n": 3}, 400, "n=3"),
        ("chat/completions", {**chat, "logprobs": True}, 400, "logprobs"),
    ]


def check_bad_requests(url: str) -> None:
    with httpx.Client(timeout=TIMEOUT_S) as http:
        for route, body, status, word in bad_requests():
            if isinstance(body, str):
                r = http.post(f"{url}/v1/{route}", content=body, headers={"content-type": "application/json"})
            else:
                r = http.post(f"{url}/v1/{route}", json=body)
            assert r.status_code == status, (route, body, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert word in error["message"], (word, error)


def test_model_may_be_omitted_and_unknown_fields_are_logged_and_ignored(server, caplog):
    """As vLLM: no `model` means the served model; an unknown field is named in a warning, not refused."""
    with caplog.at_level("WARNING", logger="specgraft.serve"):
        r = httpx.post(f"{server.url}/v1/completions", timeout=TIMEOUT_S,
                       json={"prompt": "Once upon a time", "temperature": 0, "frobnicate": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == MODEL
    assert body["usage"]["completion_tokens"] == 16  # the documented default max_tokens of /v1/completions
    assert any("ignored fields ['frobnicate']" in m for m in caplog.messages)
    r = httpx.post(f"{server.url}/v1/completions", timeout=TIMEOUT_S,
                   json={"prompt": "Once upon a time", "temperature": 1, "max_tokens": 4})  # an int where a float goes
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_bad_input_gets_a_4xx_and_the_server_keeps_serving(server, client):
    check_bad_requests(server.url)
    r = httpx.post(f"{server.url}/v1/completions", timeout=TIMEOUT_S, json={"model": MODEL, "prompt": "Hi", "max_tokens": 600})
    assert "512" in r.json()["error"]["message"] and "600" in r.json()["error"]["message"]
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0).usage.completion_tokens == 4


# ---------------------------------------------------------------------------------------------- load


async def stream_text(aclient, prompt: str, tokens: int, **extra) -> tuple[list[int], str]:
    stream = await aclient.completions.create(
        model=MODEL, prompt=prompt, max_tokens=tokens, temperature=0, stream=True,
        extra_body={"return_token_ids": True, **extra},
    )
    ids, text = [], ""
    async for c in stream:
        for choice in c.choices:
            ids += getattr(choice, "token_ids", None) or []
            text += choice.text
    return ids, text


async def disconnect_after(aclient, prompt: str, chunks: int) -> None:
    stream = await aclient.completions.create(
        model=MODEL, prompt=prompt, max_tokens=450, temperature=0, stream=True, extra_body={"ignore_eos": True})
    seen = 0
    async for _ in stream:
        seen += 1
        if seen >= chunks:
            break
    await stream.close()


def test_load_64_streams_then_disconnects_then_bad_input_beside_a_stream(server, plain, dev_prompts):
    prompts = [dev_prompts[i % len(dev_prompts)] for i in range(64)]
    offline = {p: plain.generate(p, max_new_tokens=TOKENS) for p in set(prompts)}
    long_prompt = dev_prompts[5]
    long_offline = plain.generate(long_prompt, max_new_tokens=200, eos_token_id=())

    async def scenario() -> None:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
        # 1. 64 concurrent streams, each identical to offline greedy.
        results = await asyncio.wait_for(asyncio.gather(*(stream_text(aclient, p, TOKENS) for p in prompts)), 120)
        for p, (ids, text) in zip(prompts, results):
            assert ids == offline[p].token_ids and text == offline[p].text
        # 2. 8 clients go away mid-stream: their rows are freed.
        before = metric(httpx.get(f"{server.url}/metrics").text, "specgraft_requests_total", 'status="499"')
        await asyncio.wait_for(asyncio.gather(*(disconnect_after(aclient, p, 3) for p in prompts[:8])), 60)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            text = httpx.get(f"{server.url}/metrics").text
            gone = metric(text, "specgraft_requests_total", 'status="499"') - before
            if gone >= 8 and metric(text, "specgraft_running_sequences") == 0:
                break
            await asyncio.sleep(0.05)
        assert metric(text, "specgraft_running_sequences") == 0 and metric(text, "specgraft_queued_sequences") == 0
        assert gone == 8  # cancelled: none of them ran to its 450 tokens
        # 3. every bad input gets its 4xx while a stream runs beside them.
        beside = asyncio.create_task(stream_text(aclient, long_prompt, 200, ignore_eos=True))
        await asyncio.to_thread(check_bad_requests, server.url)
        ids, text = await asyncio.wait_for(beside, 60)
        assert ids == long_offline.token_ids and text == long_offline.text
        await aclient.close()

    asyncio.run(scenario())


def test_a_client_gone_before_a_whole_answer_has_its_generation_cancelled(server):
    def counts() -> tuple[float, float]:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        return metric(text, "specgraft_requests_total", 'status="499"'), metric(text, "specgraft_running_sequences")

    before, _ = counts()
    slow = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 450, "ignore_eos": True,
            "speculative": {"drafter": "eagle", "tree": "dynamic:8,6,48"}}  # a tiny head: seconds of work
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=slow, timeout=httpx.Timeout(10, read=0.3))
    deadline = time.monotonic() + 10
    while counts() != (before + 1, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counts() == (before + 1, 0)


# ---------------------------------------------------------------------------------------------- limits and keys


@pytest.fixture(scope="module")
def small_server():
    """One row, no queue, an API key: a second request while one runs is refused."""
    app = create_app(sg.load_target(STORIES), {}, model_name=MODEL, max_batch_size=1, max_queue=0, api_key="sekret")
    running = ServerThread(app).start()
    yield running
    running.stop()


def test_api_key_is_required_when_set(small_server):
    r = httpx.get(f"{small_server.url}/v1/models", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    keyed = openai.OpenAI(base_url=f"{small_server.url}/v1", api_key="sekret", max_retries=0, timeout=TIMEOUT_S)
    assert keyed.completions.create(model=MODEL, prompt="Hi", max_tokens=3).usage.completion_tokens == 3
    assert httpx.get(f"{small_server.url}/health", timeout=10).status_code == 200  # probes need no key


def test_full_queue_answers_503_with_retry_after(small_server):
    headers = {"Authorization": "Bearer sekret"}
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=TIMEOUT_S, headers=headers) as http:
        with http.stream("POST", f"{small_server.url}/v1/completions", json=body) as first:
            lines = first.iter_lines()
            next(lines)  # the first request holds the only row
            busy = http.post(f"{small_server.url}/v1/completions", json={**body, "stream": False})
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
            assert "retry" in busy.json()["error"]["message"]
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"  # the running request was not disturbed


# ---------------------------------------------------------------------------------------------- SIGTERM


@pytest.mark.slow  # ~25 s on 2 shared cores, nearly all of it a fresh process importing torch and loading the target
def test_sigterm_drains_the_running_stream_and_exits_cleanly(plain, dev_prompts):
    import signal

    proc, url = spawn_server()
    try:
        offline = plain.generate(dev_prompts[6], max_new_tokens=300, eos_token_id=())
        body = {"model": "stories260K", "prompt": dev_prompts[6], "max_tokens": 300, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT_S) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            proc.send_signal(signal.SIGTERM)
            events = [json.loads(first[6:])] + [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        assert text == offline.text and events[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0
        assert "SIGTERM" in proc.stderr.read()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# ---------------------------------------------------------------------------------------------- bench --server


def test_bench_server_writes_the_concurrency_table(server, tmp_path):
    from specgraft.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nTom had a red ball.\nThe sun was\n")
    out = tmp_path / "bench"
    assert main(["bench", "--server", server.url, "--concurrency", "1,3", "--prompts", str(prompts),
                 "--max-new-tokens", "8", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["greedy_identical"] and results["settings"]["model"] == MODEL
    assert [(r["concurrency"], r["speculative"]) for r in results["levels"]] == [(1, "off"), (1, "on"), (3, "off"), (3, "on")]
    for r in results["levels"]:
        assert r["requests"] == 3 and r["completion_tokens"] == 24 and r["total_tokens_per_s"] > 0
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
    assert "| 3 | on |" in (out / "results.md").read_text()
    assert (out / "server_tokens_per_s.png").is_file() and (out / "server_latency.png").is_file()


def test_bench_server_pools_its_rounds_of_each_level(server, tmp_path, capsys):
    from specgraft.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nTom had a red ball.\n")
    out = tmp_path / "bench"
    assert main(["bench", "--server", server.url, "--concurrency", "2", "--rounds", "3", "--prompts", str(prompts),
                 "--max-new-tokens", "6", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["greedy_identical"] and results["settings"]["rounds"] == 3
    for r in results["levels"]:  # three passes of both prompts in each mode, pooled
        assert r["rounds"] == 3 and r["requests"] == 6 and r["completion_tokens"] == 36
    assert "3 round(s)" in (out / "results.md").read_text()
    capsys.readouterr()
    assert main(["bench", "--target", "x", "--rounds", "2", "--prompts", str(prompts), "--out", str(out)]) == 2
    assert "--rounds applies to --server and --batch-size" in capsys.readouterr().err


def test_bench_server_pairs_each_rounds_pass_with_speculation_on_with_its_pass_off(server, tmp_path, monkeypatch):
    """The paired ratio is off's wall time over on's, round by round, as a median and quartiles (on the "on" row)."""
    from specgraft.cli import main
    from specgraft.tools import bench_server as module

    real = module.run_level
    walls = {True: iter([2.0, 2.0, 2.0]), False: iter([1.0, 2.0, 4.0])}  # off, on: ratios 2, 1 and 0.5

    async def timed(mode, prompts, level, max_tokens):
        timings, _ = await real(mode, prompts, level, max_tokens)
        return timings, next(walls[mode.label == "off"])

    monkeypatch.setattr(module, "run_level", timed)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n")
    out = tmp_path / "bench"
    assert main(["bench", "--server", server.url, "--concurrency", "1", "--rounds", "3", "--prompts", str(prompts),
                 "--max-new-tokens", "4", "--out", str(out)]) == 0
    off, on = json.loads((out / "results.json").read_text())["levels"]
    assert "paired_vs_off_p50" not in off
    assert (on["paired_vs_off_p25"], on["paired_vs_off_p50"], on["paired_vs_off_p75"]) == (0.75, 1.0, 1.5)
    assert on["total_tokens_per_s"] / off["total_tokens_per_s"] == pytest.approx(6 / 7)  # pooled: 6 s off, 7 s on
    assert "| 1 | 0.857x | 1.000x (0.750-1.500) |" in (out / "results.md").read_text()


def sigint_at_call(n: int, fn):
    """The coroutine function ``fn``, except that its ``n``-th call sends this process SIGINT first, as a Ctrl-C at
    the terminal does (under `asyncio.run`, the running task is cancelled, and KeyboardInterrupt raised after it)."""
    calls = []

    async def call(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            signal.raise_signal(signal.SIGINT)
        return await fn(*args, **kwargs)

    return call


@pytest.mark.parametrize("stop", ["ctrl-c in concurrency 3", "sigint in concurrency 3", "ctrl-c in concurrency 1"])
def test_ctrl_c_in_bench_server_writes_the_levels_that_finished(server, tmp_path, capsys, monkeypatch, stop):
    """`bench --server` stopped by Ctrl-C: one line, and results.json / results.md hold the concurrency levels that
    finished (marked interrupted); stopped before any finished, it says that nothing was written."""
    from specgraft.cli import main
    from specgraft.tools import bench_server as module

    if stop.startswith("sigint") and signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's KeyboardInterrupt in this process")
    # Each level runs its two modes once: the third pass is concurrency 3's first.
    at = 1 if stop.endswith("concurrency 1") else 3
    interrupt = sigint_at_call if stop.startswith("sigint") else ctrl_c_at_call
    monkeypatch.setattr(module, "run_level", interrupt(at, module.run_level))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nTom had a red ball.\n")
    out = tmp_path / "bench"
    assert main(["bench", "--server", server.url, "--concurrency", "1,3", "--prompts", str(prompts),
                 "--max-new-tokens", "4", "--out", str(out)]) == 130
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    if at == 1:
        assert captured.err.splitlines()[-1] == (
            "specgraft bench: interrupted before any concurrency level finished; nothing written")
        assert not out.exists()
        return
    assert captured.err.splitlines()[-1] == (
        f"specgraft bench: interrupted after concurrency levels [1] of [1, 3]; the concurrency levels that finished "
        f"are in {out / 'results.json'} (and results.md)")
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["interrupted"] is True
    assert (results["settings"]["concurrency"], results["settings"]["concurrency_given"]) == ([1], [1, 3])
    assert [(r["concurrency"], r["speculative"]) for r in results["levels"]] == [(1, "off"), (1, "on")]
    assert results["greedy_identical"] is True and results["mismatches"] == []
    assert "Interrupted (Ctrl-C): concurrency levels [1] of [1, 3] finished." in (out / "results.md").read_text()
    assert all((out / name).is_file() for name in module.SERVER_PLOTS)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # the server serves on


def test_bench_server_refuses_offline_flags_and_bad_levels(tmp_path):
    from specgraft.cli import main
    from specgraft.tools.bench_server import parse_concurrency

    with pytest.raises(ValueError, match="positive integers"):
        parse_concurrency("1,x")
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hi\n")
    assert main(["bench", "--server", "http://127.0.0.1:9", "--target", "x", "--prompts", str(prompts), "--out", str(tmp_path)]) == 2


def test_streams_read_to_done_are_not_counted_as_disconnects(server, dev_prompts):
    """Sampled 64-token streams read to [DONE] count as 200s; the 499 counter is for clients that went away."""
    def counts() -> tuple[float, float]:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        return (metric(text, "specgraft_requests_total", 'status="200"'),
                metric(text, "specgraft_requests_total", 'status="499"'))

    ok_before, gone_before = counts()
    for i, prompt in enumerate(dev_prompts[:4]):
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=TIMEOUT_S, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 64, "temperature": 1.0, "seed": i, "stream": True,
            "stream_options": {"include_usage": True}, **spec("eagle"),
        }) as response:
            lines = [line for line in response.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
    deadline = time.monotonic() + 10
    while counts()[0] - ok_before < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    ok, gone = counts()
    assert (ok - ok_before, gone - gone_before) == (4, 0)


def test_metrics_count_one_verification_forward_per_step_and_vllms_spec_decode_counters(server, client, dev_prompts):
    """Concurrent requests with different drafters share steps: verification forwards equal engine steps."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    before = {name: metric(text, name) for name in ("specgraft_engine_steps_total", "specgraft_engine_verify_forwards_total")}

    async def burst() -> None:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
        drafters = ["none", "prompt-lookup", "eagle", "eagle"]
        await asyncio.gather(*(aclient.completions.create(
            model=MODEL, prompt=dev_prompts[10 + i], max_tokens=TOKENS, temperature=0,
            extra_body={"speculative": {"drafter": d, **({"tree": "chain:3"} if i == 3 else {})}})
            for i, d in enumerate(drafters)))
        await aclient.close()

    asyncio.run(burst())
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    steps = metric(text, "specgraft_engine_steps_total") - before["specgraft_engine_steps_total"]
    forwards = metric(text, "specgraft_engine_verify_forwards_total") - before["specgraft_engine_verify_forwards_total"]
    assert steps > 0 and forwards == steps
    drafted, accepted = (metric(text, f"specgraft_spec_decode_num_{n}_total") for n in ("draft_tokens", "accepted_tokens"))
    assert metric(text, "specgraft_spec_decode_num_drafts_total") > 0 and 0 < accepted <= drafted
    per_position = [metric(text, "specgraft_spec_decode_num_accepted_tokens_per_pos_total", f'position="{i}"') for i in range(4)]
    assert per_position[0] > 0 and per_position == sorted(per_position, reverse=True)  # a path reaching i + 1 reached i
    assert metric(text, "specgraft_kv_pool_bytes") > 0


def test_the_kv_pool_bytes_are_the_same_with_one_drafter_and_with_four(eagle_dir):
    target = sg.load_target(STORIES)
    eagle = load_drafter(eagle_dir, target)
    configured = {
        "one": {"eagle": eagle},
        "four": {"eagle": eagle, "self": sg.DraftModel(target, target), "lookup-eagle": sg.Composite(sg.PromptLookup(), eagle),
                 "lookup-4": sg.PromptLookup(num_tokens=4)},
    }
    pool = {}
    for name, drafters in configured.items():
        running = ServerThread(create_app(target, drafters, model_name=MODEL, max_batch_size=8)).start()
        try:
            text = httpx.get(f"{running.url}/metrics", timeout=10).text
        finally:
            running.stop()
        pool[name] = metric(text, "specgraft_kv_pool_bytes")
    assert pool["one"] == pool["four"] > 0


def test_an_adaptive_tree_request_equals_offline_greedy_and_reports_the_controllers_choices(server, client, plain, dev_prompts):
    prompt = dev_prompts[6]
    offline = plain.generate(prompt, max_new_tokens=TOKENS)
    for tree in ("adaptive", "adaptive:3,6"):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=TOKENS, temperature=0,
                                        extra_body={"speculative": {"drafter": "eagle", "tree": tree}})
        assert out.choices[0].text == offline.text
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert metric(text, "specgraft_adaptive_selected_draft_tokens_count") >= TOKENS  # one observation a step
    too_big = httpx.post(f"{server.url}/v1/completions", timeout=TIMEOUT_S, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 4, "speculative": {"drafter": "eagle", "tree": "adaptive:99,8"}})
    assert too_big.status_code == 400 and "too large" in too_big.json()["error"]["message"]
