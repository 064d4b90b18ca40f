"""Regeneration through an OpenAI-compatible endpoint: a real `specgraft serve` on loopback, and a flaky double."""

from __future__ import annotations

import copy

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from regen_helpers import records, regenerate_killed_then_resumed
from serve_helpers import ServerThread

from specgraft.infer.serve import create_app
from specgraft.model import Target
from specgraft.train.endpoint import EndpointClient
from specgraft.train.regeneration import regenerate

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ '\\n' }}{{ m['content'] }}<|end|>{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{{ '\\n' }}{% endif %}"
)
TEXT = ["Once upon a time", "Tom had a red ball. He liked to", "Lily saw a big dog.", "The sun was hot and"]
CHATS = [
    {"id": "c0", "messages": [{"role": "user", "content": "Tell me about a cat."}]},
    {"id": "c1", "messages": [
        {"role": "system", "content": "You tell stories."},
        {"role": "user", "content": "A dog and a ball."},
        {"role": "assistant", "content": "(rewritten)"},
        {"role": "user", "content": "What happened next?"},
    ]},
]


@pytest.fixture(scope="module")
def chat_target(stories):
    tokenizer = copy.deepcopy(stories.tokenizer)
    tokenizer.chat_template = CHAT_TEMPLATE
    return Target(stories.model, tokenizer, name="stories-chat")


@pytest.fixture(scope="module")
def served(chat_target):
    """`specgraft serve`'s app for the chat-templated stories260K, on a free 127.0.0.1 port."""
    running = ServerThread(create_app(chat_target, {}, model_name="stories", max_batch_size=8)).start()
    yield running
    running.stop()


def test_greedy_records_through_the_server_equal_in_process_ones(chat_target, served, tmp_path):
    inputs = [*TEXT, *CHATS]
    local = regenerate(chat_target, inputs, tmp_path / "local.jsonl", max_new_tokens=16, temperature=0, progress=False)
    client = EndpointClient(served.url, chat_target.tokenizer, max_retries=0)
    assert client.model == "stories"  # the one model the server lists
    remote = regenerate(
        chat_target, inputs, tmp_path / "remote.jsonl", max_new_tokens=16, temperature=0, progress=False,
        endpoint=client, concurrency=3,
    )
    assert remote.written == local.written == len(inputs)
    assert records(tmp_path / "remote.jsonl") == records(tmp_path / "local.jsonl")
    second_turn = records(tmp_path / "remote.jsonl")["c1"]["messages"]
    assert [m["role"] for m in second_turn] == ["system", "user", "assistant", "user", "assistant"]
    assert second_turn[2]["content"] != "(rewritten)"


def test_self_instruct_through_the_server_writes_whole_conversations(stories, tmp_path):
    tokenizer = copy.deepcopy(stories.tokenizer)
    tokenizer.chat_template = (  # a user turn ends at a newline, which stories260K does write
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    target = Target(stories.model, tokenizer, name="stories-plain-chat")
    running = ServerThread(create_app(target, {}, model_name="stories", max_batch_size=4)).start()
    try:
        summary = regenerate(
            target, [], tmp_path / "self.jsonl", max_new_tokens=12, temperature=1.0, self_instruct=3,
            self_instruct_max_tokens=128, progress=False, endpoint=EndpointClient(running.url, tokenizer), concurrency=2,
        )
    finally:
        running.stop()
    assert summary.written == 3, summary
    written = records(tmp_path / "self.jsonl")
    assert len(written) == 3 and all(key.startswith("self-") for key in written)
    for record in written.values():
        assert [m["role"] for m in record["messages"]] == ["user", "assistant"]
        assert record["messages"][0]["content"] and "\n" not in record["messages"][0]["content"]


def test_a_server_answering_503_is_retried_then_succeeds(stories, tmp_path):
    calls = []
    reply = stories.tokenizer(" there was a cat", add_special_tokens=False)["input_ids"]
    app = FastAPI()

    @app.get("/health")
    def health():
        return {"ok": True}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "flaky", "object": "model", "created": 0, "owned_by": "test"}]}

    @app.post("/v1/completions")
    def completions(body: dict):
        calls.append(body)
        if len(calls) <= 2:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        return {
            "id": "cmpl-1", "object": "text_completion", "created": 0, "model": "flaky",
            "choices": [{"index": 0, "text": "ignored: the ids are used", "token_ids": reply, "logprobs": None,
                         "finish_reason": "length"}],
        }

    running = ServerThread(app).start()
    try:
        client = EndpointClient(running.url, stories.tokenizer, max_retries=3, timeout_s=10)
        summary = regenerate(stories, ["Once upon a time"], tmp_path / "out.jsonl", max_new_tokens=8, temperature=0.7,
                             progress=False, endpoint=client)
    finally:
        running.stop()
    assert summary.written == 1 and len(calls) == 3
    assert calls[-1]["prompt"] == stories.encode("Once upon a time") and calls[-1]["max_tokens"] == 8
    assert calls[-1]["temperature"] == 0.7 and calls[-1]["return_token_ids"] is True
    assert records(tmp_path / "out.jsonl")["0"]["text"] == stories.decode(stories.encode("Once upon a time") + reply)


def test_a_run_killed_mid_way_resumes_to_the_same_records(stories, served, tmp_path):
    """`specgraft regenerate` against the server, killed with SIGKILL after its first records, then run again:
    the same records as one uninterrupted in-process run, none twice."""
    openings = [f"{opening} {name}" for opening in TEXT for name in ("Tom", "Lily", "Sam", "Mia", "Ben")]
    out = regenerate_killed_then_resumed(tmp_path, stories.name, "medusa", openings, served.url, 48,
                                         start_timeout_s=120, resume_timeout_s=300)
    reference = tmp_path / "reference.jsonl"
    regenerate(stories, openings, reference, max_new_tokens=48, temperature=0, dedupe=False, progress=False)
    assert records(out) == records(reference)
