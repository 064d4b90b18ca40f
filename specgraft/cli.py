"""The `specgraft` command line. Nothing imports this module."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def _build_drafter(spec: str, target):
    """``none``, ``prompt-lookup``, or a path to a small causal LM sharing the target's tokenizer."""
    import specgraft as sg

    if spec == "none":
        return None
    if spec == "prompt-lookup":
        return sg.PromptLookup()
    if not Path(spec).is_dir():
        raise FileNotFoundError(f"--drafter {spec!r}: expected 'none', 'prompt-lookup' or a model directory")
    return sg.DraftModel(spec, target)


def cmd_generate(args: argparse.Namespace) -> int:
    import specgraft as sg

    if not args.prompt:
        raise ValueError("--prompt is empty")
    if args.threads:
        torch.set_num_threads(args.threads)
    tree = sg.parse_tree_spec(args.tree)
    target = sg.load_target(args.target, dtype=args.dtype, device=args.device)
    drafter = _build_drafter(args.drafter, target)
    gen = sg.SpeculativeGenerator(target, drafter, tree=tree)
    options = dict(max_new_tokens=args.max_new_tokens, stop=args.stop or None)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specgraft", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with a target and a drafter")
    gen.add_argument("--target", required=True, help="target model directory or hub id")
    gen.add_argument("--drafter", default="prompt-lookup", help="'none', 'prompt-lookup', or a draft model directory")
    gen.add_argument("--tree", default="chain:5", help="'chain:DEPTH' or 'static:FILE.json' (Medusa-style paths)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    gen.add_argument("--json", action="store_true", help="print token ids, text and stats as JSON")
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, OSError, NotImplementedError) as err:
        print(f"specgraft {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
