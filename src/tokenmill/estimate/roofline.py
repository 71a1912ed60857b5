"""Step time from a roofline over the traced kernels.

Every kernel the trace records (:class:`~tokenmill.estimate.trace.OpCost`) costs the larger of:

- matrix products (and fused attention): FLOPs / (dense peak of its math mode x efficiency). The
  efficiency of a product whose smallest dimension is ``d`` is ``MATMUL_EFFICIENCY x d / (d + D0)``
  (``D0`` = ``TENSOR_CORE_D0`` on tensor cores, ``SIMT_D0`` for plain fp32): large products reach
  ``MATMUL_EFFICIENCY`` of the peak, GPT-2-small-sized ones (d = 768) about 60% of that on tensor
  cores, and ``UNALIGNED`` of it when a dimension is not a multiple of 8 (an unpadded vocabulary:
  cuBLAS falls back to slower kernels); fused attention kernels run at ``ATTENTION_EFFICIENCY``. The
  math mode is the operands' dtype
  (bf16/fp16); fp32 matmuls run on TF32 tensor cores with ``train.tf32``. Peaks:
  :data:`tokenmill.model.flops.PEAK_FLOPS`;
- everything else: bytes read and written / (memory bandwidth x ``MEMORY_EFFICIENCY``);
- ``KERNEL_MIN_US`` (a kernel never takes less).

Eager PyTorch also spends ``LAUNCH_US`` of CPU time per kernel; when that sum is longer than the GPU
time (small models), the CPU sets the pace. ``torch.compile`` is modelled as fusing the element-wise
kernels: their traffic is multiplied by ``COMPILE_TRAFFIC`` and their launches by ``COMPILE_LAUNCHES``.

Added to the compute: the optimizer step (AdamW's memory traffic: ``ADAMW_PASSES`` passes over the
parameter-sized tensors for foreach/for-loop, ``FUSED_ADAMW_PASSES`` fused; for-loop also launches
its kernels parameter by parameter), gradient clipping, data loading (``data.cpu_work_ms`` per sample,
spread over the workers), and collectives at the link bandwidth: DDP's gradient all-reduce and FSDP's
all-gathers and reduce-scatters overlap with compute (only what is longer than the compute shows),
tensor parallelism's all-reduces are on the critical path, and the pipeline adds its bubble
``(pp - 1) / micro-batches`` of a stage's time.
"""

from __future__ import annotations

from typing import Any

from tokenmill import config as C
from tokenmill.estimate.gpus import GPU
from tokenmill.estimate.recorder import OpCost
from tokenmill.estimate.step import Plan
from tokenmill.estimate.timeline import Layout
from tokenmill.estimate.trace import Pieces

MATMUL_EFFICIENCY = 0.82  # share of the dense peak that large GEMMs reach (790-800 of 989 TFLOPS on H100)
TENSOR_CORE_D0 = 512  # a tensor-core product with smallest dimension d reaches d / (d + D0) of that
SIMT_D0 = 64
UNALIGNED = 0.6
ATTENTION_EFFICIENCY = 0.45  # fused (flash / memory-efficient) attention kernels, forward and backward
MEMORY_EFFICIENCY = 0.70  # share of the datasheet bandwidth element-wise kernels reach
LINK_EFFICIENCY = 0.80  # NCCL bus bandwidth / link bandwidth
KERNEL_MIN_US = 2.0
LAUNCH_US = 6.0  # CPU time per eager kernel launch (Python + dispatcher + launch)
COMPILE_TRAFFIC = 0.5
COMPILE_LAUNCHES = 0.2
ADAMW_PASSES = 19  # foreach / for-loop AdamW: reads and writes of parameter-sized tensors
FUSED_ADAMW_PASSES = 7
CPU_FLOPS_PER_THREAD = 3e10  # a rough CPU guide (fp32, one thread)


def _op_seconds(c: OpCost, cfg: C.Config, gpu: GPU, cpu_threads: int) -> float:
    if gpu.key == "cpu":
        if c.flops:
            return c.flops / (CPU_FLOPS_PER_THREAD * cpu_threads)
        return c.bytes / (gpu.hbm_gbs * 1e9)
    if c.flops:
        mode = c.math if c.math != "fp32" else ("tf32" if cfg.train.tf32 else "fp32")
        peak = gpu.peak(mode) or gpu.peak("fp32") or 1e13
        if c.attention:
            eff = ATTENTION_EFFICIENCY
        else:
            d0 = SIMT_D0 if mode == "fp32" else TENSOR_CORE_D0
            eff = MATMUL_EFFICIENCY * c.min_dim / (c.min_dim + d0) if c.min_dim else MATMUL_EFFICIENCY
            if mode != "fp32" and not c.aligned:
                eff *= UNALIGNED
        t = c.flops / (peak * eff)
    else:
        traffic = c.bytes * (COMPILE_TRAFFIC if cfg.compile.enabled else 1.0)
        t = traffic / (gpu.hbm_gbs * 1e9 * MEMORY_EFFICIENCY)
    return max(t, KERNEL_MIN_US * 1e-6)


def _pieces_time(pieces: Pieces, plan: Plan, cfg: C.Config, gpu: GPU, threads: int) -> dict[str, float]:
    """GPU seconds of matmuls and other kernels, and the kernel count, of one micro-batch of a stage."""
    out = {"matmul": 0.0, "memory": 0.0, "kernels": 0.0, "flops": 0.0}

    def add(costs: list[OpCost], times: int) -> None:
        for c in costs:
            s = _op_seconds(c, cfg, gpu, threads) * times
            out["matmul" if c.flops else "memory"] += s
            out["flops"] += c.flops * times
            out["kernels"] += times * (1 if c.flops else (COMPILE_LAUNCHES if cfg.compile.enabled else 1))

    count: dict[str, int] = {}
    for i in plan.stage_blocks:
        k = pieces.kinds[i]
        count[k] = count.get(k, 0) + 1
    for k, n in count.items():
        rnd = pieces.blocks[k].rounds[0]
        add(rnd.fwd_costs, n)
        add(rnd.bwd_costs, n)
    for tr, present in ((pieces.embed, plan.has_embed), (pieces.head, plan.has_head)):
        if present:
            add(tr.rounds[0].fwd_costs, 1)
            add(tr.rounds[0].bwd_costs, 1)
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
        per_step = {k: v * A * n_mb for k, v in part.items()}
        gpu_s = per_step["matmul"] + per_step["memory"]
        launch_s = per_step["kernels"] * LAUNCH_US * 1e-6 if gpu.key != "cpu" else 0.0
        param_bytes = sum(p.nbytes for p in plan.params) / (lay.tp if False else 1)
        shard = lay.dp_shard if lay.dp_shard > 1 else (lay.dp_replicate if cfg.parallel.zero1 else 1)
        opt_s, opt_kernels = _optimizer_seconds(cfg, plan, gpu, param_bytes / shard)
        comm_exposed, comm_s = _comm_seconds(cfg, lay, gpu, plan, pieces, gpu_s, A)
        bubble = gpu_s * (lay.pp - 1) / n_mb if lay.pp > 1 else 0.0
        compute = max(gpu_s, launch_s)
        total = compute + opt_s + comm_exposed + bubble
        if total > worst.get("total", -1):
            worst = {"total": total, "matmul": per_step["matmul"], "memory": per_step["memory"],
                     "launch": launch_s, "optimizer": opt_s, "comm": comm_s, "comm_exposed": comm_exposed,
                     "bubble": bubble, "flops": per_step["flops"]}
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
        "collectives_ms": 1000 * worst["comm"], "collectives_exposed_ms": 1000 * worst["comm_exposed"],
        "pipeline_bubble_ms": 1000 * worst["bubble"], "data_ms": 1000 * data_s, "mfu": mfu,
    }


def _optimizer_seconds(cfg: C.Config, plan: Plan, gpu: GPU, param_bytes: float) -> tuple[float, int]:
    mem, impl = cfg.memory, cfg.optim.impl
    n_tensors = len(plan.params)
    if mem.optimizer_offload or cfg.parallel.fsdp_cpu_offload:  # the step runs on the host; copies both ways
        elems = param_bytes / 4
        host = elems * 4 * ADAMW_PASSES / 20e9  # a multi-threaded CPU AdamW, ~20 GB/s
        pcie = 2 * param_bytes / 25e9
        return host + pcie, 0
    passes = FUSED_ADAMW_PASSES if impl == "fused" else ADAMW_PASSES
    if mem.optimizer_8bit:
        passes = ADAMW_PASSES // 2
    bw = gpu.hbm_gbs * 1e9 * MEMORY_EFFICIENCY
    s = param_bytes * passes / bw
    if cfg.optim.grad_clip > 0:
        s += 3 * param_bytes / bw
    kernels = {"fused": 1, "foreach": 12, "for-loop": 12 * n_tensors}[impl]
    if mem.optimizer_in_backward:
        kernels = 12 * n_tensors
    launch = kernels * LAUNCH_US * 1e-6 if gpu.key != "cpu" else 0.0
    return max(s, launch) if impl != "for-loop" else s + launch, kernels


def _comm_seconds(cfg: C.Config, lay: Layout, gpu: GPU, plan: Plan, pieces: Pieces, compute_s: float,
                  accum: int) -> tuple[float, float]:
    """(exposed seconds, total seconds) of the collectives of one step."""
    if lay.nproc == 1:
        return 0.0, 0.0
    bw = gpu.link_gbs * 1e9 * LINK_EFFICIENCY
    grad_bytes = sum(p.nbytes for p in plan.params)
    total = exposed = 0.0
    if lay.dp_shard > 1:
        n = lay.dp_shard
        numel = sum(p.numel for p in plan.params)
        mixed = cfg.parallel.fsdp_mixed_precision == "bf16"  # gathered in bf16, reduced in fp32
        gathers = 2 if cfg.parallel.fsdp_reshard_after_forward else 1
        ag = gathers * accum * (2 * numel if mixed else grad_bytes) * (n - 1) / n / bw
        rs = (4 * numel if mixed else grad_bytes) * (n - 1) / n / bw
        total += ag + rs
        exposed += max(0.0, ag + rs - 0.9 * compute_s)
    if lay.dp_replicate > 1:
        n = lay.dp_replicate
        share = 1.0 / lay.dp_shard
        ar = 2 * grad_bytes * share * (n - 1) / n / bw
        total += ar
        exposed += max(0.0, ar - 0.6 * compute_s)  # buckets overlap with the rest of backward
    if lay.tp > 1:
        n = lay.tp
        # the row-wise projections' outputs (and in backward the column-wise ones' input gradients), (B, T, C)
        # in the matmuls' dtype: bf16/fp16 under pure bf16 and autocast
        act = pieces.batch * pieces.seq * cfg.model.n_embd * (4 if cfg.train.precision == "fp32" else 2)
        per_block = 4 * 2 * act * (n - 1) / n / bw  # 2 all-reduces forward, 2 backward
        tp = per_block * len(plan.stage_blocks) * accum
        total += tp
        exposed += tp
    if lay.pp > 1:  # the residual stream between stages: bf16 only under pure bf16
        act = pieces.batch * pieces.seq * cfg.model.n_embd * (2 if cfg.train.precision == "bf16" else 4)
        n_mb = cfg.parallel.pp_microbatches or lay.pp
        p2p = 2 * act * n_mb * accum / bw
        total += p2p
        exposed += p2p * 0.5
    return exposed, total
