"""Head checkpoints: a directory of config.json + model.safetensors + README.md.

Never pickle: weights go through safetensors only. The config names the
target the head was trained for (name, sizes and a fingerprint of its input
embedding) so loading a head on the wrong target is a clear error instead of
silent garbage.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from pydantic import TypeAdapter, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specgraft.heads.configs import HeadConfig
from specgraft.model import Target

FORMAT_VERSION = 1
SIDECAR = "specgraft_head.json"  # head config + target signature beside a transformers model directory
FINGERPRINT_ROWS = 64  # embedding rows hashed: enough to tell targets apart, cheap for 128k vocabularies


def target_signature(target: Target) -> dict[str, Any]:
    """What a head must match: sizes, and two fingerprints of evenly spaced rows of the input embedding: a hash of
    their values (exact, for feature caches, which also record the dtype) and their norms (compared within
    `NORM_RTOL`, so a head trained beside a float32 target loads beside the same target in bf16)."""
    weight = target.model.get_input_embeddings().weight.detach()
    rows = torch.linspace(0, weight.shape[0] - 1, FINGERPRINT_ROWS).long().unique()
    sample = weight[rows.to(weight.device)].float().cpu().contiguous()
    return {
        "name": target.name,
        "hidden_size": int(target.config.hidden_size),
        "vocab_size": int(target.vocab_size),
        "num_hidden_layers": int(target.num_layers),
        "embedding_fingerprint": hashlib.sha256(sample.numpy().round(4).tobytes()).hexdigest()[:16],
        "embedding_norms": [float(f"{n:.6g}") for n in sample.norm(dim=1).tolist()],
    }


# Row norms of one embedding in float32 and bf16 differ by ~0.02% (bf16 rounds each value by up to 0.4%); two
# different embeddings' 64 row norms all agreeing within 1% does not happen by chance.
NORM_RTOL = 1e-2


def check_target(signature: dict[str, Any], target: Target, where: str) -> None:
    """Raise naming every field where ``target`` differs from the one a head was trained for.

    Heads saved before the norms were recorded are checked by the exact hash, which differs between dtypes."""
    actual = target_signature(target)
    wrong = [
        f"{key}: head expects {signature[key]!r}, target has {actual[key]!r}"
        for key in ("hidden_size", "vocab_size", "num_hidden_layers")
        if key in signature and signature[key] != actual[key]
    ]
    norms = signature.get("embedding_norms")
    if norms is not None and len(norms) == len(actual["embedding_norms"]):
        same = torch.allclose(torch.tensor(norms), torch.tensor(actual["embedding_norms"]), rtol=NORM_RTOL, atol=0.0)
    else:
        same = signature.get("embedding_fingerprint", actual["embedding_fingerprint"]) == actual["embedding_fingerprint"]
    if not same:
        wrong.append(f"embedding_fingerprint: head expects {signature.get('embedding_fingerprint')!r}, target has "
                     f"{actual['embedding_fingerprint']!r} (another embedding)")
    if wrong:
        raise ValueError(
            f"{where} was trained for target {signature.get('name')!r}, not {actual['name']!r}: " + "; ".join(wrong)
        )


def umask_mode(mode: int) -> int:
    """``mode`` as the process umask leaves it: what `open` or `mkdir` would give a new file or directory."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def atomic_write(path: Path, write) -> None:
    """Write through a temporary file in the same directory, then rename: a crash never leaves half a file.

    mkstemp creates the file 0600; it gets the mode a plain write would (0666 less the umask), so a head
    read by a serving engine running as another user stays readable.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, umask_mode(0o666))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_head(head: torch.nn.Module, out_dir: str | Path, target: Target, card: str = "") -> Path:
    """Write ``head`` (its ``config`` and trainable weights) to ``out_dir``.

    Args:
        head: a head module with a ``config`` (one of heads.configs); its ``state_dict()`` is
            saved, or, when it has ``save(out_dir, target)``, that writes the weights.
        card: extra Markdown for the README model card (recipe, measured tau).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "specgraft_format": FORMAT_VERSION,
        "head": dataclasses.asdict(head.config),
        "target": target_signature(target),
    }
    if hasattr(head, "save"):  # a head that is a whole model writes its own format (e.g. a transformers dir)
        head.save(out, target)
        for f in out.iterdir():  # safetensors (under save_pretrained too) writes 0600 whatever the umask
            if f.is_file():
                f.chmod(umask_mode(0o666))
        atomic_write(out / SIDECAR, lambda p: Path(p).write_text(json.dumps(config, indent=2) + "\n"))
    else:
        tensors = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
        atomic_write(out / "model.safetensors", lambda p: save_file(tensors, p, metadata={"format": "pt"}))
        atomic_write(out / "config.json", lambda p: Path(p).write_text(json.dumps(config, indent=2) + "\n"))
    readme = (
        f"# specgraft {config['head']['type']} head\n\n"
        f"Draft head for `{config['target']['name']}` (hidden {config['target']['hidden_size']}, "
        f"vocab {config['target']['vocab_size']}, {config['target']['num_hidden_layers']} layers).\n\n"
        "```python\nimport specgraft as sg\n"
        f"target = sg.load_target({config['target']['name']!r})\n"
        f"drafter = sg.load_drafter({str(out)!r}, target)\n```\n\n{card}\n"
    )
    atomic_write(out / "README.md", lambda p: Path(p).write_text(readme))
    return out


def read_head_dir(path: str | Path) -> tuple[Any, dict[str, Any], dict[str, torch.Tensor]]:
    """(typed head config, target signature, tensors) of a head directory, with errors naming the file."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"head directory {path} does not exist")
    config_file, weights_file = path / "config.json", path / "model.safetensors"
    for f in (config_file, weights_file):
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing: a head directory holds config.json and model.safetensors")
    head_config, signature = read_head_config(config_file)
    try:
        tensors = load_file(str(weights_file))
    except SafetensorError as err:
        raise ValueError(f"{weights_file} is truncated or corrupt ({err}); train or export the head again") from None
    return head_config, signature, tensors


def read_head_config(config_file: str | Path) -> tuple[Any, dict[str, Any]]:
    """(typed head config, target signature) of a head's ``config.json``, or of the `SIDECAR` beside a distilled
    draft's transformers files, with errors naming the file and the key."""
    config_file = Path(config_file)
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_file} is not valid JSON: {err}") from None
    if "head" not in raw or "target" not in raw:
        raise ValueError(f"{config_file} lacks the 'head' and 'target' sections of a specgraft head")
    try:
        head_config = TypeAdapter(HeadConfig).validate_python(raw["head"])
    except ValidationError as err:
        kind = raw["head"].get("type") if isinstance(raw["head"], dict) else None
        # pydantic puts the union member's tag first in each location: head.num_layers, not head.eagle.num_layers.
        locations = [e["loc"][1:] if e["loc"][:1] == (kind,) else e["loc"] for e in err.errors()]
        problems = "; ".join(
            f"head.{'.'.join(map(str, loc))}: {e['msg']} (got {e['input']!r})" for loc, e in zip(locations, err.errors())
        )
        raise ValueError(f"{config_file}: invalid head config: {problems}") from None
    return head_config, raw["target"]
