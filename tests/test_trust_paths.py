"""Outputs never overlap inputs: no command deletes or overwrites anything inside a run, a checkpoint or a
prepared data folder that it reads, whatever the flags; --overwrite replaces only an earlier output."""

import hashlib
from pathlib import Path

import pytest

from conftest import run_cli

pytestmark = pytest.mark.slow


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def tokenmill(*args, cwd=None):
    return run_cli(*args, cwd=cwd)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("paths")
    (d / "text").mkdir()
    (d / "text" / "a.txt").write_text("the cat sat on the mat. " * 300)
    assert tokenmill("prepare", d / "text", "--out", d / "data", "--tokenizer", "bytes").returncode == 0
    out = tokenmill("train", "--preset", "tiny", "--data.path", d / "data", "--run-dir", d / "run",
                    "--train.max_steps", "2", "--train.device", "cpu")
    assert out.returncode == 0, out.stderr
    return d


@pytest.mark.parametrize("where, how", [
    ("run", "is the run directory"),
    ("run/checkpoints", "lies inside the run directory"),
    ("run/tokenizer", "lies inside the run directory"),
    (".", "contains the run directory"),
    ("data", "is the run's data folder"),
])
def test_export_never_writes_over_what_it_reads(world, where, how):
    before = tree(world)
    out = tokenmill("export", "--run-dir", world / "run", "--out", world / where, "--overwrite")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert how in out.stderr and "nothing was written" in out.stderr, out.stderr
    assert tree(world) == before


def test_export_overwrite_replaces_only_an_earlier_export(world, tmp_path):
    first = tokenmill("export", "--run-dir", world / "run", "--out", tmp_path / "hf")
    assert first.returncode == 0, first.stderr
    again = tokenmill("export", "--run-dir", world / "run", "--out", tmp_path / "hf", "--overwrite")
    assert again.returncode == 0, again.stderr
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    refused = tokenmill("export", "--run-dir", world / "run", "--out", mine, "--overwrite")
    assert refused.returncode == 1 and "notes.txt" in refused.stderr and "nothing was touched" in refused.stderr
    assert (mine / "notes.txt").read_text() == "keep me" and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("run_dir, flags, how", [
    ("data/run", [], "lies inside data.path"),
    ("data", [], "is data.path"),
    ("run", ["--train.init_from", "RUN"], "is train.init_from"),
])
def test_train_run_dir_never_overlaps_its_data_or_source(world, run_dir, flags, how):
    before = tree(world)
    flags = [str(world / "run") if f == "RUN" else f for f in flags]
    out = tokenmill("train", "--preset", "tiny", "--data.path", world / "data", "--run-dir", world / run_dir,
                    "--train.max_steps", "1", "--train.device", "cpu", *flags)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert how in out.stderr, out.stderr
    assert tree(world) == before


@pytest.mark.parametrize("inputs, out, how", [
    (["text"], "text", "is the input"),
    (["text"], "text/data", "lies inside the input"),
    (["text/a.txt"], "text", "contains the input"),
    (["text/*.txt"], "text/out", "lies inside the input"),  # a glob reads below its folder
])
def test_prepare_never_writes_over_its_inputs(world, tmp_path, inputs, out, how):
    before = tree(world)
    res = tokenmill("prepare", *inputs, "--out", out, "--tokenizer", "bytes", cwd=world)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert how in res.stderr and "nothing was written" in res.stderr, res.stderr
    assert tree(world) == before


def test_prepare_with_tokenizer_from_its_own_output_is_refused(world):
    before = tree(world)
    res = tokenmill("prepare", "text", "--out", "data", "--tokenizer-from", "data", cwd=world)
    assert res.returncode == 1 and "the --tokenizer-from source" in res.stderr, res.stderr
    assert tree(world) == before
