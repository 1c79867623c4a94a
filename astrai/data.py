"""Training data: a built-in byte tokenizer, token shards on disk, and deterministic window sampling.

Tokenize text files into a data folder::

    python -m astrai.data prepare --out data examples/corpus/*.txt

A data folder holds ``manifest.json`` and ``shard_NNNNN.bin`` files of raw
little-endian uint16 token ids. The manifest is written last, so a folder with a
manifest is complete. Shards are memory-mapped: reading never loads the corpus
into RAM.

Training reads windows of ``window_size + 1`` tokens (inputs plus the shifted
targets). Window ``i`` of a shard starts at token ``i * window_size``, so
neighbouring windows share one token and every token is used. The order of
windows in an epoch is a permutation drawn from ``(random_seed, epoch)`` only,
so the data position of a run is two integers: the epoch, and how many windows
of it were consumed.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset, Sampler

from astrai.contract import DATA_MANIFEST_FILE

SHARD_PATTERN = "shard_{:05d}.bin"
FORMAT = "astrai-tokens"
# 2**27 tokens = 256 MiB per uint16 shard: large enough to keep the file count low, small enough to copy around.
DEFAULT_SHARD_TOKENS = 2**27
_READ_CHUNK = 1 << 22


class DataError(Exception):
    """A data folder that cannot be trained on; the message says what to do."""


class ByteTokenizer:
    """UTF-8 bytes are the tokens 0..255; 256 marks the end of a document. Nothing to download."""

    name = "byte"
    end_of_text = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: list[int]) -> str:
        return bytes(i for i in tokens if i < 256).decode("utf-8", errors="replace")

    def encode_bytes_uint16le(self, data: bytes) -> bytes:
        """``data`` as little-endian uint16 token ids, the shard format (one zero high byte per token)."""
        out = bytearray(2 * len(data))
        out[0::2] = data
        return bytes(out)


TOKENIZER = ByteTokenizer()


def prepare(out_dir: Path, files: list[Path], shard_tokens: int = DEFAULT_SHARD_TOKENS) -> dict:
    """Tokenize ``files`` (each followed by an end-of-text token) into shards in ``out_dir``; returns the manifest.

    Files are streamed in chunks, so their size is not limited by RAM.
    """
    if shard_tokens < 2:
        raise DataError(f"shard_tokens must be at least 2, got {shard_tokens}")
    for path in files:
        if not Path(path).is_file():
            raise DataError(f"{path}: not a file")
    out_dir.mkdir(parents=True, exist_ok=True)
    # Without a manifest the folder reads as not prepared, so a crash below never leaves a half-written data set.
    (out_dir / DATA_MANIFEST_FILE).unlink(missing_ok=True)
    shards: list[dict] = []
    writer = None

    def write(encoded: bytes) -> None:
        nonlocal writer
        while encoded:
            if writer is None or shards[-1]["num_tokens"] == shard_tokens:
                if writer is not None:
                    writer.close()
                shards.append({"file": SHARD_PATTERN.format(len(shards)), "num_tokens": 0})
                writer = open(out_dir / shards[-1]["file"], "wb")
            room = shard_tokens - shards[-1]["num_tokens"]
            piece, encoded = encoded[: 2 * room], encoded[2 * room :]
            writer.write(piece)
            shards[-1]["num_tokens"] += len(piece) // 2

    end_of_text = TOKENIZER.end_of_text.to_bytes(2, "little")
    try:
        for path in files:
            with open(path, "rb") as handle:
                while chunk := handle.read(_READ_CHUNK):
                    write(TOKENIZER.encode_bytes_uint16le(chunk))
            write(end_of_text)
    finally:
        if writer is not None:
            writer.close()
    total = sum(shard["num_tokens"] for shard in shards)
    if total == len(files):
        raise DataError("the input files are empty: nothing to train on")
    for stale in sorted(out_dir.glob("shard_*.bin")):
        if stale.name not in {shard["file"] for shard in shards}:
            stale.unlink()
    manifest = {
        "format": FORMAT,
        "version": 1,
        "tokenizer": TOKENIZER.name,
        "vocab_size": TOKENIZER.vocab_size,
        "end_of_text": TOKENIZER.end_of_text,
        "dtype": "uint16",
        "byte_order": "little",
        "num_tokens": total,
        "shards": shards,
        "sources": [Path(path).name for path in files],
    }
    tmp = out_dir / f".{DATA_MANIFEST_FILE}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, out_dir / DATA_MANIFEST_FILE)
    return manifest


@dataclass(frozen=True)
class TokenData:
    """A prepared data folder, checked against its manifest; shards are mapped lazily, per process."""

    root: Path
    vocab_size: int
    tokenizer: str
    num_tokens: int
    shard_files: tuple[Path, ...]
    shard_tokens: tuple[int, ...]

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
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
            if manifest.get("format") != FORMAT or manifest.get("dtype") != "uint16":
                raise ValueError(f"expected format {FORMAT!r} with dtype 'uint16'")
            shards = [(root / shard["file"], int(shard["num_tokens"])) for shard in manifest["shards"]]
            data = cls(
                root=root,
                vocab_size=int(manifest["vocab_size"]),
                tokenizer=str(manifest["tokenizer"]),
                num_tokens=int(manifest["num_tokens"]),
                shard_files=tuple(path for path, _ in shards),
                shard_tokens=tuple(count for _, count in shards),
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise DataError(f"{manifest_path}: unreadable manifest ({error}); {how}") from None
        if data.num_tokens == 0 or not shards:
            raise DataError(f"data folder {root} holds no tokens; {how}")
        for path, count in shards:
            size = path.stat().st_size if path.is_file() else None
            if size != 2 * count:
                raise DataError(f"{path}: expected {2 * count} bytes ({count} tokens), found {size}; {how}")
        return data

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


class WindowDataset(Dataset):
    """Training window ``i`` as an int64 tensor of ``window_size + 1`` tokens (all windows without a split)."""

    def __init__(self, data: TokenData, window_size: int, split: WindowSplit | None = None):
        self.data = data
        self.window_size = window_size
        counts = [max(count - 1, 0) // window_size for count in data.shard_tokens]
        self.first_window = [sum(counts[:i]) for i in range(len(counts))]
        self.split = split or WindowSplit(sum(counts))
        # Mapped on first use in each process: DataLoader workers then map the files themselves.
        self._shards: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return self.split.num_train

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.window(self.split.train_window(index))

    def window(self, index: int) -> torch.Tensor:
        """Corpus window ``index``, training or held out."""
        if self._shards is None:
            # shared=False maps the file copy-on-write: read-only files work and pages load on demand.
            self._shards = [
                torch.from_file(str(path), shared=False, size=count, dtype=torch.uint16)
                for path, count in zip(self.data.shard_files, self.data.shard_tokens, strict=True)
            ]
        shard = bisect.bisect_right(self.first_window, index) - 1
        start = (index - self.first_window[shard]) * self.window_size
        return self._shards[shard][start : start + self.window_size + 1].to(torch.int64)


def epoch_permutation(num_windows: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of windows in ``epoch``: a function of (seed, epoch) alone."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_windows, generator=generator)


class WindowBatchSampler(Sampler[list[int]]):
    """Micro-batches of window indices for one rank, from a data position onwards.

    One optimizer step consumes ``global_batch = batch_size * grad_accum_steps * world_size``
    windows of the epoch's permutation. Rank ``r`` takes every ``world_size``-th
    of them starting at ``r``, so ranks never overlap, and after ``k`` steps from
    position ``p`` exactly ``perm[p : p + k * global_batch]`` has been used —
    whatever the world size, which keeps the position meaningful across restarts.
    Windows that do not fill a whole step at the end of an epoch are skipped.
    """

    def __init__(self, num_windows: int, batch_size: int, grad_accum_steps: int, rank: int, world_size: int, seed: int):
        self.num_windows = num_windows
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.global_batch = batch_size * grad_accum_steps * world_size
        self.epoch = 0
        self.start = 0

    def set_position(self, epoch: int, samples_in_epoch: int) -> None:
        """Start the next iteration at this position (``samples_in_epoch`` windows of ``epoch`` already used)."""
        self.epoch = epoch
        self.start = samples_in_epoch

    def steps_left(self) -> int:
        """Full optimizer steps left in the epoch from the current position."""
        return max(self.num_windows - self.start, 0) // self.global_batch

    def __len__(self) -> int:
        return self.steps_left() * self.global_batch // (self.batch_size * self.world_size)

    def __iter__(self):
        order = epoch_permutation(self.num_windows, self.seed, self.epoch)
        end = self.start + self.steps_left() * self.global_batch
        mine = order[self.start + self.rank : end : self.world_size].tolist()
        for i in range(0, len(mine), self.batch_size):
            yield mine[i : i + self.batch_size]


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: the main process handles SIGTERM/SIGINT and stops its workers itself."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m astrai.data", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="tokenize text files into a data folder (manifest.json + shards)")
    prep.add_argument("--out", type=Path, required=True, help="data folder to write")
    prep.add_argument("--shard_tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file")
    prep.add_argument("files", type=Path, nargs="+", metavar="FILE", help="text files, read as UTF-8 bytes")
    args = parser.parse_args(argv)
    try:
        manifest = prepare(args.out, args.files, args.shard_tokens)
    except DataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(
        f"wrote {manifest['num_tokens']} tokens from {len(args.files)} file(s) in {len(manifest['shards'])} shard(s) "
        f"to {args.out} (tokenizer {manifest['tokenizer']}, vocab {manifest['vocab_size']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
