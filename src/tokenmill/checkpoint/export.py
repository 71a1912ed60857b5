"""``tokenmill export``: a run's checkpoint as a Hugging Face ``GPT2LMHeadModel`` folder.

The folder holds ``config.json`` and ``model.safetensors`` (:func:`tokenmill.model.hf.save_hf_gpt2`:
the same logits as the tokenmill model, for tied and untied heads, padded vocabularies, fused or
separate q/k/v) and, when the run's tokenizer has a Hugging Face form, ``tokenizer.json``,
``tokenizer_config.json`` and ``special_tokens_map.json`` (``AutoTokenizer`` loads them). Any
checkpoint loads: single files and sharded DCP folders of FSDP/TP/PP runs alike
(:func:`tokenmill.checkpoint.load_model`).

Models GPT-2 cannot express (no biases, no q/k/v bias) are refused with the reason before anything is
written. The folder is written under a temporary name next to ``out_dir`` and renamed into place when
complete; an existing non-empty ``out_dir`` is an error unless ``overwrite`` (then it is replaced
only once the new folder is complete).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from tokenmill.errors import CheckpointError

__all__ = ["ExportResult", "export_hf"]


@dataclass
class ExportResult:
    """What :func:`export_hf` wrote: the folder, the checkpoint it came from, the file names, and why
    no tokenizer files were written (None when they were)."""

    out_dir: Path
    checkpoint: Path
    files: list[str] = field(default_factory=list)
    tokenizer_skipped: Optional[str] = None


def export_hf(run_dir: str | Path, out_dir: str | Path, checkpoint: str | Path | None = None,
              overwrite: bool = False) -> ExportResult:
    """Write the model of ``run_dir``'s newest good checkpoint (or ``checkpoint``) as a Hugging Face
    GPT-2 folder ``out_dir``; see the module docstring. Raises :class:`CheckpointError` for a model
    GPT-2 cannot express, a non-empty ``out_dir`` without ``overwrite``, or a checkpoint that does not
    load."""
    from tokenmill.checkpoint import load_model, tokenizer_dir
    from tokenmill.data.tokenizers import load_tokenizer_for_data, write_hf_tokenizer_for_data
    from tokenmill.errors import DataError
    from tokenmill.model import hf

    run_dir, out = Path(run_dir), Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise CheckpointError(f"--out {out} exists and is not empty; choose a new folder, or pass --overwrite to "
                              "replace it (it is replaced only once the export is complete).")
    model, cfg, path = load_model(run_dir, checkpoint)
    hf.check_exportable(cfg.model)  # before anything is written
    tok_dir = None if cfg.data.source == "synthetic" else tokenizer_dir(run_dir, cfg, progress=False)
    eot = None
    if tok_dir is not None:
        try:
            eot = load_tokenizer_for_data(tok_dir).eot_id
        except DataError:
            pass  # no tokenizer files then; the reason is reported below
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        hf.save_hf_gpt2(model.state_dict(), cfg.model, tmp, vocab_size=model.vocab_size, eot_id=eot)
        if tok_dir is None:
            skipped: Optional[str] = "the run was trained on synthetic tokens (no tokenizer)"
        else:
            _, skipped = write_hf_tokenizer_for_data(tok_dir, tmp, model_max_length=cfg.model.block_size)
        files = sorted(p.name for p in tmp.iterdir())
        if out.exists():  # overwrite: swap only now that the new folder is complete
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        else:
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportResult(out, path, files, skipped)
