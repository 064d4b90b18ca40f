"""Throughput against batch size: each method decodes B prompts at a time through the scheduler.

    specgraft bench --target ../shared/models/stories260K --drafter prompt-lookup \
        --prompts ../shared/data/story_prompts_dev.jsonl --batch-size 1,2,4,8,16 --out /tmp/bench-batch

Speculation spends spare compute on drafts that may be rejected: at batch 1
the target forward is memory- or overhead-bound and verifying a tree is
nearly free, at large batch the forward is compute-bound and every rejected
node costs real work. This sweep shows where it stops paying. For each batch
size the prompts are cut into groups of B; each group runs every method in
turn (the order rotates from group to group), greedy, so every method must
give plain decoding's tokens. Each method's scheduler for a batch size is
allocated before that size is timed, and kept (a KV pool is zeroed once).
``rounds`` passes over the groups (the rotation carries on) pool more time
per cell where the machine's load moves.

Per-request figures come from each row's `GenerationStats` (TTFT counts from
the batch's submission, ITL shares each step's time among its tokens); total
tokens/s is all new tokens of a group over the group's wall time. Beside it,
each method's paired ratio: plain's wall time over the method's, group by
group, as a median and quartiles (a burst of load that slows a few runs
moves a total by all of it, a median of pairs hardly).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from specgraft.heads import Drafter
from specgraft.infer import GoodputController, SpeculativeGenerator, format_tau, percentile, quartiles
from specgraft.model import Target
from specgraft.progress import progress_bar
from specgraft.tools.bench_report import counted
from specgraft.tools.step_counts import count_decoding
from specgraft.tools.sweep import Sweep, interrupted_note
from specgraft.tree import Adaptive, TreePolicy

PLOT = "throughput_vs_batch_size.png"
SWEEP_NOUN = "batch size"  # how the Ctrl-C lines and the report name one value of the sweep


def run_batch_sweep(
    target: Target,
    methods: Sequence[tuple[str, Drafter | None, TreePolicy | None]],
    prompts: Sequence[list[int]],
    batch_sizes: Sequence[int],
    max_new_tokens: int,
    progress: bool = True,
    rounds: int = 1,
    engines: Sequence[tuple[str, Any]] = (),
) -> dict[str, Any]:
    """Every method at every batch size over the same prompts, ``rounds`` times; see the module doc.

    ``engines`` are other engines run beside specgraft's methods, interleaved with them and checked against plain
    decoding alike: (name, an object with ``generate_batch(prompts, max_new_tokens, eos_token_id=())`` and
    ``reserve(rows, length)``, as `specgraft.tools.vllm_engine.VLLMEngine` has).

    Raises:
        ValueError: a batch size larger than the number of prompts, a method other than plain decoding
            first (it is the reference every output is checked against), or fewer than one round.
        SweepInterrupted: Ctrl-C after a batch size finished; its ``results`` hold the sizes that finished.
    """
    if not methods or methods[0][1] is not None:
        raise ValueError("the first method must be plain decoding (drafter None): it is the reference")
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    if max(batch_sizes) > len(prompts) or min(batch_sizes) < 1:
        raise ValueError(f"batch sizes {list(batch_sizes)} need 1 <= B <= the {len(prompts)} prompts given")
    gens = [(name, SpeculativeGenerator(target, drafter, tree=tree)) for name, drafter, tree in methods]
    gens += list(engines)
    external = {name for name, _ in engines}
    for _, gen in gens:  # warm-up: one short batch each
        gen.generate_batch(list(prompts[:2]), max_new_tokens=8, eos_token_id=())
    rows, mismatches = [], []
    settings = {"target": target.name, "prompts": len(prompts), "max_new_tokens": max_new_tokens,
                "batch_sizes": list(batch_sizes), "rounds": rounds, "decoding": "greedy",
                "order": "interleaved per group of B prompts; the method order rotates by one each group"}
    sweep = Sweep("batch_sizes", SWEEP_NOUN, list(batch_sizes))
    with sweep.keep_finished(lambda: _results(settings, rows, rounds, methods, mismatches)):
        for b in batch_sizes:  # a size's rows and differing outputs are kept together, once it finished
            size_rows, size_mismatches = _batch_size(b, gens, external, engines, prompts, max_new_tokens, rounds, progress)
            rows += size_rows
            mismatches += size_mismatches
            sweep.done.append(b)
    return _results(settings, rows, rounds, methods, mismatches)


def _batch_size(b: int, gens: list, external: set, engines: Sequence, prompts: Sequence[list[int]], max_new_tokens: int,
                rounds: int, progress: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One batch size's rows (every method over the prompts B at a time, ``rounds`` times, then counted) and the
    outputs that differ from plain decoding's."""
    rows, mismatches = [], []
    groups = [list(prompts[i : i + b]) for i in range(0, len(prompts) - b + 1, b)] * rounds
    for _, gen in gens:  # each method's memory for this size, allocated before any timing (see `reserve`)
        gen.reserve(b, max(len(p) for p in prompts) + max_new_tokens)
    runs: dict[str, list[tuple[list, float]]] = {name: [] for name, _ in gens}
    for index, group in enumerate(progress_bar(groups, desc=f"batch {b}", unit="group", enabled=progress)):
        for k in range(len(gens)):
            name, gen = gens[(index + k) % len(gens)]
            start = time.perf_counter()
            outs = gen.generate_batch(group, max_new_tokens=max_new_tokens, eos_token_id=())
            runs[name].append((outs, time.perf_counter() - start))
    reference = runs[gens[0][0]]
    for name, method_runs in runs.items():
        for (outs, _), (ref, _) in zip(method_runs, reference):
            mismatches += [{"method": name, "batch_size": b} for o, r in zip(outs, ref) if o.token_ids != r.token_ids]
        engine = getattr(dict(engines)[name], "engine_name", "other") if name in external else "specgraft"
        # Kernels and host syncs a decoding step, counted over the first group again, untimed
        counts = None if name in external else count_decoding(dict(gens)[name], groups[0], max_new_tokens)
        rows.append({**_summary(name, b, method_runs), "engine": engine, **paired(method_runs, reference),
                     "speedup_by_round": by_round(method_runs, reference, rounds),
                     "kernels_per_step": counts and counts.kernels_per_step,
                     "syncs_per_step": counts and counts.syncs_per_step})
    return rows, mismatches


def _results(settings: dict, rows: list[dict], rounds: int, methods: Sequence, mismatches: list[dict]) -> dict[str, Any]:
    """The sweep's results (what results.json holds) over the rows measured."""
    return {
        "settings": settings,
        "rows": rows,
        "crossover": crossover(rows),
        "verdict": verdict(rows, rounds),
        # Adaptive trees: by depth, what the goodput controller expected of the nodes it verified and what was accepted
        # (over the whole sweep; per drafter, shared by every method that drafts with it).
        "calibration": {name: GoodputController.stats(drafter).calibration_curve()
                        for name, drafter, tree in methods if isinstance(tree, Adaptive)},
        "greedy_identical": not mismatches,
        "mismatches": mismatches,
    }


def _summary(name: str, batch_size: int, runs: Sequence[tuple[list, float]]) -> dict[str, Any]:
    stats = [out.stats for outs, _ in runs for out in outs]
    tokens = sum(s.new_tokens for s in stats)
    wall = sum(w for _, w in runs)
    per_request = sorted(out.stats.new_tokens / w for outs, w in runs for out in outs)
    calls = sum(s.target_calls for s in stats)

    def at(key: str, q: float) -> float | None:  # None where an engine does not measure it
        values = [getattr(s, key) for s in stats]
        return None if not values or None in values else percentile(sorted(values), q)

    return {
        "method": name,
        "batch_size": batch_size,
        "requests": len(stats),
        "total_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "request_tokens_per_s_p50": statistics.median(per_request),
        "ttft_p50_s": at("ttft_s", 0.5), "ttft_p99_s": at("ttft_s", 0.99),
        "itl_p50_s": at("itl_p50_s", 0.5), "itl_p99_s": at("itl_p99_s", 0.99),
        # None where no verification step ran (every output only EOS): no mean to report
        "mean_accepted_length": sum(s.mean_accepted_length * s.target_calls for s in stats) / calls if calls else None,
    }


def paired(runs: Sequence[tuple[list, float]], reference: Sequence[tuple[list, float]]) -> dict[str, float]:
    """Plain decoding's wall time over the method's, group by group (each group ran every method back to back, and
    greedy with fixed budgets, the same tokens): its median and quartiles. A burst of load on the machine slows the
    runs it falls on, and moves a total by all of that but a median of pairs hardly."""
    return quartiles([ref / wall for (_, wall), (_, ref) in zip(runs, reference) if wall > 0], "paired_vs_plain")


def by_round(runs: Sequence[tuple[list, float]], reference: Sequence[tuple[list, float]], rounds: int) -> list[float]:
    """The method's total tokens/s over plain decoding's in each round (one pass over the groups): the spread of a
    speedup that `verdict` reads."""
    per = len(runs) // rounds
    ratios = []
    for r in range(rounds):
        mine, ref = (_rate(x[r * per : (r + 1) * per]) for x in (runs, reference))
        ratios.append(mine / ref if ref > 0 else 0.0)
    return ratios


def _rate(runs: Sequence[tuple[list, float]]) -> float:
    wall = sum(w for _, w in runs)
    return sum(out.stats.new_tokens for outs, _ in runs for out in outs) / wall if wall > 0 else 0.0


# With one round there is no spread to read: a speedup within this of 1.0x is not told apart from it (one pass of a
# short sweep moves by a few percent with the machine's load).
ONE_ROUND_NOISE = 0.05


def verdict(rows: Sequence[Mapping[str, Any]], rounds: int) -> str:
    """Where speculation stops paying, in words that say what they rest on: the rounds, and "within noise" where a
    speedup (total tokens/s over plain decoding's, as the table) is not told apart from 1.0x. With two or more
    rounds a speedup is apart from 1.0x when all its rounds lie on one side of it (``speedup_by_round``); with
    one, when it is more than `ONE_ROUND_NOISE` away.

    A batch size pays when some method pays there, and costs when every method costs there.
    """
    ours = [r for r in rows if r.get("engine", "specgraft") == "specgraft"]
    plain = ours[0]["method"]
    base = {r["batch_size"]: r["total_tokens_per_s"] for r in ours if r["method"] == plain}
    basis = f"rests on {rounds} round{'s' if rounds != 1 else ''}"
    drafting = [r for r in ours if r["method"] != plain]
    if not drafting:
        return f"No speculative method was measured ({basis})."

    def speedup(r: Mapping[str, Any]) -> float:
        return r["total_tokens_per_s"] / max(base[r["batch_size"]], 1e-9)

    def side(r: Mapping[str, Any]) -> int:  # 1: pays, -1: costs, 0: within noise
        spread = r.get("speedup_by_round") or []
        lo, hi = (min(spread), max(spread)) if rounds > 1 and len(spread) > 1 else (speedup(r) - ONE_ROUND_NOISE,
                                                                                     speedup(r) + ONE_ROUND_NOISE)
        return 1 if lo > 1.0 else -1 if hi < 1.0 else 0

    def why(r: Mapping[str, Any]) -> str:
        spread = r.get("speedup_by_round") or []
        if rounds > 1 and len(spread) > 1:
            return f"spans {min(spread):.2f}x-{max(spread):.2f}x over its {len(spread)} rounds"
        return f"lies within {ONE_ROUND_NOISE:.0%} of 1.00x, the threshold with one round"

    states = {}
    for b in sorted(base):
        at = [r for r in drafting if r["batch_size"] == b]
        sides = [side(r) for r in at]
        states[b] = (1 if 1 in sides else -1 if all(s == -1 for s in sides) else 0, max(at, key=speedup))
    stops = next((b for b, (state, _) in states.items() if state != 1), None)
    if stops is None:
        return f"Speculation pays at every batch size measured ({basis})."
    state, best = states[stops]
    if state == -1:
        return f"Speculation stops paying at batch {stops} ({basis})."
    line = (f"From batch {stops} speculation is within noise of plain decoding: the best there, {best['method']} at "
            f"{speedup(best):.2f}x, {why(best)}")
    costs = next((b for b, (state, _) in states.items() if b > stops and state == -1), None)
    return line + (f"; it stops paying at batch {costs}" if costs else "") + f" ({basis})."


def crossover(rows: Sequence[Mapping[str, Any]]) -> int | None:
    """The smallest batch size at which plain decoding's total throughput is at least every other specgraft method's."""
    rows = [r for r in rows if r.get("engine", "specgraft") == "specgraft"]
    sizes = sorted({r["batch_size"] for r in rows})
    plain = rows[0]["method"]
    for b in sizes:
        at = [r for r in rows if r["batch_size"] == b]
        base = next(r["total_tokens_per_s"] for r in at if r["method"] == plain)
        if all(r["total_tokens_per_s"] <= base for r in at if r["method"] != plain):
            return b
    return None


def batch_markdown(results: Mapping[str, Any]) -> str:
    """Total tokens/s per method (rows) and batch size (columns), then per-request latency at each size."""
    settings, rows = results["settings"], results["rows"]
    sizes = settings["batch_sizes"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cell = {(r["method"], r["batch_size"]): r for r in rows}
    lines = [
        f"# specgraft bench --batch-size: {settings['target']}",
        "",
        f"{settings['prompts']} prompts, {settings['max_new_tokens']} new tokens, greedy, "
        f"{settings.get('rounds', 1)} round(s)"
        + ("; the verification forward at static shapes (captured per size on CUDA)" if settings.get("capture") else "")
        + ". Greedy outputs identical "
        "to plain decoding: " + ("yes." if results["greedy_identical"] else f"**NO** ({len(results['mismatches'])})."),
        "",
        *interrupted_note(settings, "batch_sizes", SWEEP_NOUN),
        "Total tokens/s (tau in brackets):",
        "",
        "| method | " + " | ".join(f"B={b}" for b in sizes) + " |",
        "|---|" + "---:|" * len(sizes),
    ]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(
            f"{cell[m, b]['total_tokens_per_s']:.1f} ({format_tau(cell[m, b]['mean_accepted_length'])})" for b in sizes) + " |")
    lines += ["", results.get("verdict") or verdict(rows, settings.get("rounds", 1)), ""]
    plain = methods[0]
    lines += ["Against plain decoding:", "", "| method | " + " | ".join(f"B={b}" for b in sizes) + " |", "|---|" + "---:|" * len(sizes)]
    for m in methods[1:]:
        lines.append(f"| {m} | " + " | ".join(
            f"{cell[m, b]['total_tokens_per_s'] / max(cell[plain, b]['total_tokens_per_s'], 1e-9):.2f}x" for b in sizes) + " |")
    lines += ["", "Paired against plain decoding: plain's wall time over the method's, group by group (each group ran "
              "every method back to back), the median and quartiles over the groups:", "",
              "| method | " + " | ".join(f"B={b}" for b in sizes) + " |", "|---|" + "---:|" * len(sizes)]
    for m in methods[1:]:
        lines.append(f"| {m} | " + " | ".join(
            f"{cell[m, b]['paired_vs_plain_p50']:.3f}x ({cell[m, b]['paired_vs_plain_p25']:.3f}-"
            f"{cell[m, b]['paired_vs_plain_p75']:.3f})" for b in sizes) + " |")
    lines.append("")
    for name, curve in results.get("calibration", {}).items():
        if curve:
            lines += [f"Calibration of {name} (nodes verified by depth: the mean estimate selection used, the fraction "
                      "accepted):", "", "| depth | nodes | estimated | observed |", "|---:|---:|---:|---:|"]
            lines += [f"| {p['depth']} | {p['nodes']} | {p['estimated']:.3f} | {p['observed']:.3f} |" for p in curve]
            lines.append("")
    lines += _against_other_engines(rows, sizes)

    def ms(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value * 1e3:.{digits}f}"

    lines += ["| method | B | request tokens/s p50 | TTFT p50 / p99 ms | ITL p50 / p99 ms | kernels / syncs a step |",
              "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['batch_size']} | {r['request_tokens_per_s_p50']:.1f} | "
            f"{ms(r['ttft_p50_s'], 1)} / {ms(r['ttft_p99_s'], 1)} | {ms(r['itl_p50_s'], 2)} / {ms(r['itl_p99_s'], 2)} | "
            f"{counted(r)} |"
        )
    lines += ["", "Kernels / syncs a step: aten ops and host syncs a decoding step dispatched (prefills excluded), "
              "counted over each size's first group, untimed (specgraft.tools.step_counts): on a GPU each op is a "
              "launch and each sync drains the queue."]
    if any(r["itl_p50_s"] is None for r in rows):
        lines += ["", "-: not reported by that engine (vLLM's offline outputs carry each request's first and last token "
                  "times, not each token's)."]
    return "\n".join(lines) + "\n"


def _against_other_engines(rows: Sequence[Mapping[str, Any]], sizes: Sequence[int]) -> list[str]:
    """Each specgraft method's total tokens/s over each other engine's method's, and the best of each side."""
    ours = list(dict.fromkeys(r["method"] for r in rows if r.get("engine", "specgraft") == "specgraft"))
    theirs = list(dict.fromkeys(r["method"] for r in rows if r.get("engine", "specgraft") != "specgraft"))
    if not theirs:
        return []
    rate = {(r["method"], r["batch_size"]): r["total_tokens_per_s"] for r in rows}
    lines = []
    for other in theirs:
        lines += [f"Against {other} (total tokens/s, specgraft's over its):", "",
                  "| method | " + " | ".join(f"B={b}" for b in sizes) + " |", "|---|" + "---:|" * len(sizes)]
        lines += [f"| {m} | " + " | ".join(f"{rate[m, b] / max(rate[other, b], 1e-9):.2f}x" for b in sizes) + " |"
                  for m in ours]
        lines.append("")
    best = [(max(ours, key=lambda m: rate[m, b]), max(theirs, key=lambda m: rate[m, b])) for b in sizes]
    lines += ["Best of each side at each size:", "", "| B | specgraft | other engine | ratio |", "|---:|---|---|---:|"]
    lines += [f"| {b} | {m} ({rate[m, b]:.1f}) | {o} ({rate[o, b]:.1f}) | {rate[m, b] / max(rate[o, b], 1e-9):.2f}x |"
              for b, (m, o) in zip(sizes, best)]
    return lines + [""]


def write_batch_plot(results: Mapping[str, Any], out: Path) -> Path:
    """Total throughput against batch size, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for method in dict.fromkeys(r["method"] for r in results["rows"]):
        points = [(r["batch_size"], r["total_tokens_per_s"]) for r in results["rows"] if r["method"] == method]
        ax.plot(*zip(*points), marker="o", label=method)
    ax.set(xscale="log", xlabel="batch size", ylabel="total tokens/s", title="Throughput against batch size")
    ax.set_xticks(results["settings"]["batch_sizes"], labels=[str(b) for b in results["settings"]["batch_sizes"]])
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / PLOT
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
