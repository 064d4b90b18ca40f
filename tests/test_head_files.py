"""Head files on disk: modes a serving engine running as another user can read, and one-line errors for bad ones."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

import specgraft as sg
from conftest import tiny_causal_lm
from specgraft.heads import build_head, export_head, load_drafter, save_head
from specgraft.heads.configs import DistillConfig, EagleConfig, MedusaConfig


@pytest.fixture(scope="module")
def tiny():
    return sg.load_target(tiny_causal_lm("llama", vocab_size=97, seed=3, layers=2))


@pytest.fixture
def umask_022():
    before = os.umask(0o022)
    yield
    os.umask(before)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_saved_and_exported_heads_follow_the_umask(tiny, tmp_path, umask_022):
    head_dir = save_head(build_head(EagleConfig(), tiny), tmp_path / "head", tiny)
    assert {f.name: mode(f) for f in head_dir.iterdir()} == dict.fromkeys(
        ("config.json", "model.safetensors", "README.md"), 0o644)
    out = export_head(head_dir, "vllm", tmp_path / "vllm", target=tiny)
    assert mode(out) == 0o755
    assert {mode(f) for f in out.iterdir()} == {0o644}


def test_a_distilled_draft_model_follows_the_umask(tiny, tmp_path, umask_022):
    head_dir = save_head(build_head(DistillConfig(num_layers=1), tiny), tmp_path / "draft", tiny)
    assert {f.name: mode(f) for f in head_dir.iterdir() if f.suffix == ".safetensors"} == {"model.safetensors": 0o644}


def test_a_tighter_umask_is_kept(tiny, tmp_path):
    before = os.umask(0o077)
    try:
        head_dir = save_head(build_head(EagleConfig(), tiny), tmp_path / "head", tiny)
    finally:
        os.umask(before)
    assert mode(head_dir / "model.safetensors") == 0o600


def test_a_truncated_head_names_its_file(tiny, tmp_path):
    head_dir = save_head(build_head(EagleConfig(), tiny), tmp_path / "head", tiny)
    weights = head_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"{weights} is truncated or corrupt .*train or export the head again"):
        load_drafter(head_dir, tiny)


def test_a_bad_head_config_value_is_one_line_naming_the_key(tiny, tmp_path):
    head_dir = save_head(build_head(EagleConfig(), tiny), tmp_path / "head", tiny)
    config = json.loads((head_dir / "config.json").read_text())
    config["head"]["num_layers"] = "two"
    (head_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        load_drafter(head_dir, tiny)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{head_dir / 'config.json'}: invalid head config: head.num_layers: ")
    assert "(got 'two')" in message


def test_refused_export_reads_as_english(tiny, tmp_path):
    head_dir = save_head(build_head(MedusaConfig(), tiny), tmp_path / "medusa", tiny)
    with pytest.raises(ValueError, match="^medusa heads cannot be exported --to sglang"):
        export_head(head_dir, "sglang", tmp_path / "out", target=tiny)
