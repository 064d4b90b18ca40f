"""The target's states that vLLM's ``extract_hidden_states`` wrote while it served, imported as a specgraft recording.

vLLM (0.32) hands the target's hidden states to a KV connector when it runs the ``extract_hidden_states``
speculative method (a proposer that drafts nothing useful; it only stores states)::

    speculative_config = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                          "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYERS}}}
    kv_transfer_config = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                          "kv_connector_extra_config": {"shared_storage_path": DIR}}

Its connector writes one file a finished request, ``DIR/{request id}.safetensors``, from the states the serving
forwards computed (an empty ``.lock`` beside it is held while the file is written)::

    "hidden_states"  (T, L, H)  the states at LAYERS, sorted ascending (vLLM sorts them), in vLLM's dtype
    "token_ids"      (T,)       the prompt; with the request's kv_transfer_params {"include_output_tokens": true},
                                the prompt then every generated token but the last (no forward ran it)

The file does not say where its prompt ends: an index does, ``requests.jsonl`` in DIR unless named, one line a
request, ``{"hidden_states_path": ..., "prompt_tokens": S}`` (what vLLM's answer and its usage report). Files are
found in DIR by name, so DIR may move; files the index does not name are left out.

vLLM's layer id i is the input of decoder layer i (0: the embeddings), as HF's ``hidden_states[i]`` is, for
i < N (the target's number of layers). Id N is the last layer's output *before* the final norm, where HF's
``hidden_states[N]``, the state training rebuilds the target's logits from, is after it: LAYERS must hold N, and
the import runs the target's final norm over it. Nothing else of the target runs but one forward over the first
request imported, which checks that LAYERS and the target are those vLLM ran.

An import is idempotent: each shard names the files it came from, and a file already in the recording is skipped,
so a directory vLLM keeps writing into may be imported again and again into one recording.

Shape legend: T tokens of a request, L layers vLLM stored, H hidden, N tokens of a shard.
"""

from __future__ import annotations

import fcntl
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from specgraft.model import Target
from specgraft.model.target import DTYPES
from specgraft.train.recording import (
    INFO, SHARD_BYTES, SHARD_PATTERN, RecordingInfo, prepare_recording, recording_info, shard_name, write_shard,
)

INDEX = "requests.jsonl"
LOCK_TIMEOUT_S = 60.0  # a file of a finished request is written within moments; longer means its writer died
CHECK_TOKENS = 256  # of the first request, run through the target: enough to tell a wrong layer list or model
# Largest relative difference (norm of the difference over the norm) between vLLM's and the target's states at one
# layer that the check lets pass: vLLM in bf16 against the target in bf16 or float32 differs by 0.5-0.9% on
# tests/test_vllm.py's 8-layer model (two float32 engines, by ~1e-6), and rounding grows with depth; a wrong layer
# or model differs by ~100%.
CHECK_TOLERANCE = 0.05


@dataclass(frozen=True)
class ImportReport:
    """What an import did."""

    imported: int  # requests written into the recording
    tokens: int  # their tokens
    already: int  # requests of the index an earlier import had written
    prompt_only: tuple[str, ...]  # files with no generated token after the prompt: nothing to train on
    shards: tuple[Path, ...]  # the shards written

    def summary(self, vllm_dir: Path, out_dir: Path) -> str:
        lines = [f"imported {self.imported} requests ({self.tokens} tokens) from {vllm_dir} into {out_dir} "
                 f"({len(self.shards)} shards)"]
        if self.already:
            lines.append(f"{self.already} requests were imported before")
        if self.prompt_only:
            lines.append(f"{len(self.prompt_only)} requests hold no generated token (e.g. {self.prompt_only[0]}): "
                         'vLLM stores the prompt alone unless a request sends kv_transfer_params '
                         '{"include_output_tokens": true}')
        return "\n".join(lines)


def read_index(path: Path) -> dict[str, int]:
    """File name -> prompt tokens, from an index (one JSON object a line), in its order.

    Raises:
        FileNotFoundError: no index at ``path``.
        ValueError: a line that is not ``{"hidden_states_path": str, "prompt_tokens": int >= 0}``, or a file named
            twice, naming the line.
    """
    if not path.is_file():
        raise FileNotFoundError(
            f"no index of vLLM's requests at {path}: write one line a request, "
            '{"hidden_states_path": ..., "prompt_tokens": ...} (vLLM\'s files do not say where a prompt ends)')
    index: dict[str, int] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            name, prompt = Path(entry["hidden_states_path"]).name, entry["prompt_tokens"]
            if not isinstance(prompt, int) or prompt < 0:
                raise ValueError(f"prompt_tokens is {prompt!r}, not a count")
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}:{number}: not a request of the index ({err}); expected "
                             '{"hidden_states_path": ..., "prompt_tokens": ...}') from None
        if name in index:
            raise ValueError(f"{path}:{number}: {name} is named twice")
        index[name] = prompt
    return index


def vllm_layers(target: Target, layers: Sequence[int]) -> tuple[int, ...]:
    """The layer ids vLLM was given, in the order it stores them (ascending).

    Raises:
        ValueError: a repeated id (vLLM 0.32 sizes its buffer by the list but stores each layer once), an id out of
            0..N, or no N (the final state training needs).
    """
    n = target.num_layers
    if len(set(layers)) != len(layers):
        raise ValueError(f"layers {list(layers)} repeat an id: give vLLM each layer once")
    bad = [i for i in layers if not 0 <= i <= n]
    if bad:
        raise ValueError(f"layers {bad} are out of range for {target.name!r}: vLLM's layer ids run 0..{n}")
    if n not in layers:
        raise ValueError(
            f"layers {list(layers)} leave out {n}, the last layer's output: training rebuilds the target's logits "
            f"from its final-norm state, which the import makes from layer {n}; add {n} to "
            "eagle_aux_hidden_state_layer_ids")
    return tuple(sorted(layers))


def wait_until_written(file: Path, timeout_s: float = LOCK_TIMEOUT_S) -> None:
    """Return once vLLM's connector no longer holds ``file``'s lock (it holds FILE.lock exclusively while it writes
    FILE; vLLM's own reader, ``load_hidden_states``, waits the same way, without a limit).

    Raises:
        TimeoutError: still held after ``timeout_s``.
    """
    lock = file.with_name(file.name + ".lock")
    if not lock.exists():  # (a connector with use_synchronization_lock off writes none)
        return
    deadline = time.monotonic() + timeout_s
    with open(lock) as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(handle, fcntl.LOCK_UN)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{lock} is still held after {timeout_s:.0f} s: is {file} being written?") from None
                time.sleep(0.05)


def read_request(file: Path, num_layers: int, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_ids (T,), hidden_states (T, L, H)) of one vLLM file, checked against the layers and hidden size.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a file of vLLM's connector, or states of another shape than ``num_layers`` x ``hidden_size``.
    """
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist (named by the index)")
    wait_until_written(file)
    try:
        tensors = load_file(str(file))
    except SafetensorError as err:
        raise ValueError(f"{file} is not readable safetensors ({err})") from None
    if set(tensors) != {"hidden_states", "token_ids"}:
        raise ValueError(
            f"{file} holds {sorted(tensors)}; vLLM's hidden-states connector writes hidden_states and token_ids")
    ids, states = tensors["token_ids"], tensors["hidden_states"]
    if ids.dim() != 1 or states.shape != (ids.shape[0], num_layers, hidden_size):
        raise ValueError(
            f"{file}: hidden_states {tuple(states.shape)} for token_ids {tuple(ids.shape)}; expected "
            f"({ids.shape[0]}, {num_layers}, {hidden_size}): {num_layers} layers as given here, and the target's "
            "hidden size (were the layers given to vLLM the same?)")
    return ids.long(), states


def imported_sources(out_dir: Path) -> set[str]:
    """The vLLM files the shards in ``out_dir`` came from."""
    sources: set[str] = set()
    for file in out_dir.glob(SHARD_PATTERN):
        with safe_open(str(file), framework="pt") as f:
            sources.update(json.loads((f.metadata() or {}).get("sources", "[]")))
    return sources


@torch.no_grad()
def recorded_states(target: Target, info: RecordingInfo, states: torch.Tensor) -> dict[int, torch.Tensor]:
    """vLLM's (T, L, H) states as a recording stores them: layer -> (T, H), the last after the target's final norm."""
    norm = getattr(target.model.get_decoder(), "norm", None)
    if norm is None:
        raise ValueError(f"{target.name!r} has no final norm at model.get_decoder().norm to make its last state from")
    out = {layer: states[:, j] for j, layer in enumerate(info.layers)}
    last = info.layers[-1]
    out[last] = norm(out[last].to(device=target.device, dtype=target.dtype)).cpu()
    return out


@torch.no_grad()
def check_with_target(target: Target, info: RecordingInfo, file: Path, ids: torch.Tensor,
                      states: dict[int, torch.Tensor]) -> None:
    """Run the target over the first tokens of one request and compare its states with vLLM's, layer by layer.

    Raises:
        ValueError: a layer whose states differ by more than CHECK_TOLERANCE (relative), naming it.
    """
    n = min(len(ids), CHECK_TOKENS, target.max_context)
    out = target.forward(ids[None, :n].to(target.device), target.new_cache(),
                         torch.arange(n, device=target.device)[None], hidden_layers=info.layers)
    for layer in info.layers:
        want = out.hidden[layer][0].float().cpu()
        error = ((states[layer][:n].float() - want).norm() / want.norm().clamp_min(1e-12)).item()
        if error > CHECK_TOLERANCE:
            raise ValueError(
                f"{file}: vLLM's states at layer {layer} differ from {target.name!r}'s by {error:.2f} (relative; "
                f"at most {CHECK_TOLERANCE} is expected): give the layers in the order of vLLM's "
                "eagle_aux_hidden_state_layer_ids, and the target vLLM served")


def import_vllm_records(vllm_dir: str | Path, out_dir: str | Path, target: Target, layers: Sequence[int], *,
                        index: str | Path | None = None, dtype: str | None = None, check: bool = True) -> ImportReport:
    """Import the requests an index names from vLLM's ``extract_hidden_states`` files into a recording.

    Args:
        vllm_dir: vLLM's ``shared_storage_path``.
        out_dir: the recording (made if absent; an existing one must hold the same layers, dtype and target).
        target: the target vLLM served (its final norm runs here; its identity goes into ``recording.json``).
        layers: the ``eagle_aux_hidden_state_layer_ids`` vLLM was given; they must hold the target's last layer.
        index: the index of requests (default ``vllm_dir/requests.jsonl``).
        dtype: storage dtype (None: the target's).
        check: run the target over the first request imported and compare its states with vLLM's.

    Raises:
        FileNotFoundError: no index, or a file it names is absent.
        ValueError: bad layers, a file of another shape, states that are not the target's, or an index naming no
            request with a generated token.
    """
    vllm_dir, out_dir = Path(vllm_dir), Path(out_dir)
    info = recording_info(target, vllm_layers(target, layers), dtype)
    entries = read_index(Path(index) if index else vllm_dir / INDEX)
    writer = f"this import (from {vllm_dir})"
    done: set[str] = set()
    if (out_dir / INFO).is_file():  # refused here, before any file is read, if it records something else
        prepare_recording(out_dir, info, writer)
        done = imported_sources(out_dir)
    todo = [(name, prompt) for name, prompt in entries.items() if name not in done]
    run, shards, prompt_only = f"vllm-{time.time_ns():x}", [], []
    pending: list[tuple[str, torch.Tensor, dict[int, torch.Tensor], int]] = []  # (file, ids, states, prompt tokens)
    imported = tokens = 0

    def flush() -> None:
        if pending:
            prepare_recording(out_dir, info, writer)  # (a failed import leaves no empty recording behind)
            shards.append(out_dir / shard_name(run, len(shards)))
            write_shard(shards[-1], info, torch.cat([p[1] for p in pending]),
                        {layer: torch.cat([p[2][layer] for p in pending]) for layer in info.layers},
                        [len(p[1]) for p in pending], [p[3] for p in pending], sources=[p[0] for p in pending])
            pending.clear()

    size = 0
    for name, prompt in todo:
        ids, raw = read_request(vllm_dir / name, len(info.layers), info.hidden_size)
        if len(ids) <= prompt:  # the prompt alone: nothing generated to train on
            prompt_only.append(name)
            continue
        states = recorded_states(target, info, raw)
        if check and imported == 0:
            check_with_target(target, info, vllm_dir / name, ids, states)
        pending.append((name, ids, states, prompt))
        imported, tokens = imported + 1, tokens + len(ids)
        size += len(ids) * len(info.layers) * info.hidden_size * DTYPES[info.dtype].itemsize
        if size >= SHARD_BYTES:
            flush()
            size = 0
    flush()
    if todo and not imported:
        raise ValueError(
            f"none of the {len(todo)} requests of the index holds a generated token: vLLM stores the prompt alone "
            'unless a request sends kv_transfer_params {"include_output_tokens": true}')
    return ImportReport(imported, tokens, len(entries) - len(todo), tuple(prompt_only), tuple(shards))
