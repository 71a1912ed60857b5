"""docs/data.md runs: its example-data script, then every `tokenmill` command on the page, in order."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tokenmill.cli import main

pytest.importorskip("pyarrow", reason="pyarrow is not installed (pip install 'tokenmill[corpora]')")
pytest.importorskip("zstandard", reason="zstandard is not installed (pip install 'tokenmill[corpora]')")
pytest.importorskip("tiktoken", reason="tiktoken is not installed (pip install 'tokenmill[gpt2]')")

DOC = Path(__file__).resolve().parents[1] / "docs" / "data.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)


@pytest.mark.slow
def test_every_command_of_the_data_page_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # offline: nothing listens there
    (script,) = blocks("python")
    exec(compile(script, str(DOC), "exec"), {"__name__": "example"})
    commands = [line for block in blocks("bash") for line in block.splitlines() if line.startswith("tokenmill ")]
    assert len(commands) >= 8
    kinds = set()
    for cmd in commands:
        argv = shlex.split(cmd)[1:]
        assert main(argv + (["--no-progress"] if argv[0] == "prepare" else ["--log.progress", "plain"])) == 0, cmd
        if argv[0] == "prepare":
            out = Path(argv[argv.index("--out") + 1])
            assert (out / "meta.json").is_file()
            kinds.update(Path(a).suffix for a in argv[1:] if a.startswith("example"))
    assert {".gz", ".zst", ".parquet", ""} <= kinds  # compressed JSONL, Parquet, folders (text, shards, HF)
    assert "skipped 0 bad record(s)" in capsys.readouterr().out
