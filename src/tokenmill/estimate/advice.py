"""One sentence on memory for out-of-memory messages and the doctor: how much a config needs, and
which switch brings it under the GPU's memory.

    >>> memory_advice(cfg, "NVIDIA A100-SXM4-40GB")
    'this needs about 28.1 GB per GPU (peak reserved, NVIDIA A100-SXM4-40GB has 39.6 GB); with
     --memory.activation_checkpointing 1 it needs about 9.4 GB'
"""

from __future__ import annotations

from typing import Optional

from tokenmill import config as C
from tokenmill.errors import ConfigError, TokenmillError
from tokenmill.estimate.core import MB, estimate
from tokenmill.estimate.gpus import GPU, GPUS, gpu_spec

GB = 1024 * MB


def candidate_switches(cfg: C.Config) -> list[tuple[str, dict]]:
    """Memory-saving switches that ``cfg`` does not use yet, from the one list
    (:mod:`tokenmill.config.memory_switches`; those the estimator can evaluate): (command-line text, overrides)."""
    from tokenmill.config.memory_switches import flags, getter, memory_switches

    return [(flags(s), dict(s.overrides)) for s in memory_switches(getter(cfg), searched_only=True)]


def _with(cfg: C.Config, overrides: dict) -> Optional[C.Config]:
    try:
        return C.validate(C.apply_overrides(C.from_dict(cfg.to_dict()), overrides))
    except ConfigError:
        return None


def memory_advice(cfg: C.Config, gpu: str = "h100-sxm", nproc: int = 1, capacity_mb: Optional[float] = None) -> str:
    """``"this needs about X GB ...; with --switch it needs about Y GB"`` for ``cfg`` on ``nproc``
    processes of ``gpu`` (a key of :data:`GPUS` or the name torch reports; an unknown name is modelled
    as an H100 with ``capacity_mb``). The switch is the single one that fits (saving the most), else
    the fewest switches, added greedily, that fit, else those that save the most. Takes a few seconds
    (one estimate per candidate). Never raises: on an estimator failure the sentence says so."""
    try:
        spec = _spec(gpu, capacity_mb)
        base = _reserved(cfg, spec, nproc)
    except TokenmillError as e:
        return f"no memory estimate for this config ({e})"
    cap = spec.memory_mb * MB
    head = f"this needs about {base / GB:.1f} GB per GPU (peak reserved"
    head += f", {spec.name} has {cap / GB:.1f} GB)" if cap else ")"
    chosen: list[dict] = []
    current, best = cfg, base
    for _ in range(4):  # greedy: the switch that saves the most, until it fits
        trials = []
        for _text, ov in candidate_switches(current):
            c = _with(current, ov)
            if c is None:
                continue
            try:
                trials.append((_reserved(c, spec, nproc), ov, c))
            except TokenmillError:
                continue
        if not trials:
            break
        trials.sort(key=lambda x: x[0])
        fitting = [t for t in trials if cap and t[0] <= cap]
        value, ov, c = fitting[0] if fitting and not chosen else trials[0]
        if value >= best * 0.98:
            break
        chosen.append(ov)
        current, best = c, value
        if cap and best <= cap:
            break
    if not chosen:
        return head + "; no single switch of tokenmill's lowers it much: use more GPUs (parallel.dp_shard) or a smaller model"
    merged = {k: v for ov in chosen for k, v in ov.items()}  # a switch taken twice (batch halving) once, last value
    flags = " ".join(f"--{k} {str(v).lower() if isinstance(v, bool) else v}" for k, v in merged.items())
    tail = f"; with {flags} it needs about {best / GB:.1f} GB"
    if cap and best > cap:
        tail += " (still more than the GPU has: shard over more GPUs with parallel.dp_shard)"
    return head + tail


def _spec(gpu: str, capacity_mb: Optional[float]) -> GPU:
    try:
        spec = gpu_spec(gpu)
    except ConfigError:
        base = GPUS["h100-sxm"]
        spec = GPU("custom", gpu, capacity_mb or 0, base.hbm_gbs, base.link_gbs, base.link, base.sm, base.cc)
    if capacity_mb:
        spec = GPU(spec.key, spec.name, capacity_mb, spec.hbm_gbs, spec.link_gbs, spec.link, spec.sm, spec.cc)
    return spec


def _reserved(cfg: C.Config, spec: GPU, nproc: int) -> float:
    return estimate(cfg, spec, nproc).peak_reserved_mb * MB
