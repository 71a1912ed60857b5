"""Answers that hold together: ``doctor`` offers ``--try`` only for what a run can measure; every figure of a
verdict comes from one window of steps (a resumed run too); a data-bound run whose cores are not all used gets
``data.num_workers`` with the number that fits; a ``bench ladder --smoke`` rung whose switch the tiny shapes
undid reports no speedup. Run directories are written by hand as the trainer writes them (no training)."""

from __future__ import annotations

import json

import pytest

from conftest import tiny_cfg
from test_doctor_confidence import TOKENS, recorded_run, window
from tokenmill import config as C
from tokenmill.bench import report
from tokenmill.bench.configs import rung_config
from tokenmill.bench.load import load_ladder
from tokenmill.profiling import rules, trial
from tokenmill.profiling.doctor import diagnose, format_verdict
from tokenmill.train.metrics import steady_figures

DATA_BOUND = [(100.0 + (i % 3), 95.0) for i in range(6)]  # 95% of every window waits for data


def _threads(d, cores: int, intra: int) -> None:
    s = json.loads((d / "summary.json").read_text())
    s["threads"] = {"intra_op": intra, "inter_op": 1, "cpu_count": cores, "local_world_size": 1}
    (d / "summary.json").write_text(json.dumps(s))


def test_try_is_offered_only_for_suggestions_a_run_can_measure(tmp_path):
    """Data-bound on 2 cores both training: the advice (too small a machine) is no override, and the verdict
    ends without ``--try``; with a core left free it names the workers that fit and offers ``--try``."""
    full = recorded_run(tmp_path / "full", DATA_BOUND)
    _threads(full, cores=2, intra=2)
    v = diagnose(full)
    assert v["main"] == "data_bound"
    top = v["findings"][0]
    assert not [s for s in top["suggestions"] if s["switch"]], top["suggestions"]
    assert "too small for the per-sample work" in top["suggestions"][0]["why"]
    assert trial.candidates(v, 2) == [] and "--try" not in format_verdict(v)  # --try would measure nothing

    free = recorded_run(tmp_path / "free", DATA_BOUND)
    _threads(free, cores=2, intra=1)  # one training thread: a core free
    v = diagnose(free)
    top = v["findings"][0]
    assert v["main"] == "data_bound" and top["suggestions"][0]["switch"] == "--data.num_workers 1"
    assert "too small for the per-sample work" in top["suggestions"][1]["why"]  # loading still limits it
    tries = trial.candidates(v, 2)
    assert tries[0]["switch"] == "--data.num_workers 1"  # what --try runs
    assert format_verdict(v).rstrip().endswith(f"--try {len(tries)}")


def _data_facts(workers: int, cores: int, intra: int, data_ms: float) -> dict:
    return {"config": {"data.num_workers": workers, "train.batch_size": 8}, "device": "cpu", "step_ms": 100.0,
            "data_ms": data_ms, "data_share": data_ms / 100.0,
            "threads": {"intra_op": intra, "cpu_count": cores, "local_world_size": 1}}


def test_workers_that_fit_the_free_cores():
    """One worker that cannot keep up (the step is its loading time, 100 ms against 5 ms of compute) and three
    free cores: three workers predict max(5, 100 / 3) ms. No split hides a 95 ms wait on 2 cores, one of them
    training: the free core still takes one worker (predicted max(5, 95) ms), beside the "too small" advice.
    Both cores training: no worker is offered."""
    f = _data_facts(workers=1, cores=4, intra=1, data_ms=97.0)
    plan = rules.loading_plan(f)
    assert not plan.too_small and (plan.workers, plan.predicted_ms) == (3, pytest.approx(100 / 3))
    assert rules.data_bound(f).suggestions[0]["switch"] == "--data.num_workers 3"

    small = _data_facts(workers=0, cores=2, intra=1, data_ms=95.0)
    assert rules.loading_plan(small).too_small
    sug = rules.data_bound(small).suggestions
    assert sug[0]["switch"] == "--data.num_workers 1" and "predicted step 95.0 ms, now 100.0 ms" in sug[0]["why"]
    assert "too small for the per-sample work" in sug[1]["why"]

    none_free = _data_facts(workers=0, cores=2, intra=2, data_ms=95.0)
    assert rules.loading_plan(none_free).too_small
    assert not any(s["switch"] for s in rules.data_bound(none_free).suggestions)


def test_a_resumed_run_reads_one_window_of_steps(tmp_path):
    """metrics.jsonl keeps the first process's rows up to the checkpoint (step 30) and appends the resumed
    one's; summary.json is the resumed process's (its windows after step 35). Step time, split, tokens/s and
    MFU all come from those windows: step time x tokens/s = tokens per step."""
    d = tmp_path / "r"
    d.mkdir()
    C.save(tiny_cfg(**{"log.every_steps": 10, "log.timing_warmup_steps": 5}), d / "config.toml")
    first = [window(s, 300.0, 10.0) for s in (10, 20, 30)]  # slow: another machine, or a loaded one
    second = [window(s, 100.0 + s % 3, 10.0) for s in (40, 50, 60, 70)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first + second))
    figures = steady_figures([r["tokens_per_sec"] for r in second], TOKENS)
    summary = {"steps": 70, "start_step": 30, "tokens_per_step": TOKENS, "device": "cpu", "mfu": 0.01,
               **figures, "timing_from_step": 35}
    (d / "summary.json").write_text(json.dumps(summary))
    fig = diagnose(d)["figures"]
    assert fig["tokens_per_sec"] == summary["tokens_per_sec"]
    assert fig["step_ms"] == pytest.approx(figures["step_time_ms"], rel=1e-12)
    assert fig["step_ms"] * fig["tokens_per_sec"] == pytest.approx(1000 * TOKENS, rel=1e-12)
    assert "of 4" in fig["windows"]  # the resumed process's four windows, not seven

    # a summary that does not say which steps (an older version): the verdict's tokens/s and MFU are taken
    # from the windows its step time comes from, and the text says so
    (d / "summary.json").write_text(json.dumps({k: v for k, v in summary.items() if k != "timing_from_step"}))
    v = diagnose(d)
    fig = v["figures"]
    assert fig["step_ms"] * fig["tokens_per_sec"] == pytest.approx(1000 * TOKENS, rel=1e-12)
    assert fig["tokens_per_sec"] < summary["tokens_per_sec"] and fig["tokens_per_sec_source"] == "metrics.jsonl"
    assert v["findings"] is not None and "over the same windows" in format_verdict(v)


def _smoke_doc(names: list[str]) -> dict:
    """The llama ladder's rungs ``names`` measured under --smoke (configs resolved as the runner does; the
    figures are made up: tokens/s 1000, 1100, ...)."""
    ladder = load_ladder("llama")
    index = {r.name: i for i, r in enumerate(ladder.rungs)}
    doc = report.new_document(ladder, {}, True, None)
    carried: list[int] = []
    for k, name in enumerate(names):
        i = index[name]
        rec = report.new_record(ladder, i, ladder.rungs[i], carried)
        rec["config"] = rung_config(ladder, i, carried, smoke=True).config.to_dict()
        rec["status"] = "measured"
        rec["summary"] = {"tokens_per_sec": 1000.0 + 100 * k, "tokens_per_step": 64, "final_loss": 4.0}
        doc["rungs"].append(rec)
        carried.append(i)
    return doc


def test_a_smoke_ladder_reports_no_speedup_for_a_switch_it_flattened():
    doc = _smoke_doc(["baseline", "fused-qkv", "batch-4", "chunked-loss", "batch-8"])
    report.derive(doc)
    m = {r["name"]: r["metrics"] for r in doc["rungs"]}
    assert all(r["config"]["train"]["batch_size"] == 1 for r in doc["rungs"])  # --smoke: 4 and 8 become 1
    for name in ("batch-4", "batch-8"):
        assert m[name]["flattened"] == ["train.batch_size"] and m[name]["speedup_vs_prev"] is None
    assert m["fused-qkv"]["speedup_vs_prev"] == pytest.approx(1.1) and m["fused-qkv"]["flattened"] == []
    assert m["chunked-loss"]["speedup_vs_prev"] == pytest.approx(1300 / 1200)
    table = report.markdown_table(doc)
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    assert table.count("flattened by --smoke") == 2 and "flattened by --smoke" in rows.get("batch-4", table)
    assert "flattened by --smoke" in report.one_line(doc["rungs"][2])
    real = _smoke_doc(["baseline", "batch-4"])
    real["smoke"] = False
    report.derive(real)
    assert real["rungs"][1]["metrics"]["flattened"] == []
