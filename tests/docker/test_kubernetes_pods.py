"""The rendered Kubernetes Job, run for two indexes on the local engine exactly as its pod spec states them.

No cluster is reachable here. What a kubelet would do with the Job's pod template
is done with `docker run`: the image, the args, every env entry (the two
``fieldRef`` ones filled in as Kubernetes fills them: the completion index and the
Job's uid), the user and group, no capabilities, no privilege escalation, a
read-only root, each volume mounted where the spec mounts it (claims as host
folders, the ConfigMap as the file, emptyDirs as tmpfs), and node 0's DNS name
pointing at this host. The two pods must train, checkpoint, stop gracefully within
the grace period, and resume to the end when "the Job" runs them again.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import uuid

import pytest
import yaml

from astrai.common.contract import EXIT_STOPPED_UNFINISHED
from astrai.host import compose, kubernetes
from astrai.host.runtime import resolve_runtime

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


def _docker_run(job, documents: list[dict], index: int, controller_uid: str, name: str) -> list[str]:
    config_map, service, job_object = documents
    pod = job_object["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    security, pod_security = container["securityContext"], pod["securityContext"]
    command = ["docker", "run", "--detach", "--name", name, "--network", "host"]
    command += ["--label", f"com.docker.compose.project={job.project}"]  # so the shared tear-down finds it
    command += ["--user", f"{pod_security['runAsUser']}:{pod_security['runAsGroup']}"]
    command += ["--group-add", str(pod_security["fsGroup"])]
    if security["capabilities"]["drop"] == ["ALL"]:
        command += ["--cap-drop", "ALL"]
    if security["allowPrivilegeEscalation"] is False:
        command += ["--security-opt", "no-new-privileges:true"]
    if security["readOnlyRootFilesystem"]:
        command.append("--read-only")
    command += ["--stop-timeout", str(pod["terminationGracePeriodSeconds"])]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    claims = {"corpus": job.folder / "data", "base-model": job.folder / "params", "runs": job.folder / "checkpoints"}
    config_file = job.folder / "configmap-train.yaml"
    config_file.write_text(config_map["data"]["train.yaml"], encoding="utf-8")
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]
            read_only = mount.get("readOnly") or claim.get("readOnly")
            command += ["--mount", f"type=bind,src={claims[claim['claimName']]},dst={mount['mountPath']}"]
            command[-1] += ",readonly" if read_only else ""
        elif "configMap" in volume:
            assert volume["configMap"]["name"] == config_map["metadata"]["name"] and mount["subPath"] == "train.yaml"
            command += ["--mount", f"type=bind,src={config_file},dst={mount['mountPath']},readonly"]
        else:
            assert "emptyDir" in volume, volume
            command += ["--tmpfs", f"{mount['mountPath']}:exec,mode=1777"]
    for item in container["env"]:
        if "value" in item:
            value = item["value"]
        else:
            path = item["valueFrom"]["fieldRef"]["fieldPath"]
            value = {
                f"metadata.annotations['{kubernetes.INDEX_ANNOTATION}']": str(index),
                f"metadata.labels['{kubernetes.CONTROLLER_UID_LABEL}']": controller_uid,
            }[path]
        command += ["--env", f"{item['name']}={value}"]
    # The headless Service's DNS name of pod 0, as the cluster's DNS would answer it.
    pod0 = f"{job_object['metadata']['name']}-0.{service['metadata']['name']}.{job_object['metadata']['namespace']}.svc"
    command += ["--add-host", f"{pod0}:127.0.0.1"]
    return [*command, container["image"], *container.get("args", [])]


def test_the_rendered_pod_spec_trains_two_indexes_stops_gracefully_and_resumes(make_job, request):
    if not _port_free(kubernetes.RENDEZVOUS_PORT):
        pytest.skip(f"port {kubernetes.RENDEZVOUS_PORT} (the manifest's rendezvous port) is in use on this host")
    job = make_job(
        runtime={
            "nodes": {"count": 2, "network_interface": "lo"},
            "container": {"stop_grace_period": "70s"},
            "environment": {"OMP_NUM_THREADS": "1"},
        },
        trainer={"training": {"max_steps": 60}, "ckpt": {"ckpt_interval": 10}, "log": {"log_interval": 1}},
    )
    document = yaml.safe_load(job.config.read_text())
    image = f"{compose.project_name(job.name, 0)}-{compose.SERVICE}"
    started: list[str] = []

    def remove_pods_and_image() -> None:  # pass or fail
        if started:
            subprocess.run(["docker", "rm", "-f", *started], capture_output=True)
        subprocess.run(["docker", "image", "rm", "--force", image], capture_output=True)

    request.addfinalizer(remove_pods_and_image)
    document["runtime"]["kubernetes"] = {
        "namespace": "ml",
        "image": image,
        "claims": {"data": "corpus", "model": "base-model", "checkpoints": "runs"},
    }
    job.config.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    node0 = resolve_runtime(job.config)
    assert compose.image_name(node0) == image
    job.invoke("init")
    # The image a user pushes: the one `invoke build` makes (here node 0's, on this engine).
    compose.write_override(node0)
    built = subprocess.run(compose.compose_command(node0, "build", compose.SERVICE), capture_output=True, text=True)
    assert built.returncode == 0, built.stdout + built.stderr
    runtime = resolve_runtime(job.config)
    documents = [
        d for d in yaml.safe_load_all(job.invoke("render", "--kubernetes", "--", "--log_interval", "1").stdout)
    ]
    documents = [d for d in documents if d]
    pod_security = documents[2]["spec"]["template"]["spec"]["securityContext"]
    # What fsGroup does to a claim: the pod's group may write it.
    os.chown(job.folder / "checkpoints", pod_security["runAsUser"], pod_security["fsGroup"])
    os.chown(runtime.job_dir, pod_security["runAsUser"], pod_security["fsGroup"])

    def run_pods(round_: int) -> list[str]:
        controller_uid = str(uuid.uuid4())  # a Job created again gets a new uid, so a fresh rendezvous
        names = [f"{job.name}-pod{index}-{round_}-{secrets.token_hex(2)}" for index in (0, 1)]
        started.extend(names)
        for index in (1, 0):  # pods start in any order
            subprocess.run(
                _docker_run(job, documents, index, controller_uid, names[index]), check=True, capture_output=True
            )
        return names

    def logs(names) -> str:
        return "".join(subprocess.run(["docker", "logs", n], capture_output=True, text=True).stdout for n in names)

    def exit_codes(names) -> list[int]:
        codes = []
        for name in names:
            subprocess.run(["docker", "wait", name], capture_output=True, timeout=600)
            state = subprocess.run(
                ["docker", "inspect", "-f", "{{.State.ExitCode}}", name], capture_output=True, text=True
            )
            codes.append(int(state.stdout.strip()))
        return codes

    first = run_pods(1)
    job.wait_for(
        "a periodic checkpoint at step 10", lambda: job.checkpoints() and job.progress_step() >= 12, timeout=600
    )
    # The kubelet's stop: SIGTERM to every pod, SIGKILL after terminationGracePeriodSeconds.
    subprocess.run(["docker", "stop", *first], check=True, capture_output=True, timeout=120)
    # A graceful stop short of the end exits with its own code, which the Job's podFailurePolicy retries
    # without counting it (an evicted pod is never taken for a finished one).
    assert exit_codes(first) == [EXIT_STOPPED_UNFINISHED] * 2, logs(first)
    assert job.checkpoints()[-1][1] == "emergency", logs(first)
    assert "node 0 of 2" in logs(first[:1]) and "node 1 of 2" in logs(first[1:])

    second = run_pods(2)
    assert exit_codes(second) == [0, 0], logs(second)
    assert "resumed from" in logs(second[:1])
    assert job.checkpoints()[-1] == (60, "final")
