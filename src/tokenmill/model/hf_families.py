"""Hugging Face conversion of the Llama family, dense or mixture of experts: each call goes to
``model/hf_llama.py`` (dense classes) or ``model/hf_moe.py`` (the MoE classes, built on the dense conversion), so
``hf_llama`` never needs to know ``hf_moe``. ``model/hf.py`` and ``train/init_from.py`` convert through here."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Optional

from tokenmill.model import hf_llama, hf_moe
from tokenmill.model.hf_llama import MOE

__all__ = ["check_config", "export_architecture", "from_hf_state_dict", "hf_config", "model_fields",
           "to_hf_state_dict"]


def _by(architecture: str) -> ModuleType:
    return hf_moe if architecture in MOE else hf_llama


def check_config(c, architecture: str, where: str):
    return _by(architecture).check_config(c, architecture, where)


def model_fields(s) -> dict[str, Any]:
    return _by(s.architecture).model_fields(s)


def from_hf_state_dict(hf_sd, hf_cfg, architecture: str, *args, **kw):
    return _by(architecture).from_hf_state_dict(hf_sd, hf_cfg, architecture, *args, **kw)


def to_hf_state_dict(state_dict, cfg, architecture: str, *args, **kw):
    return _by(architecture).to_hf_state_dict(state_dict, cfg, architecture, *args, **kw)


def export_architecture(cfg, prefer: Optional[str] = None) -> str:
    return (hf_moe if cfg.moe_experts else hf_llama).export_architecture(cfg, prefer)


def hf_config(cfg, architecture: str, *args, **kw):
    return _by(architecture).hf_config(cfg, architecture, *args, **kw)
