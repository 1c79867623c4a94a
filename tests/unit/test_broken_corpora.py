"""Corpora that are broken are never read as complete (issue 25 §2).

Every file is read to its end and checked — a compressed stream to its end marker, a JSON list to its last
character — or it is an error naming it; with ``--skip_bad`` the file is left out whole, counted and named.
No input gives a traceback, and a signal leaves no worker running and nothing half-written.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zstandard
from test_corpora import _documents, _jsonl

from astrai.common.data_folder import DataError
from astrai.data.pipeline import prepare
from tests.support import REPO

RECORDS = [{"text": f"document {number} " + "word " * (number % 50)} for number in range(3000)]


def _cli(*args: str, cwd: Path | None = None, **popen) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "astrai.data", *args], cwd=cwd or REPO, capture_output=True, text=True, **popen
    )


def _no_traceback(result: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in result.stderr, result.stderr


def _cut(path: Path, keep: float = 0.5) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def _zst_file(path: Path, records: list[dict]) -> Path:
    data = "".join(json.dumps(record) + "\n" for record in records).encode()
    path.write_bytes(zstandard.ZstdCompressor().compress(data))
    return path


@pytest.mark.parametrize("damage", ["cut_zst", "corrupt_zst", "cut_gz", "after_json_list"])
def test_a_file_that_cannot_be_read_to_its_end_is_an_error_or_left_out_whole(tmp_path, damage):
    good = _jsonl(tmp_path / "good.jsonl", RECORDS[:5])
    if damage == "cut_zst":
        bad = _cut(_zst_file(tmp_path / "bad.jsonl.zst", RECORDS))
    elif damage == "corrupt_zst":
        bad = _zst_file(tmp_path / "bad.jsonl.zst", RECORDS)
        data = bytearray(bad.read_bytes())
        data[20:60] = b"\xff" * 40
        bad.write_bytes(bytes(data))
    elif damage == "cut_gz":
        bad = _cut(_jsonl(tmp_path / "bad.jsonl.gz", RECORDS, opener=gzip.open))
    else:
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(RECORDS[:10]) + '\n{"text": "after the list"}\n')
    out = tmp_path / "data"
    result = _cli("prepare", "--out", str(out), str(good), str(bad))
    _no_traceback(result)
    assert result.returncode == 1 and str(bad) in result.stderr and "nothing was written" in result.stderr
    assert not out.exists()

    result = _cli("prepare", "--skip_bad", "--out", str(out), str(good), str(bad))
    _no_traceback(result)
    assert result.returncode == 0, result.stderr
    assert f"left out {bad}" in result.stdout
    # Not one record of the damaged file: it is left out whole, never half-read.
    assert _documents(out) == [record["text"] for record in RECORDS[:5]]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["documents"] == 5 and len(manifest["left_out"]) == 1 and str(bad) in manifest["left_out"][0]


def test_a_whole_compressed_file_of_several_frames_is_read(tmp_path):
    first = zstandard.ZstdCompressor().compress(b"".join(json.dumps(r).encode() + b"\n" for r in RECORDS[:7]))
    second = zstandard.ZstdCompressor().compress(b"".join(json.dumps(r).encode() + b"\n" for r in RECORDS[7:9]))
    (tmp_path / "two.jsonl.zst").write_bytes(first + second)
    prepare(tmp_path / "data", [tmp_path / "two.jsonl.zst"])
    assert _documents(tmp_path / "data") == [record["text"] for record in RECORDS[:9]]


def test_a_broken_link_or_a_fifo_in_a_folder_is_named_never_left_out_silently(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _jsonl(corpus / "a.jsonl", RECORDS[:3])
    (corpus / "gone.jsonl").symlink_to(tmp_path / "missing.jsonl")
    os.mkfifo(corpus / "pipe.jsonl")
    with pytest.raises(DataError, match=r"gone.jsonl: a broken link; prepare reads every file"):
        prepare(tmp_path / "data", [corpus])
    assert not (tmp_path / "data").exists()
    result = _cli("prepare", "--skip_bad", "--out", str(tmp_path / "data"), str(corpus))
    _no_traceback(result)
    assert result.returncode == 0, result.stderr
    assert "gone.jsonl: a broken link" in result.stdout and "pipe.jsonl: not a regular file" in result.stdout
    assert _documents(tmp_path / "data") == [record["text"] for record in RECORDS[:3]]
    (corpus / "pipe.jsonl").unlink()
    with pytest.raises(DataError, match=r"gone.jsonl: a broken link"):
        prepare(tmp_path / "other", [corpus / "gone.jsonl"])


def test_a_lone_surrogate_escape_is_a_bad_record_not_a_traceback(tmp_path):
    corpus = tmp_path / "scraped.jsonl"
    corpus.write_text('{"text": "fine"}\n{"text": "broken \\ud800 here"}\n{"text": "also fine"}\n')
    result = _cli("prepare", "--out", str(tmp_path / "data"), str(corpus))
    _no_traceback(result)
    assert result.returncode == 1 and f"{corpus}:2: field 'text' holds a lone surrogate (\\ud800" in result.stderr
    result = _cli("prepare", "--skip_bad", "--out", str(tmp_path / "data"), str(corpus))
    assert result.returncode == 0 and "skipped 1 bad record(s)" in result.stdout
    assert _documents(tmp_path / "data") == ["fine", "also fine"]


def test_an_empty_text_is_no_document(tmp_path):
    corpus = _jsonl(tmp_path / "c.jsonl", [{"text": "one"}, {"text": ""}, {"text": "two"}])
    (tmp_path / "empty.txt").write_text("")
    manifest = prepare(tmp_path / "data", [corpus])
    assert _documents(tmp_path / "data") == ["one", "two"]
    assert manifest.documents == 2 and manifest.empty == 1
    with pytest.raises(DataError, match="the inputs are empty"):
        prepare(tmp_path / "text", [tmp_path / "empty.txt"])


def test_a_save_to_disk_folder_inside_a_corpus_folder_is_read_as_a_data_set(tmp_path):
    datasets = pytest.importorskip("datasets")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _jsonl(corpus / "a.jsonl", RECORDS[:2])
    datasets.Dataset.from_list(RECORDS[2:5]).save_to_disk(str(corpus / "b_saved"))
    prepare(tmp_path / "data", [corpus])
    assert _documents(tmp_path / "data") == [record["text"] for record in RECORDS[:5]]


def test_sigterm_leaves_no_worker_running_and_no_staging_folder(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for number in range(6):
        _jsonl(corpus / f"part{number}.jsonl", RECORDS * 8)
    out = tmp_path / "data"
    process = subprocess.Popen(
        [sys.executable, "-m", "astrai.data", "prepare", "--workers", "2", "--out", str(out), str(corpus)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not list(out.glob(".prepare-*/.piece-*")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(out.glob(".prepare-*")), "prepare did not start tokenizing"
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert "stopped by SIGTERM: nothing was written" in stderr and "Traceback" not in stderr
    assert not out.exists()
    # Nothing of the session is left: no worker, no fork server (which exits once its parent has gone).
    deadline = time.monotonic() + 15
    while (left := _session(process.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [], left


def _session(sid: int) -> list[str]:
    return subprocess.run(["pgrep", "-s", str(sid)], capture_output=True, text=True).stdout.split()


def test_info_into_a_closed_pipe_ends_quietly(tmp_path):
    prepare(tmp_path / "data", [_jsonl(tmp_path / "c.jsonl", RECORDS[:3])])
    result = subprocess.run(
        f"{sys.executable} -m astrai.data info {tmp_path / 'data'} | head -c 1",
        shell=True,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.stderr == "" and len(result.stdout) == 1


def _chat_folder(tmp_path: Path, template: str) -> Path:
    from hf_folders import make_tokenizer

    folder = make_tokenizer(tmp_path / "tok", ["hello there user assistant"] * 20, special=("<|im_end|>",))
    config = {"eos_token": "<|im_end|>", "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHAT = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "there"}]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_chat_template_that_does_not_compile_or_fails_is_named_without_a_traceback(tmp_path, workers):
    corpus = _jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}] * 3)
    folder = _chat_folder(tmp_path, "{% for m in messages %}{{ m['content'] }}")  # no endfor
    args = ["prepare", "--kind", "sft", "--workers", workers, "--tokenizer", str(folder), "--out", str(tmp_path / "d")]
    result = _cli(*args, str(corpus))
    _no_traceback(result)
    assert result.returncode == 1 and "tokenizer_config.json: the chat template does not compile (line 1" in (
        result.stderr
    )
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "chat_template": "{{ messages[0]['content'] + 1 }}"})
    )
    result = _cli(*args, str(corpus))
    _no_traceback(result)
    assert result.returncode == 1 and f"{corpus}:1: the chat template failed on it (TypeError" in result.stderr
    assert not (tmp_path / "d").exists()


def test_sharegpt_conversations_and_a_messages_field_named_by_field(tmp_path):
    from test_post_training import _sequences

    from astrai.data.tokenizing import HFTokenizer

    tokenizer = HFTokenizer(_chat_folder(tmp_path, CHATML))
    sharegpt = [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "there"}]
    corpus = _jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}, {"conversations": sharegpt}])
    prepare(tmp_path / "d", [corpus], tokenizer=tokenizer, kind="sft")
    (plain, from_sharegpt) = _sequences(tmp_path / "d")
    assert plain == from_sharegpt and any(plain[1])  # ShareGPT's human/gpt are the user/assistant roles
    # --field names the field that holds the messages (it was ignored for --kind sft).
    with pytest.raises(DataError, match=r"has no 'dialog' field .*--field names the field"):
        prepare(tmp_path / "e", [corpus], tokenizer=tokenizer, kind="sft", field="dialog")
    _jsonl(corpus, [{"dialog": CHAT}])
    prepare(tmp_path / "e", [corpus], tokenizer=tokenizer, kind="sft", field="dialog")
    assert _sequences(tmp_path / "e") == [plain]
    with pytest.raises(DataError, match=r"--field: a dpo record is read whole"):
        prepare(tmp_path / "f", [corpus], tokenizer=tokenizer, kind="dpo", field="dialog")


def test_a_linked_folder_is_read_an_empty_compressed_file_is_cut_short_an_empty_data_set_holds_nothing(tmp_path):
    datasets = pytest.importorskip("datasets")
    real = tmp_path / "real"
    real.mkdir()
    _jsonl(real / "a.jsonl", RECORDS[:2])
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _jsonl(corpus / "b.jsonl", RECORDS[2:3])
    (corpus / "linked").symlink_to(real)  # Python's rglob would not go in: its files were left out silently
    datasets.Dataset.from_list([]).save_to_disk(str(corpus / "nothing"))
    prepare(tmp_path / "data", [corpus])
    assert _documents(tmp_path / "data") == [record["text"] for record in RECORDS[2:3] + RECORDS[:2]]
    (corpus / "loop").symlink_to(corpus)
    with pytest.raises(DataError, match=r"loop: a link to a folder already read"):
        prepare(tmp_path / "data2", [corpus])
    (corpus / "loop").unlink()
    (corpus / "empty.jsonl.gz").write_bytes(b"")
    with pytest.raises(DataError, match=r"empty.jsonl.gz: cannot be decompressed to its end \(an empty file"):
        prepare(tmp_path / "data3", [corpus])


def test_a_lone_surrogate_anywhere_a_template_shows_is_a_bad_record(tmp_path):
    from astrai.data.tokenizing import HFTokenizer

    tokenizer = HFTokenizer(_chat_folder(tmp_path, CHATML))
    corpus = tmp_path / "chat.jsonl"
    corpus.write_text(
        json.dumps({"messages": CHAT})
        + "\n"
        + '{"messages": [{"role": "user\\ud800", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
    )
    result = _cli(
        "prepare",
        "--kind",
        "sft",
        "--skip_bad",
        "--tokenizer",
        str(tokenizer.file.parent),
        "--out",
        str(tmp_path / "d"),
        str(corpus),
    )
    _no_traceback(result)
    assert result.returncode == 0 and "rendered conversation holds a lone surrogate" in result.stdout, result.stderr
