"""The estimator's roofline from physics (tokenmill.estimate.roofline): the memory floor of every matrix product,
the tile/wave share of the SMs against a hand computation, QLoRA's NF4 dequantisation costed from the bytes it
moves (and checked against torchao's own operations), and the kernel floor at its source."""

import pytest

from tokenmill import config as C
from tokenmill.estimate import bandwidth as BW
from tokenmill.estimate import estimate, host
from tokenmill.estimate import roofline as R
from tokenmill.estimate.gpus import gpu_spec
from tokenmill.estimate.recorder import OpCost
from tokenmill.model.lora import nf4_bytes


def _cfg(**over) -> C.Config:
    base = {"data.source": "synthetic", "model.vocab_size": 512, "model.n_layer": 2, "model.n_embd": 256,
            "model.n_head": 4, "model.block_size": 64, "train.batch_size": 4, "lora.rank": 8,
            "lora.targets": "q,k,v,o,up,down"}
    return C.resolve(None, overrides={**base, **over}, overrides_from_string=False)


def test_lora_rank8_product_is_priced_by_its_bytes():
    cfg, a100 = _cfg(), gpu_spec("a100-80gb")
    # the adapter's first factor over 8,192 tokens of a 4,096-wide model: x (8192 x 4096) @ A^T (4096 x 8)
    c = OpCost("mm", flops=2.0 * 8192 * 4096 * 8, math="bf16", min_dim=8, dims=(1, 8192, 4096, 8))
    nbytes = (8192 * 4096 + 4096 * 8 + 8192 * 8) * 2
    assert R.matmul_bytes(c) == nbytes
    memory = nbytes / BW.streaming_bandwidth(a100)  # one pass over the operands: the streaming share (bandwidth.py)
    math = c.flops / (a100.peak("bf16") * R.matmul_efficiency(c, "bf16", a100))
    # about its bytes' time: tens of microseconds, not the 0.1% of peak of a hand-set curve (split 16 ways to fill the
    # SMs, each 256-deep K slice keeps depth_share(256) of the deep rate: the math comes to within 2% of the bytes)
    assert math == pytest.approx(memory, rel=0.02)
    assert R._op_seconds(c, cfg, a100, 1) == pytest.approx(max(math, memory), rel=1e-9)
    assert 20e-6 < memory < 100e-6
    # a large square product stays compute-bound
    big = OpCost("mm", flops=2.0 * 8192 ** 3, math="bf16", min_dim=8192, dims=(1, 8192, 8192, 8192))
    assert R._op_seconds(big, cfg, a100, 1) == pytest.approx(
        big.flops / (a100.peak("bf16") * R.matmul_efficiency(big, "bf16", a100)))


def test_tile_and_wave_share_against_a_hand_computation():
    # H100 (132 SMs), 1024 x 768 x 768: 128x128 tiles, 8 x 6 = 48, split in two along K (384 deep) = 96 tiles in
    # one wave of 132 SMs; the 256-wide tiles give 24 (48 split) tiles: less
    assert R.quantization((1, 1024, 768, 768), 132) == pytest.approx(96 / 132)
    # He's measured shape: 4224 x 8192 x 2048 in 128 x 256 tiles = 33 x 8 = 264 tiles, two full waves
    assert R.quantization((1, 4224, 8192, 2048), 132) == pytest.approx(1.0)
    # A100 (108 SMs), 8192 x 768 x 3072: 128x128 tiles split in two = 64 x 24 x 2 = 3,072 tiles in 29 waves
    assert R.quantization((1, 8192, 768, 3072), 108) == pytest.approx(3072 / (29 * 108))
    h100 = gpu_spec("h100-sxm")
    c = OpCost("mm", flops=1.0, math="bf16", min_dim=768, dims=(1, 1024, 768, 768))
    # priced with the depth of each tile's K loop; on the H100 a split keeps 512 deep at least (SPLIT_K_MIN), so
    # this product runs unsplit: 48 tiles of 132 SMs, each 768 deep
    assert R.matmul_efficiency(c, "bf16", h100) == pytest.approx(794.5 / 989 * 48 / 132 * R.depth_share(768))


def test_nf4_dequantisation_bytes_by_hand():
    n = 4096 * 4096
    half, blocks = n // 2, n // 64
    eager = R.nf4_dequant_costs(n, 2)
    # the 256-entry pair table (16 values read, 256 written, twice; the pairs stacked), the absmax scales (int8 and
    # bf16 factors in, bf16 out; the mean added), the codes widened to int32 (1 + 4 bytes a byte), the pair lookup
    # (the int32 index read, two bf16 values gathered and written a byte), the in-place scale (read, write, scales)
    hand = (2 * 272 * 2 + 1024 * 2 + (blocks * 3 + 2 * (blocks // 256)) + (4 * blocks + 2) + 5 * half
            + (4 * half + 4 * n) + (4 * n + 2 * blocks))
    assert sum(c.bytes for c in eager) == pytest.approx(hand) and len(eager) == 8
    # 12.5 bytes a bf16 weight (the table reads counted) and the scales' 9 bytes a block: torchao moves ~33
    assert hand / n == pytest.approx(12.5 + 9 / 64, rel=1e-3)
    fused = R.nf4_dequant_costs(n, 2, compiled=True)
    assert len(fused) == 1 and fused[0].bytes == nf4_bytes(n) + 2 * n


def test_qlora_is_slower_than_lora_by_its_dequantisation():
    gpu = "a100-80gb"
    lora, qlora = _cfg(), _cfg(**{"lora.quantize_base": "nf4"})
    a, b = estimate(lora, gpu), estimate(qlora, gpu)
    assert b.tokens_per_sec < a.tokens_per_sec
    # per block: q, k, v (one fused 768 x 256 weight), o (256 x 256), up (1024 x 256), down (256 x 1024), each
    # dequantised in forward and in backward
    spec = gpu_spec(gpu)
    weights = [768 * 256, 256 * 256, 1024 * 256, 256 * 1024]
    elem = 4 if qlora.train.precision != "bf16" else 2
    per_pass = sum(R._op_seconds(c, qlora, spec, 1) for n in weights for c in R.nf4_dequant_costs(n, elem))
    extra_ms = 2 * qlora.model.n_layer * per_pass * 1000
    assert b.time_breakdown_ms["memory_bound_ms"] - a.time_breakdown_ms["memory_bound_ms"] == pytest.approx(extra_ms, rel=1e-6)


def test_kernel_floor_is_its_source():
    # CUDA.jl: 80 tiny kernels replayed as one CUDA graph in 70 us
    assert R.KERNEL_MIN_US == host.GRAPH_KERNEL_US == pytest.approx(70 / 80)


def test_large_matmul_share_is_its_source():
    # MAMF BF16 table (stas00/ml-engineering 744d01e1): A100 SXM 271.2 of 312, H100 SXM 794.5 of 989 ("H200 is the
    # same"); the 4090: zzc0721/torch-performance-test-data issue 78's bf16 at n = 2048..10240 over 165.2
    a100, h100, rtx = 271.2 / 312, 794.5 / 989, (164.81 + 151.50 + 160.17 + 158.54) / 4 / 165.2
    l4 = (70.89 + 54.91 + 59.40 + 56.90) / 4 / 121  # the same source's issue 120, n = 2048..10240, over 121
    cited = {"a100-40gb": a100, "a100-80gb": a100, "h100-sxm": h100, "h200": h100, "h100-pcie": h100, "l4": l4,
             "rtx-4090": rtx}
    assert R.MATMUL_EFFICIENCY == pytest.approx(cited)
    assert (round(100 * a100, 1), round(100 * h100, 1), round(100 * rtx, 1)) == (86.9, 80.3, 96.1)  # as printed
    # every GPU the estimator knows has its entry; the CPU falls back to the H100 SXM's
    from tokenmill.estimate.gpus import GPUS
    assert set(R.MATMUL_EFFICIENCY) == {k for k in GPUS if k != "cpu"}
    assert R.large_matmul_share(gpu_spec("cpu")) == h100
    # the share reaches the pricing: a full-wave product on the 4090 runs at its own share, not the H100's
    big = OpCost("mm", flops=2.0 * 8192 ** 3, math="bf16", min_dim=8192, dims=(1, 8192, 8192, 8192))
    assert R.matmul_efficiency(big, "bf16", gpu_spec("rtx-4090")) == pytest.approx(rtx)


@pytest.mark.slow
def test_nf4_costs_follow_the_dequantisation():
    """The eager dequantisation's kernels and bytes are model/nf4.py's own, recorded (imports torchao: ~10 s)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchao")
    from tokenmill.estimate.recorder import Recorder
    from tokenmill.model.nf4 import nf4_dequantize, to_nf4

    w = to_nf4(torch.randn(256, 128, dtype=torch.bfloat16))
    rec = Recorder()
    with rec:
        nf4_dequantize(w, torch.bfloat16)
    mine = R.nf4_dequant_costs(256 * 128, 2)
    assert [c.name for c in rec.costs] == [c.name for c in mine] and rec.n_ops == R.NF4_EAGER_OPS
    for g, m in zip(rec.costs, mine):  # the recorder counts an expanded input at its full size; the kernel reads 16
        assert g.bytes == (m.bytes if g.name != "clone" else m.bytes - 16 * 2 + 256 * 2), g.name


def test_link_bandwidth_is_nccls_model_of_each_link():
    # NCCL's topology model (src/graph/topo.h, topo.cc): 12 NVLink-3 links x 20.0 GB/s on an A100, 18 NVLink-4
    # links x 20.6 GB/s on an H100 or H200, an x16 PCIe link 16 lanes x its GT/s / 8 x 0.75
    assert BW.link_bandwidth(gpu_spec("a100-80gb")) == pytest.approx(12 * 20.0e9)
    assert BW.link_bandwidth(gpu_spec("a100-40gb")) == pytest.approx(12 * 20.0e9)
    assert BW.link_bandwidth(gpu_spec("h100-sxm")) == pytest.approx(18 * 20.6e9)
    assert BW.link_bandwidth(gpu_spec("h200")) == pytest.approx(18 * 20.6e9)
    assert BW.link_bandwidth(gpu_spec("l4")) == pytest.approx(16 * 16 / 8 * 0.75 * 1e9)  # PCIe 4.0 x16: 24 GB/s
    assert BW.link_bandwidth(gpu_spec("rtx-4090")) == pytest.approx(24e9)
    assert BW.link_bandwidth(gpu_spec("h100-pcie")) == pytest.approx(16 * 32 / 8 * 0.75 * 1e9)  # PCIe 5.0: 48 GB/s


def test_in_place_bytes_count_the_read_and_the_write():
    """An in-place op that reads its input (add_, mul_) moves it twice, as the out-of-place op does; one that only
    overwrites it (copy_, fill_, zero_) once (recorder.OVERWRITES)."""
    import torch

    from tokenmill.estimate.recorder import OVERWRITES, Recorder

    x, y = torch.zeros(1000), torch.ones(1000)
    rec = Recorder()
    with rec:
        x.add_(y)
        x.mul_(2.0)
        torch.add(x, y)
        x.copy_(y)
        x.zero_()
    got = {c.name: c.bytes for c in rec.costs}
    assert got == {"add_": 3 * 4000, "mul_": 2 * 4000, "add": 3 * 4000, "copy_": 2 * 4000, "zero_": 4000}
    assert {"copy_", "fill_", "zero_"} <= OVERWRITES and "add_" not in OVERWRITES


def test_depth_share_is_its_source():
    """OpenXLA's measured H100 table (matmul_interpolator_data.h, sm_90, bf16, batch 4 x 4096 x 4096 outputs): the
    TFLOPS at each depth K against the deep share x depth_share(K), within 3%."""
    measured = {256: 504.0, 512: 620.0, 1024: 726.0, 2048: 765.0, 4096: 793.0}
    deep = measured[R.DEPTH_REF]
    for k, tflops in measured.items():
        assert deep * R.depth_share(k) == pytest.approx(tflops, rel=0.03), k
    assert R.depth_share(8192) == R.depth_share(R.DEPTH_REF) == 1.0  # the best-shape share is the ceiling
    # TF32 (the table's fp32 column, XLA's default precision on the tensor cores): 242 at K = 256 against 347 at 4096
    assert 347.0 * R.depth_share(256, "tf32") == pytest.approx(242.0, rel=0.01)
    assert R.depth_share(256, "fp32") == 1.0  # CUDA-core fp32: no fixed cost charged
    # it reaches the pricing: GPT-2's K = 768 product keeps about 86% of a deep one's rate on the H100
    h100 = gpu_spec("h100-sxm")
    shallow = OpCost("mm", flops=1.0, math="bf16", min_dim=768, dims=(1, 8192, 768, 3072))
    deep_op = OpCost("mm", flops=1.0, math="bf16", min_dim=3072, dims=(1, 8192, 4096, 3072))
    ratio = R.matmul_efficiency(shallow, "bf16", h100) / R.matmul_efficiency(deep_op, "bf16", h100)
    assert ratio == pytest.approx(R.quantization((1, 8192, 768, 3072), 132, "bf16")
                                  / R.quantization((1, 8192, 4096, 3072), 132, "bf16"))
    assert R.quantization((1, 8192, 768, 3072), 132, "bf16") == pytest.approx(
        R.quantization((1, 8192, 768, 3072), 132) * R.depth_share(768))  # enough tiles: no split
    assert 0.85 < R.depth_share(768) < 0.87 and 0.8 < ratio < 0.9


def test_alignment_split_and_fp32_attention_are_their_sources():
    """UNALIGNED: PyTorch issue 181718's align1 products against the aligned one (4090, bf16); SPLIT_K_MIN: CUTLASS's
    eight K tiles a stream-K split (64 deep on Hopper, 32 on Ampere), so an H100 product 768 deep is not split where
    an A100 one is; fp32 fused attention: the TF32 peak (3xTF32 on the tensor cores) whatever train.tf32 says."""
    assert R.UNALIGNED == pytest.approx(0.714, abs=0.001)
    assert R.SPLIT_K_MIN == {"a100": 256, "h100": 512}
    few_tiles = (1, 256, 768, 256)  # 2 output tiles: splitting K is the only way to fill more SMs
    assert R.quantization(few_tiles, 132, split_min=512) == R.quantization(few_tiles, 132, split_min=769)
    assert R.quantization(few_tiles, 108, split_min=256) > R.quantization(few_tiles, 108, split_min=769)
    a100 = gpu_spec("a100-80gb")
    off = C.resolve("gpt2-124m", overrides={"train.tf32": False}, overrides_from_string=False)
    attn = OpCost("_efficient_attention_forward", flops=1e12, math="fp32", attention=True, attn=(12, 1024, 64))
    assert R._op_seconds(attn, off, a100, 1) == pytest.approx(1e12 / (a100.peak("tf32") * R.ATTENTION_EFFICIENCY))
    assert 0.25 < R.ATTENTION_EFFICIENCY < 0.32
