"""``tokenmill export``: a run's checkpoint as a Hugging Face model folder.

The class is the one that holds the model exactly (:func:`tokenmill.model.hf.export_architecture`):
``GPT2LMHeadModel`` for learned positions; for rotary models the class of the run's
``train.init_from`` source when it was a Hugging Face folder (still present) of the Llama family,
else ``Qwen3ForCausalLM`` (q/k norms), ``Qwen2ForCausalLM`` (q/k/v biases only) or
``LlamaForCausalLM``. The folder holds ``config.json`` and ``model.safetensors``
(:func:`tokenmill.model.hf.save_hf`: the same logits as the tokenmill model, for tied and untied heads,
padded vocabularies, fused or separate q/k/v) and, when the run's tokenizer has a Hugging Face form,
``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` (``AutoTokenizer`` loads
them). Any checkpoint loads: single files and sharded DCP folders of FSDP/TP/PP runs alike
(:func:`tokenmill.checkpoint.load_model`). A LoRA run (``lora.rank > 0``) exports its adapters merged into
the base weights, ``W + (alpha / r) B A`` (:func:`tokenmill.model.lora.merge_lora`): an ordinary folder of
the same class, which ``from_pretrained`` loads with no adapter library.

Models no class can express (e.g. GPT-2 without biases, rotary with q/k norms and biases) are refused
with the reason before anything is written. The folder is written under a temporary name next to ``out_dir`` and renamed into place when
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
from tokenmill.paths import check_output

__all__ = ["ExportResult", "export_hf"]


@dataclass
class ExportResult:
    """What :func:`export_hf` wrote: the folder, the checkpoint it came from, the file names, why no
    tokenizer files were written (None when they were), and the Hugging Face class."""

    out_dir: Path
    checkpoint: Path
    files: list[str] = field(default_factory=list)
    tokenizer_skipped: Optional[str] = None
    architecture: str = "GPT2LMHeadModel"


def export_hf(run_dir: str | Path, out_dir: str | Path, checkpoint: str | Path | None = None,
              overwrite: bool = False) -> ExportResult:
    """Write the model of ``run_dir``'s newest good checkpoint (or ``checkpoint``) as a Hugging Face
    folder ``out_dir``; see the module docstring. Raises :class:`CheckpointError` for a model no
    Hugging Face class expresses, a non-empty ``out_dir`` without ``overwrite``, or a checkpoint that
    does not load."""
    from tokenmill.checkpoint import load_model, tokenizer_dir
    from tokenmill.data.tokenizers import load_tokenizer_for_data, write_hf_tokenizer_for_data
    from tokenmill.errors import DataError
    from tokenmill.model import hf

    run_dir, out = Path(run_dir), Path(out_dir)
    check_output(out, {"the run directory": run_dir, "the checkpoint": checkpoint})
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise CheckpointError(f"--out {out} exists and is not empty; choose a new folder, or pass --overwrite to "
                              "replace it (it is replaced only once the export is complete).")
    model, cfg, path = load_model(run_dir, checkpoint)
    check_output(out, {"the run's data folder": cfg.data.path, "the run's train.init_from": cfg.train.init_from})
    if overwrite and out.exists():
        _check_replaceable(out)
    like = _source_config(cfg.train.init_from)
    arch = hf.export_architecture(cfg.model, like)  # before anything is written
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
        hf.save_hf(model.state_dict(), cfg.model, tmp, vocab_size=model.vocab_size, eot_id=eot, like=like)
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
    return ExportResult(out, path, files, skipped, arch)


_EXPORT_FILES = {"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                 "pytorch_model.bin", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "vocab.json", "merges.txt", "added_tokens.json"}


def _check_replaceable(out: Path) -> None:
    """``--overwrite`` replaces an earlier export, nothing else: a file, or a folder holding anything an
    export does not write (a run's checkpoints, a data folder, your files), is refused."""
    if not out.is_dir():
        raise CheckpointError(f"--out {out} is a file, not an earlier export; --overwrite replaces only a folder "
                              "that tokenmill export wrote. Choose another --out.")
    foreign = sorted(p.name for p in out.iterdir()
                     if p.name not in _EXPORT_FILES and not p.name.startswith("model-0"))
    if foreign:
        raise CheckpointError(f"--out {out} holds {', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}, "
                              "which an export does not write: --overwrite replaces only an earlier export, so "
                              "nothing was touched. Choose another --out.")


def _source_config(init_from: Optional[str]) -> Optional[dict]:
    """The checked config.json of a run's ``train.init_from`` when it is a Hugging Face folder still
    here (the export then keeps its class and special token ids), else None."""
    from tokenmill.model import hf

    if not init_from or not hf.is_hf_folder(Path(init_from).expanduser()):
        return None
    try:
        return hf.read_hf_config(Path(init_from).expanduser())
    except CheckpointError:
        return None
