"""SmolLM2-135M-Instruct, the second real target: loading it (materialized, or straight from the shared GGUF)
and its recipes run end to end through the real CLI at toy size (two steps on a handful of conversations).

Everything here skips, naming the missing piece, without the materialized directory (see the `smollm2`
fixture), the ../shared GGUF or the ``gguf`` package.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import specgraft as sg
from specgraft.heads.checkpoint import SIDECAR
from tests.conftest import SMOLLM2, SMOLLM2_GGUF, SMOLLM2_PLACES, SMOLLM2_SHARED, find_smollm2, smollm2_missing

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes" / "smollm2-135m").glob("*.yaml"))
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def chat_ids(target) -> torch.Tensor:
    return torch.tensor([target.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False)])


# -- where the tests look for the materialized directory -----------------------------------------------------


def materialized(place: Path) -> Path:
    place.mkdir(parents=True)
    (place / "model.safetensors").write_bytes(b"")
    return place


def test_the_copy_materialize_writes_given_no_argument_is_found(tmp_path):
    default = materialized(tmp_path / ".cache/specgraft-shared/SmolLM2-135M-Instruct")  # materialize.py's own default
    assert find_smollm2({}, home=tmp_path) == default
    assert smollm2_missing(default, tmp_path / "shared") is None


def test_the_readme_place_comes_first_and_the_environment_overrides_both(tmp_path):
    readme, default = (materialized(tmp_path / place) for place in SMOLLM2_PLACES)
    assert find_smollm2({}, home=tmp_path) == readme
    assert find_smollm2({"SPECGRAFT_SMOLLM2": str(tmp_path / "mine")}, home=tmp_path) == tmp_path / "mine"


def test_the_skip_reason_is_the_exact_command_that_materializes(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    place = find_smollm2({}, home=tmp_path)
    assert place == tmp_path / SMOLLM2_PLACES[0]  # nothing yet: the README's place, where the command writes it
    command = shlex.join([sys.executable, str(shared / "materialize.py"), str(place)])
    assert command in smollm2_missing(place, shared)


def test_target_is_a_chatml_llama_on_the_fast_path(smollm2):
    assert smollm2.fast is not None, "SmolLM2 is a LlamaForCausalLM: the fast path must run it"
    assert (smollm2.vocab_size, smollm2.num_layers, smollm2.config.head_dim) == (49152, 30, 64)
    text = smollm2.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert 2 in smollm2.eos_token_ids  # <|im_end|> ends a turn


@pytest.mark.slow  # de-quantizing 272 tensors takes 15-30 s here: kept out of the default run's minute
def test_gguf_file_loads_the_same_target_as_the_materialized_directory(smollm2):
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("the gguf package is not installed (pip install 'specgraft[gguf]')")
    if not (SMOLLM2_SHARED / SMOLLM2_GGUF).is_file():
        pytest.skip(f"../shared assets are absent ({SMOLLM2_SHARED / SMOLLM2_GGUF} not found)")
    direct = sg.load_target(SMOLLM2_SHARED, gguf_file=SMOLLM2_GGUF)
    assert direct.fast is not None, "de-quantized GGUF weights are plain floats: the fast path must take them"
    assert direct.tokenizer.chat_template == smollm2.tokenizer.chat_template  # the directory's own tokenizer files
    ids = chat_ids(smollm2)
    positions = torch.arange(ids.shape[1])[None]
    a = direct.forward(ids, direct.new_cache(), positions).logits
    b = smollm2.forward(ids, smollm2.new_cache(), positions).logits
    assert torch.equal(a, b)


def test_a_gguf_file_missing_from_the_directory_is_an_error_naming_it(tmp_path):
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("the gguf package is not installed (pip install 'specgraft[gguf]')")
    with pytest.raises(FileNotFoundError, match=r"gguf_file 'model\.Q4_1\.gguf' is not a file in"):
        sg.load_target(tmp_path, gguf_file="model.Q4_1.gguf")


def test_a_gguf_file_without_the_gguf_package_says_what_to_install(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install 'specgraft\[gguf\]'"):
        sg.load_target(tmp_path, gguf_file="model.gguf")


# ---------------------------------------------------------------------------- recipes at toy size


CONVERSATIONS = [
    ("What is 2 + 3?", "2 + 3 = 5. The answer is 5."),
    ("Name a color.", "Blue is a color."),
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Say hello.", "Hello! How can I help you today?"),
]


def test_dflash_keeps_greedy_output_identical_on_a_chat_prompt(smollm2):
    """A DFlash head over SmolLM2's own taps (its mask token resolved from the tokenizer), drafting chains and trees."""
    from specgraft.heads import as_drafter, build_head
    from specgraft.heads.configs import DFlashConfig

    torch.manual_seed(0)
    head = build_head(DFlashConfig(block_size=5, target_layer_ids=[1, 14, 26]), smollm2).eval()
    assert head.config.mask_token_id is not None and head.hidden_layers == (2, 15, 27)
    ids = chat_ids(smollm2)
    ref = smollm2.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24)[0, ids.shape[1]:]
    for tree in (sg.Chain(4), sg.DynamicTree(top_k=2, depth=4, budget=8)):
        out = sg.SpeculativeGenerator(smollm2, as_drafter(head, smollm2), tree=tree).generate(ids[0].tolist(), max_new_tokens=24)
        assert out.token_ids == ref.tolist()


def test_recipes_were_found():
    assert [p.stem for p in RECIPES] == ["dflash", "draft", "eagle", "eagle3", "medusa"]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_trains_two_steps_through_the_cli(recipe, smollm2, tmp_path):
    """The recipe as written (head, features, schedule), with the data, length, batch and steps cut down."""
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(
        json.dumps({"id": str(i), "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
        for i, (q, a) in enumerate(CONVERSATIONS)
    ))
    run = tmp_path / "run"
    overrides = [
        f"target.path={SMOLLM2}", "data.regenerate=null", f"data.train={data}", "data.max_length=64",
        "data.eval_fraction=0", "eval.prompts=null", "training.max_steps=2", "training.micro_batch_size=2",
        "training.log_every=1", f"training.output_dir={run}", f"training.features_dir={tmp_path / 'features'}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "specgraft.cli", "train", str(recipe), *overrides],
        cwd=REPO, capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    curve = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert sorted(curve) == [1, 2] and all(math.isfinite(v) and v > 0 for v in curve.values())
    assert (run / "head" / "model.safetensors").is_file()
    if recipe.stem == "draft":  # a transformers model directory, the head config beside it
        head = json.loads((run / "head" / SIDECAR).read_text())
        assert head["head"]["type"] == "draft-model"
        draft = json.loads((run / "head" / "config.json").read_text())
        assert (draft["model_type"], draft["num_hidden_layers"], draft["vocab_size"]) == ("llama", 2, 49152)
        return
    head = json.loads((run / "head" / "config.json").read_text())
    assert head["head"]["type"] == recipe.stem
    if recipe.stem != "eagle3":
        return
    from safetensors.torch import load_file

    d2t = load_file(run / "head" / "model.safetensors")["d2t"]
    assert d2t.shape == (8192,)  # the recipe's reduced draft vocabulary
