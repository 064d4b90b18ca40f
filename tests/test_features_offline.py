"""The offline feature cache on stories260K: shards, size estimate, resume, stale caches, and training on it.

Sequences of mixed lengths throughout, so padding and the per-example rows
of a shard are exercised. Online and offline features agree to float noise,
not bitwise: the target's own output for a sequence changes in the last ulp
with the width it is padded to (extraction batches are not training batches).
"""

from __future__ import annotations

import copy
import json
import math
import struct
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file
from toy_train import greedy_examples

from specgraft.config import load_config
from specgraft.heads import build_head
from specgraft.heads.configs import Eagle3Config, EagleConfig
from specgraft.model import Target
from specgraft.train.data import collate
from specgraft.train.feature_cache import FeatureCache, estimate_bytes, extract_features, features_dir
from specgraft.train.features import target_batch
from specgraft.train.pipeline import run_feature_extraction, run_training

LAYERS = (2,)  # read by the head; the cache also stores the final layer 5 (stories260K has 5 layers)


@pytest.fixture(scope="module")
def examples(stories) -> list[dict]:
    """12 greedy continuations, cut to lengths between 14 and 24 tokens."""
    full = greedy_examples(stories, count=12, length=24)
    return [{k: v[: 14 + (i * 5) % 11] for k, v in e.items()} for i, e in enumerate(full)]


def config(tmp_path: Path, stories, **training):
    """A training config (never loaded as a whole run here): feature_dtype, micro_batch_size, output_dir."""
    data = tmp_path / "unused.json"
    data.write_text("[]")
    raw = {
        "target": {"path": stories.name},
        "head": {"type": "eagle"},
        "data": {"train": str(data)},
        "training": {"output_dir": str(tmp_path / "run"), "micro_batch_size": 3, **training},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(path)


def shard_paths(cache: Path) -> list[Path]:
    return sorted(cache.glob("shard-*.safetensors"))


def header_bytes(path: Path) -> int:
    """8-byte length prefix + the JSON header of a safetensors file."""
    with path.open("rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


class ForwardCounter:
    """Counts the target model's forward calls while installed."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        self.handle = model.register_forward_hook(self.hook)

    def hook(self, *_) -> None:
        self.calls += 1


# ---------------------------------------------------------------------------- extraction


def test_extraction_writes_shards_and_a_manifest(stories, examples, tmp_path):
    cache = tmp_path / "features"
    summary = extract_features(config(tmp_path, stories), stories, examples, LAYERS, cache, shard_size=5, progress=False)

    assert [p.name for p in shard_paths(cache)] == ["shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"]
    assert summary.written == tuple(p.name for p in shard_paths(cache)) and summary.skipped == ()
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["layers"] == [2, 5] and manifest["dtype"] == "float32"
    assert manifest["num_examples"] == 12 and manifest["num_tokens"] == sum(len(e["input_ids"]) for e in examples)
    assert [(s["start"], s["stop"]) for s in manifest["shards"]] == [(0, 5), (5, 10), (10, 12)]
    assert manifest["target"]["num_hidden_layers"] == 5 and manifest["target"]["dtype"] == "float32"
    assert not list(cache.glob(".*"))  # no temporary file left behind
    for path, shard in zip(shard_paths(cache), manifest["shards"]):
        with safe_open(str(path), framework="pt") as f:
            lengths = json.loads(f.metadata()["lengths"])
            assert lengths == [len(e["input_ids"]) for e in examples[shard["start"] : shard["stop"]]]
            assert sorted(f.keys()) == ["layer.2", "layer.5"]  # hidden states only: no (T, V) logits
            for key in f.keys():
                assert f.get_slice(key).get_shape() == [sum(lengths), stories.config.hidden_size]


def test_the_cache_lives_in_output_dir_unless_features_dir_says_otherwise(stories, tmp_path):
    assert features_dir(config(tmp_path, stories)) == tmp_path / "run" / "features"
    assert features_dir(config(tmp_path, stories, features_dir=str(tmp_path / "shared"))) == tmp_path / "shared"


def test_size_estimate_is_printed_and_matches_the_bytes_written(stories, examples, tmp_path, capsys):
    cache = tmp_path / "features"
    summary = extract_features(config(tmp_path, stories), stories, examples, LAYERS, cache, shard_size=5, progress=False)
    tokens = sum(len(e["input_ids"]) for e in examples)
    expected = tokens * 2 * 64 * 4  # tokens x layers (2 and the final 5) x hidden x float32 bytes
    assert summary.estimate_bytes == estimate_bytes(tokens, 2, 64, torch.float32) == expected
    assert f"{tokens} tokens x 2 layers [2, 5] x 64 hidden x 4 bytes (float32)" in capsys.readouterr().out
    # Every byte beyond the estimate is safetensors header.
    tensor_bytes = sum(p.stat().st_size - header_bytes(p) for p in shard_paths(cache))
    assert tensor_bytes == expected


def test_bfloat16_storage_halves_the_cache_and_loads_in_the_target_dtype(stories, examples, tmp_path):
    cfg = config(tmp_path, stories, feature_dtype="bfloat16")
    cache = tmp_path / "features"
    summary = extract_features(cfg, stories, examples, LAYERS, cache, progress=False)
    tokens = sum(len(e["input_ids"]) for e in examples)
    assert summary.estimate_bytes == tokens * 2 * 64 * 2
    assert sum(p.stat().st_size - header_bytes(p) for p in shard_paths(cache)) == summary.estimate_bytes

    batch = collate(examples[:4], pad_token_id=0)
    offline = FeatureCache(cache, stories, LAYERS).batch([0, 1, 2, 3], batch)
    online = target_batch(stories, batch, LAYERS)
    real = batch["attention_mask"].bool()
    assert offline.hidden[2].dtype == torch.float32  # what the head sees online too
    torch.testing.assert_close(offline.hidden[2][real], online.hidden[2][real].bfloat16().float(), rtol=0, atol=1e-5)


def test_resume_recomputes_only_the_missing_shard(stories, examples, tmp_path):
    cfg = config(tmp_path, stories)
    cache = tmp_path / "features"
    extract_features(cfg, stories, examples, LAYERS, cache, shard_size=5, progress=False)
    first = {p.name: (p.stat().st_mtime_ns, load_file(str(p))) for p in shard_paths(cache)}

    (cache / "shard-00001.safetensors").unlink()  # an interrupted extraction: one shard never renamed into place
    (cache / ".shard-00001.safetensors.abc123.tmp").write_bytes(b"half a shard")
    with pytest.raises(FileNotFoundError, match=r"incomplete: 1 of 3 shards are missing \(shard-00001.safetensors\)"):
        FeatureCache(cache, stories, LAYERS)

    counter = ForwardCounter(stories.model)
    try:
        summary = extract_features(cfg, stories, examples, LAYERS, cache, shard_size=5, progress=False)
    finally:
        counter.handle.remove()
    assert summary.written == ("shard-00001.safetensors",)
    assert summary.skipped == ("shard-00000.safetensors", "shard-00002.safetensors")
    assert counter.calls == math.ceil(5 / cfg.training.micro_batch_size)  # only shard 1's 5 examples ran
    for path in shard_paths(cache):
        if path.name != "shard-00001.safetensors":
            assert path.stat().st_mtime_ns == first[path.name][0], f"{path.name} was rewritten"
    recomputed = load_file(str(cache / "shard-00001.safetensors"))
    for name, value in first["shard-00001.safetensors"][1].items():
        assert torch.equal(recomputed[name], value), name  # the same batches give the same bits
    assert not list(cache.glob(".*.tmp"))  # the leftover temporary file is gone
    assert len(FeatureCache(cache, stories, LAYERS, examples=examples)) == 12


def test_rebuilt_logits_are_bitwise_the_targets_own(stories, examples, tmp_path):
    """Padded alike (the extraction batch is the training batch), the cache reproduces the forward exactly."""
    same = [examples[1], examples[4], examples[6]]  # 19, 23 and 22 tokens: one batch, padded to 23 both times
    cache = tmp_path / "features"
    extract_features(config(tmp_path, stories), stories, same, LAYERS, cache, batch_size=3, progress=False)
    batch = collate(same, pad_token_id=0)
    offline = FeatureCache(cache, stories, LAYERS).batch([0, 1, 2], batch)
    online = target_batch(stories, batch, LAYERS)
    real = batch["attention_mask"].bool()
    assert torch.equal(offline.target_logits[real], online.target_logits[real])
    assert torch.equal(offline.hidden[2][real], online.hidden[2][real])
    assert torch.equal(offline.hidden[2][~real], torch.zeros_like(online.hidden[2][~real]))  # padding: zeros, masked


def test_a_head_that_trains_on_tokens_alone_gets_no_logits_and_the_same_loss(stories, examples, tmp_path):
    """DFlash with token labels: neither the online forward nor the cache builds (B, T, V) logits, and its loss
    is what it was with them."""
    from specgraft.heads.base import uses_target_logits
    from specgraft.heads.configs import DFlashConfig

    torch.manual_seed(0)
    head = build_head(DFlashConfig(block_size=4, num_layers=1, num_anchors=4), stories)
    assert not uses_target_logits(head) and uses_target_logits(build_head(EagleConfig(), stories))
    cache = tmp_path / "features"
    extract_features(config(tmp_path, stories), stories, examples, head.hidden_layers, cache, progress=False)
    indices = [0, 3, 5]
    batch = collate([examples[i] for i in indices], pad_token_id=0)
    with_logits = target_batch(stories, batch, head.hidden_layers)
    losses = []
    for features in (
        with_logits,
        target_batch(stories, batch, head.hidden_layers, logits=False),
        FeatureCache(cache, stories, head.hidden_layers, examples=examples, logits=False).batch(indices, batch),
    ):
        if features is not with_logits:
            assert features.target_logits is None
        torch.manual_seed(1)  # the anchors
        losses.append(head.loss(features)[0].item())
    assert losses[1] == losses[0] and losses[2] == pytest.approx(losses[0], abs=1e-5)


def test_scaled_logits_are_refused(stories, examples, tmp_path):
    model = copy.deepcopy(stories.model)

    def scale(module, args, output):  # a final logit scale, as Cohere's logit_scale
        output.logits = output.logits * 0.5
        return output

    model.register_forward_hook(scale)
    with pytest.raises(ValueError, match="logits of 'scaled' are not its output layer applied to its last hidden state"):
        extract_features(config(tmp_path, stories), Target(model, stories.tokenizer, "scaled"), examples, LAYERS, tmp_path / "f", progress=False)


# ---------------------------------------------------------------------------- stale caches


def test_a_cache_for_other_data_is_refused(stories, examples, tmp_path):
    cfg = config(tmp_path, stories)
    cache = tmp_path / "features"
    extract_features(cfg, stories, examples, LAYERS, cache, progress=False)
    other = [dict(e) for e in examples]
    other[3] = {**other[3], "input_ids": [1] + other[3]["input_ids"][1:][::-1]}  # same lengths, other tokens
    with pytest.raises(ValueError, match=r"made for another run: data: the cache holds 12 examples with token fingerprint \w+, this run has 12 with \w+"):
        extract_features(cfg, stories, other, LAYERS, cache, progress=False)
    with pytest.raises(ValueError, match=r"data: the cache holds 12 examples .* this run has 11 with"):
        FeatureCache(cache, stories, LAYERS, examples=examples[:11])
    with pytest.raises(ValueError, match=r"example 0 has \d+ tokens in the feature cache .* but 5 in this batch"):
        FeatureCache(cache, stories, LAYERS).batch([0], collate([{"input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 1, 1, 1, 1]}], 0))


def test_a_cache_for_another_target_is_refused(stories, examples, tmp_path):
    cfg = config(tmp_path, stories)
    cache = tmp_path / "features"
    extract_features(cfg, stories, examples, LAYERS, cache, progress=False)
    model = copy.deepcopy(stories.model)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(1.5)  # same sizes, other weights
    other = Target(model, stories.tokenizer, "stories260K-rescaled")
    with pytest.raises(ValueError, match=r"target embedding_fingerprint: the cache has '\w+' .*, this run's target has '\w+' \(from 'stories260K-rescaled'\)"):
        extract_features(cfg, other, examples, LAYERS, cache, progress=False)
    with pytest.raises(ValueError, match="target embedding_fingerprint"):
        FeatureCache(cache, other, LAYERS)


def test_a_cache_without_the_layers_or_in_another_dtype_is_refused(stories, examples, tmp_path):
    cache = tmp_path / "features"
    extract_features(config(tmp_path, stories), stories, examples, LAYERS, cache, progress=False)
    with pytest.raises(ValueError, match=r"layers: the cache stores hidden states \[2, 5\], the head also needs \[3\]"):
        extract_features(config(tmp_path, stories), stories, examples, (2, 3), cache, progress=False)
    with pytest.raises(ValueError, match=r"layers: .* needs \[1\]"):
        FeatureCache(cache, stories, (1,))
    with pytest.raises(ValueError, match="dtype: the cache stores float32, training.feature_dtype asks for bfloat16"):
        extract_features(config(tmp_path, stories, feature_dtype="bfloat16"), stories, examples, LAYERS, cache, progress=False)
    # A head reading fewer of the stored layers reuses the cache as it is.
    summary = extract_features(config(tmp_path, stories), stories, examples, (), cache, progress=False)
    assert summary.written == () and len(summary.skipped) == 1


def test_feature_layers_are_stored_for_heads_that_share_the_cache(stories, examples, tmp_path):
    """Whichever head extracts first, the layers named in training.feature_layers are stored for the others."""
    cache = tmp_path / "features"
    shared = config(tmp_path, stories, feature_layers=[1, 3])
    extract_features(shared, stories, examples, (), cache, progress=False)  # a head reading only the final layer
    assert json.loads((cache / "manifest.json").read_text())["layers"] == [1, 3, 5]
    summary = extract_features(shared, stories, examples, (1, 3), cache, progress=False)  # the other head reuses it
    assert summary.written == () and len(summary.skipped) == 1
    batch = collate(examples[:2], pad_token_id=0)
    online = target_batch(stories, batch, (1, 3))
    offline = FeatureCache(cache, stories, (1, 3)).batch([0, 1], batch)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(offline.hidden[3][real], online.hidden[3][real], rtol=0, atol=1e-5)


def test_feature_layers_out_of_range_are_an_error_naming_the_key(stories, examples, tmp_path):
    with pytest.raises(ValueError, match=r"training.feature_layers \[9\] are out of range .* 0\.\.5"):
        extract_features(config(tmp_path, stories, feature_layers=[9]), stories, examples, (), tmp_path / "f", progress=False)
    assert not (tmp_path / "f").exists()


# ---------------------------------------------------------------------------- training on it


@pytest.mark.parametrize("head_config", [EagleConfig(), Eagle3Config(aux_layers=[1, 2, 4], ttt_length=3)], ids=["eagle", "eagle3"])
def test_one_training_step_on_offline_features_equals_online(stories, examples, tmp_path, head_config):
    torch.manual_seed(0)
    head = build_head(head_config, stories).train()  # train mode: EAGLE's input noise, drawn from the same seed
    cache = tmp_path / "features"
    extract_features(config(tmp_path, stories), stories, examples, head.hidden_layers, cache, shard_size=5, progress=False)
    reader = FeatureCache(cache, stories, head.hidden_layers, examples=examples)

    indices = [9, 2, 6, 11]  # across all three shards, of different lengths
    batch = collate([examples[i] for i in indices], pad_token_id=0)
    results = {}
    for mode, features in (("online", target_batch(stories, batch, head.hidden_layers)), ("offline", reader.batch(indices, batch))):
        assert sorted(features.hidden) == sorted(set(head.hidden_layers))
        head.zero_grad()
        torch.manual_seed(1)
        loss, _ = head.loss(features)
        loss.backward()
        results[mode] = (loss.item(), {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None})
    (online_loss, online_grads), (offline_loss, offline_grads) = results["online"], results["offline"]
    assert offline_loss == pytest.approx(online_loss, rel=0, abs=1e-6)
    assert online_grads.keys() == offline_grads.keys() and online_grads
    for name, grad in online_grads.items():
        torch.testing.assert_close(offline_grads[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_offline_training_runs_end_to_end_on_the_extracted_cache(stories, examples, tmp_path):
    """`run_feature_extraction` writes the cache, then two training steps read it (no extraction again) and
    log the online run's losses."""
    text = tmp_path / "stories.jsonl"
    text.write_text("".join(json.dumps({"text": stories.decode(e["input_ids"])}) + "\n" for e in examples))
    raw = {
        "target": {"path": stories.name},
        "head": {"type": "eagle"},
        "data": {"train": str(text), "max_length": 24},
        "training": {"max_steps": 2, "micro_batch_size": 4, "log_every": 1, "save_every": 0, "num_threads": 1},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(raw))
    curves = {}
    for mode in ("offline", "online"):
        cfg = load_config(tmp_path / "recipe.yaml", [f"training.features={mode}", f"training.output_dir={tmp_path / mode}"])
        if mode == "offline":
            cache = run_feature_extraction(cfg)
            assert cache == tmp_path / "offline" / "features"
            shards = {p.name: p.stat().st_mtime_ns for p in shard_paths(cache)}
            assert shards and json.loads((cache / "manifest.json").read_text())["num_examples"] == len(examples)
        run_training(cfg)
        records = [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
        curves[mode] = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert {p.name: p.stat().st_mtime_ns for p in shard_paths(cache)} == shards  # training reused the cache
    assert not (tmp_path / "online" / "features").exists()
    assert sorted(curves["offline"]) == [1, 2]
    assert curves["offline"] == pytest.approx(curves["online"], abs=1e-5)


def test_two_processes_extract_the_same_cache_as_one(stories, examples, tmp_path):
    """`specgraft extract-features` under torchrun with two (gloo) ranks: each writes its share of the shards,
    bitwise what one process writes for the same shards, and to float noise what one process writes alone.

    A shard's batches are its own examples sorted by length, so one process (one shard) pads them otherwise
    than two ranks (a shard each) and the module's docstring says why that moves the last bits."""
    import os
    import socket
    import subprocess
    import sys

    text = tmp_path / "stories.jsonl"
    text.write_text("".join(json.dumps({"text": stories.decode(e["input_ids"])}) + "\n" for e in examples))
    raw = {
        "target": {"path": stories.name},
        "head": {"type": "eagle"},
        "data": {"train": str(text), "max_length": 24},
        "training": {"micro_batch_size": 3, "num_threads": 1, "features": "offline"},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(raw))
    one = run_feature_extraction(load_config(tmp_path / "recipe.yaml", [f"training.output_dir={tmp_path / 'one'}"]))

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(port), "-m", "specgraft.cli", "extract-features", str(tmp_path / "recipe.yaml"),
        f"training.output_dir={tmp_path / 'two'}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    two = tmp_path / "two" / "features"
    assert len(shard_paths(two)) == 2 and len(shard_paths(one)) == 1  # a shard per rank; one process keeps one
    cfg = load_config(tmp_path / "recipe.yaml")
    indices = list(range(len(examples)))
    from specgraft.train.data import TokenizedDataset, load_records

    train = TokenizedDataset(load_records(str(text)), stories.tokenizer, 24).examples
    batch = collate([train[i] for i in indices], pad_token_id=0)
    head_layers = build_head(cfg.head, stories).hidden_layers
    same = tmp_path / "same-shards"
    for rank in (0, 1):  # the two ranks' work, one after the other in this process
        extract_features(cfg, stories, train, head_layers, same, progress=False, rank=rank, world_size=2)
    alone = FeatureCache(one, stories, head_layers, examples=train).batch(indices, batch)
    ranks = FeatureCache(two, stories, head_layers, examples=train).batch(indices, batch)
    reference = FeatureCache(same, stories, head_layers, examples=train).batch(indices, batch)
    assert set(ranks.hidden) == set(reference.hidden) == set(alone.hidden)
    for layer in ranks.hidden:
        assert torch.equal(ranks.hidden[layer], reference.hidden[layer]), layer
        assert torch.allclose(ranks.hidden[layer], alone.hidden[layer], rtol=0, atol=1e-4), layer
