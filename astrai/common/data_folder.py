"""A prepared data folder, read without torch: the manifest, the shards it lists, and the train/validation split.

The host (`invoke preflight`), the data tools (``python -m astrai.data``) and the
trainer read data folders through this module, so all of them accept and refuse
the same folders. A data folder holds ``manifest.json`` and ``shard_NNNNN.bin``
files of raw little-endian token ids: uint16 when the vocabulary fits, else uint32.
The manifest is written last, so a folder with a manifest is complete.

Training reads windows of ``window_size + 1`` tokens (inputs plus the shifted
targets). Window ``i`` of a shard starts at token ``i * window_size``, so
neighbouring windows share one token and every token is used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import sys
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from astrai.common.contract import DATA_MANIFEST_FILE, TOKENIZER_FILE
from astrai.common.errors import AstraiError

SHARD_PATTERN = "shard_{:05d}.bin"
FORMAT = "astrai-tokens"
# Token id width by shard dtype.
DTYPES = {"uint16": 2, "uint32": 4}
"""Token widths by name, in bytes."""


def token_dtype(vocab_size: int) -> str:
    """The narrowest width that holds every token id of the vocabulary: uint16 when it fits, else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


class DataError(AstraiError):
    """A data folder that cannot be trained on; the message says what to do."""


@dataclass(frozen=True)
class DataKind:
    """What a data folder holds (``prepare --kind``): its name, what it holds and counts, and what a run trains on."""

    name: str
    holds: str
    """What the folder holds, as messages say it."""
    counts: str
    """What `prepare` and `info` count of it (documents, records, pairs, prompts, groups, examples)."""
    trains: str = "windows of {window}+1"
    """What a run trains on of it, as a count of them reads (``{window}``: data.window_size)."""
    fields: bool = False
    """Each record's fields are kept beside its shard (what reward functions receive; a KTO example's label)."""
    fields_since: bool = False
    """Its folders keep fields only since a version of prepare: an older folder without them still reads (DPO's
    pairs, whose fields are a reward model's optional margin)."""
    units: Callable[[TokenData, int, str], object] | None = None
    """What a run trains on at a window (data, window, overlong): packed windows, pairs, examples, a count of prompts;
    None where the trainer reads windows of the token stream (seq) or the model decides (prompts)."""


def _documents(data: TokenData, window: int, overlong: str) -> int:
    return data.documents or 0


def _packed(data: TokenData, window: int, overlong: str) -> Packing:
    return _supervised_units(data, window, overlong, pairs=False)


def _paired(data: TokenData, window: int, overlong: str) -> Pairs:
    return _supervised_units(data, window, overlong, pairs=True)


def _labelled(data: TokenData, window: int, overlong: str) -> Examples:
    return _supervised_units(data, window, overlong, pairs=False, labels=data.labels())


DATA_KINDS: dict[str, DataKind] = {
    kind.name: kind
    for kind in (
        DataKind("seq", "pre-training text", "documents"),
        DataKind("sft", "SFT examples", "records", "packed windows of {window}", units=_packed),
        DataKind("dpo", "DPO pairs", "pairs", "pairs", fields=True, fields_since=True, units=_paired),
        DataKind("prompts", "prompts", "prompts", "prompts", fields=True),
        DataKind(
            "grpo", "scored completions", "groups", "prompts with their completions", fields=True, units=_documents
        ),
        DataKind("kto", "unpaired preference examples", "examples", "examples", fields=True, units=_labelled),
    )
}
"""What a data folder holds: a token stream (pre-training), supervised sequences (SFT), pairs of them (DPO), or
prompts with their records' other fields (what the online train types sample completions for), or prompts with
completions scored elsewhere (offline GRPO: each completion a sequence, its reward beside it), or unpaired examples
(KTO: a prompt and a completion, supervised, each labelled desirable or not)."""
KINDS = tuple(DATA_KINDS)


def data_kind(name: str) -> DataKind:
    return DATA_KINDS[name]


def mask_file_name(shard: str) -> str:
    """The supervision mask beside a post-training shard: one byte per token, 1 where the loss covers it."""
    return shard.replace("shard_", "mask_", 1)


def fields_file_name(shard: str) -> str:
    """Prompt data: a JSON line per sequence of the shard, ``{"prompt": text, "fields": {...}}``, in order."""
    return shard.replace("shard_", "fields_", 1).removesuffix(".bin") + ".jsonl"


def records_file_name(shard: str) -> str:
    """The lengths of a post-training shard's sequences, uint32 little-endian, in order."""
    return shard.replace("shard_", "records_", 1)


@dataclass(frozen=True)
class ShardEntry:
    """One shard of a data folder, as the manifest lists it."""

    file: str
    num_tokens: int
    num_records: int = 0
    """Post-training data: the sequences in the shard, whose lengths its records file holds (records_file_name),
    and whose supervised tokens its mask file marks (mask_file_name)."""
    mask: str | None = None
    records: str | None = None
    fields: str | None = None
    """Prompt data: each sequence's text and fields (fields_file_name)."""

    def files(self) -> list[str]:
        return [self.file, *(name for name in (self.mask, self.records, self.fields) if name is not None)]

    def to_dict(self) -> dict:
        entry = {"file": self.file, "num_tokens": self.num_tokens}
        if self.mask is not None:
            entry.update(mask=self.mask, records=self.records, num_records=self.num_records)
        if self.fields is not None:
            entry["fields"] = self.fields
        return entry

    @classmethod
    def from_dict(cls, raw: dict) -> ShardEntry:
        return cls(
            file=str(raw["file"]),
            num_tokens=int(raw["num_tokens"]),
            num_records=int(raw.get("num_records", 0)),
            mask=raw.get("mask"),
            records=raw.get("records"),
            fields=raw.get("fields"),
        )


@dataclass
class SourceEntry:
    """One input file of a data folder, and what it gave (counted up by prepare as the pieces come in)."""

    file: str
    size: int = 0
    sha256: str | None = None
    documents: int = 0
    tokens: int = 0
    skipped: int = 0
    empty: int = 0
    first_skipped: str | None = None
    """Where the first record that was skipped is, and why (with --skip_bad)."""
    left_out: str | None = None
    """Why the file was left out whole (with --skip_bad)."""

    def to_dict(self) -> dict:
        entry = dataclasses.asdict(self)
        for key in ("empty", "first_skipped", "left_out"):
            if not entry[key]:
                del entry[key]
        return entry


@dataclass(frozen=True)
class DataManifest:
    """What ``manifest.json`` records: the folder's tokens, shards, tokenizer and sources.

    One typed record, written by ``prepare`` and read by the trainer, preflight and ``info`` alike,
    as :class:`astrai.common.checkpoints.CheckpointMeta` is for a checkpoint. Keys this version does
    not know are ignored, and keys older folders lack take their defaults.
    """

    tokenizer: str
    """byte, or the library that tokenized it (tokenizers)."""
    vocab_size: int
    dtype: str
    num_tokens: int
    shards: tuple[ShardEntry, ...]
    kind: str = "seq"
    end_of_text: int | None = None
    documents: int | None = None
    """Documents (records) it holds; None for folders prepared before prepare counted them."""
    skipped: int = 0
    empty: int = 0
    left_out: tuple[str, ...] = ()
    """Inputs left out whole (with --skip_bad), each with its reason."""
    field: str | None = None
    sources: tuple[SourceEntry, ...] = ()
    end_of_text_token: str | None = None
    special_tokens: dict[str, int] | None = None
    tokenizer_sha256: str | None = None
    tokenizer_digest: str | None = None
    """What the tokenizer does (tokenizer_digest()); None in older folders and byte-level data."""
    tokenizer_files: tuple[str, ...] = ()
    """Tokenizer files in the folder, copied into every checkpoint."""

    @property
    def end_of_text_shown(self) -> str | int | None:
        """The end-of-text token as a user reads it: its text, or (byte-level data) its id."""
        return self.end_of_text_token if self.end_of_text_token is not None else self.end_of_text

    _TOKENIZER_KEYS = ("end_of_text_token", "special_tokens", "tokenizer_sha256", "tokenizer_digest")

    def to_dict(self) -> dict:
        values = {
            "format": FORMAT,
            "version": 2,
            "byte_order": "little",
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
            "shards": [shard.to_dict() for shard in self.shards],
            "sources": [source.to_dict() for source in self.sources],
            "left_out": list(self.left_out),
            "tokenizer_files": list(self.tokenizer_files),
        }
        if self.tokenizer_sha256 is None:  # byte-level data: no tokenizer file, none of its facts
            for key in (*self._TOKENIZER_KEYS, "tokenizer_files"):
                del values[key]
        return values

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False) + "\n"

    @classmethod
    def from_dict(cls, raw) -> DataManifest:
        """The record of a parsed manifest; ValueError, KeyError or TypeError names what is wrong."""
        if not isinstance(raw, dict):
            raise ValueError(f"expected a JSON object, got {type(raw).__name__}")
        if raw.get("format") != FORMAT or raw.get("dtype") not in DTYPES:
            raise ValueError(f"expected format {FORMAT!r} with dtype {' or '.join(map(repr, DTYPES))}")
        tokenizer_files = tuple(str(name) for name in raw.get("tokenizer_files", ()))
        if any(Path(name).name != name for name in tokenizer_files):
            raise ValueError(f"tokenizer_files must be file names, got {list(tokenizer_files)}")
        manifest = cls(
            tokenizer=str(raw["tokenizer"]),
            vocab_size=int(raw["vocab_size"]),
            dtype=raw["dtype"],
            num_tokens=int(raw["num_tokens"]),
            shards=tuple(ShardEntry.from_dict(shard) for shard in raw["shards"]),
            kind=str(raw.get("kind", "seq")),
            end_of_text=raw.get("end_of_text"),
            documents=raw.get("documents"),
            skipped=int(raw.get("skipped", 0)),
            empty=int(raw.get("empty", 0)),
            left_out=tuple(raw.get("left_out", ())),
            field=raw.get("field"),
            # Folders of the first version list their sources by name only.
            sources=tuple(
                SourceEntry(**{key: value for key, value in entry.items() if key in _SOURCE_KEYS})
                if isinstance(entry, dict)
                else SourceEntry(str(entry))
                for entry in raw.get("sources", ())
            ),
            tokenizer_files=tokenizer_files,
            **{key: raw.get(key) for key in cls._TOKENIZER_KEYS},
        )
        if manifest.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {manifest.kind!r}")
        return manifest

    @classmethod
    def read(cls, path: Path) -> DataManifest:
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


_SOURCE_KEYS = {f.name for f in dataclasses.fields(SourceEntry)}


@dataclass(frozen=True)
class TokenData:
    """A prepared data folder, checked against its manifest; shards are mapped lazily, per process."""

    root: Path
    vocab_size: int
    tokenizer: str
    num_tokens: int
    shard_files: tuple[Path, ...]
    shard_tokens: tuple[int, ...]
    dtype: str = "uint16"
    tokenizer_sha256: str | None = None
    tokenizer_digest: str | None = None
    """What the tokenizer does (tokenizer_digest()), recorded by prepare; None in older folders."""
    tokenizer_files: tuple[str, ...] = ()
    """Tokenizer files in the folder, copied into every checkpoint."""
    end_of_text: int | None = None
    documents: int | None = None
    """Documents (records) it holds; None for folders prepared before prepare counted them."""
    source_files: int = 0
    kind: str = "seq"
    """seq, sft, dpo or prompts (KINDS)."""
    record_counts: tuple[int, ...] = ()
    """Post-training data: the sequences of each shard (in its records file)."""
    has_fields: bool = False
    """Every shard has a fields file (the manifest lists one for each)."""

    def mask_file(self, shard: int) -> Path:
        return self.shard_files[shard].with_name(mask_file_name(self.shard_files[shard].name))

    def records_file(self, shard: int) -> Path:
        return self.shard_files[shard].with_name(records_file_name(self.shard_files[shard].name))

    def fields_file(self, shard: int) -> Path:
        return self.shard_files[shard].with_name(fields_file_name(self.shard_files[shard].name))

    def prompt_records(self) -> list[dict]:
        """Prompt data: every sequence's line of its fields file, in order over the shards: ``{"prompt": text,
        "fields": {...}}`` (prompts; with ``"messages"``, the chat messages the text was rendered from),
        ``{"prompt": text, "reward": r, "index": i, "of": k}`` (grpo: the i-th of
        its prompt's k completions, r None where it went unscored), ``{"label": true | false}`` (kto)."""
        records = []
        for shard in range(len(self.shard_files)):
            path = self.fields_file(shard)
            with open(path, encoding="utf-8") as lines:
                records += [json.loads(line) for line in lines]
            if len(records) != sum(self.record_counts[: shard + 1]):
                raise DataError(f"{path}: holds another number of records than the manifest lists; prepare it again")
        return records

    def margins(self) -> list[float] | None:
        """DPO data: each sequence's margin (TRL's ``margin``: how much more the chosen answer is preferred, 0 where a
        record gives none), in order over the shards; None for a folder prepared without them."""
        if not self.has_fields:
            return None
        return [float(record.get("margin") or 0.0) for record in self.prompt_records()]

    def labels(self) -> list[bool]:
        """KTO data: each example's label (True: desirable), in order over the shards."""
        labels = [record.get("label") for record in self.prompt_records()]
        if not all(isinstance(label, bool) for label in labels):
            raise DataError(f"{self.root}: an example's fields line has no true or false label; prepare it again")
        return labels

    @property
    def tokenizer_identity(self) -> tuple:
        """What must agree for two folders' token ids to mean the same text."""
        return (self.tokenizer, self.tokenizer_sha256, self.vocab_size, self.end_of_text)

    def tokenizer_meaning(self) -> str | None:
        """The digest of what the data's tokenizer does (None: prepared byte by byte)."""
        if self.tokenizer_sha256 is None:
            return None
        return self.tokenizer_digest or tokenizer_digest(self.root / TOKENIZER_FILE)

    @property
    def tokenizer_description(self) -> str:
        if self.tokenizer_sha256 is None:
            return f"{self.tokenizer} tokenizer"
        return f"{TOKENIZER_FILE} sha256 {self.tokenizer_sha256[:12]}"

    @classmethod
    def open(cls, root: Path) -> TokenData:
        root = Path(root)
        how = f"run: python -m astrai.data prepare --out {root} FILE..."
        if not root.is_dir():
            raise DataError(f"data folder {root} does not exist (set data_root_path, or {how})")
        manifest_path = root / DATA_MANIFEST_FILE
        if not manifest_path.is_file():
            raise DataError(f"data folder {root} has no {DATA_MANIFEST_FILE}; it is empty or not prepared ({how})")
        try:
            manifest = DataManifest.read(manifest_path)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise DataError(f"{manifest_path}: unreadable manifest ({error}); {how}") from None
        shards = [(root / shard.file, shard.num_tokens) for shard in manifest.shards]
        data = cls(
            root=root,
            vocab_size=manifest.vocab_size,
            tokenizer=manifest.tokenizer,
            num_tokens=manifest.num_tokens,
            shard_files=tuple(path for path, _ in shards),
            shard_tokens=tuple(count for _, count in shards),
            dtype=manifest.dtype,
            tokenizer_sha256=manifest.tokenizer_sha256,
            tokenizer_digest=manifest.tokenizer_digest,
            tokenizer_files=manifest.tokenizer_files,
            end_of_text=manifest.end_of_text,
            documents=manifest.documents,
            source_files=len(manifest.sources),
            kind=manifest.kind,
            record_counts=tuple(shard.num_records for shard in manifest.shards),
            has_fields=bool(manifest.shards) and all(shard.fields is not None for shard in manifest.shards),
        )
        if data.num_tokens == 0 or not shards:
            raise DataError(f"data folder {root} holds no tokens; {how}")
        width = DTYPES[data.dtype]
        for path, count in shards:
            size = path.stat().st_size if path.is_file() else None
            if size != width * count:
                raise DataError(f"{path}: expected {width * count} bytes ({count} tokens), found {size}; {how}")
        for name in data.tokenizer_files:
            if not (root / name).is_file():
                raise DataError(f"{root / name}: missing (the manifest lists it); {how}")
        if data.kind != "seq":
            for index, (count, records) in enumerate(zip(data.shard_tokens, data.record_counts, strict=True)):
                for path, size in ((data.mask_file(index), count), (data.records_file(index), 4 * records)):
                    found = path.stat().st_size if path.is_file() else None
                    if found != size:
                        raise DataError(f"{path}: expected {size} bytes, found {found}; {how}")
        kind = DATA_KINDS[data.kind]
        if kind.fields and (data.has_fields or not kind.fields_since):
            for index in range(len(data.shard_files)):
                if not data.fields_file(index).is_file():
                    raise DataError(f"{data.fields_file(index)}: missing (the manifest lists it); {how}")
        return data

    def sequence_lengths(self, shard: int) -> list[int]:
        """Post-training data: the length of each sequence of a shard, in order."""
        lengths = array("I")
        lengths.frombytes(self.records_file(shard).read_bytes())
        if sys.byteorder == "big":
            lengths.byteswap()
        return lengths.tolist()

    def check_kind(self, kind: str, train_type: str, tokenizer_hint: str = "--tokenizer MODEL") -> None:
        """Refuse data of another kind than ``kind``, which ``train_type`` trains on, naming the command that prepares
        the right one."""
        if self.kind == kind:
            return
        flag = "" if kind == KINDS[0] else f" --kind {kind}"
        raise DataError(
            f"data folder {self.root} holds {DATA_KINDS[self.kind].holds} (kind {self.kind}) but training.train_type "
            f"is {train_type}; prepare it with `python -m astrai.data prepare{flag} {tokenizer_hint} --out DIR FILE...`"
        )

    def fingerprint(self) -> str:
        """A digest of the manifest: two folders with the same one hold the same tokens in the same shards."""
        return hashlib.sha256((self.root / DATA_MANIFEST_FILE).read_bytes()).hexdigest()[:16]

    def num_windows(self, window_size: int) -> int:
        """Windows of ``window_size + 1`` tokens that fit inside the shards."""
        return sum(max(count - 1, 0) // window_size for count in self.shard_tokens)


@dataclass(frozen=True)
class WindowSplit:
    """Which windows train and which are held out for validation.

    With a ``period`` of k, the last window of every k consecutive ones is held out (none with 0):
    a fixed set, spread over the whole corpus, that depends on nothing but the window count and
    ``data.val_fraction``. A held-out window's targets are never a training window's targets
    (neighbouring windows share only one token, an input on one side).
    """

    num_windows: int
    period: int = 0

    @classmethod
    def from_fraction(cls, num_windows: int, val_fraction: float) -> WindowSplit:
        return cls(num_windows, 0 if val_fraction <= 0 else max(2, round(1 / val_fraction)))

    @property
    def num_val(self) -> int:
        return self.num_windows // self.period if self.period else 0

    @property
    def num_train(self) -> int:
        return self.num_windows - self.num_val

    def train_window(self, index: int) -> int:
        """The corpus window of training window ``index`` (0 <= index < num_train)."""
        if not self.period:
            return index
        per_block = self.period - 1
        return index // per_block * self.period + index % per_block

    def val_window(self, index: int) -> int:
        """The corpus window of held-out window ``index`` (0 <= index < num_val)."""
        return index * self.period + self.period - 1

    def eval_windows(self, limit: int) -> list[int]:
        """At most ``limit`` held-out corpus windows, evenly spread: the fixed validation set."""
        count = min(self.num_val, limit)
        return [self.val_window(i * self.num_val // count) for i in range(count)]


@dataclass(frozen=True)
class Packing:
    windows: list[list[tuple[int, int]]]
    """Each window: (sequence, tokens taken from it)."""
    truncated: int
    dropped: int
    unsupervised: int = 0
    """Sequences left out because the window would cut away every token the loss covers (long prompts)."""

    def __len__(self) -> int:
        return len(self.windows)


def _always(_sequence: int, _take: int) -> bool:
    return True


def pack(lengths: list[int], window: int, overlong: str, supervised=_always) -> Packing:
    """Sequences into windows of ``window`` predictions (L tokens take L - 1); overlong ones cut or left out.

    Best fit, longest first: each sequence goes into the open window it fills most tightly, or a new
    one. That leaves far less room unused at the ends of windows than filling them in file order (the
    training order is shuffled anyway). A function of the lengths alone, so every process and every
    resume computes the same windows; inside a window the sequences keep their file order.
    """
    takes: list[tuple[int, int]] = []
    truncated = dropped = unsupervised = 0
    for index, length in enumerate(lengths):
        if length < 2:
            dropped += 1  # nothing to predict
            continue
        take = length
        if length - 1 > window:
            if overlong == "drop":
                dropped += 1
                continue
            if not supervised(index, window + 1):
                unsupervised += 1  # the cut keeps only the prompt: it would train on nothing
                continue
            take, truncated = window + 1, truncated + 1
        takes.append((index, take))
    takes.sort(key=lambda item: (-item[1], item[0]))
    windows: list[list[tuple[int, int]]] = []
    # by_room[r]: the windows with r predictions of room left; most: the largest r with a window.
    by_room: list[list[int]] = [[] for _ in range(window + 1)]
    most = -1
    for index, take in takes:
        need = take - 1
        room = need
        while room <= most and not by_room[room]:
            room += 1
        if room > most:
            windows.append([])
            number, room = len(windows) - 1, window
        else:
            number = by_room[room].pop()
        windows[number].append((index, take))
        left = room - need
        by_room[left].append(number)
        most = max(most, left)
        while most >= 0 and not by_room[most]:
            most -= 1
    for sequences in windows:
        sequences.sort()
    windows.sort()
    return Packing(windows, truncated, dropped, unsupervised)


@dataclass(frozen=True)
class Pairs:
    pairs: list[tuple[int, int, int]]
    """Each pair: (chosen sequence, rejected sequence, tokens taken from each at most)."""
    truncated: int
    dropped: int
    unsupervised: int = 0
    """Pairs left out because the window would cut away every token the loss covers in one of their answers."""

    def __len__(self) -> int:
        return len(self.pairs)


def pair_up(lengths: list[int], window: int, overlong: str, supervised=_always) -> Pairs:
    """Consecutive sequences (chosen, rejected) as pairs that fit a window (cut to it, or left out)."""
    pairs, truncated, dropped, unsupervised = [], 0, 0, 0
    for chosen in range(0, len(lengths) - 1, 2):
        longest = max(lengths[chosen], lengths[chosen + 1])
        take = longest
        if longest - 1 > window:
            if overlong == "drop":
                dropped += 1
                continue
            take = window + 1
            if not (
                supervised(chosen, min(take, lengths[chosen]))
                and supervised(chosen + 1, min(take, lengths[chosen + 1]))
            ):
                unsupervised += 1
                continue
            truncated += 1
        pairs.append((chosen, chosen + 1, take))
    return Pairs(pairs, truncated, dropped, unsupervised)


@dataclass(frozen=True)
class Examples:
    """KTO's examples that fit a window: each one's sequence and the tokens taken from it, and its label."""

    examples: list[tuple[int, int]]
    """Each example: (sequence, tokens taken from it)."""
    labels: list[bool]
    """Each example's label (True: desirable), in the order of ``examples``."""
    truncated: int
    dropped: int
    unsupervised: int = 0
    """Examples left out because the window would cut away every token of their completion."""

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def desirable(self) -> int:
        return sum(self.labels)


def one_by_one(lengths: list[int], labels: list[bool], window: int, overlong: str, supervised=_always) -> Examples:
    """Each sequence as an example of at most ``window + 1`` tokens (cut to it, or left out), with its label."""
    examples, kept, truncated, dropped, unsupervised = [], [], 0, 0, 0
    for sequence, (length, label) in enumerate(zip(lengths, labels, strict=True)):
        take = length
        if length - 1 > window:
            if overlong == "drop":
                dropped += 1
                continue
            take = window + 1
            if not supervised(sequence, take):
                unsupervised += 1
                continue
            truncated += 1
        examples.append((sequence, take))
        kept.append(label)
    return Examples(examples, kept, truncated, dropped, unsupervised)


@dataclass(frozen=True)
class PromptUnits:
    """The prompts a run samples from: each kept prompt's record number and the tokens it keeps (its last ones)."""

    records: list[int]
    takes: list[int]
    truncated: int
    dropped: int

    def __len__(self) -> int:
        return len(self.records)


def prompt_units(lengths: list[int], limit: int, overlong: str) -> PromptUnits:
    """Prompts longer than ``limit`` tokens keep their last ``limit`` (truncate, as TRL cuts prompts on the left)
    or are left out (drop)."""
    records, takes = [], []
    truncated = dropped = 0
    for number, length in enumerate(lengths):
        if length > limit:
            if overlong == "drop":
                dropped += 1
                continue
            truncated += 1
        records.append(number)
        takes.append(min(length, limit))
    return PromptUnits(records, takes, truncated, dropped)


def _supervised_units(
    data: TokenData, window: int, overlong: str, pairs: bool, labels: list[bool] | None = None
) -> Packing | Pairs | Examples:
    """What a post-training folder trains on at ``window``: SFT sequences packed into windows, DPO pairs, or (with
    ``labels``) KTO's examples one by one.

    A record the window would cut to its prompt alone is left out (it would train on nothing); when that
    leaves nothing, or leaves out most records, it is a DataError saying what window they need.
    """
    per_shard = [data.sequence_lengths(shard) for shard in range(len(data.shard_files))]
    lengths = [length for shard in per_shard for length in shard]
    with _Masks(data, per_shard) as masks:
        if labels is not None:
            units = one_by_one(lengths, labels, window, overlong, masks.supervised)
            records = len(lengths)
        elif not pairs:
            units = pack(lengths, window, overlong, masks.supervised)
            records = len(lengths)
        else:
            units = pair_up(lengths, window, overlong, masks.supervised)
            records = len(lengths) // 2
        if units.unsupervised and (not len(units) or 2 * units.unsupervised > records):
            what = "pairs" if pairs else "records"
            raise DataError(
                f"{data.root}: data.window_size {window} cuts {units.unsupervised:,} of {records:,} {what} before "
                f"their first supervised token (their prompts are longer than the window): they would train on "
                f"nothing; raise data.window_size above {masks.latest_start:,} (where the latest of their first "
                f"supervised tokens is), or leave such records out of the data"
            )
    return units


class _Masks:
    """The supervision masks of a post-training folder, mapped: does a sequence's start hold a supervised target?"""

    def __init__(self, data: TokenData, per_shard: list[list[int]]):
        self.data = data
        self.starts: list[tuple[int, int]] = []
        for shard, lengths in enumerate(per_shard):
            position = 0
            for length in lengths:
                self.starts.append((shard, position))
                position += length
        self._maps: dict[int, mmap.mmap] = {}
        self.latest_start = 0
        """The latest position of a first supervised token among the sequences asked about."""

    def supervised(self, sequence: int, take: int) -> bool:
        """Whether the first ``take`` tokens of ``sequence`` hold a supervised target (positions 1..take-1)."""
        shard, start = self.starts[sequence]
        if shard not in self._maps:
            with open(self.data.mask_file(shard), "rb") as handle:
                self._maps[shard] = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        found = self._maps[shard].find(b"\x01", start + 1, start + take)
        if found < 0:
            first = self._maps[shard].find(b"\x01", start + 1)
            self.latest_start = max(self.latest_start, first - start)
        return found >= 0

    def __enter__(self) -> _Masks:
        return self

    def __exit__(self, *_) -> None:
        for mapped in self._maps.values():
            mapped.close()


def describe_units(units: Packing | Pairs | Examples, sequences: int, window: int, overlong: str) -> str:
    """One line: the sequences, what they became, and how many were longer than the window."""
    if isinstance(units, Examples):
        made = f"{len(units):,} examples ({units.desirable:,} desirable, {len(units) - units.desirable:,} undesirable)"
    else:
        made = f"{len(units):,} windows of {window}" if isinstance(units, Packing) else f"{len(units):,} pairs"
    what = f"{units.truncated:,} cut to the window" if overlong == "truncate" else f"{units.dropped:,} left out"
    if units.unsupervised:
        what += f", {units.unsupervised:,} left out as the cut keeps no supervised token"
    return f"{sequences:,} sequences as {made}; longer than the window: {what} (data.overlong: {overlong})"


def tokenizer_digest(path: Path) -> str:
    """SHA-256 of which token means what in a ``tokenizer.json``: the model's type, vocabulary and merges (as
    "a b" or ["a", "b"]), its byte fallback and unknown token, and the added tokens. The normalizer and
    pre-tokenizer are left out: library versions write their defaults differently, and two tokenizers that share
    a vocabulary and merges are one tokenizer's versions."""
    try:
        saved = json.loads(Path(path).read_text(encoding="utf-8"))
        model = saved.get("model") or {}
        merges = [merge.split(" ") if isinstance(merge, str) else list(merge) for merge in model.get("merges") or []]
        meaning = {
            "model": [model.get(key) for key in ("type", "vocab", "byte_fallback", "unk_token")] + [merges],
            "added": sorted(
                (token["id"], token["content"], bool(token.get("special"))) for token in saved.get("added_tokens") or []
            ),
        }
    except (OSError, ValueError, AttributeError, KeyError, TypeError) as error:
        raise DataError(f"{path}: not a readable tokenizer.json ({error})") from None
    return hashlib.sha256(json.dumps(meaning, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def data_digest(datas: list[TokenData]) -> str:
    """Which prepared data a run trains on: the fingerprints of its data folders (each one's manifest, which lists
    every source's SHA-256), the same for the same data, another when a folder was prepared again."""
    return ",".join(data.fingerprint() for data in datas)
