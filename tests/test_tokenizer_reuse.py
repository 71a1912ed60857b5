"""``tokenmill prepare --tokenizer-from``: new text tokenized with an existing tokenizer (same ids)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import run_cli
from tokenmill import config as C
from tokenmill.cli import main
from tokenmill.data import load_tokenizer_for_data, prepare

OLD = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 40
NEW = "def mul(a, b):\n    return a * b  # héllo\n\nclass Vector(Point):\n    z: float = 1.5\n" * 30


@pytest.fixture()
def base(tmp_path):
    """A prepared folder with its own trained BPE (the tokenizer to reuse) and a new text file."""
    (tmp_path / "old.txt").write_text(OLD)
    (tmp_path / "new.txt").write_text(NEW)
    prepare(tmp_path / "old.txt", tmp_path / "base", "bpe", vocab_size=300, workers=1, progress=False)
    return tmp_path


def tokens(folder, split="train"):
    meta = json.loads((folder / "meta.json").read_text())
    return np.fromfile(folder / f"{split}.bin", dtype=meta["dtype"])


def check_same_tokenizer(tmp_path, out):
    """``out`` was tokenized with base's tokenizer: same vocabulary and tokenizer.json, and its
    tokens are that tokenizer's encoding of new.txt followed by the end-of-text id."""
    meta, ref = json.loads((out / "meta.json").read_text()), json.loads((tmp_path / "base" / "meta.json").read_text())
    assert meta["tokenizer"]["vocab_size"] == ref["tokenizer"]["vocab_size"] == meta["vocab_size"]
    assert meta["tokenizer"]["name"] == "bpe" and "from" in meta["tokenizer"]
    tok = load_tokenizer_for_data(tmp_path / "base")
    assert load_tokenizer_for_data(out).encode(NEW) == tok.encode(NEW)
    ids = np.concatenate([tokens(out, "train"), tokens(out, "val")]).tolist()
    assert ids == tok.encode(NEW) + [tok.eot_id]


@pytest.mark.slow
def test_from_data_folder_through_the_cli(base):
    out = base / "ft"
    r = run_cli("prepare", base / "new.txt", "--out", out, "--tokenizer-from", base / "base", "--no-progress",
                "--workers", "1")
    assert r.returncode == 0, r.stderr
    assert f"tokenizer from: {base / 'base'}" in r.stdout and "tokenizer bpe (" in r.stdout
    check_same_tokenizer(base, out)
    assert (out / "tokenizer.json").read_text() == (base / "base" / "tokenizer.json").read_text()


def test_from_run_directory(base, capsys):
    run = base / "run"
    run.mkdir()
    cfg = C.resolve("tiny", overrides={"data.path": str(base / "base")}, overrides_from_string=False)
    (run / "config.toml").write_text(C.to_toml(cfg))
    argv = ["prepare", str(base / "new.txt"), "--out", str(base / "ft"), "--tokenizer-from", str(run),
            "--no-progress", "--workers", "1"]
    assert main(argv) == 0
    check_same_tokenizer(base, base / "ft")
    # the run's config.toml itself works too
    argv[5] = str(run / "config.toml")
    assert main(argv) == 0
    check_same_tokenizer(base, base / "ft")


@pytest.mark.parametrize("form", ["tokenizer.json", "folder-with-tokenizer.json", "vocab+merges"])
def test_from_hugging_face_tokenizer_files(base, form):
    src = base / "hf"
    src.mkdir()
    if form == "tokenizer.json":
        arg = base / "base" / "tokenizer.json"
    elif form == "folder-with-tokenizer.json":
        (src / "tokenizer.json").write_text((base / "base" / "tokenizer.json").read_text())
        arg = src
    else:  # GPT-2's slow-tokenizer files, as a Hugging Face GPT-2 folder has them
        load_tokenizer_for_data(base / "base")._tok.model.save(str(src))
        assert sorted(p.name for p in src.iterdir()) == ["merges.txt", "vocab.json"]
        arg = src
    assert main(["prepare", str(base / "new.txt"), "--out", str(base / "ft"), "--tokenizer-from", str(arg),
                 "--no-progress", "--workers", "1"]) == 0
    check_same_tokenizer(base, base / "ft")


def test_from_bytes_folder(base):
    prepare(base / "old.txt", base / "bytes", "bytes", workers=1, progress=False)
    assert main(["prepare", str(base / "new.txt"), "--out", str(base / "ft"), "--tokenizer-from",
                 str(base / "bytes"), "--no-progress", "--workers", "1", "--val-fraction", "0"]) == 0
    meta = json.loads((base / "ft" / "meta.json").read_text())
    assert meta["tokenizer"]["name"] == "bytes" and meta["vocab_size"] == 256
    assert tokens(base / "ft").tolist() == list(NEW.encode()) + [10]


def test_errors_name_the_problem(base, capsys):
    def err(*extra):
        rc = main(["prepare", str(base / "new.txt"), "--out", str(base / "ft"), "--no-progress", *extra])
        return rc, capsys.readouterr().err

    rc, e = err("--tokenizer-from", str(base / "base"), "--tokenizer", "bytes")
    assert rc == 1 and "--tokenizer-from reuses an existing tokenizer, so --tokenizer cannot be given" in e
    rc, e = err("--tokenizer-from", str(base / "nope"))
    assert rc == 1 and "does not exist" in e and "Traceback" not in e
    (base / "empty").mkdir()
    rc, e = err("--tokenizer-from", str(base / "empty"))
    assert rc == 1 and "holds no tokenizer" in e and "tiktoken cache" in e
    run = base / "synthrun"
    run.mkdir()
    (run / "config.toml").write_text(C.to_toml(C.resolve("tiny", overrides={"data.source": "synthetic", "model.vocab_size": 64},
                                                         overrides_from_string=False)))
    rc, e = err("--tokenizer-from", str(run))
    assert rc == 1 and "synthetic tokens" in e
    (base / "bad.json").write_text("{not json")
    rc, e = err("--tokenizer-from", str(base / "bad.json"))
    assert rc == 1 and "cannot be loaded as a Hugging Face tokenizer.json" in e
    assert not (base / "ft" / "meta.json").exists()
