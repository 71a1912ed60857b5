"""Wall-clock time outside a run's steady-state steps (evaluation, checkpoints, logging, warm-up): the facts of
the doctor's ``outside_steady_state`` rule."""

from __future__ import annotations

from typing import Any

from tokenmill.profiling.facts import as_config


def wall_facts(run: dict[str, Any], f: dict[str, Any]) -> dict[str, Any]:
    """Wall-clock time outside the steady-state steps: ``wall_s``, ``steady_s``, ``outside_s`` (seconds
    per part: evaluation, checkpoints, logging, the rest), ``outside_counts`` and ``wall_source``.

    The trainer's own figures (``summary.json``: ``wall_s``, ``eval_s``/``evals``,
    ``checkpoint_s``/``checkpoints``, ``log_s``, ``warmup_s``) are used where it records them (runs of
    older versions lack them). Otherwise: the wall
    time from ``config.toml`` (written as training starts) to ``summary.json`` (written at the end),
    the evaluations from the ``val_loss`` rows, each costing ``train.eval_batches`` forward passes
    of the measured training forward, and the unexplained rest. A profile gives the evaluation found
    inside its profiled steps instead (per step). The run's config is read typed (its own values over the
    config's defaults)."""
    summary, step_ms = run["summary"], f.get("step_ms")
    if not step_ms:
        return {}
    if run["profile"]:
        eval_ms = f.get("profile_eval_ms")
        if not eval_ms:
            return {}
        return {"wall_s": step_ms / 1000, "steady_s": (step_ms - eval_ms) / 1000,
                "outside_s": {"evaluation": eval_ms / 1000},
                "wall_source": "per profiled step: the forward passes between the training phases in the trace"}
    steps = (summary.get("steps") or 0) - (summary.get("start_step") or 0)
    wall, source = summary.get("wall_s"), "summary.json"
    d = run.get("dir")
    if wall is None and d is not None and (d / "summary.json").is_file() and (d / "config.toml").is_file():
        wall = (d / "summary.json").stat().st_mtime - (d / "config.toml").stat().st_mtime
        source = "estimated: config.toml to summary.json file times"
    if not wall or steps <= 0:
        return {}
    steady = steps * step_ms / 1000
    cfg = as_config(run["config"])
    parts: dict[str, float] = {}
    counts: dict[str, int] = {}
    evals = summary.get("evals", sum(1 for r in run["metrics"] if "val_loss" in r))
    if summary.get("eval_s") is not None:
        parts["evaluation"] = summary["eval_s"]
    elif evals:
        micro_ms = f["forward_ms"] / cfg.train.grad_accum_steps
        parts["evaluation"] = evals * cfg.train.eval_batches * micro_ms / 1000
        source += "; evaluation estimated as eval_batches x the training forward"
    counts["evaluation"] = evals
    every, final = cfg.checkpoint.every_steps, cfg.checkpoint.save_final
    saves = summary.get("checkpoints", (steps - 1) // every + int(final) if every else int(final))
    if summary.get("checkpoint_s") is not None:
        parts["checkpoints"] = summary["checkpoint_s"]
    if summary.get("log_s") is not None:
        parts["logging"] = summary["log_s"]
    if summary.get("warmup_s") is not None:  # beyond what the warm-up steps cost at the steady speed
        warm = min(steps, cfg.log.timing_warmup_steps)
        parts["warm-up"] = max(0.0, summary["warmup_s"] - warm * step_ms / 1000)
    rest = wall - steady - sum(parts.values())
    if rest > 0:
        if summary.get("wall_s") is not None:  # the trainer timed every part: the rest is small and unnamed
            name = "other"
        else:  # what the trainer did not record: with periodic saves, mostly the saves
            name = ("checkpoints" if "checkpoints" not in parts and saves > 1
                    else "start-up, warm-up, logging and the final save")
        parts[name] = parts.get(name, 0.0) + rest
    counts["checkpoints"] = saves
    return {"wall_s": wall, "steady_s": steady, "outside_s": {k: v for k, v in parts.items() if v > 0},
            "outside_counts": {k: v for k, v in counts.items() if v}, "wall_source": source}
