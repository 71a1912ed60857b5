"""``tokenmill.atomic``: the one way files are written. A reader sees the old file or the whole new one;
a failure (an exception from the writer, Ctrl-C) leaves the old file and no temporary sibling."""

import json
import os

import pytest

from tokenmill import atomic


def test_write_text_and_json_replace_the_file_whole(tmp_path):
    path = tmp_path / "summary.json"
    atomic.write_text(path, "old")
    atomic.write_json(path, {"tokens_per_sec": 1.5, "path": tmp_path}, default=str)
    assert json.loads(path.read_text()) == {"tokens_per_sec": 1.5, "path": str(tmp_path)}
    assert path.read_text().endswith("}\n") and sorted(os.listdir(tmp_path)) == ["summary.json"]
    # an indent of the caller's replaces the default (the GPU scripts pass indent=1: a TypeError before)
    atomic.write_json(path, {"a": [1]}, indent=1)
    assert path.read_text() == '{\n "a": [\n  1\n ]\n}\n'


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, failure):
    path = tmp_path / "config.toml"
    path.write_text("the old config\n")
    with pytest.raises(type(failure)):
        with atomic.replacing(path, durable=True) as tmp:
            assert tmp.parent == tmp_path and tmp.name.startswith(".config.toml.tmp-")
            tmp.write_text("half of the new")
            raise failure
    assert path.read_text() == "the old config\n" and sorted(os.listdir(tmp_path)) == ["config.toml"]


def test_a_durable_write_lands_and_names_are_unique(tmp_path):
    path = tmp_path / "step_00000001.pt"
    with atomic.replacing(path, durable=True) as tmp:
        tmp.write_bytes(b"\x00" * 10)
    assert path.read_bytes() == b"\x00" * 10 and sorted(os.listdir(tmp_path)) == [path.name]
    assert atomic.tmp_name(path) != atomic.tmp_name(path)
