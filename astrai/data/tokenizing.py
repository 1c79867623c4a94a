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

from astrai.common.contract import (
    CHAT_TEMPLATE_FILE,
    SPECIAL_TOKENS_MAP_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    TOKENIZER_FILES,
)
from astrai.common.data_folder import DataError, token_dtype

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


def tokenizer_settings(folder: Path) -> dict:
    """A tokenizer folder's settings as transformers reads them: ``tokenizer_config.json``, and where that file
    has no ``added_tokens_decoder`` (an older folder), ``special_tokens_map.json``'s tokens over its own."""
    config = _json_object(Path(folder) / TOKENIZER_CONFIG_FILE)
    if "added_tokens_decoder" not in config:
        for key, value in _json_object(Path(folder) / SPECIAL_TOKENS_MAP_FILE).items():
            config[key] = value
    return config


def token_text(value) -> str | None:
    """A special token's text, whether written as a string or as an AddedToken object."""
    text = value.get("content") if isinstance(value, dict) else value
    return text if isinstance(text, str) and text else None


def _json_object(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise DataError(f"{path}: unreadable ({error})") from None
    return value if isinstance(value, dict) else {}


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer (``tokenizer.json``) and the end-of-text token that separates documents.

    The end-of-text token is ``eos`` (``--eos``) when given, else the folder's ``eos_token`` (from
    ``tokenizer_config.json`` or ``special_tokens_map.json``, as transformers reads them), else the one
    well-known end-of-text special token the tokenizer has. The truncation and padding a ``tokenizer.json``
    may have saved are turned off: a document is always encoded whole.
    """

    name = "tokenizers"

    def __init__(self, path: Path, eos: str | None = None, chat_template: Path | None = None, ends: str = "a document"):
        """``ends``: what the end-of-text token ends where this tokenizer is used (a document in ``prepare``, a
        completion in ``generate``), as messages say it."""
        self.ends = ends
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
        # A saved "truncation": {"max_length": 50} would otherwise cut every document to 50 tokens, silently.
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.sha256 = hashlib.sha256(raw).hexdigest()
        # Ids may have gaps; what matters for the model is the largest one.
        self.vocab_size = max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        added = self.tokenizer.get_added_tokens_decoder()
        self.special_tokens = {token.content: index for index, token in added.items() if token.special}
        self.added_ids = frozenset(added)
        """Ids of every added token (special or not): the tokens a chat template's markers become."""
        self.chat_template_file = None if chat_template is None else Path(chat_template)
        """A chat template that replaces the folder's (``prepare --chat_template FILE``)."""
        if self.chat_template_file is not None and not self.chat_template_file.is_file():
            raise DataError(f"--chat_template {chat_template}: no such file; give a Jinja chat template file")
        # The folder's other tokenizer files travel with it (a lone tokenizer.json has none), a given chat template
        # in place of the folder's chat_template.jinja.
        self.files = [self.file] + [
            self.file.parent / name
            for name in TOKENIZER_FILES[1:]
            if path.is_dir()
            and (self.file.parent / name).is_file()
            and (name != CHAT_TEMPLATE_FILE or self.chat_template_file is None)
        ]
        if self.chat_template_file is not None:
            self.files.append(self.chat_template_file)
        self.end_of_text_token = self._pick_end_of_text(eos)
        self.end_of_text = self.tokenizer.token_to_id(self.end_of_text_token)

    def _pick_end_of_text(self, eos: str | None) -> str:
        if eos is not None:
            if eos not in self.special_tokens and self.tokenizer.token_to_id(eos) not in self.added_ids:
                listed = ", ".join(sorted(self.special_tokens)) or "none"
                raise DataError(
                    f"--eos {eos!r} is not one of the special tokens of {self.file}: an ordinary token would "
                    f"also end {self.ends} wherever the text holds it; choose one of: {listed}"
                )
            return eos
        settings = tokenizer_settings(self.file.parent) if self.file.name == TOKENIZER_FILE else {}
        token = token_text(settings.get("eos_token"))
        if token:
            return self._known(token, f"{self.file.parent}: eos_token")
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
            f"{self.file}: cannot tell which token ends {self.ends}: {why}; pass --eos TOKEN, "
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

    def decode(self, ids: list[int]) -> str:
        """The text of token ids, special tokens left out (what a model's reply reads as)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def ids_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The token ids of ``text`` and each token's (start, end) in its characters."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def encode_window(self, text: str, low: int, high: int) -> bytes:
        """The ids of the tokens of ``text`` that start in characters ``[low, high)``, as shard bytes.

        A long document is encoded window by window, each with some text of its neighbours on both sides
        (``text[:low]`` and ``text[high:]``): a token near a cut is then the token the whole document gives,
        and the windows' tokens put together are ``encode`` of the whole document.

        The window is encoded without character offsets (``encode_batch_fast``, as records are): with an
        offset for every token and a Python pass over them, a 1 MiB window took 1.9 times as long. Only two
        short stretches around the cuts are encoded with offsets, to count the window's tokens that start
        before ``low`` and from ``high`` on; each stretch has as much text on either side of its cut as the
        window has beyond that cut, so its tokens near the cut are the window's (and the document's).
        """
        ids = self.tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
        before = self._split_at(text[: 2 * low], low)[0] if low else 0
        start = max(0, 2 * high - len(text))  # the stretch around ``high`` ends where the window ends
        after = self._split_at(text[start:], high - start)[1] if high < len(text) else 0
        kept = array(self.typecode, ids[before : len(ids) - after])
        if sys.byteorder == "big":
            kept.byteswap()
        return kept.tobytes()

    def _split_at(self, text: str, cut: int) -> tuple[int, int]:
        """How many tokens of ``text`` start before character ``cut``, and how many from it on."""
        offsets = self.tokenizer.encode(text, add_special_tokens=False).offsets
        before = sum(1 for begin, _ in offsets if begin < cut)
        return before, len(offsets) - before

    @property
    def typecode(self) -> str:
        """The array typecode of the shard dtype this vocabulary needs."""
        return "H" if token_dtype(self.vocab_size) == "uint16" else _UINT32

    def spec(self) -> tuple:
        """What a worker process needs to make the same tokenizer."""
        template = None if self.chat_template_file is None else str(self.chat_template_file)
        return ("tokenizers", str(self.file), self.end_of_text_token, template)


def from_spec(spec: tuple) -> ByteTokenizer | HFTokenizer:
    """The tokenizer ``spec()`` described (in a worker process)."""
    if spec[0] == "byte":
        return ByteTokenizer()
    return HFTokenizer(Path(spec[1]), spec[2], None if spec[3] is None else Path(spec[3]))


def copy_tokenizer_files(tokenizer: HFTokenizer | None, out_dir: Path) -> list[str]:
    """Put the tokenizer's files in the (staging) data folder; returns their names."""
    import shutil

    names = []
    if tokenizer is not None:
        for source in tokenizer.files:
            name = TOKENIZER_FILE if source == tokenizer.file else source.name
            if source == tokenizer.chat_template_file:
                name = CHAT_TEMPLATE_FILE  # the template the records were rendered with goes with them
            shutil.copyfile(source, out_dir / name)
            names.append(name)
        if TOKENIZER_CONFIG_FILE not in names:
            # Without one, transformers' AutoTokenizer cannot load a checkpoint's tokenizer.json.
            config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tokenizer.end_of_text_token}
            (out_dir / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
            names.append(TOKENIZER_CONFIG_FILE)
    return sorted(names)
