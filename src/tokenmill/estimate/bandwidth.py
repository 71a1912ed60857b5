"""The share of a GPU's datasheet memory bandwidth a kernel that is not a matrix product reaches, and the bandwidth
of its collectives (``LINK_EFFICIENCY``, :func:`link_bandwidth`, :func:`group_bandwidth`: within a node and across nodes).

Three shares, by architecture (:func:`tokenmill.estimate.attention.arch`: compute capability 8.x the A100's, 9.x and
newer the H100's):

- ``STREAM_MEMORY_EFFICIENCY``: a kernel that streams, one pass reading each input once and writing each output
  once with no reduction (``STREAMING_OPS``: copies and casts, fills, arithmetic, comparisons, activations); what
  BabelStream's copy kernel measures;
- ``REDUCE_MEMORY_EFFICIENCY``: an eager one-pass reduction (``REDUCTION_OPS``: sum, mean, amax, vector norms),
  each input read once; what BabelStream's dot kernel measures;
- ``MEMORY_EFFICIENCY``: everything else (softmax, norms, index/scatter/gather, the embedding's backward,
  cat and stack, dropout's random mask), read from PyTorch's standard attention, whose softmax passes the byte
  count misses.

:func:`kernel_bandwidth` picks one by the kernel's name: one rule for eager ATen operations and for Inductor's fused
kernels. A fused kernel is named after the node it realises (:mod:`.inductor`): a pointwise root (``add``, ``mul``,
``convert_element_type``) is a pointwise kernel, which reads each buffer once and writes once, so it streams; a
fused reduction kernel (``sum``, ``mean``, ``amax``, ``var_mean``...) reads each of its buffers once in the plan
(the second loop of a row too long for one persistent kernel is the plan's next kernel, with its own bytes) and
moves them at ``INDUCTOR_REDUCTION_SHARE`` of the streaming rate, measured on Inductor's own kernels; an eager
ATen reduction reads its input once (``REDUCE_MEMORY_EFFICIENCY``); a scatter or ``cat`` is named after that op
and keeps ``MEMORY_EFFICIENCY``.
"""

from __future__ import annotations

from tokenmill.estimate.attention import arch
from tokenmill.estimate.gpus import GPU
from tokenmill.estimate.recorder import OpCost

# Share of the datasheet bandwidth PyTorch's element-wise, softmax and reduction kernels reach, by architecture: the
# share with which the roofline reproduces the 20 published measurements per GPU of a standard PyTorch attention
# (baddbmm, mask add, softmax, bmm, forward and backward; attention.PYTORCH_TFLOPS, FlashAttention-2's release
# benchmark), its streaming kernels (the mask's add, the casts: a third of the bytes) priced at
# STREAM_MEMORY_EFFICIENCY: the two-decimal value whose mean signed error over them is nearest zero (-0.1% on the A100
# 80GB, -0.4% on the H100 SXM; mean absolute 5.7% and 7.5%, at most 13.1% and 16.2%; tests/test_estimate_attention.py
# recomputes them). Read from those kernels, not from the validation set; it absorbs what the byte count misses in
# them (softmax's passes over each row). It was 0.53 / 0.59 while the mask's add was priced with the softmax, and
# 0.35 on the A100 before the products' depth (roofline.depth_share) priced the benchmark's 64- and 128-deep bmms.
MEMORY_EFFICIENCY = {"a100": 0.37, "h100": 0.39}
# What a streaming kernel reaches: BabelStream 5.0's CUDA Copy kernel (c[i] = a[i], one read and one write, doubles;
# the guide's fork github.com/gitaumark/BabelStream, src/main.cpp at 1a1a7295: 1,308,622,848 elements a 10.5 GB
# array, 100 runs, the fastest after the first) as Microsoft's AI benchmarking guide ran it (github.com/Azure/
# AI-benchmarking-guide, Benchmarks/NVIDIA/HBMBandwidth.py at 7a4e2c83), over the datasheet bandwidth of the GPU:
# "NVIDIA A100-SXM4-80GB" (ND A100 v4, CUDA 12.5; Azure_Results/ND_A100_v4_results.md at 3bb66cac) 1.61 TB/s of
# 2,039 GB/s, 79.0%; "NVIDIA H100 80GB HBM3", the SXM part (ND H100 v5, CUDA 12.6; "Azure Results/ND_H100_v5_results.md"
# at f350e7e6) 2.90 TB/s of 3,350, 86.6%. The Copy kernel, fixed before any validation result was looked at: it
# moves what a cast or a one-input op does; cross-checks, not used: Add and Triad (two reads, one write) 1.70 and
# 2.97 TB/s (83.4%, 88.7%), and the H200 (ND_H200_v5_results.md at 7f20e5fa) Copy 4.01 of 4,800 GB/s (83.5%). The
# L4 (GDDR6, compute capability 8.9) takes the A100's share through attention.arch: assumed.
STREAM_COPY_TBS = {"a100": 1.61, "h100": 2.90}
STREAM_DATASHEET_GBS = {"a100": 2039, "h100": 3350}
STREAM_MEMORY_EFFICIENCY = {a: STREAM_COPY_TBS[a] * 1000 / STREAM_DATASHEET_GBS[a] for a in STREAM_COPY_TBS}
# A GPU with its own published copy kernel: the RTX 4090 (GDDR6X, 1,008 GB/s), github.com/xytpai/nvbench
# standard/global_memory_bandwidth.cu (a CUDA copy of a 1 GiB array, read and write counted) and its README's
# RTX 4090 row: 904.3 GB/s with 8-byte elements (float2, BabelStream's element size); the 4- and 16-byte rows give
# 920.2 and 921.9. Cross-check, not used: torch's copy_ at 912 GB/s (github.com/chsasank/device-benchmarks).
STREAM_BY_GPU = {"rtx-4090": 904.335 / 1008}
# ATen ops (in-place forms included: a trailing "_" is dropped) whose kernel streams: one element-wise pass, each
# input read once, each output written once, no reduction. Not here: reductions and norms (sum, mean, softmax,
# layer/RMS norm: a second pass or a cross-thread reduction), index/gather/scatter and embedding (data-dependent
# addresses), cat/stack/slice_backward (a fill and a copy, or many inputs), dropout's forward (random numbers).
STREAMING_OPS = frozenset({
    # copies and casts: read one tensor, write one
    "_to_copy", "copy", "clone", "convert_element_type", "lift_fresh_copy", "triu", "tril",
    # fills: write one
    "fill", "zero", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "new_zeros", "new_ones",
    "new_full", "scalar_tensor", "arange", "iota",
    # arithmetic, one to three inputs read once
    "add", "sub", "rsub", "mul", "div", "neg", "reciprocal", "pow", "sqrt", "rsqrt", "abs", "sign", "maximum",
    "minimum", "clamp", "clamp_min", "clamp_max", "where", "masked_fill", "lerp", "addcmul", "addcdiv", "remainder",
    "fmod", "floor", "ceil", "round", "trunc",
    # comparisons, logic and bit operations
    "eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and", "logical_or", "bitwise_and", "bitwise_or",
    "bitwise_xor", "bitwise_not", "__rshift__", "__lshift__",
    # activations and their backward (a few arithmetic operations per element: still bound by memory)
    "exp", "exp2", "expm1", "log", "log1p", "log2", "sigmoid", "tanh", "relu", "silu", "gelu", "erf", "sin", "cos",
    "threshold_backward", "silu_backward", "gelu_backward", "sigmoid_backward", "tanh_backward",
    # dropout's backward: the saved mask times the gradient
    "native_dropout_backward",
    # QLoRA's compiled dequantisation (roofline.nf4_dequant_costs): one fused pointwise kernel reading the 4-bit codes
    # and the scales once and writing the weight; its 16-entry code table stays in cache
    "nf4_dequant",
})


# What a one-pass reduction reaches (an eager ATen reduction: each input read once, a small output: sum, mean, amax,
# a vector norm...): BabelStream's Dot kernel (sum of a[i] x b[i], two reads and
# no array written) in the same runs as the Copy share above: 1.75 TB/s on the A100-SXM4-80GB, 3.18 TB/s on the H100
# 80GB HBM3 (85.8%, 94.9%). Softmax, log-softmax and the layer/RMS norms are not one-pass here (a statistics pass,
# then a pass that normalises inside one kernel: MEMORY_EFFICIENCY, which the attention benchmark's softmax
# measures).
REDUCE_DOT_TBS = {"a100": 1.75, "h100": 3.18}
REDUCE_MEMORY_EFFICIENCY = {a: REDUCE_DOT_TBS[a] * 1000 / STREAM_DATASHEET_GBS[a] for a in REDUCE_DOT_TBS}
# An Inductor kernel named after a reduction is one pass in the estimator's plan (estimate/inductor.py): the
# element-wise work after it (a norm's scale, the softmax's division) is the plan's next kernel with its own bytes,
# which re-reads the rows it needs unless the reduction is persistent (a row held in registers). Its rate, relative
# to Inductor's pointwise kernels on the same GPU: torchbench vit-base's generated kernels run alone on an A100 with
# Inductor's benchmark harness (github.com/intel/intel-xpu-backend-for-triton issue 2229, 2024-09-13: bytes counted
# once per buffer, as here): the GELU (pointwise) 1,073.02 GB/s, the layer norm 930.15 and the safe softmax 913.15
# (both persistent reductions with their element-wise work), 0.867 and 0.851 of the GELU: their mean. Cross-check,
# not used: the same run's cat fused with a layer norm at 437.12 GB/s, 0.41 of the GELU, where a cat kernel keeps
# MEMORY_EFFICIENCY (0.37 / 0.79 = 0.47 of the streaming share on the A100). (Fused reductions took
# MEMORY_EFFICIENCY until 2026-11-29, which charged a looped row's second pass twice: in the slower share, and as
# the next kernel's bytes.)
INDUCTOR_REDUCTION_SHARE = (930.15 / 1073.02 + 913.15 / 1073.02) / 2
REDUCTION_OPS = frozenset({"sum", "mean", "amax", "amin", "max", "min", "prod", "norm", "linalg_vector_norm", "var",
                           "std", "var_mean", "std_mean", "any", "all", "argmax", "argmin"})


def reduces(name: str) -> bool:
    """Whether a kernel of this name is a one-pass reduction (``REDUCTION_OPS``)."""
    return name in REDUCTION_OPS


def streams(name: str) -> bool:
    """Whether a kernel of this name (an ATen op, or an Inductor kernel named after its root) streams."""
    return name in STREAMING_OPS or (name.endswith("_") and name[:-1] in STREAMING_OPS)


def memory_bandwidth(gpu: GPU) -> float:
    """Bytes per second the GPU's non-streaming kernels move: its datasheet bandwidth x ``MEMORY_EFFICIENCY``."""
    return gpu.hbm_gbs * 1e9 * MEMORY_EFFICIENCY[arch(gpu.cc)]


def streaming_bandwidth(gpu: GPU) -> float:
    """Bytes per second a streaming kernel moves: the datasheet bandwidth x the GPU's own copy share
    (``STREAM_BY_GPU``) or its architecture's (``STREAM_MEMORY_EFFICIENCY``)."""
    return gpu.hbm_gbs * 1e9 * STREAM_BY_GPU.get(gpu.key, STREAM_MEMORY_EFFICIENCY[arch(gpu.cc)])


def kernel_bandwidth(c: OpCost, gpu: GPU) -> float:
    """Bytes per second the kernel ``c`` (not a matrix product) moves: streaming, a one-pass reduction or neither,
    by its name."""
    if streams(c.name):
        return streaming_bandwidth(gpu)
    if reduces(c.name) and c.fused:
        return streaming_bandwidth(gpu) * INDUCTOR_REDUCTION_SHARE
    if reduces(c.name):
        return gpu.hbm_gbs * 1e9 * REDUCE_MEMORY_EFFICIENCY[arch(gpu.cc)]
    return memory_bandwidth(gpu)


# Bus bandwidth NCCL's collectives reach / the link's datasheet rate per direction (link_bandwidth), from the
# bandwidths NCCL's own topology model gives a link (the code that runs: NVIDIA/nccl src/graph/topo.h and topo.cc,
# master 5067397c): an NVLink 20.0 GB/s on compute capability 8.x (SM80_NVLINK_BW; the A100's 12 NVLink-3 links of
# 25 GB/s: 240 of 300 GB/s) and 20.6 GB/s on 9.x (SM90_NVLINK_BW; the H100's 18 NVLink-4 links: 370.8 of 450);
# a PCIe x16 link width x GT/s / 8 x 0.75 (kvDictPciGen: 24 GB/s on Gen 4, 48 on Gen 5; 32 and 64 in the table).
# Published checks: 8 A100-SXM4-80GB (Azure ND A100 v4, NCCL 2.18.5), all_reduce_perf busbw 231.6 GB/s at 8 GB,
# 0.77 of 300 (github.com/Azure/AI-benchmarking-guide, Azure_Results/ND_A100_v4_results.md); on the H100,
# S. Jeaugey (NCCL): 370 GB/s for every collective but the all-reduce, and for the ring all-reduce
# (github.com/NVIDIA/nccl-tests/issues/212). Not modelled: the H100's default all-reduce through NVLink SHARP
# (NVLS), 478.9 GB/s busbw at 8 GB on 8 H100 SXM (1.06 of 450; Azure ND H100 v5, NCCL 2.18.5, same repository).
LINK_EFFICIENCY = {"a100": 20.0 / 25, "h100": 20.6 / 25, "pcie": 0.75}


def group_bandwidth(gpu: GPU, size: int, stride: int) -> float:
    """Bus bandwidth of a collective over ``size`` ranks ``stride`` apart in the device mesh (``parallel/world.py``:
    pp, dp_replicate, dp_shard, tp, the last varying fastest; ranks fill a node in order): the link's
    (:func:`link_bandwidth`) within a node; once the group spans nodes (``size x stride`` ranks over
    ``gpu.node_gpus``), the network's line rate per GPU where it is slower (NCCL's topology model takes a NIC at its
    speed, ``net.bw = mbps / 8000`` GB/s: NVIDIA/nccl src/graph/topo.cc). A GPU without a node keeps its link."""
    bw = link_bandwidth(gpu)
    if gpu.node_gpus and gpu.nic_gbps and size > 1 and size * stride > gpu.node_gpus:
        return min(bw, gpu.nic_gbps / 8 * 1e9)
    return bw


def link_bandwidth(gpu: GPU) -> float:
    """Bytes a second NCCL's collectives move per GPU and direction (their bus bandwidth): the datasheet link
    bandwidth x ``LINK_EFFICIENCY`` of its PCIe link, else of its NVLink by architecture (the CPU's: the A100's)."""
    return gpu.link_gbs * 1e9 * LINK_EFFICIENCY["pcie" if gpu.link.startswith("PCIe") else arch(gpu.cc)]


# NCCL's ring-search bandwidths per channel (NVIDIA/nccl src/graph/search.cc, speedArrayIntra / sm90SpeedArrayIntra)
_NCCL_SPEEDS = (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0)
_NCCL_SPEEDS_SM90 = (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0)
_NCCL_SEARCH_CHANNELS, _NCCL_MAX_CHANNELS = 16, 32  # MAXCHANNELS / 2 for the search; MAXCHANNELS


def nccl_channels(gpu: GPU) -> int:
    """The channels NCCL runs a collective on within a node, each one thread block that holds an SM for as long as
    the collective runs (NCCL's CTAs never share an SM with compute kernels: S. Jeaugey, NVIDIA/nccl issue #689).
    NCCL's rule (src/graph/search.cc at 5067397c): the ring search takes, from the highest speed down, the speed at
    which as many channels as fit in the GPU's link bandwidth (NCCL's own, :data:`LINK_EFFICIENCY`) carry the most
    (``ncclTopoCompute``; done once they carry it all), then doubles them unless the speed is under 25 GB/s or, on
    compute capability 9.x, under 50 GB/s with more than 4 channels (``ncclTopoDupChannels``); ``ncclTopoPostset``
    doubles them again. HGX A100: 6 channels at 40 of 240 GB/s, 24 in all, as NCCL logs there (nccl-tests issue #100:
    'Channel 23/24'); an H800's 8 NVLinks (164.8 GB/s): 4 at 40, 16 in all, as its log says (NVIDIA/nccl issue #892:
    '16 coll channels'); the H100 SXM: 6 at 60 of 370.8, 24. A CPU: none."""
    if gpu.key == "cpu":
        return 0
    total = link_bandwidth(gpu) / 1e9
    sm90 = gpu.cc[0] >= 9
    best_n, best_speed = 0, 0.0
    for speed in (_NCCL_SPEEDS_SM90 if sm90 else _NCCL_SPEEDS):
        n = min(_NCCL_SEARCH_CHANNELS, int(total // speed + 1e-9))
        if n and n * speed > best_n * best_speed:
            best_n, best_speed = n, speed
        if best_n * best_speed >= total - 1e-9:
            break
    n = best_n
    if best_speed >= 25.0 and not (sm90 and best_speed < 50.0 and n > 4):
        n = min(2 * n, _NCCL_SEARCH_CHANNELS)
    return min(2 * n, _NCCL_MAX_CHANNELS)
