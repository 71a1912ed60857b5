"""Hostile values (issue 20 item 7): every option of every command, given values a user or a script can
produce by mistake (empty, negative, huge, NaN, infinite, a word, non-UTF-8 bytes, a folder, /dev/null, a
FIFO, a missing file, a file with a non-UTF-8 name or content), must end cleanly.

The cases come from the real parser (``tokenmill.cli.build_parser``: every sub-command, every option, so a
new option is covered when it is added) and, for the config-taking commands, from the config dataclasses
(every ``--section.field`` with its type and declared range). Each case runs ``tokenmill.cli.main`` in this
process, with stdout strict UTF-8 and stderr backslash-escaping as on a UTF-8 terminal, and asserts:

* no exception escapes ``main`` (argparse's usage error, ``SystemExit(2)``, is its clean answer);
* a value that is bad by its declared type or range exits non-zero; any other value either exits 0
  having done the command's job (the output exists) or exits non-zero;
* a non-zero exit prints no traceback and ends stderr with exactly one ``tokenmill...: error: ...`` line
  (argparse's usage block may precede it);
* the inputs (a prepared folder, a trained run, the hostile files themselves) are unchanged, byte for byte;
* nothing hangs (a FIFO opened for reading would): each case has a time limit.

CI runs a seeded sample covering every option; ``TOKENMILL_HOSTILE_CASES=all`` runs every case, ``slow``
the cases the sample leaves out (values a slow command may accept), a number that many.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import math
import os
import random
import signal
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from tokenmill import cli
from tokenmill import config as C

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

BAD, MAYBE = "bad", "maybe"  # must fail / may succeed (then the job must be done)
NON_UTF8 = os.fsdecode(b"\xff\xfe")  # what a non-UTF-8 argument becomes in sys.argv
LIMIT_S = 60  # per case: a case that blocks (a FIFO opened for reading) fails instead of hanging CI
CI_CASES = 320  # about 15 s on an idle 2-core machine, with the inputs made once

COMMON = ["--log.progress", "plain", "--log.tensorboard", "false", "--train.device", "cpu"]
SYN = ["--preset", "tiny", "--data.source", "synthetic", "--model.vocab_size", "64"]

# ----------------------------------------------------------------------------------------------
# the hostile values, by kind


def int_values() -> list[tuple[str, str, str]]:
    return [("empty", "", BAD), ("negative", "-1", BAD), ("zero", "0", MAYBE), ("huge", str(10**30), BAD),
            ("nan", "nan", BAD), ("word", "abc", BAD), ("fraction", "1.5", BAD), ("non-utf8", NON_UTF8, BAD)]


def float_values() -> list[tuple[str, str, str]]:
    return [("empty", "", BAD), ("negative", "-1", BAD), ("zero", "0", MAYBE), ("huge", "1e30", MAYBE),
            ("overflow", "1e400", BAD), ("nan", "nan", BAD), ("inf", "inf", BAD), ("word", "abc", BAD),
            ("non-utf8", NON_UTF8, BAD)]


def text_values() -> list[tuple[str, str, str]]:
    """Free text and paths: whether one is wrong depends on the option, so each may succeed."""
    return [("empty", "", MAYBE), ("non-utf8", NON_UTF8, MAYBE), ("folder", "@FOLDER", MAYBE),
            ("devnull", "/dev/null", MAYBE), ("fifo", "@FIFO", MAYBE), ("missing", "@MISSING", MAYBE),
            ("non-utf8-name", "@NONUTF8_NAME", MAYBE), ("binary-file", "@BINARY", MAYBE)]


def choice_values() -> list[tuple[str, str, str]]:
    return [("empty", "", BAD), ("word", "nope", BAD), ("non-utf8", NON_UTF8, BAD), ("padded", " auto ", BAD)]


def size_values() -> list[tuple[str, str, str]]:
    """``prepare --tokenizer-sample``: a byte size such as 500M."""
    return [("empty", "", BAD), ("negative", "-1M", BAD), ("zero", "0", BAD), ("nan", "nan", BAD),
            ("inf", "inf", BAD), ("overflow", "1e400G", BAD), ("word", "abc", BAD), ("non-utf8", NON_UTF8, BAD)]


# ----------------------------------------------------------------------------------------------
# config fields: the expected verdict from the field's declared type and range (an oracle written
# here, independently of config/resolve.py)


def _in_range(v: float, r: dict) -> bool:
    return all((("ge" not in r) or v >= r["ge"], ("gt" not in r) or v > r["gt"],
                ("le" not in r) or v <= r["le"], ("lt" not in r) or v < r["lt"]))


def field_verdict(tp, bounds: dict, value: str) -> str:
    """BAD when ``value`` is not of the field's type or outside its declared range, else MAYBE (a value
    valid alone may still clash with another field: then a clean config error is right too)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    optional = typing.get_origin(tp) is typing.Union
    if optional:
        if value.lower() in ("", "none", "null"):
            return MAYBE
        tp = args[0]
    if typing.get_origin(tp) is Literal:
        return MAYBE if value in [str(a) for a in typing.get_args(tp)] else BAD
    if tp is bool:
        return MAYBE if value.lower() in ("1", "0", "true", "false", "yes", "no", "on", "off") else BAD
    if tp is str:
        return MAYBE
    try:
        num = int(value) if tp is int else float(value)
    except ValueError:
        return BAD
    if (tp is float and not math.isfinite(num)) or (tp is int and not -(2**63) <= num < 2**63):
        return BAD
    return MAYBE if _in_range(num, bounds) else BAD


def field_values(tp, bounds: dict) -> list[tuple[str, str, str]]:
    inner = [a for a in typing.get_args(tp) if a is not type(None)]
    base = inner[0] if typing.get_origin(tp) is typing.Union else tp
    if base is int:
        raw = int_values()
    elif base is float:
        raw = float_values()
    elif base is str:
        return text_values()
    elif base is bool:
        raw = [("empty", "", BAD), ("word", "maybe", BAD), ("two", "2", BAD), ("non-utf8", NON_UTF8, BAD)]
    else:  # a Literal
        raw = choice_values()
    return [(label, value, field_verdict(tp, bounds, value)) for label, value, _ in raw]


# ----------------------------------------------------------------------------------------------
# the commands: a minimal valid base each, and what "done its job" means


@dataclass(frozen=True)
class Base:
    argv: tuple[str, ...]  # after the command words; @OUT = a fresh output path, @RUN/@DATA/@CORPUS = inputs
    done: typing.Callable  # (out: Path, stdout: str) -> bool, for an exit 0
    slow: bool = False  # a valid value starts seconds of work: only values bad by type run in CI
    positional: dict = None  # dest -> index in argv of a positional's value (absent: inserted first)


def _file(name):
    return lambda out, stdout: (out / name).is_file()


def _printed(out, stdout):
    return bool(stdout)


def _toml(out, stdout):
    return bool(tomllib.loads(stdout))


BASES = {
    ("train",): Base((*SYN, "--run-dir", "@OUT", "--train.max_steps", "1", "--train.eval_batches", "0", *COMMON),
                     _file("config.toml")),
    ("config",): Base(("--preset", "tiny"), _toml),
    ("estimate",): Base(("--preset", "tiny", "--gpu", "h100-sxm"), _printed),
    ("profile",): Base((*SYN, "--run-dir", "@OUT", "--train.max_steps", "2", "--wait", "0", "--warmup", "0",
                        "--active", "1", "--quiet", *COMMON), _printed, slow=True),
    ("prepare",): Base(("@CORPUS", "--out", "@OUT", "--tokenizer", "bytes", "--workers", "1", "--no-progress"),
                       _file("meta.json"), positional={"input": 0}),
    ("sample",): Base(("--run-dir", "@RUN", "--max-new-tokens", "4", "--device", "cpu"), _printed),
    ("export",): Base(("--run-dir", "@RUN", "--out", "@OUT"), _file("config.json")),
    # a run of plain text has no chat template: chat refuses it in one line (the options are checked first)
    ("chat",): Base(("@RUN", "--device", "cpu", "--max-new-tokens", "2"), _printed, positional={"path": 0}),
    ("eval",): Base(("--run-dir", "@RUN", "--batches", "1", "--device", "cpu"), lambda out, s: "loss" in s),
    ("doctor",): Base(("@RUN",), _printed, positional={"run_dir": 0}),
    ("bench", "ladder"): Base(("memory", "--estimate", "--out", "@OUT"), _file("ladder.json"), slow=True,
                              positional={"name": 0}),
    ("bench", "max-batch"): Base((*SYN, "--estimate-only", "--run-dir", "@OUT", "--gpu", "h100-sxm",
                                  "--max-batch-limit", "4"), _file("max-batch.json"), slow=True),
    ("bench", "max-model"): Base((*SYN, "--estimate-only", "--run-dir", "@OUT", "--gpu", "h100-sxm",
                                  "--shapes", "1:2:32"), _file("max-model.json"), slow=True),
}


def commands(parser) -> dict[tuple[str, ...], object]:
    """Every leaf sub-command of ``parser``: (words) -> its sub-parser."""
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                leaves = commands(sub)
                out.update({(name, *k): v for k, v in leaves.items()} or {(name,): sub})
    return out


@dataclass(frozen=True)
class Case:
    command: tuple[str, ...]
    option: str  # '--top-k', a positional's dest, or '--section.field'
    label: str
    value: str
    verdict: str

    @property
    def id(self) -> str:
        return f"{'-'.join(self.command)}:{self.option}={self.label}"

    @property
    def cheap(self) -> bool:
        return self.verdict == BAD or not BASES[self.command].slow


def option_values(action) -> list[tuple[str, str, str]]:
    """The hostile values of one argparse option, by its declared type."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return [("explicit-value", "=yes", BAD)]  # a flag takes no value: argparse must say so
    if action.choices:
        return choice_values()
    kind = getattr(action.type, "kind", action.type)  # config.options.number(int, ...) declares its kind
    if kind is int:
        return int_values()
    if kind is float:
        return float_values()
    if action.type is not None:  # a parsing function (prepare's sizes)
        return size_values()
    return text_values()


def all_cases() -> list[Case]:
    parser = cli.build_parser()
    specs, ranges = C.field_specs(), C.field_ranges()
    cases = []
    for words, sub in commands(parser).items():
        assert words in BASES, f"`tokenmill {' '.join(words)}` has no base command in this test: add one to BASES"
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if action.dest.startswith("cfg:"):
                key = action.dest[4:]
                values = field_values(specs[key][0], ranges[key])
                name = f"--{key}"
            else:
                values = option_values(action)
                name = action.option_strings[-1] if action.option_strings else action.dest
            cases += [Case(words, name, label, value, verdict) for label, value, verdict in values]
    return cases


def _key(case: Case):
    """A config field is one option whichever command takes it; any other option belongs to its command."""
    return case.option if case.option[2:] in C.field_specs() else (case.command, case.option)


def chosen(cases: list[Case], how: str | None) -> list[Case]:
    """Every case (``all``), the slow ones (``slow``), or a seeded sample: one value of every option first (:func:`_key`), then
    random others up to the budget; the slow commands only with values bad by type."""
    if how == "all":
        return cases
    if how == "slow":  # the ones the sample never takes: values a slow command may accept and start work on
        return [c for c in cases if not c.cheap]
    budget = int(how) if how and how.isdigit() else CI_CASES
    rng = random.Random(20)
    pool = [c for c in cases if c.cheap]
    rng.shuffle(pool)
    picked, seen = [], set()
    for c in pool:
        key = _key(c)
        if key not in seen:
            seen.add(key)
            picked.append(c)
    rest = [c for c in pool if c not in picked]
    picked += rest[:max(0, budget - len(picked))]
    return sorted(picked, key=lambda c: (c.command, c.option, c.label))


ALL_CASES = all_cases()
CASES = chosen(ALL_CASES, os.environ.get("TOKENMILL_HOSTILE_CASES"))

def _param(case: Case):
    return pytest.param(case, id=case.id.encode("ascii", "backslashreplace").decode())


# ----------------------------------------------------------------------------------------------
# the inputs, made once


def tree(root: Path) -> dict[str, str]:
    """Every entry under ``root``: relative path -> sha256 of a regular file, else its kind (a FIFO is
    never opened)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink() or not (p.is_file() or p.is_dir()):
                out[rel] = "special"
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Inputs every case may read: a text corpus, a prepared folder, a trained run, and the hostile files
    (a non-empty folder, a FIFO, a file with a non-UTF-8 name, a file of non-UTF-8 bytes)."""
    root = tmp_path_factory.mktemp("hostile")
    lines = [" ".join(f"word{(i * 7 + j) % 31}" for j in range(10)) for i in range(300)]
    (root / "corpus.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with _real_streams():
        assert cli.main(["prepare", str(root / "corpus.txt"), "--out", str(root / "data"), "--tokenizer", "bytes",
                         "--workers", "1", "--no-progress"]) == 0
        assert cli.main(["train", "--preset", "tiny", "--data.path", str(root / "data"), "--run-dir",
                         str(root / "run"), "--train.max_steps", "2", "--train.eval_batches", "1", *COMMON]) == 0
    (root / "folder").mkdir()
    (root / "folder" / "keep.txt").write_text("keep me\n")
    os.mkfifo(root / "fifo")
    (root / os.fsdecode(b"name-\xff.txt")).write_text("a file with a non-UTF-8 name\n" * 40)
    (root / "binary.txt").write_bytes(bytes(range(256)) * 8)
    return root


@contextlib.contextmanager
def _real_streams():
    """stdout and stderr as on a UTF-8 terminal: stdout strict, stderr backslash-escaping."""
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", write_through=True)
    err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="backslashreplace", write_through=True)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        yield out, err


class Hung(BaseException):
    """A case ran past LIMIT_S (a BaseException, so no ``except Exception`` swallows it)."""


def _on_alarm(signum, frame):
    raise Hung()


@pytest.fixture(scope="module")
def fast_parser():
    """``main`` builds the same parser (~0.2 s) for every call; here it is built once and shared, so the
    cases cost their own work. Parsing does not change a parser."""
    parser = cli.build_parser()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli, "build_parser", lambda: parser)
        yield


def resolve(value: str, world: Path, out: Path) -> str:
    return {"@FOLDER": str(world / "folder"), "@FIFO": str(world / "fifo"), "@MISSING": str(out.parent / "missing"),
            "@NONUTF8_NAME": str(world / os.fsdecode(b"name-\xff.txt")), "@BINARY": str(world / "binary.txt"),
            "@OUT": str(out), "@RUN": str(world / "run"), "@DATA": str(world / "data"),
            "@CORPUS": str(world / "corpus.txt")}.get(value, value)


def output_of(case: Case, world: Path, out: Path) -> Path:
    """Where the command writes: the hostile value itself when it replaces the base's output path (an
    empty one means the command's default folder, under the current one), else ``out``."""
    base = BASES[case.command].argv
    if case.option in base and base[base.index(case.option) + 1] == "@OUT":
        value = resolve(case.value, world, out)
        return Path(value) if value else Path.cwd()
    return out


def build_argv(case: Case, world: Path, out: Path) -> list[str]:
    base = BASES[case.command]
    argv = [resolve(a, world, out) for a in base.argv]
    value = resolve(case.value, world, out)
    if not case.option.startswith("-"):  # a positional
        index = (base.positional or {}).get(case.option)
        if index is None:
            argv.insert(0, value)
        else:
            argv[index] = value
    elif case.value.startswith("="):  # a flag given a value
        argv.append(case.option + case.value)
    elif case.option in argv:
        argv[argv.index(case.option) + 1] = value
    else:
        argv.append(f"{case.option}={value}" if value.startswith("-") else case.option)
        if not value.startswith("-"):
            argv.append(value)
    return [*case.command, *argv]


def run(argv: list[str]) -> tuple[int, str, str]:
    """``tokenmill ARGV`` in this process: (exit code, stdout, stderr); anything escaping ``main`` fails."""
    old = signal.signal(signal.SIGALRM, _on_alarm)  # pytest runs tests in the main thread
    signal.alarm(LIMIT_S)
    with _real_streams() as (out, err):
        try:
            rc = cli.main(argv)
        except SystemExit as e:  # argparse's usage error
            rc = e.code
        except Hung:
            pytest.fail(f"tokenmill {argv!r} ran past {LIMIT_S} s (blocked?)")
        except BaseException as e:  # noqa: BLE001 - exactly what must never happen
            pytest.fail(f"tokenmill {argv!r} raised {type(e).__name__}: {e}\nstderr: {_text(err)[-2000:]}")
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
        return rc, _text(out), _text(err)


def _text(stream) -> str:
    return stream.buffer.getvalue().decode("utf-8", "replace")


def check_clean_error(rc, err: str) -> None:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("tokenmill") and (": error: " in ln or ": config error: " in ln)]
    assert len(errors) == 1 and lines and lines[-1] == errors[0], f"not one error line at the end:\n{err}"
    if rc == 2 and lines[0].startswith("usage:"):  # argparse: its usage block, then the error
        return
    assert errors[0].startswith(("tokenmill: error: ", "tokenmill: config error: ")), err


@pytest.mark.slow
@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_hostile_value(case: Case, world, fast_parser, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # default output folders (runs/...) land here
    out = tmp_path / "out"
    before = tree(world)
    argv = build_argv(case, world, out)
    rc, stdout, stderr = run(argv)
    if rc == 0:
        assert case.verdict == MAYBE, f"accepted a bad value: tokenmill {argv!r}\n{stdout[-1000:]}{stderr[-1000:]}"
        where = output_of(case, world, out)
        done = BASES[case.command].done
        assert done(where, stdout) or any(done(p.parent, stdout) for p in where.rglob("*")), \
            f"exit 0 without the job done: {argv!r}\n{stdout[-1000:]}"
    else:
        assert rc in (1, 2), (rc, stderr)
        check_clean_error(rc, stderr)
    after = tree(world)
    after.pop("run/eval.json", None)  # eval writes its result into the run, by design
    before.pop("run/eval.json", None)
    added = {k for k in after.keys() - before.keys() if k.startswith("folder" + os.sep)}  # an output given @FOLDER
    assert {k: v for k, v in after.items() if k not in added} == before, \
        f"inputs changed: {sorted(set(after.items()) ^ set(before.items()))[:5]}"
    for k in sorted(added, reverse=True):  # the next case finds the folder as the world made it
        p = world / k
        p.rmdir() if p.is_dir() else p.unlink()


def test_the_sample_covers_every_option():
    """Every config field and every other option of every command has a case in the sample, but the text
    options of the slow commands (any value may start seconds of work: run with TOKENMILL_HOSTILE_CASES=all).
    The whole set, every value of every option on every command, is several thousand cases."""
    if os.environ.get("TOKENMILL_HOSTILE_CASES") == "slow":
        pytest.skip("TOKENMILL_HOSTILE_CASES=slow runs the cases the sample leaves out, not the sample")
    assert {_key(c) for c in CASES} >= {_key(c) for c in ALL_CASES if c.cheap}
    assert len({c.command for c in ALL_CASES}) == len(BASES) and len(ALL_CASES) > 10 * len(C.field_specs())
