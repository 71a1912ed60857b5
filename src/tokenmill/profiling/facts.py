"""The doctor's run, typed: the run's :class:`~tokenmill.config.Config` and what was measured, gathered once.

:func:`gather_facts <tokenmill.profiling.doctor.gather_facts>` collects the measured facts of a run directory
(``summary.json`` and ``profile.json`` checked where they are read, in :mod:`.run_files`) into one flat dict;
:meth:`Run.of` types it once: the config becomes a :class:`Config` (the run's values over the config's own
defaults, so a rule reads ``run.config.model.head_width``, never a default re-derived), and the facts become
frozen dataclasses (:class:`Timing`, :class:`Data`, :class:`Memory`, :class:`Host`, :class:`Work`,
:class:`Device`, :class:`Wall`, :class:`Sft`, :class:`Moe`) whose every figure is a number or None, checked here;
the windows the split is judged over are a :class:`Windows` (``run.timing.windows``), the places the steps
synchronise :class:`SyncSource` entries (``run.timing.sync_sources``), the operators the slow layer forms add
:class:`FormOps` by config field (``run.layer_forms``); ``run.world_size`` is the run's processes and
``run.recorded`` the keys its own config recorded. A value of the wrong type (a string where a number belongs, a
list of non-objects) is a :class:`DoctorError` naming the fact; a misspelt fact is an ``AttributeError`` where it
is read, not a silent None. No rule reads the flat dict (``run.facts``; tests/test_doctor_typed.py checks it).

A rule written for the typed run is wrapped with :func:`typed`: it takes a :class:`Run` and returns a
:class:`~tokenmill.profiling.findings.Finding` or None; the wrapper still accepts the flat dict (the rule
list and the tests pass it) and types it on the way in. Every rule of ``rules``, ``data_rules``,
``memory_rules``, ``model_rules``, ``fp8_rules``, ``optim_rules``, ``technique_rules``, ``sft_rules``,
``docmask_rules`` and ``moe_rules`` is written so.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, TypeVar

from tokenmill import config as C
from tokenmill.errors import DoctorError
from tokenmill.filecheck import shown

Num = Optional[float]
PHASES = ("data", "h2d", "forward", "backward", "optimizer")


def _num(f: dict[str, Any], key: str, where: str = "") -> Num:
    """The fact ``key`` as a float, or None when absent; anything else (a string, a bool, inf, NaN) is a
    :class:`DoctorError` naming it."""
    v = f.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise DoctorError(f"the doctor's fact '{where}{key}' is {v!r}, not a finite number (a damaged run file?)")
    return float(v)


def _int(f: dict[str, Any], key: str, where: str = "") -> Optional[int]:
    """The fact ``key`` as an int, or None when absent; anything else (a float, a string, a bool) is a
    :class:`DoctorError` naming it."""
    v = f.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise DoctorError(f"the doctor's fact '{where}{key}' is {shown(v)}, not an integer (a damaged run file?)")
    return v


def _text(f: dict[str, Any], key: str, where: str = "") -> str:
    """The fact ``key`` as text ("" when absent); anything else is a :class:`DoctorError` naming it."""
    v = f.get(key)
    if v is not None and not isinstance(v, str):
        raise DoctorError(f"the doctor's fact '{where}{key}' is {shown(v)}, not text (a damaged run file?)")
    return v or ""


def _object(f: dict[str, Any], key: str, where: str = "") -> dict[str, Any]:
    """The fact ``key`` as an object ({} when absent); anything else is a :class:`DoctorError` naming it."""
    v = f.get(key)
    if v is not None and not isinstance(v, dict):
        raise DoctorError(f"the doctor's fact '{where}{key}' is {shown(v)}, not an object (a damaged run file?)")
    return v or {}


def _from(cls: type, f: dict[str, Any]) -> Any:
    """``cls`` from the facts of the same names: numbers (``Num``) checked by :func:`_num`, text as text, and
    ``Seconds`` maps (part -> number) checked entry by entry."""
    out: dict[str, Any] = {}
    for x in dataclasses.fields(cls):
        if x.type == "Num":
            out[x.name] = _num(f, x.name)
        elif x.type == "str":
            out[x.name] = str(f.get(x.name) or "")
        elif x.type == "Seconds":
            part = f.get(x.name) or {}
            out[x.name] = {k: _num(part, k, f"{x.name}.") for k in part}
        elif x.type == "tuple[SyncSource, ...]":
            out[x.name] = sync_sources(f, x.name)
        elif x.type == "Optional[Windows]":
            w = f.get(x.name)
            if w is not None and not isinstance(w, Windows):
                raise DoctorError(f"the doctor's fact '{x.name}' is a {type(w).__name__}, not Windows "
                                  "(confidence.window_set builds them)")
            out[x.name] = w
    return cls(**out)


Seconds = dict[str, float]


@dataclass(frozen=True)
class SyncSource:
    """One place the profiled steps synchronise the host with the device (``profile.json`` ``syncs.sources``): the
    runtime call, the operator that made it and its parent, the phase (``region``) and Python line it ran in, how
    many times per step and the host time per step it cost."""

    call: str = ""
    op: str = ""
    parent: str = ""
    region: str = ""
    python: str = ""
    per_step: float = 0.0
    ms_per_step: Num = None


def sync_sources(f: dict[str, Any], key: str = "sync_sources") -> tuple[SyncSource, ...]:
    """The facts' ``key`` (a list of objects, as :func:`tokenmill.profiling.doctor.gather_facts` takes them from
    ``profile.json``) as :class:`SyncSource` entries, each value checked; none when absent."""
    v = f.get(key)
    if v is None:
        return ()
    if not isinstance(v, (list, tuple)) or not all(isinstance(s, (dict, SyncSource)) for s in v):
        raise DoctorError(f"the doctor's fact '{key}' is {shown(v)}, not a list of objects (a damaged run file?)")
    out = []
    for i, s in enumerate(v):
        if isinstance(s, dict):
            where = f"{key}[{i}]."
            s = SyncSource(*(_text(s, k, where) for k in ("call", "op", "parent", "region", "python")),
                           per_step=_num(s, "per_step", where) or 0.0, ms_per_step=_num(s, "ms_per_step", where))
        out.append(s)
    return tuple(out)


@dataclass(frozen=True)
class Windows:
    """The windows a run's split is judged over (:func:`tokenmill.profiling.confidence.window_set`): their
    ``kind`` ("log window", "profiled step"), how many the run had (``total``), the ones used and the ones left
    out (numbered from 1; a window at least ``confidence.SPIKE`` times the median step is left out), and over the
    windows used: each one's step time, each phase's time and each phase's share of the step; the median step
    of all of them."""

    kind: str
    total: int
    used: tuple[int, ...]
    left_out: tuple[int, ...]
    step_ms: tuple[float, ...]
    phase_ms: dict[str, tuple[float, ...]]
    shares: dict[str, tuple[float, ...]]
    median_step_ms: float


@dataclass(frozen=True)
class Timing:
    """The steady step and its phases (ms per step; shares of the step; each share's standard error over the
    run's own steps or log windows), activation checkpointing's recompute (measured or estimated), the host-device
    synchronisations per step and what they cost, the share of forward, backward, optimizer and the loop
    (``compute_share``), where the step time, split and recompute come from, the windows the split is
    over (None without per-window figures) and where the syncs are made (the profile's; none without one)."""

    step_ms: Num = None
    forward_ms: Num = None
    backward_ms: Num = None
    optimizer_ms: Num = None
    idle_ms: Num = None
    forward_share: Num = None
    backward_share: Num = None
    optimizer_share: Num = None
    idle_share: Num = None
    forward_share_se: Num = None
    backward_share_se: Num = None
    optimizer_share_se: Num = None
    recompute_ms: Num = None
    recompute_share: Num = None
    syncs_per_step: Num = None
    sync_ms: Num = None
    sync_share: Num = None
    compute_share: Num = None
    step_source: str = ""
    phase_source: str = ""
    recompute_source: str = ""
    windows: Optional[Windows] = None
    sync_sources: tuple[SyncSource, ...] = ()

    def share_lo(self, phase: str) -> Num:
        """``phase``'s share less twice its standard error over the run's own steps or log windows: what the
        run shows allowing for its own noise (None when the share is unknown)."""
        share = getattr(self, f"{phase}_share")
        return None if share is None else share - 2.0 * (getattr(self, f"{phase}_share_se") or 0.0)


@dataclass(frozen=True)
class Data:
    """The step's wait for its batches and their host-to-device copy (ms per step, shares, noise)."""

    data_ms: Num = None
    data_share: Num = None
    data_share_se: Num = None
    h2d_ms: Num = None
    h2d_share: Num = None
    h2d_share_se: Num = None


@dataclass(frozen=True)
class Memory:
    """The memory peak (MB) and its parts: the profiler's peak, the allocator's reserved peak, the device's
    total, the parts of the peak (measured or estimated; ``memory_source`` says which) and the peak's
    vocabulary-sized blocks."""

    peak_mb: Num = None
    peak_reserved_mb: Num = None
    device_total_mb: Num = None
    memory_total_mb: Num = None
    activation_mb: Num = None
    optimizer_state_mb: Num = None
    param_mb: Num = None
    grad_mb: Num = None
    vocab_sized_mb: Num = None
    transient_mb: Num = None
    alloc_retries: Num = None
    cuda_malloc_per_step: Num = None
    cuda_free_per_step: Num = None
    reserved_minus_allocated_mb: Num = None
    peak_region: str = ""
    peak_op: str = ""
    memory_source: str = ""


@dataclass(frozen=True)
class Device:
    """Where the step's time goes on the device side: the GPU's busy fraction and idle share, its kernels per
    step and their mean length, matrix products' share of the kernels' time (CUDA) or of the host operators'
    (CPU), the logging's share, the attention regions' measured share and attention's share of the FLOPs."""

    device_busy_fraction: Num = None
    device_idle_share: Num = None
    kernels_per_step: Num = None
    mean_kernel_us: Num = None
    gemm_share: Num = None
    host_matmul_share: Num = None
    logging_share: Num = None
    attn_share: Num = None
    attention_flop_share: Num = None
    host_mean_op_us: Num = None

    def idle_not_data(self, data: Data) -> float:
        """Device idle share not explained by the host waiting for (or copying) data."""
        idle = self.device_idle_share
        if idle is None:
            idle = 1.0 - (self.device_busy_fraction or 1.0)
        return max(0.0, idle - (data.data_share or 0.0) - (data.h2d_share or 0.0))


@dataclass(frozen=True)
class Work:
    """What a step computes and how fast: tokens per step, the model's FLOPs per token (``summary.json``), the
    host operators per step and the FLOPs per operator (profile), the steady tokens/s and MFU, and where those
    come from ("summary.json", or "metrics.jsonl" when its windows are not the summary's)."""

    tokens_per_step: Num = None
    flops_per_token: Num = None
    host_ops_per_step: Num = None
    flops_per_op: Num = None
    tokens_per_sec: Num = None
    mfu: Num = None
    tokens_per_sec_source: str = ""


@dataclass(frozen=True)
class Wall:
    """Wall-clock time of the run (:mod:`.wall`): in all, in the steady-state steps, and outside them by part
    (evaluation, checkpoints, logging, the rest; seconds and rounds), and how it was measured."""

    wall_s: Num = None
    steady_s: Num = None
    outside_s: Seconds = dataclasses.field(default_factory=dict)
    outside_counts: Seconds = dataclasses.field(default_factory=dict)
    wall_source: str = ""


@dataclass(frozen=True)
class Host:
    """The machine the run had (``summary.json`` ``threads``): its cores (the process's CPU affinity), the
    training threads of each process, the processes on this host, the other load when it started."""

    cpu_count: Optional[int] = None
    intra_op: int = 1
    local_world_size: int = 1
    load_avg: float = 0.0
    intra_op_known: bool = False  # the summary recorded the training threads (else intra_op is taken as 1)

    @staticmethod
    def of(f: dict[str, Any]) -> Host:
        """The facts' ``threads`` (``summary.json``'s), each value checked."""
        th, w = _object(f, "threads"), "threads."
        intra = _int(th, "intra_op", w)
        return Host(cpu_count=_int(th, "cpu_count", w), intra_op=intra or 1,
                    local_world_size=_int(th, "local_world_size", w) or 1, load_avg=_num(th, "load_avg", w) or 0.0,
                    intra_op_known=bool(intra))

    @property
    def cores(self) -> Optional[int]:
        """The cores free of other work (at least one), None when unknown."""
        if not self.cpu_count:
            return None
        return max(1, round(self.cpu_count - self.load_avg)) if self.load_avg else self.cpu_count

    @property
    def training_threads(self) -> int:
        return self.intra_op * self.local_world_size


@dataclass(frozen=True)
class Sft:
    """A chat fine-tune's shares of its steps' input positions, the means over its steps (``summary.json``
    ``padding_frac`` and ``learned_frac``; None: not a chat run, or an older version)."""

    padding_frac: Num = None
    learned_frac: Num = None


@dataclass(frozen=True)
class Moe:
    """A mixture of experts' routing (``moe_rules.moe_facts``): the median over the steady log rows of the worst
    sparse layer's load (its busiest expert's routed slots over the mean) and that layer, and the all-to-all's share
    of the profile's top operators (None: a dense model, a run of an older version, or not shown)."""

    load_max: Num = None
    load_layer: Optional[int] = None
    a2a_share: Num = None

    @staticmethod
    def of(f: dict[str, Any]) -> Moe:
        return Moe(_num(f, "moe_load_max"), _int(f, "moe_load_layer"), _num(f, "moe_a2a_share"))


@dataclass(frozen=True)
class FormOps:
    """The operators of one forward + backward of a narrow copy of the run's model (:mod:`.layer_ops`): all of
    them, the matrix products among them, and how many a slow layer form runs that its fast form would not."""

    total: int
    matmul: int
    extra: int


def layer_forms(f: dict[str, Any], key: str = "layer_forms") -> dict[str, FormOps]:
    """The facts' ``key`` (config field -> ``{"total", "matmul", "extra"}``, counted by
    :func:`tokenmill.profiling.layer_ops.layer_form_ops`) as :class:`FormOps`, each count checked."""
    out = {}
    for field, counts in _object(f, key).items():
        if not isinstance(counts, FormOps):
            counts = _object({field: counts}, field, f"{key}.")  # an object, else an error naming it
            n = [_int(counts, k, f"{key}.{field}.") for k in ("total", "matmul", "extra")]
            if None in n:
                raise DoctorError(f"the doctor's fact '{key}.{field}' is {shown(counts)}, without its total, matmul "
                                  "and extra operator counts (a damaged run file?)")
            counts = FormOps(*n)
        out[field] = counts
    return out


@dataclass(frozen=True)
class Run:
    """A run as the rules read it: ``config`` (typed), ``device``, the measured facts, and the GPU's name and
    compute capability (CUDA), a chat fine-tune's shares (``sft``), a mixture of experts' routing (``moe``), the
    operators the slow layer forms add (``layer_forms``), the run's processes (``world_size``) and the keys its own
    config recorded (``recorded``: a field newer than the run is absent). ``facts`` is the flat dict the run was
    typed from: no shipped rule reads it; :func:`tokenmill.profiling.doctor.rank` hands it to a rule written over
    the flat facts (not marked :func:`typed`)."""

    config: C.Config
    device: str
    timing: Timing
    data: Data
    memory: Memory
    host: Host
    work: Work
    kernels: Device
    wall: Wall
    facts: dict[str, Any]
    gpu_name: str = ""
    gpu_capability: Optional[tuple[int, ...]] = None
    sft: Sft = Sft()
    moe: Moe = Moe()
    layer_forms: dict[str, FormOps] = dataclasses.field(default_factory=dict)
    world_size: int = 1
    recorded: frozenset[str] = frozenset()

    @staticmethod
    def of(f: dict[str, Any]) -> Run:
        """Type the flat facts once (module doc)."""
        cap, config = f.get("gpu_capability"), _object(f, "config")
        return Run(typed_config(config), str(f.get("device") or "cpu"), _from(Timing, f),
                   _from(Data, f), _from(Memory, f), Host.of(f), _from(Work, f), _from(Device, f), _from(Wall, f), f,
                   str(f.get("gpu_name") or ""), tuple(cap) if cap else None, _from(Sft, f), Moe.of(f),
                   layer_forms(f), _int(f, "world_size") or 1, frozenset(config))

    def memory_fill(self) -> Num:
        """The peak's fraction of the GPU's memory (None on CPU or when either is unknown)."""
        m = self.memory
        peak = m.peak_reserved_mb or m.peak_mb
        if self.device != "cuda" or not m.device_total_mb or not peak:
            return None
        return peak / m.device_total_mb


def typed_config(flat: dict[str, Any]) -> C.Config:
    """A :class:`Config` from a run's flat ``{'section.field': value}``: the config's defaults, then each of the
    run's values that this version's field takes (a key of another version, or a value the field refuses, keeps
    the default; :func:`tokenmill.profiling.doctor.load_run` has warned about them). Not validated across fields:
    the rules read what ran."""
    cfg = C.Config()
    specs = C.field_specs()
    for key, value in flat.items():
        if key in specs:
            try:
                C.apply_overrides(cfg, {key: value})
            except C.ConfigError:
                continue
    return cfg


def as_config(config: C.Config | dict[str, Any]) -> C.Config:
    """``config`` itself, or a run's flat config typed (:func:`typed_config`)."""
    return config if isinstance(config, C.Config) else typed_config(config)


R = TypeVar("R")


def typed(rule: Callable[[Run], R]) -> Callable[[Any], R]:
    """A rule (or helper) written for :class:`Run`, callable with a :class:`Run` or the flat facts dict."""

    @functools.wraps(rule)
    def wrapper(run: Any) -> R:
        return rule(run if isinstance(run, Run) else Run.of(run))

    wrapper.typed = True  # type: ignore[attr-defined]  # rank() passes these the Run it built once
    return wrapper
