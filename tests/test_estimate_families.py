"""tokenmill estimate for the Llama family (RoPE, RMSNorm, SwiGLU, grouped-query attention, q/k norm): the
presets' shapes against the published parameter counts, the estimates against measured CPU allocations
(as tests/test_estimate.py does for GPT-2), the CUDA attention kernels the device model picks, the sharded
bytes of an 8-GPU Llama 3.1 8B run by hand, and the sizing searches on a family preset."""

import json
import time

import pytest
import torch
import torch.nn.functional as F

from test_estimate import measured_peak_mb, small
from tokenmill import config as C
from tokenmill.bench.sizing import FAMILY_SHAPES, SHAPES, EstimateProbe, model_shapes, search_max_batch
from tokenmill.cli import main
from tokenmill.errors import ParallelError
from tokenmill.estimate import estimate, vocab_size_of
from tokenmill.estimate.core import param_counts
from tokenmill.estimate.device import DeviceModel
from tokenmill.estimate.recorder import Recorder
from tokenmill.model.build import param_counts as model_param_counts

MiB = 1024 * 1024
# autocast hands RMSNorm (q/k norm) bf16 inputs with fp32 weights; PyTorch warns and runs its unfused form
pytestmark = pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")

# ----------------------------------------------------------------------------------------------
# The presets: each model's config.json shape, checked against its published parameter count

# preset -> (vocabulary, published total parameters, published non-embedding parameters or None). Totals
# count a tied head once: Llama 3.2 1B 1.236B and Llama 3.1 8B 8.03B (Meta's model cards), Qwen3-0.6B 0.596B
# with 0.44B non-embedding and Qwen2.5-0.5B 0.494B (Qwen's model cards), SmolLM2 134.5M and 361.8M.
PUBLISHED = {
    "smollm2-135m": (49152, 134.5e6, None),
    "smollm2-360m": (49152, 361.8e6, None),
    "qwen2.5-0.5b": (151936, 0.494e9, None),
    "qwen3-0.6b": (151936, 0.596e9, 0.44e9),
    "llama3.2-1b": (128256, 1.236e9, None),
    "llama3.1-8b": (128256, 8.03e9, None),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_parameter_counts_match_the_published_ones(name):
    cfg = C.resolve(name, overrides={"data.source": "synthetic"}, overrides_from_string=False)
    vocab, total, non_embedding = PUBLISHED[name]
    m = cfg.model
    assert vocab_size_of(cfg) == m.vocab_size == vocab  # the preset's vocabulary, nothing prepared
    assert (m.pos_emb, m.norm_type, m.mlp, m.bias) == ("rope", "rmsnorm", "swiglu", False)
    counts = model_param_counts(m, vocab)
    assert abs(counts.total / total - 1) <= 0.005, f"{name}: {counts.total:,} vs published {total:,.0f}"
    assert counts.position_embedding == 0
    if non_embedding:
        assert abs((counts.total - counts.token_embedding) / non_embedding - 1) <= 0.005
    assert param_counts(cfg, vocab)[0] == counts.total  # what tokenmill estimate reports


# ----------------------------------------------------------------------------------------------
# Estimates of CPU runs against measured CPU allocations (the check of tests/test_estimate.py)

LLAMA = {"model.pos_emb": "rope", "model.norm_type": "rmsnorm", "model.mlp": "swiglu", "model.n_kv_head": 2,
         "model.intermediate_size": 352, "model.bias": False, "model.qkv_bias": False, "train.precision": "fp32"}
FAMILY_CASES = {
    "llama-sdpa-gqa": {},
    "llama-checkpointed-dropout": {"memory.activation_checkpointing": 1, "model.dropout": 0.1},
    "llama-pure-bf16-manual": {"train.precision": "bf16", "model.attention": "manual", "model.norm": "manual"},
    "llama-autocast-chunked": {"train.precision": "bf16-autocast", "model.loss_impl": "chunked",
                               "model.loss_chunk_size": 64},
    "qwen3-qknorm-bias-autocast": {"model.qk_norm": True, "model.head_dim": 64, "model.qkv_bias": True,
                                   "model.fused_qkv": False, "train.precision": "bf16-autocast"},
    "mqa-llama3-rope-untied-accum": {"model.n_kv_head": 1, "model.rope_scaling": "llama3",
                                     "model.rope_original_context": 64, "model.tie_embeddings": False,
                                     "train.grad_accum_steps": 2, "memory.activation_checkpointing": 1,
                                     "optim.impl": "for-loop"},
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(FAMILY_CASES))
def test_family_estimates_agree_with_measured_cpu_allocations(case, tmp_path):
    cfg = small(**{**LLAMA, **FAMILY_CASES[case]})
    est = estimate(cfg, "cpu").peak_alloc_mb
    meas = measured_peak_mb(cfg, tmp_path)
    assert abs(est / meas - 1) <= 0.02, f"{case}: estimate {est:.3f} MiB, measured {meas:.3f} MiB"


def test_rope_tables_are_counted_with_the_parameters():
    """The model's cos/sin tables (block_size x head width each, buffers outside the blocks) live on the
    device beside the parameters; learned positions have none."""
    rope = small(**LLAMA)
    n_params, _ = param_counts(rope, 512)
    tables = 2 * 128 * 32 * 4  # cos and sin, T=128 x head width 128/4, fp32
    at_peak = estimate(rope, "cpu").breakdown_mb["parameters"] * MiB
    assert at_peak == 4 * n_params + tables
    gpt = small(**{"train.precision": "fp32"})
    assert estimate(gpt, "cpu").breakdown_mb["parameters"] * MiB == 4 * param_counts(gpt, 512)[0]


# ----------------------------------------------------------------------------------------------
# CUDA: the attention kernel, layouts


def _attention_saved(heads: int, kv_heads: int, dtype: torch.dtype, device: str = "cuda") -> int:
    """Bytes a causal SDPA of q (4, heads, 64, 32) over k, v (4, kv_heads, 64, 32) keeps beside its output,
    traced under the device model (as tests/test_estimate.py measures the single-head-count kernels)."""
    with torch.device("meta"):
        q = torch.empty(4, heads, 64, 32, dtype=dtype, requires_grad=True)
        k, v = (torch.empty(4, kv_heads, 64, 32, dtype=dtype, requires_grad=True) for _ in range(2))
    rec = Recorder({t.untyped_storage()._cdata for t in (q, k, v)})
    with DeviceModel(device), rec:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
        rec.sweep()
    return sum(rec.sizes[sid] for _, (_, sid, _) in rec.live.items()) - out.numel() * out.element_size()


def test_cuda_grouped_query_attention_runs_flash_only_in_bf16():
    """With fewer key/value heads, CUDA's only fused kernel for grouped heads is flash attention (fp16 /
    bf16): in fp32 PyTorch takes the math path, which keeps the B x H x T x T attention weights and the
    keys and values repeated per query head; with as many heads the memory-efficient kernel takes fp32."""
    lse = 4 * 8 * 64 * 4  # the fp32 log-sum-exp (B, H, T) of a fused kernel
    assert _attention_saved(8, 8, torch.float32) == lse
    assert _attention_saved(8, 2, torch.bfloat16) == lse
    assert _attention_saved(8, 2, torch.float32) >= 4 * 8 * 64 * 64 * 4 + 2 * 4 * 8 * 64 * 32 * 4
    assert _attention_saved(8, 2, torch.float32, "cpu") == lse  # the CPU's flash kernel takes grouped heads


def test_family_tensor_and_pipeline_parallel_layouts():
    base = {**LLAMA, "model.n_head": 8, "model.n_kv_head": 4, "model.fused_qkv": False, "train.precision": "bf16"}
    one = estimate(small(**base), "h100-sxm")
    tp = estimate(small(**{**base, "parallel.tp": 2, "parallel.dp_replicate": 1}), "h100-sxm", 2)
    assert tp.activations_per_block_mb["plain"] < 0.8 * one.activations_per_block_mb["plain"]
    assert tp.time_breakdown_ms["collectives_ms"] > 0 and tp.layout == "TP x2"
    pp = estimate(small(**{**base, "parallel.pp": 2, "parallel.dp_replicate": 1,
                           "model.tie_embeddings": False}), "h100-sxm", 2)
    assert pp.peak_alloc_mb < one.peak_alloc_mb and pp.layout == "PP x2"
    with pytest.raises(C.ConfigError, match=r"key/value heads \(4\) must be divisible by parallel.tp \(8\)"):
        small(**{**base, "parallel.tp": 8, "parallel.dp_replicate": 1})
    cfg = small(**{**base, "model.n_kv_head": 8})  # the model's own check, for a layout given to estimate()
    with pytest.raises(ParallelError, match="must be divisible by parallel.tp"):
        estimate(C.apply_overrides(cfg, {"parallel.tp": 16, "parallel.dp_replicate": 1}), "h100-sxm", 16)


def test_fsdp_state_keeps_the_parameters_dtype():
    """FSDP's shards keep the parameter's dtype: pure bf16 shards and AdamW moments are 2 bytes, fp32 4."""
    for precision, size in (("bf16", 2), ("fp32", 4)):
        cfg = small(**{**LLAMA, "train.precision": precision, "parallel.dp_shard": 2, "parallel.dp_replicate": 1})
        n = param_counts(cfg, 512)[0]
        state = estimate(cfg, "h100-sxm", 2).breakdown_mb["optimizer state"] * MiB
        assert state == pytest.approx(2 * size * n / 2, rel=0.01)


# ----------------------------------------------------------------------------------------------
# Llama 3.1 8B on eight H100s, FSDP


@pytest.mark.slow
def test_llama31_8b_fsdp8_in_seconds_and_by_hand(capsys):
    argv = ["estimate", "--preset", "llama3.1-8b", "--gpu", "h100", "--nproc", "8", "--parallel.dp_shard", "8",
            "--parallel.dp_replicate", "1", "--train.precision", "bf16-autocast"]
    t0 = time.process_time()  # CPU time, not wall time: a loaded machine slows the wall clock, not this
    assert main(argv) == 0  # the text report, with the advice (it does not fit at batch 8 x 8192)
    assert time.process_time() - t0 < 30  # a few seconds on an idle CPU
    text = capsys.readouterr().out
    assert "FSDP x8" in text and "DOES NOT FIT" in text and "advice:" in text
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    N, V, C, T = 8_030_261_248, 128256, 4096, 8192
    assert out["params"] == N
    # by hand, per rank: every matrix shards by rows over 8 ranks (all row counts divide by 8): fp32
    # parameters 4N/8; AdamW's two fp32 moments 8N/8. At the peak (the start of backward) the unit of the final
    # norm and the untied head is gathered whole (the token embedding, a unit of its own, was freed after its
    # forward: model/gpt.py edge_units), and the RoPE tables (T x 128, cos and sin).
    assert out["breakdown_mb"]["optimizer state"] * MiB == pytest.approx(8 * N / 8, rel=1e-4)
    head = (V * C + C) * 4
    assert out["breakdown_mb"]["parameters"] * MiB == pytest.approx(4 * N / 8 + head + 2 * T * 128 * 4, rel=1e-4)
    assert out["peak_reserved_mb"] > 81_079  # batch 8 x 8192 tokens does not fit an 80 GB H100
    tokens = 8 * 8 * T  # micro-batch 8 on each of 8 ranks
    assert out["tokens_per_sec"] == pytest.approx(tokens / (out["step_ms"] / 1000), rel=1e-6)
    assert 0.2 < out["mfu"] < 0.8


# ----------------------------------------------------------------------------------------------
# Sizing: max-batch and max-model for a family preset


def test_family_shapes_for_max_model():
    cfg = C.resolve("llama3.2-1b", overrides={"data.source": "synthetic"}, overrides_from_string=False)
    shapes = model_shapes(cfg)
    assert sorted(s["name"] for s in shapes) == sorted(s[0] for s in FAMILY_SHAPES)
    by_name = {s["name"]: s for s in shapes}
    assert by_name["llama3.2-1b"]["params"] == 1_235_814_400 and by_name["llama3.2-1b"]["family"] == {}
    qwen = by_name["qwen2.5-0.5b"]["family"]  # the config's vocabulary and tying, Qwen's heads and MLP
    assert qwen == {"model.intermediate_size": 4864, "model.n_kv_head": 2}
    # (layers, heads, width) shapes scale the MLP width and the grouping from the config (4 and 4:1 here)
    custom = model_shapes(cfg, [("x", 4, 12, 768)])[0]
    assert custom["family"] == {"model.intermediate_size": 3072, "model.n_kv_head": 3}
    gpt = model_shapes(C.resolve("gpt2-124m", overrides={"data.source": "synthetic"}, overrides_from_string=False))
    assert [s["name"] for s in gpt] == [s[0] for s in SHAPES] and all(s["family"] == {} for s in gpt)


@pytest.mark.slow
def test_max_batch_and_max_model_estimate_only_for_a_family_preset(tmp_path, capsys):
    cfg = C.resolve("qwen3-0.6b", overrides={"data.source": "synthetic", "train.precision": "bf16-autocast"},
                    overrides_from_string=False)
    probe = EstimateProbe(cfg, "batch", "h100-sxm")
    res = search_max_batch(probe, 1, 64, log=lambda s: None)
    b = res["max_batch"]
    assert 1 <= b < 64
    fits = [p for p in res["probes"] if p["value"] == b][0]
    assert fits["status"] == "fits" and fits["peak_reserved_mb"] <= 81_079
    out = tmp_path / "mm"
    assert main(["bench", "max-model", "--preset", "llama3.2-1b", "--estimate-only", "--gpu", "h100",
                 "--train.batch_size", "1", "--memory.activation_checkpointing", "1", "--max-params", "2e10",
                 "--run-dir", str(out)]) == 0
    text = capsys.readouterr().out
    found = json.loads((out / "max-model.json").read_text())
    assert found["estimate_only"] and not (out / "probes").exists()
    best = found["largest"]
    assert best["name"] in {s[0] for s in FAMILY_SHAPES} and f"largest that fits: {best['name']}" in text
    bigger = [s for s in found["shapes"] if s["params"] > best["params"]]
    assert bigger and all(p["status"] == "too-big" for p in found["probes"] if p["value"] == bigger[0]["name"])
