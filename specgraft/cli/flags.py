"""Every command's flags (argparse only): `specgraft --help` and `specgraft COMMAND --help` load no torch.

Drafter and tree values are parsed by `specgraft.specs` when a command runs,
so a flag here only names them. `CommandParser` is the parser each command's
flags go in.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys

from specgraft.specs import BASELINE_KINDS, DRAFTER_HELP, EXPORT_FORMATS, IMPORT_FORMATS, PROMPT_LOOKUP, TREE_HELP

DTYPES = ("float32", "float16", "bfloat16")
THREADS_HELP = (
    "torch CPU threads: 'auto' (default) picks from the model's size and this machine (one thread for models "
    "under 10M parameters, else one per idle core), or a count"
)


# How argparse tells a negative number from a flag: such a word is a value (or argparse's own error), never a flag.
_NUMBER = re.compile(r"-\.?\d")


class CommandParser(argparse.ArgumentParser):
    """One command's parser: a flag it does not have is refused under its own usage, naming the closest one it has.

    Plain argparse hands a command's unknown words up to the top-level parser, which reports them under
    `specgraft`'s usage, and only after the command's parser has said that a required flag (often the misspelt
    one) is missing. Here the unknown flags are looked for first, and nothing unknown leaves the command.
    """

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        unknown = self.unknown_flags(args)
        if unknown:
            self.error(", ".join(self.describe_unknown(word) for word in unknown))
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    def unknown_flags(self, args: list[str]) -> list[str]:
        """The words of ``args`` that argparse would read as flags this parser does not have.

        A word is a flag when it starts with '-', as argparse reads it: not '-' alone, not a negative number,
        not a word with a space, nothing after '--'. A flag is known by its name (before any '='), a unique
        or ambiguous prefix of a long flag (argparse expands or refuses those itself), or, for a short flag,
        its first two characters (``-hx``).
        """
        known = self._option_string_actions
        unknown = []
        for word in args:
            if word == "--":
                break
            if not word.startswith("-") or word == "-" or " " in word or _NUMBER.match(word):
                continue
            name = word.partition("=")[0] if word.startswith("--") else word[:2]
            if name in known or (name.startswith("--") and any(flag.startswith(name) for flag in known)):
                continue
            unknown.append(word)
        return unknown

    def describe_unknown(self, word: str) -> str:
        """'unrecognized flag --promt (did you mean --prompt?)': the closest visible long flag, by spelling."""
        visible = {
            flag.lstrip("-"): flag for action in self._actions if action.help != argparse.SUPPRESS
            for flag in action.option_strings if flag.startswith("--")
        }
        close = difflib.get_close_matches(word.partition("=")[0].lstrip("-"), visible, n=1)
        hint = f"did you mean {visible[close[0]]}?" if close else f"see {self.prog} --help"
        return f"unrecognized flag {word} ({hint})"


CAPTURE_HELP = (
    "run the target's batched verification forward, and EAGLE / EAGLE-3 and DFlash heads' draft forwards, at static "
    "shapes, captured once per size as CUDA graphs (off by default; on a CPU they run eager and are slower than the "
    "default packed forward); bench reports each one's graphs and capture seconds"
)


def parse_threads(value: str) -> int | str:
    """A ``--threads`` value: "auto" or a positive int (argparse ``type=``)."""
    if value == "auto":
        return value
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a positive int, got {value!r}")
    return count


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``specgraft bench``."""
    parser.add_argument("--target", help="target model directory or hub id (offline bench)")
    parser.add_argument("--server", metavar="URL",
                        help="bench a running `specgraft serve` at URL instead (see specgraft.tools.bench_server)")
    parser.add_argument("--concurrency", default="1,4,16,64", help="with --server: concurrent requests per level")
    parser.add_argument("--api-key", default=None, help="with --server: the server's --api-key")
    parser.add_argument("--vllm-server", action="append", default=[], metavar="LABEL=URL",
                        help="with --server: a running `vllm serve` benched beside it (repeatable), interleaved with "
                        "speculation on and off, on the same prompts; its rows are 'vllm LABEL'")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --server: each level runs on and off this many times, alternating, and pools "
                        "them (a level's totals are all its rounds' tokens over all their wall time); with "
                        "--batch-size: this many passes over the groups of each size. Rates move with the machine's "
                        "load from one pass to the next")
    parser.add_argument("--batch-size", default=None, metavar="B1,B2,...",
                        help="offline: run each method with that many prompts at a time through the scheduler "
                        "(e.g. 1,2,4,8,16): total and per-request throughput, TTFT and ITL, and where speculation "
                        "stops paying (see specgraft.tools.bench_batch); plain decoding always runs")
    parser.add_argument(
        "--drafter", action="append", default=[],
        help=DRAFTER_HELP.replace("'none' (plain decoding), ", "") + " (repeatable; each is crossed with each "
        "--tree). With --server: the one drafter NAME the requests ask for when speculation is on (default 'auto', "
        "the server's default)",
    )
    parser.add_argument("--tree", action="append", default=[], help=TREE_HELP + " (repeatable; default chain:5). "
                        "prompt-lookup ignores trees but adaptive ones, which size its depth each step")
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
    parser.add_argument("--vllm", default=None, metavar="plain,chain:K,...",
                        help="with --batch-size: run vLLM beside specgraft, interleaved, on the same prompts: 'plain' "
                        "decoding, and 'chain:K' with each trained --drafter head exported to vLLM (K speculative "
                        "tokens). vLLM runs from its own environment (bash benchmarks/vllm_env.sh)")
    parser.add_argument("--vllm-python", default=None, metavar="PATH",
                        help="with --vllm: vLLM's Python (default $SPECGRAFT_VLLM_PYTHON, else .venv-vllm/bin/python)")
    parser.add_argument("--vllm-core", type=int, default=0, metavar="N",
                        help="with --vllm: the CPU core vLLM binds its threads to (VLLM_CPU_OMP_THREADS_BIND; "
                        "default 0); give specgraft one thread too (--threads 1) to compare a core each")
    parser.add_argument("--sweep", nargs="+", default=[], metavar="KEY=V1,V2",
                        help="e.g. depth=3,5,7 (chain) or top_k=4,8 budget=16,32,64 (dynamic); crossed with each --tree")
    parser.add_argument("--out", required=True, help="directory for results.json, results.md and plots")
    parser.add_argument("--json", action="store_true", help="print results.json to stdout")
    parser.add_argument("--threads", type=parse_threads, default="auto",
                        help="torch threads, pinned for the whole run: 'auto' (default) picks from the target's size "
                        "and this machine (`specgraft.threads`; the choice is reported), or a count")
    parser.add_argument("--warmup", type=int, default=1, help="prompts run untimed by every method first")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--device", default="cpu")
    add_capture_argument(parser)
    return parser


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``specgraft serve``."""
    parser.add_argument("--target", required=True, help="target model directory or hub id")
    parser.add_argument("--drafter", action="append", default=[], metavar="NAME=DRAFTER",
                        help="a drafter requests may pick by NAME (repeatable), DRAFTER being " + DRAFTER_HELP
                        + "; 'none' and 'prompt-lookup' always exist")
    parser.add_argument("--default-drafter", default=PROMPT_LOOKUP,
                        help="drafter of requests without 'speculative' (a --drafter NAME, 'prompt-lookup' or 'none')")
    parser.add_argument("--tree", default="adaptive", help="default tree: " + TREE_HELP + " (default: %(default)s: sized "
                        "each step by expected goodput, so speculation does not cost throughput under load)")
    parser.add_argument("--max-batch-size", type=int, default=16, help="most generations running at once")
    parser.add_argument("--max-queue", type=int, default=256, help="most generations waiting; more get 503 + Retry-After")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/ routes")
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: the target's name)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds SIGTERM waits for in-flight requests before aborting them")
    parser.add_argument("--record", default=None, metavar="DIR",
                        help="record each finished request's tokens and the target's states at them into DIR, as "
                        "training data for the loaded heads (`specgraft train` with data.recorded: DIR); a request "
                        "sent with \"store\": false is not recorded. Off by default")
    parser.add_argument("--learn", default=None, metavar="NAME",
                        help="fine-tune the --drafter NAME head on the recorded traffic (needs --record) in a process "
                        "of its own, and swap each version that beats it on held-out traffic in between steps")
    parser.add_argument("--learn-dir", default=None, metavar="DIR",
                        help="where --learn's rounds run and its versions are published (default: RECORD-learn-NAME)")
    parser.add_argument("--learn-config", default=None, metavar="YAML",
                        help="a training recipe for the head: its data is mixed in as data.original_share, its "
                        "training settings are the rounds' (default: the recording alone, the head's own config)")
    parser.add_argument("--learn-every", type=int, default=64, metavar="N",
                        help="recorded requests between two rounds of --learn (default: %(default)s)")
    add_device_arguments(parser)
    return parser


def add_learn_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``specgraft learn`` (what ``serve --learn`` runs beside the server)."""
    parser.add_argument("--target", required=True, help="the served target's directory or hub id")
    parser.add_argument("--head", required=True, help="the head the server loaded (version 0)")
    parser.add_argument("--record", required=True, metavar="DIR", help="the server's --record directory")
    parser.add_argument("--out", required=True, metavar="DIR", help="where rounds run and versions are published")
    parser.add_argument("--config", default=None, metavar="YAML",
                        help="a training recipe for the head (its data is mixed in as data.original_share)")
    parser.add_argument("--every", type=int, default=64, metavar="N", help="recorded requests between two rounds")
    parser.add_argument("--rounds", type=int, default=None, help="stop after this many rounds (default: never)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of a round (default: %(default)s)")
    return parser


def add_export_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``specgraft export``."""
    parser.add_argument("head_dir", help="a specgraft head directory (config.json + model.safetensors)")
    parser.add_argument("out_dir", help="new or empty output directory")
    parser.add_argument("--to", required=True, choices=EXPORT_FORMATS, dest="fmt",
                        help="vllm, sglang, eagle (official EAGLE repo) or medusa (Medusa repo)")
    parser.add_argument("--target", default=None,
                        help="target path or hub id whose config EAGLE and DFlash draft layers copy (default: the head's own)")
    return parser


def add_import_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``specgraft import-head``."""
    parser.add_argument("src_dir", help="checkpoint directory: official EAGLE / EAGLE-3 / Medusa / DFlash layout or an engine export")
    parser.add_argument("out_dir", help="where to write the specgraft head")
    parser.add_argument("--format", required=True, choices=IMPORT_FORMATS, dest="fmt")
    parser.add_argument("--target", required=True, help="target model directory or hub id")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--device", default="cpu")
    return parser


def parse_layer_ids(value: str) -> list[int]:
    """A ``--layers`` value: comma-separated layer ids, such as 2,15,27,30 (argparse ``type=``)."""
    try:
        return [int(part) for part in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a comma-separated list of layer ids, such as 2,15,27,30") from None


def add_import_records_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``specgraft import-records``."""
    parser.add_argument("vllm_dir", help="vLLM's shared_storage_path: the files its extract_hidden_states wrote")
    parser.add_argument("out_dir", help="the recording to write (new, or one an earlier import wrote)")
    parser.add_argument("--target", required=True, help="the target vLLM served: its directory or hub id")
    parser.add_argument("--layers", required=True, type=parse_layer_ids, metavar="IDS",
                        help="the eagle_aux_hidden_state_layer_ids vLLM was given (they must hold the last layer)")
    parser.add_argument("--requests", default=None, metavar="JSONL",
                        help='the index: one {"hidden_states_path": ..., "prompt_tokens": ...} a request '
                             "(default: VLLM_DIR/requests.jsonl)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="the target's dtype, and the recording's")
    parser.add_argument("--device", default="cpu")
    return parser


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """--dtype, --device, --threads and --capture: how the target runs."""
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=parse_threads, default="auto", help=THREADS_HELP)
    add_capture_argument(parser)


def add_capture_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--capture", action="store_true", default=None, help=CAPTURE_HELP)  # absent: SPECGRAFT_CAPTURE


def add_model_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A target, a drafter and a tree: the flags generate, check-exactness and tune-tree share."""
    parser.add_argument("--target", required=True, help="target model directory or hub id")
    parser.add_argument("--drafter", default=PROMPT_LOOKUP, help=DRAFTER_HELP + " (default: %(default)s)")
    parser.add_argument("--tree", default="chain:5", help=TREE_HELP + " (default: %(default)s)")
    add_device_arguments(parser)
    parser.add_argument("--seed", type=int, default=None)
    return parser


def add_generate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``specgraft generate``."""
    add_model_arguments(parser)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--chat", action="store_true",
                        help="send --prompt as a user turn in the target's chat template (chat models)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (token-identical to the target)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--stop", action="append", help="stop string (repeatable)")
    parser.add_argument("--json", action="store_true", help="print token ids, text and stats as JSON")
    return parser


DEFAULT_CHECK_PROMPTS = ("Once upon a time", "The weather today is", "def main():")


def add_check_exactness_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``specgraft check-exactness``."""
    add_model_arguments(parser)
    parser.add_argument("--prompt", action="append", help=f"prompt (repeatable; default: {list(DEFAULT_CHECK_PROMPTS)})")
    parser.add_argument("--samples", type=int, default=2000, help="continuations per prompt and method")
    parser.add_argument("--length", type=int, default=3, help="tokens per continuation")
    parser.add_argument("--top-k", type=int, default=4, help="keeps the top_k ** length outcomes enumerable")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--json", action="store_true")
    return parser


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A YAML config and its overrides: train, regenerate, extract-features."""
    parser.add_argument("config", help="YAML training config (see recipes/)")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. training.lr=1e-3")
    # The deepspeed launcher appends --local_rank=N (LOCAL_RANK is in the environment too).
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def add_tune_tree_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``specgraft tune-tree``."""
    add_model_arguments(parser)
    parser.add_argument("--prompts", required=True, help="calibration prompts (Spec-Bench jsonl, text, ...)")
    parser.add_argument("--limit", type=int, default=10, help="calibration prompts used")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--depth", type=int, default=6, help="deepest level considered")
    parser.add_argument("--kind", choices=["dynamic", "static"], default="dynamic",
                        help="write a DynamicTree budget (EAGLE-2) or a static tree of the best nodes (Sequoia)")
    parser.add_argument("--nodes", type=int, default=None,
                        help="write the most valuable tree of exactly this many draft nodes instead of the fastest size")
    parser.add_argument("--no-timing", action="store_true",
                        help="trust the cost model: skip timing the short list of trees on the calibration prompts")
    parser.add_argument("--out", required=True, help="tree spec JSON to write")
    return parser


def add_search_layer_skip_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``specgraft search-layer-skip``."""
    parser.add_argument("--target", required=True, help="target model directory or hub id (Llama-family: the fast path)")
    parser.add_argument("--prompts", required=True, help="calibration prompts (Spec-Bench / MT-bench jsonl, text, ...)")
    parser.add_argument("--limit", type=int, default=4, help="calibration prompts used")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="target greedy tokens scored per prompt")
    parser.add_argument("--max-skip", type=int, default=None, help="most layers skipped (default: half)")
    parser.add_argument("--min-agreement", type=float, default=0.3, help="stop once top-1 agreement falls below this")
    parser.add_argument("--depth", type=int, default=3, help="deepest chain the speed estimate considers")
    parser.add_argument("--verify-cost", type=float, default=1.0,
                        help="one verification of up to depth + 1 tokens, in target forwards (measure with tune-tree)")
    add_device_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the search path as JSON")
    return parser


def add_quickstart_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``specgraft quickstart`` (its defaults are `QuickstartConfig`'s)."""
    from specgraft.tools.quickstart import QuickstartConfig

    d = QuickstartConfig.__dataclass_fields__
    parser.add_argument("--target", default=None,
                        help="any HF causal LM (directory or hub id); default: the embedded demo target, trained "
                        "on the Python standard library's source and cached under the user cache directory")
    parser.add_argument("--out", default=str(d["out_dir"].default), help="run directory (stage markers, data, head, report)")
    parser.add_argument("--resume", action="store_true", help="reuse the stages an earlier run in --out finished")
    parser.add_argument("--samples", type=int, default=d["samples"].default, help="self-distilled training sequences")
    parser.add_argument("--train-minutes", type=float, default=d["train_minutes"].default,
                        help="the head's training budget (becomes a step count from a measured step time)")
    parser.add_argument("--max-new-tokens", type=int, default=d["max_new_tokens"].default, help="tokens per bench prompt")
    parser.add_argument("--bench-prompts", type=int, default=d["bench_prompts"].default, help="prompts benchmarked")
    parser.add_argument("--prompts", default=None,
                        help="with --target: prompts to continue and benchmark (Spec-Bench / MT-bench / HumanEval / "
                        "GSM8K jsonl, or one per line); default: openings the target samples from BOS")
    parser.add_argument("--tree", action="append", default=None,
                        help=f"tree(s) to benchmark the head with (repeatable; default: {' and '.join(d['trees'].default)})")
    parser.add_argument("--demo-minutes", type=float, default=d["demo_minutes"].default,
                        help="wall-clock cap on training the demo target (its schedule shrinks to fit; raise it on a "
                        "busy machine)")
    parser.add_argument("--retrain-target", action="store_true",
                        help="train the demo target again even if one is cached (e.g. one cut short by the cap)")
    parser.add_argument("--cache-dir", default=None, help="where the demo target is cached (default: "
                        "$XDG_CACHE_HOME/specgraft or ~/.cache/specgraft)")
    return parser
