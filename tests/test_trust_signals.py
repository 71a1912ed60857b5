"""SIGINT and SIGTERM at random moments of every long command, start-up included (``tokenmill.signals``).

Each interruption starts the command as a real process (``python -m tokenmill ...``, its own session),
waits until tokenmill's handlers are in place (``/proc/PID/status`` shows SIGTERM caught: before that
it is the interpreter's own start-up), sleeps a seeded random delay spread over the command's run, and
sends SIGINT or SIGTERM to the whole process group (as a terminal's Ctrl-C or a service manager does) or
to the command alone. Then: it ended within a bounded time (never a hang), with 130 / 143 (or 0 when it
had finished), one line from tokenmill and no traceback, no process of its left, no temporary file left
(in the output folders and in its TMPDIR), inputs unchanged, and a following run (``--resume``, a rerun)
works. CI runs ``TOKENMILL_SIGNAL_REPEATS`` (default 1) interruptions per command; raise it (20) for a
long run, and ``TOKENMILL_SIGNAL_SEED`` draws other moments.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tokenmill import config as C
from tokenmill import signals
from tokenmill.cli import main

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; POSIX signals")

REPEATS = int(os.environ.get("TOKENMILL_SIGNAL_REPEATS", "1"))
SEED = int(os.environ.get("TOKENMILL_SIGNAL_SEED", "0"))
HANG_S = 120.0  # an interrupted command that has not ended by then hangs
TINY = ["--preset", "tiny", "--train.device", "cpu", "--log.progress", "plain", "--log.tensorboard", "false"]
SYNTH = ["--data.source", "synthetic", "--model.vocab_size", "64"]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def quiet(argv: list[str]) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(argv)


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def temporary_files(root: Path) -> list[str]:
    """Names a clean end must not leave: ``*.tmp``, ``.name.tmp-PID``, ``tokenmill-try-*`` folders."""
    return [str(p) for p in root.rglob("*") if ".tmp" in p.name or p.name.startswith("tokenmill-try-")]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Inputs for every command: JSONL files, a prepared folder, a trained run, a run whose metrics make
    the doctor suggest a config change, a two-rung ladder."""
    root = tmp_path_factory.mktemp("signals")
    src = root / "in"
    src.mkdir()
    for f in range(4):
        (src / f"p{f}.jsonl").write_text("".join(
            json.dumps({"text": " ".join(WORDS[(i * j + f) % 12] for j in range(40))}) + "\n" for i in range(3000)))
    assert quiet(["prepare", str(src), "--out", str(root / "data"), "--tokenizer", "bytes", "--workers", "1",
                  "--no-progress"]) == 0
    assert quiet(["train", *TINY, "--data.path", str(root / "data"), "--train.max_steps", "4",
                  "--checkpoint.every_steps", "2", "--run-dir", str(root / "run")]) == 0
    doc = root / "slow-data"
    doc.mkdir()
    C.save(C.resolve("tiny", overrides={"data.source": "synthetic", "model.vocab_size": 64, "train.device": "cpu",
                                        "log.progress": "plain", "log.tensorboard": False},
                     overrides_from_string=False), doc / "config.toml")
    rows = [{"step": s, "loss": 4.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 1000.0, "data_ms": 300.0,
             "h2d_ms": 0.1, "forward_ms": 40.0, "backward_ms": 50.0, "optimizer_ms": 8.0, "other_ms": 1.0,
             "step_ms": 399.1} for s in (2, 4, 6, 8)]
    (doc / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "ladder.toml").write_text(
        '[ladder]\nname = "sig"\ndescription = "two rungs"\nbase_preset = "tiny"\n[ladder.base]\n'
        '"data.source" = "synthetic"\n"model.vocab_size" = 64\n[ladder.measure]\nwarmup_steps = 1\n'
        'timed_steps = 4\nwindows = 2\n[[rung]]\nname = "a"\nexplain = "x"\n[[rung]]\nname = "b"\nexplain = "y"\n'
        'set = { "train.batch_size" = 4 }\n')
    return root


@dataclass(frozen=True)
class Command:
    """How to run a command into ``out`` and what must hold after an interruption."""

    argv: Callable[[Path, Path], list[str]]  # (world, out) -> arguments after `tokenmill`
    span_s: float  # signals are sent up to this long after the handlers are in place (~ the run on 2 cores)
    inputs: Callable[[Path], Path]  # a folder the command reads and must leave unchanged
    after: Callable[[Path, Path], None] = lambda world, out: None  # the follow-up (resume, rerun), in-process


def _prepare_after(world: Path, out: Path) -> None:
    """A rerun completes (resuming when the journal allows) and equals an uninterrupted prepare."""
    assert quiet(["prepare", str(world / "in"), "--out", str(out), "--tokenizer", "bytes", "--workers", "2",
                  "--no-progress"]) == 0
    assert tree_digest(out) == tree_digest(world / "data")


def _train_after(world: Path, out: Path) -> None:
    """What the user is told to do reaches max_steps: ``--resume`` when a checkpoint was saved; stopped
    before its first save, the run again from its recorded config (``--resume`` says so); a fresh start
    when the run had not begun."""
    if any((out / "checkpoints").glob("step_*")):
        args = ["train", "--resume", "--run-dir", str(out)]
    elif (out / "config.toml").is_file():
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            assert main(["train", "--resume", "--run-dir", str(out)]) == 1
        assert f"--config {out / 'config.toml'} --run-dir {out}" in err.getvalue(), err.getvalue()
        args = ["train", "--config", str(out / "config.toml"), "--run-dir", str(out)]
    else:
        args = ["train", *TINY, *SYNTH, "--train.max_steps", "12", "--checkpoint.every_steps", "3", "--run-dir",
                str(out)]
    assert quiet(args) == 0
    assert (out / "checkpoints" / "step_00000012.pt").is_file() or any(out.rglob("*00000012*"))


def _export_after(world: Path, out: Path) -> None:
    """The folder is either absent or complete (the export is atomic), and a rerun writes it."""
    if out.exists():
        assert (out / "config.json").is_file() and (out / "model.safetensors").is_file(), sorted(out.iterdir())
    assert quiet(["export", "--run-dir", str(world / "run"), "--out", str(out), "--overwrite"]) == 0


COMMANDS = {
    "prepare": Command(lambda w, o: ["prepare", str(w / "in"), "--out", str(o), "--tokenizer", "bytes",
                                     "--workers", "2", "--no-progress"], 4.0, lambda w: w / "in", _prepare_after),
    "train": Command(lambda w, o: ["train", *TINY, *SYNTH, "--train.max_steps", "12", "--checkpoint.every_steps",
                                   "3", "--data.num_workers", "1", "--run-dir", str(o)], 5.0,
                     lambda w: w / "in", _train_after),
    "eval": Command(lambda w, o: ["eval", "--run-dir", str(w / "run"), "--device", "cpu", "--batches", "20"], 3.0,
                    lambda w: w / "data"),
    "export": Command(lambda w, o: ["export", "--run-dir", str(w / "run"), "--out", str(o)], 2.0,
                      lambda w: w / "data", _export_after),
    "sample": Command(lambda w, o: ["sample", "--run-dir", str(w / "run"), "--max-new-tokens", "400"], 3.0,
                      lambda w: w / "data"),
    "bench": Command(lambda w, o: ["bench", "ladder", str(w / "ladder.toml"), "--out", str(o), "--quiet"], 12.0,
                     lambda w: w / "run"),
    "profile": Command(lambda w, o: ["profile", *TINY, *SYNTH, "--run-dir", str(o), "--wait", "1", "--warmup", "1",
                                     "--active", "3", "--quiet"], 5.0, lambda w: w / "run"),
    "doctor --try": Command(lambda w, o: ["doctor", str(w / "slow-data"), "--try", "1", "--try-steps", "4",
                                          "--try-repeats", "1"], 12.0, lambda w: w / "run"),
    "estimate": Command(lambda w, o: ["estimate", "--preset", "gpt2-124m", "--data.source", "synthetic", "--gpu",
                                      "h100-sxm"], 3.0, lambda w: w / "run"),
}


def handlers_installed(pid: int) -> bool:
    """tokenmill's handlers are in place: SIGTERM is caught (the interpreter alone leaves it default)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except OSError:
        pass
    return False


def processes_marked(mark: str) -> list[int]:
    """Live processes whose environment carries ``mark`` (the command and every child it started)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                if mark.encode() in (d / "environ").read_bytes():
                    found.append(int(d.name))
    return found


@dataclass
class Ended:
    rc: int
    stderr: str
    after_s: float  # from the signal to the exit
    tmpdir: Path
    mark: str


def interrupt(argv: list[str], sigs: list[int], delay: float, group: bool, tmp: Path, gap: float = 0.0,
              ready: Callable[[], bool] = lambda: True) -> Ended:
    """Run ``tokenmill ARGV``; ``delay`` s after its handlers are in place (and ``ready()``) send ``sigs``
    (``gap`` s apart)."""
    mark = uuid.uuid4().hex
    tmpdir = Path(tempfile.mkdtemp(prefix="tm-sig-", dir="/tmp"))  # short: sockets live in it (108 bytes)
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmpdir), TOKENMILL_SIGNAL_MARK=mark)
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    deadline = time.monotonic() + HANG_S
    while not (handlers_installed(proc.pid) and ready()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    time.sleep(delay)
    sent = time.monotonic()
    for i, s in enumerate(sigs):
        with contextlib.suppress(ProcessLookupError):
            (os.killpg if group else os.kill)(proc.pid, s)
        if i + 1 < len(sigs):
            time.sleep(gap)
    try:
        _, err = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"tokenmill {' '.join(argv)} hangs: no exit {HANG_S:.0f} s after the signal")
    return Ended(proc.returncode, err, time.monotonic() - sent, tmpdir, mark)


def assert_clean_end(e: Ended, sig: int, what: str, killed_ok: bool = False) -> None:
    """``killed_ok``: a later signal may arrive in the interpreter's last milliseconds, after Python has
    given the signals their default actions back; the process then ends by that signal (-sig here, which a
    shell reports as 128 + sig too), after tokenmill's line."""
    word = signals.WORDS[sig]
    assert e.rc in (signals.CODES[sig], 0, *([-sig] if killed_ok else [])), f"{what}: exit {e.rc}\n{e.stderr}"
    assert "Traceback" not in e.stderr and "Exception ignored" not in e.stderr, f"{what}:\n{e.stderr}"
    ours = [ln for ln in e.stderr.splitlines() if ln.startswith(("tokenmill: interrupted", "tokenmill: terminated",
                                                                  "tokenmill: error", "tokenmill: config error"))]
    assert ours == ([f"tokenmill: {word}"] if e.rc else []), f"{what}:\n{e.stderr}"
    deadline = time.monotonic() + 10
    while processes_marked(e.mark) and time.monotonic() < deadline:  # killed children: a moment to go
        time.sleep(0.05)
    assert not processes_marked(e.mark), f"{what}: processes left behind"
    left = list(e.tmpdir.iterdir())
    shutil.rmtree(e.tmpdir, ignore_errors=True)
    assert not left, f"{what}: left in TMPDIR: {left}"


def moments(name: str, n: int) -> list[tuple[int, bool, float]]:
    """(signal, to the whole group, delay) for ``n`` interruptions of ``name``: seeded, alternating."""
    rng = random.Random(f"{SEED}:{name}")
    span = COMMANDS[name].span_s
    out = []
    for i in range(n):
        third = (i + list(COMMANDS).index(name)) % 3  # start-up, mid-run, anywhere (one each with n = 1)
        delay = rng.uniform(0, 0.3) if third == 0 else rng.uniform(0.3 * span, 0.7 * span) if third == 1 else \
            rng.uniform(0, span)
        combo = (i + list(COMMANDS).index(name)) % 4  # every (signal, target) pair in turn
        out.append((signal.SIGINT if combo < 2 else signal.SIGTERM, combo % 2 == 0, delay))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMMANDS))
def test_signal_at_random_moments_ends_cleanly(name, world, tmp_path):
    cmd = COMMANDS[name]
    before = tree_digest(cmd.inputs(world))
    for i, (sig, group, delay) in enumerate(moments(name, REPEATS)):
        out = tmp_path / f"out{i}"
        e = interrupt(cmd.argv(world, out), [sig], delay, group, tmp_path)
        what = (f"{name} #{i}: {signal.Signals(sig).name} to the {'group' if group else 'process'} {delay:.2f} s "
                f"after start-up (exit {e.rc} {e.after_s:.1f} s later)")
        assert_clean_end(e, sig, what)
        assert not temporary_files(tmp_path), f"{what}: {temporary_files(tmp_path)}"
        assert tree_digest(cmd.inputs(world)) == before, f"{what}: an input changed"
        cmd.after(world, out)
        assert not temporary_files(tmp_path), f"{what}, after the follow-up: {temporary_files(tmp_path)}"


@pytest.mark.slow
def test_second_signal_while_cleaning_up_ends_at_once(world, tmp_path):
    """Ctrl-C, then Ctrl-C again 50 ms later, mid-prepare with tokenizer processes: still one line, the
    first signal's exit code (or the signal itself, see ``assert_clean_end``), no traceback, no process
    left, and the rerun resumes."""
    argv = COMMANDS["prepare"].argv(world, tmp_path / "out")
    build = tmp_path / ".out.prepare"  # the resumable build: the pool is starting or running
    e = interrupt(argv, [signal.SIGINT, signal.SIGINT], 0.05, True, tmp_path, gap=0.05, ready=build.is_dir)
    assert e.rc != 0, "prepare ended before it could be interrupted mid-run"
    assert_clean_end(e, signal.SIGINT, "prepare, two Ctrl-C", killed_ok=True)
    _prepare_after(world, tmp_path / "out")


@pytest.mark.slow
def test_closed_pipe_is_quiet(world):
    """`tokenmill sample ... | head -0`: the reader is gone before the text comes; exit 141, nothing on
    stderr (not a disk problem)."""
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill", "sample", "--run-dir", str(world / "run"),
                             "--max-new-tokens", "20"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=HANG_S) == signals.BROKEN_PIPE, err
    assert err == ""


class ClosedPipe(io.StringIO):
    def write(self, s):
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self):
        raise io.UnsupportedOperation("no file descriptor")


def test_broken_pipe_in_process_exits_141_without_a_message(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["config", "--preset", "tiny"]) == signals.BROKEN_PIPE
    assert capsys.readouterr().err == ""


def test_handlers_come_back_after_an_in_process_command(capsys):
    """``main([...])`` from Python restores the caller's handlers; SIGTERM inside a command unwinds as
    Terminated, a KeyboardInterrupt, and gives 143 and one line."""
    before = {s: signal.getsignal(s) for s in signals.SIGNALS}
    assert main(["config", "--preset", "tiny"]) == 0
    assert {s: signal.getsignal(s) for s in signals.SIGNALS} == before
    signals.install()
    try:
        with pytest.raises(signals.Terminated) as info:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises at the next bytecode
        assert isinstance(info.value, KeyboardInterrupt)
        assert signals.received() == signal.SIGTERM
        assert signals.outcome(info.value) == (143, "tokenmill: terminated")
    finally:
        signals.finish(owned=False)
    assert {s: signal.getsignal(s) for s in signals.SIGNALS} == before


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_surviving_rank_ends_with_one_line_when_another_dies(tmp_path):
    """Two gloo ranks (the environment torchrun gives them); rank 1 is killed with SIGKILL mid-run. Rank 0
    ends on its own within a bounded time with one error line naming the cause's place, no traceback."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    argv = [sys.executable, "-m", "tokenmill", "train", *TINY, *SYNTH, "--train.max_steps", "100000",
            "--log.every_steps", "1", "--run-dir", str(tmp_path / "run")]
    procs = [subprocess.Popen(argv, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True) for r in (0, 1)]
    try:
        metrics, deadline = tmp_path / "run" / "metrics.jsonl", time.monotonic() + HANG_S
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2) and time.monotonic() < deadline:
            assert procs[0].poll() is None and procs[1].poll() is None, procs[0].stderr.read()
            time.sleep(0.05)
        procs[1].kill()
        _, err = procs[0].communicate(timeout=HANG_S)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert procs[0].returncode == 1, err
    assert "Traceback" not in err, err
    ours = [ln for ln in err.splitlines() if ln.startswith("tokenmill: ")]
    assert len(ours) == 1 and ours[0].startswith("tokenmill: error: rank 0 of 2: another process of this job "
                                                 "has ended"), err


def test_a_signal_inside_a_deferred_block_raises_when_it_ends():
    """What must not stop half-way (a pool being built) finishes; the held Ctrl-C raises right after."""
    finished = []
    signals.install()
    try:
        with pytest.raises(signals.Interrupted):
            with signals.deferred():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the handler has run by now, and held the signal
                finished.append(True)
        assert finished == [True] and signals.received() == signal.SIGINT
    finally:
        signals.finish(owned=False)


def test_a_signal_during_an_import_raises_after_the_module_has_loaded(tmp_path, monkeypatch):
    """Ctrl-C while a module loads is held until the import is over: raised inside it, the exception can
    cross a C++ extension's start-up (triton's, when ``estimate`` first touches torch.compile) and the
    process aborts with SIGABRT instead of exiting 130. The module loads whole; the Ctrl-C comes after."""
    (tmp_path / "tm_slow_import.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(0.2)\nLOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    signals.install()
    try:
        with pytest.raises(signals.Interrupted):
            import tm_slow_import  # noqa: F401
            time.sleep(5)  # the held signal is sent again once the import is over
        assert sys.modules["tm_slow_import"].LOADED and signals.received() == signal.SIGINT
    finally:
        signals.finish(owned=False)
        sys.modules.pop("tm_slow_import", None)


@pytest.mark.slow
def test_a_second_signal_during_an_import_ends_the_process_at_once(tmp_path):
    """The user presses Ctrl-C again while the first waits for a slow import: exit 130 now, one line."""
    (tmp_path / "tm_slower_import.py").write_text(
        "import os, signal, time\nfor _ in range(2):\n    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(0.1)\n"
        "time.sleep(30)\nprint('loaded')\n")
    code = "from tokenmill import signals\nsignals.install()\nimport tm_slower_import\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S,
                          env=dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"))
    assert (proc.returncode, proc.stdout, proc.stderr) == (130, "", "tokenmill: interrupted\n")


STUCK = """
import ctypes, sys
from tokenmill import signals
signals.STUCK_S = 1.0  # 10 s in tokenmill; shorter here
signals.install()
libc, mutex = ctypes.CDLL(None), ctypes.create_string_buffer(64)  # a default pthread mutex (all zero)
libc.pthread_mutex_lock(mutex)
print("stuck", flush=True)
libc.pthread_mutex_lock(mutex)  # relocked by its owner: never returns, and no signal interrupts it
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_a_process_stuck_in_native_code_ends_it(sig):
    """The main thread blocked in a C call that never returns (a stuck collective, a device sync, a lock):
    no Python handler can run there, so a watcher thread that sees the signal arrive (the interpreter's
    wake-up pipe) and the main thread not move ends the process after ``STUCK_S``, saying why."""
    proc = subprocess.Popen([sys.executable, "-c", STUCK], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.stdout.readline() == "stuck\n"
    stat, deadline = Path(f"/proc/{proc.pid}/task/{proc.pid}/stat"), time.monotonic() + HANG_S
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "S" and time.monotonic() < deadline:
        time.sleep(0.01)  # the main thread is asleep in the second lock (a few bytecodes after the print)
    time.sleep(0.2)
    os.kill(proc.pid, sig)
    try:
        _, err = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("a signal to a process stuck in native code did not end it")
    assert proc.returncode == signals.CODES[sig], err
    assert err == f"tokenmill: {signals.WORDS[sig]} (no answer for 1 s: stuck in native code, ended without clean-up)\n"


HALF_BUILT_LOADER = """
import gc, multiprocessing, os, signal, sys, time
import torch
from torch.utils.data import DataLoader
from tokenmill import signals
from tokenmill.data import start_batches

class Sampler:  # iter(loader) calls this twice: before starting its workers, and after, before recording them
    calls = 0
    def __iter__(self):
        Sampler.calls += 1
        if Sampler.calls == 2:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs here, inside the DataLoader iterator's constructor
        return iter([[0, 1], [2, 3]])
    def __len__(self):
        return 2

signals.install()
loader = DataLoader(torch.arange(4), batch_sampler=Sampler(), num_workers=2)
try:
    it = (start_batches if sys.argv[1] == "whole" else iter)(loader)
    print("no interrupt")
except KeyboardInterrupt:
    gc.collect()
    deadline = time.monotonic() + 3  # ended workers go at once; the half-built iterator's never do
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    print(len(multiprocessing.active_children()), "workers left")
"""


@pytest.mark.slow
def test_a_signal_while_a_loader_starts_its_workers_leaves_none_running(tmp_path):
    """CI's red moment: the Ctrl-C arrived inside ``iter(DataLoader)``, after its workers had started and
    before it had recorded them; the half-built iterator could not end them and its ``__del__`` printed a
    traceback. ``start_batches`` builds the iterator whole and raises after; it ends its workers. (The
    bare ``iter`` is run beside it: the same moment leaves both workers running.)"""
    runs = {how: subprocess.run([sys.executable, "-c", HALF_BUILT_LOADER, how], capture_output=True, text=True,
                                timeout=HANG_S, env=dict(os.environ, OMP_NUM_THREADS="1")) for how in ("whole", "bare")}
    assert runs["whole"].stdout == "0 workers left\n", runs["whole"]
    assert "Traceback" not in runs["whole"].stderr and "Exception ignored" not in runs["whole"].stderr, runs["whole"]
    assert runs["bare"].stdout == "2 workers left\n", runs["bare"]  # the moment is the one CI met


FAILING_FINALIZER = """
import gc, os, signal, sys, time
from tokenmill import signals

class HalfBuilt:
    def __init__(self, interrupt):
        if interrupt:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises here: the object never gets its field
        self.field = 1
    def __del__(self):
        self.field  # AttributeError when half-built

signals.install()
obj = HalfBuilt(False)
del obj.field
del obj  # no signal yet: Python reports the finalizer's error as always
gc.collect()
try:
    HalfBuilt(True)
except KeyboardInterrupt:
    gc.collect()
    print("interrupted")
"""


@pytest.mark.slow
def test_after_a_signal_a_half_built_objects_finalizer_stays_quiet():
    """The class behind CI's red moment: after the signal, a finalizer failing on the object the signal's
    exception left half-built prints nothing; before it, Python's report is left as it is."""
    proc = subprocess.run([sys.executable, "-c", FAILING_FINALIZER], capture_output=True, text=True, timeout=HANG_S)
    assert proc.stdout == "interrupted\n", proc
    assert proc.stderr.count("Exception ignored") == 1 and proc.stderr.count("AttributeError") == 1, proc.stderr
