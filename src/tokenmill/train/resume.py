"""Resuming a run: load the newest good checkpoint, check the model is the same, and drop the metric
lines of steps that will be trained again."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

from tokenmill import atomic, checkpoint
from tokenmill import config as C
from tokenmill.data.mixture import absolute_mixture
from tokenmill.errors import AlreadyTrained, CheckpointError, TokenmillError, TrainingError
from tokenmill.optim import hyperparameters, load_scheduler_state, reapply_hyperparameters
from tokenmill.parallel import is_elastic_restart, unwrap
from tokenmill.parallel.world import World, barrier
from tokenmill.train.metrics import read_metrics


def resume(run_dir: Path, model, optimizer, scheduler, scaler, cfg: C.Config, world: World,
           quiet: bool) -> tuple[int, Any, Optional[int]]:
    """Load the newest good checkpoint (any layout); returns (start step, RNG state to restore, global
    samples consumed: where the data stream goes on, None when the checkpoint did not record it).

    The current config's optimizer settings win over the saved ones (see
    :func:`~tokenmill.optim.reapply_hyperparameters`). A run already at ``train.max_steps`` raises
    :class:`AlreadyTrained` before anything is written."""
    built = hyperparameters(optimizer)
    vocab = getattr(unwrap(model), "vocab_size", None)  # the data's, or model.vocab_size

    def check(saved: dict) -> None:
        missing = [k for k in ("scheduler", "rng", "config") if not isinstance(saved.get(k), dict)]
        if missing:  # a damaged or foreign file: the loader reports it and tries the previous one
            raise CheckpointError(f"the checkpoint is damaged: it has no {', '.join(missing)} entry.")
        if not isinstance(saved["step"], int) or isinstance(saved["step"], bool) or saved["step"] < 0:
            raise CheckpointError(f"the checkpoint is damaged: its step is {saved['step']!r}.")
        check_same_model(saved.get("config", {}), cfg, vocab, saved.get("vocab_size"), run_dir)
        if int(saved["step"]) >= cfg.train.max_steps:
            raise AlreadyTrained(f"{run_dir} is already at step {int(saved['step'])} (train.max_steps is "
                                 f"{cfg.train.max_steps}): nothing to train, nothing was written. Raise "
                                 "--train.max_steps to train further.")

    found = checkpoint.load_latest(run_dir, model, optimizer, world, check=check)
    if found is None:  # e.g. a torchrun restart before the first checkpoint: start over, cleanly
        if world.is_rank0:
            clean_metrics(run_dir, 0)
        barrier(world)
        return 0, None, None
    path, state = found
    load_scheduler_state(scheduler, state["scheduler"])
    reapply_hyperparameters(optimizer, scheduler, built, cfg.optim, cfg.train.max_steps)
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    start_step = int(state["step"])
    start_sample = checkpoint.saved_global_samples(state)
    if world.is_rank0:
        clean_metrics(run_dir, start_step)
        if not quiet:
            print(f"tokenmill: resumed from {path} at step {start_step}")
            for note in (schedule_note(state.get("config", {}), cfg, start_step),
                         precision_note(state.get("config", {}), cfg), data_note(state.get("config", {}), cfg)):
                if note:
                    print(note)
            old = (state.get("data_position") or {}).get("global_batch")
            new = checkpoint.global_batch(cfg, world)
            if start_sample is not None and old != new:
                print(f"tokenmill: the global batch changed from {old} to {new} samples per step; the data "
                      f"stream continues at sample {start_sample} (nothing replayed or skipped)")
    barrier(world)
    return start_step, state["rng"], start_sample


def schedule_note(saved: dict, cfg: C.Config, step: int) -> Optional[str]:
    """A line for a resume whose learning-rate schedule differs from the checkpoint's at ``step`` (a new
    train.max_steps re-stretches the cosine, a new lr or min_lr moves it), with the flag that keeps the old
    decay; None when the schedule is unchanged."""
    from tokenmill.optim.schedule import lr_at

    try:
        old_optim = C.OptimConfig(**{**dataclasses.asdict(cfg.optim), **saved.get("optim", {})})
        old_max = int(saved.get("train", {}).get("max_steps", cfg.train.max_steps))
    except (TypeError, ValueError):  # a foreign config entry: nothing to compare
        return None
    before, now = lr_at(step, old_optim, old_max), lr_at(step, cfg.optim, cfg.train.max_steps)
    if math.isclose(before, now, rel_tol=1e-6, abs_tol=1e-12):
        return None
    why = (f"train.max_steps changed from {old_max} to {cfg.train.max_steps}, which re-stretches the cosine decay"
           if old_max != cfg.train.max_steps and cfg.optim.decay_steps is None else "the schedule settings changed")
    keep = (f" To keep the old decay and go on at the floor, resume with --optim.decay_steps {old_max}."
            if old_max != cfg.train.max_steps and cfg.optim.decay_steps is None and cfg.optim.schedule == "cosine" else "")
    return (f"tokenmill: note: {why}: the learning rate at step {step} is now {now:.3g} (the checkpoint's "
            f"schedule gave {before:.3g}).{keep}")


def precision_note(saved: dict, cfg: C.Config) -> Optional[str]:
    """A line for a resume under another ``train.precision`` (allowed: the loaded weights and optimizer
    state are cast to this run's dtypes); None when unchanged."""
    old = (saved.get("train") or {}).get("precision")
    if old is None or old == cfg.train.precision:
        return None
    return (f"tokenmill: note: train.precision changed from {old!r} to {cfg.train.precision!r}: the checkpoint's "
            f"weights and optimizer state are cast to it (resume with --train.precision {old} to keep it).")


def data_note(saved: dict, cfg: C.Config) -> Optional[str]:
    """A line for a resume on other data (``data.path`` or ``data.mixture`` changed; allowed: the tokenizer is
    checked by the vocabulary): the stream goes on at the same sample index of the new data, with the flag
    that keeps the checkpoint's; None when unchanged."""
    old = saved.get("data") or {}
    for key in ("mixture", "path"):
        before, now = old.get(key), getattr(cfg.data, key)
        if key in old and _absolute(key, before) != _absolute(key, now):
            keep = f"--data.{key} {before}" if before else f"no --data.{key}"
            return (f"tokenmill: note: data.{key} changed from {before!r} to {now!r}: the data stream goes on at "
                    f"the same sample index of the new data, so the run sees other samples than it would have "
                    f"(resume with {keep} to keep the checkpoint's).")
    return None


def _absolute(key: str, value: Any) -> Any:
    """A data folder or mixture as the run directory records it (absolute), so a relative flag naming the same
    folders is no change."""
    if not isinstance(value, str) or not value:
        return value
    try:
        return absolute_mixture(value) if key == "mixture" else str(Path(value).expanduser().resolve())
    except (TokenmillError, OSError):
        return value


def resume_decision(run_dir: Path, resume_run: bool, rank0: bool) -> tuple[bool, bool]:
    """(resume, the run directory holds checkpoints): a fresh run refuses a folder with checkpoints,
    ``--resume`` one without; a worker restarted by torchrun's elastic agent resumes on its own."""
    if rank0:
        checkpoint.clean_stale_tmp(run_dir)  # left by a save that was killed: never a real checkpoint
    has_checkpoints = bool(checkpoint.list_checkpoints(run_dir))
    if not resume_run and has_checkpoints and not is_elastic_restart():
        raise TrainingError(
            f"run directory {run_dir} already holds checkpoints; pass --resume to continue that run, "
            "or choose another --run-dir."
        )
    if resume_run and not has_checkpoints and (aside := set_aside_checkpoints(run_dir)):
        if rank0:  # what the non-finite stop's message advises: --resume after changing a setting
            print(f"tokenmill: note: --resume: {run_dir} has no good checkpoint: {', '.join(map(str, aside))} "
                  "produced a non-finite loss and was set aside (kept, never loaded); training starts again from "
                  "step 0 with this config.", flush=True)
        return True, False  # resume() finds no checkpoint: step 0, the old metric lines dropped
    if resume_run and not has_checkpoints:
        if (run_dir / "config.toml").is_file():  # a run stopped (Ctrl-C, a crash) before its first save
            raise TrainingError(
                f"--resume: {run_dir} has no checkpoint to resume from: the run stopped before its first save "
                f"(checkpoint.every_steps). Start it again from step 0 with its recorded config: tokenmill train "
                f"--config {run_dir / 'config.toml'} --run-dir {run_dir}")
        raise TrainingError(f"--resume: {run_dir} has no checkpoint to resume from; check the --run-dir, "
                            "or start the run without --resume.")
    return resume_run or is_elastic_restart(), has_checkpoints  # a restarted worker: from the newest checkpoint


def resume_hint(run_dir: Path, world_size: int = 1) -> str:
    """What a stopped run says last: its run directory and the command that continues it (``--resume`` from
    its newest checkpoint; before its first save, the run again from its recorded config), launched as this
    run was (torchrun with this node's process count)."""
    launch, nodes = "tokenmill", ""
    if world_size > 1:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        launch = f"torchrun --nproc-per-node {local} -m tokenmill"
        if local != world_size:
            nodes = f" (on each of the {world_size // local} nodes, with the job's rendezvous options)"
    q = shlex.quote(str(run_dir))
    found = checkpoint.list_checkpoints(run_dir)
    if found:
        return (f"run dir {run_dir} (newest checkpoint: step {found[-1][0]}); resume with: {launch} train --resume "
                f"--run-dir {q}{nodes}")
    return (f"run dir {run_dir} has no checkpoint (stopped before its first save); start it again with: {launch} "
            f"train --config {shlex.quote(str(run_dir / 'config.toml'))} --run-dir {q}{nodes}")


def set_aside_checkpoints(run_dir: Path) -> list[Path]:
    """The checkpoints of ``run_dir`` set aside because their weights produced a non-finite loss
    (``checkpoint.SET_ASIDE``), oldest first."""
    folder = checkpoint.checkpoint_dir(run_dir)
    return sorted(folder.glob(f"*{checkpoint.SET_ASIDE}")) if folder.is_dir() else []


def clean_metrics(run_dir: Path, upto_step: int) -> None:
    """On resume, drop metric lines of steps after the checkpoint (they will be trained again) and
    lines torn by a killed process or damaged (counted in a note naming the first)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return
    skipped: list[tuple[int, str]] = []
    rows = [r for r in read_metrics(run_dir, skipped) if (r.get("step") or 0) <= upto_step]
    if skipped:
        print(f"tokenmill: note: dropped {len(skipped)} line(s) of metrics.jsonl that are not metric records (a "
              f"run killed while writing?); the first: {skipped[0][1]}", file=sys.stderr)
    atomic.write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


# fields that fix the form of the optimizer state a checkpoint holds (its parameter groups, its kind of
# state): a change cannot be loaded into the optimizer this config builds
OPTIMIZER_STATE_FIELDS = ("optim.name", "optim.decay_groups", "memory.optimizer_8bit", "memory.optimizer_in_backward")


def check_same_model(saved: dict[str, Any], cfg: C.Config, vocab: Optional[int] = None,
                     saved_vocab: Optional[int] = None, run_dir: Optional[Path] = None) -> None:
    """Refuse to resume when anything the checkpoint holds has changed: the model's shape fields, the
    vocabulary (``saved_vocab`` recorded vs ``vocab`` the model has now: a data folder of another tokenizer),
    the fields that fix the optimizer state (:data:`OPTIMIZER_STATE_FIELDS`), LoRA's adapters. One message
    names every change and the flags that restore the checkpoint's values."""
    changes = _changes(saved, cfg)
    keep = [f"--{k} {cli_value(old)}" for k, old, _ in changes]
    if vocab is not None and isinstance(saved_vocab, int) and saved_vocab != vocab and not any(
            k == "model.vocab_size" for k, _, _ in changes):
        changes.append((f"the vocabulary of data.path {cfg.data.path}" if cfg.data.path else "the vocabulary",
                        saved_vocab, vocab))
        keep.append(_vocab_fix(saved, cfg, run_dir))
    if changes:
        pairs = ", ".join(f"{k}: checkpoint {old!r} vs now {new!r}" for k, old, new in changes)
        hint = (f"What a checkpoint holds cannot change on resume: resume with the checkpoint's values "
                f"({' '.join(keep)}), or start a new run.")
        if any(k in ("model.fused_qkv", "model.tie_embeddings") for k, _, _ in changes):
            hint += (" Tensor parallelism needs --model.fused_qkv false and pipeline parallelism "
                     "--model.tie_embeddings false; to use them later, train from the start with those.")
        raise TrainingError(f"cannot resume: the run differs from the checkpoint's ({pairs}). {hint}")
    check_same_adapters(saved.get("lora") or {}, cfg)


def _changes(saved: dict[str, Any], cfg: C.Config) -> list[tuple[str, Any, Any]]:
    """``(key, checkpoint value, current value)`` for each shape field and optimizer-state field that differs
    (a field the checkpoint's config does not record is taken as unchanged; missing optimizer fields as
    their defaults, what older checkpoints ran with)."""
    out = []
    saved_model, now = saved.get("model", {}) or {}, dataclasses.asdict(cfg.model)
    for k in C.shape_fields(layout=True):
        if k in saved_model and saved_model[k] != now[k]:
            out.append((f"model.{k}", saved_model[k], now[k]))
    defaults = C.Config()
    for key in OPTIMIZER_STATE_FIELDS:
        section, name = key.split(".")
        current = getattr(getattr(cfg, section), name)
        old = (saved.get(section) or {}).get(name, getattr(getattr(defaults, section), name))
        if old != current:
            out.append((key, old, current))
    return out


def _vocab_fix(saved: dict[str, Any], cfg: C.Config, run_dir: Optional[Path]) -> str:
    """The flag that gives the model the checkpoint's vocabulary again: the data folder it trained on, else
    data tokenized with the run's own tokenizer."""
    old_path = (saved.get("data") or {}).get("path")
    if old_path and old_path != cfg.data.path:
        return f"--data.path {old_path}"
    return (f"--data.path DIR, with DIR prepared by the run's tokenizer: `tokenmill prepare TEXT --out DIR "
            f"--tokenizer-from {run_dir or 'RUN'}`")


def check_same_adapters(saved_lora: dict[str, Any], cfg: C.Config) -> None:
    """LoRA's rank and targets fix which adapters a checkpoint holds (a checkpoint without a ``lora`` entry
    has none): they cannot change on resume. lora.alpha and lora.dropout may."""
    before = (int(saved_lora.get("rank", 0) or 0), C.lora_roles(str(saved_lora.get("targets", "all")), cfg.model.mlp))
    now = (cfg.lora.rank, C.lora_roles(cfg.lora.targets, cfg.model.mlp))
    if before[0] == now[0] == 0 or before == now:
        base = str(saved_lora.get("quantize_base", "none"))
        if now[0] and base != cfg.lora.quantize_base:
            raise TrainingError(f"cannot resume: the checkpoint's frozen base is lora.quantize_base={base!r}, this "
                                f"config {cfg.lora.quantize_base!r}. Resume with --lora.quantize_base {base}, or "
                                "start a new run.")
        return
    keep = f"--lora.rank {before[0]}" + (f" --lora.targets {','.join(before[1])}" if before[0] else "")
    raise TrainingError(f"cannot resume: the checkpoint has LoRA {_adapters(*before)}, this config "
                        f"{_adapters(*now)}. Resume with {keep}, or start a new run (to fine-tune a LoRA run's "
                        "merged weights further: --train.init_from RUN).")


def _adapters(rank: int, roles: tuple[str, ...]) -> str:
    return f"rank {rank} on {','.join(roles)}" if rank else "no adapters (rank 0)"


def cli_value(v: Any) -> str:
    """A config value as written on the command line (``true``, ``64``)."""
    return str(v).lower() if isinstance(v, bool) else str(v)
