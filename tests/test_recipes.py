"""The recipes under recipes/: every config validates (offline), its DeepSpeed JSON merges without
contradicting it, its header launches itself, and the launch scripts run the command they document.

Real-model recipes cannot train here; they are validated only. Their targets and datasets are hub
names, which must validate with no network: the `offline` fixture makes any connection attempt fail.
The launch scripts run against a stand-in `deepspeed` on PATH that records its arguments.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import SMOLLM2_PLACES

from specgraft.config import ConfigError, check_files, load_config, to_deepspeed_config
from specgraft.specs import looks_like_path

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
LAUNCH = RECIPES / "launch"
SHARED = REPO.parent / "shared"
CONFIGS = sorted(RECIPES.rglob("*.yaml"))
# Recipes that train on this machine's CPU against local targets (../shared, or a copy materialized from it).
CPU_RECIPES = ("tiny", "smollm2-135m")
REAL = [p for p in CONFIGS if p.relative_to(RECIPES).parts[0] not in CPU_RECIPES]
DS_JSONS = sorted(RECIPES.rglob("*.json"))
SCRIPTS = sorted(LAUNCH.glob("*.sh"))
WORLD = 8  # the GPUs the real recipes are written for

# The one place the recipes, their README and docs/ have materialize.py write SmolLM2, where the tests look first.
SMOLLM2_DIR = "~/" + SMOLLM2_PLACES[0].as_posix()
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the README's stand-in for "your model"
# A SmolLM2 directory a command names: materialize.py's destination, a --target, or a shell variable docs/ set to it.
SMOLLM2_NAMED = re.compile(r"(?:materialize\.py\s+|--target[ =]|\bS=)([^\s`'\"]*SmolLM2[^\s`'\"]*)")
# A command line in a config's header: something that starts a run.
COMMAND = re.compile(r"(specgraft (train|regenerate)|launch_8gpu\.sh|launch_multinode\.sh|deepspeed --|torchrun --|-m specgraft\.train)\s")


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def header(path: Path) -> list[str]:
    """The comment block a config opens with."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return lines


@pytest.fixture
def offline(monkeypatch):
    """Any attempt to open a network connection fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture
def at_repo_root(monkeypatch):
    """Recipes resolve relative paths against the working directory and say to run from the repo root."""
    monkeypatch.chdir(REPO)


def unavailable(path: Path) -> str | None:
    """Why a recipe's local files are absent here (../shared, a target materialized from it), or None."""
    if "../shared" in path.read_text() and not SHARED.is_dir():
        return f"{rel(path)} reads ../shared, which is absent ({SHARED})"
    target = yaml.safe_load(path.read_text())["target"]["path"]
    if target.startswith("~") and not Path(target).expanduser().is_dir():
        return f"{rel(path)} trains {target}, which is not materialized here (see the recipe's first lines)"
    return None


def load(path: Path, overrides=()):
    """Validation needs none of the files a recipe names: every recipe validates on a fresh machine."""
    return load_config(path, overrides)


def test_recipes_were_found():
    assert len(REAL) >= 4 and DS_JSONS and {p.name for p in SCRIPTS} >= {"launch_8gpu.sh", "launch_multinode.sh"}


# ---------------------------------------------------------------------------- configs


@pytest.mark.parametrize("path", CONFIGS, ids=rel)
def test_every_recipe_validates_offline(path, offline, at_repo_root):
    cfg = load(path)
    assert Path(cfg.training.output_dir).is_absolute()
    assert Path(cfg.training.output_dir).is_relative_to(REPO / "runs"), "run outputs belong under the ignored runs/"


@pytest.mark.parametrize("path", [p for p in CONFIGS if p not in REAL], ids=rel)
def test_cpu_recipes_name_files_that_exist_once_set_up(path, offline, at_repo_root):
    """What `specgraft train` checks first: the files a CPU recipe reads (../shared, a materialized target)."""
    reason = unavailable(path)
    if reason:
        pytest.skip(reason)
    check_files(load_config(path))


@pytest.mark.parametrize("path", REAL, ids=rel)
def test_real_recipes_name_hub_sources_and_keep_them_verbatim(path, offline, at_repo_root):
    """A hub id is not a local path: it is left as written, not resolved or checked on disk."""
    cfg = load(path)
    written = path.read_text()
    assert cfg.target.path.count("/") == 1 and not Path(cfg.target.path).is_absolute()
    assert f"path: {cfg.target.path}" in written
    assert cfg.data.train is not None and cfg.data.train.count("/") == 1 and f"train: {cfg.data.train}" in written
    assert cfg.target.dtype == "bfloat16" and cfg.training.precision == "bf16"
    assert cfg.data.regenerate is not None and Path(cfg.data.regenerate.output).is_relative_to(REPO / "runs")
    assert cfg.eval.prompts is None, "eval.prompts must be a local file: leave it to an override"


@pytest.mark.parametrize("path", REAL, ids=rel)
def test_documented_override_trains_on_the_fixed_answers(path, offline, at_repo_root):
    assert load(path, ["data.regenerate=null"]).data.regenerate is None


@pytest.mark.parametrize("path", CONFIGS, ids=rel)
def test_header_launch_commands_name_the_recipe_itself(path):
    """torchtune style: the config opens with the command that runs it, and that command names this file."""
    own = rel(path)
    commands = [line for line in header(path) if COMMAND.search(line + " ")]
    assert commands, f"{own} does not open with the command that launches it"
    for line in commands:
        assert own in line, f"{own}: header command does not name this file: {line!r}"
    named = set(re.findall(r"recipes/[\w./-]+\.yaml", "\n".join(header(path))))
    assert named <= {own}, f"{own}: header names other recipes {sorted(named - {own})}"


@pytest.mark.parametrize("path", CONFIGS, ids=rel)
def test_header_references_existing_files(path):
    text = "\n".join(header(path))
    for ref in re.findall(r"recipes/[\w./-]+\.(?:sh|py|json|jsonl|example)", text):
        assert (REPO / ref).is_file(), f"{rel(path)} header refers to missing {ref}"


@pytest.mark.parametrize("path", REAL, ids=rel)
def test_real_recipe_headers_state_hardware_and_wall_time(path):
    text = "\n".join(header(path))
    assert "8x A100/H100 80GB" in text
    assert "Wall time:" in text


def test_recipes_do_not_share_output_directories(offline, at_repo_root):
    """Two recipes in one output_dir would resume from each other's checkpoints (training.resume=auto)."""
    dirs = {}
    for path in CONFIGS:
        out = load_config(path).training.output_dir
        assert out not in dirs, f"{rel(path)} and {dirs[out]} share output_dir {out}"
        dirs[out] = rel(path)


def test_regenerated_data_is_shared_only_between_identical_generators(offline, at_repo_root):
    """Regeneration reuses a finished output file: sharing one across targets or settings would train on the wrong data."""
    seen = {}
    for path in CONFIGS:
        cfg = load_config(path)
        regen = cfg.data.regenerate
        if regen is None:
            continue
        key = (cfg.target.path, cfg.target.dtype, regen.prompts, cfg.data.train, regen.num_from_bos,
               regen.max_new_tokens, regen.temperature, regen.seed, regen.max_prompts, regen.self_instruct,
               regen.self_instruct_max_tokens, regen.min_user_tokens, regen.max_user_tokens, regen.dedupe,
               regen.batch_size)
        if regen.output in seen:
            assert seen[regen.output][0] == key, f"{rel(path)} and {seen[regen.output][1]} write {regen.output} differently"
        seen[regen.output] = (key, rel(path))


def test_recipes_that_train_smollm2_name_the_one_directory_materialize_writes():
    """Every recipe whose local target is SmolLM2 names the directory the docs have materialize.py write (and the
    tests look in first), so a recipe cannot drift to a place nothing writes."""
    targets = {rel(p): yaml.safe_load(p.read_text())["target"]["path"] for p in CONFIGS}
    smollm2 = {name: path for name, path in targets.items() if "smollm2" in path.lower() and looks_like_path(path)}
    assert set(smollm2) >= {rel(p) for p in (RECIPES / "smollm2-135m").glob("*.yaml")}
    assert {name: path for name, path in smollm2.items() if path != SMOLLM2_DIR} == {}


def test_commands_name_the_one_smollm2_directory():
    """materialize.py's destination and every --target naming SmolLM2, in the recipes' headers, their README,
    README.md, docs/ and benchmarks/, are the directory the recipes train (or the hub id)."""
    files = [*CONFIGS, RECIPES / "README.md", REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "benchmarks").glob("*.py"))]
    named = [(rel(f), m.group(1)) for f in files for m in SMOLLM2_NAMED.finditer(f.read_text())]
    assert any(name == "recipes/README.md" for name, _ in named) and any(name.startswith("docs/") for name, _ in named)
    assert [(name, path) for name, path in named if path not in (SMOLLM2_DIR, SMOLLM2_HUB_ID)] == []


def test_every_recipe_is_listed_in_the_readme():
    readme = (RECIPES / "README.md").read_text()
    for path in CONFIGS:
        assert rel(path) in readme, f"recipes/README.md does not list {rel(path)}"


# ---------------------------------------------------------------------------- DeepSpeed JSON


def _values(node):
    if isinstance(node, dict):
        for value in node.values():
            yield from _values(value)
    elif isinstance(node, list):
        for value in node:
            yield from _values(value)
    else:
        yield node


@pytest.mark.parametrize("path", DS_JSONS, ids=rel)
def test_deepspeed_json_is_used_and_leaves_the_yaml_in_charge(path):
    user = json.loads(path.read_text())
    assert any(f"deepspeed_config: {rel(path)}" in c.read_text() for c in CONFIGS), f"no recipe uses {rel(path)}"
    # "auto" is HF Trainer's placeholder; to_deepspeed_config does not resolve it (int("auto") fails).
    assert "auto" not in [v for v in _values(user) if isinstance(v, str)]
    assert "scheduler" not in user, "a scheduler here silently replaces the trainer's warmup + decay schedule"
    assert not user.get("fp16", {}).get("enabled", False), "the recipes train in bf16"
    # The batch is the YAML's: micro x accumulation x world size is filled in from it.
    assert not {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"} & user.keys()
    assert "lr" not in user.get("optimizer", {}).get("params", {}), "the learning rate is training.lr"


@pytest.mark.parametrize("path", [p for p in CONFIGS if "deepspeed_config:" in p.read_text()], ids=rel)
def test_deepspeed_json_merges_without_contradicting_the_yaml(path, offline, at_repo_root):
    cfg = load(path)
    t = cfg.training
    merged = to_deepspeed_config(cfg, WORLD)
    assert merged["train_micro_batch_size_per_gpu"] == t.micro_batch_size
    assert merged["gradient_accumulation_steps"] == t.gradient_accumulation_steps
    assert merged["train_batch_size"] == t.micro_batch_size * t.gradient_accumulation_steps * WORLD
    assert merged["gradient_clipping"] == t.grad_clip
    assert merged["bf16"]["enabled"] is (t.precision == "bf16")
    assert merged["zero_optimization"]["stage"] == t.zero_stage
    params = merged["optimizer"]["params"]
    assert params["lr"] == t.lr and params["betas"] == list(t.betas) and params["weight_decay"] == t.weight_decay
    assert params["torch_adam"] is True and merged["optimizer"]["type"] == "AdamW"
    # DeepSpeed's own parser accepts it (its ZeRO section rejects unknown keys); a world of one here.
    from deepspeed.runtime.config import DeepSpeedConfig

    parsed = DeepSpeedConfig(to_deepspeed_config(cfg, 1))
    assert parsed.zero_optimization_stage == t.zero_stage
    assert parsed.gradient_clipping == t.grad_clip


# ---------------------------------------------------------------------------- launch scripts


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_launch_script_is_executable_bash_that_parses(script):
    assert script.stat().st_mode & stat.S_IXUSR, f"{rel(script)} is not executable"
    assert script.read_text().startswith("#!/usr/bin/env bash\n")
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_launch_script_references_existing_files(script):
    for ref in re.findall(r"recipes/[\w./-]+\.(?:sh|py|yaml|json|example)", script.read_text()):
        assert (REPO / ref).is_file(), f"{rel(script)} refers to missing {ref}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_launch_script_without_arguments_prints_usage(script):
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert result.returncode == 2 and "CONFIG.yaml" in result.stderr


@pytest.fixture
def fake_deepspeed(tmp_path):
    """A `deepspeed` on PATH that records its arguments and environment instead of launching."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "deepspeed_args.json"
    fake = bin_dir / "deepspeed"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f'"{sys.executable}" -c \'import json, os, sys; '
        f'json.dump({{"argv": sys.argv[1:], "cwd": os.getcwd(), "timeout": os.environ.get("DEEPSPEED_TIMEOUT")}}, '
        f'open("{record}", "w"))\' "$@"\n'
    )
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHON=sys.executable)
    for key in ("NUM_GPUS", "NUM_NODES", "GPUS_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "HOSTFILE", "DEEPSPEED_TIMEOUT"):
        env.pop(key, None)
    return env, record


def test_launch_8gpu_runs_the_documented_deepspeed_command(fake_deepspeed):
    env, record = fake_deepspeed
    config = "recipes/llama3.1-8b/eagle3.yaml"
    subprocess.run(
        ["bash", str(LAUNCH / "launch_8gpu.sh"), config, "training.max_steps=5"],
        cwd=REPO, env=env, check=True, capture_output=True, text=True,
    )
    call = json.loads(record.read_text())
    assert call["argv"] == [
        "--num_gpus", "8", "--master_port", "29500", "--module", "specgraft.train", str(REPO / config), "training.max_steps=5",
    ]
    assert Path(call["cwd"]) == REPO and call["timeout"] == "60"


def test_launch_multinode_runs_deepspeed_with_the_hostfile(fake_deepspeed, tmp_path):
    env, record = fake_deepspeed
    (tmp_path / "hostfile").write_text("# two nodes\nnode-a slots=8\nnode-b slots=8\n")
    # Never contacted: deepspeed is the stand-in. PYTHON=true skips the config check (tested above and below).
    env.update(MASTER_ADDR="10.0.0.1", PYTHON="true")
    config = REPO / "recipes/vicuna-7b/medusa.yaml"
    subprocess.run(
        ["bash", str(LAUNCH / "launch_multinode.sh"), str(config)],
        cwd=tmp_path, env=env, check=True, capture_output=True, text=True,
    )
    call = json.loads(record.read_text())
    assert call["argv"] == [
        "--hostfile", str(tmp_path / "hostfile"), "--num_nodes", "2", "--num_gpus", "8",
        "--master_addr", "10.0.0.1", "--master_port", "29500", "--module", "specgraft.train", str(config),
    ]
    assert Path(call["cwd"]) == REPO


def test_launch_refuses_a_bad_config_before_starting_deepspeed(fake_deepspeed):
    env, record = fake_deepspeed
    result = subprocess.run(
        ["bash", str(LAUNCH / "launch_8gpu.sh"), "recipes/qwen3-8b/eagle3.yaml", "training.lr=-1"],
        cwd=REPO, env=env, capture_output=True, text=True,
    )
    assert result.returncode != 0 and "training.lr" in result.stderr
    assert not record.exists(), "deepspeed ran despite an invalid config"


def test_launch_multinode_needs_a_hostfile(fake_deepspeed, tmp_path):
    env, record = fake_deepspeed
    result = subprocess.run(
        ["bash", str(LAUNCH / "launch_multinode.sh"), "recipes/qwen3-8b/eagle3.yaml"],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )
    assert result.returncode == 2 and "hostfile.example" in result.stderr and not record.exists()


def test_hostfile_example_parses_as_a_deepspeed_hostfile():
    from deepspeed.launcher.runner import _parse_hostfile

    hosts = _parse_hostfile((LAUNCH / "hostfile.example").read_text().splitlines())
    assert list(hosts.values()) == [8, 8]


# ---------------------------------------------------------------------------- data preparation


def _prepare_module():
    spec = importlib.util.spec_from_file_location("prepare_sharegpt_ultrachat", LAUNCH / "prepare_sharegpt_ultrachat.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SHAREGPT_ROWS = [
    {"id": "a1", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
                                   {"from": "human", "value": "more"}, {"from": "gpt", "value": "sure"}]},
    {"id": "a2", "conversations": []},
    {"id": "a3", "conversations": [{"from": "gpt", "value": "no question"}]},
]
ULTRACHAT_ROWS = [
    {"prompt_id": "p1", "prompt": "q", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                                  {"role": "user", "content": "q2"}]},
]


def test_prepare_keeps_source_formats_and_prefixes_ids():
    prep = _prepare_module()
    share = list(prep.sharegpt_records(SHAREGPT_ROWS))
    ultra = list(prep.ultrachat_records(ULTRACHAT_ROWS))
    assert [r["id"] for r in share] == ["sharegpt-a1"]  # no user turn: left out
    assert len(share[0]["conversations"]) == 4
    assert ultra == [{"id": "ultrachat-p1", "messages": ULTRACHAT_ROWS[0]["messages"]}]


def test_prepare_first_turn_only_and_limit():
    prep = _prepare_module()
    (share,) = prep.sharegpt_records(SHAREGPT_ROWS, first_turn_only=True)
    assert share["conversations"] == [{"from": "human", "value": "hi"}]
    (ultra,) = prep.ultrachat_records(ULTRACHAT_ROWS, first_turn_only=True)
    assert ultra["messages"] == [{"role": "user", "content": "q"}]
    assert list(prep.sharegpt_records(SHAREGPT_ROWS * 3, limit=2)) == list(prep.sharegpt_records(SHAREGPT_ROWS * 2))[:2]


def test_prepared_folder_is_a_valid_data_train_override(tmp_path, offline, at_repo_root):
    """The documented `data.train=<folder>` override: validates, and the folder reads as one source."""
    prep = _prepare_module()
    folder = tmp_path / "sharegpt-ultrachat"
    prep.write_jsonl(prep.sharegpt_records(SHAREGPT_ROWS), folder / "sharegpt.jsonl")
    prep.write_jsonl(prep.ultrachat_records(ULTRACHAT_ROWS), folder / "ultrachat.jsonl")
    cfg = load_config(RECIPES / "llama3.1-8b/eagle3.yaml", [f"data.train={folder}"])
    assert cfg.data.train == str(folder)

    from specgraft.train.data import load_records

    records = load_records(cfg.data.train, on_error=cfg.data.on_error)
    assert sorted(r["id"] for r in records) == ["sharegpt-a1", "ultrachat-p1"]
    assert all(r["messages"][0]["role"] == "user" for r in records)


def test_a_missing_local_data_override_is_an_error_naming_the_key(offline, at_repo_root):
    cfg = load_config(RECIPES / "llama3.1-8b/eagle3.yaml", ["data.train=runs/data/no-such-folder"])
    with pytest.raises(FileNotFoundError, match="llama3.1-8b/eagle3.yaml: data.train=.*no-such-folder"):
        check_files(cfg)


def test_a_bad_override_on_a_real_recipe_names_the_key(offline, at_repo_root):
    with pytest.raises(ConfigError, match="head.ttt_length"):
        load_config(RECIPES / "qwen3-8b/eagle3.yaml", ["head.ttt_length=0"])
