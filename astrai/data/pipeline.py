"""`python -m astrai.data`: tokenize a corpus into a data folder (``prepare``), or describe one (``info``). No torch.

    python -m astrai.data prepare --out data examples/corpus/*.txt
    python -m astrai.data prepare --tokenizer models/SmolLM2-135M --out data corpus/*.txt
    python -m astrai.data prepare --tokenizer models/SmolLM2-135M --out web downloads/fineweb/   # Parquet shards
    python -m astrai.data prepare --field meta.content --skip_bad --out docs docs.jsonl.zst
    python -m astrai.data info web

Every record is one document, followed by the end-of-text token; what is read and how
it is cut into pieces is :mod:`astrai.data.sources`. ``--workers`` processes (default:
the CPUs this process may use) tokenize the pieces, and the shards come out the same
for any number of workers. A record that is not valid JSON, lacks the field or holds
something other than text stops `prepare` naming the file and line (or row) and what
it found, with the output folder left as it was; ``--skip_bad`` skips such records and
counts them, per file. With ``--tokenizer`` (a Hugging Face ``tokenizers``
``tokenizer.json``, or a model folder holding one) the tokenizer's files are copied into
the data folder, and the trainer copies them into every checkpoint. The folder's format
is :mod:`astrai.common.data_folder`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from array import array
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

from astrai.common.contract import DATA_MANIFEST_FILE, TOKENIZER_FILES
from astrai.common.data_folder import (
    DATA_KINDS,
    DTYPES,
    KINDS,
    SHARD_PATTERN,
    DataError,
    DataManifest,
    ShardEntry,
    SourceEntry,
    TokenData,
    fields_file_name,
    mask_file_name,
    records_file_name,
    token_dtype,
    tokenizer_digest,
)
from astrai.common.errors import detach_stdout
from astrai.common.paths import PathError, output_folder
from astrai.common.values import format_duration
from astrai.data.chat import ChatTemplate, RecordEncoder, RecordError
from astrai.data.sources import (
    LEFT_OUT_HINT,
    Bad,
    Piece,
    Record,
    Source,
    TextWindow,
    available_cpus,
    describe_where,
    find_sources,
    pieces,
    read_piece,
    total_bytes,
)
from astrai.data.tokenizing import ByteTokenizer, HFTokenizer, copy_tokenizer_files, from_spec

# 2**27 tokens = 256 MiB per uint16 shard: large enough to keep the file count low, small enough to copy around.
DEFAULT_SHARD_TOKENS = 2**27
DEFAULT_FIELD = "text"
# Texts handed to the tokenizer at once: enough to amortise the call, few enough for a worker's memory.
_BATCH_TEXTS = 256
_BATCH_CHARS = 4 << 20
# Pieces waiting per worker: enough to keep every worker busy, few enough to bound the memory they hold.
_IN_FLIGHT_PER_WORKER = 2
_PROGRESS_SECONDS = 0.5


@dataclass(frozen=True)
class PieceResult:
    index: int
    source: int
    tokens_file: Path
    documents: int
    tokens: int
    skipped: int
    first_bad: tuple[str, str] | None = None
    """(where, problem) of the first bad record: the error without --skip_bad, the example with it."""
    bytes_read: int = 0
    empty: int = 0
    """Records whose text is empty: no document (one would be a lone end-of-text token)."""
    failed: str | None = None
    """Why the piece's source cannot be read to its end (with --skip_bad; the source is left out whole)."""


def _count(entry: SourceEntry, result: PieceResult) -> None:
    """Add what one piece of a source gave to the source's entry."""
    entry.documents += result.documents
    entry.tokens += result.tokens
    entry.skipped += result.skipped
    entry.empty += result.empty


def prepare(
    out_dir: Path,
    inputs: list[Path],
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    tokenizer: HFTokenizer | None = None,
    *,
    field: str = DEFAULT_FIELD,
    workers: int = 1,
    skip_bad: bool = False,
    progress: bool = False,
    say=None,
    kind: str = "seq",
) -> DataManifest:
    """Tokenize ``inputs`` into shards in ``out_dir``; returns the manifest.

    Without ``tokenizer`` the text is tokenized byte by byte. The output is written into a staging
    folder and moved in at the end: a failure or an interrupt leaves an earlier data set in
    ``out_dir`` as it was, and a trainer reading it keeps its mapped shards.
    """
    if shard_tokens < 2:
        raise DataError(f"shard_tokens must be at least 2, got {shard_tokens}")
    if workers < 1:
        raise DataError(f"--workers must be at least 1, got {workers}")
    if kind not in KINDS:
        raise DataError(f"--kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    fields = field.split(".")
    messages_field = None
    if not field or not all(fields):
        raise DataError(f"--field: {field!r} is not a field name (dotted for a nested field, such as meta.content)")
    sources, notes, left_out = find_sources([Path(path) for path in inputs], skip_bad)
    if not sources:
        raise DataError("no input files: name the files or folders to prepare")
    if kind != "seq":
        if field != DEFAULT_FIELD and kind != "sft":
            whole = {
                "dpo": "prompt, chosen, rejected",
                "grpo": "prompt, completions, rewards",
                "kto": "prompt, completion, label",
            }.get(kind, "its prompt, and every other field beside it")
            raise DataError(f"--field: a {kind} record is read whole ({whole}); leave --field out")
        messages_field = field if field != DEFAULT_FIELD else None
        fields = None  # a post-training example is the whole record
        text = [source.name for source in sources if source.kind == "text"]
        if text:
            raise DataError(
                f"{text[0]}: --kind {kind} reads records (JSON Lines, JSON, Parquet, save_to_disk), not text files"
            )
    for note in notes:
        (say or _stderr)(f"note: {note}")
    if kind != "seq" and tokenizer is not None:
        ChatTemplate.of_tokenizer(tokenizer)  # a template that does not compile is refused here, once
    elif getattr(tokenizer, "chat_template_file", None) is not None:
        raise DataError(
            "--chat_template: --kind seq renders no chat; give it with --kind sft, dpo, prompts, grpo or kto"
        )
    created = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out_dir))
    except OSError as error:
        raise DataError(f"cannot write {out_dir}: {error.strerror}") from None
    try:
        manifest = _prepare_into(
            staging, sources, shard_tokens, tokenizer, fields, workers, skip_bad, progress, kind, messages_field
        )
        manifest = dataclasses.replace(manifest, left_out=(*left_out, *manifest.left_out))
        with _signals_held():
            _publish(staging, out_dir, manifest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    shutil.rmtree(staging, ignore_errors=True)
    return manifest


"""The kinds that keep a line of text and fields beside each sequence (a fields file per shard)."""


def _prepare_into(
    staging: Path,
    sources: list[Source],
    shard_tokens: int,
    tokenizer: HFTokenizer | None,
    fields: list[str] | None,
    workers: int,
    skip_bad: bool,
    progress: bool,
    kind: str = "seq",
    messages_field: str | None = None,
) -> DataManifest:
    chosen = tokenizer or ByteTokenizer()
    dtype = token_dtype(chosen.vocab_size)
    group = {"seq": 0, "dpo": 2}.get(kind, 1)
    shards = _ShardWriter(staging, shard_tokens, DTYPES[dtype], group, fields=DATA_KINDS[kind].fields)
    stats = [SourceEntry(source.name, source.size) for source in sources]
    checksums = _Checksums(sources)
    meter = _Progress(total_bytes(sources)) if progress else None
    setup = (chosen.spec(), sources, fields, staging, skip_bad, kind, messages_field)
    # With --skip_bad a source's pieces are held until it has been read to its end: one that turns out cut short
    # or damaged is then left out whole, never half-read. (Without it, such a file stops prepare anyway.)
    held: list[PieceResult] = []

    def settle() -> None:
        for result in held:
            shards.append(result.tokens_file)
        held.clear()

    try:
        for result in _run(setup, pieces(sources, skip_bad), workers):
            if held and result.source != held[0].source:
                settle()
            entry = stats[result.source]
            if entry.left_out is not None or result.failed is not None:
                _discard(result)
                if entry.left_out is None:
                    if not skip_bad:
                        raise DataError(f"{result.failed}; {LEFT_OUT_HINT}")
                    for earlier in held:
                        _discard(earlier)
                    held.clear()
                    stats[result.source] = SourceEntry(entry.file, entry.size, left_out=result.failed)
                continue
            if result.first_bad is not None:
                where = describe_where(sources[result.source], result.first_bad[0])
                if not skip_bad:
                    _discard(result)
                    raise DataError(
                        f"{where}: {result.first_bad[1]}; nothing was written (--skip_bad skips such records)"
                    )
                entry.first_skipped = entry.first_skipped or f"{where}: {result.first_bad[1]}"
            _count(entry, result)
            if meter is not None:
                meter.add(result.documents, result.tokens, result.bytes_read)
            if skip_bad:
                held.append(result)
            else:
                shards.append(result.tokens_file)
        settle()
    finally:
        for result in held:
            _discard(result)
        shards.close()
        if meter is not None:
            meter.done()
    if shards.total == 0 or (kind == "seq" and all(entry.tokens == entry.documents for entry in stats)):
        failed = [entry.left_out for entry in stats if entry.left_out]
        if failed:
            raise DataError(f"nothing is left to train on: every input was left out (first: {failed[0]})")
        raise DataError("the inputs are empty: they hold no text to train on")
    field = fields or messages_field
    return _manifest(chosen, tokenizer, staging, dtype, kind, shards, stats, checksums, field)


def _manifest(chosen, tokenizer, staging, dtype, kind, shards, stats, checksums, field) -> DataManifest:
    """The manifest of a folder whose shards are written: what it holds, and what each source gave."""
    if isinstance(field, list):
        field = ".".join(field)
    copied = copy_tokenizer_files(tokenizer, staging)
    facts = {}
    if tokenizer is not None:
        facts = {
            "end_of_text_token": tokenizer.end_of_text_token,
            "special_tokens": tokenizer.special_tokens,
            "tokenizer_sha256": tokenizer.sha256,
            "tokenizer_digest": tokenizer_digest(tokenizer.file),
            "tokenizer_files": tuple(copied),
        }
    return DataManifest(
        kind=kind,
        tokenizer=chosen.name,
        vocab_size=chosen.vocab_size,
        end_of_text=chosen.end_of_text,
        dtype=dtype,
        num_tokens=shards.total,
        documents=sum(entry.documents for entry in stats),
        skipped=sum(entry.skipped for entry in stats),
        empty=sum(entry.empty for entry in stats),
        left_out=tuple(entry.left_out for entry in stats if entry.left_out is not None),
        field=field,
        shards=tuple(ShardEntry.from_dict(shard) for shard in shards.shards),
        sources=tuple(dataclasses.replace(entry, sha256=checksums.get(number)) for number, entry in enumerate(stats)),
        **facts,
    )


def _run(setup: tuple, work, workers: int):
    """Results of every piece, in piece order: in this process for one worker, else in a pool of ``workers``."""
    if workers == 1:
        previous = os.environ.get("TOKENIZERS_PARALLELISM")
        _init_worker(*setup)
        try:
            for piece in work:
                yield _run_piece(piece)
        finally:
            _WORKER.clear()
            if previous is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = previous
        return
    # forkserver: the workers start from a clean process, not a fork of this one with its checksum thread.
    context = multiprocessing.get_context("forkserver")
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker, initargs=setup)
    pending = deque()
    try:
        for piece in work:
            pending.append(pool.submit(_run_piece, piece))
            while len(pending) >= workers * _IN_FLIGHT_PER_WORKER:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        # On an error or a signal: no piece still queued is started, the running ones finish (a piece is a few
        # MiB), every worker exits, and their files are removed with the staging folder.
        pool.shutdown(wait=True, cancel_futures=True)


# --- In a worker -----------------------------------------------------------------------------------------------

_WORKER: dict = {}


def _init_worker(
    spec: tuple,
    sources: list[Source],
    fields: list[str] | None,
    staging: Path,
    skip_bad: bool,
    kind: str = "seq",
    messages_field: str | None = None,
) -> None:
    # One tokenizer per worker, one worker per core: the library's own thread pool would only fight the others.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if multiprocessing.parent_process() is not None:
        # Ctrl-C reaches the whole process group: the main process stops the pool; a worker stays quiet.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    tokenizer = from_spec(spec)
    encoder = None
    if kind != "seq":
        template = ChatTemplate.of_tokenizer(tokenizer) if isinstance(tokenizer, HFTokenizer) else None
        encoder = RecordEncoder(tokenizer, template, kind, messages_field)
    _WORKER.update(
        tokenizer=tokenizer, sources=sources, fields=fields, staging=staging, skip_bad=skip_bad, encoder=encoder
    )


def _run_piece(piece: Piece) -> PieceResult:
    """Tokenize one piece into a file of its own in the staging folder.

    A piece whose source cannot be read (damaged, not UTF-8) is, with --skip_bad, a result that says so.
    """
    out = _WORKER["staging"] / f".piece-{piece.index:09d}.bin"
    if piece.kind != "failed":
        try:
            return _run_records(piece) if _WORKER["encoder"] is not None else _run_text(piece)
        except DataError as error:
            if not _WORKER["skip_bad"]:
                raise DataError(f"{error}; {LEFT_OUT_HINT}") from None
            piece.problem = str(error)
    out.touch()
    return PieceResult(piece.index, piece.source, out, 0, 0, 0, failed=piece.problem)


def _run_text(piece: Piece) -> PieceResult:
    tokenizer = _WORKER["tokenizer"]
    source = _WORKER["sources"][piece.source]
    end_of_text = _token_bytes(tokenizer)
    out = _WORKER["staging"] / f".piece-{piece.index:09d}.bin"
    width = len(end_of_text)
    documents = skipped = written = empty = 0
    first_bad = None
    texts: list[str] = []
    chars = 0

    def flush(handle) -> None:
        nonlocal written, chars
        for encoded in tokenizer.encode_batch(texts):
            handle.write(encoded)
            handle.write(end_of_text)
            written += len(encoded) + width
        texts.clear()
        chars = 0

    with open(out, "wb") as handle:
        for item in read_piece(source, piece, _WORKER["fields"]):
            if isinstance(item, Bad):
                first_bad = first_bad or (item.where, item.problem)
                skipped += 1
                if not _WORKER["skip_bad"]:
                    break
            elif isinstance(item, TextWindow):
                encoded = _encode_text_window(tokenizer, item, source)
                handle.write(encoded)
                written += len(encoded)
            elif not item:
                empty += 1
            else:
                texts.append(item)
                documents += 1
                chars += len(item)
                if len(texts) >= _BATCH_TEXTS or chars >= _BATCH_CHARS:
                    flush(handle)
        flush(handle)
        if piece.kind == "text" and piece.last:
            if written or piece.stop > piece.start or piece.start:
                handle.write(end_of_text)
                written += width
                documents += 1
            else:
                empty += 1  # an empty text file is no document
    tokens = written // width
    return PieceResult(
        piece.index, piece.source, out, documents, tokens, skipped, first_bad, _piece_bytes(piece), empty
    )


def _run_records(piece: Piece) -> PieceResult:
    """Post-training records into token ids, a supervision mask per token and the length of each sequence."""
    tokenizer, encoder = _WORKER["tokenizer"], _WORKER["encoder"]
    source = _WORKER["sources"][piece.source]
    typecode = "H" if tokenizer.vocab_size <= 1 << 16 else "I"
    out = _WORKER["staging"] / f".piece-{piece.index:09d}.bin"
    records = skipped = tokens = 0
    first_bad = None
    with_fields = DATA_KINDS[encoder.kind].fields
    with (
        open(out, "wb") as ids_file,
        open(_mask_of(out), "wb") as mask_file,
        open(_lengths_of(out), "wb") as lengths,
        open(_fields_of(out), "w", encoding="utf-8") if with_fields else contextlib.nullcontext() as fields_file,
    ):
        for item in read_piece(source, piece, None):
            if isinstance(item, Record):
                try:
                    if encoder.kind == "prompts":
                        ids, line = encoder.prompt(item.value)
                        sequences, lines = [(ids, [0] * len(ids))], [line]
                    elif encoder.kind == "grpo":
                        sequences, lines = encoder.scored(item.value)
                    elif encoder.kind == "kto":
                        sequence, line = encoder.unpaired(item.value)
                        sequences, lines = [sequence], [line]
                    else:
                        sequences = encoder.encode(item.value)
                        lines = encoder.pair_fields(item.value) if with_fields else []
                except RecordError as error:
                    item = Bad(item.where, str(error))
            if isinstance(item, Bad):
                first_bad = first_bad or (item.where, item.problem)
                skipped += 1
                if not _WORKER["skip_bad"]:
                    break
                continue
            for ids, mask in sequences:
                ids_file.write(array(typecode, ids).tobytes())
                mask_file.write(bytes(mask))
                lengths.write(len(ids).to_bytes(4, "little"))
                tokens += len(ids)
            if with_fields:
                fields_file.write("".join(line + "\n" for line in lines))
            records += 1
    return PieceResult(piece.index, piece.source, out, records, tokens, skipped, first_bad, _piece_bytes(piece))


def _discard(result: PieceResult) -> None:
    """Remove a piece's files from the staging folder, unwritten."""
    for path in _piece_files(result.tokens_file):
        path.unlink(missing_ok=True)


def _piece_files(path: Path) -> tuple[Path, ...]:
    """A piece's tokens file and the files beside it."""
    return path, _mask_of(path), _lengths_of(path), _fields_of(path)


def _mask_of(path: Path) -> Path:
    return path.with_suffix(".mask")


def _lengths_of(path: Path) -> Path:
    return path.with_suffix(".len")


def _fields_of(path: Path) -> Path:
    return path.with_suffix(".fields")


def _encode_text_window(tokenizer, window: TextWindow, source: Source) -> bytes:
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode_bytes_uint16le(window.chunk)
    try:
        chunk = window.chunk.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{source.name}: not UTF-8 text ({error.reason}); --tokenizer reads UTF-8") from None
    # The context may begin or end inside a character; only the chunk's own text must be whole.
    left = window.data[: window.low].decode("utf-8", errors="replace")
    right = window.data[window.high :].decode("utf-8", errors="replace")
    return tokenizer.encode_window(left + chunk + right, len(left), len(left) + len(chunk))


def _token_bytes(tokenizer) -> bytes:
    width = 2 if tokenizer.vocab_size <= 1 << 16 else 4
    return tokenizer.end_of_text.to_bytes(width, "little")


def _piece_bytes(piece: Piece) -> int:
    if piece.kind in ("text", "lines") and not piece.lines:
        return piece.stop - piece.start
    return sum(len(line) for line in piece.lines if isinstance(line, bytes))


# --- In the main process ----------------------------------------------------------------------------------------


class _ShardWriter:
    """Appends pieces' tokens to shard files of about ``shard_tokens`` tokens each, in order.

    ``group`` 0 writes one stream of tokens (pre-training data, cut anywhere). Post-training data keeps
    its sequences whole, with a mask file and a file of lengths beside each shard: ``group`` 1 keeps each
    sequence in one shard (SFT, prompts), 2 each pair of them (DPO's chosen and rejected). With ``fields``
    (prompts), each sequence's line of text and fields goes into the shard's fields file.
    """

    def __init__(self, folder: Path, shard_tokens: int, width: int, group: int = 0, fields: bool = False):
        self.folder, self.shard_tokens, self.width, self.group = folder, shard_tokens, width, group
        self.fields = fields
        self.shards: list[dict] = []
        self.total = 0
        self._handles: list = []

    def append(self, path: Path) -> None:
        try:
            if self.group:
                self._append_sequences(path)
            else:
                with open(path, "rb") as source:
                    while block := source.read(self.width << 18):
                        self._write(memoryview(block))
        finally:
            for leftover in _piece_files(path):
                leftover.unlink(missing_ok=True)

    def _write(self, data: memoryview) -> None:
        while len(data):
            if not self._handles or self.shards[-1]["num_tokens"] == self.shard_tokens:
                self._next_shard()
            room = self.shard_tokens - self.shards[-1]["num_tokens"]
            part, data = data[: self.width * room], data[self.width * room :]
            self._handles[0].write(part)
            self._count(len(part) // self.width)

    def _append_sequences(self, path: Path) -> None:
        lengths = array("I")
        lengths.frombytes(_lengths_of(path).read_bytes())
        if sys.byteorder == "big":
            lengths.byteswap()
        fields = open(_fields_of(path), "rb") if self.fields else contextlib.nullcontext()
        with open(path, "rb") as ids, open(_mask_of(path), "rb") as mask, fields:
            for first in range(0, len(lengths), self.group):
                unit = lengths[first : first + self.group]
                count = sum(unit)
                shard = self.shards[-1] if self._handles else None
                if shard is None or (shard["num_tokens"] and shard["num_tokens"] + count > self.shard_tokens):
                    self._next_shard()
                tokens, masks, records = self._handles[:3]
                tokens.write(ids.read(count * self.width))
                masks.write(mask.read(count))
                records.write(b"".join(length.to_bytes(4, "little") for length in unit))
                if self.fields:  # a line per sequence of the unit (a DPO pair has two)
                    self._handles[3].write(b"".join(fields.readline() for _ in unit))
                self.shards[-1]["num_records"] += len(unit)
                self._count(count)

    def _next_shard(self) -> None:
        self.close()
        name = SHARD_PATTERN.format(len(self.shards))
        entry = {"file": name, "num_tokens": 0}
        if self.group:
            entry.update(mask=mask_file_name(name), records=records_file_name(name), num_records=0)
        if self.fields:
            entry["fields"] = fields_file_name(name)
        self.shards.append(entry)
        files = [
            name,
            *([entry["mask"], entry["records"]] if self.group else []),
            *([entry["fields"]] if self.fields else []),
        ]
        self._handles = [open(self.folder / file, "wb") for file in files]

    def _count(self, tokens: int) -> None:
        self.shards[-1]["num_tokens"] += tokens
        self.total += tokens

    def close(self) -> None:
        for handle in self._handles:
            handle.close()
        self._handles = []


class _Checksums:
    """SHA-256 of every source file, computed by a thread of its own while the workers tokenize."""

    def __init__(self, sources: list[Source]):
        self._sums: dict[int, str] = {}
        self._thread = threading.Thread(target=self._run, args=(sources,), daemon=True, name="prepare-checksums")
        self._thread.start()

    def _run(self, sources: list[Source]) -> None:
        for number, source in enumerate(sources):
            digest = hashlib.sha256()
            with open(source.path, "rb") as handle:
                while block := handle.read(1 << 22):
                    digest.update(block)
            self._sums[number] = digest.hexdigest()

    def get(self, number: int) -> str:
        self._thread.join()
        return self._sums[number]


class _Progress:
    """A line on the terminal: documents, tokens, tokens/s, and the ETA from the bytes read so far."""

    def __init__(self, total_bytes: int):
        self.total, self.read = total_bytes, 0
        self.documents = self.tokens = 0
        self.started = self.shown = time.monotonic()

    def add(self, documents: int, tokens: int, read: int) -> None:
        self.documents += documents
        self.tokens += tokens
        self.read += read
        now = time.monotonic()
        if now - self.shown >= _PROGRESS_SECONDS:
            self.shown = now
            sys.stderr.write("\r" + self.line(now))
            sys.stderr.flush()

    def line(self, now: float) -> str:
        seconds = max(now - self.started, 1e-9)
        rate = self.tokens / seconds
        text = f"{self.documents:,} documents, {self.tokens:,} tokens, {rate:,.0f} tokens/s"
        if self.total and self.read:
            share = min(self.read / self.total, 1.0)
            text += f", {share:.0%} of {self.total / 1e6:,.1f} MB, eta {format_duration(seconds / share - seconds)}"
        return text + "   "

    def done(self) -> None:
        sys.stderr.write("\r" + self.line(time.monotonic()) + "\n")
        sys.stderr.flush()


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


@contextlib.contextmanager
def _signals_held():
    """No stop between the first file moved in and the manifest: a data set half replaced would be neither the
    old one nor the new. A stop that comes meanwhile finds the work done, and is dropped."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        while signal.sigtimedwait(STOP_SIGNALS, 0) is not None:
            pass
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _publish(staging: Path, out_dir: Path, manifest: DataManifest) -> None:
    """Move a prepared data set from ``staging`` into ``out_dir``, the manifest last.

    From the first shard moved until the new manifest is in place, out_dir has no manifest and reads as
    not prepared; shards and tokenizer files of an earlier data set that the new one does not have go.
    """
    names = [name for shard in manifest.shards for name in shard.files()]
    names += list(manifest.tokenizer_files)
    (out_dir / DATA_MANIFEST_FILE).unlink(missing_ok=True)
    for name in names:
        os.replace(staging / name, out_dir / name)
    for pattern in ("shard_*.bin", "mask_*.bin", "records_*.bin"):
        for stale in sorted(out_dir.glob(pattern)):
            if stale.name not in names:
                stale.unlink()
    for name in TOKENIZER_FILES:
        if name not in names:
            (out_dir / name).unlink(missing_ok=True)
    tmp = staging / DATA_MANIFEST_FILE
    tmp.write_text(manifest.to_json(), encoding="utf-8")
    os.replace(tmp, out_dir / DATA_MANIFEST_FILE)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


# --- info -----------------------------------------------------------------------------------------------------------


def _labelled(data: TokenData) -> str:
    """A KTO folder's examples, desirable and undesirable."""
    labels = data.labels()
    return f"{len(labels):,} examples ({sum(labels):,} desirable, {len(labels) - sum(labels):,} undesirable)"


def _supervised(folder: Path) -> int:
    """Tokens the loss covers in a post-training data folder (mask bytes set)."""
    data = TokenData.open(folder)
    return sum(data.mask_file(shard).read_bytes().count(1) for shard in range(len(data.shard_files)))


"""What one of a data folder's "documents" is, by its kind."""


def describe_folder(folder: Path) -> str:
    """What ``python -m astrai.data info`` prints: the folder's totals, tokenizer and every source file."""
    data = TokenData.open(folder)
    manifest = DataManifest.read(folder / DATA_MANIFEST_FILE)
    documents = manifest.documents
    lines = [
        f"{folder}: {data.num_tokens:,} tokens"
        + (f" in {documents:,} {DATA_KINDS[data.kind].counts}" if isinstance(documents, int) else "")
        + f", {len(data.shard_files)} shard(s) of {data.dtype}",
        f"tokenizer   {data.tokenizer_description}, vocabulary {data.vocab_size}, end of text "
        f"{manifest.end_of_text_shown!r}",
    ]
    if data.kind == "grpo":
        lines.append(
            f"kind        grpo: {manifest.documents:,} prompts, {sum(data.record_counts):,} scored completions, "
            f"{_supervised(folder):,} completion tokens"
        )
    elif data.kind == "prompts":
        longest = max(max(data.sequence_lengths(shard)) for shard in range(len(data.shard_files)))
        lines.append(f"kind        prompts: {sum(data.record_counts):,} prompts, the longest {longest:,} tokens")
    elif data.kind == "kto":
        lines.append(f"kind        kto: {_labelled(data)}, {_supervised(folder):,} tokens supervised")
    elif data.kind != "seq":
        sequences = sum(data.record_counts)
        units = f"{sequences:,} SFT sequences" if data.kind == "sft" else f"{sequences // 2:,} DPO pairs"
        lines.append(f"kind        {data.kind}: {units}, {_supervised(folder):,} tokens supervised")
    if manifest.field:
        lines.append(f"field       {manifest.field}")
    sources = manifest.sources
    if sources and sources[0].sha256 is not None:
        lines.append(f"sources     {len(sources)} file(s), {manifest.skipped:,} record(s) skipped")
        width = max(len(entry.file) for entry in sources)
        for entry in sources:
            skipped = f", {entry.skipped:,} skipped" if entry.skipped else ""
            lines.append(
                f"  {entry.file:<{width}}  {entry.size:>14,} B  sha256 {entry.sha256[:12]}  "
                f"{entry.documents:>10,} documents  {entry.tokens:>14,} tokens{skipped}"
            )
    elif sources:
        lines.append(f"sources     {', '.join(entry.file for entry in sources)}")
    return "\n".join(lines)


# --- Command line ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m astrai.data", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="tokenize a corpus into a data folder (manifest.json + shards)")
    prep.add_argument("--out", required=True, help="data folder to write")
    prep.add_argument(
        "--tokenizer",
        type=Path,
        metavar="PATH",
        help="a Hugging Face tokenizers tokenizer.json, or a model folder holding one (default: bytes)",
    )
    prep.add_argument(
        "--eos",
        metavar="TOKEN",
        help="end-of-text token between documents, one of the tokenizer's special tokens (default: its eos_token)",
    )
    prep.add_argument(
        "--field", default=DEFAULT_FIELD, metavar="NAME", help="the records' text field, dotted if nested (text)"
    )
    prep.add_argument(
        "--workers", default=None, metavar="N", help="processes that tokenize (default: the CPUs this process may use)"
    )
    prep.add_argument(
        "--chat_template",
        type=Path,
        metavar="FILE",
        help="a Jinja chat template to render the records with instead of the tokenizer folder's (say, one that "
        "marks the assistant's text with {%% generation %%}); it goes into the data folder as chat_template.jinja",
    )
    prep.add_argument("--skip_bad", action="store_true", help="skip records without text instead of stopping")
    prep.add_argument(
        "--kind",
        default="seq",
        choices=KINDS,
        help="seq: text for pre-training; sft: chat (messages) or prompt/completion records; dpo: prompt, chosen, "
        "rejected; prompts: a prompt (text or messages) and any other fields, for the online train types; grpo: "
        "a prompt with its completions and their rewards (lists), scored elsewhere; kto: prompt, completion and "
        "label (true: desirable), unpaired preference records",
    )
    prep.add_argument("--shard_tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file")
    prep.add_argument(
        "inputs", type=Path, nargs="+", metavar="INPUT", help="text, JSON Lines, JSON, Parquet files or folders"
    )
    info = commands.add_parser("info", help="describe a data folder: totals, tokenizer, every source file")
    info.add_argument("folder", type=Path, help="a data folder written by prepare")
    args = parser.parse_args(argv)
    previous = {number: signal.signal(number, _raise_stopped) for number in (signal.SIGTERM, signal.SIGHUP)}
    try:
        if args.command == "info":
            print(describe_folder(args.folder))
            sys.stdout.flush()
            return 0
        code = _prepare_command(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        detach_stdout()
        return 1
    except (DataError, PathError) as error:
        print(error.show(), file=sys.stderr)
        return error.exit_code
    except OSError as error:
        print(f"error: {error.filename or ''}: {error.strerror}", file=sys.stderr)
        return 1
    except BrokenProcessPool as error:
        print(f"error: a tokenizing worker process died ({error}); nothing was written", file=sys.stderr)
        return 1
    except KeyboardInterrupt as stop:
        why = f"stopped by {stop.args[0]}" if isinstance(stop, _Stopped) else "interrupted"
        print(f"\n{why}: nothing was written (an earlier data set in the folder is as it was)", file=sys.stderr)
        return 128 + (stop.args[1] if isinstance(stop, _Stopped) else signal.SIGINT)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


class _Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP: unwinds like Ctrl-C, so the workers stop and the staging folder is removed."""


def _raise_stopped(number, _frame) -> None:
    raise _Stopped(signal.Signals(number).name, number)


def _prepare_command(args) -> int:
    from astrai.common.values import whole_number

    out = output_folder(args.out, "--out")
    if args.eos is not None and args.tokenizer is None:
        raise DataError("--eos needs --tokenizer (the byte tokenizer's end-of-text token is fixed)")
    if args.chat_template is not None and args.tokenizer is None:
        raise DataError("--chat_template needs --tokenizer (the tokenizer whose special tokens the template writes)")
    try:
        workers = available_cpus() if args.workers is None else whole_number(args.workers, 1)
    except ValueError as error:
        raise DataError(f"--workers {error}") from None
    tokenizer = HFTokenizer(args.tokenizer, args.eos, args.chat_template) if args.tokenizer is not None else None
    manifest = prepare(
        out,
        args.inputs,
        args.shard_tokens,
        tokenizer,
        field=args.field,
        workers=workers,
        skip_bad=args.skip_bad,
        progress=sys.stderr.isatty(),
        kind=args.kind,
    )
    for problem in manifest.left_out:
        print(f"left out {problem}")
    if manifest.empty:
        print(f"left out {manifest.empty:,} empty record(s): no text, no document")
    for entry in manifest.sources:
        if entry.skipped:
            print(f"skipped {entry.skipped:,} bad record(s) in {entry.file} (first: {entry.first_skipped})")
    what = f"{manifest.documents:,} documents"
    if args.kind == "prompts":
        what = f"{manifest.documents:,} prompts"
    elif args.kind == "grpo":
        completions = sum(shard.num_records for shard in manifest.shards)
        what = f"{manifest.documents:,} prompts with {completions:,} completions"
    elif args.kind == "kto":
        what = f"{_labelled(TokenData.open(out))}, {_supervised(out):,} tokens supervised"
    elif args.kind != "seq":
        records = "records" if args.kind == "sft" else "pairs"
        what = f"{manifest.documents:,} {records}, {_supervised(out):,} tokens supervised"
    print(
        f"wrote {manifest.num_tokens:,} tokens ({what}) from "
        f"{len(manifest.sources)} file(s) in {len(manifest.shards)} shard(s) to {out} "
        f"(tokenizer {manifest.tokenizer}, vocab {manifest.vocab_size}, {manifest.dtype}, "
        f"end of text {manifest.end_of_text_shown!r}, {workers} worker(s))"
    )
    return 0
