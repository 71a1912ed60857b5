"""The host's (CPU's) share of a training step: what the Python process must do before the GPU can run it.

The GPU runs a step no faster than the host issues its work; with small micro-batches the host sets the pace
(``roofline.step_time`` takes the larger of the two). The work is counted from the trace, never fitted:

- eager pieces: every ATen operation the model's code dispatches (views included; counted by the recorder)
  costs ``HOST_OP_US`` (Python, the dispatcher, autograd), and each kernel it launches ``CUDA_LAUNCH_US`` more;
- compiled pieces (:mod:`.compiled`): each kernel of Inductor's graphs costs ``COMPILED_KERNEL_US`` (its
  generated wrapper calling the kernel) plus ``CUDA_LAUNCH_US``, and each call of a compiled graph (forward
  and backward, once per micro-batch for the whole model, once per block with ``compile.scope='block'``)
  ``GRAPH_CALL_US`` (guards, AOTAutograd's runtime wrappers); with ``compile.mode='reduce-overhead'`` CUDA
  graphs replay the kernels, so only the graph calls remain;
- the optimizer step, as PyTorch's implementations dispatch it (torch/optim/adamw.py): foreach AdamW about 11
  ``_foreach_*`` calls per parameter group plus two step-counter reads per parameter, fused AdamW 3 calls per
  group, for-loop AdamW 10 operations per parameter; each foreach call launches one kernel per chunk of
  ``MTA_TENSORS`` tensors or ``MTA_ELEMENTS`` elements (aten/src/ATen/native/cuda/MultiTensorApply.cuh:
  ``depth_to_max_tensors`` 36 for four lists, 320 blocks of ``kChunkSize`` 65,536); gradient clipping adds
  ``_foreach_norm``, the total norm and ``_foreach_mul_`` (7 calls).

Sources of the constants: ``HOST_OP_US``, ``COMPILED_KERNEL_US`` and ``GRAPH_CALL_US`` are measured by
``benchmarks/validation/host_overhead.py`` (GPTs of 2 and 4 blocks with tiny shapes, eager and compiled,
forward and backward on a CPU, the least disturbed of 25 rounds; figures of this repository's 2-core CI host,
three runs: 4.1-4.9, 7.5-9.2 and 21-23 us; a faster host is faster, run the script on yours). ``CUDA_LAUNCH_US``
is CUDA.jl's published measurement of launch cost (cuda.juliagpu.org/dev/usage/graphs: 80 small kernels in
260 us when launched one by one, 3.3 us each; 70 us as one CUDA graph), whose graph figure also gives
``GRAPH_KERNEL_US``, the GPU-side time of a tiny kernel (70 / 80 us).

What the CPU stand-in assumes, until a GPU host measures its own (``benchmarks/validation/gemm_efficiency.py``,
the ``gemm-efficiency`` part of ``benchmarks/session.py``, writes ``launch``: host microseconds per eager op on
the CUDA path and GPU microseconds per tiny kernel in a CUDA graph): that Python, the dispatcher and autograd
cost per op what they cost on the 2-core CI CPU with CPU tensors (held-out eager batch-1 runs came out 9-24% too
fast, issue 32: the CUDA path seems to cost more per op than this stand-in), that a CUDA launch adds ``CUDA_LAUNCH_US`` on top
and that an Inductor kernel's wrapper call on the GPU costs what the CPU Inductor's does. QLoRA's eager NF4
dequantisation is charged ``HOST_OP_US`` per ATen op it dispatches (``roofline.NF4_EAGER_OPS``: it reads the
NF4 tensor's plain codes and scales, so no tensor-subclass dispatch runs).
"""

from __future__ import annotations

import math
from collections import defaultdict

from tokenmill import config as C

HOST_OP_US = 4.5  # per dispatched ATen op of eager PyTorch (Python + dispatcher + autograd): measured
CUDA_LAUNCH_US = 3.3  # per kernel launch through the CUDA driver: CUDA.jl's measurement
COMPILED_KERNEL_US = 8.4  # per kernel of an Inductor graph (its wrapper's call): measured
GRAPH_CALL_US = 21.0  # per call of a compiled graph (guards, AOTAutograd wrappers): measured
GRAPH_KERNEL_US = 0.875  # GPU-side time of a tiny kernel (CUDA.jl: 80 kernels replayed in 70 us)
MTA_TENSORS = 36  # MultiTensorApply.cuh: tensors per launch with four lists (AdamW)
MTA_ELEMENTS = 320 * 65536  # ... and elements per launch (320 blocks of kChunkSize)


def cudagraphs(cfg: C.Config) -> bool:
    """``compile.mode='reduce-overhead'``: Inductor replays its graphs with CUDA graphs."""
    return bool(cfg.compile.enabled and cfg.compile.mode == "reduce-overhead")


def round_host_seconds(rnd, cfg: C.Config) -> tuple[float, float]:
    """Host seconds to issue the forward and the backward of a traced piece (module doc)."""
    def part(costs: list, ops: int) -> float:
        if rnd.compiled:
            if cudagraphs(cfg):
                return 0.0
            return sum(c.launches for c in costs) * (COMPILED_KERNEL_US + CUDA_LAUNCH_US) * 1e-6
        return (ops * HOST_OP_US + len(costs) * CUDA_LAUNCH_US) * 1e-6

    return part(rnd.fwd_costs, rnd.fwd_ops), part(rnd.bwd_costs, rnd.bwd_ops)


def overlap(segments: list[tuple[float, float]], host: float = 0.0, device: float = 0.0) -> tuple[float, float]:
    """Run the host's and the GPU's clocks over work issued in order: each segment (host seconds to issue it,
    GPU seconds to run it) starts on the GPU once the GPU is free and the host has issued its first kernel, and
    ends no earlier than the host has issued all of it. Returns the two clocks (host, GPU) at the end."""
    for h, g in segments:
        start = max(device, host + min(h, GRAPH_KERNEL_US * 1e-6))
        host += h
        device = max(start + g, host + GRAPH_KERNEL_US * 1e-6)
    return host, device


def graph_call_seconds(cfg: C.Config, compiled_blocks: int) -> float:
    """Host seconds of the compiled graphs' calls in one micro-batch (forward and backward of each)."""
    if not cfg.compile.enabled:
        return 0.0
    regions = compiled_blocks if cfg.compile.scope == "block" else 1
    return 2 * regions * GRAPH_CALL_US * 1e-6


def _launches(n_tensors: int, numel: int) -> int:
    return max(math.ceil(n_tensors / MTA_TENSORS), math.ceil(numel / MTA_ELEMENTS), 1)


def optimizer_host_seconds(cfg: C.Config, params: list) -> float:
    """Host seconds of one AdamW step (and gradient clipping) over ``params`` (this rank's trained
    parameters: objects with ``numel``, ``dtype`` and ``shape``)."""
    mem, impl = cfg.memory, cfg.optim.impl
    if not params or mem.optimizer_offload or cfg.parallel.fsdp_cpu_offload:
        return 0.0
    buckets: dict = defaultdict(list)  # AdamW's parameter groups (decay groups), split by dtype
    for p in params:
        buckets[(cfg.optim.decay_groups and len(p.shape) < 2, p.dtype)].append(p)
    ops = launches = 0
    if impl == "for-loop" or mem.optimizer_in_backward or mem.optimizer_8bit:
        ops, launches = 10 * len(params), 7 * len(params)
    else:
        per_group = 3 if impl == "fused" else 11
        for b in buckets.values():
            chunks = _launches(len(b), sum(p.numel for p in b))
            ops += per_group + (2 * len(b) if impl == "foreach" else 0)
            launches += (1 if impl == "fused" else per_group) * chunks
    if cfg.optim.grad_clip > 0:
        ops += 7
        launches += 2 * sum(_launches(len(b), sum(p.numel for p in b)) for b in buckets.values()) + 3
    return (ops * HOST_OP_US + launches * CUDA_LAUNCH_US) * 1e-6
