"""Heads that learn while serving: new weights swapped in between steps never change what is generated (greedy
output stays the target's own, sampled output follows its distribution), and a server swaps each published version."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import specgraft as sg
from specgraft.heads import as_drafter, build_head
from specgraft.heads.configs import DFlashConfig, EagleConfig, MedusaConfig
from specgraft.heads.medusa import MedusaDrafter
from specgraft.infer import Tokens
from conftest import STORIES as STORIES_PATH
from test_scheduler import small_vocab_pair  # noqa: F401  (a fixture)

TREE = sg.StaticTree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])


def other_head(target, seed: int):
    """A drafter of the conftest EAGLE head's shape with other (random) weights: a version that drafts badly."""
    torch.manual_seed(seed)
    return as_drafter(build_head(EagleConfig(), target), target)


def swapping(sched, versions: list, name: str = "eagle"):
    """Step ``sched`` to the end, its drafter ``name`` taking the next of ``versions`` before every step; the
    tokens of each generation by handle."""
    out: dict[int, list[int]] = {}
    k = 0
    while not sched.idle:
        sched.adopt(name, versions[k % len(versions)])
        k += 1
        for event in sched.step():
            if isinstance(event, Tokens):
                out.setdefault(event.handle, []).extend(event.token_ids)
    return out


@pytest.mark.parametrize("tree", [sg.Chain(4), TREE], ids=["chain", "tree"])
def test_greedy_output_stays_the_targets_while_the_head_changes_every_step(stories, dev_prompts, trained_eagle, tree):
    plain = sg.SpeculativeGenerator(stories, None)
    trained = sg.load_drafter(trained_eagle, stories)
    versions = [other_head(stories, 1), sg.load_drafter(trained_eagle, stories), other_head(stories, 2)]
    sched = sg.Scheduler(stories, {"eagle": trained}, max_batch_size=4, max_len=256)
    handles = [sched.submit(p, 40, drafter="eagle", tree=tree) for p in dev_prompts[:4]]
    out = swapping(sched, versions)
    for handle, prompt in zip(handles, dev_prompts[:4]):
        assert out[handle] == plain.generate(prompt, max_new_tokens=40).token_ids
    assert sched.counters.accepted_tokens > 0  # the trained version's steps accepted drafts


def test_sampled_output_follows_the_targets_distribution_while_the_head_changes_every_step(small_vocab_pair):
    """Rows of four sampling settings, 32 a step, their EAGLE head swapped between two versions before every
    step: each setting's continuations fit the enumerated distribution."""
    from test_scheduler import ROW_FILTERS, ROW_TEMPERATURES, enumerated

    from specgraft.tools.exactness import fit

    target, _ = small_vocab_pair
    versions = [other_head(target, seed) for seed in (3, 4)]
    sched = sg.Scheduler(target, {"eagle": other_head(target, 5)}, max_batch_size=32, max_len=16)
    prompts = ([0, 1, 2, 0, 1], [3, 4, 5], [1, 1, 2, 2], [5, 0, 3, 2, 4, 1])
    settings = [dict(temperature=t, **f) for t, f in zip(ROW_TEMPERATURES, ROW_FILTERS)]
    torch.manual_seed(11)
    counts = [Counter() for _ in settings]
    for _ in range(1600 // 8):  # 1,600 draws a setting
        handles = {}
        for _ in range(8):
            for k, (prompt, setting) in enumerate(zip(prompts, settings)):
                tree = sg.Chain(3, draw="sample") if k % 2 else sg.StaticTree([[0], [1], [0, 0]], draw="sample")
                handles[sched.submit(prompt, 3, drafter="eagle", tree=tree, eos_token_id=(), **setting)] = k
        for handle, tokens in swapping(sched, versions).items():
            counts[handles[handle]][tuple(tokens)] += 1
    for k, (prompt, setting) in enumerate(zip(prompts, settings)):
        result = fit(counts[k], enumerated(target, list(prompt), setting["temperature"],
                                           {key: v for key, v in setting.items() if key != "temperature"}))
        assert result.passed, f"row setting {k} {setting}: {result}"


def test_a_head_of_another_shape_or_kind_is_refused_and_the_drafter_keeps_its_own(stories, trained_eagle):
    from specgraft.heads.configs import Eagle3Config

    drafter = sg.load_drafter(trained_eagle, stories)
    head = drafter.head
    sched = sg.Scheduler(stories, {"eagle": drafter, "lookup": sg.PromptLookup()})
    wider = as_drafter(build_head(EagleConfig(num_layers=2), stories), stories)
    with pytest.raises(ValueError, match="num_layers"):
        sched.adopt("eagle", wider)
    with pytest.raises(ValueError, match="type"):
        sched.adopt("eagle", as_drafter(build_head(Eagle3Config(), stories), stories))
    with pytest.raises(TypeError, match="cannot take new weights"):
        sched.adopt("lookup", sg.PromptLookup())
    with pytest.raises(KeyError, match="no drafter 'nope'"):
        sched.adopt("nope", drafter)
    assert drafter.head is head


# ---------------------------------------------------------------------------------------------- Medusa and DFlash

BLOCK_HEADS = {"medusa": MedusaConfig(num_heads=3), "dflash": DFlashConfig(block_size=5, num_anchors=16)}


def head_version(kind: str, target, seed: int):
    """A drafter of the ``kind`` head above with seeded random weights: a version that drafts badly (a fresh Medusa
    head's blocks are zero, so every head would be the target's own lm_head: each weight moves by noise)."""
    torch.manual_seed(seed)
    head = build_head(BLOCK_HEADS[kind], target)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return as_drafter(head, target)


@pytest.fixture(scope="module")
def fitted_block_heads(stories):
    """kind -> a drafter of that head fitted for a second to 16 greedy stories (a version that drafts some tokens)."""
    from toy_train import fit, greedy_examples

    examples = greedy_examples(stories, 16, 48)
    torch.manual_seed(0)
    return {kind: as_drafter(fit(build_head(config, stories), stories, examples, steps=60, lr=1e-2), stories)
            for kind, config in BLOCK_HEADS.items()}


@pytest.mark.parametrize("tree", [sg.Chain(4), TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("kind", ["medusa", "dflash"])
def test_greedy_output_stays_the_targets_while_a_medusa_or_dflash_head_changes_every_step(
        stories, dev_prompts, fitted_block_heads, kind, tree):
    plain = sg.SpeculativeGenerator(stories, None)
    versions = [head_version(kind, stories, 1), fitted_block_heads[kind], head_version(kind, stories, 2)]
    sched = sg.Scheduler(stories, {kind: head_version(kind, stories, 3)}, max_batch_size=4, max_len=256)
    handles = [sched.submit(p, 40, drafter=kind, tree=tree) for p in dev_prompts[:4]]
    out = swapping(sched, versions, name=kind)
    for handle, prompt in zip(handles, dev_prompts[:4]):
        assert out[handle] == plain.generate(prompt, max_new_tokens=40).token_ids
    assert sched.counters.accepted_tokens > 0  # the fitted version's steps accepted drafts


def head_of(drafter):
    """The head module a Medusa or DFlash drafter drafts with."""
    return drafter.heads if isinstance(drafter, MedusaDrafter) else drafter.head


@pytest.mark.parametrize("kind", ["medusa", "dflash"])
def test_a_medusa_or_dflash_drafter_drafts_with_the_weights_it_adopted(stories, dev_prompts, kind):
    """A generation started before the swap drafts what a drafter built on the new head drafts: nothing of the old
    head (its weights or a form of them) stays in the drafter or in the generation's state."""
    from test_recording import full_states

    old, new = head_version(kind, stories, 1), head_version(kind, stories, 2)
    ids = torch.tensor(stories.encode(dev_prompts[0]))
    hidden = full_states(stories, ids.tolist(), old.hidden_layers)

    def draft(state) -> list[int]:
        return state.propose(int(ids[-1]), TREE, TREE.max_depth).tokens.tolist()

    assert draft(old.start(ids, hidden)) != draft(new.start(ids, hidden))  # (else this could not tell them apart)
    running = old.start(ids, hidden)
    old.adopt(new)
    assert draft(running) == draft(new.start(ids, hidden))
    assert draft(old.start(ids, hidden)) == draft(new.start(ids, hidden))


@pytest.mark.parametrize("kind", ["medusa", "dflash"])
def test_a_medusa_or_dflash_head_of_another_kind_shape_or_layers_is_refused_and_the_drafter_keeps_its_own(
        stories, kind):
    from dataclasses import replace

    from specgraft.heads.medusa import MedusaHeads

    drafter, config = head_version(kind, stories, 1), BLOCK_HEADS[kind]
    head = head_of(drafter)
    sched = sg.Scheduler(stories, {kind: drafter})
    for other in (head_version("dflash" if kind == "medusa" else "medusa", stories, 1), other_head(stories, 1)):
        with pytest.raises(ValueError, match=f"cannot adopt a {type(other).__name__}"):
            sched.adopt(kind, other)
    shape = {"medusa": "num_heads", "dflash": "block_size"}[kind]
    with pytest.raises(ValueError, match=f"head.{shape}: "):
        sched.adopt(kind, as_drafter(build_head(replace(config, **{shape: getattr(config, shape) + 1}), stories), stories))
    if kind == "medusa":  # Medusa's config names no layer (its heads read the target's last): heads built on another
        elsewhere = MedusaHeads(config, stories.config.hidden_size, stories.vocab_size, stories.num_layers - 1)
        with pytest.raises(ValueError, match="reads target layers"):
            sched.adopt(kind, as_drafter(elsewhere, stories))
    else:
        layers = [next(i for i in range(stories.num_layers - 1) if i not in head.config.target_layer_ids)]
        with pytest.raises(ValueError, match="head.target_layer_ids: "):
            sched.adopt(kind, as_drafter(build_head(replace(config, target_layer_ids=layers), stories), stories))
    assert head_of(drafter) is head
    loss_only = {"medusa": {"loss_decay": 0.5}, "dflash": {"loss_decay_gamma": 3.0}}[kind]  # (weigh the loss only)
    version = as_drafter(build_head(replace(config, **loss_only), stories), stories)
    sched.adopt(kind, version)
    assert head_of(drafter) is head_of(version)


# ---------------------------------------------------------------------------------------------- versions


def test_a_version_is_current_only_once_published_whole(trained_eagle, tmp_path):
    from specgraft.heads.published import current, publish

    assert current(tmp_path) is None
    first = publish(trained_eagle, tmp_path, 1, simulated_tau=1.5, generations=64)
    (tmp_path / ".v0002.partial").mkdir()  # a publisher killed while copying version 2
    (tmp_path / ".v0002.partial" / "config.json").write_text("{")
    assert current(tmp_path) == first and (tmp_path / "v0001" / "model.safetensors").is_file()
    second = publish(trained_eagle, tmp_path, 2, simulated_tau=1.7, previous_simulated_tau=1.5, generations=128)
    assert current(tmp_path) == second and second.head == str(tmp_path / "v0002")
    assert not (tmp_path / ".v0002.partial").exists()


class FakeRound:
    """A round of training that writes what `specgraft train` would: the best step and its tau, step 0's tau."""

    def __init__(self, trained_eagle, results):
        self.head, self.results, self.configs = trained_eagle, list(results), []

    def __call__(self, config_file):
        import json
        import shutil

        import yaml

        self.configs.append(yaml.safe_load(config_file.read_text()))
        status, step, tau = self.results.pop(0)
        if status:
            return status
        run = config_file.parent / "run"
        shutil.copytree(self.head, run / "best")
        (run / "best" / "best.json").write_text(json.dumps({"step": step, "simulated_tau": tau}))
        (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/simulated_tau": 1.25}) + "\n")
        return 0


def test_a_learner_publishes_a_round_only_when_a_fine_tuned_step_beats_the_version_serving(
        stories, dev_prompts, trained_eagle, tmp_path):
    from test_recording import record_traffic

    from specgraft.heads.published import current
    from specgraft.train.learner import Learner

    from specgraft.train.recording import Recording

    for k in (0, 3):  # two recorder runs: two shards at least
        record_traffic(stories, sg.load_drafter(trained_eagle, stories), tmp_path / "rec", dev_prompts[k : k + 3])
    rounds = FakeRound(trained_eagle, [(0, 12, 1.5), (0, 0, 1.25), (1, None, None)])
    learner = Learner(str(STORIES_PATH), str(trained_eagle), str(tmp_path / "rec"), str(tmp_path / "learn"), every=3,
                      train=rounds)
    learner.run(rounds=1, poll_s=0)
    published = current(tmp_path / "learn")
    assert (published.version, published.simulated_tau, published.previous_simulated_tau, published.generations) == (
        1, 1.5, 1.25, 6)
    assert len(Recording(tmp_path / "rec").shards) == 1 and len(Recording(tmp_path / "rec")) == 6  # compacted first
    config = rounds.configs[0]
    assert config["training"]["init_from"] == str(trained_eagle) and config["data"]["recorded"] == [str(tmp_path / "rec")]
    assert config["head"]["type"] == "eagle" and config["data"]["eval_fraction"] > 0
    assert learner.round(9) is None and learner.round(12) is None  # no step beat it; the round failed
    assert current(tmp_path / "learn") == published and rounds.configs[1]["training"]["init_from"] == published.head


# ---------------------------------------------------------------------------------------------- served


def test_a_server_refuses_to_learn_with_a_drafter_that_cannot_take_new_weights(stories, tmp_path):
    from specgraft.infer.serve import create_app

    with pytest.raises(ValueError, match="no drafter 'nope' to learn"):
        create_app(stories, {}, learning={"nope": tmp_path / "learn"})
    with pytest.raises(ValueError, match="'prompt-lookup' \\(PromptLookup\\) cannot learn"):
        create_app(stories, {}, learning={"prompt-lookup": tmp_path / "learn"})


def test_a_server_swaps_in_each_published_version_and_its_output_stays_the_targets(
        stories, dev_prompts, trained_eagle, tmp_path):
    import time

    import httpx

    from serve_helpers import ServerThread, metric
    from specgraft.heads import save_head
    from specgraft.heads.published import publish
    from specgraft.infer.serve import create_app

    target = sg.load_target(STORIES_PATH)
    app = create_app(target, {"eagle": sg.load_drafter(trained_eagle, target)}, model_name="m", default_drafter="eagle",
                     default_tree=sg.Chain(4), learning={"eagle": tmp_path / "learn"})
    plain = sg.SpeculativeGenerator(stories, None)
    server = ServerThread(app).start()

    def complete(prompt: str) -> list[int]:
        body = {"model": "m", "prompt": prompt, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
        return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["token_ids"]

    def version() -> float:
        return metric(httpx.get(f"{server.url}/metrics", timeout=10).text, "specgraft_head_version", 'drafter="eagle"')

    try:
        assert complete(dev_prompts[0]) == plain.generate(dev_prompts[0], max_new_tokens=24).token_ids
        torch.manual_seed(3)
        other = save_head(build_head(EagleConfig(), stories), tmp_path / "other", stories)
        publish(other, tmp_path / "learn", 1, simulated_tau=1.1)
        deadline = time.monotonic() + 20
        while version() != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert version() == 1
        for prompt in dev_prompts[1:3]:
            assert complete(prompt) == plain.generate(prompt, max_new_tokens=24).token_ids
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert metric(text, "specgraft_head_heldout_simulated_tau", 'drafter="eagle"') == 1.1
        for v in ("0", "1"):
            assert metric(text, "specgraft_head_draft_tokens_total", f'drafter="eagle",version="{v}"') > 0
        assert metric(text, "specgraft_head_accepted_tokens_total", 'drafter="eagle",version="0"') > 0
        (tmp_path / "learn" / ".v0002.partial").mkdir()  # a learner killed while publishing: version 1 serves on
        time.sleep(1.5)
        assert version() == 1 and complete(dev_prompts[3]) == plain.generate(dev_prompts[3], max_new_tokens=24).token_ids
    finally:
        server.stop()


def test_specgraft_learn_publishes_a_real_round_and_a_learner_killed_or_stopped_mid_round_publishes_nothing(
        stories, dev_prompts, trained_eagle, tmp_path):
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from test_recording import record_traffic

    from specgraft.heads.published import current

    eagle = sg.load_drafter(trained_eagle, stories)
    record_traffic(stories, eagle, tmp_path / "rec", dev_prompts[:20])
    command = [sys.executable, "-m", "specgraft.cli", "learn", "--target", str(STORIES_PATH), "--head", str(trained_eagle),
               "--record", str(tmp_path / "rec"), "--out", str(tmp_path / "learn"), "--every", "8"]
    done = subprocess.run(command + ["--rounds", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "round for version 1: 20 recorded generations" in done.stderr
    published = current(tmp_path / "learn")  # published, or kept: either way said so
    assert (published is not None) == ("published version 1" in done.stderr)
    record_traffic(stories, eagle, tmp_path / "rec", dev_prompts[20:30])  # more traffic for a second round
    for stop in (signal.SIGKILL, signal.SIGTERM):  # killed, then stopped as serve stops it, mid-round
        shutil.rmtree(tmp_path / "learn" / "rounds", ignore_errors=True)
        learner = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rounds = []  # the round's own training process
        try:
            deadline = time.monotonic() + 120
            while not list((tmp_path / "learn" / "rounds").glob("r*-30/run/*")) and time.monotonic() < deadline:
                time.sleep(0.05)  # its round's training began
            rounds = [int(pid) for pid in Path(f"/proc/{learner.pid}/task/{learner.pid}/children").read_text().split()]
            assert rounds
            learner.send_signal(stop)
            learner.wait(30)
            if stop == signal.SIGTERM:  # its round stops with it
                deadline = time.monotonic() + 30
                while any(Path(f"/proc/{pid}").exists() for pid in rounds) and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert not any(Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()
                               for pid in rounds)
        finally:
            if learner.poll() is None:
                learner.kill()
            for pid in rounds:  # (a killed learner's round is an orphan: the test stops it)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        assert current(tmp_path / "learn") == published
