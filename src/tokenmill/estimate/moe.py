"""The mixture-of-experts terms of an estimate (``model.moe_experts`` > 0), with expert parallelism
(``parallel.ep``).

The traced model (:mod:`.trace`) already holds every expert's weights (FSDP shards them over
``parallel.dp_shard`` on the expert dimension) and its routed activations: on ``meta`` the experts run as one
product over all ``tokens x top_k`` routed rows (:class:`tokenmill.model.moe.Experts`). What the trace cannot
see is added here, from the config's shapes:

- **memory with expert parallelism**: the trace's steps are replayed a second time as the layout holds them
  (:class:`_EPStep`, :func:`ep_memory`) and the difference folded in, category by category: each rank holds
  ``E / ep`` experts, FSDP-sharded over the ``dp / ep`` ranks holding the same ones (their own ``fully_shard``
  over ``dp_mod_ep``), so an expert's sharded weights, gradients and optimizer state per rank are the total
  over ``dp`` (``dp_shard`` without HSDP: what the trace already shards); FSDP gathers, and makes and
  reduce-scatters the unsharded gradients of, only the local experts: a gathered sparse block is its dense
  weights whole plus ``1 / ep`` of its experts, wherever the replay holds one (none in the head's backward,
  the block in backward and the prefetched one in a block's backward). Without FSDP (``ep`` over DDP
  replicas) the experts' weights, gradients and optimizer state are ``1 / ep`` and outside DDP's buckets.
  The dispatch's send and receive buffers (``tokens x top_k`` rows each) are temporaries over each sparse
  block's forward and backward. Qwen3-30B-A3B, FSDP x8 and EP x8, fp32 weights: the sharded floor is 30.53B
  x 4 bytes / 8 = 14,559 MiB (+ 4 MiB of RoPE tables); a gathered sparse block 73 MiB of dense weights and
  288 MiB of its 16 local experts (2,377 MiB with all 128); at the peak (the head's backward) the replay
  holds the root gathered (embeddings, head, final norm: 622.3M x 4 bytes = 2,374 MiB) and no block, so
  ``parameters`` = 16,937 MiB;
- **the grouped expert matmuls at their real shapes**: under balanced routing each of a rank's ``E / ep``
  experts gets ``tokens x top_k x ep / E`` rows (padded to 16 on CUDA, as the grouped GEMM pads them), priced
  by the roofline's own matmul pricing (:func:`tokenmill.estimate.roofline._op_seconds`: efficiency falling
  with the smallest dimension, tile and wave quantization) for the forward, the input gradients and, when the
  experts train, the weight gradients (the forward again under activation checkpointing); the trace priced
  them as one large product, and the difference is added to the matmul time. With ``model.moe_impl = 'loop'``
  (or 'auto' where the grouped GEMM does not run: before compute capability 9.0, or without bf16 products) each
  expert's products are separate kernels, and the host dispatches :data:`LOOP_OPS_FWD` + :data:`LOOP_OPS_BWD`
  operations per expert at ``estimate.host.HOST_OP_US`` each: the larger of that and the GPU's time;
- **the all-to-all**: dispatch and combine, forward and backward (and the recomputed forward under
  activation checkpointing), each moving ``tokens x top_k x C`` activations of which ``(ep - 1) / ep`` leave
  the rank, at the GPU's link bandwidth (NVLink or PCIe, :mod:`.gpus`) x ``LINK_EFFICIENCY``, on the
  critical path (the experts wait for their tokens);
- FSDP's all-gathers and reduce-scatters of the experts move ``1 / ep`` of the bytes, within groups of
  ``dp / ep`` ranks.

:func:`apply_moe` folds these into an :class:`~tokenmill.estimate.core.Estimate` and keeps the parts in its
``moe`` field; :func:`format_moe` shows them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from tokenmill import config as C
from tokenmill.errors import ParallelError
from tokenmill.estimate.collectives import contention_seconds
from tokenmill.estimate.gpus import GPU
from tokenmill.estimate.recorder import OpCost
from tokenmill.estimate.step import Step
from tokenmill.estimate.timeline import _size

MB = 1024 * 1024
GROUP_ALIGN = 16  # rows of each expert's group on CUDA (tokenmill.model.moe.GROUP_ALIGN)
# model.moe_impl 'loop': the ATen ops the host dispatches per expert with tokens, counted from Experts._loop
# (the split's view, each linear's weight select, autocast cast, transpose and product, the chunk, SiLU and
# product), and in backward about twice as many
LOOP_OPS_FWD = 11
LOOP_OPS_BWD = 22


def check_ep(cfg: C.Config, dp: int) -> None:
    """``parallel.ep`` must divide the experts and the data-parallel world size (one line naming the field)."""
    ep, E = cfg.parallel.ep, cfg.model.moe_experts
    if ep == 1:
        return
    if not E:
        raise ParallelError(f"parallel.ep={ep} needs a mixture of experts (model.moe_experts > 0).")
    if E % ep:
        raise ParallelError(f"parallel.ep={ep} must divide model.moe_experts ({E}).")
    if dp % ep:
        raise ParallelError(f"parallel.ep={ep} must divide the data-parallel world size ({dp}): give --nproc a "
                            f"multiple of {ep}.")


def expert_ranks(ep: int, dp_shard: int, dp: int) -> int:
    """Ranks one expert layer's weights are spread over: ``ep`` ranks of experts, each group FSDP-sharded
    over the ``dp / ep`` ranks holding the same experts (``dp_mod_ep``; every data-parallel rank, the
    replicas of HSDP too); without FSDP the ``ep`` ranks; without ``ep``, FSDP's ``dp_shard``."""
    if ep == 1:
        return dp_shard
    return dp if dp_shard > 1 else ep


def a2a_bytes(tokens: int, top_k: int, width: int, act_bytes: int, ep: int, passes: int = 4) -> float:
    """Bytes one rank sends in one sparse layer's all-to-alls of one micro-batch: ``passes`` all-to-alls
    (dispatch and combine, forward and backward: 4) of ``tokens x top_k`` rows of ``width`` activations, of
    which ``(ep - 1) / ep`` go to other ranks under balanced routing."""
    return passes * tokens * top_k * width * act_bytes * (ep - 1) / ep


def tokens_per_expert(tokens: int, top_k: int, experts: int, ep: int) -> float:
    """Rows each of a rank's local experts gets under balanced routing: its ``tokens x top_k`` slots and
    those of the other ``ep - 1`` ranks, spread over ``experts`` (``ep / experts`` of them per expert)."""
    return tokens * top_k * ep / experts


def _mm(n: int, m: float, k: int, nn: int, math_: str) -> OpCost:
    """A (grouped) product of ``n`` groups of (m x k) @ (k x nn)."""
    m = max(1, int(math.ceil(m)))
    return OpCost("grouped_mm", flops=2.0 * n * m * k * nn, math=math_, min_dim=min(m, k, nn),
                  aligned=all(d % 8 == 0 for d in (m, k, nn)), dims=(n, m, k, nn))


def expert_matmuls(groups: int, rows: float, C_: int, I_: int, math_: str, trained: bool,
                   recompute: bool) -> list[OpCost]:
    """One sparse layer's expert products of one micro-batch: ``groups`` experts of ``rows`` rows each;
    the forward (twice with recompute), the input gradients, and the weight gradients when ``trained``."""
    fwd = [_mm(groups, rows, C_, 2 * I_, math_), _mm(groups, rows, I_, C_, math_)]
    bwd = [_mm(groups, rows, C_, I_, math_), _mm(groups, rows, 2 * I_, C_, math_)]
    if trained:
        bwd += [_mm(groups, 2 * I_, rows, C_, math_), _mm(groups, C_, rows, I_, math_)]
    return fwd * (2 if recompute else 1) + bwd


def _seconds(costs: list[OpCost], cfg: C.Config, gpu: GPU) -> float:
    from tokenmill.estimate.roofline import _op_seconds

    return sum(_op_seconds(c, cfg, gpu, 1) for c in costs)


def expert_impl(cfg: C.Config, gpu: GPU, mm_math: str) -> str:
    """How the experts run on ``gpu`` (``model.moe_impl``; 'auto': grouped where ``torch._grouped_mm`` runs on
    CUDA, compute capability 9.0 and bf16 products; the CPU's fp32 too)."""
    impl = cfg.model.moe_impl
    if impl != "auto":
        return impl
    if gpu.key == "cpu":
        return "grouped"
    return "grouped" if gpu.cc >= (9, 0) and mm_math == "bf16" else "loop"


def moe_terms(cfg: C.Config, lay, gpu: GPU, plan, tokens: int) -> dict[str, Any]:
    """The MoE parts of one rank's step (module doc); ``tokens``: one micro-batch's tokens on a rank."""
    from tokenmill.estimate.bandwidth import group_bandwidth
    from tokenmill.estimate.host import HOST_OP_US
    from tokenmill.estimate.step import _state_bytes

    m, ep = cfg.model, cfg.parallel.ep
    E, k, C_, I_ = m.moe_experts, m.moe_top_k, m.n_embd, m.expert_width
    experts = [p for p in plan.params if ".experts." in p.name]
    layers = len({p.block for p in experts})
    trained = any(p.trainable for p in experts)
    ranks = expert_ranks(ep, lay.dp_shard, lay.dp)
    numel = sum(p.numel for p in experts)
    width = _size(experts[0].dtype) if experts else 4
    state = sum(_state_bytes(cfg, p, 1.0 / ranks)[0] for p in experts if p.trainable)
    act = 2 if cfg.train.precision in ("bf16", "fp16") else 4  # autocast keeps the residual stream in fp32
    mm_math = "fp32" if cfg.train.precision == "fp32" else "bf16"
    cuda = gpu.key != "cpu"
    slots = tokens * k
    rows = tokens_per_expert(tokens, k, E, ep)
    local = E // ep
    padded = math.ceil(rows / GROUP_ALIGN) * GROUP_ALIGN if cuda else rows
    recompute = cfg.memory.activation_checkpointing > 0 and cfg.memory.activation_checkpointing_policy == "full"
    impl = expert_impl(cfg, gpu, mm_math)
    if impl == "loop":  # one product per expert: each its own kernel, each op issued by the host
        gpu_s = local * _seconds(expert_matmuls(1, rows, C_, I_, mm_math, trained, recompute), cfg, gpu)
        ops = local * (LOOP_OPS_FWD * (2 if recompute else 1) + LOOP_OPS_BWD)
        real = max(gpu_s, ops * HOST_OP_US * 1e-6)
    else:
        real = _seconds(expert_matmuls(local, padded, C_, I_, mm_math, trained, recompute), cfg, gpu)
    traced = _seconds(expert_matmuls(1, slots, C_, I_, mm_math, trained, recompute), cfg, gpu)
    ideal = sum(c.flops for c in expert_matmuls(local, rows, C_, I_, mm_math, trained, recompute))
    peak = gpu.peak(mm_math if mm_math != "fp32" else ("tf32" if cfg.train.tf32 else "fp32"))
    a2a = a2a_bytes(tokens, k, C_, act, ep, 6 if recompute else 4) if ep > 1 else 0.0
    A = cfg.train.grad_accum_steps
    return {
        "experts": E, "top_k": k, "impl": impl, "sparse_layers": layers, "ep": ep, "experts_per_rank": local,
        "expert_params": numel, "expert_ranks": ranks, "trained": trained, "param_width": width,
        "expert_weights_mb": numel / ranks * width / MB,
        "expert_gradients_mb": (numel / ranks * width / MB) if trained else 0.0,
        "expert_optimizer_mb": state / MB,
        "routed_activations_mb": {  # one sparse layer, one micro-batch (part of the traced activations)
            "permuted tokens": 2 * slots * C_ * act / MB,  # the expert-sorted copy and the experts' output
            "expert hidden": slots * 3 * I_ * act / MB,  # gate and up (2I), silu(gate) * up (I)
            "router logits": tokens * E * (2 * 4 + (2 if act == 2 else 4)) / MB,  # logits, fp32 probabilities
        },
        "tokens_per_expert": rows,
        "grouped_matmul_ms": 1000 * real * layers * A,
        "grouped_matmul_traced_ms": 1000 * traced * layers * A,
        "grouped_matmul_efficiency": (ideal / real / peak) if (peak and real and cuda) else None,
        "all_to_all_mb": a2a * layers * A / MB,
        "all_to_all_ms": 1000 * a2a * layers * A / group_bandwidth(gpu, ep, lay.tp),  # the ep group: dp ranks
        "a2a_buffer_bytes": 2 * slots * C_ * act if ep > 1 else 0,
        "link": gpu.link,
    }


class _EPStep(Step):
    """One rank's steps as the expert-parallel layout holds them (module doc): the routed experts' parameters
    are this rank's ``E / ep`` (``self.local``) where they are gathered, their gradients made and reduced, and
    FSDP-sharded over the ``dp / ep`` ranks holding the same experts; over DDP, kept whole, outside DDP's
    buckets (``_ddp_params_and_buffers_to_ignore``) and stepped by the optimizer at ``E / ep``."""

    def __init__(self, pieces, plan, ep: int):
        self.ep = ep
        self.expert = {p.name for p in plan.params if ".experts." in p.name}
        self.local = {p.name: dataclasses.replace(p, shape=(p.shape[0] // ep, *p.shape[1:]))
                      for p in plan.params if p.name in self.expert}
        fsdp, rep = plan.layout.dp_shard > 1, plan.layout.dp_replicate
        if not fsdp:  # a rank's optimizer steps only its experts
            plan = dataclasses.replace(plan, params=[self.local.get(p.name, p) for p in plan.params])
        elif rep > 1:  # HSDP: the experts' FSDP spans the replicas too, E / dp per rank where the rest is 1 / dp_shard
            plan = dataclasses.replace(plan, params=[
                dataclasses.replace(p, shape=(p.shape[0] // rep, *p.shape[1:]))
                if p.name in self.expert and p.shape[0] % rep == 0 else p for p in plan.params])
        super().__init__(pieces, plan)
        self.by_name.update(self.local)  # the unsharded gradients: the local experts'
        self.expert_shard = ep / plan.layout.dp if fsdp else 1.0  # FSDP over dp_mod_ep

    def setup(self) -> None:
        full = self.plan
        self.plan = dataclasses.replace(full, params=[p for p in full.params if p.name not in self.expert])
        super().setup()  # DDP's buckets leave the experts out
        self.plan = full
        if self.fsdp and self.cfg.parallel.fsdp_cpu_offload:  # the shards live on the host
            return
        for name in sorted(self.expert):
            p = self.local[name]
            self.tl.alloc(math.ceil(p.shape[0] * self.expert_shard) * (p.numel // p.shape[0]) * _size(p.dtype),
                          "parameters")

    def _on_grad(self, name: str, gid: int) -> None:
        if self.ddp and name in self.expert and self.cfg.parallel.ddp_grad_as_bucket_view:  # DDP ignores them
            self.grads[name] = gid
            return
        super()._on_grad(name, gid)

    def _unshard(self, params: list) -> list[int]:
        return super()._unshard([self.local.get(p.name, p) for p in params])

    def _reduce_scatter(self, names: list[str], sync: bool) -> None:
        """The block's own FSDP group over ``dp_shard``, the experts' over ``dp_mod_ep``."""
        super()._reduce_scatter([n for n in names if n not in self.expert], sync)
        shard, self.shard = self.shard, self.expert_shard
        super()._reduce_scatter([n for n in names if n in self.expert], sync)
        self.shard = shard


def _local_pieces(pieces, ep: int, a2a: int):
    """``pieces`` with each sparse block's expert gradients at ``1 / ep`` of the traced (all experts') size
    (:func:`_expert_grad_events`), and the dispatch's send and receive buffers (``a2a`` bytes) alive over each
    sparse block's forward and backward."""
    blocks = {}
    for kind, tr in pieces.blocks.items():
        if not any(".experts." in n for n in tr.param_shape):
            blocks[kind] = tr
            continue
        hits = _expert_grad_events(tr)
        buf = [("a", "ep-a2a", a2a, "all_to_all")], [("f", "ep-a2a")]
        rounds = [dataclasses.replace(rnd, fwd=buf[0] + rnd.fwd + buf[1], bwd=buf[0] + [
            (e[0], e[1], e[2] // ep, *e[3:]) if i in hit else e for i, e in enumerate(rnd.bwd)] + buf[1])
            for rnd, hit in zip(tr.rounds, hits)]
        blocks[kind] = dataclasses.replace(tr, rounds=rounds)
    return dataclasses.replace(pieces, blocks=blocks)


def _expert_grad_events(tr) -> list[set[int]]:
    """Per round, the positions in its backward of the expert gradients' allocations: in the first round the
    gradients' own storages; in an accumulating round the new gradient added into them, found as the last
    allocations of the same (label, bytes) (eager: ``select_backward``, the traced product's expert 0
    scattered into the stacks; compiled: the graph's outputs, at its end)."""
    first = tr.rounds[0]
    made = {sid for n, sid in first.grads.items() if ".experts." in n}
    keys = [(e[2], e[3] if len(e) > 3 else None) for e in first.bwd if e[0] == "a" and e[1] in made]
    out = [{i for i, e in enumerate(first.bwd) if e[0] == "a" and e[1] in made}]
    for rnd in tr.rounds[1:]:
        want, hit = list(keys), set()
        for i in range(len(rnd.bwd) - 1, -1, -1):
            e = rnd.bwd[i]
            key = (e[2], e[3] if len(e) > 3 else None) if e[0] == "a" else None
            if key in want:
                want.remove(key)
                hit.add(i)
        out.append(hit)
    return out


def ep_memory(cfg: C.Config, spec: GPU, plan, pieces, t: dict[str, Any]):
    """The replayed memory of one rank as the expert-parallel layout holds it
    (:class:`~tokenmill.estimate.timeline.Memory`): the estimate's own traced ``pieces`` and step, with
    :class:`_EPStep`'s local experts and :func:`_local_pieces`' gradients and all-to-all buffers."""
    step = _EPStep(_local_pieces(pieces, cfg.parallel.ep, t["a2a_buffer_bytes"]), plan, cfg.parallel.ep)
    tl = step.run()
    return tl.replay(plan.cuda, cfg.memory, int(spec.memory_mb * MB) if plan.cuda else None)


def _fsdp_expert_comm_delta(cfg: C.Config, lay, gpu: GPU, t: dict[str, Any]) -> float:
    """Seconds FSDP's expert all-gathers and reduce-scatters lose with ``ep`` (negative): the trace charged
    every expert over ``dp_shard`` ranks; with ``ep`` each rank gathers ``1 / ep`` of them over ``dp / ep``."""
    from tokenmill.estimate.bandwidth import group_bandwidth

    ep, n = cfg.parallel.ep, lay.dp_shard
    if ep == 1 or n == 1:
        return 0.0
    bw = group_bandwidth(gpu, n, lay.tp)  # what roofline charged FSDP's gathers at
    mixed = cfg.parallel.fsdp_mixed_precision == "bf16"
    numel, width = t["expert_params"], t["param_width"]
    gathers = (2 if cfg.parallel.fsdp_reshard_after_forward else 1) * cfg.train.grad_accum_steps
    volume = gathers * numel * (2 if mixed else width) + (numel * (4 if mixed else width) if t["trained"] else 0)
    n2 = max(1, lay.dp // ep)  # dp_mod_ep
    return volume * ((n2 - 1) / n2 / ep - (n - 1) / n) / bw


def apply_moe(est, cfg: C.Config, lay, spec: GPU, plan, pieces=None, base=None) -> None:
    """Fold the MoE terms (module doc) into ``est`` and keep them in ``est.moe``; nothing for a dense model.
    ``pieces`` and ``base``: the estimate's traced pieces and the memory it replayed from them (what
    ``parallel.ep`` replays again with the local experts)."""
    check_ep(cfg, lay.dp)
    if not cfg.model.moe_experts:
        return
    B = cfg.train.batch_size
    t = moe_terms(cfg, lay, spec, plan, B * cfg.model.block_size)
    shift = 0.0
    if cfg.parallel.ep > 1:  # the trace's memory replayed again with the local experts: the difference
        mem = ep_memory(cfg, spec, plan, pieces, t)
        for cat in set(base.breakdown) | set(mem.breakdown):
            d = (mem.breakdown.get(cat, 0) - base.breakdown.get(cat, 0)) / MB
            est.breakdown_mb[cat] = est.breakdown_mb.get(cat, 0.0) + d
        shift = (mem.peak_alloc - base.peak_alloc) / MB
        est.peak_alloc_mb += shift
        est.peak_reserved_mb += (mem.peak_reserved - base.peak_reserved) / MB
        est.allocator_slack_mb = est.peak_reserved_mb - est.peak_alloc_mb
        est.at_peak = mem.at_peak
    if est.capacity_mb:
        est.fits = est.peak_reserved_mb <= est.capacity_mb
    t["memory_shift_mb"] = shift
    if cfg.parallel.ep > 1:
        est.layout += f", EP x{cfg.parallel.ep}"
    if spec.key != "cpu":
        _apply_time(est, cfg, lay, spec, t)
    est.moe = {k: v for k, v in t.items() if k not in ("a2a_buffer_bytes",)}


def _apply_time(est, cfg: C.Config, lay, spec: GPU, t: dict[str, Any]) -> None:
    tb = est.time_breakdown_ms
    mm = t["grouped_matmul_ms"] - t["grouped_matmul_traced_ms"]
    tb["matmul_ms"] = tb.get("matmul_ms", 0.0) + mm
    comm = 1000 * _fsdp_expert_comm_delta(cfg, lay, spec, t)
    exposed = tb.get("collectives_exposed_ms", 0.0)
    exposed_delta = max(-exposed, comm)
    tb["collectives_ms"] = tb.get("collectives_ms", 0.0) + comm
    tb["collectives_exposed_ms"] = exposed + exposed_delta
    # the SMs NCCL holds over the collectives the compute overlaps, re-counted for the experts' own
    share = tb.get("collectives_sm_share_ms", 0.0)
    tb["collectives_sm_share_ms"] = 1000 * contention_seconds(
        spec, lay, (tb["collectives_ms"] - tb["collectives_exposed_ms"]) / 1000)
    tb["all_to_all_ms"] = t["all_to_all_ms"]
    old = est.step_ms
    est.step_ms = old + mm + exposed_delta + tb["collectives_sm_share_ms"] - share + t["all_to_all_ms"]
    scale = old / est.step_ms
    est.tokens_per_sec *= scale
    if est.mfu:
        est.mfu *= scale
    if est.tokens_per_sec_range:
        est.tokens_per_sec_range = tuple(v * scale for v in est.tokens_per_sec_range)


def format_moe(est) -> list[str]:
    """The MoE lines of ``tokenmill estimate``'s report (empty for a dense model)."""
    t: Optional[dict[str, Any]] = getattr(est, "moe", None)
    if not t:
        return []
    ra = t["routed_activations_mb"]
    lines = [
        "", f"mixture of experts: {t['experts']} experts, {t['top_k']} per token, {t['sparse_layers']} sparse layer(s) "
        f"on this rank; expert parallel x{t['ep']}: {t['experts_per_rank']} experts per rank",
        f"  expert weights {_mb(t['expert_weights_mb'])} MiB, gradients {_mb(t['expert_gradients_mb'])} MiB, "
        f"optimizer state {_mb(t['expert_optimizer_mb'])} MiB per rank ({t['expert_params'] / 1e9:,.2f}B expert "
        f"parameters over {t['expert_ranks']} rank(s): ep x FSDP)",
        "  routed activations per sparse layer and micro-batch (in the activations above): "
        + ", ".join(f"{k} {v:,.1f} MiB" for k, v in ra.items()),
    ]
    if t["memory_shift_mb"]:
        lines.append(f"  expert parallelism changes the peak by {t['memory_shift_mb']:+,.0f} MiB (replayed with only the "
                     "local experts gathered, reduced and stepped, and the dispatch's send and receive buffers)")
    if "all_to_all_ms" in est.time_breakdown_ms:
        eff = t["grouped_matmul_efficiency"]
        how = "grouped expert matmuls" if t["impl"] != "loop" else "expert matmuls, one per expert (model.moe_impl loop)"
        lines.append(f"  {how}: {t['tokens_per_expert']:,.0f} tokens per expert (balanced routing), "
                     f"{t['grouped_matmul_ms']:,.1f} ms per step" + (f" at {100 * eff:.0f}% of the peak" if eff else ""))
        if t["ep"] > 1:
            lines.append(f"  all-to-all (dispatch + combine, forward and backward): {_mb(t['all_to_all_mb'])} MiB sent "
                         f"per step over {t['link']}: {t['all_to_all_ms']:,.1f} ms, on the critical path")
    return lines


def _mb(v: float) -> str:
    return f"{v:,.0f}"
