"""A `specgraft regenerate` run through an endpoint, killed with SIGKILL mid-way and run again (endpoint tests)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml


def records(path: Path) -> dict[str, dict]:
    """A regeneration's output by record id, asserting no id was written twice."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    by_id = {r["id"]: r for r in lines}
    assert len(by_id) == len(lines), "a record was written twice"
    return by_id


def regenerate_killed_then_resumed(tmp_path: Path, target: str, head_type: str, prompts: list, endpoint: str,
                                   max_new_tokens: int, start_timeout_s: float, resume_timeout_s: float) -> Path:
    """Runs `specgraft regenerate` on ``prompts`` through ``endpoint``, SIGKILLs it after 3 records, runs it again
    to the end and returns its output file (the caller compares it with an uninterrupted run)."""
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps(p if isinstance(p, dict) else {"text": p}) + "\n" for p in prompts))
    out = tmp_path / "out.jsonl"
    config = tmp_path / "regen.yaml"
    config.write_text(yaml.safe_dump({
        "target": {"path": target},
        "head": {"type": head_type},
        "data": {"regenerate": {
            "output": str(out), "prompts": str(prompt_file), "max_new_tokens": max_new_tokens, "temperature": 0,
            "endpoint": endpoint, "concurrency": 2, "dedupe": False,
        }},
        "training": {"output_dir": str(tmp_path / "run"), "num_threads": 1},
    }))
    command = [sys.executable, "-m", "specgraft.cli", "regenerate", str(config)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = tmp_path / "killed.log"  # a file, not a pipe: a pipe nobody reads blocks the run once it fills
    with log.open("wb") as stderr:
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    started = time.monotonic()
    seen = 0
    while time.monotonic() < started + start_timeout_s and process.poll() is None:
        seen = out.read_text().count("\n") if out.exists() else 0
        if seen >= 3:
            break
        time.sleep(0.05)
    assert process.poll() is None, f"the run ended before it could be killed: {log.read_text()[-2000:]}"
    process.send_signal(signal.SIGKILL)
    process.wait(30)
    waited = time.monotonic() - started
    interrupted = out.read_text().count("\n") if out.exists() else 0
    assert 3 <= interrupted < len(prompts), (
        f"{interrupted} of {len(prompts)} records at the kill ({seen} seen last, after {waited:.0f} s): "
        f"{log.read_text()[-2000:]}")

    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=resume_timeout_s)
    assert again.returncode == 0, again.stderr[-3000:]
    return out
