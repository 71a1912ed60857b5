"""Doctor rules about memory: the logits peak, stored activations, optimizer state, allocator churn.

Each takes the typed run (:class:`~tokenmill.profiling.facts.Run`) and scores its share of the memory peak
weighted by how full the device is (see :mod:`rules`). The switches come from the one list
(:mod:`tokenmill.config.memory_switches`), read on the run's typed config."""

from __future__ import annotations

from typing import Optional

from tokenmill.config.memory_switches import getter, memory_switches
from tokenmill.profiling.facts import Run, typed
from tokenmill.profiling.findings import Finding, _clamp, advice, pct, switch


def _memory_weight(run: Run) -> float:
    """How much memory matters: the fraction of the GPU in use, at least 0.3; 0.2 on CPU, where the
    profiler sees only part of the memory and host RAM is rarely the limit."""
    if run.device != "cuda":
        return 0.2
    fill = run.memory_fill()
    return _clamp(fill, 0.3, 1.0) if fill else 0.3


def _split_batch(run: Run, why: str) -> dict:
    """Half the micro-batch, twice the accumulation, as the one list offers it (only where that keeps the global
    batch and the config stays valid); plain advice where it does not."""
    from tokenmill.config.memory_switches import flags

    halves = [s for s in memory_switches(getter(run.config)) if "train.batch_size" in s.overrides]
    return advice(why, flags(halves[0])) if halves else advice(why)


def _from_list(run: Run, parts: set[str]) -> list[dict]:
    """The switches of the one list that shrink ``parts`` of the peak and that this run does not use yet, as
    suggestions."""
    out = []
    for s in memory_switches(getter(run.config)):
        if s.saves & parts:
            (key, value), *rest = s.overrides.items()
            out.append(switch(key, value, s.why, also=dict(rest)))
    return out


@typed
def logits_peak(run: Run) -> Optional[Finding]:
    m = run.memory
    vocab, peak = m.vocab_sized_mb, m.memory_total_mb
    op = m.peak_op.lower()
    at_loss = any(w in op for w in ("cross_entropy", "log_softmax", "nll_loss", "lm_head"))
    if not peak or vocab is None or vocab / peak < 0.3:
        return None
    share = vocab / peak
    ev = [f"blocks of vocabulary size (logits, fp32 copy, log-softmax, gradients) hold {vocab:.0f} MB of the "
          f"{peak:.0f} MB peak ({pct(share)})", f"the peak happens in {m.peak_region or 'the step'}"
          + (f" at {m.peak_op}" if at_loss or m.peak_op else "")]
    model = run.config.model
    if model.loss_impl != "chunked":
        sug = [switch("model.loss_impl", "chunked", "output head + cross-entropy a chunk of tokens at a time: "
                      "the full B x T x vocab logits never exist")]
    else:
        sug = [switch("model.loss_chunk_size", max(64, model.loss_chunk_size // 4), "smaller loss chunks")]
    sug.append(_split_batch(run, "half the logits per micro-batch, same global batch"))
    return Finding(_clamp(0.5 * share * _memory_weight(run)), "memory peak at the logits / loss", ev, sug,
                   measure="memory")


@typed
def activation_memory(run: Run) -> Optional[Finding]:
    act, total = run.memory.activation_mb, run.memory.memory_total_mb
    if not act or not total:
        return None
    act = max(0.0, act - (run.memory.vocab_sized_mb or 0.0))  # the logits are the logits rule's business
    share = act / total
    if share < 0.5:
        return None
    ev = [f"activations and temporaries of the step (logits excluded): {act:.0f} MB of the {total:.0f} MB peak "
          f"({pct(share)})"]
    sug = _from_list(run, {"activations"})
    return Finding(_clamp(0.4 * share * _memory_weight(run)), "activation-dominated memory", ev, sug,
                   measure="memory")


@typed
def optimizer_state_memory(run: Run) -> Optional[Finding]:
    state, total = run.memory.optimizer_state_mb, run.memory.memory_total_mb
    if not state or not total or state / total < 0.35:
        return None
    share = state / total
    ev = [f"AdamW state (2 tensors per parameter) is about {state:.0f} MB of the {total:.0f} MB peak ({pct(share)})"]
    sug = _from_list(run, {"optimizer", "gradients", "weights"})
    return Finding(_clamp(0.4 * share * _memory_weight(run)), "optimizer-state-dominated memory", ev, sug,
                   measure="memory")


@typed
def allocator_thrash(run: Run) -> Optional[Finding]:
    m = run.memory
    retries, mallocs = int(m.alloc_retries or 0), m.cuda_malloc_per_step or 0.0
    if retries <= 0 and mallocs < 1.0:
        return None
    ev = []
    if retries:
        ev.append(f"{retries} allocation retries (the allocator freed its cache and retried cudaMalloc)")
    if mallocs:
        ev.append(f"{mallocs:.1f} cudaMalloc and {m.cuda_free_per_step or 0:.1f} cudaFree per step in "
                  "steady state (the cache never settles: changing shapes)")
    if m.reserved_minus_allocated_mb is not None:
        ev.append(f"reserved minus allocated: {m.reserved_minus_allocated_mb:.0f} MB")
    sug = []
    if not run.config.memory.expandable_segments:
        sug.append(switch("memory.expandable_segments", True, "segments grow instead of fragmenting "
                          "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)"))
    sug.append(advice("keep tensor shapes fixed (pad batches to a fixed length), or warm up with the largest shape"))
    if retries:
        sug.append(_split_batch(run, "leave the allocator headroom"))
    return Finding(_clamp(0.15 + 0.05 * min(retries, 4) + 0.02 * min(mallocs, 10)), "allocator thrash", ev, sug)
