"""Doctor rules for mixtures of experts (``model.moe_experts`` > 0): routing imbalance, the all-to-all's share of
the step under expert parallelism, and expert matmuls too small for the GPU.

Facts (:func:`moe_facts`, put among the doctor's facts by ``gather_facts`` and typed once as ``run.moe``, a
:class:`~tokenmill.profiling.facts.Moe`): ``moe_load_max``, the median over the run's steady log rows of the worst
sparse layer's load (the trainer logs ``moe_load_<i>``: layer i's busiest expert's routed slots over the mean,
:func:`tokenmill.model.moe.router_stats`), ``moe_load_layer`` (the layer with the highest median load),
and ``moe_a2a_share`` (the all-to-all's share of the profile's top operators); the run's processes are
``run.world_size``.

Thresholds:

- :data:`IMBALANCE` = 1.5: the busiest expert gets half as many tokens again as the mean. Under expert
  parallelism the rank holding it computes that much more while the others wait at the combine all-to-all, so
  the experts' time stretches by the load; on one process the total work is the same but the router is
  concentrating tokens on a few experts (the others train on little data), which the load-balancing loss exists
  to prevent. At 1.5 a third of the busiest rank's expert time is waiting for it.
- :data:`A2A_SHARE` = 0.15 of the step in all-to-all: from the profile where its collectives appear among the top
  operators, else from ``tokenmill estimate`` of the run's config (:mod:`tokenmill.estimate.moe`).
- :data:`SMALL_LOSS` = 0.3: the estimator's own pricing of the grouped matmuls at their real shapes (tokens per
  expert = tokens x top_k x ep / experts under balanced routing; :mod:`tokenmill.estimate.roofline`'s tile and wave
  quantization) loses at least 30% of their time against one product of the same FLOPs, so the threshold in
  tokens per expert follows the GPU and the expert's width rather than a fixed number; the score is that loss
  times the routed experts' share of the model's FLOPs.

``--try`` runs one process: a suggestion is a switch only where the run was one process; for a run of several
processes (expert parallelism needs them) the flags are given as advice.
"""

from __future__ import annotations

import statistics
from typing import Any, Optional

from tokenmill.profiling.facts import Run, typed
from tokenmill.profiling.findings import MIN_SCORE, Finding, _clamp, advice, pct, switch

IMBALANCE = 1.5
A2A_SHARE = 0.15
A2A_NAMES = ("all_to_all", "alltoall")
AUX_COEF_MAX = 0.1
SMALL_LOSS = 0.3


def moe_facts(rows: list[dict[str, Any]], profile: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The routing figures of a run's steady log rows (none for a dense model, or a run of an older version) and
    the all-to-all's share of the profile's top operators where they show it."""
    a2a = [o["share"] for o in (profile or {}).get("top_ops") or []
           if any(n in str(o.get("name", "")).lower() for n in A2A_NAMES)]
    loads = [r["moe_load_max"] for r in rows if isinstance(r.get("moe_load_max"), (int, float))]
    if not loads:
        return {}
    layers: dict[int, list[float]] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("moe_load_") and k[9:].isdigit() and isinstance(v, (int, float)):
                layers.setdefault(int(k[9:]), []).append(float(v))
    worst = max(layers, key=lambda i: statistics.median(layers[i])) if layers else None
    out: dict[str, Any] = {"moe_load_max": statistics.median(loads), "moe_load_layer": worst}
    if a2a:
        out["moe_a2a_share"] = sum(a2a)
    return out


def _one_process(run: Run) -> bool:
    return run.world_size == 1 and run.config.parallel.ep == 1


def _flag(run: Run, key: str, value: Any, why: str) -> dict[str, Any]:
    """A switch ``--try`` can run where the run was one process; else the same flag as advice."""
    if _one_process(run):
        return switch(key, value, why)
    return advice(f"--{key} {value}: {why} (a run of several processes: --try runs one, so try it yourself)")


def expert_flop_share(run: Run) -> Optional[float]:
    """The routed experts' share of the model's FLOPs per token (6 x top_k experts' weights per sparse layer over
    ``summary.json``'s flops_per_token)."""
    m, fpt = run.config.model, run.work.flops_per_token
    if not m.moe_experts or not fpt:
        return None
    return min(1.0, 6.0 * len(m.sparse_layers()) * m.moe_top_k * 3 * m.expert_width * m.n_embd / fpt)


@typed
def routing_imbalance(run: Run) -> Optional[Finding]:
    """The busiest expert's load at least :data:`IMBALANCE` x the mean: raise the load-balancing loss, or turn on
    the auxiliary-loss-free routing bias (``model.moe_bias_update_rate``)."""
    m = run.config.model
    load = run.moe.load_max
    if not m.moe_experts or load is None or load < IMBALANCE:
        return None
    ep, coef = run.config.parallel.ep, m.moe_aux_loss_coef
    layer = run.moe.load_layer
    ev = [f"the busiest expert gets {load:.2f}x the mean routed tokens (metrics.jsonl moe_load_max, the median over "
          f"the steady log rows" + (f"; layer {layer} the worst" if layer is not None else "") + "): 1.0 is "
          f"balanced, {m.moe_experts / m.moe_top_k:.0f} every token on the same {m.moe_top_k} experts",
          f"model.moe_aux_loss_coef = {coef:g}: the load-balancing loss " + ("is off" if not coef else "is weak")]
    share = expert_flop_share(run) or 0.0
    if ep > 1:
        ev.append(f"with expert parallelism (parallel.ep = {ep}) the rank holding the busiest experts computes "
                  f"{load:.2f}x the mean while the others wait at the combine")
        score = _clamp(share * (1 - 1 / load))
    else:
        ev.append("on one expert group the work is the same, but few experts get most of the tokens (the others "
                  "learn from little data)")
        score = MIN_SCORE
    new = min(AUX_COEF_MAX, coef * 10) if coef else 0.01
    sug = []
    if new > coef:
        sug.append(_flag(run, "model.moe_aux_loss_coef", round(new, 6), "a stronger load-balancing loss spreads the "
                         "tokens over the experts (it changes the training objective: a fine-tune usually keeps "
                         "the model's own router_aux_loss_coef)"))
    if not m.moe_bias_update_rate:
        sug.append(_flag(run, "model.moe_bias_update_rate", 0.001, "DeepSeek-V3's auxiliary-loss-free balancing: a "
                         "per-expert routing bias, moved after every step against each expert's excess load, spreads "
                         "the tokens without a loss term (the weights keep the unbiased scores)"))
    else:
        ev.append(f"model.moe_bias_update_rate = {m.moe_bias_update_rate:g}: the routing bias is on (a larger rate "
                  "moves it faster)")
    sug.append(advice("early in training routing is often unbalanced: check that the load falls over the run "
                      "(metrics.jsonl moe_load_<layer>)"))
    return Finding(max(score, MIN_SCORE), "unbalanced expert routing", ev, sug)


def _estimate(run: Run):
    """``tokenmill estimate`` of the run's config on its GPU and processes (None where it does not work out)."""
    import dataclasses

    from tokenmill.errors import TokenmillError
    from tokenmill.estimate import GPUS, estimate, gpu_spec

    if run.device != "cuda":
        return None
    try:
        try:
            g = gpu_spec(run.gpu_name)
        except TokenmillError:
            g = GPUS["h100-sxm"]
        if run.memory.device_total_mb:
            g = dataclasses.replace(g, memory_mb=run.memory.device_total_mb)
        return estimate(run.config, g, run.world_size)
    except (TokenmillError, ValueError, KeyError, TypeError, RuntimeError):
        return None


@typed
def all_to_all_share(run: Run) -> Optional[Finding]:
    """Expert parallelism's all-to-all at least :data:`A2A_SHARE` of the step: fewer EP ranks or more tokens per
    all-to-all."""
    ep = run.config.parallel.ep
    if ep == 1 or not run.config.model.moe_experts:
        return None
    share, source = run.moe.a2a_share, "the profile's top operators"
    if share is None:
        est = _estimate(run)
        if est is None or "all_to_all_ms" not in est.time_breakdown_ms:
            return None
        share, source = est.time_breakdown_ms["all_to_all_ms"] / est.step_ms, "tokenmill estimate of this config"
    if share < A2A_SHARE:
        return None
    t = run.config.train
    ev = [f"the all-to-all (dispatch and combine of every sparse layer, forward and backward) takes {pct(share)} of "
          f"the step ({source}): the experts wait for their tokens",
          f"parallel.ep = {ep}: {(ep - 1) / ep:.0%} of every token's routed copies leave the rank and come back"]
    sug = []
    if ep > 2:
        sug.append(advice(f"--parallel.ep {ep // 2}: half the ranks per expert group keep more tokens local and "
                          "take shorter hops (each rank holds twice the experts: check the memory with tokenmill "
                          "estimate)"))
    sug.append(advice(f"--train.batch_size {2 * t.batch_size}: more tokens per all-to-all and per expert matmul; "
                      "the all-to-all's fixed cost is paid over more work (where memory allows; lower "
                      "train.grad_accum_steps to keep the global batch)"))
    return Finding(_clamp(share), "the all-to-all takes a large share of the step", ev, sug)


def group_loss(run: Run, rows: float, gpu) -> float:
    """The share of the grouped expert matmuls' time (``rows`` tokens per expert, the rank's local experts) that the
    estimator's pricing loses against one product of the same FLOPs (:mod:`tokenmill.estimate.moe`)."""
    from tokenmill.estimate.moe import _seconds, expert_matmuls

    m, ep = run.config.model, run.config.parallel.ep
    C_, I_, local = m.n_embd, m.expert_width, m.moe_experts // ep
    real = _seconds(expert_matmuls(local, max(rows, 1), C_, I_, "bf16", True, False), run.config, gpu)
    big = _seconds(expert_matmuls(1, max(rows, 1) * local, C_, I_, "bf16", True, False), run.config, gpu)
    return 1 - big / real if real > 0 else 0.0


@typed
def small_expert_matmuls(run: Run) -> Optional[Finding]:
    """Tokens per expert so few (CUDA) that the estimator prices the grouped matmuls at least :data:`SMALL_LOSS`
    slower than one product of the same FLOPs: the experts' products are too thin for the GPU."""
    from tokenmill.errors import TokenmillError
    from tokenmill.estimate.gpus import GPUS, gpu_spec
    from tokenmill.estimate.moe import tokens_per_expert

    m, t, ep = run.config.model, run.config.train, run.config.parallel.ep
    if not m.moe_experts or run.device != "cuda":
        return None
    try:
        gpu = gpu_spec(run.gpu_name)
    except TokenmillError:
        gpu = GPUS["h100-sxm"]
    rows = tokens_per_expert(t.batch_size * m.block_size, m.moe_top_k, m.moe_experts, ep)
    lost = group_loss(run, rows, gpu)
    if lost < SMALL_LOSS:
        return None
    f = next((f for f in (2, 4, 8) if group_loss(run, rows * f, gpu) < SMALL_LOSS), 8)
    share = expert_flop_share(run) or 0.0
    ev = [f"{rows:,.0f} tokens per expert in a micro-batch ({t.batch_size} x {m.block_size} tokens x top-"
          f"{m.moe_top_k} over {m.moe_experts} experts" + (f", x{ep} from the expert-parallel ranks" if ep > 1 else "")
          + f"): each expert's product is thin ({m.n_embd} x {m.expert_width} weights)",
          f"the estimator prices these grouped matmuls {pct(lost)} of their time slower than one product of the same "
          f"FLOPs on the {gpu.key} (tile and wave quantization); the routed experts are {pct(share)} of the model's "
          "FLOPs"]
    sug = [_flag(run, "train.batch_size", t.batch_size * f, f"{f}x the tokens per expert (where memory allows; "
                 "lower train.grad_accum_steps to keep the global batch)")]
    if ep < m.moe_experts:
        sug.append(advice(f"with several GPUs, --parallel.ep {2 * ep}: fewer experts per rank, each receiving the "
                          "tokens of more ranks"))
    return Finding(max(_clamp(share * lost), MIN_SCORE), "expert matmuls are small", ev, sug)


RULES = [routing_imbalance, all_to_all_share, small_expert_matmuls]
