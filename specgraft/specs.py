"""The one grammar of drafter and tree specs: text -> typed spec, with no torch and no model.

Every place a user writes a drafter or a tree (``--drafter`` and ``--tree`` on
any command, ``serve``'s flags and request fields, ``bench``, a config's
``tree`` key) calls `parse_drafter` / `parse_tree`, so a new spelling is a
change here only. Parsing reads the text alone; `check_drafter` and
`check_tree_files` look at the disk, and building the drafter or policy is
`specgraft.heads.drafter_from_spec` / `specgraft.tree.policy_from_spec`.

Drafters::

    none                    plain decoding
    prompt-lookup           copy from the prompt and the output so far (no training)
    self                    the target drafts for itself
    layer-skip:12-19,22     the target drafts with those decoder layers left out
    DIR                     a trained head, a distilled draft or any small causal LM sharing the tokenizer
    prompt-lookup+X         lookup first, X (self, layer-skip:L or DIR) where lookup finds nothing
    prompt-lookup:K+X       the same, the lookup copying up to K tokens whatever the tree's depth

Trees::

    chain:DEPTH             one path
    static:FILE.json        Medusa-style paths of sibling ranks
    dynamic:TOP_K,DEPTH,BUDGET   EAGLE-2's tree, grown by cumulative draft log-prob
    adaptive[:DEPTH,NODES]  the engine sizes each step's tree across the batch by expected goodput
    FILE.json               a tree file written by `specgraft tune-tree`

A target or head is a directory or a hub id (`looks_like_path` tells them
apart); `check_model` and `check_directory` refuse a path that is not there.

This module imports nothing of specgraft's, so any room may import it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Union

PROMPT_LOOKUP = "prompt-lookup"
LAYER_SKIP_PREFIX = "layer-skip:"
DRAFTER_HELP = (
    "'none' (plain decoding), 'prompt-lookup', 'self' (the target drafts for itself), 'layer-skip:LAYERS' (the "
    "target drafts with those decoder layers left out, e.g. layer-skip:12-19; `specgraft search-layer-skip` picks "
    "them), a trained head directory "
    "(e.g. runs/eagle-stories260k/head from `specgraft train`), or a small causal LM's directory sharing the "
    "target's tokenizer; 'prompt-lookup+' before 'self', 'layer-skip:LAYERS' or a directory drafts by lookup first and with that "
    "drafter where lookup finds nothing ('prompt-lookup:K+...': the lookup copies up to K tokens, else as deep as the tree)"
)
# Every spelling of a tree `parse_tree` accepts: (form, an example, what it is, whether it reads a file). TREE_HELP and
# every error that lists the accepted forms (`tree_forms`) are written from this one table, so none can leave one out.
TREE_FORMS = (
    ("chain:DEPTH", "chain:5", "one path", False),
    ("static:FILE.json", "static:tree.json", "Medusa-style paths of sibling ranks", True),
    ("dynamic:TOP_K,DEPTH,BUDGET", "dynamic:8,6,48", "EAGLE-2", False),
    ("adaptive", "adaptive", "sized each step by expected goodput", False),
    ("adaptive:MAX_DEPTH,MAX_NODES", "adaptive:6,16", "at most that deep and that many nodes", False),
    ("FILE.json", "tree.json", "a tree file written by `specgraft tune-tree`", True),
)


def tree_forms(*, files: bool = True) -> str:
    """The accepted tree spellings as one phrase (``files=False``: those that read no file, as a request's)."""
    forms = [f"'{form}' ({meaning})" for form, _, meaning, reads in TREE_FORMS if files or not reads]
    return ", ".join(forms[:-1]) + " or " + forms[-1]


TREE_HELP = tree_forms()
# A tree as a JSON object (a tree file's, a request's): its "kind" and the keys it takes.
TREE_OBJECTS = {"chain": ("depth",), "static": ("choices",), "dynamic": ("top_k", "depth", "budget"),
                "adaptive": ("max_depth", "max_nodes")}


def tree_objects() -> str:
    """The tree objects `TREE_OBJECTS` allows, as one phrase: ``{"kind": "chain", "depth"}, ...``."""
    return ", ".join("{" + ", ".join([f'"kind": "{kind}"', *(f'"{key}"' for key in keys)]) + "}"
                     for kind, keys in TREE_OBJECTS.items())
# What `specgraft bench --baselines` runs beside the drafters (hf-assisted:PATH: HF assisted generation with PATH).
BASELINE_KINDS = ("plain", "hf", "hf-pld", "hf-assisted:PATH")
# The checkpoint layouts `specgraft export --to` writes and `specgraft import-head --format` reads.
EXPORT_FORMATS = ("vllm", "sglang", "eagle", "medusa")
IMPORT_FORMATS = ("eagle", "eagle3", "medusa", "dflash")
# prompt-lookup[:K]+DRAFTER
_COMPOSITE = re.compile(re.escape(PROMPT_LOOKUP) + r"(?::(?P<depth>[^+]*))?\+(?P<then>.*)", re.DOTALL)


# ---------------------------------------------------------------------------- drafters


@dataclass(frozen=True)
class NoDrafter:
    """``none``: plain decoding."""

    def __str__(self) -> str:
        return "none"


@dataclass(frozen=True)
class PromptLookupSpec:
    """``prompt-lookup``."""

    def __str__(self) -> str:
        return PROMPT_LOOKUP


@dataclass(frozen=True)
class SelfSpec:
    """``self``: the target drafts for itself."""

    def __str__(self) -> str:
        return "self"


@dataclass(frozen=True)
class LayerSkipSpec:
    """``layer-skip:LAYERS``: the target without those decoder layers (checked against it once it loads)."""

    skip: tuple[int, ...]

    def __str__(self) -> str:
        return LAYER_SKIP_PREFIX + format_layer_set(self.skip)


@dataclass(frozen=True)
class DirectorySpec:
    """A drafter directory: a trained head, a distilled draft, or a causal LM sharing the target's tokenizer."""

    path: str

    def __str__(self) -> str:
        return self.path


@dataclass(frozen=True)
class CompositeSpec:
    """``prompt-lookup[:K]+THEN``: lookup first, ``then`` where lookup finds nothing.

    ``first_depth``: the most tokens the lookup copies (None: as deep as the tree).
    """

    then: Union[SelfSpec, LayerSkipSpec, DirectorySpec]
    first_depth: int | None = None

    def __str__(self) -> str:
        depth = "" if self.first_depth is None else f":{self.first_depth}"
        return f"{PROMPT_LOOKUP}{depth}+{self.then}"


DrafterSpec = Union[NoDrafter, PromptLookupSpec, SelfSpec, LayerSkipSpec, DirectorySpec, CompositeSpec]
_NAMED: dict[str, DrafterSpec] = {"none": NoDrafter(), PROMPT_LOOKUP: PromptLookupSpec(), "self": SelfSpec()}


def parse_drafter(text: str | DrafterSpec) -> DrafterSpec:
    """A drafter spec from its text (see the module docstring); a spec is returned as it is.

    Raises:
        ValueError: a malformed ``layer-skip:`` set or ``prompt-lookup:K+`` count, or a composite whose
            second drafter is not 'self', 'layer-skip:LAYERS' or a directory.
    """
    if not isinstance(text, str):
        return text
    if text in _NAMED:
        return _NAMED[text]
    if text.startswith(LAYER_SKIP_PREFIX):
        try:
            return LayerSkipSpec(tuple(parse_layer_set(text[len(LAYER_SKIP_PREFIX):])))
        except ValueError as err:
            raise ValueError(f"drafter {text!r}: {err}") from None
    match = _COMPOSITE.fullmatch(text)
    if match is not None:
        depth = match["depth"]
        if depth is not None and not (depth.isdigit() and int(depth) >= 1):
            raise ValueError(f"drafter {text!r}: after 'prompt-lookup:' comes a number of tokens >= 1, got {depth!r}")
        then = parse_drafter(match["then"])
        if not isinstance(then, (SelfSpec, LayerSkipSpec, DirectorySpec)):
            raise ValueError(
                f"drafter {text!r}: after {PROMPT_LOOKUP + '+'!r} comes 'self', 'layer-skip:LAYERS' or a drafter directory"
            )
        return CompositeSpec(then, None if depth is None else int(depth))
    if not text:
        raise ValueError(f"drafter '' is empty; expected {DRAFTER_HELP}")
    return DirectorySpec(text)


def directories(spec: DrafterSpec) -> list[str]:
    """The drafter directories a spec names (what `check_drafter` requires to exist)."""
    if isinstance(spec, DirectorySpec):
        return [spec.path]
    if isinstance(spec, CompositeSpec):
        return directories(spec.then)
    return []


def check_drafter(text: str | DrafterSpec) -> DrafterSpec:
    """`parse_drafter`, then require every directory it names to exist: a typo fails before any model loads.

    Raises:
        ValueError: see `parse_drafter`.
        FileNotFoundError: a named directory is missing, or is a file.
    """
    spec = parse_drafter(text)
    for path in directories(spec):
        where = Path(path).expanduser()
        if not where.exists():
            raise FileNotFoundError(f"--drafter {path!r} does not exist; expected {DRAFTER_HELP}")
        if not where.is_dir():
            raise FileNotFoundError(f"--drafter {path!r} is a file, not a directory; expected {DRAFTER_HELP}")
    return spec


def parse_layer_set(text: str) -> list[int]:
    """'12-19,22' -> [12, ..., 19, 22]; '' -> [] (no layer). Ranges are inclusive.

    Raises:
        ValueError: a part that is neither an integer nor ``A-B`` with A <= B.
    """
    layers: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, dash, last = part.partition("-")
        try:
            lo, hi = int(first), int(last) if dash else int(first)
        except ValueError:
            raise ValueError(f"layer set {text!r}: {part!r} is not a layer index or an inclusive range A-B") from None
        if lo > hi:
            raise ValueError(f"layer set {text!r}: range {part!r} runs backwards")
        layers.extend(range(lo, hi + 1))
    return layers


def format_layer_set(layers: Iterable[int]) -> str:
    """[12, 13, 14, 19] -> '12-14,19' (the inverse of `parse_layer_set` on sorted, distinct layers)."""
    runs: list[list[int]] = []
    for layer in sorted(layers):
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# ---------------------------------------------------------------------------- trees


@dataclass(frozen=True)
class ChainSpec:
    """``chain:DEPTH``."""

    depth: int

    def __post_init__(self) -> None:
        _at_least_one(self, "depth")

    def __str__(self) -> str:
        return f"chain:{self.depth}"


@dataclass(frozen=True)
class DynamicSpec:
    """``dynamic:TOP_K,DEPTH,BUDGET`` (EAGLE-2)."""

    top_k: int
    depth: int
    budget: int

    def __post_init__(self) -> None:
        _at_least_one(self, "top_k", "depth", "budget")

    def __str__(self) -> str:
        return f"dynamic:{self.top_k},{self.depth},{self.budget}"


@dataclass(frozen=True)
class AdaptiveSpec:
    """``adaptive`` or ``adaptive:MAX_DEPTH,MAX_NODES``: the engine picks each step's nodes by expected goodput."""

    max_depth: int = 6
    max_nodes: int = 16

    def __post_init__(self) -> None:
        _at_least_one(self, "max_depth", "max_nodes")

    def __str__(self) -> str:
        return "adaptive" if self == AdaptiveSpec() else f"adaptive:{self.max_depth},{self.max_nodes}"


@dataclass(frozen=True)
class StaticFileSpec:
    """``static:FILE.json``: Medusa-style paths of sibling ranks, read when the policy is built."""

    path: str

    def __str__(self) -> str:
        return f"static:{self.path}"


@dataclass(frozen=True)
class TreeFileSpec:
    """``FILE.json``: a tree file as `specgraft tune-tree` writes it, read when the policy is built."""

    path: str

    def __str__(self) -> str:
        return self.path


TreeSpec = Union[ChainSpec, DynamicSpec, AdaptiveSpec, StaticFileSpec, TreeFileSpec]


class UnknownTreeSpec(ValueError):
    """A text that is none of `TREE_FORMS` (a known form with a bad value is a plain ValueError naming it)."""


def parse_tree(text: str | TreeSpec) -> TreeSpec:
    """A tree spec from its text (see the module docstring); a spec is returned as it is. Reads no file.

    Raises:
        UnknownTreeSpec: none of the accepted spellings (the message lists them).
        ValueError: a count below 1.
    """
    if not isinstance(text, str):
        return text
    kind, _, arg = text.partition(":")
    if kind == "chain" and arg.isdigit():
        return ChainSpec(int(arg))
    if kind == "static" and arg:
        return StaticFileSpec(arg)
    if kind == "dynamic":
        parts = arg.split(",")
        if len(parts) == 3 and all(p.strip().isdigit() for p in parts):
            return DynamicSpec(*(int(p) for p in parts))
    if kind == "adaptive":
        parts = arg.split(",")
        if not arg:
            return AdaptiveSpec()
        if len(parts) == 2 and all(p.strip().isdigit() for p in parts):
            return AdaptiveSpec(*(int(p) for p in parts))
    if kind not in _TREE_KINDS and text.endswith(".json"):
        return TreeFileSpec(text)
    raise UnknownTreeSpec(f"unknown tree spec {text!r}: expected {TREE_HELP}")


_TREE_KINDS = {form.partition(":")[0] for form, *_ in TREE_FORMS if ":" in form}  # chain, static, dynamic, adaptive


def _at_least_one(spec: ChainSpec | DynamicSpec, *names: str) -> None:
    for name in names:
        if getattr(spec, name) < 1:
            raise ValueError(f"tree {spec}: {name} must be >= 1, got {getattr(spec, name)}")


def tree_file(spec: TreeSpec) -> str | None:
    """The file a tree spec reads, if any."""
    return spec.path if isinstance(spec, (StaticFileSpec, TreeFileSpec)) else None


# ---------------------------------------------------------------------------- models


def looks_like_path(name: str) -> bool:
    """A model named by a local path, not a hub id (``org/name``): it starts with '.', '/' or '~', has two or more
    slashes, or exists here."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).exists()


def check_model(name: str, flag: str) -> str:
    """``name`` when it is a hub id or an existing directory: a mistyped path fails before any model loads.

    Raises:
        FileNotFoundError: a path that does not exist or is a file, naming ``flag`` and the path.
    """
    if looks_like_path(name):
        check_directory(name, flag)
    return name


def check_directory(path: str, flag: str) -> str:
    """``path`` when it is an existing directory (``~`` expanded).

    Raises:
        FileNotFoundError: ``path`` does not exist or is a file, naming ``flag`` and the path.
    """
    where = Path(path).expanduser()
    if not where.exists():
        raise FileNotFoundError(f"{flag} {path!r} does not exist")
    if not where.is_dir():
        raise FileNotFoundError(f"{flag} {path!r} is a file, not a directory")
    return path
