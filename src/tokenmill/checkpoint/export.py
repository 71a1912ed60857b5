"""``tokenmill export``: a run's checkpoint as a Hugging Face model folder.

The class is the one that holds the model exactly (:func:`tokenmill.model.hf.export_architecture`):
``GPT2LMHeadModel`` for learned positions; for rotary models the class of the run's
``train.init_from`` source when it was a Hugging Face folder (still present) of the Llama family,
else ``Qwen3ForCausalLM`` (q/k norms), ``Qwen2ForCausalLM`` (q/k/v biases only) or
``LlamaForCausalLM``. The folder holds ``config.json`` and ``model.safetensors``
(:func:`tokenmill.model.hf.save_hf`: the same logits as the tokenmill model, for tied and untied heads,
padded vocabularies, fused or separate q/k/v) and, when the run's tokenizer has a Hugging Face form,
``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` (``AutoTokenizer`` loads
them). A run trained on chat data (``prepare --format chat``), or fine-tuned from a Hugging Face folder with a
chat template, also gets that template (``chat_template.jinja`` and ``tokenizer_config.json``'s
``chat_template``), the special tokens it names (``bos_token``, ``eos_token``, ...) and a
``generation_config.json`` that stops at the template's end-of-turn token (:func:`find_chat_files`), so
``apply_chat_template(messages, tokenize=True)`` gives the ids the run trained on and a text-generation
pipeline ends its reply where the run learned to. Any checkpoint loads: single files and sharded DCP folders of FSDP/TP/PP runs alike
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

from tokenmill.errors import CheckpointError, PathError
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
    chat_template: Optional[str] = None  # where the chat template written came from (None: none written)
    chat_skipped: Optional[str] = None  # why a chat run's template was not written


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
        chat = _chat_files(tok_dir, cfg) if tok_dir is not None and skipped is None else None
        if chat is not None and chat.template is not None:
            write_chat_files(tmp, chat)
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
    return ExportResult(out, path, files, skipped, arch, chat.origin if chat and chat.template else None,
                        chat.missing if chat else None)


_EXPORT_FILES = {"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                 "pytorch_model.bin", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja"}


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


# ----------------------------------------------------------------------------------------------
# The chat template a run trained with (also what ``tokenmill chat`` renders a run's conversations with)

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass
class ChatFiles:
    """A run's chat template and what it needs. ``template``: the Jinja text (None: none found; ``missing`` says
    why for a run trained on chat data); ``origin``: the file or folder it was read from; ``specials``: the
    special tokens its variables name (``bos_token``, ``eos_token``, ...: the model folder's); ``end_of_turn``:
    the token that ends a reply; ``trained_sha256``: the sha256 of the template the chat data was prepared with
    (None: the run's data is not chat data)."""

    template: Optional[str] = None
    origin: str = ""
    specials: dict = field(default_factory=dict)
    end_of_turn: Optional[str] = None
    trained_sha256: Optional[str] = None
    missing: Optional[str] = None


def find_chat_files(tok_dir: Path, cfg) -> ChatFiles:
    """The chat template of a run whose tokenizer loads from ``tok_dir`` (its ``RUN/tokenizer`` copy or data
    folder) with config ``cfg``. Chat data (``meta.json`` has a ``"chat"`` section): the template whose sha256
    is the recorded ``template_sha256``, looked for in ``tok_dir``, the run's data folder, the model folder the
    data was prepared with and the run's ``train.init_from`` (a changed or missing file is never taken for it).
    Other data: the template of ``train.init_from``, a Hugging Face folder with the run's tokens. The special
    tokens are those of the first of these model folders whose tokenizer.json holds the run's tokens."""
    import hashlib

    from tokenmill.filecheck import get, read_json
    from tokenmill.paths import inside

    where = f"the run's data description '{tok_dir / 'meta.json'}'"
    meta = read_json(tok_dir / "meta.json", "the run's data description", CheckpointError)
    chat = get(meta, "chat", dict, where, err=CheckpointError, default=None)
    tok = get(meta, "tokenizer", dict, where, err=CheckpointError, default=None) or {}
    made_from = get(tok, "from", str, f"{where}: tokenizer", err=CheckpointError, default=None)
    init = cfg.train.init_from
    folders = [Path(p).expanduser() for p in (made_from, init) if p]
    models = [f for f in folders if f.is_dir() and _same_tokens(f / "tokenizer.json", tok_dir / "tokenizer.json")]
    specials = _special_tokens(models[0]) if models else {}
    if chat is None:
        source = Path(init).expanduser() if init else None
        tpl = _folder_template(source) if source in models else None
        return ChatFiles(tpl, str(source), specials) if tpl else ChatFiles()
    sha = get(chat, "template_sha256", str, f"{where}: chat", err=CheckpointError)
    name = get(chat, "template", str, f"{where}: chat", err=CheckpointError, default=TEMPLATE_FILE)
    eot = get(chat, "end_of_turn", str, f"{where}: chat", err=CheckpointError, default=None)
    given = get(chat, "template_from", str, f"{where}: chat", err=CheckpointError, default=None)
    files = [inside(tok_dir, name, f"{where}: chat.template", CheckpointError)]
    if cfg.data.path:
        files.append(inside(Path(cfg.data.path).expanduser(), name, f"{where}: chat.template", CheckpointError))
    files += [Path(given).expanduser()] if given else []
    looked = []
    for origin in [*files, *folders]:
        text = _folder_template(origin) if origin.is_dir() else _read_text(origin)
        looked.append(str(origin))
        if text is not None and hashlib.sha256(text.encode("utf-8")).hexdigest() == sha:
            return ChatFiles(text, str(origin), specials or ({"eos_token": eot} if eot else {}), eot, sha)
    return ChatFiles(None, "", specials, eot, sha, missing=(
        f"the chat template the run's data was prepared with (sha256 {sha[:12]}...) is in none of {', '.join(looked)} "
        "(moved, deleted or changed since)"))


def _chat_files(tok_dir: Path, cfg) -> ChatFiles:
    """:func:`find_chat_files` for an export: a damaged record is the reason no template was written, not the
    end of the export."""
    try:
        return find_chat_files(tok_dir, cfg)
    except (CheckpointError, PathError) as e:
        return ChatFiles(missing=str(e).rstrip("."))


def _read_text(path: Path) -> Optional[str]:
    try:
        return path.read_text(encoding="utf-8") if path.is_file() else None
    except (OSError, UnicodeDecodeError):
        return None


def _folder_template(folder: Optional[Path]) -> Optional[str]:
    """A Hugging Face folder's chat template as transformers reads it: ``chat_template.jinja``, else
    ``tokenizer_config.json``'s ``chat_template`` (a string, or the one named 'default' of a list)."""
    if folder is None or not folder.is_dir():
        return None
    text = _read_text(folder / TEMPLATE_FILE)
    if text is not None:
        return text
    tpl = _tokenizer_config(folder).get("chat_template")
    if isinstance(tpl, list):
        tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None)
    return tpl if isinstance(tpl, str) and tpl.strip() else None


def _tokenizer_config(folder: Path) -> dict:
    from tokenmill.filecheck import read_json

    path = folder / "tokenizer_config.json"
    try:
        return read_json(path, "Hugging Face", CheckpointError) if path.is_file() else {}
    except CheckpointError:
        return {}  # a damaged source config: its special tokens are not taken


def _special_tokens(folder: Path) -> dict:
    """The special tokens (text) a model folder's tokenizer_config.json names."""
    out = {}
    for key, value in _tokenizer_config(folder).items():
        if key in SPECIAL_KEYS:
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                out[key] = value
    return out


def _same_tokens(a: Path, b: Path) -> bool:
    """Whether two tokenizer.json files map the same tokens to the same ids (False when either does not load)."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(a)).get_vocab(True) == Tokenizer.from_file(str(b)).get_vocab(True)
    except Exception:  # noqa: BLE001 - tokenizers raises its own Exception type for a file it cannot read
        return False


def write_chat_files(folder: Path, chat: ChatFiles) -> list[str]:
    """Write ``chat``'s template into the Hugging Face tokenizer folder ``folder`` (which holds tokenizer.json):
    ``chat_template.jinja`` and ``tokenizer_config.json``'s ``chat_template`` (read by transformers 5 and 4),
    its special tokens (tokenizer_config.json, special_tokens_map.json), and ``generation_config.json``
    whose end ids are the eos token's and the end-of-turn token's. Returns the file names."""
    from tokenizers import Tokenizer

    from tokenmill import atomic
    from tokenmill.filecheck import read_json

    path = folder / "tokenizer_config.json"
    config = read_json(path, "the tokenizer config", CheckpointError) if path.is_file() else {}
    specials = {**{k: v for k, v in config.items() if k in SPECIAL_KEYS}, **chat.specials}
    config = {**{k: v for k, v in config.items() if k not in SPECIAL_KEYS}, **specials, "chat_template": chat.template}
    atomic.write_text(folder / TEMPLATE_FILE, chat.template)
    atomic.write_json(path, config)
    atomic.write_json(folder / "special_tokens_map.json", specials)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ends = [i for t in (specials.get("eos_token"), chat.end_of_turn) if t and (i := tok.token_to_id(t)) is not None]
    bos = tok.token_to_id(specials["bos_token"]) if specials.get("bos_token") else None
    gen = {"bos_token_id": bos, "eos_token_id": sorted(set(ends)) or None}
    if specials.get("pad_token") and tok.token_to_id(specials["pad_token"]) is not None:
        gen["pad_token_id"] = tok.token_to_id(specials["pad_token"])
    atomic.write_json(folder / "generation_config.json", gen)
    return [TEMPLATE_FILE, "generation_config.json", "special_tokens_map.json", "tokenizer_config.json"]
