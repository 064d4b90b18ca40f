"""Self-distillation on the real stories260K target: what is written, resume, padding, EOS.

In process, regeneration runs through specgraft's scheduler; the `hf_generate` fixture switches a test to HF
`generate` in batches, the path of a target without the fast path (and the one the scripted tests fake).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from specgraft.model import Target
from specgraft.train.data import load_records
from specgraft.train.regeneration import regenerate

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ '\\n' }}{{ m['content'] }}<|end|>{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{{ '\\n' }}{% endif %}"
)
PROMPTS = ["Once upon a time", "Tom had a red ball. He liked to", "Lily saw a big dog."]


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def submitted(monkeypatch) -> list[list[int]]:
    """The prompt ids of every request regeneration submits to specgraft's scheduler."""
    from specgraft.infer.scheduler import Scheduler

    prompts: list[list[int]] = []
    real = Scheduler.submit

    def spy(self, prompt, *args, **kwargs):
        prompts.append(list(prompt))
        return real(self, prompt, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "submit", spy)
    return prompts


@pytest.fixture
def hf_generate(stories, monkeypatch):
    """Regenerate through HF `generate` in batches: what a target without the fast path runs."""
    monkeypatch.setattr(stories, "fast", None)


@pytest.fixture
def generate_calls(stories, monkeypatch, hf_generate):
    """Record the batch size of every `generate` call on the target (HF `generate`'s path)."""
    calls: list[int] = []
    real = stories.model.generate

    def counting(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(stories.model, "generate", counting)
    return calls


def run(stories, inputs, path, **overrides):
    settings = dict(max_new_tokens=12, batch_size=2, progress=False) | overrides
    return regenerate(stories, inputs, path, **settings)


def test_writes_one_record_per_prompt_and_bos_sample(stories, tmp_path):
    path = tmp_path / "out.jsonl"
    summary = run(stories, PROMPTS, path, num_from_bos=2)
    assert (summary.written, summary.skipped, summary.too_long) == (5, 0, 0)
    assert [r["id"] for r in lines(path)] == ["0", "1", "2", "bos-0", "bos-1"]


def test_prompt_continuations_extend_the_prompt(stories, tmp_path):
    path = tmp_path / "out.jsonl"
    run(stories, PROMPTS, path)
    for prompt, record in zip(PROMPTS, lines(path)):
        assert record["text"].startswith(prompt)
        assert len(stories.encode(record["text"])) > len(stories.encode(prompt))


def test_bos_samples_are_generated_from_bos_alone(stories, tmp_path, submitted):
    path = tmp_path / "out.jsonl"
    run(stories, [], path, num_from_bos=2)
    assert submitted == [[stories.tokenizer.bos_token_id]] * 2
    assert all(r["text"] for r in lines(path))


def test_output_reads_back_with_load_records(stories, tmp_path):
    path = tmp_path / "out.jsonl"
    chat = {"id": "c", "messages": [{"role": "user", "content": "Tell me a story."}]}
    run(stories, [PROMPTS[0], chat], path, num_from_bos=1)
    assert load_records(path) == lines(path)


def test_chat_keeps_user_turns_and_rewrites_assistant_turns(stories, tmp_path):
    record = {
        "id": "sg",
        "conversations": [
            {"from": "human", "value": "Tell me a story."},
            {"from": "gpt", "value": "ORIGINAL"},
            {"from": "human", "value": "And then?"},
        ],
    }
    path = tmp_path / "out.jsonl"
    run(stories, [record], path)
    (out,) = lines(path)
    assert [m["role"] for m in out["messages"]] == ["user", "assistant", "user", "assistant"]
    assert [out["messages"][i]["content"] for i in (0, 2)] == ["Tell me a story.", "And then?"]
    assert "ORIGINAL" not in out["messages"][1]["content"]


def test_chat_template_target_is_prompted_with_its_template(stories, tmp_path, submitted):
    tokenizer = copy.deepcopy(stories.tokenizer)
    tokenizer.chat_template = CHAT_TEMPLATE
    target = Target(stories.model, tokenizer, name="stories-chat")
    run(target, [{"id": "c", "turns": ["Tell me a story."]}], tmp_path / "out.jsonl")
    assert [tokenizer.decode(p) for p in submitted] == ["<|user|>\nTell me a story.<|end|>\n<|assistant|>\n"]


def test_chat_replies_are_written_one_round_per_turn(stories, tmp_path, submitted):
    two_turns = {"id": "a", "turns": ["Tell me a story.", "And then?"]}
    one_turn = {"id": "b", "turns": ["Hi."]}
    run(stories, [two_turns, one_turn], tmp_path / "out.jsonl")
    a = next(r for r in lines(tmp_path / "out.jsonl") if r["id"] == "a")
    first_reply = a["messages"][1]["content"]
    assert len(submitted) == 3  # a's first turn and b's together, then a's second turn with a's first reply
    assert first_reply and first_reply in stories.decode(submitted[2]) and "And then?" in stories.decode(submitted[2])


def test_hf_generate_answers_the_first_turns_together_then_the_second(stories, tmp_path, generate_calls):
    two_turns = {"id": "a", "turns": ["Tell me a story.", "And then?"]}
    one_turn = {"id": "b", "turns": ["Hi."]}
    run(stories, [two_turns, one_turn], tmp_path / "out.jsonl")
    assert generate_calls == [2, 1]  # round 1 answers both first turns, round 2 only a's second


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_scheduler_writes_what_hf_generate_writes_greedy_and_one_sample_per_record_at_any_batch(
    stories, tmp_path, monkeypatch, temperature
):
    inputs = [*PROMPTS, {"id": "c", "turns": ["Tell me a story.", "And then?"]}]
    settings = dict(temperature=temperature, num_from_bos=2, max_new_tokens=24, seed=3)
    run(stories, inputs, tmp_path / "one.jsonl", batch_size=1, **settings)
    run(stories, inputs, tmp_path / "four.jsonl", batch_size=4, **settings)
    by_id = lambda name: {r["id"]: r for r in lines(tmp_path / name)}  # noqa: E731  (written as each ends)
    # Each request is seeded by its record: the rows that share its steps do not change its sample.
    assert by_id("one.jsonl") == by_id("four.jsonl") and len(by_id("one.jsonl")) == 6
    if temperature == 0:
        monkeypatch.setattr(stories, "fast", None)
        run(stories, inputs, tmp_path / "hf.jsonl", batch_size=4, **settings)
        assert by_id("hf.jsonl") == by_id("one.jsonl")


def test_resume_skips_finished_ids(stories, tmp_path, submitted):
    path = tmp_path / "out.jsonl"
    run(stories, PROMPTS[:2], path, batch_size=4)
    before = path.read_text()
    summary = run(stories, PROMPTS, path, batch_size=4)
    assert (summary.written, summary.skipped) == (1, 2)
    assert [stories.decode(p) for p in submitted] == [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    assert path.read_text().startswith(before)
    assert [r["id"] for r in lines(path)] == ["0", "1", "2"]


def test_resume_of_a_finished_file_generates_nothing(stories, tmp_path, submitted):
    path = tmp_path / "out.jsonl"
    run(stories, PROMPTS, path, num_from_bos=1)
    before = path.read_bytes()
    assert len(submitted) == 4
    submitted.clear()
    summary = run(stories, PROMPTS, path, num_from_bos=1)
    assert (summary.written, summary.skipped) == (0, 4)
    assert submitted == []
    assert path.read_bytes() == before


def test_resume_drops_a_torn_last_line(stories, tmp_path):
    path = tmp_path / "out.jsonl"
    run(stories, PROMPTS, path)
    text = path.read_text()
    path.write_text(text[: len(text) - 10])  # a crash mid-write of the last record
    summary = run(stories, PROMPTS, path)
    assert (summary.written, summary.skipped) == (1, 2)
    assert sorted(r["id"] for r in lines(path)) == ["0", "1", "2"]


def test_resume_keeps_a_whole_last_line_missing_its_newline(stories, tmp_path):
    path = tmp_path / "out.jsonl"
    run(stories, PROMPTS, path)
    path.write_text(path.read_text().rstrip("\n"))
    summary = run(stories, PROMPTS, path)
    assert (summary.written, summary.skipped) == (0, 3)
    assert len(lines(path)) == 3


def test_corrupt_line_before_the_end_is_an_error(stories, tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text('{"id": "0", "text": "a"}\nnot json\n{"id": "2", "text": "c"}\n')
    with pytest.raises(ValueError, match=r"out\.jsonl: line 2 is not valid JSON"):
        run(stories, PROMPTS, path)


def test_no_resume_starts_the_file_afresh(stories, tmp_path):
    path = tmp_path / "out.jsonl"
    run(stories, PROMPTS, path)
    summary = run(stories, PROMPTS[:1], path, resume=False)
    assert summary.written == 1
    assert [r["id"] for r in lines(path)] == ["0"]


def test_same_seed_gives_the_same_samples(stories, tmp_path):
    run(stories, PROMPTS, tmp_path / "a.jsonl", seed=7, num_from_bos=1)
    run(stories, PROMPTS, tmp_path / "b.jsonl", seed=7, num_from_bos=1)
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()


def test_seeding_leaves_the_callers_rng_alone(stories, tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    run(stories, PROMPTS[:1], tmp_path / "out.jsonl", seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_left_padding_does_not_change_greedy_output(stories, tmp_path):
    prompts = ["Lily", "Tom had a red ball. He liked to play with it every day in the", "Once upon a time"]
    run(stories, prompts, tmp_path / "alone.jsonl", temperature=0, batch_size=1, max_new_tokens=24)
    run(stories, prompts, tmp_path / "batched.jsonl", temperature=0, batch_size=3, max_new_tokens=24)
    assert lines(tmp_path / "alone.jsonl") == lines(tmp_path / "batched.jsonl")


def test_greedy_continuation_matches_the_targets_own_greedy_decoding(stories, tmp_path):
    run(stories, [], tmp_path / "out.jsonl", temperature=0, num_from_bos=1, max_new_tokens=20)
    ids = stories.model.generate(torch.tensor([[1]]), do_sample=False, max_new_tokens=20)[0, 1:].tolist()
    assert lines(tmp_path / "out.jsonl")[0]["text"] == stories.decode(ids)


def test_continuation_stops_at_eos_and_drops_padding(stories, tmp_path, monkeypatch, hf_generate):
    eos, pad = stories.tokenizer.eos_token_id, 0
    story = stories.encode("Once upon a time")[1:]

    def fake_generate(input_ids, attention_mask, **kwargs):
        new = torch.tensor([story + [eos, pad, pad]])
        return torch.cat([input_ids, new], dim=1)

    monkeypatch.setattr(stories.model, "generate", fake_generate)
    run(stories, [], tmp_path / "out.jsonl", num_from_bos=1)
    assert lines(tmp_path / "out.jsonl")[0]["text"] == "Once upon a time"


def test_prompt_without_room_for_new_tokens_is_counted_not_written(stories, tmp_path):
    long_prompt = "Once upon a time " * 200  # past stories260K's 512 positions
    summary = run(stories, [long_prompt, PROMPTS[0]], tmp_path / "out.jsonl")
    assert (summary.written, summary.too_long) == (1, 1)
    assert [r["id"] for r in lines(tmp_path / "out.jsonl")] == ["1"]


def test_duplicate_ids_are_an_error(stories, tmp_path):
    with pytest.raises(ValueError, match="id 'x' appears twice"):
        run(stories, [{"id": "x", "text": "a"}, {"id": "x", "text": "b"}], tmp_path / "out.jsonl")


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"temperature": -1.0}, "temperature=-1.0"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
    ],
)
def test_bad_sampling_settings_are_rejected(stories, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        run(stories, PROMPTS, tmp_path / "out.jsonl", **overrides)


# ---------------------------------------------------------------- chat data without a dataset


MT_BENCH_81 = (
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences "
    "and must-see attractions."
)


@pytest.fixture
def chat_stories(stories):
    """stories260K with a chat template set in code: its user turns end in plain text (<|end|>), not in EOS."""
    tokenizer = copy.deepcopy(stories.tokenizer)
    tokenizer.chat_template = CHAT_TEMPLATE
    return Target(stories.model, tokenizer, name="stories-chat")


@pytest.fixture
def scripted(chat_stories, monkeypatch):
    """Replace `generate` by a script: each call takes the next list of replies, one per row, as text.

    A reply ending in "<EOS>" gets the EOS token; one without it is padded with a word up to the token
    limit, as a sample that never ended would be. Records each call's prompts as text and its limit.
    """
    tokenizer = chat_stories.tokenizer
    eos = tokenizer.eos_token_id
    script: list[list[str]] = []
    calls: list[tuple[list[str], int]] = []

    def fake_generate(input_ids, attention_mask, max_new_tokens, **kwargs):
        replies = script.pop(0)
        assert len(replies) == input_ids.shape[0], f"script has {len(replies)} replies for {input_ids.shape[0]} rows"
        calls.append(([tokenizer.decode(row[mask.bool()]) for row, mask in zip(input_ids, attention_mask)], max_new_tokens))
        rows = []
        for reply in replies:
            ended = reply.endswith("<EOS>")
            ids = tokenizer(reply.removesuffix("<EOS>"), add_special_tokens=False)["input_ids"]
            filler = tokenizer(" the", add_special_tokens=False)["input_ids"]
            ids = ids + [eos] if ended else (ids + filler * max_new_tokens)[:max_new_tokens]
            assert len(ids) <= max_new_tokens, f"scripted reply {reply!r} is longer than the limit {max_new_tokens}"
            rows.append(ids + [eos] * (max_new_tokens - len(ids)))
        return torch.cat([input_ids, torch.tensor(rows)], dim=1)

    monkeypatch.setattr(chat_stories.model, "generate", fake_generate)
    monkeypatch.setattr(chat_stories, "fast", None)  # HF generate's path: the job logic is every runner's
    return chat_stories, script, calls


def test_user_turn_prefix_is_the_template_up_to_the_users_words(chat_stories):
    from specgraft.train.regeneration import user_turn_prefix

    ids, end = user_turn_prefix(chat_stories.tokenizer)
    assert chat_stories.tokenizer.decode(ids) == "<|user|>\n"
    assert end == "<|end|>"


def test_self_instruct_writes_the_user_turn_then_answers_it(scripted, tmp_path):
    target, script, calls = scripted
    script += [["Why is the sky blue?<EOS>", "Tell me about cats<|end|>\nignored"], ["Light scatters.<EOS>", "Cats purr.<EOS>"]]
    path = tmp_path / "out.jsonl"
    summary = run(target, [], path, self_instruct=2, self_instruct_max_tokens=20, max_new_tokens=12)
    assert (summary.written, summary.duplicates, summary.filtered) == (2, 0, 0)
    assert calls[0] == (["<|user|>\n"] * 2, 20)  # the user turn is sampled from the template's user prefix
    assert calls[1] == (
        ["<|user|>\nWhy is the sky blue?<|end|>\n<|assistant|>\n", "<|user|>\nTell me about cats<|end|>\n<|assistant|>\n"],
        12,
    )
    assert lines(path) == [
        {"id": "self-0", "messages": [{"role": "user", "content": "Why is the sky blue?"},
                                      {"role": "assistant", "content": "Light scatters."}]},
        {"id": "self-1", "messages": [{"role": "user", "content": "Tell me about cats"},
                                      {"role": "assistant", "content": "Cats purr."}]},
    ]


def test_self_instruct_drops_duplicate_and_unfinished_user_turns_and_samples_again(scripted, tmp_path):
    target, script, calls = scripted
    script += [
        ["Same question?<EOS>", "same   QUESTION?<EOS>"], ["An answer.<EOS>"],  # the second repeats the first
        ["a user turn that never ends"],  # no end of turn within the limit: dropped
        ["Another question?<EOS>"], ["Another answer.<EOS>"],
    ]
    path = tmp_path / "out.jsonl"
    summary = run(target, [], path, self_instruct=2, self_instruct_max_tokens=32, batch_size=4)
    assert (summary.written, summary.duplicates, summary.filtered) == (2, 1, 1)
    assert [len(prompts) for prompts, _ in calls] == [2, 1, 1, 1, 1]  # no batch asks for more than still wanted
    assert [r["messages"][0]["content"] for r in lines(path)] == ["Same question?", "Another question?"]
    assert [r["id"] for r in lines(path)] == ["self-0", "self-3"]


def test_self_instruct_stops_after_its_attempt_cap(scripted, tmp_path, caplog):
    from specgraft.train.regeneration import SELF_INSTRUCT_ATTEMPTS

    target, script, calls = scripted
    cap = 2 * SELF_INSTRUCT_ATTEMPTS  # two conversations wanted
    script += [["Hi?<EOS>"], ["Hello.<EOS>"]] + [["Hi?<EOS>"]] * (cap - 1)  # then the target only repeats itself
    with caplog.at_level("WARNING"):
        summary = run(target, [], tmp_path / "out.jsonl", self_instruct=2, batch_size=1)
    assert (summary.written, summary.duplicates) == (1, cap - 1)
    assert script == [] and "1 conversations short after sampling 8 user turns" in caplog.text


def test_self_instruct_resumes_up_to_the_requested_count_without_repeating_itself(scripted, tmp_path):
    target, script, calls = scripted
    path = tmp_path / "out.jsonl"
    script += [["First?<EOS>"], ["One.<EOS>"]]
    run(target, [], path, self_instruct=1)
    script += [["first?<EOS>"], ["Second?<EOS>"], ["Two.<EOS>"]]  # a repeat of the file's turn, then a new one
    summary = run(target, [], path, self_instruct=2)
    assert (summary.written, summary.duplicates) == (1, 1)
    assert [r["id"] for r in lines(path)] == ["self-0", "self-2"]
    assert run(target, [], path, self_instruct=2).written == 0 and script == []


def test_self_instruct_needs_a_chat_template(stories, tmp_path):
    with pytest.raises(ValueError, match="self_instruct=2 needs a chat template"):
        run(stories, [], tmp_path / "out.jsonl", self_instruct=2)


def test_self_instruct_needs_sampling(chat_stories, tmp_path):
    with pytest.raises(ValueError, match="needs temperature > 0"):
        run(chat_stories, [], tmp_path / "out.jsonl", self_instruct=2, temperature=0)


def test_self_instruct_on_the_real_model_writes_conversations(stories, tmp_path):
    """Unscripted: stories260K, under a template whose user turn ends at a newline, writes a story line as
    the user turn (it never emits EOS early), which is then answered."""
    tokenizer = copy.deepcopy(stories.tokenizer)
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    target = Target(stories.model, tokenizer, name="stories-plain-chat")
    path = tmp_path / "out.jsonl"
    # A story line ends within 64 tokens about one time in four, within 128 nearly always (6 seeds: 3 of 3
    # conversations after 3-4 attempts): the attempt cap (4 per conversation) is then out of reach.
    summary = run(target, [], path, self_instruct=3, self_instruct_max_tokens=128, batch_size=3)
    assert summary.written == 3, summary
    for record in lines(path):
        assert [m["role"] for m in record["messages"]] == ["user", "assistant"]
        assert record["messages"][0]["content"] and "\n" not in record["messages"][0]["content"]


def test_question_records_are_answered_by_the_target(scripted, tmp_path):
    """A GSM8K-style prompt file: the question is the user turn; the file's own answer is replaced."""
    target, script, calls = scripted
    source = tmp_path / "gsm8k.jsonl"
    source.write_text(json.dumps({"question": "What is 2 + 3?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5"}) + "\n")
    script += [["Five.<EOS>"]]
    run(target, load_records(source), tmp_path / "out.jsonl")
    assert calls[0][0] == ["<|user|>\nWhat is 2 + 3?<|end|>\n<|assistant|>\n"]
    assert lines(tmp_path / "out.jsonl") == [
        {"id": "0", "messages": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "Five."}]}
    ]


def test_duplicate_prompts_are_answered_once(scripted, tmp_path):
    target, script, calls = scripted
    inputs = [{"id": "a", "question": "What is 2 + 3?"}, {"id": "b", "question": "what is  2 + 3?"}, {"id": "c", "question": "Why?"}]
    script += [["Five.<EOS>", "Because.<EOS>"]]
    summary = run(target, inputs, tmp_path / "out.jsonl")
    assert (summary.written, summary.duplicates) == (2, 1)
    assert [r["id"] for r in lines(tmp_path / "out.jsonl")] == ["a", "c"]
    script += [["Five again.<EOS>"]]
    assert run(target, inputs, tmp_path / "out.jsonl", dedupe=False).written == 1  # b, now kept


def test_user_turns_outside_the_token_limits_are_left_out(scripted, tmp_path):
    target, script, calls = scripted
    tokens = lambda text: len(target.tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    short, middle, long = "Hi", "Tell me a story about a dog.", "Tell me a long story about a dog and a cat and a bird."
    assert tokens(short) < tokens(middle) < tokens(long)
    script += [["Once.<EOS>"]]
    summary = run(target, [{"question": q} for q in (short, middle, long)], tmp_path / "out.jsonl",
                  min_user_tokens=tokens(short) + 1, max_user_tokens=tokens(middle))
    assert (summary.written, summary.filtered) == (1, 2)
    assert lines(tmp_path / "out.jsonl")[0]["messages"][0]["content"] == middle


def test_a_known_evaluation_prompt_is_refused_before_anything_is_generated_or_deleted(stories, tmp_path, submitted):
    inputs = [{"question": "What is 2 + 3?"}, {"question_id": 81, "turns": [MT_BENCH_81.upper()]}]
    earlier = tmp_path / "out.jsonl"
    earlier.write_text('{"id": "0", "text": "an earlier run"}\n')
    with pytest.raises(ValueError, match=r"input 1 \(id '81'\).*known evaluation set \(MT-bench"):
        run(stories, inputs, earlier, resume=False)
    assert submitted == [] and earlier.read_text() == '{"id": "0", "text": "an earlier run"}\n'


def test_a_prompt_of_the_runs_own_evaluation_file_is_refused(stories, tmp_path):
    from specgraft.train.heldout import HeldOut

    held_out = HeldOut(["Tom had a red ball. He liked to"], "eval.prompts (dev.jsonl)")
    with pytest.raises(ValueError, match=r"input 1 \(id '1'\).*one of eval\.prompts \(dev\.jsonl\)"):
        run(stories, PROMPTS, tmp_path / "out.jsonl", held_out=held_out)


def test_regenerate_command_refuses_an_evaluation_set_as_prompts(tmp_path, monkeypatch, capsys):
    """The real CLI on a config whose prompts file is MT-bench-format evaluation data: refused before generating."""
    from specgraft.cli import main
    from tests.conftest import STORIES

    if not STORIES.is_dir():
        pytest.skip(f"../shared assets are absent ({STORIES} not found)")
    prompts = tmp_path / "question.jsonl"
    prompts.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": [MT_BENCH_81]}) + "\n")
    config = tmp_path / "regen.yaml"
    config.write_text(
        f"target: {{path: {STORIES}}}\nhead: {{type: medusa}}\n"
        f"data: {{regenerate: {{output: {tmp_path / 'out.jsonl'}, prompts: {prompts}}}}}\n"
    )
    assert main(["regenerate", str(config)]) == 2
    assert "known evaluation set" in capsys.readouterr().err and not (tmp_path / "out.jsonl").exists()


def test_max_prompts_answers_the_first_prompts_that_pass_the_filters(scripted, tmp_path):
    target, script, calls = scripted
    inputs = [{"id": i, "question": q} for i, q in enumerate(["Why?", "why?", "How?", "When?"])]
    script += [["Because.<EOS>", "Like so.<EOS>"]]
    summary = run(target, inputs, tmp_path / "out.jsonl", max_prompts=2)
    assert (summary.written, summary.duplicates) == (2, 1)
    assert [r["id"] for r in lines(tmp_path / "out.jsonl")] == ["0", "2"]


def test_two_processes_write_the_same_records_as_one(stories, tmp_path):
    """`specgraft regenerate` under torchrun with two (gloo) ranks at temperature 0: each rank answers its slice
    into its own shard, rank 0 merges them in input order, and the file equals one process's, line for line."""
    import os
    import socket
    import subprocess
    import sys

    import yaml

    openings = [f"{opening} {name}" for opening in PROMPTS for name in ("Tom", "Lily", "Sam")]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in openings))
    config = tmp_path / "regen.yaml"
    config.write_text(yaml.safe_dump({
        "target": {"path": stories.name},
        "head": {"type": "medusa"},
        "data": {"regenerate": {"output": str(tmp_path / "two.jsonl"), "prompts": str(prompts), "max_new_tokens": 16,
                                "temperature": 0, "batch_size": 2, "num_from_bos": 3}},
        "training": {"output_dir": str(tmp_path / "run"), "num_threads": 1},
    }))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(port), "-m", "specgraft.cli", "regenerate", str(config),
    ]
    result = subprocess.run(command, capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    one = tmp_path / "one.jsonl"
    run(stories, load_records(str(prompts)), one, max_new_tokens=16, temperature=0, num_from_bos=3)
    assert (tmp_path / "two.jsonl").read_text() == one.read_text()
    assert len(lines(one)) == len(openings) + 3
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("two.jsonl")) == ["two.jsonl"]  # merged


def test_a_merge_cut_short_is_completed_without_repeats(tmp_path):
    from specgraft.train.regeneration import merge_shards, shard_path

    out = tmp_path / "out.jsonl"
    order = [str(i) for i in range(6)]
    for rank in range(2):
        shard_path(out, rank, 2).write_text(
            "".join(json.dumps({"id": i, "text": i}) + "\n" for i in order[rank::2])
            + (json.dumps({"id": f"self-r{rank}-0", "messages": []}) + "\n")
        )
    out.write_text(json.dumps({"id": "0", "text": "0"}) + "\n" + '{"id": "2", "te')  # a merge killed mid-line
    assert merge_shards(out, 2, order) == 7
    assert [r["id"] for r in lines(out)] == ["0", "1", "2", "3", "4", "5", "self-r0-0", "self-r1-0"]
    assert not list(tmp_path.glob("out.jsonl.rank*"))


def test_a_merge_leaves_out_a_self_written_question_another_rank_also_wrote(tmp_path):
    from specgraft.train.regeneration import merge_shards, shard_path

    out = tmp_path / "out.jsonl"

    def chat(record_id: str, question: str) -> str:
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": "4."}]
        return json.dumps({"id": record_id, "messages": messages}) + "\n"

    out.write_text(chat("0", "What is 1 + 1?"))
    shard_path(out, 0, 2).write_text(chat("self-r0-0", "What is 2 + 2?") + chat("self-r0-1", "Why?"))
    shard_path(out, 1, 2).write_text(chat("self-r1-0", "what is  2 + 2?") + chat("self-r1-1", "what is 1 + 1?"))
    assert merge_shards(out, 2, ["0"], dedupe=True) == 2
    assert [r["id"] for r in lines(out)] == ["0", "self-r0-0", "self-r0-1"]


def test_a_round_past_max_len_ends_its_conversation_at_the_last_reply(stories, tmp_path, submitted):
    two_turns = {"id": "a", "turns": ["Tell me a story.", "And then?"]}
    long_one = {"id": "b", "turns": ["Once upon a time " * 20]}
    first = stories.encode("user: Tell me a story.\nassistant:")  # the template-less chat format, BOS included
    summary = run(stories, [two_turns, long_one], tmp_path / "out.jsonl", max_len=len(first) + 12)
    assert len(submitted[0]) == len(first)  # the first round fits exactly; b's and a's second round do not
    assert (summary.written, summary.too_long) == (1, 1)
    assert [m["role"] for m in lines(tmp_path / "out.jsonl")[0]["messages"]] == ["user", "assistant"]
