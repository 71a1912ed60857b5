"""``F``: how every config field is declared (default, doc, valid range, shape kind)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def F(default: Any, doc: str, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
      lt: float | None = None, shape: str | None = None, path: str | None = None, **kw: Any) -> Any:
    """A config field with its documentation and, for numbers, its valid range (``ge`` >=, ``gt`` >,
    ``le`` <=, ``lt`` <), checked for every field in one place (:func:`tokenmill.config.validate`).

    ``shape`` (model fields only): 'arch' = the field fixes the model's parameters or math (a Hugging Face
    source or a checkpoint decides it); 'layout' = it fixes how the same parameters are laid out in a state
    dict (context, vocabulary padding, fused q/k/v). :func:`shape_fields` lists them: the one list."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    meta = {"doc": doc, "range": bounds, "shape": shape, "path": path}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)
