"""`specgraft quickstart`: the whole pipeline, offline, in one command.

    specgraft quickstart          # the embedded demo target: about 11 minutes on 2 cores, 4.5 once it is cached
    specgraft quickstart --target ../shared/models/stories260K --samples 800 --train-minutes 2
    specgraft quickstart --resume                           # after a failure: finished stages are reused

Four stages, each a line with its time:

1. ``target``: with no ``--target``, a small Llama trained on the Python
   standard library's own source (`specgraft.tools.demo_target`), cached under
   the user cache directory, so only the first run pays for it. With
   ``--target``, any HF causal LM (a directory or hub id) is loaded and checked.
2. ``data``: prompts, then self-distillation (`specgraft.train.regeneration`):
   the target writes the sequences its head learns from. Demo prompts are the
   first two lines of stdlib functions and classes from files the target never
   trained on, plus samples from BOS; other targets use ``--prompts`` or
   openings they sample themselves from BOS. Bench prompts are a disjoint set.
3. ``train``: an EAGLE head through the DeepSpeed trainer (one process),
   from a `TrainConfig` built here; ``--train-minutes`` becomes a step budget
   from a measured step time.
4. ``bench``: `specgraft.tools.bench.run_bench` with the head (a chain and an
   EAGLE-2 dynamic tree) against plain decoding and HF ``generate``, greedy, so
   it also checks that every output is token-identical to HF's.

Everything a run writes goes under ``--out`` (default ``runs/quickstart`` in the
current directory, which the repository's .gitignore leaves out); the first and
last lines say where. Only the demo target lives elsewhere, in the user cache.

Each finished stage leaves ``OUT/stages/NAME.json`` (its settings, outputs and
time). ``--resume`` reuses a stage whose settings are unchanged; a stage that
runs again invalidates the ones after it. A failure names the stage and the
command that resumes.
"""

from __future__ import annotations

import json
import math
import os
import random
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

# No torch at module level (each stage imports it): `specgraft quickstart --help` reads this module's defaults.
from specgraft.threads import choose_threads
from specgraft.tools.demo_target import DEFAULT_MAX_MINUTES, DemoTargetSpec, cached_target_dir
from specgraft.tools.stages import Stage, StageResult, duration, run_stages
from specgraft.tools.train_cost import measure_train_cost

STAGES = ("target", "data", "train", "bench")
STAGE_DIR = "stages"
BENCH_PROMPTS_FILE = "bench_prompts.jsonl"
# The head's training run directory; the head is HEAD_RUN/head, which `specgraft bench` labels "eagle".
HEAD_RUN = "eagle"
DEMO_NOTE = (
    "Note: the demo target is a smoke test. It writes Python-shaped but meaningless text, and its greedy output "
    "often falls into repetition loops; part of any drafter's gain here (and all of prompt lookup's) comes from "
    "those loops. Run `specgraft quickstart --target MODEL` for a real model's numbers."
)
SMALL_TARGET_NOTE = (
    "The head is slower than specgraft's own plain decoding here: on a target this small one draft step costs a "
    "large share of a target forward (on a 32-layer model, about 1/32), so accepted tokens do not pay for the "
    "drafting. Plain decoding's lead over HF generate is specgraft's lean forward, not speculation."
)


@dataclass
class QuickstartConfig:
    """Every size of a quickstart run. The defaults fit 15 minutes on 2 free CPU cores, demo target included."""

    out_dir: Path = Path("runs") / "quickstart"  # relative to the current directory
    target: str | None = None  # None: the demo target
    demo: DemoTargetSpec = field(default_factory=DemoTargetSpec)
    demo_minutes: float = DEFAULT_MAX_MINUTES  # wall-clock cap on the demo target's training (its schedule shrinks to fit)
    prompts: str | None = None  # prompts file (any `read_prompt_file` format); None: see the module docstring
    samples: int = 1600  # self-distilled sequences
    sample_tokens: int = 160  # new tokens per self-distilled sequence
    regenerate_batch: int = 64
    max_length: int = 192  # tokens per training sequence (prompt + reply)
    train_minutes: float = 3.0  # the head's training budget, extraction included
    max_epochs: int = 30  # never more, however fast the machine
    lr: float = 3e-3  # stories260K-sized heads converged faster at 3e-3 than at 1e-3 (MEASURED.md)
    micro_batch_size: int = 16
    eval_fraction: float = 0.02  # held-out sequences for per-depth accuracy
    bench_prompts: int = 20
    max_new_tokens: int = 128
    # A chain and a small EAGLE-2 tree. On the demo target chains of 3-6 and trees of 6-10 nodes measured
    # within 10% of each other; bigger trees lost (tree building and verification are not free on CPU).
    trees: tuple[str, ...] = ("chain:5", "dynamic:2,5,10")
    resume: bool = False
    retrain_target: bool = False  # train the demo target again even when a cached one exists
    cache_dir: Path | None = None  # None: $XDG_CACHE_HOME/specgraft or ~/.cache/specgraft
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir).expanduser().resolve()
        positive = ("samples", "sample_tokens", "regenerate_batch", "max_length", "max_epochs", "micro_batch_size",
                    "bench_prompts", "max_new_tokens")
        bad = [f"{name}={getattr(self, name)}" for name in positive if getattr(self, name) < 1]
        bad += [f"{name}={getattr(self, name)}" for name in ("train_minutes", "demo_minutes", "lr") if getattr(self, name) <= 0]
        if bad:
            raise ValueError(f"quickstart sizes must be positive: {', '.join(bad)}")
        from specgraft.tree import parse_tree_spec

        for spec in self.trees:
            parse_tree_spec(spec)  # a tree file is read here, before any stage runs
        if self.prompts is not None and not Path(self.prompts).expanduser().is_file():
            raise FileNotFoundError(f"--prompts {self.prompts!r} does not exist")
        if self.target is not None and self.target.startswith((".", "/", "~")) and not Path(self.target).expanduser().is_dir():
            raise FileNotFoundError(f"--target {self.target!r} is not a directory")
        if self.retrain_target and self.target is not None:
            raise ValueError("--retrain-target retrains the demo target; it cannot be combined with --target")
        if self.prompts is not None and self.target is None:
            raise ValueError("--prompts needs --target: the demo target's prompts come from the standard library")


# ---------------------------------------------------------------------------- the run


def run_quickstart(cfg: QuickstartConfig, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run (or resume) every stage; return the merged outputs of all stages.

    Raises:
        StageFailed: a stage raised; finished stages keep their markers.
    """
    from specgraft.progress import quiet_libraries

    quiet_libraries()  # "Loading weights" bars at every load; the stages show their own
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    stages = [
        Stage(name, key=partial(_stage_key, cfg, name),
              run=lambda outputs, continue_partial, name=name: STAGE_FUNCTIONS[name](cfg, outputs, continue_partial))
        for name in STAGES
    ]
    start = time.perf_counter()
    outputs = run_stages(stages, cfg.out_dir / STAGE_DIR, resume=cfg.resume, echo=echo)
    outputs["total_seconds"] = round(time.perf_counter() - start, 1)
    return outputs


def _stage_key(cfg: QuickstartConfig, stage: str) -> dict[str, Any]:
    """The settings a stage's result depends on (chained to the previous stage's by `run_quickstart`)."""
    if stage == "target":
        if cfg.target:
            return {"target": cfg.target}
        # A retrain reruns the stage even under --resume; the next plain --resume reruns it from the cache, cheaply.
        return {"demo": asdict(cfg.demo)} | ({"retrain": True} if cfg.retrain_target else {})
    if stage == "data":
        prompts = str(Path(cfg.prompts).expanduser().resolve()) if cfg.prompts else None
        return {k: getattr(cfg, k) for k in ("samples", "sample_tokens", "bench_prompts", "seed")} | {"prompts": prompts}
    if stage == "train":
        return {k: getattr(cfg, k) for k in ("max_length", "train_minutes", "max_epochs", "lr", "micro_batch_size", "eval_fraction")}
    return {"max_new_tokens": cfg.max_new_tokens, "trees": list(cfg.trees)}


def _threads_for(target) -> int | None:
    """The `specgraft.threads` choice for ``target`` (one thread for small models)."""
    params = sum(p.numel() for p in target.model.parameters())
    return choose_threads(params, target.device.type).threads


def _load(path: str):
    import specgraft as sg

    return sg.load_target(path)


# ---------------------------------------------------------------------------- 1. target


def stage_target(cfg: QuickstartConfig, outputs: dict[str, Any], continue_partial: bool = False) -> StageResult:
    if cfg.target is not None:
        target = _load(cfg.target)
        if target.tokenizer is None:
            raise ValueError(f"--target {cfg.target!r} has no tokenizer; the quickstart trains on text")
        params = sum(p.numel() for p in target.model.parameters())
        given = os.path.expanduser(cfg.target)  # absolute as written: a symlinked target keeps the name the user gave
        path = os.path.abspath(given) if os.path.exists(given) else cfg.target
        return StageResult(
            {"target_path": path, "demo": False, "target_params": params},
            f"{target.name} ({params / 1e6:.2f}M parameters, {target.num_layers} layers, vocab {target.vocab_size})",
            artifacts=[path] if Path(path).exists() else [],
        )
    from specgraft.tools.demo_target import ensure_demo_target

    demo = ensure_demo_target(cfg.demo, cache_dir=cfg.cache_dir, max_minutes=cfg.demo_minutes, progress=cfg.progress,
                              retrain=cfg.retrain_target)
    info = demo.info
    how = "cached" if demo.cached else f"trained on {info['threads']} thread(s)"
    cut = ""
    if info["cut_by_wall_clock"]:
        cut = f", cut to {info['steps_done']} of {cfg.demo.steps} steps by the {info['max_minutes']}-minute cap"
        if demo.cached:
            cut += " (a busy machine; --retrain-target --demo-minutes 15 trains it to the end)"
    summary = (
        f"demo target {how}: {info['parameters'] / 1e6:.1f}M-parameter Llama, {info['steps_done']} steps on "
        f"{info['corpus']['bytes'] / 1e6:.1f} MB of stdlib source{cut}, held-out {info['heldout_bits_per_byte']:.2f} "
        f"bits/byte -> {demo.path}"
    )
    return StageResult(
        {"target_path": str(demo.path), "demo": True, "target_params": info["parameters"],
         "demo_cached": demo.cached},
        summary,
        artifacts=[str(demo.path / "model.safetensors")],
    )


# ---------------------------------------------------------------------------- 2. data


def _demo_prompts(cfg: QuickstartConfig, target_path: str) -> list[str]:
    """Openings of functions and classes in the files the demo target never trained on, in a seeded order."""
    from specgraft.tools.demo_target import TRAINING_FILE, function_openings, stdlib_files

    info = json.loads((Path(target_path) / TRAINING_FILE).read_text())
    heldout = set(info["corpus"]["heldout_paths"])
    files = [f for f in stdlib_files(max_bytes=cfg.demo.corpus_bytes) if f.path in heldout]
    openings = function_openings(files)
    random.Random(cfg.seed).shuffle(openings)
    return openings


def _sampled_openings(cfg: QuickstartConfig, target, count: int) -> list[str]:
    """Prompts the target writes itself: the start of ``count`` samples from BOS (a seed training never uses)."""
    from specgraft.train import regenerate

    if target.tokenizer.bos_token_id is None:
        raise ValueError(
            f"target {target.name!r} has no BOS token to sample its own prompts from: pass --prompts FILE "
            "(Spec-Bench / MT-bench jsonl, HumanEval, GSM8K or one prompt per line)"
        )
    path = cfg.out_dir / "openings.jsonl"
    samples = count + max(2, count // 4)  # a few spare: a sample that ends at once at EOS gives no prompt
    regenerate(target, [], path, max_new_tokens=16, temperature=1.0, batch_size=samples, seed=cfg.seed + 1,
               resume=False, num_from_bos=samples, progress=False)
    texts = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
    # Cut at the last space so a prompt never ends inside a word.
    openings = [t[: t.rfind(" ")] if t.count(" ") >= 2 else t for t in texts]
    return [o for o in openings if o.strip()][:count]


def _prompt_record(target, index: int, text: str) -> dict:
    """A regeneration input: a user turn for a chat model (it answers in its template), else a text to continue."""
    if getattr(target.tokenizer, "chat_template", None):
        return {"id": f"p{index}", "messages": [{"role": "user", "content": text}]}
    return {"id": f"p{index}", "text": text}


def stage_data(cfg: QuickstartConfig, outputs: dict[str, Any], continue_partial: bool = False) -> StageResult:
    import torch

    from specgraft.tools.bench import read_prompt_file
    from specgraft.train import regenerate

    target = _load(outputs["target_path"])
    before = torch.get_num_threads()
    threads = _threads_for(target)
    if threads:
        torch.set_num_threads(threads)
    try:
        if outputs["demo"]:
            prompts, source = _demo_prompts(cfg, outputs["target_path"]), "stdlib openings"
        elif cfg.prompts:
            prompts, source = [p.text for p in read_prompt_file(cfg.prompts)], Path(cfg.prompts).name
        else:
            prompts, source = _sampled_openings(cfg, target, cfg.bench_prompts), "openings sampled from BOS"
        if len(prompts) < cfg.bench_prompts:
            raise ValueError(f"{len(prompts)} prompts from {source}: fewer than the {cfg.bench_prompts} bench prompts")
        bench, rest = prompts[: cfg.bench_prompts], prompts[cfg.bench_prompts :]
        bench_file = cfg.out_dir / BENCH_PROMPTS_FILE
        category = "stdlib" if outputs["demo"] else "quickstart"
        bench_file.write_text("".join(
            json.dumps({"question_id": i, "category": category, "turns": [p]}) + "\n" for i, p in enumerate(bench)
        ))
        # Half the sequences continue prompts (when there are any beyond the bench's), the rest start from BOS.
        use_bos = target.tokenizer.bos_token_id is not None
        n_prompted = min(len(rest), cfg.samples // 2 if use_bos else cfg.samples)
        inputs = [_prompt_record(target, i, p) for i, p in enumerate(rest[:n_prompted])]
        data_file = cfg.out_dir / "selfdistill.jsonl"
        summary = regenerate(
            target, inputs, data_file, max_new_tokens=cfg.sample_tokens, temperature=1.0,
            batch_size=cfg.regenerate_batch, seed=cfg.seed, resume=continue_partial,
            num_from_bos=cfg.samples - n_prompted if use_bos else 0, progress=cfg.progress,
        )
    finally:
        torch.set_num_threads(before)
    written = summary.written + summary.skipped
    origin = ", ".join(part for part in (
        f"{n_prompted} continue {source}" if n_prompted else "", f"{written - n_prompted} from BOS" if written > n_prompted else ""
    ) if part)
    return StageResult(
        {"data_file": str(data_file), "bench_prompts_file": str(bench_file), "sequences": written},
        f"{written} self-distilled sequences of up to {cfg.sample_tokens} new tokens ({origin}); "
        f"{len(bench)} bench prompts from {source} -> {data_file}",
        artifacts=[str(data_file), str(bench_file)],
    )


# ---------------------------------------------------------------------------- 3. train


def train_config(cfg: QuickstartConfig, outputs: dict[str, Any], *, max_steps: int, epochs: int, threads: int | None):
    """The `TrainConfig` of the head: EAGLE-1/2, offline features, cosine schedule, one process."""
    from specgraft.config import TrainConfig

    return TrainConfig.model_validate({
        "target": {"path": outputs["target_path"]},
        "head": {"type": "eagle"},
        "data": {"train": outputs["data_file"], "max_length": cfg.max_length, "eval_fraction": cfg.eval_fraction},
        "training": {
            "output_dir": str(cfg.out_dir / HEAD_RUN),
            "epochs": epochs,
            "max_steps": max_steps,
            "micro_batch_size": cfg.micro_batch_size,
            "lr": cfg.lr,
            "warmup_ratio": 0.03,
            "schedule": "cosine",
            "save_every": 0,  # the quickstart resumes whole stages; mid-training checkpoints would cost time
            "log_every": 10,
            "resume": "never",
            "num_threads": threads,
            "seed": cfg.seed,
            # The target runs once per sequence, not once per epoch: it costs about as much as the head's step.
            "features": "offline",
        },
        "tree": cfg.trees[0],
    })


def stage_train(cfg: QuickstartConfig, outputs: dict[str, Any], continue_partial: bool = False) -> StageResult:
    import torch

    from specgraft.train import TokenizedDataset, load_records, train_eval_split
    from specgraft.train import run_training

    target = _load(outputs["target_path"])
    threads = _threads_for(target)
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        dataset = TokenizedDataset(load_records(outputs["data_file"]), target.tokenizer, cfg.max_length)
        train, _ = train_eval_split(dataset.examples, cfg.eval_fraction, seed=cfg.seed)
        cost = measure_train_cost(target, train, cfg.micro_batch_size)
    finally:
        torch.set_num_threads(before)
    batches_per_epoch = math.ceil(len(train) / cfg.micro_batch_size)
    # A few seconds of the budget go to DeepSpeed's start-up and the final evaluation.
    budget_s = max(1.0, cfg.train_minutes * 60 - 10)
    max_steps = min(cfg.max_epochs * batches_per_epoch, cost.steps_within(budget_s, batches_per_epoch))
    epochs = max(1, math.ceil(max_steps / batches_per_epoch))
    train_cfg = train_config(cfg, outputs, max_steps=max_steps, epochs=epochs, threads=threads)
    shutil.rmtree(Path(train_cfg.training.output_dir), ignore_errors=True)  # the stage runs whole or not at all
    head_dir = run_training(train_cfg)
    metrics = json.loads((Path(train_cfg.training.output_dir) / "final_metrics.json").read_text())
    accuracy = [metrics.get(f"eval/depth{d}_top1") for d in range(1, 6)]
    accuracy_text = "/".join(f"{a:.2f}" for a in accuracy if a is not None) or "-"
    return StageResult(
        {"head_dir": str(head_dir), "train_steps": max_steps},
        f"EAGLE head: {max_steps} steps ({max_steps / batches_per_epoch:.1f} epochs of {len(train)} sequences; "
        f"measured {cost.step_s * 1e3:.0f} ms/step, budget {cfg.train_minutes:g} min), held-out top-1 by depth "
        f"{accuracy_text} -> {head_dir}",
        artifacts=[str(Path(head_dir) / "model.safetensors")],
    )


# ---------------------------------------------------------------------------- 4. bench


def bench_methods(head_dir: str, trees: tuple[str, ...], target):
    """(name, drafter, tree) per tree, named as `specgraft bench --drafter HEAD_DIR --tree T` names them
    (a training run's ``RUN/head`` is labelled ``RUN``)."""
    from specgraft.heads import load_drafter
    from specgraft.tools.bench import drafter_label
    from specgraft.tree import parse_tree_spec

    label = drafter_label(Path(head_dir))
    drafter = load_drafter(head_dir, target)
    return [(f"{label} {spec}", drafter, parse_tree_spec(spec)) for spec in trees]


def specgraft_command() -> str:
    """How a shell here calls specgraft: the bare name when PATH finds this install, else its script's path
    (the README's set-up never activates the venv, so ``.venv/bin/specgraft``)."""
    script = Path(sys.executable).parent / "specgraft"
    found = shutil.which("specgraft")
    if not script.is_file() or (found is not None and Path(found).resolve() == script.resolve()):
        return "specgraft"
    relative = os.path.relpath(script)
    return relative if not relative.startswith("..") else str(script)


def bench_command(cfg: QuickstartConfig, outputs: dict[str, Any]) -> str:
    """The `specgraft bench` command that benchmarks the same head on the same prompts."""
    parts = [specgraft_command(), "bench", "--target", outputs["target_path"], "--drafter", outputs["head_dir"]]
    for spec in cfg.trees:
        parts += ["--tree", spec]
    parts += ["--prompts", outputs["bench_prompts_file"], "--max-new-tokens", str(cfg.max_new_tokens),
              "--baselines", "plain,hf", "--out", str(cfg.out_dir / "bench-again")]
    return shlex.join(parts)


def stage_bench(cfg: QuickstartConfig, outputs: dict[str, Any], continue_partial: bool = False) -> StageResult:
    import torch

    from transformers.utils import logging as hf_logging

    from specgraft.tools.bench import read_prompt_file, run_bench

    hf_logging.set_verbosity_error()  # HF's per-call generation warnings would drown the progress bar
    before = torch.get_num_threads()
    try:
        target = _load(outputs["target_path"])
        threads = _threads_for(target) or before  # `specgraft bench`'s default: pinned, so runs compare
        prompts = read_prompt_file(outputs["bench_prompts_file"])
        out_dir = cfg.out_dir / "bench"
        results = run_bench(
            target, bench_methods(outputs["head_dir"], cfg.trees, target), prompts, max_new_tokens=cfg.max_new_tokens,
            baselines=("plain", "hf"), threads=threads, warmup=1, out_dir=out_dir, progress=cfg.progress,
            extra_settings={"prompts_file": outputs["bench_prompts_file"], "limit": None, "quickstart": True},
        )
    finally:
        torch.set_num_threads(before)
    if not results["greedy_identical"]:
        raise ValueError(
            f"{len(results['mismatches'])} greedy outputs differ from HF generate (first: {results['mismatches'][0]}); "
            f"see {out_dir / 'results.json'}"
        )
    best = max(results["methods"][2:], key=lambda m: m["e2e_tokens_per_s"] or 0.0)
    return StageResult(
        {"bench_dir": str(out_dir), "results_file": str(out_dir / "results.json")},
        f"{len(prompts)} prompts x {cfg.max_new_tokens} tokens, greedy identical to HF generate; best "
        f"{best['method']}: {best['speedup_vs']['hf']:.2f}x HF generate -> {out_dir}",
        artifacts=[str(out_dir / "results.json")],
    )


# stage(config, outputs of the stages before it, continue_partial) -> result. continue_partial: an
# interrupted run of this stage, with the same settings, left work that may be reused.
STAGE_FUNCTIONS: dict[str, Callable[[QuickstartConfig, dict[str, Any], bool], StageResult]] = {
    "target": stage_target, "data": stage_data, "train": stage_train, "bench": stage_bench,
}


# ---------------------------------------------------------------------------- report


def shown(path: Path) -> str:
    """``path`` as a reader types it here: relative when under the current directory, else absolute."""
    path = Path(path).resolve()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def opening_line(cfg: QuickstartConfig) -> str:
    """The run's first line: where it writes, and which target it uses."""
    if cfg.target is None:
        target = f"the demo target, trained once and cached in {shown(cached_target_dir(cfg.demo, cfg.cache_dir))}"
    else:
        target = cfg.target
    return f"specgraft quickstart: writing data, a head and a benchmark to {shown(cfg.out_dir)} (target: {target})"


def closing_line(cfg: QuickstartConfig) -> str:
    """The run's last line: the directory holding what it wrote, its size, and where the demo target is cached."""
    size = sum(p.stat().st_size for p in cfg.out_dir.rglob("*") if p.is_file() and not p.is_symlink())
    line = f"specgraft quickstart: this run's files are in {shown(cfg.out_dir)} ({size / 1e6:.1f} MB)"
    if cfg.target is None:
        line += f"; the demo target stays cached in {shown(cached_target_dir(cfg.demo, cfg.cache_dir))}"
    return line



def report(cfg: QuickstartConfig, outputs: dict[str, Any]) -> str:
    """The table, tau per method, where the report and plots are, and how to reproduce the bench."""
    from specgraft.infer import format_tau
    from specgraft.tools.bench import PLOTS, results_markdown

    results = json.loads(Path(outputs["results_file"]).read_text())
    bench_dir = Path(outputs["bench_dir"])
    taus = ", ".join(
        f"{m['method']} {format_tau(m['mean_accepted_length'])}" for m in results["methods"] if m["method"] not in ("plain", "hf")
    )
    lines = [results_markdown(results).rstrip(), "", f"Mean accepted length (tau, tokens per target call): {taus}."]
    speeds = {m["method"]: m["e2e_tokens_per_s"] or 0.0 for m in results["methods"]}
    if max(v for k, v in speeds.items() if k not in ("plain", "hf")) < speeds["plain"]:
        lines += ["", SMALL_TARGET_NOTE]
    if outputs.get("demo"):
        lines += ["", DEMO_NOTE]
    lines += [
        "",
        f"Report: {bench_dir / 'results.md'} and {bench_dir / 'results.json'}",
        f"Plots:  {', '.join(str(bench_dir / p) for p in PLOTS)}",
        f"Head:   {outputs['head_dir']}",
        f"Same benchmark again: {bench_command(cfg, outputs)}",
        f"Total: {duration(outputs['total_seconds'])}.",
    ]
    return "\n".join(lines)
