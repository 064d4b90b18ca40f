"""The README and docs/, run as a newcomer runs them: every command after the set-up, in order, on a scratch copy.

    .venv/bin/python -m pytest -q -m readme        # about 10 minutes on 2 busy cores

The checks of the files' structure (blocks, order, links, every command documented) need no model and run
in the default suite.

The files run in DOCS's order: the README, then each page of docs/ (every
page must be listed; recipes/README.md is the recipes' own reference, not
run). The README's set-up block is not run (this venv is its result). Every
other ```bash block runs in a shell of its own, and every ```python block
with the venv's python, in that order, from one copy of the repository
beside a link to ../shared, so a later block finds what an earlier one wrote
(the docs use the README's tiny EAGLE head). Sizes shrink without touching
the files' text: the copy's .venv/bin/specgraft appends TOY_FLAGS to each
command (argparse keeps the last value of a repeated flag; training
overrides come last), the story openings are cut to a few, and the Python
examples ask for fewer tokens. STAND_INS replaces a name in a block's
command before it runs: the README's "your own model" runs on the tiny
target in ../shared. A block after ``<!-- readme-test: skip (REASON) -->``
is skipped (GPUs, hub downloads, the suite itself). A block after
``<!-- readme-test: server -->`` starts in the background on a free
127.0.0.1 port (its ``--port 8000`` rewritten), and the blocks after
``<!-- readme-test: client -->`` that follow it run against that port; the
server is stopped with SIGTERM after the last of them, as a user's Ctrl-C
would.
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

REPO = Path(__file__).resolve().parents[1]
# The order the README test runs the documentation in: the README first (its set-up, its tiny EAGLE head),
# then the pages that use what it made. Every page of docs/ is listed (test_every_page_of_docs_runs).
DOCS = ("README.md", "docs/training.md", "docs/generation.md", "docs/engine.md", "docs/bench.md",
        "docs/serving.md", "docs/results.md", "docs/vllm.md", "docs/testing.md", "docs/layout.md")
# Replaced in a block's command before it runs: the README's "your own model" is the tiny target here (no hub).
STAND_INS = {"HuggingFaceTB/SmolLM2-135M-Instruct": "../shared/models/stories260K"}
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


def runnable_blocks(text: str, setup: bool = True) -> list[tuple[str, str, str | None]]:
    """The blocks a newcomer runs, with their role: bash and python, not skipped. With ``setup`` (the README),
    the first bash block must be the set-up, and is left out."""
    blocks = [(lang, code, role) for lang, code, skip, role in readme_blocks(text)
              if lang in ("bash", "python") and not skip]
    if not setup:
        return blocks
    if not blocks or "pip install" not in blocks[0][1]:
        raise ValueError("the README's first command block must be the set-up (python3 -m venv ... pip install)")
    return blocks[1:]


def documented_blocks() -> list[tuple[str, int, str, str, str | None]]:
    """(file, number in its file, language, code, role) of every block the README test runs, in DOCS's order."""
    blocks = []
    for name in DOCS:
        for number, (lang, code, role) in enumerate(
                runnable_blocks((REPO / name).read_text(), setup=name == "README.md"), start=1):
            blocks.append((name, number, lang, code, role))
    return blocks


def stand_in(code: str) -> str:
    for name, replacement in STAND_INS.items():
        code = code.replace(name, replacement)
    return code


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
    assert runnable_blocks("```bash\n.venv/bin/specgraft generate\n```\n", setup=False)[0][1].startswith(".venv")
    roles = [role for _, _, role in blocks]
    assert "server" in roles and roles.index("server") < roles.index("client"), "the serve block, then its clients"
    assert all(f"--port {README_PORT}" not in code or role == "server" for _, code, role in blocks)


def test_the_readme_runs_your_own_model_end_to_end():
    """Its data and head (quickstart --target), the head served by name, an OpenAI client, the head exported."""
    blocks = runnable_blocks((REPO / "README.md").read_text())
    code = [c for _, c, _ in blocks]
    model = next(iter(STAND_INS))
    quickstart = next(i for i, c in enumerate(code) if "specgraft quickstart" in c)
    assert f"--target {model}" in code[quickstart] and "--prompts " in code[quickstart] and "--out runs/mine" in code[quickstart]
    served = next(i for i, (_, c, role) in enumerate(blocks) if role == "server" and "mine=runs/mine/eagle/head" in c)
    assert f"--target {model}" in code[served]
    client = blocks[served + 1]
    assert client[0] == "python" and client[2] == "client" and "from openai import OpenAI" in client[1]
    assert '"drafter": "mine"' in client[1]
    exported = next(i for i, c in enumerate(code) if "specgraft export runs/mine/eagle/head --to vllm" in c)
    assert quickstart < served < exported
    assert stand_in(code[quickstart]).count("../shared/models/stories260K") == 1 and model not in stand_in(code[served])


def test_every_page_of_docs_runs():
    """Every page of docs/ is in DOCS, so the README test runs its commands; none uses a bare command or
    leaves a server without a client."""
    pages = {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")}
    assert pages == set(DOCS) - {"README.md"}, f"list each docs page in DOCS: {sorted(pages ^ (set(DOCS) - {'README.md'}))}"
    blocks = documented_blocks()
    assert_no_bare_commands(" ".join(code for _, _, _, code, _ in blocks))
    for (name, number, _, code, role), after in zip(blocks, blocks[1:] + [(None, 0, None, "", None)]):
        if role == "server":
            assert after[0] == name and after[4] == "client", f"{name} block {number}: a server block with no client after it"
        assert f"--port {README_PORT}" not in code or role == "server", f"{name} block {number} names --port {README_PORT}"
    docs_commands = " ".join(code for name, _, _, code, _ in blocks if name != "README.md")
    assert "runs/eagle-stories260k/head" in docs_commands  # the README's head, trained before the docs run


def test_every_command_is_documented():
    """Each `specgraft COMMAND` is shown in the README or a docs page, as a command a user can copy."""
    from specgraft.cli import COMMANDS

    text = " ".join((REPO / name).read_text() for name in DOCS)
    missing = [name for name in COMMANDS if f"specgraft {name} " not in text]
    assert not missing, f"undocumented commands: {missing}"


HEADING = re.compile(r"^#{1,6} (.+?)\s*$", re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped but hyphens, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_resolve():
    """Every relative link of the README, docs/ and recipes/README.md names a file that exists, and an anchor
    that one of its headings makes."""
    bad = []
    for name in (*DOCS, "recipes/README.md"):
        page = REPO / name
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            path, _, fragment = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                bad.append(f"{name}: {target} (no such file)")
            elif fragment and linked.suffix == ".md":
                text = re.sub(r"^```.*?^```", "", linked.read_text(), flags=re.M | re.S)
                if fragment not in {anchor(h) for h in HEADING.findall(text)}:
                    bad.append(f"{name}: {target} (no such heading)")
    assert not bad, "broken links:\n" + "\n".join(bad)
    assert anchor("The bench, vLLM beside specgraft") == "the-bench-vllm-beside-specgraft"
    assert anchor("SmolLM2-135M-Instruct: a real chat model") == "smollm2-135m-instruct-a-real-chat-model"


@pytest.mark.readme
@pytest.mark.skipif(not STORIES.is_dir(), reason=f"../shared assets are absent ({STORIES} not found)")
def test_every_readme_command_runs_in_order(tmp_path):
    blocks = documented_blocks()
    assert_no_bare_commands(" ".join(code for _, _, _, code, _ in blocks))  # checked before anything runs
    repo = scratch_repository(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env |= {"XDG_CACHE_HOME": str(tmp_path / "cache"), "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    servers: list[ReadmeServer] = []
    try:
        run_blocks(blocks, repo, env, servers)
        for server in servers:  # the last page ended on a client block
            assert server.stop() == 0, "the README's server did not exit cleanly on SIGTERM"
    finally:
        for server in servers:
            server.stop()


def run_blocks(blocks, repo: Path, env: dict[str, str], servers: list[ReadmeServer]) -> None:
    """Each block in order; a server block starts in the background, and is stopped after its last client."""
    for name, number, lang, code, role in blocks:
        where = f"{name} block {number}"
        if servers and role != "client":
            assert servers.pop().stop() == 0, f"the server before {where} did not exit cleanly on SIGTERM"
        code = stand_in(code)
        if role == "server":
            servers.append(ReadmeServer(code, repo, env))
            continue
        if role == "client":
            assert servers, f"{where} is a client with no server block before it"
            code = servers[-1].client(code)
        if lang == "python":
            code = code.replace("max_new_tokens=128", "max_new_tokens=8")
            script = f"{name.replace('/', '-').removesuffix('.md')}_block_{number}.py"
            (repo / script).write_text(code)
            argv = [str(repo / ".venv" / "bin" / "python"), script]
        else:
            argv = ["bash", "-euo", "pipefail", "-c", code]
        run = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True)
        assert run.returncode == 0, (
            f"{where} ({lang}) failed with exit code {run.returncode}:\n{code}\n"
            f"--- stdout (tail)\n{run.stdout[-3000:]}\n--- stderr (tail)\n{run.stderr[-3000:]}"
        )
        assert "Traceback" not in run.stderr, f"{where} printed a traceback:\n{run.stderr[-3000:]}"
