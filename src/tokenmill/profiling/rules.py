"""Doctor rules: one small function per bottleneck.

Each rule takes the typed run (:class:`~tokenmill.profiling.facts.Run`: the run's :class:`Config` and its
measured timing, data wait, memory, host and device facts, typed once by :mod:`.facts`; any figure may be
None) and returns ``None`` when it does not apply, or a :class:`Finding`
``(score, title, evidence, suggestions, measure)``. ``score`` is a rough expected gain: the fraction
of step time the suggested switches may recover, for speed rules (of wall-clock time for the
outside-the-steady-state rule). Memory rules score their share of the memory peak weighted by how
full the device is, so they rank below real speed problems unless memory is tight. Suggestions are
ordered by expected gain and carry the exact CLI override where the config has one (or the
environment setting, ``env``, where it has none). ``measure`` says what ``tokenmill doctor --try``
compares to confirm them: steady-state tokens/s (``speed``), end-to-end tokens/s (``wall``) or the
memory peak (``memory``).

Config values are the typed config's (``run.config.model.head_width``): the run's value over the default of
the config definitions, with the sizes the config derives, never a default retyped here. Thresholds on a
phase's share use ``run.timing.share_lo``, the share less twice its standard error over the run's own steps,
so a planted cause is named the same way whatever the noise of a loaded machine.

To add a rule: write ``@typed def my_rule(run: Run) -> Finding | None`` and append it to :data:`RULES`. A rule
written over the flat facts dict (``def my_rule(f)``, reading it with :func:`cfg`; no shipped rule is now)
keeps working: :func:`doctor.rank` passes the typed run to the rules marked ``typed`` and the dict to the others,
and a typed rule also takes the dict (it is typed on the way in).
"""


from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Optional

from tokenmill.config.memory_switches import getter
from tokenmill.profiling.data_rules import core_splits, data_bound, loading_plan, workers_needed
from tokenmill.profiling.docmask_rules import document_mask_cost
from tokenmill.profiling.facts import Run, typed
from tokenmill.profiling.findings import (
    CPU_OVERHEAD_FLOPS_PER_OP,
    MIN_SCORE,
    TIGHT_MEMORY,
    Finding,
    _clamp,
    advice,
    cfg,
    config_value,
    doc,
    env_setting,
    pct,
    switch,
)
from tokenmill.profiling.fp8_rules import fp8_cannot_pay
from tokenmill.profiling.memory_rules import (
    activation_memory,
    allocator_thrash,
    logits_peak,
    optimizer_state_memory,
)
from tokenmill.profiling.model_rules import (
    LAYER_FORMS,
    attention,
    compile_off,
    form_what,
    fp32_math,
    layer_forms,
    slow_forms,
)
from tokenmill.profiling.moe_rules import RULES as MOE_RULES
from tokenmill.profiling.moe_rules import moe_facts
from tokenmill.profiling.optim_rules import RULES as OPTIM_RULES
from tokenmill.profiling.sft_rules import RULES as SFT_RULES
from tokenmill.profiling.technique_rules import lora_finetune, qlora_finetune, selective_recompute

# the doctor and the tests reach every rule and helper through this module
__all__ = [
    "CPU_OVERHEAD_FLOPS_PER_OP", "LAYER_FORMS", "MIN_SCORE", "RULES", "Finding", "attention_flop_share", "cfg",
    "config_value", "core_splits", "data_bound", "doc", "env_setting", "form_what", "loading_plan", "moe_facts",
    "optimizer_impl",
    "slow_forms", "switch", "workers_needed",
]

# ----------------------------------------------------------------------------------------------
# Speed


@typed
def copy_bound(run: Run) -> Optional[Finding]:
    share, d = run.data.h2d_share, run.config.data
    if run.device != "cuda" or share is None or share < 0.08:
        return None
    sug = []
    if not d.pin_memory:
        sug.append(switch("data.pin_memory", True, "page-locked batches copy faster and asynchronously"))
    if not d.non_blocking:
        sug.append(switch("data.non_blocking", True, "overlap the host-to-device copy with compute"))
    sug.append(advice("send smaller token ids (uint16/int32) and widen them on the device"))
    ev = [f"host-to-device copies take {run.data.h2d_ms or 0.0:.1f} ms of {run.timing.step_ms or 0.0:.1f} ms per "
          f"step ({pct(share)})"]
    return Finding(_clamp(0.7 * share), "copy-bound: host-to-device transfers stall the step", ev, sug)


@typed
def host_sync(run: Run) -> Optional[Finding]:
    t, d = run.timing, run.config.data
    per_step = t.syncs_per_step
    every = run.config.log.every_steps
    if per_step is None:
        if every != 1:
            return None
        per_step = 1.0  # the trainer reads the losses back at every log step
    if per_step < 1.0:
        return None
    sources = t.sync_sources  # profile.json's, typed (facts.SyncSource)
    ev = [f"{per_step:.1f} host-device synchronisations per step"]
    for s in sources[:3]:
        ev.append(f"{s.op or s.call} in phase '{s.region}' ({s.python or s.parent}): {s.per_step:.2f}/step")
    sug = []
    if every < 10:
        ev.append(f"log.every_steps = {every}: the trainer synchronises and reads the loss back at every log step")
        sug.append(switch("log.every_steps", 50, "synchronise (and log) every 50 steps instead"))
    if any(s.region == "h2d" for s in sources):
        if not d.pin_memory:
            sug.append(switch("data.pin_memory", True, "a copy from pageable memory blocks the host"))
        if not d.non_blocking:
            sug.append(switch("data.non_blocking", True, "asynchronous host-to-device copies (with pinned memory)"))
    if any(s.region in ("forward", "backward", "optimizer") for s in sources):
        sug.append(advice("avoid .item()/.tolist()/print(tensor) and nonzero()/boolean-mask indexing inside the "
                          "step: keep values on the device (torch.where, masked arithmetic) and read them rarely"))
    cost = t.sync_share or 0.0  # host time in the syncs and the logging around them
    if t.sync_ms:
        ev.insert(1, f"the syncs and the logging around them take {t.sync_ms:.1f} ms of {t.step_ms or 0.0:.1f} ms "
                     f"per step ({pct(cost)})")
    if run.kernels.device_idle_share is not None:  # CUDA: the syncs also leave the device idle
        score = 0.9 * max(run.kernels.idle_not_data(run.data), cost)
    else:  # no device timeline: the time they cost, and at least what the count says an accelerator loses
        score = max(sync_count_score(per_step), 0.9 * cost)
    return Finding(_clamp(score, hi=0.6), "host-sync-bound: the host waits for the device every step", ev, sug)


def sync_count_score(per_step: float) -> float:
    """The least a sync rule finding scores for ``per_step`` syncs per step (>= 1) where their cost
    cannot be measured (CPU: nothing waits): each drains an accelerator's queue of launched work."""
    return min(0.3, 0.1 + 0.05 * per_step)




@typed
def launch_overhead(run: Run) -> Optional[Finding]:
    c, k, w = run.config, run.kernels, run.work
    tokens = int(w.tokens_per_step) if w.tokens_per_step is not None else None
    batch = c.train.batch_size
    if micro_batch(run) is not None:  # the same overhead, better fixed by merging the micro-batches
        return None
    if run.device == "cuda" and k.device_busy_fraction is not None:
        # device idle while the host logs after a sync is the sync rule's business
        idle = max(0.0, k.idle_not_data(run.data) - (k.logging_share or 0.0))
        small = (k.mean_kernel_us or 0.0) < 50.0
        if idle < 0.3 or not small:
            return None
        ev = [f"the GPU is idle {pct(idle)} of the step while the host is not waiting for data",
              f"{k.kernels_per_step or 0:.0f} kernels per step, mean {k.mean_kernel_us or 0:.1f} us: "
              "the host cannot launch them fast enough"]
        if tokens is not None:
            ev.append(f"{tokens:,} tokens per step")
        score = 0.8 * idle
    else:
        # No device timeline: the evidence is the work per operator (model FLOPs per step / operators per
        # step, from the profile). It scales with tokens per step and the model's width and does not
        # depend on the thread count, the profiler's overhead or other load on the host.
        per_op, compute = w.flops_per_op, run.timing.compute_share
        if per_op is None or per_op >= CPU_OVERHEAD_FLOPS_PER_OP or compute is None or compute < 0.3:
            return None
        ev = [f"{w.host_ops_per_step or 0:,.0f} operators per step for {tokens or 0:,} tokens: "
              f"{per_op:,.0f} model FLOPs per operator on average (< {CPU_OVERHEAD_FLOPS_PER_OP:,}), nanoseconds "
              "of math behind microseconds of dispatch each"]
        if k.host_mean_op_us is not None:
            ev.append(f"mean operator self time {k.host_mean_op_us:.1f} us: framework overhead, not math")
        ev.append(f"forward, backward, optimizer and the loop between them take {pct(compute)} of the step; "
                  "at this size they hardly grow with the batch")
        score = 0.75 * compute
    sug = [switch("train.batch_size", 4 * batch, "4x the work per launch and per optimizer step (if memory allows)")]
    if not c.compile.enabled and compile_off(run) is None:  # else that finding offers compile first
        sug.append(switch("compile.enabled", True, "fuse small operators into fewer kernels"))
    if run.device == "cuda" and c.compile.mode != "reduce-overhead" and compile_off(run) is None:
        sug.append(switch("compile.mode", "reduce-overhead", "CUDA graphs: one launch for the whole step "
                          "(with --compile.enabled true)"))
    if c.optim.impl != "fused":
        sug.append(switch("optim.impl", "fused", "one fused optimizer kernel instead of many small ones"))
    if not c.memory.optimizer_in_backward:  # that steps in backward: no accumulation
        sug.append(switch("train.grad_accum_steps", 4 * c.train.grad_accum_steps,
                          "amortise the optimizer step over more micro-batches when a larger batch does not fit"))
    return Finding(_clamp(score), "launch/overhead-bound: per-operator and per-step overhead dominate", ev, sug)


@typed
def optimizer_impl(run: Run) -> Optional[Finding]:
    """A large optimizer share with the for-loop or foreach AdamW."""
    impl, mem, t = run.config.optim.impl, run.config.memory, run.timing
    share = t.optimizer_share
    lo = t.share_lo("optimizer")
    memory_optimizer = mem.optimizer_8bit or mem.optimizer_offload or mem.optimizer_in_backward
    if impl == "fused" or memory_optimizer or lo is None or lo < 0.15:
        return None
    ev = [f"the optimizer step takes {t.optimizer_ms or 0.0:.1f} ms of {t.step_ms or 0.0:.1f} ms per step ({pct(share)}; "
          f"at least {pct(lo)} allowing for the run's step-to-step noise)",
          f"optim.impl = {impl} ({doc('optim.impl')})"]
    sug = [switch("optim.impl", "fused", "one fused kernel for the whole AdamW update")]
    if impl == "for-loop":
        sug.append(switch("optim.impl", "foreach", "multi-tensor operators over all parameters at once"))
    gain = OPTIMIZER_GAIN[impl] if impl == "for-loop" or run.device == "cuda" else OPTIMIZER_GAIN["foreach-cpu"]
    return Finding(_clamp(gain * share), f"slow optimizer implementation (optim.impl = {impl})", ev, sug)


# rough fraction of the optimizer time the fused implementation saves (on CPU little over foreach)
OPTIMIZER_GAIN = {"for-loop": 0.7, "foreach": 0.4, "foreach-cpu": 0.2}


@typed
def activation_recompute(run: Run) -> Optional[Finding]:
    """Activation checkpointing on while memory is not tight: the recompute is time for nothing."""
    every, t = run.config.memory.activation_checkpointing, run.timing
    share = t.recompute_share
    if every == 0 or share is None or share < 0.05:
        return None
    fill = run.memory_fill()
    if fill is not None and fill >= TIGHT_MEMORY:
        return None  # the memory it saves is needed
    ev = [f"memory.activation_checkpointing = {every}: the forward of "
          + ("every block" if every == 1 else f"every {every}th block") + " is recomputed in backward",
          f"recompute {t.recompute_ms or 0.0:.1f} ms of {t.step_ms or 0.0:.1f} ms per step ({pct(share)}; "
          f"{t.recompute_source})"]
    if fill is not None:
        ev.append(f"memory is not tight: the peak uses {pct(fill)} of the GPU (< {pct(TIGHT_MEMORY)})")
    elif run.device == "cuda":
        ev.append("the GPU's memory size is unknown (no profile): check the peak against it before switching")
    else:
        ev.append("CPU run: activations live in host memory, which checkpointing rarely needs to save")
    sug = [switch("memory.activation_checkpointing", 0, "keep the activations: no recompute")]
    if every == 1 and run.config.model.n_layer >= 2:
        sug.append(switch("memory.activation_checkpointing", 2, "recompute every second block: half the "
                          "recompute for half the saving"))
    score = 0.9 * share * (1.0 if fill is not None or run.device != "cuda" else 0.5)
    return Finding(_clamp(score), "activation checkpointing recomputes the forward while memory is not tight",
                   ev, sug)



# memory-saving switches that cost time (field, its cheaper value, what the time goes to)
TIME_FOR_MEMORY = {
    "memory.offload_activations": (False, "copies every saved activation to the host and back, waiting where the link is slower"),
    "memory.optimizer_offload": (False, "runs AdamW on the CPU and copies gradients and weights each step"),
    "parallel.sync_every_microbatch": (False, "reduces the gradients after every micro-batch, not once a step"),
    "compile.loss_outside": (False, "runs the head and the loss outside the compiled graph"),
}


@typed
def memory_savers_with_room(run: Run) -> Optional[Finding]:
    """Switches that trade time for memory, on while memory is not tight (or on a CPU, where host memory is
    what they would save): the time is spent for nothing."""
    get = getter(run.config)
    on = [k for k, (cheap, _) in TIME_FOR_MEMORY.items() if get(k) != cheap]
    if "parallel.sync_every_microbatch" in on and run.config.train.grad_accum_steps == 1:
        on.remove("parallel.sync_every_microbatch")  # nothing extra without accumulation
    fill, cuda = run.memory_fill(), run.device == "cuda"
    if not on or (fill is not None and fill >= TIGHT_MEMORY) or (cuda and fill is None):
        return None
    where = "CPU run: the switches save host memory from host memory" if not cuda else \
        f"memory is not tight: the peak uses {pct(fill)} of the GPU (< {pct(TIGHT_MEMORY)})"
    ev = [f"{k} = {get(k)}: it {TIME_FOR_MEMORY[k][1]}" for k in on] + [where]
    sug = [switch(k, TIME_FOR_MEMORY[k][0], "spend no time on memory that is not needed") for k in on]
    if "memory.optimizer_offload" in on and run.config.memory.offload_gradients:
        sug = [switch("memory.offload_gradients", False, "the gradients stay on the device"), *sug]
    moved = (run.data.h2d_share or 0.0) + (run.timing.optimizer_share or 0.0) if cuda else 0.0
    score = max(0.12 * len(on), 0.8 * moved)
    return Finding(_clamp(score), "memory-saving switches cost time while memory is not tight", ev, sug)


@typed
def micro_batch(run: Run) -> Optional[Finding]:
    """A tiny micro-batch made up by gradient accumulation: each micro-batch pays the per-operator
    overhead in full, the optimizer step does not need the accumulation to be small."""
    accum, batch, k = run.config.train.grad_accum_steps, run.config.train.batch_size, run.kernels
    if accum < 2 or run.config.parallel.pp > 1:
        return None
    if run.device == "cuda" and k.device_busy_fraction is not None:
        idle = max(0.0, k.idle_not_data(run.data) - (k.logging_share or 0.0))
        if idle < 0.3 or (k.mean_kernel_us or 0.0) >= 50.0:
            return None
        ev = [f"the GPU is idle {pct(idle)} of the step between short kernels "
              f"(mean {k.mean_kernel_us or 0:.1f} us)"]
        score = 0.85 * idle
    else:
        per_op, compute = run.work.flops_per_op, run.timing.compute_share
        if per_op is None or per_op >= MICRO_BATCH_FLOPS_PER_OP or compute is None or compute < 0.3:
            return None
        ev = [f"{per_op:,.0f} model FLOPs per operator (< {MICRO_BATCH_FLOPS_PER_OP:,}): each micro-batch is "
              "mostly per-operator overhead"]
        score = 0.8 * compute
    ev.insert(0, f"train.batch_size = {batch} accumulated {accum} times: {accum} small forward/backward passes "
                 "per optimizer step")
    sug = [switch("train.batch_size", batch * accum, "the same global batch in one micro-batch (if memory allows)",
                  also={"train.grad_accum_steps": 1})]
    if accum % 2 == 0 and accum > 2:
        sug.append(switch("train.batch_size", 2 * batch, "half the micro-batches, twice as large",
                          also={"train.grad_accum_steps": accum // 2}))
    return Finding(_clamp(score), "tiny micro-batch made up by gradient accumulation", ev, sug)


MICRO_BATCH_FLOPS_PER_OP = 4 * CPU_OVERHEAD_FLOPS_PER_OP  # merging micro-batches costs nothing but memory


@typed
def thread_oversubscription(run: Run) -> Optional[Finding]:
    """CPU runs: more busy threads (intra-op threads per process, plus the DataLoader workers when the
    loading does real work) than cores. The threads of one operator wait for the slowest, which waits
    for a core."""
    h, d = run.host, run.config.data
    if run.device != "cpu" or not h.intra_op_known or not h.cpu_count:
        return None
    intra, cores, procs = h.intra_op, h.cpu_count, h.local_world_size
    workers = d.num_workers
    busy_workers = workers if (d.cpu_work_ms > 0 or (run.data.data_share or 0.0) > 0.05) else 0
    want = intra * procs + busy_workers
    if want <= cores:
        return None
    compute = run.timing.compute_share
    compute = 0.9 if compute is None else compute
    fit = max(1, (cores - busy_workers) // procs)
    ev = [f"{intra} intra-op threads x {procs} process(es)"
          + (f" + {busy_workers} busy DataLoader workers" if busy_workers else "")
          + f" = {want} threads on {cores} cores"
          + (f" (the {workers} workers are mostly idle: not counted)" if workers and not busy_workers else ""),
          f"forward, backward and optimizer take {pct(compute)} of the step, each operator waiting for its "
          "slowest thread"]
    sug = [env_setting("OMP_NUM_THREADS", fit, f"{fit} intra-op thread(s) per process, one core each "
                       "(or torch.set_num_threads)")]
    if busy_workers and workers > 1:
        sug.append(switch("data.num_workers", max(1, cores - intra * procs),
                          "fewer workers, so that the training threads keep their cores"))
    return Finding(_clamp(0.6 * compute * (1.0 - cores / want)), "CPU threads over-subscribed", ev, sug)


@typed
def outside_steady_state(run: Run) -> Optional[Finding]:
    """Wall-clock time outside the steady-state steps (evaluation, checkpoints, logging, warm-up) of
    15% or more: the throughput the user waits for is lower than the steady state says."""
    w = run.wall
    wall, parts = w.wall_s, w.outside_s
    if not wall or not parts:
        return None
    total = sum(parts.values())
    share = total / wall
    if share < OUTSIDE_SHARE:
        return None
    step_s = (run.timing.step_ms or 0.0) / 1000
    steady = w.steady_s if w.steady_s is not None else wall - total
    ev = [f"{total:.1f} s of {wall:.1f} s of wall-clock time ({pct(share)}) went outside the steady-state steps "
          f"({steady:.1f} s) [{w.wall_source}]"]
    sug: list[dict[str, Any]] = []
    fixable = 0.0
    for part, secs in sorted(parts.items(), key=lambda kv: -kv[1]):
        if secs / wall < 0.02:
            continue
        count = int(w.outside_counts.get(part) or 0) or None
        ev.append(f"{part}: {secs:.1f} s ({pct(secs / wall)})" + (f" in {count} rounds" if count else ""))
        fix = _outside_fix(run, part, secs, count, step_s)
        if fix:
            fixable += secs
            sug += fix
    if not sug:
        return None
    main = max(parts, key=parts.get)
    return Finding(_clamp(0.9 * fixable / wall), f"wall-clock time lost outside the steady state: {main}", ev, sug,
                   measure="wall")


OUTSIDE_SHARE = 0.15


def _outside_fix(run: Run, part: str, secs: float, count: Optional[int], step_s: float) -> list[dict[str, Any]]:
    """Switches that make one part outside the steady state rarer or cheaper (at most 5% of the time)."""
    out: list[dict[str, Any]] = []
    each = secs / count if count else None

    def rarer(now: int) -> Optional[int]:
        if not each or not step_s:
            return None
        every = max(2 * now, math.ceil(19 * each / step_s))  # each round then costs <= 5% of the steps it follows
        return every if every > now else None

    c = run.config
    if part == "evaluation":
        now = c.train.eval_every_steps
        every = rarer(now) if now > 0 else None
        if every:
            out.append(switch("train.eval_every_steps", every, f"evaluate every {every} steps: each evaluation "
                              "then costs <= 5% of the training it follows"))
        batches = c.train.eval_batches
        if batches > 4:
            out.append(switch("train.eval_batches", max(2, batches // 4), "a quarter of the validation batches"))
    elif part == "checkpoints":
        now = c.checkpoint.every_steps
        every = rarer(now) if now > 0 else None
        if every:
            out.append(switch("checkpoint.every_steps", every, f"save every {every} steps"))
    elif part == "logging":
        now = c.log.every_steps
        if now < 50:
            out.append(switch("log.every_steps", 50, "log (and synchronise) every 50 steps"))
    return out


RULES: list[Callable[[dict], Optional[Finding]]] = [
    data_bound, copy_bound, host_sync, launch_overhead, compile_off, micro_batch, optimizer_impl,
    activation_recompute, layer_forms, thread_oversubscription, outside_steady_state, fp32_math, attention,
    logits_peak, activation_memory, optimizer_state_memory, allocator_thrash, memory_savers_with_room,
    selective_recompute, lora_finetune, qlora_finetune, fp8_cannot_pay, *OPTIM_RULES, document_mask_cost,
    *SFT_RULES, *MOE_RULES,
]


def attention_flop_share(n_layer: int, n_head: int, head_width: int, block_size: int,
                         flops_per_token: Optional[float] = None, params: Optional[int] = None) -> Optional[float]:
    """Share of the attention term ``12*L*H*Q*T`` (H query heads of width Q: ``model.head_dim`` where a
    model declares it, as Qwen3 does, else n_embd / n_head) in the per-token FLOPs: the run's own
    ``flops_per_token`` (summary.json), else ``6 * params + 12*L*H*Q*T`` (a run of an older version)."""
    att = 12.0 * n_layer * n_head * head_width * block_size
    total = flops_per_token or (6.0 * params + att if params else None)
    return att / total if total and total > 0 and math.isfinite(total) else None
