"""An offline demo target: a small Llama trained on the Python standard library's own source.

`specgraft quickstart` needs a target that exists on every machine with no
network: every Python install ships its standard library as source, so the
corpus is there already. This module

1. collects the stdlib's ``.py`` files, without tests, IDLE, tkinter,
   lib2to3, ensurepip, distutils, the generated ``encodings`` charmap tables
   (16% of the bytes; they teach the model to loop on "LATIN CAPITAL LETTER
   ...") and the generated ``pydoc_data`` topic strings;
2. trains a byte-level BPE with ``tokenizers`` and wraps it as a transformers
   fast tokenizer that adds BOS, as Llama tokenizers do;
3. trains a ``LlamaForCausalLM`` on it with plain AdamW (the target is not a
   head, so it does not need the DeepSpeed trainer), scheduled by step count
   with a wall-clock cap;
4. saves model, tokenizer and ``training.json`` (its settings and results)
   under the user cache directory, keyed by a hash of the settings, so the
   next quickstart with the same settings loads it instead.

It is a pipeline smoke-test target: Python-shaped but meaningless text (mean
top probability about 0.4). Sizes from MEASURED.md: hidden 192, 4 layers,
vocab 2,048 (2.2M parameters), about 1.6 bits per byte after 900 steps.

Shape legend: B batch, T context.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import sys
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it runs: `specgraft quickstart --help` reads this module
    import torch

log = logging.getLogger(__name__)

# Directories of the stdlib left out of the corpus: test suites, GUI code, and
# packages that only vendor or convert (their code teaches nothing the rest lacks).
EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idlelib", "tkinter", "lib2to3", "ensurepip", "distutils", "site-packages", "__pycache__",
     "pydoc_data"}  # pydoc_data/topics.py: 0.75 MB of generated documentation strings
)
BOS, EOS = "<s>", "</s>"
TRAINING_FILE = "training.json"
# One file in HELDOUT_EVERY is held out of training (by a CRC of its path, so the
# split is stable across runs): its functions' first lines are the prompts.
HELDOUT_EVERY = 20
# Wall-clock cap on training, in minutes: 900 steps take about 5 minutes on 2 free cores.
DEFAULT_MAX_MINUTES = 6.5


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/specgraft``, else ``~/.cache/specgraft``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "specgraft"


# ---------------------------------------------------------------------------- corpus


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the stdlib root, POSIX
    text: str

    @property
    def heldout(self) -> bool:
        return zlib.crc32(self.path.encode()) % HELDOUT_EVERY == 0


def _is_charmap_table(text: str) -> bool:
    """The generated single-byte codecs (cp1252.py, mac_roman.py, ...): a decoding_table of character names."""
    return "charmap" in text and "decoding_table" in text


def stdlib_files(root: str | Path | None = None, max_bytes: int | None = None) -> list[SourceFile]:
    """The corpus files, sorted by path; ``max_bytes`` keeps files (in path order) until that many bytes.

    Raises:
        FileNotFoundError: no stdlib sources at ``root`` (some distributions ship only .pyc).
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files: list[SourceFile] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        dirs = rel.parts[:-1]
        if any(d in EXCLUDED_DIRS or d.startswith("config-") for d in dirs) or rel.name.startswith("test_"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if dirs[:1] == ("encodings",) and _is_charmap_table(text):
            continue
        files.append(SourceFile(rel.as_posix(), text))
        total += len(text.encode())
        if max_bytes is not None and total >= max_bytes:
            break
    if not files:
        raise FileNotFoundError(
            f"no standard-library sources under {root}: this Python ships no .py files to train the demo target on; "
            "pass --target to use a model of your own"
        )
    return files


def split_corpus(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, held out): held out by `SourceFile.heldout`, or the last file when that picks none (a small slice)."""
    heldout = [f for f in files if f.heldout]
    if not heldout and len(files) >= 2:
        heldout = files[-1:]
    return [f for f in files if f not in heldout], heldout


def function_openings(files: list[SourceFile], limit: int | None = None) -> list[str]:
    """The first two lines of every ``def`` and ``class`` in ``files``, dedented, in file order."""
    openings: list[str] = []
    for f in files:
        lines = f.text.splitlines()
        for i, line in enumerate(lines[:-1]):
            stripped = line.lstrip()
            if not stripped.startswith(("def ", "class ", "async def ")) or not stripped.rstrip().endswith(":"):
                continue
            body = lines[i + 1]
            indent = len(line) - len(stripped)
            if not body.strip() or len(body) - len(body.lstrip()) <= indent:
                continue  # a one-line signature followed by its indented body only
            openings.append(stripped.rstrip() + "\n" + body[indent:].rstrip())
            if limit is not None and len(openings) >= limit:
                return openings
    return openings


# ---------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class DemoTargetSpec:
    """Everything that decides the trained target; its hash names the cache directory.

    Defaults from MEASURED.md: 900 steps reach about 1.6 bits per byte in about
    5 minutes on 2 free cores; bigger models or a 4,096 vocabulary did worse in
    the same time; fewer than about 600 steps leaves loops and noise.
    """

    vocab_size: int = 2048
    hidden_size: int = 192
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    context: int = 256  # tokens per training window, and the model's max_position_embeddings
    batch_size: int = 8  # windows per step
    lr: float = 1e-3
    warmup_ratio: float = 0.05
    weight_decay: float = 0.1
    steps: int = 900
    corpus_bytes: int | None = None  # None: the whole corpus; tests take a slice
    seed: int = 0
    recipe: int = 1  # bump when this module changes what a spec trains, so old caches are not reused
    python: str = field(default_factory=lambda: "%d.%d" % sys.version_info[:2])  # the stdlib it reads differs by version

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class DemoTarget:
    """A trained demo target on disk: ``path`` loads with `specgraft.load_target`."""

    path: Path
    info: dict  # training.json: settings and results
    cached: bool  # True: loaded from the cache, not trained by this call


def cached_target_dir(spec: DemoTargetSpec, cache_dir: str | Path | None = None) -> Path:
    return Path(cache_dir or cache_root()) / f"demo-target-{spec.key()}"


def _complete(path: Path, spec: DemoTargetSpec) -> dict | None:
    """training.json of a finished target with exactly ``spec``'s settings, else None."""
    info_file = path / TRAINING_FILE
    if not info_file.is_file() or not (path / "model.safetensors").is_file():
        return None
    try:
        info = json.loads(info_file.read_text())
    except json.JSONDecodeError:
        return None
    return info if info.get("settings") == asdict(spec) else None


def ensure_demo_target(
    spec: DemoTargetSpec = DemoTargetSpec(),
    *,
    cache_dir: str | Path | None = None,
    max_minutes: float = DEFAULT_MAX_MINUTES,
    threads: int | str | None = "auto",
    progress: bool = True,
    retrain: bool = False,
) -> DemoTarget:
    """The cached demo target for ``spec``, trained first if no complete one exists.

    Args:
        spec: the settings; a cached target is reused only when its settings are equal.
        cache_dir: where targets live (default `cache_root`).
        max_minutes: wall-clock cap on training; on a slow (shared) machine the
            cosine schedule is shortened so it still ends annealed.
        threads: torch threads while training (restored afterwards): a count, "auto"
            (`pick_threads`, timed only when training is needed) or None (torch's setting).
        retrain: train even when a complete target is cached (one cut short by ``max_minutes``
            on a busy machine stays cached until then); the new one replaces it.
    """
    import torch

    path = cached_target_dir(spec, cache_dir)
    info = None if retrain else _complete(path, spec)
    if info is not None:
        return DemoTarget(path, info, cached=True)
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    before = torch.get_num_threads()
    if threads == "auto":
        threads = pick_threads(spec)
    if threads:
        torch.set_num_threads(threads)
    try:
        info = build_demo_target(spec, partial, max_minutes=max_minutes, progress=progress)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(before)
    shutil.rmtree(path, ignore_errors=True)  # an incomplete or stale one
    os.replace(partial, path)
    return DemoTarget(path, info, cached=False)


def pick_threads(spec: DemoTargetSpec, steps: int = 1) -> int:
    """The torch thread count that trains ``spec``'s model fastest here, timed on a few steps of random tokens.

    Which wins depends on the machine and its load: on a 2-core machine shared
    with other work, 2 threads were 5x slower than 1 for this model (each step's
    synchronisation waits for a busy core); a free machine can gain from the
    second core. A few seconds of timing settle it; a hopeless count is dropped
    after its warm-up step.
    """
    import torch

    from transformers import LlamaForCausalLM

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    candidates = sorted({1, min(2, cores), cores})
    if len(candidates) == 1:
        return 1
    before = torch.get_num_threads()

    class _Ids:  # the config reads only these two ids from the tokenizer
        bos_token_id, eos_token_id = 0, 1

    timings = {}
    try:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = LlamaForCausalLM(_model_config(spec, _Ids))
            optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr)
            window = torch.randint(0, spec.vocab_size, (spec.batch_size, spec.context + 1))
            for threads in candidates:
                torch.set_num_threads(threads)
                for i in range(steps + 1):  # step 0 warms this thread count up; a hopeless one stops there
                    start = time.perf_counter()
                    optimizer.zero_grad(set_to_none=True)
                    _loss(model, window).backward()
                    optimizer.step()
                    timings[threads] = time.perf_counter() - start
                    if timings[threads] > 3 * min(timings.values()):
                        break
    finally:
        torch.set_num_threads(before)
    log.info("demo target seconds per step by threads: %s", timings)
    return min(timings, key=timings.get)


# ---------------------------------------------------------------------------- building


def train_tokenizer(files: list[SourceFile], vocab_size: int):
    """A byte-level BPE over ``files`` as a transformers fast tokenizer that prepends BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((f.text for f in files), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    # clean_up_tokenization_spaces would turn "x ." into "x." on decode: wrong for code.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, clean_up_tokenization_spaces=False,
        model_max_length=10**9,  # documents are longer than the context; the loop cuts windows
    )


def _token_stream(files: list[SourceFile], tokenizer) -> torch.Tensor:
    """Every file as BOS + text + EOS, concatenated: (N,) token ids."""
    import torch

    encoded = tokenizer([f.text for f in files], add_special_tokens=True)["input_ids"]
    eos = tokenizer.eos_token_id
    return torch.tensor([i for ids in encoded for i in (*ids, eos)], dtype=torch.long)


def _model_config(spec: DemoTargetSpec, tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.context,
        tie_word_embeddings=True,  # the embedding is a sixth of the parameters; untied it would be a third
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )


@dataclass
class StepBudget:
    """Steps by count, fewer when the wall clock would run past ``max_seconds``.

    Every ``check_every`` steps the plan becomes what fits the remaining time
    at the average speed so far (never more than ``steps``, never fewer than
    done). The cosine schedule follows ``planned``, so a slow machine still
    ends with a decayed learning rate; a machine that speeds up again gets
    steps back.
    """

    steps: int
    max_seconds: float
    planned: int = 0
    check_every: int = 25

    def __post_init__(self) -> None:
        self.planned = self.steps

    def replan(self, done: int, elapsed: float) -> None:
        if done < self.check_every or done % self.check_every:
            return
        affordable = done + int(max(0.0, self.max_seconds - elapsed) / (elapsed / done))
        self.planned = max(done, min(self.steps, affordable))


def _lr(step: int, planned: int, warmup: int, peak: float) -> float:
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, planned - warmup))
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def _windows(stream: torch.Tensor, batch: int, context: int, generator: torch.Generator) -> torch.Tensor:
    """(B, T + 1) random windows of the stream."""
    import torch

    starts = torch.randint(0, stream.numel() - context - 1, (batch,), generator=generator)
    return torch.stack([stream[s : s + context + 1] for s in starts.tolist()])


def _mean_loss(model, stream: torch.Tensor, spec: DemoTargetSpec, batches: int) -> float:
    """Mean next-token loss over ``batches`` fixed windows of ``stream`` (seeded, so runs compare)."""
    import torch

    generator = torch.Generator().manual_seed(1234)
    model.eval()
    losses = []
    with torch.no_grad():
        for _ in range(batches):
            window = _windows(stream, spec.batch_size, spec.context, generator)
            losses.append(_loss(model, window).item())
    model.train()
    return sum(losses) / len(losses)


def _loss(model, window: torch.Tensor) -> torch.Tensor:
    import torch

    logits = model(input_ids=window[:, :-1]).logits  # (B, T, V)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())


def build_demo_target(
    spec: DemoTargetSpec, out_dir: str | Path, *, max_minutes: float = DEFAULT_MAX_MINUTES, progress: bool = True
) -> dict:
    """Train tokenizer and model for ``spec`` into ``out_dir`` (model, tokenizer, training.json); return the info."""
    import torch

    from specgraft.progress import progress_bar
    from transformers import GenerationConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    started = time.perf_counter()
    cpu_started = time.process_time()
    files = stdlib_files(max_bytes=spec.corpus_bytes)
    train_files, heldout_files = split_corpus(files)
    tokenizer = train_tokenizer(train_files, spec.vocab_size)
    stream = _token_stream(train_files, tokenizer)  # (N,)
    heldout = _token_stream(heldout_files, tokenizer) if heldout_files else stream
    train_bytes = sum(len(f.text.encode()) for f in train_files)
    bytes_per_token = train_bytes / stream.numel()
    if stream.numel() < 4 * (spec.context + 1):
        raise ValueError(f"the corpus gives {stream.numel()} tokens: too few for windows of {spec.context + 1}")
    tokenizer_s = time.perf_counter() - started

    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(_model_config(spec, tokenizer))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=spec.weight_decay)
    generator = torch.Generator().manual_seed(spec.seed)
    budget = StepBudget(spec.steps, max_minutes * 60)
    warmup = round(spec.warmup_ratio * spec.steps)
    loop_start = time.perf_counter()
    smoothed = None
    bar = progress_bar(total=spec.steps, desc="demo target", unit="step", enabled=progress)
    step = 0
    while step < budget.planned:
        lr = _lr(step, budget.planned, warmup, spec.lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = _loss(model, _windows(stream, spec.batch_size, spec.context, generator))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
        budget.replan(step, time.perf_counter() - loop_start)
        bar.update(1)
        if step % 10 == 0 or step == budget.planned:
            bar.set_postfix(bpb=f"{smoothed / math.log(2) / bytes_per_token:.2f}", lr=f"{lr:.1e}")
        if bar.total != budget.planned:
            bar.total = budget.planned  # the wall-clock cap changed the schedule
            bar.refresh()
    bar.close()
    train_s = time.perf_counter() - loop_start
    model.eval()
    heldout_loss = _mean_loss(model, heldout, spec, batches=4)

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    info = {
        "settings": asdict(spec),
        "what": "a smoke-test target: a small Llama trained on the Python standard library's source; "
        "its text is Python-shaped but meaningless",
        "parameters": sum(p.numel() for p in model.parameters()),
        "corpus": {
            "files": len(train_files), "heldout_files": len(heldout_files), "bytes": train_bytes,
            "tokens": stream.numel(), "bytes_per_token": round(bytes_per_token, 3),
            "heldout_paths": [f.path for f in heldout_files],
        },
        "steps_done": step,
        "cut_by_wall_clock": step < spec.steps,
        "max_minutes": max_minutes,
        "threads": torch.get_num_threads(),
        "train_loss": round(smoothed, 4),
        "train_bits_per_byte": round(smoothed / math.log(2) / bytes_per_token, 3),
        "heldout_bits_per_byte": round(heldout_loss / math.log(2) / bytes_per_token, 3),
        "tokenizer_seconds": round(tokenizer_s, 1),
        "train_seconds": round(train_s, 1),
        "seconds": round(time.perf_counter() - started, 1),
        "cpu_seconds": round(time.process_time() - cpu_started, 1),
    }
    (out_dir / TRAINING_FILE).write_text(json.dumps(info, indent=2) + "\n")  # written last: marks it complete
    return info
