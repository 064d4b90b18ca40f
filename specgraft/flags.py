"""The flags of the commands whose code is heavy (bench, serve, export, import-head), without their imports.

`specgraft --help` and `specgraft COMMAND --help` build only argparse: the
modules that run these commands import torch and transformers, so their
flags live here and those modules read the choices from here.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from specgraft.threads import parse_threads

BASELINE_KINDS = ("plain", "hf", "hf-pld", "hf-assisted:PATH")
EXPORT_FORMATS = ("vllm", "sglang", "eagle", "medusa")
IMPORT_FORMATS = ("eagle", "eagle3", "medusa")
PROMPT_LOOKUP = "prompt-lookup"  # the drafter name a server always offers
NAMED_DRAFTERS = ("none", PROMPT_LOOKUP, "self")
COMPOSITE_PREFIX = PROMPT_LOOKUP + "+"  # --drafter prompt-lookup+DRAFTER: lookup first, DRAFTER where it finds nothing
# --drafter prompt-lookup:K+DRAFTER: the lookup copies up to K tokens whatever the tree's depth
COMPOSITE = re.compile(re.escape(PROMPT_LOOKUP) + r"(?::(?P<depth>[^+]*))?\+(?P<then>.*)", re.DOTALL)
LAYER_SKIP_PREFIX = "layer-skip:"  # --drafter layer-skip:12-19,22 skips those decoder layers (checked once the target loads)
DRAFTER_HELP = (
    "'none' (plain decoding), 'prompt-lookup', 'self' (the target drafts for itself), 'layer-skip:LAYERS' (the "
    "target drafts with those decoder layers left out, e.g. layer-skip:12-19; `specgraft search-layer-skip` picks "
    "them), a trained head directory "
    "(e.g. runs/eagle-stories260k/head from `specgraft train`), or a small causal LM's directory sharing the "
    "target's tokenizer; 'prompt-lookup+' before 'self', 'layer-skip:LAYERS' or a directory drafts by lookup first and with that "
    "drafter where lookup finds nothing ('prompt-lookup:K+...': the lookup copies up to K tokens, else as deep as the tree)"
)


def split_composite(spec: str) -> tuple[int | None, str] | None:
    """``prompt-lookup[:K]+DRAFTER`` -> (K or None, DRAFTER); None for any other spec."""
    match = COMPOSITE.fullmatch(spec)
    if match is None:
        return None
    depth = match["depth"]
    if depth is not None and not (depth.isdigit() and int(depth) >= 1):
        raise ValueError(f"--drafter {spec!r}: after 'prompt-lookup:' comes a number of tokens >= 1, got {depth!r}")
    return (None if depth is None else int(depth)), match["then"]


def check_drafter_spec(spec: str) -> None:
    """Refuse a --drafter that is neither a named drafter nor an existing directory, before any model loads."""
    if spec in NAMED_DRAFTERS or spec.startswith(LAYER_SKIP_PREFIX):
        return
    composite = split_composite(spec)
    if composite is not None:
        then = composite[1]
        if (then in NAMED_DRAFTERS and then != "self") or split_composite(then) is not None:
            raise ValueError(
                f"--drafter {spec!r}: after {COMPOSITE_PREFIX!r} comes 'self', 'layer-skip:LAYERS' or a drafter directory"
            )
        return check_drafter_spec(then)
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"--drafter {spec!r} does not exist; expected {DRAFTER_HELP}")
    if not path.is_dir():
        raise FileNotFoundError(f"--drafter {spec!r} is a file, not a directory; expected {DRAFTER_HELP}")


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``specgraft bench``."""
    parser.add_argument("--target", help="target model directory or hub id (offline bench)")
    parser.add_argument("--server", metavar="URL",
                        help="bench a running `specgraft serve` at URL instead (see specgraft.infer.bench_server)")
    parser.add_argument("--concurrency", default="1,4,16,64", help="with --server: concurrent requests per level")
    parser.add_argument("--api-key", default=None, help="with --server: the server's --api-key")
    parser.add_argument("--batch-size", default=None, metavar="B1,B2,...",
                        help="offline: run each method with that many prompts at a time through the scheduler "
                        "(e.g. 1,2,4,8,16): total and per-request throughput, TTFT and ITL, and where speculation "
                        "stops paying (see specgraft.infer.bench_batch); plain decoding always runs")
    parser.add_argument(
        "--drafter", action="append", default=[],
        help="'prompt-lookup', 'self' (the target drafts for itself), 'layer-skip:LAYERS' (the target drafts with "
        "those decoder layers left out, e.g. layer-skip:12-19), a draft-model directory or a trained head "
        "directory (repeatable; each is crossed with each --tree). With --server: the one drafter NAME the "
        "requests ask for when speculation is on (default 'auto', the server's default)",
    )
    parser.add_argument("--tree", action="append", default=[], help="'chain:N', 'static:FILE.json' or "
                        "'dynamic:TOP_K,DEPTH,BUDGET' (repeatable; default chain:5). prompt-lookup ignores trees")
    parser.add_argument(
        "--method", nargs=2, action="append", default=[], metavar=("DRAFTER", "TREE"),
        help="one drafter with one tree, not crossed with the others (repeatable), e.g. "
        "--method runs/medusa/head static:tree.json --method runs/eagle/head dynamic:8,6,48",
    )
    parser.add_argument("--prompts", required=True, help="Spec-Bench / MT-bench / HumanEval / GSM8K jsonl(.gz), or text")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None, help="first N prompts only")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default): greedy, each output checked token for token against the reference; "
                        "above 0 every method samples softmax(logits / T) unfiltered (HF with top_k=0, top_p=1)")
    parser.add_argument("--per-category", type=int, default=None, metavar="N",
                        help="first N prompts of each category (e.g. Spec-Bench's 13), then --limit")
    parser.add_argument("--baselines", default="plain,hf", help=f"comma list of {', '.join(BASELINE_KINDS)}")
    parser.add_argument("--sweep", nargs="+", default=[], metavar="KEY=V1,V2",
                        help="e.g. depth=3,5,7 (chain) or top_k=4,8 budget=16,32,64 (dynamic); crossed with each --tree")
    parser.add_argument("--out", required=True, help="directory for results.json, results.md and plots")
    parser.add_argument("--json", action="store_true", help="print results.json to stdout")
    parser.add_argument("--threads", type=parse_threads, default="auto",
                        help="torch threads, pinned for the whole run: 'auto' (default) picks from the target's size "
                        "and this machine (`specgraft.threads`; the choice is reported), or a count")
    parser.add_argument("--warmup", type=int, default=1, help="prompts run untimed by every method first")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    return parser


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``specgraft serve``."""
    parser.add_argument("--target", required=True, help="target model directory or hub id")
    parser.add_argument("--drafter", action="append", default=[], metavar="NAME=HEAD_DIR",
                        help="a drafter requests may pick by NAME (repeatable); 'none' and 'prompt-lookup' always exist")
    parser.add_argument("--default-drafter", default=PROMPT_LOOKUP,
                        help="drafter of requests without 'speculative' (a --drafter NAME, 'prompt-lookup' or 'none')")
    parser.add_argument("--tree", default="chain:5", help="default tree: 'chain:K', 'static:FILE.json', 'dynamic:TOP_K,DEPTH,BUDGET'")
    parser.add_argument("--max-batch-size", type=int, default=16, help="most generations running at once")
    parser.add_argument("--max-queue", type=int, default=256, help="most generations waiting; more get 503 + Retry-After")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/ routes")
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: the target's name)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds SIGTERM waits for in-flight requests before aborting them")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=parse_threads, default="auto",
                        help="torch threads: 'auto' (default) picks from the target's size and this machine "
                        "(`specgraft.threads`), or a count")
    return parser


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``specgraft export``."""
    parser.add_argument("head_dir", help="a specgraft head directory (config.json + model.safetensors)")
    parser.add_argument("out_dir", help="new or empty output directory")
    parser.add_argument("--to", required=True, choices=EXPORT_FORMATS, dest="fmt",
                        help="vllm, sglang, eagle (official EAGLE repo) or medusa (Medusa repo)")
    parser.add_argument("--target", default=None,
                        help="target path or hub id whose config EAGLE draft layers copy (default: the head's own)")


def add_import_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``specgraft import-head``."""
    parser.add_argument("src_dir", help="checkpoint directory: official EAGLE / EAGLE-3 / Medusa layout or an engine export")
    parser.add_argument("out_dir", help="where to write the specgraft head")
    parser.add_argument("--format", required=True, choices=IMPORT_FORMATS, dest="fmt")
    parser.add_argument("--target", required=True, help="target model directory or hub id")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--device", default="cpu")
