"""The data-bound doctor rule and its advice for the machine the run had: DataLoader workers that fit its
cores beside the training threads, workers that take cores from them (with ``OMP_NUM_THREADS``), or "the machine
is too small for the per-sample work" (see ``docs/profile.md``, "Data workers to suggest")."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

from tokenmill.profiling.facts import Run, typed
from tokenmill.profiling.findings import Finding, _clamp, advice, pct, switch


@typed
def data_bound(run: Run) -> Optional[Finding]:
    share, d, t = run.data.data_share, run.config.data, run.config.train
    if share is None or share < 0.15:
        return None
    step, wait = run.timing.step_ms or 0.0, run.data.data_ms or 0.0
    workers = d.num_workers
    ev = [f"the step waits {wait:.1f} ms of {step:.1f} ms for the next batch ({pct(share)})",
          f"data.num_workers = {workers}"]
    work = d.cpu_work_ms
    batch = t.batch_size * t.grad_accum_steps
    if work > 0:
        ev.append(f"data.cpu_work_ms = {work:g}: {work * batch:.0f} ms of per-sample CPU work per step")
    plan = loading_plan(run)
    ev.append(plan.how)
    sug = []
    if plan.too_small:
        spare = free_core_workers(run, plan)
        if spare:  # the cores left free take workers: a switch --try can measure, however small its gain
            sug.append(spare)
        sug.append(advice(f"this machine is too small for the per-sample work: do it once offline (at prepare "
                          f"time) or make it cheaper, or train on a machine with at least {plan.cores_needed} "
                          "cores"))
    elif plan.workers > workers:
        sug.append(_workers_switch(run, plan))
    compute = step - wait
    if workers > 0 and work > 0 and workers * compute >= 1.25 * work * batch:
        # the workers keep up on average (known per-sample cost): the wait is jitter, which a deeper queue hides
        sug.append(switch("data.prefetch_factor", 4, "keep more batches ready per worker (smooths jitter; it "
                          "cannot make loading faster)"))
    if workers > 0 and not d.persistent_workers:
        sug.append(switch("data.persistent_workers", True, "do not restart workers every epoch/eval"))
    if run.device == "cuda":
        if not d.pin_memory:
            sug.append(switch("data.pin_memory", True, "page-locked batches: faster, asynchronous copies"))
        if not d.non_blocking:
            sug.append(switch("data.non_blocking", True, "overlap the copy with compute (needs pinned memory)"))
    if work > 0 and not plan.too_small:
        sug.append(advice("make the per-sample CPU work cheaper or do it once offline (e.g. at prepare time)"))
    return Finding(_clamp(0.9 * share), "data-bound: the training step waits for the DataLoader", ev, sug)


def _workers_switch(run: Run, plan: Plan) -> dict[str, Any]:
    """``--data.num_workers N``, with ``OMP_NUM_THREADS`` in the environment when the training threads must
    give up cores to the workers."""
    w, t = plan.workers, plan.threads
    why = f"{w} worker processes load batches as fast as the step uses them"
    sug = switch("data.num_workers", w, why)
    if t is not None and t < run.host.intra_op:
        sug["why"] = (f"OMP_NUM_THREADS={t} in the environment and {w} worker(s): the training threads give "
                      f"{w} core(s) to loading (predicted step {plan.predicted_ms:.1f} ms)")
        sug["env"] = {"OMP_NUM_THREADS": str(t)}
    return sug


def free_core_workers(run: Run, plan: Plan) -> Optional[dict[str, Any]]:
    """Where no split of the cores hides the wait but the run left cores free (its cores less the training
    threads and the workers it had): ``--data.num_workers`` with one worker more per free core, the number
    that fits, and the step it predicts (``max(compute, load / W)``); None when no core is free."""
    w, cores = run.config.data.num_workers, run.host.cores
    if not cores:
        return None
    free = cores - run.host.training_threads - w
    if free < 1:
        return None
    fit = w + free
    step, data = run.timing.step_ms or 0.0, run.data.data_ms or 0.0
    compute = max(step - data, 0.05 * step)
    predicted = max(compute, (data if w == 0 else w * step) / fit)
    return switch("data.num_workers", fit, f"{fit} worker(s): {'the one' if free == 1 else 'the'} free core"
                  f"{'s' if free > 1 else ''} beside the training threads load batches too (predicted step "
                  f"{predicted:.1f} ms, now {step:.1f} ms: loading still limits it; `--try` measures it)")


# a plan must predict at most this much of today's step: workers on spare cores (a worker also costs its
# batches' transfer), or workers that take cores from the training threads (compute's scaling is uncertain)
SPARE_MARGIN, WORKER_MARGIN = 0.9, 0.8


@dataclass(frozen=True)
class Plan:
    """How to hide the data wait on this machine (:func:`loading_plan`): ``need`` (workers that keep up),
    ``workers`` and ``threads`` to suggest (threads: None to keep the run's), ``too_small`` (no split of the cores
    helps), ``cores_needed`` (None: the run's cores unknown), ``predicted_ms`` and ``how`` (the reasoning, for the
    evidence)."""

    need: int
    workers: int
    threads: Optional[int]
    too_small: bool
    predicted_ms: float
    cores_needed: Optional[int]
    how: str


@typed
def loading_plan(run: Run) -> Plan:
    """How to hide the data wait on this machine (a :class:`Plan`).

    With ``W`` workers a step lasts ``max(compute, load / W)``; loading a step's batches takes ``data_ms``
    without workers, ``W x step_ms`` for ``W`` workers that cannot keep up. The workers need cores of their
    own: the run's cores (``threads.cpu_count``: the process's CPU affinity) less the training threads
    (intra-op threads x local processes). When that leaves too few, the plan gives ``k`` cores to workers and
    ``cores - k`` to training (compute assumed to slow in proportion to its threads: conservative), and takes
    it only when the predicted step is at most :data:`WORKER_MARGIN` of today's (a worker also costs its
    batches' transfer); else the machine is too small for the per-sample work."""
    w, step, data = run.config.data.num_workers, run.timing.step_ms or 0.0, run.data.data_ms or 0.0
    compute = max(step - data, 0.05 * step)
    load = data if w == 0 else w * step
    need = max(w + 1, math.ceil(1.25 * load / compute))  # 25% headroom
    how = (f"loading a step's batches takes about {load:.1f} ms of CPU "
           + ("(the wait itself, loading in the training process)" if w == 0 else f"({w} worker(s) x {step:.1f} ms)")
           + f", the rest of the step {compute:.1f} ms: {need} workers keep up (with 25% headroom)")
    h = run.host
    cores = h.cores  # less the other work on the machine when the run started (where recorded)
    train_threads = h.training_threads
    plan = Plan(need=need, workers=need, threads=None, too_small=False, predicted_ms=compute,
                cores_needed=train_threads + need if cores else None, how=how)
    if not cores:
        return plan
    if need <= cores - train_threads:
        return dataclasses.replace(plan, how=how + f"; the run had {cores} cores, {train_threads} for training: "
                                   "they fit")
    splits = core_splits(cores, h.intra_op, h.local_world_size, compute, load)
    how += f"; the run had {cores} cores and {train_threads} training thread(s)"
    fit = [x for x in splits if x[0] <= (SPARE_MARGIN if x[3] else WORKER_MARGIN) * step]
    if fit:
        best, k, t, _ = min(fit)
        return dataclasses.replace(plan, workers=k, threads=t, predicted_ms=best, how=how + f": {k} worker(s) and "
                                   f"{t} training thread(s) per process predict {best:.1f} ms per step (now "
                                   f"{step:.1f} ms); loading will still limit the step, make it cheaper")
    best = min(splits)[0] if splits else math.inf
    return dataclasses.replace(
        plan, too_small=True, workers=w, predicted_ms=step, how=how + f": no split of them between training and "
        f"loading predicts a step under {pct(SPARE_MARGIN)} of today's ("
        f"{'best ' + format(best, '.1f') + ' ms' if splits else 'one core'}): the machine is too small for the "
        f"per-sample work (it needs about {plan.cores_needed} cores)")


def core_splits(cores: int, intra: int, procs: int, compute: float, load: float) -> list[tuple[float, int, int, bool]]:
    """Every split of the cores between ``k`` workers and the training threads left beside them (at most the
    run's ``intra`` per process): ``(predicted step ms, k, threads, whether training kept all its threads)``,
    the step being ``max(compute x intra / threads, load / k)``."""
    out = []
    for k in range(1, cores):
        t = min(intra, (cores - k) // procs)
        if t >= 1:
            out.append((max(compute * intra / t, load / k), k, t, t == intra))
    return out


@typed
def workers_needed(run: Run) -> tuple[int, str]:
    """DataLoader workers to suggest and how it was computed (:func:`loading_plan`)."""
    plan = loading_plan(run)
    return plan.workers, plan.how
