"""Parquet files and Arrow files (Hugging Face ``datasets`` folders), read with pyarrow.

A Parquet piece is a run of whole row groups, an Arrow piece a run of record batches, about
:data:`~tokenmill.data.chunking.CHUNK_BYTES` of text each (a single row group or batch may be
larger: it is the smallest unit these formats can be read in). Only the text column is read.
An Arrow file written by ``datasets`` is an IPC *stream*; an IPC *file* (Feather v2) is read too.
"""

from __future__ import annotations

from collections.abc import Iterator

from tokenmill.errors import DataError

from .sources import InputFile, Piece, missing_input


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            "reading Parquet and Arrow files needs the pyarrow package. Fix: `pip install 'tokenmill[corpora]'` "
            "(or `pip install pyarrow`)."
        ) from None
    return pa, pq


def check_text_column(schema, field: str, inp: InputFile) -> None:
    """DataError unless ``schema`` has a string column ``field``."""
    pa, _ = _pyarrow()
    names = list(schema.names)
    if field not in names:
        texts = [n for n in names if _is_text(pa, schema.field(n).type)]
        raise DataError(
            f"'{inp.path}' has no column '{field}' (columns: {names[:12]}). Fix: pass --text-field with the column "
            f"that holds the text{f' (text columns: {texts[:6]})' if texts else ''}."
        )
    kind = schema.field(field).type
    if not _is_text(pa, kind):
        texts = [n for n in names if _is_text(pa, schema.field(n).type)]
        raise DataError(
            f"'{inp.path}': column '{field}' holds {kind}, not text. Fix: pass --text-field with a string column"
            f"{f' (here: {texts[:6]})' if texts else ' (this file has none)'}."
        )


def _is_text(pa, kind) -> bool:
    checks = [pa.types.is_string, pa.types.is_large_string]
    if hasattr(pa.types, "is_string_view"):
        checks.append(pa.types.is_string_view)
    return any(c(kind) for c in checks)


def _open_parquet(inp: InputFile):
    _, pq = _pyarrow()
    if not inp.path.exists():
        raise missing_input(inp)
    return pq.ParquetFile(inp.path)


def _batches(inp: InputFile):
    """(reader, batch iterator) of an Arrow IPC stream or file, memory-mapped (nothing copied)."""
    pa, _ = _pyarrow()
    if not inp.path.exists():
        raise missing_input(inp)
    source = pa.memory_map(str(inp.path), "r")
    try:
        reader = pa.ipc.open_stream(source)
        return reader.schema, iter(reader)
    except pa.ArrowInvalid:
        source.seek(0)
        reader = pa.ipc.open_file(source)
        return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))


def iter_columnar_pieces(inp: InputFile, index: int, start: list, chunk: int, field: str) -> Iterator[Piece]:
    """Pieces of a Parquet or Arrow file from position ``start`` = [row group / batch index, records]."""
    pa, _ = _pyarrow()
    try:
        sizes = _unit_sizes(inp, field)
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise missing_input(inp) from None
        yield Piece(index, list(start), None, (0, 0), disk=inp.size, error=f"is not a readable {inp.kind} file ({e})")
        return
    units, error = sizes
    unit, record = start
    while unit < len(units):
        stop, nbytes, rows = unit, 0, 0
        while stop < len(units) and (nbytes < chunk or stop == unit):
            nbytes, rows, stop = nbytes + units[stop][0], rows + units[stop][1], stop + 1
        last = stop == len(units) and error is None
        yield Piece(index, [unit, record], None if last else [stop, record + rows], (unit, stop),
                    disk=sum(u[2] for u in units[unit:stop]))
        unit, record = stop, record + rows
    if error is not None:
        yield Piece(index, [unit, record], None, (unit, unit), disk=0, error=error)


def _unit_sizes(inp: InputFile, field: str) -> tuple[list[tuple[int, int, int]], str | None]:
    """(text bytes, rows, bytes on disk) per row group / record batch, and the reason reading stopped
    early (a truncated Arrow file) or None."""
    pa, _ = _pyarrow()
    if inp.kind == "parquet":
        pf = _open_parquet(inp)
        check_text_column(pf.schema_arrow, field, inp)
        meta = pf.metadata
        col = pf.schema_arrow.names.index(field)
        out = []
        for i in range(meta.num_row_groups):
            rg = meta.row_group(i)
            c = rg.column(col) if col < rg.num_columns else None
            text = c.total_uncompressed_size if c is not None else rg.total_byte_size
            out.append((text, rg.num_rows, c.total_compressed_size if c is not None else rg.total_byte_size))
        return out, None
    schema, batches = _batches(inp)
    check_text_column(schema, field, inp)
    out, error = [], None
    try:
        for b in batches:
            col = b.column(schema.names.index(field))
            n = sum(buf.size for buf in col.buffers() if buf is not None)
            out.append((n, b.num_rows, n))
    except (pa.ArrowException, OSError) as e:
        error = f"ends early: record batch {len(out)} cannot be read ({e}); a truncated file"
    return out, error


def _values(column) -> list:
    """A string column as Python values; a value that is not UTF-8 becomes an error note (a bad record)."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        out = []
        for v in column:
            try:
                out.append(v.as_py())
            except UnicodeDecodeError as e:
                out.append(_NotUtf8(e.start))
        return out


class _NotUtf8:
    def __init__(self, at: int):
        self.at = at


def columnar_documents(inp: InputFile, piece: Piece, field: str) -> tuple[list[str], list[int], list]:
    """(texts, record numbers from 1, bad records) of the row groups / batches ``piece.span``."""
    pa, _ = _pyarrow()
    a, b = piece.span
    try:
        if inp.kind == "parquet":
            table = _open_parquet(inp).read_row_groups(list(range(a, b)), columns=[field])
            values = _values(table.column(field))
        else:
            schema, batches = _batches(inp)
            idx = schema.names.index(field)
            values = []
            for i, batch in enumerate(batches):
                if i >= b:
                    break
                if i >= a:
                    values += _values(batch.column(idx))
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise missing_input(inp) from None
        return [], [], [(piece.start[1] + 1, f"row groups / batches {a}..{b - 1} cannot be read ({e})")]
    texts, numbers, bad = [], [], []
    for i, v in enumerate(values):
        n = piece.start[1] + i + 1
        if isinstance(v, str):
            texts.append(v)
            numbers.append(n)
        elif isinstance(v, _NotUtf8):
            bad.append((n, f"column '{field}' is not UTF-8 (bad byte at offset {v.at})"))
        else:
            bad.append((n, f"column '{field}' is {'null' if v is None else type(v).__name__}, not text"))
    return texts, numbers, bad
