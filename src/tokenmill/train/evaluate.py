"""``tokenmill eval``: validation loss, perplexity and bits per byte of a run's checkpoint.

What is evaluated: the validation split of the run's data (or of ``data_path``, which must use the
run's tokenizer), either

- **whole** (default): consecutive non-overlapping windows of ``model.block_size`` tokens from the
  start of the split, the last one shorter, so that every token after the first is predicted exactly
  once, from up to ``block_size`` tokens of context; or
- **``batches`` = N**: N micro-batches of windows spread evenly over the split, the same windows the
  training run evaluates with ``train.eval_batches = N`` and the same ``train.batch_size`` (so the
  loss equals the run's logged ``val_loss`` of that checkpoint).

The numbers (``nats``: the summed cross-entropy of every predicted token, natural log):

- ``val_loss`` = nats / predicted tokens; ``perplexity`` = exp(val_loss);
- ``bits_per_byte`` = nats / ln 2 / bytes, where ``bytes`` is the length in UTF-8 bytes of the text
  of the predicted tokens, counted exactly from each id's byte string (byte-level BPE and tiktoken
  tokens are byte strings, a byte id is one byte, special tokens such as ``<|endoftext|>`` count 0
  bytes; a token of a non-byte-level tokenizer counts the UTF-8 bytes of its decoded text). It
  compares models with different tokenizers on the same text.

A run that learned through a chat folder's loss mask (``data.loss_mask``) is evaluated as it trained: on the
split's chat windows (``data.chat_packing``: whole conversations, packed or padded, the packed ones kept apart),
over the learned tokens only, with the trainer's terms (:func:`tokenmill.train.loss_mask.eval_terms`): the
summed loss of the learned targets / their number, so ``batches`` = N gives the run's logged ``val_loss``; the
whole split is every window once, and ``tokens`` / ``bytes`` count the learned targets.

The result is printed and written to ``RUN/eval.json`` (atomically).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from tokenmill import atomic, checkpoint
from tokenmill import config as C
from tokenmill.checkpoint.files import DCP_NAME, FILE_NAME
from tokenmill.data import WindowDataset, open_token_data, val_batches
from tokenmill.data.chat_windows import ChatWindows
from tokenmill.data.dataset import IGNORE_INDEX
from tokenmill.data.loader import use_loss_mask
from tokenmill.data.meta import read_meta
from tokenmill.data.tokenizers import (
    BpeTokenizer,
    ByteTokenizer,
    TiktokenTokenizer,
    bytes_to_unicode,
    load_tokenizer_for_data,
)
from tokenmill.errors import DataError
from tokenmill.model import GPT
from tokenmill.train.loss_mask import eval_terms
from tokenmill.train.parallelize import document_eot_id, keep_documents_apart

__all__ = ["EVAL_FILE", "evaluate_model", "evaluate_run", "token_byte_lengths", "whole_split_batches"]

EVAL_FILE = "eval.json"


def token_byte_lengths(tok: Any, vocab_size: int) -> np.ndarray:
    """UTF-8 bytes of each id's text (special tokens 0), an int64 array of ``vocab_size`` entries."""
    out = np.zeros(vocab_size, dtype=np.int64)
    if isinstance(tok, ByteTokenizer):
        out[:256] = 1
    elif isinstance(tok, TiktokenTokenizer):
        enc = tok._enc
        special = set(enc._special_tokens.values())
        for i in range(min(enc.n_vocab, vocab_size)):
            if i not in special:
                try:
                    out[i] = len(enc.decode_single_token_bytes(i))
                except KeyError:  # a gap in the ranks
                    pass
    elif isinstance(tok, BpeTokenizer):
        hft = tok._tok
        byte_chars = set(bytes_to_unicode().values())
        added = {i: t for i, t in hft.get_added_tokens_decoder().items()}
        for text, i in hft.get_vocab(with_added_tokens=False).items():
            if i >= vocab_size or i in added:
                continue
            # byte-level BPE: one character per byte; otherwise the decoded text's bytes
            out[i] = len(text) if all(c in byte_chars for c in text) else len(hft.decode([i]).encode("utf-8"))
        for i, t in added.items():
            if i < vocab_size and not t.special:
                out[i] = len(t.content.encode("utf-8"))
    else:
        for i in range(vocab_size):
            out[i] = len(tok.decode([i]).encode("utf-8"))
    return out


def whole_split_batches(tokens: np.ndarray, block_size: int, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The whole split as ``(x, y)`` batches of consecutive non-overlapping windows (the last window,
    shorter, in a batch of its own): every token after the first is a target exactly once. Lazy: a
    memory-mapped split is read one batch at a time."""
    n = len(tokens)
    full = (n - 1) // block_size
    for b in range(0, full, batch_size):
        rows = [np.asarray(tokens[i * block_size : (i + 1) * block_size + 1], dtype=np.int64)
                for i in range(b, min(b + batch_size, full))]
        chunk = torch.from_numpy(np.stack(rows))
        yield chunk[:, :-1], chunk[:, 1:]
    if n - 1 > full * block_size:
        tail = torch.from_numpy(np.asarray(tokens[full * block_size :], dtype=np.int64))[None]
        yield tail[:, :-1], tail[:, 1:]


def chat_batches(chat: ChatWindows, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Every window of a chat split once, in order, ``batch_size`` to a batch (lazy: one batch read at a time)."""
    for a in range(0, chat.n_windows, batch_size):
        rows = [chat.window(j) for j in range(a, min(a + batch_size, chat.n_windows))]
        yield torch.stack([x for x, _ in rows]), torch.stack([y for _, y in rows])


@torch.inference_mode()
def evaluate_model(model: GPT, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                   byte_lengths: Optional[np.ndarray] = None, device: torch.device | str = "cpu",
                   masked: bool = False) -> dict[str, Any]:
    """Loss, perplexity and (with ``byte_lengths``, see :func:`token_byte_lengths`) bits per byte of
    ``model`` over ``batches`` of ``(x, y)`` ids; the model's own loss (its loss form and precision
    switches). ``masked``: over the learned targets only (the others -100), as the trainer's evaluation."""
    was_training = model.training
    model.eval()
    nats, tokens, nbytes, windows, n_batches = 0.0, 0, 0, 0, 0
    try:
        for x, y in batches:
            windows += x.size(0)
            n_batches += 1
            x, y = x.to(device, torch.int64), y.to(device, torch.int64)
            if masked:  # the trainer's terms: [summed loss of the learned targets, their number]
                loss_sum, learned = eval_terms(model(x, y, reduction="sum")[1], y, True).tolist()
                nats, tokens = nats + loss_sum, tokens + int(learned)
            else:
                nats += float(model(x, y)[1].float()) * y.numel()
                tokens += y.numel()
            if byte_lengths is not None:
                nbytes += int(byte_lengths[y[y != IGNORE_INDEX].cpu().numpy()].sum())
    finally:
        model.train(was_training)
    if tokens == 0:
        raise DataError("nothing to evaluate: no validation tokens" + (" learned (the windows' loss mask leaves "
                        "none)." if masked else "."))
    loss = nats / tokens
    out = {"windows": windows, "batches": n_batches, "tokens": tokens, "nats": nats, "val_loss": loss, "perplexity": math.exp(min(loss, 700.0)),
           "bits_per_token": loss / math.log(2)}
    if byte_lengths is not None:
        out["bytes"] = nbytes
        out["bits_per_byte"] = nats / math.log(2) / nbytes if nbytes else None
    return out


def _data_folder(cfg: C.Config, data_path: Optional[str | Path], run_dir: Path) -> Path:
    if data_path is not None:
        return Path(data_path)
    if cfg.data.source == "synthetic":
        raise DataError(f"{run_dir} was trained on synthetic tokens: there is no text to evaluate on. Pass a "
                        "prepared folder with the run's vocabulary: --data.path DATA.")
    if cfg.data.mixture:  # one folder's val split at a time: the user says which
        raise DataError(f"{run_dir} was trained on a data mixture ({cfg.data.mixture}); evaluate one of its folders "
                        "at a time: --data.path DATA.")
    if cfg.data.path:
        return Path(cfg.data.path)
    from tokenmill.data import ensure_embedded_corpus

    return ensure_embedded_corpus(cfg.data, progress=False)


def _check_same_tokenizer(data: Path, run_tok: Optional[Path], vocab_size: int) -> None:
    """The data must be tokenized with the run's tokenizer: the same vocabulary size as the run's
    tokenizer (a synthetic run: at most the model's)."""
    theirs = (read_meta(data).get("tokenizer") or {}).get("vocab_size")
    ours = (read_meta(run_tok).get("tokenizer") or {}).get("vocab_size") if run_tok is not None else None
    if theirs == ours or (ours is None and theirs is not None and theirs <= vocab_size):
        return
    raise DataError(
        f"the data in '{data}' has a tokenizer of {theirs} ids, the run's has {ours or vocab_size}: the loss "
        "would be meaningless. Fix: tokenize the text with the run's tokenizer "
        "(`tokenmill prepare TEXT --out DIR --tokenizer-from RUN`)."
    )


def evaluate_run(run_dir: str | Path, data_path: Optional[str | Path] = None, batches: Optional[int] = None,
                 batch_size: Optional[int] = None, checkpoint_path: Optional[str | Path] = None,
                 device: torch.device | str = "cpu", write: bool = True, progress: bool = False) -> dict[str, Any]:
    """Evaluate the newest good checkpoint of ``run_dir`` (or ``checkpoint_path``) on the validation split
    (see the module docstring); returns the result and writes it to ``RUN/eval.json`` (``write``).
    ``batch_size``: default the run's ``train.batch_size``. ``progress``: a bar on a terminal, else a line
    with the rate and ETA about every tenth of the batches (stderr)."""
    from tokenmill.checkpoint import tokenizer_dir

    run_dir = Path(run_dir)
    model, cfg, path = checkpoint.load_model(run_dir, checkpoint_path)
    folder = _data_folder(cfg, data_path, run_dir)
    keep_documents_apart(model, cfg, folder, document_eot_id(cfg, folder, torch.device(device)))  # as it trained
    run_tok = None if cfg.data.source == "synthetic" else tokenizer_dir(run_dir, cfg)
    _check_same_tokenizer(folder, run_tok, model.vocab_size)
    vf = open_token_data(folder, "val", model.vocab_size, "quick")
    bs, B = cfg.model.block_size, batch_size or cfg.train.batch_size
    if (batches is not None and batches < 1) or B < 1:
        raise DataError(f"--batches and --batch-size must be >= 1, got {batches} and {B}.")
    if len(vf) < 2:
        raise DataError(f"'{vf.file}' holds {len(vf)} tokens: nothing to predict. Prepare more text (--val-fraction).")
    masked = use_loss_mask(cfg.data.loss_mask, [vf], None)  # a chat folder: its learned tokens, as trained
    chat = ChatWindows(vf, bs, cfg.data.chat_packing, "sequential") if masked else None
    if batches is None and chat is not None:  # every window once
        data, total = chat_batches(chat, B), -(-chat.n_windows // B)
    elif batches is None:
        data = whole_split_batches(vf.tokens, bs, B)
        total = -(-((len(vf) - 1) // bs) // B) + (1 if (len(vf) - 1) % bs else 0)
    else:
        data = val_batches(chat or WindowDataset(vf, bs, "sequential"), B, batches)
        total = batches
    if progress:
        data = _reporting(data, total)
    lengths = token_byte_lengths(load_tokenizer_for_data(folder), model.vocab_size)
    result = evaluate_model(model.to(device), data, lengths, device, masked)
    m = FILE_NAME.match(path.name) or DCP_NAME.match(path.name)
    result = {"run_dir": str(run_dir), "checkpoint": str(path), "step": int(m.group(1)) if m else None,
              "data": str(folder), "split": "val", "whole_split": batches is None, "batch_size": B,
              "block_size": bs, "learned_only": masked, **result}
    if write:
        atomic.write_json(run_dir / EVAL_FILE, result)
    return result


def _reporting(batches: Iterable, total: int) -> Iterator:
    """``batches`` unchanged, with a progress bar (terminal) or a line every tenth of ``total`` (stderr)."""
    import sys

    from tokenmill.train.metrics import Progress

    bar = Progress("auto", total, 0, unit="batch")
    every = max(1, total // 10)
    try:
        for b in batches:
            yield b
            bar.update()
            if bar.bar is None and (bar.n % every == 0 or bar.n == total):
                print(f"eval{bar.status()}", file=sys.stderr, flush=True)
    finally:
        bar.close()


def format_result(r: dict[str, Any]) -> str:
    """Two lines for the console."""
    what = "the whole val split" if r["whole_split"] else f"{r['batches']} val batches"
    head = (f"eval of {r['checkpoint']} (step {r['step']}) on {what} of {r['data']}: {r['tokens']:,} "
            f"{'learned ' if r.get('learned_only') else ''}tokens, "
            f"{r.get('bytes', 0):,} bytes, {r['windows']} windows")
    bpb = f" | bits/byte {r['bits_per_byte']:.4f}" if r.get("bits_per_byte") is not None else ""
    return f"{head}\nval_loss {r['val_loss']:.4f} | perplexity {r['perplexity']:.3f}{bpb}"
