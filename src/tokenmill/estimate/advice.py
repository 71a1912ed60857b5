"""One sentence on memory for out-of-memory messages, ``tokenmill estimate --advice`` and the doctor: how much
a config needs, and which switches bring it under the GPU's memory.

    >>> memory_advice(cfg, "NVIDIA A100-SXM4-40GB")
    'this needs about 28.1 GB per GPU (peak reserved, NVIDIA A100-SXM4-40GB has 39.6 GB); with
     --memory.activation_checkpointing 1 it needs about 9.4 GB'

The search (:func:`search`) reads the one list of switches (:mod:`tokenmill.config.memory_switches`) in two
tiers: first those with the same numerics and no optional package (activation checkpointing, the chunked loss,
a smaller micro-batch with more accumulation, SDPA, LoRA for a full fine-tune, CPU offload), then, only when
those do not fit, the switches that change the numerics or need torchao (pure bf16 weights, 8-bit AdamW, an NF4
base, the step in backward) and, for a job of several processes, sharding over them (ZeRO-1, FSDP). Only when
neither fits does the sentence suggest more GPUs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

from tokenmill import config as C
from tokenmill.errors import ConfigError, TokenmillError
from tokenmill.estimate.core import MB, estimate
from tokenmill.estimate.gpus import GPU, GPUS, gpu_spec

GB = 1024 * MB
ROUNDS = 10  # greedy rounds at most (a micro-batch of 16 halves four times)


def candidate_switches(cfg: C.Config, numerics: bool = False, nproc: int = 1) -> list[tuple[str, dict]]:
    """Memory-saving switches that ``cfg`` does not use yet, from the one list
    (:mod:`tokenmill.config.memory_switches`): (command-line text, overrides). Without ``numerics``, those with
    the same numerics and no optional package; with it, every switch of the list that works on ``nproc``
    processes (sharding over them too: the job has those GPUs already)."""
    from tokenmill.config.memory_switches import flags, getter, memory_switches

    found = memory_switches(getter(cfg), searched_only=not numerics)
    return [(flags(s), dict(s.overrides)) for s in found if not s.several_gpus or nproc > 1]


def _with(cfg: C.Config, overrides: dict) -> Optional[C.Config]:
    try:
        return C.validate(C.apply_overrides(C.from_dict(cfg.to_dict()), overrides))
    except ConfigError:
        return None


@dataclass
class Search:
    """What :func:`search` found: the overrides in the order chosen, the memory (bytes) with them, and the
    config they make."""

    chosen: list[dict]
    best: float
    cfg: C.Config
    seen: dict = field(default_factory=dict)  # config (as JSON) -> memory: a config is estimated once

    def reserved(self, cfg: C.Config, spec: GPU, nproc: int) -> float:
        key = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
        if key not in self.seen:
            self.seen[key] = _reserved(cfg, spec, nproc)
        return self.seen[key]


def _greedy(s: Search, spec: GPU, nproc: int, cap: float, numerics: bool) -> None:
    """Add, round by round, the first switch of the list that makes the config fit ``cap``, else the one that
    saves the most, until it fits (``cap`` 0: no capacity, the one that saves the most)."""
    for _ in range(ROUNDS):
        if cap and s.best <= cap and s.chosen:  # a config that fits already: the one switch that saves the most
            return
        trials = []
        for _text, ov in candidate_switches(s.cfg, numerics, nproc):
            c = _with(s.cfg, ov)
            if c is None:
                continue
            try:
                trials.append((s.reserved(c, spec, nproc), ov, c))
            except TokenmillError:
                continue
            if cap and trials[-1][0] <= cap:
                break  # the first that fits is the one chosen below: the rest need no estimate
        if not trials:
            return
        fitting = [t for t in trials if cap and t[0] <= cap]  # in the list's order: most commonly useful first
        value, ov, c = fitting[0] if fitting else min(trials, key=lambda x: x[0])
        if value >= s.best * 0.98:
            return
        s.chosen.append(ov)
        s.cfg, s.best = c, value


def _prune(cfg: C.Config, s: Search, spec: GPU, nproc: int, cap: float) -> None:
    """Drop every chosen switch the config still fits without (the last chosen first), so the advice names only
    what is needed: a micro-batch halved three times where twice fits comes back to twice."""
    i = len(s.chosen) - 1
    while i >= 0:
        rest = s.chosen[:i] + s.chosen[i + 1:]
        c = _with(cfg, _merged(rest)) if rest else cfg
        try:
            value = s.reserved(c, spec, nproc) if c is not None else None
        except TokenmillError:
            value = None
        if value is not None and value <= cap:
            s.chosen, s.cfg, s.best = rest, c, value
        i -= 1


def search(cfg: C.Config, spec: GPU, nproc: int = 1) -> Search:
    """The switches that bring ``cfg`` under ``spec``'s memory on ``nproc`` processes (module doc): the
    same-numerics tier greedily, then the rest of the single-GPU switches if that does not fit, then the
    chosen ones that are not needed dropped. Raises what the estimator raises for ``cfg`` itself."""
    cap = spec.memory_mb * MB
    s = Search([], 0.0, cfg)
    s.best = s.reserved(cfg, spec, nproc)
    fitted = cap and s.best <= cap
    _greedy(s, spec, nproc, cap, numerics=False)
    if cap and s.best > cap:
        _greedy(s, spec, nproc, cap, numerics=True)
    if cap and s.best <= cap and not fitted:
        _prune(cfg, s, spec, nproc, cap)
    return s


def _merged(chosen: list[dict]) -> dict:
    """One override per key, the last value (a micro-batch halved twice: its final size and accumulation)."""
    return {k: v for ov in chosen for k, v in ov.items()}


def memory_advice(cfg: C.Config, gpu: str = "h100-sxm", nproc: int = 1, capacity_mb: Optional[float] = None) -> str:
    """``"this needs about X GB ...; with --switch it needs about Y GB"`` for ``cfg`` on ``nproc``
    processes of ``gpu`` (a key of :data:`GPUS` or the name torch reports; an unknown name is modelled
    as an H100 with ``capacity_mb``), the switches by :func:`search`. Takes a few seconds (one estimate per
    candidate and round). Never raises: on an estimator failure the sentence says so."""
    try:
        spec = _spec(gpu, capacity_mb)
        found = search(cfg, spec, nproc)
        base = found.seen[next(iter(found.seen))]
    except TokenmillError as e:
        return f"no memory estimate for this config ({e})"
    cap = spec.memory_mb * MB
    head = f"this needs about {base / GB:.1f} GB per GPU (peak reserved"
    head += f", {spec.name} has {cap / GB:.1f} GB)" if cap else ")"
    if not found.chosen:
        if cap and base <= cap:  # nothing to lower: saying "use more GPUs" here would send a run that fits away
            return head + "; it fits as it is: no memory switch is needed"
        return head + "; no single switch of tokenmill's lowers it much: use more GPUs (parallel.dp_shard) or a smaller model"
    merged = _merged(found.chosen)
    flags = " ".join(f"--{k} {str(v).lower() if isinstance(v, bool) else v}" for k, v in merged.items())
    tail = f"; with {flags} it needs about {found.best / GB:.1f} GB"
    costs = _numerics(cfg, merged)
    if costs:
        tail += f" ({'; '.join(costs)})"
    if cap and found.best > cap:
        tail += " (still more than the GPU has: shard over more GPUs with parallel.dp_shard)"
    return head + tail


def _numerics(cfg: C.Config, merged: dict) -> list[str]:
    """What the chosen switches of the second tier change or need (their ``why`` from the one list)."""
    from tokenmill.config.memory_switches import getter, memory_switches

    same = {k for s in memory_switches(getter(cfg), searched_only=True) for k in s.overrides}
    return [s.why for s in memory_switches(getter(cfg)) if not s.several_gpus
            and any(k not in same and merged.get(k) == v for k, v in s.overrides.items())]


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
