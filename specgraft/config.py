"""The training config: typed YAML, validated before any model loads.

A config has the sections ``target``, ``head``, ``data``, ``training``,
``tracking`` and ``eval``, plus the scalar ``tree`` (the tree used when
evaluating mean accepted length). Every section forbids unknown keys, so a
typo is an error naming the file, the line and the dotted key, not a
silently ignored setting.

Paths: a relative path, whether written in the YAML file or given as an
override, resolves against the current working directory, like any other
command-line path (and like torchtune's configs). Recipes therefore say
which directory they run from. After loading, every local path in the
config is absolute, so nothing later depends on the working directory.

Overrides are ``section.key=value`` strings (``training.lr=1e-3``,
``data.regenerate.seed=3``, ``tree=chain:3``); the value is parsed as a YAML
scalar or flow collection (``training.betas=[0.9,0.95]``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from specgraft.heads.configs import HeadConfig
from specgraft.specs import looks_like_path, parse_tree, tree_file

# A data source with one of these endings is a local file, not a hub dataset name.
LOCAL_DATA_SUFFIXES = (".json", ".jsonl", ".txt", ".gz", ".parquet", ".csv", ".arrow")


class ConfigError(ValueError):
    """A config that cannot run; the message names the file, the key and the value."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TargetSection(_Section):
    """The frozen target LLM."""

    path: str  # local directory or hub id
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    device: str = "cpu"  # ignored when CUDA is available: each rank uses cuda:LOCAL_RANK
    attn_implementation: Literal["sdpa", "eager", "flex_attention"] = "sdpa"  # flash_attention_2 takes no tree mask


class RegenerateSection(_Section):
    """Self-distillation: answer the prompts with the target itself and train on its own outputs."""

    output: str  # JSONL written by regeneration; training reads it (re-used if it already exists)
    num_from_bos: int = Field(0, ge=0)  # extra sequences sampled from BOS alone (no prompt)
    # Prompts file (any data format, e.g. GSM8K's {"question"} lines); None: the user turns of data.train.
    # Prompts of known evaluation sets (MT-bench, Spec-Bench, GSM8K test) or of eval.prompts are refused.
    prompts: str | None = None
    max_prompts: int | None = Field(None, ge=1)  # answer only the first N prompts that pass the filters; None: all
    # Extra conversations whose user turn the target writes itself after its chat template's user prefix
    # (Magpie), then answers: chat data with no dataset. Needs a chat template and temperature > 0.
    self_instruct: int = Field(0, ge=0)
    self_instruct_max_tokens: int = Field(128, ge=1)  # a self-written user turn not ended within this is dropped
    min_user_tokens: int = Field(1, ge=1)  # records with a shorter user turn are dropped (and counted)
    max_user_tokens: int | None = Field(None, ge=1)  # records with a longer user turn are dropped; None: no limit
    dedupe: bool = True  # drop records whose user turns repeat an earlier record's (whitespace and case ignored)
    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(1.0, ge=0.0)  # 1.0 samples the target's own distribution; 0 is greedy
    batch_size: int = Field(16, ge=1)  # rows generating at once in process
    # In process: most tokens (prompt + reply) one row holds, its KV allocated up front for every row; None: the
    # target's context, at most 4096. A conversation whose next round does not fit ends at its last reply.
    max_len: int | None = Field(None, ge=2)
    seed: int = 0
    # An OpenAI-compatible server of the target (vLLM, SGLang, `specgraft serve`): its base URL, e.g.
    # http://10.0.0.5:8000/v1. The target's weights are then not loaded here, only its tokenizer and config.
    endpoint: str | None = None
    concurrency: int = Field(16, ge=1)  # requests in flight to the endpoint
    model: str | None = None  # the endpoint's model name; None: the one model it serves
    api_key_env: str = "OPENAI_API_KEY"  # the environment variable holding the endpoint's API key, if it needs one
    request_timeout_s: float = Field(600.0, gt=0)
    max_retries: int = Field(8, ge=0)  # connection errors, timeouts, 429 and 5xx, with exponential backoff


class DataSection(_Section):
    """Training conversations: a local file or a hub dataset name."""

    train: str | None = None  # required unless data.regenerate says where prompts come from, or data.recorded
    format: Literal["auto", "sharegpt", "openai", "text", "question"] = "auto"
    max_length: int = Field(2048, ge=2)  # tokens per sequence after the chat template; longer ones are cut
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0)  # held out for per-depth accuracy, never trained on
    # Train on this seeded share of the training split (held-out split unchanged; smaller shares nested in larger
    # ones): to measure how much data buys how much tau before regenerating more (recipes/README.md).
    train_fraction: float = Field(1.0, gt=0.0, le=1.0)
    on_error: Literal["raise", "skip"] = "raise"  # a malformed record stops loading, or is skipped and counted
    regenerate: RegenerateSection | None = None
    # Recordings of served traffic (`specgraft serve --record DIR`): their generations train with the states the
    # server recorded (no target forward); the held-out split (eval_fraction) is then drawn from them alone
    recorded: list[str] = Field(default_factory=list)
    # With data.recorded: the share of the mix drawn from data.train / data.regenerate (seeded), so the head keeps
    # what it drafted well; the rest is the recorded traffic. 0: the recordings alone
    original_share: float = Field(0.25, ge=0.0, lt=1.0)


class TrainingSection(_Section):
    """The optimisation loop. Steps count optimizer steps (one per accumulation window)."""

    output_dir: str = "runs/specgraft"
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)  # cap on optimizer steps; the schedule spans the capped length
    micro_batch_size: int = Field(8, ge=1)  # sequences per rank per forward
    gradient_accumulation_steps: int = Field(1, ge=1)  # global batch = micro * accumulation * world size
    lr: float = Field(1e-3, gt=0.0)  # stories260K heads converged faster at 3e-3 than 1e-3; 7B EAGLE uses 3e-5..1e-4
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_ratio: float = Field(0.03, ge=0.0, lt=1.0)  # linear warmup over this fraction of all steps
    schedule: Literal["cosine", "linear", "constant"] = "cosine"  # decay to 0 after warmup (constant: no decay)
    grad_clip: float = Field(1.0, ge=0.0)  # max global gradient norm; 0 disables clipping
    precision: Literal["fp32", "bf16"] = "fp32"  # of the head; the target keeps target.dtype
    zero_stage: Literal[0, 1, 2] = 0  # 1 shards optimizer states, 2 also gradients; heads are small, 0 is usually right
    deepspeed_config: str | None = None  # a DeepSpeed JSON whose values override the generated ones
    seed: int = 0  # of the head's init, the data order and the training noise
    save_every: int = Field(500, ge=0)  # optimizer steps between resumable checkpoints; 0: only the final export
    eval_every: int = Field(0, ge=0)  # optimizer steps between evaluations; 0: evaluate only at the end
    log_every: int = Field(10, ge=1)
    # auto: the latest complete checkpoint in output_dir, if any; never: start over (deletes
    # output_dir/checkpoints); or a checkpoint directory (output_dir/checkpoints/step_N).
    resume: str = "auto"
    # Fine-tune: a head directory (what a run writes to OUTPUT_DIR/head or OUTPUT_DIR/best) whose weights this run
    # starts from, refused unless it has this config's head type and shape and was trained for this target. A
    # checkpoint that training.resume finds in output_dir still wins. Lowers the defaults of lr and warmup_ratio
    # (`_continuing_defaults`) and needs data.eval_fraction > 0: the held-out simulated tau of the initial head,
    # evaluated before the first step, decides whether output_dir/best keeps it or a fine-tuned one.
    init_from: str | None = None
    num_threads: int | None = Field(None, ge=1)  # torch CPU threads; None: picked from the target's size (specgraft.threads)
    # online: the target runs on every batch. offline: it runs once per example ahead of training
    # (`specgraft extract-features CONFIG`, or at start-up when the cache is absent or incomplete) and
    # training reads the hidden states from disk: tokens x layers read (+ the final one) x hidden x dtype
    # bytes, e.g. 4 x 4096 x 2 = 32 KiB per token for EAGLE-3 on an 8B bf16 target. Faster per step over
    # many epochs; the estimate is printed before extraction starts.
    features: Literal["online", "offline"] = "online"
    features_dir: str | None = None  # the offline feature cache; None: output_dir/features
    # More HF hidden_states indices the offline cache stores besides the head's own (and the final one), so
    # heads that read different layers of one dataset share one cache whichever is extracted first.
    feature_layers: list[int] = Field(default_factory=list)
    # Storage dtype of the offline cache; None: target.dtype. bfloat16 halves an fp32 target's cache, at bf16 precision.
    feature_dtype: Literal["float32", "float16", "bfloat16"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _continuing_defaults(cls, data: Any) -> Any:
        """With ``init_from`` set, an ``lr`` or ``warmup_ratio`` the section leaves out takes a fine-tune's default.

        A tenth of a fresh head's lr: the head is already near a minimum, and Adam's first steps move every
        weight by about lr whatever its gradient (its moments start again at zero), so a fresh head's rate
        would first undo part of what the head knows. No warmup: warmup keeps those steps of a random init from
        large, badly aimed moves; at a tenth of the rate they are small already, and a short fine-tune would
        spend a good share of its steps warming up. If the first steps still hurt, the initial head's
        evaluation before step 1 keeps it in output_dir/best. A value the config or an override gives wins.
        """
        if isinstance(data, dict) and data.get("init_from") is not None:
            fresh_lr = cls.model_fields["lr"].default
            data = {"lr": fresh_lr / 10, "warmup_ratio": 0.0, **data}
        return data


class TrackingSection(_Section):
    """Experiment tracking. The default needs no account: nothing is sent anywhere."""

    wandb: Literal["disabled", "offline", "online"] = "disabled"  # offline writes runs to dir for `wandb sync`
    project: str = "specgraft"
    run_name: str | None = None
    dir: str | None = None  # None: training.output_dir


class EvalSection(_Section):
    """Speculative decoding with the head being trained, measuring mean accepted length (tau)."""

    prompts: str | None = None  # JSONL of prompts (Spec-Bench / MT-Bench style); None: no tau evaluation
    num_prompts: int = Field(40, ge=1)
    max_new_tokens: int = Field(128, ge=1)


class TrainConfig(_Section):
    """One training run, as read from YAML."""

    target: TargetSection
    head: HeadConfig
    data: DataSection
    training: TrainingSection = Field(default_factory=TrainingSection)
    tree: str = "chain:5"  # chain:DEPTH, static:FILE.json, dynamic:TOP_K,DEPTH,BUDGET: for the tau evaluation
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    _source: str | None = PrivateAttr(None)  # the YAML file it was read from, for error messages

    @model_validator(mode="after")
    def _compatible(self) -> "TrainConfig":
        # Combinations that cannot run; each message names both keys.
        if self.data.train is None and self.data.regenerate is None and not self.data.recorded:
            raise ValueError("data.train is required (a file or hub dataset), unless data.regenerate or "
                             "data.recorded is set")
        regen = self.data.regenerate
        if (
            regen is not None and self.data.train is None and regen.prompts is None
            and regen.num_from_bos == 0 and regen.self_instruct == 0
        ):
            raise ValueError(
                "data.regenerate has nothing to answer: set data.regenerate.prompts, data.train, "
                "data.regenerate.num_from_bos > 0 or data.regenerate.self_instruct > 0"
            )
        if regen is not None and regen.self_instruct and regen.temperature == 0:
            raise ValueError(
                f"data.regenerate.self_instruct={regen.self_instruct} needs data.regenerate.temperature > 0: "
                "greedy decoding writes the same user turn every time"
            )
        if regen is not None and regen.max_user_tokens is not None and regen.max_user_tokens < regen.min_user_tokens:
            raise ValueError(
                f"data.regenerate.max_user_tokens={regen.max_user_tokens} is below "
                f"data.regenerate.min_user_tokens={regen.min_user_tokens}"
            )
        if self.training.init_from is not None and self.data.eval_fraction == 0:
            raise ValueError(
                f"training.init_from={self.training.init_from!r} needs data.eval_fraction > 0: the held-out "
                "simulated tau decides whether output_dir/best keeps the initial head or a fine-tuned one"
            )
        if self.training.eval_every > 0 and self.eval.prompts is None and self.data.eval_fraction == 0:
            raise ValueError(
                f"training.eval_every={self.training.eval_every} needs something to evaluate on: "
                "set eval.prompts or data.eval_fraction > 0 (or training.eval_every=0)"
            )
        try:
            parse_tree(self.tree)  # the one grammar of tree specs; `check_files` looks for a tree file
        except ValueError as err:
            raise ValueError(f"tree={self.tree!r}: {err}") from None
        return self


# ---------------------------------------------------------------------------- loading


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML config, apply ``section.key=value`` overrides, validate keys and types, make local paths absolute.

    The files the config names need not exist yet (a recipe's target may be materialized later, its data
    regenerated): `check_files` looks for them, and `specgraft train` / ``regenerate`` run it first.

    Raises:
        FileNotFoundError: the config file is missing.
        ConfigError: invalid YAML, a malformed override, an unknown key, a wrong type, or
            incompatible options; the message names the file, the dotted key and the value.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (target, head, data, ...), got {type(raw).__name__}")
    overridden: dict[tuple[str, ...], str] = {}
    for item in overrides:
        keys, value = _parse_override(item)
        _set_dotted(raw, keys, value, item)
        overridden[keys] = item
    try:
        cfg = TrainConfig.model_validate(raw)
    except ValidationError as err:
        head = raw.get("head")
        head_type = head.get("type") if isinstance(head, dict) else None
        raise ConfigError(_describe(err, path, text, overridden, head_type)) from None
    _absolute_paths(cfg)
    cfg._source = str(path)
    return cfg


def _parse_override(item: str) -> tuple[tuple[str, ...], Any]:
    """``a.b=value`` -> (("a", "b"), parsed value)."""
    key, sep, value = item.partition("=")
    keys = tuple(key.strip().split("."))
    if not sep or not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) for k in keys):
        raise ConfigError(f"override {item!r} is malformed: expected section.key=value, e.g. training.lr=1e-3")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({err})") from None
    return keys, parsed


def _set_dotted(raw: dict, keys: tuple[str, ...], value: Any, item: str) -> None:
    node = raw
    for depth, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            where = ".".join(keys[: depth + 1])
            raise ConfigError(f"override {item!r}: {where} is {child!r}, not a section with keys")
        node = child
    node[keys[-1]] = value


def _describe(
    err: ValidationError, path: Path, text: str, overridden: dict[tuple[str, ...], str], head_type: str | None
) -> str:
    """One line per problem: file:line, dotted key, what is wrong, the value, and the override that set it."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        root = None
    lines = []
    for e in err.errors():
        loc = [str(part) for part in e["loc"]]
        if len(loc) >= 2 and loc[0] == "head" and loc[1] == head_type:
            del loc[1]  # a discriminated union puts the tag in the location (head.medusa.num_heads)
        key = ".".join(loc) or "(top level)"
        if e["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            problem = "unknown key"
        elif e["type"] == "missing":
            problem = "required key is missing"
        elif not loc:  # a cross-field check: its message names the keys, the input is the whole config
            problem = e["msg"].removeprefix("Value error, ")
        else:
            problem = f"{e['msg']} (got {e['input']!r})"
        source = next((f" (set by override {item!r})" for keys, item in overridden.items() if ".".join(keys) == key), "")
        line = _line_of(root, loc)
        where = f"{path}:{line}" if line and not source else str(path)
        lines.append(f"{where}: {key}: {problem}{source}")
    return "invalid config:\n  " + "\n  ".join(lines)


def _line_of(root: yaml.Node | None, loc: list[str]) -> int | None:
    """1-based line of the deepest key of ``loc`` present in the YAML node tree."""
    line, node = None, root
    for key in loc:
        if not isinstance(node, yaml.MappingNode):
            break
        match = next(((k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == key), None)
        if match is None:
            break
        line, node = match[0].start_mark.line + 1, match[1]
    return line


def _absolute(value: str) -> str:
    """``value`` made absolute against the working directory, its symlinks kept: a head records the target path
    the user wrote, not where a link happened to point (``..`` is taken lexically, as a shell's ``cd`` does)."""
    return os.path.abspath(os.path.expanduser(value))


def _is_local_data(source: str) -> bool:
    """A file path rather than a hub dataset name (``org/name``)."""
    return (
        source.startswith((".", "/", "~"))
        or source.lower().endswith(LOCAL_DATA_SUFFIXES)
        or source.count("/") > 1
        or Path(source).exists()
    )


def _absolute_paths(cfg: TrainConfig) -> None:
    """Resolve every local path against the working directory, so nothing later depends on it."""
    target = cfg.target.path
    if looks_like_path(target):
        cfg.target.path = _absolute(target)
    if cfg.data.train is not None and _is_local_data(cfg.data.train):
        cfg.data.train = _absolute(cfg.data.train)
    cfg.data.recorded = [_absolute(path) for path in cfg.data.recorded]
    regen = cfg.data.regenerate
    if regen is not None:
        if regen.prompts is not None:
            regen.prompts = _absolute(regen.prompts)
        regen.output = _absolute(regen.output)
    if cfg.eval.prompts is not None:
        cfg.eval.prompts = _absolute(cfg.eval.prompts)
    spec = parse_tree(cfg.tree)
    if tree_file(spec) is not None:
        cfg.tree = str(dataclasses.replace(spec, path=_absolute(spec.path)))
    training = cfg.training
    training.output_dir = _absolute(training.output_dir)
    for key in ("deepspeed_config", "features_dir"):
        if getattr(training, key) is not None:
            setattr(training, key, _absolute(getattr(training, key)))
    if training.resume not in ("auto", "never"):
        training.resume = _absolute(training.resume)
    if training.init_from is not None:
        training.init_from = _absolute(training.init_from)
    if cfg.tracking.dir is not None:
        cfg.tracking.dir = _absolute(cfg.tracking.dir)


def check_files(cfg: TrainConfig) -> None:
    """Require the local files and directories a run reads at start-up to exist, naming the key and the file.

    `load_config` validates without them; the commands that run a config (train, regenerate,
    extract-features) call this first, so a typo fails before any model loads.

    Raises:
        FileNotFoundError: the target directory, data, prompts, tree file, DeepSpeed JSON, resume checkpoint or
            the head to fine-tune from.
        ConfigError: the DeepSpeed JSON is not a JSON object.
    """
    where = cfg._source or "config"

    def must_exist(key: str, value: str, kind: str = "file") -> None:
        path = Path(value)
        if not (path.is_dir() if kind == "directory" else path.exists()):
            raise FileNotFoundError(
                f"{where}: {key}={value!r}: {kind} {path} does not exist "
                "(relative paths resolve against the working directory)"
            )

    if looks_like_path(cfg.target.path):
        must_exist("target.path", cfg.target.path, "directory")
    regen = cfg.data.regenerate
    if cfg.data.train is not None and _is_local_data(cfg.data.train):
        must_exist("data.train", cfg.data.train)
    for k, recorded in enumerate(cfg.data.recorded):
        must_exist(f"data.recorded[{k}]", recorded, "directory")
    if regen is not None and regen.prompts is not None:
        must_exist("data.regenerate.prompts", regen.prompts)
    if cfg.eval.prompts is not None:
        must_exist("eval.prompts", cfg.eval.prompts)
    tree = tree_file(parse_tree(cfg.tree))
    if tree is not None:
        must_exist("tree", tree)
    training = cfg.training
    if training.deepspeed_config is not None:
        must_exist("training.deepspeed_config", training.deepspeed_config)
        _read_json(training.deepspeed_config, "training.deepspeed_config")
    if training.resume not in ("auto", "never"):
        must_exist("training.resume", training.resume, "directory")
    if training.init_from is not None:
        must_exist("training.init_from", training.init_from, "directory")


def _read_json(path: str, key: str) -> dict:
    try:
        value = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{key}: {path}:{err.lineno} is not valid JSON: {err.msg}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: {path} must hold a JSON object, got {type(value).__name__}")
    return value


# ---------------------------------------------------------------------------- DeepSpeed


def to_deepspeed_config(cfg: TrainConfig, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config for ``cfg``, with ``training.deepspeed_config``'s values merged over it.

    The learning-rate schedule (warmup, then cosine / linear / no decay) is
    the trainer's own LambdaLR handed to ``deepspeed.initialize``, so it is
    not in this dict; a ``scheduler`` section in the user's JSON replaces it.
    ``train_batch_size`` is micro x accumulation x ``world_size`` after the
    merge (unless the JSON sets it too), so overriding only the micro batch
    stays consistent.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: expected >= 1")
    t = cfg.training
    generated: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        "bf16": {"enabled": t.precision == "bf16"},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": t.lr,
                "betas": list(t.betas),
                "eps": 1e-8,
                "weight_decay": t.weight_decay,
                "torch_adam": True,  # torch's AdamW: no fused-op build, runs on CPU and GPU alike
            },
        },
        "steps_per_print": 2**31 - 1,  # the trainer logs; DeepSpeed's own step prints would interleave with tqdm
        "wall_clock_breakdown": False,
    }
    user = _read_json(t.deepspeed_config, "training.deepspeed_config") if t.deepspeed_config else {}
    _merge(generated, user)
    if "train_batch_size" not in user:
        generated["train_batch_size"] = (
            generated["train_micro_batch_size_per_gpu"] * generated["gradient_accumulation_steps"] * world_size
        )
    return generated


def _merge(base: dict, update: dict) -> None:
    """Recursive dict update: nested sections merge key by key, other values replace."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def dump_config(cfg: TrainConfig) -> str:
    """The validated config as YAML (for the model card and the run directory)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
