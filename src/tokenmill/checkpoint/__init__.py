"""Checkpoints under every layout, behind one API used by every command (train, sample, export, eval).

- Single process, DDP and ZeRO-1: rank 0 writes one ``step_XXXXXXXX.pt`` file (``files``; ZeRO-1 first
  gathers the optimizer state to rank 0).
- FSDP / TP / PP (sharded parameters): a DCP folder ``step_XXXXXXXX.dcp/`` (``dcp``).

:func:`load_latest` and :func:`load_model` try the newest checkpoint first; one that is damaged,
truncated or refused (it would run code) is reported with its path and the next older one is tried.
Nothing is ever deleted on load. Every read lands on the CPU and runs no code.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from tokenmill import config as C
from tokenmill.checkpoint import background
from tokenmill.checkpoint.files import (
    DCP_NAME,
    FILE_NAME,
    TMP_NAME,
    atomic_torch_save,
    check_room,
    checkpoint_dir,
    clean_state_dict,
    dcp_path,
    file_path,
    first_line,
    read_file,
    rng_state,
    set_rng_state,
    state_nbytes,
)
from tokenmill.errors import CheckpointError, ConfigError, DataError, ParallelError
from tokenmill.optim import consolidated_state_dict
from tokenmill.parallel import World, unwrap
from tokenmill.parallel.world import barrier


def _dcp():
    """The sharded-checkpoint module, imported where a DCP folder is read or written (torch.distributed.checkpoint
    costs about a second of every process's start, and most runs keep single files)."""
    from tokenmill.checkpoint import dcp

    return dcp

__all__ = [
    "background", "checkpoint_dir", "clean_stale_tmp", "data_position", "global_batch", "list_checkpoints", "load_latest",
    "load_model", "read_latest", "read_state", "save_checkpoint", "saved_global_samples", "set_rng_state",
    "tokenizer_dir",
]


_NOTHING_DELETED = " Nothing was deleted: put a good checkpoint back, or start a new run in another --run-dir."


def _warn(msg: str) -> None:
    print(f"tokenmill: warning: {msg}", file=sys.stderr, flush=True)


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Every checkpoint of ``run_dir`` (single files and complete DCP folders), oldest first."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = FILE_NAME.match(p.name) or DCP_NAME.match(p.name)
        if m and (p.is_file() or (p / "extra.pt").exists()):
            found.append((int(m.group(1)), p))
    return sorted(found)


def clean_stale_tmp(run_dir: str | Path) -> list[Path]:
    """Remove temporary files left by a save that was killed (never a real checkpoint); returns them."""
    d = checkpoint_dir(run_dir)
    gone = []
    if d.is_dir():
        for p in d.iterdir():
            if TMP_NAME.match(p.name):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                gone.append(p)
    return gone


def global_batch(cfg: C.Config, world: World) -> int:
    """Samples of the global data stream consumed per optimizer step (micro-batch x accumulation x
    data-parallel degree)."""
    return cfg.train.batch_size * cfg.train.grad_accum_steps * world.dp_size


def data_position(step: int, global_samples: int | None, cfg: C.Config, world: World) -> dict[str, int]:
    """Where the global data stream stands after ``step`` steps: ``global_samples`` consumed (default:
    every step at the current global batch), and the global batch of the run that saved it.
    ``global_batch`` marks the entry as complete (older checkpoints stored ``global_samples`` without
    the data-parallel degree; :func:`saved_global_samples` ignores those)."""
    g = global_batch(cfg, world)
    samples = step * g if global_samples is None else global_samples
    return {"step": step, "global_samples": samples, "global_batch": g}


def saved_global_samples(extra: dict[str, Any]) -> int | None:
    """The number of global samples a checkpoint had consumed, or None for a checkpoint that did not
    record it reliably (resume then starts at ``step`` x the current global batch)."""
    pos = extra.get("data_position") or {}
    if "global_batch" not in pos or "global_samples" not in pos:
        return None
    return int(pos["global_samples"])


def _extra(model, scheduler, scaler, cfg, world: World, step, global_samples=None) -> dict[str, Any]:
    return {
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else {},
        "step": step,
        "data_position": data_position(step, global_samples, cfg, world),
        "rng": rng_state(world.device),
        "config": cfg.to_dict(),
        "vocab_size": getattr(unwrap(model), "vocab_size", None),
    }


def save_checkpoint(run_dir, step, model, optimizer, scheduler, scaler, cfg, world: World,
                    global_samples: int | None = None) -> Path:
    """Save step ``step`` (a collective under torchrun: every rank must call it), then keep the newest
    ``checkpoint.keep_last``. ``global_samples``: samples of the global data stream consumed so far
    (default ``step`` x the current global batch; a resumed run whose global batch changed passes the
    true count).

    ``checkpoint.async_save``: the state is staged in host memory and written in the background
    (:mod:`tokenmill.checkpoint.background`), except at ``train.max_steps`` (nothing left to overlap).
    Every save first waits for the one in flight, whose failure is raised here."""
    background.wait()
    in_background = cfg.checkpoint.async_save and step < cfg.train.max_steps
    rotate = (lambda: _rotate(run_dir, step, cfg.checkpoint.keep_last)) if world.is_rank0 else None
    if world.is_rank0:
        _prune(run_dir, step, cfg.checkpoint.keep_last)  # before the write: the peak is keep_last + 1
    if world.sharded:
        extra = _extra(model, scheduler, scaler, cfg, world, step, global_samples) if world.is_rank0 else None
        path = _dcp().save_dcp(dcp_path(run_dir, step), model, optimizer, world, extra, rotate, in_background)
    else:
        path = file_path(run_dir, step)
        optim_sd = consolidated_state_dict(optimizer, world)
        if world.is_rank0:
            state = _extra(model, scheduler, scaler, cfg, world, step, global_samples)
            state["model"] = clean_state_dict(unwrap(model).state_dict())
            state["optimizer"] = optim_sd
            path.parent.mkdir(parents=True, exist_ok=True)
            check_room(path, state_nbytes(state), _peak_count(run_dir, step, cfg), cfg.checkpoint.async_save)
            if in_background:
                background.PENDING.start(state, path, after=rotate)
            else:
                atomic_torch_save(state, path)
                rotate()
    barrier(world)
    return path


def _prune(run_dir, step: int, keep_last: int) -> None:
    """Before writing step ``step``: keep only the newest ``keep_last`` checkpoints older than it. The
    newest of them has proved itself (the caller checked every loss up to ``step``; the trainer never saves
    a model whose losses were not checked), so the one :func:`_rotate` protected is no longer needed, and
    the folder holds at most ``keep_last`` checkpoints plus the one being written."""
    older = [p for s, p in list_checkpoints(run_dir) if s < step]
    for old in older[:-keep_last]:
        shutil.rmtree(old) if old.is_dir() else old.unlink(missing_ok=True)


def _peak_count(run_dir, step: int, cfg: C.Config) -> int:
    """How many checkpoints the folder will hold at its fullest from this save on: ``keep_last`` plus the
    one being written, or fewer when the run has fewer saves left (this one and the final one included)."""
    ck, t = cfg.checkpoint, cfg.train
    every = ck.every_steps
    periodic = (t.max_steps - 1) // every - step // every if every else 0  # saves after this one, before the end
    left = 1 + max(0, periodic) + int(ck.save_final and step < t.max_steps)
    kept = len([s for s, _ in list_checkpoints(run_dir) if s < step])
    return min(ck.keep_last + 1, kept + left)


def _rotate(run_dir, step: int, keep_last: int) -> None:
    """Keep the newest ``keep_last`` checkpoints up to ``step``; a newer one (a damaged checkpoint the run
    fell back from) is neither counted nor deleted, so rotation never removes the checkpoint just written.
    The newest older one is kept too until this one has proved itself (a finite loss at the next step, see
    :func:`set_aside`): a run stopped by a NaN always has a checkpoint that did not produce it."""
    kept = [p for s, p in list_checkpoints(run_dir) if s <= step]
    protect = kept[-2] if len(kept) >= 2 else None
    for old in kept[:-keep_last]:
        if old != protect:
            shutil.rmtree(old) if old.is_dir() else old.unlink(missing_ok=True)


SET_ASIDE = ".nonfinite"  # suffix of a checkpoint whose weights produced a non-finite loss


def set_aside(run_dir: str | Path, from_step: int) -> list[Path]:
    """Rename the checkpoints at ``from_step`` and later to ``NAME.nonfinite``: kept on disk, never loaded
    again (the loader lists only proper names), so ``--resume`` starts from the newest checkpoint whose next
    step was finite. A background save in flight lands first (its failure is only reported: the run is
    stopping for the non-finite loss). Returns the new paths."""
    try:
        background.wait()
    except CheckpointError as e:
        _warn(str(e))
    moved = []
    for s, p in list_checkpoints(run_dir):
        if s >= from_step:
            dest = p.with_name(p.name + SET_ASIDE)
            if dest.exists():
                shutil.rmtree(dest) if dest.is_dir() else dest.unlink()
            p.rename(dest)
            moved.append(dest)
    return moved


def read_state(path: Path) -> dict[str, Any]:
    """A checkpoint's state without loading weights into a model: the whole file for a single file
    (model weights included), ``extra.pt`` (step, config, scheduler, ...) for a DCP folder."""
    if path.is_dir():
        # refuse a folder whose metadata would run code, or whose weights are pickled objects, before reading
        _refuse_object_weights(path, _dcp().read_metadata(path))
        return read_file(path / "extra.pt")
    return read_file(path)


def read_latest(run_dir: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """``(path, state)`` of the newest checkpoint that reads (see :func:`read_state`), or None when there
    is none; damaged or refused ones are reported and skipped."""
    for _, path in reversed(list_checkpoints(run_dir)):
        try:
            return path, read_state(path)
        except CheckpointError as e:
            _warn(f"{e} Trying the previous checkpoint (nothing is deleted).")
    return None


def load_latest(run_dir, model, optimizer, world: World,
                check: Optional[Callable[[dict], None]] = None) -> tuple[Path, dict[str, Any]] | None:
    """Load the newest good checkpoint into ``model`` and ``optimizer`` (already parallelised) and return
    ``(path, state)`` with the scheduler/scaler/RNG/step/config entries; None when there is none.

    ``check(state)`` runs before any weight is loaded (e.g. refuse a different model shape) and its
    errors propagate. A damaged or refused checkpoint is reported and the next older one is tried; when
    none loads, :class:`CheckpointError` lists them all."""
    found = list_checkpoints(run_dir)
    problems = []
    for _, path in reversed(found):
        try:
            state = read_state(path)
            if check is not None:
                check(state)
            _check_optimizer_kind(path, state, optimizer)
            if path.is_dir():
                _dcp().load_dcp(path, model, optimizer)
            else:
                if world.sharded:
                    raise ParallelError(
                        f"{path} is a single-file checkpoint; resuming it with sharded parameters (FSDP, TP or PP) "
                        "is not supported. Resume it with one process or DDP (parallel.dp_shard=1, tp=1, pp=1)."
                    )
                _load_file_state(path, state, model, optimizer)
            return path, state
        except CheckpointError as e:
            msg = str(e) if str(path) in str(e) else f"{path}: {e}"
            problems.append(msg)
            if world.is_rank0:
                _warn(f"{msg} Trying the previous checkpoint (nothing is deleted).")
    if problems:
        raise CheckpointError(f"no checkpoint of {run_dir} could be loaded: " + " | ".join(problems) + _NOTHING_DELETED)
    return None


def _check_optimizer_kind(path: Path, state: dict[str, Any], optimizer) -> None:
    """Refuse to load one optimizer kind's state into the other (``optim.name``), naming the flag: their
    states do not convert (Muon keeps one momentum buffer per hidden matrix, AdamW two moments)."""
    from tokenmill.optim import MuonWithAdamW

    saved = ((state.get("config") or {}).get("optim") or {}).get("name", "adamw")
    now = "muon" if isinstance(optimizer, MuonWithAdamW) else "adamw"
    if saved in ("adamw", "muon") and saved != now:
        raise ConfigError(f"checkpoint {path} was saved with optim.name = '{saved}', this run uses '{now}': "
                          f"their optimizer states do not convert. Resume with --optim.name {saved}, or start a "
                          "new run (train.init_from takes the weights alone).")


def _load_file_state(path: Path, state: dict[str, Any], model, optimizer) -> None:
    """Load a single file's model and optimizer entries; one that does not fit is a :class:`CheckpointError`
    (the caller tries the previous checkpoint)."""
    missing = [k for k in ("model", "optimizer") if not isinstance(state.get(k), dict)]
    if missing:
        raise CheckpointError(f"checkpoint {path} is damaged: it has no {' or '.join(missing)} entry.")
    try:
        unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (KeyError, RuntimeError, ValueError, TypeError, IndexError) as e:
        raise CheckpointError(f"checkpoint {path} does not fit this model or optimizer "
                              f"({first_line(e)}).") from None


def load_model(run_dir: str | Path, checkpoint: str | Path | None = None):
    """The model of a run directory's newest good checkpoint (or of ``checkpoint``), on the CPU, with the
    run's config and the checkpoint's path: ``(GPT, Config, Path)``. Single files and sharded (DCP)
    folders of FSDP, TP and PP runs alike (a DCP checkpoint is read whole in this one process). A LoRA
    run's adapters are merged into the base weights (:func:`tokenmill.model.lora.merge_lora`): a plain GPT."""
    from tokenmill.model import GPT
    from tokenmill.model.lora import apply_lora, merge_lora

    run_dir = Path(run_dir)
    if checkpoint is not None:
        candidates = [Path(checkpoint)]
        if not candidates[0].exists():
            raise CheckpointError(f"checkpoint {checkpoint} does not exist; `ls {checkpoint_dir(run_dir)}` lists them.")
        if not (candidates[0].is_file() or candidates[0].is_dir()):  # a FIFO or device: reading could block
            raise CheckpointError(f"checkpoint {checkpoint} is not a file or folder; `ls {checkpoint_dir(run_dir)}` "
                                  "lists the checkpoints.")
    else:
        candidates = [p for _, p in reversed(list_checkpoints(run_dir))]
        if not candidates:
            raise CheckpointError(f"no checkpoint in {checkpoint_dir(run_dir)}; train first "
                                  f"(tokenmill train --run-dir {run_dir}).")
    problems = []
    for path in candidates:
        try:
            state = read_state(path)
            cfg = C.from_dict(state["config"])
            vocab = state.get("vocab_size") or cfg.model.vocab_size or _data_vocab(run_dir, cfg)
            _check_shapes(path, state, cfg, vocab)  # before allocating: a bad config could ask for any size
            model = apply_lora(GPT(cfg.model, vocab), cfg.lora, init=False)  # lora.rank 0: the plain GPT
            weights = _dcp().load_model_weights(path, model) if path.is_dir() else state["model"]
            model.load_state_dict(weights)
            return merge_lora(model), cfg, path
        except (CheckpointError, ConfigError) as e:
            msg = str(e) if str(path) in str(e) else f"{path}: {e}"
            problems.append(msg)
            if len(candidates) > 1:
                _warn(f"{msg} Trying the previous checkpoint (nothing is deleted).")
        except (KeyError, RuntimeError, TypeError, ValueError, IndexError) as e:
            problems.append(f"checkpoint {path} does not match its config ({first_line(e)})")
            if len(candidates) > 1:
                _warn(f"{problems[-1]}. Trying the previous checkpoint (nothing is deleted).")
    raise CheckpointError("no checkpoint could be loaded: " + " | ".join(problems) + _NOTHING_DELETED)


def _refuse_object_weights(path: Path, metadata):
    """A DCP folder's metadata, checked: every model entry must be a tensor. A pickled object where a weight
    belongs is refused without reading it (it could run code); returns ``metadata``."""
    objects = [k for k, m in metadata.state_dict_metadata.items() if k.startswith("model.") and not hasattr(m, "size")]
    if objects:
        raise CheckpointError(f"refused to load {path}: its entry '{objects[0]}' is a pickled object where a "
                              "weight belongs, which could run code. Only load checkpoints you trust.")
    return metadata


def _check_shapes(path: Path, state: dict[str, Any], cfg: C.Config, vocab: Any) -> None:
    """Refuse a checkpoint whose recorded config does not describe its own weights (compared on the
    ``meta`` device, so nothing is allocated for a config that asks for an absurd size)."""
    import torch

    from tokenmill.model import GPT

    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise CheckpointError(f"checkpoint {path} is damaged: its vocabulary size is {vocab!r}.")
    if path.is_dir():
        md = _refuse_object_weights(path, _dcp().read_metadata(path)).state_dict_metadata
        have = {k[len("model."):]: tuple(m.size) for k, m in md.items() if k.startswith("model.")}
    else:
        weights = state.get("model")
        if not isinstance(weights, dict):
            raise CheckpointError(f"checkpoint {path} is damaged: it has no model entry.")
        have = {k: tuple(v.shape) for k, v in weights.items() if isinstance(v, torch.Tensor)}
    _check_depth_and_width(path, have, cfg.model)  # before building: the config could ask for any size
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in GPT(cfg.model, vocab).state_dict().items()}
    bad = [f"{k} {have.get(k)} vs {shape}" for k, shape in want.items() if have.get(k) != shape]
    if bad:
        raise CheckpointError(f"checkpoint {path} does not match its own config (weights vs config: "
                              f"{'; '.join(bad[:3])}{'; ...' if len(bad) > 3 else ''}).")


def _check_depth_and_width(path: Path, have: dict[str, tuple], m: C.ModelConfig) -> None:
    """The recorded depth and width against the weights' own (block indices, the embedding's width), so a
    damaged or hostile config.toml never makes the shape check build a model of absurd size."""
    depth = len({k.split(".")[1] for k in have if k.startswith("blocks.") and k.count(".") >= 2})
    width = (have.get("wte.weight") or (0, 0))[-1]
    if depth != m.n_layer or width != m.n_embd:
        raise CheckpointError(f"checkpoint {path} does not match its own config: the config says {m.n_layer} "
                              f"layers of width {m.n_embd}, the weights hold {depth} of width {width}.")


TOKENIZER_DIR = "tokenizer"  # RUN/tokenizer: the copy of the data's meta.json and tokenizer files


def tokenizer_dir(run_dir: str | Path, cfg: C.Config, progress: bool = True) -> Path:
    """Where a run's tokenizer loads from: its own copy (``RUN/tokenizer``), else the recorded data
    folder (older runs), else the embedded corpus (prepared again, identically, if it is gone)."""
    own = Path(run_dir) / TOKENIZER_DIR
    if (own / "meta.json").is_file():
        _check_own_tokenizer(own, cfg)
        return own
    if cfg.data.path:
        return Path(cfg.data.path)
    from tokenmill.data import ensure_embedded_corpus

    return ensure_embedded_corpus(cfg.data, progress=progress)


def _check_own_tokenizer(own: Path, cfg: C.Config) -> None:
    """A run's tokenizer copy that does not load is refused with the fix that works: remove the copy (the
    recorded data folder, or the embedded corpus, is read instead) or copy the data folder's files back;
    preparing data again would not help, since the copy is read first."""
    from tokenmill.data import load_tokenizer_for_data

    try:
        load_tokenizer_for_data(own)
    except (DataError, OSError, ValueError, KeyError, TypeError) as e:
        data = cfg.data.path or "the embedded corpus"
        why = first_line(e).split(" Fix:")[0]  # the data folder's fix (prepare again) would not help here
        raise CheckpointError(f"the run's tokenizer copy {own} is damaged ({why}). Fix: delete that "
                              f"folder (`rm -r {own}`) and tokenmill reads the tokenizer of the data the run "
                              f"trained on ({data}), or copy that folder's .json files into it.") from None


def _data_vocab(run_dir: Path, cfg: C.Config) -> int:
    """The vocabulary of the run's tokenizer (checkpoints written before the vocabulary was recorded)."""
    from tokenmill.data import load_tokenizer_for_data

    return load_tokenizer_for_data(tokenizer_dir(run_dir, cfg)).vocab_size
