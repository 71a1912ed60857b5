"""Sharded checkpoints (FSDP / TP / PP): ``torch.distributed.checkpoint`` (DCP), read safely.

A folder ``step_XXXXXXXX.dcp/`` in which each rank saves its own shards in parallel, plus ``extra.pt``
(rank 0: scheduler, scaler, step, data position, RNG, config). The folder is written under a
temporary name and renamed once every rank has finished, so a crash never leaves a half-written
checkpoint under a real name. Model and optimizer state are keyed by parameter name
(``get_state_dict``/``set_state_dict``), so a DCP checkpoint loads under any world size and layout.

**Reading runs no code.** DCP reads its ``.metadata`` file with a plain ``pickle.load`` and the
non-tensor entries (learning rates, betas) with ``torch.load(weights_only=False)``: a crafted
folder could run code on the machine that opens it. :class:`SafeReader` unpickles the metadata with
an allow-list of DCP's own metadata classes, and :class:`SafePlanner` reads non-tensor entries with
``weights_only=True``; anything else is refused with :class:`~tokenmill.errors.CheckpointError`.
"""

from __future__ import annotations

import contextlib
import enum
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from tokenmill.atomic import fsync_dir
from tokenmill.checkpoint.files import (
    atomic_torch_save,
    first_line,
    refused_message,
    unpickling_detail,
)
from tokenmill.errors import CheckpointError
from tokenmill.parallel.world import World, barrier

_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles only DCP metadata: its own dataclasses and enums, torch sizes, dtypes and layouts."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in _METADATA_MODULES:
            obj = getattr(__import__(module, fromlist=[name]), name, None)
            if isinstance(obj, type) and (hasattr(obj, "__dataclass_fields__") or issubclass(obj, enum.Enum)):
                return obj
        refused = pickle.UnpicklingError(f"'{module}.{name}' is not allowed in checkpoint metadata")
        refused.refused = True  # hostile, not damaged (a damaged pickle raises UnpicklingError too)
        raise refused


def read_metadata(path: Path):
    """The DCP metadata of checkpoint folder ``path``, unpickled with the allow-list."""
    meta = path / ".metadata"
    try:
        with open(meta, "rb") as f:
            return _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        if getattr(e, "refused", False):
            raise CheckpointError(
                f"refused to load {meta}: {e}; it could run code. Only load checkpoints you trust."
            ) from None
        raise CheckpointError(f"checkpoint {meta} is damaged ({first_line(e)}).") from None
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is incomplete: it has no {meta.name} file.") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint {meta} cannot be read: {e.strerror or e}.") from None
    except (EOFError, ValueError, AttributeError, ImportError, IndexError, TypeError,
            KeyError, MemoryError, RecursionError) as e:
        raise CheckpointError(f"checkpoint {meta} is damaged ({first_line(e)}).") from None


class SafeReader(FileSystemReader):
    """DCP's file-system reader with the metadata read by :func:`read_metadata` (no arbitrary unpickling)."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor entries read by ``torch.load(weights_only=True)``; ``path``
    (the checkpoint folder) names it in errors."""

    def __init__(self, path: str | Path | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.path = path

    def load_bytes(self, read_item, value) -> None:
        entry = f"entry '{read_item.dest_index.fqn}' of checkpoint {self.path}"
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(refused_message(entry, e) or f"{entry} is damaged ({unpickling_detail(e)}).") \
                from None
        except (RuntimeError, EOFError, ValueError, OSError, KeyError, IndexError, TypeError) as e:
            raise CheckpointError(f"{entry} is damaged ({first_line(e)}).") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _load(state: dict, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafePlanner(path))
    except CheckpointError:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - a damaged or foreign folder: name it (DCP's CheckpointException
        inner = _inner_errors(e)  # derives from BaseException, not Exception)
        ours = [x for x in inner if isinstance(x, CheckpointError)]
        if ours:  # DCP wraps errors raised in the reader and planner
            raise ours[0] from None
        cause = inner[-1] if inner else e  # the innermost: e.g. FileNotFoundError of a missing shard file
        raise CheckpointError(f"checkpoint {path} could not be read ({type(cause).__name__}: {first_line(cause)}).") \
            from None


def _inner_errors(e: BaseException) -> list[BaseException]:
    """``e`` and the errors inside it, outermost first: causes, contexts, and the per-rank failures of
    torch's ``CheckpointException``."""
    seen, out, stack = set(), [], [e]
    while stack:
        x = stack.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        out.append(x)
        failures = getattr(x, "failures", None)  # torch's CheckpointException: {rank: (exception, traceback)}
        if isinstance(failures, dict):
            stack += [v[0] if isinstance(v, tuple) else v for v in failures.values()]
        stack += [x.__cause__, x.__context__]
    return out


def save_dcp(final: Path, model, optimizer, world: World, extra: dict | None = None,
             after: Callable[[], None] | None = None, background: bool = False) -> Path:
    """Write model and optimizer shards of every rank into ``final`` (via a temporary folder renamed once
    every rank has written), then, on rank 0, ``extra`` as ``extra.pt`` (the mark of a complete folder) and
    ``after()`` (rotation). ``background`` (``checkpoint.async_save``): ``dcp.async_save``, the rename and
    the rest done by a thread once the shards are written (:mod:`tokenmill.checkpoint.background`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tokenmill.checkpoint.background import PENDING, stage

    d = final.parent
    tmp = d / f".{final.name}.tmp"
    if world.is_rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(world)
    with _without_empty_groups(optimizer):
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_options())
    extra = stage(extra) if background and extra is not None else extra  # the live scheduler may change

    def commit() -> None:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(d)
        if extra is not None:
            atomic_torch_save(extra, final / "extra.pt")
        if after is not None:
            after()

    if background:
        PENDING.start_dcp({"model": model_sd, "optimizer": optim_sd}, tmp, commit if world.is_rank0 else None)
        return final
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp))
    barrier(world)
    if world.is_rank0:
        commit()
    barrier(world)
    return final


def load_dcp(path: Path, model, optimizer) -> None:
    """Load DCP checkpoint ``path`` into ``model`` and ``optimizer`` (already parallelised; any layout)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from tokenmill.errors import ParallelError

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        raise ParallelError(f"{path} is a sharded (DCP) checkpoint; resume it without parallel.zero1.")
    with _without_empty_groups(optimizer):
        _load_state(path, model, optimizer)


def _load_state(path: Path, model, optimizer) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options())
    absent, extra = _bias_switch(model_sd, path)
    state = {"model": {k: v for k, v in model_sd.items() if k not in absent} | extra, "optimizer": optim_sd}
    _load(state, path)
    for k in extra:
        if bool(state["model"].pop(k).any()):
            raise CheckpointError(f"'{k}' is non-zero: the weights were trained with DeepSeek-V3's routing bias; "
                                  "set --model.moe_bias_update_rate > 0 to route with it.")
    state["model"] |= {k: torch.zeros_like(model_sd[k]) for k in absent}
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_options())


@contextlib.contextmanager
def _without_empty_groups(optimizer):
    """The optimizer without its parameter groups that hold no parameter (LoRA: no trainable norm or bias, so
    the no-decay group is empty), put back afterwards at their places: torch's distributed state dict cannot
    unflatten a group with no parameter, and such a group has no state to save (its learning rate is the
    schedule's, set again on resume)."""
    groups = optimizer.param_groups
    empty = [(i, g) for i, g in enumerate(groups) if not g["params"]]
    if not empty:
        yield
        return
    groups[:] = [g for g in groups if g["params"]]
    try:
        yield
    finally:
        now = optimizer.param_groups  # a load made a new list of new group dicts
        for i, g in empty:
            now.insert(i, g)


def _bias_switch(model_sd: dict, path: Path) -> tuple[set, dict]:
    """``model.moe_bias_update_rate`` switched between 0 and > 0 since the save (the MoE routing bias,
    ``router_bias``, added or removed), handled as single-file checkpoints do (``MoE._load_from_state_dict``):
    the model's biases the checkpoint lacks (left out of the read, then zero) and, for the saved biases the
    model lacks, zero tensors to read them into (a non-zero one is refused)."""
    saved = read_metadata(path).state_dict_metadata
    absent = {k for k in model_sd if k.endswith("router_bias") and f"model.{k}" not in saved}
    extra = {k[6:]: torch.zeros(tuple(md.size), dtype=md.properties.dtype) for k, md in saved.items()
             if k.startswith("model.") and k.endswith("router_bias") and k[6:] not in model_sd}
    return absent, extra


def load_model_weights(path: Path, model) -> dict[str, torch.Tensor]:
    """The model weights of DCP checkpoint ``path``, read whole in one process (no process group),
    as a state dict for ``model`` (a plain GPT of the run's shape): for sampling and export."""
    state = {"model": model.state_dict()}
    _load(state, path)
    return state["model"]


def _options():
    """Optimizer state keyed by parameter name, hyperparameters included (``param_groups.<name>.lr``):
    so a checkpoint loads into any grouping of the parameters (tensor parallelism splits the groups
    by mesh, see ``optim/adamw.py``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)
