"""The offline bench's report: the markdown table a README quotes, results.json, and the plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from specgraft.infer import format_tau

PLOTS = ("speed_vs_accepted_length.png", "accept_length_histogram.png", "acceptance_by_depth.png")


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def counted(row: Mapping[str, Any]) -> str:
    """A row's kernels and host syncs a decoding step, or - where not counted (another engine's)."""
    if row.get("kernels_per_step") is None:
        return "-"
    return f"{row['kernels_per_step']:.0f} / {row['syncs_per_step']:.1f}"


def results_markdown(results: Mapping[str, Any]) -> str:
    """The table a README quotes: method, tau, end-to-end tokens/s, speedup vs each baseline."""
    settings = results["settings"]
    bases = settings["baselines"]
    header = ["method", "tau", "tokens/s"] + [f"vs {b}" for b in bases] + ["kernels / syncs a step"]
    temperature = settings.get("temperature", 0.0)
    lines = [
        f"# specgraft bench: {settings['target']}",
        "",
        f"{settings['prompts']} prompts, {settings['max_new_tokens']} new tokens, "
        + (f"sampled at temperature {temperature}, " if temperature else "greedy, ")
        + f"{settings['threads']} thread(s)"
        + (f" ({settings['threads_choice']})" if settings.get("threads_choice") else "")
        + f", {settings['device']} {settings['dtype']}"
        + (f"; small-row products: {settings['small_rows']['choice']}" if settings.get("small_rows") else "")
        + ". "
        + (
            "Sampled outputs are not compared (each method draws its own)."
            if temperature
            else f"Greedy outputs identical to `{settings['reference']}`: "
            + ("yes." if results["greedy_identical"] else f"**NO** ({len(results['mismatches'])} mismatches).")
        ),
        "",
    ]
    if settings.get("interrupted"):
        lines += [f"**Interrupted** after {settings['prompts']} of {settings['prompts_given']} prompts: the table "
                  "holds the prompts every method finished.", ""]
    lines += [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
    ]
    for m in results["methods"]:
        row = [m["method"], format_tau(m["mean_accepted_length"]), _fmt(m["e2e_tokens_per_s"], 1)]
        row += [_fmt(m["speedup_vs"].get(b), 2) + "x" if m["speedup_vs"].get(b) is not None else "-" for b in bases]
        row.append(counted(m))
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "tau: committed tokens per target call after the first (HF methods: tokens per streamed chunk). "
        "tokens/s: median over prompts of new tokens / wall time of the whole call, prefill included, "
        "the same clock for every method; speedups are ratios of these medians. "
        "Methods ran interleaved, prompt by prompt. Kernels / syncs a step: aten ops and host syncs a decoding "
        "step dispatched, counted on the first prompt (untimed; specgraft.tools.step_counts): on a GPU each op is "
        "a launch and each sync drains the queue.",
        "",
    ]
    categories = settings.get("categories") or []
    if len(categories) > 1:
        lines += [
            "Per category: tau / tokens/s.",
            "",
            "| method | " + " | ".join(categories) + " |",
            "|" + "|".join(["---"] + ["---:"] * len(categories)) + "|",
        ]
        for m in results["methods"]:
            cells = [m["per_category"].get(c) for c in categories]
            lines.append("| " + " | ".join([m["method"]] + [
                "-" if c is None else f"{format_tau(c['mean_accepted_length'])} / {_fmt(c['e2e_tokens_per_s'], 1)}"
                for c in cells
            ]) + " |")
        lines.append("")
    return "\n".join(lines)


def write_results(results: Mapping[str, Any], out_dir: str | Path) -> Path:
    """results.json, results.md and the plots into ``out_dir`` (created)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(results_markdown(results))
    write_plots(results, out)
    return out


def write_plots(results: Mapping[str, Any], out: Path) -> list[Path]:
    """Speed vs accepted length, accept-length histograms, and acceptance per depth, as PNGs."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never open a window
    from matplotlib import pyplot as plt

    methods = [m for m in results["methods"] if m["mean_accepted_length"] is not None]
    paths = [out / name for name in PLOTS]

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for m in methods:
        ax.scatter(m["mean_accepted_length"], m["e2e_tokens_per_s"] or 0.0)
        ax.annotate(m["method"], (m["mean_accepted_length"], m["e2e_tokens_per_s"] or 0.0), fontsize=8,
                    xytext=(4, 4), textcoords="offset points")
    ax.set(xlabel="mean accepted length (tau)", ylabel="tokens/s (median, end to end)", title="Speed vs accepted length")
    _save(fig, paths[0])

    fig, axes = plt.subplots(len(methods), 1, figsize=(6, 1.8 * len(methods) + 0.6), squeeze=False, sharex=True)
    for ax, m in zip(axes[:, 0], methods):
        hist = m["accept_length_histogram"]
        total = sum(hist) or 1
        ax.bar(range(1, len(hist) + 1), [h / total for h in hist])
        ax.set_ylabel("share of steps", fontsize=8)
        ax.set_title(m["method"], fontsize=9)
    axes[-1, 0].set_xlabel("tokens committed per target call")
    _save(fig, paths[1])

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for m in methods:
        rates = m["acceptance_by_depth"]
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=m["method"])
    ax.set(xlabel="tree depth d", ylabel="P(accepted at d | reached d)", title="Acceptance per depth", ylim=(0, 1.05))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    _save(fig, paths[2])
    return paths


def _save(fig, path: Path) -> None:
    from matplotlib import pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
