"""`specgraft serve`: an OpenAI-compatible HTTP server over the continuous-batching scheduler.

    specgraft serve --target ../shared/models/stories260K --drafter eagle=runs/eagle/head \
        --default-drafter prompt-lookup --max-batch-size 16 --port 8000

A thin layer (FastAPI + uvicorn, as vLLM's server): it parses OpenAI's
requests, picks each request's drafter and tree from its ``speculative``
field, hands the generation to the `Engine` thread (one scheduler: requests
with different settings share every target forward) and streams back the
text the engine's detokenizer released. It never decodes by itself. Routes: ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator, Mapping, Sequence

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from specgraft.heads import PromptLookup
from specgraft.heads.base import Drafter
from specgraft.infer.observer import StepObserver
from specgraft.infer.serve.engine import Engine, Job, QueueFull
from specgraft.infer.serve.learning import HeadWatcher
from specgraft.infer.events import Failed, Finished, Tokens
from specgraft.infer.serve.protocol import (
    COMPLETION_MAX_TOKENS,
    MAX_SPECULATIVE_TOKENS,
    MAX_TREE_NODES,
    ChatCompletionRequest,
    CompletionRequest,
    Speculative,
    TextStream,
    engine_options,
    error_body,
    finish_reason,
    new_id,
    now,
    refused_options,
    stop_strings,
)
from specgraft.infer.request import PromptIds, check_prompt
from specgraft.infer.scheduler import most_draft_slots, most_tree_nodes
from specgraft.infer.serve.metrics import Metrics
from specgraft.infer.stats import GenerationStats
from specgraft.model import TREE_SLOTS, Target
from specgraft.specs import PROMPT_LOOKUP, UnknownTreeSpec, parse_tree, tree_file, tree_forms, tree_objects
from specgraft.tree import Adaptive, Chain, StaticTree, TreePolicy, policy_from_spec, tree_from_spec

RETRY_AFTER_S = 1  # what a 503 tells clients to wait: a batch of steps frees rows within about a second
DISCONNECT_POLL_S = 0.5  # how often a request that has no token yet checks that its client is still there


class HTTPError(Exception):
    """A request the server answers with an OpenAI error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


@dataclass(frozen=True)
class Choice:
    """What a request's ``speculative`` field picks: the drafter (its pool key, and the name stats report) and tree."""

    key: str  # the drafter's name in the engine's pool
    drafter: Drafter | None
    tree: TreePolicy
    name: str  # the drafter the request named (resolved from "auto")

    def tree_label(self, *, greedy: bool) -> str | None:
        """The tree the request's stats report: what its drafter grows, drawn as the request draws (None: speculation
        off). A greedy request draws every child top-k whatever the policy's ``draw``; prompt lookup ignores the
        policy's shape and copies a trie of its matches, whose depth an `Adaptive` tree sizes."""
        if self.drafter is None:
            return None
        if isinstance(self.drafter, PromptLookup):
            lookup = self.drafter
            if isinstance(self.tree, Adaptive):
                return (f"prompt-lookup trie: up to {lookup.max_matches} matches, at most "
                        f"{min(lookup.num_tokens, self.tree.max_depth)} tokens deep, sized each step by {self.tree!r}")
            return f"prompt-lookup trie: up to {lookup.max_matches} matches, at most {lookup.num_tokens} tokens deep"
        tree = self.tree
        if greedy and getattr(tree, "draw", "top-k") != "top-k":  # (DynamicTree and Adaptive always draw top-k)
            tree = replace(tree, draw="top-k")
        return repr(tree)


@dataclass
class ServerState:
    """What the routes share: the target, the loaded drafters, the engine and the metrics."""

    target: Target
    drafters: dict[str, Drafter | None]
    default_drafter: str
    default_tree: TreePolicy
    model_name: str
    engine: Engine
    metrics: Metrics
    api_key: str | None = None
    prompt_lookups: dict[int, PromptLookup] = field(default_factory=dict)  # one per num_speculative_tokens

    def resolve(self, spec: Speculative | None) -> Choice:
        """The drafter and tree a request's ``speculative`` field picks; errors name what is available."""
        spec = spec or Speculative()
        name = self.default_drafter if spec.drafter == "auto" else spec.drafter
        if name not in self.drafters:
            raise HTTPError(400, f"unknown drafter {spec.drafter!r}: available are {', '.join(self.available())}",
                            param="speculative.drafter")
        if spec.num_speculative_tokens is not None and spec.tree is not None:
            raise HTTPError(400, "give speculative.num_speculative_tokens or speculative.tree, not both",
                            param="speculative")
        drafter = self.drafters[name]
        if drafter is None:
            return Choice(name, None, self.default_tree, name)
        tree = self.default_tree
        if spec.num_speculative_tokens is not None:
            tree = Chain(depth=spec.num_speculative_tokens)
        elif spec.tree is not None:
            tree = request_tree(spec.tree)
        if isinstance(drafter, PromptLookup):  # copies tokens, ignores trees: K is how many it copies
            k = spec.num_speculative_tokens
            if k is None:
                return Choice(name, drafter, tree, name)
            lookup = self.prompt_lookups.setdefault(k, PromptLookup(num_tokens=k))
            return Choice(f"{name}:num_tokens={k}", lookup, tree, name)
        return Choice(name, drafter, tree, name)

    def available(self) -> list[str]:
        return ["auto", *self.drafters]


def request_tree(spec: str | list[list[int]] | dict[str, Any]) -> TreePolicy:
    """A tree from a request: a spelling of `TREE_FORMS` that reads no file, static paths, or a tree object
    (`TREE_OBJECTS`).

    Never a file: a request must not make the server read its disk.
    """
    try:
        if isinstance(spec, str):
            try:
                parsed = parse_tree(spec)
            except UnknownTreeSpec:  # its message lists the file forms too, which a request may not use
                parsed = None
            if parsed is None or tree_file(parsed) is not None:
                raise ValueError(f"tree {spec!r}: a request takes {tree_forms(files=False)}, a list of paths, or a "
                                 f"tree object: {tree_objects()} (never a file)")
            tree = policy_from_spec(parsed)
        elif isinstance(spec, list):
            tree = StaticTree(spec)
        else:
            tree = tree_from_spec(spec, where="speculative.tree")
    except (ValueError, TypeError, KeyError) as err:
        raise HTTPError(400, str(err), param="speculative.tree") from None
    depth = tree.max_depth
    if isinstance(tree, StaticTree):
        nodes = len(tree.choices)
    else:  # a chain (depth nodes), a dynamic tree (budget nodes) or an adaptive one (at most max_nodes)
        nodes = getattr(tree, "budget", None) or getattr(tree, "max_nodes", None) or depth
    nodes = max(nodes, getattr(tree, "top_k", 0))  # a dynamic tree scores top_k children of every node it grows
    if depth > MAX_SPECULATIVE_TOKENS or nodes > MAX_TREE_NODES:
        raise HTTPError(400, f"tree {spec!r} is too large: depth {depth} (at most {MAX_SPECULATIVE_TOKENS}), "
                        f"{nodes} nodes (at most {MAX_TREE_NODES})", param="speculative.tree")
    return tree


def tree_headroom(drafters: dict[str, Drafter | None], default_tree: TreePolicy) -> int:
    """The KV pool's slots a row for the tree it verifies: the most nodes, root included, of the largest tree this
    server admits, whichever drafter grows it: the default tree, a request's (`request_tree`: at most
    `MAX_TREE_NODES` drafts, `MAX_SPECULATIVE_TOKENS` deep), or a prompt lookup's trie (a request's
    ``num_speculative_tokens`` copies that many tokens). `TREE_SLOTS` where a drafter's trees have no known bound."""
    trees = (default_tree, Chain(depth=MAX_SPECULATIVE_TOKENS))  # (a lookup's trie ignores the tree's shape)
    sizes = [most_tree_nodes(drafter, tree) for drafter in drafters.values() for tree in trees]
    sizes += [1 + MAX_TREE_NODES, most_tree_nodes(PromptLookup(num_tokens=MAX_SPECULATIVE_TOKENS), default_tree)]
    return TREE_SLOTS if None in sizes else max(sizes)


def draft_headroom(drafters: dict[str, Drafter | None], default_tree: TreePolicy, tree_slots: int) -> int:
    """The draft pools' slots a row for drafting a tree: the KV pool's (``tree_slots``), or the default tree's
    drafting where it takes more, so that a request naming no tree is never refused. A request's tree that takes more
    is refused with a 400 (`Scheduler.submit`): a dynamic tree's levels take (depth - 1) x top_k slots beside its
    root, 16,129 for dynamic:256,64,256, whose 256 drafts the KV pool holds."""
    sizes = [most_draft_slots(drafter, default_tree) for drafter in drafters.values()]
    return max([tree_slots, *(size for size in sizes if size is not None)])


def chat_prompt_ids(target: Target, messages: list[dict[str, str]]) -> PromptIds:
    """The target's chat template applied to the messages, ready for the assistant's turn.

    A target without a template (a base model such as stories260K) gets the
    messages' texts joined by newlines, encoded as plain text.
    """
    tokenizer = target.tokenizer
    if tokenizer is None:
        raise HTTPError(400, f"target {target.name!r} has no tokenizer: chat needs one")
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return checked(target, [int(i) for i in ids], "messages")
    return checked(target, "\n".join(m["content"] for m in messages), "messages")


def completion_prompt_ids(target: Target, prompt: str | list) -> PromptIds:
    """One prompt's token ids: a string, a list of token ids, or a one-item list of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        raise HTTPError(400, f"prompt holds {len(prompt)} prompts: one prompt per request", param="prompt")
    if isinstance(prompt, str) and prompt and target.tokenizer is None:
        raise HTTPError(400, f"target {target.name!r} has no tokenizer: send token ids", param="prompt")
    return checked(target, prompt, "prompt")


def checked(target: Target, prompt: str | list[int], param: str) -> PromptIds:
    """The engine's own check of a prompt (`check_prompt`), once, as a 400 naming the request's field."""
    try:
        return check_prompt(target, prompt)
    except ValueError as err:
        raise HTTPError(400, str(err), param=param) from None


# ---------------------------------------------------------------------------------------------- the app


def create_app(
    target: Target,
    drafters: dict[str, Drafter | None],
    *,
    default_drafter: str = PROMPT_LOOKUP,
    default_tree: TreePolicy | None = None,
    model_name: str | None = None,
    max_batch_size: int = 16,
    max_queue: int = 256,
    api_key: str | None = None,
    observers: Sequence[StepObserver] = (),
    learning: Mapping[str, str | Path] | None = None,
) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine thread and stops it (failing what is left) at shutdown.

    Args:
        drafters: name -> loaded drafter; ``none`` and ``prompt-lookup`` are added when absent.
        default_drafter: the drafter of requests without ``speculative`` (and of ``"auto"``).
        default_tree: the tree of requests that name none (default ``Adaptive()``: sized each step by expected
            goodput, so speculation does not cost throughput under load; T(N) is timed here, before serving).
        observers: more observers of the engine's steps, beside its metrics (a traffic recorder).
        learning: drafter name -> the directory its learner publishes versions in (`HeadWatcher`): each new one is
            swapped in between steps, and /metrics counts acceptance by version.
    """
    drafters = {"none": None, PROMPT_LOOKUP: PromptLookup(), **drafters}
    if default_drafter not in drafters:
        raise ValueError(f"--default-drafter {default_drafter!r} is not loaded: choose from {', '.join(drafters)}")
    for name in learning or {}:
        if drafters.get(name) is None:
            raise ValueError(f"no drafter {name!r} to learn: loaded are {', '.join(drafters)}")
        if not hasattr(drafters[name], "adopt"):
            raise ValueError(f"drafter {name!r} ({type(drafters[name]).__name__}) cannot learn: only a head's drafter "
                             "(EAGLE, EAGLE-3, Medusa, DFlash) takes new weights between steps")
    default_tree = default_tree or Adaptive()
    metrics = Metrics()
    tree_slots = tree_headroom(drafters, default_tree)
    engine = Engine(target, drafters, max_batch_size=max_batch_size, max_queue=max_queue, observer=metrics,
                    tree_slots=tree_slots, draft_slots=draft_headroom(drafters, default_tree, tree_slots))
    for observer in observers:
        engine.scheduler.add_observer(observer)
    watchers = []
    for name, directory in (learning or {}).items():
        watchers.append(HeadWatcher(engine, target, name, directory))
        metrics.learning(name)
    state = ServerState(
        target=target, drafters=drafters, default_drafter=default_drafter, default_tree=default_tree,
        model_name=model_name or target.name, engine=engine, metrics=metrics, api_key=api_key,
    )

    if isinstance(state.default_tree, Adaptive):
        engine.scheduler.prepare_adaptive()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        for watcher in watchers:
            watcher.start()
        yield
        for watcher in watchers:
            await asyncio.to_thread(watcher.stop)
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="specgraft", lifespan=lifespan)
    app.state.specgraft = state

    @app.exception_handler(HTTPError)
    async def http_error(request: Request, err: HTTPError) -> JSONResponse:
        return error_response(state, err)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {"msg": "invalid request", "loc": ()}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid" or not param:
            why = first.get("ctx", {}).get("error", first["msg"])
            return error_response(state, HTTPError(400, f"malformed JSON body (expected a JSON object): {why}"))
        return error_response(state, HTTPError(400, f"{param or 'body'}: {first['msg']}", param=param or None))

    async def check_api_key(request: Request) -> None:
        """A dependency of the /v1/ routes (a middleware would wrap ``receive`` and hide client disconnects)."""
        if state.api_key:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
                raise HTTPError(401, "missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key")

    keyed = [Depends(check_api_key)]

    @app.get("/health")
    async def health() -> Response:
        if engine.crashed is not None or not engine.thread.is_alive():
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=keyed)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": now(), "owned_by": "specgraft",
            "max_model_len": target.max_context, "drafters": state.available(), "default_drafter": state.default_drafter,
        }]}

    @app.post("/v1/completions", dependencies=keyed)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        ids = completion_prompt_ids(target, body.prompt)
        max_tokens = COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        return await serve(state, request, body, ids, max_tokens, chat=False, budget_field="max_tokens")

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        if not body.messages:
            raise HTTPError(400, "messages is empty", param="messages")
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        except ValueError as err:
            raise HTTPError(400, str(err), param="messages") from None
        ids = chat_prompt_ids(target, messages)
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        budget = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if budget is None:  # as vLLM: the rest of the context
            budget = target.max_context - len(ids.ids)
            if budget < 1:
                raise HTTPError(400, f"prompt ({len(ids.ids)} tokens) fills the target's context of {target.max_context} tokens",
                                param="messages")
        return await serve(state, request, body, ids, budget, chat=True, budget_field=field)

    return app


def error_response(state: ServerState, err: HTTPError) -> JSONResponse:
    state.metrics.requests.labels(str(err.status)).inc()
    kind = err.kind if err.status < 500 else "server_error"
    headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status == 503 else None
    return JSONResponse(error_body(err.message, kind=kind, param=err.param, code=err.code), status_code=err.status,
                        headers=headers)


@dataclass
class Reply:
    """What one request needs while its tokens arrive."""

    job: Job
    chat: bool
    id: str
    created: int
    prompt_tokens: int
    text: TextStream
    token_ids: bool  # return token ids with the text (vLLM's return_token_ids)
    tokens: list[int] = field(default_factory=list)


async def serve(state: ServerState, request: Request, body: CompletionRequest | ChatCompletionRequest,
                prompt_ids: PromptIds, max_tokens: int, *, chat: bool, budget_field: str) -> Response:
    """Validate, submit, wait for the first event (so a refused option is still a 4xx), then answer.

    ``budget_field``: the request's field that set ``max_tokens``, for the error that names it.
    """
    if body.model is not None and body.model != state.model_name:
        raise HTTPError(404, f"model {body.model!r} does not exist: this server serves {state.model_name!r}",
                        param="model", code="model_not_found")
    why = refused_options(body)
    if why:
        raise HTTPError(400, why)
    if len(prompt_ids.ids) + max_tokens > state.target.max_context:
        raise HTTPError(400, f"prompt ({len(prompt_ids.ids)} tokens) + {budget_field} ({max_tokens}) exceeds the "
                        f"target's context of {state.target.max_context} tokens", param=budget_field)
    choice = state.resolve(body.speculative)
    job = Job(drafter_key=choice.key, drafter=choice.drafter, tree=choice.tree, prompt=prompt_ids,
              max_new_tokens=max_tokens, options=engine_options(body), loop=asyncio.get_running_loop(),
              drafter_name=choice.name, tree_label=choice.tree_label(greedy=body.temperature == 0))
    try:
        state.engine.submit(job)
    except QueueFull as err:
        raise HTTPError(503, f"server busy: {err}; retry after {RETRY_AFTER_S}s", code="server_busy") from None
    reply = Reply(job, chat, new_id("chatcmpl" if chat else "cmpl"), now(), len(prompt_ids.ids),
                  TextStream(stop_strings(body)), body.return_token_ids)
    first = await first_event(state, request, job)
    if first is None:
        return Response(status_code=499)
    if isinstance(first, Failed):
        raise failure(first)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(stream(state, reply, first, max_tokens, include_usage), media_type="text/event-stream")
    return await whole(state, request, reply, first, max_tokens)


async def first_event(state: ServerState, request: Request, job: Job):
    """The job's first event, or None when its client disconnected while it waited (the job is cancelled)."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                state.engine.cancel(job)
                state.metrics.requests.labels("499").inc()
                return None


async def whole(state: ServerState, request: Request, reply: Reply, event, max_tokens: int) -> Response:
    """A non-streaming answer: gather every token, then one JSON body.

    The client is checked every ``DISCONNECT_POLL_S`` while tokens arrive too:
    one that went away has its job cancelled rather than run to the end.
    """
    text = ""
    checked = time.monotonic()
    while not isinstance(event, (Finished, Failed)):
        reply.tokens += event.token_ids
        text += reply.text.add(event.text)
        if time.monotonic() - checked > DISCONNECT_POLL_S:
            checked = time.monotonic()
            if await request.is_disconnected():
                state.engine.cancel(reply.job)
                state.metrics.requests.labels("499").inc()
                return Response(status_code=499)
        event = await first_event(state, request, reply.job)
        if event is None:
            return Response(status_code=499)
    if isinstance(event, Failed):
        raise failure(event)
    text += reply.text.finish(event.output.text)
    reason = finish_reason(reply.text, reply.tokens, max_tokens, state.target.eos_token_ids)
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": reason}
              if reply.chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": reason})
    if reply.token_ids:
        choice["token_ids"] = reply.tokens
    state.metrics.requests.labels("200").inc()
    return JSONResponse({
        "id": reply.id, "object": "chat.completion" if reply.chat else "text_completion", "created": reply.created,
        "model": state.model_name, "choices": [choice], "usage": usage(reply),
        "speculative_stats": speculative_stats(reply.job, event.output.stats),
    })


async def stream(state: ServerState, reply: Reply, event, max_tokens: int, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: a chunk per step that released text, a chunk with the finish reason, then (with
    ``include_usage``) the usage chunk; ``speculative_stats`` rides on the last of them.

    When the client goes away, Starlette stops this generator: ``finally``
    cancels the job, and the engine frees its rows before its next step. Whether the job ended is what this
    generator saw (a Finished or Failed event), not ``job.ended``: the engine thread posts the last event
    before it marks the job ended, so a stream read to its end could otherwise be counted as a disconnect.
    """
    job = reply.job
    ended = False
    try:
        if reply.chat:
            yield sse(chunk(state, reply, {"role": "assistant", "content": ""}, None))
        while isinstance(event, Tokens):
            reply.tokens += event.token_ids
            delta = reply.text.add(event.text)
            if delta or reply.token_ids:
                yield sse(chunk(state, reply, delta, None, event.token_ids))
            event = await job.events.get()
        ended = True
        if isinstance(event, Failed):  # the status line is sent already: report in the stream, as vLLM does
            err = failure(event)
            state.metrics.requests.labels(str(err.status)).inc()
            yield sse(error_body(err.message, kind="server_error", code=err.status))
            yield "data: [DONE]\n\n"
            return
        # Counted before the last chunks go out: a client that closes as soon as it reads [DONE] stops this
        # generator at that yield, and its request still succeeded.
        state.metrics.requests.labels("200").inc()
        reason = finish_reason(reply.text, reply.tokens, max_tokens, state.target.eos_token_ids)
        finish = chunk(state, reply, reply.text.finish(event.output.text), reason)
        stats = {"speculative_stats": speculative_stats(job, event.output.stats)}  # on the last chunk, whichever it is
        if include_usage:
            yield sse(finish)
            yield sse({**chunk(state, reply, "", None), "choices": [], "usage": usage(reply), **stats})
        else:
            yield sse({**finish, **stats})
        yield "data: [DONE]\n\n"
    finally:
        if not ended:
            state.engine.cancel(job)
            state.metrics.requests.labels("499").inc()


def chunk(state: ServerState, reply: Reply, delta: str | dict[str, str], reason: str | None,
          token_ids: list[int] | None = None) -> dict[str, Any]:
    """One streamed chunk; ``token_ids`` (the step's tokens) when the request asked for them."""
    if reply.chat:
        content = delta if isinstance(delta, dict) else ({"content": delta} if delta or reason is None else {})
        choice = {"index": 0, "delta": content, "logprobs": None, "finish_reason": reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}
        kind = "text_completion"
    if reply.token_ids and token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": reply.id, "object": kind, "created": reply.created, "model": state.model_name, "choices": [choice]}


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def usage(reply: Reply) -> dict[str, int]:
    """Tokens, never forward passes: what the request generated, however many target calls it took."""
    done = len(reply.tokens)
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": done, "total_tokens": reply.prompt_tokens + done}


def failure(event: Failed) -> HTTPError:
    """A failed job as the HTTP error it answers: the engine's own refusals carry a status; a step's fault is a 500."""
    return HTTPError(getattr(event.error, "status", 500), str(event.error))


def speculative_stats(job: Job, stats: GenerationStats) -> dict[str, Any]:
    """How the tokens were made. ``target_calls`` counts the prefill (it makes the first token), so plain
    decoding has exactly one target call per token."""
    return {
        "drafter": job.drafter_name,
        "tree": job.tree_label,
        "mean_accepted_length": stats.tau,  # null where no verification step ran (an answer of only EOS)
        "target_calls": stats.target_calls + 1,
        "draft_tokens_per_token": stats.draft_tokens_per_token,
    }


# ---------------------------------------------------------------------------------------------- running it


def run_server(app: FastAPI, *, host: str, port: int, shutdown_timeout: float) -> int:
    """Serve ``app`` until SIGTERM / SIGINT; uvicorn drains in-flight requests for up to ``shutdown_timeout`` s."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=shutdown_timeout)
    # uvicorn catches SIGTERM, stops accepting, drains in-flight requests (up to --shutdown-timeout), and then
    # re-raises the signal for the handler it found. That handler is this one, so a drained server exits 0
    # rather than dying by the signal's default action.
    caught: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: caught.append(sig))
    try:
        uvicorn.Server(config).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if caught:
        print("specgraft serve: SIGTERM: stopped accepting, drained in-flight requests, exiting", file=sys.stderr)
    return 0
