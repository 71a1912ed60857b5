"""Streaming element-wise kernels at BabelStream's share of the bandwidth, everything else at MEMORY_EFFICIENCY
(tokenmill/estimate/bandwidth.py): the constant against its cited figures, eager ops traced by the recorder, and
Inductor's fused pointwise and reduction kernels as estimate/inductor.py plans them."""

import pytest
import torch

from tokenmill import config as C
from tokenmill.estimate import bandwidth as B
from tokenmill.estimate import roofline as R
from tokenmill.estimate.gpus import gpu_spec
from tokenmill.estimate.inductor import plan_graph
from tokenmill.estimate.recorder import OpCost, Recorder


@pytest.fixture(scope="module")
def cfg():
    return C.resolve("gpt2-124m", overrides={"data.source": "synthetic"}, overrides_from_string=False)


def _traced(fn, *shapes, dtype=torch.bfloat16) -> list[OpCost]:
    args = [torch.empty(s, dtype=dtype, device="meta") for s in shapes]
    with Recorder() as rec:
        fn(*args)
    return rec.costs


def test_streaming_share_is_the_cited_copy_bandwidth():
    # BabelStream's Copy on Azure's ND A100 v4 and ND H100 v5: 1.61 and 2.90 TB/s of 2,039 and 3,350 GB/s
    assert B.STREAM_MEMORY_EFFICIENCY["a100"] == pytest.approx(1610 / 2039)
    assert B.STREAM_MEMORY_EFFICIENCY["h100"] == pytest.approx(2900 / 3350)
    # the datasheet figures are the GPU table's for the measured GPUs
    assert gpu_spec("a100-80gb").hbm_gbs == B.STREAM_DATASHEET_GBS["a100"]
    assert gpu_spec("h100-sxm").hbm_gbs == B.STREAM_DATASHEET_GBS["h100"]
    # streaming is faster than the softmax-derived share, and below the datasheet
    for a in ("a100", "h100"):
        assert B.MEMORY_EFFICIENCY[a] < B.STREAM_MEMORY_EFFICIENCY[a] < 1.0
    # the RTX 4090 its own copy kernel's (xytpai/nvbench: 904.3 GB/s), the L4 (8.9) the A100's, the H200 the H100's
    assert B.streaming_bandwidth(gpu_spec("rtx-4090")) == pytest.approx(904.335e9)
    assert B.streaming_bandwidth(gpu_spec("l4")) == pytest.approx(gpu_spec("l4").hbm_gbs * 1e9 * 1610 / 2039)
    assert B.streaming_bandwidth(gpu_spec("h200")) == pytest.approx(gpu_spec("h200").hbm_gbs * 1e9 * 2900 / 3350)


@pytest.mark.parametrize("key", ["a100-80gb", "h100-sxm"])
def test_eager_add_streams_and_softmax_does_not(cfg, key):
    gpu = gpu_spec(key)
    n = 8192 * 4096
    (add,) = _traced(torch.add, (8192, 4096), (8192, 4096))
    assert add.name == "add" and add.bytes == 3 * 2 * n  # two bf16 inputs read, one written
    stream = gpu.hbm_gbs * 1e9 * B.STREAM_MEMORY_EFFICIENCY[B.arch(gpu.cc)]
    assert R._op_seconds(add, cfg, gpu, 1) == pytest.approx(add.bytes / stream)
    (inplace,) = _traced(lambda x, y: x.mul_(y), (8192, 4096), (8192, 4096))
    assert inplace.name == "mul_" and R._op_seconds(inplace, cfg, gpu, 1) == pytest.approx(inplace.bytes / stream)
    (cast,) = _traced(lambda x: x.float(), (8192, 4096))
    assert cast.name == "_to_copy" and R._op_seconds(cast, cfg, gpu, 1) == pytest.approx(6 * n / stream)
    (soft,) = _traced(lambda x: torch.softmax(x, -1), (8192, 4096))
    assert soft.name == "_softmax" and soft.bytes == 2 * 2 * n
    plain = gpu.hbm_gbs * 1e9 * B.MEMORY_EFFICIENCY[B.arch(gpu.cc)]
    assert R._op_seconds(soft, cfg, gpu, 1) == pytest.approx(soft.bytes / plain)


def test_which_names_stream():
    for name in ("add", "add_", "mul", "_to_copy", "copy_", "silu", "silu_backward", "gelu", "where", "fill_",
                 "native_dropout_backward", "convert_element_type", "zeros_like", "nf4_dequant"):
        assert B.streams(name), name
    for name in ("sum", "mean", "amax", "var_mean", "_softmax", "_softmax_backward_data", "native_layer_norm",
                 "cat", "stack", "slice_backward", "index", "gather", "index_put_", "embedding",
                 "embedding_dense_backward", "native_dropout", "mm"):
        assert not B.streams(name), name
    # one-pass reductions (BabelStream's dot share); softmax and the norms make a second pass and are not
    for name in ("sum", "mean", "amax", "var_mean", "linalg_vector_norm"):
        assert B.reduces(name), name
    for name in ("_softmax", "_log_softmax", "_softmax_backward_data", "native_layer_norm", "add", "cat"):
        assert not B.reduces(name), name


def test_reduction_share_is_the_cited_dot_bandwidth(cfg):
    # BabelStream's Dot in the same Azure runs: 1.75 and 3.18 TB/s of 2,039 and 3,350 GB/s
    assert B.REDUCE_MEMORY_EFFICIENCY["a100"] == pytest.approx(1750 / 2039)
    assert B.REDUCE_MEMORY_EFFICIENCY["h100"] == pytest.approx(3180 / 3350)
    h100 = gpu_spec("h100-sxm")
    red = OpCost("mean", bytes=1e9)
    assert R._op_seconds(red, cfg, h100, 1) == pytest.approx(1e9 / (3350e9 * 3180 / 3350))


def _rms_kernels(width: int, cpu: bool = False) -> list[OpCost]:
    from torch.fx.experimental.proxy_tensor import make_fx

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    gm = make_fx(rms, tracing_mode="fake")(torch.randn(64, width), torch.randn(width))
    return [k.cost for k in plan_graph(gm, cpu=cpu).kernels]


def test_inductor_pointwise_kernel_streams_and_reduction_kernel_has_its_measured_share(cfg):
    """An RMS norm as Inductor plans it: the mean of squares is a fused reduction kernel (the streaming share x
    INDUCTOR_REDUCTION_SHARE, Inductor's own reduction kernels against its GELU on one A100); the scale, reading the
    mean and the weight and writing once, a fused pointwise kernel (the streaming share)."""
    kernels = _rms_kernels(256)
    assert [c.name for c in kernels] == ["mean", "mul"]
    assert B.INDUCTOR_REDUCTION_SHARE == pytest.approx((930.15 + 913.15) / 2 / 1073.02)
    h100 = gpu_spec("h100-sxm")
    # at these sizes the kernel floor would hide the bandwidth: compare the shares on the byte counts themselves
    assert all(c.fused for c in kernels)
    big = [OpCost(c.name, bytes=c.bytes * 1e4, fused=True) for c in kernels]
    assert R._op_seconds(big[1], cfg, h100, 1) == pytest.approx(big[1].bytes / B.streaming_bandwidth(h100))
    assert R._op_seconds(big[0], cfg, h100, 1) == pytest.approx(
        big[0].bytes / (B.streaming_bandwidth(h100) * B.INDUCTOR_REDUCTION_SHARE))
    # the same reduction as one eager ATen op: BabelStream's dot share
    eager = OpCost("mean", bytes=big[0].bytes)
    assert R._op_seconds(eager, cfg, h100, 1) == pytest.approx(eager.bytes / (h100.hbm_gbs * 1e9
                                                                            * B.REDUCE_MEMORY_EFFICIENCY["h100"]))


def test_a_persistent_reduction_loads_its_rows_once():
    """Inductor keeps a row of at most 1,024 elements reduced over its innermost dimension in registers (a persistent
    reduction, choices.py), so the scale fused after it does not read x again; a longer row loops over memory
    again, and a CPU graph's C++ kernels read it once per pass."""
    x, stats, w = 64 * 256 * 4, 64 * 4, 256 * 4
    mean, scale = _rms_kernels(256)
    assert mean.bytes == x  # the mean stays in the kernel (test_a_buffer_read_only_inside_its_fused_kernel...)
    assert scale.bytes == w + x  # the weight read, the output written: x held
    for width, cpu in ((4096, False), (256, True)):
        x, w = 64 * width * 4, width * 4
        mean, scale = _rms_kernels(width, cpu)
        assert scale.bytes == x + stats + w + x, (width, cpu)  # x read again, the output written


def test_a_softmax_sum_reads_its_rows_with_the_max_on_a_gpu():
    """On a GPU, Inductor's online softmax computes amax(x) and sum(exp(x - amax)) in one loop over x, however long
    the row (post_grad.py prepare_softmax_online): the vocabulary's log-softmax reads the logits once for both
    statistics and once more for its output; a CPU graph reads them once per pass; a row of 1,000 is persistent
    and read once."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    def plan(width, cpu):
        gm = make_fx(lambda z: torch.log_softmax(z, -1), decomposition_table=select_decomp_table(),
                     tracing_mode="fake")(torch.randn(8, width))
        costs = [k.cost for k in plan_graph(gm, cpu=cpu).kernels]
        assert [c.name for c in costs] == ["amax", "sum", "sub"]
        return [c.bytes for c in costs]

    s = 8 * 4  # one fp32 statistic a row
    for width, cpu, reads in ((50257, False, 2), (50257, True, 3), (1000, False, 1)):
        x = 8 * width * 4
        amax, total, out = plan(width, cpu)
        assert (amax >= x) + (total >= x) + (out >= 2 * x) == reads, (width, cpu)
        # bytes of (amax, sum, output) kernels: x read, statistics written and read, the output written; a row of
        # 1,000 is one persistent kernel whose statistics never leave it (kernel-local buffers)
        assert (amax, total, out) == {(50257, False): (x + s, 2 * s, 2 * x + 2 * s),
                                      (50257, True): (x + s, x + 2 * s, 2 * x + 2 * s),
                                      (1000, False): (x, 0, x)}[width, cpu]


def test_skinny_product_floor_streams(cfg):
    # a LoRA factor x (8192 x 4096) @ A^T (4096 x 8) in bf16: its operands read once, its output written once
    a100 = gpu_spec("a100-80gb")
    c = OpCost("mm", flops=2.0 * 8192 * 4096 * 8, math="bf16", min_dim=8, dims=(1, 8192, 4096, 8))
    nbytes = (8192 * 4096 + 4096 * 8 + 8192 * 8) * 2
    # priced at the longer of its math and its floor: the two within 2% (its 256-deep split slices keep
    # roofline.depth_share(256) of the deep rate), the floor its bytes at the streaming share
    floor = nbytes / (2039e9 * 1610 / 2039)
    assert floor <= R._op_seconds(c, cfg, a100, 1) <= 1.02 * floor


def test_a_buffer_read_only_inside_its_fused_kernel_is_never_stored_on_a_gpu():
    """Inductor removes a buffer whose every reader is fused into the kernel that writes it (codegen/common.py
    remove_kernel_local_buffers): a product of five inputs used twice (stored, as it reads more than 4 buffers), a
    persistent row sum of it and the difference, one kernel on a GPU: the five inputs read once and the output
    written, nothing else allocated; a CPU graph stores the product and the sum."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(a, b, c, d, e):
        t = a * b * c * d * e
        return t - t.sum(-1, keepdim=True)

    gm = make_fx(f, tracing_mode="fake")(*[torch.randn(64, 256) for _ in range(5)])
    x = 64 * 256 * 4
    gpu, cpu = plan_graph(gm, cpu=False), plan_graph(gm, cpu=True)
    assert sum(k.cost.bytes for k in gpu.kernels) == 5 * x + x
    assert [e[2] for e in gpu.events if e[0] == "a"] == [x]
    assert sum(k.launches for k in gpu.kernels) == 1
    assert sorted(e[2] for e in cpu.events if e[0] == "a") == [64 * 4, x, x]
    assert sum(k.cost.bytes for k in cpu.kernels) > 5 * x + x
