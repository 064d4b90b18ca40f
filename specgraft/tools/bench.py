"""`specgraft bench`: every method on every prompt, interleaved, against baselines in the same run.

    specgraft bench --target ../shared/models/stories260K --drafter prompt-lookup --drafter self \
        --tree chain:5 --prompts ../shared/data/story_prompts_dev.jsonl --baselines plain,hf,hf-pld --out /tmp/bench

Timings on shared machines swing 2x with other load, so methods are never
timed in separate passes: after a warm-up, each prompt runs every method in
turn (the order rotates from prompt to prompt so no method always goes
first), with torch's thread count pinned. All decoding is greedy, which also
makes the run a losslessness check: every method must produce the reference
method's tokens (``hf`` when present, else ``plain``).

One clock for speed: the wall time of the whole call for one prompt
(prefill included), taken around our engine and HF ``generate`` alike.
``e2e_tokens_per_s`` is the median over prompts of new tokens / that time;
``speedup_vs`` is the ratio of those medians. The GenerationStats keys keep
their DESIGN.md meaning (``tokens_per_s`` is decode throughput after the
first token). For HF methods they are measured by a streamer that stamps each
chunk ``generate`` emits (one chunk per target forward); what HF cannot tell
us (draft tokens, KV peak) is None and listed under ``not_measured``.

Writes ``results.json``, ``results.md`` and three PNG plots into ``--out``.

This module runs the bench (interleaving, aggregation, sweeps, flags); the
prompt readers are in `specgraft.tools.prompts`, the methods in
`bench_runners`, the report and plots in `bench_report`, and ``--server``
(a running `specgraft serve` driven over HTTP) in `bench_server`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import platform
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import torch

from specgraft.heads import Drafter, PromptLookup, drafter_from_spec
from specgraft.infer import GenerationStats
from specgraft.model import Target
from specgraft.progress import progress_bar
from specgraft.specs import (
    CompositeSpec, DirectorySpec, DrafterSpec, NoDrafter, StaticFileSpec, TreeFileSpec, check_drafter, parse_drafter, parse_tree,
)
from specgraft.tools.bench_report import PLOTS, results_markdown, write_results
from specgraft.tools.bench_runners import (
    HF_PLD_NUM_TOKENS, STATS_KEYS, Runner, baseline_runner, drafter_label, engine_runner, parse_baseline,
)
from specgraft.tools.prompts import BenchPrompt, encode_prompt, read_prompt_file
from specgraft.tools.step_counts import count_decoding
from specgraft.tools.sweep import SweepInterrupted, nothing_written
from specgraft.tree import Adaptive, Chain, TreePolicy, parse_tree_spec

if TYPE_CHECKING:
    import argparse

SWEEP_KEYS = ("depth", "top_k", "budget")


# ---------------------------------------------------------------------------------------------- aggregation


def _median(values: Iterable[float | None]) -> float | None:
    values = list(values)
    return None if not values or any(v is None for v in values) else statistics.median(values)


def _weighted_mean(values: Sequence[float | None], weights: Sequence[int]) -> float | None:
    """None where a weighed value is not measured (another engine's), or where nothing is weighed (a tau of prompts
    that made no verification step: their outputs were only EOS); a value of weight 0 counts for nothing."""
    weighed = [(v, w) for v, w in zip(values, weights) if w]
    if not weighed or any(v is None for v, _ in weighed):
        return None
    return sum(v * w for v, w in weighed) / sum(w for _, w in weighed)


def _sum_histograms(histograms: Sequence[list[int]]) -> list[int]:
    total = [0] * max((len(h) for h in histograms), default=0)
    for h in histograms:
        for i, count in enumerate(h):
            total[i] += count
    return total


def aggregate(runs: Sequence[GenerationStats | Mapping[str, Any]], wall_s: Sequence[float]) -> dict[str, Any]:
    """One method's stats over prompts, each key reduced as a reader of the table would expect.

    - ``new_tokens``, ``target_calls``, ``accept_length_histogram``: sums.
    - ``mean_accepted_length``: total tokens the verifications committed / total
      target calls (each prompt's tau weighted by its target calls).
    - ``draft_tokens_per_token``: total draft tokens / total new tokens.
    - ``ttft_s``, ``tokens_per_s``, ``itl_p50_s``, ``itl_p99_s``: medians over
      prompts of the per-prompt values (the p99 is each prompt's own p99, not a pooled one).
    - ``kv_cache_tokens_peak``: the largest; ``lossless``: all of them.
    - ``wall_s``: sum of per-prompt end-to-end wall times; ``e2e_tokens_per_s``:
      median over prompts of new tokens / wall time.

    A key that any run left None (not measured) stays None.
    """
    stats = [r.to_dict() if isinstance(r, GenerationStats) else dict(r) for r in runs]
    if len(stats) != len(wall_s) or not stats:
        raise ValueError(f"aggregate needs one wall time per run and at least one run, got {len(stats)} and {len(wall_s)}")
    col = {key: [s[key] for s in stats] for key in STATS_KEYS}
    kv = col["kv_cache_tokens_peak"]
    return {
        "prompts": len(stats),
        "new_tokens": sum(col["new_tokens"]),
        "target_calls": sum(col["target_calls"]),
        "mean_accepted_length": _weighted_mean(col["mean_accepted_length"], col["target_calls"]),
        "accept_length_histogram": _sum_histograms(col["accept_length_histogram"]),
        "draft_tokens_per_token": _weighted_mean(col["draft_tokens_per_token"], col["new_tokens"]),
        "ttft_s": _median(col["ttft_s"]),
        "tokens_per_s": _median(col["tokens_per_s"]),
        "itl_p50_s": _median(col["itl_p50_s"]),
        "itl_p99_s": _median(col["itl_p99_s"]),
        "kv_cache_tokens_peak": None if any(v is None for v in kv) else max(kv),
        "lossless": all(col["lossless"]),
        "wall_s": sum(wall_s),
        "e2e_tokens_per_s": _median(n / w if w > 0 else 0.0 for n, w in zip(col["new_tokens"], wall_s)),
    }


def acceptance_by_depth(histogram: Sequence[int]) -> list[float]:
    """P(draft at depth d accepted | the step reached depth d), from an accept-length histogram.

    ``histogram[i]`` counts steps that committed i + 1 tokens, i.e. accepted i
    drafts; a step reached depth d when it accepted d - 1. The histogram does
    not record tree depth, so a step whose tree ended before depth d (no
    prompt-lookup match, a token budget running out) counts as a rejection there.
    """
    rates = []
    for d in range(1, len(histogram)):
        reached = sum(histogram[d - 1:])
        rates.append(sum(histogram[d:]) / reached if reached else 0.0)
    return rates


def speedups(entry: Mapping[str, Any], baselines: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """Ratio of median end-to-end tokens/s to each baseline's (same prompts, same clock)."""
    out = {}
    for name, base in baselines.items():
        ours, theirs = entry["e2e_tokens_per_s"], base["e2e_tokens_per_s"]
        out[name] = ours / theirs if ours is not None and theirs else None
    return out


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix of the other); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ---------------------------------------------------------------------------------------------- the run


@dataclass
class PromptRun:
    prompt: BenchPrompt
    tokens: list[int]
    stats: dict[str, Any]
    wall_s: float


class BenchInterrupted(KeyboardInterrupt):
    """Ctrl-C during `run_bench`'s timed prompts, after what finished was written (when ``out_dir`` was given)."""

    def __init__(self, results: dict[str, Any], out_dir: Path | None) -> None:
        super().__init__(f"interrupted after {results['settings']['prompts']} of "
                         f"{results['settings']['prompts_given']} prompts")
        self.results, self.out_dir = results, out_dir


MethodSpec = tuple[str, Drafter | None, TreePolicy | None] | Runner


def _timed(runner: Runner, ids: list[int], max_new_tokens: int) -> tuple[list[int], dict[str, Any], float]:
    start = time.perf_counter()
    tokens, stats = runner.generate(ids, max_new_tokens)
    return tokens, stats, time.perf_counter() - start


def _build_runners(
    target: Target, methods: Sequence[MethodSpec], baselines: Sequence[str], temperature: float = 0.0
) -> list[Runner]:
    """Baselines first, then our methods; names must be unique since they key the report."""
    for spec in baselines:
        parse_baseline(spec)  # every spec checked before any assistant loads
    runners = [baseline_runner(spec, target, temperature) for spec in baselines]
    runners += [m if isinstance(m, Runner) else engine_runner(m[0], target, m[1], m[2], temperature) for m in methods]
    names = [r.name for r in runners]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"method names must be unique; repeated: {duplicates}")
    if not runners:
        raise ValueError("nothing to benchmark: no methods and no baselines")
    return runners


def _check_lengths(target: Target, prompts: Sequence[BenchPrompt], encoded: Sequence[list[int]], max_new_tokens: int) -> None:
    for prompt, ids in zip(prompts, encoded):
        if len(ids) + max_new_tokens > target.max_context:
            raise ValueError(
                f"prompt {prompt.id!r} ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the target's "
                f"context of {target.max_context}; lower --max-new-tokens or drop the prompt"
            )


def run_interleaved(
    runners: Sequence[Runner], prompts: Sequence[BenchPrompt], encoded: Sequence[list[int]],
    max_new_tokens: int, warmup: int, progress: bool, desc: str = "bench", keep_on_interrupt: bool = False,
) -> dict[str, list[PromptRun]]:
    """Warm every method up, then each prompt runs every method in turn, starting one later each prompt.

    Load on a shared machine then falls on every method alike (`specgraft tune-tree` times its trees so too).
    With ``keep_on_interrupt``, a Ctrl-C after the first prompt ends the loop and returns the prompts every
    method finished (fewer runs than prompts); before it, or without the flag, the KeyboardInterrupt propagates.
    """
    for ids in encoded[:warmup]:
        for runner in runners:
            runner.generate(ids, max_new_tokens)
    runs: dict[str, list[PromptRun]] = {r.name: [] for r in runners}
    bar = progress_bar(list(zip(prompts, encoded)), desc=desc, unit="prompt", enabled=progress)
    try:
        for index, (prompt, ids) in enumerate(bar):
            for k in range(len(runners)):
                runner = runners[(index + k) % len(runners)]
                tokens, stats, wall = _timed(runner, ids, max_new_tokens)
                runs[runner.name].append(PromptRun(prompt, tokens, stats, wall))
    except KeyboardInterrupt:
        finished = min(len(method_runs) for method_runs in runs.values())
        if not keep_on_interrupt or finished == 0:
            raise
        return {name: method_runs[:finished] for name, method_runs in runs.items()}
    return runs


def _mismatches(runs: Mapping[str, list[PromptRun]], reference: str) -> list[dict[str, Any]]:
    found = []
    for name, method_runs in runs.items():
        for ref, run in zip(runs[reference], method_runs):
            index = first_difference(ref.tokens, run.tokens)
            if name != reference and index is not None:
                found.append({"method": name, "prompt_id": run.prompt.id, "first_diff": index, "reference": reference})
    return found


def _aggregate_runs(method_runs: Sequence[PromptRun]) -> dict[str, Any]:
    return aggregate([r.stats for r in method_runs], [r.wall_s for r in method_runs])


def _method_entry(runner: Runner, method_runs: list[PromptRun]) -> dict[str, Any]:
    entry = {"method": runner.name, "source": runner.source, **_aggregate_runs(method_runs)}
    entry["acceptance_by_depth"] = acceptance_by_depth(entry["accept_length_histogram"])
    categories = sorted({r.prompt.category for r in method_runs})
    entry["per_category"] = {c: _aggregate_runs([r for r in method_runs if r.prompt.category == c]) for c in categories}
    entry["measured"] = list(runner.measured) + ["wall_s", "e2e_tokens_per_s"]
    entry["not_measured"] = [k for k in STATS_KEYS if k not in runner.measured]
    return entry


def _add_speedups(entries: list[dict[str, Any]], baseline_names: Sequence[str]) -> None:
    by_name = {e["method"]: e for e in entries}
    bases = {b: by_name[b] for b in baseline_names}
    for entry in entries:
        entry["speedup_vs"] = speedups(entry, bases)
        for category, agg in entry["per_category"].items():
            agg["speedup_vs"] = speedups(agg, {b: e["per_category"][category] for b, e in bases.items()})


def run_bench(
    target: Target,
    methods: Sequence[MethodSpec],
    prompts: Sequence[BenchPrompt],
    *,
    max_new_tokens: int = 128,
    baselines: Sequence[str] = ("plain", "hf"),
    temperature: float = 0.0,
    threads: int = 1,
    warmup: int = 1,
    out_dir: str | Path | None = None,
    progress: bool = True,
    extra_settings: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Benchmark ``methods`` against ``baselines`` on ``prompts``, interleaved.

    Greedy (``temperature`` 0), every output is checked token for token against
    the reference (``hf``, else ``plain``); sampled, every method draws from
    softmax(logits / T) unfiltered, and outputs are not compared.

    Args:
        target: the frozen target.
        methods: ``(name, drafter, tree)`` for our engine, or a ready `Runner`.
        prompts: from `read_prompt_file`; encoded with `encode_prompt`.
        baselines: ``plain``, ``hf``, ``hf-pld``, ``hf-assisted:PATH``.
        temperature: 0 for greedy; else every method samples (HF with top_k=0, top_p=1).
        threads: torch threads for the run (restored afterwards).
        warmup: prompts (from the start) every method runs once, untimed, first.
        out_dir: where results.json, results.md and the plots go (None: nowhere).
        extra_settings: merged into ``settings`` (e.g. the prompts file).

    Returns:
        The results.json object (see the module docstring and `aggregate`).

    Raises:
        BenchInterrupted: Ctrl-C after every method finished at least one prompt; the prompts every method
            finished were aggregated (``settings.interrupted``) and written to ``out_dir`` first.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if threads < 1 or warmup < 0:
        raise ValueError(f"need threads >= 1 and warmup >= 0, got threads={threads}, warmup={warmup}")
    if not prompts:
        raise ValueError("no prompts to benchmark")
    runners = _build_runners(target, methods, baselines, temperature)
    names = [r.name for r in runners]
    reference = "hf" if "hf" in names else "plain" if "plain" in names else names[0]
    encoded = [encode_prompt(target, p.text) for p in prompts]
    _check_lengths(target, prompts, encoded, max_new_tokens)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runs = run_interleaved(runners, prompts, encoded, max_new_tokens, warmup, progress, keep_on_interrupt=True)
    finally:
        torch.set_num_threads(before)
    finished = len(runs[names[0]])
    interrupted = finished < len(prompts)
    entries = [_method_entry(r, runs[r.name]) for r in runners]
    for runner, entry in zip(runners, entries):  # counted on the first prompt, untimed (see `count_decoding`)
        count = runner.generator and not interrupted  # after a Ctrl-C, nothing more runs
        counts = count_decoding(runner.generator, encoded[:1], max_new_tokens) if count else None
        entry.update(kernels_per_step=counts and counts.kernels_per_step, syncs_per_step=counts and counts.syncs_per_step)
    baseline_names = names[: len(baselines)]  # runner names: hf-assisted:PATH becomes hf-assisted:DIRNAME
    _add_speedups(entries, baseline_names)
    mismatches = _mismatches(runs, reference) if temperature == 0 else []
    results = {
        "methods": entries,
        "greedy_identical": not mismatches if temperature == 0 else None,  # None: sampled, nothing to compare
        "mismatches": mismatches,
        "settings": _settings(target, prompts[:finished], max_new_tokens, baseline_names, threads, warmup, reference,
                              {"temperature": temperature, **(extra_settings or {})}),
        "per_prompt": [
            {"method": name, "prompt_id": r.prompt.id, "category": r.prompt.category, "new_tokens": len(r.tokens),
             "wall_s": r.wall_s, "mean_accepted_length": r.stats["mean_accepted_length"]}
            for name, method_runs in runs.items() for r in method_runs
        ],
    }
    if interrupted:
        results["settings"].update(interrupted=True, prompts_given=len(prompts))
    if out_dir is not None:
        write_results(results, out_dir)
    if interrupted:
        raise BenchInterrupted(results, None if out_dir is None else Path(out_dir))
    return results


def _settings(
    target: Target, prompts: Sequence[BenchPrompt], max_new_tokens: int, baselines: Sequence[str],
    threads: int, warmup: int, reference: str, extra: Mapping[str, Any] | None,
) -> dict[str, Any]:
    import transformers

    return {
        "target": target.name,
        "dtype": str(target.dtype).removeprefix("torch."),
        "device": str(target.device),
        "prompts": len(prompts),
        "categories": sorted({p.category for p in prompts}),
        "max_new_tokens": max_new_tokens,
        "decoding": "greedy",
        "baselines": list(baselines),
        "reference": reference,
        "threads": threads,
        "small_rows": target.small_rows.to_dict(),
        "capture": target.capture,
        "warmup_prompts": warmup,
        "order": "interleaved per prompt; the method order rotates by one each prompt",
        "clock": "wall time of one whole generate call per prompt, prefill included, the same for every method",
        "e2e_tokens_per_s": "median over prompts of new_tokens / wall time",
        "speedup_vs": "e2e_tokens_per_s of the method / e2e_tokens_per_s of the baseline",
        "hf_stats": "from a streamer stamping each chunk generate emits (one per target forward); "
        "the first chunk is HF's prefill call; HF's ttft_s counts from the generate call (its setup included), "
        "ours from the start of decoding",
        "hf_pld_num_tokens": HF_PLD_NUM_TOKENS,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        **(extra or {}),
    }


# ---------------------------------------------------------------------------------------------- sweeps


def parse_sweep(spec: Sequence[str]) -> dict[str, list[int]]:
    """``["depth=3,5,7", "top_k=4,8"]`` -> ``{"depth": [3, 5, 7], "top_k": [4, 8]}``, every item checked."""
    axes: dict[str, list[int]] = {}
    for item in spec:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or key not in SWEEP_KEYS:
            raise ValueError(f"--sweep {item!r}: expected KEY=V1,V2,... with KEY one of {', '.join(SWEEP_KEYS)}")
        if key in axes:
            raise ValueError(f"--sweep {item!r}: {key} is given twice")
        parts = [v.strip() for v in values.split(",")]
        if not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--sweep {item!r}: values must be positive integers separated by commas")
        axes[key] = [int(p) for p in parts]
    return axes


def tree_name(tree: TreePolicy) -> str:
    """The tree's spec string where it has one (``chain:5``, ``dynamic:8,6,48``)."""
    if isinstance(tree, Chain):
        return f"chain:{tree.depth}"
    if type(tree).__name__ == "DynamicTree":
        return f"dynamic:{tree.top_k},{tree.depth},{tree.budget}"
    return type(tree).__name__


def expand_sweep(spec: Sequence[str], base_tree: TreePolicy) -> list[tuple[str, TreePolicy]]:
    """Every combination of the swept values applied to ``base_tree``, as (name, tree).

    ``depth`` applies to `Chain`; ``top_k``, ``depth`` and ``budget`` to
    `DynamicTree`. A key the base tree does not have is an error naming it.
    """
    axes = parse_sweep(spec)
    if not axes:
        return [(tree_name(base_tree), base_tree)]
    fields = {f.name for f in dataclasses.fields(base_tree)} if dataclasses.is_dataclass(base_tree) else set()
    wrong = [k for k in axes if k not in fields]
    if wrong:
        has = ", ".join(sorted(fields & set(SWEEP_KEYS))) or "nothing to sweep"
        raise ValueError(
            f"--sweep {', '.join(wrong)} does not apply to tree {tree_name(base_tree)} ({type(base_tree).__name__} has: "
            f"{has}); depth applies to chain:N, top_k/depth/budget to dynamic:TOP_K,DEPTH,BUDGET"
        )
    trees = []
    for combo in itertools.product(*axes.values()):
        tree = dataclasses.replace(base_tree, **dict(zip(axes, combo)))
        trees.append((tree_name(tree), tree))
    return trees


# ---------------------------------------------------------------------------------------------- command line


def parse_batch_sizes(spec: str) -> list[int]:
    """``"1,2,4,8"`` -> [1, 2, 4, 8], each a positive integer."""
    parts = [p.strip() for p in spec.split(",")]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--batch-size {spec!r}: expected positive integers separated by commas, e.g. 1,2,4,8")
    return sorted({int(p) for p in parts})


def _batch_bench(args, target: Target, methods, prompts, batch_sizes: list[int], threads_why: str) -> int:
    """``bench --batch-size``: each method over the prompts B at a time; writes JSON, markdown and a plot."""
    from specgraft.tools.bench_batch import SWEEP_NOUN, batch_markdown, run_batch_sweep, write_batch_plot

    if args.temperature:
        raise ValueError("--batch-size runs greedy (its outputs are checked against plain decoding); drop --temperature")
    engine_methods = [m for m in methods if not isinstance(m, Runner)]
    encoded = [encode_prompt(target, p.text) for p in prompts]
    stopped = None
    with contextlib.ExitStack() as stack:
        engines = _vllm_engines(args, target, max(map(len, encoded)) + args.max_new_tokens, stack)
        try:
            results = run_batch_sweep(
                target, [("plain", None, None), *engine_methods], encoded, batch_sizes, args.max_new_tokens,
                rounds=args.rounds, engines=engines,
            )
        except SweepInterrupted as stop:  # the batch sizes that finished are written below
            results, stopped = stop.results, stop
        except KeyboardInterrupt:
            print(nothing_written(SWEEP_NOUN), file=sys.stderr)
            return 130
    results["settings"].update(threads=torch.get_num_threads(), threads_choice=threads_why, prompts_file=str(args.prompts),
                               small_rows=target.small_rows.to_dict(), capture=target.capture)
    if target.captured is not None:  # what the static forward did: graphs captured and replayed (CUDA), or eager
        results["settings"]["captured"] = target.captured.stats()
        drafts = captured_drafts(engine_methods)
        if drafts:
            results["settings"]["captured_drafts"] = drafts
    if engines:
        results["settings"]["vllm"] = {"version": engines[0][1].version, "core": args.vllm_core,
                                       "load_s": {name: engine.load_s for name, engine in engines}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(batch_markdown(results))
    write_batch_plot(results, out)
    if stopped is not None:
        print(stopped.where(out), file=sys.stderr)
        return 130
    print(json.dumps(results, indent=2) if args.json else batch_markdown(results))
    if not results["greedy_identical"]:
        print(f"specgraft bench: {len(results['mismatches'])} greedy outputs differ from plain decoding", file=sys.stderr)
        return 1
    return 0


def parse_vllm(spec: str) -> list[int | None]:
    """``--vllm plain,chain:3`` -> [None, 3]: None is plain decoding, K a chain of K speculative tokens."""
    parsed = []
    for part in (p.strip() for p in spec.split(",")):
        kind, sep, depth = part.partition(":")
        if part == "plain":
            parsed.append(None)
        elif kind == "chain" and depth.isdigit() and int(depth) > 0:
            parsed.append(int(depth))
        else:
            raise ValueError(f"--vllm {spec!r}: {part!r} is not 'plain' or 'chain:K' (K a positive integer)")
    return parsed


def _vllm_engines(args: argparse.Namespace, target: Target, longest: int, stack: contextlib.ExitStack) -> list:
    """``--vllm``: (name, `VLLMEngine`) for plain decoding and each trained --drafter head at each chain depth."""
    from specgraft.tools.vllm_engine import VLLMEngine, speculative_config, vllm_draft_dir

    if not args.vllm:
        return []
    parsed = [(spec, parse_drafter(spec)) for spec in args.drafter]
    heads = [(spec_label(spec), Path(p.path)) for spec, p in parsed if isinstance(p, DirectorySpec)]
    common = dict(python=args.vllm_python, core=args.vllm_core, dtype=args.dtype,
                  max_model_len=longest + max(d or 0 for d in parse_vllm(args.vllm)) + 1)
    engines = []
    for depth in parse_vllm(args.vllm):
        if depth is None:
            print("vLLM: loading plain decoding", file=sys.stderr)
            engines.append(("vllm plain", stack.enter_context(VLLMEngine(args.target, **common))))
            continue
        for label, head_dir in heads:
            exported = Path(args.out) / "vllm-heads" / label
            shutil.rmtree(exported, ignore_errors=True)  # this bench's own export of the head, written again
            kind, draft_dir = vllm_draft_dir(head_dir, exported, target)
            print(f"vLLM: loading {label} chain:{depth}", file=sys.stderr)
            engine = VLLMEngine(args.target, speculative_config=speculative_config(kind, draft_dir, depth), **common)
            engines.append((f"vllm {label} chain:{depth}", stack.enter_context(engine)))
    return engines


def check_bench_drafter(spec: str | DrafterSpec) -> DrafterSpec:
    """A --drafter of the bench, parsed and checked (`specgraft.specs.check_drafter`); ``none`` is a baseline here."""
    parsed = check_drafter(spec)
    if isinstance(parsed, NoDrafter):
        raise ValueError("--drafter none: plain decoding is the 'plain' baseline here (--baselines plain)")
    return parsed


def build_drafter(spec: str | DrafterSpec, target: Target) -> Drafter:
    """A drafter from a --drafter value (see `specgraft.heads.drafter_from_spec`); ``none`` is a baseline here."""
    return drafter_from_spec(check_bench_drafter(spec), target)


def spec_label(spec: str | DrafterSpec) -> str:
    """A --drafter value's name in tables: as written, with each directory named by `drafter_label`."""
    parsed = parse_drafter(spec)
    if isinstance(parsed, DirectorySpec):
        return drafter_label(Path(parsed.path))
    if isinstance(parsed, CompositeSpec):  # prompt-lookup[:K]+ as written, then its drafter's label
        return str(parsed).removesuffix(str(parsed.then)) + spec_label(parsed.then)
    return str(parsed)


def captured_drafts(methods: list[MethodSpec]) -> dict[str, dict[str, int | float]]:
    """What each drafter's captured draft forwards did (graphs, replays, the seconds its first calls took capturing),
    keyed by the labels of the methods that share it."""
    shared: dict[int, tuple[list[str], Drafter]] = {}
    for label, drafter, _ in methods:
        shared.setdefault(id(drafter), ([], drafter))[0].append(label)
    return {" / ".join(labels): drafter.draft_graphs.stats() for labels, drafter in shared.values()
            if getattr(drafter, "draft_graphs", None) is not None}


def _methods(args: argparse.Namespace, trees: list[tuple[str, TreePolicy]], target: Target) -> list[MethodSpec]:
    """Each --drafter crossed with each tree, then each --method pair; a drafter named twice loads once.

    Prompt lookup builds its own trie, so it runs once whatever the fixed trees, and once more per adaptive tree
    (which sizes its depth each step).
    """
    drafters: dict[str, Drafter] = {}

    def labelled(spec: str) -> tuple[str, Drafter]:
        if spec not in drafters:
            drafters[spec] = build_drafter(spec, target)
        return spec_label(spec), drafters[spec]

    methods: list[MethodSpec] = []
    for spec in args.drafter:
        label, drafter = labelled(spec)
        if isinstance(drafter, PromptLookup):
            methods.append((label, drafter, None))
            methods += [(f"{label} {name}", drafter, tree) for name, tree in trees if isinstance(tree, Adaptive)]
            continue
        methods += [(f"{label} {name}", drafter, tree) for name, tree in trees]
    for spec, tree_spec in args.method:
        label, drafter = labelled(spec)
        tree = parse_tree_spec(tree_spec)
        if isinstance(drafter, PromptLookup) and not isinstance(tree, Adaptive):
            tree = None
        methods.append((label if tree is None else f"{label} {tree_label(tree_spec)}", drafter, tree))
    names = [name for name, _, _ in methods]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"methods named twice (a drafter and tree given more than once?): {repeated}")
    return methods


def tree_label(spec: str) -> str:
    """A tree spec as a method label: a spec file by its file name, other specs as written."""
    parsed = parse_tree(spec)
    if isinstance(parsed, StaticFileSpec):
        return f"static:{Path(parsed.path).name}"
    return Path(parsed.path).name if isinstance(parsed, TreeFileSpec) else spec


def _trees(args: argparse.Namespace) -> list[tuple[str, TreePolicy]]:
    trees = []
    for spec in args.tree or ["chain:5"]:
        base = parse_tree_spec(spec)
        trees += expand_sweep(args.sweep, base) if args.sweep else [(tree_label(spec), base)]
    return trees


def bench_main(args: argparse.Namespace) -> int:
    """Run ``specgraft bench``. Every flag is checked before a model loads.

    Returns 0, or 1 when some method's greedy output differs from the reference
    (the results are still written, and the mismatches listed).
    """
    from transformers.utils import logging as hf_logging

    import specgraft as sg

    if args.server:
        return _server_bench(args)
    if not args.target:
        raise ValueError("give --target (offline bench) or --server URL (a running specgraft serve)")
    if args.vllm_server:
        raise ValueError("--vllm-server benches a vLLM server beside --server URL (a running specgraft serve); "
                         "offline, --vllm runs vLLM beside the batch bench")
    if args.rounds != 1 and not args.batch_size:
        raise ValueError("--rounds applies to --server and --batch-size (the offline bench interleaves its methods "
                         "prompt by prompt)")
    if not Path(args.prompts).is_file():
        raise FileNotFoundError(f"--prompts {args.prompts!r} does not exist")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.vllm:
        from specgraft.tools.vllm_engine import vllm_python

        if not args.batch_size:
            raise ValueError("--vllm runs with --batch-size (vLLM's LLM.generate takes a batch of prompts at a time)")
        parse_vllm(args.vllm)
        vllm_python(args.vllm_python)  # its environment exists, before the target loads
    baselines = [b.strip() for b in args.baselines.split(",") if b.strip()]
    for spec in baselines:
        parse_baseline(spec)
    for spec in args.drafter:
        check_bench_drafter(spec)
    for spec, tree_spec in args.method:
        check_bench_drafter(spec)
        parse_tree_spec(tree_spec)  # a tree file is read here, before the target loads
    trees = _trees(args)
    prompts = read_prompt_file(args.prompts, args.limit, args.per_category)
    if not args.drafter and not args.method and not baselines:
        raise ValueError("nothing to benchmark: give --drafter, --method or --baselines")

    hf_logging.set_verbosity_error()  # HF's per-call generation warnings would drown the progress bar
    batch_sizes = parse_batch_sizes(args.batch_size) if args.batch_size else None
    target = sg.load_target(args.target, dtype=args.dtype, device=args.device, threads=args.threads,
                            capture=args.capture)
    choice = target.threads
    print(f"threads: {torch.get_num_threads()} ({choice.why})", file=sys.stderr)
    print(f"small-row products: {target.small_rows.describe()}", file=sys.stderr)
    methods = _methods(args, trees, target)
    if batch_sizes:
        return _batch_bench(args, target, methods, prompts, batch_sizes, choice.why)
    try:
        results = run_bench(
            target, methods, prompts, max_new_tokens=args.max_new_tokens, baselines=baselines,
            temperature=args.temperature, threads=torch.get_num_threads(), warmup=args.warmup, out_dir=args.out,
            progress=True, extra_settings={"prompts_file": str(args.prompts), "limit": args.limit,
                                           "per_category": args.per_category, "threads_choice": choice.why},
        )
    except BenchInterrupted as stop:
        print(f"specgraft bench: {stop}; the prompts every method finished are in {stop.out_dir / 'results.json'} "
              "(and results.md)", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("specgraft bench: interrupted before every method finished a prompt; nothing written", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(results_markdown(results))
        print(f"wrote results.json, results.md and {len(PLOTS)} plots to {args.out}", file=sys.stderr)
    if results["greedy_identical"] is False:
        print(f"specgraft bench: {len(results['mismatches'])} greedy outputs differ from "
              f"{results['settings']['reference']!r}; see 'mismatches' in results.json", file=sys.stderr)
        return 1
    return 0


def _server_bench(args: argparse.Namespace) -> int:
    """``--server``: the HTTP bench, which loads no model here; flags of the offline bench are refused."""
    from specgraft.tools.bench_server import server_bench_main

    offline = [flag for flag, given in (("--target", args.target), ("--tree", args.tree), ("--method", args.method),
                                        ("--sweep", args.sweep), ("--temperature", args.temperature),
                                        ("--vllm", args.vllm)) if given]
    if offline:
        raise ValueError(f"{', '.join(offline)} apply to the offline bench, not to --server")
    if len(args.drafter) > 1:
        raise ValueError(f"--server takes one --drafter (a name the server loaded), got {args.drafter}")
    args.server_drafter = args.drafter[0] if args.drafter else "auto"
    return server_bench_main(args)

