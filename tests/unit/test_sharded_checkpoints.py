"""The sharded checkpoint format under torchrun on CPU (gloo): the full format's folder, written by every rank.

Real ``torchrun`` launches of ``python -m astrai.train`` with 2 and 4 processes; each test kills what it started.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from hf_folders import hf_logits
from safetensors.torch import load_file
from trainer_runs import TRAINER, Run, metrics_step, node_command, staging, wait_for

from astrai.common.checkpoints import (
    STAGING_PREFIX,
    latest_complete_checkpoint,
    list_complete_checkpoints,
    scan_job_dir,
)
from astrai.common.contract import TORCHRUN_MODULE
from astrai.trainer.checkpoint.files import join_optimizer_tensors
from astrai.trainer.checkpoint.sharded import row_range
from astrai.trainer.models.weights import load_pretrained
from tests.support import free_port

pytestmark = pytest.mark.slow


def _torchrun(processes: int, config: Path, *args: str) -> list[str]:
    launcher = [sys.executable, "-m", TORCHRUN_MODULE, "--standalone", "--nproc-per-node", str(processes)]
    return [*launcher, "-m", "astrai.train", "--config", str(config), "--parallel_mode", "fsdp", *args]


def _train(command: list[str], env: dict, log: Path) -> str:
    run = Run(command, env, log)
    assert run.wait() == 0, run.output()
    return run.output()


def _losses(ckpt_dir: Path) -> dict[int, float]:
    lines = (ckpt_dir / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


def _optimizer(folder: Path) -> dict:
    return join_optimizer_tensors(torch.load(folder / "optimizer.pt", weights_only=True), folder)


def test_row_ranges_cover_every_row_once_as_fsdp_splits_them():
    for rows in (0, 1, 3, 7, 320, 1000):
        for world in (1, 2, 3, 4, 8):
            ranges = [row_range(rows, rank, world) for rank in range(world)]
            assert ranges[0][0] == 0 and ranges[-1][1] == rows
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
            sizes = [len(chunk) for chunk in torch.arange(rows).chunk(world)] if rows else []
            assert [stop - start for start, stop in ranges] == sizes + [0] * (world - len(sizes))


def _sharded_and_full_runs(tmp_path, train_yaml, trainer_env, processes: int, keys: dict) -> dict[str, dict]:
    """The same run in both formats on ``processes`` ranks; {format: {step: checkpoint folder}}."""
    folders = {}
    for format in ("sharded", "full"):
        config = train_yaml(tmp_path / f"{format}.yaml", ckpt_dir=str(tmp_path / format), **keys)
        _train(_torchrun(processes, config, "--format", format), trainer_env, tmp_path / f"{format}.log")
        folders[format] = {c.step: c.path for c in list_complete_checkpoints(tmp_path / format)}
    return folders


def _assert_same_checkpoint(sharded: Path, full: Path) -> None:
    """The sharded folder holds the full one's tensors: the same model bytes, the same optimizer state."""
    assert json.loads((sharded / "meta.json").read_text())["format"] == "sharded"
    assert (sharded / "optimizer.safetensors").is_file() and not (full / "optimizer.safetensors").exists()
    ours, theirs = load_file(sharded / "model.safetensors"), load_file(full / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)
    # Laid out alike, too: the very same bytes.
    assert (sharded / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    mine, other = _optimizer(sharded), _optimizer(full)
    assert mine["param_groups"] == other["param_groups"] and mine["state"].keys() == other["state"].keys()
    for param, values in other["state"].items():
        assert values.keys() == mine["state"][param].keys()
        assert all(torch.equal(value, mine["state"][param][key]) for key, value in values.items())


def test_a_sharded_folder_is_the_full_one_tensor_for_tensor_loads_in_transformers_and_resumes_either_way(
    tmp_path, train_yaml, trainer_env
):
    processes = 2  # 4 ranks: the next test
    keys = {"max_steps": 20, "ckpt_interval": 10, "global_batch_size": 16}
    folders = _sharded_and_full_runs(tmp_path, train_yaml, trainer_env, processes, keys)
    assert sorted(folders["sharded"]) == sorted(folders["full"]) == [10, 20]
    for step in (10, 20):
        _assert_same_checkpoint(folders["sharded"][step], folders["full"][step])

    tokens = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
    final = folders["sharded"][20]
    with torch.no_grad():
        assert torch.allclose(hf_logits(final, tokens), load_pretrained(folders["full"][20])(tokens), atol=1e-4)

    # A full checkpoint resumes in the sharded format (its optimizer.pt mapped, each rank reading its rows), and a
    # sharded one in the full format; both end on the same weights as the uninterrupted runs (on 2 processes: the
    # other world sizes are the next test's).
    for source, format in (("full", "sharded"), ("sharded", "full")):
        job = tmp_path / f"{source}-as-{format}"
        job.mkdir()
        shutil.copytree(folders[source][10], job / folders[source][10].name)
        config = train_yaml(tmp_path / f"{source}-as-{format}.yaml", ckpt_dir=str(job), **keys)
        output = _train(_torchrun(processes, config, "--format", format), trainer_env, tmp_path / f"{job.name}.log")
        assert f"resumed from {job / folders[source][10].name}" in output
        resumed = latest_complete_checkpoint(job)
        assert resumed.step == 20 and resumed.meta.format == format
        assert (resumed.path / "model.safetensors").read_bytes() == (final / "model.safetensors").read_bytes()


def test_stop_then_resume_on_4_2_and_1_processes_trains_the_same_following_steps(tmp_path, train_yaml, trainer_env):
    keys = {"max_steps": 24, "ckpt_interval": 1000, "global_batch_size": 16, "log_interval": 1}
    # The uninterrupted runs, in both formats on 4 ranks: as on 2 (the test above), the same checkpoints.
    folders = _sharded_and_full_runs(tmp_path, train_yaml, trainer_env, 4, {**keys, "ckpt_interval": 12})
    for step in (12, 24):
        _assert_same_checkpoint(folders["sharded"][step], folders["full"][step])
    expected = _losses(tmp_path / "sharded")
    assert _losses(tmp_path / "full") == expected

    stopped_dir = tmp_path / "stopped"
    config = train_yaml(tmp_path / "stopped.yaml", ckpt_dir=str(stopped_dir), **keys)
    run = Run(_torchrun(4, config), trainer_env, tmp_path / "stopped.log")
    try:
        wait_for(lambda: metrics_step(stopped_dir) >= 6, run)
        os.kill(run.workers()[2], signal.SIGTERM)  # any rank's signal stops every rank
        assert run.proc.wait(timeout=120) == 0, run.output()
    finally:
        run.kill()
    stopped = latest_complete_checkpoint(stopped_dir)
    assert stopped.meta.reason == "emergency" and stopped.meta.format == "sharded" and stopped.step < 24
    assert {name: _losses(stopped_dir)[name] for name in range(1, stopped.step + 1)} == {
        name: expected[name] for name in range(1, stopped.step + 1)
    }

    for processes in (4, 2, 1):
        job = tmp_path / f"resume-{processes}"
        job.mkdir()
        shutil.copytree(stopped.path, job / stopped.path.name)
        config = train_yaml(tmp_path / f"resume-{processes}.yaml", ckpt_dir=str(job), **keys)
        command = [*TRAINER, "--config", str(config)] if processes == 1 else _torchrun(processes, config)
        output = _train(command, trainer_env, tmp_path / f"resume-{processes}.log")
        assert f"resumed from {job / stopped.path.name}" in output
        losses = _losses(job)
        assert sorted(losses) == list(range(stopped.step + 1, 25))
        for step, loss in losses.items():
            if processes == 4:
                assert loss == expected[step], (processes, step)
            else:
                assert loss == pytest.approx(expected[step], rel=1e-5), (processes, step)


def test_sigkill_of_one_rank_during_a_save_publishes_nothing_and_the_next_start_resumes_the_previous_one(
    tmp_path, train_yaml, trainer_env
):
    ckpt_dir = tmp_path / "ckpt"
    # A checkpoint after every step: a save is nearly always under way.
    config = train_yaml(tmp_path / "train.yaml", ckpt_dir=str(ckpt_dir), max_steps=400, ckpt_interval=1, keep_last=2)
    killed_during_save = None
    for _attempt in range(5):
        run = Run(_torchrun(2, config), trainer_env, tmp_path / "run.log")
        try:
            wait_for(lambda: metrics_step(ckpt_dir) >= 10, run, timeout=180)
            deadline = time.monotonic() + 10
            while not staging(ckpt_dir) and time.monotonic() < deadline:
                time.sleep(0.0002)
            writing = staging(ckpt_dir)
            os.kill(run.workers()[1], signal.SIGKILL)
            code = run.proc.wait(timeout=120)
        finally:
            run.kill()
        assert code != 0
        left = staging(ckpt_dir)
        # The kill landed during a save when its staging folder is still there, or when it was removed (rank 0,
        # seeing its peer gone, fails the save and cleans up) without ever being published.
        published = {checkpoint.name for checkpoint in scan_job_dir(ckpt_dir).complete}
        finals = {name.removeprefix(STAGING_PREFIX).rsplit("-", 2)[0] for name in writing}
        if writing and (left or not finals & published):
            killed_during_save = left or writing
            break
    assert killed_during_save, "no kill landed while a checkpoint was being written"
    scan = scan_job_dir(ckpt_dir)
    assert scan.complete and not scan.damaged
    newest = scan.complete[-1]
    # The folder being written when rank 1 died never became a checkpoint; what `invoke list` shows is whole.
    complete = {checkpoint.name for checkpoint in scan.complete}
    for name in killed_during_save:
        assert name.removeprefix(STAGING_PREFIX).rsplit("-", 2)[0] not in complete
    assert all(checkpoint.meta.format == "sharded" for checkpoint in scan.complete)

    rerun = Run(_torchrun(2, config, "--max_steps", str(newest.step + 5)), trainer_env, tmp_path / "rerun.log")
    assert rerun.wait() == 0, rerun.output()
    assert f"resumed from {newest.path}" in rerun.output()
    assert latest_complete_checkpoint(ckpt_dir).step == newest.step + 5 and not staging(ckpt_dir)


def test_no_rank_holds_more_than_its_share_during_a_sharded_save(tmp_path):
    from bench.sharded_checkpoints import measure, peak_bytes

    measured = measure("small", 128, 4, 2, 1, tmp_path)
    share = measured["share_bytes"]
    sharded, full = peak_bytes(measured["samples"]["sharded"]), peak_bytes(measured["samples"]["full"])
    print(f"peak extra bytes over the share: sharded {sharded / share:.3f}, full {full / share:.3f}")
    assert sharded <= 1.25 * share
    # The gathered save holds the whole state on rank 0: twice its share on two ranks.
    assert full >= 1.8 * share
    # A resume reads each rank's rows straight into its shard; the full one hands every rank the whole state.
    loads = {format: max(b for _, b in measured["samples"][format]["load"]) for format in ("sharded", "full")}
    print(f"resume: sharded {loads['sharded'] / share:.3f}, full {loads['full'] / share:.3f} of the share")
    assert loads["sharded"] <= 0.25 * share and loads["full"] >= 1.8 * share


@pytest.mark.parametrize("shared", [True, False])
def test_two_nodes_need_one_shared_job_dir_in_the_sharded_format(tmp_path, train_yaml, trainer_env, shared):
    config = train_yaml(tmp_path / "train.yaml", max_steps=20, ckpt_interval=10)
    port = free_port()
    dirs = [tmp_path / "shared"] * 2 if shared else [tmp_path / "node0", tmp_path / "node1"]
    runs = [
        Run(
            [*node_command(node, port, parallel_mode="fsdp"), "--config", str(config), "--ckpt_dir", str(dirs[node])],
            {**trainer_env, "ASTRAI_NODE_RANK": str(node), "GLOO_SOCKET_IFNAME": "lo"},
            tmp_path / f"node{node}.log",
        )
        for node in (0, 1)
    ]
    try:
        codes = [run.wait(timeout=240) for run in runs]
    finally:
        for run in runs:
            run.kill()
    output = "".join(run.output() for run in runs)
    if shared:
        assert codes == [0, 0], output
        assert latest_complete_checkpoint(dirs[0]).step == 20
    else:
        assert all(code != 0 for code in codes), output
        assert (
            "error: ckpt.format sharded: node(s) 1 do not share the job dir" in output and "ckpt.format: full" in output
        )
        assert not list_complete_checkpoints(dirs[0]) and not list_complete_checkpoints(dirs[1])


def test_a_write_that_fails_fails_the_save_on_every_rank_and_leaves_no_folder(
    small_disk, train_yaml, trainer_env, tmp_path
):
    job_dir = small_disk / "j"
    config = train_yaml(tmp_path / "train.yaml", max_steps=200, ckpt_interval=20, log_interval=1, ckpt_dir=str(job_dir))
    run = Run(_torchrun(2, config), trainer_env, tmp_path / "run.log")
    code = run.wait(timeout=300)
    output = run.output()
    assert code != 0, output
    assert f"error: the disk is full: checkpoint epoch_0_step_40 does not fit in {job_dir} (" in output, output
    # No rank went on training into a collective the other had left: both stopped with an error of ours.
    assert "astrai/trainer" not in output, output
    assert output.count("error: ") >= 2, output
    assert [c.step for c in list_complete_checkpoints(job_dir)] == [20]
    assert not staging(job_dir)
    last = json.loads((job_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert 40 <= last < 60, last


def test_a_periodic_sharded_save_holds_the_state_of_its_own_step_while_training_goes_on(
    tmp_path, train_yaml, make_trainer, one_thread, monkeypatch
):
    from astrai.trainer.checkpoint import sharded

    # A slow disk: the writer thread is still writing when the next steps change every tensor and step counter.
    write_rows = sharded.ShardedState.write_rows

    def slow(self, folder):
        time.sleep(0.3)
        write_rows(self, folder)

    monkeypatch.setattr(sharded.ShardedState, "write_rows", slow)
    ckpt_dir = tmp_path / "sharded"
    config = train_yaml(tmp_path / "train.yaml", ckpt_dir=str(ckpt_dir), max_steps=12, ckpt_interval=4)
    trainer = make_trainer(config, format="sharded")
    try:
        trainer.train()
    finally:
        trainer.close()
    monkeypatch.undo()
    reference = train_yaml(tmp_path / "full.yaml", ckpt_dir=str(tmp_path / "full"), max_steps=12, ckpt_interval=4)
    trainer = make_trainer(reference, format="full")
    try:
        trainer.train()
    finally:
        trainer.close()
    written = list_complete_checkpoints(ckpt_dir)
    assert [c.step for c in written] == [4, 8, 12] and {c.meta.format for c in written} == {"sharded"}
    for checkpoint in written:
        mine, theirs = _optimizer(checkpoint.path), _optimizer(tmp_path / "full" / checkpoint.name)
        for param, values in theirs["state"].items():
            assert float(mine["state"][param]["step"]) == checkpoint.step
            assert all(torch.equal(value, mine["state"][param][key]) for key, value in values.items()), param
        ours = load_file(checkpoint.path / "model.safetensors")
        assert all(
            torch.equal(t, ours[n])
            for n, t in load_file(tmp_path / "full" / checkpoint.name / "model.safetensors").items()
        )


def test_a_sharded_checkpoint_that_does_not_fit_the_model_is_skipped_for_the_one_before(
    tmp_path, train_yaml, trainer_env
):
    from safetensors.torch import save_file

    ckpt_dir = tmp_path / "ckpt"
    config = train_yaml(tmp_path / "train.yaml", ckpt_dir=str(ckpt_dir), max_steps=20, ckpt_interval=10)
    _train(_torchrun(2, config), trainer_env, tmp_path / "first.log")
    newest = latest_complete_checkpoint(ckpt_dir)
    moments = load_file(newest.path / "optimizer.safetensors")
    name = next(iter(moments))
    moments[name] = moments[name][:-1].clone()  # a row short: the headers are whole, the shapes are not
    save_file(moments, newest.path / "optimizer.safetensors")
    output = _train(_torchrun(2, config, "--max_steps", "20"), trainer_env, tmp_path / "second.log")
    assert f"warning: skipping {newest.path}: " in output and "the model's" in output, output
    assert f"resumed from {ckpt_dir / 'epoch_0_step_10'}" in output
