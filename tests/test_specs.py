"""The one grammar of drafter and tree specs (specgraft.specs): every spelling, its round trip, and its errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specgraft.specs import (
    ChainSpec, CompositeSpec, DirectorySpec, DynamicSpec, LayerSkipSpec, NoDrafter, PromptLookupSpec, SelfSpec,
    StaticFileSpec, TreeFileSpec, check_drafter, parse_drafter, parse_tree,
)


@pytest.mark.parametrize(("text", "spec"), [
    ("none", NoDrafter()),
    ("prompt-lookup", PromptLookupSpec()),
    ("self", SelfSpec()),
    ("layer-skip:12-14,19", LayerSkipSpec((12, 13, 14, 19))),
    ("runs/eagle/head", DirectorySpec("runs/eagle/head")),
    ("prompt-lookup+self", CompositeSpec(SelfSpec())),
    ("prompt-lookup:4+layer-skip:3", CompositeSpec(LayerSkipSpec((3,)), first_depth=4)),
    ("prompt-lookup+runs/eagle/head", CompositeSpec(DirectorySpec("runs/eagle/head"))),
])
def test_every_drafter_spelling_parses_and_prints_back(text, spec):
    assert parse_drafter(text) == spec
    assert str(spec) == text
    assert parse_drafter(spec) is spec


@pytest.mark.parametrize(("text", "spec"), [
    ("chain:5", ChainSpec(5)),
    ("dynamic:8,6,48", DynamicSpec(8, 6, 48)),
    ("static:trees/medusa.json", StaticFileSpec("trees/medusa.json")),
    ("runs/tuned.json", TreeFileSpec("runs/tuned.json")),
])
def test_every_tree_spelling_parses_and_prints_back(text, spec):
    assert parse_tree(text) == spec
    assert str(spec) == text


@pytest.mark.parametrize(("text", "message"), [
    ("layer-skip:3-1", "runs backwards"),
    ("layer-skip:x", "not a layer index"),
    ("prompt-lookup:0+self", "a number of tokens >= 1, got '0'"),
    ("prompt-lookup+none", "comes 'self', 'layer-skip:LAYERS' or a drafter directory"),
    ("prompt-lookup+prompt-lookup", "comes 'self', 'layer-skip:LAYERS' or a drafter directory"),
    ("", "is empty"),
])
def test_a_bad_drafter_spec_names_itself(text, message):
    with pytest.raises(ValueError, match=message):
        parse_drafter(text)


@pytest.mark.parametrize("text", ["chain", "chain:x", "dynamic:8,6", "static:", "tree.yaml"])
def test_an_unknown_tree_spec_lists_the_spellings(text):
    with pytest.raises(ValueError, match="unknown tree spec.*chain:DEPTH.*dynamic:TOP_K,DEPTH,BUDGET"):
        parse_tree(text)


@pytest.mark.parametrize(("text", "message"), [("chain:0", "depth must be >= 1"), ("dynamic:8,0,48", "depth must be >= 1")])
def test_a_tree_of_nothing_is_refused_by_the_parser(text, message):
    with pytest.raises(ValueError, match=message):
        parse_tree(text)


def test_parsing_reads_no_file_and_checking_does(tmp_path):
    missing = tmp_path / "absent"
    assert parse_drafter(f"prompt-lookup+{missing}") == CompositeSpec(DirectorySpec(str(missing)))
    with pytest.raises(FileNotFoundError, match="absent.*does not exist"):
        check_drafter(f"prompt-lookup+{missing}")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileNotFoundError, match="is a file, not a directory"):
        check_drafter(str(tmp_path / "file"))
    assert check_drafter(str(tmp_path)) == DirectorySpec(str(tmp_path))


def test_the_grammar_loads_without_torch():
    code = "import sys, specgraft.specs; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
