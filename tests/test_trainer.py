"""The DeepSpeed trainer on stories260K with a toy head (tests/toy_train.py).

One plain process in-process; two processes under the `deepspeed` launcher
(CPU, gloo) with an exact resume from a mid-run checkpoint; and the real
``python -m specgraft.train`` entry for two steps.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shlex
import os
import shutil
import socket
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from safetensors.torch import load_file
from toy_train import ToyHead, collate, greedy_examples

from specgraft.config import load_config
from specgraft.heads import load_drafter
from specgraft.heads.medusa import MedusaDrafter
from specgraft.train.feature_cache import FeatureCache, extract_features
from specgraft.train.features import target_batch
from specgraft.train.trainer import Trainer, latest_checkpoint, lr_factor

TOY_TRAIN = Path(__file__).with_name("toy_train.py")
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def examples(stories) -> list[dict]:
    """48 greedy stories260K continuations of 32 tokens: learnable from the target's last hidden state."""
    return greedy_examples(stories, count=48, length=32)


@pytest.fixture(scope="module")
def data_file(examples, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "toy.json"
    path.write_text(json.dumps(examples))
    return path


def write_config(tmp_path: Path, stories, data_file: Path, name: str = "config.yaml", **training) -> Path:
    raw = {
        "target": {"path": stories.name},
        "head": {"type": "medusa", "num_heads": 1},  # the toy head reports this config
        "data": {"train": str(data_file)},
        "training": {"output_dir": str(tmp_path / "run"), "lr": 1e-2, "log_every": 1, "seed": 0, **training},
    }
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env["OMP_NUM_THREADS"] = "1"
    return env


# ---------------------------------------------------------------------------- units


def test_lr_schedule_warms_up_then_decays():
    factor = partial(lr_factor, warmup_steps=4, total_steps=14)
    warmup = [factor(s, schedule="cosine") for s in range(5)]
    assert warmup == [0.2, 0.4, 0.6, 0.8, 1.0]  # never 0: the first step is not wasted
    assert factor(9, schedule="cosine") == pytest.approx(0.5)  # half-way through the decay
    assert factor(9, schedule="linear") == pytest.approx(0.5)
    assert factor(13, schedule="cosine") > 0
    assert factor(13, schedule="constant") == 1.0
    decay = [factor(s, schedule="cosine") for s in range(4, 14)]
    assert decay == sorted(decay, reverse=True)


def test_target_batch_matches_the_full_forward_and_offline_features_match_it(stories, examples, tmp_path, data_file):
    batch = collate([examples[0], {"input_ids": examples[1]["input_ids"][:20], "loss_mask": examples[1]["loss_mask"][:20]}])
    layers = (2, stories.num_layers)
    online = target_batch(stories, batch, layers)
    with torch.no_grad():
        alone = stories.model(torch.tensor([examples[1]["input_ids"][:20]]), output_hidden_states=True)
    # The padded row's real positions see exactly what the sequence sees alone.
    torch.testing.assert_close(online.target_logits[1, :20], alone.logits[0].float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(online.hidden[2][1, :20], alone.hidden_states[2][0], rtol=1e-4, atol=1e-4)
    assert not online.hidden[2].requires_grad and online.loss_mask.dtype == torch.float32

    # The batch's rows are examples 7 and 9 of the cached data.
    data = [examples[i] for i in range(10)]
    data[7], data[9] = examples[0], {k: v[:20] for k, v in examples[1].items()}
    cfg = load_config(write_config(tmp_path, stories, data_file))
    summary = extract_features(cfg, stories, data, layers, tmp_path / "features", shard_size=4, progress=False)
    assert len(summary.written) == 3  # examples 0-3, 4-7, 8-9
    offline = FeatureCache(tmp_path / "features", stories, layers, examples=data)
    for _ in range(2):  # the first read opens the shards, the second reuses them
        cached = offline.batch([7, 9], batch)
        real = batch["attention_mask"].bool()
        torch.testing.assert_close(cached.target_logits[real], online.target_logits[real], rtol=1e-5, atol=1e-5)
        for layer in layers:
            torch.testing.assert_close(cached.hidden[layer][real], online.hidden[layer][real])
    assert sorted(offline._open) == [1, 2]  # only the shards holding examples 7 and 9 were opened


def test_target_batch_names_a_bad_layer(stories, examples):
    with pytest.raises(ValueError, match=r"hidden layers \[9\] are out of range .* 0..5"):
        target_batch(stories, collate(examples[:1]), (9,))


def test_trainer_rejects_a_module_without_a_loss(stories, tmp_path, data_file, examples):
    cfg = load_config(write_config(tmp_path, stories, data_file))
    with pytest.raises(TypeError, match="Linear is not a trainable head: it lacks config, hidden_layers, loss"):
        Trainer(cfg, target=stories, head=torch.nn.Linear(2, 2), train_data=examples, collate=collate)


# ---------------------------------------------------------------------------- one process


def test_single_process_run_learns_logs_and_exports(stories, tmp_path, data_file, examples):
    cfg = load_config(
        write_config(tmp_path, stories, data_file, epochs=2, micro_batch_size=8, save_every=3),
        ["tracking.wandb=offline", f"tracking.dir={tmp_path / 'tracking'}"],
    )
    trainer = Trainer(cfg, target=stories, head=ToyHead(stories), train_data=examples, collate=collate)
    head_dir = trainer.fit()

    run = tmp_path / "run"
    curve = losses(run)
    assert sorted(curve) == list(range(1, 13))  # 48 examples / 8 x 2 epochs
    assert curve[12] < 0.5 * curve[1], curve
    assert (run / "config.yaml").is_file()
    assert list((tmp_path / "tracking" / "wandb").glob("offline-run-*")), "no offline wandb run written"
    assert latest_checkpoint(run).name == "step_00000012"
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [f"step_{s:08d}" for s in (3, 6, 9, 12)]
    assert not list((run / "checkpoints" / ".partial").iterdir())  # every checkpoint was renamed into place

    assert head_dir == run / "head"
    assert {p.name for p in head_dir.iterdir()} >= {"config.json", "model.safetensors", "README.md"}
    exported = load_file(str(head_dir / "model.safetensors"))
    for name, value in trainer.head.state_dict().items():
        torch.testing.assert_close(exported[name], value)
    card = (head_dir / "README.md").read_text()
    assert f"{curve[12]:.4g}" in card and "lr: 0.01" in card  # final metrics and the config

    # The plain process left no trace: a later run (or test) starts its own world again.
    assert not dist.is_initialized()
    assert not any(key in os.environ for key in LAUNCH_ENV)


def test_the_best_simulated_tau_keeps_its_head_beside_the_last(stories, tmp_path, data_file, examples):
    values = iter([1.5, 2.5, 2.0])  # evaluations at steps 2, 4 and the end (6)
    heads = {}

    def evaluate(head):
        heads[len(heads)] = {k: v.clone() for k, v in head.state_dict().items()}
        return {"simulated_tau": next(values), "depth1_top1": 0.5}

    config = write_config(tmp_path, stories, data_file, epochs=1, micro_batch_size=8, eval_every=2, save_every=0)
    held_out = ["data.eval_fraction=0.1"]  # eval_every needs something to evaluate on (the test's evaluate)
    trainer = Trainer(
        load_config(config, held_out), target=stories, head=ToyHead(stories), train_data=examples, collate=collate, evaluate=evaluate
    )
    trainer.fit()
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["eval/simulated_tau"]) for r in records if "eval/simulated_tau" in r] == [
        (2, 1.5), (4, 2.5), (6, 2.0)
    ]
    assert json.loads((run / "best" / "best.json").read_text()) == {"step": 4, "simulated_tau": 2.5}
    best = load_file(str(run / "best" / "model.safetensors"))
    for name, value in heads[1].items():  # the head evaluated at step 4, not the last
        torch.testing.assert_close(best[name], value)
    assert not torch.equal(best["proj.weight"], load_file(str(run / "head" / "model.safetensors"))["proj.weight"])
    assert "eval/simulated_tau | 2.5" in (run / "best" / "README.md").read_text()
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("best")) == ["best"]  # nothing left aside

    # A resumed run knows the best so far: a lower value does not replace it; resume=never starts over.
    again = Trainer(load_config(config, held_out), target=stories, head=ToyHead(stories), train_data=examples, collate=collate,
                    evaluate=lambda head: {"simulated_tau": 2.4})
    again.fit()
    assert json.loads((run / "best" / "best.json").read_text())["simulated_tau"] == 2.5
    fresh = Trainer(load_config(config, [*held_out, "training.resume=never"]), target=stories, head=ToyHead(stories),
                    train_data=examples, collate=collate, evaluate=lambda head: {"simulated_tau": 2.4})
    fresh.fit()
    assert json.loads((run / "best" / "best.json").read_text()) == {"step": 2, "simulated_tau": 2.4}


def test_bf16_with_zero_stage_2(stories, tmp_path, data_file, examples):
    cfg = load_config(
        write_config(tmp_path, stories, data_file, precision="bf16", zero_stage=2, max_steps=3, micro_batch_size=8)
    )
    head_dir = Trainer(cfg, target=stories, head=ToyHead(stories), train_data=examples, collate=collate).fit()
    curve = losses(tmp_path / "run")
    assert len(curve) == 3 and all(math.isfinite(v) for v in curve.values())
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(head_dir / "model.safetensors")).values())


@pytest.mark.parametrize(("precision", "zero_stage"), [("bf16", 0), ("fp32", 2)])
def test_single_process_resume_is_exact(stories, tmp_path, data_file, examples, precision, zero_stage):
    overrides = [f"training.precision={precision}", f"training.zero_stage={zero_stage}"]
    config = write_config(tmp_path, stories, data_file, epochs=1, micro_batch_size=8, save_every=3)
    full = Trainer(load_config(config, overrides), target=stories, head=ToyHead(stories), train_data=examples, collate=collate)
    full.fit()
    reference = {k: v.clone() for k, v in full.head.state_dict().items()}

    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "run", resumed_dir)
    shutil.rmtree(resumed_dir / "head")
    shutil.rmtree(resumed_dir / "checkpoints" / "step_00000006")
    cfg = load_config(config, [*overrides, f"training.output_dir={resumed_dir}"])
    resumed = Trainer(cfg, target=stories, head=ToyHead(stories, seed=1), train_data=examples, collate=collate)
    resumed.fit()
    assert resumed.step == 6
    for name, value in reference.items():
        torch.testing.assert_close(resumed.head.state_dict()[name], value, rtol=0, atol=1e-6)


def test_resume_refuses_a_different_batch_layout(stories, tmp_path, data_file, examples):
    config = write_config(tmp_path, stories, data_file, max_steps=2, save_every=2, micro_batch_size=8)
    Trainer(load_config(config), target=stories, head=ToyHead(stories), train_data=examples, collate=collate).fit()
    changed = load_config(config, ["training.micro_batch_size=4", "training.max_steps=4"])
    with pytest.raises(ValueError, match="micro_batch_size=8, this run has micro_batch_size=4"):
        Trainer(changed, target=stories, head=ToyHead(stories), train_data=examples, collate=collate).fit()
    assert not dist.is_initialized()  # cleaned up after the failure too


def test_offline_features_train_like_online(stories, tmp_path, data_file, examples):
    """The feature cache (logits rebuilt from the last hidden state) gives the online run's losses."""
    curves = {}
    for mode in ("online", "offline"):
        cfg = load_config(
            write_config(tmp_path, stories, data_file, epochs=2, micro_batch_size=8, max_steps=8),
            [f"training.features={mode}", f"training.output_dir={tmp_path / mode}"],
        )
        trainer = Trainer(cfg, target=stories, head=ToyHead(stories), train_data=examples, collate=collate)
        trainer.fit()
        curves[mode] = losses(tmp_path / mode)
    cache = FeatureCache(tmp_path / "offline" / "features", stories, trainer.head.hidden_layers, examples=examples)
    assert len(cache) == len(examples)  # every example's features extracted once, before training
    assert not (tmp_path / "online" / "features").exists()
    assert curves["offline"] == pytest.approx(curves["online"], abs=1e-4)


# ---------------------------------------------------------------------------- two processes


def launch_two(config: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``deepspeed --num_gpus 2 tests/toy_train.py CONFIG`` (CPU: two gloo ranks)."""
    command = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
        str(TOY_TRAIN), str(config), *overrides,
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


def test_two_processes_agree_and_resume_exactly(stories, tmp_path, data_file):
    # 24 examples per rank in micro-batches of 5: 5 per epoch, so accumulation windows of 2 cross epochs.
    config = write_config(
        tmp_path, stories, data_file, epochs=3, micro_batch_size=5, gradient_accumulation_steps=2,
        zero_stage=1, save_every=3, num_threads=1,
    )
    run = tmp_path / "run"
    launch_two(config)
    rank0, rank1 = (load_file(str(run / f"rank{r}.safetensors")) for r in (0, 1))
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), f"ranks disagree on {name}"
    curve = losses(run)
    assert sorted(curve) == list(range(1, 8))  # 3 epochs x 5 micro-batches // 2
    assert curve[7] < 0.5 * curve[1], curve
    step3 = run / "checkpoints" / "step_00000003"
    assert {"rng_rank0.pt", "rng_rank1.pt", "trainer_state.json"} <= {p.name for p in step3.iterdir()}

    # An interrupted copy: only the step-3 checkpoint survives; resume=auto must reproduce the rest.
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    for leftover in ("head", "rank0.safetensors", "rank1.safetensors", "final_metrics.json", "checkpoints/step_00000006"):
        path = resumed / leftover
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    launch_two(config, f"training.output_dir={resumed}")
    for rank, reference in ((0, rank0), (1, rank1)):
        weights = load_file(str(resumed / f"rank{rank}.safetensors"))
        for name in reference:
            torch.testing.assert_close(weights[name], reference[name], rtol=0, atol=1e-6)
    resumed_curve = losses(resumed)
    assert sorted(resumed_curve) == sorted(curve)  # steps 4-7 logged once, by the resumed run
    for step in range(4, 8):
        assert resumed_curve[step] == pytest.approx(curve[step], abs=1e-6)
    assert (resumed / "head" / "model.safetensors").is_file()


# ---------------------------------------------------------------------------- the real entry point


def test_cli_trains_two_steps(stories, tmp_path, examples):
    text = tmp_path / "stories.jsonl"
    text.write_text("".join(json.dumps({"text": stories.decode(e["input_ids"])}) + "\n" for e in examples))
    config = tmp_path / "recipe.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "target": {"path": stories.name},
                "head": {"type": "medusa", "num_heads": 2},
                "data": {"train": str(text), "max_length": 32},
                "training": {"output_dir": str(tmp_path / "run"), "log_every": 1, "num_threads": 1},
            }
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "specgraft.train", str(config), "training.max_steps=2", "training.micro_batch_size=4",
         "training.eval_every=1", "data.eval_fraction=0.2"],
        capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    curve = losses(tmp_path / "run")
    assert sorted(curve) == [1, 2] and all(math.isfinite(v) for v in curve.values())
    assert json.loads((tmp_path / "run" / "head" / "config.json").read_text())["head"]["num_heads"] == 2
    # Each evaluation simulates a chain as deep as the recipe's tree (chain:5 by default) on the held-out split,
    # and the best one's head is kept, loadable, beside the last.
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    simulated = {r["step"]: r["eval/simulated_tau"] for r in records if "eval/simulated_tau" in r}
    assert sorted(simulated) == [1, 2] and all(1.0 <= v <= 6.0 for v in simulated.values()), simulated
    best = json.loads((tmp_path / "run" / "best" / "best.json").read_text())
    assert best["simulated_tau"] == max(simulated.values()) and simulated[best["step"]] == best["simulated_tau"]
    assert isinstance(load_drafter(tmp_path / "run" / "best", stories), MedusaDrafter)


def test_cli_reports_a_config_error_before_loading_anything(tmp_path, stories):
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump({"target": {"path": stories.name}, "head": {"type": "medusa"}, "data": {"train": "x/y"}}))
    result = subprocess.run(
        [sys.executable, "-m", "specgraft.train", str(config), "training.epochz=2", "--local_rank=0"],
        capture_output=True, text=True, env=subprocess_env(), timeout=120,
    )
    assert result.returncode == 2
    assert "training.epochz: unknown key (set by override 'training.epochz=2')" in result.stderr


def test_train_fraction_trains_on_a_nested_share_and_keeps_the_held_out_split(stories, tmp_path):
    from specgraft.train.pipeline import _training_data
    from specgraft.train.trainer import DistEnv

    env = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), created_group=False, set_env=())
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": f"Story {i}: the cat sat."}) + "\n" for i in range(48)))
    config = write_config(tmp_path, stories, texts)
    splits = {
        f: _training_data(load_config(config, ["data.eval_fraction=0.25", f"data.train_fraction={f}"]), stories, env)
        for f in (0.25, 0.5, 1.0)
    }
    (quarter, q_held), (half, h_held), (full, f_held) = splits.values()
    assert len(full) == 36 and (len(half), len(quarter)) == (18, 9)
    assert q_held == h_held == f_held and len(f_held) == 12  # evaluated on the same sequences at every share
    key = lambda examples: {tuple(e["input_ids"]) for e in examples}  # noqa: E731
    assert key(quarter) < key(half) < key(full)
    assert not key(full) & key(f_held)


def medusa_recipe(tmp_path, stories, examples, monkeypatch, *, eval_fraction: float = 0.0, **training) -> Path:
    """A one-head Medusa recipe over the examples' text (``eval_fraction`` held out, ``training`` settings over the
    defaults), run through `specgraft train` on the CPU accelerator."""
    text = tmp_path / "stories.jsonl"
    text.write_text("".join(json.dumps({"text": stories.decode(e["input_ids"])}) + "\n" for e in examples))
    config = tmp_path / "recipe.yaml"
    config.write_text(yaml.safe_dump({
        "target": {"path": stories.name},
        "head": {"type": "medusa", "num_heads": 1},
        "data": {"train": str(text), "max_length": 32, "eval_fraction": eval_fraction},
        "training": {"output_dir": str(tmp_path / "run"), "log_every": 1, "num_threads": 1, "micro_batch_size": 8,
                     **training},
    }))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    return config


def test_ctrl_c_names_the_last_checkpoint_and_the_command_that_resumes_from_it(
    stories, tmp_path, examples, monkeypatch, capsys, caplog
):
    from specgraft.cli import main
    from specgraft.tools.quickstart import specgraft_command
    from specgraft.train.trainer import Trainer

    config = medusa_recipe(tmp_path, stories, examples, monkeypatch)
    log_train = Trainer._log_train

    def ctrl_c_at_step_3(self, *args, **kwargs):  # a SIGINT lands as KeyboardInterrupt in the loop
        log_train(self, *args, **kwargs)
        if self.step == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "_log_train", ctrl_c_at_step_3)
    argv = ["train", str(config), "training.max_steps=4", "training.save_every=2", "training.resume=never"]
    assert main(argv) == 130
    err = capsys.readouterr().err.strip()
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000002"
    command = shlex.join([specgraft_command(), "train", str(config), "training.max_steps=4", "training.save_every=2",
                          "training.resume=auto"])
    assert err.splitlines()[-1] == (
        f"specgraft train: interrupted; the last checkpoint is {checkpoint}; continue from it with: {command}"
    ), err
    assert "Traceback" not in err

    monkeypatch.setattr(Trainer, "_log_train", log_train)
    with caplog.at_level(logging.INFO, logger="specgraft.train.trainer"):
        assert main(shlex.split(command)[1:]) == 0  # the printed command continues from step 2 and finishes
    assert f"resumed from {checkpoint} at step 2" in caplog.text
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3, 4]
    assert (tmp_path / "run" / "head" / "model.safetensors").is_file()


def test_ctrl_c_before_the_first_checkpoint_says_none_was_written(stories, tmp_path, monkeypatch):
    from specgraft.cli import interrupted_training
    from specgraft.cli.flags import add_config_arguments
    from specgraft.tools.quickstart import specgraft_command

    config = write_config(tmp_path, stories, tmp_path / "data.json", save_every=50)
    args = add_config_arguments(argparse.ArgumentParser()).parse_args([str(config), "training.lr=1e-3"])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    line = interrupted_training(args, load_config(config, args.overrides))
    command = shlex.join([specgraft_command(), "train", str(config), "training.lr=1e-3", "training.resume=auto"])
    assert line == f"specgraft train: interrupted before any checkpoint (one is written every 50 steps); start again with: {command}"


def test_train_redirected_writes_lines_not_progress_bars(stories, tmp_path, examples, monkeypatch, capfd):
    from transformers.utils import logging as hf_logging

    from specgraft.cli import main

    config = medusa_recipe(tmp_path, stories, examples, monkeypatch)
    hf_logging.enable_progress_bar()  # as a user's process starts (the test session turns it off)
    try:
        assert main(["train", str(config), "training.max_steps=3"]) == 0
    finally:
        hf_logging.disable_progress_bar()
    out, err = capfd.readouterr()  # the file descriptors, as a shell redirect sees them
    assert "\r" not in out + err and "Loading weights" not in err and "it/s" not in err, err
    progress = [line for line in err.splitlines() if line.startswith("train:")]
    assert len(progress) == 1 and progress[0].startswith("train: 3/3 step (100%), 0m00s, loss="), err
    assert len(err.splitlines()) <= 3, err  # besides it, at most DeepSpeed's probe for libaio (the linker's 2 lines)
    assert out.splitlines()[-1] == f"head written to {tmp_path / 'run' / 'head'}"
