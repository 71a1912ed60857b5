"""``tokenmill bench ladder NAME --estimate [--gpu NAME]``: every rung predicted by
:mod:`tokenmill.estimate` instead of run, beside the seed's reference figures.

Each rung's config is resolved exactly as for a real run (every earlier rung carried: nothing fails
in a prediction), then estimated for the rung's process count on the GPU (``--gpu``, else the one the
ladder's ``[ladder.reference] hardware`` names, else an H100 SXM). ``ladder.json`` keeps, per rung,
``estimate`` = {``peak_alloc_mb``, ``peak_reserved_mb``, ``step_ms``, ``tokens_per_sec``} (plus
``time_for_samples_s`` with ``[ladder] samples``), the whole prediction under ``estimate_detail``, and
``estimate_error`` = estimate / reference - 1 for every reference figure the rung has; the document's
``estimate.mean_abs_error`` averages those per metric. A rung whose ``needs`` fields do not exist is
skipped, as in a real run.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from tokenmill import atomic
from tokenmill import config as C
from tokenmill.bench import report
from tokenmill.bench.configs import rung_config
from tokenmill.bench.plot import write_png
from tokenmill.bench.schema import Ladder, LadderError
from tokenmill.errors import TokenmillError

ESTIMATE_KEYS = ("peak_alloc_mb", "peak_reserved_mb", "step_ms", "tokens_per_sec")
COMPARED = ("peak_alloc_mb", "peak_reserved_mb", "tokens_per_sec", "time_for_samples_s")
DEFAULT_GPU = "h100-sxm"


def ladder_gpu(ladder: Ladder, gpu: Optional[str] = None) -> str:
    """``gpu`` if given, else the first GPU named in ``[ladder.reference] hardware``, else an H100 SXM."""
    from tokenmill.estimate.gpus import gpu_spec

    if gpu:
        return gpu_spec(gpu).key
    for word in re.split(r"[\s,;()]+", ladder.reference_info.get("hardware", "")):
        try:
            key = gpu_spec(word).key if word else None
        except C.ConfigError:
            continue
        if key not in (None, "cpu"):
            return key
    return DEFAULT_GPU


def predict_rung(ladder: Ladder, i: int, gpu: str, cli_set: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """The record of rung ``i`` predicted on ``gpu`` (see the module doc)."""
    from tokenmill.estimate import estimate

    rung = ladder.rungs[i]
    rec = report.new_record(ladder, i, rung, list(range(i)))
    rec.update(metrics=None, estimate=None, estimate_detail=None, estimate_error={})
    missing = rung.missing_fields()
    if missing:
        rec["status"], rec["reason"] = "skipped", f"needs {', '.join(missing)} (not a tokenmill config field yet)"
        return rec
    try:
        rc = rung_config(ladder, i, None, cli_set)
    except LadderError as e:
        rec["status"], rec["reason"] = "failed", f"config: {e}"
        return rec
    rec["config"], rec["plan"] = rc.config.to_dict(), rc.plan.to_dict()
    try:
        est = estimate(rc.config, gpu, rung.nproc)
    except TokenmillError as e:
        rec["status"], rec["reason"] = "failed", f"estimate: {e}"
        return rec
    figures = est.short()
    if ladder.samples and est.tokens_per_sec:
        figures["time_for_samples_s"] = round(ladder.samples * rc.config.model.block_size / est.tokens_per_sec, 3)
    rec["status"], rec["estimate"], rec["estimate_detail"] = "estimated", figures, est.to_dict()
    rec["estimate_error"] = {k: figures[k] / ref - 1 for k, ref in rung.reference.items() if k in figures and ref}
    return rec


def estimate_beside(cfg: C.Config, nproc: int, summary: dict[str, Any]) -> dict[str, Any]:
    """For a rung measured on a CUDA GPU: ``estimate`` (the same four figures as in ``--estimate``) for
    the same config on that GPU, and ``estimate_error_vs_measured`` (estimate / measured - 1), so the
    estimator's error is a tracked figure.
    Never raises: a GPU missing from the table, or an estimator failure, is recorded as the reason."""
    from tokenmill.estimate import estimate

    try:
        est = estimate(cfg, summary.get("gpu_name") or "", nproc)
    except Exception as e:  # noqa: BLE001 - a prediction must never break a measured ladder
        return {"estimate": None, "estimate_reason": f"{type(e).__name__}: {e}"}
    figures = est.short()
    key = {"step_ms": "step_time_ms"}
    errors = {k: figures[k] / summary[key.get(k, k)] - 1 for k in ESTIMATE_KEYS if summary.get(key.get(k, k))}
    return {"estimate": figures, "estimate_error_vs_measured": errors}


def mean_errors(rungs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per compared metric: mean absolute relative error of the estimates against the references, and
    how many rungs it covers."""
    out = {}
    for k in COMPARED:
        errs = [abs(r["estimate_error"][k]) for r in rungs if k in (r.get("estimate_error") or {})]
        if errs:
            out[k] = {"mean_abs_error": sum(errs) / len(errs), "rungs": len(errs)}
    return out


def predict_ladder(ladder: Ladder, out_dir: str | Path, gpu: Optional[str] = None,
                   cli_set: Optional[dict[str, str]] = None, env: Optional[dict[str, Any]] = None,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
    """Predict every rung; write ``ladder.json``, ``ladder.md`` and ``ladder.png`` into ``out_dir``."""
    from tokenmill.bench.env import probe_environment
    from tokenmill.estimate.gpus import gpu_spec

    key = ladder_gpu(ladder, gpu)
    spec = gpu_spec(key)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = env if env is not None else probe_environment()
    doc = report.new_document(ladder, env, False, cli_set)
    doc["mode"] = "estimated"
    doc["gpu"] = f"{spec.name} (estimated)"
    doc["estimate"] = {"gpu": spec.name, "gpu_key": spec.key, "mean_abs_error": {}}
    log(f"tokenmill bench: ladder '{ladder.name}' ({len(ladder.rungs)} rungs) estimated for {spec.name} -> {out}")
    for i, rung in enumerate(ladder.rungs):
        rec = predict_rung(ladder, i, key, cli_set)
        doc["rungs"].append(rec)
        e = rec["estimate"]
        if e:
            log(f"[{i + 1:>2}/{len(ladder.rungs)}] {rung.name}: {e['tokens_per_sec']:,.0f} tok/s, peak alloc "
                f"{e['peak_alloc_mb'] / 1024:.2f} GB, reserved {e['peak_reserved_mb'] / 1024:.2f} GB")
        else:
            log(f"[{i + 1:>2}/{len(ladder.rungs)}] {rung.name}: {rec['status']}: {rec['reason']}")
    doc["estimate"]["mean_abs_error"] = mean_errors(doc["rungs"])
    atomic.write_json(out / "ladder.json", doc, default=str)
    atomic.write_text(out / "ladder.md", markdown(doc))
    note = write_png(doc, out / "ladder.png")
    log("")
    log(markdown_table(doc))
    log("")
    log(error_line(doc))
    log(f"wrote {out / 'ladder.json'}, {out / 'ladder.md'}" + (f", {out / 'ladder.png'}" if note is None else ""))
    if note:
        log(f"tokenmill bench: {note}")
    return doc


# ----------------------------------------------------------------------------------------------
# Report


def _err(v: Optional[float]) -> str:
    return "" if v is None else f"{100 * v:+.0f}%"


def _columns(doc: dict[str, Any]) -> list[tuple[str, Callable[[dict[str, Any]], str]]]:
    has_ref = {k: any(k in r["reference"] for r in doc["rungs"]) for k in COMPARED}
    samples = doc["ladder"]["samples"]

    def est(key, fmt):
        return lambda r: fmt((r["estimate"] or {}).get(key)) if r["estimate"] else ""

    def ref(key, fmt):
        return lambda r: fmt(r["reference"][key]) if key in r["reference"] else ""

    def err(key):
        return lambda r: _err((r.get("estimate_error") or {}).get(key))

    gb, num = report._gb, report._num
    cols: list[tuple[str, Callable]] = [("#", lambda r: str(r["index"])), ("rung", lambda r: r["name"])]
    cols.append(("est tok/s", est("tokens_per_sec", num)))
    if has_ref["tokens_per_sec"]:
        cols += [("ref tok/s", ref("tokens_per_sec", num)), ("err", err("tokens_per_sec"))]
    cols.append(("est step ms", est("step_ms", lambda v: num(v, "{:,.1f}"))))
    if samples:
        secs = lambda v: num(v, "{:,.2f}")  # noqa: E731
        cols.append((f"est s for {samples:,}", est("time_for_samples_s", secs)))
        if has_ref["time_for_samples_s"]:
            cols += [("ref s", ref("time_for_samples_s", secs)), ("err", err("time_for_samples_s"))]
    cols.append(("est peak alloc GB", est("peak_alloc_mb", gb)))
    if has_ref["peak_alloc_mb"]:
        cols += [("ref alloc GB", ref("peak_alloc_mb", gb)), ("err", err("peak_alloc_mb"))]
    cols.append(("est peak reserved GB", est("peak_reserved_mb", gb)))
    if has_ref["peak_reserved_mb"]:
        cols += [("ref reserved GB", ref("peak_reserved_mb", gb)), ("err", err("peak_reserved_mb"))]
    cols.append(("status", lambda r: "estimated" if r["status"] == "estimated"
                 else f"{r['status']}: {(r['reason'] or '').replace('|', '/')}"))
    return cols


def markdown_table(doc: dict[str, Any]) -> str:
    cols = _columns(doc)
    lines = ["| " + " | ".join(h for h, _ in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(f(r) for _, f in cols) + " |" for r in doc["rungs"]]
    return "\n".join(lines)


def error_line(doc: dict[str, Any]) -> str:
    errs = doc["estimate"]["mean_abs_error"]
    if not errs:
        return "no reference figures to compare the estimates with"
    parts = [f"{k} {100 * v['mean_abs_error']:.1f}% over {v['rungs']} rung(s)" for k, v in errs.items()]
    return "mean absolute error of the estimates against the seed's figures: " + "; ".join(parts)


def markdown(doc: dict[str, Any]) -> str:
    lad, e = doc["ladder"], doc["estimate"]
    info = lad["reference"]
    out = [
        f"# Ladder `{lad['name']}`, estimated for {e['gpu']}",
        "",
        lad["description"],
        "",
        "- nothing was run: every rung is predicted by `tokenmill estimate` (docs/estimate.md) from its "
        "resolved config, every earlier rung carried",
        f"- date {doc['date']}, tokenmill {doc.get('tokenmill_version') or '?'}, torch {doc['torch']}",
        "- memory: per-rank peak allocated and reserved (GB = 1024^3 bytes); time: the roofline model's step "
        "time and tokens/s (the whole job's for multi-GPU rungs)",
    ]
    if info or any(r["reference"] for r in doc["rungs"]):
        out.append(f"- ref = the seed's own figures ({info.get('source', 'seed')}; {info.get('hardware', '')}); "
                   "err = estimate / ref - 1")
        if info.get("note"):
            out.append(f"- {info['note']}")
    out.append(f"- {error_line(doc)}")
    return "\n".join(out + report.table_and_rungs(doc, "estimated", markdown_table, _peak_parts)) + "\n"


def _peak_parts(r: dict[str, Any]) -> Optional[str]:
    """The three largest parts of a rung's estimated peak."""
    d = r.get("estimate_detail")
    if not d:
        return None
    top = sorted(((v, k) for k, v in d["breakdown_mb"].items() if v >= 1), reverse=True)[:3]
    return " — at the peak: " + ", ".join(f"{k} {v / 1024:.2f} GB" for v, k in top)
