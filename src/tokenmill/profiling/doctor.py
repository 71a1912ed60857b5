"""``tokenmill doctor RUN_DIR``: read a run, turn it into flat facts, apply the rules, rank the findings.

Inputs, all optional but at least one of the first two: ``profile.json`` (``tokenmill profile``),
``metrics.jsonl`` (steady-state log rows: after ``log.timing_warmup_steps``), ``summary.json`` and
``config.toml``. The time split comes from the profile when there is one (it also sees the logging
between steps), else from the trainer's always-on breakdown in the metrics. Further facts: the noise of
each phase's share over the run's own steps, the recompute of activation checkpointing, the operators
the hand-written layer forms add (counted on a narrow copy of the model), the threads the run had, and
the wall-clock time outside the steady state (:func:`wall_facts`). ``--try`` is :mod:`.trial`.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Optional

from tokenmill import config as C
from tokenmill.errors import DoctorError
from tokenmill.profiling import confidence, rules
from tokenmill.profiling.facts import Run, typed_config
from tokenmill.profiling.layer_ops import is_matmul, layer_form_ops
from tokenmill.profiling.run_files import read_profile, read_summary
from tokenmill.profiling.sft_rules import sft_facts
from tokenmill.profiling.trace import OUTSIDE
from tokenmill.profiling.wall import wall_facts
from tokenmill.train.metrics import read_metrics, steady_figures
from tokenmill.train.timing import PHASES

HOW_TO_MAKE_A_RUN = ("make one with `tokenmill train ... --run-dir DIR` or `tokenmill profile ... --run-dir DIR`, "
                     "then run `tokenmill doctor DIR`")
RERUN_PROFILE = "re-run `tokenmill profile` with this version to write a new one"


def load_run(run_dir: str | Path) -> dict[str, Any]:
    """The raw inputs: ``config`` (flat 'section.field' dict), ``metrics`` (the last run's rows),
    ``summary``, ``profile``, and ``warnings`` (what was skipped while reading)."""
    d = Path(run_dir)
    if d.is_file():
        hint = f" its folder: `tokenmill doctor {d.parent}`" if d.parent != Path() else " a run directory"
        raise DoctorError(f"'{d}' is a file, not a run directory; give{hint}.")
    if not d.exists():
        raise DoctorError(f"run directory '{d}' does not exist; {HOW_TO_MAKE_A_RUN}.")
    names = ("config.toml", "metrics.jsonl", "profile.json")
    if not any((d / n).is_file() for n in names):
        raise DoctorError(f"'{d}' is not a tokenmill run directory (no {', '.join(names)}); {HOW_TO_MAKE_A_RUN}.")
    out: dict[str, Any] = {"config": {}, "metrics": [], "summary": {}, "profile": None, "warnings": [], "dir": d,
                           "config_error": None}
    out["config"], out["config_error"] = _read_config(d / "config.toml")
    if out["config_error"]:
        out["warnings"].append(f"config.toml does not load as this version's config: {out['config_error']} The "
                               "findings read its values key by key, as recorded; `--try` needs a config that loads.")
    if (d / "metrics.jsonl").is_file():
        rows = _read_jsonl(d / "metrics.jsonl", out["warnings"])
        out["metrics"] = last_run(rows)
        if len(out["metrics"]) < len(rows):
            out["warnings"].append(f"metrics.jsonl holds several runs; reading the last one only "
                                   f"({len(out['metrics'])} of {len(rows)} rows)")
    if (d / "summary.json").is_file():  # written atomically: a damaged one is refused, naming the field
        out["summary"] = read_summary(d / "summary.json")
    if (d / "profile.json").is_file():
        out["profile"] = read_profile(d / "profile.json", f" Fix: {RERUN_PROFILE}.")
    if not out["profile"] and not out["metrics"] and out["warnings"]:  # nothing readable: not "train longer"
        raise DoctorError(f"'{d / 'metrics.jsonl'}' is unreadable ({'; '.join(out['warnings'])}).")
    if not out["profile"] and not any("step_ms" in r for r in out["metrics"]):
        raise DoctorError(
            f"'{d}' has neither profile.json nor timed rows in metrics.jsonl; train longer than "
            "log.timing_warmup_steps + log.every_steps, or run `tokenmill profile`."
        )
    return out


def _read_config(path: Path) -> tuple[dict[str, Any], Optional[str]]:
    """(the run's flat config, why it does not load or None); this version's defaults when there is none.
    A config that does not load (written by another version, or holding a value this version refuses, e.g.
    an absurd recorded shape) is taken key by key, as it is; a value of the wrong type for a field this version
    knows (a string where a number belongs) is left out (the field's default is read) and named in the reason."""
    if not path.is_file():
        return C.flatten(C.Config().to_dict()), None
    try:
        return C.flatten(C.from_dict(C.load_toml(path)).to_dict()), None
    except C.ConfigError as e:
        error = str(e)
    try:
        tree = C.load_toml(path)
    except C.ConfigError as e:
        raise DoctorError(str(e)) from None
    from tokenmill.config.resolve import check_ranges

    flat, specs, dropped = {}, C.field_specs(), []
    for s, body in tree.items():
        for k, v in body.items() if isinstance(body, dict) else ():
            key = f"{s}.{k}"
            try:  # this field's own type, choices and range (no cross-field rule): what the rules compute with
                if key in specs:
                    one = C.apply_overrides(C.Config(), {key: v})
                    check_ranges(one)
                    v = getattr(getattr(one, s), k)
                flat[key] = v
            except C.ConfigError:
                dropped.append(key)
    if dropped:
        error += f" Left out, read as this version's default: {', '.join(dropped)}."
    return flat, error


def _read_jsonl(path: Path, warnings: list[str]) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl`` (:func:`tokenmill.train.metrics.read_metrics`: each checked); lines that
    are not a metric record (a run killed mid-write, a damaged line) are skipped with a warning that counts
    them, names their line numbers and quotes the first one's problem."""
    skipped: list[tuple[int, str]] = []
    rows = read_metrics(path.parent, skipped)
    if skipped:
        lines = [str(i) for i, _ in skipped]
        warnings.append(f"{path.name}: skipped {len(skipped)} unreadable line(s) ({', '.join(lines[:5])}"
                        f"{', ...' if len(lines) > 5 else ''}; a run killed while writing?); the first: {skipped[0][1]}")
    return rows


def last_run(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the last run in a ``metrics.jsonl`` that successive runs appended to: a new run
    starts where a training row's step does not increase over the previous training row's."""
    start, prev = 0, None
    for i, r in enumerate(rows):
        if "loss" not in r or "val_loss" in r or "event" in r or "step" not in r:
            continue  # evaluation and event rows repeat the step of the training row before them
        if prev is not None and r["step"] <= prev:
            start = i
        prev = r["step"]
    return rows[start:]


def steady_rows(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Logged training rows with a timing, after the timing warm-up: the windows of the process that wrote
    ``summary.json`` where it says which (``timing_from_step`` to ``steps``), so a resumed run's step time,
    split and tokens/s all come from the same steps; else every row after ``log.timing_warmup_steps``."""
    warm = rules.config_value(run["config"], "log.timing_warmup_steps")
    rows = [r for r in run["metrics"] if r.get("step_ms") and "loss" in r]
    first, last = run["summary"].get("timing_from_step"), run["summary"].get("steps")
    if first is not None:
        same = [r for r in rows if first < r["step"] <= (last if last is not None else math.inf)]
        if same:
            return same
    later = [r for r in rows if r["step"] > warm]
    return later or rows


def facts_from_metrics(rows: list[dict[str, Any]], tokens_per_step: Optional[int] = None) -> dict[str, Any]:
    """The time split from the trainer's log windows: each phase's share is its time over the step time
    summed over the windows used (:func:`confidence.window_set`: a window >= 3x the median step is left
    out), its ms that share of ``step_ms``, which is the summary's figure (:func:`steady_step_ms`)."""
    f: dict[str, Any] = {}
    if not rows:
        return f
    keys = [*PHASES, "other"]
    phase_ms = {p: [r.get(f"{p}_ms") or 0.0 for r in rows] for p in keys}
    w = confidence.window_set([r["step_ms"] for r in rows], phase_ms, "log window")
    total = sum(w.step_ms) or 1.0
    step, f["step_source"] = steady_step_ms(rows, tokens_per_step)
    for p in keys:
        share = sum(w.phase_ms[p]) / total
        f[f"{p}_share" if p != "other" else "idle_share"] = share
        f[f"{p}_ms" if p != "other" else "idle_ms"] = share * step
    f["step_ms"] = step
    f["other_ms"] = f["idle_ms"]
    f.update(share_errors({p: w.phase_ms[p] for p in PHASES}, w.step_ms))
    f["windows"] = w  # typed: Run.timing.windows
    f["loop_share"] = f["idle_share"]  # the trainer's windows leave logging out of other_ms
    f["phase_source"] = "metrics.jsonl (trainer's always-on breakdown)"
    return f


def steady_step_ms(rows: list[dict[str, Any]], tokens_per_step: Optional[int]) -> tuple[float, str]:
    """The steady step time and where it comes from: with the run's tokens per step and rows written by
    the trainer (each window's ``step_ms`` is tokens per step / its tokens/s), the summary's own figure
    (:func:`tokenmill.train.metrics.steady_figures` of every window: tokens/s == tokens per step / step
    time exactly); else the median of the windows' step times."""
    tps = [r.get("tokens_per_sec") for r in rows]
    if tokens_per_step and all(tps) and all(
            math.isclose(r["step_ms"], 1000.0 * tokens_per_step / t, rel_tol=1e-6) for r, t in zip(rows, tps)):
        return steady_figures(tps, tokens_per_step)["step_time_ms"], "tokens per step / median window tokens/s"
    return statistics.median(r["step_ms"] for r in rows), "median window step time"


def share_errors(phase_ms: dict[str, tuple[float, ...]], step_ms: tuple[float, ...]) -> dict[str, float]:
    """``<phase>_share_se``: the standard error of each phase's share of the step over the run's own
    steps or log windows (0 from a single one): the noise the rules allow for."""
    out = {}
    for p, values in phase_ms.items():
        shares = [v / s for v, s in zip(values, step_ms) if s]
        out[f"{p}_share_se"] = statistics.stdev(shares) / len(shares) ** 0.5 if len(shares) > 1 else 0.0
    return out


def facts_from_profile(p: dict[str, Any]) -> dict[str, Any]:
    """Facts from ``profile.json``; a file of another version raises :class:`DoctorError`."""
    try:
        return _profile_facts(p)
    except (KeyError, TypeError, AttributeError) as e:
        raise DoctorError(
            f"profile.json does not have the layout this version reads ({type(e).__name__}: {e}; written by "
            f"another version of tokenmill?); {RERUN_PROFILE}."
        ) from None


def _profile_facts(p: dict[str, Any]) -> dict[str, Any]:
    """The rules' facts from a ``profile.json``: the step's phases and syncs, then what the profile
    measured of recompute, host and device work, memory and the allocator."""
    ms, share = p["breakdown"]["ms_per_step"], p["breakdown"]["share"]
    f: dict[str, Any] = {f"{k}_ms": v for k, v in ms.items() if k != "step"}
    f["step_ms"] = ms["step"]
    f["step_source"] = "mean of the profiled steps (under the profiler: slower than summary.json's windows)"
    f.update({f"{k}_share": v for k, v in share.items()})
    f["phase_source"] = "profile.json (record_function regions of the profiled steps)"
    _sync_facts(p, f)
    _measured_facts(p, f)
    return f


def _sync_facts(p: dict[str, Any], f: dict[str, Any]) -> None:
    """Syncs per step and what they cost the host; the phases' shares per profiled step (their noise)."""
    ms, b = p["breakdown"]["ms_per_step"], p["breakdown"]
    f["syncs_per_step"] = p["syncs"]["per_step"]
    f["sync_sources"] = sources = p["syncs"]["sources"]
    # What the syncs cost the host: the time inside the sync calls within the phases, plus, when the
    # syncs happen outside the phases (the trainer's read-back at log steps), the time outside the
    # phases (logging). That time is the sync rule's, not per-step overhead (loop_share).
    inside = sum(s.get("ms_per_step") or 0.0 for s in sources if s.get("region") != OUTSIDE)
    outside = any(s.get("region") == OUTSIDE for s in sources)
    # An evaluation inside the profiled steps also runs outside the phases: its time is the
    # outside-the-steady-state rule's, not logging.
    eval_ms = min(ms["idle"], (b.get("outside") or {}).get("eval_ms_per_step") or 0.0)
    idle_ms = ms["idle"] - eval_ms
    idle_share = idle_ms / ms["step"] if ms["step"] else 0.0
    f["logging_share"] = idle_share if outside else 0.0
    f["loop_share"] = idle_share - f["logging_share"]
    f["sync_ms"] = inside + (idle_ms if outside else 0.0)
    f["sync_share"] = f["sync_ms"] / ms["step"] if ms["step"] else None
    if eval_ms:
        f["profile_eval_ms"] = eval_ms
    each = b.get("each_step_ms")
    if each:
        f["windows"] = w = confidence.window_set(each["step"], {k: v for k, v in each.items() if k != "step"},
                                                 "profiled step")
        f.update(share_errors(w.phase_ms, w.step_ms))
        if w.left_out and w.step_ms:  # the split over the steps used, scaled to the profile's step
            total = sum(w.step_ms)
            for k, v in w.phase_ms.items():
                f[f"{k}_share"] = sum(v) / total
                f[f"{k}_ms"] = f[f"{k}_share"] * ms["step"]
    else:  # a profile of an older version: no per-step figures, no noise estimate
        f.update({f"{k}_share_se": 0.0 for k in PHASES})


def _measured_facts(p: dict[str, Any], f: dict[str, Any]) -> None:
    """Recompute, host and device work, attention, memory, the allocator and the GPU, as profiled."""
    ms, b = p["breakdown"]["ms_per_step"], p["breakdown"]
    rec = b.get("recompute")
    if rec and ms["step"]:
        cuda = rec.get("device_ms_per_step") is not None
        f["recompute_ms"] = rec["device_ms_per_step"] if cuda else rec["host_ms_per_step"]
        f["recompute_share"] = f["recompute_ms"] / ms["step"]
        f["recompute_source"] = ("measured in the profile: device time of the forward kernels launched inside "
                                 "backward" if cuda else "measured in the profile: forward operators inside backward")
    f["host_mean_op_us"] = p["host_busy"]["mean_op_us"]
    # matrix products' share of the host operators' time (CPU; CUDA reads it from the kernels below)
    f["host_matmul_share"] = sum(r["share"] for r in p.get("top_ops", []) if is_matmul(r["name"]))
    f["host_ops_per_step"] = p["host_busy"]["ops_per_step"]
    d = p.get("device_busy")
    if d:
        f["device_busy_fraction"] = d["busy_fraction"]
        f["device_idle_share"] = 1.0 - (d["busy_fraction"] or 0.0)
        for k in ("kernels_per_step", "mean_kernel_us", "gemm_share"):
            f[k] = d[k]
    attn = (p.get("per_block") or {}).get("attn_ms_per_step")  # null: not measured (e.g. skipped under compile)
    if attn is not None and ms["step"]:
        f["attn_share"] = attn / ms["step"]
    m = p.get("memory")
    if m:
        for k in ("peak_mb", "peak_region", "peak_op", "vocab_sized_mb", "transient_mb", "step_start_mb",
                  "categories_at_peak_mb"):
            f[k] = m.get(k)
        f["memory_device"] = m["device"]
    a = p.get("allocator")
    if a:
        f["alloc_retries"] = a["during_profiled_steps"]["num_alloc_retries"] or a["alloc_retries_total"]
        for k in ("cuda_malloc_per_step", "cuda_free_per_step", "reserved_minus_allocated_mb", "peak_reserved_mb",
                  "device_total_mb"):
            f[k] = a[k]
    g = p.get("gpu")
    if g:
        f["gpu_name"], f["gpu_capability"], f["device_total_mb"] = g["name"], g["capability"], g["total_mb"]

def memory_facts(f: dict[str, Any], config: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    """Parameter/gradient/AdamW-state sizes and the activation part of the peak: measured when the
    profile has the memory timeline's categories (``--with-stack``), else estimated from the
    parameter count and the allocator growth within the step."""
    cats = f.get("categories_at_peak_mb")
    if cats and sum(cats.values()) > 0:
        return {
            "memory_total_mb": sum(cats.values()),
            "activation_mb": cats.get("activation", 0) + cats.get("temporary", 0) + cats.get("autograd_detail", 0),
            "optimizer_state_mb": cats.get("optimizer_state", 0),
            "param_mb": cats.get("parameter", 0),
            "grad_mb": cats.get("gradient", 0),
            "memory_source": "memory timeline categories at the peak",
        }
    params = summary.get("params")
    out: dict[str, Any] = {"memory_source": "estimated from the parameter count"}
    if not params:
        return {}
    width = 2 if rules.config_value(config, "train.precision") == "bf16" else 4
    param_mb = params * width / 1024**2
    grad_mb = (summary.get("trainable_params") or params) * width / 1024**2  # LoRA: the adapters only
    out.update(param_mb=param_mb, grad_mb=grad_mb, optimizer_state_mb=2 * grad_mb)
    persistent = param_mb + 2 * grad_mb  # weights + AdamW state; gradients are freed (set_to_none) before forward
    if f.get("memory_device") == "cuda" and f.get("peak_mb"):
        total = f["peak_mb"]
        act = f.get("transient_mb")
    elif f.get("device") == "cuda" and summary.get("peak_alloc_mb"):
        total = summary["peak_alloc_mb"]
        act = max(0.0, total - persistent - param_mb)
    elif f.get("transient_mb") is not None:  # CPU: the profiler saw only allocations made while it ran
        act = f["transient_mb"]
        total = act + persistent
    else:
        return out
    out.update(memory_total_mb=total, activation_mb=act)
    return out


def gather_facts(run: dict[str, Any]) -> dict[str, Any]:
    """Everything the rules read, as one flat dict."""
    cfg, summary, prof = run["config"], run["summary"], run["profile"]
    f: dict[str, Any] = {"config": cfg}
    f["device"] = (prof or {}).get("device") or summary.get("device") or "cpu"
    f.update(facts_from_metrics(steady_rows(run), summary.get("tokens_per_step")))
    if prof:
        f.update(facts_from_profile(prof))
    cfg = f["config"] = as_run(cfg, f)
    f["gpu_name"] = f.get("gpu_name") or summary.get("gpu_name")
    f["tokens_per_step"] = (prof or {}).get("tokens_per_step") or summary.get("tokens_per_step")
    fpt = summary.get("flops_per_token") or (6.0 * summary["params"] if summary.get("params") else None)
    f["flops_per_token"] = fpt
    if fpt and f["tokens_per_step"] and f.get("host_ops_per_step"):
        f["flops_per_op"] = fpt * f["tokens_per_step"] / f["host_ops_per_step"]
    f["compute_share"] = _compute_share(f)
    f["tokens_per_sec"], f["mfu"], f["tokens_per_sec_source"] = _same_window_speed(f, summary)
    f.update(sft_facts(summary))  # chat fine-tuning: padding and learned shares (profiling/sft_rules.py)
    f.update(rules.moe_facts(steady_rows(run), prof))  # experts' load, all-to-all share (moe_rules.py)
    f["threads"], f["world_size"] = summary.get("threads"), summary.get("world_size")  # run.host, run.world_size
    if "recompute_share" not in f and rules.config_value(cfg, "memory.activation_checkpointing") and f.get("step_ms"):
        # no profile: backward is about twice the forward without recompute; the excess is the recompute
        f["recompute_ms"] = max(0.0, f["backward_ms"] - 2.0 * f["forward_ms"])
        f["recompute_share"] = f["recompute_ms"] / f["step_ms"]
        f["recompute_source"] = "estimated: backward minus twice the forward (no profile)"
    f["layer_forms"] = layer_form_ops(cfg, cuda=f["device"] == "cuda")
    f.update(wall_facts(run, f))
    m = typed_config(cfg).model  # the config's own head width (model.head_dim, else n_embd / n_head)
    f["attention_flop_share"] = rules.attention_flop_share(m.n_layer, m.n_head, m.head_width, m.block_size,
                                                           summary.get("flops_per_token"), summary.get("params"))
    f.update(memory_facts(f, cfg, summary))
    return f


def _same_window_speed(f: dict[str, Any], summary: dict[str, Any]) -> tuple[Optional[float], Optional[float], str]:
    """tokens/s and MFU over the steps the step time was taken from: the summary's own where the step time is
    its figure (tokens per step / median window tokens/s) or comes from a profile (the verdict says so); where
    the metrics' windows are not the summary's (an older run's summary, rows of another process), the median
    window's tokens/s, and the MFU scaled to it. The third item says which."""
    tps, mfu = summary.get("tokens_per_sec"), summary.get("mfu")
    step, tokens = f.get("step_ms"), f.get("tokens_per_step")
    if not (f.get("step_source", "").startswith("tokens per step") and step and tokens):
        return tps, mfu, "summary.json"
    mine = 1000.0 * tokens / step
    if tps and math.isclose(mine, tps, rel_tol=1e-6):
        return tps, mfu, "summary.json"
    return mine, (mfu * mine / tps if mfu and tps else None), "metrics.jsonl"


def as_run(config: dict[str, Any], f: dict[str, Any]) -> dict[str, Any]:
    """The run's config with ``train.precision='auto'`` and ``train.tf32`` unset made what they were on its
    device (:func:`tokenmill.config.concrete`, the trainer's own choice), so the rules read what ran. A
    run's config.toml records them made already; a run without one has the defaults."""
    precision, tf32 = (rules.config_value(config, k) for k in ("train.precision", "train.tf32"))
    if precision != "auto" and tf32 is not None:
        return config
    cap = f.get("gpu_capability")
    made = C.concrete(C.Config(train=C.TrainConfig(precision=precision, tf32=tf32)), f["device"],
                      bf16=not cap or cap[0] >= 8).train
    return {**config, "train.precision": made.precision, "train.tf32": made.tf32}


def _compute_share(f: dict[str, Any]) -> Optional[float]:
    """Share of the step in forward, backward, optimizer and the loop between them: what per-operator
    overhead can inflate (data waits, copies, syncs and logging are other rules' business)."""
    parts = [f.get(f"{p}_share") for p in ("forward", "backward", "optimizer")]
    if any(x is None for x in parts):
        return None
    return sum(parts) + (f.get("loop_share") or 0.0)


def diagnose(run_dir: str | Path) -> dict[str, Any]:
    """The verdict for a run directory (also what ``--json`` prints)."""
    raw = load_run(run_dir)
    run = Run.of(gather_facts(raw))  # typed once: the rules, the ratings and the figures read it
    found = rank(run)
    return {
        "run_dir": str(run_dir),
        "device": run.device,
        "sources": [n for n, ok in (("profile.json", raw["profile"]), ("metrics.jsonl", raw["metrics"]),
                                    ("summary.json", raw["summary"])) if ok],
        **verdict_of(found),
        "findings": [{**x, "confidence": x["confidence"].to_json()} for x in found],  # the JSON's keys
        "figures": _figures(run),
        "warnings": raw["warnings"],
        "config_error": raw["config_error"],  # why config.toml does not load (None: it does); --try refuses
    }


def verdict_of(found: list[dict[str, Any]]) -> dict[str, Any]:
    """``verdict`` and ``main``: the first major finding that is not within the run's noise; "too noisy to
    judge" when every major finding is, "nothing stands out" when there is none."""
    major = [x for x in found if not x["minor"]]
    judged = [x for x in major if not x["confidence"].noisy]
    if judged:
        return {"verdict": judged[0]["title"], "main": judged[0]["key"]}
    if major:
        return {"verdict": f"{confidence.NOISY} ({major[0]['title']}?)", "main": None,
                "clearer_run": confidence.CLEARER}
    return {"verdict": "nothing stands out", "main": None}


def rank(facts: Run | dict[str, Any]) -> list[dict[str, Any]]:
    """Apply every rule to the typed run (or the flat facts, typed once here); findings best first, each with its
    rule name as ``key`` and its :class:`confidence.Confidence`; major findings within the run's noise last."""
    out, run = [], facts if isinstance(facts, Run) else Run.of(facts)
    for rule in rules.RULES:  # a rule written for the Run (facts.typed) takes it, the rest the flat dict
        res: Optional[rules.Finding] = rule(run if getattr(rule, "typed", False) else run.facts)
        if res is not None:
            x = {"key": rule.__name__, **res._asdict(), "minor": res.score < rules.MIN_SCORE}
            x["confidence"] = confidence.rate(x, run)
            out.append(x)
    return sorted(out, key=lambda x: (x["minor"], x["confidence"].noisy, -x["score"]))


def _figures(run: Run) -> dict[str, Any]:
    """``figures`` of ``--json`` from the typed run: the step and its split, work, speed, memory peak, where they
    come from and the windows (described); an unknown figure is left out."""
    t, w, m = run.timing, run.work, run.memory
    values = {"step_ms": t.step_ms, **{f"{p}_share": confidence.phase_share(run, p) for p in (*PHASES, "idle")},
              "syncs_per_step": t.syncs_per_step, "device_busy_fraction": run.kernels.device_busy_fraction,
              "sync_share": t.sync_share, "tokens_per_step": w.tokens_per_step and int(w.tokens_per_step),
              "host_ops_per_step": w.host_ops_per_step, "flops_per_op": w.flops_per_op, "tokens_per_sec":
              w.tokens_per_sec, "mfu": w.mfu, "peak_mb": m.peak_mb, "memory_total_mb": m.memory_total_mb,
              "phase_source": t.phase_source, "step_source": t.step_source, "tokens_per_sec_source":
              w.tokens_per_sec_source, "windows": t.windows and confidence.describe(t.windows)}
    return {k: v for k, v in values.items() if v is not None and v != ""}


def format_verdict(v: dict[str, Any]) -> str:
    """The verdict as text for the terminal."""
    fig = v["figures"]
    lines = [f"tokenmill doctor: {v['run_dir']} ({v['device']}; read {', '.join(v['sources'])})"]
    if fig.get("step_ms"):
        split = ", ".join(f"{p} {100 * fig[f'{p}_share']:.0f}%" for p in (*PHASES, "idle") if f"{p}_share" in fig)
        lines.append(f"step {fig['step_ms']:.1f} ms: {split}  [{fig.get('phase_source', '')}]")
        if fig.get("windows"):
            where = "as in summary.json" if fig.get("tokens_per_sec_source", "summary.json") == "summary.json" else (
                "over the same windows (summary.json's are of other steps)")
            tps = (f", {fig['tokens_per_sec']:,.0f} tokens/s {where}" if fig.get("tokens_per_sec")
                   and "profiled" not in fig.get("step_source", "") else "")
            lines.append(f"  windows: step time = {fig.get('step_source', 'profile')}{tps}; "
                         f"split over {fig['windows']}")
    major = [x for x in v["findings"] if not x["minor"]]
    if not major:
        lines.append("Nothing stands out: no rule found a bottleneck worth a switch.")
    elif v["main"] is None:
        lines.append(f"Too noisy to judge: every finding is within the run's own noise. For a clearer run: "
                     f"{confidence.CLEARER}.")
    for i, x in enumerate(major, 1):
        rating = confidence.Confidence.of_json(x["confidence"])  # the verdict's JSON keys, typed back
        head = "Main bottleneck" if i == 1 and not rating.noisy else f"{i}." + " (too noisy to judge)" * rating.noisy
        lines.append(f"\n{head}: {x['title']} (expected gain ~{100 * x['score']:.0f}%)")
        lines.append(f"  {rating.label()}")
        lines += [*(f"  - {e}" for e in x["evidence"]), "  try, best first:"]
        for s in x["suggestions"]:
            lines.append(f"    {s['switch']:<44} {s['why']}" if s["switch"] else f"    {s['why']}")
    minor = [x for x in v["findings"] if x["minor"]]
    if minor:
        lines.append("\nMinor: " + "; ".join(f"{x['title']} (~{100 * x['score']:.0f}%)" for x in minor))
    from tokenmill.profiling.trial import candidates

    n = len(candidates(v, 2)) if major and "try" not in v and not v.get("config_error") else 0
    if n:  # only suggestions a run can measure (a config override or an environment setting)
        lines.append(f"\nMeasure the top suggestion{'s' if n > 1 else ''} on this machine: "
                     f"tokenmill doctor {v['run_dir']} --try {n}")
    return "\n".join(lines)
