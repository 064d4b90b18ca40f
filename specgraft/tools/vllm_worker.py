"""One vLLM engine in its own interpreter, answering JSON requests: run by `specgraft.tools.vllm_engine`.

    .venv-vllm/bin/python specgraft/tools/vllm_worker.py

vLLM lives in its own environment (its transformers and torch pins are its
own), so this file is run by *that* environment's Python and imports nothing
but the standard library and vLLM; specgraft is not installed there.

The protocol is one JSON object a line. The first line on stdin configures
the engine (``LLM``'s keyword arguments, ``speculative_config`` included); the
worker answers ``{"ok": true, ...}`` once it is loaded. Each later line is a
request, answered by one line:

- ``{"op": "generate", "prompts": [[ids], ...], "max_tokens": N, "temperature": 0.0, "ignore_eos": true}``:
  every prompt's ``token_ids``, the call's ``wall_s`` (``LLM.generate`` alone), each request's ``ttft_s`` and
  ``decode_s``, and ``spec``: the spec-decode counters this call added (vLLM's ``spec_decode_num_drafts``,
  ``..._num_draft_tokens``, ``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``); with speculation and
  ``per_request_spec_decode_metrics`` on, each request's ``histograms`` (steps by accepted drafts: [j] accepted j).
  With ``"kv_transfer_params": {...}`` (a KV connector's, e.g. ``{"include_output_tokens": true}``), every request
  is sent them, and each one's ``kv_transfer_params`` as the connector answered comes back.
- ``{"op": "start_profile"}`` and ``{"op": "stop_profile"}``: ``LLM``'s torch profiler, for an engine configured
  with ``profiler_config`` (it writes its traces and an op table there).

Answers go to the stdout the worker was started with; vLLM's own logs (it logs
to stdout) are moved to stderr first, so they never mix with answers. The
worker ends at the end of its stdin. An error answers ``{"error": ...}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

SPEC_COUNTERS = {  # vLLM's metric name -> the key answered
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos",
}


def spec_counters(llm) -> dict:
    """The engine's spec-decode counters so far (empty without speculation)."""
    counters = {}
    for metric in llm.get_metrics():
        key = SPEC_COUNTERS.get(metric.name)
        if key == "accepted_per_pos":
            counters[key] = list(metric.values)
        elif key is not None:
            counters[key] = metric.value
    return counters


def difference(after: dict, before: dict) -> dict:
    """What one call added to the counters."""
    out = {}
    for key, value in after.items():
        if isinstance(value, list):
            earlier = before.get(key) or [0] * len(value)
            out[key] = [a - b for a, b in zip(value, earlier)]
        else:
            out[key] = value - before.get(key, 0)
    return out


def generate(llm, request: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    kv_transfer_params = request.get("kv_transfer_params")  # a KV connector's, for every request of the call
    params = SamplingParams(
        temperature=request.get("temperature", 0.0),
        max_tokens=request["max_tokens"],
        ignore_eos=request.get("ignore_eos", True),
        seed=request.get("seed"),
        extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None,
    )
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in request["prompts"]]
    before = spec_counters(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    answer = {"token_ids": [list(o.outputs[0].token_ids) for o in outputs], "wall_s": wall,
              "spec": difference(spec_counters(llm), before), "ttft_s": [], "decode_s": [], "histograms": [],
              "kv_transfer_params": [o.kv_transfer_params for o in outputs]}
    for o in outputs:
        m = o.metrics  # RequestStateStats: engine-core timestamps, monotonic
        answer["ttft_s"].append(getattr(m, "first_token_latency", None) if m else None)
        answer["decode_s"].append(m.last_token_ts - m.first_token_ts if m and m.first_token_ts else None)
        spec = getattr(o.outputs[0], "spec_decode_metrics", None)  # with per_request_spec_decode_metrics="summary"
        answer["histograms"].append(list(spec.histogram) if spec is not None else None)
    return answer


def main() -> int:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM logs to stdout: send it (and its engine processes, which inherit fd 1) to stderr
    sys.stdout = sys.stderr

    def answer(obj: dict) -> None:
        answers.write(json.dumps(obj) + "\n")

    try:
        config = json.loads(sys.stdin.readline())
        start = time.perf_counter()
        import vllm
        from vllm import LLM

        llm = LLM(**config)
    except Exception as e:  # the host reports it with this process's log
        answer({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        return 1
    answer({"ok": True, "vllm_version": vllm.__version__, "load_s": time.perf_counter() - start})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            op = request.get("op")
            if op == "generate":
                answer(generate(llm, request))
            elif op in ("start_profile", "stop_profile"):  # with profiler_config in the engine's configuration
                getattr(llm, op)()
                answer({"ok": True})
            else:
                raise ValueError(f"unknown op {op!r}; expected 'generate', 'start_profile' or 'stop_profile'")
        except Exception as e:
            answer({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    return 0


if __name__ == "__main__":  # vLLM spawns its engine core: the guard keeps the children from running this again
    sys.exit(main())
