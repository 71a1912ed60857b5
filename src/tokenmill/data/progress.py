"""Progress of ``prepare``: input MB/s, tokens/s and the time left.

On a terminal: a tqdm bar over the input bytes with the token rate beside it. Elsewhere (a log file,
CI): a plain line on stderr every ``every`` seconds and at the end, e.g.
``prepare: 512.0 MB of 2.0 GB (25%), 40.1 MB/s, 9.8M tokens/s, 1.2M documents, ETA 37s``.
"""

from __future__ import annotations

import sys
import time


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def _count(n: float) -> str:
    for unit, f in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= f:
            return f"{n / f:.1f}{unit}"
    return f"{n:.0f}"


def _eta(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    """``update(bytes, tokens, documents)`` as pieces finish; ``close()`` at the end. ``total``: input
    bytes on disk (the ETA assumes the rest goes at the rate so far)."""

    def __init__(self, total: int, enabled: bool = True, label: str = "prepare", every: float = 10.0,
                 stream=None, done: int = 0):
        self.total, self.label, self.every = total, label, every
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.bytes, self.tokens, self.docs = done, 0, 0
        self.start_bytes = done
        self.t0 = self.last = time.perf_counter()
        self.bar = None
        if enabled and getattr(self.stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, unit="B", unit_scale=True, desc=label, file=self.stream,
                            dynamic_ncols=True)

    def update(self, nbytes: int, tokens: int, docs: int) -> None:
        self.bytes += nbytes
        self.tokens += tokens
        self.docs += docs
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(nbytes)
            self.bar.set_postfix_str(f"{_count(self.tokens / max(1e-9, self._elapsed()))} tok/s", refresh=False)
        elif time.perf_counter() - self.last >= self.every:
            self._line()

    def _elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def status(self) -> str:
        t = max(1e-9, self._elapsed())
        rate = (self.bytes - self.start_bytes) / t
        pct = f" ({100 * self.bytes / self.total:.0f}%)" if self.total else ""
        eta = f", ETA {_eta((self.total - self.bytes) / rate)}" if rate > 0 and self.total > self.bytes else ""
        return (f"{self.label}: {_size(self.bytes)} of {_size(self.total)}{pct}, {_size(rate)}/s, "
                f"{_count(self.tokens / t)} tokens/s, {_count(self.docs)} documents{eta}")

    def _line(self) -> None:
        self.last = time.perf_counter()
        print(self.status(), file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            self._line()
