import multiprocessing.process
import os
import subprocess

import pytest
import torch

from tokenmill import config as C

torch.set_num_threads(1)  # tiny models: more threads only add contention on 2-core CI


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Each test session prepares the embedded corpus in its own cache folder, never the user's."""
    cache = tmp_path_factory.getbasetemp() / "tokenmill-cache"
    monkeypatch.setenv("TOKENMILL_CACHE", str(cache))
    monkeypatch.setenv("TOKENMILL_TEST", "1")


def tiny_cfg(**overrides) -> C.Config:
    """The tiny preset on synthetic tokens (vocab 64), quiet, on CPU."""
    base = {
        "data.source": "synthetic",
        "model.vocab_size": 64,
        "train.device": "cpu",
        "log.progress": "plain",
        "log.tensorboard": False,
        "train.precision": "fp32",  # what 'auto' gives on a CPU, recorded as such (test_defaults.py tests 'auto')
        "train.tf32": False,
    }
    base.update(overrides)
    return C.resolve("tiny", overrides=base, overrides_from_string=False)


def cpu_env() -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    return env


def block_import(monkeypatch, prefix: str) -> None:
    """Make ``import prefix...`` fail as if the package were not installed (for the install messages)."""
    import builtins

    real = builtins.__import__

    def refuse(name, *a, **k):
        if name.startswith(prefix):
            raise ImportError(f"No module named '{name}'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", refuse)


# ------------------------------------------------------------------------------------------------
# The quick tier (`pytest -m "not slow"`) starts no process: a test that starts one (a subprocess, a torchrun
# launch, DataLoader or prepare workers) is marked slow, and one that is not fails here, saying so.

_quick = {"item": None, "started": {}}  # the quick-tier test now running; nodeid -> what it started
_real_popen_init = subprocess.Popen.__init__
_real_process_start = multiprocessing.process.BaseProcess.start


def _refuse_in_quick_tier(what: str) -> None:
    item = _quick["item"]
    if item is not None:
        _quick["started"].setdefault(item.nodeid, []).append(what)
        pytest.fail(f"{item.nodeid} starts a process ({what}): mark this test slow (@pytest.mark.slow); the quick "
                    "tier (-m 'not slow') starts none", pytrace=False)


def _popen_init(self, args, *a, **k):
    _refuse_in_quick_tier(" ".join(map(str, args))[:120] if isinstance(args, (list, tuple)) else str(args)[:120])
    _real_popen_init(self, args, *a, **k)


def _process_start(self):
    _refuse_in_quick_tier(f"multiprocessing {type(self).__name__} {self.name}")
    _real_process_start(self)


subprocess.Popen.__init__ = _popen_init
multiprocessing.process.BaseProcess.start = _process_start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test without the slow (or gpu) marker is set up, run and torn down with process starts refused."""
    exempt = item.get_closest_marker("slow") or item.get_closest_marker("gpu")
    _quick["item"] = None if exempt else item
    try:
        yield
    finally:
        _quick["item"] = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A refused start that the test's code swallowed (or a thread raised) still fails the test."""
    rep = (yield).get_result()
    started = _quick["started"].pop(item.nodeid, None) if call.when == "teardown" else _quick["started"].get(item.nodeid)
    if started and rep.passed and call.when == "call":
        rep.outcome = "failed"
        rep.longrepr = (f"{item.nodeid} started a process ({started[0]}): mark this test slow (@pytest.mark.slow); "
                        "the quick tier (-m 'not slow') starts none")


# ------------------------------------------------------------------------------------------------
# The CLI in this process, for tests of what a command says and writes (not of the process itself: signals,
# exit by the interpreter, torchrun, pipes and locks between runs keep real processes). Importing torch in a
# new interpreter costs about 5 s on a 2-core CI machine; the suite runs a few hundred commands.

def run_cli(*args, cwd=None) -> subprocess.CompletedProcess:
    """``tokenmill ARGS`` through ``tokenmill.cli.main`` in this process, as ``subprocess.run(...,
    capture_output=True, text=True)`` would report it (a traceback becomes stderr and exit code 1, as the
    interpreter would end the process)."""
    import contextlib
    import io
    import traceback

    from tokenmill.cli import main

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            (contextlib.chdir(cwd) if cwd is not None else contextlib.nullcontext()):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse: --help, usage errors
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except Exception:  # noqa: BLE001 - reported as the process would report it
            traceback.print_exc(file=err)
            rc = 1
    return subprocess.CompletedProcess(["tokenmill", *argv], rc, out.getvalue(), err.getvalue())


# ------------------------------------------------------------------------------------------------
# One torchrun launch for the 2-rank jobs of several files (the module's two_rank_jobs(folder), each in its
# own folder) and one for the 4-rank jobs (four_rank_jobs): each launch costs every process's torch import
# (~5 s on a 2-core CI machine). The first pytest-xdist worker to ask runs it; the other waits and reads it.

TWO_RANK = {"gpt2": "test_parallel", "llama": "test_parallel_families", "muon": "test_muon",
            "lora": "test_lora_cli", "async": "test_async_checkpoint", "moe": "test_moe_everything",
            "sft_layouts": "test_sft_layouts", "sft": "test_sft_train", "moe_metrics": "test_moe_metrics",
            "ep": "test_expert_parallel", "hf": "test_hf_cli"}
FOUR_RANK = {"gpt2": "test_parallel", "llama": "test_parallel_families", "ep": "test_expert_parallel"}
_LAUNCH_USERS: dict[int, set[str]] = {2: set(), 4: set()}  # nproc -> the files whose selected tests read its launch


def pytest_collection_finish(session):
    """Only the files with a selected test that reads a shared launch add their jobs to it (a file imported by
    another, or with its launch tests deselected, adds none)."""
    for item in session.items:
        for nproc, fixture in ((2, "two_rank_launch"), (4, "four_rank_launch")):
            if fixture in getattr(item, "fixturenames", ()) and getattr(item, "module", None) is not None:
                _LAUNCH_USERS[nproc].add(item.module.__name__)


def _shared_launch(tmp_path_factory, nproc: int, modules: dict[str, str]):
    import fcntl
    import importlib
    import shutil
    import sys

    users = _LAUNCH_USERS[nproc] or set(sys.modules)  # the files this session runs that read this launch
    present = {folder: m for folder, m in modules.items() if m in sys.modules and m in users}
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by this session's workers
    tmp = root / f"launch{nproc}"
    with open(root / f"launch{nproc}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (tmp / "launched").exists():
            shutil.rmtree(tmp, ignore_errors=True)  # what a failed launch left: launched again
            tmp.mkdir()
            name = "two_rank_jobs" if nproc == 2 else "four_rank_jobs"
            jobs = [job for folder, m in present.items() for job in getattr(sys.modules[m], name)(tmp / folder)]
            # a job whose rank 1 dies on purpose (test_parallel's elastic restart) runs last, and torchrun
            # restarts the workers once for it; the restarted workers run only it (test_parallel._jobs_to_run)
            jobs.sort(key=lambda job: "kill_rank1_at_step" in job)
            restarts = sum("kill_rank1_at_step" in job for job in jobs)
            assert restarts <= 1, "one dying job a launch"
            importlib.import_module("test_parallel").launch(tmp, jobs, nproc=nproc, max_restarts=restarts,
                                                            timeout=600)
            (tmp / "launched").write_text(" ".join(present))
    return tmp


@pytest.fixture(scope="session")
def two_rank_launch(tmp_path_factory):
    return _shared_launch(tmp_path_factory, 2, TWO_RANK)


@pytest.fixture(scope="session")
def four_rank_launch(tmp_path_factory):
    return _shared_launch(tmp_path_factory, 4, FOUR_RANK)


def count_newton_schulz(monkeypatch) -> list:
    """Record every matrix Muon orthogonalises from now on, as (stacked experts, (rows, columns)), by wrapping
    tokenmill.optim.muon.newton_schulz; returns the list the wrapper fills."""
    from tokenmill.optim import muon as M

    seen: list[tuple[int, tuple[int, ...]]] = []
    real = M.newton_schulz

    def counting(g, *a, **kw):
        seen.append((g.shape[0] if g.ndim == 3 else 1, tuple(g.shape[-2:])))
        return real(g, *a, **kw)

    monkeypatch.setattr(M, "newton_schulz", counting)
    return seen
