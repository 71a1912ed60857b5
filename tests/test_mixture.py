"""Data mixtures (``data.mixture``): the schedule realises the weights, the stream is a pure function of
(seed, k) whatever the layout or worker count, validation keeps the shares, bad values give one-line
errors, and a mixture of compressed JSON Lines shards and a Parquet file trains and resumes exactly
through the CLI.

The two tiny sources are told apart by their content: one holds only lowercase letters, the other only
digits (byte tokenizer: id = byte), so which source a window came from is read off its tokens, not taken
from the code under test."""

from __future__ import annotations

import gzip
import json
import random
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenmill import config as C
from tokenmill.cli import main
from tokenmill.data import build_datasets, build_train_loader, prepare, val_batches
from tokenmill.data.dataset import global_indices
from tokenmill.data.mixture import MAX_PERIOD, MixtureDataset, parse_mixture, schedule, slot_counts
from tokenmill.errors import ConfigError, DataError, PathError
from tokenmill.train.run_dir import open_run_dir

LETTERS = set(b"abcdefghijklmnopqrstuvwxyz")
DIGITS = set(b"0123456789")


def _texts(alphabet: str, n: int, seed: int) -> list[str]:
    rnd = random.Random(seed)
    return [" ".join("".join(rnd.choice(alphabet) for _ in range(rnd.randint(2, 8))) for _ in range(60))
            for _ in range(n)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two prepared folders with the byte tokenizer: letters and digits."""
    root = tmp_path_factory.mktemp("mix")
    out = {}
    for name, alphabet in (("letters", "abcdefghijklmnopqrstuvwxyz"), ("digits", "0123456789")):
        src = root / f"{name}-text"
        src.mkdir()
        for i, t in enumerate(_texts(alphabet, 12, len(name))):
            (src / f"d{i}.txt").write_text(t)
        out[name] = prepare(src, root / name, "bytes", workers=1, progress=False, val_fraction=0.25)
    return out


def which(x: torch.Tensor) -> int:
    """0 for a letters window, 1 for a digits window (space and newline belong to both)."""
    ids = set(x.tolist()) - {ord(" "), ord("\n")}
    assert ids and (ids <= LETTERS or ids <= DIGITS), ids
    return 0 if ids <= LETTERS else 1


def mix_cfg(folders, spec: str, **over) -> C.Config:
    base = {"data.mixture": spec.format(**folders), "train.device": "cpu", "log.progress": "plain"}
    return C.resolve("tiny", overrides={**base, **over}, overrides_from_string=False)


def test_malformed_values_are_config_errors_naming_the_entry():
    bad = {
        "": "is empty",
        "a:3,b": "entry 'b' is not PATH:WEIGHT",
        "a:": "entry 'a:' is not PATH:WEIGHT",
        ":2": "entry ':2' is not PATH:WEIGHT",
        "a:-1,b:1": "the weight '-1' is negative",
        "a:0,b:1": "the weight '0' is zero",
        "a:nan,b:1": "the weight 'nan' is not a number",
        "a:inf,b:1": "the weight 'inf' is not a number",
        "a:1/0": "the weight '1/0' is not a number",
        "a:2,./a:1": "names the folder './a' twice",
    }
    for spec, message in bad.items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            parse_mixture(spec)
    parsed = parse_mixture(" c:/x/y:3 , rel/b:0.25,z:1/3")  # a path keeps its colons: the weight is after the last
    assert [(s.path, s.weight) for s in parsed] == [("c:/x/y", 3), ("rel/b", Fraction(1, 4)), ("z", Fraction(1, 3))]


@pytest.mark.parametrize("weights", [[3, 1], ["0.7", "0.3"], [1, 1, 1], [1, 2, 5], ["0.123457", "0.3", 1],
                                     ["1e-9", 1]])
def test_schedule_realises_the_weights_in_every_span(weights):
    """Every period holds each source's exact share; every span of n consecutive samples holds n x share
    within 2 samples (checked at every start, n up to 300); with shares that need a period above
    MAX_PERIOD, each is within 1/MAX_PERIOD of its weight's."""
    ws = [Fraction(str(w)) for w in weights]
    period, counts = slot_counts(ws)
    shares = [w / sum(ws) for w in ws]
    if period < MAX_PERIOD:
        assert [Fraction(c, period) for c in counts] == shares
    assert sum(counts) == period and all(abs(Fraction(c, period) - s) <= Fraction(1, MAX_PERIOD)
                                         for c, s in zip(counts, shares))
    src, rank = schedule(counts)
    for i, c in enumerate(counts):
        assert sorted(rank[src == i].tolist()) == list(range(c))  # each position of a source used once
        tiled = np.tile(src, 2 + 300 // period) == i
        run = np.concatenate([[0], np.cumsum(tiled)])
        for n in range(1, 301):
            spans = run[n:n + period] - run[:period]
            assert np.abs(spans - n * c / period).max() < 2, (i, n)


@pytest.mark.slow
def test_stream_is_the_same_for_every_layout_and_worker_count(folders):
    """The global stream (samples 0..47) assembled from each rank's micro-batches equals ds[k] for
    (B, A, D) = (4,1,1), (2,2,1), (1,2,2), (2,1,2), with 0 and 2 DataLoader workers, and a loader started at
    sample 24 (a resume) gives samples 24.. . Each sample's source (read off its tokens) is locate(k)'s."""
    cfg = mix_cfg(folders, "{letters}:3,{digits}:1")
    src = build_datasets(cfg.data, 32, seed=5, with_val=False)
    ds = src.train
    assert isinstance(ds, MixtureDataset) and src.data_dir == folders["letters"]
    want = [ds[k][0] for k in range(48)]
    assert [which(x) for x in want] == [ds.locate(k)[0] for k in range(48)]
    for (b, a, d), workers in [((4, 1, 1), 0), ((2, 2, 1), 2), ((1, 2, 2), 0), ((2, 1, 2), 2)]:
        got: dict[int, torch.Tensor] = {}
        cfg.data.num_workers = workers
        for rank in range(d):
            loader = build_train_loader(ds, cfg.data, b, a, 0, 48 // (b * a * d), rank, d)
            for i, (x, _) in enumerate(loader):
                step, micro = divmod(i, a)
                for row, k in zip(x, global_indices(step, micro, rank, b, a, d)):
                    got[k] = row
        assert sorted(got) == list(range(48))
        assert all(torch.equal(got[k], want[k]) for k in range(48)), (b, a, d, workers)
    cfg.data.num_workers = 0
    resumed = build_train_loader(ds, cfg.data, 4, 1, 6, 12, start_sample=24)
    assert all(torch.equal(r, want[24 + j]) for j, r in enumerate(torch.cat([x for x, _ in resumed])))
    other = build_datasets(cfg.data, 32, seed=6, with_val=False).train  # another seed, another stream
    assert not all(torch.equal(other[k][0], want[k]) for k in range(48))


def test_realised_shares_by_content_and_validation_shares(folders):
    """Over 2,000 samples (weights 3:1 and then 1:2) the share read off the tokens is within 2 samples of the
    weights' and equals samples_per_source; validation draws each source's share of its windows (within
    one), from that source's val split, the same batches on every call."""
    for spec, shares in (("{letters}:3,{digits}:1", (0.75, 0.25)), ("{letters}:1,{digits}:2", (1 / 3, 2 / 3))):
        data = build_datasets(mix_cfg(folders, spec).data, 32, seed=11, with_val=True)
        ds, n = data.train, 2000
        by_content = np.bincount([which(ds[k][0]) for k in range(n)], minlength=2)
        assert by_content.tolist() == ds.samples_per_source(0, n)
        assert all(abs(c - n * s) < 2 for c, s in zip(by_content, shares)), by_content
        batches = val_batches(data.val, 4, 6)
        val_src = [which(x) for xb, _ in batches for x in xb]
        assert all(abs(val_src.count(i) - 24 * s) <= 1 for i, s in enumerate(shares)), val_src
        val_tokens = {i: bytes(np.asarray(data.val.sources[i].token_file.tokens, dtype=np.uint8)) for i in (0, 1)}
        for xb, _ in batches:
            for x in xb:
                assert bytes(x.to(torch.uint8).tolist()) in val_tokens[which(x)]  # a window of that val split
        again = val_batches(data.val, 4, 6)
        assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))


def test_bad_mixtures_are_one_line_errors(folders, tmp_path, capsys):
    """A missing folder and a malformed value through the CLI (exit 1 and 2, one line); different
    tokenizers (both folders named), a mixture with data.path or synthetic data, and a run directory
    inside a mixture folder, each by its message."""
    letters, digits = folders["letters"], folders["digits"]
    run = str(tmp_path / "run")
    for extra, code, message in [
        (f"{letters}:1,{tmp_path / 'nowhere'}:1", 1, "nowhere' does not exist"),
        (f"{letters}=3,{digits}=1", 2, "is not PATH:WEIGHT"),
    ]:
        assert main(["train", "--preset", "tiny", "--train.device", "cpu", "--run-dir", run, "--data.mixture", extra]) == code
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and err.startswith("tokenmill:"), err
    bpe = prepare(Path(letters).parent / "letters-text", tmp_path / "bpe", "bpe", vocab_size=300, workers=1,
                  progress=False)
    cases = [
        ({"data.mixture": f"{letters}:1,{bpe}:1"}, DataError,
         f"'{letters}' (bytes, 256 ids) and '{bpe}' (bpe, 300 ids, end-of-text id 0, tokenizer.json "),
        ({"data.mixture": f"{letters}:1", "data.path": str(digits)}, ConfigError, "data.mixture and data.path are both set"),
        ({"data.mixture": f"{letters}:1", "data.source": "synthetic", "model.vocab_size": 64}, ConfigError,
         "data.source is 'synthetic'"),
    ]
    for over, kind, message in cases:
        with pytest.raises(kind) as e:
            build_datasets(C.resolve("tiny", overrides=over, overrides_from_string=False).data, 32, 0)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(PathError, match=r"data.mixture\[1\]"):
        open_run_dir(Path(digits) / "run", mix_cfg(folders, "{letters}:1,{digits}:1"))


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.slow
def test_cli_prepare_mix_train_and_resume_exactly(tmp_path, monkeypatch, capsys):
    """prepare .jsonl.gz shards (BPE) and a Parquet file (the same tokenizer), mix them 3:1, train 6 steps with
    document masking; 3 steps then --resume to 6 give the same losses and val loss; config.toml records absolute folders, the
    log records the realised shares, summary.json the per-source counts."""
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (pip install 'tokenmill[corpora]')")
    pq = pytest.importorskip("pyarrow.parquet")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shards").mkdir()
    texts = _texts("abcdefghij", 90, 1)
    for k in range(3):
        lines = "".join(json.dumps({"text": t}) + "\n" for t in texts[k * 30:(k + 1) * 30])
        (tmp_path / "shards" / f"part-{k}.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    pq.write_table(pa.table({"content": _texts("klmnopqrst", 40, 2)}), tmp_path / "web.parquet", row_group_size=10)
    assert main(["prepare", "shards", "--out", "data/shards", "--tokenizer", "bpe", "--vocab-size", "300",
                 "--no-progress"]) == 0
    assert main(["prepare", "web.parquet", "--text-field", "content", "--out", "data/web", "--tokenizer-from",
                 "data/shards", "--no-progress"]) == 0
    common = ["train", "--preset", "tiny", "--train.device", "cpu", "--log.progress", "plain", "--log.every_steps", "1",
              "--data.mixture", "data/shards:3,data/web:1", "--optim.decay_steps", "6", "--train.eval_batches", "2",
              "--data.document_mask", "true"]
    assert main([*common, "--run-dir", "full", "--train.max_steps", "6"]) == 0
    assert "data mixture: shards 75.0% (weight 3), web 25.0% (weight 1)" in capsys.readouterr().out
    assert main([*common, "--run-dir", "cut", "--train.max_steps", "3"]) == 0
    assert main([*common, "--run-dir", "cut", "--train.max_steps", "6", "--resume"]) == 0
    full, cut = _losses(tmp_path / "full"), _losses(tmp_path / "cut")
    assert list(full) == list(range(1, 7)) and cut == full  # bit-exact on CPU
    s_full, s_cut = (json.loads((tmp_path / r / "summary.json").read_text()) for r in ("full", "cut"))
    assert s_cut["val_loss"] == s_full["val_loss"]
    mix = {m["source"]: m for m in s_cut["mixture"]}
    assert mix["shards"]["samples"] + mix["web"]["samples"] == 6 * 4
    assert mix["shards"]["samples"] == 18 and mix["shards"]["target_share"] == 0.75  # 24 samples: 6 periods of 4
    rows = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    last = next(r for r in rows if r.get("step") == 6 and "loss" in r)
    assert last["mix_share/shards"] == 0.75 and last["mix_share/web"] == 0.25
    recorded = C.load_toml(tmp_path / "cut" / "config.toml")["data"]["mixture"]
    assert recorded == f"{tmp_path / 'data' / 'shards'}:3,{tmp_path / 'data' / 'web'}:1"
    assert (tmp_path / "cut" / "tokenizer" / "tokenizer.json").is_file()
    # the same folders named relatively on resume are no change; other weights are allowed and said, with the
    # flag that keeps the checkpoint's mixture
    assert "data.mixture changed" not in capsys.readouterr().out
    other = [*common[:10], "data/shards:1,data/web:1", *common[11:]]
    assert main([*other, "--run-dir", "cut", "--train.max_steps", "7", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "data.mixture changed from" in out and "--data.mixture data/shards:3,data/web:1 " in out, out
