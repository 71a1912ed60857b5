"""An interrupted ``prepare`` resumes where it stopped and gives the same folder as an uninterrupted one;
it never leaves a folder that looks complete; changed settings or inputs start over where needed."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tokenmill.data import pipeline as pipeline_mod
from tokenmill.data import prepare

prep = importlib.import_module("tokenmill.data.prepare")
ENCODE_PIECE = pipeline_mod.encode_piece

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def make_inputs(root: Path, files: int = 4, records: int = 80) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        lines = [json.dumps({"text": " ".join(WORDS[(f * 7 + i * j) % len(WORDS)] for j in range(20 + i % 30))})
                 for i in range(records)]
        (root / f"part-{f}.jsonl").write_text("\n".join(lines) + "\n")
    (root / "book.txt").write_text("\n".join(" ".join(WORDS[(i * k) % 12] for k in range(12)) for i in range(400)))
    return root


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


class Boom(KeyboardInterrupt):
    pass


def interrupt_after(monkeypatch, n: int) -> list:
    """Make the n-th tokenized piece raise KeyboardInterrupt (as Ctrl-C would); returns the call log."""
    real, calls = ENCODE_PIECE, []

    def encode(piece):
        calls.append((piece.file, tuple(piece.start)))
        if len(calls) == n:
            raise Boom()
        return real(piece)

    monkeypatch.setattr(pipeline_mod, "encode_piece", encode)
    return calls


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_interrupted_prepare_resumes_to_the_same_folder(tmp_path, monkeypatch, capsys, tokenizer):
    src = make_inputs(tmp_path / "in")
    monkeypatch.setattr(prep, "CHUNK_BYTES", 700)  # many pieces; book.txt is cut into several
    calls = interrupt_after(monkeypatch, 10**9)
    ref = prepare(src, tmp_path / "ref", tokenizer, vocab_size=300, workers=1, progress=False)
    total = len(calls)
    assert total > 20

    monkeypatch.setattr(prep, "COMMIT_SECONDS", 0.0)
    for stop in (3, total - 2):  # inside the text document (book.txt comes first), and near the end
        calls = interrupt_after(monkeypatch, stop)
        with pytest.raises(Boom):
            prepare(src, tmp_path / "out", tokenizer, vocab_size=300, workers=1, progress=False)
        build = tmp_path / ".out.prepare"
        assert build.is_dir() and not (build / "meta.json").exists() and not (tmp_path / "out").exists()
        assert len(calls) == stop
    calls = interrupt_after(monkeypatch, 10**9)
    prepare(src, tmp_path / "out", tokenizer, vocab_size=300, workers=1, progress=False)
    assert "resuming an interrupted prepare" in capsys.readouterr().err
    assert len(calls) <= 3  # only what the last interruption had not committed
    assert folder_bytes(tmp_path / "out") == folder_bytes(ref)
    assert not (tmp_path / ".out.prepare").exists()


@pytest.mark.slow
def test_changed_settings_or_inputs_start_over(tmp_path, monkeypatch, capsys):
    src = make_inputs(tmp_path / "in")
    monkeypatch.setattr(prep, "CHUNK_BYTES", 700)
    monkeypatch.setattr(prep, "COMMIT_SECONDS", 0.0)
    interrupt_after(monkeypatch, 12)
    with pytest.raises(Boom):
        prepare(src, tmp_path / "out", "bytes", workers=1, progress=False)
    interrupt_after(monkeypatch, 10**9)
    capsys.readouterr()
    seed1 = prepare(src, tmp_path / "out", "bytes", seed=1, workers=1, progress=False)  # other settings
    assert "resuming" not in capsys.readouterr().err
    assert folder_bytes(seed1) == folder_bytes(prepare(src, tmp_path / "ref1", "bytes", seed=1, workers=1,
                                                       progress=False))
    # an input file before the recorded position changed: its tokens are made again
    interrupt_after(monkeypatch, 12)
    with pytest.raises(Boom):
        prepare(src, tmp_path / "o2", "bytes", workers=1, progress=False)
    (src / "book.txt").write_text("a new book\n" * 50)  # sorted first: before everything done
    calls = interrupt_after(monkeypatch, 10**9)
    out = prepare(src, tmp_path / "o2", "bytes", workers=1, progress=False)
    assert calls[0] == (0, (0, 0))
    assert folder_bytes(out) == folder_bytes(prepare(src, tmp_path / "ref2", "bytes", workers=1, progress=False))


SLOW_CHILD = """
import importlib, sys, time
import tokenmill.data.pipeline as pl
p = importlib.import_module("tokenmill.data.prepare")  # the module (the package exports the function)
p.COMMIT_SECONDS, p.CHUNK_BYTES = 0.1, 1 << 12
fast = pl.encode_piece
def encode_piece(piece):  # 20 ms a piece: slow enough to be killed mid-run
    time.sleep(0.02)
    return fast(piece)
encode_piece.__module__ = pl.__name__
pl.encode_piece = encode_piece
from tokenmill.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_prepare_killed_hard_resumes(tmp_path):
    """SIGKILL to the prepare and its tokenizer processes mid-run; the rerun resumes and matches."""
    src = make_inputs(tmp_path / "in", files=4, records=1000)
    ref = prepare(src, tmp_path / "ref", "bytes", workers=2, progress=False)
    argv = [sys.executable, "-c", SLOW_CHILD, "prepare", str(src), "--out", str(tmp_path / "out"), "--tokenizer",
            "bytes", "--workers", "2", "--no-progress"]
    proc = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    journal = tmp_path / ".out.prepare" / "journal.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if journal.is_file() and journal.read_text().count("\n") >= 6:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "prepare finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)  # the prepare and its tokenizer processes (its own session)
    proc.wait()
    assert not (tmp_path / "out").exists()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "resuming an interrupted prepare" in done.stderr
    assert folder_bytes(tmp_path / "out") == folder_bytes(ref)
