"""Shared fixtures: the ../shared assets (skipped with a reason when absent) and tiny random models."""

from __future__ import annotations

import inspect
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Mapping

import pytest
import torch
from transformers.utils import logging as hf_logging

torch.set_num_threads(1)  # tiny models run much faster on one thread
# Few-row products as F.linear unless a test pins or measures otherwise: timings chosen per run would make the
# float32 rounding of a run depend on the machine's load (tests/test_fast_llama.py covers both forms and "auto").
os.environ.setdefault("SPECGRAFT_SMALL_ROWS", "linear")
hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
STORIES = SHARED / "models" / "stories260K"
DEV_PROMPTS = SHARED / "data" / "story_prompts_dev.jsonl"

needs_shared = pytest.mark.skipif(
    not STORIES.is_dir(), reason=f"../shared assets are absent ({STORIES} not found); they ship beside the repo"
)


@pytest.fixture(scope="session")
def stories():
    """The real pretrained stories260K target, frozen, float32 on CPU."""
    if not STORIES.is_dir():
        pytest.skip(f"../shared assets are absent ({STORIES} not found)")
    import specgraft as sg

    return sg.load_target(STORIES)


def uncaptured(target):
    """``target`` with its verification forward packed, not captured (the same model and fast path): the default
    path whose counts and forward kinds a test describes, also in a run where SPECGRAFT_CAPTURE=1 captures."""
    import copy

    if not target.capture:
        return target
    plain = copy.copy(target)
    plain.capture, plain.captured = False, None
    return plain


@pytest.fixture(scope="session")
def dev_prompts() -> list[str]:
    if not DEV_PROMPTS.is_file():
        pytest.skip(f"../shared assets are absent ({DEV_PROMPTS} not found)")
    return [json.loads(line)["turns"][0] for line in DEV_PROMPTS.read_text().splitlines() if line.strip()]


def ctrl_c_at_call(n: int, fn):
    """``fn`` (a function or a coroutine function), except that its ``n``-th call raises KeyboardInterrupt, as a
    Ctrl-C landing there would."""
    calls = []

    def count() -> None:
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt

    if inspect.iscoroutinefunction(fn):
        async def call_async(*args, **kwargs):
            count()
            return await fn(*args, **kwargs)

        return call_async

    def call(*args, **kwargs):
        count()
        return fn(*args, **kwargs)

    return call


def tiny_causal_lm(arch: str = "llama", *, vocab_size: int = 97, seed: int = 0, layers: int = 2):
    """A random tiny causal LM of a given architecture, built in-process (no download).

    Llama-family archs (llama, qwen2, qwen3, mistral) run on the fast path;
    the others (`NON_LLAMA_ARCHS`) only on Hugging Face's forward.
    """
    from transformers import (
        GemmaConfig,
        GemmaForCausalLM,
        GPT2Config,
        GPT2LMHeadModel,
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="sdpa",
    )
    no_gqa = {k: v for k, v in common.items() if k != "num_key_value_heads"}
    builders = {
        "llama": (LlamaConfig, LlamaForCausalLM, common),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, common),
        # Qwen3 sets head_dim apart from hidden_size / heads: 16 * 4 != 32 on purpose.
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, {**common, "head_dim": 16}),
        "mistral": (MistralConfig, MistralForCausalLM, {**common, "sliding_window": 4096}),
        # GPT-2: learned absolute positions, LayerNorm, fused qkv, tied embeddings; its own config names.
        "gpt2": (GPT2Config, GPT2LMHeadModel, dict(
            vocab_size=vocab_size, n_embd=32, n_inner=64, n_layer=layers, n_head=4, n_positions=256,
            bos_token_id=1, eos_token_id=2, attn_implementation="sdpa",
        )),
        # GPT-NeoX: rotary on a quarter of each head (partial_rotary_factor 0.25), parallel residual, no GQA.
        "gpt_neox": (GPTNeoXConfig, GPTNeoXForCausalLM, no_gqa),
        # Phi-3: fused qkv and gate_up projections, GQA; its default pad id (32000) lies outside a tiny vocabulary.
        "phi3": (Phi3Config, Phi3ForCausalLM, {**common, "pad_token_id": 0}),
        # Gemma: embeddings scaled by sqrt(hidden), (1 + w) RMSNorm, tied lm_head, head_dim 16 != 32 / 4.
        "gemma": (GemmaConfig, GemmaForCausalLM, {**common, "head_dim": 16, "pad_token_id": 0}),
    }
    config_cls, model_cls, kwargs = builders[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs))
    # Random init gives near-uniform logits; scale the output so greedy choices are not coin flips on ties.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    return model.eval()


# Families the fast path does not cover: they run on Hugging Face's forward only.
NON_LLAMA_ARCHS = ("gpt2", "gpt_neox", "phi3", "gemma")


def numbered_kv(batch: int, heads: int, length: int, dim: int, layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) of shape (B, heads, S, dim) whose every entry is unique across layers."""
    raw = []
    for layer in range(layers):
        keys = torch.arange(batch * heads * length * dim, dtype=torch.float32).reshape(batch, heads, length, dim)
        keys = keys + 10_000 * layer
        raw.append((keys, -keys - 1))
    return raw


def filled_cache(batch: int = 2, heads: int = 3, length: int = 9, dim: int = 4, layers: int = 2, max_len: int = 64):
    """A StaticKVCache holding `numbered_kv`, and those raw tensors."""
    from specgraft.model import StaticKVCache

    cache = StaticKVCache(layers, heads, dim, max_len=max_len)
    start = cache.extend(batch, length)
    raw = numbered_kv(batch, heads, length, dim, layers)
    for layer, (keys, values) in enumerate(raw):
        cache.update(layer, start, keys, values)
    return cache, raw



SMOLLM2_SHARED = SHARED / "models" / "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Where ../shared/models/SmolLM2-135M-Instruct/materialize.py writes the float32 directory, under the home directory:
# the README and recipes tell it the first; given no argument it writes the second. SPECGRAFT_SMOLLM2 points elsewhere.
SMOLLM2_PLACES = (
    Path(".cache/specgraft/models/SmolLM2-135M-Instruct"),
    Path(".cache/specgraft-shared/SmolLM2-135M-Instruct"),
)


def find_smollm2(environ: Mapping[str, str] = os.environ, home: Path | None = None) -> Path:
    """The materialized SmolLM2 directory: $SPECGRAFT_SMOLLM2, else the first of `SMOLLM2_PLACES` (under ``home``)
    that holds the weights, else the first (where the skip reason says to write it)."""
    if environ.get("SPECGRAFT_SMOLLM2"):
        return Path(environ["SPECGRAFT_SMOLLM2"])
    places = [(Path.home() if home is None else home) / place for place in SMOLLM2_PLACES]
    return next((place for place in places if (place / "model.safetensors").is_file()), places[0])


SMOLLM2 = find_smollm2()


def smollm2_missing(path: Path = SMOLLM2, shared: Path = SMOLLM2_SHARED) -> str | None:
    """Why the materialized SmolLM2-135M-Instruct target at ``path`` cannot load here (with the exact command that
    writes it), or None when it can."""
    if (path / "model.safetensors").is_file():
        return None
    if not shared.is_dir():
        return f"SmolLM2-135M-Instruct is not materialized at {path}, and ../shared ({shared}) is absent"
    import importlib.util

    package = "" if importlib.util.find_spec("gguf") else "pip install 'specgraft[gguf]' (the gguf package is missing), then "
    command = shlex.join([sys.executable, str(shared / "materialize.py"), str(path)])
    return (f"SmolLM2-135M-Instruct is not materialized at {path}: {package}run {command} "
            "(or set SPECGRAFT_SMOLLM2 to a copy)")


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct chat target (ChatML, vocab 49,152), float32 on CPU, fast path."""
    reason = smollm2_missing()
    if reason:
        pytest.skip(reason)
    import specgraft as sg

    return sg.load_target(SMOLLM2)


@pytest.fixture(scope="session")
def trained_dflash(stories):
    """A DFlash head for stories260K fitted for seconds to 16 greedy stories: it drafts their continuations well
    (and other text poorly), so both accepted and rejected drafts are exercised. Returns (drafter, the stories)."""
    from toy_train import fit, greedy_examples

    from specgraft.heads import as_drafter, build_head
    from specgraft.heads.configs import DFlashConfig

    torch.manual_seed(0)
    head = build_head(DFlashConfig(block_size=6, num_anchors=24, target_layer_ids=[0, 2, 3]), stories)
    examples = greedy_examples(stories, 16, 64)
    fit(head, stories, examples, steps=150, lr=1e-2)
    return as_drafter(head, stories), [e["input_ids"] for e in examples]


@pytest.fixture(scope="session")
def trained_eagle(stories, tmp_path_factory):
    """A tiny EAGLE head for stories260K, trained for seconds on the target's own greedy text (a real, if small,
    self-distilled head: it drafts well, tau ~4 on a chain of 4), saved as a head directory."""
    from toy_train import fit, greedy_examples

    from specgraft.heads import build_head, save_head
    from specgraft.heads.configs import EagleConfig

    torch.manual_seed(0)
    examples = greedy_examples(stories, 48, 64)
    head = fit(build_head(EagleConfig(), stories), stories, examples, steps=150, lr=3e-3)  # MEASURED.md's rate
    return save_head(head, tmp_path_factory.mktemp("trained-eagle"), stories)
