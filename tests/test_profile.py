"""``tokenmill profile``: the files it writes on CPU, the trace analysis (checked on a hand-made CUDA-like
trace too, so the device paths are tested without a GPU), and the CUDA extras on a GPU."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from conftest import tiny_cfg
from tokenmill.cli import main
from tokenmill.profiling import analysis, memory, runner
from tokenmill.profiling.runner import ProfileOptions, prepare_config, run_profile
from tokenmill.profiling.trace import OUTSIDE, Trace

TINY_CPU = ["--preset", "tiny", "--data.source", "synthetic", "--model.vocab_size", "64", "--train.device", "cpu",
            "--log.progress", "plain"]


@pytest.mark.slow
def test_profile_cli_writes_trace_and_report(tmp_path, capsys):
    run = tmp_path / "p"
    rc = main(["profile", *TINY_CPU, "--run-dir", str(run), "--wait", "1", "--warmup", "1", "--active", "3",
               "--per-block", "--tensorboard", "--quiet"])
    assert rc == 0
    doc = json.loads((run / "trace.json").read_text())
    regions = {e["name"] for e in doc["traceEvents"] if e.get("cat") == "user_annotation"}
    assert {"forward", "backward", "optimizer", "h2d", "block0.attn", "block1.mlp"} <= regions
    assert any(n.startswith("enumerate(DataLoader)") for n in regions)
    prof = json.loads((run / "profile.json").read_text())
    assert prof["breakdown"]["steps"] == [3, 4, 5]  # wait 1 + warmup 1, then 3 profiled steps
    ms = prof["breakdown"]["ms_per_step"]
    assert set(ms) == {"data", "h2d", "forward", "backward", "optimizer", "idle", "step"}
    assert ms["forward"] > 0 and ms["backward"] > 0 and ms["optimizer"] > 0
    assert abs(sum(v for k, v in ms.items() if k != "step") - ms["step"]) < 1e-6 * max(1.0, ms["step"])
    assert prof["device_busy"] is None and 0 < prof["host_busy"]["busy_fraction"] <= 1
    assert prof["top_ops"] and prof["top_ops"][0]["self_ms_per_step"] > 0
    assert prof["memory"]["peak_mb"] > 0 and prof["memory"]["peak_region"] in ("forward", "backward", "optimizer", "data",
                                                                                 "h2d", OUTSIDE)
    assert prof["per_block"]["attn_ms_per_step"] > 0 and prof["per_block"]["mlp_ms_per_step"] > 0
    assert any("CPU run" in n for n in prof["notes"])
    threads = json.loads((run / "summary.json").read_text())["threads"]  # what the doctor's thread rule reads
    assert threads["intra_op"] == torch.get_num_threads() and threads["cpu_count"] >= 1
    md = (run / "profile.md").read_text()
    assert "## Time per step" in md and "## Memory peak" in md and "n/a" in md  # no device timeline on CPU
    assert (run / "profile.png").stat().st_size > 1000
    assert list((run / "tensorboard_trace").glob("*.pt.trace.json"))
    assert json.loads((run / "summary.json").read_text())["steps"] == 6  # wait + warmup + active + 1
    assert "tokenmill doctor" in capsys.readouterr().out


def test_profile_schedule_and_max_steps(tmp_path):
    opts = ProfileOptions(wait=2, warmup=2, active=4)
    cfg = prepare_config(tiny_cfg(), opts, given=set())
    assert cfg.train.max_steps == 9 and cfg.checkpoint.save_final is False
    cfg = prepare_config(tiny_cfg(**{"train.max_steps": 30}), opts, given={"train.max_steps"})
    assert cfg.train.max_steps == 30
    rc = main(["profile", *TINY_CPU, "--run-dir", str(tmp_path / "x"), "--train.max_steps", "3"])
    assert rc == 2  # config error: the schedule needs more steps


@pytest.mark.slow
def test_sync_count_follows_log_interval(tmp_path):
    """The trainer reads the loss back at log steps only: one sync point per step at every_steps=1, none in
    a window without a log step (the optimizer's host-side step counters are not syncs)."""
    opts = ProfileOptions(wait=1, warmup=1, active=3)
    got = {}
    for every in (1, 100):
        cfg = prepare_config(tiny_cfg(**{"log.every_steps": every}), opts, set())
        got[every] = run_profile(cfg, tmp_path / str(every), opts, quiet=True)["syncs"]
    assert got[1]["per_step"] == pytest.approx(1.0)
    assert got[1]["sources"][0]["region"] == OUTSIDE
    assert got[100]["per_step"] == 0.0


# ------------------------------------------------------------------------------------------------
# The analysis on a hand-made trace with device events (what a CUDA run produces)


def _x(name, cat, ts, dur, tid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _mem(ts, total, nbytes, addr):
    return {"ph": "i", "name": "[memory]", "cat": "cpu_instant_event", "pid": 1, "tid": 1, "ts": ts,
            "args": {"Total Allocated": total, "Bytes": nbytes, "Addr": addr, "Device Type": 1, "Device Id": 0}}


def cuda_like_trace() -> Trace:
    """Two 1000 us steps: forward launches a 300 us kernel, backward a 400 us one; each step ends with a
    loss read-back (item -> _local_scalar_dense -> cudaStreamSynchronize) outside the phases; a
    300 MB block is allocated in forward by aten::addmm and freed in backward."""
    ev = []
    for i, t0 in enumerate((0, 1000)):
        ev += [
            _x(f"ProfilerStep#{i + 4}", "user_annotation", t0, 1000),
            _x("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "user_annotation", t0 + 10, 90),
            _x("forward", "user_annotation", t0 + 100, 200),
            _x("aten::addmm", "cpu_op", t0 + 110, 50),
            _x("cudaLaunchKernel", "cuda_runtime", t0 + 120, 10, correlation=10 + i),
            _x("backward", "user_annotation", t0 + 300, 300),
            _x("cudaLaunchKernel", "cuda_runtime", t0 + 310, 10, correlation=20 + i),
            _x("optimizer", "user_annotation", t0 + 600, 100),
            _x("aten::item", "cpu_op", t0 + 800, 150),
            _x("aten::_local_scalar_dense", "cpu_op", t0 + 801, 148),
            _x("cudaStreamSynchronize", "cuda_runtime", t0 + 810, 130),
            _x("ampere_sgemm_128x64_nn", "kernel", t0 + 130, 300, tid=7, correlation=10 + i),
            _x("elementwise_kernel", "kernel", t0 + 440, 400, tid=7, correlation=20 + i),
            _mem(t0 + 115, 100 * 2**20 + 300 * 2**20, 300 * 2**20, 0xA0 + i),
            _mem(t0 + 350, 100 * 2**20, -300 * 2**20, 0xA0 + i),
        ]
    return Trace({"traceEvents": ev})


def test_analysis_of_a_cuda_like_trace():
    tr = cuda_like_trace()
    b = analysis.breakdown(tr)
    assert b["steps"] == [5, 6]
    ms = b["ms_per_step"]
    assert ms["data"] == pytest.approx(0.09) and ms["forward"] == pytest.approx(0.2)
    assert ms["backward"] == pytest.approx(0.3) and ms["optimizer"] == pytest.approx(0.1)
    assert ms["idle"] == pytest.approx(0.31) and ms["step"] == pytest.approx(1.0)
    d = analysis.device_breakdown(tr)
    assert d["busy_fraction"] == pytest.approx(0.7)  # 700 us of kernels per 1000 us step
    assert d["ms_per_step_by_launching_phase"] == pytest.approx({"forward": 0.3, "backward": 0.4})
    assert d["kernels_per_step"] == 2 and d["mean_kernel_us"] == pytest.approx(350)
    assert d["gemm_share"] == pytest.approx(300 / 700)
    s = analysis.syncs(tr)
    assert s["per_step"] == 1.0 and s["basis"].startswith("blocking CUDA")
    assert s["ms_per_step"] == pytest.approx(0.13) and s["sources"][0]["ms_per_step"] == pytest.approx(0.13)
    src = s["sources"][0]
    assert src["call"] == "cudaStreamSynchronize" and src["op"] == "aten::item" and src["region"] == OUTSIDE
    assert analysis.top_kernels(tr)[0]["name"] == "elementwise_kernel"
    m = memory.memory_peak(tr)
    assert m["device"] == "cuda" and m["peak_mb"] == pytest.approx(400)
    assert m["peak_region"] == "forward" and "aten::addmm" in m["peak_op"]
    assert m["peak_step"] == 5 and m["peak_at_ms"] == pytest.approx(0.115)
    assert m["top_live"][0]["mb"] == pytest.approx(300) and m["top_live"][0]["region"] == "forward"
    assert m["transient_mb"] == pytest.approx(300)
    # a 300 MB block is "vocabulary-sized" for B*T*V = 75 Mi elements at 4 bytes each
    assert memory.memory_peak(tr, (300 * 2**20 // 4,))["vocab_sized_mb"] == pytest.approx(300)


def test_recompute_and_evaluation_in_a_cuda_like_trace():
    """Activation checkpointing: forward operators inside backward, scaled by the forward's own ratio
    of its whole time to those operators' time (host and device). An evaluation between the phases:
    its span per step, and its read-back counted apart from the training's syncs."""
    ev = []
    for i, t0 in enumerate((0, 1000)):
        ev += [
            _x(f"ProfilerStep#{i + 4}", "user_annotation", t0, 1000),
            _x("forward", "user_annotation", t0 + 100, 200),
            _x("aten::linear", "cpu_op", t0 + 110, 100),  # half the forward on the host
            _x("cudaLaunchKernel", "cuda_runtime", t0 + 120, 10, correlation=10 + i),
            _x("cudaLaunchKernel", "cuda_runtime", t0 + 250, 10, correlation=30 + i),  # outside the linear
            _x("backward", "user_annotation", t0 + 300, 300),
            _x("autograd::engine::evaluate_function: AddmmBackward0", "cpu_op", t0 + 310, 200),
            _x("aten::linear", "cpu_op", t0 + 320, 50),  # recomputed
            _x("cudaLaunchKernel", "cuda_runtime", t0 + 330, 10, correlation=20 + i),
            _x("aten::mm", "cpu_op", t0 + 400, 50),
            _x("aten::item", "cpu_op", t0 + 650, 20),  # the training loop's loss read-back
            _x("aten::linear", "cpu_op", t0 + 700, 40),  # evaluation forward passes
            _x("aten::linear", "cpu_op", t0 + 800, 60),
            _x("aten::item", "cpu_op", t0 + 900, 20),  # the evaluation's read-back
            _x("gemm_kernel", "kernel", t0 + 130, 60, tid=7, correlation=10 + i),
            _x("elementwise_kernel", "kernel", t0 + 260, 20, tid=7, correlation=30 + i),
            _x("gemm_kernel", "kernel", t0 + 340, 30, tid=7, correlation=20 + i),
        ]
    tr = Trace({"traceEvents": ev})
    rec = analysis.recompute(tr)
    assert rec["ops_per_step"] == 1 and rec["ops_host_ms_per_step"] == pytest.approx(0.05)
    assert rec["host_ms_per_step"] == pytest.approx(0.05 * 200 / 100)  # forward 200 us, its linears 100 us
    assert rec["device_ms_per_step"] == pytest.approx(0.03 * 80 / 60)  # forward kernels 80 us, the linear's 60
    out = analysis.outside_phases(tr)
    assert out["steps_with_eval"] == 2 and out["eval_ms_per_step"] == pytest.approx(0.16)  # 700..860 us
    cpu = Trace({"traceEvents": [e for e in ev if e["cat"] != "kernel"]})
    s = analysis.syncs(cpu)
    assert s["per_step"] == 1.0 and s["in_evaluation_per_step"] == 1.0
    b = analysis.breakdown(cpu)
    assert b["each_step_ms"]["step"] == [1.0, 1.0] and b["each_step_ms"]["forward"] == [0.2, 0.2]
    assert b["recompute"]["device_ms_per_step"] is None and b["outside"]["steps_with_eval"] == 2



    """--per-block under compile skips the hooks: profile.json records null (unknown), never zeros."""
    opts = ProfileOptions(wait=1, warmup=1, active=2, per_block=True)
    compiled = tiny_cfg(**{"compile.enabled": True})
    assert runner.analyse(cuda_like_trace(), compiled, None, opts, cuda=False)["per_block"] is None
    assert runner.analyse(cuda_like_trace(), tiny_cfg(), None, opts, cuda=False)["per_block"] is None  # no regions
    tr = cuda_like_trace()
    doc = {"traceEvents": [e for e in tr.doc["traceEvents"]] + [_x("block0.attn", "user_annotation", 110, 40)]}
    pb = runner.analyse(Trace(doc), tiny_cfg(), None, opts, cuda=False)["per_block"]
    assert pb == {"attn_ms_per_step": pytest.approx(0.02), "mlp_ms_per_step": 0.0}


# ------------------------------------------------------------------------------------------------
# CUDA


@pytest.mark.gpu
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_profile_on_cuda_writes_memory_files(tmp_path):
    opts = ProfileOptions(wait=1, warmup=1, active=3, with_stack=True)
    cfg = prepare_config(tiny_cfg(**{"train.device": "cuda"}), opts, set())
    prof = run_profile(cfg, tmp_path, opts, quiet=True)
    assert prof["device"] == "cuda" and prof["gpu"]["capability"][0] >= 3
    assert prof["device_busy"]["kernels_per_step"] > 0 and 0 < prof["device_busy"]["busy_fraction"] <= 1
    assert prof["top_kernels"]
    a = prof["allocator"]
    assert {"num_alloc_retries", "num_device_alloc", "num_device_free"} <= set(a["during_profiled_steps"])
    assert a["reserved_mb"] >= a["allocated_mb"] > 0
    assert prof["memory"]["device"] == "cuda" and prof["memory"]["peak_mb"] > 0
    with open(tmp_path / "memory_snapshot.pickle", "rb") as f:
        assert "segments" in pickle.load(f)
    assert (tmp_path / "memory_timeline.json").exists()
    # on CUDA with --with-stack the runner also writes the HTML timeline, and lists it among the files
    assert (tmp_path / "memory_timeline.html").exists(), prof["notes"]
    assert prof["files"]["memory_timeline"] == "memory_timeline.html"
