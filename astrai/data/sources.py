"""What `prepare` reads: the corpus files named on the command line, split into pieces that workers tokenize.

Formats, by file name:

- ``.txt``, ``.md``: plain text, one document per file;
- ``.jsonl``, ``.json``: JSON Lines, one record (a document) per line; a ``.json`` file whose
  first character is ``[`` holds one list of records instead;
- ``.jsonl.gz``, ``.jsonl.zst``, ``.json.gz``, ``.json.zst``: the same, compressed;
- ``.parquet``: one record per row (what the Hub's dataset downloads hold);
- a folder: every file of these formats in it, in name order (hidden files left out; a folder that
  holds record files takes no ``.txt``/``.md`` beside them, which are its README and notes);
- a folder written by ``datasets.Dataset.save_to_disk``: its Arrow files, one record per row.

A record's text is its ``text`` field unless ``--field`` names another (dotted for a nested
one, ``meta.content``). The input is cut into pieces whose bounds depend on the files alone,
never on the number of workers: a text or JSON Lines file in byte ranges ending at a line end,
a Parquet file by row group, an Arrow file by record batch; compressed files and JSON lists
are read by the main process in order and handed out in batches of records. Workers
tokenize pieces in any order and the results are written in piece order, so the shards are
the same for any number of workers. No file is ever read whole into memory.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from astrai.common.configfile import show_value
from astrai.common.data_folder import DataError

TEXT_SUFFIXES = (".txt", ".md")
LINE_SUFFIXES = (".jsonl", ".json")
COMPRESSED_SUFFIXES = (".gz", ".zst")
KNOWN = (
    ".txt",
    ".md",
    ".jsonl",
    ".json",
    ".jsonl.gz",
    ".jsonl.zst",
    ".json.gz",
    ".json.zst",
    ".parquet",
    "a folder of these",
    "a datasets save_to_disk folder",
)
SAVE_TO_DISK_STATE = "state.json"
LEFT_OUT_HINT = "nothing was written (--skip_bad leaves such a file out)"
PIECE_BYTES = 16 << 20
"""Bytes of a text or JSON Lines file per piece (the piece then runs on to the next line end)."""
BATCH_BYTES = 8 << 20
"""Bytes of decompressed lines (or of JSON-list records) the main process hands out per piece."""


@dataclass(frozen=True)
class Source:
    """One input file, as the manifest lists it."""

    path: Path
    kind: str
    """text, lines, compressed, array, parquet or arrow."""
    name: str
    """How the manifest names it: the path as given, or inside the folder given."""
    size: int


@dataclass
class Piece:
    """One unit of work: a range of one source, or records the main process read from it."""

    index: int
    source: int
    kind: str
    start: int = 0
    stop: int = 0
    last: bool = True
    """For a text file cut in pieces: whether this piece ends the document."""
    first_record: int = 0
    """Line (from 1) or record (from 0) number of the piece's first record, for messages."""
    lines: list[bytes] = field(default_factory=list)
    """Raw lines (compressed JSON Lines) or parsed records (a JSON list) read by the main process."""
    problem: str | None = None
    """For kind "failed": why the source could not be read to its end (``--skip_bad`` leaves it out)."""


def find_sources(inputs: list[Path], skip_bad: bool = False) -> tuple[list[Source], list[str], list[str]]:
    """The files to read, in order; notes on what a folder held that is not read; and, with ``skip_bad``, the
    entries of a folder that cannot be read (a broken link, a FIFO), each named with why (else an error)."""
    sources: list[Source] = []
    notes: list[str] = []
    left_out: list[str] = []
    for given in inputs:
        path = Path(given)
        if path.is_dir():
            if (path / SAVE_TO_DISK_STATE).is_file():
                sources += _saved_dataset(path)
                continue
            if (path / "dataset_dict.json").is_file():
                splits = sorted(entry.name for entry in path.iterdir() if entry.is_dir())
                raise DataError(
                    f"{path}: a datasets DatasetDict (splits: {', '.join(splits)}); give one split's folder, "
                    f"such as {path / (splits[0] if splits else 'train')}"
                )
            found, skipped, unreadable = _folder(path)
            if unreadable and not skip_bad:
                raise DataError(
                    f"{unreadable[0]}; prepare reads every file of a folder it is given (remove it, or "
                    "--skip_bad leaves it out)"
                )
            left_out += unreadable
            if not found:
                raise DataError(f"{path}: holds no file prepare reads (it reads {', '.join(KNOWN[:9])})")
            sources += found
            if skipped:
                notes.append(f"{path}: left out {', '.join(skipped)} (text files beside record files)")
            continue
        if not path.is_file():
            what = "a broken link" if path.is_symlink() and not path.exists() else "not a file or folder"
            raise DataError(f"{path}: {what}")
        sources.append(_source(path, str(path)))
    return sources, notes, left_out


def _folder(folder: Path) -> tuple[list[Source], list[str], list[str]]:
    """A folder's sources in name order, the text files left out beside record files, and what is unreadable.

    A ``save_to_disk`` folder inside it is one data set, read as such; linked folders are followed.
    """
    entries, datasets, unreadable = _walk(folder)
    found: list[tuple[Path, list[Source]]] = []
    for path in entries:
        if path in datasets:
            sources = _saved_dataset(path)
            if sources:  # an empty data set holds nothing to read
                found.append((path, sources))
        elif path.is_file():
            if _kind(path) is None:
                raise DataError(
                    f"{path}: prepare does not know this kind of file; it reads {', '.join(KNOWN[:9])} "
                    "(move it out of the folder, or name the files to read)"
                )
            found.append((path, [_source(path, str(path))]))
        else:
            broken = path.is_symlink() and not path.exists()
            unreadable.append(
                f"{path}: {'a broken link' if broken else 'not a regular file (a FIFO, socket or device)'}"
            )
    records = [(path, items) for path, items in found if items[0].kind != "text"]
    chosen = records or found
    skipped = [str(path.relative_to(folder)) for path, items in found if (path, items) not in chosen]
    return [source for _, items in chosen for source in items], skipped, unreadable


def _walk(folder: Path) -> tuple[list[Path], set[Path], list[str]]:
    """Every entry below ``folder`` that is not a folder, in name order, following linked folders (each real
    folder once); the ``save_to_disk`` folders among them, as entries of their own; and the links that would
    lead back into a folder already read."""
    entries: list[Path] = []
    datasets: set[Path] = set()
    loops: list[str] = []
    seen: set[str] = set()
    for root, folders, files in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:
            loops.append(f"{root}: a link to a folder already read (a loop, or the same files twice)")
            folders[:] = []
            continue
        seen.add(real)
        here = Path(root)
        if here != folder and (here / SAVE_TO_DISK_STATE).is_file():
            datasets.add(here)
            entries.append(here)
            folders[:] = []
            continue
        folders[:] = sorted(name for name in folders if not name.startswith("."))
        entries += [here / name for name in files if not name.startswith(".")]
    return sorted(entries, key=lambda path: path.relative_to(folder).parts), datasets, loops


def _saved_dataset(folder: Path) -> list[Source]:
    try:
        state = json.loads((folder / SAVE_TO_DISK_STATE).read_text(encoding="utf-8"))
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(f"{folder / SAVE_TO_DISK_STATE}: not a datasets save_to_disk state ({error})") from None
    sources = []
    for name in names:
        path = folder / name
        if Path(name).name != name or not path.is_file():
            raise DataError(f"{folder / SAVE_TO_DISK_STATE}: lists {name!r}, which is not a file in {folder}")
        sources.append(Source(path, "arrow", str(path), path.stat().st_size))
    return sources


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    if name.endswith(LINE_SUFFIXES):
        return "lines"
    if name.endswith(tuple(s + c for s in LINE_SUFFIXES for c in COMPRESSED_SUFFIXES)):
        return "compressed"
    if name.endswith(".parquet"):
        return "parquet"
    return None


def _source(path: Path, name: str) -> Source:
    kind = _kind(path)
    if kind is None:
        raise DataError(f"{path}: prepare does not know this kind of file; it reads {', '.join(KNOWN)}")
    if kind == "lines" and path.name.lower().endswith(".json") and _first_char(path) == b"[":
        kind = "array"
    return Source(path, kind, name, path.stat().st_size)


def _first_char(path: Path) -> bytes:
    with open(path, "rb") as handle:
        while chunk := handle.read(4096):
            stripped = chunk.lstrip()
            if stripped:
                return stripped[:1]
    return b""


# --- Pieces -----------------------------------------------------------------------------------------------------


def pieces(sources: list[Source], skip_bad: bool = False) -> Iterator[Piece]:
    """Every piece of every source, in order; compressed files and JSON lists are read here as they go.

    A source that cannot be read to its end stops here with a DataError naming it; with ``skip_bad``, a
    piece of kind "failed" says so instead, and the pieces after it are the next source's.
    """
    index = 0
    for number, source in enumerate(sources):
        try:
            for piece in _source_pieces(number, source):
                piece.index = index
                index += 1
                yield piece
        except DataError as error:
            if not skip_bad:
                raise DataError(f"{error}; {LEFT_OUT_HINT}") from None
            yield Piece(index, number, "failed", problem=str(error))
            index += 1


def _source_pieces(number: int, source: Source) -> Iterator[Piece]:
    if source.kind in ("text", "lines"):
        bounds = _line_bounds(source.path, source.size)
        for start, stop in zip(bounds, bounds[1:], strict=False):
            yield Piece(0, number, source.kind, start, stop, last=stop == bounds[-1])
        if source.kind == "text" and len(bounds) == 1:
            yield Piece(0, number, "text", 0, 0)  # an empty file is an empty document
    elif source.kind == "compressed":
        yield from _batches(number, "lines", _decompressed_lines(source.path), start=1)
    elif source.kind == "array":
        yield from _batches(number, "records", _array_records(source.path), start=0)
    elif source.kind == "parquet":
        import pyarrow.parquet as pq

        groups = _arrow_call(source.path, lambda: pq.ParquetFile(source.path).metadata.num_row_groups)
        for group in range(groups):
            yield Piece(0, number, "parquet", group, group + 1)
    elif source.kind == "arrow":
        for batch in range(_arrow_call(source.path, lambda: _arrow_batch_count(source.path))):
            yield Piece(0, number, "arrow", batch, batch + 1)


def _line_bounds(path: Path, size: int) -> list[int]:
    """Offsets that cut a file into pieces of about PIECE_BYTES, each ending at a line end (or the file's end)."""
    bounds = [0]
    with open(path, "rb") as handle:
        while bounds[-1] < size:
            target = bounds[-1] + PIECE_BYTES
            if target >= size:
                bounds.append(size)
                break
            handle.seek(target)
            handle.readline()
            bounds.append(min(handle.tell(), size))
    return bounds


def _batches(number: int, kind: str, items: Iterator[tuple[int, bytes]], start: int) -> Iterator[Piece]:
    batch: list = []
    first, size = start, 0
    for position, item in items:
        if not batch:
            first = position
        batch.append(item)
        size += len(item) if isinstance(item, bytes) else 256
        if size >= BATCH_BYTES:
            yield Piece(0, number, kind, first_record=first, lines=batch)
            batch, size = [], 0
    if batch:
        yield Piece(0, number, kind, first_record=first, lines=batch)


def _decompressed_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of a .gz or .zst file, decompressed as it is read, to the end marker of its last
    frame: a file cut short or damaged is a DataError naming it, never read as complete."""
    import zstandard

    if path.stat().st_size == 0:
        raise DataError(f"{path}: cannot be decompressed to its end (an empty file holds no compressed stream)")
    try:
        if path.name.lower().endswith(".gz"):
            with gzip.open(path, "rb") as stream:  # raises EOFError when the last member has no end
                yield from enumerate(stream, start=1)
            return
        with open(path, "rb") as raw:
            yield from enumerate(_lines(_zstd_blocks(raw)), start=1)
    except (OSError, EOFError, ValueError, zstandard.ZstdError) as error:
        raise DataError(f"{path}: cannot be decompressed to its end ({error})") from None


def _zstd_blocks(raw) -> Iterator[bytes]:
    """The decompressed bytes of every zstd frame in ``raw``; EOFError when the last frame has no end."""
    import zstandard

    decompressor = zstandard.ZstdDecompressor()
    frame, inside = decompressor.decompressobj(), False
    while data := raw.read(1 << 20):
        while data:
            out = frame.decompress(data)
            inside = True
            if out:
                yield out
            if frame.eof:  # this frame is whole; what follows it is the next frame
                data, frame, inside = frame.unused_data, decompressor.decompressobj(), False
            else:
                data = b""
    if inside:
        raise EOFError("the file ends inside a zstd frame: it was cut short")


def _lines(blocks: Iterator[bytes]) -> Iterator[bytes]:
    """The lines (with their line ends) of a stream of byte blocks."""
    rest = b""
    for block in blocks:
        parts = (rest + block).split(b"\n")
        rest = parts.pop()
        for part in parts:
            yield part + b"\n"
    if rest:
        yield rest


def _array_records(path: Path) -> Iterator[tuple[int, object]]:
    """(index, record) of a JSON file holding one list of records, parsed as it is read."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as handle:
        buffer = ""
        position = 0
        index = 0

        def more() -> bool:
            nonlocal buffer, position
            chunk = handle.read(1 << 20)
            buffer = buffer[position:] + chunk
            position = 0
            return bool(chunk)

        def skip_space() -> None:
            nonlocal position
            while True:
                while position < len(buffer) and buffer[position] in " \t\r\n":
                    position += 1
                if position < len(buffer) or not more():
                    return

        try:
            more()
            skip_space()
            if buffer[position : position + 1] != "[":
                raise DataError(f"{path}: expected a JSON list of records")
            position += 1
            while True:
                skip_space()
                if buffer[position : position + 1] == "]":
                    position += 1
                    skip_space()
                    if position < len(buffer):
                        raise DataError(
                            f"{path}: holds more after the closing ] of its list of records "
                            f"({show_value(buffer[position : position + 40], 40)}): not one JSON document"
                        )
                    return
                if index and buffer[position : position + 1] == ",":
                    position += 1
                    skip_space()
                while True:
                    try:
                        record, end = decoder.raw_decode(buffer, position)
                        if end == len(buffer) and more():
                            continue  # a number or literal may go on in the next chunk
                        break
                    except ValueError as error:
                        if not more():
                            raise DataError(f"{path}: record {index}: not valid JSON ({error.args[0]})") from None
                position = end
                yield index, record
                index += 1
                skip_space()
                if position >= len(buffer):
                    raise DataError(f"{path}: the list of records is not closed with ]")
        except UnicodeDecodeError as error:
            raise DataError(f"{path}: not UTF-8 ({error.reason})") from None


def _arrow_batch_count(path: Path) -> int:
    import pyarrow as pa

    with pa.memory_map(str(path)) as mapped:
        return sum(1 for _ in pa.ipc.open_stream(mapped))


def _arrow_call(path: Path, call):
    try:
        return call()
    except DataError:
        raise
    except Exception as error:  # pyarrow raises its own ArrowInvalid/ArrowException family
        raise DataError(f"{path}: not readable ({type(error).__name__}: {error})") from None


# --- Reading a piece (in a worker) -------------------------------------------------------------------------------


@dataclass
class Bad:
    """A record that cannot be a document: where it is and what it holds."""

    where: str
    problem: str


@dataclass
class Record:
    """A whole record (post-training data) and where it is, for messages."""

    where: str
    value: object


def read_piece(source: Source, piece: Piece, fields: list[str] | None) -> Iterator[str | dict | bytes | Bad]:
    """The piece's documents in order: text (str), a TextWindow of a text file's range, or a Bad record.

    A text file's piece yields its bytes in windows of about 1 MiB cut at line ends (one document
    continues across chunks and pieces); every other kind yields one item per record: its text field,
    or with ``fields`` None the whole record (post-training data).
    """
    if piece.kind == "text":
        yield from _text_windows(source.path, piece.start, piece.stop)
    elif piece.kind == "lines":
        if piece.lines:
            for offset, line in enumerate(piece.lines):
                yield from _line_record(line, fields, f"line {piece.first_record + offset}")
        else:
            yield from _range_records(source.path, piece.start, piece.stop, fields)
    elif piece.kind == "records":
        for offset, record in enumerate(piece.lines):
            yield _field(record, fields, f"record {piece.first_record + offset}")
    elif piece.kind == "parquet":
        yield from _parquet_records(source.path, piece.start, fields)
    elif piece.kind == "arrow":
        yield from _arrow_records(source.path, piece.start, fields)


CHUNK_BYTES = 1 << 20
CONTEXT_BYTES = 16 << 10
"""Text of the neighbouring chunks a text file's chunk is tokenized with, on each side (TextWindow)."""


@dataclass(frozen=True)
class TextWindow:
    """A chunk of a text file (``data[low:high]``) with some of the file's bytes around it for context."""

    data: bytes
    low: int
    high: int

    @property
    def chunk(self) -> bytes:
        return self.data[self.low : self.high]


def _text_windows(path: Path, start: int, stop: int) -> Iterator[TextWindow]:
    """The piece's bytes in chunks of about CHUNK_BYTES cut at line ends, each with CONTEXT_BYTES around it.

    A text file is one document, so a chunk's neighbours are its context even across pieces: a tokenizer
    that sees them gives the tokens near a cut that the whole document would.
    """
    size = path.stat().st_size
    with open(path, "rb") as handle:
        position = start
        while position < stop:
            handle.seek(position)
            chunk = handle.read(min(CHUNK_BYTES, stop - position))
            if not chunk:
                break
            if position + len(chunk) < stop and not chunk.endswith(b"\n"):
                chunk += handle.readline(stop - position - len(chunk))  # pieces end at a line end: chunks too
            end = position + len(chunk)
            before = max(0, position - CONTEXT_BYTES)
            handle.seek(before)
            left = handle.read(position - before)
            handle.seek(end)
            right = handle.read(min(CONTEXT_BYTES, size - end))
            yield TextWindow(left + chunk + right, len(left), len(left) + len(chunk))
            position = end


def _range_records(path: Path, start: int, stop: int, fields: list[str]) -> Iterator[str | Bad]:
    with open(path, "rb") as handle:
        handle.seek(start)
        position = start
        while position < stop:
            line = handle.readline()
            if not line:
                break
            yield from _line_record(line, fields, f"byte {position}")
            position += len(line)


def _line_record(line: bytes, fields: list[str], where: str) -> Iterator[str | Bad]:
    if not line.strip():
        return  # blank lines (a trailing newline, say) are not records
    try:
        record = json.loads(line)
    except ValueError as error:
        yield Bad(where, f"not valid JSON ({_reason(error)}): {show_value(line.decode('utf-8', 'replace'), 80)}")
        return
    yield _field(record, fields, where)


def _reason(error: ValueError) -> str:
    return error.msg if isinstance(error, json.JSONDecodeError) else str(error)


def _field(record, fields: list[str] | None, where: str) -> str | dict | Bad:
    if fields is None:
        return Record(where, record)  # a post-training record: the whole of it (astrai.data.chat reads it)
    dotted = ".".join(fields)
    value = record
    for part in fields:
        if not isinstance(value, dict):
            return Bad(where, f"not a JSON object with a {dotted!r} field: {show_value(record, 80)}")
        if part not in value:
            keys = ", ".join(sorted(str(key) for key in value)[:12]) or "none"
            return Bad(where, f"has no {dotted!r} field (its keys: {keys}); choose the field with --field NAME")
        value = value[part]
    if not isinstance(value, str):
        kind = "null" if value is None else type(value).__name__
        return Bad(where, f"field {dotted!r} holds {kind}, not text: {show_value(value, 80)}")
    problem = not_unicode_text(value)
    if problem:
        return Bad(where, f"field {dotted!r} {problem}")
    return value


def not_unicode_text(text: str) -> str | None:
    """Why a string from JSON is no text a tokenizer can read (a lone surrogate escape such as "\\ud800", valid
    JSON and common in scraped data), or None."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"holds a lone surrogate (\\u{ord(text[error.start]):04x} at character {error.start}), not text"
    return None


def _column(table, fields: list[str]):
    """The values at the dotted field of each row of an Arrow table or batch (None when missing)."""
    names = table.schema.names
    if fields[0] not in names:
        return None
    column = table.column(names.index(fields[0])).to_pylist()
    if len(fields) == 1:
        return column
    return [_nested(value, fields[1:]) for value in column]


_MISSING = object()


def _nested(value, fields: list[str]):
    for part in fields:
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _table_records(table, fields: list[str] | None, first_row: int, path: Path) -> Iterator[str | dict | Bad]:
    if fields is None:
        for offset, row in enumerate(table.to_pylist()):
            yield Record(f"row {first_row + offset}", row)
        return
    dotted = ".".join(fields)
    values = _column(table, fields)
    if values is None:
        columns = ", ".join(table.schema.names[:12])
        raise DataError(f"{path}: has no column {fields[0]!r} (its columns: {columns}); choose it with --field NAME")
    for offset, value in enumerate(values):
        where = f"row {first_row + offset}"
        if value is _MISSING:
            yield Bad(where, f"has no {dotted!r} field; choose the field with --field NAME")
        elif not isinstance(value, str):
            kind = "null" if value is None else type(value).__name__
            yield Bad(where, f"field {dotted!r} holds {kind}, not text: {show_value(value, 80)}")
        else:
            yield value


def _parquet_records(path: Path, group: int, fields: list[str]) -> Iterator[str | Bad]:
    import pyarrow.parquet as pq

    def read():
        handle = pq.ParquetFile(path)
        first = sum(handle.metadata.row_group(i).num_rows for i in range(group))
        columns = [fields[0]] if fields and fields[0] in handle.schema_arrow.names else None
        return handle.read_row_group(group, columns=columns), first

    table, first = _arrow_call(path, read)
    yield from _table_records(table, fields, first, path)


def _arrow_records(path: Path, batch_index: int, fields: list[str]) -> Iterator[str | Bad]:
    import pyarrow as pa

    def read():
        with pa.memory_map(str(path)) as mapped:
            first = 0
            for index, batch in enumerate(pa.ipc.open_stream(mapped)):
                if index == batch_index:
                    return pa.Table.from_batches([batch]), first
                first += batch.num_rows
        raise DataError(f"{path}: has no record batch {batch_index}")

    table, first = _arrow_call(path, read)
    yield from _table_records(table, fields, first, path)


def line_of(path: Path, offset: int) -> int:
    """The line number (from 1) at byte ``offset`` of a file, counted by reading up to it."""
    count = 1
    with open(path, "rb") as handle:
        left = offset
        while left > 0:
            chunk = handle.read(min(1 << 20, left))
            if not chunk:
                break
            count += chunk.count(b"\n")
            left -= len(chunk)
    return count


def describe_where(source: Source, where: str) -> str:
    """'FILE:LINE' for a record found by byte offset, 'FILE, row N' and the like otherwise."""
    if where.startswith("byte "):
        return f"{source.name}:{line_of(source.path, int(where.split()[1]))}"
    if where.startswith("line "):
        return f"{source.name}:{where.split()[1]}"
    return f"{source.name}, {where}"


def total_bytes(sources: list[Source]) -> int:
    return sum(source.size for source in sources)


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity, which a container or taskset may narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
