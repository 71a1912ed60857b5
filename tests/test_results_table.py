"""benchmarks/results_table.py: the README's measured-results section comes only from committed result
files of GPU runs (the inputs here are hand-written test documents, not measurements)."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("results_table", ROOT / "benchmarks" / "results_table.py")
rt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rt)


def ladder_doc(gpu: str, smoke: bool = False) -> dict:
    return {"ladder": {"name": "rasbt"}, "smoke": smoke, "torch": "2.11.0", "cuda": "12.8", "date": "2026-11-23T10:00",
            "git_commit": "0123456789abcdef", "environment": {"gpu_names": [gpu] if gpu else []},
            "rungs": [{"name": "baseline", "status": "measured", "reference": {"tokens_per_sec": 12525},
                       "reference_check": None,
                       "metrics": {"tokens_per_sec": 30000.4, "mfu_bf16": 0.1234, "peak_alloc_mb": 2048.0}},
                      {"name": "tf32", "status": "skipped", "metrics": None}]}


def test_rows_come_from_gpu_result_files_only(tmp_path, monkeypatch):
    monkeypatch.setattr(rt, "ROOT", tmp_path)
    res = tmp_path / "benchmarks" / "results"
    (res / "2026-11-23-h100").mkdir(parents=True)
    (res / "2026-11-23-h100" / "rasbt-ladder.json").write_text(json.dumps(ladder_doc("NVIDIA H100 80GB HBM3")))
    (res / "2026-11-23-h100" / "smoke-ladder.json").write_text(json.dumps(ladder_doc("NVIDIA H100", smoke=True)))
    (res / "2026-11-23-h100" / "cpu-ladder.json").write_text(json.dumps(ladder_doc("")))
    text = rt.table(res)
    rows = [line for line in text.splitlines() if line.startswith("| rasbt")]
    assert rows == ["| rasbt | baseline | 30,000 | 12.3% | 2.00 | 12,525 |  | NVIDIA H100 80GB HBM3, torch 2.11.0, "
                    "CUDA 12.8, 2026-11-23, 0123456789 | `benchmarks/results/2026-11-23-h100/rasbt-ladder.json` |"]


def test_no_results_says_so_and_the_readme_round_trips(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{rt.START}\nold table\n{rt.END}\nrest\n")
    assert rt.update_readme(readme, tmp_path / "nothing")
    assert readme.read_text() == f"intro\n{rt.START}\n{rt.NONE_YET}{rt.END}\nrest\n"
    assert not rt.update_readme(readme, tmp_path / "nothing")


def test_the_readme_section_is_what_the_committed_results_give():
    """The README quotes no GPU figure that a committed result file does not back."""
    text = (ROOT / "README.md").read_text()
    section = text.split(rt.START)[1].split(rt.END)[0]
    assert section.strip() == rt.table(ROOT / "benchmarks" / "results").strip()
