"""Trust (issue 11): no input, fault or file makes tokenmill crash, lose data or run foreign code.

Everything goes through the real command line: ``tokenmill.cli.main(argv)`` in this process (fast), and
subprocesses where the behaviour needs one (kill -9, two concurrent runs, a file-size limit, a user
without the right to write). Each bad input must end with exit code != 0, a message naming the problem,
no traceback, and every file that existed before unchanged (the tree is hashed before and after).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import cpu_env, tiny_cfg
from tokenmill import config as C
from tokenmill.cli import build_parser, main
from tokenmill.errors import TrainingError

# ----------------------------------------------------------------------------------------------
# helpers

STEPS = 2  # the shared runs hold checkpoints step 1 and step 2
COMMON = ["--log.progress", "plain", "--log.tensorboard", "false", "--train.device", "cpu"]
SYNTH = ["train", "--preset", "tiny", "--data.source", "synthetic", "--model.vocab_size", "64",
         "--train.max_steps", "1", *COMMON]


def on_data(path, *extra) -> list:
    """A one-step training of the tiny model on the data folder ``path``."""
    return ["train", "--preset", "tiny", "--data.path", path, "--train.max_steps", 1, *COMMON, *extra]


def cli(argv: list[str], capsys) -> tuple[int, str]:
    """Run ``tokenmill ARGV`` in this process; (exit code, stdout + stderr). An exception escaping
    ``main`` (a traceback for the user) fails the test."""
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's own usage errors
        rc = e.code
    except BaseException as e:  # noqa: BLE001 - exactly what must never happen
        out = capsys.readouterr()
        pytest.fail(f"tokenmill {' '.join(map(str, argv))} raised {type(e).__name__}: {e}\n{out.err[-2000:]}")
    out = capsys.readouterr()
    return rc, out.out + out.err


def tree(root: Path) -> dict[str, str]:
    """Every file and folder under ``root``: relative path -> sha256 (or 'dir' / 'link')."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "link"
            elif p.is_dir():
                out[rel] = "dir"
            else:
                try:
                    out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
                except PermissionError:  # a test made it unreadable (not root): its metadata stands in
                    st = p.stat()
                    out[rel] = f"unreadable {st.st_size} {st.st_mtime_ns} {st.st_mode:o}"
    return out


def assert_unchanged(before: dict[str, str], root: Path) -> None:
    after = tree(root)
    changed = [k for k, v in before.items() if after.get(k) != v]
    assert not changed, f"files changed or removed: {changed}"


def write_text_corpus(path: Path, n_lines: int = 400) -> Path:
    words = ("the quick brown fox jumps over a lazy dog while tokens flow through the mill "
             "and every step is checked twice before it is written").split()
    lines = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(n_lines)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def text_train(data: Path, run: Path, steps: int = STEPS, *extra) -> list[str]:
    return ["train", "--preset", "tiny", "--data.path", data, "--run-dir", run, "--train.max_steps", steps,
            "--checkpoint.every_steps", 1, "--checkpoint.keep_last", 5, "--train.eval_batches", 1, *COMMON,
            *extra]


def checkpoints(run: Path) -> list[Path]:
    return sorted((run / "checkpoints").glob("step_*"))


class Payload:
    """Unpickling this creates ``marker`` (stands for any code an attacker would run)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@contextlib.contextmanager
def permissions_enforced():
    """File permissions as an ordinary user meets them. Root ignores them (CAP_DAC_OVERRIDE), so as root
    this thread drops that capability (and CAP_DAC_READ_SEARCH) for the duration and takes it back after;
    skips where that is impossible."""
    if os.geteuid() != 0:
        yield
        return
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    version_3 = 0x20080522
    data = (Data * 2)()
    if not hasattr(libc, "capset") or libc.capget(ctypes.byref(Header(version_3, 0)), data) != 0:
        pytest.skip("running as root and cannot drop CAP_DAC_OVERRIDE: permissions are not enforced here")
    saved = [(d.effective, d.permitted, d.inheritable) for d in data]
    data[0].effective &= ~((1 << 1) | (1 << 2))  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
    if libc.capset(ctypes.byref(Header(version_3, 0)), data) != 0:
        pytest.skip("running as root and cannot drop CAP_DAC_OVERRIDE: permissions are not enforced here")
    try:
        yield
    finally:
        for d, (eff, perm, inh) in zip(data, saved):
            d.effective, d.permitted, d.inheritable = eff, perm, inh
        assert libc.capset(ctypes.byref(Header(version_3, 0)), data) == 0


# ----------------------------------------------------------------------------------------------
# shared runs (built once per module, copied per test)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A prepared data folder, a run trained on it (checkpoints step 1 and 2) and a synthetic run."""
    root = tmp_path_factory.mktemp("trust-base")
    text = write_text_corpus(root / "corpus.txt")
    assert main(["prepare", str(text), "--out", str(root / "data"), "--tokenizer", "bytes", "--workers", "1",
                 "--no-progress"]) == 0
    assert main([str(a) for a in text_train(root / "data", root / "run")]) == 0
    assert main([*SYNTH, "--run-dir", str(root / "synth")]) == 0
    return root


@dataclass
class Env:
    """Fresh copies of the shared runs in a test's own folder, made on first use."""

    tmp: Path
    base: Path

    def _copy(self, name: str) -> Path:
        dst = self.tmp / name
        if not dst.exists():
            shutil.copytree(self.base / name, dst, symlinks=True)
        return dst

    @property
    def data(self) -> Path:
        return self._copy("data")

    @property
    def run(self) -> Path:
        """The text run; its config.toml points at this test's copy of the data."""
        run, data = self._copy("run"), self.data
        cfg = (run / "config.toml").read_text()
        (run / "config.toml").write_text(cfg.replace(str(self.base / "data"), str(data)))
        return run

    @property
    def synth(self) -> Path:
        return self._copy("synth")

    def file(self, name: str, content: bytes | str = b"x") -> Path:
        p = self.tmp / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content.encode() if isinstance(content, str) else content)
        return p

    def data_with(self, edit: Callable[[Path], None]) -> Path:
        d = self.tmp / "data-edited"
        if not d.exists():
            shutil.copytree(self.base / "data", d)
        edit(d)
        return d


@pytest.fixture
def env(base, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return Env(tmp_path, base)


# ----------------------------------------------------------------------------------------------
# 1. Bad inputs: at least 40, each through the real CLI


def _meta_edit(**changes):
    def edit(d: Path) -> None:
        meta = json.loads((d / "meta.json").read_text())
        meta.update(changes)
        (d / "meta.json").write_text(json.dumps(meta))
    return edit


def _unavailable_device() -> str:
    if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        return "mps"
    if not torch.cuda.is_available():
        return "cuda"
    pytest.skip("both CUDA and MPS are available here")


def _retoken(f: Path) -> None:
    """Change the first token into another valid id (only the checksum can tell)."""
    b = bytearray(f.read_bytes())
    b[0], b[1] = (b[0] + 1) % 200, 0
    f.write_bytes(bytes(b))


def _garbage_checkpoints(kind: str):
    def setup(e: Env) -> list:
        run = e.run
        for p in checkpoints(run):
            data = p.read_bytes()
            p.write_bytes({"empty": b"", "garbage": os.urandom(4096), "truncated": data[: len(data) // 2]}[kind])
        return ["train", "--resume", "--run-dir", run, "--train.max_steps", 4]
    return setup


def _payload_only(e: Env) -> list:
    run = e.run
    for p in checkpoints(run):
        p.unlink()
    torch.save({"step": 1, "model": {}, "x": Payload(e.tmp / "PWNED")}, run / "checkpoints" / "step_00000001.pt")
    return ["train", "--resume", "--run-dir", run, "--train.max_steps", 4]


def _only_dcp(damage: Callable[[Path], None]):
    def setup(e: Env) -> list:
        run = e.run
        folder = run / "checkpoints" / f"step_{PLANTED_STEP:08d}.dcp"
        _write_dcp(run, folder)
        for p in checkpoints(run):
            if p != folder:
                p.unlink()
        damage(folder)
        return ["train", "--resume", "--run-dir", run, "--train.max_steps", PLANTED_STEP + 1]
    return setup


def _moved_data(e: Env) -> list:
    run = e.run
    shutil.move(str(e.data), str(e.tmp / "data-moved"))
    return ["train", "--resume", "--run-dir", run, "--train.max_steps", 4]


def _prepare_into_existing(e: Env) -> list:
    bad = e.file("latin1.txt", "caf\xe9 cr\xe8me\n".encode("latin-1") * 50)
    return ["prepare", bad, "--out", e.data, "--tokenizer", "bytes", "--workers", 1, "--no-progress"]


def _sample_truncated(e: Env) -> list:
    run = e.run
    for p in checkpoints(run):
        p.write_bytes(p.read_bytes()[:1000])
    return ["sample", "--run-dir", run]


def _garbage_metrics(e: Env) -> list:
    run = e.run
    (run / "metrics.jsonl").write_bytes(os.urandom(2000))
    return ["doctor", run]


def _read_only(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o555)
    return path


def _unreadable(path: Path) -> Path:
    path.chmod(0)
    return path


# cases that need file permissions enforced (run under permissions_enforced())
PERMISSION_CASES = {"run-dir-not-writable", "config-unreadable", "data-unreadable", "prepare-out-not-writable"}

BAD_INPUTS: list[tuple[str, Callable[[Env], list], str]] = [
    # -- config values (class 6; every numeric field is walked by the next test)
    ("batch-size-0", lambda e: [*SYNTH, "--train.batch_size", 0], r"train\.batch_size must be >= 1, got 0"),
    ("negative-lr", lambda e: [*SYNTH, "--optim.lr", -1], r"optim\.lr must be >= 0"),
    ("beta1-1.5", lambda e: [*SYNTH, "--optim.beta1", 1.5], r"optim\.beta1 must be"),
    ("negative-init-std", lambda e: [*SYNTH, "--model.init_std", -0.02], r"model\.init_std must be > 0"),
    ("prefetch-factor-0", lambda e: [*SYNTH, "--data.prefetch_factor", 0], r"data\.prefetch_factor must be"),
    ("negative-eval-batches", lambda e: [*SYNTH, "--train.eval_batches", -1], r"train\.eval_batches must be"),
    ("negative-ckpt-interval", lambda e: [*SYNTH, "--checkpoint.every_steps", -5], r"checkpoint\.every_steps"),
    ("lr-nan", lambda e: [*SYNTH, "--optim.lr", "nan"], r"optim\.lr must be a finite number"),
    ("lr-inf", lambda e: [*SYNTH, "--optim.lr", "inf"], r"optim\.lr must be a finite number"),
    ("seed-beyond-64-bit", lambda e: [*SYNTH, "--train.seed", 10**23], r"train\.seed"),
    ("train-unavailable-device", lambda e: [*SYNTH, "--train.device", _unavailable_device()],
     r"--train\.device (mps|cuda): .* is not available|no CUDA GPU is visible"),
    ("train-not-a-device", lambda e: [*SYNTH, "--train.device", "tpu"], r"train\.device: 'tpu' is not one of"),
    ("n-embd-not-divisible", lambda e: [*SYNTH, "--model.n_embd", 30, "--model.n_head", 4], r"divisible"),
    ("misspelt-key", lambda e: [*SYNTH, "--train.batchsize", 4], r"Did you mean 'train\.batch_size'"),
    ("unknown-preset", lambda e: ["train", "--preset", "tinny"], r"unknown preset 'tinny'.*Did you mean"),
    ("not-an-integer", lambda e: [*SYNTH, "--train.max_steps", "abc"], r"train\.max_steps: expected an integer"),
    ("not-a-choice", lambda e: [*SYNTH, "--model.attention", "flashy"], r"model\.attention: 'flashy' is not one"),
    ("absurd-vocab", lambda e: [*SYNTH, "--model.vocab_size", 10**12],  # config/size.py check_size
     r"vocabulary of 1,000,000,000,000 ids.*at most 4,294,967,296.*--model\.vocab_size"),
    ("absurd-width", lambda e: [*SYNTH, "--model.n_embd", 10**7, "--model.n_head", 1],
     r"n_embd 10,000,000.*is absurd: 2,400,001,240,000,000 parameters, more than 100,000,000,000,000"),
    # -- config files
    ("config-missing", lambda e: [*SYNTH, "--config", "nope.toml"], r"config file 'nope\.toml' does not exist"),
    ("config-not-utf8", lambda e: [*SYNTH, "--config", e.file("c.toml", b"[train]\n# caf\xe9\nseed = 1\n")],
     r"not UTF-8"),
    ("config-not-toml", lambda e: [*SYNTH, "--config", e.file("c.toml", "[train\nseed = = 1")], r"not valid TOML"),
    ("config-is-a-folder", lambda e: [*SYNTH, "--config", e.tmp], r"is a folder"),
    ("config-bad-value", lambda e: [*SYNTH, "--config", e.file("c.toml", '[train]\nbatch_size = "x"\n')],
     r"train\.batch_size: expected an integer"),
    ("config-unknown-section", lambda e: [*SYNTH, "--config", e.file("c.toml", "[trian]\nseed = 1\n")],
     r"unknown config section '\[trian\]'.*Did you mean"),
    # -- data folders (bad or hostile files)
    ("data-missing", lambda e: on_data(e.tmp / "nodata"), r"does not exist"),
    ("data-is-a-file", lambda e: on_data(e.file("f.bin")), r"is a file"),
    ("data-without-meta", lambda e: on_data(e.data_with(lambda d: (d / "meta.json").unlink())), r"meta\.json' is missing"),
    ("data-garbage-meta", lambda e: on_data(e.data_with(lambda d: (d / "meta.json").write_bytes(os.urandom(300)))), r"meta\.json' is not valid JSON"),
    ("data-foreign-format", lambda e: on_data(e.data_with(_meta_edit(format="other"))), r"not a tokenmill token folder"),
    ("data-truncated-bin", lambda e: on_data(e.data_with(
        lambda d: os.truncate(d / "train.bin", (d / "train.bin").stat().st_size - 3))), r"truncated"),
    ("data-tampered-bin", lambda e: on_data(e.data_with(lambda d: _retoken(d / "train.bin"))),
     r"sha256 checksum mismatch"),
    ("data-file-outside-folder", lambda e: on_data(e.data_with(lambda d: _meta_edit(
        splits={"train": {"file": "../corpus.txt", "tokens": 10, "sha256": "0"}})(d))),
     r"names the file '\.\./corpus\.txt'; it must be a file name inside the folder"),
    ("data-vocab-too-big", lambda e: on_data(e.data, "--model.vocab_size", 10),
     r"vocab_size 2\d\d .*model\.vocab_size is 10"),
    # -- run directories and resume (classes 3, 4, 5)
    ("run-dir-is-a-file", lambda e: [*SYNTH, "--run-dir", e.file("runfile")], r"exists and is not a folder"),
    ("run-dir-under-a-file", lambda e: [*SYNTH, "--run-dir", e.file("runfile") / "sub"],
     r"runfile.*a file stands where a folder is needed"),
    ("train-over-checkpoints", lambda e: [*SYNTH, "--run-dir", e.synth], r"already holds checkpoints.*--resume"),
    ("resume-missing-dir", lambda e: ["train", "--resume", "--run-dir", e.tmp / "nothere"],
     r"there is no run directory"),
    ("resume-misspelt-dir", lambda e: (e.run, ["train", "--resume", "--run-dir", e.tmp / "rnu"])[1],
     r"Did you mean .*run\?"),
    ("resume-nothing-to-resume", lambda e: ["train", "--resume", "--run-dir", (e.tmp / "empty").mkdir() or
                                            e.tmp / "empty", *SYNTH[1:]], r"no checkpoint to resume from"),
    ("resume-without-run-dir", lambda e: ["train", "--resume"], r"--resume needs --run-dir"),
    ("resume-changed-shape", lambda e: ["train", "--resume", "--run-dir", e.run, "--model.n_embd", 64,
                                        "--train.max_steps", 4],
     r"cannot resume: .*model\.n_embd: checkpoint 32 vs now 64.*--model\.n_embd 32"),
    ("resume-empty-checkpoints", _garbage_checkpoints("empty"), r"no checkpoint of .* could be loaded.*step_0000000"),
    ("resume-garbage-checkpoints", _garbage_checkpoints("garbage"), r"step_00000002\.pt is damaged"),
    ("resume-truncated-checkpoints", _garbage_checkpoints("truncated"), r"step_00000002\.pt is damaged"),
    ("resume-damaged-dcp-metadata", _only_dcp(lambda f: (f / ".metadata").write_bytes(os.urandom(500))),
     r"step_00000005\.dcp/\.metadata is damaged"),
    ("resume-dcp-missing-shard", _only_dcp(lambda f: (f / "__0_0.distcp").unlink()),
     r"checkpoint .*step_00000005\.dcp could not be read"),
    ("resume-refused-checkpoint", _payload_only, r"refused to load .*step_00000001\.pt"),
    ("resume-config-not-utf8", lambda e: (lambda r: ((r / "config.toml").write_bytes(b"[train]\nx = '\xff'\n"),
                                                     ["train", "--resume", "--run-dir", r])[1])(e.run),
     r"config\.toml' is not UTF-8"),
    ("resume-data-moved", _moved_data, r"data folder '.*data' does not exist"),
    # -- operating-system errors: permission denied (a user without the right to write or read)
    ("run-dir-not-writable", lambda e: [*SYNTH, "--run-dir", _read_only(e.tmp / "ro") / "run"],
     r"ro/run: Permission denied; make it readable/writable"),
    ("config-unreadable", lambda e: [*SYNTH, "--config", _unreadable(e.file("c.toml", "[train]\nseed = 1\n"))],
     r"c\.toml' cannot be read: Permission denied"),
    ("data-unreadable", lambda e: on_data(e.data_with(lambda d: _unreadable(d / "train.bin"))),
     r"train\.bin.*Permission denied"),
    ("prepare-out-not-writable", lambda e: ["prepare", write_text_corpus(e.tmp / "t.txt", 5), "--out",
                                            _read_only(e.tmp / "ro") / "data", "--tokenizer", "bytes"],
     r"Permission denied"),
    # -- sample (class 7)
    ("sample-negative-tokens", lambda e: ["sample", "--run-dir", e.run, "--max-new-tokens", -5],
     r"--max-new-tokens, --temperature and --top-k must be >= 0"),
    ("sample-negative-temperature", lambda e: ["sample", "--run-dir", e.run, "--temperature", -1], r">= 0"),
    ("sample-negative-top-k", lambda e: ["sample", "--run-dir", e.run, "--top-k", -1], r">= 0"),
    ("sample-not-a-number", lambda e: ["sample", "--run-dir", e.run, "--max-new-tokens", "many"],
     r"invalid int value: 'many'"),
    ("sample-prompt-not-utf8", lambda e: ["sample", "--run-dir", e.run, "--prompt", "caf\udce9"],
     r"--prompt is not valid UTF-8"),
    ("sample-unavailable-device", lambda e: ["sample", "--run-dir", e.run, "--device", "cuda:99"],
     r"--device cuda:99"),
    ("sample-not-a-device", lambda e: ["sample", "--run-dir", e.run, "--device", "banana"], r"'banana' is not a dev"),
    ("sample-missing-run", lambda e: ["sample", "--run-dir", e.tmp / "nothere"], r"there is no run directory \S*nothere"),
    ("sample-missing-checkpoint", lambda e: ["sample", "--run-dir", e.run, "--checkpoint", e.tmp / "step_9.pt"],
     r"checkpoint .*step_9\.pt does not exist"),
    ("sample-garbage-checkpoint", lambda e: ["sample", "--run-dir", e.run, "--checkpoint",
                                             e.file("junk.pt", os.urandom(5000))], r"junk\.pt is damaged"),
    ("sample-truncated-checkpoints", _sample_truncated, r"no checkpoint could be loaded.*step_00000002\.pt"),
    ("sample-synthetic-run", lambda e: ["sample", "--run-dir", e.synth], r"synthetic tokens"),
    # -- prepare
    ("prepare-missing-input", lambda e: ["prepare", e.tmp / "nope.txt", "--out", e.tmp / "o"], r"does not exist"),
    ("prepare-out-is-a-file", lambda e: ["prepare", write_text_corpus(e.tmp / "t.txt", 5), "--out",
                                         e.file("outfile"), "--tokenizer", "bytes"], r"outfile.*not a folder"),
    ("prepare-failure-keeps-existing", _prepare_into_existing, r"latin1\.txt' is not UTF-8"),
    ("prepare-bad-val-fraction", lambda e: ["prepare", write_text_corpus(e.tmp / "t.txt", 5), "--out", e.tmp / "o",
                                            "--val-fraction", 1.5], r"val_fraction must be in \[0, 1\)"),
    ("prepare-empty-input", lambda e: ["prepare", e.file("empty.txt", b""), "--out", e.tmp / "o"], r"empty"),
    ("prepare-missing-tokenizer-from", lambda e: ["prepare", e.file("t.txt", "hi\n"), "--out", e.tmp / "o",
                                                  "--tokenizer-from", e.tmp / "nope"], r"does not exist"),
    # -- doctor and config
    ("doctor-garbage-metrics", _garbage_metrics, r"metrics.*(unreadable|not JSON|cannot be read|damaged)"),
    ("doctor-missing-run", lambda e: ["doctor", e.tmp / "nothere"], r"nothere"),
    ("config-readme-without-markers", lambda e: ["config", "--update-readme", e.file("R.md", "# hi\n")],
     r"no <!-- config-reference:start -->"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,setup,match", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_refused_clearly_and_changes_nothing(name, setup, match, env, capsys):
    """exit != 0, a message naming the problem, no traceback, every pre-existing file unchanged (and,
    for planted payloads, no code run)."""
    argv = setup(env)
    before = tree(env.tmp)
    with permissions_enforced() if name in PERMISSION_CASES else contextlib.nullcontext():
        rc, out = cli(argv, capsys)
    assert rc not in (0, None), f"exit 0 for {name}:\n{out}"
    assert re.search(match, out), f"{name}: message does not name the problem:\n{out}"
    assert "Traceback" not in out
    assert_unchanged(before, env.tmp)
    assert not (env.tmp / "PWNED").exists()


def test_at_least_forty_bad_inputs():
    assert len({c[0] for c in BAD_INPUTS}) >= 40


# ----------------------------------------------------------------------------------------------
# 2. Every numeric config field refuses a value outside its declared range


def _outside(r: dict) -> float:
    if "ge" in r:
        return r["ge"] - 1
    if "gt" in r:
        return r["gt"]
    if "le" in r:
        return r["le"] + 1
    return r["lt"]


RANGED = [(k, r) for k, r in C.field_ranges().items() if r]


@pytest.mark.parametrize("key,bounds", RANGED, ids=[k for k, _ in RANGED])
def test_every_numeric_field_refuses_a_value_outside_its_range(key, bounds, capsys):
    tp = C.field_specs()[key][0]
    v = _outside(bounds)
    value = str(int(v)) if "int" in str(tp) else repr(float(v))
    rc, out = cli(["config", "--preset", "tiny", f"--{key}", value], capsys)
    assert rc == 2, out
    assert f"{key} must be" in out and "Traceback" not in out, out


def test_every_numeric_field_declares_a_range():
    specs = C.field_specs()
    numeric = [k for k, (tp, _, _) in specs.items() if any(t in str(tp) for t in ("int", "float"))]
    assert numeric and [k for k in numeric if not C.field_ranges()[k]] == []


# ----------------------------------------------------------------------------------------------
# 3. Planted payloads: no command that reads a checkpoint runs code from it

PLANTED_STEP = 5  # newer than the run's own checkpoints (1, 2): every loader tries it first


def _good_state(run: Path) -> dict:
    return torch.load(run / "checkpoints" / f"step_{STEPS:08d}.pt", map_location="cpu", weights_only=True)


def _write_dcp(run: Path, folder: Path, model_payload=None, optim_payload=None, extra_payload=None) -> None:
    """A sharded (DCP) checkpoint of the run's newest weights and optimizer, written as an FSDP/TP/PP run
    writes it (state keyed by parameter name), optionally with a payload in place of one entry."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from tokenmill.model import GPT
    from tokenmill.optim import build_optimizer
    from tokenmill.parallel.world import World

    state = _good_state(run)
    cfg = C.from_dict(state["config"])
    model = GPT(cfg.model, state["vocab_size"])
    model.load_state_dict(state["model"])
    opt = build_optimizer(model, cfg, World(device=torch.device("cpu")))
    opt.load_state_dict(state["optimizer"])
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    if model_payload is not None:
        msd["wpe.weight"] = model_payload  # a non-tensor entry where a weight belongs
    if optim_payload is not None:
        osd[next(k for k in osd if k.startswith("param_groups.") and k.endswith(".lr"))] = optim_payload
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(folder))
    extra = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
    extra["step"] = PLANTED_STEP
    if extra_payload is not None:
        extra["scheduler"]["payload"] = extra_payload
    torch.save(extra, folder / "extra.pt")


PAYLOAD_KINDS = ["file", "dcp-metadata", "dcp-model-entry", "dcp-optim-entry", "dcp-extra"]


def plant(run: Path, kind: str, marker: Path) -> Path:
    """Plant a checkpoint of step PLANTED_STEP whose loading with plain pickle/torch.load would create
    ``marker``; returns its path."""
    ck = run / "checkpoints"
    if kind == "file":
        state = _good_state(run)
        state["step"] = PLANTED_STEP
        state["scheduler"]["payload"] = Payload(marker)
        path = ck / f"step_{PLANTED_STEP:08d}.pt"
        torch.save(state, path)
        return path
    folder = ck / f"step_{PLANTED_STEP:08d}.dcp"
    p = Payload(marker)
    _write_dcp(run, folder, model_payload=p if kind == "dcp-model-entry" else None,
               optim_payload=p if kind == "dcp-optim-entry" else None,
               extra_payload=p if kind == "dcp-extra" else None)
    if kind == "dcp-metadata":
        (folder / ".metadata").write_bytes(pickle.dumps(p))
    return folder


def _unsafe_load(kind: str, path: Path) -> None:
    """What a plain reader does with the planted checkpoint (the positive control)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    if kind == "file":
        torch.load(path, weights_only=False)
    elif kind == "dcp-metadata":
        FileSystemReader(str(path)).read_metadata()
    elif kind == "dcp-extra":
        torch.load(path / "extra.pt", weights_only=False)
    else:
        state = _good_state(path.parent.parent)
        from tokenmill.model import GPT

        cfg = C.from_dict(state["config"])
        msd = GPT(cfg.model, state["vocab_size"]).state_dict()
        md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        want = {"model": msd} if kind == "dcp-model-entry" else {
            "optimizer": {k[len("optimizer."):]: (torch.empty(0) if hasattr(m, "size") else None)
                          for k, m in md.items() if k.startswith("optimizer.param_groups.")}}
        try:
            dcp.load(want, checkpoint_id=str(path))
        except Exception:  # noqa: BLE001 - the payload has run (or not) by the time loading fails
            pass


@pytest.mark.slow
@pytest.mark.parametrize("kind", PAYLOAD_KINDS)
def test_planted_payload_is_live(kind, env):
    """Positive control: each planted checkpoint does run its payload when read with plain
    ``pickle``/``torch.load(weights_only=False)``/DCP's stock reader, so the tests below are real."""
    marker = env.tmp / "CONTROL"
    path = plant(env.run, kind, marker)
    _unsafe_load(kind, path)
    assert marker.exists(), f"the {kind} payload did not run under a plain reader: the test would prove nothing"


def _commands(env: Env) -> dict[str, tuple[list, str | None]]:
    """Each command that reads a checkpoint: (argv, why it is skipped or None)."""
    subs = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001
    run = env.run
    init_ok = "train.init_from" in C.field_specs()
    return {
        "train-resume": (["train", "--resume", "--run-dir", run, "--train.max_steps", PLANTED_STEP + 1], None),
        "sample": (["sample", "--run-dir", run, "--max-new-tokens", 4], None),
        "init-from": (text_train(env.data, env.tmp / "ft", 1, "--train.init_from", run),
                      None if init_ok else "train.init_from does not exist yet"),
        "eval": (["eval", "--run-dir", run], None if "eval" in subs else "`tokenmill eval` does not exist yet"),
        "export": (["export", "--run-dir", run, "--out", env.tmp / "hf"],
                   None if "export" in subs else "`tokenmill export` does not exist yet"),
    }


COMMANDS = ["train-resume", "sample", "init-from", "eval", "export"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", PAYLOAD_KINDS)
@pytest.mark.parametrize("command", COMMANDS)
def test_no_payload_runs_and_the_newest_good_checkpoint_is_used(command, kind, env, capsys):
    """A hostile newest checkpoint is refused, named, kept (never deleted), and the command goes on from
    the newest good one; the payload never runs."""
    marker = env.tmp / "PWNED"
    planted = plant(env.run, kind, marker)
    planted_hash = tree(planted.parent)
    argv, skip = _commands(env)[command]
    if skip:
        pytest.skip(skip)
    rc, out = cli(argv, capsys)
    assert not marker.exists(), f"{command} ran the payload planted in {planted}"
    assert "Traceback" not in out
    if command != "train-resume":  # a resumed run trains past the planted step and saves its own step 5
        assert tree(planted.parent) == planted_hash, "a checkpoint changed or was removed"
    if kind == "dcp-optim-entry" and command != "train-resume":
        assert rc == 0, out  # only training reads optimizer entries; the weights of this checkpoint are clean
        return
    assert rc == 0, out
    assert planted.name in out and "refused" in out, out
    if command == "train-resume":
        assert f"resumed from {env.run / 'checkpoints' / f'step_{STEPS:08d}.pt'}" in out


@pytest.mark.slow
@pytest.mark.parametrize("kind", PAYLOAD_KINDS)
def test_payload_in_the_only_checkpoint_is_an_error_naming_it(kind, env, capsys):
    marker = env.tmp / "PWNED"
    run = env.run
    planted = plant(run, kind, marker)
    for p in checkpoints(run):
        if p != planted:
            p.unlink()
    for argv in (["train", "--resume", "--run-dir", run, "--train.max_steps", PLANTED_STEP + 1],
                 ["sample", "--run-dir", run, "--checkpoint", planted]):
        rc, out = cli(argv, capsys)
        assert not marker.exists()
        if kind == "dcp-optim-entry" and argv[0] == "sample":
            assert rc == 0, out
            continue
        assert rc == 1 and "refused" in out and planted.name in out and "Traceback" not in out, out


@pytest.mark.slow
def test_clean_sharded_checkpoint_loads(env, capsys):
    """Control for the DCP cases: a clean sharded checkpoint resumes and samples (the refusals above come
    from the payloads, not from DCP folders being unreadable here)."""
    run = env.run
    _write_dcp(run, run / "checkpoints" / f"step_{PLANTED_STEP:08d}.dcp")
    rc, out = cli(["sample", "--run-dir", run, "--max-new-tokens", 4], capsys)
    assert rc == 0 and "warning" not in out, out
    rc, out = cli(["train", "--resume", "--run-dir", run, "--train.max_steps", PLANTED_STEP + 1], capsys)
    assert rc == 0 and f"resumed from {run / 'checkpoints' / f'step_{PLANTED_STEP:08d}.dcp'}" in out, out


# ----------------------------------------------------------------------------------------------
# 4. Faults: a save that fails (permission, file-size limit), kill -9, two runs in one directory


def _assert_checkpoints_intact(run: Path, before: dict[str, str], capsys) -> None:
    """The checkpoints are exactly as before (no temporary file left) and the newest still loads."""
    assert tree(run / "checkpoints") == before
    rc, out = cli(["sample", "--run-dir", run, "--max-new-tokens", 4], capsys)
    assert rc == 0 and "warning" not in out, out


@pytest.mark.slow
def test_save_without_permission_keeps_previous_checkpoints(env, capsys):
    run = env.run
    before = tree(run / "checkpoints")
    _read_only(run / "checkpoints")
    with permissions_enforced():
        rc, out = cli(["train", "--resume", "--run-dir", run, "--train.max_steps", STEPS + 1], capsys)
    assert rc == 1 and "Traceback" not in out, out
    assert re.search(r"could not write checkpoint .*step_00000003\.pt: Permission denied; make it", out), out
    (run / "checkpoints").chmod(0o755)
    _assert_checkpoints_intact(run, before, capsys)


@pytest.mark.slow
def test_full_disk_keeps_previous_checkpoints(env, capsys):
    """A save that hits a file-size limit (RLIMIT_FSIZE, as a full disk does: the write fails midway)
    stops with a clear error, leaves no partial file, and the previous checkpoint loads."""
    run = env.run
    before = tree(run / "checkpoints")
    limit = 64 * 1024  # a checkpoint of the tiny model is ~380 kB; metrics and config lines are far smaller
    code = ("import resource, signal, sys; import tokenmill.cli, tokenmill.train.trainer; "
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.getrlimit(resource.RLIMIT_FSIZE)[1])); "
            "sys.exit(tokenmill.cli.main(sys.argv[1:]))")
    p = subprocess.run([sys.executable, "-c", code, "train", "--resume", "--run-dir", str(run),
                        "--train.max_steps", str(STEPS + 1)], capture_output=True, text=True, env=cpu_env(),
                       cwd=env.tmp, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 1 and "Traceback" not in out, out
    assert re.search(r"tokenmill: error: could not write checkpoint .*step_00000003\.pt.*(size limit|too large)",
                     out), out
    _assert_checkpoints_intact(run, before, capsys)
    rc, out = cli(["train", "--resume", "--run-dir", run, "--train.max_steps", STEPS + 1], capsys)
    assert rc == 0 and "resumed from" in out, out  # with space again, the run continues


def _wait_for(cond: Callable[[], bool], proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    t0 = time.time()
    while not cond():
        if proc.poll() is not None:
            pytest.fail(f"the training process ended before {what}: {proc.stderr.read() if proc.stderr else ''}")
        if time.time() - t0 > timeout:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.mark.slow
def test_second_run_is_locked_out_and_a_killed_run_resumes(env, capsys):
    """Two trainings into one run directory: the second stops with a clear error while the first runs.
    The first killed with SIGKILL mid-run (a torn metrics line, a stale .tmp) resumes cleanly."""
    run = env.run
    argv = ["train", "--resume", "--run-dir", str(run), "--train.max_steps", "100000", "--log.every_steps", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill", *argv], cwd=env.tmp, env=cpu_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: len(checkpoints(run)) >= 4, proc, "two new checkpoints")
        rc, out = cli(argv, capsys)
        assert rc == 1 and f"in use by another tokenmill process (pid {proc.pid})" in out, out
        rc, out = cli(["train", "--preset", "tiny", "--data.path", env.data, "--run-dir", run, *COMMON], capsys)
        assert rc == 1 and "in use by another tokenmill process" in out, out
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 99999, "loss": 1.2')  # the line a kill -9 tears
    stale = run / "checkpoints" / ".step_00099999.pt.tmp-12345"
    stale.write_bytes(b"half a checkpoint")
    last = int(checkpoints(run)[-1].name[5:13])
    rc, out = cli(["train", "--resume", "--run-dir", run, "--train.max_steps", last + 1], capsys)
    assert rc == 0 and f"resumed from {checkpoints(run)[-2]}" in out, out
    assert not stale.exists() and not list((run / "checkpoints").glob(".*tmp*"))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]  # every line parses
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == sorted(steps) and steps[-1] == last + 1 and 99999 not in steps


@pytest.mark.slow
def test_rotation_never_deletes_the_checkpoint_just_written(env, capsys):
    """With a damaged newer checkpoint and keep_last 1, the resumed run keeps its fresh checkpoint (the
    damaged one is neither loaded nor counted, and not deleted) and the one before it, which stays until the
    fresh one has proved itself by a finite next step (see test_trust_numerics.py)."""
    run = env.run
    bad = run / "checkpoints" / f"step_{PLANTED_STEP:08d}.pt"
    bad.write_bytes(os.urandom(3000))
    rc, out = cli(["train", "--resume", "--run-dir", run, "--train.max_steps", STEPS + 1, "--checkpoint.keep_last",
                   1], capsys)
    assert rc == 0 and f"{bad} is damaged" in out, out
    assert [p.name for p in checkpoints(run)] == [f"step_{STEPS:08d}.pt", f"step_{STEPS + 1:08d}.pt", bad.name]


# ----------------------------------------------------------------------------------------------
# 5. Resume semantics and self-contained runs


@pytest.mark.slow
def test_resume_at_max_steps_writes_nothing(env, capsys):
    run = env.run
    before = tree(env.tmp)
    rc, out = cli(["train", "--resume", "--run-dir", run, "--train.max_steps", STEPS], capsys)
    assert rc == 0 and "nothing to train, nothing was written" in out, out
    assert tree(env.tmp) == before


@pytest.mark.slow
def test_settings_given_on_resume_take_effect(env, capsys):
    """--optim.lr, the schedule and weight decay given on resume are used (the step count and the optimizer
    moments come from the checkpoint)."""
    run = env.run
    rc, out = cli(["train", "--resume", "--run-dir", run, "--train.max_steps", STEPS + 2, "--log.every_steps", 1,
                   "--optim.lr", 0.005, "--optim.schedule", "constant", "--optim.weight_decay", 0.3], capsys)
    assert rc == 0, out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["lr"]) for r in rows if "lr" in r and r["step"] > STEPS] == [(3, 0.005), (4, 0.005)]
    state = torch.load(checkpoints(run)[-1], weights_only=True)
    assert state["step"] == STEPS + 2
    assert sorted({g["weight_decay"] for g in state["optimizer"]["param_groups"]}) == [0.0, 0.3]
    assert "lr = 0.005" in (run / "config.toml").read_text()


@pytest.mark.slow
def test_run_is_self_contained(env, capsys, monkeypatch):
    """A run started with a relative data path resumes from another directory without repeating the
    flags, and samples after its data folder has moved (its tokenizer travels with it)."""
    a, b = env.tmp / "a", env.tmp / "b"
    a.mkdir()
    b.mkdir()
    shutil.copytree(env.base / "data", a / "data")
    monkeypatch.chdir(a)
    rc, out = cli(text_train(Path("data"), Path("run"), 1), capsys)
    assert rc == 0, out
    recorded = C.load_toml(a / "run" / "config.toml")["data"]["path"]
    assert recorded == str((a / "data").resolve())
    assert (a / "run" / "tokenizer" / "meta.json").is_file()
    monkeypatch.chdir(b)
    rc, out = cli(["train", "--resume", "--run-dir", a / "run", "--train.max_steps", 2], capsys)
    assert rc == 0 and "resumed from" in out, out
    shutil.move(str(a / "data"), str(env.tmp / "elsewhere"))
    rc, out = cli(["sample", "--run-dir", a / "run", "--prompt", "the quick", "--max-new-tokens", 8], capsys)
    assert rc == 0 and out.startswith("the quick"), out


# ----------------------------------------------------------------------------------------------
# 6. prepare never damages an existing data folder


@pytest.mark.slow
def test_prepare_over_an_existing_folder_replaces_only_its_data(env, capsys):
    """A successful prepare into an existing folder swaps in the new data and keeps the user's own
    files; a failed one (above: prepare-failure-keeps-existing) changes nothing. No temporary folder stays."""
    data = env.data
    (data / "NOTES.md").write_text("mine")
    old_meta = json.loads((data / "meta.json").read_text())
    text = write_text_corpus(env.tmp / "other.txt", 50)
    rc, out = cli(["prepare", text, "--out", data, "--tokenizer", "bytes", "--workers", 1, "--no-progress"], capsys)
    assert rc == 0, out
    meta = json.loads((data / "meta.json").read_text())
    assert meta["splits"]["train"]["tokens"] < old_meta["splits"]["train"]["tokens"]
    assert (data / "NOTES.md").read_text() == "mine"
    assert sorted(p.name for p in env.tmp.iterdir() if p.name.startswith(".")) == []
    rc, out = cli(on_data(data), capsys)  # the new folder is complete and valid
    assert rc == 0, out


def test_readme_guarantees_name_tests_that_exist():
    """Each test the README's "What tokenmill guarantees" section names exists here."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## What tokenmill guarantees", 1)[1].split("\n## ", 1)[0]
    tests = set(re.findall(r"`(test_\w+)`", section))
    cases = set(re.findall(r"`\[([\w-]+)\]`", section)) - {"name"}
    assert len(tests) >= 8 and len(cases) >= 5
    assert sorted(t for t in tests if not callable(globals().get(t))) == []
    assert sorted(cases - {c[0] for c in BAD_INPUTS}) == []


# ----------------------------------------------------------------------------------------------
# 7. The out-of-memory pre-check (train/advice.check_fits)


def test_memory_precheck_counts_the_training_state():
    """Weights + gradients + AdamW moments per rank, divided by sharding, moved by offloading; an absurd
    size is refused with the numbers and the switches, a normal one passes."""
    from tokenmill.parallel.world import World
    from tokenmill.train.advice import check_fits, state_bytes
    from tokenmill.train.parallelize import count_params

    cfg = tiny_cfg()
    n = count_params(cfg.model, 64)
    cpu, cuda = World(device=torch.device("cpu")), World(device=torch.device("cuda"))
    assert state_bytes(cfg, n, cpu) == (0, 16 * n)  # fp32 weights, gradients, two moments: all host memory
    assert state_bytes(cfg, n, cuda) == (16 * n, 0)
    assert state_bytes(tiny_cfg(**{"train.precision": "bf16"}), n, cuda) == (8 * n, 0)
    fsdp = World(device=torch.device("cuda"), size=4, dp_shard=4, fsdp=True)
    assert state_bytes(cfg, 4 * n, fsdp) == (16 * n, 0)
    offload = tiny_cfg(**{"memory.optimizer_offload": True})
    assert state_bytes(offload, n, cuda) == (8 * n, 12 * n)  # fp32 master weights and moments on the host
    check_fits(cfg, 64, cpu)  # the tiny model fits anywhere
    with pytest.raises(TrainingError) as e:
        check_fits(tiny_cfg(), 10**12, cpu)  # a vocabulary the data gives after the config is resolved
    msg = str(e.value)
    assert msg.startswith("out of memory before the first step") and "32,000,000,026,496 parameters" in msg
    assert "465.7 TB" in msg and "token embedding alone holds 32,000,000,000,000" in msg and "--train.precision bf16" in msg
