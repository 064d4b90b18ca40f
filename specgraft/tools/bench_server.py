"""`specgraft bench --server URL`: a running server driven by the `openai` client at several concurrency levels.

    specgraft serve --target ../shared/models/stories260K --max-batch-size 64 &
    specgraft bench --server http://127.0.0.1:8000 --concurrency 1,4,16,64 \
        --prompts ../shared/data/story_prompts_dev.jsonl --out /tmp/bench-server

Each level runs every prompt as a streaming greedy request, ``concurrency``
in flight at once, twice: speculation on (the request's ``speculative``
field names the drafter) and off (``{"drafter": "none"}``); the order of the
two alternates from pass to pass so neither always runs first. With
``--rounds N`` a level makes N such pairs of passes and pools each mode's
(a short pass moves by 10% or more with the machine's load; pooled rounds,
alternated, move much less). Latency and throughput are measured apart, as
DESIGN.md asks:

- TTFT: request sent -> first chunk with tokens (queueing and prefill included).
- ITL: the gap between two chunks / the tokens of the later chunk (a step's
  tokens arrive together), pooled over a level's requests.
- per-request tokens/s: completion tokens / the request's wall time (median).
- total tokens/s: all completion tokens of the level / the level's wall time (summed over its rounds).
- paired: speculation off's wall time over on's, round by round (the two passes of a round run back to back and,
  greedy with the same budgets, make the same tokens), as a median and quartiles: a burst of load moves a pooled
  total by all of it, a median of pairs hardly (served on stories260K, a pass moved by 15-20% from round to round).

With ``--vllm-server LABEL=URL`` (repeatable), running ``vllm serve`` instances
join the rotation as modes of their own (``vllm LABEL``: plain, or with a
``--speculative-config``), on the same prompts and levels; each of specgraft's
two modes is set against each of them, pooled and paired round by round, and a
vLLM server's tokens per verification step come from its ``/metrics`` counters.

Greedy outputs with speculation on (and every vLLM server's) must equal those with it off, token for token
(lossless; token ids, as engines render a lone byte token's text differently); a difference is listed and
makes the command return 1. Writes
``results.json``, ``results.md`` and two plots into ``--out``; after a Ctrl-C, those of the levels that finished,
marked interrupted (see `specgraft.tools.sweep`).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from specgraft.infer import percentile, quartiles
from specgraft.tools.prompts import read_prompt_file
from specgraft.tools.sweep import Sweep, SweepInterrupted, interrupted_note, nothing_written

if TYPE_CHECKING:
    import argparse

REQUEST_TIMEOUT_S = 600.0
SERVER_PLOTS = ("server_tokens_per_s.png", "server_latency.png")
SWEEP_NOUN = "concurrency level"  # how the Ctrl-C lines and the report name one value of the sweep


@dataclass
class RequestTiming:
    """One streamed request: when it started, when each chunk with tokens arrived and how many it held."""

    start: float
    token_ids: list[int] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    end: float = 0.0
    completion_tokens: int = 0
    stats: dict[str, Any] | None = None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start if self.chunk_times else self.end - self.start

    def itl(self) -> list[float]:
        gaps = []
        for i in range(1, len(self.chunk_times)):
            n = self.chunk_tokens[i]
            gaps += [(self.chunk_times[i] - self.chunk_times[i - 1]) / n] * n
        return gaps


def parse_concurrency(spec: str) -> list[int]:
    """``"1,4,16,64"`` -> [1, 4, 16, 64]; each a positive integer."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--concurrency {spec!r}: expected positive integers separated by commas, e.g. 1,4,16,64")
    return [int(p) for p in parts]


@dataclass
class Mode:
    """One way of serving the prompts: specgraft with speculation off or on, or another engine's server as it is."""

    label: str  # "off", "on", or "vllm LABEL"
    client: Any  # openai.AsyncOpenAI
    model: str
    extra_body: dict[str, Any]
    engine: str = "specgraft"
    metrics_url: str | None = None  # a vLLM server's /metrics, read around each pass for its spec-decode counters


@dataclass
class Pooled:
    """One mode's passes at a level, pooled over its rounds."""

    timings: list[RequestTiming] = field(default_factory=list)
    wall_s: float = 0.0
    drafts: float = 0.0  # a vLLM server's verification steps in them (its counters' difference)
    walls: list[float] = field(default_factory=list)  # each round's wall time, for the paired ratios


async def one_request(mode: Mode, prompt: str, max_tokens: int) -> RequestTiming:
    timing = RequestTiming(start=time.perf_counter())
    stream = await mode.client.completions.create(
        model=mode.model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={**mode.extra_body, "return_token_ids": True},
    )
    async for chunk in stream:
        now = time.perf_counter()
        for choice in chunk.choices:
            ids = getattr(choice, "token_ids", None) or []
            tokens = len(ids)
            timing.token_ids += ids
            if tokens:
                timing.chunk_times.append(now)
                timing.chunk_tokens.append(tokens)
        extra = chunk.model_extra or {}
        timing.stats = extra.get("speculative_stats") or timing.stats
        if chunk.usage is not None:
            timing.completion_tokens = chunk.usage.completion_tokens
    timing.end = time.perf_counter()
    return timing


async def run_level(mode: Mode, prompts: Sequence[str], concurrency: int, max_tokens: int
                    ) -> tuple[list[RequestTiming], float]:
    """Every prompt once, ``concurrency`` requests in flight at a time; (timings in prompt order, wall seconds)."""
    gate = asyncio.Semaphore(concurrency)

    async def gated(prompt: str) -> RequestTiming:
        async with gate:
            return await one_request(mode, prompt, max_tokens)

    start = time.perf_counter()
    timings = await asyncio.gather(*(gated(p) for p in prompts))
    return list(timings), time.perf_counter() - start


async def _vllm_counters(mode: Mode) -> dict[str, float]:
    """The spec-decode counters of a vLLM server (empty for specgraft's, which reports per request)."""
    if mode.metrics_url is None:
        return {}
    import httpx

    from specgraft.tools.vllm_engine import spec_counters_from_prometheus

    async with httpx.AsyncClient(timeout=30) as http:
        return spec_counters_from_prometheus((await http.get(mode.metrics_url)).text)


def summarize(timings: Sequence[RequestTiming], wall_s: float, drafts: float = 0.0) -> dict[str, Any]:
    """A level's latency and throughput figures over ``timings`` (one or more rounds of it) and the wall time those
    rounds took (see the module docstring for each clock). ``drafts``: a vLLM server's verification steps in them
    (from its counters; specgraft reports its target calls per request); a plain vLLM server has no steps to count,
    and its tokens per call is None."""
    ttft = sorted(t.ttft for t in timings)
    itl = sorted(x for t in timings for x in t.itl()) or [0.0]
    tokens = sum(t.completion_tokens for t in timings)
    per_request = [t.completion_tokens / (t.end - t.start) for t in timings if t.end > t.start]
    calls = sum((t.stats or {}).get("target_calls", 0) for t in timings) + drafts
    return {
        "requests": len(timings),
        "completion_tokens": tokens,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "itl_p50_s": percentile(itl, 0.5),
        "itl_p99_s": percentile(itl, 0.99),
        "request_tokens_per_s": statistics.median(per_request) if per_request else 0.0,
        "total_tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "tokens_per_target_call": tokens / calls if calls else None,
        "wall_s": wall_s,
    }


@dataclass
class ServerRun:
    """What `bench_server` has measured: the levels that finished, each added whole (its rows, its comparisons with
    vLLM, its outputs that differ) once its last pass ends, so a Ctrl-C leaves no half-measured level behind."""

    settings: dict[str, Any]
    sweep: Sweep
    levels: list[dict[str, Any]] = field(default_factory=list)
    against: list[dict[str, Any]] = field(default_factory=list)
    mismatches: list[dict[str, Any]] = field(default_factory=list)

    def finished(self, level: int, rows: list[dict], against: list[dict], mismatches: list[dict]) -> None:
        self.levels += rows
        self.against += against
        self.mismatches += mismatches
        self.sweep.done.append(level)

    def results(self) -> dict[str, Any]:
        """The results dict written by `write_server_results`, over the levels that finished."""
        return {"settings": self.settings, "levels": self.levels, "against_vllm": self.against,
                "greedy_identical": not self.mismatches, "mismatches": self.mismatches}


def bench_server(url: str, prompts: Sequence[str], levels: Sequence[int], *, max_tokens: int, drafter: str,
                 api_key: str = "none", rounds: int = 1, progress: bool = False,
                 vllm_servers: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """Every level with speculation on and off, ``rounds`` times each (the order rotating from pass to pass); the
    results dict written by `write_server_results`. ``vllm_servers``: (label, URL) of running ``vllm serve``
    instances, each a mode of its own (``vllm LABEL``) in the same rotation, checked against the same outputs.

    Raises:
        ValueError: fewer than one round.
        SweepInterrupted: Ctrl-C after a level finished; its ``results`` hold the levels that finished.
    """
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    run = ServerRun(
        settings={"server": url, "model": None, "drafter": drafter, "prompts": len(prompts), "max_tokens": max_tokens,
                  "concurrency": list(levels), "rounds": rounds, "decoding": "greedy, streamed",
                  "vllm_servers": dict(vllm_servers),
                  "ttft": "request sent -> first chunk with tokens", "itl": "chunk gap / tokens in the chunk",
                  "request_tokens_per_s": "median over requests of completion tokens / request wall time",
                  "total_tokens_per_s": "completion tokens of the level / level wall time",
                  "paired_vs_off": "off's wall time over on's, round by round: median and quartiles",
                  "against_vllm": "specgraft's pooled total tokens/s over vLLM's; paired: vLLM's wall time over "
                                  "specgraft's, round by round"},
        sweep=Sweep("concurrency", SWEEP_NOUN, list(levels)),
    )
    # A Ctrl-C reaches the coroutine as a cancellation (asyncio.run's SIGINT handler), and comes out of asyncio.run
    # as KeyboardInterrupt: the levels that finished are kept here, outside the event loop.
    with run.sweep.keep_finished(run.results):
        asyncio.run(_run_levels(run, url, prompts, levels, max_tokens, drafter, api_key, rounds, progress, vllm_servers))
    return run.results()


async def _run_levels(run: ServerRun, url: str, prompts: Sequence[str], levels: Sequence[int], max_tokens: int,
                      drafter: str, api_key: str, rounds: int, progress: bool,
                      vllm_servers: Sequence[tuple[str, str]]) -> None:
    """`bench_server`'s passes, each level added to ``run`` as it finishes."""
    import openai

    def client(base: str, key: str):
        return openai.AsyncOpenAI(base_url=f"{base.rstrip('/')}/v1", api_key=key, max_retries=0, timeout=REQUEST_TIMEOUT_S)

    ours = client(url, api_key)
    clients = [ours]
    try:
        model = run.settings["model"] = (await ours.models.list()).data[0].id
        modes = [Mode("off", ours, model, {"speculative": {"drafter": "none"}}),
                 Mode("on", ours, model, {"speculative": {"drafter": drafter}})]
        for label, server in vllm_servers:
            clients.append(theirs := client(server, "none"))
            modes.append(Mode(f"vllm {label}", theirs, (await theirs.models.list()).data[0].id, {}, engine="vllm",
                              metrics_url=f"{server.rstrip('/')}/metrics"))
        for mode in modes:  # warm-up: one untimed request each
            await one_request(mode, prompts[0], max_tokens)
        passes = 0
        for level in levels:
            rows, against, mismatches = await _level(modes, prompts, level, max_tokens, rounds, passes, progress)
            passes += rounds
            run.finished(level, rows, against, mismatches)
    finally:
        for each in clients:
            await each.close()


async def _level(modes: Sequence[Mode], prompts: Sequence[str], level: int, max_tokens: int, rounds: int, passes: int,
                 progress: bool) -> tuple[list[dict], list[dict], list[dict]]:
    """One level's ``rounds`` of passes, each mode once a round (the order rotating from the ``passes`` before):
    its rows, its comparisons with vLLM and the outputs that differ from speculation off's."""
    pooled = {m.label: Pooled() for m in modes}
    mismatches, against = [], []
    for _ in range(rounds):
        outputs: dict[str, list[list[int]]] = {}  # token ids: engines detokenize a lone byte token differently
        shift = passes % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            before = await _vllm_counters(mode)
            timings, wall = await run_level(mode, prompts, level, max_tokens)
            drafts = (await _vllm_counters(mode)).get("drafts", 0.0) - before.get("drafts", 0.0)
            outputs[mode.label] = [t.token_ids for t in timings]
            cell = pooled[mode.label]
            cell.timings += timings
            cell.wall_s += wall
            cell.drafts += drafts
            cell.walls.append(wall)
            if progress:
                r = summarize(timings, wall)
                print(f"concurrency {level:3d} {mode.label:>12s}: {r['total_tokens_per_s']:.1f} tokens/s total, "
                      f"TTFT p50 {r['ttft_p50_s'] * 1e3:.1f} ms", file=sys.stderr)
        passes += 1
        mismatches += [{"concurrency": level, "prompt": n, "mode": label}
                       for label, got in outputs.items() if label != "off"
                       for n, (a, b) in enumerate(zip(got, outputs["off"])) if a != b]
    rows = [{"concurrency": level, "speculative": m.label, "engine": m.engine, "rounds": rounds,
             **summarize(pooled[m.label].timings, pooled[m.label].wall_s, pooled[m.label].drafts)}
            for m in modes]
    walls = {label: cell.walls for label, cell in pooled.items()}
    rows[1].update(quartiles([off / w for off, w in zip(walls["off"], walls["on"]) if w > 0], "paired_vs_off"))
    for ours_row in rows[:2]:
        for theirs_row in rows[2:]:
            pairs = zip(walls[theirs_row["speculative"]], walls[ours_row["speculative"]])
            against.append({
                "concurrency": level, "specgraft": ours_row["speculative"], "vllm": theirs_row["speculative"],
                "ratio": ours_row["total_tokens_per_s"] / max(theirs_row["total_tokens_per_s"], 1e-9),
                **quartiles([t / w for t, w in pairs if w > 0], "paired")})
    return rows, against, mismatches


def server_markdown(results: Mapping[str, Any]) -> str:
    s = results["settings"]
    lines = [
        f"# specgraft bench --server: {s['model']}",
        "",
        f"{s['prompts']} prompts, {s['max_tokens']} tokens each, greedy, streamed, "
        f"{s.get('rounds', 1)} round(s) of each mode a level; speculative on = drafter "
        f"`{s['drafter']}`, off = `none`" + "".join(f"; vllm {k} = {v}" for k, v in s.get("vllm_servers", {}).items())
        + ". Outputs identical in every mode: "
        + ("yes." if results["greedy_identical"] else f"**NO** ({len(results['mismatches'])} differ)."),
        "",
        *interrupted_note(s, "concurrency", SWEEP_NOUN),
        "| concurrency | speculative | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | req tok/s | total tok/s | tok/call |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["levels"]:
        per_call = "-" if r["tokens_per_target_call"] is None else f"{r['tokens_per_target_call']:.2f}"
        lines.append(
            f"| {r['concurrency']} | {r['speculative']} | {r['ttft_p50_s'] * 1e3:.1f} | {r['ttft_p99_s'] * 1e3:.1f} | "
            f"{r['itl_p50_s'] * 1e3:.2f} | {r['itl_p99_s'] * 1e3:.2f} | {r['request_tokens_per_s']:.1f} | "
            f"{r['total_tokens_per_s']:.1f} | {per_call} |"
        )
    lines += ["", "tok/call: completion tokens per target forward, prefill included.", ""]
    on = [r for r in results["levels"] if r["speculative"] == "on" and "paired_vs_off_p50" in r]
    if on:
        off = {r["concurrency"]: r["total_tokens_per_s"] for r in results["levels"] if r["speculative"] == "off"}
        lines += ["Speculation on against off: pooled total tokens/s, and paired (off's wall time over on's, round by "
                  "round; median and quartiles):", "", "| concurrency | total | paired |", "|---:|---:|---:|"]
        lines += [f"| {r['concurrency']} | {r['total_tokens_per_s'] / max(off[r['concurrency']], 1e-9):.3f}x | "
                  f"{r['paired_vs_off_p50']:.3f}x ({r['paired_vs_off_p25']:.3f}-{r['paired_vs_off_p75']:.3f}) |"
                  for r in on]
        lines.append("")
    against = results.get("against_vllm") or []
    if against:
        lines += ["specgraft against vLLM: pooled total tokens/s, specgraft's over vLLM's, and paired (vLLM's wall time "
                  "over specgraft's, round by round; median and quartiles):", "",
                  "| concurrency | specgraft | vLLM | total | paired |", "|---:|---|---|---:|---:|"]
        lines += [f"| {a['concurrency']} | {a['specgraft']} | {a['vllm']} | {a['ratio']:.3f}x | {a['paired_p50']:.3f}x "
                  f"({a['paired_p25']:.3f}-{a['paired_p75']:.3f}) |" for a in against]
        lines.append("")
    return "\n".join(lines)


def write_server_results(results: Mapping[str, Any], out_dir: str | Path) -> Path:
    """results.json, results.md and the two plots into ``out_dir`` (created)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never open a window
    from matplotlib import pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(server_markdown(results))
    figures = [plt.subplots(figsize=(6, 4.5)) for _ in SERVER_PLOTS]
    for mode in dict.fromkeys(r["speculative"] for r in results["levels"]):
        rows = [r for r in results["levels"] if r["speculative"] == mode]
        levels = [r["concurrency"] for r in rows]
        figures[0][1].plot(levels, [r["total_tokens_per_s"] for r in rows], marker="o", label=f"total, speculative {mode}")
        figures[0][1].plot(levels, [r["request_tokens_per_s"] for r in rows], marker="x", linestyle="--",
                           label=f"per request, speculative {mode}")
        figures[1][1].plot(levels, [r["ttft_p50_s"] * 1e3 for r in rows], marker="o", label=f"TTFT p50, {mode}")
        figures[1][1].plot(levels, [r["itl_p50_s"] * 1e3 for r in rows], marker="x", linestyle="--", label=f"ITL p50, {mode}")
    figures[0][1].set(xscale="log", xlabel="concurrent requests", ylabel="tokens/s", title="Throughput")
    figures[1][1].set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="ms", title="Latency")
    for (fig, ax), name in zip(figures, SERVER_PLOTS):
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
    return out


def parse_vllm_server(spec: str) -> tuple[str, str]:
    """``--vllm-server LABEL=URL`` -> (label, url)."""
    label, sep, url = spec.partition("=")
    if not sep or not label.strip() or not url.startswith(("http://", "https://")):
        raise ValueError(f"--vllm-server {spec!r}: expected LABEL=URL, e.g. eagle3-chain3=http://127.0.0.1:8001")
    return label.strip(), url.strip()


def server_bench_main(args: argparse.Namespace) -> int:
    """``specgraft bench --server``: 0, 1 when speculation changed some greedy output, 130 after a Ctrl-C (the levels
    that finished written, or nothing before one did)."""
    levels = parse_concurrency(args.concurrency)
    for spec in args.vllm_server:
        parse_vllm_server(spec)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    prompts = [p.text for p in read_prompt_file(args.prompts, args.limit, args.per_category)]
    stopped = None
    try:
        results = bench_server(
            args.server, prompts, levels, max_tokens=args.max_new_tokens, drafter=args.server_drafter,
            api_key=args.api_key or "none", rounds=args.rounds, progress=True,
            vllm_servers=[parse_vllm_server(spec) for spec in args.vllm_server],
        )
    except SweepInterrupted as stop:  # the levels that finished are written below
        results, stopped = stop.results, stop
    except KeyboardInterrupt:
        print(nothing_written(SWEEP_NOUN), file=sys.stderr)
        return 130
    results["settings"]["prompts_file"] = str(args.prompts)
    write_server_results(results, args.out)
    if stopped is not None:
        print(stopped.where(args.out), file=sys.stderr)
        return 130
    print(json.dumps(results, indent=2) if args.json else server_markdown(results))
    print(f"wrote results.json, results.md and {len(SERVER_PLOTS)} plots to {args.out}", file=sys.stderr)
    if not results["greedy_identical"]:
        print(f"specgraft bench: {len(results['mismatches'])} outputs differ with speculation on; see results.json",
              file=sys.stderr)
        return 1
    return 0
