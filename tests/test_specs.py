"""The one grammar of drafter and tree specs (specgraft.specs): every spelling, its round trip, and its errors."""

from __future__ import annotations

import subprocess
import sys
import typing

import pytest

from specgraft.specs import (
    ChainSpec, CompositeSpec, DirectorySpec, DynamicSpec, LayerSkipSpec, NoDrafter, PromptLookupSpec, SelfSpec,
    TREE_FORMS, TREE_HELP, TREE_OBJECTS, StaticFileSpec, TreeFileSpec, TreeSpec, UnknownTreeSpec, check_drafter,
    parse_drafter, parse_tree, tree_file, tree_forms,
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


def test_the_table_of_tree_forms_holds_every_kind_of_spec_and_every_listing_names_each_form():
    """TREE_FORMS is the one list: its examples parse to every kind of tree spec there is, and the help, the
    parser's error and a request's list (the forms that read no file) name each form of it."""
    parsed = [parse_tree(example) for _, example, _, _ in TREE_FORMS]
    assert {type(spec) for spec in parsed} == set(typing.get_args(TreeSpec))
    assert [tree_file(spec) is not None for spec in parsed] == [reads for *_, reads in TREE_FORMS]
    with pytest.raises(UnknownTreeSpec) as err:
        parse_tree("bogus")
    for form, _, _, reads in TREE_FORMS:
        assert f"'{form}'" in TREE_HELP and f"'{form}'" in str(err.value)
        assert (f"'{form}'" in tree_forms(files=False)) is not reads
    assert "'adaptive'" in tree_forms(files=False) and "'adaptive:MAX_DEPTH,MAX_NODES'" in tree_forms(files=False)


def test_a_tree_object_of_unknown_kind_lists_every_kind():
    from specgraft.tree import tree_from_spec

    with pytest.raises(ValueError, match="unknown kind 'adaptve'") as err:
        tree_from_spec({"kind": "adaptve", "max_depth": 3, "max_nodes": 6}, where="speculative.tree")
    for kind in TREE_OBJECTS:
        assert f'"kind": "{kind}"' in str(err.value)


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
