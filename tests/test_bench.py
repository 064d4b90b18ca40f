"""`specgraft bench`: prompt-file readers, stats aggregation, the greedy cross-check, reports and flags.

Runs on stories260K with two or three prompts and 16 new tokens; timings are
never asserted, only the bookkeeping around them.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json

import pytest
import torch
from conftest import DEV_PROMPTS, SHARED, STORIES, ctrl_c_at_call

import specgraft as sg
from specgraft.heads import build_head, save_head
from specgraft.heads.configs import MedusaConfig
from specgraft.cli.flags import add_bench_arguments
from specgraft.tools.bench import (
    acceptance_by_depth, aggregate, bench_main, build_drafter, expand_sweep, first_difference, run_bench, tree_label,
)
from specgraft.tools.bench_report import PLOTS
from specgraft.tools.bench_runners import (
    HF_GREEDY, STATS_KEYS, ChunkClock, Runner, engine_runner, hf_runner, hf_sampling, parse_baseline,
)
from specgraft.tools.prompts import BenchPrompt, encode_prompt, read_prompt_file
from specgraft.tree import DynamicTree

N = 16  # new tokens per run: enough for drafts to be accepted and rejected
PROMPTS = [
    BenchPrompt("0", "story", "Once upon a time, there was a little dog named"),
    BenchPrompt("1", "story", "Tom had a red ball. He liked to"),
]


def _write_jsonl(path, records, *, gz=False):
    text = "".join(json.dumps(r) + "\n" for r in records)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


# ------------------------------------------------------------------------------------------ prompt files


def test_reads_spec_bench_and_mt_bench_first_turns(tmp_path):
    path = _write_jsonl(tmp_path / "q.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
        {"question_id": 82, "category": "math", "turns": ["What is 2+2?"]},
    ])
    assert read_prompt_file(path) == [
        BenchPrompt("81", "writing", "Write a poem."),
        BenchPrompt("82", "math", "What is 2+2?"),
    ]


@pytest.mark.parametrize("gz", [False, True], ids=["jsonl", "jsonl.gz"])
def test_reads_humaneval(tmp_path, gz):
    name = "HumanEval.jsonl.gz" if gz else "HumanEval.jsonl"
    path = _write_jsonl(tmp_path / name, [
        {"task_id": "HumanEval/0", "prompt": "def add(a, b):\n", "entry_point": "add"},
        {"task_id": "HumanEval/1", "prompt": "def sub(a, b):\n", "entry_point": "sub"},
    ], gz=gz)
    assert read_prompt_file(path) == [
        BenchPrompt("HumanEval/0", "humaneval", "def add(a, b):\n"),
        BenchPrompt("HumanEval/1", "humaneval", "def sub(a, b):\n"),
    ]


def test_reads_gsm8k_with_line_numbers_as_ids(tmp_path):
    path = _write_jsonl(tmp_path / "gsm8k.jsonl", [
        {"question": "Janet has 3 ducks.", "answer": "#### 3"},
        {"question": "A robe takes 2 bolts.", "answer": "#### 3"},
    ])
    assert read_prompt_file(path) == [
        BenchPrompt("1", "gsm8k", "Janet has 3 ducks."),
        BenchPrompt("2", "gsm8k", "A robe takes 2 bolts."),
    ]


def test_reads_plain_text_one_prompt_per_line_skipping_blank_lines(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("Once upon a time\n\n  \nThe cat sat\n")
    assert read_prompt_file(path) == [BenchPrompt("1", "text", "Once upon a time"), BenchPrompt("4", "text", "The cat sat")]


def test_json_lines_are_detected_from_the_records_whatever_the_suffix(tmp_path):
    path = _write_jsonl(tmp_path / "questions.txt", [{"question": "Why?"}])
    assert read_prompt_file(path) == [BenchPrompt("1", "gsm8k", "Why?")]


def test_reads_training_data_text_records(tmp_path):
    path = _write_jsonl(tmp_path / "openings.jsonl", [{"id": "opening-0", "text": "Anna was sad."}, {"text": "A duck"}])
    assert read_prompt_file(path) == [BenchPrompt("opening-0", "text", "Anna was sad."), BenchPrompt("2", "text", "A duck")]


def test_limit_keeps_the_first_prompts(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("a\nb\nc\n")
    assert [p.text for p in read_prompt_file(path, limit=2)] == ["a", "b"]


def test_per_category_keeps_the_first_prompts_of_each_category_then_the_limit(tmp_path):
    records = [{"question_id": i, "category": c, "turns": [f"q{i}"]} for i, c in enumerate("aabbbcab")]
    path = _write_jsonl(tmp_path / "q.jsonl", records)
    assert [p.id for p in read_prompt_file(path, per_category=2)] == ["0", "1", "2", "3", "5"]
    assert [p.id for p in read_prompt_file(path, per_category=1, limit=2)] == ["0", "2"]
    with pytest.raises(ValueError, match="per_category must be >= 1, got 0"):
        read_prompt_file(path, per_category=0)


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"turns": ["ok"', "not valid JSON"),
        ('{"content": "no known key"}', "unknown record format"),
        ('{"text": ""}', "non-empty string"),
        ('{"turns": []}', "non-empty list"),
        ('{"prompt": 3}', "non-empty string"),
        ('["a list"]', "expected a JSON object"),
    ],
)
def test_malformed_line_is_named_by_file_and_line_number(tmp_path, bad_line, message):
    path = tmp_path / "q.jsonl"
    path.write_text('{"turns": ["fine"]}\n\n' + bad_line + "\n")
    with pytest.raises(ValueError, match=rf"q\.jsonl:3: .*{message}"):
        read_prompt_file(path)


def test_missing_prompts_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_prompt_file(tmp_path / "nope.jsonl")


@pytest.mark.skipif(not SHARED.is_dir(), reason=f"../shared assets are absent ({SHARED} not found)")
@pytest.mark.parametrize(
    "name, count, categories",
    [
        ("spec_bench_question.jsonl", 480, 13),  # 8 MT-bench categories + 5 Spec-Bench tasks
        ("mt_bench_question.jsonl", 80, 8),
        ("HumanEval.jsonl.gz", 164, 1),
        ("gsm8k_test.jsonl", 1319, 1),
        ("story_prompts_dev.jsonl", 40, 1),
    ],
)
def test_real_prompt_sets_read_in_their_original_formats(name, count, categories):
    prompts = read_prompt_file(SHARED / "data" / name)
    assert count is None or len(prompts) == count
    assert len({p.category for p in prompts}) == categories
    assert all(p.text for p in prompts)


def test_chat_template_wraps_the_prompt_when_the_tokenizer_has_one(stories):
    plain = encode_prompt(stories, "Tom had a red ball.")
    assert plain == stories.encode("Tom had a red ball.")  # stories260K has no template: raw text
    tokenizer = copy.deepcopy(stories.tokenizer)
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}User: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}Story:{% endif %}"
    )
    templated = encode_prompt(sg.Target(stories.model, tokenizer, "templated"), "Tom had a red ball.")
    assert templated[0] == tokenizer.bos_token_id and templated[1] != tokenizer.bos_token_id  # BOS once
    assert stories.decode(templated) == "User: Tom had a red ball.\nStory:"


# ------------------------------------------------------------------------------------------ aggregation


def test_aggregate_reduces_each_key_as_documented():
    runs = [
        sg.GenerationStats(new_tokens=9, target_calls=4, mean_accepted_length=2.0, accept_length_histogram=[1, 2, 1],
                           draft_tokens_per_token=1.0, ttft_s=0.1, tokens_per_s=100.0, itl_p50_s=0.01, itl_p99_s=0.03,
                           kv_cache_tokens_peak=20),
        sg.GenerationStats(new_tokens=5, target_calls=4, mean_accepted_length=1.0, accept_length_histogram=[4],
                           draft_tokens_per_token=2.0, ttft_s=0.3, tokens_per_s=50.0, itl_p50_s=0.02, itl_p99_s=0.05,
                           kv_cache_tokens_peak=30),
        sg.GenerationStats(new_tokens=4, target_calls=1, mean_accepted_length=3.0, accept_length_histogram=[0, 0, 1],
                           draft_tokens_per_token=0.5, ttft_s=0.2, tokens_per_s=80.0, itl_p50_s=0.04, itl_p99_s=0.04,
                           kv_cache_tokens_peak=10, lossless=False),
    ]
    agg = aggregate(runs, wall_s=[0.5, 1.0, 0.1])
    assert agg["prompts"] == 3
    assert agg["new_tokens"] == 18
    assert agg["target_calls"] == 9
    assert agg["mean_accepted_length"] == pytest.approx((8 + 4 + 3) / 9)  # tokens after the first / calls
    assert agg["accept_length_histogram"] == [5, 2, 2]
    assert agg["draft_tokens_per_token"] == pytest.approx((9 + 10 + 2) / 18)  # draft tokens / new tokens
    assert agg["ttft_s"] == pytest.approx(0.2)
    assert agg["tokens_per_s"] == pytest.approx(80.0)
    assert agg["itl_p50_s"] == pytest.approx(0.02)
    assert agg["itl_p99_s"] == pytest.approx(0.04)
    assert agg["kv_cache_tokens_peak"] == 30
    assert agg["lossless"] is False
    assert agg["wall_s"] == pytest.approx(1.6)
    assert agg["e2e_tokens_per_s"] == pytest.approx(18.0)  # median of 18, 5 and 40 tokens/s


def test_aggregate_keeps_unmeasured_keys_none():
    stats = {**sg.GenerationStats(new_tokens=3, target_calls=2, mean_accepted_length=1.0).to_dict(),
             "draft_tokens_per_token": None, "kv_cache_tokens_peak": None}
    agg = aggregate([stats, stats], wall_s=[1.0, 1.0])
    assert agg["draft_tokens_per_token"] is None and agg["kv_cache_tokens_peak"] is None
    assert agg["new_tokens"] == 6


def test_acceptance_by_depth_is_conditional_on_reaching_the_depth():
    # 1 step accepted nothing, 3 accepted one draft, 4 accepted two.
    assert acceptance_by_depth([1, 3, 4]) == pytest.approx([7 / 8, 4 / 7])
    assert acceptance_by_depth([5]) == []


def test_chunk_clock_measures_hf_like_our_recorder():
    clock = ChunkClock()
    clock.start = 0.5
    clock.put(torch.tensor([[1, 2, 3]]))  # the prompt: not a generated chunk
    for size in (2, 3, 1, 2):
        clock.put(torch.zeros(1, size))
    clock.times = [1.0, 1.5, 2.0, 2.5]
    stats = clock.stats(new_tokens=8)
    assert clock.sizes == [2, 3, 1, 2]
    assert stats["ttft_s"] == pytest.approx(0.5)
    assert stats["target_calls"] == 3  # the first chunk is HF's prefill call
    assert stats["mean_accepted_length"] == pytest.approx(2.0)
    assert stats["accept_length_histogram"] == [1, 1, 1]
    assert stats["tokens_per_s"] == pytest.approx(6 / 1.5)
    assert stats["itl_p50_s"] == pytest.approx((0.5 / 3 + 0.25) / 2)  # 3 tokens at 1/6 s, 1 at 0.5, 2 at 0.25
    assert stats["draft_tokens_per_token"] is None and stats["kv_cache_tokens_peak"] is None


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


# ------------------------------------------------------------------------------------------ runs


def _flipped(runner: Runner, at: int) -> Runner:
    """A deliberately wrong method: the wrapped runner's output with one token changed."""

    def generate(ids, max_new_tokens):
        tokens, stats = runner.generate(ids, max_new_tokens)
        tokens[at] = (tokens[at] + 1) % 512
        return tokens, stats

    return Runner("wrong", generate)


def test_a_method_whose_greedy_output_differs_is_reported(stories):
    wrong = _flipped(engine_runner("inner", stories, None, None), at=5)
    results = run_bench(stories, [wrong], PROMPTS, max_new_tokens=N, baselines=("plain", "hf"), warmup=0, progress=False)
    assert results["greedy_identical"] is False
    assert results["mismatches"] == [
        {"method": "wrong", "prompt_id": "0", "first_diff": 5, "reference": "hf"},
        {"method": "wrong", "prompt_id": "1", "first_diff": 5, "reference": "hf"},
    ]


def test_sampled_bench_samples_every_method_and_compares_nothing(stories, tmp_path):
    prompts = [BenchPrompt("0", "writing", PROMPTS[0].text), BenchPrompt("1", "qa", PROMPTS[1].text)]
    greedy = run_bench(stories, [], prompts, max_new_tokens=N, baselines=("plain", "hf"), warmup=0, progress=False)
    sampled = run_bench(stories, [("prompt-lookup", sg.PromptLookup(), None)], prompts, max_new_tokens=N,
                        baselines=("plain", "hf"), temperature=1.5, warmup=0, out_dir=tmp_path, progress=False)
    assert sampled["greedy_identical"] is None and sampled["mismatches"] == []
    assert sampled["settings"]["temperature"] == 1.5
    assert greedy["greedy_identical"] is True
    markdown = (tmp_path / "results.md").read_text()
    assert "sampled at temperature 1.5" in markdown and "not compared" in markdown
    assert "| method | qa | writing |" in markdown  # the per-category table


def test_sampled_runners_of_our_engine_and_of_hf_really_sample(stories):
    ids = encode_prompt(stories, PROMPTS[0].text)
    torch.manual_seed(0)
    for make in (lambda t: engine_runner("plain", stories, None, None, t), lambda t: hf_runner("hf", stories, t)):
        greedy = make(0.0).generate(ids, N)[0]
        sampled = [make(1.5).generate(ids, N)[0] for _ in range(3)]
        assert any(tokens != greedy for tokens in sampled)  # three seeded 16-token draws at T=1.5


def test_hf_sampling_options_switch_off_shipped_filters():
    assert hf_sampling(0.0) == HF_GREEDY
    options = hf_sampling(0.7)
    assert options["do_sample"] is True and options["temperature"] == 0.7
    assert options["top_k"] == 0 and options["top_p"] == 1.0 and options["min_p"] is None


def test_report_files_and_keys(stories, tmp_path):
    from conftest import uncaptured

    stories = uncaptured(stories)  # the packed path's counts, below
    methods = [("prompt-lookup", sg.PromptLookup(), None), ("self chain:3", sg.DraftModel(stories, stories), sg.Chain(3))]
    results = run_bench(stories, methods, PROMPTS, max_new_tokens=N, baselines=("plain", "hf", "hf-pld"),
                        warmup=1, out_dir=tmp_path, progress=False)
    assert results["greedy_identical"] is True and results["mismatches"] == []
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk == json.loads(json.dumps(results))
    assert set(on_disk) >= {"methods", "greedy_identical", "mismatches", "settings"}
    assert [m["method"] for m in on_disk["methods"]] == ["plain", "hf", "hf-pld", "prompt-lookup", "self chain:3"]
    by_name = {m["method"]: m for m in on_disk["methods"]}
    for m in on_disk["methods"]:
        assert set(STATS_KEYS) <= set(m)
        assert set(m["speedup_vs"]) == {"plain", "hf", "hf-pld"}
        assert m["speedup_vs"]["plain"] == pytest.approx(m["e2e_tokens_per_s"] / by_name["plain"]["e2e_tokens_per_s"])
        assert set(m["per_category"]) == {"story"}
        assert set(m["per_category"]["story"]["speedup_vs"]) == {"plain", "hf", "hf-pld"}
        assert m["new_tokens"] == 2 * N
    hf = by_name["hf"]
    assert hf["source"] == "transformers" and hf["not_measured"] == ["draft_tokens_per_token", "kv_cache_tokens_peak"]
    assert hf["draft_tokens_per_token"] is None
    assert hf["target_calls"] == 2 * (N - 1) and hf["mean_accepted_length"] == 1.0  # one chunk per greedy step
    assert by_name["self chain:3"]["mean_accepted_length"] > 1.5  # the target drafting for itself is accepted
    # Kernels and host syncs a decoding step, counted for our engine's methods (not transformers')
    assert hf["kernels_per_step"] is None and by_name["hf-pld"]["syncs_per_step"] is None
    ours = [by_name[name] for name in ("plain", "prompt-lookup", "self chain:3")]
    assert all(m["kernels_per_step"] > 50 and m["syncs_per_step"] >= 1 for m in ours)
    assert by_name["plain"]["syncs_per_step"] == 1.0  # batch 1: the choice read back, nothing else
    assert by_name["self chain:3"]["kernels_per_step"] > by_name["plain"]["kernels_per_step"]
    markdown = (tmp_path / "results.md").read_text()
    assert "| method | tau | tokens/s | vs plain | vs hf | vs hf-pld | kernels / syncs a step |" in markdown
    assert f"| {by_name['plain']['kernels_per_step']:.0f} / 1.0 |" in markdown
    assert all(f"| {name} |" in markdown for name in by_name)
    for name in PLOTS:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hf_assisted_baseline_loads_its_assistant_from_a_directory(stories):
    results = run_bench(stories, [], PROMPTS, max_new_tokens=N, baselines=("hf", f"hf-assisted:{STORIES}"),
                        warmup=0, progress=False)
    assert results["greedy_identical"] is True
    assisted = results["methods"][1]
    assert assisted["method"] == "hf-assisted:stories260K"
    assert assisted["mean_accepted_length"] > 2.0  # the target assisting itself: most drafts are accepted
    assert results["settings"]["baselines"] == ["hf", "hf-assisted:stories260K"]


def test_methods_run_interleaved_after_warmup_with_rotating_order(stories):
    calls = []

    def fake(name):
        return Runner(name, lambda ids, n: (calls.append((name, tuple(ids))) or [7] * n, sg.GenerationStats(new_tokens=n).to_dict()))

    prompts = PROMPTS + [BenchPrompt("2", "story", "There was a big tree.")]
    run_bench(stories, [fake("a"), fake("b"), fake("c")], prompts, max_new_tokens=2, baselines=(), warmup=1, progress=False)
    warm, timed = calls[:3], calls[3:]
    assert {name for name, _ in warm} == {"a", "b", "c"}
    first_per_prompt = [timed[i * 3][0] for i in range(3)]
    assert first_per_prompt == ["a", "b", "c"]
    assert all(len({ids for _, ids in timed[i * 3:(i + 1) * 3]}) == 1 for i in range(3))  # one prompt at a time


def test_hf_baseline_ignores_the_models_shipped_repetition_penalty():
    if not STORIES.is_dir():
        pytest.skip(f"../shared assets are absent ({STORIES} not found)")
    target = sg.load_target(STORIES)
    target.model.generation_config.repetition_penalty = 1.5
    results = run_bench(target, [], PROMPTS[:1], max_new_tokens=N, baselines=("plain", "hf"), warmup=0, progress=False)
    assert results["greedy_identical"] is True


def test_threads_are_restored_after_the_run(stories):
    before = torch.get_num_threads()
    run_bench(stories, [], PROMPTS[:1], max_new_tokens=2, baselines=("plain",), threads=2, warmup=0, progress=False)
    assert torch.get_num_threads() == before


# ------------------------------------------------------------------------------------------ sweeps


def test_sweep_over_chain_depths():
    assert [name for name, _ in expand_sweep(["depth=3,5,7"], sg.Chain(5))] == ["chain:3", "chain:5", "chain:7"]


def test_sweep_over_dynamic_tree_is_the_cartesian_product():
    trees = expand_sweep(["top_k=4,8", "budget=16,32"], DynamicTree(top_k=8, depth=6, budget=48))
    assert [name for name, _ in trees] == ["dynamic:4,6,16", "dynamic:4,6,32", "dynamic:8,6,16", "dynamic:8,6,32"]
    assert trees[1][1] == DynamicTree(top_k=4, depth=6, budget=32)


@pytest.mark.parametrize(
    "spec, tree, message",
    [
        (["top_k=4,8"], sg.Chain(5), r"top_k does not apply to tree chain:5 \(Chain has: depth\)"),
        (["width=2"], sg.Chain(5), "KEY one of depth, top_k, budget"),
        (["depth=3,x"], sg.Chain(5), "positive integers"),
        (["depth=0"], sg.Chain(5), "positive integers"),
        (["depth=3", "depth=4"], sg.Chain(5), "given twice"),
        (["depth=3"], sg.StaticTree([[0], [0, 0]]), "StaticTree has: nothing to sweep"),
    ],
)
def test_bad_sweeps_name_the_item(spec, tree, message):
    with pytest.raises(ValueError, match=message):
        expand_sweep(spec, tree)


# ------------------------------------------------------------------------------------------ command line


def _args(*argv: str) -> argparse.Namespace:
    return add_bench_arguments(argparse.ArgumentParser()).parse_args(list(argv))


@pytest.fixture()
def prompts_file(tmp_path):
    return _write_jsonl(tmp_path / "p.jsonl", [{"question_id": p.id, "category": p.category, "turns": [p.text]} for p in PROMPTS])


def test_json_flag_prints_results_json(stories, prompts_file, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the automatic choice is what this checks
    args = _args("--target", str(STORIES), "--drafter", "prompt-lookup", "--drafter", "self", "--sweep", "depth=2,3",
                 "--prompts", str(prompts_file), "--max-new-tokens", str(N), "--baselines", "plain",
                 "--out", str(tmp_path / "out"), "--json")
    assert bench_main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [m["method"] for m in printed["methods"]] == ["plain", "prompt-lookup", "self chain:2", "self chain:3"]
    assert printed["settings"]["prompts_file"] == str(prompts_file)
    assert printed == json.loads((tmp_path / "out" / "results.json").read_text())
    # --threads defaults to auto: one thread for a 260K-parameter target, reported with its reason.
    assert printed["settings"]["threads"] == 1
    assert printed["settings"]["threads_choice"].startswith("auto: 0.3M parameters, under 10M run fastest on one thread")
    assert "1 thread(s) (auto: 0.3M parameters" in (tmp_path / "out" / "results.md").read_text()


def test_method_pairs_a_drafter_with_one_tree_without_crossing(stories, prompts_file, tmp_path, capsys):
    spec = tmp_path / "paths.json"
    spec.write_text(json.dumps({"kind": "static", "choices": [[0], [1], [0, 0]]}))
    args = _args("--target", str(STORIES), "--drafter", "self", "--tree", "chain:2",
                 "--method", "self", "dynamic:2,2,3", "--method", "self", str(spec), "--method", "prompt-lookup", "chain:9",
                 "--prompts", str(prompts_file), "--max-new-tokens", str(N), "--baselines", "plain",
                 "--out", str(tmp_path / "out"), "--json")
    assert bench_main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [m["method"] for m in printed["methods"]] == [
        "plain", "self chain:2", "self dynamic:2,2,3", "self paths.json", "prompt-lookup"]
    assert printed["greedy_identical"]


def test_the_same_method_twice_is_refused(stories, prompts_file, tmp_path):
    args = _args("--target", str(STORIES), "--drafter", "self", "--tree", "chain:2", "--method", "self", "chain:2",
                 "--prompts", str(prompts_file), "--out", str(tmp_path / "out"))
    with pytest.raises(ValueError, match=r"methods named twice .*'self chain:2'"):
        bench_main(args)


def test_tree_labels_name_spec_files_by_file_name():
    assert tree_label("dynamic:8,6,48") == "dynamic:8,6,48"
    assert tree_label("/runs/tune/tree.json") == "tree.json"
    assert tree_label("static:/runs/medusa/paths.json") == "static:paths.json"


@pytest.mark.parametrize(
    "flags, error, message",
    [
        (["--method", "/no/such/head", "chain:3"], FileNotFoundError, "--drafter '/no/such/head'"),
        (["--method", "self", "spiral:3"], ValueError, "unknown tree spec 'spiral:3'"),
        (["--baselines", "plain,hf-foo"], ValueError, "unknown baseline 'hf-foo': choose from plain, hf, hf-pld"),
        (["--baselines", "hf-assisted"], ValueError, "hf-assisted needs a model directory"),
        (["--baselines", "hf-assisted:/no/such/dir"], FileNotFoundError, "/no/such/dir"),
        (["--drafter", "/no/such/head"], FileNotFoundError, "--drafter '/no/such/head'"),
        (["--sweep", "budget=8"], ValueError, "budget does not apply to tree chain:5"),
        (["--tree", "spiral:3"], ValueError, "unknown tree spec 'spiral:3'"),
        (["--max-new-tokens", "0"], ValueError, "--max-new-tokens must be >= 1"),
    ],
)
def test_bad_arguments_fail_before_any_model_loads(prompts_file, tmp_path, flags, error, message):
    # The target does not exist: each error must come from checking the flag, not from loading.
    args = _args("--target", str(tmp_path / "no-target"), "--prompts", str(prompts_file), "--out", str(tmp_path), *flags)
    with pytest.raises(error, match=message):
        bench_main(args)


def test_missing_prompts_file_is_a_clear_error(tmp_path):
    args = _args("--target", str(tmp_path / "no-target"), "--prompts", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"--prompts '.*missing\.jsonl' does not exist"):
        bench_main(args)


def test_parse_baseline_accepts_the_documented_kinds(tmp_path):
    assert parse_baseline("hf-pld") == ("hf-pld", None)
    assert parse_baseline(f"hf-assisted:{tmp_path}") == ("hf-assisted", str(tmp_path))
    with pytest.raises(ValueError, match="unknown baseline 'plain:x'"):
        parse_baseline("plain:x")


def test_drafter_directories_load_as_heads_or_draft_models(stories, tmp_path):
    save_head(build_head(MedusaConfig(num_heads=2), stories), tmp_path / "medusa", stories)
    assert type(build_drafter(str(tmp_path / "medusa"), stories)).__name__ == "MedusaDrafter"
    assert isinstance(build_drafter(str(STORIES), stories), sg.DraftModel)  # a plain transformers model directory


def test_dev_prompt_file_is_the_spec_bench_format():
    if not DEV_PROMPTS.is_file():
        pytest.skip(f"../shared assets are absent ({DEV_PROMPTS} not found)")
    prompts = read_prompt_file(DEV_PROMPTS, limit=3)
    assert [p.id for p in prompts] == ["0", "1", "2"] and prompts[0].text.startswith("Once upon a time")


def test_batch_size_sweep_runs_every_method_at_every_size_and_checks_outputs(stories, prompts_file, tmp_path, capsys,
                                                                           monkeypatch):
    monkeypatch.setenv("SPECGRAFT_CAPTURE", "0")  # the packed path's counts, below
    args = _args("--target", str(STORIES), "--drafter", "prompt-lookup", "--drafter", "self", "--tree", "chain:3",
                 "--tree", "adaptive", "--prompts", str(prompts_file), "--max-new-tokens", str(N), "--batch-size", "2,1",
                 "--out", str(tmp_path / "out"), "--json")
    assert bench_main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["greedy_identical"] and printed["settings"]["batch_sizes"] == [1, 2]
    cells = {(r["method"], r["batch_size"]) for r in printed["rows"]}
    # Prompt lookup ignores fixed trees but not adaptive ones, which size its depth.
    methods = ("plain", "prompt-lookup", "prompt-lookup adaptive", "self chain:3", "self adaptive")
    assert cells == {(m, b) for m in methods for b in (1, 2)}
    assert set(printed["calibration"]) == {"prompt-lookup adaptive", "self adaptive"}
    assert all(set(p) == {"depth", "nodes", "estimated", "observed"} for c in printed["calibration"].values() for p in c)
    plain = [r for r in printed["rows"] if r["method"] == "plain"]
    assert all(r["mean_accepted_length"] == 1.0 and r["total_tokens_per_s"] > 0 for r in plain)
    assert all(r["paired_vs_plain_p25"] == r["paired_vs_plain_p50"] == r["paired_vs_plain_p75"] == 1.0 for r in plain)
    assert all(r["kernels_per_step"] > 50 and r["syncs_per_step"] >= 1 for r in printed["rows"])
    assert [r["syncs_per_step"] for r in plain] == [1.0, 2.0]  # the choices read back; at batch 2 the packing staged
    assert (tmp_path / "out" / "throughput_vs_batch_size.png").is_file()
    markdown = (tmp_path / "out" / "results.md").read_text()
    assert "| plain |" in markdown and "| self adaptive |" in markdown and "Against plain decoding" in markdown
    assert "Paired against plain decoding" in markdown


def test_capture_runs_the_batch_sweep_through_the_static_forward_with_the_same_outputs(stories, prompts_file, tmp_path,
                                                                                      capsys, trained_eagle):
    """--capture: the same outputs through the static forwards, and what the target's and each captured drafter's
    forwards did (graphs, replays, eager runs, the seconds capturing: eager here, on a CPU)."""
    args = _args("--target", str(STORIES), "--drafter", "self", "--tree", "chain:3", "--prompts", str(prompts_file),
                 "--method", str(trained_eagle), "chain:2", "--method", str(trained_eagle), "dynamic:2,2,3",
                 "--max-new-tokens", str(N), "--batch-size", "2,1", "--capture", "--out", str(tmp_path / "out"), "--json")
    assert bench_main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["greedy_identical"] and printed["settings"]["capture"] is True
    assert printed["settings"]["captured"]["eager"] > 0 and printed["settings"]["captured"]["graphs"] == 0  # CPU
    eagle = {r["method"] for r in printed["rows"]} - {"plain", "self chain:3"}
    assert len(eagle) == 2 and {(r["method"], r["batch_size"]) for r in printed["rows"]} == {
        (m, b) for m in ("plain", "self chain:3", *eagle) for b in (1, 2)}
    (labels, drafts), = printed["settings"]["captured_drafts"].items()  # the head's, its two methods sharing it
    assert set(labels.split(" / ")) == eagle and drafts["eager"] > 0 and drafts["graphs"] == 0
    assert "static shapes" in (tmp_path / "out" / "results.md").read_text()


def test_paired_ratios_are_plains_wall_over_the_methods_group_by_group():
    """A burst that slows one group's run of a method moves its total, not the median of its pairs."""
    from specgraft.tools.bench_batch import paired

    reference = [([], 1.0), ([], 2.0), ([], 3.0), ([], 1.0), ([], 1.0)]
    method = [([], 2.0), ([], 2.0), ([], 6.0), ([], 10.0), ([], 1.25)]  # ratios 0.5, 1, 0.5, 0.1, 0.8
    assert paired(method, reference) == {"paired_vs_plain_p25": 0.5, "paired_vs_plain_p50": 0.5, "paired_vs_plain_p75": 0.8}


def test_batch_size_rounds_pass_over_the_groups_again_and_pool_them(stories, prompts_file, tmp_path, capsys):
    args = _args("--target", str(STORIES), "--drafter", "prompt-lookup", "--tree", "adaptive", "--prompts", str(prompts_file),
                 "--max-new-tokens", str(N), "--batch-size", "1", "--rounds", "2", "--out", str(tmp_path / "out"), "--json")
    assert bench_main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["greedy_identical"] and printed["settings"]["rounds"] == 2
    assert {r["method"] for r in printed["rows"]} >= {"plain", "prompt-lookup adaptive"}
    assert all(r["requests"] == 2 * len(PROMPTS) for r in printed["rows"])  # each prompt twice, pooled
    assert "2 round(s)" in (tmp_path / "out" / "results.md").read_text()


def test_batch_size_values_are_checked_before_a_model_loads(prompts_file, tmp_path):
    args = _args("--target", "/nonexistent", "--prompts", str(prompts_file), "--batch-size", "1,x", "--out", str(tmp_path))
    with pytest.raises(ValueError, match="--batch-size '1,x'"):
        bench_main(args)


def test_ctrl_c_writes_the_prompts_every_method_finished_and_says_where(stories, tmp_path, capsys, monkeypatch):
    import specgraft.tools.bench as bench

    prompts = PROMPTS + [BenchPrompt("2", "story", "There was a big tree.")]
    prompts_file = _write_jsonl(tmp_path / "p.jsonl", [
        {"question_id": p.id, "category": p.category, "turns": [p.text]} for p in prompts])
    # The third timed run: plain and prompt-lookup finished prompt 0; prompt 1 is half done.
    monkeypatch.setattr(bench, "_timed", ctrl_c_at_call(3, bench._timed))
    out = tmp_path / "out"
    args = _args("--target", str(STORIES), "--drafter", "prompt-lookup", "--prompts", str(prompts_file),
                 "--max-new-tokens", str(N), "--baselines", "plain", "--out", str(out))
    assert bench_main(args) == 130
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert captured.err.splitlines()[-1] == (
        f"specgraft bench: interrupted after 1 of 3 prompts; the prompts every method finished are in "
        f"{out / 'results.json'} (and results.md)"
    )
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["prompts"] == 1 and results["settings"]["prompts_given"] == 3
    assert results["settings"]["interrupted"] is True and results["greedy_identical"] is True
    assert [(m["method"], m["prompts"], m["new_tokens"]) for m in results["methods"]] == [
        ("plain", 1, N), ("prompt-lookup", 1, N)]
    assert {r["prompt_id"] for r in results["per_prompt"]} == {"0"}
    assert "**Interrupted** after 1 of 3 prompts" in (out / "results.md").read_text()
    assert all((out / name).is_file() for name in PLOTS)


def test_ctrl_c_before_any_prompt_finished_writes_nothing(stories, tmp_path, capsys, monkeypatch):
    import specgraft.tools.bench as bench

    def ctrl_c(runner, ids, max_new_tokens):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "_timed", ctrl_c)
    prompts_file = _write_jsonl(tmp_path / "p.jsonl", [{"question_id": 0, "turns": [PROMPTS[0].text]}])
    args = _args("--target", str(STORIES), "--prompts", str(prompts_file), "--max-new-tokens", "2",
                 "--baselines", "plain", "--out", str(tmp_path / "out"))
    assert bench_main(args) == 130
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "specgraft bench: interrupted before every method finished a prompt; nothing written"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stop_at_count", [3, 1], ids=["after batch size 1", "during batch size 1"])
def test_ctrl_c_in_a_batch_sweep_writes_the_batch_sizes_that_finished(stories, prompts_file, tmp_path, capsys,
                                                                      monkeypatch, stop_at_count):
    """`bench --batch-size` stopped by Ctrl-C: one line, and results.json / results.md hold the batch sizes that
    finished (marked interrupted); stopped before any finished, it says that nothing was written."""
    import specgraft.tools.bench_batch as bench_batch

    # Each method's step count closes its batch size.
    monkeypatch.setattr(bench_batch, "count_decoding", ctrl_c_at_call(stop_at_count, bench_batch.count_decoding))
    out = tmp_path / "out"
    args = _args("--target", str(STORIES), "--drafter", "prompt-lookup", "--prompts", str(prompts_file),
                 "--max-new-tokens", str(N), "--batch-size", "1,2", "--out", str(out))
    assert bench_main(args) == 130
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    if stop_at_count == 1:
        assert captured.err.splitlines()[-1] == (
            "specgraft bench: interrupted before any batch size finished; nothing written")
        assert not (out / "results.json").exists()
        return
    assert captured.err.splitlines()[-1] == (
        f"specgraft bench: interrupted after batch sizes [1] of [1, 2]; the batch sizes that finished are in "
        f"{out / 'results.json'} (and results.md)")
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["interrupted"] is True and results["settings"]["batch_sizes"] == [1]
    assert {(r["method"], r["batch_size"]) for r in results["rows"]} == {("plain", 1), ("prompt-lookup", 1)}
    assert results["greedy_identical"] is True
    assert "Interrupted (Ctrl-C): batch sizes [1] of [1, 2] finished." in (out / "results.md").read_text()


def test_aggregate_has_no_mean_accepted_length_where_no_prompt_made_a_verification_step():
    """An output of only EOS makes no verification step: its tau is null, not 0.0, and the others' stay theirs."""
    eos_only = sg.GenerationStats(new_tokens=1, target_calls=0).to_dict()
    assert eos_only["mean_accepted_length"] is None
    drafted = sg.GenerationStats(new_tokens=7, target_calls=3, mean_accepted_length=2.0).to_dict()
    assert aggregate([eos_only, drafted], wall_s=[1.0, 1.0])["mean_accepted_length"] == pytest.approx(2.0)
    assert aggregate([eos_only, eos_only], wall_s=[1.0, 1.0])["mean_accepted_length"] is None


def _batch_rows(speedups: dict[int, list[float]], rounds: int) -> list[dict]:
    """Hand-made sweep rows: plain at 100 tokens/s at each size, one method at the mean of its rounds' speedups."""
    rows = []
    for b, per_round in speedups.items():
        rows.append({"method": "plain", "batch_size": b, "total_tokens_per_s": 100.0, "speedup_by_round": [1.0] * rounds})
        rows.append({"method": "lookup", "batch_size": b, "total_tokens_per_s": 100.0 * sum(per_round) / len(per_round),
                     "speedup_by_round": per_round})
    return rows


def test_the_batch_verdict_says_what_it_rests_on_and_when_a_speedup_is_within_noise():
    from specgraft.tools.bench_batch import verdict

    clear = _batch_rows({1: [1.5, 1.4], 2: [1.2, 1.1], 4: [0.8, 0.9]}, rounds=2)
    assert verdict(clear, 2) == "Speculation stops paying at batch 4 (rests on 2 rounds)."
    everywhere = _batch_rows({1: [1.5, 1.4], 2: [1.2, 1.1]}, rounds=2)
    assert verdict(everywhere, 2) == "Speculation pays at every batch size measured (rests on 2 rounds)."
    # 1.01x on average, but one round below 1.0x: not apart from plain decoding; then a clear loss
    noisy = _batch_rows({1: [1.5, 1.4], 4: [0.99, 1.03], 8: [0.8, 0.85]}, rounds=2)
    line = verdict(noisy, 2)
    assert "within noise" in line and "batch 4" in line and "0.99x-1.03x over its 2 rounds" in line
    assert "stops paying at batch 8" in line and line.endswith("(rests on 2 rounds).")
    # One round: a stated threshold instead of a spread
    one = _batch_rows({1: [1.5], 2: [1.02]}, rounds=1)
    line = verdict(one, 1)
    assert "within noise" in line and "batch 2" in line and "5% of 1.00x" in line and line.endswith("(rests on 1 round).")
    assert verdict(_batch_rows({1: [1.5], 2: [0.9]}, rounds=1), 1) == "Speculation stops paying at batch 2 (rests on 1 round)."


def test_the_batch_report_prints_the_verdict_and_no_steps_for_a_tau_of_nothing():
    from specgraft.tools.bench_batch import batch_markdown

    rows = _batch_rows({1: [1.5], 2: [1.02]}, rounds=1)
    for r in rows:
        r.update(mean_accepted_length=None if r["method"] == "lookup" else 1.0, engine="specgraft",
                 paired_vs_plain_p25=1.0, paired_vs_plain_p50=1.0, paired_vs_plain_p75=1.0, request_tokens_per_s_p50=1.0,
                 ttft_p50_s=0.1, ttft_p99_s=0.1, itl_p50_s=0.01, itl_p99_s=0.01, kernels_per_step=None)
    results = {"settings": {"target": "t", "prompts": 2, "max_new_tokens": 4, "batch_sizes": [1, 2], "rounds": 1},
               "rows": rows, "greedy_identical": True, "mismatches": []}
    markdown = batch_markdown(results)
    assert "within noise" in markdown and "(rests on 1 round)" in markdown
    assert "150.0 (n/a (no steps))" in markdown and "0.00)" not in markdown
