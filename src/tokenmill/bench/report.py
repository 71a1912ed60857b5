"""Derived figures of a ladder run and its reports: ``ladder.json`` content, ``ladder.md``, terminal.

Per measured rung (``rung["metrics"]``): steady-state tokens/s (median of the timed windows, with
min/max), step time, MFU (against the peak of the rung's math mode, and ``mfu_bf16`` against the
bf16 dense peak), peak allocated/reserved memory (CUDA), final loss and its change from the
baseline's (``loss_flag`` past ``[ladder.measure] loss_tolerance``), speedup over the previous
*measured* rung and over the baseline (the first measured rung), and with ``[ladder] samples`` the
time for that many samples = samples * block_size / tokens_per_sec. In a ``--smoke`` run, a rung whose switch
the tiny shapes undid (``flattened``: a batch of 4 or 8 becomes 1, as the previous rung's) reports no change
over the previous rung: "flattened by --smoke" instead.

Reference figures from the seeds are compared by direction, for rungs measured on a CUDA GPU outside
--smoke only: the headline metric's change from the previous measured rung, in the seed and here,
each classed better / worse / same (within ``SAME_WITHIN``), and ``agrees`` says whether the
classes match.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import tokenmill
from tokenmill import atomic
from tokenmill.bench.env import gpu_label
from tokenmill.bench.plot import write_png
from tokenmill.bench.references import compares_references, on_gpu
from tokenmill.bench.schema import Ladder, Rung
from tokenmill.model.flops import peak_flops

HEADLINE_METRIC = {"tokens_per_sec": "tokens_per_sec", "peak_alloc_mb": "peak_alloc_mb",
                   "time_for_samples": "time_for_samples_s"}
HIGHER_IS_BETTER = {"tokens_per_sec": True, "time_for_samples_s": False, "peak_alloc_mb": False,
                    "peak_reserved_mb": False}
WORDS = {"tokens_per_sec": ("faster", "slower"), "time_for_samples_s": ("faster", "slower"),
         "peak_alloc_mb": ("less memory", "more memory"), "peak_reserved_mb": ("less memory", "more memory")}
REF_LABELS = {"tokens_per_sec": "ref tok/s", "time_for_samples_s": "ref s", "peak_alloc_mb": "ref alloc GB",
              "peak_reserved_mb": "ref reserved GB"}
SAME_WITHIN = 0.03  # a change under 3% counts as "same"


def new_document(ladder: Ladder, env: dict[str, Any], smoke: bool, cli_set: Optional[dict[str, str]]) -> dict[str, Any]:
    return {
        "format": "tokenmill-ladder",
        "version": 1,
        "ladder": {
            "name": ladder.name,
            "description": ladder.description,
            "source": ladder.source,
            "base_preset": ladder.base_preset,
            "headline": ladder.headline,
            "samples": ladder.samples,
            "requires": ladder.requires,
            "gpu": ladder.gpu,
            "base": ladder.base,
            "measure": asdict(ladder.measure),
            "reference": ladder.reference_info,
        },
        "smoke": smoke,
        "cli_set": cli_set or {},
        "gpu": gpu_label(env),
        "torch": env.get("torch"),
        "cuda": env.get("cuda"),
        "date": env.get("date"),
        "tokenmill_version": tokenmill.__version__,
        "git_commit": env.get("git_commit"),
        "git_dirty": env.get("git_dirty"),
        "host": env.get("host"),
        "environment": env,
        "warnings": [],
        "baseline_rung": None,
        "rungs": [],
    }


def new_record(ladder: Ladder, i: int, rung: Rung, carried: list[int]) -> dict[str, Any]:
    """The record of rung ``i`` in ``ladder.json`` before it is run or predicted (``carried``: the
    earlier rungs whose switches it keeps)."""
    return {
        "index": i,
        "name": rung.name,
        "explain": rung.explain,
        "set": rung.set,
        "requires": ladder.requirement(rung),
        "needs": rung.needs,
        "packages": rung.packages,
        "launcher": rung.launcher,
        "nproc": rung.nproc,
        "reference": rung.reference,
        "dropped": [ladder.rungs[j].name for j in range(i) if j not in carried],
        "status": None,
        "reason": None,
        "config": None,
        "plan": None,
        "summary": None,
    }


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if (a is not None and b) else None


def _direction(change: Optional[float], metric: str) -> Optional[str]:
    """'better' / 'worse' / 'same' for a relative change ``new/old - 1`` of ``metric``."""
    if change is None:
        return None
    if abs(change) < SAME_WITHIN:
        return "same"
    up = change > 0
    return "better" if up == HIGHER_IS_BETTER[metric] else "worse"


def mfu_bf16(summary: dict[str, Any]) -> Optional[float]:
    """MFU against the GPU's bf16 dense peak whatever the rung's math mode: comparable across rungs."""
    fpt, tps, gpu = summary.get("flops_per_token"), summary.get("tokens_per_sec"), summary.get("gpu_name")
    peak = peak_flops(gpu, "bf16") if gpu else None
    if not (fpt and tps and peak):
        return None
    return fpt * tps / (peak * (summary.get("world_size") or 1))  # tokens/s are the whole job's


def rung_metrics(rung: dict[str, Any], samples: Optional[int]) -> dict[str, Any]:
    """A rung's figures, all from its run's ``summary.json``: tokens/s is the median over the timed windows
    and the step time is tokens per step / that tokens/s (one figure, so the two always agree; a summary of
    an older version that took the median step time on its own is recomputed); ``windows`` says which."""
    s = rung.get("summary") or {}
    m = {k: s.get(k) for k in ("tokens_per_sec", "tokens_per_sec_min", "tokens_per_sec_max", "step_time_ms",
                               "mfu", "peak_alloc_mb", "peak_reserved_mb", "final_loss", "params")}
    if s.get("tokens_per_step") and m["tokens_per_sec"]:
        m["step_time_ms"] = 1000.0 * s["tokens_per_step"] / m["tokens_per_sec"]
    m["windows"] = windows_used(s)
    m["mfu_bf16"] = mfu_bf16(s)
    m["final_loss_finite"] = m["final_loss"] is not None and math.isfinite(m["final_loss"])
    m["tasks"] = task_scores(s)
    tps = m["tokens_per_sec"]
    if samples and tps:
        block = rung["config"]["model"]["block_size"]
        m["time_for_samples_s"] = samples * block / tps
        m["time_extrapolated"] = not (rung.get("plan") or {}).get("covers_samples", False)
    return m


def task_scores(summary: dict[str, Any]) -> dict[str, float]:
    """The rung's task scores at its last evaluation (``eval.tasks``: ``tasks/TASK/METRIC`` in summary.json)."""
    return {k[len("tasks/"):]: float(v) for k, v in summary.items()
            if k.startswith("tasks/") and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _task_columns(doc: dict[str, Any]) -> list[tuple[str, Callable[[dict[str, Any]], str]]]:
    """A column per task score any rung measured (a ladder run with --set eval.tasks=...): the comparison at
    equal tokens beside the speed."""
    names = sorted({k for r in doc["rungs"] if r.get("metrics") for k in (r["metrics"].get("tasks") or {})})
    return [(name, lambda r, name=name: _num((r["metrics"].get("tasks") or {}).get(name), "{:.4f}")
             if r.get("metrics") else "") for name in names]


def windows_used(summary: dict[str, Any]) -> Optional[str]:
    """``median of 9 windows after step 10``: the windows a run's tokens/s and step time come from."""
    n = summary.get("timing_windows") or len(summary.get("tokens_per_sec_windows") or [])
    if not n:
        return None
    after = summary.get("timing_from_step")
    return f"median of {n} window{'s' if n > 1 else ''}" + (f" after step {after}" if after is not None else "")


def derive(doc: dict[str, Any]) -> None:
    """(Re)compute ``metrics`` and ``reference_check`` of every rung, in place."""
    lad = doc["ladder"]
    headline = HEADLINE_METRIC[lad["headline"]]
    tolerance = lad["measure"].get("loss_tolerance", 0.05)
    prev = base = None
    for r in doc["rungs"]:
        r["metrics"] = None
        r["reference_check"] = None
        if r.get("status") != "measured":
            continue
        m = rung_metrics(r, lad["samples"])
        base = base or r
        base_tps = m["tokens_per_sec"] if base is r else base["metrics"]["tokens_per_sec"]
        m["vs_rung"] = prev["name"] if prev else None
        m["flattened"] = flattened(r, prev) if doc["smoke"] else []
        whole = bool(m["flattened"]) and len(m["flattened"]) == len(r["set"])  # the rung's switch ran as before
        m["speedup_vs_prev"] = _ratio(m["tokens_per_sec"], prev["metrics"]["tokens_per_sec"]) if prev and not whole else None
        m["speedup_vs_baseline"] = _ratio(m["tokens_per_sec"], base_tps)
        for key in ("peak_alloc_mb", "time_for_samples_s"):
            old = prev["metrics"].get(key) if prev else None
            q = _ratio(m.get(key), old)
            m[f"{key}_change_vs_prev"] = q - 1 if q is not None and not whole else None
        _loss_check(m, m if base is r else base["metrics"], tolerance)
        r["metrics"] = m
        if not doc["smoke"] and on_gpu(r):  # smoke (tiny shapes) or CPU figures: nothing to compare
            r["reference_check"] = _reference_check(r, prev, headline)
        prev = r
    doc["baseline_rung"] = base["name"] if base else None


def flattened(r: dict[str, Any], prev: Optional[dict[str, Any]]) -> list[str]:
    """The keys of rung ``r``'s switch whose value in its resolved config is the previous measured rung's: a
    ``--smoke`` run's shrinking flattened them (a batch of 4 or 8 becomes 1, as the baseline's). All of them: the
    rung measured nothing its switch buys, and no speedup over the previous rung is reported."""
    if prev is None or not r.get("config") or not prev.get("config"):
        return []
    def value(rec: dict[str, Any], key: str) -> Any:
        section, _, name = key.partition(".")
        return (rec["config"].get(section) or {}).get(name, object())
    return [k for k in r["set"] if value(r, k) == value(prev, k)]


def _loss_check(m: dict[str, Any], base: dict[str, Any], tolerance: float) -> None:
    """``loss_change_vs_baseline`` and ``loss_flag``: non-finite, or further than ``tolerance``
    (relative) from the baseline rung's final loss."""
    loss, ref = m["final_loss"], base["final_loss"]
    change = None
    if m["final_loss_finite"] and base["final_loss_finite"] and ref:
        change = loss / ref - 1
    m["loss_change_vs_baseline"] = change
    m["loss_flag"] = (loss is not None and not m["final_loss_finite"]) or (change is not None and abs(change) > tolerance)


def _reference_check(r: dict[str, Any], prev: Optional[dict[str, Any]], metric: str) -> Optional[dict[str, Any]]:
    ref_now = r["reference"].get(metric)
    if ref_now is None:
        return None
    out = {"metric": metric, "reference": ref_now, "vs_rung": prev["name"] if prev else None,
           "reference_change": None, "measured_change": None, "reference_direction": None,
           "measured_direction": None, "agrees": None}
    if prev is None or prev["reference"].get(metric) is None:
        return out
    out["reference_change"] = ref_now / prev["reference"][metric] - 1
    q = _ratio(r["metrics"].get(metric), prev["metrics"].get(metric))
    out["measured_change"] = q - 1 if q is not None else None
    out["reference_direction"] = _direction(out["reference_change"], metric)
    out["measured_direction"] = _direction(out["measured_change"], metric)
    if out["measured_direction"] is not None:
        out["agrees"] = out["reference_direction"] == out["measured_direction"]
    return out


# ----------------------------------------------------------------------------------------------
# Formatting


def _num(v: Optional[float], fmt: str = "{:,.0f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def _gb(mb: Optional[float]) -> str:
    return "n/a" if mb is None else f"{mb / 1024:.2f}"


def _pct(change: Optional[float]) -> str:
    return "" if change is None else f"{100 * change:+.0f}%"


def _x(v: Optional[float]) -> str:
    return "" if v is None else f"x{v:.2f}"


def one_line(r: dict[str, Any]) -> str:
    m = r["metrics"] or {}
    parts = [f"{_num(m.get('tokens_per_sec'))} tok/s"]
    if m.get("speedup_vs_prev"):
        parts.append(f"{_x(m['speedup_vs_prev'])} vs prev")
    if m.get("flattened"):
        parts.append(_flat(r))
    if m.get("time_for_samples_s") is not None:
        parts.append(f"{m['time_for_samples_s']:.2f} s for the samples")
    if m.get("peak_alloc_mb") is not None:
        parts.append(f"peak alloc {_gb(m['peak_alloc_mb'])} GB")
    if m.get("final_loss") is not None:
        parts.append(f"loss {m['final_loss']:.4f}")
    return ", ".join(parts)


def _columns(doc: dict[str, Any]) -> list[tuple[str, Callable[[dict[str, Any]], str]]]:
    lad = doc["ladder"]
    headline = HEADLINE_METRIC[lad["headline"]]
    has_ref = {k: any(k in r["reference"] for r in doc["rungs"]) for k in HIGHER_IS_BETTER}
    compare = compares_references(doc)
    samples = lad["samples"]

    def met(key, fmt=_num):
        return lambda r: fmt((r["metrics"] or {}).get(key)) if r["metrics"] else ""

    def ref(key, fmt=_num):
        return lambda r: fmt(r["reference"].get(key)) if key in r["reference"] else ""

    def ref_cols(key):
        if not has_ref[key]:
            return []
        fmt = _gb if key.endswith("_mb") else (lambda v: _num(v, "{:,.2f}") if key.endswith("_s") else _num(v))
        cols = [(REF_LABELS[key], ref(key, fmt))]
        if key == headline and compare:
            cols += [("ref Δ / ours Δ", _ref_change), ("agrees", _agrees)]
        return cols

    def tps(r):
        m = r["metrics"]
        if not m:
            return ""
        return f"{_num(m['tokens_per_sec'])} ({_num(m['tokens_per_sec_min'])}–{_num(m['tokens_per_sec_max'])})"

    def time_s(r):
        m = r["metrics"]
        if not m or m.get("time_for_samples_s") is None:
            return ""
        return f"{m['time_for_samples_s']:.2f}" + ("*" if m.get("time_extrapolated") else "")

    cols: list[tuple[str, Callable]] = [("#", lambda r: str(r["index"])), ("rung", lambda r: r["name"])]
    time_head = f"time for {samples:,} samples (s)" if samples else ""
    if headline == "time_for_samples_s":
        cols += [(time_head, time_s), ("Δ time", met("time_for_samples_s_change_vs_prev", _pct))]
        cols += ref_cols("time_for_samples_s")
    if headline == "peak_alloc_mb":
        cols += [("peak alloc GB", met("peak_alloc_mb", _gb)), ("Δ mem", met("peak_alloc_mb_change_vs_prev", _pct))]
        cols += ref_cols("peak_alloc_mb")
    cols += [("tok/s (min–max)", tps), ("vs prev", lambda r: _flat(r) or met("speedup_vs_prev", _x)(r)),
             ("vs base", met("speedup_vs_baseline", _x))]
    cols += ref_cols("tokens_per_sec")
    pct = lambda v: _num(v and 100 * v, "{:.1f}%")  # noqa: E731
    cols += [("windows", lambda r: (r["metrics"] or {}).get("windows") or "" if r["metrics"] else ""),
             ("step ms", met("step_time_ms", lambda v: _num(v, "{:,.1f}"))),
             ("MFU", met("mfu", pct)), ("MFU bf16 peak", met("mfu_bf16", pct))]
    if headline != "peak_alloc_mb":
        cols += [("peak alloc GB", met("peak_alloc_mb", _gb))]
        cols += ref_cols("peak_alloc_mb")
    cols += [("peak reserved GB", met("peak_reserved_mb", _gb))] + ref_cols("peak_reserved_mb")
    if any(r.get("estimate") for r in doc["rungs"]):  # tokenmill estimate beside the measurement

        def est(key):
            return lambda r: _gb(r["estimate"].get(key)) if r.get("estimate") else ""

        cols += [("est alloc GB", est("peak_alloc_mb")), ("est reserved GB", est("peak_reserved_mb"))]
    if samples and headline != "time_for_samples_s":
        cols += [(time_head, time_s)] + ref_cols("time_for_samples_s")
    cols += [("final loss", _loss)] + _task_columns(doc) + [("status", _status)]
    return cols


def _flat(r: dict[str, Any]) -> str:
    """"flattened by --smoke" where the smoke shapes undid the rung's switch (all of it), naming the keys where
    only some of it; empty otherwise."""
    keys = (r.get("metrics") or {}).get("flattened") or []
    if not keys:
        return ""
    whole = len(keys) == len(r["set"])
    return "flattened by --smoke" + ("" if whole else f" ({', '.join(keys)})")


def _loss(r: dict[str, Any]) -> str:
    m = r["metrics"]
    if not m:
        return ""
    text = _num(m["final_loss"], "{:.4f}")
    if m.get("loss_flag"):
        change = m.get("loss_change_vs_baseline")
        text += f" ⚠ {_pct(change)} vs base" if change is not None else " ⚠"
    return text


def _ref_change(r: dict[str, Any]) -> str:
    c = r.get("reference_check")
    if not c or c["reference_change"] is None:
        return ""
    return f"{_pct(c['reference_change'])} / {_pct(c['measured_change']) or 'n/a'}"


def _agrees(r: dict[str, Any]) -> str:
    c = r.get("reference_check")
    if not c or c["reference_direction"] is None:
        return ""
    better, worse = WORDS[c["metric"]]
    word = {"better": better, "worse": worse, "same": "same"}
    ref = word[c["reference_direction"]]
    if c["agrees"] is None:
        return f"ref {ref}; ours n/a"
    return f"yes ({ref})" if c["agrees"] else f"NO (ref {ref}, ours {word[c['measured_direction']]})"


def _status(r: dict[str, Any]) -> str:
    if r["status"] == "measured":
        return "ok" + (f"; without {', '.join(r['dropped'])}" if r["dropped"] else "")
    return f"{r['status']}: {(r['reason'] or '').replace('|', '/')}"


def markdown_table(doc: dict[str, Any]) -> str:
    cols = _columns(doc)
    lines = ["| " + " | ".join(h for h, _ in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in doc["rungs"]:
        lines.append("| " + " | ".join(f(r) for _, f in cols) + " |")
    return "\n".join(lines)


def markdown(doc: dict[str, Any]) -> str:
    lad = doc["ladder"]
    commit = (doc["git_commit"] or "unknown")[:12] + (" (with local changes)" if doc.get("git_dirty") else "")
    version = doc.get("tokenmill_version") or "?"
    out = [
        f"# Ladder `{lad['name']}`" + (" (smoke run: tiny shapes, figures mean nothing)" if doc["smoke"] else ""),
        "",
        lad["description"],
        "",
        f"- GPU: {doc['gpu']}; torch {doc['torch']}, CUDA {doc['cuda']}",
        f"- date {doc['date']}, host {doc['host']}, tokenmill {version}, commit {commit}",
        f"- headline: {lad['headline']}; baseline rung: {doc['baseline_rung']}",
        "- tokens/s: median over the timed log windows (min–max in brackets; `windows`: how many, after which "
        "step), warm-up steps excluded; step ms = tokens per step / that tokens/s (one figure); MFU from the same "
        "tokens/s; vs prev / vs base: tokens/s ratios to the previous measured rung and to the baseline",
        "- MFU: against the dense peak of the rung's math mode (fp32, tf32 or bf16); MFU bf16 peak: against "
        "the bf16 dense peak for every rung (comparable across rungs)",
        f"- final loss: ⚠ = more than {100 * lad['measure'].get('loss_tolerance', 0.05):.0f}% from the "
        "baseline rung's, or not finite (on synthetic uniform token ids every rung ends near ln(vocab))",
    ]
    out[2:2] = [f"> **warning**: {w}\n" for w in doc.get("warnings", [])]  # under the title
    if lad["samples"]:
        out.append(f"- time for {lad['samples']:,} samples = samples x block_size / tokens/s; "
                   "* = extrapolated (the timed steps covered fewer samples)")
    if lad["reference"] or any(r["reference"] for r in doc["rungs"]):
        info = lad["reference"]
        line = f"- ref = the seed's own figures ({info.get('source', 'seed')}; {info.get('hardware', '')}), not measured here; "
        if compares_references(doc):
            line += (f"Δ compares each rung with the previous measured rung, changes under {100 * SAME_WITHIN:.0f}% "
                     "count as same")
        else:
            line += "not compared: " + ("a --smoke run" if doc["smoke"] else "this run was not on a CUDA GPU")
        out.append(line)
        if info.get("note"):
            out.append(f"- {info['note']}")
    return "\n".join(out + table_and_rungs(doc, "measured")) + "\n"


def table_and_rungs(doc: dict[str, Any], done: str, table=None, detail=None) -> list[str]:
    """The ``--set`` line, the table and the "Rungs" list (each rung's switches; the status and reason of
    a rung that is not ``done``, or ``detail(rung)`` where that gives text) of a ladder's Markdown."""
    out = [f"- --set: {doc['cli_set']}"] if doc["cli_set"] else []
    out += ["", (table or markdown_table)(doc), "", "## Rungs", ""]
    for r in doc["rungs"]:
        what = ", ".join(f"`{k} = {v!r}`" for k, v in r["set"].items()) or "(baseline)"
        line = f"{r['index']}. **{r['name']}**: {r['explain']} {what}"
        extra = detail(r) if detail else None
        if extra:
            line += extra
        elif r["status"] != done:
            line += f" — {r['status']}: {r['reason']}"
        out.append(line)
    return out


def write_outputs(doc: dict[str, Any], out: Path, log: Callable[[str], None]) -> None:
    """ladder.md and ladder.png (ladder.json is written by the runner); prints the table."""
    atomic.write_text(out / "ladder.md", markdown(doc))
    note = write_png(doc, out / "ladder.png")
    log("")
    log(markdown_table(doc))
    log("")
    log(f"wrote {out / 'ladder.json'}, {out / 'ladder.md'}" + (f", {out / 'ladder.png'}" if note is None else ""))
    if note:
        log(f"tokenmill bench: {note}")
    for w in doc.get("warnings", []):  # again at the end, where it is seen
        log(f"tokenmill bench: warning: {w}")
