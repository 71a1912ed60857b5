"""The collectives of one training step in its time (:func:`comm_seconds`: what they take and what of it the
compute does not hide, from the order the step runs them in) and what they take from the compute they overlap
(:func:`contention_seconds`: the SMs NCCL's channels hold). Read by :func:`.roofline.step_time` and
:mod:`.moe` (the experts' own collectives)."""

from __future__ import annotations

from tokenmill import config as C
from tokenmill.estimate.bandwidth import group_bandwidth, nccl_channels
from tokenmill.estimate.fsdp import gathered_bytes
from tokenmill.estimate.gpus import GPU
from tokenmill.estimate.step import Plan
from tokenmill.estimate.timeline import Layout
from tokenmill.estimate.trace import Pieces
from tokenmill.model.gpt import edge_units_apart

__all__ = ["comm_seconds", "contention_seconds"]


def contention_seconds(gpu: GPU, lay: Layout, overlapped_s: float) -> float:
    """What the compute loses while collectives run beside it: NCCL holds one SM per channel
    (:func:`~.bandwidth.nccl_channels`) for as long as a collective runs, so over the overlapped seconds the
    compute has ``channels / SMs`` fewer of the GPU's SMs (24 of 108 on an A100, 24 of 132 on an H100). Within
    one node only: across nodes NCCL's channels follow its network rings (fewer; not modelled, none counted). The
    memory bandwidth NCCL's copies take beside it is not counted either."""
    if overlapped_s <= 0 or not gpu.sm or (gpu.node_gpus and lay.nproc > gpu.node_gpus):
        return 0.0
    return overlapped_s * nccl_channels(gpu) / gpu.sm


def comm_seconds(cfg: C.Config, lay: Layout, gpu: GPU, plan: Plan, pieces: Pieces, compute_s: float,
                  backward_s: float) -> tuple[float, float]:
    """(exposed seconds, total seconds) of the collectives of one step. What overlaps follows from the order the
    step runs them in (``compute_s``: the step's GPU compute; ``backward_s``: one micro-batch's backward):

    - FSDP2 gathers each group's parameters ahead of its use on its own stream and reduce-scatters each group's
      gradients while the next group's backward runs: all is hidden but a micro-batch's first all-gather and a
      backward's last reduce-scatter (one group's each), unless the collectives outlast the compute;
    - DDP all-reduces a bucket (``parallel.ddp_bucket_mb``) as soon as its gradients are ready, during that
      micro-batch's backward: the last bucket waits for the backward's end, and what is longer than the backward
      shows;
    - gradients are reduced once a step, or after every micro-batch with ``parallel.sync_every_microbatch``;
    - tensor parallelism's all-reduces sit between the products that need them (all exposed); a pipeline's sends
      hide behind the stage's next micro-batch except in the fill and the drain."""
    if lay.nproc == 1:
        return 0.0, 0.0
    accum = cfg.train.grad_accum_steps
    syncs = accum if cfg.parallel.sync_every_microbatch else 1  # gradient reductions a step
    grad_bytes = sum(p.nbytes for p in plan.params if p.trainable)  # a frozen parameter has no gradient
    total = exposed = 0.0
    if lay.dp_shard > 1:
        n = lay.dp_shard
        bw = group_bandwidth(gpu, n, lay.tp)
        # a group per block, then the embeddings' and the head's (model/gpt.py edge_units), or the root's with them
        groups = len(plan.stage_blocks) + (2 if edge_units_apart(cfg.model) else 1)
        grad_numel = sum(p.numel for p in plan.params if p.trainable)
        mixed = cfg.parallel.fsdp_mixed_precision == "bf16"  # reduced in fp32 (gathered: fsdp.gathered_bytes)
        gathers = 2 if cfg.parallel.fsdp_reshard_after_forward else 1
        gathered = sum(gathered_bytes(cfg, p) for p in plan.params)
        ag = gathers * accum * gathered * (n - 1) / n / bw
        rs = syncs * (4 * grad_numel if mixed else grad_bytes) * (n - 1) / n / bw
        edge = accum * gathered * (n - 1) / n / bw / groups + rs / groups  # the first gather, the last reduction
        total += ag + rs
        exposed += max(edge, ag + rs - compute_s)
    if lay.dp_replicate > 1:
        n = lay.dp_replicate
        bw = group_bandwidth(gpu, n, lay.dp_shard * lay.tp)
        share = 1.0 / lay.dp_shard
        ar = 2 * grad_bytes * share * (n - 1) / n / bw  # one reduction (a ring all-reduce moves the bytes twice)
        tail = min(ar, 2 * cfg.parallel.ddp_bucket_mb * 2**20 * (n - 1) / n / bw)  # the last bucket
        total += syncs * ar
        exposed += syncs * max(tail, ar - backward_s)
    if lay.tp > 1:
        n = lay.tp
        bw = group_bandwidth(gpu, n, 1)
        # the row-wise projections' outputs (and in backward the column-wise ones' input gradients), (B, T, C)
        # in the matmuls' dtype: bf16/fp16 under pure bf16 and autocast
        act = pieces.batch * pieces.seq * cfg.model.n_embd * (4 if cfg.train.precision == "fp32" else 2)
        per_block = 4 * 2 * act * (n - 1) / n / bw  # 2 all-reduces forward, 2 backward
        tp = per_block * len(plan.stage_blocks) * accum
        total += tp
        exposed += tp
    if lay.pp > 1:  # the residual stream between stages: bf16 only under pure bf16
        bw = group_bandwidth(gpu, lay.pp, lay.dp * lay.tp)
        act = pieces.batch * pieces.seq * cfg.model.n_embd * (2 if cfg.train.precision == "bf16" else 4)
        n_mb = cfg.parallel.pp_microbatches or lay.pp
        p2p = 2 * act * n_mb * accum / bw
        total += p2p
        # a send runs beside the stage's next micro-batch, but not in the fill and the drain: the first micro-batch's
        # activation hops through the pp - 1 stage boundaries forward, the last one's gradient back
        exposed += min(p2p, 2 * (lay.pp - 1) * act * accum / bw)
    return exposed, total
