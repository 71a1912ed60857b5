"""Cutting long text into bounded pieces that tokenize exactly as the whole.

A byte-level BPE that first splits text with a GPT-2 style regex (GPT-2, Llama 3, Qwen, tokenmill's
own BPE) gives the same ids for ``a + b`` as for ``a`` then ``b`` when the cut falls

1. after a newline that has a non-blank character on both sides (the regex always ends a piece
   at such a newline and starts a new one after it), else
2. before a space that has a non-blank character on both sides (a space followed by a letter,
   digit or symbol always starts a new piece, and the piece before it ends at the non-blank).

Cuts are looked for from ``target`` on; when neither kind occurs within ``limit`` bytes (a run of
text with no blank at all), the text is cut at a UTF-8 character boundary there, which may change
the ids of the one word that spans the cut. Blank means :meth:`str.isspace` (the regex's ``\\s``).
"""

from __future__ import annotations

CHUNK_BYTES = 1 << 20  # the size pieces are cut to
LIMIT_BYTES = 64 << 20  # no blank within this many bytes: cut anyway


def _char_after(buf, i: int, end: int) -> str | None:
    """The character whose UTF-8 encoding starts at byte ``i`` (None at the end or on a bad byte)."""
    if i >= end:
        return None
    lead = buf[i]
    n = 1 if lead < 0x80 else 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4
    try:
        return bytes(buf[i : min(i + n, end)]).decode("utf-8")
    except UnicodeDecodeError:
        return None


def _char_before(buf, i: int, start: int) -> str | None:
    """The character whose UTF-8 encoding ends just before byte ``i``."""
    j = i - 1
    while j > start and i - j < 4 and 0x80 <= buf[j] < 0xC0:
        j -= 1
    if j < start:
        return None
    try:
        return bytes(buf[j:i]).decode("utf-8")
    except UnicodeDecodeError:
        return None


def _solid(c: str | None) -> bool:
    return c is not None and not c.isspace()


def _find_cut(buf, sep: bytes, start: int, pos: int, end: int, after: bool) -> int | None:
    """First cut at a ``sep`` byte in ``[pos, end)`` with solid characters on both sides."""
    i = buf.find(sep, pos, end)
    while i != -1:
        if _solid(_char_before(buf, i, start)) and _solid(_char_after(buf, i + 1, end)):
            return i + 1 if after else i
        i = buf.find(sep, i + 1, end)
    return None


def next_cut(buf, start: int, target: int, end: int, final: bool, limit: int = LIMIT_BYTES) -> int | None:
    """Where to end the piece of ``buf[start:end]`` that should be about ``target - start`` bytes long.

    ``buf``: bytes, bytearray or mmap. Returns ``end`` when the rest is short (and ``final``: no more
    bytes follow), a cut position in ``(start, end)``, or None when more bytes are needed to decide
    (not ``final`` and no cut found in what is there yet)."""
    if target >= end:
        return end if final else None
    hard = start + limit
    near = min(end, hard, target + max(1, target - start))  # look near the target first, then further
    for lo, hi in ((target, near), (near, min(end, hard))):
        for sep, after in ((b"\n", True), (b" ", False)):
            cut = _find_cut(buf, sep, start, lo, hi, after)
            if cut is not None:
                return cut
    if end >= hard:  # no blank anywhere: cut at a character boundary
        i = hard
        while i > start + 1 and 0x80 <= buf[i] < 0xC0:
            i -= 1
        return i
    return end if final else None


def cut_bytes(buf, start: int, end: int, chunk: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """``buf[start:end]`` as byte ranges of about ``chunk`` bytes, cut only where it is safe."""
    out, pos = [], start
    while pos < end:
        cut = next_cut(buf, pos, pos + chunk, end, final=True)
        out.append((pos, cut))
        pos = cut
    return out


def cut_text(text: str, chunk: int = CHUNK_BYTES) -> list[str]:
    """``text`` as pieces of about ``chunk`` UTF-8 bytes (the rules of :func:`next_cut`)."""
    if len(text) <= chunk // 4:
        return [text]
    data = text.encode("utf-8")
    if len(data) <= chunk:
        return [text]
    return [data[a:b].decode("utf-8") for a, b in cut_bytes(data, 0, len(data), chunk)]
