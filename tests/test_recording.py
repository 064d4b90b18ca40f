"""Recording served traffic: the tokens a scheduler generated and the target's states at them, read back as
training data, with no change to what is generated."""

from __future__ import annotations

import pytest
import torch

import specgraft as sg
from conftest import STORIES, needs_shared
from specgraft.infer import Tokens
from specgraft.train.data import collate
from specgraft.train.recording import Recording, TrafficRecorder

TREE = sg.StaticTree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])


def serve(target, prompts, drafters=None, *, observer=None, cancel=None, **options):
    """Greedy outputs of ``prompts`` submitted together to one scheduler with ``options``, in prompt order
    (``cancel``: the index of a prompt cancelled after its first step)."""
    sched = sg.Scheduler(target, drafters or {}, max_batch_size=3, max_len=256)
    if observer is not None:
        sched.add_observer(observer)
    handles = [sched.submit(p, 24, **options) for p in prompts]
    out: dict[int, list[int]] = {h: [] for h in handles}
    while not sched.idle:
        for event in sched.step():
            if isinstance(event, Tokens):
                out[event.handle].extend(event.token_ids)
        if cancel is not None and handles[cancel] in sched.running:
            sched.cancel(handles[cancel])
            cancel = None
    return [out[h] for h in handles]


def record_traffic(target, head, directory, prompts, **options) -> list[list[int]]:
    """Serve ``prompts`` with ``head`` loaded as "eagle" (the requests' drafter unless ``options`` say otherwise)
    under a recorder of its layers into ``directory``, written whole before this returns; the outputs."""
    recorder = TrafficRecorder(directory, target, head.hidden_layers)
    try:
        return serve(target, prompts, {"eagle": head}, observer=recorder, **{"drafter": "eagle", **options})
    finally:
        recorder.close()


def full_states(target, ids: list[int], layers) -> dict[int, torch.Tensor]:
    """The target's states at every token of ``ids`` from one plain forward: layer -> (n, H)."""
    out = target.forward(torch.tensor([ids]), target.new_cache(), torch.arange(len(ids))[None], hidden_layers=layers)
    return {i: h[0] for i, h in out.hidden.items()}


@pytest.mark.parametrize("tree", [None, sg.Chain(4), TREE], ids=["plain", "chain", "tree"])
def test_recorded_generations_hold_the_tokens_run_and_the_targets_states_at_them(stories, dev_prompts,
                                                                                  trained_eagle, tmp_path, tree):
    eagle = sg.load_drafter(trained_eagle, stories)
    prompts = dev_prompts[:3]
    options = {"drafter": "none"} if tree is None else {"drafter": "eagle", "tree": tree}
    plain = serve(stories, prompts)
    recorded = record_traffic(stories, eagle, tmp_path / "rec", prompts, **options)
    assert recorded == plain  # recording changes nothing generated
    rec = Recording(tmp_path / "rec")
    assert rec.info.layers == (*sorted(set(eagle.hidden_layers) - {stories.num_layers}), stories.num_layers)
    examples = rec.examples()
    assert sorted(len(e["input_ids"]) for e in examples) == sorted(
        len(stories.encode(p)) + len(o) - 1 for p, o in zip(prompts, plain))
    features = rec.features(stories, eagle.hidden_layers)
    for prompt, output in zip(prompts, plain):
        ids = stories.encode(prompt)
        [index] = [k for k, e in enumerate(examples) if e["input_ids"][: len(ids)] == ids]
        example = examples[index]
        assert example["input_ids"] == ids + output[:-1]  # every token a forward ran; the last one none did
        assert example["loss_mask"] == [0] * len(ids) + [1] * (len(output) - 1)
        got = features.batch([index], collate([example], pad_token_id=0))
        want = full_states(stories, example["input_ids"], rec.info.layers)
        for layer in eagle.hidden_layers:
            torch.testing.assert_close(got.hidden[layer][0], want[layer], atol=1e-4, rtol=1e-4)
        logits = stories.model.get_output_embeddings()(want[stories.num_layers]).float()
        torch.testing.assert_close(got.target_logits[0], logits, atol=1e-4, rtol=1e-4)


def test_sampled_generations_draw_the_same_tokens_with_a_recorder(stories, dev_prompts, trained_eagle, tmp_path):
    eagle = sg.load_drafter(trained_eagle, stories)
    options = dict(drafter="eagle", tree=sg.Chain(3), temperature=0.8, seed=7)
    alone = serve(stories, dev_prompts[:3], {"eagle": eagle}, **options)
    recorded = record_traffic(stories, eagle, tmp_path / "rec", dev_prompts[:3], **options)
    assert recorded == alone and len(Recording(tmp_path / "rec")) == 3


def test_cancelled_and_opted_out_requests_are_not_recorded(stories, dev_prompts, trained_eagle, tmp_path):
    eagle = sg.load_drafter(trained_eagle, stories)
    recorder = TrafficRecorder(tmp_path / "rec", stories, eagle.hidden_layers)
    serve(stories, dev_prompts[:3], {"eagle": eagle}, observer=recorder, cancel=1, drafter="eagle")
    serve(stories, dev_prompts[3:5], {"eagle": eagle}, observer=recorder, drafter="eagle", record=False)
    recorder.close()
    examples = Recording(tmp_path / "rec").examples()
    prompts = sorted(tuple(e["input_ids"][: e["loss_mask"].index(1)]) for e in examples)
    assert prompts == sorted(tuple(stories.encode(p)) for p in (dev_prompts[0], dev_prompts[2]))


def test_a_directory_recorded_for_other_layers_is_refused_and_stray_files_are_never_read(stories, tmp_path):
    TrafficRecorder(tmp_path, stories, [2]).close()
    with pytest.raises(ValueError, match=r"records \[2, 5\].*records \[1, 5\].*another directory"):
        TrafficRecorder(tmp_path, stories, [1])
    (tmp_path / ".records-abc-000000.safetensors.x1y2.tmp").write_bytes(b"half a shard")  # a killed writer's
    assert len(Recording(tmp_path)) == 0
    (tmp_path / "records-abc-000000.safetensors").write_bytes(b"not a shard")
    with pytest.raises(ValueError, match="records-abc-000000.safetensors is not a readable shard"):
        Recording(tmp_path)
    with pytest.raises(FileNotFoundError, match="serve --record"):
        Recording(tmp_path / "absent")


def test_compacting_a_recording_merges_its_shards_and_a_killed_compaction_loses_and_doubles_nothing(
        stories, dev_prompts, trained_eagle, tmp_path, monkeypatch):
    from pathlib import Path

    from specgraft.train.recording import compact_recording

    eagle = sg.load_drafter(trained_eagle, stories)
    for k in range(4):  # four recorder runs: a shard each at least
        record_traffic(stories, eagle, tmp_path / "rec", dev_prompts[2 * k : 2 * k + 2])

    def contents():
        rec = Recording(tmp_path / "rec")
        examples = rec.examples()
        features = rec.features(stories, eagle.hidden_layers)
        states = [features.batch([i], collate([e], pad_token_id=0)).hidden for i, e in enumerate(examples)]
        return rec, sorted(zip((tuple(e["input_ids"]) for e in examples), examples, states), key=lambda t: t[0])

    def assert_same(got, want):
        assert [g[:2] for g in got] == [w[:2] for w in want]
        for (_, _, g), (_, _, w) in zip(got, want):
            for layer in eagle.hidden_layers:
                torch.testing.assert_close(g[layer], w[layer], atol=0, rtol=0)

    before, want = contents()
    assert len(before.shards) >= 4 and len(want) == 8
    sizes = sorted(shard.file.stat().st_size for shard in before.shards)
    unlink = Path.unlink
    calls = []

    def killed_after_one(path, *args, **kwargs):  # the compaction dies after removing one source
        if calls:
            raise KeyboardInterrupt
        calls.append(path)
        unlink(path, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        compact_recording(tmp_path / "rec", max_bytes=sum(sizes) + 1)
    monkeypatch.setattr(Path, "unlink", unlink)
    half, got = contents()
    assert len(half.shards) == 1 and len(half.replaced) == len(before.shards) - 1  # the merged one; sources skipped
    assert_same(got, want)
    assert compact_recording(tmp_path / "rec") == len(before.shards) - 1  # the leftovers go
    after, got = contents()
    assert [s.file.name for s in after.shards] == [s.file.name for s in half.shards] and not after.replaced
    assert_same(got, want)
    assert sorted((tmp_path / "rec").iterdir()) == sorted([tmp_path / "rec" / "recording.json", after.shards[0].file])

    for k in range(4, 6):  # more traffic, then merged in groups of at most two of these shards' sizes
        record_traffic(stories, eagle, tmp_path / "rec", dev_prompts[2 * k : 2 * k + 2])
    more, want = contents()
    limit = 2 * max(s.file.stat().st_size for s in more.shards[1:]) + 1
    compact_recording(tmp_path / "rec", max_bytes=limit)
    merged, got = contents()
    assert_same(got, want)
    assert len(merged.shards) < len(more.shards) and all(s.file.stat().st_size <= limit for s in merged.shards[1:])


# ---------------------------------------------------------------------------------------------- served


def test_a_server_records_its_requests_but_those_sent_with_store_false(stories, dev_prompts, trained_eagle, tmp_path):
    import httpx

    from serve_helpers import ServerThread
    from specgraft.infer.serve import create_app

    target = sg.load_target(STORIES)
    eagle = sg.load_drafter(trained_eagle, target)
    recorder = TrafficRecorder(tmp_path / "rec", target, eagle.hidden_layers)
    app = create_app(target, {"eagle": eagle}, model_name="stories", default_drafter="eagle", observers=[recorder])
    server = ServerThread(app).start()
    try:
        for prompt, store in ((dev_prompts[0], None), (dev_prompts[1], False), (dev_prompts[2], True)):
            body = {"model": "stories", "prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True,
                    **({} if store is None else {"store": store})}
            assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        server.stop()
        recorder.close()
    examples = Recording(tmp_path / "rec").examples()
    assert sorted(tuple(e["input_ids"][: e["loss_mask"].index(1)]) for e in examples) == sorted(
        tuple(target.encode(p)) for p in (dev_prompts[0], dev_prompts[2]))


def test_sigkill_while_recording_leaves_every_shard_whole(dev_prompts, trained_eagle, tmp_path):
    """A server recording a stream of requests, killed once it wrote a few shards: every shard on disk reads whole
    (its tokens, lengths and every layer's rows agree), and a temporary file it was writing is never read."""
    import signal
    import threading
    import time

    import httpx
    from safetensors import safe_open

    from serve_helpers import spawn_server

    record = tmp_path / "rec"
    proc, url = spawn_server("--drafter", f"eagle={trained_eagle}", "--default-drafter", "eagle", "--record", str(record))
    stop = threading.Event()

    def client(k: int) -> None:  # requests until the server dies (bounded in count and time)
        for i in range(200):
            if stop.is_set():
                return
            body = {"model": "stories260K", "prompt": dev_prompts[(k * 7 + i) % len(dev_prompts)],
                    "max_tokens": 8 + (i * 5) % 24, "temperature": 0}
            try:
                httpx.post(f"{url}/v1/completions", json=body, timeout=30)
            except httpx.HTTPError:
                return
    try:
        clients = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(4)]
        for thread in clients:
            thread.start()
        deadline = time.monotonic() + 60
        while len(list(record.glob("records-*.safetensors"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        stop.set()
        for thread in clients:
            thread.join(40)
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    shards = sorted(record.glob("records-*.safetensors"))
    assert len(shards) >= 3
    rec = Recording(record)
    for shard in rec.shards:
        with safe_open(str(shard.file), framework="pt") as f:
            n = sum(shard.lengths)
            assert f.get_tensor("input_ids").shape == (n,)
            for layer in rec.info.layers:
                assert f.get_tensor(f"layer.{layer}").shape == (n, rec.info.hidden_size)
        assert all(0 < p < length for p, length in zip(shard.prompt_lengths, shard.lengths))
    examples = rec.examples()
    assert len(examples) == sum(len(s.lengths) for s in rec.shards) >= 3
    features = rec.features(sg.load_target(STORIES), [rec.info.layers[0]])
    batch = features.batch([len(examples) - 1], collate([examples[-1]], pad_token_id=0))
    assert torch.isfinite(batch.hidden[rec.info.layers[0]]).all()


# ---------------------------------------------------------------------------------------------- trained on


def test_a_batch_mixing_recorded_and_original_rows_gets_each_rows_states_as_the_target_computes_them(
        stories, dev_prompts, trained_eagle, tmp_path):
    from specgraft.train.features import target_batch
    from specgraft.train.mix import MixedFeatures, open_recordings, recorded_examples, recorded_features, with_original_share

    eagle = sg.load_drafter(trained_eagle, stories)
    record_traffic(stories, eagle, tmp_path / "rec", dev_prompts[:4], tree=sg.Chain(3))
    recordings = open_recordings([tmp_path / "rec"])
    cut = max(len(stories.encode(p)) for p in dev_prompts[:4]) + 5  # every generation cut: a prefix of its states read
    recorded = recorded_examples(recordings, max_length=cut)
    assert len(recorded) == 4 and all(len(e["input_ids"]) <= cut for e in recorded)
    original = [{"input_ids": stories.encode(p), "loss_mask": [1] * len(stories.encode(p))} for p in dev_prompts[4:10]]
    mixed = with_original_share(recorded, original, 1 / 3, seed=0)
    assert mixed[:4] == recorded and len(mixed) == 6 and all(e in original for e in mixed[4:])
    layers = eagle.hidden_layers

    def online(indices, batch):
        return target_batch(stories, batch, layers)

    features = MixedFeatures(mixed, recorded_features(stories, layers, logits=True), online)
    rows = [5, 0, 4, 2]  # original, recorded, original, recorded
    batch = collate([mixed[i] for i in rows], pad_token_id=0)
    got, want = features.batch(rows, batch), target_batch(stories, batch, layers)
    real = batch["attention_mask"].bool()
    for layer in layers:
        torch.testing.assert_close(got.hidden[layer][real], want.hidden[layer][real], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.target_logits[real], want.target_logits[real], atol=1e-4, rtol=1e-4)
    assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.loss_mask, want.loss_mask)


@pytest.mark.parametrize("share", [0.0, 0.5])
def test_specgraft_train_fine_tunes_a_head_on_a_recording_running_the_target_only_for_the_original_share(
        stories, dev_prompts, trained_eagle, tmp_path, monkeypatch, share):
    import json

    import yaml

    from specgraft.cli import main
    from specgraft.train import trainer as trainer_module

    eagle = sg.load_drafter(trained_eagle, stories)
    record_traffic(stories, eagle, tmp_path / "rec", dev_prompts[:12], tree=sg.Chain(3))
    text = tmp_path / "original.jsonl"
    text.write_text("".join(json.dumps({"text": p}) + "\n" for p in dev_prompts[12:40]))  # 21 trained after the held-out quarter
    config = tmp_path / "recipe.yaml"
    config.write_text(yaml.safe_dump({
        "target": {"path": str(STORIES)},
        "head": {"type": "eagle"},  # the conftest head's config (EagleConfig's defaults)
        "data": {"train": str(text), "recorded": [str(tmp_path / "rec")], "original_share": share,
                 "max_length": 64, "eval_fraction": 0.25},
        "training": {"output_dir": str(tmp_path / "out"), "init_from": str(trained_eagle), "num_threads": 1,
                     "micro_batch_size": 4, "save_every": 0, "log_every": 1, "epochs": 1},
    }))
    rows: list[int] = []
    online = trainer_module.target_batch

    def counted(target, batch, *args, **kwargs):
        rows.append(batch["input_ids"].shape[0])
        return online(target, batch, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "target_batch", counted)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert main(["train", str(config)]) == 0
    from specgraft.train.mix import open_recordings, recorded_examples, split_recorded

    train, heldout = split_recorded(recorded_examples(open_recordings([tmp_path / "rec"]), 64), 0.25)
    assert heldout and train  # (a quarter held out, by each generation's hash)
    recorded_train = len(train)
    originals = round(share / (1 - share) * recorded_train)
    assert sum(rows) == originals  # the recorded rows read their recorded states; only the original ones ran
    best = json.loads((tmp_path / "out" / "best" / "best.json").read_text())
    assert "simulated_tau" in best


@needs_shared  # the config names stories260K, whose directory is checked before the recordings
def test_a_config_may_train_on_recordings_alone_and_a_missing_one_is_named(tmp_path):
    from specgraft.config import check_files, load_config

    config = tmp_path / "recipe.yaml"
    config.write_text(f"target: {{path: {STORIES}}}\nhead: {{type: eagle}}\ndata: {{recorded: [{tmp_path / 'nope'}]}}\n")
    cfg = load_config(config)
    assert cfg.data.train is None and cfg.data.original_share == 0.25
    with pytest.raises(FileNotFoundError, match=r"data.recorded\[0\]=.*nope"):
        check_files(cfg)


def test_a_growing_recording_keeps_its_held_out_generations_held_out():
    from specgraft.train.mix import split_recorded

    examples = [{"input_ids": [1, k, k * k % 97, 5], "loss_mask": [0, 1, 1, 1]} for k in range(400)]
    train, heldout = split_recorded(examples, 0.2)
    assert 0.12 < len(heldout) / 400 < 0.28 and len(train) + len(heldout) == 400
    early_train, early_heldout = split_recorded(examples[:150], 0.2)
    assert early_heldout == [e for e in heldout if e in examples[:150]]
    assert early_train == [e for e in train if e in examples[:150]]
