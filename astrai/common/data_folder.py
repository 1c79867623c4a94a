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

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from astrai.common.contract import DATA_MANIFEST_FILE, TOKENIZER_FILE
from astrai.common.errors import AstraiError

SHARD_PATTERN = "shard_{:05d}.bin"
FORMAT = "astrai-tokens"
# Token id width by shard dtype.
DTYPES = {"uint16": 2, "uint32": 4}


class DataError(AstraiError):
    """A data folder that cannot be trained on; the message says what to do."""


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
    tokenizer_files: tuple[str, ...] = ()
    """Tokenizer files in the folder, copied into every checkpoint."""
    end_of_text: int | None = None
    documents: int | None = None
    """Documents (records) it holds; None for folders prepared before prepare counted them."""
    source_files: int = 0

    @property
    def tokenizer_identity(self) -> tuple:
        """What must agree for two folders' token ids to mean the same text."""
        return (self.tokenizer, self.tokenizer_sha256, self.vocab_size, self.end_of_text)

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
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
            if manifest.get("format") != FORMAT or manifest.get("dtype") not in DTYPES:
                raise ValueError(f"expected format {FORMAT!r} with dtype {' or '.join(map(repr, DTYPES))}")
            shards = [(root / shard["file"], int(shard["num_tokens"])) for shard in manifest["shards"]]
            tokenizer_files = tuple(str(name) for name in manifest.get("tokenizer_files", ()))
            if any(Path(name).name != name for name in tokenizer_files):
                raise ValueError(f"tokenizer_files must be file names, got {list(tokenizer_files)}")
            data = cls(
                root=root,
                vocab_size=int(manifest["vocab_size"]),
                tokenizer=str(manifest["tokenizer"]),
                num_tokens=int(manifest["num_tokens"]),
                shard_files=tuple(path for path, _ in shards),
                shard_tokens=tuple(count for _, count in shards),
                dtype=manifest["dtype"],
                tokenizer_sha256=manifest.get("tokenizer_sha256"),
                tokenizer_files=tokenizer_files,
                end_of_text=manifest.get("end_of_text"),
                documents=manifest.get("documents"),
                source_files=len(manifest.get("sources", [])),
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise DataError(f"{manifest_path}: unreadable manifest ({error}); {how}") from None
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
