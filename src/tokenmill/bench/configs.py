"""The resolved config of each rung, and how many steps it runs and times.

Order, later wins::

    defaults < [ladder] base_preset < BENCH_DEFAULTS < [ladder.base] < --set KEY=VALUE
             < the ``set`` of every carried earlier rung, then this rung's
             < --smoke shrinking < step plan ([ladder.measure]) < RUNNER_FIXED

A rung that was skipped or failed is not carried: later rungs run without its switch, and the
report lists it under ``dropped``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional

from tokenmill import config as C
from tokenmill.bench.schema import Ladder, LadderError, Measure, ladder_label

BENCH_DEFAULTS: dict[str, Any] = {
    "train.eval_batches": 0,  # evaluation is excluded from timing anyway; it only costs time
    "train.sample_at_end": False,
    "log.tensorboard": False,
}
RUNNER_FIXED: dict[str, Any] = {
    "log.progress": "plain",
    "checkpoint.save_final": False,
    "checkpoint.every_steps": 0,
}
SMOKE_MEASURE = Measure(warmup_steps=2, timed_steps=4, windows=2)
SMOKE_MAX_VOCAB = 500  # not a multiple of 64, so the vocabulary-padding rung still pads


@dataclass
class StepPlan:
    """``max_steps = warmup_steps + timed_steps``; windows close every ``every_steps`` steps."""

    warmup_steps: int
    timed_steps: int
    every_steps: int
    max_steps: int
    samples_per_step: int
    timed_samples: int
    covers_samples: Optional[bool]  # timed part >= [ladder] samples (None: no samples figure)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RungConfig:
    config: C.Config
    plan: StepPlan


def plan_steps(measure: Measure, cfg: C.Config, nproc: int, samples: Optional[int],
               timed_override: Optional[int] = None) -> StepPlan:
    """Whole windows: the timed part and the warm-up are rounded up to multiples of the window."""
    dp = max(1, nproc // (cfg.parallel.tp * cfg.parallel.pp))  # TP and PP ranks share a batch
    per_step = cfg.train.batch_size * cfg.train.grad_accum_steps * dp
    if timed_override:
        timed = timed_override
    elif measure.cover_samples and samples:
        timed = math.ceil(samples / per_step)
    else:
        timed = measure.timed_steps
    every = max(1, timed // max(1, min(measure.windows, timed)))
    timed = math.ceil(timed / every) * every
    warmup = math.ceil(measure.warmup_steps / every) * every
    covers = (timed * per_step >= samples) if samples else None
    return StepPlan(warmup, timed, every, warmup + timed, per_step, timed * per_step, covers)


def smoke_overrides(cfg: C.Config) -> dict[str, Any]:
    """Tiny shapes and capped batch sizes (divided by 8, so batch rungs still differ)."""
    out: dict[str, Any] = {
        "model.n_layer": 2,
        "model.n_embd": 64,
        "model.n_head": 2,
        "model.block_size": 64,
        "train.batch_size": max(1, min(32, math.ceil(cfg.train.batch_size / 8))),
        "data.num_workers": min(cfg.data.num_workers, 1),  # keeps the worker path, spares small CPUs
    }
    out.update(_smoke_family(cfg.model))
    if cfg.data.source == "synthetic" and cfg.model.vocab_size:
        out["model.vocab_size"] = min(cfg.model.vocab_size, SMOKE_MAX_VOCAB)
    pp = cfg.parallel.pp
    if pp > 1:  # as many pipeline micro-batches as stages, and a batch they divide
        out["parallel.pp_microbatches"] = pp
        out["train.batch_size"] = math.ceil(out["train.batch_size"] / pp) * pp
    return out


def _smoke_family(m: C.ModelConfig) -> dict[str, Any]:
    """The smoke shapes (2 heads of 32) for the family fields a model declares, keeping its forms:
    grouped-query attention stays grouped (1 key/value head for the 2 query heads), a declared head width
    becomes 32, a declared MLP width keeps its ratio to the width."""
    out: dict[str, Any] = {}
    if m.n_kv_head is not None:
        out["model.n_kv_head"] = 1 if m.n_kv_head < m.n_head else 2
    if m.head_dim is not None:
        out["model.head_dim"] = 32
    if m.intermediate_size is not None:
        out["model.intermediate_size"] = max(2, round(m.intermediate_size * 64 / m.n_embd))
    return out


def rung_config(
    ladder: Ladder,
    index: int,
    carried: Optional[list[int]] = None,
    cli_set: Optional[dict[str, str]] = None,
    smoke: bool = False,
    timed_steps: Optional[int] = None,
) -> RungConfig:
    """The resolved config of rung ``index``. ``carried``: indices of earlier rungs whose ``set`` is
    applied (default: all earlier rungs). ``cli_set``: ``--set`` strings applied after the base."""
    rung = ladder.rungs[index]
    where = f"{ladder_label(ladder.name, ladder.source)}, rung {index} '{rung.name}'"
    carried = list(range(index)) if carried is None else carried
    try:
        cfg = C.Config()
        if ladder.base_preset:
            C.apply_overrides(cfg, C.flatten(C.load_preset(ladder.base_preset)), origin=f"preset '{ladder.base_preset}'")
        C.apply_overrides(cfg, BENCH_DEFAULTS)
        C.apply_overrides(cfg, ladder.base, origin="[ladder.base]")
        if cli_set:
            C.apply_overrides(cfg, cli_set, from_string=True, origin="--set")
        for j in sorted(carried) + [index]:
            C.apply_overrides(cfg, ladder.rungs[j].set, origin=f"rung '{ladder.rungs[j].name}'")
        if smoke:
            C.apply_overrides(cfg, smoke_overrides(cfg), origin="--smoke")
        plan = plan_steps(SMOKE_MEASURE if smoke else ladder.measure, cfg, rung.nproc, ladder.samples, timed_steps)
        C.apply_overrides(cfg, {
            "train.max_steps": plan.max_steps,
            "log.every_steps": plan.every_steps,
            "log.timing_warmup_steps": plan.warmup_steps,
            **RUNNER_FIXED,
        })
        C.validate(cfg)
    except LadderError:
        raise
    except C.ConfigError as e:
        raise LadderError(f"{where}: {e}") from None
    return RungConfig(cfg, plan)


def check_ladder_configs(ladder: Ladder) -> None:
    """Resolve every rung's cumulative config, normal and --smoke (rungs whose ``needs`` fields are
    missing are left out, as the runner leaves them out)."""
    available = [i for i, r in enumerate(ladder.rungs) if not r.missing_fields()]
    for i in available:
        earlier = [j for j in available if j < i]
        rung_config(ladder, i, earlier)
        rung_config(ladder, i, earlier, smoke=True)
