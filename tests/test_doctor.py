"""``tokenmill doctor``: planted bottlenecks are named first; each rule triggers on its evidence and ranks.

End-to-end cases profile a short CPU run (``tokenmill profile`` in process) with one bottleneck planted
and check the verdict; CUDA-only diagnoses run on a GPU and are skipped elsewhere.
"""

from __future__ import annotations

import inspect
import json
import os
import textwrap

import pytest
import torch

from conftest import tiny_cfg
from tokenmill.cli import main
from tokenmill.data.prepare import prepare
from tokenmill.profiling import memory, rules
from tokenmill.profiling.doctor import diagnose, rank
from tokenmill.profiling.runner import ProfileOptions, prepare_config, run_profile
from tokenmill.train.trainer import train

OPTS = ProfileOptions(wait=1, warmup=1, active=3)


@pytest.fixture(scope="module")
def byte_tokens(tmp_path_factory):
    """A small bytes-tokenized folder (the data path that honours data.cpu_work_ms)."""
    src = tmp_path_factory.mktemp("text")
    for i, mod in enumerate((inspect, json, textwrap)):
        (src / f"doc{i}.txt").write_text(inspect.getsource(mod))
    return prepare(src, tmp_path_factory.mktemp("tok"), "bytes", workers=1, progress=False)


def profiled(tmp_path, opts=OPTS, **overrides) -> dict:
    cfg = prepare_config(tiny_cfg(**overrides), opts, set())
    run_profile(cfg, tmp_path, opts, quiet=True)
    return diagnose(tmp_path)


def keys(verdict) -> list[str]:
    return [f["key"] for f in verdict["findings"] if not f["minor"]]


def switches(finding) -> list[str]:
    return [s["switch"] or "" for s in finding["suggestions"]]


# ------------------------------------------------------------------------------------------------
# Planted bottlenecks (CPU)


def token_data(path) -> dict:
    return {"data.source": "tokens", "data.path": str(path), "data.validate": "quick", "model.vocab_size": None}


def test_data_bound_is_named_first(tmp_path, byte_tokens):
    v = profiled(tmp_path, **token_data(byte_tokens), **{"data.cpu_work_ms": 20.0, "train.batch_size": 2})
    assert v["main"] == "data_bound", v
    top = v["findings"][0]
    assert any(s.startswith("--data.num_workers") for s in switches(top))
    assert any("data.cpu_work_ms" in e for e in top["evidence"])


def test_data_bound_from_metrics_alone(tmp_path, byte_tokens):
    """A plain training run (no profile): the trainer's always-on breakdown is enough."""
    cfg = tiny_cfg(**token_data(byte_tokens), **{"data.cpu_work_ms": 10.0, "train.batch_size": 2,
                                                 "train.max_steps": 7, "log.every_steps": 2, "train.eval_batches": 0})
    train(cfg, tmp_path, quiet=True)
    v = diagnose(tmp_path)
    assert v["sources"] == ["metrics.jsonl", "summary.json"] and v["main"] == "data_bound"


def test_host_sync_every_step_is_named_first(tmp_path):
    v = profiled(tmp_path, **{"log.every_steps": 1, "train.batch_size": 16, "model.n_embd": 128, "model.n_head": 4})
    assert v["main"] == "host_sync", v
    assert v["figures"]["syncs_per_step"] >= 1
    assert "--log.every_steps 50" in switches(v["findings"][0])


def test_tiny_batch_is_overhead_bound(tmp_path):
    v = profiled(tmp_path, **{"train.batch_size": 1, "model.block_size": 16, "log.every_steps": 100})
    assert v["main"] == "launch_overhead", v
    assert any(s.startswith("--train.batch_size 4") for s in switches(v["findings"][0]))


def test_manual_attention_gets_the_sdpa_suggestion(tmp_path):
    opts = ProfileOptions(wait=1, warmup=1, active=3, per_block=True)
    v = profiled(tmp_path, opts, **{"model.attention": "manual", "train.batch_size": 8, "model.block_size": 64,
                                    "model.n_embd": 64})
    assert "attention" in keys(v)
    found = next(f for f in v["findings"] if f["key"] == "attention")
    assert "--model.attention sdpa" in switches(found)
    assert v["main"] == "attention"


def test_balanced_run_has_no_false_alarm(tmp_path):
    v = profiled(tmp_path, **{"train.batch_size": 16, "model.n_embd": 128, "model.n_head": 4})
    assert "data_bound" not in keys(v) and "host_sync" not in keys(v)
    assert v["main"] is None and v["verdict"] == "nothing stands out"


def test_doctor_cli_text_json_and_errors(tmp_path, capsys):
    cfg = tiny_cfg(**{"train.max_steps": 6, "log.every_steps": 1, "train.batch_size": 16, "model.n_embd": 128,
                      "model.n_head": 4, "train.eval_batches": 0})
    train(cfg, tmp_path / "run", quiet=True)
    capsys.readouterr()
    assert main(["doctor", str(tmp_path / "run")]) == 0
    text = capsys.readouterr().out
    assert "Main bottleneck: host-sync-bound" in text and "--log.every_steps 50" in text
    assert main(["doctor", str(tmp_path / "run"), "--json"]) == 0
    v = json.loads(capsys.readouterr().out)
    assert v["main"] == "host_sync" and v["findings"][0]["suggestions"][0]["switch"] == "--log.every_steps 50"
    (tmp_path / "empty").mkdir()
    assert main(["doctor", str(tmp_path / "empty")]) == 1
    assert "neither profile.json nor timed rows" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# Rules on synthetic facts


def facts(**kw) -> dict:
    """A healthy CPU run; keyword arguments plant evidence."""
    f = {
        "config": {"data.num_workers": 0, "log.every_steps": 10, "train.batch_size": 8, "train.grad_accum_steps": 1,
                   "model.attention": "sdpa", "train.precision": "fp32", "optim.impl": "foreach"},
        "device": "cpu", "step_ms": 100.0, "data_ms": 2.0, "h2d_ms": 0.5, "data_share": 0.02, "h2d_share": 0.005,
        "idle_share": 0.02, "fixed_share": 0.12, "tokens_per_step": 8192, "syncs_per_step": 0.1, "sync_sources": [],
    }
    cfg = kw.pop("config", {})
    f.update(kw)
    f["config"].update(cfg)
    return f


def cuda_facts(**kw) -> dict:
    base = {"device": "cuda", "gpu_name": "NVIDIA H100 80GB HBM3", "gpu_capability": [9, 0],
            "device_busy_fraction": 0.95, "device_idle_share": 0.05, "mean_kernel_us": 200.0, "kernels_per_step": 400,
            "gemm_share": 0.1, "device_total_mb": 81559.0, "config": {"train.precision": "bf16-autocast"}}
    base.update(kw)
    return facts(**base)


@pytest.mark.parametrize("planted, expected", [
    ({"data_share": 0.6, "data_ms": 60.0}, "data_bound"),
    ({"syncs_per_step": 3.0, "config": {"log.every_steps": 1}}, "host_sync"),
    ({"fixed_share": 0.6, "tokens_per_step": 32}, "launch_overhead"),
    ({"config": {"model.attention": "manual"}, "attention_flop_share": 0.2}, "attention"),
])
def test_each_cpu_rule_triggers_first(planted, expected):
    assert [f["key"] for f in rank(facts())] == []  # the healthy run triggers nothing
    found = rank(facts(**planted))
    assert found[0]["key"] == expected and found[0]["score"] >= rules.MIN_SCORE


@pytest.mark.parametrize("planted, expected", [
    ({"device_busy_fraction": 0.3, "device_idle_share": 0.7, "mean_kernel_us": 8.0}, "launch_overhead"),
    ({"config": {"train.precision": "fp32", "train.tf32": False}, "gemm_share": 0.7}, "fp32_math"),
    ({"syncs_per_step": 2.0, "device_busy_fraction": 0.6, "device_idle_share": 0.4,
      "sync_sources": [{"call": "cudaStreamSynchronize", "op": "", "parent": "aten::copy_", "region": "h2d",
                        "python": "", "per_step": 2.0}]}, "host_sync"),
    ({"h2d_share": 0.3, "h2d_ms": 30.0}, "copy_bound"),
    ({"alloc_retries": 3, "cuda_malloc_per_step": 4.0, "cuda_free_per_step": 4.0}, "allocator_thrash"),
    ({"vocab_sized_mb": 60000.0, "memory_total_mb": 70000.0, "peak_reserved_mb": 75000.0, "peak_region": "forward",
      "peak_op": "aten::cross_entropy_loss > aten::log_softmax"}, "logits_peak"),
    ({"activation_mb": 60000.0, "memory_total_mb": 70000.0, "peak_reserved_mb": 75000.0}, "activation_memory"),
    ({"optimizer_state_mb": 40000.0, "memory_total_mb": 70000.0, "peak_reserved_mb": 75000.0},
     "optimizer_state_memory"),
])
def test_each_cuda_rule_triggers_first(planted, expected):
    assert rank(cuda_facts()) == []
    found = rank(cuda_facts(**planted))
    assert found[0]["key"] == expected and found[0]["score"] >= rules.MIN_SCORE


def test_blocking_copies_suggest_pinned_memory():
    src = [{"call": "cudaStreamSynchronize", "op": "", "parent": "aten::copy_", "region": "h2d", "python": "",
            "per_step": 2.0}]
    found = rank(cuda_facts(syncs_per_step=2.0, sync_sources=src, device_idle_share=0.3))
    assert found[0]["key"] == "host_sync"
    assert {"--data.pin_memory true", "--data.non_blocking true"} <= set(switches(found[0]))


def test_gpu_idle_while_waiting_for_data_is_not_launch_overhead():
    f = cuda_facts(data_share=0.6, data_ms=60.0, device_busy_fraction=0.3, device_idle_share=0.7, mean_kernel_us=8.0)
    assert [x["key"] for x in rank(f)] == ["data_bound"]


def test_ranking_follows_expected_gain():
    f = facts(data_share=0.5, data_ms=50.0, syncs_per_step=2.0, config={"model.attention": "manual"})
    assert [x["key"] for x in rank(f)] == ["data_bound", "host_sync", "attention"]
    f = facts(data_share=0.2, data_ms=20.0, fixed_share=0.8, tokens_per_step=64)
    assert [x["key"] for x in rank(f)][:2] == ["launch_overhead", "data_bound"]


def test_suggestions_name_existing_switches_only():
    """Every --switch names a real config field; fields that do not exist become plain advice."""
    from tokenmill.config import field_specs

    planted = [facts(data_share=0.6, data_ms=60.0), facts(fixed_share=0.6, tokens_per_step=32),
               cuda_facts(optimizer_state_mb=40000.0, memory_total_mb=70000.0, peak_reserved_mb=75000.0),
               cuda_facts(vocab_sized_mb=60000.0, memory_total_mb=70000.0, peak_reserved_mb=75000.0)]
    for f in planted:
        for finding in rank(f):
            for s in finding["suggestions"]:
                for word in (s["switch"] or "").split():
                    if word.startswith("--"):
                        assert word[2:] in field_specs(), word
    assert rules.switch("no_such.field", 1, "why")["switch"] is None
    assert rules.switch("train.batch_size", True, "why")["switch"] is None  # wrong type: advice only
    assert rules.switch("train.precision", "fp64", "why", "fallback") == {"switch": None, "why": "fallback"}


def test_logits_peak_suggests_the_chunked_loss():
    found = rank(cuda_facts(vocab_sized_mb=60000.0, memory_total_mb=70000.0, peak_reserved_mb=75000.0))
    assert found[0]["key"] == "logits_peak"
    assert "--model.loss_impl chunked" in switches(found[0])
    already = rank(cuda_facts(vocab_sized_mb=60000.0, memory_total_mb=70000.0, peak_reserved_mb=75000.0,
                              config={"model.loss_impl": "chunked", "model.loss_chunk_size": 1024}))
    assert "--model.loss_chunk_size 256" in switches(already[0])


def test_memory_rules_stay_minor_on_cpu():
    f = facts(activation_mb=9.0, memory_total_mb=10.0, vocab_sized_mb=8.0)
    assert all(x["minor"] for x in rank(f))


# ------------------------------------------------------------------------------------------------
# CUDA-only diagnoses


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_allocator_thrash_from_varying_shapes():
    """Growing shapes never fit the cached blocks: a cudaMalloc every step; fixed shapes settle."""
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        pytest.skip("expandable segments grow in place instead of calling cudaMalloc")

    def run(sizes) -> dict:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = memory.allocator_counters()
        for n in sizes:
            x = torch.ones(n, device="cuda")
            (x * 2).sum().item()
            del x
        a = memory.allocator_summary(before, len(sizes))
        return cuda_facts(alloc_retries=a["during_profiled_steps"]["num_alloc_retries"],
                          cuda_malloc_per_step=a["cuda_malloc_per_step"], cuda_free_per_step=a["cuda_free_per_step"],
                          reserved_minus_allocated_mb=a["reserved_minus_allocated_mb"])

    mb = 2**20 // 4
    growing = run([(8 + 4 * i) * mb for i in range(8)])
    assert growing["cuda_malloc_per_step"] >= 1
    assert rank(growing)[0]["key"] == "allocator_thrash"
    assert any("expandable_segments" in (s["switch"] or "") for s in rank(growing)[0]["suggestions"])
    run([16 * mb] * 2)  # warm the cache for the fixed shape
    fixed = run([16 * mb] * 8)
    assert fixed["cuda_malloc_per_step"] < 1 and "allocator_thrash" not in [x["key"] for x in rank(fixed)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_vocabulary_sized_logits_peak(tmp_path):
    """A narrow model with a 32k vocabulary: the fp32 logits and their copies hold the peak."""
    v = profiled(tmp_path, **{"train.device": "cuda", "model.vocab_size": 32768, "model.block_size": 128,
                              "train.batch_size": 16})
    prof = json.loads((tmp_path / "profile.json").read_text())
    assert prof["memory"]["vocab_sized_mb"] > 0.5 * (prof["memory"]["peak_mb"] - prof["memory"]["step_start_mb"])
    memory_keys = [f["key"] for f in v["findings"] if f["key"].endswith(("_peak", "_memory"))]
    assert memory_keys and memory_keys[0] == "logits_peak"
