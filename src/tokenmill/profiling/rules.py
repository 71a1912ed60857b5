"""Doctor rules: one small function per bottleneck.

Each rule reads the flat ``facts`` dict built by :mod:`tokenmill.profiling.doctor` (any key may be
missing) and returns ``None`` when it does not apply, or a :class:`Finding` ``(score, title,
evidence, suggestions)``. ``score`` is a rough expected gain: the fraction of step time the
suggested switches may recover, for speed rules. Memory rules score their share of the memory peak
weighted by how full the device is, so they rank below real speed problems unless memory is tight.
Suggestions are ordered by expected gain and carry the exact CLI override where the config has one.

To add a rule: write ``def my_rule(f) -> Finding | None`` and append it to :data:`RULES`.
"""

from __future__ import annotations

import functools
import math
import typing
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, Optional

from tokenmill.config import field_specs

MIN_SCORE = 0.10  # below this a finding is reported as minor ("nothing stands out" otherwise)
# CPU: below this many model FLOPs per operator the step is per-operator overhead (see launch_overhead)
CPU_OVERHEAD_FLOPS_PER_OP = 4096


class Finding(NamedTuple):
    score: float
    title: str
    evidence: list[str]
    suggestions: list[dict[str, Optional[str]]]


@functools.cache
def _specs() -> dict:
    return field_specs()  # fixed for the process; building it is slow (type hints of every section)


def has_field(key: str) -> bool:
    return key in _specs()


def _accepts(tp: Any, value: Any) -> bool:
    """Whether a field annotated ``tp`` takes ``value`` (so a suggestion never names a wrong value)."""
    if typing.get_origin(tp) is typing.Union:
        return any(_accepts(a, value) for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is Literal:
        return value in typing.get_args(tp)
    if tp is bool or isinstance(value, bool):
        return tp is bool and isinstance(value, bool)
    return isinstance(value, tp) or (tp is float and isinstance(value, int))


def switch(key: str, value: Any, why: str, fallback: Optional[str] = None,
           also: Optional[dict[str, Any]] = None) -> dict[str, Optional[str]]:
    """A suggestion ``--key value`` (followed by the ``also`` overrides it needs to be valid); plain
    advice (``fallback``, else ``why``) where this version of the config lacks a field or a value does
    not fit it."""
    words = []
    for k, val in {key: value, **(also or {})}.items():
        spec = _specs().get(k)
        if spec is None or not _accepts(spec[0], val):
            return advice(fallback or why)
        words.append(f"--{k} {str(val).lower() if isinstance(val, bool) else val}")
    return {"switch": " ".join(words), "why": why}


def advice(why: str, switch_text: Optional[str] = None) -> dict[str, Optional[str]]:
    return {"switch": switch_text, "why": why}


def pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def cfg(f: dict, key: str, default: Any = None) -> Any:
    return f.get("config", {}).get(key, default)


def _clamp(x: float, lo: float = 0.0, hi: float = 0.95) -> float:
    return max(lo, min(hi, x))


# ----------------------------------------------------------------------------------------------
# Speed


def data_bound(f: dict) -> Optional[Finding]:
    share = f.get("data_share")
    if share is None or share < 0.15:
        return None
    workers = cfg(f, "data.num_workers", 0)
    ev = [f"the step waits {f['data_ms']:.1f} ms of {f['step_ms']:.1f} ms for the next batch ({pct(share)})",
          f"data.num_workers = {workers}"]
    work = cfg(f, "data.cpu_work_ms", 0.0) or 0.0
    batch = cfg(f, "train.batch_size", 1) * cfg(f, "train.grad_accum_steps", 1)
    if work > 0:
        ev.append(f"data.cpu_work_ms = {work:g}: {work * batch:.0f} ms of per-sample CPU work per step")
    sug = []
    if workers == 0:
        sug.append(switch("data.num_workers", 4, "load batches in 4 worker processes, in parallel with the step"))
    else:
        sug.append(switch("data.num_workers", 2 * workers, "more worker processes"))
        sug.append(switch("data.prefetch_factor", 4, "keep more batches ready per worker"))
        if not cfg(f, "data.persistent_workers", True):
            sug.append(switch("data.persistent_workers", True, "do not restart workers every epoch/eval"))
    if f.get("device") == "cuda":
        if not cfg(f, "data.pin_memory", False):
            sug.append(switch("data.pin_memory", True, "page-locked batches: faster, asynchronous copies"))
        if not cfg(f, "data.non_blocking", False):
            sug.append(switch("data.non_blocking", True, "overlap the copy with compute (needs pinned memory)"))
    if work > 0:
        sug.append(advice("make the per-sample CPU work cheaper or do it once offline (e.g. at prepare time)"))
    return Finding(_clamp(0.9 * share), "data-bound: the training step waits for the DataLoader", ev, sug)


def copy_bound(f: dict) -> Optional[Finding]:
    share = f.get("h2d_share")
    if f.get("device") != "cuda" or share is None or share < 0.08:
        return None
    sug = []
    if not cfg(f, "data.pin_memory", False):
        sug.append(switch("data.pin_memory", True, "page-locked batches copy faster and asynchronously"))
    if not cfg(f, "data.non_blocking", False):
        sug.append(switch("data.non_blocking", True, "overlap the host-to-device copy with compute"))
    sug.append(advice("send smaller token ids (uint16/int32) and widen them on the device"))
    ev = [f"host-to-device copies take {f['h2d_ms']:.1f} ms of {f['step_ms']:.1f} ms per step ({pct(share)})"]
    return Finding(_clamp(0.7 * share), "copy-bound: host-to-device transfers stall the step", ev, sug)


def host_sync(f: dict) -> Optional[Finding]:
    per_step = f.get("syncs_per_step")
    every = cfg(f, "log.every_steps", 10)
    if per_step is None:
        if every != 1:
            return None
        per_step = 1.0  # the trainer reads the losses back at every log step
    if per_step < 1.0:
        return None
    sources = f.get("sync_sources") or []
    ev = [f"{per_step:.1f} host-device synchronisations per step"]
    for s in sources[:3]:
        where = s.get("python") or s.get("parent") or ""
        ev.append(f"{s.get('op') or s.get('call')} in phase '{s.get('region')}' ({where}): {s['per_step']:.2f}/step")
    sug = []
    if every < 10:
        ev.append(f"log.every_steps = {every}: the trainer synchronises and reads the loss back at every log step")
        sug.append(switch("log.every_steps", 50, "synchronise (and log) every 50 steps instead"))
    if any(s.get("region") == "h2d" for s in sources):
        if not cfg(f, "data.pin_memory", False):
            sug.append(switch("data.pin_memory", True, "a copy from pageable memory blocks the host"))
        if not cfg(f, "data.non_blocking", False):
            sug.append(switch("data.non_blocking", True, "asynchronous host-to-device copies (with pinned memory)"))
    if any(s.get("region") in ("forward", "backward", "optimizer") for s in sources):
        sug.append(advice("avoid .item()/.tolist()/print(tensor) and nonzero()/boolean-mask indexing inside the "
                          "step: keep values on the device (torch.where, masked arithmetic) and read them rarely"))
    cost = f.get("sync_share") or 0.0  # host time in the syncs and the logging around them
    if f.get("sync_ms"):
        ev.insert(1, f"the syncs and the logging around them take {f['sync_ms']:.1f} ms of {f['step_ms']:.1f} ms "
                     f"per step ({pct(cost)})")
    if f.get("device_idle_share") is not None:  # CUDA: the syncs also leave the device idle
        score = 0.9 * max(_idle_not_data(f), cost)
    else:  # no device timeline: the time they cost, and at least what the count says an accelerator loses
        score = max(sync_count_score(per_step), 0.9 * cost)
    return Finding(_clamp(score, hi=0.6), "host-sync-bound: the host waits for the device every step", ev, sug)


def sync_count_score(per_step: float) -> float:
    """The least a sync rule finding scores for ``per_step`` syncs per step (>= 1) where their cost
    cannot be measured (CPU: nothing waits): each drains an accelerator's queue of launched work."""
    return min(0.3, 0.1 + 0.05 * per_step)


def _idle_not_data(f: dict) -> float:
    """Device idle share not explained by the host waiting for (or copying) data."""
    idle = f.get("device_idle_share")
    if idle is None:
        idle = 1.0 - (f.get("device_busy_fraction") or 1.0)
    return max(0.0, idle - (f.get("data_share") or 0.0) - (f.get("h2d_share") or 0.0))


def launch_overhead(f: dict) -> Optional[Finding]:
    tokens = f.get("tokens_per_step")
    batch = cfg(f, "train.batch_size", 1)
    if f.get("device") == "cuda" and f.get("device_busy_fraction") is not None:
        # device idle while the host logs after a sync is the sync rule's business
        idle = max(0.0, _idle_not_data(f) - (f.get("logging_share") or 0.0))
        small = (f.get("mean_kernel_us") or 0.0) < 50.0
        if idle < 0.3 or not small:
            return None
        ev = [f"the GPU is idle {pct(idle)} of the step while the host is not waiting for data",
              f"{f.get('kernels_per_step', 0):.0f} kernels per step, mean {f.get('mean_kernel_us', 0):.1f} us: "
              "the host cannot launch them fast enough"]
        if tokens is not None:
            ev.append(f"{tokens:,} tokens per step")
        score = 0.8 * idle
    else:
        # No device timeline: the evidence is the work per operator (model FLOPs per step / operators per
        # step, from the profile). It scales with tokens per step and the model's width and does not
        # depend on the thread count, the profiler's overhead or other load on the host.
        per_op, compute = f.get("flops_per_op"), f.get("compute_share")
        if per_op is None or per_op >= CPU_OVERHEAD_FLOPS_PER_OP or compute is None or compute < 0.3:
            return None
        ev = [f"{f.get('host_ops_per_step', 0):,.0f} operators per step for {tokens or 0:,} tokens: "
              f"{per_op:,.0f} model FLOPs per operator on average (< {CPU_OVERHEAD_FLOPS_PER_OP:,}), nanoseconds "
              "of math behind microseconds of dispatch each"]
        if f.get("host_mean_op_us") is not None:
            ev.append(f"mean operator self time {f['host_mean_op_us']:.1f} us: framework overhead, not math")
        ev.append(f"forward, backward, optimizer and the loop between them take {pct(compute)} of the step; "
                  "at this size they hardly grow with the batch")
        score = 0.75 * compute
    sug = [switch("train.batch_size", 4 * batch, "4x the work per launch and per optimizer step (if memory allows)")]
    if not cfg(f, "compile.enabled", False):
        sug.append(switch("compile.enabled", True, "fuse small operators into fewer kernels"))
    if f.get("device") == "cuda" and cfg(f, "compile.mode", "default") != "reduce-overhead":
        sug.append(switch("compile.mode", "reduce-overhead", "CUDA graphs: one launch for the whole step "
                          "(with --compile.enabled true)"))
    if cfg(f, "optim.impl", "foreach") != "fused":
        sug.append(switch("optim.impl", "fused", "one fused optimizer kernel instead of many small ones"))
    if not cfg(f, "memory.optimizer_in_backward", False):  # that steps in backward: no accumulation
        sug.append(switch("train.grad_accum_steps", 4 * cfg(f, "train.grad_accum_steps", 1),
                          "amortise the optimizer step over more micro-batches when a larger batch does not fit"))
    return Finding(_clamp(score), "launch/overhead-bound: per-operator and per-step overhead dominate", ev, sug)


TENSOR_CORE_GPUS = ("A100", "A10", "A30", "A40", "A6000", "L4", "L40", "H100", "H200", "GH200", "B200", "RTX 30",
                    "RTX 40", "RTX 50", "3090", "4090", "5090")


def fp32_math(f: dict) -> Optional[Finding]:
    if f.get("device") != "cuda" or cfg(f, "train.precision", "fp32") != "fp32" or cfg(f, "train.tf32", False):
        return None
    cap = f.get("gpu_capability")
    name = (f.get("gpu_name") or "").upper()
    if not ((cap and cap[0] >= 8) or any(g in name for g in TENSOR_CORE_GPUS)):
        return None
    gemm = f.get("gemm_share")
    ev = [f"train.precision = fp32 with train.tf32 = false on {f.get('gpu_name') or 'a tensor-core GPU'}"]
    if gemm is not None:
        ev.append(f"matmul kernels take {pct(gemm)} of device time, on the slow non-tensor-core fp32 path")
    if f.get("mfu") is not None:
        ev.append(f"MFU {pct(f['mfu'])}")
    score = 0.5 * gemm if gemm is not None else 0.35
    sug = [switch("train.precision", "bf16-autocast", "bf16 tensor cores, half-size activations"),
           switch("train.tf32", True, "TF32 tensor cores for fp32 matmuls (about 2x on A100 in the README ladder)")]
    return Finding(_clamp(score), "fp32 math on a tensor-core GPU", ev, sug)


def attention(f: dict) -> Optional[Finding]:
    kind = cfg(f, "model.attention", "sdpa")
    backend = cfg(f, "model.sdpa_backend", "auto")
    if kind != "manual" and backend != "math":
        return None
    # the larger of the measured attention regions' share (forward; they include the projections, which
    # roughly offsets the backward they miss) and twice the FLOP share (the T x T matrix costs traffic)
    share = max(f.get("attn_share") or 0.0, 2.0 * (f.get("attention_flop_share") or 0.0))
    what = "model.attention = manual" if kind == "manual" else "model.sdpa_backend = math"
    ev = [f"{what}: the T x T attention matrix is materialised (memory traffic and memory)"]
    if f.get("attn_share") is not None:
        ev.append(f"attention regions take {pct(f['attn_share'])} of the step (forward only)")
    elif f.get("attention_flop_share"):
        ev.append(f"attention is {pct(f['attention_flop_share'])} of the model FLOPs at block_size "
                  f"{cfg(f, 'model.block_size')}")
    sug = [switch("model.attention", "sdpa", "scaled_dot_product_attention: flash / memory-efficient kernels")
           if kind == "manual" else switch("model.sdpa_backend", "auto", "let PyTorch pick a fused kernel")]
    if f.get("device") == "cuda" and cfg(f, "train.precision", "fp32") == "fp32":
        sug.append(switch("train.precision", "bf16-autocast", "flash attention needs bf16/fp16"))
    return Finding(_clamp(share, lo=0.08, hi=0.6), "attention not on a fused kernel", ev, sug)


# ----------------------------------------------------------------------------------------------
# Memory


def _memory_weight(f: dict) -> float:
    """How much memory matters: the fraction of the GPU in use, at least 0.3; 0.2 on CPU, where the
    profiler sees only part of the memory and host RAM is rarely the limit."""
    total, peak = f.get("device_total_mb"), f.get("peak_reserved_mb") or f.get("peak_mb")
    if f.get("device") != "cuda":
        return 0.2
    return _clamp(peak / total, 0.3, 1.0) if total and peak else 0.3


def _split_batch(f: dict, why: str) -> dict:
    """Half the micro-batch, twice the accumulation: only where that keeps the global batch and the
    config stays valid (no step in backward; the pipeline's micro-batches still divide the batch)."""
    b, a = cfg(f, "train.batch_size", 1), cfg(f, "train.grad_accum_steps", 1)
    pp_micro = (cfg(f, "parallel.pp_microbatches", 0) or cfg(f, "parallel.pp", 1)) if cfg(f, "parallel.pp", 1) > 1 else 1
    if b < 2 or b % 2 or (b // 2) % pp_micro or cfg(f, "memory.optimizer_in_backward", False):
        return advice(why)
    return advice(why, f"--train.batch_size {b // 2} --train.grad_accum_steps {2 * a}")


def logits_peak(f: dict) -> Optional[Finding]:
    vocab, peak = f.get("vocab_sized_mb"), f.get("memory_total_mb")
    region = f.get("peak_region", "")
    op = (f.get("peak_op") or "").lower()
    at_loss = any(w in op for w in ("cross_entropy", "log_softmax", "nll_loss", "lm_head"))
    if not peak or vocab is None or vocab / peak < 0.3:
        return None
    share = vocab / peak
    ev = [f"blocks of vocabulary size (logits, fp32 copy, log-softmax, gradients) hold {vocab:.0f} MB of the "
          f"{peak:.0f} MB peak ({pct(share)})", f"the peak happens in {region or 'the step'}"
          + (f" at {f.get('peak_op')}" if at_loss or f.get("peak_op") else "")]
    generic = ("compute the loss in chunks of the sequence, or with a fused linear + cross-entropy kernel, so "
               "the B x T x vocab fp32 logits never exist at once (no such switch in this version's config)")
    if cfg(f, "model.loss_impl", "full") != "chunked":
        sug = [switch("model.loss_impl", "chunked", "output head + cross-entropy a chunk of tokens at a time: "
                      "the full B x T x vocab logits never exist", generic)]
    else:
        chunk = cfg(f, "model.loss_chunk_size", 1024) or 1024
        sug = [switch("model.loss_chunk_size", max(64, chunk // 4), "smaller loss chunks", generic)]
    sug.append(_split_batch(f, "half the logits per micro-batch, same global batch"))
    return Finding(_clamp(0.5 * share * _memory_weight(f)), "memory peak at the logits / loss", ev, sug)


def activation_memory(f: dict) -> Optional[Finding]:
    act, total = f.get("activation_mb"), f.get("memory_total_mb")
    if not act or not total:
        return None
    act = max(0.0, act - (f.get("vocab_sized_mb") or 0.0))  # the logits are the logits rule's business
    share = act / total
    if share < 0.5:
        return None
    ev = [f"activations and temporaries of the step (logits excluded): {act:.0f} MB of the {total:.0f} MB peak "
          f"({pct(share)})"]
    sug = []
    if cfg(f, "memory.activation_checkpointing", 0) != 1:
        sug.append(switch("memory.activation_checkpointing", 1, "recompute activations in backward (~30% slower)"))
    sug.append(_split_batch(f, "half the activations, same global batch"))
    if cfg(f, "train.precision", "fp32") == "fp32":
        sug.append(switch("train.precision", "bf16-autocast", "half-size activations"))
    if cfg(f, "model.attention", "sdpa") == "manual":
        sug.append(switch("model.attention", "sdpa", "no T x T attention matrices"))
    return Finding(_clamp(0.4 * share * _memory_weight(f)), "activation-dominated memory", ev, sug)


def optimizer_state_memory(f: dict) -> Optional[Finding]:
    state, total = f.get("optimizer_state_mb"), f.get("memory_total_mb")
    if not state or not total or state / total < 0.35:
        return None
    share = state / total
    ev = [f"AdamW state (2 tensors per parameter) is about {state:.0f} MB of the {total:.0f} MB peak ({pct(share)})"]
    sug = []
    if cfg(f, "train.precision", "fp32") != "bf16":
        sug.append(switch("train.precision", "bf16", "pure bf16 halves weights, gradients and optimizer state"))
    # memory.optimizer_8bit / _offload / _in_backward exclude each other: offered only when none is on
    alternative = not any(cfg(f, f"memory.{k}", False) for k in ("optimizer_8bit", "optimizer_offload",
                                                                     "optimizer_in_backward"))
    fp16 = cfg(f, "train.precision", "fp32") == "fp16-autocast"
    model_parallel = cfg(f, "parallel.tp", 1) > 1 or cfg(f, "parallel.pp", 1) > 1
    if alternative and not model_parallel:
        sug.append(switch("memory.optimizer_8bit", True, "8-bit AdamW state, about a quarter of fp32 state "
                          "(needs torchao)", "8-bit optimizer state (e.g. torchao's AdamW8bit)"))
    if alternative and not fp16:
        sug.append(switch("memory.optimizer_offload", True, "AdamW state and its step in CPU memory",
                          "offload the optimizer state to CPU memory"))
    if cfg(f, "memory.optimizer_offload", False) and not cfg(f, "memory.offload_gradients", False):
        sug.append(switch("memory.offload_gradients", True, "the gradients too: each leaves the device "
                          "inside backward, as soon as it is complete"))
    if cfg(f, "parallel.dp_shard", 1) == 1 and not cfg(f, "parallel.zero1", False):
        if not model_parallel:
            sug.append(switch("parallel.zero1", True, "with several GPUs: shard the optimizer state over "
                              "data-parallel ranks", "with several GPUs: shard the optimizer state (ZeRO-1 / FSDP)"))
        # only one of dp_replicate and dp_shard may be -1 (the rest of the world size)
        also = {"parallel.dp_replicate": 1} if cfg(f, "parallel.dp_replicate", -1) == -1 else {}
        sug.append(switch("parallel.dp_shard", -1, "with several GPUs: FSDP shards parameters, gradients and state",
                          also=also))
    if alternative and not fp16 and cfg(f, "train.grad_accum_steps", 1) == 1:
        # the step in backward cannot clip the global gradient norm
        also = {"optim.grad_clip": 0} if (cfg(f, "optim.grad_clip", 1.0) or 0) > 0 else {}
        sug.append(switch("memory.optimizer_in_backward", True, "step in backward: no full set of gradient buffers"
                          + (" (no gradient clipping)" if also else ""),
                          "apply the optimizer step inside backward, freeing each gradient at once", also=also))
    if cfg(f, "optim.impl", "foreach") != "for-loop":
        sug.append(switch("optim.impl", "for-loop", "smaller optimizer temporaries (the state itself stays)"))
    return Finding(_clamp(0.4 * share * _memory_weight(f)), "optimizer-state-dominated memory", ev, sug)


def allocator_thrash(f: dict) -> Optional[Finding]:
    retries = f.get("alloc_retries") or 0
    mallocs = f.get("cuda_malloc_per_step") or 0.0
    if retries <= 0 and mallocs < 1.0:
        return None
    ev = []
    if retries:
        ev.append(f"{retries} allocation retries (the allocator freed its cache and retried cudaMalloc)")
    if mallocs:
        ev.append(f"{mallocs:.1f} cudaMalloc and {f.get('cuda_free_per_step', 0):.1f} cudaFree per step in "
                  "steady state (the cache never settles: changing shapes)")
    if f.get("reserved_minus_allocated_mb") is not None:
        ev.append(f"reserved minus allocated: {f['reserved_minus_allocated_mb']:.0f} MB")
    env = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    sug = []
    if has_field("memory.expandable_segments"):
        if not cfg(f, "memory.expandable_segments", False):
            sug.append(switch("memory.expandable_segments", True, f"segments grow instead of fragmenting ({env})"))
    else:
        sug.append(advice("segments grow instead of fragmenting", env))
    sug.append(advice("keep tensor shapes fixed (pad batches to a fixed length), or warm up with the largest shape"))
    if retries:
        sug.append(_split_batch(f, "leave the allocator headroom"))
    return Finding(_clamp(0.15 + 0.05 * min(retries, 4) + 0.02 * min(mallocs, 10)), "allocator thrash", ev, sug)


RULES: list[Callable[[dict], Optional[Finding]]] = [
    data_bound, copy_bound, host_sync, launch_overhead, fp32_math, attention,
    logits_peak, activation_memory, optimizer_state_memory, allocator_thrash,
]


def attention_flop_share(n_layer: int, n_embd: int, block_size: int, params: Optional[int]) -> Optional[float]:
    """Share of ``12*L*H*Q*T`` in the per-token FLOPs ``6*N + 12*L*H*Q*T`` (H*Q = n_embd)."""
    if not params:
        return None
    att = 12.0 * n_layer * n_embd * block_size
    total = 6.0 * params + att
    return att / total if total > 0 and math.isfinite(total) else None
