"""`prepare --tokenizer`: a Hugging Face tokenizers tokenizer, its end-of-text token, shard widths, the manifest."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from conftest import CORPUS_FILES
from hf_folders import make_tokenizer
from tokenizers import Tokenizer, models, pre_tokenizers

from astrai.common.data_folder import TokenData
from astrai.data import pipeline as data_module
from astrai.trainer.feed.windows import WindowDataset


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    texts = [path.read_text() for path in CORPUS_FILES]
    return make_tokenizer(tmp_path_factory.mktemp("tok"), texts, special=("<|endoftext|>", "<pad>"))


def _tokens(folder) -> list[int]:
    manifest = json.loads((folder / "manifest.json").read_text())
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    return np.concatenate([np.fromfile(folder / s["file"], dtype=dtype) for s in manifest["shards"]]).tolist()


def test_prepare_with_a_tokenizer_folder_writes_its_tokens_and_records_it(tmp_path, tokenizer_dir, capsys):
    out = tmp_path / "data"
    assert (
        data_module.main(
            [
                "prepare",
                "--tokenizer",
                str(tokenizer_dir),
                "--shard_tokens",
                "1000",
                "--out",
                str(out),
                *map(str, CORPUS_FILES),
            ]
        )
        == 0
    )
    assert "end of text '<|endoftext|>'" in capsys.readouterr().out
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    expected = []
    for path in CORPUS_FILES:
        expected += tokenizer.encode(path.read_text(), add_special_tokens=False).ids + [eos]
    assert _tokens(out) == expected
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer"] == "tokenizers" and manifest["dtype"] == "uint16"
    assert manifest["vocab_size"] == tokenizer.get_vocab_size() and manifest["end_of_text"] == eos
    assert manifest["special_tokens"] == {"<|endoftext|>": eos, "<pad>": tokenizer.token_to_id("<pad>")}
    assert manifest["tokenizer_sha256"] == hashlib.sha256((tokenizer_dir / "tokenizer.json").read_bytes()).hexdigest()
    assert len(manifest["shards"]) > 1
    # The tokenizer travels with the data (and from there into every checkpoint).
    assert manifest["tokenizer_files"] == ["tokenizer.json", "tokenizer_config.json"]
    assert (out / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    opened = TokenData.open(out)
    window = WindowDataset(opened, 16)[0]
    assert window.tolist() == expected[:17]

    # Prepared again byte by byte, the folder holds no stale tokenizer.
    data_module.main(["prepare", "--out", str(out), str(CORPUS_FILES[0])])
    assert not (out / "tokenizer.json").exists() and TokenData.open(out).tokenizer_files == ()


def test_end_of_text_token_rules(tmp_path, tokenizer_dir):
    texts = [CORPUS_FILES[0].read_text()]
    # --eos first, over tokenizer_config.json's eos_token (an instruct model's eos is often its end of turn,
    # while its documents were separated by another token) ...
    folder = make_tokenizer(tmp_path / "a", texts, special=("<s>", "</s>", "<|endoftext|>"), eos_in_config="</s>")
    assert data_module.HFTokenizer(folder, eos="<|endoftext|>").end_of_text_token == "<|endoftext|>"
    # ... then tokenizer_config.json's eos_token ...
    assert data_module.HFTokenizer(folder).end_of_text_token == "</s>"
    # ... overridden by special_tokens_map.json where transformers reads that file (no added_tokens_decoder) ...
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    assert data_module.HFTokenizer(folder).end_of_text_token == "<|endoftext|>"
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "added_tokens_decoder": {}}))
    assert data_module.HFTokenizer(folder).end_of_text_token == "</s>"
    (folder / "special_tokens_map.json").unlink()
    # ... as an AddedToken object too ...
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<s>", "special": True}}))
    assert data_module.HFTokenizer(folder).end_of_text_token == "<s>"
    # ... else --eos ...
    (folder / "tokenizer_config.json").unlink()
    assert data_module.HFTokenizer(folder, eos="<s>").end_of_text_token == "<s>"
    # ... else the one well-known end-of-text token it has; two of them are ambiguous.
    with pytest.raises(
        data_module.DataError,
        match=r"several end-of-text candidates \(<\|endoftext\|>, </s>\); "
        r"pass --eos TOKEN, one of its special tokens: </s>, <s>, <\|endo",
    ):
        data_module.HFTokenizer(folder)
    assert data_module.HFTokenizer(tokenizer_dir / "tokenizer.json").end_of_text_token == "<|endoftext|>"
    plain = make_tokenizer(tmp_path / "b", texts, special=("<unk>",))
    with pytest.raises(data_module.DataError, match=r"none of the usual .*special tokens: <unk>"):
        data_module.HFTokenizer(plain)
    with pytest.raises(data_module.DataError, match=r"--eos '<end>' is not one of the special tokens .*: <unk>"):
        data_module.HFTokenizer(plain, eos="<end>")
    # An ordinary token would end a document wherever the text holds it.
    ordinary = next(
        token
        for token in json.loads((plain / "tokenizer.json").read_text())["model"]["vocab"]
        if len(token) > 2 and token.isalpha()
    )
    with pytest.raises(data_module.DataError, match=rf"--eos '{ordinary}' is not one of the special tokens"):
        data_module.HFTokenizer(plain, eos=ordinary)


def test_bad_tokenizer_paths_and_text_are_refused_clearly(tmp_path, tokenizer_dir, capsys):
    corpus = str(CORPUS_FILES[0])
    assert data_module.main(["prepare", "--tokenizer", str(tmp_path), "--out", str(tmp_path / "o"), corpus]) == 1
    assert "holds no tokenizer.json" in capsys.readouterr().err
    (tmp_path / "broken.json").write_text("{}")
    assert (
        data_module.main(
            ["prepare", "--tokenizer", str(tmp_path / "broken.json"), "--out", str(tmp_path / "o"), corpus]
        )
        == 1
    )
    assert "not a tokenizers tokenizer.json" in capsys.readouterr().err
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    assert (
        data_module.main(
            ["prepare", "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "o"), str(tmp_path / "latin1.txt")]
        )
        == 1
    )
    assert "latin1.txt: not UTF-8 text" in capsys.readouterr().err
    assert data_module.main(["prepare", "--eos", "</s>", "--out", str(tmp_path / "o"), corpus]) == 1
    assert "--eos needs --tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "o" / "manifest.json").exists()


def _word_level_tokenizer(path, size: int):
    """A word-level tokenizer with ``size`` words w0..w{size-1}, built directly (no training)."""
    vocab = {f"w{i}": i for i in range(size - 1)}
    vocab["<|endoftext|>"] = size - 1
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(path))
    return path


def test_a_vocabulary_beyond_uint16_gets_uint32_shards(tmp_path):
    tokenizer = _word_level_tokenizer(tmp_path / "words.json", 70_000)
    text = tmp_path / "doc.txt"
    text.write_text("w1 w65535 w65536 w69998\nw3 w4\n")
    manifest = data_module.prepare(tmp_path / "data", [text], tokenizer=data_module.HFTokenizer(tokenizer))
    assert manifest.dtype == "uint32" and manifest.vocab_size == 70_000
    assert _tokens(tmp_path / "data") == [1, 65535, 65536, 69998, 3, 4, 69_999]
    opened = TokenData.open(tmp_path / "data")
    assert WindowDataset(opened, 4)[0].tolist() == [1, 65535, 65536, 69998, 3]
    assert WindowDataset(opened, 4)[0].dtype == torch.int64


def test_the_trainer_refuses_data_whose_vocabulary_does_not_fit_the_model(tmp_path, train_yaml, capsys):
    from astrai.trainer.run.loop import main

    tokenizer = _word_level_tokenizer(tmp_path / "words.json", 70_000)
    text = tmp_path / "doc.txt"
    text.write_text(" ".join(f"w{i}" for i in range(0, 69_000, 7)))
    data_module.prepare(tmp_path / "data", [text], tokenizer=data_module.HFTokenizer(tokenizer))
    config = train_yaml(tmp_path / "train.yaml", data_root_path=str(tmp_path / "data"), ckpt_dir=str(tmp_path / "c"))
    assert main(["--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert "data vocabulary 70000 (tokenizer.json sha256" in err
    assert "does not fit the model's vocab_size 320" in err and "Traceback" not in err
    assert not list((tmp_path / "c").glob("epoch_*"))


def test_a_tokenizer_s_saved_truncation_and_padding_never_cut_a_document(tmp_path, tokenizer_dir):
    # A real GPT-2 tokenizer.json keeps "truncation": {"max_length": ...}; padding is saved the same way.
    saved = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    saved.enable_truncation(max_length=50)
    saved.enable_padding(length=64, pad_id=saved.token_to_id("<pad>"), pad_token="<pad>")
    folder = tmp_path / "truncating"
    folder.mkdir()
    saved.save(str(folder / "tokenizer.json"))
    assert json.loads((folder / "tokenizer.json").read_text())["truncation"]["max_length"] == 50
    corpus = tmp_path / "corpus.jsonl"
    texts = [path.read_text() for path in CORPUS_FILES]
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts) + '{"text": "short"}\n')
    data_module.prepare(tmp_path / "data", [corpus], tokenizer=data_module.HFTokenizer(folder))
    whole = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = whole.token_to_id("<|endoftext|>")
    expected = [i for text in [*texts, "short"] for i in [*whole.encode(text, add_special_tokens=False).ids, eos]]
    assert _tokens(tmp_path / "data") == expected


@pytest.mark.parametrize("kind", ["bytelevel", "sentencepiece", "llama3"])
def test_a_long_document_s_ids_are_encode_of_the_whole_document_across_every_cut(tmp_path, monkeypatch, kind):
    from real_chat_templates import train_tokenizer

    from astrai.data import sources

    # Small chunks and pieces, so that a document of 60 KB is cut many times, some cuts inside "\n\n" runs
    # (one token to these tokenizers) and before words a SentencePiece tokenizer would prefix with ▁.
    monkeypatch.setattr(sources, "CHUNK_BYTES", 1000)
    monkeypatch.setattr(sources, "CONTEXT_BYTES", 200)
    monkeypatch.setattr(sources, "PIECE_BYTES", 7000)
    lines = [f"Line {n} says héllo to the world.\n" + "\n" * (n % 4) + " " * (n % 3) for n in range(1500)]
    text = "".join(lines)
    document = tmp_path / "long.txt"
    document.write_text(text, encoding="utf-8")
    tokenizer = train_tokenizer(kind, lines[:300], ("<|endoftext|>",))
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    data_module.prepare(tmp_path / "data", [document], tokenizer=data_module.HFTokenizer(folder))
    expected = tokenizer.encode(text, add_special_tokens=False).ids + [tokenizer.token_to_id("<|endoftext|>")]
    assert len(document.read_bytes()) > 8 * sources.PIECE_BYTES
    assert _tokens(tmp_path / "data") == expected


@pytest.mark.parametrize("kind", ["bytelevel", "sentencepiece", "llama3"])
def test_a_window_keeps_the_document_s_tokens_that_start_inside_it(tmp_path, kind):
    from array import array

    from real_chat_templates import train_tokenizer

    lines = [f"Line {n} says héllo to the world.\n" + "\n" * (n % 4) + " " * (n % 3) for n in range(80)]
    text = "".join(lines)
    trained = train_tokenizer(kind, lines, ("<|endoftext|>",))
    trained.save(str(tmp_path / "tokenizer.json"))
    tokenizer = data_module.HFTokenizer(tmp_path / "tokenizer.json")
    whole = trained.encode(text, add_special_tokens=False)
    cut_in_newlines = text.index("\n\n\n") + 1
    inside_words = text.index("world", 800) + 2, text.index("héllo", 1300) + 3
    # (low, high, context): a long window, one shorter than its context, cuts inside a run of newlines, before
    # a word a SentencePiece tokenizer prefixes with ▁ and inside words, and windows at either end of the text.
    for low, high, context in [
        (700, 1900, 120),
        (1000, 1030, 90),
        (cut_in_newlines, cut_in_newlines + 400, 60),
        (text.index(" says", 900), text.index(" says", 1500), 60),
        (*inside_words, 60),
        (0, 500, 80),
        (len(text) - 300, len(text), 100),
    ]:
        start, stop = max(0, low - context), min(len(text), high + context)
        got = array("H")
        got.frombytes(tokenizer.encode_window(text[start:stop], low - start, high - start))
        expected = [i for i, (begin, _) in zip(whole.ids, whole.offsets, strict=True) if low <= begin < high]
        assert got.tolist() == expected, (low, high, context)
