"""Ctrl-C and SIGTERM during training keep the last completed step (``train/stop.py`` on ``signals.graceful``).

Each test starts ``tokenmill train`` as a real process (its own session), waits until it has logged a few
steps, and signals it: the run saves the step it had completed, says so, names its run directory and the
command that resumes it, and exits 130 / 143 with the one usual line. Following that command gives the
losses of a run that was never interrupted (bit for bit on one process; within 1e-5 relative on two, where
only the order of floating-point sums differs). A second signal skips the save and ends the process at
once, leaving no file behind.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cpu_env
from tokenmill import checkpoint, signals
from tokenmill.cli import main
from tokenmill.train.metrics import read_metrics

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals")

HANG_S = 150.0
# the schedule decays over 1000 steps whatever train.max_steps is, so the interrupted run, its resume with a
# smaller max_steps and the reference share every learning rate
FLAGS = ["--preset", "tiny", "--train.device", "cpu", "--log.progress", "plain", "--log.tensorboard", "false",
         "--data.source", "synthetic", "--model.vocab_size", "64", "--log.every_steps", "1",
         "--train.eval_batches", "0", "--optim.decay_steps", "1000", "--optim.warmup_steps", "2",
         "--train.max_steps", "100000"]
DROPOUT = ["--model.dropout", "0.1"]  # one process: the resumed masks are the uninterrupted run's too
SAVE_LINE = re.compile(r"^tokenmill: saving step (\d+) before exiting \(a second (Ctrl-C|signal) skips it\)$", re.M)
RESUME_LINE = re.compile(r"; resume with: (.+)$", re.M)


def losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run) if r.get("loss") is not None]


def quiet(argv: list[str]) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(argv)


def start(cmd: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=cwd, env=cpu_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def wait_for_steps(proc: subprocess.Popen, run: Path, n: int) -> None:
    deadline = time.monotonic() + HANG_S
    while len(losses(run)) < n:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "no training steps logged"
        time.sleep(0.02)


def ended(proc: subprocess.Popen) -> str:
    try:
        return proc.communicate(timeout=HANG_S)[1]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the signalled run did not end")


def temporary_files(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if ".tmp" in p.name]


@pytest.mark.slow
@pytest.mark.parametrize("sig, group", [(signal.SIGINT, True), (signal.SIGTERM, False)])
def test_a_signal_mid_run_saves_the_last_step_and_the_printed_command_resumes_exactly(tmp_path, sig, group):
    """Ctrl-C to the process group (a terminal) or SIGTERM to the process (a scheduler): the step it was in
    completes and is saved; the printed command resumes it, and the losses equal an uninterrupted run's."""
    run = tmp_path / "run"
    proc = start([sys.executable, "-m", "tokenmill", "train", *FLAGS, *DROPOUT, "--run-dir", str(run)], tmp_path)
    wait_for_steps(proc, run, 3)
    (os.killpg if group else os.kill)(proc.pid, sig)
    err = ended(proc)
    assert proc.returncode == signals.CODES[sig], err
    assert "Traceback" not in err, err
    saved = SAVE_LINE.search(err)
    assert saved and saved.group(2) == ("Ctrl-C" if sig == signal.SIGINT else "signal"), err
    step = int(saved.group(1))
    assert [s for s, _ in checkpoint.list_checkpoints(run)] == [step]  # no periodic save ran: this is the signal's
    assert losses(run)[-1][0] == step  # the last completed step, not one before it
    lines = [ln for ln in err.splitlines() if ln.startswith("tokenmill: ")]
    assert lines[-2:] == [f"tokenmill: run dir {run} (newest checkpoint: step {step}); resume with: tokenmill train "
                          f"--resume --run-dir {run}", f"tokenmill: {signals.WORDS[sig]}"], err
    assert not temporary_files(tmp_path)

    command = shlex.split(RESUME_LINE.search(err).group(1))
    assert command[:2] == ["tokenmill", "train"]
    assert quiet([*command[1:], "--train.max_steps", str(step + 3)]) == 0
    assert quiet(["train", *FLAGS, *DROPOUT, "--train.max_steps", str(step + 3), "--run-dir", str(tmp_path / "ref")]) == 0
    assert losses(run) == losses(tmp_path / "ref") and len(losses(run)) == step + 3


SLOW_SAVE = """
import sys, time, torch
real = torch.save
def slow_save(obj, f, *args, **kw):  # test-only: the signal's save takes long enough to be interrupted
    real(obj, f, *args, **kw)
    print("written, not yet renamed", file=sys.stderr, flush=True)
    time.sleep(60)
torch.save = slow_save
from tokenmill.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_second_ctrl_c_during_the_save_ends_at_once_without_a_file(tmp_path):
    """The save of the first Ctrl-C is under way (its file written under a temporary name); a second Ctrl-C
    ends the process at once: exit 130, the one line, the temporary file removed, no checkpoint."""
    run = tmp_path / "run"
    proc = start([sys.executable, "-c", SLOW_SAVE, "train", *FLAGS, "--run-dir", str(run)], tmp_path)
    wait_for_steps(proc, run, 3)
    os.killpg(proc.pid, signal.SIGINT)
    deadline = time.monotonic() + HANG_S
    while not any(".tmp" in p.name for p in (run / "checkpoints").glob("*")):  # the save is under way
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.02)
    second = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    err = ended(proc)
    assert time.monotonic() - second < 10, "the second Ctrl-C did not end the run at once"
    assert proc.returncode == 130, err
    assert "Traceback" not in err and SAVE_LINE.search(err), err
    assert [ln for ln in err.splitlines() if ln.startswith("tokenmill: interrupted")] == ["tokenmill: interrupted"]
    assert "resume with" not in err  # it ended at once
    assert checkpoint.list_checkpoints(run) == [] and not temporary_files(tmp_path), list(run.rglob("*"))


@pytest.mark.slow
def test_sigterm_to_torchrun_saves_one_checkpoint_on_every_rank_and_resumes(tmp_path):
    """Two FSDP ranks (gloo) under torchrun; SIGTERM to torchrun's process group (a scheduler's preemption
    notice), which passes it on to its workers: both ranks stop after the same step and write one sharded
    checkpoint together; the printed command resumes it, with the losses of one uninterrupted process on
    the same global batch."""
    run = tmp_path / "run"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
              "tokenmill"]
    flags = [*FLAGS, "--parallel.dp_shard", "2", "--train.batch_size", "4"]
    proc = start([*launch, "train", *flags, "--run-dir", str(run)], tmp_path)
    wait_for_steps(proc, run, 3)
    os.killpg(proc.pid, signal.SIGTERM)
    err = ended(proc)
    assert not re.search(r'File ".*tokenmill', err), err  # torchrun's agent prints its own traceback; no rank does
    saved = SAVE_LINE.findall(err)
    assert len(saved) == 1, err  # rank 0 says it, for both
    step = int(saved[0][0])
    found = checkpoint.list_checkpoints(run)
    assert [s for s, _ in found] == [step] and found[0][1].is_dir(), found  # one DCP folder, complete
    assert err.count("tokenmill: terminated") == 2, err  # each rank's one line
    command = shlex.split(RESUME_LINE.search(err).group(1))
    assert command[:5] == ["torchrun", "--nproc-per-node", "2", "-m", "tokenmill"], command
    resumed = subprocess.run([*launch, *command[5:], "--train.max_steps", str(step + 3)], cwd=tmp_path,
                             env=cpu_env(), capture_output=True, text=True, timeout=HANG_S)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resumed from {found[0][1]} at step {step}" in resumed.stdout
    ref = tmp_path / "ref"
    assert quiet(["train", *FLAGS, "--train.batch_size", "8", "--train.max_steps", str(step + 3),
                  "--run-dir", str(ref)]) == 0
    got, want = losses(run), losses(ref)
    assert [s for s, _ in got] == [s for s, _ in want] == list(range(1, step + 4))
    for (s, a), (_, b) in zip(got, want):
        assert abs(a - b) <= 1e-5 * abs(b), (s, a, b)


# ----------------------------------------------------------------------------------------------
# The mechanism (signals.graceful) and the policy's other branches, in this process


def test_graceful_holds_the_first_signal_until_it_is_taken():
    signals.install()
    try:
        with signals.graceful(60.0):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler has run, and raised nothing
            assert signals.requested() == signal.SIGTERM == signals.received()
            assert signals.take() == signal.SIGTERM and signals.requested() is None
        assert signals.received() == signal.SIGTERM  # taken: the exit code stays the signal's
    finally:
        signals.finish(owned=False)


def test_graceful_raises_a_signal_not_taken_within_the_grace_time_or_still_pending_at_its_end():
    signals.install()
    try:
        t0 = time.monotonic()
        with pytest.raises(signals.Interrupted):
            with signals.graceful(0.2):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(10)  # raised here once the grace time is over
        assert time.monotonic() - t0 < 5
        signals.install()
        with pytest.raises(signals.Terminated):
            with signals.graceful(60.0):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
    finally:
        signals.finish(owned=False)


@pytest.mark.slow
def test_a_second_signal_in_graceful_mode_ends_the_process_at_once():
    code = ("import os, signal, time\nfrom tokenmill import signals\nsignals.install()\n"
            "with signals.graceful(60.0):\n    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(0.1)\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(30)\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert (proc.returncode, proc.stderr) == (130, "tokenmill: interrupted\n")
    assert time.monotonic() - t0 < 20


def signalled_run(tmp_path: Path, capsys, at_step: int = 3) -> str:
    """Train in this process (tokenmill's handlers installed, as ``cli.main`` does); a SIGINT arrives
    during step ``at_step``'s callback. Returns stderr."""
    from conftest import tiny_cfg
    from tokenmill.train.trainer import Callbacks, train

    def ctrl_c(step: int) -> None:
        if step == at_step:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)

    signals.install()
    try:
        with pytest.raises(signals.Interrupted):
            train(tiny_cfg(**{"train.max_steps": 50, "train.eval_batches": 0}), tmp_path / "run",
                  callbacks=Callbacks(on_step_end=ctrl_c))
    finally:
        signals.finish(owned=False)
    return capsys.readouterr().err


@pytest.mark.slow
def test_a_save_that_would_not_fit_the_budget_is_skipped_and_said(tmp_path, capsys, monkeypatch):
    from tokenmill.train import stop

    monkeypatch.setattr(stop, "WRITE_BYTES_PER_S", 1.0)  # the estimate: far over the budget
    err = signalled_run(tmp_path, capsys)
    run = tmp_path / "run"
    assert re.search(r"^tokenmill: not saving step 3: it would end about \d+ s after the signal, past the 25 s",
                     err, re.M), err
    assert checkpoint.list_checkpoints(run) == []
    assert err.rstrip().splitlines()[-1] == (
        f"tokenmill: run dir {run} has no checkpoint (stopped before its first save); start it again with: "
        f"tokenmill train --config {run / 'config.toml'} --run-dir {run}")


@pytest.mark.slow
def test_a_step_that_does_not_end_within_the_budget_is_abandoned_with_the_resume_line(tmp_path, capsys,
                                                                                      monkeypatch):
    from tokenmill.train import stop

    monkeypatch.setattr(stop, "BUDGET_S", 0.0)  # the grace time is over at once: the usual KeyboardInterrupt
    err = signalled_run(tmp_path, capsys)
    assert "saving step" not in err and checkpoint.list_checkpoints(tmp_path / "run") == []
    assert err.rstrip().splitlines()[-1].startswith(f"tokenmill: run dir {tmp_path / 'run'} has no checkpoint"), err
