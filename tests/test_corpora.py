"""Real corpora for ``tokenmill prepare``: JSON Lines (plain, gzip, Zstandard), Parquet, Arrow and saved
Hugging Face dataset folders, globs; bad records; sharded output read by memory map; bad input through
the CLI. The token streams are checked against a reference built here from the documented rules (each
document's ids, then the end-of-text ids; a document is in val when sha256(f"{seed}:{key}") < val_fraction,
key = file key + "#" + record number)."""

from __future__ import annotations

import gzip
import hashlib
import importlib
import json
import random
from pathlib import Path

import numpy as np
import pytest

from tokenmill.cli import main
from tokenmill.data import DataError, WindowDataset, get_tokenizer, open_token_data, prepare
from tokenmill.data.dataset import TokenFile

pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (pip install 'tokenmill[corpora]')")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard", reason="zstandard is not installed (pip install 'tokenmill[corpora]')")

WORDS = "the quick brown fox jumps over the lazy dog héllo wörld 😀 naïve café 東京 data mill".split()


def records(n: int, seed: int = 0) -> list[dict]:
    rnd = random.Random(seed)
    return [{"id": i, "text": "\n".join(" ".join(rnd.choice(WORDS) for _ in range(rnd.randint(3, 40)))
                                        for _ in range(rnd.randint(1, 4)))} for i in range(n)]


def jsonl_bytes(recs: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs).encode()


def write_jsonl(path: Path, recs: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = jsonl_bytes(recs)
    if path.suffix == ".gz":
        data = gzip.compress(data)
    elif path.suffix == ".zst":
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


def write_hf_folder(folder: Path, recs: list[dict], batch: int = 50) -> Path:
    """A folder laid out as ``datasets.Dataset.save_to_disk`` writes it: an Arrow IPC stream of record
    batches, state.json naming it, dataset_info.json."""
    folder.mkdir(parents=True)
    table = pa.table({"text": [r["text"] for r in recs], "id": [r["id"] for r in recs]})
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            for b in table.to_batches(max_chunksize=batch):
                writer.write_batch(b)
    (folder / "state.json").write_text(json.dumps({
        "_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_fingerprint": "0", "_format_columns": None,
        "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": None}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))
    return folder


def is_val(seed: int, key: str, frac: float) -> bool:
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "little") / 2**64 < frac


def expected(docs: list[tuple[str, str]], tok, seed: int = 0, frac: float = 0.0) -> dict[str, list[int]]:
    """The token streams the documented rules give for (key, text) documents, in order."""
    sep = [tok.eot_id] if tok.eot_id is not None else tok.encode("\n")
    out = {"train": [], "val": []}
    for key, text in docs:
        out["val" if is_val(seed, key, frac) else "train"] += tok.encode(text) + sep
    return out


def streams(folder: Path) -> dict[str, list[int]]:
    return {s: np.asarray(open_token_data(folder, s).tokens, dtype=np.int64).tolist() for s in ("train", "val")}


def meta(folder: Path) -> dict:
    return json.loads((folder / "meta.json").read_text())


@pytest.fixture(scope="module")
def recs() -> list[dict]:
    return records(300)


@pytest.fixture(scope="module")
def byte_tok():
    return get_tokenizer("bytes")


# ----------------------------------------------------------------------------------------------
# Inputs


@pytest.mark.parametrize("name", ["a.jsonl", "a.json", "a.jsonl.gz", "a.jsonl.zst", "a.parquet", "hf"])
def test_every_input_kind_gives_the_documented_stream(tmp_path, recs, byte_tok, name):
    if name == "a.parquet":
        src = tmp_path / name
        pq.write_table(pa.table({"text": [r["text"] for r in recs], "n": [r["id"] for r in recs]}), src,
                       row_group_size=40)
    elif name == "hf":
        src = write_hf_folder(tmp_path / name, recs)
    else:
        src = write_jsonl(tmp_path / name, recs)
    key = "data-00000-of-00001.arrow" if name == "hf" else name
    out = prepare(src, tmp_path / "out", "bytes", val_fraction=0.2, seed=3, workers=2, progress=False)
    want = expected([(f"{key}#{i + 1}", r["text"]) for i, r in enumerate(recs)], byte_tok, seed=3, frac=0.2)
    assert streams(out) == want
    m = meta(out)
    assert m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == len(recs)
    assert m["splits"]["val"]["documents"] == sum(is_val(3, f"{key}#{i + 1}", 0.2) for i in range(len(recs)))
    assert m["prepare"]["bad_records"] == 0 and m["version"] == 2


def test_formats_agree_and_globs_folders_and_several_inputs(tmp_path, recs, byte_tok):
    """Shards of one corpus in different formats give the same tokens (no val split), whichever way they
    are named: a folder, a glob pattern, or a list of inputs."""
    a, b, c = recs[:100], recs[100:200], recs[200:]
    write_jsonl(tmp_path / "mix" / "part-0.jsonl.gz", a)
    write_jsonl(tmp_path / "mix" / "part-1.jsonl.zst", b)
    pq.write_table(pa.table({"text": [r["text"] for r in c]}), tmp_path / "mix" / "part-2.parquet", row_group_size=7)
    (tmp_path / "mix" / "notes.md").write_text("not an input\n")
    want = expected([("", r["text"]) for r in recs], byte_tok)
    folder = prepare(tmp_path / "mix", tmp_path / "o1", "bytes", val_fraction=0, progress=False)
    assert streams(folder) == want and meta(folder)["prepare"]["inputs"] == 3
    pattern = prepare(str(tmp_path / "mix" / "part-*"), tmp_path / "o2", "bytes", val_fraction=0, progress=False)
    assert streams(pattern) == want
    listed = [tmp_path / "mix" / n for n in ("part-0.jsonl.gz", "part-1.jsonl.zst", "part-2.parquet")]
    assert streams(prepare(listed, tmp_path / "o3", "bytes", val_fraction=0, workers=2, progress=False)) == want
    # a saved DatasetDict: every split folder it names, in order
    root = tmp_path / "dd"
    write_hf_folder(root / "train", a)
    write_hf_folder(root / "test", b)
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    assert streams(prepare(root, tmp_path / "o4", "bytes", val_fraction=0, progress=False)) == expected(
        [("", r["text"]) for r in a + b], byte_tok)


@pytest.mark.slow
def test_text_files_compressed_and_plain_give_the_same_tokens(tmp_path, recs, monkeypatch):
    """A .txt.gz document is one document, cut into pieces while streaming: same ids as the plain file."""
    prep = importlib.import_module("tokenmill.data.prepare")
    text = "\n".join(r["text"] for r in recs) * 3
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "doc.txt").write_text(text)
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "doc.txt.gz").write_bytes(gzip.compress(text.encode()))
    tok = get_tokenizer("gpt2")
    monkeypatch.setattr(prep, "CHUNK_BYTES", 2000)  # many pieces
    plain = prepare(tmp_path / "t", tmp_path / "p", tok, val_fraction=0, workers=2, progress=False)
    packed = prepare(tmp_path / "z", tmp_path / "q", tok, val_fraction=0, workers=2, progress=False)
    assert streams(plain) == streams(packed) == {"train": tok.encode(text) + [tok.eot_id], "val": []}


# ----------------------------------------------------------------------------------------------
# Bad records


def test_bad_records_are_counted_reported_and_skipped_or_stop(tmp_path, recs, byte_tok, capsys):
    good = recs[:6]
    lines = [json.dumps(good[0]).encode(), b'{"text": "cut', json.dumps(good[1]).encode(),
             b'{"text": "caf\xe9"}', json.dumps({"id": 7}).encode(), json.dumps({"text": 5}).encode(),
             json.dumps({"text": None}).encode(), b"[1, 2]", json.dumps({"text": ""}).encode(),
             json.dumps(good[2]).encode()]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    full = gzip.compress(jsonl_bytes(good[3:]))
    (tmp_path / "in" / "b.jsonl.gz").write_bytes(full[: len(full) - 12])  # a truncated shard
    rc = main(["prepare", str(tmp_path / "in"), "--out", str(tmp_path / "o"), "--tokenizer", "bytes",
               "--val-fraction", "0", "--no-progress", "--workers", "2"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    a = tmp_path / "in" / "a.jsonl"
    for n, what in [(2, "is not a JSON object"), (4, "is not UTF-8"), (5, "has no field 'text'"),
                    (6, "field 'text' is int, not text"), (7, "field 'text' is NoneType"), (8, "is not a JSON object")]:
        assert f"'{a}' record {n}: {what}" in out.err, (n, out.err)
    assert "b.jsonl.gz' record" in out.err and "truncated" in out.err
    # 6 in a.jsonl; in b.jsonl.gz the record cut by the truncation and the truncation itself
    assert "skipped 8 bad record(s)" in out.out, out.out
    m = meta(tmp_path / "o")
    assert m["prepare"]["bad_records"] == 8 and m["prepare"]["empty_records"] == 1
    kept = streams(tmp_path / "o")["train"]
    assert kept[: len(expected([("", r["text"]) for r in good[:3]], byte_tok)["train"])] == expected(
        [("", r["text"]) for r in good[:3]], byte_tok)["train"]
    assert m["splits"]["train"]["documents"] == 5  # the records of the truncated shard before the cut stay
    rc = main(["prepare", str(tmp_path / "in"), "--out", str(tmp_path / "o2"), "--tokenizer", "bytes",
               "--on-bad-record", "stop", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and f"'{a}' record 2: is not a JSON object" in err and "--on-bad-record skip" in err
    assert "Traceback" not in err and not (tmp_path / "o2").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# ----------------------------------------------------------------------------------------------
# Sharded output, read by memory map


def test_sharded_split_reads_as_one_array(tmp_path, recs):
    out = prepare(write_jsonl(tmp_path / "a.jsonl", recs * 3), tmp_path / "o", "bytes", val_fraction=0.05,
                  shard_tokens=4096, workers=2, progress=False)
    m = meta(out)
    train = m["splits"]["train"]
    counts = [s["tokens"] for s in train["shards"]]
    assert len(counts) > 5 and set(counts[:-1]) == {4096} and 0 < counts[-1] <= 4096 and sum(counts) == train["tokens"]
    assert [s["file"] for s in train["shards"]][:2] == ["train-00000.bin", "train-00001.bin"]
    whole = np.concatenate([np.fromfile(out / s["file"], dtype="<u2") for s in train["shards"]])
    for s in train["shards"]:
        assert hashlib.sha256((out / s["file"]).read_bytes()).hexdigest() == s["sha256"]
    tf = open_token_data(out, "train")
    assert len(tf) == len(whole) and tf.tokens.shape == whole.shape and tf.tokens.dtype == whole.dtype
    for a, b in [(0, 10), (4090, 4100), (4096, 8192), (100, 3 * 4096 + 5), (len(whole) - 7, len(whole))]:
        assert np.array_equal(tf.tokens[a:b], whole[a:b])
    assert tf.tokens[4096] == whole[4096] and tf.tokens[-1] == whole[-1]
    ds = WindowDataset(tf, 64, "random", seed=1)
    for k in range(200):
        s = ds.start(k)
        assert np.array_equal(ds[k][0].numpy(), whole[s : s + 64].astype(np.int64))
    assert np.array_equal(np.asarray(tf.tokens), whole)
    import pickle

    again = pickle.loads(pickle.dumps(tf))
    assert isinstance(again, TokenFile) and again._tokens is None and np.array_equal(again.tokens[5000:5010], whole[5000:5010])
    # a damaged or missing shard is named
    raw = bytearray((out / "train-00002.bin").read_bytes())
    raw[10] ^= 1
    (out / "train-00002.bin").write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"train-00002\.bin': sha256 checksum mismatch"):
        open_token_data(out, "train")
    (out / "train-00003.bin").unlink()
    with pytest.raises(DataError, match=r"train-00003\.bin' \(train split .*\) is missing"):
        open_token_data(out, "train", validate="quick")


def test_version_1_folders_stay_readable(tmp_path, recs):
    out = prepare(write_jsonl(tmp_path / "a.jsonl", recs), tmp_path / "o", "bytes", progress=False)
    m = meta(out)
    old = dict(m, version=1, splits={s: {"file": e["shards"][0]["file"], "tokens": e["tokens"],
                                         "sha256": e["shards"][0]["sha256"], "documents": e["documents"]}
                                     for s, e in m["splits"].items()})
    (out / "meta.json").write_text(json.dumps(old))
    assert streams(out)["train"] == np.fromfile(out / "train.bin", dtype="<u2").tolist()


# ----------------------------------------------------------------------------------------------
# Bad input through the CLI: one line, the fix, the existing folder untouched


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _big_vocab_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tokenmill.data.tokenizers import bytes_to_unicode

    vocab = {c: b for b, c in bytes_to_unicode().items()}
    vocab.update({f"w{i}": 256 + i for i in range(70_000)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.save(str(path))
    return path


BAD = {
    "empty-corpus": (lambda d: [str(d / "empty.jsonl")], r"holds only empty files: the corpus is empty"),
    "no-documents": (lambda d: [str(d / "nulls.jsonl")], r"holds no document to tokenize .*record 1: field 'text' is NoneType"),
    "missing-field": (lambda d: [str(d / "body.jsonl")], r"record 1 has no field 'text' \(its fields: \['body', 'id'\]\)"
                      r"\. Fix: pass --text-field"),
    "missing-column": (lambda d: [str(d / "t.parquet"), "--text-field", "content"],
                       r"has no column 'content' \(columns: \['text', 'n'\]\)\. Fix: pass --text-field"),
    "column-not-text": (lambda d: [str(d / "t.parquet"), "--text-field", "n"],
                        r"column 'n' holds int64, not text\. Fix: .*\(here: \['text'\]\)"),
    "json-array": (lambda d: [str(d / "array.json")], r"is one JSON array, not JSON Lines.*jq -c"),
    "vocab-beyond-dtype": (lambda d: [str(d / "a.jsonl"), "--tokenizer-from", str(d / "big.json"), "--dtype", "uint16"],
                           r"--dtype uint16 holds ids below 65,536, but the tokenizer has 70,256 ids\. Fix: --dtype uint32"),
    "no-such-pattern": (lambda d: [str(d / "nope-*.jsonl")], r"matches no file"),
}


@pytest.fixture(scope="module")
def bad_world(tmp_path_factory, recs) -> Path:
    d = tmp_path_factory.mktemp("bad")
    (d / "empty.jsonl").write_bytes(b"")
    (d / "nulls.jsonl").write_text('{"text": null}\n' * 3)
    write_jsonl(d / "body.jsonl", [{"body": r["text"], "id": r["id"]} for r in recs[:5]])
    pq.write_table(pa.table({"text": [r["text"] for r in recs[:5]], "n": list(range(5))}), d / "t.parquet")
    (d / "array.json").write_text(json.dumps([{"text": "a"}, {"text": "b"}], indent=1))
    write_jsonl(d / "a.jsonl", recs[:20])
    _big_vocab_tokenizer(d / "big.json")
    return d


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gives_one_line_with_the_fix_and_keeps_the_folder(case, bad_world, tmp_path, capsys, recs):
    import re

    existing = prepare(write_jsonl(tmp_path / "old.jsonl", recs[:30]), tmp_path / "data", "bytes", progress=False)
    before = _tree(tmp_path)
    args, match = BAD[case]
    rc = main(["prepare", *args(bad_world), "--out", str(existing), "--no-progress", "--workers", "1"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("tokenmill: error:")]
    assert rc == 1 and len(lines) == 1 and re.search(match, lines[0]), err
    assert "Traceback" not in err and _tree(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "old.jsonl"]  # no build folder left


def test_a_shard_that_vanishes_mid_run_stops_cleanly_and_the_rerun_resumes(tmp_path, recs, capsys, monkeypatch):
    prep = importlib.import_module("tokenmill.data.prepare")
    for k in range(4):
        write_jsonl(tmp_path / "in" / f"part-{k}.jsonl", recs[k * 60 : (k + 1) * 60])
    ref = prepare(tmp_path / "in", tmp_path / "ref", "bytes", workers=1, progress=False)
    existing = prepare(tmp_path / "in" / "part-0.jsonl", tmp_path / "data", "bytes", progress=False)
    before = _tree(existing)
    monkeypatch.setattr(prep, "COMMIT_SECONDS", 0.0)
    real_take, gone = prep._Build._take, tmp_path / "in" / "part-3.jsonl"
    saved = gone.read_bytes()

    def take_then_delete(self, piece, enc):
        real_take(self, piece, enc)
        if piece.file == 1 and gone.exists():
            gone.unlink()

    monkeypatch.setattr(prep._Build, "_take", take_then_delete)
    argv = ["prepare", str(tmp_path / "in"), "--out", str(existing), "--tokenizer", "bytes", "--no-progress",
            "--workers", "1"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"input file '{gone}' was listed when prepare started but is gone now" in err and "resumes" in err
    assert _tree(existing) == before  # untouched
    gone.write_bytes(saved)
    monkeypatch.setattr(prep._Build, "_take", real_take)
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "resuming an interrupted prepare at input file 4 of 4" in err
    assert streams(existing) == streams(ref)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_ids_beyond_the_declared_vocabulary_are_refused(tmp_path, recs):
    from tokenmill.data.tokenizers import ByteTokenizer

    class Narrow(ByteTokenizer):  # claims 100 ids, produces byte values up to 255
        vocab_size = 100

    with pytest.raises(DataError, match=r"produced id \d+, but its vocabulary has 100 ids"):
        prepare(write_jsonl(tmp_path / "a.jsonl", recs[:5]), tmp_path / "o", Narrow(), progress=False)
    assert not (tmp_path / "o").exists() and not (tmp_path / ".o.prepare").exists()
