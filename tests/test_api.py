"""docs/api.md: the documented Python API snippet runs exactly as written (in a fresh folder holding the
one file it starts from, ``my_text.txt``), and does what its comments say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.train.metrics import read_metrics

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"
TEXT = "def area(r):\n    return 3.14 * r ** 2  # aire, 面積\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 80


def api_snippet() -> str:
    body = DOC.read_text().split("<!-- api-example:start -->", 1)[1].split("<!-- api-example:end -->", 1)[0]
    return body.split("```python", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_documented_snippet_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_text.txt").write_text(TEXT)
    scope: dict = {"__name__": "__main__"}
    exec(compile(api_snippet(), str(DOC), "exec"), scope)
    out = capsys.readouterr().out

    # trained, loaded, generated, evaluated and fine-tuned, as the comments say
    assert scope["steps"] == list(range(1, 31)) and f"{len(scope['steps'])} steps" in out
    assert scope["path"].name == "step_00000030.pt"
    assert scope["out"].shape == (2, scope["prompt"].size(1) + 40) and sum(ln[1:5] == "def " for ln in out.splitlines()) == 2
    result = json.loads((tmp_path / "runs" / "notebook" / "eval.json").read_text())
    assert result["val_loss"] == pytest.approx(scope["result"]["val_loss"]) and result["whole_split"]
    assert f"perplexity {result['perplexity']:.1f}" in out
    ft = tmp_path / "runs" / "notebook-ft"
    assert [r["step"] for r in read_metrics(ft) if "loss" in r][-1] == 10
    assert "init_from = " in (ft / "config.toml").read_text()
    # the fine-tuning run took the source's shape, not the defaults (12 layers of width 768)
    assert (scope["ft"].model.n_layer, scope["ft"].model.n_embd) == (12, 768)
    from tokenmill.checkpoint import load_model

    assert load_model(ft)[1].model.n_embd == scope["cfg"].model.n_embd == 32
