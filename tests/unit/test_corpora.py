"""Real corpora into data folders: JSON Lines, JSON lists, compressed, Parquet, save_to_disk, folders (issue 18).

Every test reads the shards back and checks the documents a user would expect: one per record, in order,
each followed by the end-of-text token, the same for any number of workers.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard
from hf_folders import make_tokenizer

from astrai.common.data_folder import DataError, TokenData
from astrai.data import sources
from astrai.data.pipeline import describe_folder, main, prepare
from astrai.data.tokenizing import ByteTokenizer, HFTokenizer
from tests.support import REPO

TEXTS = [f"record {i}: {'é' if i % 3 == 0 else 'e'} " + "word " * (i % 7) for i in range(200)]


def _documents(folder: Path) -> list[str]:
    """The documents of a byte-tokenized data folder, split at the end-of-text token."""
    data = TokenData.open(folder)
    ids = [int.from_bytes(chunk[i : i + 2], "little") for chunk in _shard_bytes(data) for i in range(0, len(chunk), 2)]
    assert ids and ids[-1] == ByteTokenizer.end_of_text
    documents, current = [], []
    for token in ids:
        if token == ByteTokenizer.end_of_text:
            documents.append(bytes(current).decode("utf-8"))
            current = []
        else:
            current.append(token)
    return documents


def _shard_bytes(data: TokenData) -> list[bytes]:
    return [path.read_bytes() for path in data.shard_files]


def _jsonl(path: Path, records: list, opener=open) -> Path:
    with opener(path, "wt", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def _zst(path: Path, records: list) -> Path:
    data = "".join(json.dumps(record) + "\n" for record in records).encode()
    path.write_bytes(zstandard.ZstdCompressor().compress(data))
    return path


def _parquet(path: Path, records: list[dict], row_group_size: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=row_group_size)
    return path


RECORDS = [{"id": i, "text": text} for i, text in enumerate(TEXTS)]


@pytest.mark.parametrize(
    "make",
    [
        lambda d: _jsonl(d / "c.jsonl", RECORDS),
        lambda d: _jsonl(d / "c.json", RECORDS),
        lambda d: (d / "c.json").write_text(json.dumps(RECORDS, indent=1)) and d / "c.json",
        lambda d: _jsonl(d / "c.jsonl.gz", RECORDS, gzip.open),
        lambda d: _zst(d / "c.jsonl.zst", RECORDS),
        lambda d: _zst(d / "c.json.zst", RECORDS),
        lambda d: _parquet(d / "c.parquet", RECORDS, row_group_size=37),
    ],
    ids=["jsonl", "json-lines", "json-list", "jsonl.gz", "jsonl.zst", "json.zst", "parquet"],
)
def test_each_record_is_one_document_in_order(tmp_path, make):
    made = make(tmp_path)
    manifest = prepare(tmp_path / "out", [made])
    assert _documents(tmp_path / "out") == TEXTS
    assert manifest.documents == len(TEXTS) and manifest.sources[0].documents == len(TEXTS)
    assert manifest.sources[0].tokens == manifest.num_tokens


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_any_number_of_workers_writes_the_same_shards(tmp_path, monkeypatch, workers):
    """N records give N documents and N end-of-text tokens, cut in pieces within files and across them."""
    monkeypatch.setattr(sources, "PIECE_BYTES", 1 << 12)  # so that one file makes many pieces
    monkeypatch.setattr(sources, "BATCH_BYTES", 1 << 11)
    inputs = [
        _jsonl(tmp_path / "a.jsonl", RECORDS),
        _zst(tmp_path / "b.jsonl.zst", RECORDS[:120]),
        _parquet(tmp_path / "c.parquet", RECORDS[:90], row_group_size=16),
        tmp_path / "d.txt",
    ]
    inputs[3].write_text("".join(TEXTS))  # one document, cut in pieces
    prepare(tmp_path / "ref", inputs, shard_tokens=5000, workers=1)
    manifest = prepare(tmp_path / "out", inputs, shard_tokens=5000, workers=workers)
    documents = _documents(tmp_path / "out")
    assert documents == TEXTS + TEXTS[:120] + TEXTS[:90] + ["".join(TEXTS)]
    assert manifest.documents == len(documents) == 200 + 120 + 90 + 1
    reference = TokenData.open(tmp_path / "ref")
    assert _shard_bytes(TokenData.open(tmp_path / "out")) == _shard_bytes(reference) and len(reference.shard_files) > 3
    assert (tmp_path / "out" / "manifest.json").read_text() == (tmp_path / "ref" / "manifest.json").read_text()


def test_a_tokenizer_s_ids_are_the_library_s_for_every_record(tmp_path):
    from tokenizers import Tokenizer

    folder = make_tokenizer(tmp_path / "tok", TEXTS * 3)
    tokenizer = HFTokenizer(folder)
    prepare(tmp_path / "out", [_jsonl(tmp_path / "c.jsonl", RECORDS)], tokenizer=tokenizer, workers=2)
    data = TokenData.open(tmp_path / "out")
    ids = [int.from_bytes(b[i : i + 2], "little") for b in _shard_bytes(data) for i in range(0, len(b), 2)]
    library = Tokenizer.from_file(str(folder / "tokenizer.json"))
    expected = [
        t for text in TEXTS for t in [*library.encode(text, add_special_tokens=False).ids, tokenizer.end_of_text]
    ]
    assert ids == expected


def test_nested_fields_save_to_disk_folders_and_folders_of_files(tmp_path):
    import datasets

    nested = [{"meta": {"content": text}, "text": 1} for text in TEXTS[:50]]
    datasets.Dataset.from_list(nested).save_to_disk(str(tmp_path / "saved"))
    manifest = prepare(tmp_path / "out", [tmp_path / "saved"], field="meta.content")
    assert _documents(tmp_path / "out") == TEXTS[:50] and manifest.field == "meta.content"
    assert manifest.sources[0].file.endswith("data-00000-of-00001.arrow")

    folder = tmp_path / "download"
    (folder / "data").mkdir(parents=True)
    _parquet(folder / "data" / "train-00001.parquet", RECORDS[100:], row_group_size=50)
    _parquet(folder / "data" / "train-00000.parquet", RECORDS[:100], row_group_size=50)
    (folder / "README.md").write_text("# a dataset card, not a document")
    (folder / ".gitattributes").write_text("*.parquet filter=lfs")
    notes = []
    manifest = prepare(tmp_path / "out2", [folder], say=notes.append)
    assert _documents(tmp_path / "out2") == TEXTS
    assert [Path(entry.file).name for entry in manifest.sources] == ["train-00000.parquet", "train-00001.parquet"]
    assert any("left out README.md" in note for note in notes)

    datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS[:3])}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"a datasets DatasetDict \(splits: train\); give one split's folder"):
        prepare(tmp_path / "out3", [tmp_path / "dict"])


@pytest.mark.parametrize(
    ("line", "found"),
    [
        ('{"text": "ok"', "not valid JSON"),
        ('{"body": "no text field"}', "has no 'text' field (its keys: body)"),
        ('{"text": 7}', "field 'text' holds int, not text: 7"),
        ('{"text": null}', "field 'text' holds null"),
        ('["a", "list"]', "not a JSON object with a 'text' field"),
    ],
)
def test_a_bad_record_is_named_by_file_and_line_and_nothing_is_written(tmp_path, monkeypatch, line, found):
    monkeypatch.setattr(sources, "PIECE_BYTES", 1 << 10)
    prepare(tmp_path / "out", [_jsonl(tmp_path / "old.jsonl", RECORDS[:5])])
    before = {path.name: path.read_bytes() for path in (tmp_path / "out").iterdir()}
    path = _jsonl(tmp_path / "c.jsonl", RECORDS)
    lines = path.read_text().splitlines()
    lines.insert(150, line)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=f"c.jsonl:151: .*{_escape(found)}"):
        prepare(tmp_path / "out", [path], workers=2)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before

    manifest = prepare(tmp_path / "out", [path], workers=2, skip_bad=True)
    assert manifest.sources[0].skipped == 1 and manifest.skipped == 1
    assert manifest.sources[0].first_skipped.startswith(f"{path}:151: ")
    assert _documents(tmp_path / "out") == TEXTS


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_bad_rows_of_parquet_and_records_of_a_json_list_are_named_too(tmp_path):
    rows = [*RECORDS[:30], {"id": 30, "text": None}, *RECORDS[31:40]]
    with pytest.raises(DataError, match=r"c.parquet, row 30: field 'text' holds null"):
        prepare(tmp_path / "out", [_parquet(tmp_path / "c.parquet", rows, row_group_size=8)])
    (tmp_path / "l.json").write_text(json.dumps([*RECORDS[:3], {"text": ["x"]}]))
    with pytest.raises(DataError, match=r"l.json, record 3: field 'text' holds list"):
        prepare(tmp_path / "out", [tmp_path / "l.json"])
    with pytest.raises(DataError, match="has no column 'body'"):
        prepare(tmp_path / "out", [tmp_path / "c.parquet"], field="body")


def test_an_unknown_kind_of_file_is_refused_with_the_kinds_prepare_knows(tmp_path):
    (tmp_path / "corpus.csv").write_text("text\nhello\n")
    with pytest.raises(DataError, match=r"corpus.csv: prepare does not know this kind of file; it reads .txt, .md, "):
        prepare(tmp_path / "out", [tmp_path / "corpus.csv"])
    assert not (tmp_path / "out").exists()


def test_a_json_list_is_read_as_a_stream_whatever_its_records_size(tmp_path):
    big = {"text": "x" * (3 << 20), "n": 12345678901234567890}
    (tmp_path / "big.json").write_text(json.dumps([RECORDS[0], big, *RECORDS[1:4]]))
    prepare(tmp_path / "out", [tmp_path / "big.json"])
    assert _documents(tmp_path / "out") == [TEXTS[0], big["text"], *TEXTS[1:4]]
    (tmp_path / "open.json").write_text(json.dumps(RECORDS[:3])[:-1])
    with pytest.raises(DataError, match="not closed"):
        prepare(tmp_path / "out", [tmp_path / "open.json"])


def test_info_and_the_command_line_show_every_source_file(tmp_path):
    path = _jsonl(tmp_path / "c.jsonl", [*RECORDS[:10], {"no": "text"}])
    result = subprocess.run(
        [sys.executable, "-m", "astrai.data", "prepare", "--out", str(tmp_path / "out"), "--skip_bad", str(path)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert f"skipped 1 bad record(s) in {path} (first: {path}:11: has no 'text' field" in result.stdout
    assert "(10 documents) from 1 file(s)" in result.stdout
    described = describe_folder(tmp_path / "out")
    assert "10 documents" in described and "1 record(s) skipped" in described and "c.jsonl" in described
    info = subprocess.run(
        [sys.executable, "-m", "astrai.data", "info", str(tmp_path / "out")], capture_output=True, text=True, cwd=REPO
    )
    assert info.returncode == 0 and info.stdout.strip() == described
    assert main(["prepare", "--out", str(tmp_path / "x"), "--workers", "1e-3", str(path)]) == 1
