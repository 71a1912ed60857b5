"""docs/sft.md runs as written: every fenced ``bash`` block's commands in order (``export`` lines set the variables
the test has not set; ``echo TEXT | tokenmill ...`` feeds TEXT to stdin), then its ``python`` block, in a fresh
folder holding what the page starts from: a tiny random Llama folder ($MODEL, with the Llama 3 template) and a
chat JSONL ($DATA). Only $STEPS and $CONTEXT are the test's (2 optimizer steps of 64-token windows)."""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from test_chat_cli import _llama  # noqa: E402
from test_sft_train import conversations  # noqa: E402
from tokenmill.cli import main  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "sft.md"


def blocks() -> list[tuple[str, str]]:
    """(language, code) of each fenced bash / python block, in order."""
    return re.findall(r"```(bash|python)\n(.*?)```", DOC.read_text(), re.S)


def commands(code: str) -> list[str]:
    lines = code.replace("\\\n", " ").splitlines()
    return [ln.split(" #")[0].strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def run_line(line: str, monkeypatch) -> None:
    if line.startswith("export "):
        for assignment in shlex.split(line)[1:]:
            name, _, value = assignment.partition("=")
            if name not in os.environ:  # the test's own values win
                monkeypatch.setenv(name, value)
        return
    stdin = "Hello!\n"  # what the user types at the interactive chat
    if line.startswith("echo "):
        said, _, line = line.partition("|")
        stdin = shlex.split(said)[1] + "\n"
    argv = shlex.split(os.path.expandvars(line.strip()))
    assert argv[0] == "tokenmill", line
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    assert main(argv[1:]) == 0, line


@pytest.mark.slow
def test_sft_walkthrough_runs_as_written(tmp_path, monkeypatch, capsys):
    _llama(tmp_path / "models" / "tiny-llama")
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in conversations(40)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MODEL", "models/tiny-llama")
    monkeypatch.setenv("DATA", "chats.jsonl")
    monkeypatch.setenv("STEPS", "2")
    monkeypatch.setenv("CONTEXT", "64")
    found = blocks()
    assert [lang for lang, _ in found].count("python") == 1
    ran = []
    for lang, code in found:
        if lang == "python":
            exec(compile(code, str(DOC), "exec"), {})
            continue
        for line in commands(code):
            run_line(line, monkeypatch)
            ran.append(line.split("|")[-1].split()[:2])
    assert [c[1] for c in ran if c[0] == "tokenmill"] == ["chat", "prepare", "train", "train", "chat", "chat",
                                                          "export", "export"]
    out = capsys.readouterr().out
    for run in ("runs/sft", "runs/sft-lora"):
        assert json.loads((tmp_path / run / "summary.json").read_text())["steps"] == 2
    for folder in ("sft-model", "sft-lora-model"):
        assert (tmp_path / folder / "chat_template.jinja").read_text() == (tmp_path / "data/sft/chat_template.jinja").read_text()
    assert out.strip()  # the replies and the pipeline's answer were printed
