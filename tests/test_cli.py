"""The command line a newcomer meets first: fast help, flags that say what they take, errors before loading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import STORIES, needs_shared
import specgraft as sg
from specgraft.cli import COMMANDS, build_parser, main

SPECGRAFT = Path(sys.executable).parent / "specgraft"


def test_help_loads_neither_torch_nor_transformers():
    code = (
        "import sys, contextlib, io\n"
        "from specgraft.cli import main\n"
        "for argv in (['--help'], ['generate', '--help'], ['check-exactness', '--help'], ['tune-tree', '--help'], "
        "['train', '--help'], ['quickstart', '--help'], ['bench', '--help'], ['serve', '--help'], "
        "['export', '--help'], ['import-head', '--help']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        main(argv)\n"
        "print(sorted(m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("command", ["generate", "check-exactness", "tune-tree"])
def test_model_flags_name_every_drafter_and_tree_form(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for form in ("dynamic:TOP_K,DEPTH,BUDGET", "static:FILE.json", "chain:DEPTH", "a tree file written by",
                 "trained head directory", "prompt-lookup", "'auto'"):
        assert form in text, form


def test_every_command_builds_its_flags_and_entry_point():
    parser = build_parser()  # every command's flags at once (main builds only the chosen one's)
    args = parser.parse_args(["bench", "--target", "t", "--prompts", "p.jsonl", "--out", "o"])
    assert args.func.__name__ == "cmd_bench" and args.threads == "auto"
    for name in COMMANDS:
        assert parser._subparsers._group_actions[0].choices[name].get_default("func") is not None, name


def test_a_missing_drafter_is_named_before_the_target_loads(capsys):
    # The target does not exist either: the drafter's error must come first, so no model was loaded.
    code = main(["generate", "--target", "/nonexistent/target", "--drafter", "runs/missing/head", "--prompt", "x"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--drafter 'runs/missing/head' does not exist" in err and "trained head directory" in err


def test_check_exactness_refuses_a_length_too_short_for_any_draft_before_loading(capsys):
    code = main(["check-exactness", "--target", "/nonexistent/target", "--drafter", "prompt-lookup", "--length", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "--length 2" in err and "at least 3 tokens" in err


def test_threads_flag_takes_auto_or_a_count(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--target", "t", "--prompt", "x", "--threads", "0"])
    assert "argument --threads: expected 'auto' or a positive int, got '0'" in capsys.readouterr().err


def test_a_bad_tree_file_names_the_file_and_the_key(tmp_path, capsys):
    tree = tmp_path / "tree.json"
    tree.write_text('{"kind": "dynamic", "top_k": "x", "depth": 5, "budget": 10}')
    assert main(["generate", "--target", "t", "--prompt", "x", "--tree", str(tree)]) == 2
    assert f"tree file {tree}: 'top_k' must be an integer, got 'x'" in capsys.readouterr().err


@needs_shared
def test_a_truncated_target_is_one_line_not_a_traceback(tmp_path, capsys):
    target = tmp_path / "target"
    target.mkdir()
    for f in STORIES.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert main(["generate", "--target", str(target), "--drafter", "none", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"could not load target {str(target)!r}: a .safetensors file there is truncated or corrupt" in err


# -- a misspelt flag: named, with the closest real one, under the command's own usage -------------------------


def test_a_misspelt_flag_is_named_with_the_closest_one_under_the_commands_usage(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["generate", "--promt", "hi"])
    err = capsys.readouterr().err
    assert exit.value.code == 2
    assert err.startswith("usage: specgraft generate ")
    assert err.endswith("specgraft generate: error: unrecognized flag --promt (did you mean --prompt?)\n")
    assert "required" not in err  # not "the following arguments are required: --prompt"


def long_flags(command: str) -> list[str]:
    parser = build_parser(command)._subparsers._group_actions[0].choices[command]
    return [f for a in parser._actions if a.help != "==SUPPRESS==" for f in a.option_strings if f.startswith("--")]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_suggests_its_own_flag_for_a_misspelt_one(command, capsys):
    flag = max((f for f in long_flags(command) if f != "--help"), key=len, default="--help")
    misspelt = flag[:-2] + flag[-1]  # one letter dropped
    with pytest.raises(SystemExit):
        main([command, misspelt, "1"])
    err = capsys.readouterr().err
    assert err.startswith(f"usage: specgraft {command} ")
    assert f"specgraft {command}: error: unrecognized flag {misspelt} (did you mean {flag}?)" in err


def test_a_flag_nothing_resembles_points_to_the_commands_help(capsys):
    with pytest.raises(SystemExit):
        main(["train", "recipe.yaml", "--lr", "3"])
    err = capsys.readouterr().err
    assert err.startswith("usage: specgraft train ")
    assert "specgraft train: error: unrecognized flag --lr (see specgraft train --help)" in err


def test_a_stray_word_is_refused_under_the_commands_usage(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--target", "t", "--prompt", "x", "stray"])
    err = capsys.readouterr().err
    assert err.startswith("usage: specgraft generate ")
    assert "specgraft generate: error: unrecognized arguments: stray" in err


def test_negative_numbers_prefixes_and_flag_values_still_parse():
    args = build_parser("generate").parse_args(
        ["generate", "--target", "t", "--prompt", "x", "--temperature", "-0.5", "--max-new", "7", "--seed=-3"]
    )
    assert (args.temperature, args.max_new_tokens, args.seed) == (-0.5, 7, -3)
    args = build_parser("train").parse_args(["train", "r.yaml", "training.lr=1e-3", "--local_rank=0"])
    assert args.overrides == ["training.lr=1e-3"] and args.local_rank == 0


# -- a path that is not there: one line naming the flag, before torch loads ---------------------------------

# main() in a fresh interpreter; prints its exit code and whether torch was imported by the time it returned.
MAIN_WITHOUT_TORCH = (
    "import sys\n"
    "from specgraft.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "print(code, 'torch' in sys.modules)\n"
)


@pytest.mark.parametrize("argv, flag", [
    (["generate", "--target", "MISSING", "--prompt", "hi"], "--target"),
    (["check-exactness", "--target", "MISSING"], "--target"),
    (["tune-tree", "--target", "MISSING", "--prompts", "PROMPTS", "--out", "t.json"], "--target"),
    (["search-layer-skip", "--target", "MISSING", "--prompts", "PROMPTS"], "--target"),
    (["bench", "--target", "MISSING", "--prompts", "PROMPTS", "--out", "o"], "--target"),
    (["bench", "--target", "t", "--method", "MISSING", "chain:3", "--prompts", "PROMPTS", "--out", "o"], "--drafter"),
    (["serve", "--target", "MISSING"], "--target"),
    (["export", "MISSING", "out", "--to", "vllm"], "head_dir"),
    (["export", "HERE", "out", "--to", "vllm", "--target", "MISSING"], "--target"),
    (["import-head", "MISSING", "out", "--format", "eagle", "--target", "t"], "src_dir"),
    (["import-head", "HERE", "out", "--format", "eagle", "--target", "MISSING"], "--target"),
])
def test_a_missing_target_or_head_is_refused_before_torch_loads(tmp_path, argv, flag):
    missing = str(tmp_path / "no" / "such")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    where = {"MISSING": missing, "PROMPTS": str(prompts), "HERE": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", MAIN_WITHOUT_TORCH, *(where.get(a, a) for a in argv)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.stdout.split() == ["2", "False"], run.stderr
    first = run.stderr.splitlines()[0]
    assert first.startswith(f"specgraft {argv[0]}: error: {flag} ") and f"{missing!r} does not exist" in first
    if flag != "--drafter":  # the drafter's error goes on to list every drafter form
        assert run.stderr.count("\n") == 1


@pytest.mark.parametrize("command", ["train", "regenerate", "extract-features"])
@pytest.mark.parametrize("named_by", ["the file", "an override"])
def test_a_config_whose_target_path_is_not_there_is_refused_before_torch_loads(tmp_path, command, named_by):
    """The config commands refuse a local target.path that is not there in one line naming the key, the path and
    the config file, before torch loads, whether the file or a ``target.path=`` override names it."""
    missing = str(tmp_path / "no" / "such")
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"text": "Once upon a time"}) + "\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({  # JSON is YAML
        "target": {"path": missing if named_by == "the file" else str(tmp_path)}, "head": {"type": "medusa"},
        "data": {"train": str(data)}, "training": {"output_dir": str(tmp_path / "run")},
    }))
    overrides = [] if named_by == "the file" else [f"target.path={missing}"]
    run = subprocess.run([sys.executable, "-c", MAIN_WITHOUT_TORCH, command, str(recipe), *overrides],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.stdout.split() == ["2", "False"], run.stderr
    assert run.stderr.startswith(f"specgraft {command}: error: {recipe}: target.path={missing!r}: directory {missing} "
                                 "does not exist") and run.stderr.count("\n") == 1


def test_a_target_path_override_is_what_the_config_commands_check(tmp_path):
    """An override that names an existing target replaces the file's missing one: the next missing file is named."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({
        "target": {"path": str(tmp_path / "no" / "such")}, "head": {"type": "medusa"},
        "data": {"train": str(tmp_path / "train.jsonl")}, "training": {"output_dir": str(tmp_path / "run")},
    }))
    run = subprocess.run([sys.executable, "-c", MAIN_WITHOUT_TORCH, "train", str(recipe), f"target.path={tmp_path}"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.stdout.split() == ["2", "False"], run.stderr
    assert run.stderr.startswith(f"specgraft train: error: {recipe}: data.train=") and "target.path" not in run.stderr


def test_a_file_given_for_a_head_directory_says_so(tmp_path, capsys):
    head = tmp_path / "config.json"
    head.write_text("{}")
    assert main(["export", str(head), str(tmp_path / "out"), "--to", "vllm"]) == 2
    assert capsys.readouterr().err == f"specgraft export: error: head_dir {str(head)!r} is a file, not a directory\n"


@needs_shared
def test_a_head_trained_on_a_symlinked_target_names_the_link_it_was_given(tmp_path, capsys):
    """The head records the target path as written, and export's printed command names it; the head still
    loads beside the target reached through its real path (the check is by sizes and embedding, not by name)."""
    from specgraft.heads import drafter_from_spec

    link = tmp_path / "models" / "stories"
    link.parent.mkdir()
    link.symlink_to(STORIES, target_is_directory=True)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": f"Once upon a time there was cat number {i}."}) + "\n" for i in range(8)))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({  # JSON is YAML
        "target": {"path": str(link)}, "head": {"type": "medusa", "num_heads": 2},
        "data": {"train": str(data), "max_length": 16},
        "training": {"max_steps": 1, "micro_batch_size": 4, "save_every": 0, "num_threads": 1,
                     "output_dir": str(tmp_path / "run")},
    }))
    assert main(["train", str(recipe)]) == 0
    head = Path(capsys.readouterr().out.split("head written to ")[1].strip())
    assert json.loads((head / "config.json").read_text())["target"]["name"] == str(link)
    assert main(["export", str(head), str(tmp_path / "vllm"), "--to", "vllm"]) == 0
    command = capsys.readouterr().out
    assert f"vllm serve {link}" in command and str(STORIES.resolve()) not in command
    drafter_from_spec(str(head), sg.load_target(STORIES.resolve()))


def test_train_does_not_warn_that_deepspeed_fell_back_to_the_cpu(tmp_path):
    # `specgraft train` on a config that runs, its training replaced by what the trainer does first: ask DeepSpeed for
    # its accelerator. (A config that is refused never gets that far, nor imports torch.)
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"text": "Once upon a time"}) + "\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({"target": {"path": str(tmp_path)}, "head": {"type": "medusa"},
                                  "data": {"train": str(data)}, "training": {"output_dir": str(tmp_path / "run")}}))
    code = (
        "import sys, types\n"
        "from specgraft.cli import main\n"
        "def run_training(cfg):\n"
        "    from deepspeed.accelerator import get_accelerator\n"
        "    print(get_accelerator().device_name())\n"
        "    return 'head'\n"
        "sys.modules['specgraft.train.pipeline'] = types.SimpleNamespace(run_training=run_training)\n"
        f"assert main(['train', {str(recipe)!r}]) == 0\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"} | {"CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["cpu", "head written to head"]
    assert "Setting accelerator to CPU" not in run.stderr + run.stdout


@pytest.mark.parametrize("text, message", [
    ('{"kind": "chain"}', "a chain tree needs 'depth'"),
    ('{"kind": "chain", "depth": 0}', "Chain depth must be >= 1, got 0"),
    ('[["x"]]', "path ['x'] must hold integer sibling ranks"),
    ('[[0, 0]]', "StaticTree path [0, 0] is listed without its prefix [0]"),
])
def test_tree_file_errors_name_the_file(tmp_path, text, message):
    import specgraft as sg

    tree = tmp_path / "tree.json"
    tree.write_text(text)
    with pytest.raises(ValueError) as err:
        sg.parse_tree_spec(str(tree))
    assert str(err.value).startswith(f"tree file {tree}: {message}")


@pytest.mark.parametrize(("plain_p", "speculative_p", "verdict"), [
    (0.5, 0.5, "PASS: speculative sampling matches"),
    (0.5, 1e-4, "FAIL: speculative sampling does NOT match"),
    (1e-4, 0.5, "FAIL: plain sampling itself failed the test"),
])
def test_check_exactness_states_its_rule_and_exits_non_zero_on_any_failure(monkeypatch, capsys, plain_p, speculative_p,
                                                                          verdict):
    import specgraft
    import specgraft.cli as cli
    from specgraft.tools import exactness

    def report(p: float) -> exactness.Fit:
        return exactness.Fit(p_value=p, tv=0.01, tv_bound=0.05, n=100)

    reports = [exactness.PromptReport("Once", 4, report(plain_p), report(speculative_p), 1.5)]
    monkeypatch.setattr(cli, "_load", lambda args: (None, None, None))  # no model: the reports are given
    monkeypatch.setattr(specgraft, "SpeculativeGenerator", lambda *a, **k: None)
    monkeypatch.setattr(exactness, "check_exactness", lambda *a, **k: reports)
    code = main(["check-exactness", "--target", "t", "--prompt", "Once"])
    out = capsys.readouterr().out
    assert code == (0 if verdict.startswith("PASS") else 1)
    assert verdict in out
    assert "p-value is at most 0.001" in out and "'plain' is the target sampling alone" in out
    assert "fails any of these 2 tests with probability at most 0.004" in out


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_generate_chat_sends_the_prompt_in_the_chat_template(stories, monkeypatch, capsys):
    import specgraft.cli as cli
    from specgraft.tools.prompts import encode_prompt

    monkeypatch.setattr(stories.tokenizer, "chat_template", CHATML, raising=False)
    monkeypatch.setattr(cli, "_load", lambda args: (stories, None, None))
    assert main(["generate", "--target", "t", "--drafter", "none", "--prompt", "Hi", "--chat", "--json",
                 "--max-new-tokens", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = sg.SpeculativeGenerator(stories, None).generate(encode_prompt(stories, "Hi"), max_new_tokens=4)
    assert out["token_ids"] == expected.token_ids
    assert encode_prompt(stories, "Hi") != stories.encode("Hi")  # the template was applied
    assert main(["generate", "--target", "t", "--drafter", "none", "--prompt", "Hi", "--max-new-tokens", "2"]) == 0
    assert "is a chat model and --prompt goes to it as raw text; --chat sends it" in capsys.readouterr().err


def test_generate_chat_without_a_template_is_refused(stories, monkeypatch, capsys):
    import specgraft.cli as cli

    monkeypatch.setattr(cli, "_load", lambda args: (stories, None, None))
    assert main(["generate", "--target", "t", "--prompt", "Hi", "--chat"]) == 2
    assert "has no chat template" in capsys.readouterr().err


def test_generate_says_when_the_output_is_only_end_of_sequence(stories, monkeypatch, capsys):
    import specgraft.cli as cli
    from specgraft.model import Target

    first = sg.SpeculativeGenerator(stories, None).generate("Once upon a time", max_new_tokens=1).token_ids[0]
    monkeypatch.setattr(Target, "eos_token_ids", property(lambda self: (first,)))
    monkeypatch.setattr(cli, "_load", lambda args: (stories, None, None))
    assert main(["generate", "--target", "t", "--drafter", "none", "--prompt", "Once upon a time"]) == 0
    err = capsys.readouterr().err
    assert f"the output is only the end-of-sequence token [{first}]" in err
    assert "mean accepted length n/a (no steps)" in err and "mean accepted length 0.00" not in err  # no step verified


def test_generate_reports_its_threads(stories, monkeypatch, capsys):
    import specgraft
    from specgraft.threads import ThreadChoice

    monkeypatch.setattr(specgraft, "load_target", lambda *a, **k: stories)
    monkeypatch.setattr(stories, "threads", ThreadChoice(1, "auto: a test"))
    assert main(["generate", "--target", "t", "--drafter", "none", "--prompt", "Once", "--max-new-tokens", "2"]) == 0
    assert "threads: 1 (auto: a test)" in capsys.readouterr().err
