"""Self-distillation on the real stories260K target: what is written, resume, padding, EOS."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from specgraft.target import Target
from specgraft.train.data import load_records
from specgraft.train.regenerate import regenerate

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ '\\n' }}{{ m['content'] }}<|end|>{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{{ '\\n' }}{% endif %}"
)
PROMPTS = ["Once upon a time", "Tom had a red ball. He liked to", "Lily saw a big dog."]


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def generate_calls(stories, monkeypatch):
    """Record the batch size of every `generate` call on the target."""
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


def test_bos_samples_are_generated_from_bos_alone(stories, tmp_path, monkeypatch):
    seen = []
    real = stories.model.generate

    def spy(*args, **kwargs):
        seen.append(kwargs["input_ids"][kwargs["attention_mask"].bool()].tolist())
        return real(*args, **kwargs)

    monkeypatch.setattr(stories.model, "generate", spy)
    path = tmp_path / "out.jsonl"
    run(stories, [], path, num_from_bos=2)
    assert seen == [[stories.tokenizer.bos_token_id] * 2]
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


def test_chat_template_target_is_prompted_with_its_template(stories, tmp_path, monkeypatch):
    tokenizer = copy.deepcopy(stories.tokenizer)
    tokenizer.chat_template = CHAT_TEMPLATE
    target = Target(stories.model, tokenizer, name="stories-chat")
    seen = []
    real = stories.model.generate

    def spy(*args, **kwargs):
        seen.append(tokenizer.decode(kwargs["input_ids"][0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(stories.model, "generate", spy)
    run(target, [{"id": "c", "turns": ["Tell me a story."]}], tmp_path / "out.jsonl")
    assert seen == ["<|user|>\nTell me a story.<|end|>\n<|assistant|>\n"]


def test_chat_replies_are_written_one_round_per_turn(stories, tmp_path, generate_calls):
    two_turns = {"id": "a", "turns": ["Tell me a story.", "And then?"]}
    one_turn = {"id": "b", "turns": ["Hi."]}
    run(stories, [two_turns, one_turn], tmp_path / "out.jsonl")
    assert generate_calls == [2, 1]  # round 1 answers both first turns, round 2 only a's second


def test_resume_skips_finished_ids(stories, tmp_path, generate_calls):
    path = tmp_path / "out.jsonl"
    run(stories, PROMPTS[:2], path, batch_size=4)
    before = path.read_text()
    summary = run(stories, PROMPTS, path, batch_size=4)
    assert (summary.written, summary.skipped) == (1, 2)
    assert generate_calls == [2, 1]
    assert path.read_text().startswith(before)
    assert [r["id"] for r in lines(path)] == ["0", "1", "2"]


def test_resume_of_a_finished_file_generates_nothing(stories, tmp_path, generate_calls):
    path = tmp_path / "out.jsonl"
    run(stories, PROMPTS, path, num_from_bos=1)
    before = path.read_bytes()
    generate_calls.clear()
    summary = run(stories, PROMPTS, path, num_from_bos=1)
    assert (summary.written, summary.skipped) == (0, 4)
    assert generate_calls == []
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


def test_continuation_stops_at_eos_and_drops_padding(stories, tmp_path, monkeypatch):
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
