"""Trust, second pass (issue 20, items 3, 5 and 6), through the real command line in this process:

- sizes: an absurd shape (on the command line, in a Hugging Face config.json, recorded in a run) stops in
  well under a second with its numbers, by one check (``config/size.py``) for every command;
- paths and names: non-UTF-8 names, bad globs and counts are refused with one line; ``~`` and ``$VAR`` are
  expanded in every path field; a ladder's name never leaves its folder;
- resume: the message names every field that changed (shape, vocabulary, optimizer groups) and the flags
  that fix it, and those flags do fix it; a damaged tokenizer copy names the fix that works.
"""

import dataclasses
import hashlib
import itertools
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import torch

from conftest import tiny_cfg
from tokenmill import config as C
from tokenmill.cli import main
from tokenmill.config.size import MAX_PARAMS, check_size, param_count
from tokenmill.model.build import count_params

COMMON = ["--log.progress", "plain", "--log.tensorboard", "false", "--train.device", "cpu",
          "--train.eval_batches", "0", "--train.precision", "fp32"]


def cli(argv, capsys) -> tuple[int, str]:
    """``tokenmill ARGV`` in this process: (exit code, stdout + stderr); a traceback fails the test."""
    capsys.readouterr()
    try:
        rc = main([os.fsdecode(a) if isinstance(a, bytes) else str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    except BaseException as e:  # noqa: BLE001 - exactly what must never happen
        pytest.fail(f"tokenmill {argv} raised {type(e).__name__}: {e}\n{capsys.readouterr().err[-2000:]}")
    out = capsys.readouterr()
    return rc, out.out + out.err


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def error_line(out: str) -> str:
    """The one error line of a refused command (and nothing that looks like a traceback)."""
    assert "Traceback" not in out, out
    lines = [x for x in out.splitlines() if x.startswith("tokenmill: ") and "error" in x.split(":")[1]]
    assert len(lines) == 1, out
    return lines[0]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Two prepared folders (bytes: 256 ids; a BPE of at most 300) and a run of 2 steps on the first."""
    d = tmp_path_factory.mktemp("second")
    (d / "text").mkdir()
    (d / "text" / "a.txt").write_text("the cat sat on the mat and the dog ate the bone. " * 200)
    assert main(["prepare", str(d / "text"), "--out", str(d / "bytes"), "--tokenizer", "bytes", "--no-progress"]) == 0
    assert main(["prepare", str(d / "text"), "--out", str(d / "bpe"), "--tokenizer", "bpe", "--vocab-size", "300",
                 "--no-progress"]) == 0
    assert main(["train", "--preset", "tiny", "--data.path", str(d / "bytes"), "--run-dir", str(d / "run"),
                 "--train.max_steps", "2", *COMMON]) == 0
    return d


# ------------------------------------------------------------------------------------------------
# 3. sizes checked before any work


ABSURD = {
    "depth": (["--model.n_layer", 10**9], ["model.n_layer 1,000,000,000", "at most 10,000"]),
    "width": (["--model.n_embd", 2**40], ["n_embd 1,099,511,627,776", "parameters, more than 100,000,000,000,000"]),
    "vocabulary": (["--model.vocab_size", 10**12], ["1,000,000,000,000 ids", "at most 4,294,967,296"]),
    "micro-batch": (["--train.batch_size", 10**8], ["= 3,200,000,000 tokens", "at most 2,147,483,648"]),
    "attention scores": (["--model.attention", "manual", "--model.block_size", 10**7],
                         ["attention scores", "2.8 PiB", "block_size 10,000,000"]),
}


@pytest.mark.parametrize("what", list(ABSURD))
def test_an_absurd_size_on_the_command_line_stops_at_once_in_estimate(what, capsys):
    flags, words = ABSURD[what]
    t0 = time.process_time()
    rc, out = cli(["estimate", "--preset", "tiny", *flags], capsys)
    assert time.process_time() - t0 < 5  # the depth ran for minutes, the width was a traceback
    line = error_line(out)
    assert rc == 2 and line.startswith("tokenmill: config error:") and all(w in line for w in words), out


@pytest.mark.parametrize("command", [
    ["train", "--run-dir", "RUN", *COMMON], ["bench", "max-batch", "--run-dir", "RUN"],
    ["bench", "max-model", "--run-dir", "RUN"], ["profile", "--run-dir", "RUN"], ["config"],
])
def test_every_command_takes_the_same_size_check(command, tmp_path, capsys):
    argv = [str(tmp_path / "out") if a == "RUN" else a for a in command]
    t0 = time.process_time()
    rc, out = cli([*argv, "--preset", "tiny", "--model.n_layer", 10**9], capsys)
    assert time.process_time() - t0 < 5
    assert rc == 2 and "model.n_layer 1,000,000,000 is absurd" in error_line(out)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_the_count_is_the_model_count_and_the_limits_refuse_only_absurd_shapes():
    """The arithmetic count equals the count of the model built on meta, for every preset and family form;
    every shipped preset and the largest published shapes pass."""
    for name in C.preset_names():
        cfg = C.resolve(name)
        for vocab in (61, 50257):
            assert param_count(cfg.model, vocab) == count_params(cfg.model, vocab), name
    base = tiny_cfg().model
    llama = dataclasses.replace(base, norm_type="rmsnorm", mlp="swiglu", pos_emb="rope", bias=False, qkv_bias=False,
                                n_kv_head=1, intermediate_size=48)
    forms = [{}, {"bias": False}, {"qkv_bias": False}, {"tie_embeddings": False}, {"vocab_pad_multiple": 64},
             {"head_dim": 8}, {"qk_norm": True}, {"n_kv_head": 1}, {"intermediate_size": 40}]
    for b, form in itertools.product((base, llama), forms):
        m = dataclasses.replace(b, **form)
        assert param_count(m, 61) == count_params(m, 61), m
    big = C.resolve("llama3.1-8b").model  # 405B: 126 layers of 16,384, a 128k vocabulary, 128k context
    big = dataclasses.replace(big, n_layer=126, n_embd=16384, n_head=128, n_kv_head=8, intermediate_size=53248,
                              block_size=131072, vocab_size=128256)
    check_size(big, batch_size=1)
    assert 4.0e11 < param_count(big, 128256) < 4.1e11 < MAX_PARAMS


@pytest.mark.slow
def test_an_absurd_hugging_face_config_stops_before_any_weight(world, tmp_path, capsys):
    assert cli(["export", "--run-dir", world / "run", "--out", tmp_path / "hf"], capsys)[0] == 0
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**conf, "n_layer": 10**9}))
    before = tree(tmp_path)
    t0 = time.process_time()
    rc, out = cli(["train", "--preset", "tiny", "--data.path", world / "bytes", "--run-dir", tmp_path / "ft",
                   "--train.init_from", tmp_path / "hf", "--train.max_steps", 1, *COMMON], capsys)
    assert time.process_time() - t0 < 5
    line = error_line(out)
    assert rc == 2 and "train.init_from the Hugging Face GPT2LMHeadModel folder" in line, out
    assert "model.n_layer 1,000,000,000 is absurd" in line and tree(tmp_path) == before


@pytest.mark.slow
def test_an_absurd_data_vocabulary_stops_the_estimate(world, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(world / "bytes", data)
    meta = json.loads((data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps({**meta, "vocab_size": 10**12, "dtype": "uint32"}))
    before = tree(tmp_path)
    rc, out = cli(["estimate", "--preset", "tiny", "--data.path", data], capsys)
    line = error_line(out)
    assert rc == 2 and f"1,000,000,000,000 ids (from {data / 'meta.json'}) is absurd" in line, out
    assert tree(tmp_path) == before


@pytest.mark.slow
def test_an_absurd_recorded_config_stops_sample_before_building(world, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(world / "run", run)
    path = sorted((run / "checkpoints").glob("step_*.pt"))[-1]
    state = torch.load(path, weights_only=True)
    state["config"]["model"]["n_embd"] = 2**40
    torch.save(state, path)
    before = tree(run)
    t0 = time.process_time()
    rc, out = cli(["sample", "--run-dir", run, "--max-new-tokens", 2], capsys)
    assert time.process_time() - t0 < 5
    line = error_line(out)
    assert rc == 1 and str(path) in line and "n_embd 1,099,511,627,776" in line and "is absurd" in line
    assert "more than 100,000,000,000,000" in line and tree(run) == before


@pytest.mark.slow
def test_an_absurd_recorded_config_is_named_by_the_doctor_and_refused_by_try(world, tmp_path, capsys):
    """``doctor RUN`` reads the metrics of a run whose config.toml records an absurd depth: it warns with
    the numbers, does not offer ``--try``, and ``--try`` stops before any run (not 2 x N failed runs)."""
    run = tmp_path / "run"
    shutil.copytree(world / "run", run)
    cfg = run / "config.toml"
    cfg.write_text(re.sub(r"(?m)^n_layer = \d+$", "n_layer = 1000000000", cfg.read_text()))
    assert "n_layer = 1000000000" in cfg.read_text()
    rc, out = cli(["doctor", run], capsys)
    warning = [x for x in out.splitlines() if x.startswith("tokenmill: warning: config.toml does not load")]
    assert rc == 0 and len(warning) == 1 and "model.n_layer 1,000,000,000 is absurd" in warning[0], out
    assert "step " in out and "--try 2" not in out
    before = tree(run)
    t0 = time.process_time()
    rc, out = cli(["doctor", run, "--try", 1, "--try-steps", 2, "--try-repeats", 1], capsys)
    line = error_line(out)
    assert rc == 1 and "--try trains the run's config" in line and "1,000,000,000 is absurd" in line, out
    assert time.process_time() - t0 < 5 and tree(run) == before


# ------------------------------------------------------------------------------------------------
# 5. paths and names


@pytest.mark.parametrize("case, words", [
    ("folder", ["input b'/", "/text\\xff' is not valid UTF-8"]),
    ("file-in-folder", ["input file b'/", "/a\\xfe.txt' is not valid UTF-8"]),
    ("out", ["--out b'/", "/out\\xff' is not valid UTF-8"]),
])
def test_non_utf8_names_are_refused_before_anything_is_written(case, words, tmp_path, capsys):
    raw = os.fsencode(tmp_path)
    src = raw + b"/text\xff" if case == "folder" else raw + b"/text"
    os.makedirs(src)
    with open(src + (b"/a\xfe.txt" if case == "file-in-folder" else b"/a.txt"), "w") as f:
        f.write("hello there " * 50)
    out = raw + (b"/out\xff" if case == "out" else b"/out")
    before = tree(tmp_path)
    rc, text = cli(["prepare", src, "--out", out, "--tokenizer", "bytes", "--no-progress"], capsys)
    line = error_line(text)
    assert rc == 1 and all(w in line for w in words) and "Rename it" in line, text
    assert tree(tmp_path) == before


@pytest.mark.parametrize("flags, words", [
    (["--glob", "ABS/*.txt"], "is an absolute path"),
    (["--glob", ""], "--glob is empty"),
    (["--glob", "../*.txt"], "climbs out of the input folder"),
    (["--max-files", "-1"], "--max-files must be >= 1"),
    (["--max-files", "0"], "--max-files must be >= 1"),
])
def test_bad_globs_and_counts_are_refused(flags, words, tmp_path, capsys):
    (tmp_path / "text").mkdir()
    for n in "ab":
        (tmp_path / "text" / f"{n}.txt").write_text("hello there " * 50)
    flags = [f.replace("ABS", str(tmp_path / "text")) for f in flags]
    before = tree(tmp_path)
    rc, out = cli(["prepare", tmp_path / "text", "--out", tmp_path / "out", "--tokenizer", "bytes", *flags], capsys)
    assert rc == 1 and words in error_line(out) and tree(tmp_path) == before


def test_home_and_variables_are_expanded_in_every_path_field(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TM_DATA", str(tmp_path / "d"))
    (tmp_path / "c.toml").write_text('[data]\ncache_dir = "~/cache"\n')
    rc, out = cli(["config", "--preset", "tiny", "--config", tmp_path / "c.toml", "--data.path", "$TM_DATA/x",
                   "--train.init_from", "${TM_DATA}/src"], capsys)
    got = C.tomllib.loads(out.split("\n", 1)[1] if out.startswith("#") else out)
    assert rc == 0 and got["data"]["path"] == f"{tmp_path}/d/x" and got["data"]["cache_dir"] == f"{tmp_path}/cache"
    assert got["train"]["init_from"] == f"{tmp_path}/d/src"
    rc, out = cli(["config", "--preset", "tiny", "--data.mixture", "~/a:1,$TM_DATA/b:2"], capsys)
    assert rc == 0 and C.tomllib.loads(out)["data"]["mixture"] == f"{tmp_path}/a:1,{tmp_path}/d/b:2"
    monkeypatch.delenv("TM_UNSET_356", raising=False)
    rc, out = cli(["config", "--preset", "tiny", "--data.path", "$TM_UNSET_356/x"], capsys)
    assert rc == 2 and "data.path '$TM_UNSET_356/x' names the environment variable $TM_UNSET_356, which is not " \
                       "set" in error_line(out)


@pytest.mark.parametrize("where, name", [("ladder", "../../escape"), ("ladder", "a/b"), ("rung", "..")])
def test_a_ladder_name_never_leaves_its_folder(where, name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ladder, rung = (name, "base") if where == "ladder" else ("mine", name)
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "l.toml").write_text(f'[ladder]\nname = "{ladder}"\ndescription = "d"\nbase_preset = '
                                              f'"tiny"\n\n[[rung]]\nname = "{rung}"\nexplain = "e"\n')
    monkeypatch.chdir(tmp_path / "work")
    before = tree(tmp_path)
    rc, out = cli(["bench", "ladder", "l.toml", "--smoke"], capsys)
    line = error_line(out)
    assert rc == 2 and (f"'{name}' cannot be used as a file name" in line or "a rung name may hold only" in line)
    assert tree(tmp_path) == before


# ------------------------------------------------------------------------------------------------
# 6. resume messages


def resume(run: Path, data: Path, capsys, *extra) -> tuple[int, str]:
    return cli(["train", "--preset", "tiny", "--data.path", data, "--run-dir", run, "--train.max_steps", 3,
                "--resume", *COMMON, *extra], capsys)


@pytest.mark.slow
def test_a_changed_data_vocabulary_is_named_with_the_folder_that_fixes_it(world, capsys):
    before = tree(world / "run")
    rc, out = resume(world / "run", world / "bpe", capsys)
    line = error_line(out)
    now = json.loads((world / "bpe" / "meta.json").read_text())["vocab_size"]  # <= 300: the merges it found
    assert rc == 1 and f"the vocabulary of data.path {world / 'bpe'}: checkpoint 256 vs now {now}" in line, out
    assert f"--data.path {world / 'bytes'}" in line and tree(world / "run") == before


@pytest.mark.slow
def test_every_changed_field_is_named_and_the_named_flags_fix_it(world, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(world / "run", run)
    before = tree(run)
    rc, out = resume(run, world / "bytes", capsys, "--model.n_layer", 3, "--optim.decay_groups", "false",
                     "--optim.name", "muon")
    line = error_line(out)
    for change in ("model.n_layer: checkpoint 2 vs now 3", "optim.decay_groups: checkpoint True vs now False",
                   "optim.name: checkpoint 'adamw' vs now 'muon'"):
        assert change in line, line
    fix = line.split("checkpoint's values (")[1].split(")")[0].split()
    assert fix == ["--model.n_layer", "2", "--optim.name", "adamw", "--optim.decay_groups", "true"]
    assert rc == 1 and tree(run) == before
    rc, out = resume(run, world / "bytes", capsys, "--model.n_layer", 3, "--optim.decay_groups", "false",
                     "--optim.name", "muon", *fix, "--train.precision", "bf16-autocast")
    assert rc == 0 and "resumed from" in out and "step      3" in out, out
    assert "train.precision changed from 'fp32' to 'bf16-autocast'" in out  # allowed, and said


@pytest.mark.slow
def test_a_damaged_tokenizer_copy_names_the_fix_that_works(world, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(world / "run", run)
    (run / "tokenizer" / "meta.json").write_text("garbage{")
    before = tree(run)
    rc, out = cli(["sample", "--run-dir", run, "--max-new-tokens", 2], capsys)
    line = error_line(out)
    assert rc == 1 and f"the run's tokenizer copy {run / 'tokenizer'} is damaged" in line, out
    assert f"rm -r {run / 'tokenizer'}" in line and "prepare" not in line and tree(run) == before
    shutil.rmtree(run / "tokenizer")  # the fix it names
    assert cli(["sample", "--run-dir", run, "--max-new-tokens", 2], capsys)[0] == 0
