"""The `specgraft` command line. Nothing imports this module.

Only the chosen subcommand's flags are built, and its module is imported when it
runs: `specgraft --help` and `specgraft generate --help` answer without loading
torch or transformers.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

from specgraft import flags
from specgraft.flags import DRAFTER_HELP, check_drafter_spec
from specgraft.threads import parse_threads

DEFAULT_CHECK_PROMPTS = ("Once upon a time", "The weather today is", "def main():")
TREE_HELP = (
    "'chain:DEPTH', 'static:FILE.json' (Medusa-style paths of sibling ranks), 'dynamic:TOP_K,DEPTH,BUDGET' "
    "(EAGLE-2), or a tree file written by `specgraft tune-tree`"
)
THREADS_HELP = (
    "torch CPU threads: 'auto' (default) picks from the model's size and this machine (one thread for models "
    "under 10M parameters, else one per idle core), or a count"
)
def _load(args: argparse.Namespace):
    """Target, drafter and tree from the common flags; the tree and drafter are checked before any model loads."""
    import specgraft as sg
    from specgraft.heads import drafter_from_spec

    tree = sg.parse_tree_spec(args.tree)
    check_drafter_spec(args.drafter)
    target = sg.load_target(args.target, dtype=args.dtype, device=args.device, threads=args.threads)
    return target, drafter_from_spec(args.drafter, target), tree


def cmd_generate(args: argparse.Namespace) -> int:
    import specgraft as sg

    if not args.prompt:
        raise ValueError("--prompt is empty")
    target, drafter, tree = _load(args)
    gen = sg.SpeculativeGenerator(target, drafter, tree=tree)
    options = dict(
        max_new_tokens=args.max_new_tokens, stop=args.stop or None, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed,
    )
    if args.json:
        out = gen.generate(args.prompt, **options)
        print(json.dumps({"token_ids": out.token_ids, "text": out.text, "stats": out.stats.to_dict()}, indent=2))
        return 0
    stats = None
    for chunk in gen.stream(args.prompt, **options):
        print(chunk.text, end="", flush=True)
        stats = chunk.stats or stats
    print()
    print(
        f"[{stats.new_tokens} tokens, {stats.target_calls} target calls, "
        f"mean accepted length {stats.mean_accepted_length:.2f}, {stats.tokens_per_s:.1f} tokens/s]",
        file=sys.stderr,
    )
    return 0


def cmd_check_exactness(args: argparse.Namespace) -> int:
    import specgraft as sg
    from specgraft.infer.exactness import check_exactness

    prompts = args.prompt or list(DEFAULT_CHECK_PROMPTS)
    if args.length < 3 and args.drafter != "none":
        raise ValueError(
            f"--length {args.length}: the prefill gives the first token and the last step has nothing left to "
            "draft for, so a continuation needs at least 3 tokens for the drafter to propose anything"
        )
    if args.top_k < 1 or args.top_k ** args.length > 4096:
        raise ValueError(f"--top-k {args.top_k} and --length {args.length}: need 1 <= top_k ** length <= 4096 outcomes")
    target, drafter, tree = _load(args)
    gen = sg.SpeculativeGenerator(target, drafter, tree=tree)
    reports = check_exactness(
        gen, prompts, samples=args.samples, length=args.length, temperature=args.temperature, top_k=args.top_k,
        seed=args.seed or 0,
    )
    rows = []
    for r in reports:
        verdict = "PASS" if r.passed else "FAIL"
        print(f"{verdict}  {r.prompt[:40]!r:44s} outcomes={r.outcomes:4d}  plain: {r.plain}  speculative: {r.speculative}  tau={r.mean_accepted_length:.2f}")
        rows.append({"prompt": r.prompt, "passed": r.passed, "plain": vars(r.plain), "speculative": vars(r.speculative), "mean_accepted_length": r.mean_accepted_length})
    passed = all(r.passed for r in reports)
    print(f"{'PASS' if passed else 'FAIL'}: speculative sampling {'matches' if passed else 'does NOT match'} the target's distribution on {len(reports)} prompts")
    if args.json:
        print(json.dumps({"passed": passed, "prompts": rows}, indent=2))
    return 0 if passed else 1


def _deepspeed_on_cpu_quietly() -> None:
    """Name the CPU accelerator when no GPU is visible: DeepSpeed would warn "Setting accelerator to CPU" at import."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def cmd_train(args: argparse.Namespace) -> int:
    _deepspeed_on_cpu_quietly()
    from specgraft.config import load_config
    from specgraft.train.pipeline import run_training

    cfg = load_config(args.config, args.overrides)  # every config error surfaces before a model loads
    head_dir = run_training(cfg)
    print(f"head written to {head_dir}")
    return 0


def cmd_extract_features(args: argparse.Namespace) -> int:
    _deepspeed_on_cpu_quietly()
    from specgraft.config import load_config
    from specgraft.train.pipeline import run_feature_extraction

    cfg = load_config(args.config, args.overrides)
    print(f"features in {run_feature_extraction(cfg)}")
    return 0


def cmd_regenerate(args: argparse.Namespace) -> int:
    _deepspeed_on_cpu_quietly()
    from specgraft.config import load_config
    from specgraft.train.pipeline import run_regeneration

    cfg = load_config(args.config, args.overrides)
    print(f"self-distilled data in {run_regeneration(cfg)}")
    return 0


def cmd_tune_tree(args: argparse.Namespace) -> int:
    from specgraft.infer.bench import encode_prompt, read_prompt_file
    from specgraft.infer.tune import tune

    if not Path(args.prompts).is_file():
        raise FileNotFoundError(f"--prompts {args.prompts} does not exist")
    target, drafter, _ = _load(args)
    if drafter is None:
        raise ValueError("--drafter none has nothing to tune")
    prompts = [encode_prompt(target, p.text) for p in read_prompt_file(args.prompts, limit=args.limit)]
    result = tune(
        target, drafter, prompts, depth=args.depth, max_new_tokens=args.max_new_tokens, nodes=args.nodes,
        kind=args.kind, measure=not args.no_timing,
    )
    spec = result.spec()
    report = {
        **spec,
        "predicted_speedup_vs_plain": result.best.speedup,
        "expected_tokens_per_step": result.best.expected_tokens,
        "verify_cost": {str(n): c for n, c in result.verify_cost.items()},
        "draft_cost_per_depth": result.draft_cost,
        "plain_step": result.plain_step,
        "step_overhead": result.step_overhead,
        "acceptance": result.acceptance,
        "timed": [{"tree": tree or "plain", "tokens_per_s": speed} for tree, speed in result.measured],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print("verification cost T(n)/T(1): " + ", ".join(f"{n}: {c:.2f}" for n, c in result.verify_cost.items()))
    print(f"draft round cost: {result.draft_cost:.2f} x T(1); plain decoding step {result.plain_step:.2f} x T(1); "
          f"speculative step overhead {result.step_overhead:.2f} x T(1)")
    print("acceptance by depth (rank 0): " + ", ".join(f"{a[0]:.2f}" for a in result.acceptance))
    for tree, speed in result.measured:
        print(f"timed on the calibration prompts: {tree or 'plain decoding'}: {speed:.1f} tokens/s")
    print(f"chosen: {len(result.best.choices)} nodes, depth {result.best.depth}, "
          f"expected {result.best.expected_tokens:.2f} tokens/step, predicted {result.best.speedup:.2f}x plain decoding")
    if result.measured:
        plain = result.measured[0][1]
        speed = next(v for tree, v in result.measured if tree == spec)
        print(f"measured: {speed / plain:.2f}x plain decoding on the calibration prompts")
        slower = speed < plain
    else:
        slower = result.best.speedup < 1.0
    if slower:
        print("plain decoding is faster here: on this device a draft round and its bookkeeping cost too much "
              "next to a target forward; the tree written is the fastest one that speculates")
    print(f"tree spec written to {args.out} (use --tree {args.out})")
    return 0


def cmd_search_layer_skip(args: argparse.Namespace) -> int:
    import specgraft as sg
    from specgraft.infer.bench import encode_prompt, read_prompt_file

    if not Path(args.prompts).is_file():
        raise FileNotFoundError(f"--prompts {args.prompts} does not exist")
    target = sg.load_target(args.target, dtype=args.dtype, device=args.device, threads=args.threads)
    prompts = [encode_prompt(target, p.text) for p in read_prompt_file(args.prompts, limit=args.limit)]
    result = sg.search_layer_skip(
        target, prompts, max_new_tokens=args.max_new_tokens, max_skip=args.max_skip, min_agreement=args.min_agreement,
        max_depth=args.depth, verify_cost=args.verify_cost,
    )
    if args.json:
        rows = [{**vars(c), "skip": list(c.skip), "spec": c.spec} for c in result.path]
        print(json.dumps({"best": result.best.spec, "positions": result.positions, "path": rows}, indent=2))
        return 0
    print(f"top-1 agreement with the target on {result.positions} tokens of its own greedy continuations:")
    print(f"{'skipped':>8} {'agreement':>9} {'draft cost':>10} {'depth':>5} {'tau':>5} {'speed-up':>8}  drafter")
    for c in result.path:
        print(f"{len(c.skip):8d} {c.agreement:9.3f} {c.draft_cost:10.3f} {c.depth:5d} {c.expected_tokens:5.2f} "
              f"{c.expected_speedup:7.2f}x  {c.spec if c.skip else '(none: the target itself, for reference)'}")
    print(f"chosen: --drafter {result.best.spec} --tree chain:{result.best.depth} "
          f"(expected {result.best.expected_speedup:.2f}x plain decoding; measure it with `specgraft bench`)")
    if result.best.expected_speedup <= 1.0:
        print("no skipped set is expected to beat plain decoding here: drafts that agree often cost nearly a full forward")
    return 0


def _search_layer_skip_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target model directory or hub id (Llama-family: the fast path)")
    p.add_argument("--prompts", required=True, help="calibration prompts (Spec-Bench / MT-bench jsonl, text, ...)")
    p.add_argument("--limit", type=int, default=4, help="calibration prompts used")
    p.add_argument("--max-new-tokens", type=int, default=32, help="target greedy tokens scored per prompt")
    p.add_argument("--max-skip", type=int, default=None, help="most layers skipped (default: half)")
    p.add_argument("--min-agreement", type=float, default=0.3, help="stop once top-1 agreement falls below this")
    p.add_argument("--depth", type=int, default=3, help="deepest chain the speed estimate considers")
    p.add_argument("--verify-cost", type=float, default=1.0,
                   help="one verification of up to depth + 1 tokens, in target forwards (measure with tune-tree)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=parse_threads, default="auto", help=THREADS_HELP)
    p.add_argument("--json", action="store_true", help="print the search path as JSON")
    p.set_defaults(func=cmd_search_layer_skip)


def _model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target model directory or hub id")
    p.add_argument("--drafter", default="prompt-lookup", help=DRAFTER_HELP + " (default: %(default)s)")
    p.add_argument("--tree", default="chain:5", help=TREE_HELP + " (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=parse_threads, default="auto", help=THREADS_HELP)
    p.add_argument("--seed", type=int, default=None)


def _generate_flags(gen: argparse.ArgumentParser) -> None:
    _model_flags(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (token-identical to the target)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print token ids, text and stats as JSON")
    gen.set_defaults(func=cmd_generate)


def _check_exactness_flags(check: argparse.ArgumentParser) -> None:
    _model_flags(check)
    check.add_argument("--prompt", action="append", help=f"prompt (repeatable; default: {list(DEFAULT_CHECK_PROMPTS)})")
    check.add_argument("--samples", type=int, default=2000, help="continuations per prompt and method")
    check.add_argument("--length", type=int, default=3, help="tokens per continuation")
    check.add_argument("--top-k", type=int, default=4, help="keeps the top_k ** length outcomes enumerable")
    check.add_argument("--temperature", type=float, default=1.0)
    check.add_argument("--json", action="store_true")
    check.set_defaults(func=cmd_check_exactness)


def _config_flags(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.ArgumentParser], None]:
    def add(cmd: argparse.ArgumentParser) -> None:
        cmd.add_argument("config", help="YAML training config (see recipes/)")
        cmd.add_argument("overrides", nargs="*", help="section.key=value, e.g. training.lr=1e-3")
        cmd.set_defaults(func=func)

    return add


def _tune_tree_flags(tune_p: argparse.ArgumentParser) -> None:
    _model_flags(tune_p)
    tune_p.add_argument("--prompts", required=True, help="calibration prompts (Spec-Bench jsonl, text, ...)")
    tune_p.add_argument("--limit", type=int, default=10, help="calibration prompts used")
    tune_p.add_argument("--max-new-tokens", type=int, default=64)
    tune_p.add_argument("--depth", type=int, default=6, help="deepest level considered")
    tune_p.add_argument("--kind", choices=["dynamic", "static"], default="dynamic",
                        help="write a DynamicTree budget (EAGLE-2) or a static tree of the best nodes (Sequoia)")
    tune_p.add_argument("--nodes", type=int, default=None,
                        help="write the most valuable tree of exactly this many draft nodes instead of the fastest size")
    tune_p.add_argument("--no-timing", action="store_true",
                        help="trust the cost model: skip timing the short list of trees on the calibration prompts")
    tune_p.add_argument("--out", required=True, help="tree spec JSON to write")
    tune_p.set_defaults(func=cmd_tune_tree)


def _module_flags(module: str, add_arguments: str, run: str) -> Callable[[argparse.ArgumentParser], None]:
    """Flags of a command whose module brings its own flags and entry point, imported only when it is chosen."""

    def add(cmd: argparse.ArgumentParser) -> None:
        mod = importlib.import_module(module)
        getattr(mod, add_arguments)(cmd)
        cmd.set_defaults(func=getattr(mod, run))

    return add


def _heavy_command(add_arguments: Callable[[argparse.ArgumentParser], Any], module: str, run: str):
    """Flags from `specgraft.flags` (argparse only); the module that runs the command is imported only to run it."""

    def runner(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), run)(args)

    runner.__name__ = runner.__qualname__ = run  # reads as the entry point it stands for

    def add(cmd: argparse.ArgumentParser) -> None:
        add_arguments(cmd)
        cmd.set_defaults(func=runner)

    return add


# name -> (help, adds the command's flags and sets its func)
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "generate": ("generate text with a target and a drafter", _generate_flags),
    "check-exactness": ("test statistically that speculative sampling follows the target's distribution",
                        _check_exactness_flags),
    "train": ("train a draft head (one process; use deepspeed --module specgraft.train for many)",
              _config_flags(cmd_train)),
    "regenerate": ("self-distillation only: the target writes the config's training data", _config_flags(cmd_regenerate)),
    "extract-features": ("write the hidden states the head needs as sharded safetensors",
                         _config_flags(cmd_extract_features)),
    "tune-tree": ("measure this device and drafter, and size the tree for speed", _tune_tree_flags),
    "search-layer-skip": ("pick the layers a self-speculative layer-skip draft leaves out, on calibration prompts",
                          _search_layer_skip_flags),
    "quickstart": ("offline end-to-end demo: demo target, self-distilled data, a trained head, a benchmark",
                   _module_flags("specgraft.quickstart", "add_quickstart_arguments", "quickstart_main")),
    "export": ("write a trained head in vLLM, SGLang, EAGLE or Medusa format",
               _heavy_command(flags.add_export_arguments, "specgraft.heads.export", "export_main")),
    "import-head": ("read an official EAGLE, EAGLE-3 or Medusa checkpoint",
                    _heavy_command(flags.add_import_arguments, "specgraft.heads.import_head", "import_main")),
    "bench": ("benchmark drafters and trees against baselines in one interleaved run",
              _heavy_command(flags.add_bench_arguments, "specgraft.infer.bench", "bench_main")),
    "serve": ("an OpenAI-compatible server with continuous batching",
              _heavy_command(flags.add_serve_arguments, "specgraft.infer.server", "serve_main")),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand with its help line; the flags of ``command`` only (of all of them when None)."""
    parser = argparse.ArgumentParser(prog="specgraft", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (text, add_flags) in COMMANDS.items():
        cmd = sub.add_parser(name, help=text, description=text)
        if command is None or command == name:
            add_flags(cmd)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The top-level parser has no options but --help, so the first bare word names the command.
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in COMMANDS else "").parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, OSError, NotImplementedError) as err:
        print(f"specgraft {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
