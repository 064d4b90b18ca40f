"""The bridge to vLLM without vLLM: flags, errors, counters and reports (tests/test_vllm.py runs vLLM itself)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from specgraft.tools.bench import parse_vllm
from specgraft.tools.bench_batch import batch_markdown, run_batch_sweep
from specgraft.tools.bench_server import parse_vllm_server
from specgraft.tools.vllm_engine import (
    VLLM_PYTHON_ENV, VLLMCall, VLLMEngine, head_type, spec_counters_from_prometheus, speculative_config, vllm_python,
)
from conftest import STORIES, needs_shared


def test_vllm_specs_parse_and_name_a_bad_part():
    assert parse_vllm("plain,chain:3, chain:1") == [None, 3, 1]
    for bad in ("chain", "chain:0", "tree:3", "plain,chain:x"):
        with pytest.raises(ValueError, match="is not 'plain' or 'chain:K'"):
            parse_vllm(bad)
    assert parse_vllm_server("eagle3=http://127.0.0.1:8001") == ("eagle3", "http://127.0.0.1:8001")
    for bad in ("http://127.0.0.1:8001", "x=127.0.0.1:8001", "=http://h"):
        with pytest.raises(ValueError, match="expected LABEL=URL"):
            parse_vllm_server(bad)


def test_a_missing_environment_names_the_command_that_builds_it(tmp_path, monkeypatch):
    monkeypatch.delenv(VLLM_PYTHON_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"bash benchmarks/vllm_env\.sh"):
        vllm_python()
    monkeypatch.setenv(VLLM_PYTHON_ENV, sys.executable)
    assert str(vllm_python()) == sys.executable


def test_bench_refuses_vllm_flags_in_the_wrong_mode_before_a_model_loads(tmp_path, capsys):
    from specgraft.cli import main

    prompts = tmp_path / "p.txt"
    prompts.write_text("Hi\n")
    common = ["--prompts", str(prompts), "--out", str(tmp_path / "out")]
    target = str(tmp_path)  # a directory that holds no model: loading it would fail otherwise
    assert main(["bench", "--target", target, "--vllm", "plain", *common]) == 2
    assert "--vllm runs with --batch-size" in capsys.readouterr().err
    assert main(["bench", "--target", target, "--vllm-server", "a=http://127.0.0.1:9", *common]) == 2
    assert "--vllm-server benches a vLLM server beside --server" in capsys.readouterr().err
    assert main(["bench", "--server", "http://127.0.0.1:9", "--vllm", "plain", *common]) == 2
    assert "--vllm apply to the offline bench" in capsys.readouterr().err


def test_the_worker_reports_a_failed_load_with_its_reason():
    """specgraft's own Python has no vllm: the worker answers with the import error and the host raises it."""
    with pytest.raises(RuntimeError, match="No module named 'vllm'"):
        VLLMEngine("/nonexistent", python=sys.executable, timeout_s=120)


def test_a_call_becomes_per_request_stats_from_vllms_histograms():
    call = VLLMCall(token_ids=[[5] * 10, [6] * 4], wall_s=1.0, ttft_s=[0.1, 0.2], decode_s=[0.9, None],
                    histograms=[[2, 1, 2, 0], [3, 0, 0, 0]])  # [j]: steps that accepted j drafts
    first, second = call.outputs()
    assert first.token_ids == [5] * 10
    assert first.stats.accept_length_histogram == [2, 1, 2]  # steps committing 1, 2, 3 tokens; trailing zero dropped
    assert first.stats.target_calls == 5 and first.stats.mean_accepted_length == pytest.approx((2 + 2 + 6) / 5)
    assert first.stats.tokens_per_s == pytest.approx(9 / 0.9) and first.stats.ttft_s == 0.1
    assert second.stats.accept_length_histogram == [3] and second.stats.tokens_per_s is None
    assert first.stats.itl_p50_s is None  # vLLM reports a request's first and last token times only
    plain = VLLMCall(token_ids=[[1, 2, 3]], wall_s=0.1, ttft_s=[0.01], decode_s=[0.02], histograms=[None]).outputs()[0]
    assert plain.stats.accept_length_histogram == [2] and plain.stats.mean_accepted_length == 1.0


def test_prometheus_counters_are_summed_over_labels():
    text = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 12.0',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 7.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 2.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 5.0',
        'vllm:num_requests_running{engine="0",model_name="m"} 0.0',
    ])
    assert spec_counters_from_prometheus(text) == {"drafts": 12.0, "accepted_tokens": 7.0, "accepted_per_pos": [5.0, 2.0]}


@needs_shared
def test_heads_name_their_vllm_method(stories, tmp_path):
    from specgraft.heads import build_head, save_head
    from specgraft.heads.configs import DistillConfig, Eagle3Config

    assert head_type(save_head(build_head(Eagle3Config(), stories), tmp_path / "e3", stories)) == "eagle3"
    assert head_type(save_head(build_head(DistillConfig(), stories), tmp_path / "dm", stories)) == "draft-model"
    assert speculative_config("draft-model", tmp_path / "dm", 2) == {
        "method": "draft_model", "model": str(tmp_path / "dm"), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="not a specgraft head directory"):
        head_type(STORIES)
    with pytest.raises(ValueError, match="no speculative method"):
        speculative_config("layer-skip", tmp_path, 2)


class EchoEngine:
    """Another engine for the batch bench: plain decoding's tokens (given), a fixed wall time per call."""

    engine_name = "echo"

    def __init__(self, reference) -> None:
        self.reference = reference

    def reserve(self, rows: int, length: int) -> None:
        pass

    def generate_batch(self, prompts, max_new_tokens, eos_token_id=None):
        from specgraft.infer import GenerationStats

        return [SimpleNamespace(token_ids=self.reference[tuple(p)], stats=GenerationStats(
            new_tokens=max_new_tokens, target_calls=max_new_tokens - 1, mean_accepted_length=1.0, ttft_s=0.01,
            itl_p50_s=None, itl_p99_s=None)) for p in prompts]


@needs_shared
def test_other_engines_run_in_the_batch_sweep_and_are_set_against_specgraft(stories):
    import specgraft as sg

    prompts = [[1, 400], [1, 300], [1, 200]]
    reference = {tuple(p): o.token_ids for p, o in zip(
        prompts, sg.SpeculativeGenerator(stories, None).generate_batch(prompts, max_new_tokens=6, eos_token_id=()))}
    results = run_batch_sweep(stories, [("plain", None, None), ("lookup", sg.PromptLookup(), None)], prompts, [1, 3], 6,
                              progress=False, engines=[("echo plain", EchoEngine(reference))])
    assert results["greedy_identical"]
    echo = [r for r in results["rows"] if r["method"] == "echo plain"]
    assert [r["engine"] for r in echo] == ["echo", "echo"] and echo[0]["itl_p50_s"] is None
    assert {r["engine"] for r in results["rows"] if r["method"] != "echo plain"} == {"specgraft"}
    markdown = batch_markdown(results)
    assert "Against echo plain (total tokens/s, specgraft's over its):" in markdown
    assert "| lookup |" in markdown.split("Against echo plain")[1] and "Best of each side at each size:" in markdown
    assert "| echo plain | 1 |" in markdown and "- / -" in markdown
