"""Preflight on each node of a multi-node job: rendezvous, interface, port; and what status says about the node."""

from __future__ import annotations

import socket

import yaml

from astrai.host import engine, preflight, status
from astrai.host.runtime import resolve_runtime
from tests.support import free_port, write_config


def _runtime(tmp_path, node: int, rendezvous: str, interface: str | None = None):
    nodes = {"count": 2, "rendezvous": rendezvous}
    if interface is not None:
        nodes["network_interface"] = interface
    runtime = {"gpu": {"devices": "none"}, "container": {"cuda_tag": "cpu"}, "nodes": nodes}
    return resolve_runtime(write_config(tmp_path, runtime), node)


def _listening() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    return server


def test_node_0_needs_its_port_free(tmp_path):
    port = free_port()
    checks = preflight.node_checks(_runtime(tmp_path, 0, f"localhost:{port}", "lo"))
    assert [(c.mark, c.name) for c in checks] == [
        (preflight.PASS, "rendezvous"),
        (preflight.PASS, "network interface"),
        (preflight.PASS, "rendezvous port"),
    ]
    with _listening() as server:
        busy = server.getsockname()[1]
        (*_, port_check) = preflight.node_checks(_runtime(tmp_path, 0, f"127.0.0.1:{busy}"))
    assert port_check.failed and f"port {busy} is in use on node 0" in port_check.detail


def test_other_nodes_only_warn_when_node_0_is_not_up_yet(tmp_path):
    port = free_port()
    (_, reach) = preflight.node_checks(_runtime(tmp_path, 1, f"127.0.0.1:{port}"))
    assert reach.mark == preflight.WARN and not reach.failed and "does not answer yet" in reach.detail
    assert "any order" in preflight.format_checklist([reach])
    with _listening() as server:
        (_, reach) = preflight.node_checks(_runtime(tmp_path, 1, f"127.0.0.1:{server.getsockname()[1]}"))
    assert reach.mark == preflight.PASS


def test_an_unknown_host_or_interface_fails(tmp_path):
    (bad_host,) = preflight.node_checks(_runtime(tmp_path, 1, "no-such-host.invalid:29500"))
    assert bad_host.failed and "no-such-host.invalid does not resolve" in bad_host.detail
    checks = preflight.node_checks(_runtime(tmp_path, 1, f"127.0.0.1:{free_port()}", "nosuch0"))
    interface = next(c for c in checks if c.name == "network interface")
    assert interface.failed and "nosuch0 does not exist on this host" in interface.detail and "lo" in interface.detail


def test_other_nodes_need_no_base_model_but_a_folder_to_mount(tmp_path):
    runtime = _runtime(tmp_path, 1, "127.0.0.1:29500")
    _, check = preflight._model_check(runtime, None)
    assert check.mark == preflight.FAIL and "every node mounts it" in check.detail and "invoke init" in check.hint
    runtime.model_dir.mkdir(parents=True)  # empty: nothing on it is read on node 1
    _, check = preflight._model_check(runtime, None)
    assert check.mark == preflight.SKIP and "not needed on node 1" in check.detail


def test_status_names_the_node_and_the_world_size(tmp_path, monkeypatch):
    monkeypatch.setattr(engine, "find_container", lambda project: None)
    lines = status.format_status(status.job_status(_runtime(tmp_path, 1, "10.0.0.1:29500")))
    assert (
        "node        1 of 2, world size 2 (1 process(es) on each of 2 node(s)); rendezvous 10.0.0.1:29500 "
        "(static)" in lines
    )


def test_sharded_checkpoints_on_several_nodes_ask_for_a_shared_file_system(tmp_path, monkeypatch):
    from astrai.common.config import CkptSection, ParallelSection, TrainerConfig

    def runtime(mode: str):
        path = tmp_path / "train.yaml"
        gpu = {"devices": "none", "processes": 2, "parallel_mode": mode}
        nodes = {"count": 2, "rendezvous": "127.0.0.1:29400"}
        path.write_text(yaml.safe_dump({"runtime": {"gpu": gpu, "container": {"cuda_tag": "cpu"}, "nodes": nodes}}))
        return resolve_runtime(path, 0)

    fsdp, ddp = runtime("fsdp"), runtime("ddp")
    default, full = TrainerConfig(), TrainerConfig(ckpt=CkptSection(format="full"))
    # The runtime's mode decides the default format, as the entrypoint passes it on to the trainer.
    assert preflight.shared_checkpoints_check(ddp, default).detail.startswith("ckpt.format full: only node 0")
    assert preflight.shared_checkpoints_check(fsdp, full).mark == preflight.PASS
    sharded = TrainerConfig(parallel=ParallelSection(parallel_mode="ddp"), ckpt=CkptSection(format="sharded"))
    for config in (default, sharded):
        check = preflight.shared_checkpoints_check(fsdp if config is default else ddp, config)
        assert check.mark == preflight.WARN and not check.failed
        assert "one shared file system on all 2 nodes" in check.detail and "local" in check.detail
        assert "ckpt.format: full" in check.hint
    # On a network file system it passes, still saying what it needs.
    mountinfo = tmp_path / "mountinfo"
    where = fsdp.checkpoints_dir
    where.mkdir(parents=True, exist_ok=True)
    mountinfo.write_text(
        f"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
        f"90 22 0:51 / {str(where).replace(' ', chr(92) + '040')} rw - nfs4 server:/ckpt rw\n"
    )
    monkeypatch.setattr(preflight, "MOUNTINFO", mountinfo)
    check = preflight.shared_checkpoints_check(fsdp, default)
    assert check.mark == preflight.PASS and "(here: nfs4)" in check.detail
    mountinfo.write_text(f"90 22 0:51 / {where} rw - fuse.gcsfuse bucket rw\n")
    check = preflight.shared_checkpoints_check(fsdp, default)
    assert check.mark == preflight.WARN and "fuse.gcsfuse mount" in check.detail
