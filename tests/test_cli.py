"""End to end through the real command line: prepare -> train -> sample, reproduce, kill and resume."""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cpu_env, run_cli
from tokenmill.cli import main
from tokenmill.train.metrics import read_metrics

TINY = ["--preset", "tiny", "--train.device", "cpu", "--log.progress", "plain"]
SYNTH = ["--data.source", "synthetic", "--model.vocab_size", "64"]


def tm(*args, check=True):
    """``tokenmill ARGS`` in this process (conftest.run_cli); the killed-run test keeps a real process."""
    out = run_cli(*args)
    if check and out.returncode != 0:
        raise AssertionError(f"tokenmill {args} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out


def step_losses(run_dir):
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir) if r.get("loss") is not None]


@pytest.mark.slow
def test_prepare_train_sample_and_reproduce(tmp_path):
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(4):
        (texts / f"doc{i}.txt").write_text(("the quick brown fox jumps over the lazy dog. " * 40) + f"doc {i}\n")
    tm("prepare", texts, "--out", tmp_path / "data", "--tokenizer", "bpe", "--vocab-size", "300", "--no-progress")
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert meta["tokenizer"]["name"] == "bpe" and meta["vocab_size"] <= 300

    run = tmp_path / "run"
    out = tm("train", *TINY, "--data.path", tmp_path / "data", "--train.max_steps", 6, "--log.every_steps", 2,
             "--run-dir", run)
    assert "tokens/s" in out.stdout
    rows = read_metrics(run)
    assert [r["step"] for r in rows if "loss" in r] == [2, 4, 6]
    assert any("val_loss" in r for r in rows)

    sample = tm("sample", "--run-dir", run, "--prompt", "the quick", "--max-new-tokens", 20)
    assert sample.stdout.startswith("the quick")

    # the saved config reproduces the run exactly
    again = tmp_path / "again"
    tm("train", "--config", run / "config.toml", "--run-dir", again)
    assert step_losses(again) == step_losses(run)


@pytest.mark.slow
def test_embedded_corpus_is_prepared_once(tmp_path):
    args = [*TINY, "--data.tokenizer", "bytes", "--train.max_steps", 2, "--train.eval_batches", 1]
    first = tm("train", *args, "--run-dir", tmp_path / "a")
    assert "preparing" in (first.stdout + first.stderr).lower()
    second = tm("train", *args, "--run-dir", tmp_path / "b")
    assert "preparing" not in (second.stdout + second.stderr).lower()
    assert step_losses(tmp_path / "a") == step_losses(tmp_path / "b")


@pytest.mark.slow
def test_errors_are_clear_and_exit_nonzero(tmp_path):
    out = tm("train", *TINY, "--data.path", tmp_path / "nothing-here", "--run-dir", tmp_path / "r", check=False)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "nothing-here" in out.stderr
    out = tm("sample", "--run-dir", tmp_path / "empty", check=False)
    assert out.returncode == 1 and "there is no run directory" in out.stderr


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_trajectory(tmp_path):
    common = [*TINY, *SYNTH, "--train.max_steps", 30, "--log.every_steps", 1, "--checkpoint.every_steps", 4,
              "--model.dropout", 0.1]
    tm("train", *common, "--run-dir", tmp_path / "full")

    cut = tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill", "train", *map(str, common), "--run-dir", str(cut)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=cpu_env())
    deadline = time.time() + 120
    while time.time() < deadline:
        done = [s for s, _ in step_losses(cut)] if (cut / "metrics.jsonl").exists() else []
        if done and done[-1] >= 14:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = step_losses(cut)[-1][0]
    assert killed_at < 30, "the run finished before it could be killed"

    tm("train", *common, "--run-dir", cut, "--resume")
    assert step_losses(cut) == step_losses(tmp_path / "full")  # bit-exact on CPU


@pytest.mark.slow
def test_parallel_errors_are_clear_and_suggest_torchrun(tmp_path):
    """A parallel layout in one process (no torchrun) stops with the message, no traceback."""
    out = tm("train", *TINY, *SYNTH, "--parallel.tp", 2, "--model.fused_qkv", "false", "--run-dir", tmp_path / "r",
             check=False)
    assert out.returncode == 1, out.stderr
    assert out.stderr.startswith("tokenmill: error:") and "Traceback" not in out.stderr, out.stderr
    assert "torchrun --nproc-per-node 2 -m tokenmill train" in out.stderr


@pytest.mark.slow
def test_every_error_class_lives_in_errors_and_is_a_tokenmill_error():
    """One error hierarchy: every exception class tokenmill defines is in tokenmill/errors.py and derives
    from TokenmillError (which the CLI prints without a traceback)."""
    import ast

    from tokenmill import errors

    src = Path(errors.__file__).parent
    elsewhere = []
    for path in src.rglob("*.py"):
        if path.name == "errors.py" and path.parent == src:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                getattr(b, "id", getattr(b, "attr", "")).endswith(("Error", "Exception")) for b in node.bases
            ):
                elsewhere.append(f"{path.relative_to(src)}:{node.name}")
    assert not elsewhere, elsewhere
    defined = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)]
    assert len(defined) >= 10
    assert all(issubclass(c, errors.TokenmillError) for c in defined)




def test_help_lists_every_command(capsys):
    """`tokenmill --help` names each sub-command the parser has (generated, so it cannot go stale), and the
    README mentions each of them."""
    from pathlib import Path

    from tokenmill.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for name in commands:
        assert f"    {name} " in out, name
        assert f"tokenmill {name}" in readme, f"README never shows `tokenmill {name}`"
