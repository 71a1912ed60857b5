"""Training tokenmill's byte-level BPE with bounded memory.

The Hugging Face trainer counts the pre-tokenized words of every text it is given. Given a whole
file as one string it holds that string and every piece of it at once (about 100x the file), so
texts are handed to it in pieces of at most :data:`~tokenmill.data.chunking.CHUNK_BYTES`, cut where
the cut leaves the pre-tokenization unchanged (:mod:`tokenmill.data.chunking`): the word counts, and
so the trained tokenizer, are the same as from the whole texts, and memory stays at the trainer's
own table of distinct words however large the files are.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenmill.errors import DataError

from .chunking import CHUNK_BYTES, cut_bytes, cut_text
from .tokenizers import EOT_TEXT, BpeTokenizer


def read_text_chunks(path: Path, chunk: int = CHUNK_BYTES) -> Iterator[str]:
    """A UTF-8 text file (a leading BOM dropped) as safely cut pieces of about ``chunk`` bytes, read
    one at a time; DataError naming the file when it is not UTF-8."""
    import mmap

    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        return
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for a, b in cut_bytes(mm, 0, size, chunk):
            data = mm[a:b]
            try:
                yield data.decode("utf-8-sig" if a == 0 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"'{path}' is not UTF-8 text (bad byte {data[e.start]:#04x} at byte offset {a + e.start}). "
                    "Fix: convert it to UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or exclude it with --glob."
                ) from None


def text_pieces(texts_or_files: Iterable[str | Path], chunk: int = CHUNK_BYTES) -> Iterator[str]:
    """Every item as bounded pieces: ``pathlib.Path`` items are UTF-8 files, ``str`` items texts."""
    for item in texts_or_files:
        if isinstance(item, Path):
            yield from read_text_chunks(item, chunk)
        else:
            yield from cut_text(item, chunk)


def train_bpe(texts_or_files: Iterable[str | Path], vocab_size: int, out_path: str | Path) -> BpeTokenizer:
    """Train a byte-level BPE with ``vocab_size`` ids (256 bytes + ``<|endoftext|>`` + merges) and
    save it atomically as ``out_path`` (a tokenizer.json).

    ``texts_or_files``: ``pathlib.Path`` items are read as UTF-8 files, ``str`` items are texts; both
    are streamed in bounded pieces (see the module docstring), so an iterator over a corpus larger
    than memory is fine. Training is deterministic. On a small corpus the vocabulary can end up
    smaller than asked (no pair left to merge): the returned tokenizer's ``vocab_size`` is the real one.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise DataError(
            f"bpe vocab_size must be >= 257 (256 byte ids + <|endoftext|>), got {vocab_size}. "
            "Fix: raise --vocab-size, or use --tokenizer bytes."
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text_pieces(texts_or_files), trainer=trainer)
    bpe = BpeTokenizer(tok, Path(out_path))
    bpe.save(out_path)
    return bpe
