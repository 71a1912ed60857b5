"""``python -m tokenmill`` ends a successful command without the interpreter's teardown
(``tokenmill.__main__._exit``): what the process printed, what its exit functions write and what a thread that
is still running finishes must all survive it, and a failed command keeps its exit code."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # each case is a process of its own


def _run(body: str, tmp_path) -> subprocess.CompletedProcess:
    script = "import atexit, sys, threading, time\nfrom tokenmill.__main__ import _exit\n" + textwrap.dedent(body)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # Python's own buffers, as users run it
    return subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env=env)


def test_a_successful_exit_keeps_the_output_and_runs_the_exit_functions(tmp_path):
    p = _run("""
        atexit.register(lambda: open("atexit.txt", "w").write("ran"))
        sys.stdout.write("x" * 200_000)  # written through at once (larger than the stream's buffer)
        sys.stdout.write("tail")  # still in the buffer: lost without a flush
        print("last line", file=sys.stderr)
        _exit(0)
    """, tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "x" * 200_000 + "tail" and p.stderr == "last line\n"
    assert (tmp_path / "atexit.txt").read_text() == "ran"


def test_a_running_thread_is_waited_for_and_a_failure_keeps_its_code(tmp_path):
    p = _run("""
        def work():
            time.sleep(0.5)
            open("thread.txt", "w").write("finished")
        threading.Thread(target=work).start()  # not a daemon: the usual exit joins it
        _exit(0)
    """, tmp_path)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "thread.txt").read_text() == "finished"
    p = _run("""
        atexit.register(lambda: print("cleaned up"))
        _exit(3)
    """, tmp_path)
    assert p.returncode == 3 and p.stdout == "cleaned up\n", (p.returncode, p.stdout, p.stderr)
