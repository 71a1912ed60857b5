"""Step time from a roofline over the traced kernels.

Every kernel the trace records (:class:`~tokenmill.estimate.trace.OpCost`) costs the larger of:

- matrix products: the larger of their math time, FLOPs / (dense peak of its math mode x efficiency), and their
  memory time, the bytes of both operands and the output / (memory bandwidth x ``STREAM_MEMORY_EFFICIENCY``,
  :mod:`.bandwidth`: one pass over them), so a skinny product (a LoRA adapter's rank-8 factor) is priced by the
  bytes it moves, not as compute. The efficiency is not a hand-set curve: it is what large products reach
  (``MATMUL_EFFICIENCY``, measured per GPU) times the share of the SMs the product's tiles keep busy
  (:func:`quantization`: tile and wave quantization over the GPU's SM count, NVIDIA's "Matrix Multiplication
  Background User's Guide"), times ``UNALIGNED`` when a dimension is not a multiple of 8 (an unpadded vocabulary:
  cuBLAS falls back to slower kernels); fused attention kernels run at FlashAttention-2's published share of the
  peak for their sequence length and head size, scaled by the SMs their grid fills (:mod:`.attention`). The math
  mode is the operands' dtype (bf16/fp16); fp32 matmuls run on TF32 tensor cores with ``train.tf32``;
  ``benchmarks/validation/gemm_efficiency.py`` measures all of it on a lent GPU;
- QLoRA's base: every NF4 weight dequantised in the forward and the backward (:func:`nf4_dequant_costs`);
- everything else: bytes read and written / (memory bandwidth x a share, :mod:`.bandwidth`): a streaming
  element-wise kernel (one read of each input, one write, no reduction; eager or an Inductor pointwise kernel)
  at ``STREAM_MEMORY_EFFICIENCY`` (BabelStream's copy), the rest (reductions, softmax, norms, gathers and
  scatters, cat) at ``MEMORY_EFFICIENCY``;
- ``KERNEL_MIN_US`` (a kernel never takes less).

Each constant below names its source; ``docs/estimate.md`` lists those still awaiting a measurement. The host
issues the step while the GPU runs it, so a step takes the longer of the GPU's time and the host's
(:mod:`.host`: per dispatched eager op, per compiled kernel, per graph call, per optimizer call, with their
measured sources): with small micro-batches the host sets the pace. A compiled piece's costs are Inductor's
own fused kernels (:mod:`.inductor`), not the eager ops scaled by a factor.

Added to the compute: the optimizer step (AdamW's memory traffic: ``ADAMW_PASSES`` passes over the
parameter-sized tensors for foreach/for-loop, ``FUSED_ADAMW_PASSES`` fused, foreach and fused through
multi-tensor-apply kernels at ``FOREACH_MEMORY_EFFICIENCY`` of the bandwidth; for-loop also launches
its kernels parameter by parameter), gradient clipping, data loading (``data.cpu_work_ms`` per sample,
spread over the workers), and collectives at the link bandwidth: DDP's gradient all-reduce and FSDP's
all-gathers and reduce-scatters overlap with compute (only what is longer than the compute shows),
tensor parallelism's all-reduces are on the critical path, and the pipeline adds its bubble
``(pp - 1) / micro-batches`` of a stage's time. Muon's step (``optim.name``) and FP8 matmuls
(``train.fp8``): :mod:`tokenmill.estimate.techniques`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from tokenmill import config as C
from tokenmill.estimate.attention import arch, attention_efficiency
from tokenmill.estimate.bandwidth import (
    kernel_bandwidth,
    link_bandwidth,
    memory_bandwidth,
    streaming_bandwidth,
)
from tokenmill.estimate.collectives import comm_seconds, contention_seconds
from tokenmill.estimate.gpus import GPU
from tokenmill.estimate.host import (
    COMPILED_KERNEL_US,
    CUDA_LAUNCH_US,
    GRAPH_KERNEL_US,
    HOST_OP_US,
    graph_call_seconds,
    optimizer_host_seconds,
    overlap,
    round_host_seconds,
)
from tokenmill.estimate.recorder import OpCost
from tokenmill.estimate.step import Plan, offloaded_sizes
from tokenmill.estimate.techniques import (
    docmask_attention_seconds,
    fp8_linear_op,
    fp8_on,
    fp8_op_seconds,
    muon_hidden,
    muon_seconds,
    offload_stall_seconds,
)
from tokenmill.estimate.timeline import Layout
from tokenmill.estimate.trace import Pieces

# Every constant names its source: a published measurement, a count read from the code that runs, or one still
# to be measured (benchmarks/validation/gemm_efficiency.py, a part of benchmarks/session.py; docs/estimate.md lists
# those). None is chosen by its score on the validation set.
# Share of the dense peak a large product reaches when its tiles fill every SM, per GPU (the estimator's keys).
# One methodology where it exists: S. Bekman's "Maximum Achievable Matmul FLOPS" (MAMF) BF16 table
# (github.com/stas00/ml-engineering, compute/accelerator/README.md at commit 744d01e1): mamf-finder.py times
# torch.mm over a sweep of shapes (CUDA events, L2 flushed, mean of 100 runs after 50 warm-ups) and reports the
# best shape's mean TFLOPS, over the dense peak it names. The RTX 4090, which that table lacks: the mean of the
# bf16 torch.mm TFLOPS that github.com/zzc0721/torch-performance-test-data issue 78 reports (torch 2.7.0+cu128;
# square n x n, 30 runs after 6 warm-ups, wall clock) at the sizes whose 256 x 128 output tiles alone fill its 128
# SMs (n >= 2048; n = 1024 has 32 such tiles), a rule fixed before any validation result was looked at; over the
# Ada whitepaper's 165.2 TFLOPS (BF16, FP32 accumulate, dense). Cross-check, not used: fp16 167.1 / 158.6 TFLOPS at
# n = 2048 / 8192 on a 4090 (github.com/mli/transformers-benchmarks issue 4). A GPU without a published figure
# takes the H100 SXM's share (:func:`large_matmul_share`); gemm_efficiency.py measures the share on a lent GPU.
MATMUL_EFFICIENCY = {
    "a100-40gb": 271.2 / 312,  # MAMF "NVIDIA A100 SXM": 271.2 of 312 TFLOPS (86.9%), 1024x10240x5120, torch 2.6.0
    "a100-80gb": 271.2 / 312,  # the same row: the table names no memory size; both are SXM4, 108 SMs at 1410 MHz
    "h100-sxm": 794.5 / 989,  # MAMF "NVIDIA H100 SXM": 794.5 of 989 TFLOPS (80.3%), 2048x2048x13312, torch 2.7.0
    "h200": 794.5 / 989,  # the H100 SXM row, whose note reads "H200 is the same"
    "h100-pcie": 794.5 / 989,  # no published figure: the H100 SXM's share
    "l4": (70.89 + 54.91 + 59.40 + 56.90) / 4 / 121,  # the same source's issue 120 (torch 2.9.0), same rule: 50.0%
    "rtx-4090": (164.81 + 151.50 + 160.17 + 158.54) / 4 / 165.2,  # issue 78, n = 2048, 4096, 8192, 10240: 96.1%
}


def large_matmul_share(gpu: GPU) -> float:
    """``MATMUL_EFFICIENCY`` of ``gpu``; a GPU it does not list (the CPU) takes the H100 SXM's."""
    return MATMUL_EFFICIENCY.get(gpu.key, MATMUL_EFFICIENCY["h100-sxm"])


# a dimension not a multiple of 8: cuBLAS's align1 kernels. PyTorch issue 181718 (RTX 4090, bf16 square products):
# N = 2055, 2057, 2071, 2073 at 115.6 / 106.8 / 110.9 / 112.0 TFLOPS against N = 2040's 155.9: 0.714
UNALIGNED = (115.6 + 106.8 + 110.9 + 112.0) / 4 / 155.9
# bf16/fp16 fused attention: FlashAttention-2's published throughput (estimate/attention.py). fp32 inputs run the
# memory-efficient kernel, whose fp32 products are 3xTF32 on the tensor cores whatever train.tf32 says (PyTorch's
# mem_eff_attention/gemm_kernel_utils.h, DefaultGemmType for sm80+): a share of the TF32 peak, xformers' A100 fp32
# forward (facebookresearch/xformers PR 587: B 64, M 1024, H 16, K 64 / 128 at 49.1 / 43.0 TFLOPS over 156)
ATTENTION_EFFICIENCY = (49.1 + 43.0) / 2 / 156
# multi-tensor-apply kernels (foreach and fused AdamW, clip_grad_norm_'s foreach norm and scale) launch at most 320
# blocks per kernel (MultiTensorApply.cuh before CUDA 13): PyTorch PR #134373 measured 1,458 GB/s for
# _foreach_copy_ on an H100 SXM (3,350 GB/s datasheet) through them
FOREACH_MEMORY_EFFICIENCY = 1458 / 3350
# GPU-side floor of a kernel: CUDA.jl's measurement, 80 tiny kernels replayed as one CUDA graph in 70 us
# (host.GRAPH_KERNEL_US); the 2.0 us used before was kept for its validation score, which is no source
KERNEL_MIN_US = GRAPH_KERNEL_US
LAUNCH_US = HOST_OP_US + CUDA_LAUNCH_US  # host time per op of Muon's step (estimate/techniques.py): one op, one launch
# reads and writes of parameter-sized tensors, counted from torch/optim/adamw.py: foreach / for-loop AdamW's
# _foreach_* calls, the fused kernel's one pass over parameter, gradient and both moments
ADAMW_PASSES = 19
FUSED_ADAMW_PASSES = 7
# The host link (pinned host <-> GPU copies: activation and optimizer offloading), per direction: an x16 PCIe link's
# payload rate from the PCIe Base Specification: 8 / 16 / 32 GT/s a lane for generations 3 / 4 / 5, 128b/130b
# encoding, and a memory write of the 256-byte maximum payload carries 26 bytes of overhead (a 4-DW header with a
# 64-bit address, 16 bytes; the framing token, 4; the sequence number, 2; the LCRC, 4): 256 / 282 of the encoded
# rate (Gen 4: 28.6 GB/s, Gen 5: 57.2 GB/s). A ceiling: the copy engines and host memory may deliver less, which
# benchmarks/validation/gemm_efficiency.py (host_link) measures, each direction alone, both at once and beside a
# matmul. A GPU the table gives no generation for is taken as Gen 4.
PCIE_GT_S = {3: 8e9, 4: 16e9, 5: 32e9}
PCIE_PAYLOAD_SHARE = 256 / (256 + 26)


def host_link_bytes_s(gpu: GPU) -> float:
    """Bytes a second one direction of ``gpu``'s x16 PCIe host link carries (the comment above)."""
    return PCIE_GT_S[gpu.pcie or 4] * 16 * 128 / 130 / 8 * PCIE_PAYLOAD_SHARE


CPU_FLOPS_PER_THREAD = 3e10  # not sourced: a rough CPU guide (fp32, one thread); the CPU is no prediction target

# A product's depth K costs each output tile a fixed start and finish (filling the load pipeline, writing the tile
# out) worth K_OVERHEAD steps of its K loop: depth K runs at K / (K + K_OVERHEAD) of a deep product's rate. OpenXLA's
# measured H100 table (xla/service/gpu/model/matmul_interpolator_data.h, tensorflow 372d578b, sm_90), batch 4 of
# 4096 x 4096 outputs at K = 256 ... 4096: 504 / 620 / 726 / 765 / 793 bf16 TFLOPS, which 0.834 x K / (K + 163) gives
# within 2%; 242 ... 347 in fp32 (TF32: XLA's default), K = 256 against 4096 giving 122 (test_estimate_physics.py).
# Plain fp32 on the CUDA cores (K steps 15x slower): none. The large-product shares are best shapes of depth 4096 or
# more: kept from DEPTH_REF on. Measured on the H100 only; every GPU takes it until gemm_efficiency.py measures its own.
K_OVERHEAD = {"bf16": 163, "fp16": 163, "tf32": 122}
DEPTH_REF = 4096


def depth_share(k: int, mode: str = "bf16") -> float:
    """Share of a deep product's throughput a ``mode`` product of depth ``k`` keeps (``K_OVERHEAD``; 1 from
    DEPTH_REF on, and for plain fp32)."""
    k0 = K_OVERHEAD.get(mode, 0)
    return min(1.0, (k / (k + k0)) / (DEPTH_REF / (DEPTH_REF + k0)))


QUANTIZATION = True
# the large cuBLAS tiles of NVIDIA's "Matrix Multiplication Background User's Guide" (DU-09799-001, 2023, section
# 2.3: 256x128 and 128x256 the most efficient, 128x128 next)
TILES = ((256, 128), (128, 256), (128, 128))
# the shallowest K slice a split-K product keeps: CUTLASS's stream-K scheduler gives each split at least 8 K tiles
# (tile_scheduler_params.h, min_iters_per_sk_unit_), 64 deep on Hopper, 32 in Ampere's kernels (cuBLAS names them)
SPLIT_K_MIN = {"a100": 8 * 32, "h100": 8 * 64}


def quantization(dims: tuple, sm: int, mode: Optional[str] = None, split_min: int = SPLIT_K_MIN["a100"]) -> float:
    """Share of the GPU's SMs a matrix product of (batch, M, K, N) keeps busy: its output is cut into tiles
    (tile quantization: partial tiles at the edges compute padding) run in waves of one tile per SM (wave
    quantization: the last wave leaves SMs idle); a product with few output tiles and a long K is split along K
    so that more tiles run at once (split-K, ``CUBLASLT_ALGO_CONFIG_SPLITK_NUM``; at most 16 splits, each at
    least ``split_min`` deep: :data:`SPLIT_K_MIN`). The best tile of :data:`TILES` and split, as cuBLAS's
    heuristics pick one (NVIDIA Deep Learning Performance guide, "Matrix Multiplication Background").
    With a math ``mode``, each choice also keeps :func:`depth_share` of its K slice (a split shortens every tile's
    K loop): the product of the two, what the roofline prices."""
    batch, m, k, n = dims
    best = 0.0
    for tm, tn in TILES:
        tiles = batch * -(-m // tm) * -(-n // tn)
        for split in (1, 2, 4, 8, 16):
            if split > 1 and k // split < split_min:
                break
            waves = -(-(tiles * split) // sm)
            share = batch * m * n * split / (waves * sm * tm * tn)
            best = max(best, share * depth_share(k // split, mode) if mode else share)
    return min(best, 1.0)


def matmul_bytes(c: OpCost) -> float:
    """Bytes a matrix product moves at least: both operands read once and the output written once, in its math
    dtype (bf16/fp16: 2 bytes, fp32: 4)."""
    if not c.dims:
        return c.bytes
    batch, m, k, n = c.dims
    return float(batch * (m * k + k * n + m * n) * (2 if c.math in ("bf16", "fp16") else 4))


def matmul_efficiency(c: OpCost, mode: str, gpu: GPU) -> float:
    """Share of the dense peak a product runs at: ``MATMUL_EFFICIENCY`` of the GPU x the SMs its tiles keep busy
    and what the depth of each tile's K loop keeps (:func:`quantization` with :func:`depth_share`), x
    ``UNALIGNED`` for a misaligned tensor-core product."""
    eff = large_matmul_share(gpu)
    if mode != "fp32" and not c.aligned:
        eff *= UNALIGNED
    if QUANTIZATION and c.dims and gpu.sm:
        eff *= quantization(c.dims, gpu.sm, mode, SPLIT_K_MIN[arch(gpu.cc)])
    return eff


def attention_share(c: OpCost, mode: str, gpu: GPU) -> float:
    """Share of the peak a fused attention kernel runs at: FlashAttention-2's for bf16/fp16 inputs
    (:func:`tokenmill.estimate.attention.attention_efficiency`), else ``ATTENTION_EFFICIENCY`` of the TF32 peak."""
    if mode in ("bf16", "fp16") and c.attn and gpu.cc >= (8, 0):
        return attention_efficiency(c.attn, gpu.cc, gpu.sm)
    return ATTENTION_EFFICIENCY


def _op_seconds(c: OpCost, cfg: C.Config, gpu: GPU, cpu_threads: int) -> float:
    if gpu.key == "cpu":
        if c.flops:
            return c.flops / (CPU_FLOPS_PER_THREAD * cpu_threads)
        return c.bytes / (gpu.hbm_gbs * 1e9)
    if c.flops:
        mode = c.math if c.math != "fp32" else ("tf32" if cfg.train.tf32 or c.attention else "fp32")
        peak = gpu.peak(mode) or gpu.peak("fp32") or 1e13
        eff = attention_share(c, mode, gpu) if c.attention else matmul_efficiency(c, mode, gpu)
        # the roofline: a product is as slow as its math or its memory traffic, whichever is longer. A product's
        # floor counts each operand read once and the output written once, one pass with no softmax-like second
        # read, so it moves them at the streaming share (bandwidth.py); a fused attention keeps MEMORY_EFFICIENCY
        floor = c.bytes / memory_bandwidth(gpu) if c.attention else matmul_bytes(c) / streaming_bandwidth(gpu)
        t = max(c.flops / (peak * eff), floor)
    else:  # eager ops, or a compiled piece's fused kernels (estimate/inductor.py): streaming or not by name
        t = c.bytes / kernel_bandwidth(c, gpu)
    return max(t, KERNEL_MIN_US * 1e-6) if c.launches else t  # a kernel fused into the previous one: no floor


# QLoRA (lora.quantize_base='nf4'): each NF4 weight is dequantised to the input's dtype in the forward and again
# in the backward; eagerly by model/nf4.py nf4_dequantize, whose ATen operations (counted by the recorder:
# tests/test_estimate_physics.py) are listed below. Compiled, Inductor fuses torchao's element-wise chain into one
# kernel (assumed, not traced: the estimator's compiled capture runs on plain weights): it reads the codes and
# scales and writes the weight.
NF4_EAGER_OPS = 17  # ATen operations dispatched per dequantisation, views included


def nf4_dequant_costs(numel: int, elem: int, compiled: bool = False) -> list[OpCost]:
    """The kernels that dequantise one NF4 weight of ``numel`` elements into a dtype of ``elem`` bytes."""
    from tokenmill.model.nf4 import NF4_BLOCK, nf4_bytes, nf4_groups

    if compiled:
        return [OpCost("nf4_dequant", bytes=float(nf4_bytes(numel) + numel * elem))]
    half, blocks = numel // 2, numel // NF4_BLOCK
    groups = blocks // nf4_groups(numel)[1]  # the scales' factors, in the weight's dtype
    table = [("clone", 272 * elem), ("repeat", 272 * elem), ("stack", 1024 * elem)]  # the 256 code pairs
    scalers = [("div", blocks * (1 + elem) + groups * elem), ("add", 2 * blocks * elem + elem)]
    codes = [("_to_copy", half + 4 * half)]  # each byte widened to an int32 index
    lookup = [("index_select", 4 * half + 2 * numel * elem)]  # the index read, a pair gathered and written
    scale = [("mul_", 2 * numel * elem + blocks * elem)]  # in place, by the block scales
    return [OpCost(n, bytes=float(b)) for n, b in table + scalers + codes + lookup + scale]


def nf4_dequant_seconds(trace, compiled: bool, cfg: C.Config, gpu: GPU, threads: int
                        ) -> tuple[float, float, int]:
    """(GPU seconds, host seconds, kernels) of one dequantisation of every NF4 weight of a traced block."""
    gpu_s = host_s = 0.0
    kernels = 0
    for numel, elem in trace.nf4_sizes:
        costs = nf4_dequant_costs(numel, elem, compiled)
        gpu_s += sum(_op_seconds(c, cfg, gpu, threads) for c in costs)
        kernels += len(costs)
        host_s += (len(costs) * (COMPILED_KERNEL_US + CUDA_LAUNCH_US) if compiled
                   else NF4_EAGER_OPS * HOST_OP_US + len(costs) * CUDA_LAUNCH_US) * 1e-6
    return gpu_s, host_s, kernels


def _pieces_time(pieces: Pieces, plan: Plan, cfg: C.Config, gpu: GPU, threads: int) -> dict[str, float]:
    """GPU seconds of matmuls and other kernels, and the kernel count, of one micro-batch of a stage."""
    out: dict[str, Any] = {"matmul": 0.0, "memory": 0.0, "kernels": 0.0, "flops": 0.0, "host": 0.0}

    fp8 = fp8_on(cfg, gpu.name)  # train.fp8 on a GPU with FP8: the block linears' products

    def add(costs: list[OpCost], block: bool = False) -> float:
        total = 0.0
        for c in costs:
            s = _op_seconds(c, cfg, gpu, threads)
            if block and fp8 and fp8_linear_op(c, cfg):
                bf16 = _op_seconds(dataclasses.replace(c, math="bf16"), cfg, gpu, threads)
                # the casts: an amax (a one-pass reduction) and a scaled cast (streaming), at the streaming share
                f8, k = fp8_op_seconds(bf16, c, cfg, streaming_bandwidth(gpu), KERNEL_MIN_US * 1e-6)
                s, out["kernels"] = f8, out["kernels"] + (k - 1)
            if block and c.attention:  # data.document_mask: the whole T x T and the mask's read (techniques.py)
                s = docmask_attention_seconds(s, cfg, pieces.batch, pieces.seq, memory_bandwidth(gpu),
                                              plan.cuda, "backward" in c.name, gpu.cc)
            out["matmul" if c.flops else "memory"] += s
            out["flops"] += c.flops
            out["kernels"] += c.launches
            total += s
        return total

    qlora = bool(cfg.lora.rank) and cfg.lora.quantize_base == "nf4"

    def piece(rnd, block: bool = False, kind: str = "") -> tuple[tuple[float, float], tuple[float, float]]:
        h_f, h_b = round_host_seconds(rnd, cfg)
        g_f, g_b = add(rnd.fwd_costs, block), add(rnd.bwd_costs, block)
        if block and qlora:  # the NF4 base dequantised in forward, in backward, and in a checkpoint's recompute
            g, h, k = nf4_dequant_seconds(pieces.blocks[kind], rnd.compiled, cfg, gpu, threads)
            again = 2 if kind.startswith("checkpointed") else 1  # trace.py block_kind
            h_f, g_f, h_b, g_b = h_f + h, g_f + g, h_b + again * h, g_b + again * g
            out["memory"] += (1 + again) * g
            out["kernels"] += (1 + again) * k
        out["host"] += h_f + h_b
        return (h_f, g_f), (h_b, g_b)

    fwd, bwd = [], []  # (host, GPU) seconds of each piece in the order the step issues them
    if plan.has_embed:
        f, b = piece(pieces.embed.rounds[0])
        fwd.append(f)
        bwd.append(b)
    for i in plan.stage_blocks:
        f, b = piece(pieces.blocks[pieces.kinds[i]].rounds[0], block=True, kind=pieces.kinds[i])
        fwd.append(f)
        bwd.insert(0, b)
    if plan.has_head:
        f, b = piece(pieces.head.rounds[0])
        fwd.append(f)
        bwd.insert(0, b)
    out["offload"] = offload_stall_seconds([g for _, g in fwd], [g for _, g in reversed(bwd)],
                                           offloaded_sizes(plan, pieces), host_link_bytes_s(gpu))
    compiled_blocks = sum(pieces.blocks[pieces.kinds[i]].rounds[0].compiled for i in plan.stage_blocks)
    calls = graph_call_seconds(cfg, compiled_blocks) / 2  # the forward graphs' calls, then the backward's
    out["host"] += 2 * calls
    out["segments"] = [(calls, 0.0)] + fwd + [(calls, 0.0)] + bwd
    out["backward"] = sum(g for _, g in bwd)  # GPU seconds of one micro-batch's backward (gradient collectives)
    return out


def step_time(cfg: C.Config, lay: Layout, gpu: GPU, stages: list[tuple[Plan, Pieces]], n_flop: int) -> dict[str, Any]:
    """Milliseconds per optimizer step, with its parts (the slowest pipeline stage sets the pace)."""
    import torch

    threads = max(1, torch.get_num_threads())
    t, A = cfg.train, cfg.train.grad_accum_steps
    worst: dict[str, float] = {}
    for plan, pieces in stages:
        part = _pieces_time(pieces, plan, cfg, gpu, threads)
        n_mb = (cfg.parallel.pp_microbatches or lay.pp) if lay.pp > 1 else 1
        per_step = {k: v * A * n_mb for k, v in part.items() if k not in ("segments", "backward")}
        # memory.offload_activations: the copies run beside the compute; what it waits for (techniques.py)
        offload_s = per_step["offload"] if gpu.key != "cpu" else 0.0
        gpu_s = per_step["matmul"] + per_step["memory"] + offload_s
        param_bytes = sum(p.nbytes for p in plan.params if p.trainable)  # what the optimizer steps
        shard = lay.dp_shard if lay.dp_shard > 1 else (lay.dp_replicate if cfg.parallel.zero1 else 1)
        opt_s, opt_kernels = _optimizer_seconds(cfg, plan, gpu, param_bytes / shard)
        comm_exposed, comm_s = comm_seconds(cfg, lay, gpu, plan, pieces, gpu_s, part["backward"] * n_mb)
        contention = contention_seconds(gpu, lay, comm_s - comm_exposed)  # none on the CPU (no SMs)
        bubble = gpu_s * (lay.pp - 1) / n_mb if lay.pp > 1 else 0.0
        # the host issues the step's work while the GPU runs it (estimate/host.py's two clocks): micro-batches,
        # then the optimizer step
        opt_host = optimizer_host_seconds(cfg, [p for p in plan.params if p.trainable])
        if gpu.key != "cpu":
            host_t, gpu_t = overlap(part["segments"] * (A * n_mb) + [(opt_host, opt_s)])
            gpu_t += offload_s
            launch_s = per_step["host"] + opt_host
            total = max(host_t, gpu_t) + comm_exposed + contention + bubble
        else:
            launch_s = 0.0
            total = gpu_s + opt_s + comm_exposed + bubble
        if total > worst.get("total", -1):
            worst = {"total": total, "matmul": per_step["matmul"], "memory": per_step["memory"], "offload": offload_s,
                     "launch": launch_s, "optimizer": opt_s, "comm": comm_s, "comm_exposed": comm_exposed,
                     "contention": contention, "bubble": bubble, "flops": per_step["flops"]}
    data_s = 0.0
    if cfg.data.cpu_work_ms > 0:  # data.cpu_work_ms per sample, in the main process or spread over workers
        per_step_samples = t.batch_size * A
        data_s = per_step_samples * cfg.data.cpu_work_ms / 1000.0 / max(1, cfg.data.num_workers)
    total = worst["total"] + data_s if cfg.data.num_workers == 0 else max(worst["total"], data_s)
    tokens = t.batch_size * A * lay.dp * cfg.model.block_size
    from tokenmill.model.flops import flops_per_token, math_mode

    fpt = flops_per_token(cfg.model, n_flop, cfg.model.block_size)
    peak = gpu.peak(math_mode(t.precision, t.tf32))
    mfu = fpt * tokens / (total * peak * lay.nproc) if peak else None
    return {
        "step_ms": 1000 * total,
        "matmul_ms": 1000 * worst["matmul"], "memory_bound_ms": 1000 * worst["memory"],
        "launch_ms": 1000 * worst["launch"], "optimizer_ms": 1000 * worst["optimizer"],
        "activation_offload_ms": 1000 * worst["offload"],
        "collectives_ms": 1000 * worst["comm"], "collectives_exposed_ms": 1000 * worst["comm_exposed"],
        "collectives_sm_share_ms": 1000 * worst["contention"],
        "pipeline_bubble_ms": 1000 * worst["bubble"], "data_ms": 1000 * data_s, "mfu": mfu,
    }


def _optimizer_seconds(cfg: C.Config, plan: Plan, gpu: GPU, param_bytes: float) -> tuple[float, int]:
    if cfg.optim.name == "muon":  # Muon for the blocks' matrices (estimate/techniques.py), AdamW for the rest
        trained = [p for p in plan.params if p.trainable]
        total = sum(p.nbytes for p in trained) or 1
        shard = max(1, round(total / max(param_bytes, 1)))
        rest = [p for p in trained if not muon_hidden(cfg, p)]
        adam_s, adam_k = _adamw_seconds(cfg, gpu, param_bytes * sum(p.nbytes for p in rest) / total, len(rest))
        launch = LAUNCH_US * 1e-6 if gpu.key != "cpu" else 0.0
        # the momentum's passes are element-wise lerps, casts and updates: streaming kernels (bandwidth.py)
        muon_s, muon_k = muon_seconds(cfg, trained, gpu.peak("bf16") or 1e13, large_matmul_share(gpu),
                                      streaming_bandwidth(gpu), link_bandwidth(gpu),
                                      shard, launch)
        return adam_s + muon_s, int(adam_k + muon_k)
    return _adamw_seconds(cfg, gpu, param_bytes, sum(p.trainable for p in plan.params))


def _adamw_seconds(cfg: C.Config, gpu: GPU, param_bytes: float, n_tensors: int) -> tuple[float, int]:
    mem, impl = cfg.memory, cfg.optim.impl
    if mem.optimizer_offload or cfg.parallel.fsdp_cpu_offload:  # the step runs on the host; copies both ways
        elems = param_bytes / 4
        host = elems * 4 * ADAMW_PASSES / 20e9  # not sourced: a multi-threaded CPU AdamW, ~20 GB/s
        pcie = 2 * param_bytes / host_link_bytes_s(gpu)
        return host + pcie, 0
    passes = FUSED_ADAMW_PASSES if impl == "fused" else ADAMW_PASSES
    if mem.optimizer_8bit:
        passes = ADAMW_PASSES // 2
    # foreach and fused AdamW run multi-tensor-apply kernels; for-loop AdamW (and the step in backward) runs
    # ordinary element-wise kernels (mul_, lerp_, addcdiv_...: streaming), 8-bit AdamW torchao's (a block-wise
    # absmax, a reduction, in each quantisation: MEMORY_EFFICIENCY)
    bw = memory_bandwidth(gpu) if mem.optimizer_8bit else streaming_bandwidth(gpu)
    per_tensor = impl == "for-loop" or mem.optimizer_in_backward or mem.optimizer_8bit
    mta = gpu.hbm_gbs * 1e9 * FOREACH_MEMORY_EFFICIENCY
    s = param_bytes * passes / (bw if per_tensor else mta)
    if cfg.optim.grad_clip > 0:  # _foreach_norm, then _foreach_mul_: multi-tensor-apply kernels
        s += 3 * param_bytes / mta
    kernels = {"fused": 1, "foreach": 12, "for-loop": 12 * n_tensors}[impl]
    if mem.optimizer_in_backward:
        kernels = 12 * n_tensors
    return s, kernels  # the GPU's time; the host's is estimate/host.py's optimizer_host_seconds
