"""Several nodes and another world size, on one machine without Docker: real torchrun launches on CPU.

Two nodes are two ``torchrun --nnodes 2`` launches that meet at a rendezvous on 127.0.0.1, as two hosts
would; the entrypoint passes the same arguments in the containers.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from trainer_runs import TORCHRUN, TRAINER, Run, metrics_step, node_command, run_to_end, stop_gracefully, wait_for

from astrai.common.checkpoints import latest_complete_checkpoint, list_complete_checkpoints
from tests.support import free_port

pytestmark = pytest.mark.slow


def _records(ckpt_dir: Path) -> dict[int, dict]:
    """The last metrics record of each step (a resumed run repeats none, but take the newest anyway)."""
    lines = (ckpt_dir / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record for record in map(json.loads, lines)}


def _node_env(trainer_env: dict, node: int, timeout: int = 10) -> dict:
    return {
        **trainer_env,
        "ASTRAI_NODE_RANK": str(node),
        "ASTRAI_FAILURE_TIMEOUT_SECONDS": str(timeout),
        "GLOO_SOCKET_IFNAME": "lo",
    }


def _two_process_ddp(config: Path) -> list[str]:
    """The trainer under torchrun on this host: two processes, DDP."""
    return [*TORCHRUN, "-m", "astrai.train", "--config", str(config), "--parallel_mode", "ddp"]


def test_a_resume_on_another_world_size_trains_the_same_steps(tmp_path, train_yaml, trainer_env):
    keys = {"global_batch_size": 8, "batch_per_device": 4, "max_steps": 30, "log_interval": 1, "ckpt_interval": 100}
    reference_dir, resumed_dir = tmp_path / "reference", tmp_path / "resumed"
    reference = train_yaml(tmp_path / "reference.yaml", ckpt_dir=str(reference_dir), **keys)
    run_to_end([*TRAINER, "--config", str(reference)], trainer_env, tmp_path / "reference.log")

    # Two processes (grad_accum_steps 1), stopped after a few steps, then one process (grad_accum_steps 2).
    path = train_yaml(tmp_path / "train.yaml", ckpt_dir=str(resumed_dir), **keys)
    command = _two_process_ddp(path)
    stop_gracefully(Run(command, trainer_env, tmp_path / "two.log"), lambda: metrics_step(resumed_dir) >= 10, rank=0)
    stopped = latest_complete_checkpoint(resumed_dir)
    assert stopped.meta.world_size == 2 and stopped.meta.global_batch == 8
    run = run_to_end([*TRAINER, "--config", str(path)], trainer_env, tmp_path / "one.log")
    assert "seeded from random_seed, step and rank" in run.output()
    assert "global batch changed" not in run.output()

    expected, got = _records(reference_dir), _records(resumed_dir)
    assert sorted(got) == sorted(expected) == list(range(1, 31))
    for step in range(1, 31):
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-3), step
        assert got[step]["lr"] == pytest.approx(expected[step]["lr"], rel=1e-9)
        assert got[step]["tokens_seen"] == expected[step]["tokens_seen"]


def test_without_global_batch_size_a_new_world_size_is_named_at_resume(tmp_path, train_yaml, trainer_env):
    path = train_yaml(tmp_path / "train.yaml", ckpt_dir=str(tmp_path / "ckpt"), max_steps=8, ckpt_interval=4)
    command = [*_two_process_ddp(path), "--max_steps", "4"]
    run_to_end(command, trainer_env, tmp_path / "two.log")
    run = run_to_end([*TRAINER, "--config", str(path)], trainer_env, tmp_path / "one.log")
    assert "note: the global batch changed since that checkpoint (8 -> 4 sequences per step" in run.output()


def test_two_nodes_need_checkpoints_and_model_on_node_0_only_and_survive_no_lost_node(
    tmp_path, train_yaml, trainer_env
):
    port = free_port()
    ckpt_dir = tmp_path / "ckpt"
    node0 = train_yaml(tmp_path / "node0.yaml", ckpt_dir=str(ckpt_dir), max_steps=200, log_interval=5)
    # Node 1 has neither the checkpoint folder nor the base model.
    node1 = train_yaml(
        tmp_path / "node1.yaml",
        ckpt_dir=str(tmp_path / "absent"),
        max_steps=200,
        param_path=str(tmp_path / "no-model"),
        log_interval=5,
    )
    runs = [Run([*node_command(0, port), "--config", str(node0)], _node_env(trainer_env, 0), tmp_path / "n0.log")]
    runs.append(Run([*node_command(1, port), "--config", str(node1)], _node_env(trainer_env, 1), tmp_path / "n1.log"))
    try:
        # The periodic checkpoint of step 20 is agreed by both nodes and written in the background; wait until
        # it is published, so that the restart below has something to resume from.
        wait_for(lambda: latest_complete_checkpoint(ckpt_dir) is not None, runs[0], timeout=180)
        assert not (tmp_path / "absent").exists()
        # Node 1 dies at once (a host reboot): node 0 names it and exits non-zero within the timeout.
        runs[1].kill()
        lost_at = time.monotonic()
        code = runs[0].proc.wait(timeout=30)
        elapsed = time.monotonic() - lost_at
    finally:
        for run in runs:
            run.kill()
    assert code != 0
    assert elapsed <= 10, elapsed
    assert "lost node 1" in runs[0].output()
    assert "starting from base model" in runs[0].output()

    # Both started again: node 0 resumes and sends the checkpoint to node 1, which still has none.
    port = free_port()
    finish = ["--max_steps", "40"]
    runs = [
        Run(
            [*node_command(node, port), "--config", str(config), *finish],
            _node_env(trainer_env, node),
            tmp_path / f"again{node}.log",
        )
        for node, config in ((0, node0), (1, node1))
    ]
    codes = [run.wait(timeout=300) for run in runs]
    assert codes == [0, 0], runs[0].output() + runs[1].output()
    assert "resumed from" in runs[0].output() and latest_complete_checkpoint(ckpt_dir).step == 40
    assert not (tmp_path / "absent").exists()


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_a_stop_on_node_1_stops_both_nodes_with_one_emergency_checkpoint(tmp_path, train_yaml, trainer_env, backend):
    port = free_port()
    ckpt_dir = tmp_path / "ckpt"
    path = train_yaml(tmp_path / "train.yaml", ckpt_dir=str(ckpt_dir), max_steps=200, log_interval=5)
    # Node 1 starts first: nodes may start in any order.
    runs = {
        node: Run(
            [*node_command(node, port, backend), "--config", str(path)],
            _node_env(trainer_env, node),
            tmp_path / f"n{node}.log",
        )
        for node in (1, 0)
    }
    try:
        wait_for(lambda: metrics_step(ckpt_dir) >= 20, runs[0], timeout=180)
        (worker,) = runs[1].workers().values()
        os.kill(worker, signal.SIGTERM)
        codes = [runs[node].proc.wait(timeout=60) for node in (0, 1)]
    finally:
        for run in runs.values():
            run.kill()
    assert codes == [0, 0], runs[0].output() + runs[1].output()
    reasons = [c.meta.reason for c in list_complete_checkpoints(ckpt_dir)]
    assert reasons.count("emergency") == 1 and reasons[-1] == "emergency"
    assert "stop requested (on another rank)" in runs[0].output()


def test_state_travels_as_a_skeleton_and_tensors_in_order():
    import torch

    from astrai.trainer.checkpoint.files import Progress
    from astrai.trainer.launch.distributed import _fill_tensors, _slots, _strip_tensors

    state = {
        "progress": Progress(step=3),
        "weights": {"a": torch.arange(6).view(2, 3), "b": torch.ones(2)},
        "optimizer": {"state": {"a": {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]},
    }
    tensors: list = []
    skeleton = _strip_tensors(state, tensors)
    assert [slot.shape for slot in _slots(skeleton)] == [(2, 3), (2,), ()]
    received = _fill_tensors(skeleton, [torch.zeros_like(t) + t for t in tensors])
    assert received["progress"] == Progress(step=3) and received["optimizer"]["param_groups"] == [{"lr": 0.1}]
    assert torch.equal(received["weights"]["a"], state["weights"]["a"])
    assert torch.equal(received["optimizer"]["state"]["a"]["step"], torch.tensor(3.0))
