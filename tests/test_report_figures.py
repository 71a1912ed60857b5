"""One source for each figure: the trainer's summary, the doctor and the ladder report agree on tokens/s and
step time (tokens/s == tokens per step / step time, from the same windows), each says which windows it used,
and the ladder plot draws the spread over windows on axes that fit the data."""

from __future__ import annotations

import json

import pytest

from conftest import tiny_cfg
from tokenmill.bench import report
from tokenmill.bench.plot import figure, value_axis, window_span
from tokenmill.profiling.doctor import diagnose, format_verdict
from tokenmill.train.metrics import read_metrics
from tokenmill.train.trainer import train


@pytest.mark.slow
def test_summary_doctor_and_ladder_read_one_figure(tmp_path):
    cfg = tiny_cfg(**{"train.max_steps": 9, "log.every_steps": 2, "log.timing_warmup_steps": 1,
                      "train.eval_batches": 0, "checkpoint.save_final": False})
    train(cfg, tmp_path, quiet=True)
    s = json.loads((tmp_path / "summary.json").read_text())
    rows = [r for r in read_metrics(tmp_path) if r.get("tokens_per_sec")]
    assert s["timing_windows"] == len(rows) == len(s["tokens_per_sec_windows"]) >= 2
    assert s["tokens_per_sec_windows"] == [r["tokens_per_sec"] for r in rows]  # the logged windows, all of them
    assert s["step_time_ms"] * s["tokens_per_sec"] == pytest.approx(1000 * s["tokens_per_step"], rel=1e-12)
    assert all(r["step"] > s["timing_from_step"] for r in rows)

    v = diagnose(tmp_path)
    assert v["figures"]["step_ms"] == pytest.approx(s["step_time_ms"], rel=1e-12)
    assert v["figures"]["tokens_per_sec"] == s["tokens_per_sec"]
    assert f"of {len(rows)}" in v["figures"]["windows"]
    text = format_verdict(v)
    assert f"{s['tokens_per_sec']:,.0f} tokens/s as in summary.json" in text and "split over log windows" in text

    m = report.rung_metrics({"summary": s, "plan": None}, None)
    assert (m["tokens_per_sec"], m["step_time_ms"]) == (s["tokens_per_sec"], s["step_time_ms"])
    assert m["windows"] == f"median of {len(rows)} windows after step {s['timing_from_step']}"


def test_ladder_step_time_is_derived_from_tokens_per_second():
    """A summary of an older version took the median step time on its own (4 windows: it differs from
    tokens per step / the median tokens/s); the report shows the one that agrees with tokens/s."""
    windows = [1000.0, 1100.0, 1300.0, 2000.0]
    s = {"tokens_per_sec": 1200.0, "tokens_per_sec_windows": windows, "tokens_per_sec_min": 1000.0,
         "tokens_per_sec_max": 2000.0, "tokens_per_step": 120, "step_time_ms": 1000 * (120 / 1100 + 120 / 1300) / 2}
    m = report.rung_metrics({"summary": s}, None)
    assert m["step_time_ms"] == pytest.approx(100.0) and m["windows"] == "median of 4 windows"


def ladder_doc(device: str) -> dict:
    """A measured two-rung ladder (plus a skipped one) as ``tokenmill bench`` records it."""
    def summary(tps, lo, hi):
        out = {"tokens_per_sec": tps, "tokens_per_sec_min": lo, "tokens_per_sec_max": hi, "tokens_per_step": 128,
               "final_loss": 4.0, "device": device, "timing_windows": 5, "timing_from_step": 3}
        if device == "cuda":
            out.update(peak_alloc_mb=3000.0 * tps / 1000, peak_reserved_mb=4000.0 * tps / 1000)
        return out

    rungs = [(summary(1000.0, 900.0, 1400.0), "measured"), (summary(1500.0, 1200.0, 2600.0), "measured"),
             (None, "skipped")]
    doc = {"ladder": {"name": "t", "headline": "tokens_per_sec", "samples": None, "measure": {},
                      "reference": {}}, "smoke": False, "gpu": device, "torch": "x", "rungs": []}
    for i, (s, status) in enumerate(rungs):
        doc["rungs"].append({"index": i, "name": f"r{i}", "status": status, "reason": None, "summary": s,
                             "reference": {}, "dropped": [], "set": {}, "explain": "", "plan": None})
    report.derive(doc)
    return doc


def test_cpu_ladder_plot_is_one_panel_with_window_spread():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    doc = ladder_doc("cpu")
    fig = figure(doc)
    try:
        (ax,) = fig.axes  # no memory figures: no empty memory panel
        lo, hi = ax.get_xlim()
        assert lo == 0 and hi >= 2600.0  # covers the highest window, not just the medians
        assert hi == pytest.approx(value_axis([1000.0, 1500.0, None], [1400.0, 2600.0])[1])
        bars = [c for c in ax.containers if type(c).__name__ == "ErrorbarContainer"]
        assert len(bars) == 1
        segments = bars[0].lines[2][0].get_segments()  # one min-max segment per measured rung
        assert sorted((round(p[0][0]), round(p[1][0])) for p in segments) == [(900, 1400), (1200, 2600)]
    finally:
        plt.close(fig)
    table = report.markdown_table(doc)
    assert "| windows |" in table and "median of 5 windows after step 3" in table


def test_gpu_ladder_plot_keeps_the_memory_panel_within_its_axis():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    fig = figure(ladder_doc("cuda"))
    try:
        left, right = fig.axes
        assert right.get_xlim()[1] >= 4000.0 * 1.5 / 1024  # the largest reserved peak (GB) fits
        assert left.get_xlim()[1] >= 2600.0
    finally:
        plt.close(fig)


def test_window_span_of_a_time_headline_is_inverse():
    m = {"tokens_per_sec": 1000.0, "tokens_per_sec_min": 800.0, "tokens_per_sec_max": 1250.0,
         "time_for_samples_s": 10.0}
    assert window_span(m, "time_for_samples_s") == pytest.approx((8.0, 12.5))
    assert window_span({**m, "tokens_per_sec_min": 1, "tokens_per_sec_max": 2}, "tokens_per_sec") == (None, None)
