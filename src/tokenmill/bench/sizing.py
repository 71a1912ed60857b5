"""Sizing searches: the largest micro-batch, and the largest model, that train without running out
of memory with the given switches.

Both searches take a ``probe`` callable (value -> :class:`Probe`), so the search logic is tested
with a deterministic probe; the real probe (:class:`SubprocessProbe`) trains a few steps in a fresh
``tokenmill train`` subprocess. A probe *fits* when the run finishes (and stays under
``memory_cap_mb`` when one is given); it is *too big* on out-of-memory, over the cap, or past its
time limit; any other failure stops the search with that error (a config mistake is not a size).

- max-batch: double from ``start`` until a probe is too big (or ``limit`` is reached), then binary
  search between the last fit and the first failure.
- max-model: shapes ordered by parameter count (counted on the meta device, nothing allocated); binary
  search for the largest that fits (memory grows with size). The shapes follow the config's family: the
  GPT-2 / GPT-3 shapes (:data:`SHAPES`) for a GELU model, the published Llama / Qwen / SmolLM2 shapes
  (:data:`FAMILY_SHAPES`: layers, query and key/value heads, width, MLP width) for a SwiGLU one; every other
  field (vocabulary, tying, biases, RoPE, norms, q/k norm) stays the config's (:func:`shape_overrides`).

With a ``guess`` (the answer of the same search run on :class:`EstimateProbe`, which asks
``tokenmill estimate`` instead of training), the search starts there: it probes the guess, then steps
away from it in growing steps until the answer is bracketed, then bisects; a good guess costs two or
three probes. ``--estimate-only`` answers with the estimate probes alone (no GPU needed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from tokenmill import atomic
from tokenmill import config as C
from tokenmill.bench.runner import run_train
from tokenmill.errors import SizingError

# (name, n_layer, n_head, n_embd): the GPT-2 shapes, the GPT-3 paper's 1.3B (16 heads of 128), 2.7B,
# 6.7B and 13B shapes, and two in-between sizes with heads of 128.
SHAPES: list[tuple[str, int, int, int]] = [
    ("gpt2-124m", 12, 12, 768),
    ("gpt2-medium-350m", 24, 16, 1024),
    ("gpt2-large-774m", 36, 20, 1280),
    ("gpt3-xl-1.3b", 24, 16, 2048),
    ("gpt2-xl-1.5b", 48, 25, 1600),
    ("gpt3-2.7b", 32, 32, 2560),
    ("gpt3-6.7b", 32, 32, 4096),
    ("9b-like", 36, 36, 4608),
    ("gpt3-13b", 40, 40, 5120),
    ("20b-like", 44, 48, 6144),
]
# (name, n_layer, n_head, n_kv_head, n_embd, intermediate_size) of the Llama family, from each model's
# config.json (Hugging Face: HuggingFaceTB/SmolLM2-*, Qwen/Qwen2.5-*, meta-llama/Llama-3.*); heads of n_embd / n_head.
FAMILY_SHAPES: list[tuple[str, int, int, int, int, int]] = [
    ("smollm2-135m", 30, 9, 3, 576, 1536),
    ("smollm2-360m", 32, 15, 5, 960, 2560),
    ("qwen2.5-0.5b", 24, 14, 2, 896, 4864),
    ("llama3.2-1b", 16, 32, 8, 2048, 8192),
    ("qwen2.5-3b", 36, 16, 2, 2048, 11008),
    ("llama3.2-3b", 28, 24, 8, 3072, 8192),
    ("llama3.1-8b", 32, 32, 8, 4096, 14336),
    ("qwen2.5-14b", 48, 40, 8, 5120, 13824),
    ("qwen2.5-32b", 64, 40, 8, 5120, 27648),
    ("llama3.1-70b", 80, 64, 8, 8192, 28672),
]
PROBE_FIXED: dict[str, Any] = {
    "log.every_steps": 1,
    "log.timing_warmup_steps": 1,
    "log.progress": "plain",
    "log.tensorboard": False,
    "checkpoint.save_final": False,
    "checkpoint.every_steps": 0,
    "train.eval_batches": 0,
    "train.sample_at_end": False,
}



@dataclass
class Probe:
    """One probe: ``status`` is 'fits', 'too-big' or 'error'."""

    value: Any
    status: str
    reason: Optional[str] = None
    wall_s: Optional[float] = None
    step_time_ms: Optional[float] = None
    tokens_per_sec: Optional[float] = None
    peak_alloc_mb: Optional[float] = None
    peak_reserved_mb: Optional[float] = None
    params: Optional[int] = None

    def line(self) -> str:
        s = f"{self.status}"
        if self.step_time_ms is not None:
            s += f", step {self.step_time_ms:,.1f} ms"
        if self.peak_alloc_mb is not None:
            s += f", peak alloc {self.peak_alloc_mb:,.0f} MB, reserved {self.peak_reserved_mb or 0:,.0f} MB"
        if self.reason:
            s += f" ({self.reason})"
        return s


ProbeFn = Callable[[Any], Probe]


def fmt_params(n: int) -> str:
    """124439808 -> '124.4M'; 1557611200 -> '1.56B'; small counts in full."""
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def _run(probe: ProbeFn, value: Any, probes: list[Probe], label: str, log: Callable[[str], None]) -> bool:
    p = probe(value)
    probes.append(p)
    log(f"  probe {label}: {p.line()}")
    if p.status == "error":
        raise SizingError(f"probe {label} failed for a reason other than memory: {p.reason}")
    return p.status == "fits"


def search_max_batch(probe: ProbeFn, start: int = 1, limit: int = 1024,
                     log: Callable[[str], None] = print, guess: Optional[int] = None) -> dict[str, Any]:
    """The largest batch in [1, limit] that fits (0 if none); ``hit_limit`` when ``limit`` fits.
    ``guess``: start from this batch instead of doubling from ``start`` (see the module doc)."""
    if start < 1 or limit < 1:
        raise ValueError("start and limit must be >= 1")
    probes: list[Probe] = []
    lo, hi = 0, None  # lo: largest known fit; hi: smallest known misfit
    if guess is not None and guess >= 1:
        lo, hi = _bracket(probe, probes, log, min(max(guess, 1), limit), limit)
    else:
        b = min(start, limit)
        while True:
            if _run(probe, b, probes, f"batch {b}", log):
                lo = b
                if b >= limit:
                    break
                b = min(2 * b, limit)
            else:
                hi = b
                break
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        if _run(probe, mid, probes, f"batch {mid}", log):
            lo = mid
        else:
            hi = mid
    return {"max_batch": lo, "hit_limit": lo == limit, "limit": limit, "probes": [asdict(p) for p in probes]}


def _bracket(probe: ProbeFn, probes: list[Probe], log: Callable[[str], None], g: int, limit: int,
             label: Callable[[int], str] = lambda b: f"batch {b}", value: Callable[[int], Any] = lambda b: b,
             low: int = 1) -> tuple[int, Optional[int]]:
    """Probe ``g``, then step up (it fits) or down (it does not) in doubling steps until a fit and a
    misfit surround the answer: returns (largest fit or low - 1, smallest misfit or None)."""
    def run(b: int) -> bool:
        return _run(probe, value(b), probes, label(b), log)

    step = max(1, g // 8)
    if run(g):
        lo = g
        while lo < limit:
            b = min(limit, lo + step)
            if not run(b):
                return lo, b
            lo, step = b, step * 2
        return lo, None
    hi = g
    while hi > low:
        b = max(low, hi - step)
        if run(b):
            return b, hi
        hi, step = b, step * 2
    return low - 1, hi


def search_max_model(shapes: list[dict[str, Any]], probe: ProbeFn,
                     log: Callable[[str], None] = print, guess: Optional[int] = None) -> dict[str, Any]:
    """Binary search over ``shapes`` (ordered smallest first) for the largest that fits; ``guess``:
    the index of the shape to start from (see the module doc)."""
    if not shapes:
        raise ValueError("no shapes to probe")
    probes: list[Probe] = []
    lo, hi = -1, len(shapes)  # shapes[lo] fits (or none), shapes[hi] does not (or none left)

    def label(i: int) -> str:
        return f"{shapes[i]['name']} ({fmt_params(shapes[i]['params'])} params)"

    if guess is not None and 0 <= guess < len(shapes):
        g = guess
        if _run(probe, shapes[g], probes, label(g), log):
            lo = g
            if g + 1 < len(shapes):
                if _run(probe, shapes[g + 1], probes, label(g + 1), log):
                    lo = g + 1
                else:
                    hi = g + 1
        else:
            hi = g
            if g > 0:
                if _run(probe, shapes[g - 1], probes, label(g - 1), log):
                    lo = g - 1
                else:
                    hi = g - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        s = shapes[mid]
        label = f"{s['name']} ({fmt_params(s['params'])} params)"
        if _run(probe, s, probes, label, log):
            lo = mid
        else:
            hi = mid
    return {
        "largest": shapes[lo] if lo >= 0 else None,
        "hit_limit": lo == len(shapes) - 1,
        "shapes": shapes,
        "probes": [asdict(p) for p in probes],
    }


# ----------------------------------------------------------------------------------------------
# Real probes


def count_params(cfg: C.Config) -> int:
    """Parameters of ``cfg``'s model, counted on the meta device (no memory is allocated)."""
    from tokenmill.estimate import vocab_size_of
    from tokenmill.train.parallelize import count_params as model_params

    return model_params(cfg.model, vocab_size_of(cfg))


def with_overrides(cfg: C.Config, overrides: dict[str, Any]) -> C.Config:
    """A validated copy of ``cfg`` with ``overrides`` applied."""
    return C.validate(C.apply_overrides(C.from_dict(cfg.to_dict()), overrides))


def _nearest_divisor(n: int, target: float) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - target), -d))


def family_fields(m: C.ModelConfig, n_head: int, n_embd: int) -> dict[str, Any]:
    """The family fields of a shape given only layers, heads and width, scaled from the config ``m``: the
    MLP width in ``m``'s ratio to the width (a multiple of 64; None when ``m`` leaves it to 4 x width), the
    key/value heads in ``m``'s grouping (the divisor of ``n_head`` nearest ``n_head`` / group; None for
    multi-head), heads of ``n_embd / n_head``."""
    width = None if m.intermediate_size is None else max(64, round(m.mlp_width / m.n_embd * n_embd / 64) * 64)
    kv = None if m.n_kv_head is None else _nearest_divisor(n_head, n_head * m.kv_heads / m.n_head)
    return {"model.intermediate_size": width, "model.n_kv_head": kv, "model.head_dim": None}


def shape_overrides(shape: dict[str, Any]) -> dict[str, Any]:
    """The ``model.*`` overrides that turn a config into ``shape`` (a :func:`model_shapes` entry)."""
    base = {"model.n_layer": shape["n_layer"], "model.n_head": shape["n_head"], "model.n_embd": shape["n_embd"]}
    return {**base, **shape.get("family", {})}


def model_shapes(cfg: C.Config, shapes: Optional[list[tuple]] = None,
                 max_params: Optional[float] = None) -> list[dict[str, Any]]:
    """The shapes with their parameter counts for ``cfg`` (its vocab, block size, head/bias
    switches), sorted by size, without those above ``max_params``. ``shapes``: (name, layers, heads,
    width) tuples, whose other family fields are scaled from ``cfg`` (:func:`family_fields`), or (name,
    layers, heads, key/value heads, width, MLP width) tuples; default :data:`FAMILY_SHAPES` for a SwiGLU
    config, else :data:`SHAPES`."""
    m = cfg.model
    out = []
    for shape in shapes or (FAMILY_SHAPES if m.mlp == "swiglu" else SHAPES):
        if len(shape) == 6:
            name, n_layer, n_head, kv, n_embd, width = shape
            family = {"model.intermediate_size": width, "model.n_kv_head": kv, "model.head_dim": None}
        else:
            name, n_layer, n_head, n_embd = shape
            family = family_fields(m, n_head, n_embd)
        family = {k: v for k, v in family.items() if v != getattr(m, k.split(".", 1)[1])}  # only what changes
        entry = {"name": name, "n_layer": n_layer, "n_head": n_head, "n_embd": n_embd, "family": family}
        entry["params"] = count_params(with_overrides(cfg, shape_overrides(entry)))
        out.append(entry)
    out.sort(key=lambda s: s["params"])
    return [s for s in out if max_params is None or s["params"] <= max_params]


class SubprocessProbe:
    """Train ``steps`` steps of ``cfg`` with one change in a fresh subprocess (see module doc)."""

    def __init__(self, cfg: C.Config, out_dir: Path, kind: str, steps: int = 3, timeout_s: float = 600.0,
                 memory_cap_mb: Optional[float] = None, launcher: Optional[str] = None, nproc: int = 1):
        if kind not in ("batch", "model"):
            raise ValueError(kind)
        self.cfg, self.out_dir, self.kind = cfg, Path(out_dir), kind
        self.steps, self.timeout_s, self.memory_cap_mb = steps, timeout_s, memory_cap_mb
        self.launcher, self.nproc = launcher, nproc

    def overrides(self, value: Any) -> tuple[str, dict[str, Any]]:
        if self.kind == "batch":
            return f"batch-{value}", {"train.batch_size": value}
        return value["name"], shape_overrides(value)

    def __call__(self, value: Any) -> Probe:
        name, changes = self.overrides(value)
        cfg = with_overrides(self.cfg, {**changes, **PROBE_FIXED, "train.max_steps": self.steps})
        res = run_train(cfg, self.out_dir / "probes" / name, self.timeout_s, self.launcher, self.nproc)
        s = res.summary or {}
        p = Probe(value=value if self.kind == "batch" else value["name"], status="fits", wall_s=round(res.wall_s, 2),
                  step_time_ms=s.get("step_time_ms"), tokens_per_sec=s.get("tokens_per_sec"),
                  peak_alloc_mb=s.get("peak_alloc_mb"), peak_reserved_mb=s.get("peak_reserved_mb"),
                  params=s.get("params"))
        if res.summary is None or res.rc != 0:
            p.status = "too-big" if (res.oom or res.timed_out) else "error"
            p.reason = res.reason
        elif self.memory_cap_mb is not None:
            used = p.peak_reserved_mb if p.peak_reserved_mb is not None else p.peak_alloc_mb
            if used is None:
                p.reason = "no CUDA memory figures here: --memory-cap-mb not applied"
            elif used > self.memory_cap_mb:
                p.status, p.reason = "too-big", f"peak reserved {used:,.0f} MB > cap {self.memory_cap_mb:,.0f} MB"
        return p


def write_result(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_json(path, result, default=str)


class EstimateProbe:
    """A probe that asks ``tokenmill estimate`` instead of training: a value *fits* when the predicted
    peak reserved memory per GPU is within ``cap_mb`` (``--memory-cap-mb``, else the GPU's memory)."""

    def __init__(self, cfg: C.Config, kind: str, gpu: str, nproc: int = 1, cap_mb: Optional[float] = None):
        from tokenmill.estimate import gpu_spec

        if kind not in ("batch", "model"):
            raise ValueError(kind)
        self.cfg, self.kind, self.nproc = cfg, kind, nproc
        self.spec = gpu_spec(gpu) if isinstance(gpu, str) else gpu
        self.cap_mb = cap_mb or self.spec.memory_mb

    def __call__(self, value: Any) -> Probe:
        from tokenmill.estimate import estimate

        if self.kind == "batch":
            cfg = with_overrides(self.cfg, {"train.batch_size": value})
        else:
            cfg = with_overrides(self.cfg, shape_overrides(value))
        try:
            est = estimate(cfg, self.spec, self.nproc)
        except C.ConfigError as e:
            return Probe(value=value if self.kind == "batch" else value["name"], status="error", reason=str(e))
        fits = est.peak_reserved_mb <= self.cap_mb
        return Probe(value=value if self.kind == "batch" else value["name"], status="fits" if fits else "too-big",
                     reason=f"estimate: {est.peak_reserved_mb:,.0f} MiB reserved of {self.cap_mb:,.0f}",
                     step_time_ms=round(est.step_ms, 2), tokens_per_sec=round(est.tokens_per_sec, 1),
                     peak_alloc_mb=round(est.peak_alloc_mb, 1), peak_reserved_mb=round(est.peak_reserved_mb, 1),
                     params=est.params)
