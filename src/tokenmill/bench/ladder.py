"""Run a ladder: every rung in order, each in a fresh subprocess; write ladder.json/.md/.png.

A rung is *measured*, *failed* (non-zero exit, time limit, no timed window: the reason is its
error line) or *skipped* (the machine lacks what it ``requires`` or a Python package it names in
``packages``, a config field it ``needs`` does not exist yet, or torch.compile on a CPU in --smoke).
Only measured rungs are carried into later rungs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from tokenmill import atomic
from tokenmill import config as C
from tokenmill.bench import report
from tokenmill.bench.configs import rung_config
from tokenmill.bench.env import gpu_label, probe_environment
from tokenmill.bench.report import new_record as _record
from tokenmill.bench.runner import run_train
from tokenmill.bench.schema import Ladder, LadderError, Rung

SMOKE_TIMEOUT_S = 300.0


def skip_reason(ladder: Ladder, rung: Rung, cfg, env: dict[str, Any], smoke: bool) -> Optional[str]:
    """Why this rung cannot be measured here, or None."""
    need = ladder.requirement(rung)
    device = cfg.train.device
    if need == "multi-gpu":
        n = max(rung.nproc, 2)
        if env.get("gpu_count", 0) < n:
            return f"needs {n} CUDA GPUs (found {env.get('gpu_count', 0)})"
    if need in ("cuda", "multi-gpu"):
        if not env.get("cuda_available"):
            return "needs a CUDA GPU (none visible)"
        if device in ("cpu", "mps"):
            return f"needs CUDA but train.device = '{device}'"
    absent = rung.missing_packages()
    if absent:
        return f"needs the Python package(s) {', '.join(absent)} (not installed: pip install {' '.join(absent)})"
    runs_on_cpu = device == "cpu" or (device == "auto" and not env.get("cuda_available"))
    if smoke and runs_on_cpu and cfg.compile.enabled:
        return "torch.compile on a CPU costs about a minute per graph; skipped in --smoke"
    return None


def gpu_warning(ladder: Ladder, env: dict[str, Any], smoke: bool, cli_set: Optional[dict[str, str]]) -> Optional[str]:
    """A warning when a ladder written for a CUDA GPU runs elsewhere for real (not --smoke)."""
    if smoke or not ladder.gpu:
        return None
    device = (cli_set or {}).get("train.device", "auto")
    if env.get("cuda_available") and device in ("auto", "cuda"):
        return None
    where = "no CUDA GPU is visible" if not env.get("cuda_available") else f"--set train.device={device}"
    return (f"ladder '{ladder.name}' is written for a CUDA GPU, but {where}: its rungs run on the CPU (or are "
            "skipped), the figures say nothing about GPU speed or memory, and no comparison with the seed's "
            "reference figures is made. Use --smoke to check the machinery quickly.")


def run_ladder(
    ladder: Ladder,
    out_dir: str | Path,
    smoke: bool = False,
    timed_steps: Optional[int] = None,
    cli_set: Optional[dict[str, str]] = None,
    timeout_s: Optional[float] = None,
    env: Optional[dict[str, Any]] = None,
    log: Callable[[str], None] = print,
    echo_runs: bool = True,
    only: Optional[set[str]] = None,
) -> dict[str, Any]:
    """Run every rung (or those named in ``only``) and write ``ladder.json`` (after each rung), ``ladder.md`` and
    ``ladder.png``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = env if env is not None else probe_environment()
    limit = timeout_s or (min(ladder.timeout_s, SMOKE_TIMEOUT_S) if smoke else ladder.timeout_s)
    doc = report.new_document(ladder, env, smoke, cli_set)
    log(f"tokenmill bench: ladder '{ladder.name}' ({len(ladder.rungs)} rungs) on {gpu_label(env)}"
        f"{' [smoke]' if smoke else ''} -> {out}")
    warning = gpu_warning(ladder, env, smoke, cli_set)
    if warning:
        doc["warnings"].append(warning)
        log(f"tokenmill bench: warning: {warning}")
    carried: list[int] = []
    echo = (lambda line: log(f"        | {line}")) if echo_runs else None
    for i, rung in enumerate(ladder.rungs):
        rec = _record(ladder, i, rung, carried)
        doc["rungs"].append(rec)
        log(f"[{i + 1:>2}/{len(ladder.rungs)}] {rung.name}: {rung.explain}")
        if only is not None and rung.name not in only:
            status, reason = _not_selected(ladder, i, rec, carried, cli_set, smoke, timed_steps, env)
        else:
            status, reason = _run_rung(ladder, i, rec, carried, out, cli_set, smoke, timed_steps, env, limit, echo)
        rec["status"], rec["reason"] = status, reason
        if status == "measured":
            carried.append(i)
            report.derive(doc)
            log(f"        -> {report.one_line(rec)}")
        else:
            log(f"        -> {status}: {reason}")
        _write_json(out, doc)
    report.derive(doc)
    _write_json(out, doc)
    report.write_outputs(doc, out, log)
    return doc


def _not_selected(ladder: Ladder, i: int, rec: dict[str, Any], carried: list[int], cli_set: Optional[dict[str, str]],
                  smoke: bool, timed_steps: Optional[int], env: dict[str, Any]) -> tuple[str, str]:
    """A rung left out by ``--rungs``: not run, but where it would have run its switches are carried, so each
    selected rung trains the config it has in the whole ladder."""
    rung = ladder.rungs[i]
    if rung.missing_fields():
        return "skipped", "not selected (--rungs)"
    try:
        rc = rung_config(ladder, i, carried, cli_set, smoke, timed_steps)
    except LadderError as e:
        return "failed", f"config: {e}"
    rec["config"] = rc.config.to_dict()
    if why := skip_reason(ladder, rung, rc.config, env, smoke):
        return "skipped", f"not selected (--rungs); it would be skipped here: {why}"
    carried.append(i)
    return "skipped", "not selected (--rungs); its switches are carried into the later rungs"


def _run_rung(ladder: Ladder, i: int, rec: dict[str, Any], carried: list[int], out: Path,
              cli_set: Optional[dict[str, str]], smoke: bool, timed_steps: Optional[int], env: dict[str, Any],
              limit: float, echo: Optional[Callable[[str], None]]) -> tuple[str, Optional[str]]:
    """Resolve, check and run one rung, filling ``rec``; returns (status, reason)."""
    rung = ladder.rungs[i]
    missing = rung.missing_fields()
    if missing:
        specs = list(C.field_specs())
        return "skipped", "; ".join(f"needs {k} (not a tokenmill config field yet).{C._closest(k, specs)}"
                                    for k in missing)
    try:
        rc = rung_config(ladder, i, carried, cli_set, smoke, timed_steps)
    except LadderError as e:
        return "failed", f"config: {e}"
    rec["config"] = rc.config.to_dict()
    rec["plan"] = rc.plan.to_dict()
    why = skip_reason(ladder, rung, rc.config, env, smoke)
    if why:
        return "skipped", why
    run_dir = out / "rungs" / f"{i:02d}-{rung.name}"
    rec["run_dir"] = str(run_dir.relative_to(out))
    res = run_train(rc.config, run_dir, limit, rung.launcher, rung.nproc, echo)
    rec.update(command=res.command, wall_s=round(res.wall_s, 2), summary=res.summary, oom=res.oom,
               stderr_tail=None if res.ok else res.stderr_tail)
    if res.ok and res.summary.get("device") == "cuda" and not smoke:  # the estimator's error, tracked
        from tokenmill.bench.predict import estimate_beside

        rec.update(estimate_beside(rc.config, rung.nproc, res.summary))
    return ("measured", None) if res.ok else ("failed", res.reason)


def _write_json(out: Path, doc: dict[str, Any]) -> None:
    atomic.write_json(out / "ladder.json", doc, default=str)
