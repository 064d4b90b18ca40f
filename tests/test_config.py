"""The training config: defaults, overrides, and every class of bad config failing before a model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from specgraft.config import ConfigError, check_files, load_config, to_deepspeed_config
from specgraft.heads.configs import EagleConfig, MedusaConfig


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """A target directory, a data file and a prompts file; the target is never loaded here."""
    target = tmp_path / "target"
    target.mkdir()
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "hello"}\n')
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["Once upon a time"]}\n')
    return {"target": target, "data": data, "prompts": prompts}


def write(tmp_path: Path, raw: dict | str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw, sort_keys=False))
    return path


def minimal(files: dict[str, Path], **sections) -> dict:
    raw = {"target": {"path": str(files["target"])}, "head": {"type": "medusa"}, "data": {"train": str(files["data"])}}
    for name, values in sections.items():
        if isinstance(values, dict):
            raw.setdefault(name, {}).update(values)
        else:
            raw[name] = values
    return raw


# ---------------------------------------------------------------------------- what works


def test_minimal_config_gets_defaults(tmp_path, files):
    cfg = load_config(write(tmp_path, minimal(files)))
    assert cfg.head == MedusaConfig()
    assert cfg.training.lr == 1e-3 and cfg.training.schedule == "cosine" and cfg.training.zero_stage == 0
    assert cfg.training.resume == "auto" and cfg.training.features == "online"
    assert cfg.training.features_dir is None and cfg.training.feature_dtype is None  # output_dir/features, target.dtype
    assert cfg.tracking.wandb == "disabled"  # the default needs no wandb account
    assert cfg.tree == "chain:5"
    assert cfg.eval.prompts is None
    assert Path(cfg.training.output_dir).is_absolute()


def test_overrides_set_typed_values_and_nested_sections(tmp_path, files):
    cfg = load_config(
        write(tmp_path, minimal(files)),
        [
            "training.lr=3e-3",
            "training.betas=[0.8, 0.99]",
            "training.max_steps=7",
            "head.type=eagle",
            "head.noise=0.2",
            "tree=chain:3",
            "data.regenerate.output=regen.jsonl",
            "data.regenerate.num_from_bos=4",
        ],
    )
    assert cfg.training.lr == 3e-3 and isinstance(cfg.training.lr, float)
    assert cfg.training.betas == (0.8, 0.99)
    assert cfg.training.max_steps == 7
    assert cfg.head == EagleConfig(noise=0.2)
    assert cfg.tree == "chain:3"
    assert cfg.data.regenerate.num_from_bos == 4
    assert Path(cfg.data.regenerate.output).is_absolute()


def test_fine_tuning_lowers_the_lr_and_drops_the_warmup_by_default(tmp_path, files, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fresh = load_config(write(tmp_path, minimal(files, data={"eval_fraction": 0.1})))
    tuned = load_config(write(tmp_path, minimal(files, data={"eval_fraction": 0.1})), ["training.init_from=runs/a/best"])
    assert tuned.training.lr == fresh.training.lr / 10 and tuned.training.warmup_ratio == 0.0
    assert fresh.training.warmup_ratio > 0
    assert tuned.training.init_from == str(tmp_path / "runs" / "a" / "best")  # made absolute like every path


def test_an_lr_or_warmup_the_config_gives_wins_over_the_fine_tuning_defaults(tmp_path, files):
    in_yaml = minimal(files, data={"eval_fraction": 0.1}, training={"lr": 3e-3, "init_from": "head"})
    cfg = load_config(write(tmp_path, in_yaml))
    assert cfg.training.lr == 3e-3 and cfg.training.warmup_ratio == 0.0
    cfg = load_config(write(tmp_path, in_yaml), ["training.warmup_ratio=0.1", "training.lr=1e-3"])
    assert cfg.training.lr == 1e-3 and cfg.training.warmup_ratio == 0.1  # the fresh default's value, given: kept


def test_fine_tuning_needs_a_held_out_split(tmp_path, files):
    with pytest.raises(ConfigError, match=r"training\.init_from=.*needs data\.eval_fraction > 0"):
        load_config(write(tmp_path, minimal(files)), ["training.init_from=head"])


def test_a_missing_head_to_fine_tune_from_names_the_key_and_path(tmp_path, files):
    raw = minimal(files, data={"eval_fraction": 0.1}, training={"init_from": str(tmp_path / "no_head")})
    cfg = load_config(write(tmp_path, raw))  # validation needs no file; running the config does
    with pytest.raises(FileNotFoundError, match=r"training\.init_from=.*no_head.*: directory .*no_head does not exist"):
        check_files(cfg)


def test_hub_dataset_names_are_not_checked_on_disk(tmp_path, files):
    raw = minimal(files, data={"train": "someorg/some-dataset"})
    assert load_config(write(tmp_path, raw)).data.train == "someorg/some-dataset"


def test_relative_paths_resolve_against_the_working_directory(tmp_path, files, monkeypatch):
    """Documented choice: like any command-line path, not relative to the config file."""
    config_dir = tmp_path / "recipes"
    config_dir.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    (work / "mine.jsonl").write_text('{"text": "x"}\n')
    (config_dir / "beside.jsonl").write_text('{"text": "x"}\n')
    monkeypatch.chdir(work)

    cfg = load_config(write(config_dir, minimal(files, data={"train": "mine.jsonl"})), ["training.features_dir=cache"])
    assert cfg.data.train == str(work / "mine.jsonl")
    assert cfg.training.features_dir == str(work / "cache")

    cfg = load_config(write(config_dir, minimal(files, data={"train": "beside.jsonl"})))
    assert cfg.data.train == str(work / "beside.jsonl")  # not the file beside the config
    with pytest.raises(FileNotFoundError, match="working directory"):
        check_files(cfg)


def test_a_symlinked_target_keeps_the_path_written_not_where_the_link_points(tmp_path, files, monkeypatch):
    """The head records target.path: a link the user named stays that link (made absolute), and still checks out."""
    link = tmp_path / "models" / "current"
    link.parent.mkdir()
    link.symlink_to(files["target"], target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(write(tmp_path, minimal(files, target={"path": "./models/current"})))
    assert cfg.target.path == str(link)
    check_files(cfg)


# ---------------------------------------------------------------------------- what fails, and how it says so


def test_unknown_key_names_file_line_and_dotted_key(tmp_path, files):
    raw = minimal(files)
    raw["training"] = {"lr": 1e-3, "learning_rate": 1e-3}
    path = write(tmp_path, raw)
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if "learning_rate" in text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"{path}:{line}: training.learning_rate: unknown key" in str(err.value)


def test_unknown_key_inside_the_head_union_is_named_without_the_tag(tmp_path, files):
    raw = minimal(files, head={"type": "medusa", "num_head": 3})
    with pytest.raises(ConfigError, match=r"head\.num_head: unknown key"):
        load_config(write(tmp_path, raw))


def test_unknown_section_is_an_error(tmp_path, files):
    raw = minimal(files, trainer={"lr": 1})
    with pytest.raises(ConfigError, match="trainer: unknown key"):
        load_config(write(tmp_path, raw))


def test_wrong_type_names_key_and_value(tmp_path, files):
    raw = minimal(files, training={"epochs": "many"})
    with pytest.raises(ConfigError, match=r"training\.epochs: .*valid integer.*'many'"):
        load_config(write(tmp_path, raw))


def test_wrong_choice_names_key_and_value(tmp_path, files):
    raw = minimal(files, training={"precision": "fp16"})
    with pytest.raises(ConfigError, match=r"training\.precision: .*'fp16'"):
        load_config(write(tmp_path, raw))


def test_unknown_head_type_is_an_error(tmp_path, files):
    raw = minimal(files, head={"type": "hydra"})
    with pytest.raises(ConfigError, match=r"head: .*'hydra'"):
        load_config(write(tmp_path, raw))


def test_missing_required_key(tmp_path, files):
    raw = minimal(files)
    del raw["target"]["path"]
    with pytest.raises(ConfigError, match=r"target\.path: required key is missing"):
        load_config(write(tmp_path, raw))


def test_wrong_type_from_an_override_names_the_override(tmp_path, files):
    with pytest.raises(ConfigError, match=r"training\.lr: .*\(set by override 'training\.lr=fast'\)"):
        load_config(write(tmp_path, minimal(files)), ["training.lr=fast"])


def test_unknown_key_from_an_override(tmp_path, files):
    with pytest.raises(ConfigError, match=r"training\.lrr: unknown key \(set by override"):
        load_config(write(tmp_path, minimal(files)), ["training.lrr=1"])


@pytest.mark.parametrize("override", ["training.lr", "=3", "training..lr=3", "training.lr x=3", "3training.lr=1"])
def test_malformed_override(tmp_path, files, override):
    with pytest.raises(ConfigError, match=f"override {override!r} is malformed"):
        load_config(write(tmp_path, minimal(files)), [override])


def test_override_into_a_scalar_is_malformed(tmp_path, files):
    with pytest.raises(ConfigError, match=r"override 'training\.lr\.peak=1': training\.lr is 0\.001"):
        load_config(write(tmp_path, minimal(files, training={"lr": 1e-3})), ["training.lr.peak=1"])


def test_invalid_yaml_names_the_file(tmp_path, files):
    path = write(tmp_path, "target: {path: [unclosed\n")
    with pytest.raises(ConfigError, match=f"{path}: invalid YAML"):
        load_config(path)


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_missing_data_file_names_key_and_path(tmp_path, files):
    raw = minimal(files, data={"train": str(tmp_path / "absent.jsonl")})
    cfg = load_config(write(tmp_path, raw))  # validation needs no file; running the config does
    with pytest.raises(FileNotFoundError, match=r"data\.train=.*absent\.jsonl"):
        check_files(cfg)


def test_missing_eval_prompts_file(tmp_path, files):
    raw = minimal(files, eval={"prompts": "no_such_prompts.jsonl"})
    cfg = load_config(write(tmp_path, raw))  # validation needs no file; running the config does
    with pytest.raises(FileNotFoundError, match=r"eval\.prompts=.*no_such_prompts\.jsonl"):
        check_files(cfg)


def test_missing_target_directory(tmp_path, files):
    raw = minimal(files, target={"path": str(tmp_path / "no_model")})
    cfg = load_config(write(tmp_path, raw))  # validation needs no file; running the config does
    with pytest.raises(FileNotFoundError, match=r"target\.path=.*no_model"):
        check_files(cfg)


def test_resume_from_a_missing_checkpoint(tmp_path, files):
    raw = minimal(files, training={"resume": str(tmp_path / "runs" / "step_00000100")})
    cfg = load_config(write(tmp_path, raw))  # validation needs no file; running the config does
    with pytest.raises(FileNotFoundError, match=r"training\.resume=.*step_00000100"):
        check_files(cfg)


def test_eval_every_without_anything_to_evaluate_names_both_keys(tmp_path, files):
    raw = minimal(files, training={"eval_every": 50})
    with pytest.raises(ConfigError, match=r"training\.eval_every=50.*eval\.prompts"):
        load_config(write(tmp_path, raw))
    raw["eval"] = {"prompts": str(files["prompts"])}
    assert load_config(write(tmp_path, raw)).training.eval_every == 50


def test_no_training_data_at_all(tmp_path, files):
    raw = minimal(files)
    del raw["data"]["train"]
    with pytest.raises(ConfigError, match=r"data\.train is required"):
        load_config(write(tmp_path, raw))


def test_regeneration_with_nothing_to_answer(tmp_path, files):
    raw = minimal(files, data={"regenerate": {"output": "out.jsonl"}})
    del raw["data"]["train"]
    with pytest.raises(ConfigError, match=r"data\.regenerate has nothing to answer"):
        load_config(write(tmp_path, raw))


def test_self_instruct_alone_is_something_to_answer(tmp_path, files):
    raw = minimal(files, data={"regenerate": {"output": "out.jsonl", "self_instruct": 8}})
    del raw["data"]["train"]
    assert load_config(write(tmp_path, raw)).data.regenerate.self_instruct == 8


def test_self_instruct_needs_sampling(tmp_path, files):
    raw = minimal(files, data={"regenerate": {"output": "out.jsonl", "self_instruct": 8, "temperature": 0}})
    with pytest.raises(ConfigError, match=r"data\.regenerate\.self_instruct=8 needs data\.regenerate\.temperature > 0"):
        load_config(write(tmp_path, raw))


def test_user_token_limits_must_be_ordered(tmp_path, files):
    raw = minimal(files, data={"regenerate": {"output": "out.jsonl", "min_user_tokens": 8}})
    with pytest.raises(ConfigError, match=r"max_user_tokens=4 is below data\.regenerate\.min_user_tokens=8"):
        load_config(write(tmp_path, raw), ["data.regenerate.max_user_tokens=4"])


def test_bad_tree_spec(tmp_path, files):
    with pytest.raises(ConfigError, match=r"tree='chain:0'"):
        load_config(write(tmp_path, minimal(files, tree="chain:0")))


# ---------------------------------------------------------------------------- DeepSpeed


def test_deepspeed_config_follows_the_training_section(tmp_path, files):
    raw = minimal(
        files,
        training={"micro_batch_size": 4, "gradient_accumulation_steps": 3, "grad_clip": 0.5, "zero_stage": 2,
                  "precision": "bf16", "lr": 2e-4, "weight_decay": 0.01, "betas": [0.9, 0.98]},
    )
    ds = to_deepspeed_config(load_config(write(tmp_path, raw)), world_size=2)
    assert ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == 4 * 3 * 2
    assert ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"] == {"stage": 2}
    assert ds["bf16"] == {"enabled": True}
    assert ds["optimizer"]["type"] == "AdamW"
    assert ds["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.9, 0.98], "eps": 1e-8, "weight_decay": 0.01, "torch_adam": True}


def test_deepspeed_json_overrides_merge_key_by_key(tmp_path, files):
    override = tmp_path / "ds.json"
    override.write_text(json.dumps({"zero_optimization": {"overlap_comm": True}, "train_micro_batch_size_per_gpu": 2}))
    raw = minimal(files, training={"deepspeed_config": str(override), "zero_stage": 1, "micro_batch_size": 8})
    ds = to_deepspeed_config(load_config(write(tmp_path, raw)), world_size=4)
    assert ds["zero_optimization"] == {"stage": 1, "overlap_comm": True}
    assert ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["train_batch_size"] == 2 * 1 * 4  # derived after the merge, so it stays consistent


def test_invalid_deepspeed_json_names_key_and_line(tmp_path, files):
    override = tmp_path / "ds.json"
    override.write_text('{\n  "zero_optimization": {"stage": 1,}\n}\n')
    raw = minimal(files, training={"deepspeed_config": str(override)})
    cfg = load_config(write(tmp_path, raw))  # the JSON is read with the other files the config names
    with pytest.raises(ConfigError, match=r"training\.deepspeed_config: .*ds\.json:2 is not valid JSON"):
        check_files(cfg)


def test_a_missing_tree_file_is_found_by_check_files(tmp_path, files):
    cfg = load_config(write(tmp_path, minimal(files, tree="static:absent.json")))
    assert cfg.tree == f"static:{Path('absent.json').resolve()}"
    with pytest.raises(FileNotFoundError, match=r"tree=.*absent\.json"):
        check_files(cfg)


@pytest.mark.parametrize("entry", ["run_training", "run_regeneration", "run_feature_extraction"])
def test_running_a_config_checks_its_files_before_anything_loads(tmp_path, files, entry):
    import specgraft.train as train

    raw = minimal(files, target={"path": str(tmp_path / "no_model")},
                  data={"regenerate": {"output": str(tmp_path / "out.jsonl"), "num_from_bos": 1}})
    cfg = load_config(write(tmp_path, raw))
    with pytest.raises(FileNotFoundError, match=r"config\.yaml: target\.path=.*no_model"):
        getattr(train, entry)(cfg)


def test_a_bad_override_is_refused_before_torch_loads(tmp_path, files):
    """Validation reads pydantic models only (specgraft.heads loads its modules on first use)."""
    import subprocess
    import sys

    path = write(tmp_path, minimal(files))
    code = (
        "import sys\n"
        "from specgraft.config import ConfigError, load_config\n"
        "try:\n"
        f"    load_config({str(path)!r}, ['training.lr=abc'])\n"
        "except ConfigError as err:\n"
        "    assert 'training.lr' in str(err)\n"
        "    sys.exit(10 + ('torch' in sys.modules))\n"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 10
