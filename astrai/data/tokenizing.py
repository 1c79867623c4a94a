"""The tokenizers `prepare` uses: bytes (the default, nothing to download) or a model's own ``tokenizer.json``.

Both turn a batch of texts into token ids as the little-endian bytes of the shard
dtype (uint16 when the vocabulary fits, else uint32), ready to be written.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from pathlib import Path

from astrai.common.contract import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, TOKENIZER_FILES
from astrai.common.data_folder import DataError

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

    def encode_batch(self, texts: list[str]) -> list[bytes]:
        """Each text's token ids as little-endian uint16 bytes."""
        return [self.encode_bytes_uint16le(text.encode("utf-8")) for text in texts]

    def ids(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def spec(self) -> tuple:
        """What a worker process needs to make the same tokenizer."""
        return ("byte",)


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

    def encode_batch(self, texts: list[str]) -> list[bytes]:
        """Each text's token ids, without special tokens added, as little-endian bytes of the shard dtype."""
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        out = []
        for encoding in encodings:
            ids = array(self.typecode, encoding.ids)
            if sys.byteorder == "big":
                ids.byteswap()
            out.append(ids.tobytes())
        return out

    def ids(self, texts: list[str]) -> list[list[int]]:
        """Each text's token ids, without special tokens added."""
        return [encoding.ids for encoding in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def ids_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The token ids of ``text`` and each token's (start, end) in its characters."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    @property
    def typecode(self) -> str:
        """The array typecode of the shard dtype this vocabulary needs."""
        return "H" if self.vocab_size <= 1 << 16 else _UINT32

    def spec(self) -> tuple:
        """What a worker process needs to make the same tokenizer."""
        return ("tokenizers", str(self.file), self.end_of_text_token)


def from_spec(spec: tuple) -> ByteTokenizer | HFTokenizer:
    """The tokenizer ``spec()`` described (in a worker process)."""
    if spec[0] == "byte":
        return ByteTokenizer()
    return HFTokenizer(Path(spec[1]), spec[2])


def copy_tokenizer_files(tokenizer: HFTokenizer | None, out_dir: Path) -> list[str]:
    """Put the tokenizer's files in the (staging) data folder; returns their names."""
    import shutil

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
