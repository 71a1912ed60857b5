"""tokenmill estimate: its formulas, its agreement with measured CPU allocations, and its error against
the seeds' published GPU memory figures."""

import json
import re
import time

import pytest
import torch

from tokenmill import config as C
from tokenmill.bench.load import load_ladder
from tokenmill.bench.predict import ladder_gpu, predict_ladder
from tokenmill.cli import main
from tokenmill.errors import ParallelError
from tokenmill.estimate import estimate, gpu_spec, memory_advice
from tokenmill.estimate.allocator import CachingAllocator, MiB, round_size, segment_size
from tokenmill.estimate.core import param_counts, resolve_layout
from tokenmill.estimate.device import DeviceModel
from tokenmill.estimate.recorder import Recorder
from tokenmill.estimate.roofline import MATMUL_EFFICIENCY, _op_seconds
from tokenmill.estimate.step import pipeline_order
from tokenmill.model.flops import flop_params


def small(**overrides) -> C.Config:
    """A 2-layer, 128-wide GPT on synthetic ids, on the CPU, short."""
    base = {"data.source": "synthetic", "model.vocab_size": 512, "model.n_layer": 2, "model.n_embd": 128,
            "model.n_head": 4, "model.block_size": 128, "train.batch_size": 8, "train.max_steps": 3,
            "train.device": "cpu", "train.eval_batches": 0, "log.progress": "plain", "log.tensorboard": False,
            "checkpoint.save_final": False, "log.every_steps": 1}
    base.update(overrides)
    return C.resolve(None, overrides=base, overrides_from_string=False)


# ----------------------------------------------------------------------------------------------
# Formulas


def test_allocator_rounding_segments_split_and_merge():
    assert (round_size(1), round_size(512), round_size(513)) == (512, 512, 1024)
    assert (segment_size(1), segment_size(MiB), segment_size(MiB + 1), segment_size(11 * MiB)) == (
        2 * MiB, 2 * MiB, 20 * MiB, 12 * MiB)
    a = CachingAllocator()
    a.malloc("s", 100)  # small pool: one 2 MiB segment
    a.malloc("m", 3 * MiB)  # 20 MiB segment, split: 17 MiB stay cached
    a.malloc("l", 50 * MiB)  # its own 50 MiB segment
    assert (a.allocated, a.reserved) == (512 + 53 * MiB, 72 * MiB)
    a.free("m")
    a.malloc("m2", 2 * MiB)  # best fit: the cached 20 MiB block (the 50 MiB one is in use)
    a.free("l")
    a.malloc("big", 30 * MiB)  # reuses the free 50 MiB segment: nothing new reserved
    assert (a.allocated, a.reserved, a.peak_reserved) == (512 + 32 * MiB, 72 * MiB, 72 * MiB)
    a.free("big")
    a.malloc("big2", 50 * MiB)  # the 30 + 20 MiB pieces merged back into one block
    assert a.reserved == 72 * MiB
    # a block whose rest would be 1 MiB or less is handed out whole (and counted whole)
    b = CachingAllocator()
    b.malloc("x", 19 * MiB + 512)
    assert b.allocated == 20 * MiB


def test_allocator_expandable_segments_and_capacity():
    a = CachingAllocator(expandable_segments=True)
    a.malloc("a", 30 * MiB)
    a.malloc("b", 30 * MiB)
    assert a.reserved == 60 * MiB  # one growing segment, no 20 MiB granularity
    a.free("b")
    assert a.reserved == 30 * MiB  # the free end is unmapped
    c = CachingAllocator(capacity=100 * MiB)
    c.malloc("a", 60 * MiB)
    c.free("a")
    c.malloc("b", 70 * MiB)  # the cached 60 MiB segment is released before passing the capacity
    assert c.reserved == 70 * MiB and not c.out_of_memory


def test_recorder_events_and_costs():
    with torch.device("meta"):
        w = torch.empty(64, 32, requires_grad=True)
        x = torch.empty(16, 32, requires_grad=True)
    rec = Recorder({w.untyped_storage()._cdata, x.untyped_storage()._cdata})
    with rec:
        y = torch.relu(x @ w.t())  # mm output (16x64 fp32) then relu output; relu keeps its output
        rec.mark("end of forward")
    sizes = [e[2] for e in rec.events if e[0] == "a"]
    assert sizes == [16 * 64 * 4, 16 * 64 * 4]
    assert sum(1 for e in rec.events if e[0] == "f") == 1  # the mm output: nothing kept it
    mm = [c for c in rec.costs if c.flops]
    assert mm[0].flops == 2 * 16 * 32 * 64 and mm[0].math == "fp32" and mm[0].min_dim == 16
    relu = [c for c in rec.costs if c.name == "relu"][0]
    assert relu.bytes == 2 * 16 * 64 * 4  # read and written once
    del y


def test_recorder_charges_indexing_kernels_the_rows_they_touch():
    # an embedding lookup, cross-entropy's nll_loss and its backward read one row / value per index, not the
    # whole table or log-probability matrix (ATen's kernels); the log-softmax around it reads everything
    V, D, N = 1000, 16, 8
    with torch.device("meta"):
        table = torch.empty(V, D)
        logits = torch.empty(N, V, requires_grad=True)
        idx = torch.zeros(N, dtype=torch.long)
    with Recorder({t.untyped_storage()._cdata for t in (table, logits, idx)}) as rec:
        torch.nn.functional.embedding(idx, table)
        torch.nn.functional.cross_entropy(logits, idx).backward()
    cost = {c.name: c.bytes for c in rec.costs if not c.flops}
    assert cost["embedding"] == N * 8 + 2 * N * D * 4  # indices, the rows read, the rows written
    assert cost["nll_loss_forward"] == N * 8 + N * 4 + 2 * 4  # one value per target; loss and total weight
    assert cost["nll_loss_backward"] == N * 8 + N * 4 + N * V * 4  # the gradient written once
    assert cost["_log_softmax"] == 2 * N * V * 4  # read and written whole


def test_device_model_dropout_attention_and_autocast():
    def saved(device, fn, shape=(4, 8, 64, 32), dtype=torch.float32, autocast=None):
        with torch.device("meta"):
            x = torch.empty(shape, dtype=dtype, requires_grad=True)
        rec = Recorder({x.untyped_storage()._cdata})
        dm = DeviceModel(device, autocast, dropout=0.1)
        with dm, rec, dm.autocast_region():
            out = fn(x)
            rec.sweep()
        return sum(rec.sizes[sid] for _, (_, sid, _) in rec.live.items()) - out.numel() * out.element_size()

    n = 4 * 8 * 64 * 32
    dropout = lambda x: torch.nn.functional.dropout(x, 0.1)  # noqa: E731
    assert saved("cuda", dropout) == n  # CUDA keeps a bool mask
    assert saved("cpu", dropout) == 4 * n  # the CPU keeps the fp32 scaled noise
    attn = lambda x: torch.nn.functional.scaled_dot_product_attention(x, x, x, dropout_p=0.1, is_causal=True)  # noqa: E731
    assert saved("cuda", attn) == 4 * 8 * 64 * 4  # only the fp32 log-sum-exp beside the output
    assert saved("cpu", attn) >= 4 * 8 * 64 * 64 * 4  # the CPU keeps the T x T matrix with dropout
    lin = torch.nn.Linear(32, 32, device="meta")
    # autocast on CUDA: the bf16 copies of the input and of the (cached) weight are kept for backward
    assert saved("cuda", lambda x: lin(x), (16, 32), autocast=torch.bfloat16) == 16 * 32 * 2 + 32 * 32 * 2 + 32 * 2


def test_param_counts_match_the_model_and_the_flops_convention():
    from tokenmill.model import GPT

    for o in ({}, {"model.tie_embeddings": False, "model.vocab_pad_multiple": 64}, {"model.bias": False}):
        cfg = C.resolve("gpt2-124m", overrides=o, overrides_from_string=False)
        with torch.device("meta"):
            n = GPT(cfg.model, 50257).num_params()
        assert param_counts(cfg, 50257) == (n, flop_params(cfg.model, 50257))


def test_optimizer_state_and_temporaries():
    """AdamW keeps two moments per parameter in its dtype; foreach adds a square root per parameter of a
    group, for-loop two of the largest parameter, fused nothing; 8-bit keeps 1-byte moments."""
    cfg = small(**{"model.dropout": 0.0})
    n_params, _ = param_counts(cfg, 512)
    by_impl = {impl: estimate(small(**{"optim.impl": impl}), "h100-sxm") for impl in ("foreach", "for-loop", "fused")}
    for e in by_impl.values():
        assert e.breakdown_mb["optimizer state"] in (0.0, pytest.approx(2 * 4 * n_params / MiB, rel=0.02))
    bf16 = estimate(small(**{"train.precision": "bf16"}), "h100-sxm")
    assert bf16.breakdown_mb["parameters"] == pytest.approx(2 * n_params / MiB, rel=0.05)
    e8 = estimate(small(**{"memory.optimizer_8bit": True}), "h100-sxm")
    off = estimate(small(**{"memory.optimizer_offload": True}), "h100-sxm")
    assert off.host_mb == pytest.approx(4 * 4 * n_params / MiB, rel=0.01) and off.breakdown_mb["optimizer state"] == 0
    assert e8.peak_alloc_mb < by_impl["foreach"].peak_alloc_mb


def test_roofline_kernel_times():
    from tokenmill.estimate.recorder import OpCost

    cfg = small(**{"train.tf32": False})
    a100 = gpu_spec("a100-40gb")
    mm = OpCost("mm", flops=2e12, math="fp32", min_dim=4096)
    eff = MATMUL_EFFICIENCY["a100-40gb"]  # no shape given: no tile/wave share, no memory floor
    assert _op_seconds(mm, cfg, a100, 1) == pytest.approx(2e12 / (19.5e12 * eff))
    ew = OpCost("add", bytes=1.555e9)  # streams: BabelStream's copy share on the A100 (estimate/bandwidth.py)
    assert _op_seconds(ew, cfg, a100, 1) == pytest.approx(1.555e9 / (1555e9 * 1610 / 2039))
    red = OpCost("sum", bytes=1.555e9)  # a one-pass reduction: BabelStream's dot share on the A100
    assert _op_seconds(red, cfg, a100, 1) == pytest.approx(1.555e9 / (1555e9 * 1750 / 2039))
    soft = OpCost("_softmax", bytes=1.555e9)  # softmax: the A100's MEMORY_EFFICIENCY, 0.37
    assert _op_seconds(soft, cfg, a100, 1) == pytest.approx(1.555e9 / (1555e9 * 0.37))


def test_layouts_and_pipeline_order():
    assert pipeline_order("gpipe", 3, 2, 0) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]
    assert pipeline_order("1f1b", 4, 2, 0) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3),
                                               ("B", 2), ("B", 3)]
    assert pipeline_order("1f1b", 4, 2, 1)[:3] == [("F", 0), ("B", 0), ("F", 1)]
    base = C.resolve("gpt2-124m", overrides={"data.source": "synthetic", "train.batch_size": 4}, overrides_from_string=False)
    with pytest.raises(ParallelError, match="not divisible"):
        resolve_layout(C.resolve("gpt2-124m", overrides={"parallel.dp_shard": 3}, overrides_from_string=False), 4)

    def est(nproc, **o):
        cfg = C.from_dict(base.to_dict())
        C.apply_overrides(cfg, o)
        return estimate(C.validate(cfg), "h100-sxm", nproc)

    one = est(1)
    fsdp = est(2, **{"parallel.dp_shard": 2, "parallel.dp_replicate": 1})
    ddp = est(2)
    tp = est(2, **{"parallel.tp": 2, "parallel.dp_replicate": 1, "model.fused_qkv": False})
    pp = est(2, **{"parallel.pp": 2, "parallel.dp_replicate": 1, "model.tie_embeddings": False})
    assert fsdp.breakdown_mb["optimizer state"] < 0.6 * one.breakdown_mb["optimizer state"] or \
        fsdp.peak_alloc_mb < one.peak_alloc_mb
    assert ddp.peak_alloc_mb > one.peak_alloc_mb  # DDP's buckets: one more copy of the gradients
    assert tp.activations_per_block_mb["plain"] < 0.8 * one.activations_per_block_mb["plain"]
    assert pp.peak_alloc_mb < one.peak_alloc_mb
    assert (ddp.layout, fsdp.layout, tp.layout, pp.layout) == ("DDP x2", "FSDP x2", "TP x2", "PP x2")


# ----------------------------------------------------------------------------------------------
# Estimates of CPU runs against measured CPU allocations


def measured_peak_mb(cfg: C.Config, tmp_path) -> float:
    """Peak bytes of tensor memory a real ``train()`` on the CPU holds, from the CPU allocator's own
    events (torch.profiler with profile_memory: every allocation and free with its size), counted
    from the start of training as CUDA's peak is (model and optimizer state included)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from tokenmill.train.trainer import Callbacks, train

    def start(_trainer):
        with record_function("tokenmill-measure-start"):
            pass

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        train(cfg, tmp_path / "run", quiet=True, callbacks=Callbacks(on_train_start=start))
    events = list(prof.profiler.kineto_results.events())
    t0 = min(e.start_ns() for e in events if e.name() == "tokenmill-measure-start")
    live = peak = 0
    for t, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        live += nbytes
        if t >= t0:
            peak = max(peak, live)
    if peak == 0:
        pytest.skip("this PyTorch's profiler reports no CPU memory events")
    return peak / MiB


CPU_CASES = {
    "sdpa-native": {},
    "manual-dropout": {"model.attention": "manual", "model.norm": "manual", "model.gelu": "manual", "model.dropout": 0.1},
    "checkpointed": {"memory.activation_checkpointing": 1, "model.dropout": 0.1},
    "pure-bf16": {"train.precision": "bf16", "model.attention": "manual"},
    "bf16-autocast": {"train.precision": "bf16-autocast"},
    "chunked-accum-forloop": {"model.loss_impl": "chunked", "model.loss_chunk_size": 256,
                              "train.grad_accum_steps": 2, "optim.impl": "for-loop"},
    "untied-padded-fused": {"optim.impl": "fused", "model.tie_embeddings": False, "model.vocab_pad_multiple": 64,
                            "model.vocab_size": 500},
    "lora": {"lora.rank": 8},
    "qlora": {"lora.rank": 8, "lora.quantize_base": "nf4"},  # NF4 as stored, each dequantisation in the trace (+2.2%)
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CPU_CASES))
def test_cpu_estimate_agrees_with_measured_allocations(case, tmp_path):
    cfg = small(**CPU_CASES[case])
    est = estimate(cfg, "cpu").peak_alloc_mb
    meas = measured_peak_mb(cfg, tmp_path)
    assert abs(est / meas - 1) <= 0.10, f"{case}: estimate {est:.2f} MiB, measured {meas:.2f} MiB"


# ----------------------------------------------------------------------------------------------
# GPU estimates against the seeds' published figures


# Memory within 15% of the seeds' figures. Speed: the bound is where the estimate stands (docs/estimate.md: 31.7% and
# 19.4%, every rung faster than the seeds'; the rasbt README's timed windows also hold its evaluations), kept so a
# change that moves the seeds' speed further shows here rather than going unnoticed, as the move from 14.8% did.
# 29.9% -> 31.7%: UNALIGNED from its source (0.6 -> 0.714) speeds the rungs before the vocabulary's padding; the
# README's own padding rung (+13.7%) says the A100's penalty is larger, but a seed is not a source to fit to.
# 31.7% -> 36.0%: Inductor's reductions read from its source (the measured reduction share, persistent rows and the
# online softmax read once, single-use expressions inlined up to 100 ops) speed the compiled rungs 8-11.
SEED_BOUNDS = {"rasbt": {"peak_reserved_mb": 0.15, "tokens_per_sec": 0.37},
               "book-memory": {"peak_alloc_mb": 0.15, "time_for_samples_s": 0.20}}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SEED_BOUNDS))
def test_ladder_estimates_against_the_seed_references(name, tmp_path):
    ladder = load_ladder(name)
    doc = predict_ladder(ladder, tmp_path, log=lambda line: None)
    for metric, bound in SEED_BOUNDS[name].items():
        refs = [r for r in doc["rungs"] if metric in r["reference"]]
        assert refs and all(r["status"] == "estimated" for r in refs)
        errors = [abs(r["estimate"][metric] / r["reference"][metric] - 1) for r in refs]
        mean = sum(errors) / len(errors)
        assert mean <= bound, f"{name} {metric}: mean relative error {mean:.1%} ({[round(e, 3) for e in errors]})"
        assert doc["estimate"]["mean_abs_error"][metric]["mean_abs_error"] == pytest.approx(mean)
    saved = json.loads((tmp_path / "ladder.json").read_text())
    assert set(saved["rungs"][0]["estimate"]) >= {"peak_alloc_mb", "peak_reserved_mb", "step_ms", "tokens_per_sec"}
    md = (tmp_path / "ladder.md").read_text()
    assert "est peak reserved GB" in md and ("ref reserved GB" in md or "ref alloc GB" in md)


def test_ladder_gpu_comes_from_the_reference_hardware():
    assert ladder_gpu(load_ladder("rasbt")) == "a100-80gb"  # "A100, PyTorch 2.6, CUDA 12.4"
    assert ladder_gpu(load_ladder("book-memory")) == "h100-sxm"  # "one H100; ..."
    assert ladder_gpu(load_ladder("rasbt"), "l4") == "l4"


# ----------------------------------------------------------------------------------------------
# The command and the advice


def test_estimate_command_gpt2_xl_in_seconds(capsys):
    t0 = time.process_time()  # CPU time, not wall time: a loaded machine slows the wall clock, not this
    assert main(["estimate", "--preset", "gpt2-xl", "--data.source", "synthetic", "--gpu", "h100-sxm", "--json"]) == 0
    assert time.process_time() - t0 < 30  # a few seconds on an idle CPU
    out = json.loads(capsys.readouterr().out)
    assert 1.5e9 < out["params"] < 1.6e9
    assert out["peak_reserved_mb"] >= out["peak_alloc_mb"] > out["breakdown_mb"]["optimizer state"] > 0
    assert sum(out["breakdown_mb"].values()) == pytest.approx(out["peak_alloc_mb"], rel=1e-6)
    assert out["tokens_per_sec"] > 0 and 0 < out["mfu"] < 1


def test_estimate_command_text_and_errors(capsys):
    assert main(["estimate", "--preset", "gpt2-124m", "--data.source", "synthetic", "--gpu", "l4",
                 "--train.batch_size", "24"]) == 0
    out = capsys.readouterr().out
    assert "peak reserved" in out and "DOES NOT FIT" in out and "advice: this needs about" in out
    assert main(["estimate", "--preset", "tiny", "--gpu", "a100-41gb"]) == 2
    assert "unknown GPU 'a100-41gb'" in capsys.readouterr().err
    assert main(["estimate", "--gpus"]) == 0
    table = capsys.readouterr().out
    for key in ("a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "l4", "rtx-4090"):
        assert f"`{key}`" in table


def test_memory_advice_names_a_switch_that_fits():
    cfg = C.resolve("gpt2-124m", overrides={"data.source": "synthetic", "train.batch_size": 32,
                                            "train.precision": "fp32"}, overrides_from_string=False)
    text = memory_advice(cfg, "NVIDIA A100-SXM4-40GB")
    m = re.match(r"this needs about ([\d.]+) GB per GPU .*; with (--\S+ \S+.*) it needs about ([\d.]+) GB$", text)
    assert m, text
    need, after = float(m.group(1)), float(m.group(3))
    assert need > 39.6 > after  # too big for the 40 GB A100, and the switch brings it under
    switches = m.group(2).split()
    overrides = {k[2:]: v for k, v in zip(switches[::2], switches[1::2])}
    fixed = C.validate(C.apply_overrides(C.from_dict(cfg.to_dict()), overrides, from_string=True))
    assert estimate(fixed, "a100-40gb").peak_reserved_mb / 1024 == pytest.approx(after, abs=0.1)


def test_memory_advice_shards_over_the_jobs_own_gpus():
    """A job of 2 processes whose config fits no GPU of 11.7 GB with the single-GPU switches: the advice shards over
    the two it has (FSDP, parallel.dp_shard -1) before it suggests more GPUs, and the figure it prints is the
    estimate of the config with its flags on 2 processes."""
    cfg = C.resolve("gpt2-xl", overrides={"data.source": "synthetic", "train.batch_size": 1, "model.block_size": 256,
                                          "memory.activation_checkpointing": 1, "model.loss_impl": "chunked"},
                    overrides_from_string=False)
    text = memory_advice(cfg, "l4", 2, capacity_mb=12000)
    m = re.match(r"this needs about ([\d.]+) GB per GPU .*; with (--\S+ \S+.*?) it needs about ([\d.]+) GB", text)
    assert m and "--parallel.dp_shard -1" in m.group(2) and "more GPUs" not in text, text
    switches = m.group(2).split()
    overrides = {k[2:]: v for k, v in zip(switches[::2], switches[1::2])}
    fixed = C.validate(C.apply_overrides(C.from_dict(cfg.to_dict()), overrides, from_string=True))
    est = estimate(fixed, "l4", 2)
    assert est.layout == "FSDP x2" and est.peak_reserved_mb / 1024 == pytest.approx(float(m.group(3)), abs=0.1)
    assert float(m.group(3)) < 12000 / 1024 < float(m.group(1))


def test_fsdp_cpu_offload_is_a_memory_switch_under_fsdp_only():
    """The one list offers parallel.fsdp_cpu_offload where FSDP shards (it needs it), not under DDP/ZeRO-1 nor once
    on; the advice on 2 processes of a 3 GB GPU chooses FSDP, then its CPU offload, and prints the estimate of
    the config with both."""
    from tokenmill.config.memory_switches import getter, memory_switches

    def offered(**over):
        cfg = C.resolve("gpt2-xl", overrides={"data.source": "synthetic", **over}, overrides_from_string=False)
        return [s.overrides for s in memory_switches(getter(cfg)) if "parallel.fsdp_cpu_offload" in s.overrides]

    assert offered(**{"parallel.dp_shard": 2}) == [{"parallel.fsdp_cpu_offload": True}]
    assert offered() == offered(**{"parallel.zero1": True}) == []
    assert offered(**{"parallel.dp_shard": 2, "parallel.fsdp_cpu_offload": True}) == []
    cfg = C.resolve("gpt2-xl", overrides={"data.source": "synthetic", "train.batch_size": 1, "model.block_size": 256,
                                          "memory.activation_checkpointing": 1, "model.loss_impl": "chunked",
                                          "train.precision": "bf16"}, overrides_from_string=False)
    text = memory_advice(cfg, "l4", 2, capacity_mb=3000)
    m = re.match(r"this needs about [\d.]+ GB per GPU .*; with (--\S+ \S+.*?) it needs about ([\d.]+) GB$", text)
    assert m and "--parallel.dp_shard -1" in m.group(1) and "--parallel.fsdp_cpu_offload true" in m.group(1), text
    switches = m.group(1).split()
    overrides = {k[2:]: v for k, v in zip(switches[::2], switches[1::2])}
    fixed = C.validate(C.apply_overrides(C.from_dict(cfg.to_dict()), overrides, from_string=True))
    assert estimate(fixed, "l4", 2).peak_reserved_mb / 1024 == pytest.approx(float(m.group(2)), abs=0.1)


def test_docs_gpu_table_is_the_code_table():
    from pathlib import Path

    from tokenmill.estimate.gpus import gpu_table_markdown

    doc = (Path(__file__).resolve().parents[1] / "docs" / "estimate.md").read_text()
    table = doc.split("<!-- gpu-table:start -->")[1].split("<!-- gpu-table:end -->")[0].strip()
    assert table == gpu_table_markdown()
    assert gpu_spec("NVIDIA A100-SXM4-40GB").key == "a100-40gb" and gpu_spec("h100").key == "h100-sxm"


def test_estimate_beside_a_measured_rung():
    from tokenmill.bench.predict import estimate_beside

    cfg = small()
    summary = {"gpu_name": "NVIDIA H100 80GB HBM3", "peak_alloc_mb": 50.0, "peak_reserved_mb": 60.0,
               "step_time_ms": 10.0, "tokens_per_sec": 1e5}
    rec = estimate_beside(cfg, 1, summary)
    est = rec["estimate"]
    assert rec["estimate_error_vs_measured"]["peak_alloc_mb"] == pytest.approx(est["peak_alloc_mb"] / 50.0 - 1)
    assert rec["estimate_error_vs_measured"]["step_ms"] == pytest.approx(est["step_ms"] / 10.0 - 1)
    assert estimate_beside(cfg, 1, {"gpu_name": "Some Future GPU"})["estimate"] is None
