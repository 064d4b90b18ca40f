"""vLLM's extract_hidden_states files imported as a recording (`specgraft.train.vllm_records`), on files written here
in vLLM's format (its ExampleHiddenStatesConnector: "hidden_states" (T, L, H) at the sorted layer ids, the last one
before the final norm, and "token_ids" (T,)); tests/test_vllm.py imports what vLLM itself wrote."""

from __future__ import annotations

import fcntl
import json
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specgraft.train.data import collate
from specgraft.train.recording import Recording
from specgraft.train.vllm_records import import_vllm_records, vllm_layers, wait_until_written

LAYERS = [5, 1, 3]  # as a user gives vLLM's eagle_aux_hidden_state_layer_ids: stories260K has 5 layers


@torch.no_grad()
def vllm_states(target, ids: list[int], layers) -> torch.Tensor:
    """What vLLM stores for ``ids``: (T, L, H), ``layers`` ascending, the last layer's output before the final norm."""
    captured = {}

    def keep_input(module, args, out) -> None:
        captured["pre"] = args[0][0]

    hook = target.model.get_decoder().norm.register_forward_hook(keep_input)
    try:
        out = target.model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        hook.remove()
    n = target.num_layers
    return torch.stack([captured["pre"] if i == n else out.hidden_states[i][0] for i in sorted(layers)], dim=1)


def write_request(directory: Path, name: str, target, ids: list[int], prompt_tokens: int, layers=LAYERS) -> None:
    """One request's file as vLLM's connector writes it, and its line in the index (what vLLM's answer reports)."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file({"hidden_states": vllm_states(target, ids, layers), "token_ids": torch.tensor(ids)},
              str(directory / f"{name}.safetensors"))
    (directory / f"{name}.safetensors.lock").touch()  # vLLM leaves it, released, beside the file
    with open(directory / "requests.jsonl", "a") as index:
        index.write(json.dumps({"hidden_states_path": f"/elsewhere/{name}.safetensors",
                                "prompt_tokens": prompt_tokens}) + "\n")


def requests(target, count: int = 3) -> list[tuple[str, list[int], int]]:
    """(name, prompt + generated tokens, prompt tokens) of a few requests."""
    g = torch.Generator().manual_seed(0)
    out = []
    for k in range(count):
        prompt, generated = 3 + k, 6 + 2 * k
        out.append((f"{k}-cafe{k:04d}", [1, *torch.randint(3, 512, (prompt + generated - 1,), generator=g).tolist()],
                    prompt))
    return out


def test_an_import_holds_vllms_tokens_and_the_targets_states_at_them(stories, tmp_path):
    for name, ids, prompt in requests(stories):
        write_request(tmp_path / "vllm", name, stories, ids, prompt)
    report = import_vllm_records(tmp_path / "vllm", tmp_path / "rec", stories, LAYERS)
    assert (report.imported, report.already, report.prompt_only) == (3, 0, ())
    rec = Recording(tmp_path / "rec")
    assert rec.info.layers == (1, 3, 5) and len(rec) == 3
    examples = rec.examples()
    features = rec.features(stories, [1, 3])
    for index, (example, (_, ids, prompt)) in enumerate(zip(examples, requests(stories))):  # in the index's order
        assert example["input_ids"] == ids and example["loss_mask"] == [0] * prompt + [1] * (len(ids) - prompt)
        got = features.batch([index], collate([example], pad_token_id=0))
        out = stories.model(torch.tensor([ids]), output_hidden_states=True)
        for layer in (1, 3):
            torch.testing.assert_close(got.hidden[layer][0], out.hidden_states[layer][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.target_logits[0], out.logits[0].float(), atol=1e-4, rtol=1e-4)  # via the final norm


def test_importing_again_adds_only_the_requests_not_yet_imported(stories, tmp_path):
    (first, second, third) = requests(stories)
    for name, ids, prompt in (first, second):
        write_request(tmp_path / "vllm", name, stories, ids, prompt)
    import_vllm_records(tmp_path / "vllm", tmp_path / "rec", stories, LAYERS)
    again = import_vllm_records(tmp_path / "vllm", tmp_path / "rec", stories, LAYERS)
    assert (again.imported, again.already, again.shards) == (0, 2, ())
    write_request(tmp_path / "vllm", third[0], stories, third[1], third[2])
    later = import_vllm_records(tmp_path / "vllm", tmp_path / "rec", stories, LAYERS)
    assert (later.imported, later.already) == (1, 2)
    assert [e["input_ids"] for e in Recording(tmp_path / "rec").examples()] == [first[1], second[1], third[1]]


def test_prompt_only_requests_are_left_out_and_an_index_of_only_those_is_refused(stories, tmp_path):
    (name, ids, prompt), (other, other_ids, other_prompt) = requests(stories, 2)
    write_request(tmp_path / "only", name, stories, ids[:prompt], prompt)  # include_output_tokens was not sent
    with pytest.raises(ValueError, match="include_output_tokens"):
        import_vllm_records(tmp_path / "only", tmp_path / "rec", stories, LAYERS)
    assert not (tmp_path / "rec").exists()  # a failed import leaves no recording behind
    write_request(tmp_path / "mixed", name, stories, ids[:prompt], prompt)
    write_request(tmp_path / "mixed", other, stories, other_ids, other_prompt)
    report = import_vllm_records(tmp_path / "mixed", tmp_path / "rec", stories, LAYERS)
    assert report.imported == 1 and report.prompt_only == (f"{name}.safetensors",)
    assert "include_output_tokens" in report.summary(tmp_path / "mixed", tmp_path / "rec")


@pytest.mark.parametrize("layers, match", [([1, 3], "leave out 5"), ([1, 3, 3, 5], "repeat"), ([1, 6, 5], r"\[6\]")])
def test_layers_must_hold_the_last_one_each_once_in_range(stories, layers, match):
    with pytest.raises(ValueError, match=match):
        vllm_layers(stories, layers)
    assert vllm_layers(stories, [5, 0, 2]) == (0, 2, 5)  # vLLM stores them ascending


def test_layers_other_than_vllms_are_caught_by_the_targets_forward(stories, tmp_path):
    (name, ids, prompt), = requests(stories, 1)
    write_request(tmp_path / "vllm", name, stories, ids, prompt)  # written for 1, 3, 5
    with pytest.raises(ValueError, match="at layer 2 differ"):
        import_vllm_records(tmp_path / "vllm", tmp_path / "rec", stories, [2, 3, 5])
    assert not (tmp_path / "rec").exists()


def test_a_file_of_other_layers_a_missing_file_and_a_bad_index_line_are_named(stories, tmp_path):
    (name, ids, prompt), = requests(stories, 1)
    write_request(tmp_path / "vllm", name, stories, ids, prompt)
    shapes = rf"{name}.safetensors: hidden_states \({len(ids)}, 3, 64\).*expected \({len(ids)}, 4, 64\)"
    with pytest.raises(ValueError, match=shapes):
        import_vllm_records(tmp_path / "vllm", tmp_path / "rec", stories, [0, 1, 3, 5])
    with open(tmp_path / "vllm" / "requests.jsonl", "a") as index:
        index.write(json.dumps({"hidden_states_path": "gone.safetensors", "prompt_tokens": 2}) + "\n")
        index.write('{"hidden_states_path": "x.safetensors"}\n')
    with pytest.raises(ValueError, match=r"requests.jsonl:3: .*prompt_tokens"):
        import_vllm_records(tmp_path / "vllm", tmp_path / "rec", stories, LAYERS)
    with pytest.raises(FileNotFoundError, match="gone.safetensors does not exist"):
        import_vllm_records(tmp_path / "vllm", tmp_path / "rec", stories, LAYERS, index=_first_lines(tmp_path, 2))
    with pytest.raises(FileNotFoundError, match="no index"):
        import_vllm_records(tmp_path / "vllm", tmp_path / "rec", stories, LAYERS, index=tmp_path / "none.jsonl")


def _first_lines(tmp_path: Path, n: int) -> Path:
    index = tmp_path / "short.jsonl"
    index.write_text("".join((tmp_path / "vllm" / "requests.jsonl").read_text().splitlines(keepends=True)[:n]))
    return index


def test_a_file_is_read_once_vllms_writer_lets_go_of_its_lock(tmp_path):
    file = tmp_path / "0-abc.safetensors"
    fd = os.open(f"{file}.lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as the connector holds it while it writes
    with pytest.raises(TimeoutError, match="still held"):
        wait_until_written(file, timeout_s=0.1)
    threading.Timer(0.2, os.close, [fd]).start()
    wait_until_written(file, timeout_s=10)  # returns once the writer closes it
    wait_until_written(tmp_path / "no-lock.safetensors")  # a connector without locks writes none


def test_import_records_command(stories, tmp_path, capsys):
    from conftest import STORIES
    from specgraft.cli import main

    for name, ids, prompt in requests(stories, 2):
        write_request(tmp_path / "vllm", name, stories, ids, prompt)
    assert main(["import-records", str(tmp_path / "vllm"), str(tmp_path / "rec"), "--target", str(STORIES),
                 "--layers", "5,1,3"]) == 0
    assert "imported 2 requests" in capsys.readouterr().out and len(Recording(tmp_path / "rec")) == 2
    assert main(["import-records", str(tmp_path / "vllm"), str(tmp_path / "rec"), "--target", str(STORIES),
                 "--layers", "1,3"]) == 2
    assert "leave out 5" in capsys.readouterr().err
