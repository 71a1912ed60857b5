"""Doctor rules about memory: the logits peak, stored activations, optimizer state, allocator churn.

Each scores its share of the memory peak weighted by how full the device is (see :mod:`rules`)."""

from __future__ import annotations

from typing import Optional

from tokenmill.profiling.findings import (
    Finding,
    _clamp,
    advice,
    cfg,
    pct,
    switch,
)


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
    b, a = cfg(f, "train.batch_size"), cfg(f, "train.grad_accum_steps")
    pp_micro = (cfg(f, "parallel.pp_microbatches") or cfg(f, "parallel.pp")) if cfg(f, "parallel.pp") > 1 else 1
    if b < 2 or b % 2 or (b // 2) % pp_micro or cfg(f, "memory.optimizer_in_backward"):
        return advice(why)
    return advice(why, f"--train.batch_size {b // 2} --train.grad_accum_steps {2 * a}")


def _from_list(f: dict, parts: set[str]) -> list[dict]:
    """The switches of the one list (:mod:`tokenmill.config.memory_switches`) that shrink ``parts`` of the
    peak and that this run does not use yet, as suggestions."""
    from tokenmill.config.memory_switches import memory_switches

    out = []
    for s in memory_switches(lambda key: cfg(f, key)):
        if s.saves & parts:
            (key, value), *rest = s.overrides.items()
            out.append(switch(key, value, s.why, also=dict(rest)))
    return out


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
    if cfg(f, "model.loss_impl") != "chunked":
        sug = [switch("model.loss_impl", "chunked", "output head + cross-entropy a chunk of tokens at a time: "
                      "the full B x T x vocab logits never exist")]
    else:
        sug = [switch("model.loss_chunk_size", max(64, cfg(f, "model.loss_chunk_size") // 4), "smaller loss chunks")]
    sug.append(_split_batch(f, "half the logits per micro-batch, same global batch"))
    return Finding(_clamp(0.5 * share * _memory_weight(f)), "memory peak at the logits / loss", ev, sug, measure="memory")


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
    sug = _from_list(f, {"activations"})
    return Finding(_clamp(0.4 * share * _memory_weight(f)), "activation-dominated memory", ev, sug, measure="memory")


def optimizer_state_memory(f: dict) -> Optional[Finding]:
    state, total = f.get("optimizer_state_mb"), f.get("memory_total_mb")
    if not state or not total or state / total < 0.35:
        return None
    share = state / total
    ev = [f"AdamW state (2 tensors per parameter) is about {state:.0f} MB of the {total:.0f} MB peak ({pct(share)})"]
    sug = _from_list(f, {"optimizer", "gradients", "weights"})
    return Finding(_clamp(0.4 * share * _memory_weight(f)), "optimizer-state-dominated memory", ev, sug, measure="memory")


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
    sug = []
    if not cfg(f, "memory.expandable_segments"):
        sug.append(switch("memory.expandable_segments", True, "segments grow instead of fragmenting "
                          "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)"))
    sug.append(advice("keep tensor shapes fixed (pad batches to a fixed length), or warm up with the largest shape"))
    if retries:
        sug.append(_split_batch(f, "leave the allocator headroom"))
    return Finding(_clamp(0.15 + 0.05 * min(retries, 4) + 0.02 * min(mallocs, 10)), "allocator thrash", ev, sug)
