"""Data: byte tokenization into shards, memory-mapped windows, deterministic rank-split sampling, clear errors."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from astrai.common.data_folder import DataError, DataManifest, TokenData
from astrai.data import pipeline as data_module
from astrai.data.pipeline import prepare
from astrai.data.tokenizing import ByteTokenizer
from astrai.trainer.feed.windows import WindowBatchSampler, WindowDataset, epoch_permutation, ignore_stop_signals

TOKENIZER = ByteTokenizer()


def _write(path, text: str):
    path.write_text(text, encoding="utf-8")
    return path


def test_prepare_writes_byte_tokens_and_a_manifest(tmp_path, capsys):
    a = _write(tmp_path / "a.txt", "héllo")
    b = _write(tmp_path / "b.txt", "world\n")
    assert data_module.main(["prepare", "--out", str(tmp_path / "out"), str(a), str(b)]) == 0
    assert "wrote 14 tokens" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["tokenizer"] == "byte" and manifest["vocab_size"] == 257 and manifest["dtype"] == "uint16"
    assert manifest["num_tokens"] == len("héllo".encode()) + 1 + len("world\n") + 1
    raw = (tmp_path / "out" / "shard_00000.bin").read_bytes()
    tokens = [int.from_bytes(raw[i : i + 2], "little") for i in range(0, len(raw), 2)]
    assert tokens == TOKENIZER.encode("héllo") + [256] + TOKENIZER.encode("world\n") + [256]
    assert TOKENIZER.decode(tokens) == "hélloworld\n"


def test_the_manifest_is_one_record_written_and_read_alike_and_older_folders_still_read(tmp_path, capsys):
    corpus = _write(tmp_path / "c.txt", "one\n")
    written = prepare(tmp_path / "out", [corpus])
    text = (tmp_path / "out" / "manifest.json").read_text()
    assert DataManifest.from_dict(json.loads(text)) == written and written.to_json() == text
    assert written.sources[0].file == str(corpus) and written.sources[0].documents == 1
    # The first version listed its sources by name and counted neither documents nor skips.
    old = {key: value for key, value in json.loads(text).items() if key not in ("documents", "skipped", "empty")}
    (tmp_path / "out" / "manifest.json").write_text(json.dumps({**old, "sources": ["c.txt"], "version": 1}))
    assert TokenData.open(tmp_path / "out").documents is None
    assert data_module.main(["info", str(tmp_path / "out")]) == 0
    assert "sources     c.txt" in capsys.readouterr().out
    for broken, named in (({**old, "shards": [{"file": "x"}]}, "num_tokens"), ({**old, "kind": "rl"}, "kind")):
        (tmp_path / "out" / "manifest.json").write_text(json.dumps(broken))
        with pytest.raises(DataError, match=f"unreadable manifest.*{named}"):
            TokenData.open(tmp_path / "out")


def test_windows_come_from_the_shards_and_never_cross_them(tmp_path):
    text = "".join(chr(ord("a") + i % 26) for i in range(100))
    prepare(tmp_path, [_write(tmp_path / "t.txt", text)], shard_tokens=40)
    data = TokenData.open(tmp_path)
    assert data.shard_tokens == (40, 40, 21)
    # (40 - 1) // 8 = 4 windows in each full shard, (21 - 1) // 8 = 2 in the last.
    assert data.num_windows(8) == 10
    dataset = WindowDataset(data, 8)
    assert len(dataset) == 10
    assert dataset[0].dtype == torch.int64 and dataset[0].tolist() == list(text[:9].encode())
    assert dataset[4].tolist() == list(text[40:49].encode())
    assert dataset[9].tolist() == list(text[88:97].encode())


def test_shards_are_memory_mapped_not_read(tmp_path, monkeypatch):
    prepare(tmp_path, [_write(tmp_path / "t.txt", "x" * 1000)])
    mapped = []
    real_from_file = torch.from_file
    monkeypatch.setattr(
        torch, "from_file", lambda *args, **kwargs: mapped.append(kwargs) or real_from_file(*args, **kwargs)
    )
    dataset = WindowDataset(TokenData.open(tmp_path), 16)
    dataset[3]
    assert mapped == [{"shared": False, "size": 1001, "dtype": torch.uint16}]


def test_missing_empty_or_damaged_data_folders_say_what_to_do(tmp_path):
    with pytest.raises(DataError, match=r"does not exist .*python -m astrai.data prepare"):
        TokenData.open(tmp_path / "nope")
    with pytest.raises(DataError, match="has no manifest.json"):
        TokenData.open(tmp_path)
    with pytest.raises(DataError, match="empty"):
        prepare(tmp_path / "out", [_write(tmp_path / "empty.txt", "")])
    prepare(tmp_path / "ok", [_write(tmp_path / "t.txt", "some text")])
    shard = tmp_path / "ok" / "shard_00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match="expected 20 bytes"):
        TokenData.open(tmp_path / "ok")


def test_epoch_order_is_a_function_of_seed_and_epoch():
    assert torch.equal(epoch_permutation(100, seed=1, epoch=0), epoch_permutation(100, seed=1, epoch=0))
    assert not torch.equal(epoch_permutation(100, seed=1, epoch=0), epoch_permutation(100, seed=1, epoch=1))
    assert not torch.equal(epoch_permutation(100, seed=1, epoch=0), epoch_permutation(100, seed=2, epoch=0))


def _rank_batches(num_windows, batch, accum, world, seed, epoch=0, start=0):
    out = []
    for rank in range(world):
        sampler = WindowBatchSampler(num_windows, batch, accum, rank, world, seed)
        sampler.set_position(epoch, start)
        out.append(list(sampler))
    return out


def test_ranks_split_each_step_without_overlap():
    num_windows, batch, accum, world = 103, 3, 2, 2
    per_rank = _rank_batches(num_windows, batch, accum, world, seed=7)
    global_batch = batch * accum * world
    steps = num_windows // global_batch
    assert all(len(batches) == steps * accum for batches in per_rank)
    used = [i for batches in per_rank for b in batches for i in b]
    assert len(used) == len(set(used)) == steps * global_batch
    # After k steps exactly the first k * global_batch windows of the permutation are used.
    order = epoch_permutation(num_windows, 7, 0).tolist()
    first_step = {i for batches in per_rank for b in batches[:accum] for i in b}
    assert first_step == set(order[:global_batch])


def test_resuming_mid_epoch_continues_the_same_order():
    full = _rank_batches(60, 2, 1, 2, seed=3)
    resumed = _rank_batches(60, 2, 1, 2, seed=3, start=5 * 4)
    assert resumed == [batches[5:] for batches in full]


def test_data_position_stays_meaningful_when_the_world_size_changes():
    order = epoch_permutation(60, 3, 0).tolist()
    # Two ranks used 12 windows; one rank continues with the next ones of the same permutation.
    (single,) = _rank_batches(60, 4, 1, 1, seed=3, start=12)
    assert [i for b in single for i in b] == order[12:60]


class _SignalProbe(Dataset):
    def __len__(self):
        return 1

    def __getitem__(self, index):
        return torch.tensor(
            [
                os.getpid(),
                signal.getsignal(signal.SIGTERM) == signal.SIG_IGN,
                signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
            ]
        )


def test_dataloader_workers_ignore_stop_signals():
    loader = DataLoader(_SignalProbe(), batch_size=None, num_workers=1, worker_init_fn=ignore_stop_signals)
    ((pid, ignores_term, ignores_int),) = [row.tolist() for row in loader]
    assert pid != os.getpid()
    assert ignores_term and ignores_int


@pytest.mark.parametrize("resume_at", [0, 3])
def test_every_world_size_trains_the_same_windows_in_every_step(resume_at):
    # A global batch of 12 on world sizes 1, 2, 3 and 4 (grad_accum_steps 12, 6, 4, 3 of one window each),
    # resumed after `resume_at` steps: step k uses the same 12 windows whatever the world size.
    num_windows, global_batch, seed = 100, 12, 7

    def steps(world_size: int) -> list[set[int]]:
        accum = global_batch // world_size
        per_rank = []
        for rank in range(world_size):
            sampler = WindowBatchSampler(num_windows, 1, accum, rank, world_size, seed)
            sampler.set_position(epoch=2, samples_in_epoch=resume_at * global_batch)
            per_rank.append(list(sampler))
        count = len(per_rank[0]) // accum
        assert all(len(batches) == count * accum for batches in per_rank)
        return [
            {i for batches in per_rank for batch in batches[step * accum : (step + 1) * accum] for i in batch}
            for step in range(count)
        ]

    reference = steps(1)
    assert len(reference) == num_windows // global_batch - resume_at
    assert all(len(windows) == global_batch for windows in reference)
    for world_size in (2, 3, 4):
        assert steps(world_size) == reference


def test_a_failed_prepare_leaves_the_earlier_data_set_and_a_new_one_replaces_it_whole(tmp_path):
    out = tmp_path / "data"
    prepare(out, [_write(tmp_path / "a.txt", "a" * 100)], shard_tokens=40)
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    assert sorted(before) == ["manifest.json", "shard_00000.bin", "shard_00001.bin", "shard_00002.bin"]
    with pytest.raises(DataError, match="empty"):
        prepare(out, [_write(tmp_path / "empty.txt", "")], shard_tokens=40)
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before  # no staging left either
    with pytest.raises(DataError, match="empty"):
        prepare(tmp_path / "new" / "data", [tmp_path / "empty.txt"])
    assert not (tmp_path / "new" / "data").exists()

    # A trainer that has the old shards mapped keeps reading them: they are replaced, not rewritten.
    old = TokenData.open(out)
    dataset = WindowDataset(old, 8)
    first = dataset[0].tolist()
    prepare(out, [_write(tmp_path / "b.txt", "b" * 50)], shard_tokens=40)
    assert dataset[0].tolist() == first == [ord("a")] * 9
    new = TokenData.open(out)
    assert new.shard_tokens == (40, 11) and sorted(path.name for path in out.iterdir()) == [
        "manifest.json",
        "shard_00000.bin",
        "shard_00001.bin",
    ]
