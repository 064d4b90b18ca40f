"""Fine-tuning from a trained head (``training.init_from``): loading it, refusing another head or target, and
keeping in ``output_dir/best`` whichever of the initial and the fine-tuned heads has the higher held-out tau.

The trainer's bookkeeping runs on stories260K with the toy head and a scripted evaluator; two real runs of
`specgraft train` fine-tune a Medusa head on CPU in a few optimizer steps, one made worse, one made better.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from toy_train import ToyHead, collate, greedy_examples

from specgraft.config import load_config
from specgraft.heads import build_head, load_head_weights, save_head
from specgraft.heads.configs import (
    LOSS_FIELDS, DFlashConfig, DistillConfig, Eagle3Config, EagleConfig, MedusaConfig,
)
from specgraft.model import Target
from specgraft.train.trainer import Trainer


@pytest.fixture(scope="module")
def examples(stories) -> list[dict]:
    """48 greedy stories260K continuations of 32 tokens: learnable from the target's last hidden state."""
    return greedy_examples(stories, count=48, length=32)


@pytest.fixture
def initial(stories, tmp_path) -> Path:
    """A toy head saved as `specgraft train` saves one: what ``training.init_from`` names."""
    return save_head(ToyHead(stories, seed=3), tmp_path / "initial", stories)


def toy_config(tmp_path: Path, stories, examples, **training):
    """The toy head's run (1-head Medusa config, as the toy head reports), 4 steps of 8 examples from ``initial``."""
    data = tmp_path / "toy.json"
    data.write_text(json.dumps(examples))
    raw = {
        "target": {"path": stories.name},
        "head": {"type": "medusa", "num_heads": 1},
        "data": {"train": str(data), "eval_fraction": 0.1},  # init_from needs a held-out split (the evaluator here is scripted)
        "training": {"output_dir": str(tmp_path / "run"), "init_from": str(tmp_path / "initial"), "max_steps": 4,
                     "micro_batch_size": 8, "eval_every": 2, "save_every": 0, "log_every": 1, **training},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def scripted(values: list[float], seen: list[tuple[int, dict]], trainer: list[Trainer]):
    """An evaluator returning ``values`` in turn as simulated tau, recording (step, weights) of each head it sees."""
    values = iter(values)

    def evaluate(head):
        seen.append((trainer[0].step, {k: v.detach().clone() for k, v in head.state_dict().items()}))
        return {"simulated_tau": next(values)}

    return evaluate


def run_toy(config: Path, stories, examples, values: list[float], overrides=()) -> tuple[Trainer, list]:
    seen, holder = [], []
    trainer = Trainer(load_config(config, list(overrides)), target=stories, head=ToyHead(stories), train_data=examples,
                      collate=collate, evaluate=scripted(values, seen, holder))
    holder.append(trainer)
    trainer.fit()
    return trainer, seen


def assert_same_weights(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0, atol=0)


# ---------------------------------------------------------------------------- which head is kept


def test_a_fine_tune_that_never_beats_the_initial_head_keeps_it_in_best(stories, tmp_path, examples, initial, capsys):
    trainer, seen = run_toy(toy_config(tmp_path, stories, examples), stories, examples, [2.0, 1.5, 1.8])
    run = tmp_path / "run"
    saved = load_file(str(initial / "model.safetensors"))
    assert [step for step, _ in seen] == [0, 2, 4]  # the initial head is evaluated before any step
    assert_same_weights(seen[0][1], saved)  # ... with the weights it was given
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["eval/simulated_tau"]) for r in records if "eval/simulated_tau" in r] == [
        (0, 2.0), (2, 1.5), (4, 1.8)
    ]
    assert json.loads((run / "best" / "best.json").read_text()) == {"step": 0, "simulated_tau": 2.0}
    assert_same_weights(load_file(str(run / "best" / "model.safetensors")), saved)
    assert not torch.equal(load_file(str(run / "head" / "model.safetensors"))["proj.weight"], saved["proj.weight"])
    assert f"From the head in `{initial}` (training.init_from): 0 optimizer steps" in (run / "best" / "README.md").read_text()
    out = capsys.readouterr().out.splitlines()
    assert "the initial head (step 0): simulated_tau=2" in out
    assert out[-1] == (f"kept the initial head (training.init_from={initial}) in {run / 'best'}: simulated_tau 2; "
                       "fine-tuning's best, at step 4, was 1.8")


def test_a_fine_tune_that_beats_the_initial_head_keeps_the_better_step(stories, tmp_path, examples, initial, capsys):
    _, seen = run_toy(toy_config(tmp_path, stories, examples), stories, examples, [2.0, 2.5, 2.5])
    run = tmp_path / "run"
    assert json.loads((run / "best" / "best.json").read_text()) == {"step": 2, "simulated_tau": 2.5}  # a tie keeps the earlier
    assert_same_weights(load_file(str(run / "best" / "model.safetensors")), seen[1][1])
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"kept step 2 in {run / 'best'}: simulated_tau 2.5; the initial head (training.init_from={initial}) had 2"
    )


def test_a_checkpoint_to_resume_wins_over_init_from_and_the_initial_tau_is_remembered(
    stories, tmp_path, examples, initial, caplog, capsys
):
    config = toy_config(tmp_path, stories, examples, save_every=2)
    run_toy(config, stories, examples, [2.0, 1.5, 1.8], ["training.max_steps=2"])
    save_file({"proj.weight": torch.zeros(1)}, str(initial / "model.safetensors"))  # would not load: it is not read
    capsys.readouterr()
    with caplog.at_level(logging.WARNING, logger="specgraft.train.trainer"):
        trainer, seen = run_toy(config, stories, examples, [1.9])
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000002"
    assert (f"training.init_from={initial} is not loaded: training.resume=auto continues from {checkpoint} (a new "
            "training.output_dir, or training.resume=never, starts from the head)") in caplog.text
    assert trainer.step == 4 and [step for step, _ in seen] == [4]  # no second step-0 evaluation
    assert json.loads((tmp_path / "run" / "best" / "best.json").read_text()) == {"step": 0, "simulated_tau": 2.0}
    assert capsys.readouterr().out.splitlines()[-1].endswith("simulated_tau 2; fine-tuning's best, at step 4, was 1.9")


def test_a_fresh_run_logs_its_initial_head_once(stories, tmp_path, examples, initial):
    """An earlier attempt that wrote no checkpoint leaves its step-0 record; the fresh run replaces it."""
    config = toy_config(tmp_path, stories, examples)
    run_toy(config, stories, examples, [2.0, 1.5, 1.8])
    run_toy(config, stories, examples, [2.1, 1.5, 1.8])
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval/simulated_tau"] for r in records if r["step"] == 0] == [2.1]


# ---------------------------------------------------------------------------- what is refused


def rescaled(stories) -> Target:
    """stories260K with another embedding of the same sizes: another target to a head's signature."""
    model = copy.deepcopy(stories.model)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(1.5)
    return Target(model, stories.tokenizer, "stories260K-rescaled")


@pytest.mark.parametrize("saved, message", [
    ("medusa-2", r"holds a medusa head of another shape: head\.num_heads: 2 in the saved head, 1 in this config "
                 r"\(set them as the saved head has them; only loss_decay may differ\)$"),
    ("medusa-2-layers", r"head\.num_layers: 2 in the saved head, 1 in this config"),
    ("eagle", r"holds a head of type 'eagle', and this config's head\.type is 'medusa'"),
    ("another target", r"was trained for target 'stories260K-rescaled', not .*stories260K.*: embedding_fingerprint"),
], ids=["more heads", "deeper heads", "another type", "another target"])
def test_another_head_or_target_is_refused_naming_init_from(stories, tmp_path, examples, saved, message):
    path = tmp_path / "initial"
    if saved == "another target":
        save_head(ToyHead(stories), path, rescaled(stories))
    else:
        config = {"medusa-2": MedusaConfig(num_heads=2), "medusa-2-layers": MedusaConfig(num_heads=1, num_layers=2),
                  "eagle": EagleConfig()}[saved]
        save_head(build_head(config, stories), path, stories)
    config = toy_config(tmp_path, stories, examples)
    trainer = Trainer(load_config(config), target=stories, head=ToyHead(stories), train_data=examples, collate=collate)
    with pytest.raises(ValueError, match=rf"training\.init_from='{re.escape(str(path))}'.*{message}"):
        trainer.fit()
    assert not (tmp_path / "run" / "best").exists()


def test_loss_weights_may_differ_from_the_initial_head(stories, tmp_path):
    saved = build_head(MedusaConfig(num_heads=2, loss_decay=0.5), stories)
    save_head(saved, tmp_path / "initial", stories)
    head = build_head(MedusaConfig(num_heads=2), stories)
    load_head_weights(head, tmp_path / "initial", stories, where="init")
    assert_same_weights(head.state_dict(), saved.state_dict())


def test_the_loss_fields_are_fields_of_the_head_configs():
    fields = {f.name for config in (MedusaConfig, EagleConfig, Eagle3Config, DFlashConfig, DistillConfig)
              for f in dataclasses.fields(config)}
    assert LOSS_FIELDS <= fields, LOSS_FIELDS - fields


def test_a_distilled_draft_model_loads_from_its_transformers_directory(stories, tmp_path):
    config = DistillConfig(num_layers=1)
    saved = build_head(config, stories)
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.01)
    save_head(saved, tmp_path / "draft", stories)
    head = build_head(config, stories)
    load_head_weights(head, tmp_path / "draft", stories, where="init")
    assert_same_weights(head.state_dict(), saved.state_dict())


def test_specgraft_train_refuses_a_missing_init_from_in_one_line_before_torch_loads(stories, tmp_path, examples):
    missing = tmp_path / "no" / "head"
    config = toy_config(tmp_path, stories, examples)
    code = "import sys\nfrom specgraft.cli import main\nprint(main(sys.argv[1:]), 'torch' in sys.modules)\n"
    run = subprocess.run([sys.executable, "-c", code, "train", str(config), f"training.init_from={missing}"],
                         capture_output=True, text=True, timeout=120)
    assert run.stdout.split() == ["2", "False"], run.stderr
    assert run.stderr == (f"specgraft train: error: {config}: training.init_from={str(missing)!r}: directory {missing} "
                          "does not exist (relative paths resolve against the working directory)\n")


# ---------------------------------------------------------------------------- real runs of specgraft train


@pytest.fixture
def medusa_run(stories, examples, tmp_path, monkeypatch):
    """`specgraft train` of a one-head Medusa recipe on the examples' text (lr 1e-2, 20% held out), by name of its
    output directory and overrides; returns the output directory."""
    from specgraft.cli import main
    from test_trainer import medusa_recipe

    config = medusa_recipe(tmp_path, stories, examples, monkeypatch, eval_fraction=0.2, save_every=0, lr=1e-2)

    def run(name: str, *overrides: str) -> Path:
        assert main(["train", str(config), f"training.output_dir={tmp_path / name}", *overrides]) == 0
        return tmp_path / name

    return run


def test_specgraft_train_keeps_the_initial_head_when_fine_tuning_makes_it_worse(medusa_run, capsys):
    trained = medusa_run("trained", "training.epochs=3") / "head"  # 15 steps
    run = medusa_run("worse", f"training.init_from={trained}", "training.lr=1.0", "training.max_steps=2",
                     "training.eval_every=1")  # steps of ~1 per weight wreck a head whose weights are ~0.02
    best = json.loads((run / "best" / "best.json").read_text())
    assert best["step"] == 0 and best["simulated_tau"] > 1.2, best
    assert_same_weights(load_file(str(run / "best" / "model.safetensors")), load_file(str(trained / "model.safetensors")))
    out = capsys.readouterr().out
    assert f"kept the initial head (training.init_from={trained}) in {run / 'best'}: simulated_tau" in out


def test_specgraft_train_keeps_the_fine_tuned_head_when_it_is_better(medusa_run, capsys):
    barely = medusa_run("barely", "training.max_steps=1") / "head"
    run = medusa_run("better", f"training.init_from={barely}", "training.epochs=2", "training.eval_every=5")  # 10 steps
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    tau = {r["step"]: r["eval/simulated_tau"] for r in records if "eval/simulated_tau" in r}
    assert sorted(tau) == [0, 5, 10] and tau[10] > tau[0] + 0.1, tau
    best = json.loads((run / "best" / "best.json").read_text())
    assert best["step"] > 0 and best["simulated_tau"] == max(tau.values())
    assert f"kept step {best['step']} in {run / 'best'}" in capsys.readouterr().out
