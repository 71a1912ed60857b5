"""Run training configs in fresh subprocesses; run a ladder rung by rung.

Each run is ``python -m tokenmill train --config rung.toml --run-dir DIR`` (through
``python -m torch.distributed.run --standalone --nproc-per-node N`` for multi-process rungs), so the
CUDA allocator, compile caches in memory and peak-memory statistics start clean every time. A run
that exits non-zero, or runs past its time limit, is a failure with a one-line reason.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from tokenmill import config as C

OOM_MARKERS = ("out of memory", "outofmemoryerror", "cublas_status_alloc_failed", "cudaerrormemoryallocation")


@dataclass
class RunResult:
    """The outcome of one training subprocess."""

    ok: bool
    rc: Optional[int]
    wall_s: float
    summary: Optional[dict[str, Any]] = None
    reason: Optional[str] = None
    oom: bool = False
    timed_out: bool = False
    command: list[str] = field(default_factory=list)
    stderr_tail: list[str] = field(default_factory=list)


def train_command(config_path: Path, run_dir: Path, launcher: Optional[str] = None, nproc: int = 1) -> list[str]:
    cmd = [sys.executable]
    if launcher == "torchrun":
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return cmd + ["-m", "tokenmill", "train", "--config", str(config_path), "--run-dir", str(run_dir)]


def failure_reason(stderr: str, rc: Optional[int]) -> str:
    """One line saying why a run failed: tokenmill's own error line, else the last exception line,
    else the last line of stderr."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("tokenmill: ") and "error" in ln.split(":", 2)[1]:
            return ln.split(":", 2)[2].strip()
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        if head.endswith(("Error", "Exception")) and " " not in head:
            return ln
    if lines:
        return lines[-1]
    return f"exit status {rc} with no error output"


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop the run and its children (it leads its own process group)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_train(
    cfg: C.Config,
    run_dir: Path,
    timeout_s: float,
    launcher: Optional[str] = None,
    nproc: int = 1,
    echo: Optional[Callable[[str], None]] = None,
) -> RunResult:
    """Train ``cfg`` in a subprocess into a fresh ``run_dir``. ``echo`` gets each stdout line.

    Files: ``run_dir/rung.toml`` (the resolved config), ``stdout.log``, ``stderr.log`` and the
    trainer's own ``summary.json`` / ``metrics.jsonl``.
    """
    run_dir = Path(run_dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    config_path = run_dir / "rung.toml"
    C.save(cfg, config_path)
    cmd = train_command(config_path, run_dir, launcher, nproc)
    _threads_note(cfg, nproc)
    rc, timed_out, wall = _run_logged(cmd, run_dir, timeout_s, echo)
    stderr = (run_dir / "stderr.log").read_text(errors="replace")
    oom = any(m in stderr.lower() for m in OOM_MARKERS)
    res = RunResult(ok=False, rc=rc, wall_s=wall, oom=oom, timed_out=timed_out, command=cmd,
                    stderr_tail=stderr.splitlines()[-40:])
    if timed_out:
        res.reason = f"timed out after {timeout_s:.0f} s"
    elif rc != 0:
        reason = failure_reason(stderr, rc)
        res.reason = f"out of memory: {reason}" if oom and "out of memory" not in reason.lower() else reason
    else:
        res.reason = _summary_problem(res, run_dir, nproc)
        res.ok = res.reason is None
    return res


def _threads_note(cfg: C.Config, nproc: int) -> None:
    """Say the CPU-threads note (too many threads for the free cores) once for the whole ladder, for a rung
    that runs on the CPU with ``nproc`` processes; its rungs never repeat it."""
    from tokenmill.train.device import NOTED_ENV, contention_note, thread_settings

    if cfg.train.device not in ("cpu", "auto") or os.environ.get(NOTED_ENV):
        return
    if cfg.train.device == "auto":
        import torch

        if torch.cuda.is_available() or torch.backends.mps.is_available():
            return
    if (note := contention_note({**thread_settings(), "local_world_size": nproc})) is not None:
        print(note, flush=True)


def _run_logged(cmd: list[str], run_dir: Path, timeout_s: float,
                echo: Optional[Callable[[str], None]]) -> tuple[int, bool, float]:
    """Run ``cmd`` in its own session, stdout to ``run_dir/stdout.log`` (and ``echo``), stderr to
    ``stderr.log``; the whole group is killed on timeout or on any exception here (a Ctrl-C).
    Returns (exit code, timed out, wall seconds)."""
    from tokenmill.train.device import NOTED_ENV

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env[NOTED_ENV] = "1"  # the CPU-threads note is the ladder's to say, once (_threads_note), not each rung's
    t0 = time.perf_counter()
    timed_out = False
    with open(run_dir / "stderr.log", "w") as err, open(run_dir / "stdout.log", "w") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                                start_new_session=True)

        def pump() -> None:
            for line in proc.stdout:
                out.write(line)
                if echo is not None:
                    echo(line.rstrip("\n"))

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
        except BaseException:
            _kill_group(proc)
            raise
        reader.join(timeout=10)
    return proc.returncode, timed_out, time.perf_counter() - t0


def _summary_problem(res: RunResult, run_dir: Path, nproc: int) -> Optional[str]:
    """Read a finished run's ``summary.json`` into ``res``; why it is not a measurement (None: it is)."""
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        return "the run exited 0 but wrote no summary.json"
    res.summary = json.loads(summary_path.read_text())
    if nproc > 1 and res.summary.get("world_size") != nproc:
        return (f"launched {nproc} processes but summary.json reports world_size="
                f"{res.summary.get('world_size')!r}: the trainer did not run distributed")
    if not res.summary.get("tokens_per_sec"):
        return "no steady-state tokens/s (no timed window: too few steps after warm-up?)"
    return None
