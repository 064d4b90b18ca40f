"""The `specgraft` command line: the only module that parses one. Nothing imports it but ``__main__`` entry points.

Only the chosen subcommand's flags are built (`specgraft.cli.flags`, argparse
only), and what runs it is imported when it runs: `specgraft --help` and
`specgraft generate --help` answer without loading torch or transformers.
Drafter and tree values are parsed by `specgraft.specs` before any model loads,
and a target or head directory that is not there is refused before torch loads.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import sys
import traceback
from pathlib import Path
from typing import Callable

from specgraft.cli import flags
from specgraft.cli.flags import DEFAULT_CHECK_PROMPTS
from specgraft.specs import (
    PROMPT_LOOKUP, NoDrafter, check_directory, check_drafter, check_model, parse_drafter, parse_tree,
)


def load_device_target(args: argparse.Namespace):
    """``args.target`` as the device flags say (`flags.add_device_arguments`: --dtype, --device, --threads,
    --capture)."""
    import specgraft as sg

    return sg.load_target(args.target, dtype=args.dtype, device=args.device, threads=args.threads, capture=args.capture)


def _load(args: argparse.Namespace):
    """Target, drafter and tree from the common flags; the paths they name are checked before torch loads."""
    tree_spec, drafter = parse_tree(args.tree), check_drafter(args.drafter)
    check_model(args.target, "--target")
    from specgraft.heads import drafter_from_spec
    from specgraft.tree import policy_from_spec

    tree = policy_from_spec(tree_spec)  # a tree file is read here
    target = load_device_target(args)
    return target, drafter_from_spec(drafter, target), tree


def cmd_generate(args: argparse.Namespace) -> int:
    if not args.prompt:
        raise ValueError("--prompt is empty")
    target, drafter, tree = _load(args)
    import specgraft as sg
    from specgraft.tools.prompts import encode_prompt

    if target.threads is not None:
        print(f"threads: {target.threads.threads or 'unchanged'} ({target.threads.why})", file=sys.stderr)
    print(f"small-row products: {target.small_rows.describe()}", file=sys.stderr)
    has_template = bool(getattr(target.tokenizer, "chat_template", None))
    if args.chat and not has_template:
        raise ValueError(f"--chat: target {target.name!r} has no chat template; give the prompt as plain text")
    if has_template and not args.chat:
        print(f"note: {target.name} is a chat model and --prompt goes to it as raw text; --chat sends it as a "
              "user turn in the model's chat template", file=sys.stderr)
    prompt = encode_prompt(target, args.prompt) if args.chat else args.prompt
    gen = sg.SpeculativeGenerator(target, drafter, tree=tree)
    options = dict(
        max_new_tokens=args.max_new_tokens, stop=args.stop or None, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed,
    )
    if args.json:
        out = gen.generate(prompt, **options)
        print(json.dumps({"token_ids": out.token_ids, "text": out.text, "stats": out.stats.to_dict()}, indent=2))
        stats, ids = out.stats, out.token_ids
    else:
        stats, ids = None, []
        for chunk in gen.stream(prompt, **options):
            print(chunk.text, end="", flush=True)
            stats, ids = chunk.stats or stats, ids + list(chunk.token_ids)
        print()
        from specgraft.infer import format_tau

        print(
            f"[{stats.new_tokens} tokens, {stats.target_calls} target calls, "
            f"mean accepted length {format_tau(stats.tau)}, {stats.tokens_per_s:.1f} tokens/s]",
            file=sys.stderr,
        )
    if ids and all(i in target.eos_token_ids for i in ids):
        hint = "" if args.chat or not has_template else "; a chat model given raw text often does this: try --chat"
        print(f"the output is only the end-of-sequence token {ids}: the target chose to stop at once{hint}",
              file=sys.stderr)
    return 0


def cmd_check_exactness(args: argparse.Namespace) -> int:
    prompts = args.prompt or list(DEFAULT_CHECK_PROMPTS)
    if args.length < 3 and args.drafter != "none":
        raise ValueError(
            f"--length {args.length}: the prefill gives the first token and the last step has nothing left to "
            "draft for, so a continuation needs at least 3 tokens for the drafter to propose anything"
        )
    if args.top_k < 1 or args.top_k ** args.length > 4096:
        raise ValueError(f"--top-k {args.top_k} and --length {args.length}: need 1 <= top_k ** length <= 4096 outcomes")
    target, drafter, tree = _load(args)
    import specgraft as sg
    from specgraft.tools.exactness import check_exactness, rule

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
    calibrated = all(r.plain.passed for r in reports)
    print(rule(2 * len(reports)))
    if not calibrated:
        print("FAIL: plain sampling itself failed the test: the enumeration or the sample size is off, so the "
              "speculative verdict says nothing; rerun with another --seed or more --samples")
    else:
        print(f"{'PASS' if passed else 'FAIL'}: speculative sampling {'matches' if passed else 'does NOT match'} "
              f"the target's distribution on {len(reports)} prompts")
    if args.json:
        print(json.dumps({"passed": passed, "calibrated": calibrated, "prompts": rows}, indent=2))
    return 0 if passed else 1


def _deepspeed_on_cpu_quietly() -> None:
    """Name the CPU accelerator when no GPU is visible: DeepSpeed would warn "Setting accelerator to CPU" at import."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _config(args: argparse.Namespace):
    """The validated config and its files, before torch loads: a typo in an override, or a target.path, data file
    or checkpoint that is not there, is refused at once (the overrides applied first)."""
    from specgraft.config import check_files, load_config

    cfg = load_config(args.config, args.overrides)
    check_files(cfg)
    _deepspeed_on_cpu_quietly()  # it imports torch: only for a config that will run, before anything imports DeepSpeed
    return cfg


def cmd_train(args: argparse.Namespace) -> int:
    """Run ``specgraft train``; a Ctrl-C ends in one line naming the last checkpoint and the command that resumes."""
    cfg = _config(args)
    from specgraft.train.pipeline import run_training

    try:
        head_dir = run_training(cfg)
    except KeyboardInterrupt:
        if os.environ.get("RANK", "0") == "0":
            print(interrupted_training(args, cfg), file=sys.stderr)
        return 130
    if os.environ.get("RANK", "0") == "0":  # one line from a launcher's many processes
        print(f"head written to {head_dir}")
    return 0


def interrupted_training(args: argparse.Namespace, cfg) -> str:
    """What a Ctrl-C on ``specgraft train`` says: the last complete checkpoint (or that none exists yet) and the
    command that continues from it (``training.resume=auto`` picks the newest checkpoint)."""
    from specgraft.tools.quickstart import specgraft_command
    from specgraft.train.trainer import latest_checkpoint

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a launcher started this process: only it knows its command
        command = "the same launch command with training.resume=auto"
    else:
        overrides = [o for o in args.overrides if not o.startswith("training.resume=")]
        command = shlex.join([specgraft_command(), "train", args.config, *overrides, "training.resume=auto"])
    checkpoint = latest_checkpoint(cfg.training.output_dir)
    if checkpoint is not None:
        return f"specgraft train: interrupted; the last checkpoint is {checkpoint}; continue from it with: {command}"
    every = cfg.training.save_every
    when = f"one is written every {every} steps" if every else "training.save_every=0 writes none"
    return f"specgraft train: interrupted before any checkpoint ({when}); start again with: {command}"


def cmd_extract_features(args: argparse.Namespace) -> int:
    cfg = _config(args)
    from specgraft.train.pipeline import run_feature_extraction

    print(f"features in {run_feature_extraction(cfg)}")
    return 0


def cmd_regenerate(args: argparse.Namespace) -> int:
    cfg = _config(args)
    from specgraft.train.pipeline import run_regeneration

    print(f"self-distilled data in {run_regeneration(cfg)}")
    return 0


def cmd_tune_tree(args: argparse.Namespace) -> int:
    if not Path(args.prompts).is_file():
        raise FileNotFoundError(f"--prompts {args.prompts} does not exist")
    target, drafter, _ = _load(args)
    from specgraft.tools.prompts import encode_prompt, read_prompt_file
    from specgraft.tools.tune import tune

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
    if not Path(args.prompts).is_file():
        raise FileNotFoundError(f"--prompts {args.prompts} does not exist")
    check_model(args.target, "--target")
    import specgraft as sg
    from specgraft.tools.prompts import encode_prompt, read_prompt_file

    target = load_device_target(args)
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


def cmd_export(args: argparse.Namespace) -> int:
    check_directory(args.head_dir, "head_dir")
    if args.target is not None:
        check_model(args.target, "--target")
    from specgraft.heads import export_head

    out = export_head(args.head_dir, args.fmt, args.out_dir, target=args.target)
    print(f"exported to {out}; serve it with:\n  " + (out / "README.md").read_text().split("```bash\n")[1].split("\n```")[0])
    return 0


def cmd_import_head(args: argparse.Namespace) -> int:
    check_directory(args.src_dir, "src_dir")
    check_model(args.target, "--target")
    from specgraft.heads import import_head
    from specgraft.model import load_target

    target = load_target(args.target, dtype=args.dtype, device=args.device)
    out = import_head(args.src_dir, args.fmt, args.out_dir, target)
    print(f"imported {args.fmt} head to {out}")
    return 0


def cmd_import_records(args: argparse.Namespace) -> int:
    check_directory(args.vllm_dir, "vllm_dir")
    check_model(args.target, "--target")
    from specgraft.model import load_target
    from specgraft.train.vllm_records import import_vllm_records

    target = load_target(args.target, dtype=args.dtype, device=args.device)
    report = import_vllm_records(args.vllm_dir, args.out_dir, target, args.layers, index=args.requests)
    print(report.summary(Path(args.vllm_dir), Path(args.out_dir)))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if not args.server:  # against a server, --drafter names one of its drafters and there is no --target
        for spec in args.drafter + [drafter for drafter, _ in args.method]:
            check_drafter(spec)
        if args.target is not None:
            check_model(args.target, "--target")
    from specgraft.tools.bench import bench_main

    return bench_main(args)


def parse_drafter_flags(values: list[str]) -> dict[str, str]:
    """serve's ``NAME=DRAFTER`` flags -> {name: drafter spec}; names are unique and not reserved, directories exist."""
    named: dict[str, str] = {}
    for value in values:
        name, sep, spec = value.partition("=")
        if not sep or not name or not spec:
            raise ValueError(f"--drafter {value!r}: expected NAME=DRAFTER, e.g. eagle=runs/eagle/head")
        if name in ("none", "auto", PROMPT_LOOKUP) or name in named:
            raise ValueError(f"--drafter {value!r}: the name {name!r} is reserved or given twice")
        parsed = parse_drafter(spec)
        if isinstance(parsed, NoDrafter):
            raise ValueError(f"--drafter {value!r}: 'none' is always there (speculative off)")
        try:
            check_drafter(parsed)
        except FileNotFoundError:
            raise FileNotFoundError(f"--drafter {value!r}: directory {spec!r} does not exist") from None
        named[name] = spec
    return named


def cmd_serve(args: argparse.Namespace) -> int:
    """Load the target and drafters once, then serve until SIGTERM / SIGINT (uvicorn drains in-flight requests)."""
    named = parse_drafter_flags(args.drafter)
    tree_spec = parse_tree(args.tree)
    if args.default_drafter not in ("none", PROMPT_LOOKUP, *named):
        raise ValueError(f"--default-drafter {args.default_drafter!r}: choose from none, {PROMPT_LOOKUP}, {', '.join(named)}")
    check_model(args.target, "--target")
    learn_dir = _check_learning(args, named)
    import specgraft as sg
    from specgraft.heads import drafter_from_spec
    from specgraft.infer.serve import create_app, run_server
    from specgraft.tree import policy_from_spec

    tree = policy_from_spec(tree_spec)  # a tree file is read here
    target = load_device_target(args)
    drafters = {name: drafter_from_spec(spec, target) for name, spec in named.items()}
    recorder = _traffic_recorder(args.record, target, drafters) if args.record else None
    learning = {args.learn: learn_dir} if args.learn else {}
    app = create_app(
        target, drafters, default_drafter=args.default_drafter, default_tree=tree,
        model_name=args.served_model_name or Path(args.target).name, max_batch_size=args.max_batch_size,
        max_queue=args.max_queue, api_key=args.api_key, observers=[recorder] if recorder else [], learning=learning,
    )
    print(app.state.specgraft.engine.describe(), file=sys.stderr)
    learner = _start_learner(args, named[args.learn], learn_dir) if args.learn else None
    try:
        return run_server(app, host=args.host, port=args.port, shutdown_timeout=args.shutdown_timeout)
    finally:
        if learner is not None:
            learner.terminate()
            learner.wait(30)
        if recorder is not None:
            recorder.close()
            print(f"specgraft serve: recorded {recorder.generations_written} requests in {recorder.shards_written} "
                  f"shards to {recorder.directory}" + (f" (recording stopped: {recorder.error})" if recorder.error else ""),
                  file=sys.stderr)


def _check_learning(args: argparse.Namespace, named: dict) -> Path | None:
    """serve --learn NAME: a head loaded as NAME, a recording to learn from; where its versions go."""
    if args.learn is None:
        return None
    if args.learn not in named or not Path(named[args.learn]).is_dir():
        raise ValueError(f"--learn {args.learn!r}: no head is loaded as --drafter {args.learn}=HEAD_DIR")
    if not args.record:
        raise ValueError("--learn needs --record DIR: the learner fine-tunes on the recorded traffic")
    if args.learn_config is not None and not Path(args.learn_config).is_file():
        raise ValueError(f"--learn-config {args.learn_config!r}: no such file")
    return Path(args.learn_dir or f"{args.record.rstrip('/')}-learn-{args.learn}")


def _start_learner(args: argparse.Namespace, head, learn_dir: Path):
    """The learner process beside the server: `specgraft learn`, its log in LEARN_DIR/learner.log."""
    import subprocess

    learn_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "specgraft.cli", "learn", "--target", args.target, "--head", str(head),
               "--record", args.record, "--out", str(learn_dir), "--every", str(args.learn_every)]
    if args.learn_config:
        command += ["--config", args.learn_config]
    log_file = open(learn_dir / "learner.log", "a")
    print(f"specgraft serve: learning {args.learn!r} from the recorded traffic every {args.learn_every} requests; "
          f"versions in {learn_dir}, the learner's log in {learn_dir / 'learner.log'}", file=sys.stderr)
    return subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)


def cmd_learn(args: argparse.Namespace) -> int:
    """Rounds of fine-tuning on a recording until killed (or ``--rounds``)."""
    import logging

    from specgraft.train.learner import Learner

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    # serve stops its learner with SIGTERM: leave through the round's cleanup, which stops the round's training
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    learner = Learner(args.target, args.head, args.record, args.out, config=args.config, every=args.every,
                      threads=args.threads)
    learner.run(rounds=args.rounds)
    return 0


def _traffic_recorder(directory: str, target, drafters: dict):
    """serve --record: a recorder of the states every loaded head reads (and the final one)."""
    from specgraft.train.recording import TrafficRecorder

    layers = sorted({i for d in drafters.values() for i in getattr(d, "hidden_layers", ())})
    if not layers:
        raise ValueError("--record: no loaded drafter reads the target's states, so there is nothing to learn from; "
                         "load a head with --drafter NAME=HEAD_DIR")
    recorder = TrafficRecorder(directory, target, layers)
    print(f"specgraft serve: recording finished requests (their tokens and the target's states at layers "
          f"{list(recorder.layers)}) to {recorder.directory}; a request with \"store\": false is not recorded",
          file=sys.stderr)
    return recorder


# ---------------------------------------------------------------------------- quickstart


def config_from_args(args: argparse.Namespace):
    """The `QuickstartConfig` of ``specgraft quickstart``'s flags (bad sizes and missing files fail here)."""
    from specgraft.tools.quickstart import QuickstartConfig

    return QuickstartConfig(
        out_dir=Path(args.out), target=args.target, prompts=args.prompts, samples=args.samples,
        train_minutes=args.train_minutes, max_new_tokens=args.max_new_tokens, bench_prompts=args.bench_prompts,
        trees=tuple(args.tree) if args.tree else QuickstartConfig.__dataclass_fields__["trees"].default,
        resume=args.resume, cache_dir=Path(args.cache_dir) if args.cache_dir else None,
        demo_minutes=args.demo_minutes, retrain_target=args.retrain_target,
    )


def resume_command(args: argparse.Namespace) -> str:
    """The command line that resumes this run: the flags given, plus --resume."""
    from specgraft.tools.quickstart import specgraft_command

    defaults = flags.add_quickstart_arguments(argparse.ArgumentParser()).parse_args([])
    parts = [specgraft_command(), "quickstart"]
    for name, value in vars(args).items():
        if not hasattr(defaults, name) or name == "resume" or value == getattr(defaults, name):
            continue
        flag = "--" + name.replace("_", "-")
        values = value if isinstance(value, list) else [value]
        for v in values:
            parts += [flag, str(v)]
    return shlex.join(parts + ["--resume"])


def cmd_quickstart(args: argparse.Namespace) -> int:
    """Run ``specgraft quickstart``; 0 on success, 1 when a stage fails (after saying how to resume)."""
    from specgraft.tools.quickstart import STAGE_DIR, closing_line, opening_line, report, run_quickstart
    from specgraft.tools.stages import StageFailed

    cfg = config_from_args(args)  # bad sizes and missing files fail here, before any work
    _deepspeed_on_cpu_quietly()
    print(opening_line(cfg), flush=True)
    out_dir_existed = cfg.out_dir.exists()
    try:
        outputs = run_quickstart(cfg, echo=lambda line: print(line, flush=True))
    except StageFailed as failure:
        if not isinstance(failure.cause, (KeyboardInterrupt, ValueError, OSError)):
            traceback.print_exception(failure.cause, file=sys.stderr)
        print(f"specgraft quickstart: {failure}", file=sys.stderr)
        if failure.stage == "target" and cfg.target is not None and isinstance(failure.cause, (OSError, ValueError)):
            # The given target cannot load: a resume would fail the same way, and nothing was made worth keeping.
            if not out_dir_existed:
                shutil.rmtree(cfg.out_dir, ignore_errors=True)
            print("  check --target: it must be a causal LM directory or a hub id reachable from here", file=sys.stderr)
            return 1
        print(f"  finished stages are kept in {cfg.out_dir / STAGE_DIR}; resume with:\n  {resume_command(args)}",
              file=sys.stderr)
        return 130 if isinstance(failure.cause, KeyboardInterrupt) else 1
    print()
    print(report(cfg, outputs))
    print(closing_line(cfg))
    return 0


# name -> (help, adds the command's flags, runs it)
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], object], Callable[[argparse.Namespace], int]]] = {
    "generate": ("generate text with a target and a drafter", flags.add_generate_arguments, cmd_generate),
    "check-exactness": ("test statistically that speculative sampling follows the target's distribution",
                        flags.add_check_exactness_arguments, cmd_check_exactness),
    "train": ("train a draft head (one process; use deepspeed --module specgraft.train for many)",
              flags.add_config_arguments, cmd_train),
    "regenerate": ("self-distillation only: the target writes the config's training data",
                   flags.add_config_arguments, cmd_regenerate),
    "extract-features": ("write the hidden states the head needs as sharded safetensors",
                         flags.add_config_arguments, cmd_extract_features),
    "tune-tree": ("measure this device and drafter, and size the tree for speed", flags.add_tune_tree_arguments,
                  cmd_tune_tree),
    "search-layer-skip": ("pick the layers a self-speculative layer-skip draft leaves out, on calibration prompts",
                          flags.add_search_layer_skip_arguments, cmd_search_layer_skip),
    "quickstart": ("offline end-to-end demo: demo target, self-distilled data, a trained head, a benchmark",
                   flags.add_quickstart_arguments, cmd_quickstart),
    "export": ("write a trained head in vLLM, SGLang, EAGLE or Medusa format", flags.add_export_arguments, cmd_export),
    "import-head": ("read an official EAGLE, EAGLE-3, Medusa or DFlash checkpoint", flags.add_import_arguments,
                    cmd_import_head),
    "import-records": ("turn the hidden states vLLM's extract_hidden_states wrote into a recording to train on",
                       flags.add_import_records_arguments, cmd_import_records),
    "bench": ("benchmark drafters and trees against baselines in one interleaved run", flags.add_bench_arguments,
              cmd_bench),
    "serve": ("an OpenAI-compatible server with continuous batching", flags.add_serve_arguments, cmd_serve),
    "learn": ("fine-tune a served head on its recorded traffic, round after round (what serve --learn runs)",
              flags.add_learn_arguments, cmd_learn),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand with its help line; the flags of ``command`` only (of all of them when None)."""
    parser = argparse.ArgumentParser(prog="specgraft", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=flags.CommandParser)
    for name, (text, add_flags, run) in COMMANDS.items():
        cmd = sub.add_parser(name, help=text, description=text)
        if command is None or command == name:
            add_flags(cmd)
            cmd.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The top-level parser has no options but --help, so the first bare word names the command.
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in COMMANDS else "").parse_args(argv)
    from specgraft.progress import quiet_libraries

    quiet_libraries()
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, OSError, NotImplementedError) as err:
        print(f"specgraft {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # commands with work worth naming (train, bench, quickstart) say more themselves
        print(f"specgraft {args.command}: interrupted", file=sys.stderr)
        return 130

