"""The README, run as a newcomer runs it: every command after the set-up, in order, on a scratch copy.

    .venv/bin/python -m pytest -q -m readme        # about 10 minutes on 2 busy cores

The set-up block is not run (this venv is its result). Every other ```bash
block runs in one shell, and every ```python block with the venv's python,
in the README's order, from a copy of the repository beside a link to
../shared. Sizes shrink without touching the README's text: the copy's
.venv/bin/specgraft appends TOY_FLAGS to each command (argparse keeps the last
value of a repeated flag; training overrides come last), the story openings
are cut to a few, and the Python examples ask for fewer tokens. A block after
``<!-- readme-test: skip (REASON) -->`` is skipped (GPUs, hub downloads).
A block after ``<!-- readme-test: server -->`` starts in the background on a
free 127.0.0.1 port (its ``--port 8000`` rewritten), and the blocks after
``<!-- readme-test: client -->`` that follow it run against that port; the
server is stopped with SIGTERM after the last of them, as a user's Ctrl-C would.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import SHARED, STORIES

pytestmark = pytest.mark.readme

REPO = Path(__file__).resolve().parents[1]
SKIP = re.compile(r"<!-- readme-test: skip \((.+?)\) -->\s*$")
ROLE = re.compile(r"<!-- readme-test: (server|client) -->\s*$")
README_PORT = "8000"  # the port the README's server and client blocks name
SERVER_START_S = 120.0  # loading the target and the head, then /health answers
SERVER_STOP_S = 30.0
FENCE = re.compile(r"^```(\w*)\s*$")
# Appended to each `specgraft COMMAND` the README runs: sizes only, never what the command does.
TOY_FLAGS = {
    "train": ["data.regenerate.num_from_bos=8", "data.regenerate.max_new_tokens=24", "training.max_steps=3",
              "training.epochs=1", "training.save_every=0", "eval.num_prompts=2", "eval.max_new_tokens=8"],
    "regenerate": ["data.regenerate.num_from_bos=8", "data.regenerate.max_new_tokens=24"],
    "generate": ["--max-new-tokens", "8"],
    "bench": ["--limit", "2", "--max-new-tokens", "8", "--warmup", "0"],
    "tune-tree": ["--limit", "2", "--max-new-tokens", "8", "--depth", "3"],
    "check-exactness": ["--samples", "100", "--prompt", "Once upon a time"],
    "quickstart": ["--samples", "8", "--train-minutes", "0.05", "--max-new-tokens", "8", "--bench-prompts", "2"],
}
# bench --batch-size at toy sizes: the batches must fit in bench's toy --limit of prompts.
TOY_BATCH_SIZES = ["--batch-size", "1,2"]
STORY_OPENINGS = 8  # of recipes/tiny/story_openings.jsonl, each continued by the regeneration step


def readme_blocks(text: str) -> list[tuple[str, str, str | None, str | None]]:
    """(language, code, skip reason or None, role: 'server', 'client' or None) of every fenced block, in order."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        skip, role = SKIP.match(before), ROLE.match(before)
        blocks.append((match.group(1), "\n".join(lines[i + 1 : end]) + "\n", skip.group(1) if skip else None,
                       role.group(1) if role else None))
        i = end + 1
    return blocks


def runnable_blocks(text: str) -> list[tuple[str, str, str | None]]:
    """The blocks a newcomer runs after the set-up, with their role: bash and python, not skipped, after the
    first bash block."""
    blocks = [(lang, code, role) for lang, code, skip, role in readme_blocks(text)
              if lang in ("bash", "python") and not skip]
    if not blocks or "pip install" not in blocks[0][1]:
        raise ValueError("the README's first command block must be the set-up (python3 -m venv ... pip install)")
    return blocks[1:]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ReadmeServer:
    """A README server block running in the background on a free loopback port, stopped by SIGTERM."""

    def __init__(self, code: str, cwd: Path, env: dict[str, str]) -> None:
        assert f"--port {README_PORT}" in code, "a server block names --port 8000"
        self.port = free_port()
        self.log = cwd / "readme_server.log"
        self.proc = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", "exec " + code.strip().replace(f"--port {README_PORT}", f"--port {self.port}")],
            cwd=cwd, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise AssertionError(f"the README's server did not answer /health in {SERVER_START_S}s:\n{self.log.read_text()[-3000:]}")

    def client(self, code: str) -> str:
        assert f"127.0.0.1:{README_PORT}" in code, "a client block talks to 127.0.0.1:8000"
        return code.replace(f"127.0.0.1:{README_PORT}", f"127.0.0.1:{self.port}")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(SERVER_STOP_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(SERVER_STOP_S)
        return self.proc.returncode


def scratch_repository(root: Path) -> Path:
    """A copy of the repository's tracked files in root/repo, ../shared linked beside it, and a toy-sized venv."""
    repo = root / "repo"
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, repo / name)
    (root / "shared").symlink_to(SHARED)
    openings = repo / "recipes" / "tiny" / "story_openings.jsonl"
    openings.write_text("".join(openings.read_text().splitlines(keepends=True)[:STORY_OPENINGS]))
    bin_dir = repo / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    # A script, not a link: a linked python would look for pyvenv.cfg beside the copy and miss the venv's packages.
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bin_dir / "python").chmod(0o755)
    for tool in ("deepspeed", "torchrun"):
        if (Path(sys.executable).parent / tool).exists():
            (bin_dir / tool).symlink_to(Path(sys.executable).parent / tool)
    shim = bin_dir / "specgraft"
    shim.write_text(
        f"#!{sys.executable}\n"
        "# The README's specgraft at toy sizes: tests/test_readme.py's TOY_FLAGS appended to each command.\n"
        "import sys\n"
        "from specgraft.cli import main\n"
        f"TOY_FLAGS = {TOY_FLAGS!r}\n"
        f"TOY_BATCH_SIZES = {TOY_BATCH_SIZES!r}\n"
        "argv = sys.argv[1:]\n"
        "toy = (TOY_FLAGS.get(argv[0], []) + (TOY_BATCH_SIZES if '--batch-size' in argv else [])) if argv else []\n"
        "sys.exit(main(argv + toy))\n"
    )
    shim.chmod(0o755)
    return repo


def assert_no_bare_commands(commands: str) -> None:
    """The set-up never activates the venv: a bare specgraft fails, a bare pip or python runs outside it
    (and, in this test, would install into the machine's own Python)."""
    bare = re.search(r"(^|[;&|]\s*|\n\s*)(specgraft|pip3?|python3?) ", commands)
    assert bare is None, f"bare `{bare.group(2)}` in a block the README test runs: spell it .venv/bin/{bare.group(2)}"


def test_blocks_are_found_and_the_setup_comes_first():
    text = (REPO / "README.md").read_text()
    blocks = runnable_blocks(text)
    commands = " ".join(code for _, code, _ in blocks)
    assert "specgraft train recipes/tiny/eagle-stories260k.yaml" in commands
    assert commands.index("specgraft train recipes/tiny/eagle") < commands.index("runs/eagle-stories260k/head")
    assert_no_bare_commands(commands)
    for leak in ("pip install -e '.[gguf]'", "cd x && python run.py", "specgraft train c.yaml"):
        with pytest.raises(AssertionError, match="bare"):
            assert_no_bare_commands(leak)
    with pytest.raises(ValueError, match="must be the set-up"):
        runnable_blocks("```bash\nspecgraft generate\n```\n")
    roles = [role for _, _, role in blocks]
    assert "server" in roles and roles.index("server") < roles.index("client"), "the serve block, then its clients"
    assert all(f"--port {README_PORT}" not in code or role == "server" for _, code, role in blocks)


@pytest.mark.skipif(not STORIES.is_dir(), reason=f"../shared assets are absent ({STORIES} not found)")
def test_every_readme_command_runs_in_order(tmp_path):
    blocks = runnable_blocks((REPO / "README.md").read_text())
    assert_no_bare_commands(" ".join(code for _, code, _ in blocks))  # checked before anything runs
    repo = scratch_repository(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env |= {"XDG_CACHE_HOME": str(tmp_path / "cache"), "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    servers: list[ReadmeServer] = []
    try:
        run_blocks(blocks, repo, env, servers)
        for server in servers:  # the README ended on a client block
            assert server.stop() == 0, "the README's server did not exit cleanly on SIGTERM"
    finally:
        for server in servers:
            server.stop()


def run_blocks(blocks, repo: Path, env: dict[str, str], servers: list[ReadmeServer]) -> None:
    """Each block in order; a server block starts in the background, and is stopped after its last client."""
    for number, (lang, code, role) in enumerate(blocks, start=1):
        if servers and role != "client":
            assert servers.pop().stop() == 0, "the README's server did not exit cleanly on SIGTERM"
        if role == "server":
            servers.append(ReadmeServer(code, repo, env))
            continue
        if role == "client":
            assert servers, f"README block {number} is a client with no server block before it"
            code = servers[-1].client(code)
        if lang == "python":
            code = code.replace("max_new_tokens=128", "max_new_tokens=8")
            (repo / f"readme_block_{number}.py").write_text(code)
            argv = [str(repo / ".venv" / "bin" / "python"), f"readme_block_{number}.py"]
        else:
            argv = ["bash", "-euo", "pipefail", "-c", code]
        run = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True)
        assert run.returncode == 0, (
            f"README block {number} ({lang}) failed with exit code {run.returncode}:\n{code}\n"
            f"--- stdout (tail)\n{run.stdout[-3000:]}\n--- stderr (tail)\n{run.stderr[-3000:]}"
        )
        assert "Traceback" not in run.stderr, f"README block {number} printed a traceback:\n{run.stderr[-3000:]}"
