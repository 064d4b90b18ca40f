"""`specgraft quickstart` at toy sizes: every stage's artifacts, resume, failures, and a real target.

The toy demo target trains on a 200 KB slice of the stdlib for a few steps;
every stage takes seconds. The demo target's cache points into tmp_path
(never the user's cache directory).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from conftest import STORIES, needs_shared
from specgraft import cli
from specgraft.cli.flags import add_bench_arguments, add_quickstart_arguments
from specgraft.tools import quickstart as qs
from specgraft.tools.bench import bench_main
from specgraft.tools.bench_report import PLOTS
from specgraft.tools.stages import StageFailed, StageResult
from specgraft.tools import demo_target as dt

TOY_DEMO = dt.DemoTargetSpec(
    vocab_size=320, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, context=128, batch_size=4,
    steps=12, corpus_bytes=200_000,
)


def toy_config(out_dir: Path, cache_dir: Path, **overrides) -> qs.QuickstartConfig:
    sizes = dict(
        demo=TOY_DEMO, samples=12, sample_tokens=24, regenerate_batch=8, max_length=48, train_minutes=0.05,
        bench_prompts=2, max_new_tokens=16, progress=False,
    )
    return qs.QuickstartConfig(out_dir=out_dir, cache_dir=cache_dir, **(sizes | overrides))


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One toy quickstart on the demo target: (config, outputs, printed stage lines)."""
    root = tmp_path_factory.mktemp("quickstart")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(root / "xdg"))  # nothing may reach the real user cache
        cfg = toy_config(root / "run", root / "cache")
        lines: list[str] = []
        outputs = qs.run_quickstart(cfg, echo=lines.append)
    assert not (root / "xdg" / "specgraft").exists()
    return cfg, outputs, lines


def parser() -> argparse.ArgumentParser:
    return add_quickstart_arguments(argparse.ArgumentParser())


# ------------------------------------------------------------------------------------------ demo target


def test_corpus_is_stdlib_source_without_tests_gui_or_charmap_tables():
    paths = {f.path for f in dt.stdlib_files()}
    assert {"json/decoder.py", "argparse.py", "encodings/utf_8.py"} <= paths
    excluded = ("test/", "idlelib/", "tkinter/", "lib2to3/", "ensurepip/", "distutils/", "pydoc_data/")
    assert not [p for p in paths if p.startswith(excluded) or "/tests/" in p]
    assert "encodings/cp1252.py" not in paths and "encodings/mac_roman.py" not in paths


def test_function_openings_are_two_dedented_lines():
    source = dt.SourceFile("m.py", "class A:\n    def f(self, x):\n        return x\n\ndef g(): pass\n")
    assert dt.function_openings([source]) == ["class A:\n    def f(self, x):", "def f(self, x):\n    return x"]


def test_step_budget_shrinks_on_a_slow_clock_and_recovers():
    budget = dt.StepBudget(steps=100, max_seconds=10.0, check_every=10)
    budget.replan(10, elapsed=5.0)  # 0.5 s/step: 10 more fit
    assert budget.planned == 20
    budget.replan(20, elapsed=6.0)  # faster now: 0.3 s/step, 13 more fit
    assert budget.planned == 33
    budget.replan(30, elapsed=12.0)  # past the cap: stop at once
    assert budget.planned == 30


def test_demo_target_is_cached_by_settings(demo_run, tmp_path):
    cfg, outputs, _ = demo_run
    path = Path(outputs["target_path"])
    assert path.parent == cfg.cache_dir and not outputs["demo_cached"]
    info = json.loads((path / dt.TRAINING_FILE).read_text())
    assert info["settings"] == asdict(TOY_DEMO) and info["steps_done"] == TOY_DEMO.steps
    again = dt.ensure_demo_target(TOY_DEMO, cache_dir=cfg.cache_dir, progress=False)
    assert again.cached and again.path == path
    assert dt.cached_target_dir(dt.DemoTargetSpec(**(asdict(TOY_DEMO) | {"seed": 1})), cfg.cache_dir) != path


def test_an_incomplete_cached_target_is_trained_again(tmp_path):
    spec = dt.DemoTargetSpec(**(asdict(TOY_DEMO) | {"steps": 2}))
    first = dt.ensure_demo_target(spec, cache_dir=tmp_path, progress=False)
    (first.path / dt.TRAINING_FILE).unlink()  # as if training had died before the end
    second = dt.ensure_demo_target(spec, cache_dir=tmp_path, progress=False)
    assert not second.cached and (second.path / dt.TRAINING_FILE).is_file()


def test_demo_tokenizer_adds_bos_and_round_trips_code(demo_run):
    import specgraft as sg

    target = sg.load_target(demo_run[1]["target_path"])
    code = "def f(x):\n    return x . y  # spaces kept\n"
    ids = target.encode(code)
    assert ids[0] == target.tokenizer.bos_token_id and target.decode(ids) == code
    assert target.eos_token_ids == (target.tokenizer.eos_token_id,)


# ------------------------------------------------------------------------------------------ stages


def test_every_stage_leaves_its_artifacts(demo_run):
    cfg, outputs, lines = demo_run
    assert [line.split()[0] for line in lines] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    for stage in qs.STAGES:
        marker = json.loads((cfg.out_dir / qs.STAGE_DIR / f"{stage}.json").read_text())
        assert marker["stage"] == stage and marker["seconds"] >= 0
    records = [json.loads(line) for line in Path(outputs["data_file"]).read_text().splitlines()]
    assert len(records) == cfg.samples and all(r["text"] for r in records)
    assert sum(r["id"].startswith("bos-") for r in records) == cfg.samples // 2
    bench_prompts = Path(outputs["bench_prompts_file"]).read_text().splitlines()
    assert len(bench_prompts) == cfg.bench_prompts
    assert not {json.loads(p)["turns"][0] for p in bench_prompts} & {r["text"] for r in records}
    head = Path(outputs["head_dir"])
    assert (head / "config.json").is_file() and (head / "model.safetensors").is_file()
    bench = Path(outputs["bench_dir"])
    assert all((bench / name).is_file() for name in ("results.json", "results.md", *PLOTS))


def test_bench_reports_identical_greedy_output(demo_run):
    cfg, outputs, _ = demo_run
    results = json.loads(Path(outputs["results_file"]).read_text())
    assert results["greedy_identical"] and not results["mismatches"]
    names = [m["method"] for m in results["methods"]]
    assert names == ["plain", "hf"] + [f"{qs.HEAD_RUN} {tree}" for tree in cfg.trees]
    report = qs.report(cfg, outputs)
    assert f"| {qs.HEAD_RUN} chain:5 |" in report and "Mean accepted length" in report and qs.DEMO_NOTE in report


def test_the_report_says_so_where_a_method_verified_no_step(demo_run, tmp_path):
    """A method whose outputs were only EOS has no mean accepted length (null in results.json): the report says so
    instead of failing on it or printing 0.00."""
    cfg, outputs, _ = demo_run
    results = json.loads(Path(outputs["results_file"]).read_text())
    method = next(m for m in results["methods"] if m["method"] not in ("plain", "hf"))
    method["mean_accepted_length"] = None
    (tmp_path / "results.json").write_text(json.dumps(results))
    report = qs.report(cfg, {**outputs, "results_file": str(tmp_path / "results.json")})
    assert f"{method['method']} n/a (no steps)" in report


def test_resume_reuses_every_finished_stage(demo_run, monkeypatch):
    cfg, outputs, _ = demo_run
    for stage in qs.STAGES:
        monkeypatch.setitem(qs.STAGE_FUNCTIONS, stage, lambda *a, stage=stage: pytest.fail(f"{stage} ran again"))
    lines: list[str] = []
    again = qs.run_quickstart(toy_config(cfg.out_dir, cfg.cache_dir, resume=True), echo=lines.append)
    assert all("reused" in line for line in lines) and again["head_dir"] == outputs["head_dir"]


def test_resume_reruns_from_the_first_changed_or_missing_stage(monkeypatch, tmp_path):
    out = tmp_path / "run"
    ran: list[str] = []

    def fake(stage):
        def run(config, previous, continue_partial):
            ran.append(stage)
            artifact = out / f"{stage}.txt"
            artifact.write_text(stage)
            return StageResult({f"{stage}_file": str(artifact)}, "fake", artifacts=[str(artifact)])
        return run

    for stage in qs.STAGES:
        monkeypatch.setitem(qs.STAGE_FUNCTIONS, stage, fake(stage))
    quiet = dict(echo=lambda line: None)
    qs.run_quickstart(toy_config(out, tmp_path), **quiet)
    assert ran == list(qs.STAGES)
    ran.clear()
    qs.run_quickstart(toy_config(out, tmp_path, resume=True, train_minutes=0.1), **quiet)
    assert ran == ["train", "bench"]
    ran.clear()
    (out / "data.txt").unlink()
    lines: list[str] = []
    qs.run_quickstart(toy_config(out, tmp_path, resume=True, train_minutes=0.1), echo=lines.append)
    assert ran == ["data", "train", "bench"] and "data.txt is gone" in lines[1]
    ran.clear()
    qs.run_quickstart(toy_config(out, tmp_path, train_minutes=0.1), **quiet)
    assert ran == list(qs.STAGES)  # without --resume everything runs again


def test_an_interrupted_stage_continues_its_work_only_with_the_same_settings(demo_run, monkeypatch, tmp_path):
    cfg, _, _ = demo_run
    out = tmp_path / "run"
    (out / qs.STAGE_DIR).mkdir(parents=True)
    target_marker = cfg.out_dir / qs.STAGE_DIR / "target.json"
    (out / qs.STAGE_DIR / "target.json").write_text(target_marker.read_text())
    calls: list[bool] = []

    def interrupted(config, previous, continue_partial):
        calls.append(continue_partial)
        raise KeyboardInterrupt

    monkeypatch.setitem(qs.STAGE_FUNCTIONS, "data", interrupted)
    for overrides in ({}, {}, {"samples": 13}, {}):
        with pytest.raises(StageFailed, match="stage 'data' failed"):
            qs.run_quickstart(toy_config(out, cfg.cache_dir, resume=True, **overrides), echo=lambda line: None)
    assert calls == [False, True, False, False]  # the last run's settings differ from the third's


def test_a_failing_stage_is_named_with_the_resume_command(monkeypatch, tmp_path, capsys):
    def broken(config, previous, continue_partial):
        raise ValueError("no space left for the head")

    monkeypatch.setitem(qs.STAGE_FUNCTIONS, "target", broken)
    args = parser().parse_args(["--out", str(tmp_path / "run"), "--samples", "40", "--tree", "chain:3"])
    assert cli.cmd_quickstart(args) == 1
    err = capsys.readouterr().err
    assert "stage 'target' failed" in err and "no space left for the head" in err
    assert f"{qs.specgraft_command()} quickstart --out {tmp_path / 'run'} --samples 40 --tree chain:3 --resume" in err
    assert not (tmp_path / "run" / qs.STAGE_DIR / "target.json").exists()


def test_bad_sizes_fail_before_any_stage(tmp_path):
    with pytest.raises(ValueError, match="samples=0"):
        cli.config_from_args(parser().parse_args(["--out", str(tmp_path), "--samples", "0"]))
    with pytest.raises(ValueError, match="--prompts needs --target"):
        qs.QuickstartConfig(out_dir=tmp_path, prompts=__file__)


# ------------------------------------------------------------------------------------------ a real target


@needs_shared
def test_stories260k_quickstart_matches_specgraft_bench(tmp_path, capsys):
    out = tmp_path / "run"
    args = parser().parse_args([
        "--target", str(STORIES), "--samples", "8", "--train-minutes", "0.05", "--max-new-tokens", "16",
        "--bench-prompts", "2", "--out", str(out),
    ])
    assert cli.cmd_quickstart(args) == 0
    printed = capsys.readouterr().out
    assert "[4/4] bench" in printed and "Greedy outputs identical to `hf`: yes." in printed
    assert qs.DEMO_NOTE not in printed
    ours = json.loads((out / "bench" / "results.json").read_text())

    command = next(line for line in printed.splitlines() if line.startswith("Same benchmark again: "))
    argv = command.removeprefix("Same benchmark again: ").split()[2:]  # drop "specgraft bench"
    assert bench_main(add_bench_arguments(argparse.ArgumentParser()).parse_args(argv)) == 0
    theirs = json.loads((out / "bench-again" / "results.json").read_text())
    assert [m["method"] for m in theirs["methods"]] == [m["method"] for m in ours["methods"]]
    for a, b in zip(ours["methods"], theirs["methods"]):
        assert (a["new_tokens"], a["target_calls"], a["mean_accepted_length"]) == (
            b["new_tokens"], b["target_calls"], b["mean_accepted_length"])
    assert [r["new_tokens"] for r in ours["per_prompt"]] == [r["new_tokens"] for r in theirs["per_prompt"]]


# ------------------------------------------------------------------------------------------ a newcomer's mistakes


def test_a_missing_target_path_fails_before_the_run_directory_exists(tmp_path):
    with pytest.raises(FileNotFoundError, match="--target './no-such-model' is not a directory"):
        cli.config_from_args(parser().parse_args(["--target", "./no-such-model", "--out", str(tmp_path / "run")]))
    assert not (tmp_path / "run").exists()


@needs_shared
def test_a_symlinked_target_is_recorded_as_the_path_given(tmp_path, monkeypatch):
    """The run's target (which the head and the printed commands name) is the link, made absolute, not its end."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "stories").symlink_to(STORIES, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    result = qs.stage_target(qs.QuickstartConfig(out_dir=tmp_path / "run", target="models/stories"), {})
    assert result.outputs["target_path"] == str(tmp_path / "models" / "stories")


def test_a_target_that_cannot_load_leaves_nothing_to_resume(tmp_path, capsys):
    # A hub id, not a path: only loading it (offline here) can tell.
    args = parser().parse_args(["--target", "no-such-org/no-such-model", "--out", str(tmp_path / "run")])
    assert cli.cmd_quickstart(args) == 1
    err = capsys.readouterr().err
    assert "stage 'target' failed" in err and "check --target" in err
    assert "--resume" not in err and not (tmp_path / "run").exists()


def test_retrain_target_replaces_a_cached_one_cut_short_by_the_cap(tmp_path):
    spec = dt.DemoTargetSpec(**(asdict(TOY_DEMO) | {"steps": 2}))
    first = dt.ensure_demo_target(spec, cache_dir=tmp_path, progress=False)
    info = json.loads((first.path / dt.TRAINING_FILE).read_text())
    (first.path / dt.TRAINING_FILE).write_text(json.dumps(info | {"cut_by_wall_clock": True, "steps_done": 1}))
    cached = qs.stage_target(toy_config(tmp_path / "run", tmp_path, demo=spec), {})
    assert "cut to 1 of 2 steps" in cached.summary and "--retrain-target --demo-minutes" in cached.summary
    args = parser().parse_args(["--retrain-target", "--demo-minutes", "9"])
    assert (args.retrain_target, args.demo_minutes) == (True, 9.0)
    again = qs.stage_target(toy_config(tmp_path / "run", tmp_path, demo=spec, retrain_target=True), {})
    assert not again.outputs["demo_cached"] and "cut to" not in again.summary
    assert json.loads((first.path / dt.TRAINING_FILE).read_text())["steps_done"] == 2


def test_printed_commands_work_without_activating_the_venv(monkeypatch, tmp_path):
    script = Path(sys.executable).parent / "specgraft"
    if not script.is_file():
        pytest.skip(f"no specgraft script beside {script.parent} (not installed in a venv)")
    monkeypatch.chdir(script.parent.parent.parent)  # the repository root, where the README's venv is .venv
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert qs.specgraft_command() == os.path.relpath(script)  # .venv/bin/specgraft after the README's set-up
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin")
    assert qs.specgraft_command() == "specgraft"


# ------------------------------------------------------------------------------------------ where it writes


def test_the_default_run_directory_is_runs_quickstart_which_git_ignores(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.config_from_args(parser().parse_args([])).out_dir == tmp_path / "runs" / "quickstart"
    ignored = (Path(__file__).resolve().parents[1] / ".gitignore").read_text().splitlines()
    assert "runs/" in ignored  # a quickstart run from the repository root leaves nothing for git to show


def test_the_first_and_last_lines_say_where_the_run_writes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)

    def run_quickstart(cfg, echo):  # the stages' work: 2.5 MB in the run directory
        cfg.out_dir.mkdir(parents=True)
        (cfg.out_dir / "head.bin").write_bytes(b"x" * 2_500_000)
        return {}

    monkeypatch.setattr(qs, "run_quickstart", run_quickstart)
    monkeypatch.setattr(qs, "report", lambda cfg, outputs: "the report")
    assert cli.cmd_quickstart(parser().parse_args(["--cache-dir", str(tmp_path / "cache")])) == 0
    lines = capsys.readouterr().out.splitlines()
    cached = tmp_path / "cache" / f"demo-target-{qs.QuickstartConfig().demo.key()}"
    assert lines[0] == ("specgraft quickstart: writing data, a head and a benchmark to runs/quickstart "
                        "(target: the demo target, trained once and cached in cache/" + cached.name + ")")
    assert lines[-1] == ("specgraft quickstart: this run's files are in runs/quickstart (2.5 MB); "
                         "the demo target stays cached in cache/" + cached.name)


def test_a_named_target_and_out_directory_are_named_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = qs.QuickstartConfig(out_dir=tmp_path.parent / "elsewhere", target="HuggingFaceTB/SmolLM2-135M")
    assert qs.opening_line(cfg) == (f"specgraft quickstart: writing data, a head and a benchmark to "
                                    f"{tmp_path.parent / 'elsewhere'} (target: HuggingFaceTB/SmolLM2-135M)")
    cfg.out_dir.mkdir()
    assert qs.closing_line(cfg) == f"specgraft quickstart: this run's files are in {tmp_path.parent / 'elsewhere'} (0.0 MB)"
