"""Data mixtures (``data.mixture``): several prepared folders drawn with weights, as one global stream.

``data.mixture = "PATH:WEIGHT,PATH:WEIGHT,..."``: entries separated by commas, each a prepared folder and
its weight after the entry's last colon (so a path may hold colons, not commas). Weights are positive
finite numbers (``3``, ``0.25``, ``1e-2``, ``1/3``), relative: source ``i`` gets the share
``w_i / sum(w)`` of the samples.

**Which source sample ``k`` comes from** is a pure function of ``(seed, k)``: a fixed *schedule* of
``P`` positions (the period) holds ``c_i = P x share_i`` positions of source ``i``, spread evenly (the
``j``-th of them sits at ``(j + 1/2) / c_i`` of the period, ties to the lower source index), and sample
``k`` takes position ``(k + o) mod P``, ``o`` an offset hashed from the seed. The shares are read as
exact fractions (``0.7`` is 7/10), so ``P`` is the least common denominator of the shares and every span
of ``P`` consecutive samples holds exactly ``c_i`` of source ``i``; any span of ``n`` samples holds
``n x share_i`` within a sample or two (not the ``sqrt(n)`` drift of drawing the source by a hash). Shares
whose period would pass :data:`MAX_PERIOD` are rounded to multiples of ``1/MAX_PERIOD`` (largest
remainders, at least one position each). The stream needs no state: resuming at any sample and any
(batch, accumulation, data-parallel, worker) layout sees the same samples.

**Which window**: sample ``k`` is the ``j``-th sample of its source, ``j = (k + o) // P x c_i +`` (the
rank of its position among source ``i``'s in the schedule), again O(1) and stateless; the window is then
source ``i``'s window ``j`` (``data.sampling``: a hash of (source seed, ``j``), or the ``j``-th
non-overlapping window in file order), the source seed hashed from (seed, ``i``).

**Validation** draws ``n`` windows with the same schedule (offset 0): source ``i`` gives its share of them
(within one window), spread evenly over its own val split, in schedule order: the same batches on every
call.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from tokenmill.errors import ConfigError, DataError
from tokenmill.filecheck import check_number

from .dataset import STREAM_LENGTH, WindowDataset, _index, open_token_data, sample_key
from .meta import read_meta

MAX_PERIOD = 1 << 16
_OFFSET_SALT = 0x6D69787475726500  # "mixture": the schedule's offset
_SOURCE_SALT = 0x736F757263650000  # "source": each source's window seed
FORMAT_HINT = "write it as PATH:WEIGHT,PATH:WEIGHT (e.g. data/web:3,data/code:1)"


@dataclass(frozen=True)
class MixSource:
    """One entry of ``data.mixture``: the folder as written, its weight as written and as a fraction."""

    path: str
    weight_text: str
    weight: Fraction


def parse_mixture(spec: str) -> list[MixSource]:
    """The entries of a ``data.mixture`` value; a malformed value is a :class:`ConfigError` naming the entry."""
    if not spec or not spec.strip():
        raise ConfigError(f"data.mixture is empty; {FORMAT_HINT}, or unset it.")
    out: list[MixSource] = []
    for entry in spec.split(","):
        entry = entry.strip()
        path, colon, text = entry.rpartition(":")
        path, text = path.strip(), text.strip()
        if not colon or not path or not text:
            raise ConfigError(f"data.mixture entry {entry!r} is not PATH:WEIGHT; {FORMAT_HINT} (a path may not "
                              "hold a comma).")
        out.append(MixSource(path, text, _weight(entry, text)))
    seen: dict[str, str] = {}
    for s in out:
        real = str(Path(s.path).expanduser().resolve())
        if real in seen:
            raise ConfigError(f"data.mixture names the folder '{s.path}' twice ('{seen[real]}' is the same "
                              "folder); give it once, with the sum of its weights.")
        seen[real] = s.path
    return out


def _weight(entry: str, text: str) -> Fraction:
    """The weight as an exact fraction; its float must be finite and a nonzero literal must not underflow to
    0.0 (checked first: ``Fraction('1e999999999')`` would compute a billion-digit integer)."""
    num, _, den = text.partition("/")
    try:
        parts = [(p, float(p)) for p in ((num, den) if den else (num,))]
    except ValueError:
        parts = None
    if parts and not all(math.isfinite(v) for _, v in parts):
        parts = None  # infinite or NaN: "not a number", before Fraction runs
    for part, value in parts or []:  # a nonzero literal read as 0.0: refused before Fraction runs
        check_number(part, value, f"data.mixture entry {entry!r}: the weight", ConfigError)
    try:
        w = Fraction(text) if parts is not None else None
    except (ValueError, ZeroDivisionError):
        w = None
    if w is None or w <= 0:
        what = "not a number" if w is None else ("zero" if w == 0 else "negative")
        raise ConfigError(f"data.mixture entry {entry!r}: the weight {text!r} is {what}; a weight is a positive "
                          "finite number such as 3, 0.25 or 1/3 (relative: shares are weight / sum of weights).")
    return w


def mixture_paths(spec: str | None) -> dict[str, str]:
    """``{'data.mixture[i]': path}`` for the folders a mixture reads (empty when unset)."""
    if not spec:
        return {}
    return {f"data.mixture[{i}]": s.path for i, s in enumerate(parse_mixture(spec))}


def absolute_mixture(spec: str) -> str:
    """``spec`` with every folder as an absolute path (what a run directory records)."""
    return ",".join(f"{Path(s.path).expanduser().resolve()}:{s.weight_text}" for s in parse_mixture(spec))


def check_mixture_config(data_cfg) -> list[MixSource]:
    """The mixture's entries, refusing what cannot go with it (data.path, synthetic data)."""
    if data_cfg.path:
        raise ConfigError(f"data.mixture and data.path are both set (data.path '{data_cfg.path}'); a mixture "
                          "replaces data.path: unset one (a folder of its own belongs in the mixture, e.g. "
                          f"{data_cfg.path}:1).")
    if data_cfg.source != "tokens":
        raise ConfigError(f"data.mixture reads prepared folders, but data.source is {data_cfg.source!r}; use "
                          "data.source='tokens' or unset data.mixture.")
    return parse_mixture(data_cfg.mixture)


# ----------------------------------------------------------------------------------------------
# The schedule


def slot_counts(weights: list[Fraction]) -> tuple[int, list[int]]:
    """``(P, [c_i])``: the period and each source's positions in it (exact shares when the least common
    denominator is <= MAX_PERIOD, else largest-remainder rounding at MAX_PERIOD, at least 1 each)."""
    total = sum(weights)
    shares = [w / total for w in weights]
    period = math.lcm(*(s.denominator for s in shares))
    if period <= MAX_PERIOD:
        return period, [int(s * period) for s in shares]
    if len(weights) > MAX_PERIOD:
        raise ConfigError(f"data.mixture has {len(weights)} sources; at most {MAX_PERIOD}.")
    exact = [s * MAX_PERIOD for s in shares]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))  # largest remainder first
    for i in by_remainder[:MAX_PERIOD - sum(counts)]:
        counts[i] += 1
    for i, c in enumerate(counts):
        if c == 0:  # every source keeps a position: one from the largest
            counts[i] = 1
            counts[max(range(len(counts)), key=counts.__getitem__)] -= 1
    return MAX_PERIOD, counts


def schedule(counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """``(source, rank)`` over the period: position ``p`` belongs to source ``source[p]`` and is its
    ``rank[p]``-th position. Source ``i``'s ``j``-th position sits at time ``(j + 1/2) / c_i``; positions are
    the times in order (ties: lower source first)."""
    src = np.concatenate([np.full(c, i, dtype=np.int64) for i, c in enumerate(counts)])
    rank = np.concatenate([np.arange(c, dtype=np.int64) for c in counts])
    times = np.concatenate([(2 * np.arange(c, dtype=np.float64) + 1) / (2 * c) for c in counts])
    order = np.lexsort((src, times))  # distinct rationals with denominators <= 2*MAX_PERIOD: exact as floats
    return src[order], rank[order]


def source_labels(paths: list[str]) -> list[str]:
    """Short names for logs: each folder's name, with ``#i`` where two share one."""
    names = [Path(p).expanduser().resolve().name or str(p) for p in paths]
    return [f"{n}#{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]


class MixtureDataset(Dataset):
    """The global stream of a mixture: ``ds[k] = (x, y)`` is window ``j`` of source ``i``, ``(i, j) =
    locate(k)`` (see the module doc). ``sources`` are :class:`WindowDataset` of one split each."""

    def __init__(self, sources: list[WindowDataset], weights: list[Fraction], labels: list[str], seed: int,
                 offset: bool = True):
        if len(sources) != len(weights) or not sources:
            raise ValueError("a mixture needs one weight per source, and at least one source")
        self.sources, self.labels = sources, labels
        self.weights = weights
        self.period, self.counts = slot_counts(weights)
        self.pattern, self.rank = schedule(self.counts)
        self.offset = sample_key(seed, _OFFSET_SALT) % self.period if offset else 0
        self.vocab_size = sources[0].vocab_size
        self.block_size = sources[0].block_size

    @property
    def shares(self) -> list[float]:
        """The target share of each source (what the schedule realises per period)."""
        return [c / self.period for c in self.counts]

    def __len__(self) -> int:
        return STREAM_LENGTH

    def locate(self, k: int) -> tuple[int, int]:
        """``(source, j)``: sample ``k`` is the ``j``-th sample of that source."""
        q, p = divmod(_index(k) + self.offset, self.period)
        i = int(self.pattern[p])
        return i, q * self.counts[i] + int(self.rank[p])

    def __getitem__(self, k) -> tuple[torch.Tensor, torch.Tensor]:
        i, j = self.locate(k)
        return self.sources[i][j]

    def _before(self, x: int) -> np.ndarray:
        q, r = divmod(x, self.period)
        return q * np.asarray(self.counts, dtype=np.int64) + np.bincount(self.pattern[:r], minlength=len(self.counts))

    def samples_per_source(self, start: int, stop: int) -> list[int]:
        """How many of the global samples ``start .. stop-1`` each source gives (exact, O(period))."""
        return (self._before(stop + self.offset) - self._before(start + self.offset)).tolist()

    def spread(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``n`` fixed windows for validation: source of each by the schedule's first ``n`` positions,
        each source's windows spread evenly over its split."""
        who = [self.locate(v)[0] for v in range(n)]
        per = [who.count(i) for i in range(len(self.sources))]
        seen = [0] * len(self.sources)
        out = []
        for i in who:
            ds = self.sources[i]
            out.append(ds.window(seen[i] * ds.n_starts // per[i]))
            seen[i] += 1
        return out


def _drawn(loader: Any, done: int) -> tuple[MixtureDataset, int] | None:
    """A training loader's mixture and the global samples its run had drawn after ``done`` steps (None
    when it reads no mixture)."""
    ds = getattr(loader, "dataset", None)
    if not isinstance(ds, MixtureDataset):
        return None
    return ds, loader.batch_sampler.samples_after(done)


def realised_shares(loader: Any, done: int) -> dict[str, float]:
    """For the log record after ``done`` steps: ``{'mix_share/LABEL': share}`` of the samples drawn so far
    (the stream's first ones, whatever the run's start); empty unless the loader reads a mixture."""
    drawn = _drawn(loader, done)
    if drawn is None or drawn[1] <= 0:
        return {}
    ds, n = drawn
    return {f"mix_share/{name}": c / n for name, c in zip(ds.labels, ds.samples_per_source(0, n))}


def mixture_summary(loader: Any, done: int) -> dict[str, Any]:
    """For summary.json: ``{'mixture': [per source: folder, weight, target share, samples drawn, realised
    share]}`` after ``done`` steps; empty unless the loader reads a mixture."""
    drawn = _drawn(loader, done)
    if drawn is None:
        return {}
    ds, n = drawn
    got = ds.samples_per_source(0, n) if n > 0 else [0] * len(ds.sources)
    return {"mixture": [
        {"source": name, "path": str(Path(src.token_file.path).resolve()), "weight": float(w), "target_share": share,
         "samples": c, "realised_share": c / n if n > 0 else None}
        for name, src, w, share, c in zip(ds.labels, ds.sources, ds.weights, ds.shares, got)]}


def describe(dataset: MixtureDataset) -> str:
    """One line: each source's target share and weight, and the period."""
    parts = ", ".join(f"{n} {100 * s:.1f}% (weight {float(w):g})"
                      for n, s, w in zip(dataset.labels, dataset.shares, dataset.weights))
    return f"tokenmill: data mixture: {parts}; exact every {dataset.period:,} samples"


# ----------------------------------------------------------------------------------------------
# Opening the sources


def tokenizer_identity(folder: Path) -> tuple:
    """What must agree for two folders' ids to mean the same text: tokenizer name, vocabulary size,
    end-of-text id and the tokenizer file's content (parsed, so formatting does not count)."""
    meta = read_meta(folder)
    info = meta.get("tokenizer") if isinstance(meta.get("tokenizer"), dict) else {}
    file = folder / "tokenizer.json"
    digest = None
    if file.is_file():
        try:
            canon = json.dumps(json.loads(file.read_text(encoding="utf-8")), sort_keys=True)
        except (ValueError, UnicodeDecodeError, RecursionError):  # not JSON, or nested too deep: compare bytes
            canon = file.read_bytes().hex()
        digest = hashlib.sha256(canon.encode()).hexdigest()
    return info.get("name"), meta["vocab_size"], info.get("eot_id"), digest


def _describe_tokenizer(ident: tuple) -> str:
    name, vocab, eot, digest = ident
    eot = f", end-of-text id {eot}" if eot is not None else ""
    file = f", tokenizer.json {digest[:12]}" if digest else ""
    return f"{name}, {vocab} ids{eot}{file}"


def check_same_tokenizer(folders: list[Path]) -> None:
    """Refuse a mixture whose folders were tokenized differently, naming both."""
    first = tokenizer_identity(folders[0])
    for other in folders[1:]:
        ident = tokenizer_identity(other)
        if ident != first:
            raise DataError(
                f"data.mixture: '{folders[0]}' ({_describe_tokenizer(first)}) and '{other}' "
                f"({_describe_tokenizer(ident)}) were prepared with different tokenizers: the same id would mean "
                f"different text. Fix: prepare one again with the other's tokenizer (`tokenmill prepare INPUT --out "
                f"DIR --tokenizer-from {folders[0]}`)."
            )


def open_mixture(data_cfg, block_size: int, seed: int, model_vocab_size: int | None, with_val: bool,
                 ids_for, progress: bool = False) -> tuple[MixtureDataset, MixtureDataset | None, int, Path]:
    """``(train, val, vocab_size, first folder)`` of ``data_cfg.mixture``. ``ids_for(vocab)`` is the id dtype;
    ``progress`` prints the sources' target shares (:func:`describe`)."""
    entries = check_mixture_config(data_cfg)
    folders = [Path(s.path).expanduser() for s in entries]
    for f in folders:
        read_meta(f)  # a missing or unprepared folder: its own message first
    check_same_tokenizer(folders)
    weights = [s.weight for s in entries]
    labels = source_labels([s.path for s in entries])
    trains, vals = [], []
    for i, f in enumerate(folders):
        tf = open_token_data(f, "train", model_vocab_size, data_cfg.validate)
        ids = ids_for(tf.vocab_size)
        src_seed = sample_key(seed, _SOURCE_SALT + i)
        trains.append(WindowDataset(tf, block_size, data_cfg.sampling, src_seed, data_cfg.cpu_work_ms, ids))
        if with_val:
            vf = open_token_data(f, "val", model_vocab_size, data_cfg.validate)
            vals.append(WindowDataset(vf, block_size, "sequential", src_seed, ids=ids))
    train = MixtureDataset(trains, weights, labels, seed)
    val = MixtureDataset(vals, weights, labels, seed, offset=False) if with_val else None
    if progress:
        print(describe(train), flush=True)
    return train, val, trains[0].vocab_size, folders[0]
