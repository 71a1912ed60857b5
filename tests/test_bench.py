"""tokenmill bench: ladder files, smoke runs through the real CLI, failing rungs, sizing searches."""

import json
import math
import subprocess
import sys

import pytest
import torch

from conftest import cpu_env
from tokenmill import config as C
from tokenmill.bench import report
from tokenmill.bench.configs import plan_steps, rung_config
from tokenmill.bench.ladder import run_ladder
from tokenmill.bench.runner import failure_reason
from tokenmill.bench.schema import LadderError, Measure, load_ladder, shipped_ladders
from tokenmill.bench.sizing import (
    Probe,
    SizingError,
    count_params,
    model_shapes,
    search_max_batch,
    search_max_model,
)
from tokenmill.cli import main

CPU_ONLY = not torch.cuda.is_available()
CPU_ENV = {"cuda_available": False, "gpu_count": 0, "gpu_names": [], "torch": torch.__version__, "cuda": None}


# ----------------------------------------------------------------------------------------------
# Ladder files


@pytest.mark.parametrize("name", ["rasbt", "book-perf", "book-memory", "best", "scale-out"])
def test_shipped_ladder_parses_and_every_rung_resolves(name):
    assert name in shipped_ladders()
    ladder = load_ladder(name)  # parsing resolves every cumulative config, normal and --smoke
    for i, rung in enumerate(ladder.rungs):
        assert rung.explain and not rung.missing_fields()
        for smoke in (False, True):
            cfg = rung_config(ladder, i, smoke=smoke).config
            assert C.validate(cfg) is cfg
            for key, value in rung.set.items() if not smoke else ():  # the rung's own switch is in its config
                section, field = key.split(".")
                assert getattr(getattr(cfg, section), field) == value
            assert cfg.log.progress == "plain" and cfg.checkpoint.save_final is False


def test_rasbt_ladder_is_faithful():
    ladder = load_ladder("rasbt")
    assert [r.name for r in ladder.rungs] == [
        "baseline", "mask-on-the-fly", "tf32", "fused-adamw", "pin-memory", "bf16", "native-norm-gelu",
        "flash-attention", "compile", "vocab-pad-64", "batch-32"]
    base = rung_config(ladder, 0).config
    m, o = base.model, base.optim
    assert (m.tie_embeddings, m.qkv_bias, m.fused_qkv, m.attention, m.causal_mask, m.norm, m.gelu) == (
        False, False, False, "manual", "buffer", "manual", "manual")
    assert (m.dropout, m.block_size, base.train.batch_size, base.train.precision, base.data.num_workers) == (
        0.1, 1024, 8, "fp32", 4)
    assert (o.lr, o.weight_decay, o.decay_groups, o.schedule, o.grad_clip) == (5e-4, 0.1, False, "constant", 0.0)
    assert 162e6 < count_params(base) < 164e6  # the README's 163M (untied head)
    last = rung_config(ladder, len(ladder.rungs) - 1).config
    assert (last.train.precision, last.train.tf32, last.optim.impl, last.data.pin_memory) == ("bf16", True, "fused", True)
    assert (last.model.attention, last.compile.enabled, last.model.vocab_pad_multiple, last.train.batch_size) == (
        "sdpa", True, 64, 32)
    assert all(r.reference.get("tokens_per_sec") for r in ladder.rungs)


def test_book_ladders_shapes():
    mem = load_ladder("book-memory")
    assert 700e6 < count_params(rung_config(mem, 0).config) < 720e6  # the book's ~709M
    assert mem.rungs[-1].nproc == 2 and mem.requirement(mem.rungs[-1]) == "multi-gpu"
    perf = load_ladder("book-perf")
    plan = rung_config(perf, 0).plan
    assert plan.covers_samples and plan.timed_samples >= 10240
    assert perf.requirement(perf.rungs[-1]) == "multi-gpu"


def _write(tmp_path, text, name="mine.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


USER_LADDER = """
[ladder]
name = "mine"
description = "A user's ladder."
base_preset = "tiny"
[ladder.base]
"data.source" = "synthetic"
"model.vocab_size" = 64
[ladder.measure]
warmup_steps = 1
timed_steps = 4
windows = 2
"""


def test_unknown_override_key_gets_closest_suggestion(tmp_path, capsys):
    path = _write(tmp_path, USER_LADDER + '[[rung]]\nname = "a"\nexplain = "x"\nset = { "train.batchsize" = 4 }\n')
    with pytest.raises(LadderError, match=r"unknown config key 'train.batchsize'.*Did you mean 'train.batch_size'"):
        load_ladder(str(path))
    assert main(["bench", "ladder", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "Did you mean 'train.batch_size'" in capsys.readouterr().err
    bad_table = _write(tmp_path, USER_LADDER.replace("[ladder.measure]", "[ladder.measur]") + '[[rung]]\nname = "a"\n'
                       'explain = "x"\n', "bad.toml")
    with pytest.raises(LadderError, match="Did you mean 'measure'"):
        load_ladder(str(bad_table))
    owned = _write(tmp_path, USER_LADDER + '[[rung]]\nname = "a"\nexplain = "x"\nset = { "train.max_steps" = 4 }\n',
                   "owned.toml")
    with pytest.raises(LadderError, match=r"\[ladder.measure\]"):
        load_ladder(str(owned))
    with pytest.raises(LadderError, match="Did you mean 'rasbt'"):
        load_ladder("rasbtt")


def test_plan_steps_whole_windows():
    cfg = C.resolve("tiny", overrides={"train.batch_size": 32}, overrides_from_string=False)
    p = plan_steps(Measure(warmup_steps=5, timed_steps=40, windows=4), cfg, 1, None)
    assert (p.warmup_steps, p.timed_steps, p.every_steps, p.max_steps) == (10, 40, 10, 50)
    p = plan_steps(Measure(warmup_steps=10, windows=4, cover_samples=True), cfg, 2, 10240)
    assert p.samples_per_step == 64 and p.timed_samples >= 10240 and p.covers_samples
    assert p.max_steps == p.warmup_steps + p.timed_steps and p.timed_steps % p.every_steps == 0


def test_failure_reason_lines():
    assert failure_reason("noise\ntokenmill: error: train.device='cuda' but no GPU\n", 1) == (
        "train.device='cuda' but no GPU")
    tb = "Traceback (most recent call last):\n  File x\nRuntimeError: cuDNN attention cannot run here\n"
    assert failure_reason(tb, 1) == "RuntimeError: cuDNN attention cannot run here"
    assert "exit status 3" in failure_reason("", 3)


# ----------------------------------------------------------------------------------------------
# Running ladders


def test_failing_rung_is_reported_and_the_ladder_goes_on(tmp_path):
    rungs = """
[[rung]]
name = "broken-data"
explain = "points at token data that does not exist"
set = { "data.source" = "tokens", "data.path" = "/nonexistent/tokenmill-data" }

[[rung]]
name = "gpu-only"
explain = "declared to need CUDA"
set = { "train.precision" = "bf16" }
requires = "cuda"

[[rung]]
name = "future-field"
explain = "needs a field this tokenmill lacks"
set = { "model.no_such_field" = 1 }
needs = ["model.no_such_field"]

[[rung]]
name = "batch-2"
explain = "still runs, without the failed rung's switch"
set = { "train.batch_size" = 2 }
"""
    ladder = load_ladder(str(_write(tmp_path, USER_LADDER + rungs)))
    lines = []
    doc = run_ladder(ladder, tmp_path / "out", env=CPU_ENV, log=lines.append, cli_set={"train.device": "cpu"})
    by = {r["name"]: r for r in doc["rungs"]}
    assert by["broken-data"]["status"] == "failed"
    assert "/nonexistent/tokenmill-data" in by["broken-data"]["reason"]
    assert by["gpu-only"]["status"] == "skipped" and "CUDA" in by["gpu-only"]["reason"]
    assert by["future-field"]["status"] == "skipped" and "model.no_such_field" in by["future-field"]["reason"]
    after = by["batch-2"]
    assert after["status"] == "measured", after["reason"]
    assert after["dropped"] == ["broken-data", "gpu-only", "future-field"]
    assert after["config"]["data"]["source"] == "synthetic" and after["config"]["train"]["batch_size"] == 2
    assert after["metrics"]["tokens_per_sec"] > 0 and doc["baseline_rung"] == "batch-2"
    saved = json.loads((tmp_path / "out" / "ladder.json").read_text())
    assert [r["status"] for r in saved["rungs"]] == ["failed", "skipped", "skipped", "measured"]
    md = (tmp_path / "out" / "ladder.md").read_text()
    assert "failed:" in md and "/nonexistent/tokenmill-data" in md
    assert any("failed" in ln for ln in lines)


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    """rasbt and book-memory --smoke through the real CLI, run side by side."""
    root = tmp_path_factory.mktemp("bench-smoke")
    env = dict(cpu_env(), TOKENMILL_CACHE=str(root / "cache"))
    procs = {}
    for name in ("rasbt", "book-memory"):
        cmd = [sys.executable, "-m", "tokenmill", "bench", "ladder", name, "--smoke", "--quiet", "--out",
               str(root / name)]
        procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    results = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=600)
        results[name] = (p.returncode, out, err, root / name)
    return results


def _check_smoke(result, name):
    rc, out, err, folder = result
    assert rc == 0, f"{out}\n{err}"
    ladder = load_ladder(name)
    doc = json.loads((folder / "ladder.json").read_text())
    assert doc["smoke"] and doc["ladder"]["name"] == name and doc["torch"]
    assert "git_commit" in doc and doc["date"] and doc["host"]
    assert [r["name"] for r in doc["rungs"]] == [r.name for r in ladder.rungs]
    prev = base = None
    for r in doc["rungs"]:
        assert r["status"] in ("measured", "skipped"), (r["name"], r["reason"])
        if r["status"] == "skipped":
            assert r["reason"] and r["metrics"] is None
            continue
        m = r["metrics"]
        assert m["tokens_per_sec"] > 0 and m["tokens_per_sec_min"] <= m["tokens_per_sec"] <= m["tokens_per_sec_max"]
        assert math.isfinite(m["final_loss"]) and m["step_time_ms"] > 0
        base = base or m
        assert m["speedup_vs_baseline"] == pytest.approx(m["tokens_per_sec"] / base["tokens_per_sec"])
        if prev is None:
            assert m["speedup_vs_prev"] is None
        else:
            assert m["speedup_vs_prev"] == pytest.approx(m["tokens_per_sec"] / prev["tokens_per_sec"])
        prev = m
    md = (folder / "ladder.md").read_text()
    assert all(r.name in md for r in ladder.rungs)
    assert (folder / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.markdown_table(doc) in out  # the table is printed at the end
    return {r["name"]: r for r in doc["rungs"]}


def test_smoke_rasbt(smoke_runs):
    rungs = _check_smoke(smoke_runs["rasbt"], "rasbt")
    assert rungs["baseline"]["status"] == "measured" and rungs["batch-32"]["status"] == "measured"
    assert rungs["batch-32"]["config"]["train"]["batch_size"] > rungs["baseline"]["config"]["train"]["batch_size"]
    assert rungs["baseline"]["config"]["model"]["n_layer"] == 2
    if CPU_ONLY:
        for name in ("tf32", "pin-memory", "bf16"):
            assert rungs[name]["status"] == "skipped" and "CUDA" in rungs[name]["reason"]
        assert rungs["compile"]["status"] == "skipped" and "torch.compile" in rungs["compile"]["reason"]
        assert rungs["native-norm-gelu"]["config"]["train"]["precision"] == "fp32"  # bf16 was not carried


def test_smoke_book_memory(smoke_runs):
    rungs = _check_smoke(smoke_runs["book-memory"], "book-memory")
    acc = rungs["grad-accum-2"]["config"]["train"]
    assert (acc["grad_accum_steps"], rungs["adamw-for-loop"]["config"]["optim"]["impl"]) == (2, "for-loop")
    fsdp = rungs["fsdp-2gpu"]
    assert fsdp["status"] == "skipped" and "2 CUDA GPUs" in fsdp["reason"]
    if CPU_ONLY:
        assert rungs["baseline"]["metrics"]["peak_alloc_mb"] is None  # no CUDA memory figures on a CPU


# ----------------------------------------------------------------------------------------------
# Sizing


def _probe(fits):
    calls = []

    def probe(value):
        calls.append(value)
        return Probe(value=value, status="fits" if fits(value) else "too-big", step_time_ms=1.0)

    return probe, calls


def test_max_batch_search():
    probe, calls = _probe(lambda b: b <= 23)
    res = search_max_batch(probe, log=lambda s: None)
    assert res["max_batch"] == 23 and not res["hit_limit"]
    assert calls == [1, 2, 4, 8, 16, 32, 24, 20, 22, 23]
    probe, _ = _probe(lambda b: True)
    assert search_max_batch(probe, start=4, limit=16, log=lambda s: None) == {
        **search_max_batch(probe, start=4, limit=16, log=lambda s: None), "max_batch": 16, "hit_limit": True}
    probe, calls = _probe(lambda b: b <= 2)
    assert search_max_batch(probe, start=8, log=lambda s: None)["max_batch"] == 2 and calls == [8, 4, 2, 3]
    probe, _ = _probe(lambda b: False)
    assert search_max_batch(probe, log=lambda s: None)["max_batch"] == 0

    def broken(b):
        return Probe(value=b, status="error", reason="RuntimeError: bad config")

    with pytest.raises(SizingError, match="bad config"):
        search_max_batch(broken, log=lambda s: None)


def test_max_model_search():
    cfg = C.resolve("gpt2-124m", overrides={"data.source": "synthetic"}, overrides_from_string=False)
    shapes = model_shapes(cfg)
    params = [s["params"] for s in shapes]
    assert params == sorted(params) and len(shapes) == 10
    assert 124e6 < params[0] < 125e6 and 19e9 < params[-1] < 21e9
    probe, calls = _probe(lambda s: s["params"] <= 3e9)
    res = search_max_model(shapes, probe, log=lambda s: None)
    assert res["largest"]["name"] == "gpt3-2.7b" and not res["hit_limit"]
    assert len(calls) <= 4
    probe, _ = _probe(lambda s: False)
    assert search_max_model(shapes, probe, log=lambda s: None)["largest"] is None
    assert [s["name"] for s in model_shapes(cfg, max_params=1e9)] == [
        "gpt2-124m", "gpt2-medium-350m", "gpt2-large-774m"]


def test_max_batch_real_probes_on_cpu(tmp_path):
    out = tmp_path / "mb"
    cmd = [sys.executable, "-m", "tokenmill", "bench", "max-batch", "--preset", "tiny", "--data.source", "synthetic",
           "--model.vocab_size", "64", "--train.device", "cpu", "--start", "4", "--max-batch-limit", "4",
           "--run-dir", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=cpu_env(), timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads((out / "max-batch.json").read_text())
    assert res["max_batch"] == 4 and res["hit_limit"]
    assert res["environment"]["torch"] and res["environment"]["date"] and "git_commit" in res["environment"]
    assert [q["value"] for q in res["probes"]] == [4]  # one real probe; the search is tested above
    assert res["probes"][0]["status"] == "fits" and res["probes"][0]["step_time_ms"] > 0
    assert (out / "probes" / "batch-4" / "rung.toml").exists()
    assert "largest micro-batch that fits: 4" in p.stdout
