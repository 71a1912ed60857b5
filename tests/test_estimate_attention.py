"""The estimator's attention and element-wise kernel speeds against their published source: FlashAttention-2's
release benchmark (tokenmill/estimate/attention.py), for the fused kernel and for a standard PyTorch attention
traced by the estimator's own recorder and priced by its roofline."""

import math

import pytest
import torch
import torch.nn.functional as F

from tokenmill import config as C
from tokenmill.estimate import attention as A
from tokenmill.estimate import roofline as R
from tokenmill.estimate.gpus import gpu_spec
from tokenmill.estimate.recorder import OpCost, Recorder

SHAPES = [(32, 512), (16, 1024), (8, 2048), (4, 4096), (2, 8192)]  # (batch, tokens): 16k tokens, as benchmarked


def standard_attention(qkv: torch.Tensor, causal: bool) -> torch.Tensor:
    """The benchmark's PyTorch attention (benchmark_flash_attention.py at attention.BENCH_COMMIT), op for op:
    the scores by baddbmm into an empty tensor, the causal mask built in fp32 and added, softmax, dropout at 0,
    the values by einsum."""
    b, t, _, h, d = qkv.shape
    q, k, v = qkv.unbind(dim=2)
    q = q.permute(0, 2, 1, 3).reshape(b * h, t, d)
    k = k.permute(0, 2, 3, 1).reshape(b * h, d, t)
    scores = torch.empty(b * h, t, t, dtype=qkv.dtype, device=qkv.device)
    scores = torch.baddbmm(scores, q, k, beta=0, alpha=1 / math.sqrt(d)).view(b, h, t, t)
    if causal:
        scores = scores + torch.triu(torch.full((t, t), -10000.0, device=qkv.device), 1).to(dtype=scores.dtype)
    att = F.dropout(torch.softmax(scores, dim=-1), 0.0)
    return torch.einsum("bhts,bshd->bthd", att, v).to(dtype=qkv.dtype)


def _tflops(gpu, cfg, b: int, t: int, d: int, causal: bool) -> float:
    h = 2048 // d
    qkv = torch.empty(b, t, 3, h, d, dtype=torch.float16, device="meta", requires_grad=True)
    with Recorder() as rec:
        out = standard_attention(qkv, causal)
        out.backward(torch.empty_like(out))
    seconds = sum(R._op_seconds(c, cfg, gpu, 1) for c in rec.costs)
    return 3.5 * 4 * b * t * t * h * d / (2 if causal else 1) / seconds / 1e12


def test_memory_efficiency_reproduces_the_published_standard_attention():
    """MEMORY_EFFICIENCY is what makes the roofline give the 20 published figures per GPU, the mask's add and the
    casts streaming (estimate/bandwidth.py): mean signed error within 1% (the constant's comment states -0.1% /
    -0.4%), mean absolute within 8% (5.7% / 7.5%), every figure within 17% (13.1% / 16.2%)."""
    cfg = C.resolve("gpt2-124m", overrides={"data.source": "synthetic"}, overrides_from_string=False)
    for arch, key in A.BENCH_GPUS.items():
        gpu = gpu_spec(key)
        assert A.arch(gpu.cc) == arch
        errors = []
        for (a, causal, d), measured in A.PYTORCH_TFLOPS.items():
            if a != arch:
                continue
            for (b, t), m in zip(SHAPES, measured):
                errors.append(_tflops(gpu, cfg, b, t, d, causal) / m - 1)
        assert len(errors) == 20
        assert abs(sum(errors) / len(errors)) < 0.01, (arch, errors)
        assert sum(abs(e) for e in errors) / len(errors) < 0.08, (arch, errors)
        assert max(abs(e) for e in errors) < 0.17, (arch, errors)


def test_fused_attention_share_is_the_published_throughput():
    for (arch, d), row in A.FA2_CAUSAL_TFLOPS.items():
        cc = gpu_spec(A.BENCH_GPUS[arch]).cc
        for t, tflops in zip(A.SEQLENS, row):
            assert A.fa2_share(cc, t, d) * A.BENCH_PEAK_TFLOPS[arch] == pytest.approx(tflops)
    h100 = gpu_spec("h100-sxm").cc
    # between measurements: in log2 of the sequence and linear in the head size; held at the ends
    assert A.fa2_share(h100, 1448, 64) * 989.4 == pytest.approx((192 + 232) / 2, rel=0.01)
    assert A.fa2_share(h100, 1024, 96) * 989.4 == pytest.approx((192 + 221) / 2)
    assert A.fa2_share(h100, 128, 64) == A.fa2_share(h100, 512, 64)
    assert A.fa2_share(h100, 65536, 256) == A.fa2_share(h100, 16384, 128)
    # a grid of fewer blocks than SMs leaves some idle: GPT-2 at batch 1 (12 heads, 8 blocks of 128 queries each)
    assert A.grid_fill(12, 1024, 132) == pytest.approx(96 / 132)
    assert A.grid_fill(16 * 32, 1024, 132) == pytest.approx(4096 / (32 * 132))


def test_flash_attention_1_is_its_published_throughput_only_inside_its_block():
    """A validation case whose source ran FlashAttention 1 is priced at the same figures' FlashAttention bars; the
    estimate of a tokenmill run (outside the block) keeps FlashAttention-2's, and an unknown version is refused."""
    h100 = gpu_spec("h100-sxm").cc
    with A.flash_generation(1):
        for (arch, d), row in A.FA1_CAUSAL_TFLOPS.items():
            cc = gpu_spec(A.BENCH_GPUS[arch]).cc
            for t, tflops in zip(A.SEQLENS, row):
                assert A.fa2_share(cc, t, d) * A.BENCH_PEAK_TFLOPS[arch] == pytest.approx(tflops)
    assert A.fa2_share(h100, 2048, 128) * 989.4 == pytest.approx(265)
    with pytest.raises(ValueError, match="FlashAttention version must be one of"):
        with A.flash_generation(3):
            pass
    # what the harness runs: a case with flash_attention = 1 is slower than its twin without
    from tokenmill.estimate.validation import Case, run_case
    flags = {"model.n_layer": 2, "model.block_size": 2048, "train.batch_size": 8, "train.precision": "bf16"}
    twin = [Case(id=f"fa{v}", family="gpt2", source="x", config="x", gpu="h100-sxm", preset="gpt2-124m",
                 flags=flags, tokens_per_sec=1.0, flash_attention=v) for v in (1, 2)]
    fa1, fa2 = (run_case(c)["est_tokens_per_sec"] for c in twin)
    assert fa1 < 0.97 * fa2
    assert A.fa2_share(h100, 2048, 128) * 989.4 == pytest.approx(265)


def test_the_roofline_prices_fused_attention_by_its_shape():
    """A traced bf16 attention on the H100 runs at FlashAttention-2's share x its grid fill; fp32 inputs (the
    memory-efficient kernel) and a GPU before Ampere keep the hand value."""
    cfg = C.resolve("gpt2-124m", overrides={"data.source": "synthetic"}, overrides_from_string=False)
    h100 = gpu_spec("h100-sxm")
    flops = 2 * 2.0 * 1 * 12 * 1024 * 1024 * 64 * 0.5
    op = OpCost("_scaled_dot_product_flash_attention", flops=flops, math="bf16", attention=True, attn=(12, 1024, 64))
    share = A.fa2_share(h100.cc, 1024, 64) * 96 / 132
    assert R._op_seconds(op, cfg, h100, 1) == pytest.approx(flops / (h100.peak("bf16") * share))
    assert R.attention_share(OpCost("x", flops=1.0, math="fp32", attention=True, attn=(12, 1024, 64)), "tf32",
                             h100) == R.ATTENTION_EFFICIENCY
    # an older GPU: the hand value
    old = type(h100)(**{**h100.__dict__, "cc": (7, 0)})
    assert R.attention_share(op, "bf16", old) == R.ATTENTION_EFFICIENCY


def test_flex_tile_share_is_what_create_block_mask_keeps():
    """The tiles the estimator counts for documents packed in a window are the non-empty tiles (partial and full)
    of torch's own block mask for the same documents (causal, same document), exactly."""
    from torch.nn.attention.flex_attention import create_block_mask

    T, rng = 1024, torch.Generator().manual_seed(0)
    windows = []
    for _ in range(3):
        lengths = []
        while True:
            n = int(torch.randint(20, 400, (1,), generator=rng))
            if sum(lengths) + n > T - 50:
                break
            lengths.append(n)
        windows.append(lengths)
    doc = torch.zeros(len(windows), T, dtype=torch.long)
    for b, lengths in enumerate(windows):  # the rest of each window: one more document (packed padding)
        doc[b, sum(lengths):] = len(lengths)
        for i, start in enumerate([0, *torch.tensor(lengths).cumsum(0).tolist()[:-1]]):
            doc[b, start:start + lengths[i]] = i

    def same_document(b, h, q, k):
        return (q >= k) & (doc[b, q] == doc[b, k])

    mask = create_block_mask(same_document, len(windows), None, T, T, device="cpu")
    n = T // A.FLEX_BLOCK
    kept = int(mask.kv_num_blocks.sum()) + int(mask.full_kv_num_blocks.sum())
    assert A.flex_tile_share(windows, T) == kept / (len(windows) * n * (n + 1) // 2)
    assert A.flex_tile_share([[512, 512]], 1024) == pytest.approx(20 / 36) and A.flex_tile_share([[1024]], 1024) == 1
