"""specgraft's exports in vLLM itself (its CPU build, in .venv-vllm): each loads, decodes the target's own greedy
tokens, and accepts exactly the tokens specgraft accepts, position by position.

    bash benchmarks/vllm_env.sh && pytest -m vllm tests/test_vllm.py

vLLM runs in its own environment, across a process boundary (`specgraft.tools.vllm_engine`), as users deploy it.
Its CPU attention refuses head_dim 8 (stories260K), so the target is a tiny Llama with head_dim 64 built here. Its
output layer is scaled up, as `conftest.tiny_causal_lm` does, so greedy choices are not near-ties, and each head is
trained for a few seconds on the target's own greedy text, so that it accepts at every position.

Equality is exact, not within a tolerance: both engines run float32 on this CPU, and an accepted count moves only
where a draft's or the target's top two logits lie within the engines' rounding difference (about 1e-6 relative)
of each other. A difference is a bug on one side, to be found, not a tolerance to widen.

vLLM drafts a full chain at every step and counts what the target accepts there even past ``max_tokens``, where
specgraft drafts no deeper than the budget leaves room for; `accepted_per_position` counts specgraft's steps as
vLLM counts its own (see its docstring).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import specgraft as sg
from specgraft.heads import build_head, export_head, save_head
from specgraft.heads.configs import DFlashConfig, DistillConfig, Eagle3Config, EagleConfig, MedusaConfig
from specgraft.tools.vllm_engine import DEFAULT_PYTHON, VLLM_PYTHON_ENV, VLLMEngine, accepted_per_position, speculative_config
from toy_train import fit, greedy_examples

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[1]
VOCAB = 512
DEPTH = 3  # vLLM's num_speculative_tokens; specgraft's Chain(3)
NEW_TOKENS = 48
# Trained on 64 greedy sequences of the target; steps chosen so that every head accepts at depth 3 too.
HEADS = {
    "eagle3": (Eagle3Config(draft_vocab_size=256, ttt_length=3), 60),  # a reduced draft vocabulary (d2t / t2d)
    "eagle": (EagleConfig(), 150),
    "dflash": (DFlashConfig(num_layers=1, block_size=DEPTH + 1, mask_token_id=3), 120),
    "medusa": (MedusaConfig(num_heads=DEPTH), 150),
    "draft-model": (DistillConfig(num_layers=1), 150),
}


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    python = Path(os.environ.get(VLLM_PYTHON_ENV) or REPO / DEFAULT_PYTHON)
    if not python.is_file():
        pytest.skip(f"vLLM's environment is absent ({python}); build it with `bash benchmarks/vllm_env.sh`")
    return python


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A tiny Llama vLLM's CPU attention runs (head_dim 64, GQA 2/1, 8 layers: EAGLE-3's taps 2, 4, 5 distinct)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # sharp greedy choices (see the module docstring)
    path = tmp_path_factory.mktemp("vllm") / "tiny-llama-hd64"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target(target_dir):
    return sg.load_target(target_dir)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """BOS and 1-5 random tokens: none of them starts a training sequence."""
    generator = torch.Generator().manual_seed(123)
    lengths = torch.randint(1, 6, (8,), generator=generator)
    return [[1, *torch.randint(3, VOCAB, (int(n),), generator=generator).tolist()] for n in lengths]


@pytest.fixture(scope="module")
def plain(vllm_python, target_dir, prompts):
    """vLLM's greedy tokens without speculation."""
    with VLLMEngine(target_dir, python=vllm_python, core=0, enforce_eager=True, skip_tokenizer_init=True,
                    max_model_len=512, kv_cache_gib=1) as engine:
        return engine.generate(prompts, NEW_TOKENS).token_ids


@pytest.fixture(scope="module")
def examples(target):
    return greedy_examples(target, count=64, length=64)


def trained_head(head_type: str, target, examples, root: Path) -> tuple[Path, Path]:
    """(specgraft head directory, the directory vLLM loads) for ``head_type``, trained on the target's greedy text."""
    config, steps = HEADS[head_type]
    torch.manual_seed(0)
    head = build_head(config, target)
    if head_type == "eagle3":
        counts = torch.bincount(torch.tensor([t for e in examples for t in e["input_ids"]]), minlength=VOCAB)
        head.set_draft_vocab(counts, target)
    fit(head, target, examples, steps=steps, lr=3e-3)
    head_dir = save_head(head, root / head_type, target)
    if head_type == "draft-model":  # an ordinary transformers directory: vLLM loads it as it is
        return head_dir, head_dir
    return head_dir, export_head(head_dir, "vllm", root / f"{head_type}-vllm", target)


def test_plain_decoding_equals_specgraft(plain, target, prompts):
    ours = sg.SpeculativeGenerator(target, None).generate_batch(prompts, max_new_tokens=NEW_TOKENS, eos_token_id=())
    assert [o.token_ids for o in ours] == plain


@pytest.mark.parametrize("head_type", list(HEADS))
def test_export_decodes_and_accepts_as_specgraft(head_type, vllm_python, target_dir, target, examples, prompts, plain,
                                                 tmp_path):
    head_dir, served_dir = trained_head(head_type, target, examples, tmp_path)
    generator = sg.SpeculativeGenerator(target, sg.load_drafter(head_dir, target), tree=sg.Chain(DEPTH))
    ours = accepted_per_position(generator, prompts, NEW_TOKENS, DEPTH)
    assert ours["token_ids"] == plain
    assert all(ours["accepted_per_pos"]), f"the {head_type} head should accept at every depth: {ours}"

    with VLLMEngine(target_dir, python=vllm_python, core=0, enforce_eager=True, skip_tokenizer_init=True,
                    max_model_len=512, kv_cache_gib=1,
                    speculative_config=speculative_config(head_type, served_dir, DEPTH)) as engine:
        theirs = engine.generate(prompts, NEW_TOKENS)
    assert theirs.token_ids == plain
    assert theirs.spec["drafts"] == ours["drafts"]
    assert theirs.spec["draft_tokens"] == DEPTH * ours["drafts"]
    assert theirs.spec["accepted_per_pos"] == ours["accepted_per_pos"]


# -- SmolLM2-135M-Instruct, where materialized (conftest.SMOLLM2) ---------------------------------------------------

SMOLLM2_NEW_TOKENS = 48


@pytest.fixture(scope="module")
def smollm2_eagle3(smollm2, tmp_path_factory) -> tuple[Path, Path]:
    """An EAGLE-3 head over SmolLM2 with a 2K draft vocabulary, trained for a minute on the target's own greedy
    answers to 16 GSM8K *train* questions (12 full-batch steps: it accepts at depth 1): (head directory, its vLLM
    export)."""
    from conftest import SHARED
    from specgraft.tools.prompts import encode_prompt, read_prompt_file

    questions = read_prompt_file(SHARED / "data" / "gsm8k_train.jsonl", limit=16)
    prompts = [encode_prompt(smollm2, q.text) for q in questions]
    answers = sg.SpeculativeGenerator(smollm2, None).generate_batch(prompts, max_new_tokens=48)
    examples = [{"input_ids": p + a.token_ids, "loss_mask": [0] * len(p) + [1] * len(a.token_ids)}
                for p, a in zip(prompts, answers)]
    counts = torch.bincount(torch.tensor([t for e in examples for t in e["input_ids"]]), minlength=smollm2.vocab_size)
    torch.manual_seed(0)
    head = build_head(Eagle3Config(draft_vocab_size=2048, ttt_length=3), smollm2)
    head.set_draft_vocab(counts, smollm2)
    fit(head, smollm2, examples, steps=12, lr=1e-2)
    root = tmp_path_factory.mktemp("smollm2-eagle3")
    head_dir = save_head(head, root / "head", smollm2)
    return head_dir, export_head(head_dir, "vllm", root / "vllm", smollm2)


def test_smollm2_eagle3_export_decodes_and_accepts_as_specgraft(vllm_python, smollm2, smollm2_eagle3):
    from conftest import SHARED, SMOLLM2
    from specgraft.tools.prompts import encode_prompt, read_prompt_file

    head_dir, served_dir = smollm2_eagle3
    prompts = [encode_prompt(smollm2, q.text) for q in read_prompt_file(SHARED / "data" / "gsm8k_test.jsonl", limit=8)]
    plain = [o.token_ids for o in sg.SpeculativeGenerator(smollm2, None).generate_batch(
        prompts, max_new_tokens=SMOLLM2_NEW_TOKENS, eos_token_id=())]
    generator = sg.SpeculativeGenerator(smollm2, sg.load_drafter(head_dir, smollm2), tree=sg.Chain(DEPTH))
    ours = accepted_per_position(generator, prompts, SMOLLM2_NEW_TOKENS, DEPTH)
    assert ours["token_ids"] == plain
    assert ours["accepted_per_pos"][0] > 0, f"the head should accept: {ours}"

    with VLLMEngine(SMOLLM2, python=vllm_python, core=0, enforce_eager=True, max_model_len=1024, kv_cache_gib=1,
                    speculative_config=speculative_config("eagle3", served_dir, DEPTH)) as engine:
        theirs = engine.generate(prompts, SMOLLM2_NEW_TOKENS)
    assert theirs.token_ids == plain
    assert theirs.spec["drafts"] == ours["drafts"]
    assert theirs.spec["accepted_per_pos"] == ours["accepted_per_pos"]
