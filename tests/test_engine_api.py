"""The public generation API: prompt forms, streaming, stats, stop rules, budgets and bad input."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from conftest import STORIES, tiny_causal_lm

import specgraft as sg

DESIGN_STATS_KEYS = {
    "new_tokens",
    "target_calls",
    "mean_accepted_length",
    "accept_length_histogram",
    "draft_tokens_per_token",
    "ttft_s",
    "tokens_per_s",
    "itl_p50_s",
    "itl_p99_s",
    "kv_cache_tokens_peak",
    "lossless",
}
BRANCHING_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]
DRAFTERS = ["plain", "prompt_lookup", "self_chain", "self_tree", "random_draft"]
N = 64  # new tokens for most tests on stories260K


def make_generator(target: sg.Target, kind: str) -> sg.SpeculativeGenerator:
    if kind == "plain":
        return sg.SpeculativeGenerator(target, None)
    if kind == "prompt_lookup":
        return sg.SpeculativeGenerator(target, sg.PromptLookup())
    if kind == "self_chain":
        return sg.SpeculativeGenerator(target, sg.DraftModel(target, target), tree=sg.Chain(5))
    if kind == "self_tree":
        return sg.SpeculativeGenerator(target, sg.DraftModel(target, target), tree=sg.StaticTree(BRANCHING_TREE))
    if kind == "random_draft":
        draft = sg.DraftModel(tiny_causal_lm("llama", vocab_size=target.vocab_size, seed=3), target)
        return sg.SpeculativeGenerator(target, draft, tree=sg.Chain(3))
    raise KeyError(kind)


def hf_generate(target: sg.Target, ids: list[int], n: int, **kwargs) -> list[int]:
    x = torch.tensor([ids])
    out = target.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n, **kwargs)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def prompt(dev_prompts) -> str:
    return dev_prompts[0]


@pytest.fixture(scope="module")
def prompt_ids(stories, prompt) -> list[int]:
    return stories.encode(prompt)


@pytest.fixture(scope="module")
def reference(stories, prompt_ids) -> list[int]:
    """The target's own greedy continuation, EOS disabled."""
    return hf_generate(stories, prompt_ids, N, eos_token_id=None)


@pytest.fixture(scope="module")
def tiny_target() -> sg.Target:
    """A tokenizer-less tiny random Llama (vocab 97, context 256)."""
    return sg.load_target(tiny_causal_lm("llama"))


# --------------------------------------------------------------------------- prompt forms


def test_text_prompt_and_its_token_ids_give_the_same_output(stories, prompt, prompt_ids):
    gen = make_generator(stories, "self_chain")
    from_text = gen.generate(prompt, max_new_tokens=32)
    from_ids = gen.generate(prompt_ids, max_new_tokens=32)
    assert from_text.token_ids == from_ids.token_ids
    assert from_text.text == from_ids.text


def test_tensor_prompt_gives_the_same_output_as_a_token_list(stories, prompt_ids):
    gen = make_generator(stories, "self_chain")
    expected = gen.generate(prompt_ids, max_new_tokens=32).token_ids
    assert gen.generate(torch.tensor(prompt_ids), max_new_tokens=32).token_ids == expected
    assert gen.generate(torch.tensor([prompt_ids]), max_new_tokens=32).token_ids == expected


def test_batched_tensor_prompt_raises_value_error_instead_of_concatenating(stories, prompt_ids):
    # (2, S) is a batch of two prompts; it must not be silently read as one prompt of 2S tokens.
    gen = make_generator(stories, "plain")
    with pytest.raises(ValueError):
        gen.generate(torch.tensor([prompt_ids, prompt_ids]), max_new_tokens=4)


def test_text_prompt_matches_hf_greedy_of_the_tokenized_prompt(stories, prompt, prompt_ids):
    out = make_generator(stories, "prompt_lookup").generate(prompt, max_new_tokens=N, eos_token_id=())
    assert out.token_ids == hf_generate(stories, prompt_ids, N, eos_token_id=None)
    # The text continues the prompt's: its first word keeps the space SentencePiece drops at a decode's start.
    assert prompt + out.text == stories.decode(prompt_ids + out.token_ids)
    assert out.text.startswith(" ") and not stories.decode(out.token_ids).startswith(" ")


# --------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("kind", DRAFTERS)
def test_stream_token_ids_concatenate_to_generate_token_ids(stories, prompt, kind):
    gen = make_generator(stories, kind)
    chunks = list(gen.stream(prompt, max_new_tokens=N))
    assert [t for c in chunks for t in c.token_ids] == gen.generate(prompt, max_new_tokens=N).token_ids


@pytest.mark.parametrize("index", [0, 5, 11, 30])
def test_stream_text_concatenates_to_generate_text(stories, dev_prompts, index):
    gen = make_generator(stories, "self_chain")
    text = "".join(c.text for c in gen.stream(dev_prompts[index], max_new_tokens=N))
    expected = gen.generate(dev_prompts[index], max_new_tokens=N).text
    assert expected and text == expected


def test_stream_text_concatenates_to_generate_text_when_stopped_mid_step(stories, prompt, reference):
    gen = make_generator(stories, "self_chain")
    eos = reference[20]
    text = "".join(c.text for c in gen.stream(prompt, max_new_tokens=N, eos_token_id=eos))
    assert text == gen.generate(prompt, max_new_tokens=N, eos_token_id=eos).text


def test_stream_yields_one_chunk_per_step_with_stats_on_the_last_only(stories, prompt):
    chunks = list(make_generator(stories, "self_chain").stream(prompt, max_new_tokens=N))
    assert chunks[-1].stats is not None
    assert all(c.stats is None for c in chunks[:-1])
    assert chunks[-1].token_ids == []
    # the first chunk is the prefill's token, then one chunk per target call
    assert len(chunks) == chunks[-1].stats.target_calls + 2


def test_stream_last_chunk_stats_match_generate_stats(stories, prompt):
    gen = make_generator(stories, "self_tree")
    streamed = list(gen.stream(prompt, max_new_tokens=N))[-1].stats
    generated = gen.generate(prompt, max_new_tokens=N).stats
    for key in ("new_tokens", "target_calls", "mean_accepted_length", "accept_length_histogram",
                "draft_tokens_per_token", "kv_cache_tokens_peak", "lossless"):
        assert getattr(streamed, key) == getattr(generated, key), key


# --------------------------------------------------------------------------- stats


def test_stats_have_every_field_of_the_design_table(stories, prompt):
    stats = make_generator(stories, "self_chain").generate(prompt, max_new_tokens=16).stats
    assert isinstance(stats, sg.GenerationStats)
    assert {f.name for f in dataclasses.fields(stats)} == DESIGN_STATS_KEYS
    assert set(json.loads(json.dumps(stats.to_dict()))) == DESIGN_STATS_KEYS  # JSON report keys


@pytest.mark.parametrize("kind", DRAFTERS)
def test_stats_new_tokens_equals_the_number_of_generated_tokens(stories, prompt_ids, kind):
    out = make_generator(stories, kind).generate(prompt_ids, max_new_tokens=N, eos_token_id=())
    assert out.stats.new_tokens == len(out.token_ids) == N


@pytest.mark.parametrize("kind", DRAFTERS)
def test_stats_histogram_sums_to_target_calls(stories, prompt_ids, kind):
    stats = make_generator(stories, kind).generate(prompt_ids, max_new_tokens=N, eos_token_id=()).stats
    assert stats.target_calls > 0
    assert sum(stats.accept_length_histogram) == stats.target_calls


@pytest.mark.parametrize("kind", DRAFTERS)
def test_stats_histogram_accounts_for_every_token_after_the_first(stories, prompt_ids, kind):
    stats = make_generator(stories, kind).generate(prompt_ids, max_new_tokens=N, eos_token_id=()).stats
    committed = sum((i + 1) * count for i, count in enumerate(stats.accept_length_histogram))
    assert committed == stats.new_tokens - 1


@pytest.mark.parametrize("kind", DRAFTERS)
def test_stats_mean_accepted_length_is_tokens_after_the_first_per_target_call_without_a_cut(stories, prompt_ids, kind):
    stats = make_generator(stories, kind).generate(prompt_ids, max_new_tokens=N, eos_token_id=()).stats
    assert stats.mean_accepted_length == pytest.approx((stats.new_tokens - 1) / stats.target_calls)


@pytest.mark.parametrize("kind", DRAFTERS)
def test_stats_report_greedy_decoding_as_lossless(stories, prompt_ids, kind):
    stats = make_generator(stories, kind).generate(prompt_ids, max_new_tokens=16).stats
    assert stats.lossless is True


def test_plain_decoding_stats_make_one_target_call_per_token(stories, prompt_ids):
    stats = make_generator(stories, "plain").generate(prompt_ids, max_new_tokens=N, eos_token_id=()).stats
    assert stats.target_calls == N - 1
    assert stats.mean_accepted_length == 1.0
    assert stats.accept_length_histogram == [N - 1]
    assert stats.draft_tokens_per_token == 0.0


def test_plain_decoding_kv_peak_is_the_last_verified_sequence(stories, prompt_ids):
    stats = make_generator(stories, "plain").generate(prompt_ids, max_new_tokens=N, eos_token_id=()).stats
    # the last step runs the root at position len(prompt) + N - 2; the last token itself is never run
    assert stats.kv_cache_tokens_peak == len(prompt_ids) + N - 1


def test_draft_model_kv_peak_counts_the_draft_cache_too(stories, prompt_ids):
    stats = make_generator(stories, "self_chain").generate(prompt_ids, max_new_tokens=N, eos_token_id=()).stats
    target_only = len(prompt_ids) + N - 1
    assert target_only + len(prompt_ids) <= stats.kv_cache_tokens_peak <= 2 * (len(prompt_ids) + N) + 5


def test_draft_model_kv_peak_counts_both_draft_trees(stories, prompt_ids):
    """Target and draft caches at their fullest, each holding the step's draft tree (exact: all accepted)."""
    stats = make_generator(stories, "self_chain").generate(prompt_ids, max_new_tokens=N, eos_token_id=()).stats
    peak, done = 0, 1
    while done < N:
        d = min(5, N - done - 1)  # the step's chain depth
        cached = len(prompt_ids) + done - 1  # committed tokens before the root, in both caches
        # target: the cache plus root and d nodes; draft: the cache plus root and the d - 1 nodes it expanded
        peak = max(peak, (cached + d + 1) + (cached + d))
        done += d + 1
    assert stats.kv_cache_tokens_peak == peak


def test_stats_count_the_last_step_before_a_stop_cut(stories, prompt_ids, reference):
    """tau and the histogram both count what verification committed, also in the step an EOS cut short."""
    # An EOS in the middle of a self-drafted chain step (steps commit 6 tokens after the first).
    k = next(k for k in range(1, N) if k % 6 not in (0, 5) and reference[k] not in reference[:k])
    stats = make_generator(stories, "self_chain").generate(prompt_ids, max_new_tokens=N, eos_token_id=reference[k]).stats
    committed = sum((i + 1) * count for i, count in enumerate(stats.accept_length_histogram))
    assert stats.new_tokens == k + 1
    assert committed > stats.new_tokens - 1  # the cut dropped tokens the last step had committed
    assert sum(stats.accept_length_histogram) == stats.target_calls
    assert stats.mean_accepted_length == pytest.approx(committed / stats.target_calls)


def test_self_draft_chain_draft_tokens_per_token_counts_every_proposed_node(stories, prompt_ids):
    stats = make_generator(stories, "self_chain").generate(prompt_ids, max_new_tokens=N, eos_token_id=()).stats
    # the target drafting for itself is accepted in full, so the schedule is known:
    # each step drafts min(5, remaining - 1) tokens and commits one more than it drafts
    drafted, done = 0, 1
    while done < N:
        d = min(5, N - done - 1)
        drafted += d
        done += d + 1
    assert stats.draft_tokens_per_token == pytest.approx(drafted / N)


@pytest.mark.parametrize("kind", DRAFTERS)
def test_stats_timings_are_positive_and_ordered(stories, prompt_ids, kind):
    stats = make_generator(stories, kind).generate(prompt_ids, max_new_tokens=32, eos_token_id=()).stats
    assert stats.ttft_s > 0
    assert stats.tokens_per_s > 0 and math.isfinite(stats.tokens_per_s)
    assert 0 < stats.itl_p50_s <= stats.itl_p99_s


# --------------------------------------------------------------------------- end of sequence


@pytest.mark.parametrize("kind", DRAFTERS)
def test_eos_id_ends_the_output_at_its_first_occurrence_like_hf(stories, prompt_ids, reference, kind):
    eos = reference[20]
    first = reference.index(eos)
    out = make_generator(stories, kind).generate(prompt_ids, max_new_tokens=N, eos_token_id=eos)
    assert out.token_ids == reference[: first + 1]  # the EOS token is kept, as transformers does
    assert out.token_ids == hf_generate(stories, prompt_ids, N, eos_token_id=eos)


@pytest.mark.parametrize("kind", ["plain", "self_chain", "self_tree"])
def test_several_eos_ids_end_the_output_at_the_first_of_any(stories, prompt_ids, reference, kind):
    late, early = reference[40], reference[25]
    first = min(reference.index(late), reference.index(early))
    out = make_generator(stories, kind).generate(prompt_ids, max_new_tokens=N, eos_token_id=[late, early])
    assert out.token_ids == reference[: first + 1]
    assert out.token_ids == hf_generate(stories, prompt_ids, N, eos_token_id=[late, early])


def test_eos_cutting_a_step_short_counts_kept_tokens_as_new_and_committed_ones_in_tau(stories, prompt_ids, reference):
    eos = reference[20]
    out = make_generator(stories, "self_chain").generate(prompt_ids, max_new_tokens=N, eos_token_id=eos)
    committed = sum((i + 1) * c for i, c in enumerate(out.stats.accept_length_histogram))
    assert committed > len(out.token_ids) - 1  # the last step committed tokens past the EOS
    assert out.stats.new_tokens == len(out.token_ids)
    # tau is on the histogram's basis: what verification committed, before the EOS cut
    assert out.stats.mean_accepted_length == pytest.approx(committed / out.stats.target_calls)


def _tiny_prompt_with_eos(tiny_target) -> tuple[list[int], list[int]]:
    """A prompt whose greedy continuation on the tiny Llama contains its EOS id 2 early on."""
    for seed in range(200):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, 97, (8,), generator=g).tolist()
        full = hf_generate(tiny_target, ids, 40, eos_token_id=None, pad_token_id=0)
        if 2 in full[:30]:
            return ids, full
    raise AssertionError("no prompt found whose tiny-Llama continuation contains EOS")


def test_default_eos_is_the_targets_own(tiny_target):
    ids, full = _tiny_prompt_with_eos(tiny_target)
    out = make_generator(tiny_target, "self_chain").generate(ids, max_new_tokens=40)
    assert out.token_ids == full[: full.index(2) + 1]
    assert out.token_ids == hf_generate(tiny_target, ids, 40, pad_token_id=0)


def test_empty_eos_ids_disable_end_of_sequence(tiny_target):
    ids, full = _tiny_prompt_with_eos(tiny_target)
    out = make_generator(tiny_target, "self_chain").generate(ids, max_new_tokens=40, eos_token_id=())
    assert out.token_ids == full


# --------------------------------------------------------------------------- stop strings


def _first_completion(target, ids: list[int], stop: str) -> int:
    return next(k for k in range(len(ids)) if stop in target.decode(ids[: k + 1]))


@pytest.mark.parametrize("kind", DRAFTERS)
@pytest.mark.parametrize("stop", ["run around.", "big b"])
def test_stop_string_ends_the_output_with_the_token_completing_it(stories, prompt_ids, reference, kind, stop):
    assert stop in stories.decode(reference)
    k = _first_completion(stories, reference, stop)
    out = make_generator(stories, kind).generate(prompt_ids, max_new_tokens=N, stop=stop, eos_token_id=())
    assert out.token_ids == reference[: k + 1]
    assert stop in out.text


def test_stop_string_output_matches_hf_stop_strings(stories, prompt_ids):
    out = make_generator(stories, "self_chain").generate(prompt_ids, max_new_tokens=N, stop="big b")
    assert out.token_ids == hf_generate(stories, prompt_ids, N, stop_strings="big b", tokenizer=stories.tokenizer)


def test_the_first_of_several_stop_strings_ends_the_output(stories, prompt_ids, reference):
    stops = ["big b", "run around."]
    k = min(_first_completion(stories, reference, s) for s in stops)
    out = make_generator(stories, "self_tree").generate(prompt_ids, max_new_tokens=N, stop=stops, eos_token_id=())
    assert out.token_ids == reference[: k + 1]


def test_stop_string_never_generated_leaves_the_budget_in_charge(stories, prompt_ids, reference):
    out = make_generator(stories, "self_chain").generate(prompt_ids, max_new_tokens=N, stop="zebra!", eos_token_id=())
    assert out.token_ids == reference


def test_stop_string_on_a_target_without_tokenizer_raises_value_error(tiny_target):
    # Without a tokenizer the output cannot be decoded, so a stop string could never fire.
    gen = make_generator(tiny_target, "plain")
    with pytest.raises(ValueError, match="tokenizer"):
        gen.generate([5, 6, 7], max_new_tokens=8, stop="x")


# --------------------------------------------------------------------------- token bans


@pytest.mark.parametrize("kind", ["plain", "self_chain"])
def test_banned_token_never_appears_in_greedy_output_like_hf_bad_words(stories, prompt_ids, reference, kind):
    banned = reference[3]
    out = make_generator(stories, kind).generate(
        prompt_ids, max_new_tokens=32, eos_token_id=(), banned_token_ids=[banned]
    )
    assert banned not in out.token_ids
    assert out.token_ids == hf_generate(stories, prompt_ids, 32, eos_token_id=None, bad_words_ids=[[banned]])


# --------------------------------------------------------------------------- token budget


@pytest.mark.parametrize("kind", DRAFTERS)
@pytest.mark.parametrize("n", [1, 2, 3, 6, 13])
def test_max_new_tokens_is_respected_exactly(stories, prompt_ids, reference, kind, n):
    out = make_generator(stories, kind).generate(prompt_ids, max_new_tokens=n, eos_token_id=())
    assert out.token_ids == reference[:n]


def test_generation_that_fills_the_context_exactly_is_allowed(stories):
    ids = stories.encode("Once upon a time")
    n = stories.max_context - len(ids)
    out = make_generator(stories, "prompt_lookup").generate(ids, max_new_tokens=n, eos_token_id=())
    assert out.token_ids == hf_generate(stories, ids, n, eos_token_id=None)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("empty", ["", [], torch.tensor([], dtype=torch.long)], ids=["text", "list", "tensor"])
def test_empty_prompt_raises_value_error(stories, empty):
    with pytest.raises(ValueError, match="empty"):
        make_generator(stories, "plain").generate(empty, max_new_tokens=4)


@pytest.mark.parametrize("bad", [[1, 512], [1, -1], [1, 2.0]], ids=["vocab_size", "negative", "float"])
def test_out_of_range_token_ids_raise_value_error_naming_the_vocabulary(stories, bad):
    with pytest.raises(ValueError, match="512"):
        make_generator(stories, "plain").generate(bad, max_new_tokens=4)


@pytest.mark.parametrize("n", [0, -3, 2.5])
def test_non_positive_or_non_integer_max_new_tokens_raises_value_error(stories, n):
    with pytest.raises(ValueError, match="max_new_tokens"):
        make_generator(stories, "plain").generate([1, 403], max_new_tokens=n)


def test_prompt_plus_budget_beyond_the_context_raises_value_error_naming_the_numbers(stories):
    ids = stories.encode("Once upon a time")
    n = 513 - len(ids)
    with pytest.raises(ValueError) as err:
        make_generator(stories, "plain").generate(ids, max_new_tokens=n)
    message = str(err.value)
    assert str(len(ids)) in message and str(n) in message and "512" in message


def test_negative_temperature_raises_value_error(stories):
    with pytest.raises(ValueError, match="temperature"):
        make_generator(stories, "plain").generate([1, 403], max_new_tokens=4, temperature=-0.5)


def test_text_prompt_on_a_target_without_tokenizer_raises_value_error(tiny_target):
    with pytest.raises(ValueError, match="tokenizer"):
        make_generator(tiny_target, "plain").generate("Once upon a time", max_new_tokens=4)


def test_load_target_rejects_an_unknown_dtype_name():
    with pytest.raises(ValueError, match="float64"):
        sg.load_target(STORIES, dtype="float64")


def test_load_target_rejects_a_bad_device_string():
    with pytest.raises(ValueError, match="not-a-device"):
        sg.load_target(STORIES, device="not-a-device")


def test_load_target_rejects_flash_attention_2():
    with pytest.raises(ValueError, match="flash_attention_2"):
        sg.load_target(STORIES, attn_implementation="flash_attention_2")


def test_load_target_of_a_missing_path_raises_file_not_found_naming_it(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        sg.load_target(missing)
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        sg.load_target(str(missing))


def test_draft_model_with_another_vocabulary_raises_value_error_naming_both_sizes(tiny_target):
    with pytest.raises(ValueError, match=r"101.*97|97.*101"):
        sg.DraftModel(tiny_causal_lm("llama", vocab_size=101, seed=1), tiny_target)


class _HalfDrafter:
    hidden_layers = ()

    def propose(self, root_token, policy, max_depth, sampling=None):
        raise AssertionError("never called")


@pytest.mark.parametrize("drafter", [object(), _HalfDrafter()], ids=["object", "no_reset_commit"])
def test_drafter_not_implementing_the_protocol_raises_type_error(tiny_target, drafter):
    with pytest.raises(TypeError, match="Drafter"):
        sg.SpeculativeGenerator(tiny_target, drafter)


def test_generator_rejects_a_raw_hf_model_as_target():
    with pytest.raises(TypeError, match="load_target"):
        sg.SpeculativeGenerator(tiny_causal_lm("llama"), None)


# --------------------------------------------------------------------------- per-token costs stay flat


def test_stop_rule_decodes_a_bounded_window_per_token(stories, dev_prompts):
    """The stop-string check decodes only the newest tokens: its work per token does not grow with the output."""
    from specgraft.infer.detokenize import Detokenizer
    from specgraft.infer.stopping import StopRule

    ids = stories.encode(" ".join(dev_prompts))  # long real text
    assert len(ids) > 300
    windows: list[int] = []

    def decode(part):
        windows.append(len(part))
        return stories.decode(part)

    stop = "no such words"
    rule = StopRule(len(ids) + 1, (), (stop,), Detokenizer(decode))
    for token in ids:
        rule.accept([token])
    assert not rule.done and rule.text.text + rule.text.tail == stories.decode(ids)
    assert max(windows) <= 8, f"decoded windows of up to {max(windows)} tokens"


def test_stop_rule_fires_at_the_token_a_full_decode_would(stories, dev_prompts):
    """Incremental matching agrees with matching the whole decoded output, token by token."""
    from specgraft.infer.detokenize import Detokenizer
    from specgraft.infer.stopping import StopRule

    ids = stories.encode(dev_prompts[5] + " " + dev_prompts[6])
    text = stories.decode(ids)
    for stop in (text[40:47], text[-5:], text[len(text) // 2 : len(text) // 2 + 12], " "):
        want = next(k for k in range(len(ids)) if stop in stories.decode(ids[: k + 1]))
        rule = StopRule(len(ids), (), (stop,), Detokenizer(stories.decode))
        kept = rule.accept(ids)
        assert len(kept) == want + 1, stop


def test_an_output_of_only_eos_has_no_mean_accepted_length(stories):
    """No verification step ran: the stats say so (None, null in JSON, "n/a (no steps)" in text), not tau 0.00."""
    from specgraft.infer import format_tau

    gen = sg.SpeculativeGenerator(stories, sg.PromptLookup())
    first = gen.generate("Once upon a time", max_new_tokens=1).token_ids[0]
    out = gen.generate("Once upon a time", max_new_tokens=16, eos_token_id=first)
    assert out.token_ids == [first] and out.stats.target_calls == 0
    assert out.stats.tau is None and json.loads(json.dumps(out.stats.to_dict()))["mean_accepted_length"] is None
    assert format_tau(out.stats.tau) == "n/a (no steps)"
    drafted = gen.generate("Once upon a time", max_new_tokens=16, eos_token_id=())
    assert drafted.stats.tau == drafted.stats.to_dict()["mean_accepted_length"] > 0
    assert format_tau(drafted.stats.tau) == f"{drafted.stats.mean_accepted_length:.2f}"
