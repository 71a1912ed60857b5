"""Long commands say how far they are, with a rate and an ETA, also when the output is not a terminal
(a log file, CI, nohup): train's log lines and eval's progress lines."""

import re
import subprocess
import sys

import pytest

from conftest import cpu_env, run_cli
from tokenmill.train.metrics import Progress, format_duration

ETA = re.compile(r"(\d+)/(\d+) \((\d+)%\) \| [\d.,]+ (step|batch)/s \| ETA (\d+h\d\dm|\d+m\d\ds|\d+s)")


def run(*args):
    return subprocess.run([sys.executable, "-m", "tokenmill", *args], capture_output=True, text=True,
                          env=cpu_env(), timeout=300)


def test_format_duration():
    assert [format_duration(s) for s in (0, 12.4, 284, 10_920, float("inf"))] == ["0s", "12s", "4m44s", "3h02m", "?"]


def test_plain_progress_status_counts_from_the_resumed_step():
    p = Progress("plain", total=100, initial=40)
    assert p.status() == ""  # nothing done yet in this invocation: no rate to quote
    p.update(10)
    m = ETA.search(p.status())
    assert m and m.group(1, 2, 3) == ("50", "100", "50"), p.status()


@pytest.mark.slow
def test_train_and_eval_print_rate_and_eta_to_a_pipe(tmp_path):
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text(" ".join(["the cat sat on a mat and the dog ran"] * 800))
    data, run_dir = tmp_path / "data", tmp_path / "run"
    assert run_cli("prepare", text, "--out", data, "--tokenizer", "bytes").returncode == 0  # the pipe: train and eval
    # train in this process (its stdout is not a terminal either); eval's progress goes to a real pipe
    out = run_cli("train", "--preset", "tiny", "--data.path", data, "--run-dir", run_dir,
                  "--train.max_steps", "20", "--log.every_steps", "10", "--train.device", "cpu")
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("step") and "loss" in line
             and "val_loss" not in line]
    found = [ETA.search(line) for line in lines]
    assert all(found) and [m.group(1) for m in found] == ["10", "20"], out.stdout
    ev = run("eval", "--run-dir", str(run_dir), "--batches", "20")
    assert ev.returncode == 0, ev.stderr
    progress = [m for m in map(ETA.search, ev.stderr.splitlines()) if m]
    assert progress and progress[-1].group(1, 2, 4) == ("20", "20", "batch"), ev.stderr
