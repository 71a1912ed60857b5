"""``tokenmill prepare`` on the command line: its options, reusing an existing tokenizer
(``--tokenizer-from``), and the run (above ``prepare`` and the embedded corpus, which it may use)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from tokenmill.config.options import number
from tokenmill.errors import DataError, describe_os_error
from tokenmill.filecheck import get, read_toml
from tokenmill.paths import check_output, check_text

from .chat import LEARN, OVERFLOW
from .meta import META_NAME
from .prepare import DEFAULT_GLOB, ON_BAD, prepare
from .shards import SHARD_TOKENS
from .sources import DEFAULT_GLOB_HELP, KINDS
from .tokenizers import (
    NAMES,
    TOKENIZER_FILE,
    TiktokenTokenizer,
    get_tokenizer,
    is_tiktoken_cache,
    load_hf_tokenizer_file,
    load_tokenizer_for_data,
    load_vocab_merges,
)

# ----------------------------------------------------------------------------------------------
# Reusing a tokenizer


def _run_data_folder(run_dir: Path) -> Path:
    """The prepared data folder a run directory's ``config.toml`` trained on (its values type-checked: a
    damaged config.toml is one error naming it)."""
    from .corpus import ensure_embedded_corpus

    cfg_path = run_dir / "config.toml"
    where = f"'{cfg_path}'"
    data = get(read_toml(cfg_path, "run config", DataError), "data", dict, where, default={})
    where = f"{where}: [data]"
    data = {"source": get(data, "source", str, where, default=None), "path": get(data, "path", str, where, default=None),
            "tokenizer": get(data, "tokenizer", str, where, default="bpe"),
            "bpe_vocab_size": get(data, "bpe_vocab_size", int, where, lo=1, default=4096),
            "cache_dir": get(data, "cache_dir", str, where, default=None)}
    if data["source"] == "synthetic":
        raise DataError(
            f"run '{run_dir}' trained on synthetic tokens (data.source = 'synthetic'): it has no tokenizer to "
            "reuse. Fix: pass the data folder or tokenizer.json to reuse instead."
        )
    if data.get("path"):
        path = Path(data["path"]).expanduser()
        if not path.is_absolute() and not path.exists() and (run_dir / path).exists():
            path = run_dir / path  # a path relative to the run directory
        if not path.exists():
            raise DataError(
                f"run '{run_dir}' trained on data.path = '{data['path']}', which does not exist here. Fix: pass "
                "that data folder (or its tokenizer.json) to --tokenizer-from directly."
            )
        return path
    # the embedded corpus: its prepared folder in the cache (prepared again, identically, if gone)
    from types import SimpleNamespace

    dc = SimpleNamespace(tokenizer=data["tokenizer"], bpe_vocab_size=data["bpe_vocab_size"], cache_dir=data["cache_dir"])
    return ensure_embedded_corpus(dc)


def tokenizer_from(source: str | Path):
    """The tokenizer to reuse from ``source``, for preparing new text with the same vocabulary:

    * a prepared data folder (``meta.json``): its tokenizer ('bpe', 'bytes' or 'gpt2');
    * a run directory (``config.toml``): the tokenizer of the data it trained on (``data.path``, or
      the embedded corpus with its ``data.tokenizer``);
    * a ``tokenizer.json`` file, or a folder holding one (a Hugging Face model folder of any family:
      GPT-2, Llama, Qwen, Mistral, ...; documents end with its ``<|endoftext|>``, else with the
      folder's eos token), or a folder with GPT-2's ``vocab.json`` + ``merges.txt``: stored as the new
      folder's tokenizer.json;
    * a tiktoken cache folder holding GPT-2's BPE files (then TIKTOKEN_CACHE_DIR is set to it for
      this process), or the name ``gpt2`` (tiktoken's GPT-2 BPE, from $TIKTOKEN_CACHE_DIR).
    """
    if str(source) == "gpt2":
        return get_tokenizer("gpt2")
    path = Path(source).expanduser()
    if path.is_file():
        if path.name == "config.toml":
            return load_tokenizer_for_data(_run_data_folder(path.parent))
        return load_hf_tokenizer_file(path)
    if path.is_dir():
        if (path / META_NAME).is_file():
            return load_tokenizer_for_data(path)
        if (path / "config.toml").is_file():
            return load_tokenizer_for_data(_run_data_folder(path))
        if (path / TOKENIZER_FILE).is_file():
            return load_hf_tokenizer_file(path / TOKENIZER_FILE)
        if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            return load_vocab_merges(path)
        if is_tiktoken_cache(path):
            os.environ["TIKTOKEN_CACHE_DIR"] = str(path.resolve())  # inherited by the tokenizer workers
            return TiktokenTokenizer("gpt2")
        raise DataError(
            f"--tokenizer-from '{path}': the folder holds no tokenizer: expected a prepared data folder "
            "(meta.json), a run directory (config.toml), a tokenizer.json, GPT-2's vocab.json + merges.txt, "
            "or a tiktoken cache with GPT-2's BPE files."
        )
    raise DataError(
        f"--tokenizer-from '{source}' does not exist. Fix: pass a prepared data folder, a run directory, a "
        "tokenizer.json, or 'gpt2' (tiktoken)."
    )


# ----------------------------------------------------------------------------------------------
# CLI


def add_prepare_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of ``tokenmill prepare [INPUT] --out DIR ...``."""
    parser.add_argument(
        "input",
        nargs="*",
        metavar="INPUT",
        help="text and JSON Lines files (.txt, .jsonl/.json/.ndjson; also .gz/.zst compressed), Parquet and Arrow "
        "files, folders of them, a saved Hugging Face dataset folder, or quoted glob patterns (docs/data.md); "
        "omitted: the embedded corpus (this Python's stdlib sources)",
    )
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="output folder (token shards, meta.json)"
    )
    parser.add_argument("--tokenizer", choices=NAMES, default=None, help="tokenizer (default: bpe)")
    parser.add_argument(
        "--vocab-size", type=number(int, ge=257), default=None, metavar="N", help="bpe vocabulary size (default: 4096)"
    )
    parser.add_argument(
        "--tokenizer-from",
        default=None,
        metavar="DATA_OR_RUN",
        help="reuse an existing tokenizer instead of --tokenizer (same vocabulary, e.g. to fine-tune): a "
        "prepared data folder, a run directory (the data it trained on), a tokenizer.json (or a folder "
        "with one, e.g. a Hugging Face GPT-2/Llama/Qwen/Mistral model folder, or with GPT-2's vocab.json + "
        "merges.txt), a tiktoken cache folder with GPT-2's BPE files, or 'gpt2' (default: none)",
    )
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=0.1,
        metavar="F",
        help="share of documents for validation (default: 0.1)",
    )
    parser.add_argument(
        "--workers", type=number(int, ge=0), default=None, metavar="N", help="tokenizer processes (default: CPUs)"
    )
    parser.add_argument(
        "--glob", default=DEFAULT_GLOB, metavar="PATTERN",
        help=f"files of a folder (default: {DEFAULT_GLOB_HELP})",
    )
    parser.add_argument("--text-field", default="text", metavar="NAME",
                        help="the JSON field / Parquet or Arrow column holding the text (default: text)")
    parser.add_argument("--format", default="auto", choices=("auto", *KINDS, "chat"),
                        help="the kind of every input file (default: auto, from the file name); chat: records are "
                        "conversations (JSON Lines / Parquet / Arrow), rendered with the chat template of "
                        "--tokenizer-from, with a loss mask (docs/data.md, Chat data)")
    add_chat_args(parser)
    parser.add_argument("--on-bad-record", default="skip", choices=ON_BAD,
                        help="a record that is not JSON, not UTF-8, lacks the field or is not text, or a truncated "
                        "shard: skip (count, report the first ones) or stop (default: skip)")
    parser.add_argument("--shard-tokens", type=number(int, ge=1), default=SHARD_TOKENS, metavar="N",
                        help=f"tokens per output shard file (default: {SHARD_TOKENS:,})")
    parser.add_argument("--tokenizer-sample", type=parse_size, default=None, metavar="SIZE",
                        help="train the bpe tokenizer on a hashed sample of about SIZE of the training text "
                        "(e.g. 500M, 2G; default: all of it)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "uint16", "uint32"),
                        help="token id type of the files (default: auto: uint16 when the vocabulary fits)")
    parser.add_argument(
        "--seed", type=number(int, ge=0), default=0, help="seed of the train/val document split (default: 0)"
    )
    parser.add_argument("--max-files", type=number(int), default=None, metavar="N", help="use only the first N files")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _glob_root(pattern: str) -> str:
    """The folder a glob pattern reads below (the path up to its first wildcard); the path itself else."""
    parts = Path(pattern).parts
    for i, part in enumerate(parts):
        if any(c in part for c in "*?["):
            return str(Path(*parts[:i])) if i else "."
    return pattern


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    """The options of ``--format chat``."""
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="with --format chat: a Jinja chat template instead of the --tokenizer-from folder's")
    parser.add_argument("--chat-learn", default="assistant", choices=LEARN,
                        help="with --format chat: the tokens the loss learns: every assistant reply, only the last, or "
                        "every token (default: assistant)")
    parser.add_argument("--chat-overflow", default="split", choices=OVERFLOW,
                        help="with --format chat: a conversation longer than --block-size is dropped, or split at "
                        "exchange boundaries (default: split)")
    parser.add_argument("--block-size", type=number(int, ge=2), default=None, metavar="N",
                        help="with --format chat: the training window in tokens (default: no limit)")


def _run_chat(args: argparse.Namespace, source) -> int:
    """``prepare --format chat``: the template and tokenizer of --tokenizer-from, then the chat build."""
    from .chat import ChatTemplate
    from .chat_prepare import chat_summary, prepare_chat

    if source is None or args.tokenizer is not None or args.vocab_size is not None:
        raise DataError("--format chat renders each conversation with a model's chat template: pass --tokenizer-from "
                        "HF_MODEL_FOLDER (and neither --tokenizer nor --vocab-size).")
    out = prepare_chat(args.input or None, args.out, ChatTemplate(source, args.chat_template), learn=args.chat_learn,
                       overflow=args.chat_overflow, block_size=args.block_size, val_fraction=args.val_fraction,
                       workers=args.workers, seed=args.seed, progress=not args.no_progress, glob=args.glob,
                       max_files=args.max_files, on_bad_record=args.on_bad_record, shard_tokens=args.shard_tokens,
                       dtype=args.dtype)
    meta = json.loads((out / META_NAME).read_text())
    s, prep = meta["splits"], meta["prepare"]
    bad = prep["bad_records"]
    print(f"prepared {out}: train {s['train']['tokens']:,} tokens ({s['train']['documents']} sequences), val "
          f"{s['val']['tokens']:,} tokens ({s['val']['documents']} sequences), {meta['dtype']}, with loss masks\n"
          f"{chat_summary(meta)}\nsource: {meta['source']}\ntokenizer and chat template from: {source}\n"
          f"skipped {bad:,} bad record(s)" + (f" (the first: {prep['first_bad_record']})" if bad else ""))
    return 0


def run_prepare(args: argparse.Namespace) -> int:
    """Run ``prepare`` from parsed arguments, print a summary; DataError propagates. Returns 0."""
    source = getattr(args, "tokenizer_from", None)
    for what, path in (("--out", args.out), ("--tokenizer-from", source), *(("input", i) for i in args.input or [])):
        if path is not None:
            check_text(path, what)  # before any name is printed, hashed or recorded
    inputs = {f"the input {i}": _glob_root(i) for i in (args.input or [])}
    check_output(args.out, {**inputs, "the --tokenizer-from source": source})  # before anything is written
    template, block = getattr(args, "chat_template", None), getattr(args, "block_size", None)
    if args.format != "chat" and (template or block):
        raise DataError("--chat-template and --block-size go with --format chat. Fix: add --format chat, or drop them.")
    if template is not None:
        check_text(template, "--chat-template")
    if args.format == "chat":
        return _run_chat(args, source)
    if source is not None:
        given = [f for f, v in (("--tokenizer", args.tokenizer), ("--vocab-size", args.vocab_size)) if v is not None]
        if given:
            raise DataError(
                f"--tokenizer-from reuses an existing tokenizer, so {' and '.join(given)} cannot be given with "
                "it. Fix: drop one of them."
            )
        tokenizer = tokenizer_from(source)
    else:
        tokenizer = args.tokenizer if args.tokenizer is not None else "bpe"
    out = _prepare(
        args.input or None,
        args.out,
        tokenizer=tokenizer,
        vocab_size=args.vocab_size if args.vocab_size is not None else 4096,
        val_fraction=args.val_fraction,
        workers=args.workers,
        seed=args.seed,
        progress=not args.no_progress,
        glob=args.glob,
        max_files=args.max_files,
        tokenizer_from=source,
        text_field=args.text_field,
        fmt=args.format,
        on_bad_record=args.on_bad_record,
        shard_tokens=args.shard_tokens,
        tokenizer_sample=args.tokenizer_sample,
        dtype=args.dtype,
    )
    meta = json.loads((out / META_NAME).read_text())
    s, prep = meta["splits"], meta.get("prepare", {})
    shards = sum(len(e.get("shards", [e])) for e in s.values())
    bad = prep.get("bad_records", 0)
    print(
        f"prepared {out}: train {s['train']['tokens']:,} tokens ({s['train']['documents']} docs), "
        f"val {s['val']['tokens']:,} tokens ({s['val']['documents']} docs), "
        f"tokenizer {meta['tokenizer']['name']} "
        f"({meta['vocab_size']} ids), {meta['dtype']}, {shards} token file(s)\nsource: {meta['source']}"
        + (f"\ntokenizer from: {source}" if source is not None else "")
        + f"\nskipped {bad:,} bad record(s)" + (f" (the first: {prep['first_bad_record']})" if bad else "")
    )
    return 0


def _prepare(inputs, out_dir: str, **kwargs) -> Path:
    """``prepare``; an operating-system error that stops it (a file-size limit, a full disk) also says that the
    hidden build folder is kept, and how to resume from it or remove it."""
    try:
        return prepare(inputs, out_dir, **kwargs)
    except OSError as e:
        given = Path(out_dir)
        out = given.resolve() if given.is_symlink() else Path(os.path.abspath(given))
        build = next((b for b in (out.parent / f".{out.name}.prepare", out / f".{out.name}.prepare") if b.is_dir()),
                     None)
        if build is None:
            raise
        raise DataError(
            f"prepare stopped: {describe_os_error(e)} The partial build is kept in {build} (hidden, beside "
            "--out): once the limit is raised or space is freed (`ulimit -f` shows a file-size limit), run the same "
            f"command again and it resumes where it stopped; to start over instead, remove it: rm -r {build}"
        ) from None


def parse_size(text: str) -> int:
    """'500M', '2G', '1.5GB', '100000' -> bytes (k/M/G/T are powers of 1000)."""
    t = text.strip().upper().removesuffix("B")
    scale = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale != 1 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 500M or 2G, got {text!r}") from None
    if not value < 2**63:  # infinite, NaN or beyond any file size
        raise argparse.ArgumentTypeError(f"expected a finite size like 500M or 2G, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a size >= 1 byte, got {text!r}")
    return int(value)
