"""How far an estimate may be off: the mean absolute error of the estimator against published measurements in
the same *regime* (eager / compiled, small / large micro-batch, one GPU / several, and the fine-tuning method:
full, LoRA or QLoRA), from ``benchmarks/validation/published.toml`` (:mod:`.validation`;
``tests/test_estimate_validation.py`` checks that :data:`REGIME_ERRORS` is what the file gives). A regime with
fewer than :data:`MIN_CASES` measurements of a quantity borrows the error of all measurements of that quantity
(stated as such).
"""

from __future__ import annotations

from typing import Any, Optional

from tokenmill import config as C

MIN_CASES = 3
METHOD_NAMES = {"full": "full", "lora": "LoRA", "qlora": "QLoRA"}  # regime_of's fourth part, as printed
# regime -> (memory error, memory cases, speed error, speed cases); None: no measurement in the regime
REGIME_ERRORS: dict[tuple[str, str, str, str], tuple[Optional[float], int, Optional[float], int]] = {
    ("compiled", "large", "many", "full"): (0.06, 10, 0.095, 12),
    ("compiled", "large", "one", "full"): (0.054, 14, 0.084, 20),
    ("compiled", "large", "one", "lora"): (0.009, 2, 0.033, 2),
    ("compiled", "large", "one", "qlora"): (0.06, 3, 0.082, 3),
    ("compiled", "small", "many", "full"): (0.05, 1, None, 0),
    ("compiled", "small", "many", "lora"): (0.047, 1, None, 0),
    ("compiled", "small", "one", "full"): (0.007, 5, 0.15, 5),
    ("compiled", "small", "one", "lora"): (0.056, 1, 0.093, 1),
    ("compiled", "small", "one", "qlora"): (0.05, 1, 0.013, 1),
    ("eager", "large", "many", "full"): (0.048, 4, 0.123, 14),
    ("eager", "large", "many", "lora"): (0.045, 4, 0.061, 3),
    ("eager", "large", "many", "qlora"): (0.05, 7, 0.131, 6),
    ("eager", "large", "one", "full"): (0.015, 5, 0.13, 10),
    ("eager", "large", "one", "lora"): (0.019, 5, 0.177, 7),
    ("eager", "large", "one", "qlora"): (0.011, 4, 0.021, 6),
    ("eager", "small", "many", "full"): (0.062, 2, 0.13, 2),
    ("eager", "small", "many", "lora"): (0.01, 2, None, 0),
    ("eager", "small", "many", "qlora"): (0.094, 4, 0.196, 2),
    ("eager", "small", "one", "full"): (0.019, 3, 0.155, 4),
    ("eager", "small", "one", "lora"): (0.04, 3, None, 0),
    ("eager", "small", "one", "qlora"): (0.052, 4, None, 0),
}
OVERALL = {"memory": (0.043, 85), "speed": (0.108, 98)}  # all measurements: (error, cases)


def regime_table(summary: dict[str, Any]) -> dict:
    """:data:`REGIME_ERRORS` and :data:`OVERALL` as a validation summary (:func:`.validation.summarize`) gives them."""
    table = {k: (_r(v["memory"]), v["n_memory"], _r(v["speed"]), v["n_speed"]) for k, v in summary["regimes"].items()}
    return {"regimes": table, "overall": {"memory": (_r(summary["memory"]), summary["n_memory"]),
                                          "speed": (_r(summary["speed"]), summary["n_speed"])}}


def regime_markdown() -> str:
    """The table of docs/estimate.md ("How far off"): :data:`REGIME_ERRORS` as printed, with the overall error a
    regime with too few measurements borrows."""
    def cell(err: Optional[float], n: int, name: str) -> str:
        overall = f"all, {100 * OVERALL[name][0]:.1f}%"
        if err is None:
            return f"none ({overall})"
        return f"{100 * err:.1f}% ({n}{': ' + overall if n < MIN_CASES else ''})"

    rows = ["| regime | memory error (cases) | tokens/s error (cases) |", "|---|---|---|"]
    for (mode, size, gpus, method), (mem, n_mem, speed, n_speed) in sorted(REGIME_ERRORS.items()):
        where = "one GPU" if gpus == "one" else "several"
        rows.append(f"| {mode}, {size}, {where}, {METHOD_NAMES[method]} | {cell(mem, n_mem, 'memory')} "
                    f"| {cell(speed, n_speed, 'speed')} |")
    return "\n".join(rows)


def _r(v: Optional[float]) -> Optional[float]:
    return None if v is None else round(v, 3)


def error_for(cfg: C.Config, nproc: int) -> dict[str, Any]:
    """The relative error to print beside an estimate of ``cfg``: per quantity, the regime's mean absolute error
    and the number of published measurements behind it (or the overall figure where the regime has too few)."""
    from tokenmill.estimate.validation import regime_of

    key = regime_of(cfg, nproc)
    mem, n_mem, speed, n_speed = REGIME_ERRORS.get(key, (None, 0, None, 0))
    out: dict[str, Any] = {"regime": "/".join(key)}
    for name, err, n in (("memory", mem, n_mem), ("speed", speed, n_speed)):
        if err is None or n < MIN_CASES:
            err, n = OVERALL[name]
            out[f"{name}_basis"] = f"all {n} published measurements (fewer than {MIN_CASES} in this regime)"
        else:
            out[f"{name}_basis"] = f"{n} published measurements in this regime"
        out[name] = err
    return out
