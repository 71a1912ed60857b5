"""``tokenmill doctor RUN_DIR --try N``: measure the doctor's advice instead of trusting it.

The top ``N`` suggestions that are config overrides (or environment settings) are tried as short
A/B runs of the run's own ``config.toml``: A is the config as it is, B adds one suggestion. Every run
is a fresh ``python -m tokenmill train`` process (as ``tokenmill bench`` launches them) with the same
number of steps and the same timing warm-up, and the order alternates round by round (A B1 .. BN,
then BN .. B1 A, ...), so that drift in the machine's load falls on both sides alike.

Each B run is compared with the A run of its round: the change in steady-state tokens/s, in
end-to-end tokens/s (tokens trained / wall-clock time of the training, evaluation and checkpoints
included) and in the memory peak (CUDA: the allocator's peak; CPU: the process's peak resident
memory). The finding's ``measure`` picks the figure that decides: a suggestion is *confirmed* when
every round improves it and the median change is larger than the baseline's own spread (the
difference between the A runs), *worse* when every round makes it worse by more than that spread,
and *not confirmed* otherwise.
"""

from __future__ import annotations

import os
import shlex
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from tokenmill import atomic
from tokenmill.errors import DoctorError
from tokenmill.profiling.run_files import read_summary

# figure -> (key in a run's result, True when higher is better)
FIGURES = {"speed": ("tokens_per_sec", True), "wall": ("wall_tokens_per_sec", True), "memory": ("peak_mb", False)}
MIN_CHANGE = 0.02  # a confirmed change is at least 2%, however quiet the baseline


def candidates(verdict: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The first ``n`` distinct suggestions that can be run (an override or an environment setting),
    findings best first, each finding's suggestions in order; major findings before minor ones."""
    out, seen = [], set()
    for finding in sorted(verdict["findings"], key=lambda x: (x["minor"], -x["score"])):
        for s in finding["suggestions"]:
            env = s.get("env") or {}
            if not s.get("switch") and not env:
                continue
            key = (s.get("switch"), tuple(sorted(env.items())))
            if key in seen:
                continue
            seen.add(key)
            out.append({"switch": s.get("switch"), "env": env, "why": s["why"], "finding": finding["key"],
                        "measure": finding.get("measure", "speed")})
            if len(out) == n:
                return out
    return out


def run_trials(run_dir: str | Path, verdict: dict[str, Any], n: int, steps: int = 30, repeats: int = 3,
               timeout_s: float = 600.0, echo: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
    """Try the top ``n`` suggestions of ``verdict`` on ``run_dir``'s config; returns the report (also
    written to ``RUN_DIR/doctor_try.json``)."""
    run_dir = Path(run_dir)
    config = run_dir / "config.toml"
    if not config.is_file():
        raise DoctorError(f"--try needs the run's config: '{config}' does not exist (runs written by "
                          "`tokenmill train` or `tokenmill profile` have one).")
    if n < 1 or steps < 2 or repeats < 1:
        raise DoctorError("--try N needs N >= 1, --try-steps >= 2 and --try-repeats >= 1.")
    if verdict.get("config_error"):  # every try trains the run's config as it is: each run would fail
        raise DoctorError(f"--try trains the run's config, and '{config}' does not load: {verdict['config_error']}")
    tries = candidates(verdict, n)
    report: dict[str, Any] = {"steps": steps, "repeats": repeats, "order": [], "baseline": [], "tries": []}
    if not tries:
        report["note"] = "no suggestion of this verdict is a config override or an environment setting"
        return report
    for t in tries:
        t["runs"] = []
    work = Path(tempfile.mkdtemp(prefix="tokenmill-try-"))
    try:
        for r in range(repeats):
            arms = [None, *range(len(tries))]  # None: the baseline
            for arm in (arms if r % 2 == 0 else arms[::-1]):
                label = "A" if arm is None else f"B{arm + 1}"
                t = None if arm is None else tries[arm]
                if echo:
                    echo(f"tokenmill doctor --try: round {r + 1}/{repeats}, {label}"
                         + ("" if t is None else f": {_describe(t)}"))
                res = run_one(config, work / f"{r}-{label}", steps, t, timeout_s)
                res["round"] = r
                report["order"].append(label)
                (report["baseline"] if t is None else t["runs"]).append(res)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for t in tries:
        t.update(compare(report["baseline"], t["runs"], t["measure"]))
    report["tries"] = tries
    atomic.write_json(run_dir / "doctor_try.json", report)
    return report


def _describe(t: dict[str, Any]) -> str:
    env = " ".join(f"{k}={v}" for k, v in t["env"].items())
    return " ".join(x for x in (env, t["switch"] or "") if x)


def run_one(config: Path, run_dir: Path, steps: int, t: Optional[dict[str, Any]], timeout_s: float) -> dict[str, Any]:
    """One training process: the run's config, ``steps`` steps, the suggestion's overrides and
    environment; its tokens/s, end-to-end tokens/s and memory peak."""
    from tokenmill.bench.runner import failure_reason, train_command

    words = shlex.split(t["switch"]) if t and t["switch"] else []
    given = set(words[::2])
    fixed = {"--train.max_steps": str(steps), "--checkpoint.save_final": "false", "--log.progress": "plain",
             "--log.tensorboard": "false"}
    cmd = train_command(config, run_dir) + words
    for k, v in fixed.items():
        if k not in given:
            cmd += [k, v]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(t["env"] if t else {}))
    run_dir.mkdir(parents=True)
    t0 = time.perf_counter()
    with open(run_dir / "stderr.log", "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
        rss_kb = _wait(proc, timeout_s)
    wall = time.perf_counter() - t0
    out: dict[str, Any] = {"ok": False, "process_s": wall}
    summary_path = run_dir / "summary.json"
    if proc.returncode != 0 or not summary_path.is_file():
        reason = "timed out" if rss_kb is None else failure_reason((run_dir / "stderr.log").read_text(), proc.returncode)
        return {**out, "reason": reason}
    s = read_summary(summary_path)  # checked: a damaged summary is one error naming the file and field
    train_s = s.get("wall_s") or (summary_path.stat().st_mtime - (run_dir / "config.toml").stat().st_mtime)
    tokens = (s.get("tokens_per_step") or 0) * ((s.get("steps") or 0) - (s.get("start_step") or 0))
    peak = s.get("peak_alloc_mb") if s.get("device") == "cuda" else (rss_kb / 1024 if rss_kb else None)
    lo, hi, tps = s.get("tokens_per_sec_min"), s.get("tokens_per_sec_max"), s.get("tokens_per_sec")
    out["window_spread"] = (hi - lo) / tps if lo and hi and tps else None  # within the run, over its windows
    return {**out, "ok": bool(s.get("tokens_per_sec")), "tokens_per_sec": s.get("tokens_per_sec"),
            "wall_tokens_per_sec": tokens / train_s if train_s > 0 else None, "train_s": train_s, "peak_mb": peak,
            "peak_source": "CUDA allocator peak" if s.get("device") == "cuda" else "peak resident memory",
            "config": _read_values(run_dir / "config.toml", given)}


def _wait(proc: subprocess.Popen, timeout_s: float) -> Optional[int]:
    """Wait for the process; its peak resident memory in KB (Linux ``ru_maxrss``), or None when it ran
    past ``timeout_s`` (then it and its children are killed)."""
    from tokenmill.bench.runner import _kill_group

    deadline = time.monotonic() + timeout_s
    try:
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                return usage.ru_maxrss
            if time.monotonic() > deadline:
                _kill_group(proc)
                return None
            time.sleep(0.05)
    except BaseException:  # Ctrl-C or SIGTERM (its own session: nothing else ends it)
        _kill_group(proc)
        raise


def _read_values(path: Path, flags: set[str]) -> dict[str, Any]:
    """The values the run resolved for the overridden keys (proof the override took effect)."""
    from tokenmill import config as C

    try:
        flat = C.flatten(C.load_toml(path))
    except C.ConfigError:
        return {}
    return {k[2:]: flat.get(k[2:]) for k in flags}


def compare(base: list[dict[str, Any]], runs: list[dict[str, Any]], measure: str) -> dict[str, Any]:
    """Per-round ratios B/A of each figure, their median change and spread, and the status."""
    by_round = {r["round"]: r for r in base if r.get("ok")}
    failed = [r for r in runs if not r.get("ok")]
    if failed:
        return {"status": "failed", "reason": failed[0].get("reason") or "no steady-state tokens/s"}
    changes: dict[str, Any] = {}
    for name, (key, _higher) in FIGURES.items():
        ratios = [r[key] / by_round[r["round"]][key] for r in runs
                  if r["round"] in by_round and r.get(key) and by_round[r["round"]].get(key)]
        a = [b[key] for b in by_round.values() if b.get(key)]
        if not ratios:
            continue
        changes[name] = {"ratio": statistics.median(ratios), "change": statistics.median(ratios) - 1.0,
                         "low": min(ratios) - 1.0, "high": max(ratios) - 1.0, "rounds": len(ratios),
                         "baseline_spread": (max(a) - min(a)) / statistics.median(a) if len(a) > 1 else None}
    if measure not in changes:
        return {"status": "failed", "reason": "the baseline runs failed", "changes": changes}
    c, higher = changes[measure], FIGURES[measure][1]
    noise = max(MIN_CHANGE, c["baseline_spread"] or 0.0)
    better = c["low"] > 0 if higher else c["high"] < 0
    worse = c["high"] < 0 if higher else c["low"] > 0
    gain = c["change"] if higher else -c["change"]
    if c["rounds"] > 1 and better and gain > noise:
        status = "confirmed"
    elif c["rounds"] > 1 and worse and -gain > noise:
        status = "worse"
    else:
        status = "not confirmed"
    spreads = [r["window_spread"] for r in [*base, *runs] if r.get("window_spread") is not None]
    return {"status": status, "decided_by": measure, "noise": noise, "changes": changes,
            "exceeds_noise": c["rounds"] > 1 and abs(gain) > noise and (better or worse),
            "window_spread": statistics.median(spreads) if spreads else None}


def format_trials(report: dict[str, Any]) -> list[str]:
    """The --try report as text lines."""
    if report.get("note") and not report.get("order"):  # nothing was run: no rounds to describe
        return [f"\nNothing tried: {report['note']}"]
    lines = [f"\nTried ({report['repeats']} round(s) of {report['steps']} steps, a fresh process per run, "
             f"A and B alternated: {' '.join(report['order'])}):"]
    if report.get("note"):
        return lines + [f"  {report['note']}"]
    a = [r for r in report["baseline"] if r.get("ok")]
    if a:
        tps = [r["tokens_per_sec"] for r in a]
        lines.append(f"  A (the run's config): {statistics.median(tps):,.0f} tokens/s (runs {_span(tps)})")
    bad = [r for r in report["baseline"] if not r.get("ok")]
    if bad:
        lines.append(f"  A: {len(bad)} of {len(report['baseline'])} runs failed ({bad[0].get('reason')}); their "
                     "rounds are left out")
    for t in report["tries"]:
        head = f"  B {_describe(t)} [{t['finding']}]: {t['status'].upper()}"
        if t["status"] == "failed":
            lines.append(f"{head}: {t['reason']}")
            continue
        lines.append(head + f" (decided by {FIGURE_NAMES[t['decided_by']]}; baseline noise {100 * t['noise']:.0f}%)")
        c = t["changes"][t["decided_by"]]
        within = t.get("window_spread")
        lines.append(f"      B/A ratio {c['ratio']:.3f} (rounds {1 + c['low']:.3f} .. {1 + c['high']:.3f}): the difference "
                     + ("exceeds" if t.get("exceeds_noise") else "does not exceed") + f" the noise ({100 * t['noise']:.0f}%"
                     + (f"; windows within a run spread {100 * within:.0f}%" if within is not None else "") + ")")
        for name, c in t["changes"].items():
            lines.append(f"      {FIGURE_NAMES[name]:<22} {100 * c['change']:+.1f}% (rounds {100 * c['low']:+.1f}% .. "
                         f"{100 * c['high']:+.1f}%)")
    return lines


FIGURE_NAMES = {"speed": "steady tokens/s", "wall": "end-to-end tokens/s", "memory": "memory peak"}


def _span(values: list[float]) -> str:
    return f"{min(values):,.0f} .. {max(values):,.0f}"
