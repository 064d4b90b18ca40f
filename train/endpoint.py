"""Regeneration through an OpenAI-compatible server: vLLM, SGLang, or `specgraft serve`.

A target that needs GPUs writes its training data where it is served: the
serving engine batches and scales, and regeneration only sends requests.
Chat turns go to ``/v1/chat/completions`` (the server applies the target's
chat template); text continuations and self-instruct user turns go to
``/v1/completions`` with the prompt as token ids, so nothing is lost to a
tokenizer round trip. Replies are taken as token ids where the server returns
them (vLLM's and specgraft's ``return_token_ids``), else the reply text is
encoded, so at temperature 0 the records equal in-process regeneration's.

The `openai` client retries connection errors, timeouts, 429 and 5xx with
exponential backoff (honouring ``Retry-After``); a request that still fails
stops the run, and the records already written stay (a rerun resumes).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Sequence

DEFAULT_API_KEY_ENV = "OPENAI_API_KEY"


@dataclass(frozen=True)
class Sampling:
    """What every request asks for: the recipe's sampling settings, neutral otherwise."""

    temperature: float
    top_p: float = 1.0


class EndpointClient:
    """One OpenAI-compatible server; thread-safe (the `openai` client pools connections)."""

    def __init__(
        self,
        base_url: str,
        tokenizer,
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        max_retries: int = 8,
    ) -> None:
        from openai import OpenAI

        self.tokenizer = tokenizer
        self.client = OpenAI(
            base_url=base_url.rstrip("/") if base_url.rstrip("/").endswith("/v1") else base_url.rstrip("/") + "/v1",
            api_key=api_key or "EMPTY",  # servers without --api-key ignore it; the client needs a value
            timeout=timeout_s,
            max_retries=max_retries,
        )
        self.model = model or self._served_model(base_url)

    def _served_model(self, base_url: str) -> str:
        models = [m.id for m in self.client.models.list()]
        if not models:
            raise ValueError(f"data.regenerate.endpoint {base_url} serves no model; set data.regenerate.model")
        if len(models) > 1:
            raise ValueError(
                f"data.regenerate.endpoint {base_url} serves {len(models)} models ({', '.join(models)}); "
                "name one in data.regenerate.model"
            )
        return models[0]

    def complete(self, prompt: Sequence[int], max_tokens: int, sampling: Sampling, seed: int) -> list[int]:
        """A continuation of ``prompt`` (token ids): its token ids, end-of-sequence included if it stopped there."""
        response = self.client.completions.create(
            model=self.model, prompt=list(prompt), max_tokens=max_tokens, seed=seed, **_sampling(sampling),
        )
        choice = response.choices[0]
        return self._ids(getattr(choice, "token_ids", None), choice.text)

    def chat(self, messages: Sequence[dict], max_tokens: int, sampling: Sampling, seed: int) -> list[int]:
        """The assistant's reply to ``messages``, as token ids."""
        response = self.client.chat.completions.create(
            model=self.model, messages=list(messages), max_tokens=max_tokens, seed=seed, **_sampling(sampling),
        )
        choice = response.choices[0]
        return self._ids(getattr(choice, "token_ids", None), choice.message.content or "")

    def _ids(self, token_ids: Sequence[int] | None, text: str) -> list[int]:
        if token_ids is not None:
            return [int(t) for t in token_ids]
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _sampling(sampling: Sampling) -> dict:
    """The request's sampling fields; the server's own defaults (a model's top_k, penalties) are switched off where
    the server has a field for them, since regeneration samples the target's own distribution."""
    return {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "extra_body": {"return_token_ids": True, "top_k": -1, "repetition_penalty": 1.0},
    }


def request_seed(seed: int, job_id: str, round_: int) -> int:
    """A per-request seed from the run's seed, the record and its round: a server that honours ``seed`` samples
    each record the same way on a rerun, whatever order the requests arrive in."""
    digest = hashlib.sha256(f"{seed}:{job_id}:{round_}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def api_key_from(env_var: str | None) -> str | None:
    """The API key in ``env_var`` (default OPENAI_API_KEY), or None when it is unset."""
    return os.environ.get(env_var or DEFAULT_API_KEY_ENV)
