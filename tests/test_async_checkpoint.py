"""Asynchronous checkpoints (``checkpoint.async_save``): the files equal a synchronous save's, training
overlaps a slow write (measured), a write that fails or a process killed mid-write leaves the previous
checkpoint loadable and nothing partial under a real name, and FSDP's DCP folders save in the background too."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import cpu_env, run_cli, tiny_cfg
from tokenmill import checkpoint as ckpt
from tokenmill.checkpoint import background
from tokenmill.errors import CheckpointError
from tokenmill.train.trainer import Callbacks, train

FLAGS = ["--preset", "tiny", "--data.source", "synthetic", "--model.vocab_size", "64", "--train.device", "cpu",
         "--log.progress", "plain", "--log.tensorboard", "false", "--train.precision", "fp32"]


def assert_same_tree(a, b, where=""):
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}/{i}")
    else:
        assert a == b, where


@pytest.fixture(autouse=True)
def _no_save_left_in_flight():
    """Each test starts and ends with no background save of this process in flight."""
    yield
    try:
        background.wait()
    except CheckpointError:
        pass


def test_stage_copies_every_tensor_and_container():
    live = {"w": torch.ones(3), "groups": [{"lr": 0.1, "params": [0, 1]}], "step": 4}
    staged = background.stage(live)
    live["w"].add_(1)
    live["groups"][0]["lr"] = 0.2
    assert staged["w"].tolist() == [1.0, 1.0, 1.0] and staged["groups"][0]["lr"] == 0.1 and staged["step"] == 4


@pytest.mark.slow
def test_background_checkpoints_equal_synchronous_ones(tmp_path):
    """Every checkpoint of a run saved in the background holds exactly what the synchronous run saved:
    model, optimizer moments, scheduler, RNG state, data position (the config differs in the switch only)."""
    over = {"train.max_steps": 6, "checkpoint.every_steps": 2, "checkpoint.keep_last": 10, "model.dropout": 0.1}
    train(tiny_cfg(**over), tmp_path / "sync", quiet=True)
    train(tiny_cfg(**over, **{"checkpoint.async_save": True}), tmp_path / "async", quiet=True)
    a, b = ckpt.list_checkpoints(tmp_path / "sync"), ckpt.list_checkpoints(tmp_path / "async")
    assert [s for s, _ in a] == [s for s, _ in b] == [2, 4, 6]
    for (_, pa), (_, pb) in zip(a, b):
        sa, sb = ckpt.read_state(pa), ckpt.read_state(pb)
        assert sb["config"]["checkpoint"].pop("async_save") is True
        sa["config"]["checkpoint"].pop("async_save")
        assert_same_tree(sa, sb, pa.name)
    assert not list((tmp_path / "async" / "checkpoints").glob(".*"))


def slow_fsync(monkeypatch, seconds: float) -> None:
    """A slow disk: every fsync (the checkpoint file's and its folder's) takes ``seconds`` more."""
    real = os.fsync

    def fsync(fd):
        time.sleep(seconds)
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def timed_run(run_dir: Path, async_save: bool) -> tuple[float, list[float]]:
    """Wall time of a 12-step run saving every 3 steps, whose steps take >= 0.1 s of simulated compute
    (a sleep in the step-end callback), and the duration of each step."""
    stamps = []

    def compute(step):
        time.sleep(0.1)
        stamps.append(time.perf_counter())

    over = {"train.max_steps": 12, "checkpoint.every_steps": 3, "checkpoint.keep_last": 10,
            "checkpoint.async_save": async_save, "train.eval_batches": 0}
    t0 = time.perf_counter()
    train(tiny_cfg(**over), run_dir, quiet=True, callbacks=Callbacks(on_step_end=compute))
    return time.perf_counter() - t0, [b - a for a, b in zip(stamps, stamps[1:])]


@pytest.mark.slow
def test_training_overlaps_the_write_of_a_lagging_disk(tmp_path, monkeypatch):
    """With a disk that takes 0.2 s per save (two fsyncs of 0.1 s, which sleep), the synchronous run pays every
    save in the step after it; the background run hides the write. Judged inside each run, against its own
    ordinary steps (their median), so a loaded machine that slows every step does not decide it: each
    synchronous save costs at least 0.15 s more than an ordinary step, and the background run's three steps
    after a save cost together less than half of what the synchronous run's do."""
    slow_fsync(monkeypatch, 0.1)
    _sync_wall, sync_steps = timed_run(tmp_path / "sync", False)
    _async_wall, async_steps = timed_run(tmp_path / "async", True)
    after_save = [2, 5, 8]  # intervals step 3->4, 6->7, 9->10

    def excess(steps: list[float]) -> list[float]:
        ordinary = statistics.median(x for i, x in enumerate(steps) if i not in after_save)
        return [steps[i] - ordinary for i in after_save]

    sync_excess, async_excess = excess(sync_steps), excess(async_steps)
    assert all(e > 0.15 for e in sync_excess), sync_steps
    assert sum(async_excess) < 0.5 * sum(sync_excess), (async_steps, sync_steps)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "async")] == [3, 6, 9, 12]


@pytest.mark.slow
def test_a_failed_background_write_is_reported_at_the_next_save(tmp_path):
    """The write of step 2 fails inside torch.save (the writer hook adds an object that cannot be pickled):
    the next save raises an error naming the file, the atomic writer left nothing partial, and step 1 still
    loads."""
    run = tmp_path / "run"
    real = background.PENDING.write

    def failing(obj, path):
        real({**obj, "lock": threading.Lock()} if path.name == "step_00000002.pt" else obj, path)

    background.PENDING.write = failing
    try:
        with pytest.raises(CheckpointError, match=r"background save failed: could not write checkpoint "
                                                  r".*step_00000002\.pt \(TypeError: .*intact"):
            train(tiny_cfg(**{"train.max_steps": 4, "checkpoint.every_steps": 1, "checkpoint.async_save": True}),
                  run, quiet=True)
    finally:
        background.PENDING.write = real
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [1]
    assert not list((run / "checkpoints").glob(".*"))
    assert ckpt.read_state(ckpt.list_checkpoints(run)[0][1])["step"] == 1


@pytest.mark.slow
def test_a_full_disk_during_a_background_write_is_a_clear_error(tmp_path):
    """Through the command line, under a file-size limit (RLIMIT_FSIZE: the write fails midway, as on a
    full disk): one line naming the file, exit 1, no partial file; the previous checkpoint loads and the run
    resumes once there is space again."""
    run = tmp_path / "run"
    base = ["train", *FLAGS, "--run-dir", str(run)]
    assert run_cli(*base, "--train.max_steps", "2").returncode == 0  # the limited process is the one under test
    code = ("import resource, signal, sys; import tokenmill.cli, tokenmill.train.trainer; "
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1])); "
            "sys.exit(tokenmill.cli.main(sys.argv[1:]))")
    p = subprocess.run([sys.executable, "-c", code, "train", *FLAGS, "--run-dir", str(run), "--resume",
                        "--train.max_steps", "4", "--checkpoint.every_steps", "1", "--checkpoint.async_save", "true"],
                       capture_output=True, text=True, env=cpu_env(), timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 1 and "Traceback" not in out, out
    assert "tokenmill: error: the background save failed: could not write checkpoint" in out, out
    assert "step_00000003.pt" in out, out
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2] and not list((run / "checkpoints").glob(".*"))
    p = run_cli(*base, "--resume", "--train.max_steps", "3")
    assert p.returncode == 0 and "resumed from" in p.stdout + p.stderr


KILLED_WRITER = """
import os, sys, threading, time
real = os.fsync
def fsync(fd):  # a disk that never finishes flushing the checkpoint writer's file
    if threading.current_thread().name == "tokenmill-checkpoint-writer":
        time.sleep(600)
    return real(fd)
os.fsync = fsync
import tokenmill.cli
sys.exit(tokenmill.cli.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_process_killed_mid_write_keeps_the_previous_checkpoint(tmp_path):
    """SIGKILL while the background writer of step 4 is inside its write (the temporary file is written, not
    yet renamed): the checkpoint under a real name is step 2's and loads; --resume removes the temporary
    file and goes on from step 2."""
    run = tmp_path / "run"
    base = ["train", *FLAGS, "--run-dir", str(run)]
    assert run_cli(*base, "--train.max_steps", "2").returncode == 0  # the killed process is the one under test
    argv = [*base, "--resume", "--train.max_steps", "1000", "--checkpoint.every_steps", "2",
            "--checkpoint.async_save", "true"]
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, *argv], env=cpu_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    d = run / "checkpoints"
    try:
        t0 = time.time()
        while not list(d.glob(".step_*.pt.tmp-*")):
            assert proc.poll() is None and time.time() - t0 < 120, "no background write began"
            time.sleep(0.05)
        time.sleep(0.3)  # torch.save is done: the writer sits in fsync
    finally:
        proc.kill()
        proc.wait()
    tmp = list(d.glob(".step_*.pt.tmp-*"))
    assert len(tmp) == 1 and tmp[0].name.startswith(".step_00000004.pt.tmp-") and tmp[0].stat().st_size > 0
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2]
    assert ckpt.read_state(d / "step_00000002.pt")["step"] == 2
    p = run_cli(*base, "--resume", "--train.max_steps", "3")
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "step_00000002.pt at step 2" in out, out
    assert not tmp[0].exists() and [s for s, _ in ckpt.list_checkpoints(run)] == [2, 3]


@pytest.mark.slow
def test_a_nan_stop_lets_the_save_in_flight_land_before_setting_checkpoints_aside(tmp_path):
    """set_aside (a non-finite loss) waits for the background save first, so a checkpoint still being
    written cannot appear under its real name after the others were set aside."""
    run = tmp_path / "run"
    gate = threading.Event()
    real = background.PENDING.write
    background.PENDING.write = lambda obj, path: (gate.wait(10), real(obj, path))
    try:
        train(tiny_cfg(**{"train.max_steps": 2, "checkpoint.every_steps": 1, "checkpoint.async_save": True,
                          "checkpoint.save_final": False}), run, quiet=True)
        assert background.PENDING.busy()
        threading.Timer(0.3, gate.set).start()
        moved = ckpt.set_aside(run, 1)
    finally:
        background.PENDING.write = real
    assert [p.name for p in moved] == ["step_00000001.pt.nonfinite"] and not ckpt.list_checkpoints(run)


def two_rank_jobs(tmp) -> list[dict]:
    """The FSDP runs (synchronous, background saves, a resume of the latter), trained in
    tests/test_parallel.py's 2-rank launch (conftest.two_rank_launch: one launch's imports for several files)."""
    from test_parallel import common

    over = {"parallel.dp_shard": 2, "checkpoint.every_steps": 2, "checkpoint.keep_last": 5}
    return [{"cfg": common(**over), "run_dir": str(tmp / "sync")},
            {"cfg": common(**over, **{"checkpoint.async_save": True}), "run_dir": str(tmp / "async")},
            {"cut": {"src": str(tmp / "async"), "step": 2}, "run_dir": str(tmp / "resumed"),
             "cfg": common(**over, **{"checkpoint.async_save": True}), "resume": True}]


@pytest.mark.slow
def test_sharded_checkpoints_save_in_the_background(two_rank_launch):
    """FSDP on 2 gloo processes with dcp.async_save: the same losses and the same DCP checkpoints (every one
    read whole) as the synchronous run; the async run's step-2 checkpoint resumes to the same losses."""
    from test_parallel import losses

    tmp_path = two_rank_launch / "async"
    assert losses(tmp_path / "async") == losses(tmp_path / "sync") == losses(tmp_path / "resumed")
    a, b = ckpt.list_checkpoints(tmp_path / "sync"), ckpt.list_checkpoints(tmp_path / "async")
    assert [s for s, _ in a] == [s for s, _ in b] == [2, 4, 6] and all(p.suffix == ".dcp" for _, p in b)
    for (_, pa), (_, pb) in zip(a, b):
        ma, mb = ckpt.load_model(tmp_path, pa)[0].state_dict(), ckpt.load_model(tmp_path, pb)[0].state_dict()
        assert_same_tree(ma, mb, pb.name)
        ea, eb = ckpt.read_state(pa), ckpt.read_state(pb)
        assert_same_tree(ea["rng"], eb["rng"]) and ea["data_position"] == eb["data_position"]
    assert not list((tmp_path / "async" / "checkpoints").glob(".*"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_background_checkpoints_on_cuda_equal_synchronous_ones(tmp_path):
    """On CUDA the state is staged in pinned host buffers by asynchronous copies (the writer waits for them):
    the files hold exactly what a synchronous save holds."""
    over = {"train.device": "cuda", "train.max_steps": 6, "checkpoint.every_steps": 2, "checkpoint.keep_last": 10}
    train(tiny_cfg(**over), tmp_path / "sync", quiet=True)
    train(tiny_cfg(**over, **{"checkpoint.async_save": True}), tmp_path / "async", quiet=True)
    for (_, pa), (_, pb) in zip(ckpt.list_checkpoints(tmp_path / "sync"), ckpt.list_checkpoints(tmp_path / "async")):
        sa, sb = ckpt.read_state(pa), ckpt.read_state(pb)
        sa["config"]["checkpoint"].pop("async_save")
        sb["config"]["checkpoint"].pop("async_save")
        assert_same_tree(sa, sb, pa.name)
    assert background.PENDING.pinned  # the pinned staging buffers were used


def _count_while_writing(monkeypatch, folder: Path) -> list[int]:
    """Wrap both writers (the background one and the synchronous final save): before each write, the number of
    checkpoint files on disk plus the one about to be written; after it, the files on disk."""
    seen: list[int] = []

    def files() -> int:
        return len([p for p in folder.iterdir() if p.name.startswith("step_")]) if folder.is_dir() else 0

    def wrap(real):
        def write(state, path):
            seen.append(files() + 1)
            real(state, path)
            seen.append(files())
        return write

    monkeypatch.setattr(background.PENDING, "write", wrap(background.PENDING.write))
    monkeypatch.setattr(ckpt, "atomic_torch_save", wrap(ckpt.atomic_torch_save))
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [True, False])
def test_keep_last_1_never_holds_more_than_two_checkpoints(tmp_path, monkeypatch, async_save):
    """keep_last 1: at every save (three in the background, the final one synchronous) the folder holds at most
    two checkpoints, the one being written and the last good one; the run ends with the final checkpoint and the
    one before it, kept until the final one has proved itself by a finite next step (see test_trust_numerics.py)."""
    run = tmp_path / "run"
    seen = _count_while_writing(monkeypatch, run / "checkpoints")
    over = {"train.max_steps": 8, "checkpoint.every_steps": 2, "checkpoint.keep_last": 1,
            "checkpoint.async_save": async_save, "train.eval_batches": 0}
    train(tiny_cfg(**over), run, quiet=True)
    assert len(seen) == 8 and max(seen) == 2, seen  # four saves, before and after each
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [6, 8]
    assert not list((run / "checkpoints").glob(".*"))


def _tensor_bytes(run: Path) -> int:
    return ckpt.files.state_nbytes(ckpt.read_state(ckpt.list_checkpoints(run)[-1][1]))


@pytest.mark.slow
@pytest.mark.parametrize("over, peak", [
    ({"checkpoint.every_steps": 2, "checkpoint.keep_last": 2}, 3),  # saves 2, 4, 6, 8: keep_last + 1
    ({"checkpoint.every_steps": 0, "checkpoint.keep_last": 5}, 1),  # the final save alone: one
])
def test_the_disk_check_asks_for_the_documented_room(tmp_path, monkeypatch, capsys, over, peak):
    """Before writing, a save compares the free space with the documented need, peak x (tensor bytes + 1 MiB)
    with peak = min(keep_last + 1, the saves of the run), less the checkpoints already there: one byte short
    for the rest of the run is a warning with the numbers at the first save (the run goes on); one byte short
    for the checkpoint itself (with peak 1, the same) stops the run before anything is written; exactly enough
    is silent."""
    cfg = tiny_cfg(**{"train.max_steps": 8, "train.eval_batches": 0, **over})
    train(cfg, tmp_path / "measure", quiet=True)
    one = _tensor_bytes(tmp_path / "measure") + ckpt.files.SLACK_BYTES
    for free, run in ((peak * one, "enough"), (peak * one - 1, "short"))[: 1 + (peak > 1)]:
        monkeypatch.setattr(ckpt.files, "free_bytes", lambda folder, free=free: free)
        capsys.readouterr()
        train(cfg, tmp_path / run, quiet=True)
        err = capsys.readouterr().err
        assert ckpt.list_checkpoints(tmp_path / run)[-1][0] == 8
        warned = f"the run needs room for {peak} checkpoint(s) of {ckpt.files._gb(one)}"
        assert (warned in err and "0.0 MB short" in err) == (run == "short") and err.count(warned) <= 1, err
    monkeypatch.setattr(ckpt.files, "free_bytes", lambda folder: one - 1)
    with pytest.raises(CheckpointError, match=rf"not enough disk space .*step_0000000\d\.pt: the run needs room for "
                                              rf"{peak} checkpoint.*nothing was written"):
        train(cfg, tmp_path / "full", quiet=True)
    assert not ckpt.list_checkpoints(tmp_path / "full")
