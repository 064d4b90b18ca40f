"""The frozen target: one adapter over any Hugging Face causal LM.

Everything that knows transformers' calling conventions lives here, so the
engine, the heads and the trees speak only in tensors: token ids, explicit
position ids, an optional 4D additive mask, and a KV cache whose rows can be
kept or dropped by index.

Llama-family targets (Llama, Mistral, Qwen2, Qwen3) run by default on
`specgraft.model.fast_llama`, a lean forward over the same weights with a
`StaticKVCache`; everything else, or ``fast=False``, runs HF's own forward
with a `KVCache`. Both caches have the same interface. HF's forward gets its
cache under the keyword its own signature names (`cache_keyword`: the name
changed in transformers 5.24), and `load_target` checks once, per model, that
a continuation through the cache equals a fresh forward over the whole
sequence, so API drift fails at load rather than as wrong text.

Shape legend: B batch, T new tokens, S cached tokens, V vocabulary, H hidden.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import transformers
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedModel

from specgraft.model.captured import CapturedForward
from specgraft.model.caches import BatchedKVCache, KVCache, StaticKVCache
from specgraft.model.fast_llama import FastLlama, Segment, unsupported_reason
from specgraft.model.small_rows import MODES as SMALL_ROW_MODES, SmallRowChoice
from specgraft.threads import ThreadChoice, apply_threads, choose_threads

CAPTURE_ENV = "SPECGRAFT_CAPTURE"  # "1": load_target captures where it is not told (whole test runs on that path)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Attention backends that honour an arbitrary 4D additive mask. flash_attention_2
# takes no such mask, so a tree would silently attend to its siblings.
MASKED_ATTENTION = ("sdpa", "eager", "flex_attention")
# Slots a static cache holds beyond the model's context: the nodes of one tree
# share positions but each needs a slot, so a tree verified at the very end of
# the context runs past it. Trees are at most a few hundred nodes.
TREE_SLOTS = 1024
# The keyword an HF forward takes its KV cache by, newest first: transformers 5.24
# renamed ``past_key_values`` to ``cache``. A forward swallows a name it does not
# know into ``**kwargs`` and silently runs without a cache, so the name is read
# from the forward's own signature, never guessed.
CACHE_KEYWORDS = ("cache", "past_key_values")


def _named_cache_keyword(module_class: type) -> str | None:
    params = inspect.signature(module_class.forward).parameters  # follows functools.wraps to the real forward
    return next((name for name in CACHE_KEYWORDS if name in params), None)


@functools.cache
def installed_cache_keyword() -> str:
    """The keyword the installed transformers' own models take the cache by (read from Llama's forward).

    Raises:
        RuntimeError: a transformers whose Llama takes neither known keyword.
    """
    name = _named_cache_keyword(LlamaForCausalLM)
    if name is None:
        raise RuntimeError(
            f"transformers {transformers.__version__}: LlamaForCausalLM.forward takes none of {CACHE_KEYWORDS}, "
            "so specgraft cannot tell how this version passes the KV cache"
        )
    return name


@functools.cache
def cache_keyword(module_class: type) -> str:
    """The keyword ``module_class.forward`` takes the KV cache by (read once per class).

    A forward that names neither keyword but takes ``**kwargs`` (an adapter or
    offloading wrapper that passes everything on) gets the installed
    transformers' own name; `load_target` then checks that the cache is used.

    Raises:
        TypeError: a forward that can take neither keyword.
    """
    name = _named_cache_keyword(module_class)
    if name is not None:
        return name
    params = inspect.signature(module_class.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return installed_cache_keyword()
    raise TypeError(
        f"{module_class.__name__}.forward takes no KV cache keyword ({' or '.join(CACHE_KEYWORDS)}) "
        "and no **kwargs, so specgraft cannot pass it a cache"
    )


@dataclass
class ModelOutput:
    """logits: (B, T, V) float32. hidden: requested layer index -> (B, T, H)."""

    logits: torch.Tensor
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)


class Target:
    """A frozen causal LM with the single forward the engine needs.

    Build it with `load_target`; the same adapter also wraps independent
    draft models.

    Args:
        model: the HF model (kept as ``self.model`` for ``generate`` and friends).
        fast: ``"auto"`` runs Llama-family models on `FastLlama` and others on HF's
            forward; True requires the fast path; False always uses HF's forward.
        capture: run the batched verification forward at static shapes, captured once per size as a CUDA graph
            (`specgraft.model.captured`); off CUDA the same static forward runs eager. Needs the fast path.

    Raises:
        ValueError: ``fast=True`` or ``capture=True`` on a model the fast path cannot run exactly.
    """

    def __init__(
        self, model: PreTrainedModel, tokenizer=None, name: str | None = None, *, fast: bool | str = "auto",
        capture: bool = False,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = model.config
        self.name = name or getattr(self.config, "_name_or_path", "") or type(model).__name__
        self.fast = _fast_path(model, fast)
        if capture and self.fast is None:
            raise ValueError(f"capture=True needs the fast path, and {self.name!r} runs Hugging Face's forward "
                             f"({unsupported_reason(model) or 'fast=False'})")
        self.capture = capture
        self.captured: CapturedForward | None = None  # the last pool's (its graphs hold that pool's addresses)
        self.threads: ThreadChoice | None = None  # what `load_target` set torch's CPU threads to, and why
        # HF's forward is called with the cache under the keyword it takes; the fast path needs none.
        self.cache_keyword = cache_keyword(type(model)) if self.fast is None else None

    @property
    def device(self) -> torch.device:
        # The engine asks every step; walking model.parameters() costs ~15 us, a held weight nothing.
        return (self.fast.embed if self.fast is not None else next(self.model.parameters())).device

    @property
    def dtype(self) -> torch.dtype:
        return (self.fast.embed if self.fast is not None else next(self.model.parameters())).dtype

    @property
    def small_rows(self) -> SmallRowChoice:
        """How the fast path multiplies a few rows by each weight shape (F.linear everywhere on HF's forward)."""
        return self.fast.small_rows if self.fast is not None else SmallRowChoice(how="F.linear everywhere (Hugging Face's forward)")

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def max_context(self) -> int:
        """Longest sequence the engine will run: the position limit, or the sliding window if smaller.

        Caches here keep every position, so beyond a sliding window the
        target's own attention would differ from ours.
        """
        limit = getattr(self.config, "max_position_embeddings", None) or 2**31
        window = getattr(self.config, "sliding_window", None)
        if window and getattr(self.config, "use_sliding_window", True):
            limit = min(limit, window)
        return limit

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.config, "eos_token_id", None)
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    def new_cache(self) -> KVCache | StaticKVCache:
        """An empty cache for `forward`: static buffers on the fast path, HF's DynamicCache otherwise."""
        if self.fast is not None:
            return self.fast.new_cache(max_len=self.max_context + TREE_SLOTS)
        return KVCache()

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"target {self.name!r} has no tokenizer: pass token ids, or load_target(..., tokenizer=...)")
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(list(ids), skip_special_tokens=True)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache | StaticKVCache,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        hidden_layers: Sequence[int] = (),
        last_only: bool = False,
    ) -> ModelOutput:
        """Run new tokens (B, T) after the cached ones and append their KV to ``cache``.

        Args:
            input_ids: (B, T) token ids.
            cache: the cache to read and extend (from `new_cache`); holds S positions before the call.
            position_ids: (B, T) explicit RoPE positions (a tree node sits at prefix + depth).
            attention_mask: (B or 1, 1, T, S + T) additive float mask, or None for plain causal.
            hidden_layers: HF ``hidden_states`` indices to return (0 = embeddings,
                num_layers = after the final norm).
            last_only: compute logits for the last position only (prefill).
        """
        if attention_mask is not None:
            expected = (input_ids.shape[1], len(cache) + input_ids.shape[1])
            if tuple(attention_mask.shape[-2:]) != expected:
                raise ValueError(f"attention mask has shape {tuple(attention_mask.shape)}, expected (.., 1, {expected[0]}, {expected[1]})")
        if self.fast is not None:
            if not isinstance(cache, StaticKVCache):
                raise TypeError(f"target {self.name!r} runs the fast path and needs its own cache: use target.new_cache()")
            logits, hidden = self.fast.forward(
                input_ids, cache, position_ids, attention_mask, tuple(hidden_layers), last_only
            )
            return ModelOutput(logits=logits.float(), hidden=hidden)
        if not isinstance(cache, KVCache):
            raise TypeError(f"target {self.name!r} runs Hugging Face's forward and needs a KVCache: use target.new_cache()")
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=True,
            output_hidden_states=bool(hidden_layers),
            logits_to_keep=1 if last_only else 0,
            **{self.cache_keyword: cache.hf},
        )
        hidden = {i: out.hidden_states[i] for i in hidden_layers}
        return ModelOutput(logits=out.logits.float(), hidden=hidden)


    def new_batched_cache(self, rows: int, max_len: int | None = None) -> BatchedKVCache | None:
        """Rows of KV slots for a batch of sequences (fast path only; None: this target runs rows one by one)."""
        if self.fast is None:
            return None
        return self.fast.new_batched_cache(rows, max_len or self.max_context + TREE_SLOTS, scratch=self.capture)

    @torch.inference_mode()
    def forward_packed(
        self,
        input_ids: torch.Tensor,
        cache: BatchedKVCache,
        segments: Sequence[Segment],
        hidden_layers: Sequence[int] = (),
        logits_at: torch.Tensor | None = None,
    ) -> ModelOutput:
        """One forward over several rows' new tokens, concatenated (fast path only; see `FastLlama.forward_packed`).

        Args:
            input_ids: (N,) every segment's tokens, segment by segment.
            cache: the batched cache whose rows the segments name; each row's length grows by its tokens.
            segments: one `Segment` per row: its row, token count and tree visibility (which give each token's
                position: the row's length before the forward plus the token's depth).
            logits_at: (M,) the only tokens whose logits are computed (prompts' last tokens in a prefill, whose
                shapes are never captured).

        Returns:
            logits (N or M, V) and hidden layer -> (N, H), packed as the inputs are.
        """
        if self.fast is None:
            raise TypeError(f"target {self.name!r} runs Hugging Face's forward: it verifies rows one by one")
        if self.capture and logits_at is None:
            if self.captured is None or self.captured.pool is not cache:
                self.captured = CapturedForward(self.fast, cache)
            logits, hidden = self.captured(input_ids, segments, tuple(hidden_layers))
        else:
            logits, hidden = self.fast.forward_packed(input_ids, cache, segments, tuple(hidden_layers), logits_at)
        return ModelOutput(logits=logits.float(), hidden=hidden)


def _fast_path(model: PreTrainedModel, fast: bool | str) -> FastLlama | None:
    """The fast forward for ``model`` as ``fast`` asks ("auto", True or False), or None for HF's."""
    if fast not in ("auto", True, False):
        raise ValueError(f"fast={fast!r} must be 'auto', True or False")
    if fast is False:
        return None
    reason = unsupported_reason(model)
    if reason is None:
        return FastLlama.from_model(model)
    if fast is True:
        raise ValueError(f"fast=True, but {reason}; use fast='auto' or False to run Hugging Face's forward")
    return None


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def _resolve_device(device: str | torch.device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device={device!r} is not a valid torch device ({err})") from None


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).exists()


def load_model(
    path_or_model: str | Path | PreTrainedModel,
    *,
    tokenizer=None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    role: str = "target",
    fast: bool | str = "auto",
    gguf_file: str | None = None,
    capture: bool = False,
) -> Target:
    """Load and freeze a causal LM, checking that tree attention and the KV cache will be exact on it.

    ``fast``: "auto" runs Llama-family models on the lean `FastLlama` forward, True
    requires it (ValueError naming the architecture otherwise), False keeps HF's.
    ``gguf_file``: a GGUF file inside the directory (or hub repo), de-quantized by
    transformers (needs the ``gguf`` package); the tokenizer comes from the
    directory's own files when it has them (they carry the chat template), else from the GGUF.
    """
    torch_dtype = _resolve_dtype(dtype)
    torch_device = _resolve_device(device)
    if attn_implementation not in MASKED_ATTENTION:
        raise ValueError(
            f"attn_implementation={attn_implementation!r} cannot take the 4D tree mask; "
            f"use one of {', '.join(MASKED_ATTENTION)}"
        )
    if isinstance(path_or_model, PreTrainedModel):
        model, name = path_or_model, None
        if model.config._attn_implementation not in MASKED_ATTENTION:
            raise ValueError(
                f"{role} model uses attn_implementation={model.config._attn_implementation!r}, which cannot take "
                f"the 4D tree mask; build it with one of {', '.join(MASKED_ATTENTION)}"
            )
        model = model.to(device=torch_device, dtype=torch_dtype)
    else:
        name = str(path_or_model)
        if _looks_like_path(name) and not Path(name).expanduser().is_dir():
            raise FileNotFoundError(f"{role} path {name!r} is not a directory")
        source = Path(name).expanduser() if _looks_like_path(name) else name
        if gguf_file is not None and importlib.util.find_spec("gguf") is None:
            raise ImportError(f"gguf_file={gguf_file!r} needs the gguf package: pip install 'specgraft[gguf]'")
        if gguf_file is not None and _looks_like_path(name) and not (source / gguf_file).is_file():
            raise FileNotFoundError(f"{role} gguf_file {gguf_file!r} is not a file in {name!r}")
        gguf = {} if gguf_file is None else {"gguf_file": gguf_file}
        try:
            model = AutoModelForCausalLM.from_pretrained(
                source, dtype=torch_dtype, attn_implementation=attn_implementation, **gguf
            ).to(torch_device)
        except OSError as err:
            raise OSError(f"could not load {role} {name!r}{f' ({gguf_file})' if gguf_file else ''}: {err}") from None
        except SafetensorError as err:
            raise OSError(f"could not load {role} {name!r}: a .safetensors file there is truncated or corrupt ({err})") from None
        if tokenizer is None:
            tokenizer = _load_tokenizer(source, gguf_file)
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"{role} {name or type(model).__name__} is an encoder-decoder; specgraft needs a causal LM")
    model.eval().requires_grad_(False)
    target = Target(model, tokenizer, name, fast=fast, capture=capture)
    _check_tree_attention(target, role)
    _check_cached_continuation(target, role)
    return target


def _load_tokenizer(source: str | Path, gguf_file: str | None):
    """The tokenizer of a model directory or hub id, or None: a model without one still takes token ids.

    The directory's own tokenizer files win over a GGUF's embedded vocabulary: they carry the chat template.
    """
    for options in ({}, {"gguf_file": gguf_file}) if gguf_file else ({},):
        try:
            return AutoTokenizer.from_pretrained(source, **options)
        except (OSError, ValueError):
            continue
    return None


def load_target(
    path_or_model: str | Path | PreTrainedModel,
    tokenizer=None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    fast: bool | str = "auto",
    threads: int | str | None = "auto",
    gguf_file: str | None = None,
    small_rows: str | None = None,
    capture: bool | None = None,
) -> Target:
    """Load a frozen target from a local path, a hub id, or a built `PreTrainedModel`.

    ``fast="auto"`` runs Llama, Mistral, Qwen2 and Qwen3 models with sdpa or eager
    attention on `specgraft.model.fast_llama` (same weights, same outputs, less
    overhead); ``fast=False`` keeps Hugging Face's forward; ``fast=True`` requires
    the fast path. ``threads="auto"`` sets torch's CPU threads from the model's
    size (`specgraft.threads`: one thread for small models, measured 7-65x
    faster than torch's default on a shared CPU); an int sets that many; None
    leaves torch's setting. ``gguf_file`` names a GGUF file in the directory to
    de-quantize and load (``pip install 'specgraft[gguf]'``) instead of
    safetensors weights. ``small_rows`` says how the fast path multiplies rows
    by its weights: "auto" (default, or what the ``SPECGRAFT_SMALL_ROWS``
    environment variable says) times ``F.linear`` against ``weight @ x.T``
    (at 1-4 rows) and oneDNN's packed weights for each weight shape on this
    machine, after the threads are set, and keeps the fastest
    (`specgraft.model.small_rows`); "linear", "transposed" or "packed" pins
    one form. The choice is ``target.small_rows``. ``capture=True`` runs the
    engine's batched verification forward at static shapes, captured once per
    size as a CUDA graph on CUDA (`specgraft.model.captured`; off CUDA it runs
    eager and is slower than the packed forward); None reads
    ``SPECGRAFT_CAPTURE`` ("1": on wherever the fast path runs; default off),
    so a whole test run can take the captured path.

    Raises:
        FileNotFoundError: a path that does not exist, or a ``gguf_file`` not in it.
        ImportError: ``gguf_file`` without the ``gguf`` package.
        ValueError: an unknown dtype or device, an attention backend without
            4D masks, a model whose forward ignores the tree mask, a forward
            that does not continue through the KV cache it is given (the error
            names the transformers version), or ``fast=True`` on an
            architecture the fast path does not cover.
        TypeError: a forward that takes no KV cache keyword.
    """
    choose_threads(0, "cpu", threads)  # a bad value fails before the model loads
    from_env = capture is None
    if from_env:
        value = os.environ.get(CAPTURE_ENV, "0")
        if value not in ("0", "1"):
            raise ValueError(f"{CAPTURE_ENV}={value!r} must be 0 or 1")
        capture = value == "1"
    if small_rows is not None and small_rows not in SMALL_ROW_MODES:
        raise ValueError(f"small_rows={small_rows!r} must be one of {', '.join(SMALL_ROW_MODES)}")
    target = load_model(
        path_or_model, tokenizer=tokenizer, dtype=dtype, device=device, attn_implementation=attn_implementation,
        fast=fast, gguf_file=gguf_file, capture=capture and not from_env,
    )
    target.capture = capture and target.fast is not None  # the environment's capture: wherever the fast path runs
    target.threads = apply_threads(target.model, threads)
    if target.fast is not None:  # timed at the thread count the model will run with
        target.fast.choose_small_rows(small_rows)
    return target


def _check_tree_attention(target: Target, role: str) -> None:
    """Refuse a model whose forward ignores a custom 4D mask.

    Two tokens with a mask that hides the first from the second must give the
    second the logits it has alone at position 1. A model that ignores the
    mask (or reorders positions) fails this and would verify trees wrongly.
    """
    device, dtype = target.device, target.dtype
    ids = torch.tensor([[1, 2]], device=device) % target.vocab_size
    visible = torch.eye(2, dtype=torch.bool, device=device)
    mask = torch.full((2, 2), torch.finfo(dtype).min, dtype=dtype, device=device).masked_fill(visible, 0.0)
    pair = target.forward(ids, target.new_cache(), torch.tensor([[0, 1]], device=device), mask[None, None])
    alone = target.forward(ids[:, 1:], target.new_cache(), torch.tensor([[1]], device=device))
    if not _same_logits(pair.logits[:, 1], alone.logits[:, 0], dtype):
        raise ValueError(
            f"{role} {target.name!r} ({type(target.model).__name__}) ignores custom 4D attention masks, "
            "so tree verification would be wrong; use a model whose attention takes a 4D mask (sdpa or eager)"
        )


def _check_cached_continuation(target: Target, role: str) -> None:
    """Refuse a model whose forward does not continue through the KV cache it is given.

    A prefix runs into a cache; two sibling tokens then run through it at the
    same position, each seeing the prefix and itself, as tree nodes do. Each
    must get the logits of a fresh forward over the prefix and that token.
    This catches a cache passed under a keyword the forward does not take
    (it runs cacheless and says nothing), and a mask dropped once a cache is
    in play, at load time rather than as wrong text.
    """
    device, dtype = target.device, target.dtype
    ids = torch.tensor([[1, 2, 3, 4, 5]], device=device) % target.vocab_size
    prefix, siblings = ids[:, :3], ids[:, 3:]  # (1, 3), (1, 2)
    where = (
        f"{role} {target.name!r} ({type(target.model).__name__}) under transformers {transformers.__version__}"
        + (f", cache passed as {target.cache_keyword}=" if target.cache_keyword else ", fast path")
    )
    cache = target.new_cache()
    target.forward(prefix, cache, torch.arange(3, device=device)[None])
    if len(cache) != prefix.shape[1]:
        raise ValueError(
            f"{where}: a forward over {prefix.shape[1]} tokens left {len(cache)} positions in the KV cache, "
            "so the model is not using the cache it is given"
        )
    visible = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 1]], dtype=torch.bool, device=device)  # (2, 3 + 2)
    mask = torch.full(visible.shape, torch.finfo(dtype).min, dtype=dtype, device=device).masked_fill(visible, 0.0)
    cached = target.forward(siblings, cache, torch.tensor([[3, 3]], device=device), mask[None, None]).logits
    faults = ("does not attend to what its KV cache holds", "ignores the 4D mask once a KV cache is in play")
    for row, what in enumerate(faults):  # row 0 sees the prefix and itself either way; row 1 only if masked
        whole = torch.cat([prefix, siblings[:, row:row + 1]], dim=1)
        fresh = target.forward(whole, target.new_cache(), torch.arange(4, device=device)[None]).logits[:, -1]
        if not _same_logits(cached[:, row], fresh, dtype):
            raise ValueError(
                f"{where}: a continuation through the KV cache differs from a fresh forward over the whole "
                f"sequence (max |difference| {float((cached[:, row] - fresh).abs().max()):.3g}, largest |logit| "
                f"{float(fresh.abs().max()):.3g}): the forward {what}, "
                "so speculative output would be wrong; this transformers version may pass the cache differently"
            )


def _same_logits(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    """Equal to rounding: apart by at most a small fraction of the largest |logit| (1e-3 float32, 3e-2 half).

    Why relative: one position's logits computed two ways (through a cache or
    fresh, inside a tree or alone) run different kernel shapes. Measured on
    SmolLM2-135M they differ by 6e-5 (float32) and 5e-3 (float16) of the
    largest |logit|, 1.4e-3 absolute in float32, beyond any fixed atol that
    a 2-layer model needs; a forward that ignores its cache moves them by
    0.24 (stories260K) to 1.2 (SmolLM2) of it.
    """
    rtol = 1e-3 if dtype == torch.float32 else 3e-2
    return float((got - want).abs().max()) <= rtol * max(1.0, float(want.abs().max()))
