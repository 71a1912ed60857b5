"""Inputs as users have them, through the real ``tokenmill prepare``: a byte-order mark and Windows line ends
read as the plain file, a pipe (process substitution, ``/dev/fd/N``) read in one pass, and a resumed prepare
that notices an input edited in place (same size, same modification time) instead of mixing two corpora."""

from __future__ import annotations

import gzip
import importlib
import json
import os
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import pytest

from conftest import cpu_env
from tokenmill.cli import main
from tokenmill.data import pipeline as pipeline_mod

prep = importlib.import_module("tokenmill.data.prepare")
ENCODE_PIECE = pipeline_mod.encode_piece
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
BOM = b"\xef\xbb\xbf"


def jsonl_bytes(records: int = 120, offset: int = 0) -> bytes:
    lines = [json.dumps({"text": " ".join(WORDS[(offset + i * j) % 12] for j in range(10 + i % 25)), "id": i})
             for i in range(records)]
    return ("\n".join(lines) + "\n").encode()


def text_bytes(lines: int = 300) -> bytes:
    return "\n".join(" ".join(WORDS[(i * k) % 12] for k in range(1 + i % 9)) for i in range(lines)).encode()


def tokens(folder: Path) -> dict[str, bytes]:
    """The token files and the document counts of a prepared folder."""
    meta = json.loads((folder / "meta.json").read_text())
    out = {p.name: p.read_bytes() for p in sorted(folder.glob("*.bin"))}
    return out | {f"{s}_documents": meta["splits"][s]["documents"] for s in ("train", "val")}


def cli_prepare(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["prepare", *map(str, args), "--no-progress"])
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


@pytest.mark.parametrize("name, plain", [("c.jsonl", jsonl_bytes()), ("c.txt", text_bytes())])
def test_a_byte_order_mark_and_windows_line_ends_read_as_the_plain_file(tmp_path, capsys, name, plain):
    """The same corpus saved by a Windows editor (UTF-8 with a byte-order mark, CRLF line ends) gives the very
    tokens of the plain file: no first record lost as bad, no stray carriage returns."""
    (tmp_path / "unix").mkdir()
    (tmp_path / "windows").mkdir()
    (tmp_path / "unix" / name).write_bytes(plain)
    (tmp_path / "windows" / name).write_bytes(BOM + plain.replace(b"\n", b"\r\n"))
    for kind in ("unix", "windows"):
        rc, out = cli_prepare(capsys, tmp_path / kind / name, "--out", tmp_path / f"o-{kind}", "--tokenizer", "bytes")
        assert rc == 0 and "skipped 0 bad record(s)" in out and "warning" not in out, out
    assert tokens(tmp_path / "o-windows") == tokens(tmp_path / "o-unix")
    assert b"\r" not in b"".join(v for v in tokens(tmp_path / "o-windows").values() if isinstance(v, bytes))


def feed(data: bytes, fd: int | None = None) -> str:
    """A pipe whose writer (a thread) sends ``data`` and closes; its ``/dev/fd/N`` path, as a shell's ``<(...)``
    (``fd``: that number N, as bash gives the same one on every run)."""
    r, w = os.pipe()
    if fd is not None:
        os.dup2(r, fd)
        os.close(r)
        r = fd

    def write() -> None:
        with os.fdopen(w, "wb") as f:
            f.write(data)

    threading.Thread(target=write, daemon=True).start()
    return f"/dev/fd/{r}"


def fd_of(path: str) -> int:
    return int(path.rsplit("/", 1)[1])


@pytest.mark.slow  # prepare's worker pool starts processes
@pytest.mark.parametrize("data, kind", [(jsonl_bytes(), "jsonl"), (gzip.compress(jsonl_bytes(), mtime=0), "jsonl.gz"),
                                        (text_bytes(), "txt")])
@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_a_pipe_is_read_as_its_file(tmp_path, capsys, data, kind, tokenizer):
    """``tokenmill prepare /dev/fd/N`` (what ``<(cat f)`` passes) reads the pipe, telling JSON Lines, gzip and
    text from its first bytes, and gives the file's documents and tokens (the key, and so the split, is the
    pipe's name: compared over both splits). A BPE is trained on a copy in the build folder (the pipe is read
    once), removed at the end."""
    (tmp_path / "f").mkdir()
    file = tmp_path / "f" / f"c.{kind}"
    file.write_bytes(data)
    opts = ["--tokenizer", tokenizer] + (["--vocab-size", 300] if tokenizer == "bpe" else [])
    rc, out = cli_prepare(capsys, file, "--out", tmp_path / "ref", *opts, "--val-fraction", 0)
    assert rc == 0, out
    pipe = feed(data)
    try:
        rc, out = cli_prepare(capsys, pipe, "--out", tmp_path / "out", *opts, "--val-fraction", 0)
    finally:
        os.close(fd_of(pipe))
    assert rc == 0 and "does not exist" not in out and "warning" not in out, out
    assert ("is a pipe and a BPE is trained on it first" in out) == (tokenizer == "bpe"), out
    assert tokens(tmp_path / "out") == tokens(tmp_path / "ref")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f", "out", "ref"]  # no build folder, no copy left


def test_an_interrupted_prepare_reads_a_pipe_again_from_its_start(tmp_path, monkeypatch, capsys):
    """A pipe cannot be read twice: a prepare interrupted while reading one says so on the rerun and reads
    the new pipe from its start; the folder equals an uninterrupted prepare's."""
    data = jsonl_bytes(4000)  # about 600 kB: the pipe hands it over in pieces of its buffer (64 kB)
    monkeypatch.setattr(prep, "CHUNK_BYTES", 700)
    monkeypatch.setattr(prep, "COMMIT_SECONDS", 0.0)
    calls = []

    def encode(piece):
        calls.append(piece.start)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return ENCODE_PIECE(piece)

    monkeypatch.setattr(pipeline_mod, "encode_piece", encode)
    pipes = [feed(data) for _ in range(3)]
    try:
        assert main(["prepare", pipes[0], "--out", str(tmp_path / "out"), "--tokenizer", "bytes", "--workers",
                     "1", "--val-fraction", "0"]) == 130  # as Ctrl-C ends it
        assert (tmp_path / ".out.prepare" / "journal.jsonl").read_text().count("\n") > 2  # commits were made
        monkeypatch.setattr(pipeline_mod, "encode_piece", ENCODE_PIECE)
        rc, out = cli_prepare(capsys, pipes[1], "--out", tmp_path / "out", "--tokenizer", "bytes", "--workers", 1,
                              "--val-fraction", 0)  # the split hashes the key: the pipe's number
        assert rc == 0 and "is a pipe, which cannot be read again: it is read from its start" in out, out
        assert "resuming" not in out
        rc, out = cli_prepare(capsys, pipes[2], "--out", tmp_path / "ref", "--tokenizer", "bytes", "--workers", 1,
                              "--val-fraction", 0)
    finally:
        for p in pipes:
            os.close(fd_of(p))
    assert tokens(tmp_path / "out") == tokens(tmp_path / "ref")


def test_a_copied_pipe_resumes_when_it_brings_the_same_bytes(tmp_path, monkeypatch, capsys):
    """A pipe a BPE is trained on is copied first; interrupted while tokenizing, the rerun with a pipe of the
    same name and bytes resumes (the copy's bytes are checked) and gives the uninterrupted folder."""
    data = jsonl_bytes(2000)
    monkeypatch.setattr(prep, "CHUNK_BYTES", 700)
    monkeypatch.setattr(prep, "COMMIT_SECONDS", 0.0)
    calls = []

    def encode(piece):
        calls.append(piece.start)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return ENCODE_PIECE(piece)

    monkeypatch.setattr(pipeline_mod, "encode_piece", encode)
    opts = ["--tokenizer", "bpe", "--vocab-size", "300", "--workers", "1", "--no-progress"]
    try:
        assert main(["prepare", feed(data, 63), "--out", str(tmp_path / "out"), *opts]) == 130
        os.close(63)
        monkeypatch.setattr(pipeline_mod, "encode_piece", ENCODE_PIECE)
        rc, out = cli_prepare(capsys, feed(data, 63), "--out", tmp_path / "out", *opts[:-1])
        assert rc == 0 and "resuming an interrupted prepare" in out and "changed since" not in out, out
        os.close(63)
        rc, out = cli_prepare(capsys, feed(data, 63), "--out", tmp_path / "ref", *opts[:-1])
    finally:
        os.close(63) if fd_open(63) else None
    assert rc == 0 and tokens(tmp_path / "out") == tokens(tmp_path / "ref")


def fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


@pytest.mark.slow
def test_process_substitution_through_a_shell(tmp_path):
    """The command as a user types it: ``tokenmill prepare <(cat f.jsonl) ...`` and ``<(gzip -c f.jsonl)``."""
    (tmp_path / "f.jsonl").write_bytes(jsonl_bytes())
    script = ("set -e; tokenmill() { python -m tokenmill \"$@\"; }; "
              "tokenmill prepare <(cat f.jsonl) --out plain --tokenizer bytes --no-progress; "
              "tokenmill prepare <(gzip -c f.jsonl) --out zipped --tokenizer bpe --vocab-size 300 --no-progress")
    p = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, env=cpu_env(),
                       timeout=300)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stdout + p.stderr
    for out in ("plain", "zipped"):
        meta = json.loads((tmp_path / out / "meta.json").read_text())
        assert meta["prepare"]["documents"] == 120 and meta["prepare"]["bad_records"] == 0, meta


# ----------------------------------------------------------------------------------------------
# A resumed prepare checks the bytes it read, not the name, size and modification time


def corpus(root: Path) -> Path:
    """A text file, three JSON Lines files and a gzip one (stored, not deflated: a letter can be edited in it)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "a-book.txt").write_bytes(text_bytes(400))
    for f in range(3):
        (root / f"part-{f}.jsonl").write_bytes(jsonl_bytes(80, offset=f))
    (root / "part-3.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(3000, offset=3), compresslevel=0, mtime=0))
    return root


def edit_in_place(path: Path) -> None:
    """Change one letter of a word near the start (same size; a gzip file stays valid: its checksum is fixed), and put
    the modification time back."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    i = data.index(b"gamma", 16)  # a word of a text (never a field name)
    data[i + 1] = ord("x")
    if path.suffix == ".gz":
        raw = zlib.decompressobj(-15).decompress(bytes(data[10:-8]))
        data[-8:-4] = zlib.crc32(raw).to_bytes(4, "little")
        assert gzip.decompress(bytes(data)) == raw
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def interrupted(tmp_path, monkeypatch, src: Path, tokenizer: str, stop: int) -> dict:
    """A prepare into ``out`` interrupted at its ``stop``-th piece; the last journal line."""
    calls = []

    def encode(piece):
        calls.append(piece)
        if len(calls) == stop:
            raise KeyboardInterrupt
        return ENCODE_PIECE(piece)

    monkeypatch.setattr(pipeline_mod, "encode_piece", encode)
    assert main(["prepare", str(src), "--out", str(tmp_path / "out"), "--tokenizer", tokenizer, "--vocab-size",
                 "300", "--workers", "1", "--no-progress"]) == 130  # as Ctrl-C ends it
    monkeypatch.setattr(pipeline_mod, "encode_piece", ENCODE_PIECE)
    return json.loads((tmp_path / ".out.prepare" / "journal.jsonl").read_text().splitlines()[-1])


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
@pytest.mark.parametrize("where", ["done file", "file in progress", "compressed file"])
def test_an_input_edited_in_place_is_read_again(tmp_path, monkeypatch, capsys, tokenizer, where):
    """Interrupted, then one byte edited in what was already read (a file done, the file being read, a gzip
    file being read) keeping size and modification time: the rerun names the file and gives the folder a fresh
    prepare of the edited corpus gives (a BPE is trained again on it), never a mix of both corpora."""
    src = corpus(tmp_path / "in")
    files = sorted(src.iterdir())
    monkeypatch.setattr(prep, "CHUNK_BYTES", 700)
    monkeypatch.setattr(prep, "COMMIT_SECONDS", 0.0)
    per_file = [p.file for p in _pieces(src)]
    stop = {"done file": per_file.index(1) + 5, "file in progress": per_file.index(1) + 5,
            "compressed file": len(per_file)}[where]  # the gzip file: read 256 kB at a time
    last = interrupted(tmp_path, monkeypatch, src, tokenizer, stop)
    edited = {"done file": files[0], "file in progress": files[1], "compressed file": files[4]}[where]
    assert last["file"] == files.index(edited) + (where == "done file") and last["pos"] is not None, last
    edit_in_place(edited)
    rc, out = cli_prepare(capsys, src, "--out", tmp_path / "out", "--tokenizer", tokenizer, "--vocab-size", 300,
                          "--workers", 1)
    assert rc == 0 and f"input '{edited}' changed since the interrupted prepare read it" in out, out
    rc, _ = cli_prepare(capsys, src, "--out", tmp_path / "ref", "--tokenizer", tokenizer, "--vocab-size", 300,
                        "--workers", 1)
    assert tokens(tmp_path / "out") == tokens(tmp_path / "ref")


def _pieces(src: Path) -> list:
    """Every piece a prepare of ``src`` tokenizes (with the monkeypatched piece size)."""
    from tokenmill.data.readers import iter_pieces
    from tokenmill.data.sources import collect_inputs

    inputs, _ = collect_inputs(src)
    return [p for i, f in enumerate(inputs) for p in iter_pieces(f, i, [0, 0], prep.CHUNK_BYTES)]


def test_an_unchanged_input_with_a_new_modification_time_still_resumes(tmp_path, monkeypatch, capsys):
    """The other way round: a file touched (new modification time, same bytes) does not throw the work away."""
    src = corpus(tmp_path / "in")
    monkeypatch.setattr(prep, "CHUNK_BYTES", 700)
    monkeypatch.setattr(prep, "COMMIT_SECONDS", 0.0)
    interrupted(tmp_path, monkeypatch, src, "bytes", 12)
    for p in src.iterdir():
        os.utime(p, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns + 10**9))
    rc, out = cli_prepare(capsys, src, "--out", tmp_path / "out", "--tokenizer", "bytes", "--workers", 1)
    assert rc == 0 and "resuming an interrupted prepare" in out and "changed since" not in out, out
    rc, _ = cli_prepare(capsys, src, "--out", tmp_path / "ref", "--tokenizer", "bytes", "--workers", 1)
    assert tokens(tmp_path / "out") == tokens(tmp_path / "ref")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
