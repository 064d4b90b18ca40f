"""Training data: reading every record format, loss masks on both template paths, batching, splits."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from specgraft.train.data import (
    TokenizedDataset,
    collate,
    load_records,
    prompt_ids,
    tokenize_examples,
    tokenize_record,
    train_eval_split,
)

# A minimal jinja chat template. Its end-of-turn marker is plain text so the
# masked tokens decode back to exactly "{content}<|end|>\n".
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ '\\n' }}{{ m['content'] }}<|end|>{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{{ '\\n' }}{% endif %}"
)
CONVERSATION = {
    "id": "c",
    "messages": [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Tell me a story."},
        {"role": "assistant", "content": "Once upon a time"},
        {"role": "user", "content": "More"},
        {"role": "assistant", "content": "The end."},
    ],
}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def masked_runs(example, tokenizer) -> list[str]:
    """Decoded text of each maximal run of trained tokens."""
    runs, current = [], []
    for token, trained in zip(example["input_ids"], example["loss_mask"]):
        if trained:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


@pytest.fixture
def chat_tokenizer(stories):
    tokenizer = copy.deepcopy(stories.tokenizer)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# ---------------------------------------------------------------- reading


def test_sharegpt_jsonl_is_normalised(tmp_path):
    path = write_jsonl(
        tmp_path / "sg.jsonl",
        [
            {
                "id": "x1",
                "conversations": [
                    {"from": "system", "value": "S"},
                    {"from": "human", "value": "Q"},
                    {"from": "gpt", "value": "A"},
                ],
            }
        ],
    )
    assert load_records(path) == [
        {
            "id": "x1",
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "A"},
            ],
        }
    ]


def test_openai_json_array_is_read(tmp_path):
    path = tmp_path / "oa.json"
    rows = [{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}] * 2
    path.write_text(json.dumps(rows))
    assert load_records(path) == [{"id": str(i), **rows[i]} for i in range(2)]


def test_text_parquet_is_read(tmp_path):
    import datasets

    path = tmp_path / "t.parquet"
    datasets.Dataset.from_list([{"text": "one"}, {"text": "two"}]).to_parquet(str(path))
    assert load_records(path) == [{"id": "0", "text": "one"}, {"id": "1", "text": "two"}]


def test_turns_records_become_user_messages_keyed_by_question_id(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question_id": 81, "category": "w", "turns": ["a", "b"]}])
    assert load_records(path) == [
        {"id": "81", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    ]


def test_question_records_become_a_user_turn_and_its_answer(tmp_path):
    """GSM8K's format: the question is the user turn, the answer (when present) the assistant turn."""
    rows = [{"question": "What is 2 + 3?", "answer": "#### 5"}, {"id": "q", "question": "Why?"}]
    assert load_records(write_jsonl(tmp_path / "gsm8k.jsonl", rows)) == [
        {"id": "0", "messages": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "#### 5"}]},
        {"id": "q", "messages": [{"role": "user", "content": "Why?"}]},
    ]


def test_auto_detects_each_file_of_a_folder(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "plain"}])
    write_jsonl(tmp_path / "b.jsonl", [{"conversations": [{"from": "human", "value": "Q"}]}])
    records = load_records(tmp_path)
    assert [("text" in r, "messages" in r) for r in records] == [(True, False), (False, True)]


def test_auto_reads_a_regenerated_mix_of_messages_and_text(tmp_path):
    rows = [{"id": "0", "messages": [{"role": "user", "content": "Q"}]}, {"id": "bos-0", "text": "story"}]
    path = write_jsonl(tmp_path / "mix.jsonl", rows)
    assert load_records(path) == rows


def test_explicit_format_is_enforced(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "plain"}])
    with pytest.raises(ValueError, match=r"t\.jsonl: record 0: missing field 'conversations'"):
        load_records(path, format="sharegpt")


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"conversations": [{"from": "human"}]}, r"conversations\[0\] is missing 'value'"),
        ({"conversations": "hello"}, r"field 'conversations' must be a list, got str"),
        ({"conversations": [{"from": "bot", "value": "hi"}]}, r"conversations\[0\] has unknown role 'bot'"),
        ({"conversations": [{"from": "gpt", "value": 3}]}, r"conversations\[0\]\.value must be a string, got int"),
        ({"prompt": "Q"}, r"missing field 'conversations' \(keys: \['prompt'\]\)"),
    ],
)
def test_malformed_record_error_names_file_and_index(tmp_path, bad, message):
    good = {"conversations": [{"from": "human", "value": "Q"}]}
    path = write_jsonl(tmp_path / "data.jsonl", [good, good, bad])
    with pytest.raises(ValueError, match=r"data\.jsonl: record 2: " + message):
        load_records(path)


def test_file_without_any_known_field_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "odd.jsonl", [{"prompt": "Q"}])
    with pytest.raises(ValueError, match=r"odd\.jsonl: record 0: cannot tell the format.*\['prompt'\]"):
        load_records(path)


def test_openai_unknown_role_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "oa.jsonl", [{"messages": [{"role": "tool", "content": "x"}]}])
    with pytest.raises(ValueError, match=r"oa\.jsonl: record 0: messages\[0\] has unknown role 'tool'"):
        load_records(path)


def test_skip_mode_drops_and_counts_malformed_records(tmp_path):
    good = {"text": "fine"}
    path = write_jsonl(tmp_path / "data.jsonl", [good, {"text": 5}, good, {"other": 1}])
    records = load_records(path, on_error="skip")
    assert [r["id"] for r in records] == ["0", "2"]
    assert records.skipped == 2
    assert "data.jsonl: record 1: field 'text' must be a str" in records.errors[0]


def test_missing_local_file_is_not_looked_up_on_the_hub(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_records(tmp_path / "absent.jsonl")


def test_a_name_that_is_not_a_local_path_is_read_from_the_hub(monkeypatch):
    import datasets

    asked = []

    def fake_load_dataset(name, split):
        asked.append((name, split))
        return datasets.Dataset.from_list([{"text": "a"}, {"prompt": "b"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    with pytest.raises(ValueError, match=r"org/name\[test\]: record 1: missing field 'text'"):
        load_records("org/name", split="test")
    assert asked == [("org/name", "test")]


def test_bad_on_error_value_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="on_error='ignore'"):
        load_records(tmp_path, on_error="ignore")


# ---------------------------------------------------------------- tokenizing


def test_text_record_trains_every_token_but_the_first(stories):
    example = tokenize_record({"id": "t", "text": "Once upon a time"}, stories.tokenizer, 64)
    assert example["input_ids"] == stories.encode("Once upon a time")
    assert example["input_ids"][0] == stories.tokenizer.bos_token_id
    assert example["loss_mask"] == [0] + [1] * (len(example["input_ids"]) - 1)


def test_plain_template_renders_documented_text(stories):
    example = tokenize_record(CONVERSATION, stories.tokenizer, 512)
    assert example["input_ids"][0] == stories.tokenizer.bos_token_id
    assert stories.tokenizer.decode(example["input_ids"], skip_special_tokens=True) == (
        "system: Be kind.\nuser: Tell me a story.\nassistant: Once upon a time\nuser: More\nassistant: The end.\n"
    )


def test_plain_template_trains_only_assistant_turns(stories):
    example = tokenize_record(CONVERSATION, stories.tokenizer, 512)
    assert masked_runs(example, stories.tokenizer) == ["Once upon a time\n", "The end.\n"]


def test_chat_template_trains_only_assistant_turns(chat_tokenizer):
    example = tokenize_record(CONVERSATION, chat_tokenizer, 512)
    assert masked_runs(example, chat_tokenizer) == ["Once upon a time<|end|>\n", "The end.<|end|>\n"]


def test_chat_template_text_is_not_given_a_second_bos(chat_tokenizer):
    example = tokenize_record(CONVERSATION, chat_tokenizer, 512)
    assert chat_tokenizer.decode(example["input_ids"]).startswith("<|system|>\nBe kind.<|end|>")
    assert chat_tokenizer.bos_token_id not in example["input_ids"]


def test_chat_template_that_rewrites_history_is_an_error(chat_tokenizer):
    chat_tokenizer.chat_template = "{% for m in messages | reverse %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="record 'c'.*not a prefix"):
        tokenize_record(CONVERSATION, chat_tokenizer, 512)


# Like Qwen3's: an assistant turn before the last user turn loses its reasoning.
DROPS_OLD_REASONING = (
    "{% set ns = namespace(last_user=0) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ '\\n' }}"
    "{% if m['role'] == 'assistant' and loop.index0 < ns.last_user %}{{ m['content'].split('</think>')[-1] }}"
    "{% else %}{{ m['content'] }}{% endif %}<|end|>{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{{ '\\n' }}{% endif %}"
)
REASONING = copy.deepcopy(CONVERSATION)
REASONING["messages"][2]["content"] = "<think>hmm</think>Once upon a time"


def test_a_conversation_whose_template_drops_old_reasoning_splits_by_turn(chat_tokenizer):
    chat_tokenizer.chat_template = DROPS_OLD_REASONING
    with pytest.raises(ValueError, match="record 'c'.*not a prefix"):
        tokenize_record(REASONING, chat_tokenizer, 512)
    first, second = tokenize_examples(REASONING, chat_tokenizer, 512)
    assert (first["id"], second["id"]) == ("c/2", "c/4")
    # Each example is what the model reads when it writes that turn, trained on that turn only.
    assert masked_runs(first, chat_tokenizer) == ["<think>hmm</think>Once upon a time<|end|>\n"]
    assert masked_runs(second, chat_tokenizer) == ["The end.<|end|>\n"]
    history = chat_tokenizer.decode(second["input_ids"])
    assert "<|assistant|>\nOnce upon a time<|end|>" in history and "hmm" not in history
    assert second["input_ids"][: len(prompt_ids(REASONING["messages"][:4], chat_tokenizer))] == prompt_ids(
        REASONING["messages"][:4], chat_tokenizer
    )


def test_a_prefix_preserving_conversation_stays_one_example(chat_tokenizer):
    chat_tokenizer.chat_template = DROPS_OLD_REASONING
    (example,) = tokenize_examples(CONVERSATION, chat_tokenizer, 512)  # nothing to drop: history is unchanged
    assert example["id"] == "c"
    assert masked_runs(example, chat_tokenizer) == ["Once upon a time<|end|>\n", "The end.<|end|>\n"]


def test_a_template_that_rewrites_even_single_turns_is_still_an_error(chat_tokenizer):
    chat_tokenizer.chat_template = "{% for m in messages | reverse %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="record 'c'.*not a prefix"):
        tokenize_examples(CONVERSATION, chat_tokenizer, 512)


def test_dataset_splits_conversations_whose_template_rewrites_history(chat_tokenizer):
    chat_tokenizer.chat_template = DROPS_OLD_REASONING
    dataset = TokenizedDataset([REASONING, CONVERSATION], chat_tokenizer, 512)
    assert [e["id"] for e in dataset] == ["c/2", "c/4", "c"]


def test_prompt_ids_end_with_the_generation_prompt(stories, chat_tokenizer):
    history = CONVERSATION["messages"][:2]
    chat = chat_tokenizer.decode(prompt_ids(history, chat_tokenizer))
    assert chat.endswith("Tell me a story.<|end|>\n<|assistant|>\n")
    plain = stories.tokenizer.decode(prompt_ids(history, stories.tokenizer), skip_special_tokens=True)
    assert plain.endswith("user: Tell me a story.\nassistant:")


def test_truncation_keeps_the_first_max_length_tokens(stories):
    full = tokenize_record(CONVERSATION, stories.tokenizer, 512)
    cut = tokenize_record(CONVERSATION, stories.tokenizer, 20)
    assert len(cut["input_ids"]) == len(cut["loss_mask"]) == 20
    assert cut["input_ids"] == full["input_ids"][:20]
    assert cut["loss_mask"] == full["loss_mask"][:20]


# ---------------------------------------------------------------- batching


def test_collate_right_pads_and_masks_padding():
    batch = collate(
        [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [1]}], pad_token_id=0
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].dtype == torch.float32
    assert batch["loss_mask"].tolist() == [[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]


def test_collate_rejects_mismatched_mask_length():
    with pytest.raises(ValueError, match="example 0: 2 input_ids but 1 loss_mask"):
        collate([{"input_ids": [1, 2], "loss_mask": [1]}], pad_token_id=0)


def test_dataset_drops_examples_with_nothing_to_train(stories):
    prompt_only = {"id": "p", "messages": [{"role": "user", "content": "Hi"}]}
    dataset = TokenizedDataset([CONVERSATION, prompt_only], stories.tokenizer, 64)
    assert len(dataset) == 1 and dataset.dropped == 1
    assert dataset[0]["id"] == "c"


def test_dataset_batches_through_a_dataloader(stories):
    records = [{"id": str(i), "text": "Once upon a time " * (i + 1)} for i in range(3)]
    dataset = TokenizedDataset(records, stories.tokenizer, 64)
    loader = torch.utils.data.DataLoader(dataset, batch_size=3, collate_fn=lambda b: collate(b, pad_token_id=0))
    batch = next(iter(loader))
    lengths = [len(e["input_ids"]) for e in dataset]
    assert batch["input_ids"].shape == (3, max(lengths))
    assert batch["attention_mask"].sum(1).tolist() == lengths


def test_split_is_deterministic_and_partitions(stories):
    items = list(range(50))
    train, evaluation = train_eval_split(items, 0.2, seed=3)
    assert (train, evaluation) == train_eval_split(items, 0.2, seed=3)
    assert len(evaluation) == 10
    assert sorted(train + evaluation) == items


def test_split_depends_on_the_seed():
    items = list(range(50))
    assert train_eval_split(items, 0.2, seed=0)[1] != train_eval_split(items, 0.2, seed=1)[1]


def test_split_holds_out_at_least_one_item():
    assert len(train_eval_split(list(range(5)), 0.01)[1]) == 1


def test_subsample_keeps_nested_seeded_shares_in_input_order():
    from specgraft.train.data import subsample

    items = list(range(64))
    eighth, quarter, half = (subsample(items, f, seed=5) for f in (1 / 8, 1 / 4, 1 / 2))
    assert (len(eighth), len(quarter), len(half)) == (8, 16, 32)
    assert set(eighth) < set(quarter) < set(half)
    assert half == sorted(half)  # input order kept
    assert subsample(items, 1.0) == items
    assert subsample(items, 1 / 8, seed=6) != eighth
    assert subsample(items[:3], 0.01) == [subsample(items[:3], 0.01)[0]] and len(subsample(items[:3], 0.01)) == 1
    with pytest.raises(ValueError, match="fraction=0"):
        subsample(items, 0)
