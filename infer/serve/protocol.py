"""OpenAI's request and response shapes, as `specgraft serve` reads and writes them.

Request bodies follow OpenAI's and vLLM's protocol field by field:

- Types are strict, as OpenAI's API is: ``"max_tokens": "8"`` or ``8.0`` is a
  400 naming the field (vLLM's pydantic models coerce them; we follow OpenAI).
  A float field takes an integer (``"temperature": 1``), as both do.
- ``model`` may be omitted: it means the served model, as in vLLM (OpenAI
  requires it); a model name other than the served one is a 404.
- Unknown top-level fields are ignored and logged by name at WARNING, as vLLM
  does (OpenAI clients send fields this server does not use). Known fields
  the engine cannot honour are refused by name (`refused_options`).
- ``max_tokens`` defaults to 16 on /v1/completions (OpenAI's and vLLM's
  default) and to the rest of the target's context on /v1/chat/completions
  (vLLM's; ``max_completion_tokens`` is taken first). Errors name the
  request's own field. `TextStream` turns committed tokens into text deltas with
OpenAI's stop-string rule: a stop string, and anything after it, never
reaches the client.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator


# Speculation limits per request: a request picks its own tree, so its size is bounded here (the server's KV pool
# holds a row's slots for the largest tree it admits, these included: `tree_headroom`; a tree this size already costs
# far more to verify than it can save).
MAX_SPECULATIVE_TOKENS = 64
MAX_TREE_NODES = 256
COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions

log = logging.getLogger("specgraft.serve")


class Speculative(BaseModel):
    """The per-request ``speculative`` field: which drafter, and how far it drafts."""

    model_config = ConfigDict(extra="forbid", strict=True)

    drafter: str = "auto"  # a name the server loaded, "auto" (the server's default) or "none"
    num_speculative_tokens: int | None = Field(None, ge=1, le=MAX_SPECULATIVE_TOKENS)
    tree: str | list[list[int]] | dict[str, Any] | None = None  # a tree spec (no file), paths, or a tree object


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields both routes share: OpenAI's, plus the extras vLLM accepts (top_k, min_p, repetition_penalty)."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _log_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(cls.model_fields))
            if unknown:
                log.warning("%s: ignored fields %s (this server does not use them)", cls.__name__, unknown)
        return data

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)  # OpenAI's default
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1 (vLLM's spelling): no top-k
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM's: generate max_tokens whatever the EOS token says
    return_token_ids: bool = False  # vLLM's: each choice also carries its token ids
    speculative: Speculative | None = None
    store: bool | None = None  # OpenAI's: false keeps the request out of the server's recording (serve --record)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(COMPLETION_MAX_TOKENS, ge=1)
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text: a string, or its text parts joined (other parts are refused)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"message content part of type {part.get('type')!r} is not supported: text only")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None


def refused_options(req: CompletionRequest | ChatCompletionRequest) -> str | None:
    """Why the engine cannot serve these options as asked, or None.

    Penalties are refused rather than ignored: each would need a different
    target distribution on every draft path (the engine refuses
    repetition_penalty and presence_penalty itself; frequency_penalty and
    logit_bias never reach it).
    """
    if req.n != 1:
        return f"n={req.n} is not supported: one completion per request (send n requests)"
    if req.logprobs:
        return "logprobs are not supported by this server"
    if req.frequency_penalty:
        return f"frequency_penalty={req.frequency_penalty} is not supported: it changes the target's distribution per draft path"
    if req.logit_bias:
        return "logit_bias is not supported by this server"
    if isinstance(req, CompletionRequest):
        if req.echo:
            return "echo is not supported by this server"
        if req.best_of not in (None, 1):
            return f"best_of={req.best_of} is not supported: one completion per request"
        if req.suffix:
            return "suffix is not supported by this server"
    return None


def engine_options(req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """The request's sampling options as `Scheduler.submit` takes them."""
    return dict(
        temperature=req.temperature, top_k=max(req.top_k, 0), top_p=req.top_p, min_p=req.min_p,
        seed=req.seed, stop=stop_strings(req), repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty, eos_token_id=() if req.ignore_eos else None,
        record=req.store is not False,
    )


def stop_strings(req: CompletionRequest | ChatCompletionRequest) -> tuple[str, ...]:
    stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return tuple(s for s in stops if s)


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class TextStream:
    """Text deltas of a growing output with OpenAI's stop rule (the stop string is not returned).

    It reads the text the engine's detokenizer released step by step (`Tokens.text`)
    and decodes nothing itself. While stop strings are set, the last ``longest
    stop - 1`` characters are held back: they may be the start of a stop string
    the next tokens complete.
    """

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.text = ""
        self.stops = tuple(stops)
        self.hold = max(map(len, self.stops), default=1) - 1
        self.sent = 0
        self.stopped = False  # a stop string was found: nothing more is released

    def add(self, delta: str) -> str:
        self.text += delta
        return self._release(self.text, final=False)

    def finish(self, text: str) -> str:
        """The rest of the text, reconciled with the output's full decode ``text`` (releasing any held-back characters)."""
        return self._release(text, final=True)

    def _release(self, text: str, final: bool) -> str:
        if self.stopped:
            return ""
        # A stop string starting before `sent` would have been whole when that text was released.
        found = [i for i in (text.find(s, self.sent) for s in self.stops) if i != -1]
        if found:
            self.stopped = True
            end = min(found)
        else:
            end = len(text) if final else max(self.sent, len(text) - self.hold)
        delta = text[self.sent : end]
        self.sent = max(self.sent, end)
        return delta


def finish_reason(stream: TextStream, token_ids: Sequence[int], max_tokens: int, eos: Sequence[int]) -> str:
    """``stop`` (EOS or a stop string) or ``length`` (the token budget ran out), as OpenAI reports it."""
    if stream.stopped or (token_ids and token_ids[-1] in eos):
        return "stop"
    return "length" if len(token_ids) >= max_tokens else "stop"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
