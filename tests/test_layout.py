"""DESIGN.md's dependency arrows, held by reading every module's imports (lazy ones inside functions too).

An arrow is "may import". The rooms, from the bottom up:

    specgraft.specs, specgraft.threads,  nothing of ours (the spec grammar; the thread choice; lazy package
    specgraft.lazy, specgraft.progress    exports, which any room may use; progress bars)
    specgraft.tree                        specs
    specgraft.model                       threads
    specgraft.heads                       tree, model, specs
    specgraft.config                      heads (their typed configs), specs
    specgraft.infer                       heads, tree, model, specs, threads (its `serve` package, the HTTP layer,
                                          is imported only by the cli, and alone imports the HTTP stack)
    specgraft.train                       heads, model, config, tree, specs, progress (and infer for evaluation,
                                          regeneration and recording served traffic only)
    specgraft.tools                       the public API: `specgraft` and its rooms' packages, never their modules
    specgraft.cli                         everything; nothing imports it but a ``__main__`` entry point

`specgraft/__init__.py` re-exports the API, so it may import any room but tools and cli. Only the cli
imports argparse: no other module parses a command line. Imports under ``if TYPE_CHECKING:`` never run and
are not arrows.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# folder -> the package it imports as (pyproject.toml's package-dir)
FOLDERS = {"specgraft": "specgraft", "heads": "specgraft.heads", "tree": "specgraft.tree",
           "infer": "specgraft.infer", "train": "specgraft.train"}
LAZY = "specgraft.lazy"  # a package's PEP 562 exports: any room's package may use it
LEAVES = ("specgraft.specs", "specgraft.threads", LAZY, "specgraft.progress")  # no module of ours
ROOMS = (*LEAVES, "specgraft.tree", "specgraft.model", "specgraft.heads",
         "specgraft.config", "specgraft.infer", "specgraft.train", "specgraft.tools", "specgraft.cli")
ALLOWED = {
    **{leaf: set() for leaf in LEAVES},
    "specgraft.tree": {"specgraft.specs"},
    "specgraft.model": {"specgraft.threads"},
    "specgraft.heads": {"specgraft.tree", "specgraft.model", "specgraft.specs"},
    "specgraft.config": {"specgraft.heads", "specgraft.specs"},
    "specgraft.infer": {"specgraft.heads", "specgraft.tree", "specgraft.model", "specgraft.specs", "specgraft.threads"},
    "specgraft.train": {"specgraft.heads", "specgraft.model", "specgraft.config", "specgraft.tree", "specgraft.specs",
                        "specgraft.progress"},
    "specgraft.tools": {"specgraft", *ROOMS[:-2]},
    "specgraft": set(ROOMS[:-2]),
}
# Simulated tau runs the engine on held-out prompts; regeneration runs the target through its scheduler.
TRAIN_MAY_USE_INFER = ("specgraft.train.evaluate", "specgraft.train.regeneration", "specgraft.train.recording")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    imported: str  # the module named (for `from a import b`, a.b when b is a module, else a)
    line: int


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    parts[0] = FOLDERS[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> dict[str, Path]:
    files = {}
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            files[module_name(path)] = path
    return files


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def imports_of(module: str, source: str, known: set[str], is_package: bool = False) -> list[Import]:
    """Every import in ``source`` that runs (top level or inside a function), relative ones resolved."""
    found: list[Import] = []

    def visit(node: ast.AST) -> None:
        if _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(module, alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.append(Import(module, name if name in known else base, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def room_of(module: str) -> str | None:
    """The room a module of ours belongs to; None for a module that is not ours."""
    if module == "specgraft":
        return "specgraft"
    return next((room for room in ROOMS if module == room or module.startswith(room + ".")), None)


def violations(module: str, imports: list[Import], where: str) -> list[str]:
    """What breaks the arrows among ``imports`` of ``module`` (one line each, naming file and line)."""
    bad = []
    room = room_of(module)
    entry_point = module.endswith(".__main__")
    for imp in imports:
        top = imp.imported.split(".")[0]
        if top == "argparse" and room != "specgraft.cli":
            bad.append(f"{where}:{imp.line}: {module} imports argparse: only specgraft.cli parses command lines")
        if top != "specgraft":
            continue
        target = room_of(imp.imported)
        if target is None or target == room:
            continue
        if target == "specgraft.cli":
            if not entry_point:
                bad.append(f"{where}:{imp.line}: {module} imports {imp.imported}: nothing imports the cli")
            continue
        if room == "specgraft.cli" or entry_point:
            continue
        if room == "specgraft.tools" and imp.imported not in (*ROOMS, "specgraft"):
            bad.append(f"{where}:{imp.line}: {module} imports {imp.imported}: a tool uses the public API "
                       f"({target} or specgraft), not a module inside it")
            continue
        if target in ALLOWED[room] or (target == LAZY and room not in LEAVES):
            continue
        if target == "specgraft.infer" and module in TRAIN_MAY_USE_INFER:
            continue
        bad.append(f"{where}:{imp.line}: {module} imports {imp.imported}: {room} may not import {target}")
    return bad


def test_the_rooms_are_found():
    modules = sources()
    assert {room_of(m) for m in modules} >= set(ROOMS) | {"specgraft"}
    assert None not in {room_of(m) for m in modules}, "a module outside every room"


def test_every_import_follows_the_arrows():
    modules = sources()
    known = set(modules)
    bad = []
    for module, path in modules.items():
        imports = imports_of(module, path.read_text(), known, is_package=path.name == "__init__.py")
        bad += violations(module, imports, str(path.relative_to(REPO)))
    assert not bad, "imports against DESIGN.md's arrows:\n  " + "\n  ".join(bad)


SERVE = "specgraft.infer.serve"  # the HTTP layer: in the engine's room, above it
HTTP_STACK = ("fastapi", "uvicorn", "starlette", "prometheus_client")


def test_the_engine_never_imports_its_server():
    """`specgraft.infer.serve` is a layer over the scheduler: nothing else of ours but the cli imports it, and only it
    imports the HTTP stack."""
    modules = sources()
    known = set(modules)
    bad = []
    for module, path in modules.items():
        if module == SERVE or module.startswith(SERVE + "."):
            continue
        for imp in imports_of(module, path.read_text(), known, is_package=path.name == "__init__.py"):
            top = imp.imported.split(".")[0]
            serve = imp.imported == SERVE or imp.imported.startswith(SERVE + ".")
            if (serve and room_of(module) != "specgraft.cli") or top in HTTP_STACK:
                bad.append(f"{path.relative_to(REPO)}:{imp.line}: {module} imports {imp.imported}")
    assert not bad, "outside specgraft.infer.serve:\n  " + "\n  ".join(bad)


SCHEDULER_NAMES = ("Scheduler", "sched", "scheduler")  # how the tools and benchmarks name a scheduler or its class


def reaches_into_the_scheduler(source: str) -> list[tuple[int, str]]:
    """(line, what) of every private attribute of a scheduler ``source`` reads, sets or patches: ``sched._x``, or a
    call given a scheduler and a private name (``setattr(Scheduler, "_x", f)``, ``wrap(sg.Scheduler, "_x")``)."""

    def private(name: object) -> bool:
        return isinstance(name, str) and name.startswith("_") and not name.startswith("__")

    def scheduler(node: ast.AST) -> bool:
        return ast.unparse(node).split(".")[-1] in SCHEDULER_NAMES

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and private(node.attr) and scheduler(node.value):
            found.append((node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
        elif isinstance(node, ast.Call):
            owners = [a for a in node.args if scheduler(a)]
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and private(a.value)]
            found += [(node.lineno, f"{ast.unparse(owners[0])}.{name}") for name in names if owners]
    return sorted(found)


def test_tools_and_benchmarks_watch_the_scheduler_through_its_observer_hook():
    """DESIGN.md: `specgraft.tools` and benchmarks/ use the public API and the step-observer hook
    (`Scheduler.add_observer`), never the scheduler's private methods or state."""
    paths = sorted((REPO / "benchmarks").glob("*.py")) + sorted((REPO / "specgraft" / "tools").glob("*.py"))
    bad = [f"{path.relative_to(REPO)}:{line}: {what}" for path in paths
           for line, what in reaches_into_the_scheduler(path.read_text())]
    assert not bad, "private scheduler attributes used (observe the step instead):\n  " + "\n  ".join(bad)
    patched = ("import specgraft as sg\nsg.Scheduler._commit = f\nsetattr(sg.Scheduler, '_draft', g)\nx = sched._held\n"
               "wrap(sg.Scheduler, '_verify', 'verify')\nsched.add_observer(o)\nsg.Scheduler.step(sched)\n")
    assert [what for _, what in reaches_into_the_scheduler(patched)] == [
        "sg.Scheduler._commit", "sg.Scheduler._draft", "sched._held", "sg.Scheduler._verify"]


@pytest.mark.parametrize(
    ("module", "source", "complaint"),
    [
        ("specgraft.tree.policies", "import torch\nfrom specgraft.model import Target\n", "may not import specgraft.model"),
        ("specgraft.heads.medusa", "def f():\n    from specgraft.tools.bench import run_bench\n", "may not import specgraft.tools"),
        ("specgraft.infer.serve.server", "import argparse\n", "only specgraft.cli parses"),
        ("specgraft.train.data", "from specgraft import cli\n", "nothing imports the cli"),
        ("specgraft.tools.bench", "from specgraft.infer.scheduler import Scheduler\n", "a tool uses the public API"),
        ("specgraft.train.data", "from specgraft.infer import SpeculativeGenerator\n", "may not import specgraft.infer"),
        ("specgraft.specs", "from .tree import Chain\n", "may not import specgraft.tree"),
    ],
)
def test_a_wrong_import_is_reported(module, source, complaint):
    known = set(sources())
    found = violations(module, imports_of(module, source, known), "x.py")
    assert any(complaint in line for line in found), found


def test_type_checking_imports_are_not_arrows():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import argparse\n    from specgraft.tools import bench\n"
    assert violations("specgraft.infer.serve.server", imports_of("specgraft.infer.serve.server", source, set()), "x.py") == []


def test_entry_points_may_start_the_cli():
    source = "from specgraft.cli import main\n"
    assert violations("specgraft.train.__main__", imports_of("specgraft.train.__main__", source, set()), "x.py") == []


def test_leaves_are_not_open_to_every_room():
    """Only the lazy-exports helper is open to all: the tree may not reach for the thread choice."""
    found = violations("specgraft.tree.policies", imports_of("specgraft.tree.policies", "import specgraft.threads\n", set()), "x.py")
    assert any("may not import specgraft.threads" in line for line in found), found
