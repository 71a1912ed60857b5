"""The files of a run directory that ``tokenmill doctor`` and ``--try`` read, checked where they are read.

``summary.json`` (the trainer's) and ``profile.json`` (``tokenmill profile``'s) are read with
:func:`tokenmill.filecheck.read_json` (invalid JSON, not UTF-8, nested too deep, not an object: one error
naming the file), then every value the doctor reads is type-checked against a shape (:data:`SUMMARY`,
:data:`PROFILE`): a string where a number belongs, a list where an object belongs, is one
:class:`~tokenmill.errors.DoctorError` naming the file, the field and the value. Fields a shape does not
name are not read and not checked; absent fields stay absent (the doctor reads them with defaults, or
calls a profile without them one of another version).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenmill.errors import DoctorError, TokenmillError
from tokenmill.filecheck import get, read_json, shown

__all__ = ["PROFILE", "SUMMARY", "Null", "check_shape", "read_profile", "read_summary"]


class Null:
    """A shape whose value may also be null."""

    def __init__(self, shape: Any):
        self.shape = shape


_N = Null
SUMMARY: dict[str, Any] = {
    **{k: _N(int) for k in ("steps", "start_step", "params", "trainable_params", "tokens_per_step", "world_size",
                            "evals", "checkpoints", "logs", "timing_windows", "timing_from_step")},
    **{k: _N(float) for k in ("flops_per_token", "tokens_per_sec", "tokens_per_sec_min", "tokens_per_sec_max",
                              "step_time_ms", "mfu", "wall_s", "warmup_s", "eval_s", "checkpoint_s", "log_s",
                              "peak_alloc_mb", "peak_reserved_mb", "peak_flops", "compile_s",
                              "learned_frac", "padding_frac", "learned_tokens_per_sec")},  # the last: chat data
    **{k: _N(str) for k in ("device", "gpu_name", "layout")},
    "tokens_per_sec_windows": _N([float]),
    "threads": _N({"intra_op": _N(int), "inter_op": _N(int), "cpu_count": _N(int), "local_world_size": _N(int),
                   "load_avg": _N(float)}),
}
_SOURCE = {"call": str, "op": str, "parent": str, "region": str, "python": str, "per_step": float,
           "ms_per_step": _N(float)}
PROFILE: dict[str, Any] = {
    "version": int, "device": str, "tokens_per_step": _N(int),
    "breakdown": {"steps": [int], "ms_per_step": {"*": float}, "share": {"*": float},
                  "each_step_ms": _N({"*": [float]}), "outside": _N({"eval_ms_per_step": _N(float)}),
                  "recompute": _N({"device_ms_per_step": _N(float), "host_ms_per_step": _N(float)})},
    "host_busy": {"busy_fraction": _N(float), "ops_per_step": float, "mean_op_us": float},
    "device_busy": _N({"*": _N(float), "basis": str, "ms_per_step_by_launching_phase": {"*": float}}),
    "top_ops": [{"name": str, "share": float, "self_ms_per_step": float, "calls_per_step": float}],
    "syncs": {"per_step": float, "ms_per_step": _N(float), "sources": [_SOURCE]},
    "memory": _N({"device": str, "peak_region": _N(str), "peak_op": _N(str), "categories_at_peak_mb": _N({"*": float}),
                  **{k: _N(float) for k in ("peak_mb", "vocab_sized_mb", "transient_mb", "step_start_mb")}}),
    "allocator": _N({"during_profiled_steps": {"*": int}, "alloc_retries_total": int,
                     **{k: _N(float) for k in ("cuda_malloc_per_step", "cuda_free_per_step", "peak_reserved_mb",
                                               "reserved_minus_allocated_mb", "device_total_mb")}}),
    "per_block": _N({"attn_ms_per_step": _N(float), "mlp_ms_per_step": _N(float)}),
    "gpu": _N({"name": str, "capability": [int], "total_mb": float}),
}


def check_shape(doc: Any, shape: Any, where: str, err: type[TokenmillError] = DoctorError, field: str = "") -> Any:
    """``doc`` when it has ``shape``: a type (:func:`tokenmill.filecheck.get`'s kinds), an object of shapes by
    key (``"*"``: any other key), a one-element list (a list of that shape), or :class:`Null` (that, or
    null). Else ``err`` naming ``where``, the field (``a.b[2].c``) and the value."""
    if isinstance(shape, Null):
        if doc is None:
            return doc
        shape = shape.shape
    if isinstance(shape, dict):
        if not isinstance(doc, dict):
            raise err(f"{where}: '{field}' must be an object, got {shown(doc)}." if field else
                      f"{where} must hold an object, got {shown(doc)}.")
        for key, value in doc.items():
            sub = shape.get(key, shape.get("*"))
            if sub is not None:
                check_shape(value, sub, where, err, f"{field}.{key}" if field else key)
    elif isinstance(shape, list):
        if not isinstance(doc, list):
            raise err(f"{where}: '{field}' must be a list, got {shown(doc)}.")
        for i, value in enumerate(doc):
            check_shape(value, shape[0], where, err, f"{field}[{i}]")
    else:
        get({field: doc}, field, shape, where, err=err)
    return doc


def read_summary(path: str | Path, err: type[TokenmillError] = DoctorError) -> dict[str, Any]:
    """A run's ``summary.json``, its values checked (:data:`SUMMARY`); ``err`` naming the file otherwise."""
    return check_shape(read_json(path, "run summary", err), SUMMARY, f"run summary '{path}'", err)


def read_profile(path: str | Path, fix: str = "") -> dict[str, Any]:
    """A ``profile.json``, its values checked (:data:`PROFILE`); a DoctorError naming the file otherwise
    (``fix``: a sentence appended)."""
    where = f"profile '{path}'"
    doc = read_json(path, "profile", DoctorError, fix=fix)
    try:
        return check_shape(doc, PROFILE, where)
    except DoctorError as e:
        raise DoctorError(f"{str(e).rstrip('.')}.{fix}") from None
