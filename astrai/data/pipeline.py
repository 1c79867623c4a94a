"""Tokenize text into a data folder, byte by byte or with a model's own tokenizer. No torch needed.

    python -m astrai.data prepare --out data examples/corpus/*.txt
    python -m astrai.data prepare --tokenizer models/SmolLM2-135M --out data corpus/*.txt

With ``--tokenizer`` (a Hugging Face ``tokenizers`` ``tokenizer.json``, or a model
folder holding one) the tokenizer's files are copied into the data folder, and
the trainer copies them into every checkpoint, so a checkpoint is a complete
model folder. The folder's format is described in :mod:`astrai.common.data_folder`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from array import array
from pathlib import Path

from astrai.common.contract import DATA_MANIFEST_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, TOKENIZER_FILES
from astrai.common.data_folder import DTYPES, FORMAT, SHARD_PATTERN, DataError

# 2**27 tokens = 256 MiB per uint16 shard: large enough to keep the file count low, small enough to copy around.
DEFAULT_SHARD_TOKENS = 2**27
_READ_CHUNK = 1 << 22
# Text handed to the tokenizer per piece, and pieces per batch: big enough for its threads, small enough for RAM.
_TEXT_CHUNK = 1 << 20
_TEXT_BATCH = 16
_UINT32 = next(code for code in "IL" if array(code).itemsize == 4)
# End-of-text tokens in common use, tried when neither tokenizer_config.json nor --eos names one.
WELL_KNOWN_END_OF_TEXT = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


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


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer (``tokenizer.json``) and the end-of-text token that separates documents.

    The end-of-text token is ``tokenizer_config.json``'s ``eos_token`` when the folder has one, else ``eos``
    (``--eos``), else the one well-known end-of-text special token the tokenizer has.
    """

    name = "tokenizers"

    def __init__(self, path: Path, eos: str | None = None):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError("--tokenizer needs the tokenizers package: pip install 'astrai-train[train]'") from None
        path = Path(path)
        self.file = path / TOKENIZER_FILE if path.is_dir() else path
        if not self.file.is_file():
            where = f"{path} holds no {TOKENIZER_FILE}" if path.is_dir() else f"{path} does not exist"
            raise DataError(f"--tokenizer: {where}; give a tokenizer.json or a model folder holding one")
        raw = self.file.read_bytes()
        try:
            self.tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as error:  # the Rust library raises plain Exception for any parse problem
            raise DataError(f"{self.file}: not a tokenizers tokenizer.json ({error})") from None
        self.sha256 = hashlib.sha256(raw).hexdigest()
        # Ids may have gaps; what matters for the model is the largest one.
        self.vocab_size = max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        self.special_tokens = {
            token.content: index for index, token in self.tokenizer.get_added_tokens_decoder().items() if token.special
        }
        # The folder's other tokenizer files travel with it (a lone tokenizer.json has none).
        self.files = [self.file] + [
            self.file.parent / name
            for name in TOKENIZER_FILES[1:]
            if path.is_dir() and (self.file.parent / name).is_file()
        ]
        self.end_of_text_token = self._pick_end_of_text(eos)
        self.end_of_text = self.tokenizer.token_to_id(self.end_of_text_token)

    def _pick_end_of_text(self, eos: str | None) -> str:
        config_path = self.file.parent / TOKENIZER_CONFIG_FILE
        if self.file.name == TOKENIZER_FILE and config_path.is_file():
            try:
                token = json.loads(config_path.read_text(encoding="utf-8")).get("eos_token")
            except (OSError, ValueError, AttributeError) as error:
                raise DataError(f"{config_path}: unreadable ({error})") from None
            if isinstance(token, dict):
                token = token.get("content")
            if token:
                if eos is not None and eos != token:
                    print(f"note: using {config_path.name}'s eos_token {token!r}, not --eos {eos!r}", file=sys.stderr)
                return self._known(token, f"{config_path}: eos_token")
        if eos is not None:
            return self._known(eos, "--eos")
        found = [token for token in WELL_KNOWN_END_OF_TEXT if token in self.special_tokens]
        if len(found) == 1:
            return found[0]
        listed = ", ".join(sorted(self.special_tokens)) or "none"
        why = (
            f"it has several end-of-text candidates ({', '.join(found)})"
            if found
            else f"it has none of the usual end-of-text tokens ({', '.join(WELL_KNOWN_END_OF_TEXT)})"
        )
        raise DataError(
            f"{self.file}: cannot tell which token ends a document: {why}; pass --eos TOKEN, "
            f"one of its special tokens: {listed}"
        )

    def _known(self, token: str, what: str) -> str:
        if self.tokenizer.token_to_id(token) is None:
            raise DataError(f"{what} {token!r} is not in the vocabulary of {self.file}")
        return token

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, encoded in parallel by the library, without special tokens added."""
        return [encoding.ids for encoding in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]


TOKENIZER = ByteTokenizer()


def prepare(
    out_dir: Path, files: list[Path], shard_tokens: int = DEFAULT_SHARD_TOKENS, tokenizer: HFTokenizer | None = None
) -> dict:
    """Tokenize ``files`` (each followed by an end-of-text token) into shards in ``out_dir``; returns the manifest.

    Files are streamed in chunks, so their size is not limited by RAM. Without ``tokenizer`` the text
    is tokenized byte by byte; with one, in batches of text pieces cut at line ends.
    """
    if shard_tokens < 2:
        raise DataError(f"shard_tokens must be at least 2, got {shard_tokens}")
    for path in files:
        if not Path(path).is_file():
            raise DataError(f"{path}: not a file")
    vocab_size = tokenizer.vocab_size if tokenizer is not None else TOKENIZER.vocab_size
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    # Everything is written to a staging folder first: a failure or an interrupt leaves an earlier data set in
    # out_dir as it was, and a trainer reading it keeps its mapped shards (they are replaced, not rewritten).
    staging = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out_dir))
    try:
        manifest = _prepare_into(staging, files, shard_tokens, tokenizer, vocab_size)
        _publish(staging, out_dir, manifest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    shutil.rmtree(staging, ignore_errors=True)
    return manifest


def _prepare_into(out_dir: Path, files: list[Path], shard_tokens: int, tokenizer, vocab_size: int) -> dict:
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    width = DTYPES[dtype]
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
            piece, encoded = encoded[: width * room], encoded[width * room :]
            writer.write(piece)
            shards[-1]["num_tokens"] += len(piece) // width

    try:
        if tokenizer is None:
            end_of_text = TOKENIZER.end_of_text.to_bytes(2, "little")
            for path in files:
                with open(path, "rb") as handle:
                    while chunk := handle.read(_READ_CHUNK):
                        write(TOKENIZER.encode_bytes_uint16le(chunk))
                write(end_of_text)
        else:
            _tokenize_with(tokenizer, files, "H" if width == 2 else _UINT32, write)
    finally:
        if writer is not None:
            writer.close()
    total = sum(shard["num_tokens"] for shard in shards)
    if total == len(files):
        raise DataError("the input files are empty: nothing to train on")
    copied = _copy_tokenizer_files(tokenizer, out_dir)
    manifest = {
        "format": FORMAT,
        "version": 1,
        "tokenizer": TOKENIZER.name if tokenizer is None else tokenizer.name,
        "vocab_size": vocab_size,
        "end_of_text": TOKENIZER.end_of_text if tokenizer is None else tokenizer.end_of_text,
        "dtype": dtype,
        "byte_order": "little",
        "num_tokens": total,
        "shards": shards,
        "sources": [Path(path).name for path in files],
    }
    if tokenizer is not None:
        manifest.update(
            end_of_text_token=tokenizer.end_of_text_token,
            special_tokens=tokenizer.special_tokens,
            tokenizer_sha256=tokenizer.sha256,
            tokenizer_files=copied,
        )
    return manifest


def _publish(staging: Path, out_dir: Path, manifest: dict) -> None:
    """Move a prepared data set from ``staging`` into ``out_dir``, the manifest last.

    From the first shard moved until the new manifest is in place, out_dir has no manifest and reads as
    not prepared; shards and tokenizer files of an earlier data set that the new one does not have go.
    """
    names = [shard["file"] for shard in manifest["shards"]] + list(manifest.get("tokenizer_files", []))
    (out_dir / DATA_MANIFEST_FILE).unlink(missing_ok=True)
    for name in names:
        os.replace(staging / name, out_dir / name)
    for stale in sorted(out_dir.glob("shard_*.bin")):
        if stale.name not in names:
            stale.unlink()
    for name in TOKENIZER_FILES:
        if name not in names:
            (out_dir / name).unlink(missing_ok=True)
    tmp = staging / DATA_MANIFEST_FILE
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, out_dir / DATA_MANIFEST_FILE)


def _tokenize_with(tokenizer: HFTokenizer, files: list[Path], typecode: str, write) -> None:
    """Encode files in batches of text pieces; each file ends with the end-of-text token."""
    pending: list[str | None] = []  # text pieces, None where a file ends

    def flush() -> None:
        texts = [piece for piece in pending if piece is not None]
        encoded = iter(tokenizer.encode_batch(texts))
        ids = array(typecode)
        for piece in pending:
            ids.extend(next(encoded) if piece is not None else (tokenizer.end_of_text,))
        if sys.byteorder == "big":
            ids.byteswap()
        write(ids.tobytes())
        pending.clear()

    for path in files:
        # newline="" keeps the text as written (no \r\n translation), so tokens match the file.
        with open(path, encoding="utf-8", newline="") as handle:
            try:
                # Pieces end at a line end, where tokenizers split words anyway.
                while piece := handle.read(_TEXT_CHUNK) + handle.readline():
                    pending.append(piece)
                    if len(pending) >= _TEXT_BATCH:
                        flush()
            except UnicodeDecodeError as error:
                raise DataError(f"{path}: not UTF-8 text ({error.reason}); --tokenizer reads text files") from None
        pending.append(None)
    flush()


def _copy_tokenizer_files(tokenizer: HFTokenizer | None, out_dir: Path) -> list[str]:
    """Put the tokenizer's files in the (staging) data folder; returns their names."""
    names = []
    if tokenizer is not None:
        for source in tokenizer.files:
            name = TOKENIZER_FILE if source == tokenizer.file else source.name
            shutil.copyfile(source, out_dir / name)
            names.append(name)
        if TOKENIZER_CONFIG_FILE not in names:
            # Without one, transformers' AutoTokenizer cannot load a checkpoint's tokenizer.json.
            config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tokenizer.end_of_text_token}
            (out_dir / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
            names.append(TOKENIZER_CONFIG_FILE)
    return sorted(names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m astrai.data", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="tokenize text files into a data folder (manifest.json + shards)")
    prep.add_argument("--out", type=Path, required=True, help="data folder to write")
    prep.add_argument("--shard_tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file")
    prep.add_argument(
        "--tokenizer",
        type=Path,
        metavar="PATH",
        help="a Hugging Face tokenizers tokenizer.json, or a model folder holding one (default: bytes)",
    )
    prep.add_argument(
        "--eos",
        metavar="TOKEN",
        help="end-of-text token between files, when the tokenizer folder's tokenizer_config.json names none",
    )
    prep.add_argument("files", type=Path, nargs="+", metavar="FILE", help="text files (UTF-8)")
    args = parser.parse_args(argv)
    try:
        if args.eos is not None and args.tokenizer is None:
            raise DataError("--eos needs --tokenizer (the byte tokenizer's end-of-text token is fixed)")
        tokenizer = HFTokenizer(args.tokenizer, args.eos) if args.tokenizer is not None else None
        manifest = prepare(args.out, args.files, args.shard_tokens, tokenizer)
    except DataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(
        f"wrote {manifest['num_tokens']} tokens from {len(args.files)} file(s) in {len(manifest['shards'])} shard(s) "
        f"to {args.out} (tokenizer {manifest['tokenizer']}, vocab {manifest['vocab_size']}, {manifest['dtype']}, "
        f"end of text {manifest.get('end_of_text_token', manifest['end_of_text'])!r})"
    )
    return 0
