"""The estimator against published GPU measurements (``benchmarks/validation/published.toml``).

:func:`load` reads the cases, :func:`run_case` estimates one (with the source's differences the config cannot
express: memory its model holds that training never uses, a compiled model that returns only the loss, attention
kernels of FlashAttention 1),
:func:`summarize` gives the mean absolute errors overall and per *regime* (eager / compiled, small / large
micro-batch, one GPU / several, and the fine-tuning method: every weight trained, LoRA or QLoRA), and
:func:`markdown_table` the table of docs/estimate.md. The same functions run ``benchmarks/validation/heldout.toml``,
the held-out cases evaluated once after the estimator is frozen (``update.py --heldout``; a case already
evaluated carries its date in ``spent``, and :func:`fresh` keeps the others: ``--heldout --fresh``). The per-regime
errors are what :mod:`.uncertainty` prints beside every estimate; ``tests/test_estimate_validation.py``
recomputes all of it, so the file, the doc and the printed ranges cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import tomllib

from tokenmill import config as C
from tokenmill.errors import DataError
from tokenmill.estimate.gpus import GPU, gpu_spec
from tokenmill.filecheck import get

SMALL_BATCH_TOKENS = 8192  # a micro-batch of fewer tokens per GPU is 'small': the host can set the pace


@dataclass
class Case:
    id: str
    family: str
    source: str
    config: str
    gpu: str
    preset: Optional[str] = None
    flags: dict[str, Any] = field(default_factory=dict)
    nproc: int = 1
    returns_logits: bool = True
    other_mib: float = 0.0
    extra_mib: float = 0.0  # memory tokenmill's config keeps that the source's does not (added to the measurement)
    capacity_mib: Optional[float] = None  # the source GPU's memory where it differs from the table's GPU
    flash_attention: int = 2  # the FlashAttention the source's fused attention ran (1: PyTorch 2.0/2.1, flash-attn 1.x)
    memory_metric: str = "allocated"
    memory_mib: Optional[float] = None
    tokens_per_sec: Optional[float] = None
    memory_error: Optional[float] = None  # recorded in the file (estimate / measured - 1)
    speed_error: Optional[float] = None
    spent: Optional[str] = None  # the date (YYYY-MM-DD) it was evaluated as held out; absent in heldout.toml: fresh


def load(path: str | Path) -> tuple[list[Case], dict[str, Any]]:
    """The cases and the ``[summary]`` table of a validation file (``spent``, where given, checked: a
    YYYY-MM-DD date string)."""
    doc = tomllib.loads(Path(path).read_text())
    cases = []
    for c in doc.get("case", []):
        where = f"{path}: case {c.get('id', '?')}"
        spent = get(c, "spent", str, where, err=DataError, default=None)
        if spent is not None and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", spent):
            raise DataError(f"{where}: 'spent' must be the date the case was evaluated (YYYY-MM-DD), "
                            f"got {spent!r}.")
        get(c, "flash_attention", int, where, err=DataError, default=2, lo=1, hi=2)
        cases.append(Case(**c))
    return cases, doc.get("summary", {})


def fresh(cases: list[Case]) -> list[Case]:
    """The held-out cases not evaluated yet (no ``spent`` date): what ``update.py --heldout --fresh`` runs."""
    return [c for c in cases if c.spent is None]


def config_of(case: Case) -> C.Config:
    """The tokenmill config that expresses the case (synthetic data: nothing is prepared)."""
    overrides = {"data.source": "synthetic", **({} if case.returns_logits else {"model.return_logits": False}),
                 **case.flags}
    return C.resolve(case.preset, overrides=overrides, overrides_from_string=False)


def regime(case: Case) -> tuple[str, str, str, str]:
    """(compiled | eager, small | large micro-batch, one | many GPUs, full | lora | qlora) of a case."""
    cfg = config_of(case)
    return regime_of(cfg, case.nproc)


def method_of(cfg: C.Config) -> str:
    """The fine-tuning method: 'full' (every weight trains, pre-training included), 'lora' (``lora.rank`` > 0) or
    'qlora' (LoRA over an NF4 base, ``lora.quantize_base``)."""
    if not cfg.lora.rank:
        return "full"
    return "lora" if cfg.lora.quantize_base == "none" else "qlora"


def regime_of(cfg: C.Config, nproc: int) -> tuple[str, str, str, str]:
    tokens = cfg.train.batch_size * cfg.model.block_size
    return ("compiled" if cfg.compile.enabled else "eager", "small" if tokens < SMALL_BATCH_TOKENS else "large",
            "one" if nproc == 1 else "many", method_of(cfg))


def case_gpu(case: Case) -> GPU:
    """The GPU a case is estimated on: the table's, its capacity moved to the headroom the source had (the
    allocator releases its cache at the capacity: the source's, not the table's, with the config holding
    ``extra_mib`` more and ``other_mib`` less than the source did)."""
    gpu = gpu_spec(case.gpu)
    if case.capacity_mib or case.extra_mib or case.other_mib:
        gpu = dataclasses.replace(gpu, memory_mb=(case.capacity_mib or gpu.memory_mb) + case.extra_mib
                                  - case.other_mib)
    return gpu


def run_case(case: Case) -> dict[str, Any]:
    """Estimate a case; its errors (estimate / measured - 1) where the source measured memory or speed."""
    from tokenmill.estimate import estimate
    from tokenmill.estimate.attention import flash_generation
    cfg = config_of(case)
    with flash_generation(case.flash_attention):
        est = estimate(cfg, case_gpu(case), case.nproc)
    out: dict[str, Any] = {"id": case.id, "regime": regime_of(cfg, case.nproc), "est_tokens_per_sec": est.tokens_per_sec,
                           "est_memory_mib": None, "memory_error": None, "speed_error": None}
    if case.memory_mib is not None:
        mem = est.peak_alloc_mb if case.memory_metric == "allocated" else est.peak_reserved_mb
        out["est_memory_mib"] = mem
        out["memory_error"] = mem / measured_mib(case) - 1
    if case.tokens_per_sec is not None:
        out["speed_error"] = est.tokens_per_sec / case.tokens_per_sec - 1
    return out


def rounded(result: dict[str, Any]) -> dict[str, Any]:
    """A :func:`run_case` result with its errors as the file records them (4 decimals): the means, the regime table
    and the doc's table are computed from these, so they can be checked against the file without estimating."""
    return {**result, **{k: None if result[k] is None else round(result[k], 4) for k in ("memory_error", "speed_error")}}


def recorded(case: Case) -> dict[str, Any]:
    """A case's result as ``published.toml`` records it (its errors; its regime from its config): no estimate."""
    return {"id": case.id, "regime": regime(case), "memory_error": case.memory_error, "speed_error": case.speed_error}


def measured_mib(case: Case) -> float:
    """The source's memory figure made comparable: less what the source holds that tokenmill's config does not,
    plus what tokenmill's config keeps that the source's does not (both stated in the file, never fitted)."""
    return case.memory_mib - case.other_mib + case.extra_mib


def floor_mib(case: Case) -> Optional[float]:
    """A lower bound on the source's own peak memory, from the shapes alone (never the estimator): the bytes it
    cannot avoid holding at once, for a case whose measurement is to be checked before it is taken. Its device's
    share of the weights (2 bytes a value in bf16 or fp16, 4 in fp32; a QLoRA block projection 0.5: NF4's codes;
    over the FSDP shards) and, with every layer checkpointed, each layer's input (batch x tokens x width, 2 bytes:
    the narrowest a source keeps). None where the source may hold less on the device than that (FSDP CPU offload,
    activation offloading, tensor or pipeline parallelism, checkpointing of some layers only) or measured none."""
    if case.memory_mib is None:
        return None
    cfg = config_of(case)
    m, par, mem = cfg.model, cfg.parallel, cfg.memory
    if par.fsdp_cpu_offload or mem.offload_activations or par.tp > 1 or par.pp > 1:
        return None
    if mem.activation_checkpointing not in (0, 1):
        return None
    from tokenmill.config.matrices import model_matrices

    width = 4 if cfg.train.precision == "fp32" else 2
    blocks = sum(math.prod(x.shape) for layer in model_matrices(m) for x in layer)
    edges = m.vocab_size * m.n_embd * (1 if m.tie_embeddings else 2)
    nf4 = cfg.lora.rank > 0 and cfg.lora.quantize_base == "nf4"
    weights = blocks * (0.5 if nf4 else width) + edges * width
    shards = par.dp_shard if par.dp_shard > 1 else 1
    held = weights / shards
    if mem.activation_checkpointing == 1:
        held += m.n_layer * cfg.train.batch_size * m.block_size * m.n_embd * 2
    return held / 2**20


def _mean_abs(values: list[Optional[float]]) -> Optional[float]:
    vals = [abs(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean absolute errors: overall, and per regime (with the number of cases behind each)."""
    by: dict[tuple, list] = {}
    for r in results:
        by.setdefault(tuple(r["regime"]), []).append(r)
    regimes = {k: {"memory": _mean_abs([r["memory_error"] for r in v]), "speed": _mean_abs([r["speed_error"] for r in v]),
                   "n_memory": sum(r["memory_error"] is not None for r in v),
                   "n_speed": sum(r["speed_error"] is not None for r in v)} for k, v in sorted(by.items())}
    return {"memory": _mean_abs([r["memory_error"] for r in results]),
            "speed": _mean_abs([r["speed_error"] for r in results]),
            "n_memory": sum(r["memory_error"] is not None for r in results),
            "n_speed": sum(r["speed_error"] is not None for r in results), "regimes": regimes}


def _pct(v: Optional[float]) -> str:
    return "" if v is None else f"{100 * v:+.1f}%"


def flags_of(case: Case) -> str:
    """The ``tokenmill estimate`` command line of a case."""
    def value(v: Any) -> str:
        return str(v).lower() if isinstance(v, bool) else str(v)

    words = ([f"--preset {case.preset}"] if case.preset else []) + [f"--gpu {case.gpu}"]
    words += [f"--nproc {case.nproc}"] if case.nproc > 1 else []
    words += [f"--{k} {value(v)}" for k, v in case.flags.items()]
    return " ".join(words + ([] if case.returns_logits else ["--model.return_logits false"]))


TABLE_HEAD = ["| case | config | tokenmill flags | memory MiB (measured / estimated) | error | tokens/s (measured / "
              "estimated) | error |", "|---|---|---|---|---|---|---|"]


def markdown_row(c: Case, r: dict[str, Any]) -> str:
    """One case's row of the table of docs/estimate.md (``r``: its :func:`run_case` result)."""
    mem = "" if c.memory_mib is None else f"{measured_mib(c):,.0f} / {r['est_memory_mib']:,.0f}"
    tps = "" if c.tokens_per_sec is None else f"{c.tokens_per_sec:,.0f} / {r['est_tokens_per_sec']:,.0f}"
    return (f"| [{c.id}]({c.source}) | {c.config} | `{flags_of(c)}` | {mem} | {_pct(r['memory_error'])} "
            f"| {tps} | {_pct(r['speed_error'])} |")


def summary_row(results: list[dict[str, Any]]) -> str:
    """The table's last row: the mean absolute errors over ``results``."""
    s = summarize(results)
    return (f"| **mean absolute error** | | | {s['n_memory']} cases | **{100 * (s['memory'] or 0):.1f}%** "
            f"| {s['n_speed']} cases | **{100 * (s['speed'] or 0):.1f}%** |")


def markdown_table(cases: list[Case], results: list[dict[str, Any]]) -> str:
    """The table of docs/estimate.md: one row per case, then the mean absolute errors."""
    return "\n".join(TABLE_HEAD + [markdown_row(c, r) for c, r in zip(cases, results)] + [summary_row(results)])
