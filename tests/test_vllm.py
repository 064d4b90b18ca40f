"""specgraft's exports in vLLM itself (its CPU build, in .venv-vllm): each loads, decodes the target's own greedy
tokens, and accepts exactly the tokens specgraft accepts, position by position.

    bash benchmarks/vllm_env.sh && pytest -m vllm tests/test_vllm.py

vLLM runs in its own environment, across a process boundary (`specgraft.tools.vllm_engine`), as users deploy it.
Its CPU attention refuses head_dim 8 (stories260K), so the target is a tiny Llama with head_dim 64 built here. Its
output layer is scaled up, as `conftest.tiny_causal_lm` does, so greedy choices are not near-ties, and each head is
trained for a few seconds on the target's own greedy text, so that it accepts at every position.

Equality is exact, not within a tolerance: both engines run float32 on this CPU, and an accepted count moves only
where a draft's or the target's top two logits lie within the engines' rounding difference (about 1e-6 relative)
of each other. A difference is a bug on one side, to be found, not a tolerance to widen.

vLLM drafts a full chain at every step and counts what the target accepts there even past ``max_tokens``, where
specgraft drafts no deeper than the budget leaves room for; `accepted_per_position` counts specgraft's steps as
vLLM counts its own (see its docstring).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import specgraft as sg
from specgraft.heads import build_head, export_head, save_head
from specgraft.heads.configs import DFlashConfig, DistillConfig, Eagle3Config, EagleConfig, MedusaConfig
from specgraft.tools.vllm_engine import DEFAULT_PYTHON, VLLM_PYTHON_ENV, VLLMEngine, accepted_per_position, speculative_config
from regen_helpers import records
from toy_train import fit, greedy_examples

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[1]
VOCAB = 512
DEPTH = 3  # vLLM's num_speculative_tokens; specgraft's Chain(3)
NEW_TOKENS = 48
# Trained on 64 greedy sequences of the target; steps chosen so that every head accepts at depth 3 too.
HEADS = {
    "eagle3": (Eagle3Config(draft_vocab_size=256, ttt_length=3), 60),  # a reduced draft vocabulary (d2t / t2d)
    "eagle": (EagleConfig(), 150),
    "dflash": (DFlashConfig(num_layers=1, block_size=DEPTH + 1, mask_token_id=3), 120),
    "medusa": (MedusaConfig(num_heads=DEPTH), 150),
    "draft-model": (DistillConfig(num_layers=1), 150),
}


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    python = Path(os.environ.get(VLLM_PYTHON_ENV) or REPO / DEFAULT_PYTHON)
    if not python.is_file():
        pytest.skip(f"vLLM's environment is absent ({python}); build it with `bash benchmarks/vllm_env.sh`")
    return python


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A tiny Llama vLLM's CPU attention runs (head_dim 64, GQA 2/1, 8 layers: EAGLE-3's taps 2, 4, 5 distinct)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # sharp greedy choices (see the module docstring)
    path = tmp_path_factory.mktemp("vllm") / "tiny-llama-hd64"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target(target_dir):
    return sg.load_target(target_dir)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """BOS and 1-5 random tokens: none of them starts a training sequence."""
    generator = torch.Generator().manual_seed(123)
    lengths = torch.randint(1, 6, (8,), generator=generator)
    return [[1, *torch.randint(3, VOCAB, (int(n),), generator=generator).tolist()] for n in lengths]


@pytest.fixture(scope="module")
def plain(vllm_python, target_dir, prompts):
    """vLLM's greedy tokens without speculation."""
    with VLLMEngine(target_dir, python=vllm_python, core=0, enforce_eager=True, skip_tokenizer_init=True,
                    max_model_len=512, kv_cache_gib=1) as engine:
        return engine.generate(prompts, NEW_TOKENS).token_ids


@pytest.fixture(scope="module")
def examples(target):
    return greedy_examples(target, count=64, length=64)


def trained_head(head_type: str, target, examples, root: Path) -> tuple[Path, Path]:
    """(specgraft head directory, the directory vLLM loads) for ``head_type``, trained on the target's greedy text."""
    config, steps = HEADS[head_type]
    torch.manual_seed(0)
    head = build_head(config, target)
    if head_type == "eagle3":
        counts = torch.bincount(torch.tensor([t for e in examples for t in e["input_ids"]]), minlength=VOCAB)
        head.set_draft_vocab(counts, target)
    fit(head, target, examples, steps=steps, lr=3e-3)
    head_dir = save_head(head, root / head_type, target)
    if head_type == "draft-model":  # an ordinary transformers directory: vLLM loads it as it is
        return head_dir, head_dir
    return head_dir, export_head(head_dir, "vllm", root / f"{head_type}-vllm", target)


def test_plain_decoding_equals_specgraft(plain, target, prompts):
    ours = sg.SpeculativeGenerator(target, None).generate_batch(prompts, max_new_tokens=NEW_TOKENS, eos_token_id=())
    assert [o.token_ids for o in ours] == plain


@pytest.mark.parametrize("head_type", list(HEADS))
def test_export_decodes_and_accepts_as_specgraft(head_type, vllm_python, target_dir, target, examples, prompts, plain,
                                                 tmp_path):
    head_dir, served_dir = trained_head(head_type, target, examples, tmp_path)
    generator = sg.SpeculativeGenerator(target, sg.load_drafter(head_dir, target), tree=sg.Chain(DEPTH))
    ours = accepted_per_position(generator, prompts, NEW_TOKENS, DEPTH)
    assert ours["token_ids"] == plain
    assert all(ours["accepted_per_pos"]), f"the {head_type} head should accept at every depth: {ours}"

    with VLLMEngine(target_dir, python=vllm_python, core=0, enforce_eager=True, skip_tokenizer_init=True,
                    max_model_len=512, kv_cache_gib=1,
                    speculative_config=speculative_config(head_type, served_dir, DEPTH)) as engine:
        theirs = engine.generate(prompts, NEW_TOKENS)
    assert theirs.token_ids == plain
    assert theirs.spec["drafts"] == ours["drafts"]
    assert theirs.spec["draft_tokens"] == DEPTH * ours["drafts"]
    assert theirs.spec["accepted_per_pos"] == ours["accepted_per_pos"]


# -- the bench, vLLM beside specgraft --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench_setup(target_dir, target, examples, tmp_path_factory):
    """The tiny target with stories260K's tokenizer (the same 512 ids: the bench reads text prompts), a trained EAGLE
    head, and a prompt file."""
    import shutil

    from conftest import DEV_PROMPTS, STORIES

    if not STORIES.is_dir():
        pytest.skip(f"../shared assets are absent ({STORIES} not found)")
    root = tmp_path_factory.mktemp("bench")
    model = root / "tiny-llama-hd64-tok"
    shutil.copytree(target_dir, model)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(STORIES / name, model / name)
    head_dir, _ = trained_head("eagle", target, examples, root)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(DEV_PROMPTS.read_text().splitlines(keepends=True)[:4]))
    return model, head_dir, prompts


def test_batch_bench_runs_vllm_beside_specgraft(vllm_python, bench_setup, tmp_path, capsys):
    import json

    from specgraft.cli import main

    model, head_dir, prompts = bench_setup
    assert main(["bench", "--target", str(model), "--drafter", str(head_dir), "--tree", "chain:2", "--batch-size", "1,2",
                 "--prompts", str(prompts), "--max-new-tokens", "16", "--threads", "1", "--vllm", "plain,chain:2",
                 "--vllm-python", str(vllm_python), "--out", str(tmp_path / "out"), "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert results["greedy_identical"] and results["settings"]["vllm"]["version"].startswith("0.32")
    label = head_dir.name
    rows = {(r["method"], r["batch_size"]): r for r in results["rows"]}
    assert set(rows) == {(m, b) for m in ("plain", f"{label} chain:2", "vllm plain", f"vllm {label} chain:2") for b in (1, 2)}
    assert rows["vllm plain", 1]["engine"] == "vllm" and rows["vllm plain", 1]["mean_accepted_length"] == 1.0
    assert rows[f"vllm {label} chain:2", 1]["mean_accepted_length"] > 1.0  # its drafts accepted
    assert "Against vllm plain" in (tmp_path / "out" / "results.md").read_text()


def test_server_bench_puts_vllm_serve_in_the_rotation(vllm_python, bench_setup, tmp_path):
    import json

    from serve_helpers import ServerThread

    from specgraft.cli import main
    from specgraft.infer.serve import create_app
    from specgraft.tools.vllm_engine import VLLMServer, speculative_config, vllm_draft_dir

    model, head_dir, prompts = bench_setup
    ours = sg.load_target(model)
    kind, draft_dir = vllm_draft_dir(head_dir, tmp_path / "export", ours)
    spec = ["--speculative-config", json.dumps(speculative_config(kind, draft_dir, 2))]
    running = ServerThread(create_app(ours, {"eagle": sg.load_drafter(head_dir, ours)}, default_drafter="eagle",
                                      default_tree=sg.Chain(2), max_batch_size=4)).start()
    try:
        with VLLMServer(model, ["--enforce-eager", *spec], python=vllm_python, core=0, max_model_len=512,
                        kv_cache_gib=1) as theirs:
            assert main(["bench", "--server", running.url, "--vllm-server", f"eagle-chain2={theirs.url}",
                         "--concurrency", "1,2", "--prompts", str(prompts), "--max-new-tokens", "16",
                         "--out", str(tmp_path / "out")]) == 0
    finally:
        running.stop()
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["greedy_identical"]
    assert [(r["concurrency"], r["speculative"]) for r in results["levels"]] == [
        (c, m) for c in (1, 2) for m in ("off", "on", "vllm eagle-chain2")]
    vllm_rows = [r for r in results["levels"] if r["engine"] == "vllm"]
    assert all(r["completion_tokens"] == 4 * 16 and r["tokens_per_target_call"] > 1.0 for r in vllm_rows)
    assert [(a["specgraft"], a["vllm"]) for a in results["against_vllm"]] == [
        ("off", "vllm eagle-chain2"), ("on", "vllm eagle-chain2")] * 2


# -- SmolLM2-135M-Instruct, where materialized (conftest.SMOLLM2) ---------------------------------------------------

SMOLLM2_NEW_TOKENS = 48


@pytest.fixture(scope="module")
def smollm2_eagle3(smollm2, tmp_path_factory) -> tuple[Path, Path]:
    """An EAGLE-3 head over SmolLM2 with a 2K draft vocabulary, trained for a minute on the target's own greedy
    answers to 16 GSM8K *train* questions (12 full-batch steps: it accepts at depth 1): (head directory, its vLLM
    export)."""
    from conftest import SHARED
    from specgraft.tools.prompts import encode_prompt, read_prompt_file

    questions = read_prompt_file(SHARED / "data" / "gsm8k_train.jsonl", limit=16)
    prompts = [encode_prompt(smollm2, q.text) for q in questions]
    answers = sg.SpeculativeGenerator(smollm2, None).generate_batch(prompts, max_new_tokens=48)
    examples = [{"input_ids": p + a.token_ids, "loss_mask": [0] * len(p) + [1] * len(a.token_ids)}
                for p, a in zip(prompts, answers)]
    counts = torch.bincount(torch.tensor([t for e in examples for t in e["input_ids"]]), minlength=smollm2.vocab_size)
    torch.manual_seed(0)
    head = build_head(Eagle3Config(draft_vocab_size=2048, ttt_length=3), smollm2)
    head.set_draft_vocab(counts, smollm2)
    fit(head, smollm2, examples, steps=12, lr=1e-2)
    root = tmp_path_factory.mktemp("smollm2-eagle3")
    head_dir = save_head(head, root / "head", smollm2)
    return head_dir, export_head(head_dir, "vllm", root / "vllm", smollm2)


def test_smollm2_eagle3_export_decodes_and_accepts_as_specgraft(vllm_python, smollm2, smollm2_eagle3):
    from conftest import SHARED, SMOLLM2
    from specgraft.tools.prompts import encode_prompt, read_prompt_file

    head_dir, served_dir = smollm2_eagle3
    prompts = [encode_prompt(smollm2, q.text) for q in read_prompt_file(SHARED / "data" / "gsm8k_test.jsonl", limit=8)]
    plain = [o.token_ids for o in sg.SpeculativeGenerator(smollm2, None).generate_batch(
        prompts, max_new_tokens=SMOLLM2_NEW_TOKENS, eos_token_id=())]
    generator = sg.SpeculativeGenerator(smollm2, sg.load_drafter(head_dir, smollm2), tree=sg.Chain(DEPTH))
    ours = accepted_per_position(generator, prompts, SMOLLM2_NEW_TOKENS, DEPTH)
    assert ours["token_ids"] == plain
    assert ours["accepted_per_pos"][0] > 0, f"the head should accept: {ours}"

    with VLLMEngine(SMOLLM2, python=vllm_python, core=0, enforce_eager=True, max_model_len=1024, kv_cache_gib=1,
                    speculative_config=speculative_config("eagle3", served_dir, DEPTH)) as engine:
        theirs = engine.generate(prompts, SMOLLM2_NEW_TOKENS)
    assert theirs.token_ids == plain
    assert theirs.spec["drafts"] == ours["drafts"]
    assert theirs.spec["accepted_per_pos"] == ours["accepted_per_pos"]


# -- regeneration through `vllm serve` (SmolLM2) ---------------------------------------------------------------------

REGEN_NEW_TOKENS = 64


@pytest.fixture(scope="module")
def smollm2_server(vllm_python, smollm2):
    """`vllm serve` on SmolLM2, float32, on 127.0.0.1 (its chat template is the model directory's, as ours)."""
    from conftest import SMOLLM2
    from specgraft.tools.vllm_engine import VLLMServer

    with VLLMServer(SMOLLM2, ["--enforce-eager", "--max-num-seqs", "8"], python=vllm_python, core=0,
                    max_model_len=1024, kv_cache_gib=1) as server:
        yield server


def gsm8k_train(count: int) -> list[dict]:
    """The first GSM8K *train* questions as chat records (regeneration rewrites their answers)."""
    from conftest import SHARED
    from specgraft.train.data import load_records

    return [{"id": r["id"], "messages": r["messages"][:1]} for r in load_records(SHARED / "data" / "gsm8k_train.jsonl")[:count]]


def test_greedy_regeneration_through_vllm_serve_equals_in_process(smollm2, smollm2_server, tmp_path):
    from specgraft.train.endpoint import EndpointClient
    from specgraft.train.regeneration import regenerate

    inputs = gsm8k_train(8)
    local = regenerate(smollm2, inputs, tmp_path / "local.jsonl", max_new_tokens=REGEN_NEW_TOKENS, temperature=0,
                       progress=False)
    remote = regenerate(smollm2, inputs, tmp_path / "vllm.jsonl", max_new_tokens=REGEN_NEW_TOKENS, temperature=0,
                        progress=False, endpoint=EndpointClient(smollm2_server.url, smollm2.tokenizer, max_retries=0),
                        concurrency=4)
    assert remote.written == local.written == len(inputs)
    assert records(tmp_path / "vllm.jsonl") == records(tmp_path / "local.jsonl")


def test_regeneration_through_vllm_serve_resumes_after_sigkill(smollm2, smollm2_server, tmp_path):
    """`specgraft regenerate` against vLLM, killed with SIGKILL after its first records, then run again: the records of
    one uninterrupted in-process run, none lost and none twice."""
    from conftest import SMOLLM2
    from regen_helpers import regenerate_killed_then_resumed
    from specgraft.train.regeneration import regenerate

    inputs = gsm8k_train(12)
    out = regenerate_killed_then_resumed(tmp_path, str(SMOLLM2), "eagle3", inputs, smollm2_server.url,
                                         REGEN_NEW_TOKENS, start_timeout_s=900, resume_timeout_s=600)
    reference = tmp_path / "reference.jsonl"
    regenerate(smollm2, inputs, reference, max_new_tokens=REGEN_NEW_TOKENS, temperature=0, dedupe=False, progress=False)
    assert records(out) == records(reference)


# -- vLLM's extract_hidden_states, imported as a recording -----------------------------------------------------------

# EAGLE-3's taps on 8 layers (2, 4, 5) and the last layer (its output before the final norm, which the import
# applies), in no order: vLLM stores them ascending.
EXTRACTED = [8, 2, 5, 4]


def test_vllms_extracted_states_import_as_a_recording_specgraft_trains_on(vllm_python, target_dir, target, prompts,
                                                                          tmp_path, monkeypatch):
    """vLLM serves with extract_hidden_states (its CPU build needs `vllm_hidden_states_cpu`'s copy; see there), the
    files import as a recording whose states equal the target's own at every token, and specgraft train runs on it."""
    import json
    import shutil

    import yaml

    from conftest import STORIES
    from specgraft.cli import main
    from specgraft.train.data import collate
    from specgraft.train.recording import Recording

    states_dir, rec = tmp_path / "vllm-states", tmp_path / "rec"
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": EXTRACTED}}}
    connector = {"kv_connector": "CPUHiddenStatesConnector", "kv_connector_module_path": "vllm_hidden_states_cpu",
                 "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(states_dir)}}
    # A prompt longer than vLLM's 128-token CPU block, then one sharing it: the second reads the first's cached block.
    long = [1, *torch.randint(3, VOCAB, (150,), generator=torch.Generator().manual_seed(5)).tolist()]
    batches = [prompts, [long], [long + [7, 9, 11]]]
    kv = {"include_output_tokens": True}  # the generated tokens' states too, not the prompt's alone
    with VLLMEngine(target_dir, python=vllm_python, core=0, enforce_eager=True, skip_tokenizer_init=True,
                    max_model_len=512, kv_cache_gib=1, speculative_config=spec, kv_transfer_config=connector) as engine:
        calls = [engine.generate(batch, NEW_TOKENS, kv_transfer_params=kv) for batch in batches]
        # (imported while vLLM runs: a file written moments after its answer is waited for by its lock)
        requests = [(p, out, params["hidden_states_path"]) for batch, call in zip(batches, calls)
                    for p, out, params in zip(batch, call.token_ids, call.kv_transfer_params)]
        (states_dir / "requests.jsonl").write_text("".join(
            json.dumps({"hidden_states_path": path, "prompt_tokens": len(p)}) + "\n" for p, _, path in requests))
        assert main(["import-records", str(states_dir), str(rec), "--target", str(target_dir),
                     "--layers", ",".join(map(str, EXTRACTED))]) == 0

    ours = sg.SpeculativeGenerator(target, None).generate_batch(prompts, max_new_tokens=NEW_TOKENS, eos_token_id=())
    assert calls[0].token_ids == [o.token_ids for o in ours]  # extracting leaves vLLM's decoding as it was
    recording = Recording(rec)
    assert recording.info.layers == (2, 4, 5, 8) and len(recording) == len(requests)
    features = recording.features(target, [2, 4, 5])
    for index, (example, (prompt, output, _)) in enumerate(zip(recording.examples(), requests)):
        assert example["input_ids"] == prompt + output[:-1]  # every token vLLM ran; the last one none did
        assert example["loss_mask"] == [0] * len(prompt) + [1] * (len(output) - 1)
        got = features.batch([index], collate([example], pad_token_id=0))
        ids = example["input_ids"]
        want = target.forward(torch.tensor([ids]), target.new_cache(), torch.arange(len(ids))[None],
                              hidden_layers=(2, 4, 5, 8))
        for layer in (2, 4, 5):
            torch.testing.assert_close(got.hidden[layer][0], want.hidden[layer][0], atol=1e-5, rtol=1e-5)
        logits = target.model.get_output_embeddings()(want.hidden[8][0]).float()  # from the final-norm state
        torch.testing.assert_close(got.target_logits[0], logits, atol=1e-4, rtol=1e-4)

    if not STORIES.is_dir():
        pytest.skip(f"../shared assets are absent ({STORIES} not found): training needs a tokenizer")
    with_tokenizer = tmp_path / "tiny-llama-hd64-tok"  # the same 512 ids as stories260K's tokenizer
    shutil.copytree(target_dir, with_tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(STORIES / name, with_tokenizer / name)
    config = tmp_path / "recipe.yaml"
    config.write_text(yaml.safe_dump({
        "target": {"path": str(with_tokenizer)},
        "head": {"type": "eagle3", "aux_layers": [2, 4, 5], "draft_vocab_size": 256, "ttt_length": 2},
        "data": {"recorded": [str(rec)], "max_length": 64, "eval_fraction": 0.25},
        "training": {"output_dir": str(tmp_path / "out"), "num_threads": 1, "micro_batch_size": 2, "max_steps": 2,
                     "save_every": 0, "log_every": 1, "epochs": 1},
    }))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert main(["train", str(config)]) == 0
    assert (tmp_path / "out" / "best" / "best.json").is_file()
