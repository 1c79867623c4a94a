"""`invoke render --kubernetes`: manifests that pass the Kubernetes API's schemas and the TrainJob CRD's.

No API server can be had here, so every rendered object goes through
kubernetes-validate in strict mode (unknown fields are errors, as with
``kubectl apply --validate=strict``) and the TrainJob through the openAPIV3Schema
vendored from Kubeflow Trainer v2.3.0, with unknown fields refused the same way.
Each validator is first shown to refuse a broken object, so a pass means something.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from astrai.common.contract import (
    ENV_NODE_RANK,
    ENV_PROCESSES,
    ENV_RDZV_ENDPOINT,
    ENV_RDZV_ID,
    ENV_STOPPED_EXIT_CODE,
    EXIT_STOPPED_UNFINISHED,
)
from astrai.host import kubernetes
from astrai.host.runtime import resolve_runtime
from tests.support import REPO, write_config

K8S_VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())
"""The oldest Kubernetes with everything the Job uses (pod index label, controller-uid label), and the newest."""


def _runtime(tmp_path: Path, *, gpu=None, nodes=2, kube=None, container=None, environment=None, name="My_Job.v2"):
    block = {
        "job_name": name,
        "gpu": gpu or {"devices": [0, 1]},
        "container": {
            "cuda_tag": "cpu" if (gpu or {}).get("devices") == "none" else "cu128",
            "stop_grace_period": "10m",
            "stop_timeout_seconds": 500,
            "max_restarts": 3,
            **(container or {}),
        },
        "nodes": {"count": nodes},
        "kubernetes": {
            "namespace": "ml",
            "image": "registry.example/astrai-train:v1",
            "claims": {"data": "corpus", "model": "base-model", "checkpoints": "ckpts"},
            "node_selector": {"nvidia.com/gpu.product": "A100"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            **(kube or {}),
        },
    }
    if environment is not None:
        block["environment"] = environment
    return resolve_runtime(write_config(tmp_path, block, {"training": {"max_steps": 100}}))


def _rendered(runtime, args=(), trainjob=False) -> list[dict]:
    """The manifests as a cluster reads them: from the text `invoke render --kubernetes` prints."""
    text = kubernetes.dump_manifests(runtime, kubernetes.render_manifests(runtime, list(args), trainjob=trainjob))
    return [document for document in yaml.safe_load_all(text) if document is not None]


def _validate_k8s(document: dict) -> None:
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(document, version, strict=True)


def _closed(schema):
    """The CRD schema with unknown fields refused wherever it lists the fields (the API server prunes them)."""
    if isinstance(schema, dict):
        schema = {key: _closed(value) for key, value in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    return schema


def _trainjob_errors(document: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(_closed(kubernetes.trainjob_schema()))
    return [f"{'.'.join(map(str, error.absolute_path))}: {error.message}" for error in validator.iter_errors(document)]


def _pod(documents: list[dict]) -> dict:
    (job,) = [document for document in documents if document["kind"] == "Job"]
    return job["spec"]["template"]["spec"]


def _env(container: dict) -> dict:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container["env"]}


def test_the_validators_refuse_a_broken_object(tmp_path):
    documents = _rendered(_runtime(tmp_path))
    job = copy.deepcopy(next(document for document in documents if document["kind"] == "Job"))
    job["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["mountPth"] = "/data"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_k8s(job)
    job = copy.deepcopy(next(document for document in documents if document["kind"] == "Job"))
    job["spec"]["completions"] = "2"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_k8s(job)
    (trainjob,) = [d for d in _rendered(_runtime(tmp_path), trainjob=True) if d["kind"] == "TrainJob"]
    trainjob["spec"]["trainer"]["numNodes"] = "2"
    trainjob["spec"]["trainer"]["nodes"] = 2
    errors = _trainjob_errors(trainjob)
    assert any("numNodes" in error for error in errors) and any("'nodes'" in error for error in errors), errors


@pytest.mark.parametrize(
    "gpu, nodes",
    [({"devices": [0, 1]}, 2), ({"devices": [0]}, 1), ({"devices": "none", "processes": 2}, 3)],
    ids=["2-gpus-2-nodes", "1-gpu-1-node", "cpu-3-nodes"],
)
def test_job_service_and_config_map_pass_the_api_schemas(tmp_path, gpu, nodes):
    documents = _rendered(_runtime(tmp_path, gpu=gpu, nodes=nodes), ["--max_lr", "1e-3"])
    assert [document["kind"] for document in documents] == ["ConfigMap", "Service", "Job"]
    for document in documents:
        _validate_k8s(document)


@pytest.mark.parametrize("gpu", [{"devices": [0, 1, 2, 3]}, {"devices": "none"}], ids=["gpus", "cpu"])
def test_trainjob_passes_the_vendored_crd_schema(tmp_path, gpu):
    documents = _rendered(_runtime(tmp_path, gpu=gpu), ["--max_lr", "1e-3"], trainjob=True)
    config, trainjob = documents
    _validate_k8s(config)
    assert trainjob["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and kubernetes.TRAINER_VERSION == "v2.3.0"
    assert _trainjob_errors(trainjob) == []
    spec = trainjob["spec"]
    assert spec["runtimeRef"]["name"] == "torch-distributed" and spec["trainer"]["numNodes"] == 2
    # Each pod patched like the Job's: the vendored schema checks the pod spec inside only as an object,
    # so the patch goes through the Kubernetes PodSpec schema too.
    patch = spec["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    pod = patch["template"]["spec"]["template"]["spec"]
    container = {**pod["containers"][0], "image": spec["trainer"]["image"]}
    _validate_k8s(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {**pod, "containers": [container]}}
    )
    assert pod["terminationGracePeriodSeconds"] == 600
    env = {item["name"]: item["value"] for item in spec["trainer"]["env"]}
    assert ENV_NODE_RANK not in env and ENV_RDZV_ENDPOINT not in env  # from the runtime's PET_ variables
    if gpu["devices"] != "none":
        assert spec["trainer"]["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": "4"}}


def test_the_pod_carries_the_docker_jobs_settings(tmp_path):
    runtime = _runtime(tmp_path, environment={"NCCL_DEBUG": "INFO $x $(HOSTNAME)", "HF_HOME": "/tmp/hf"})
    with runtime.config_path.open("a", encoding="utf-8") as handle:
        handle.write("# WANDB_API_KEY=old-secret-in-a-comment\n")
    documents = _rendered(runtime, ["--max_lr", "1e-3", "--note", "a b $HOME ü $(POD_NAME)"])
    config, service, job = documents
    name = kubernetes.object_name("My_Job.v2")
    pod = _pod(documents)
    (container,) = pod["containers"]
    env = _env(container)
    # Rendezvous: rank from the Job's index, node 0 by the headless Service's DNS name, a fresh id per Job.
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 2
    assert job["spec"]["parallelism"] == 2 and job["spec"]["backoffLimit"] == 3
    # An evicted (or drained, preempted) pod is retried, not counted: a disruption, or a stop short of the end.
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    stopped = {"containerName": container["name"], "operator": "In", "values": [EXIT_STOPPED_UNFINISHED]}
    assert {"action": "Ignore", "onExitCodes": stopped} in rules
    assert env[ENV_STOPPED_EXIT_CODE] == str(EXIT_STOPPED_UNFINISHED)
    assert env[ENV_NODE_RANK] == {
        "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
    }
    assert env[ENV_RDZV_ENDPOINT] == f"{name}-0.{name}.ml.svc:29500"
    assert env[ENV_RDZV_ID] == {"fieldRef": {"fieldPath": "metadata.labels['batch.kubernetes.io/controller-uid']"}}
    assert pod["subdomain"] == service["metadata"]["name"] == name
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == job["spec"]["template"]["metadata"]["labels"]
    # Grace for the emergency checkpoint, memory /dev/shm, the hardening, GPUs.
    assert pod["terminationGracePeriodSeconds"] == 600
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
    }
    assert pod["securityContext"]["runAsUser"] != 0
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "2"}}
    assert "CUDA_VISIBLE_DEVICES" not in env and env["ASTRAI_GPU_DEVICES"] == "all"
    assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "ckpts"}
    assert volumes["data"]["persistentVolumeClaim"] == {"claimName": "corpus", "readOnly": True}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "A100"}
    # Literal values: $ stays, 1e-3 stays a string, and $( is escaped as $$( (Kubernetes expands $(VAR) there).
    assert container["args"] == ["--max_lr", "1e-3", "--note", "a b $HOME ü $$(POD_NAME)"]
    assert env["NCCL_DEBUG"] == "INFO $x $$(HOSTNAME)"
    # The ConfigMap holds the trainer sections only, written anew: no runtime block, no comment.
    published = config["data"]["train.yaml"]
    assert yaml.safe_load(published) == {"training": {"max_steps": 100}}
    assert "runtime" not in published and "old-secret" not in published


def test_a_cpu_job_counts_its_processes_and_asks_for_no_gpu(tmp_path):
    pod = _pod(_rendered(_runtime(tmp_path, gpu={"devices": "none", "processes": 2})))
    (container,) = pod["containers"]
    assert "resources" not in container
    assert _env(container)[ENV_PROCESSES] == "2"


@pytest.mark.parametrize("name", ["My_Job.v2", "a" * 63, "x", "9lives", "job--name"])
def test_object_names_are_dns_labels_with_room_for_the_index(tmp_path, name):
    made = kubernetes.object_name(name)
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", made) and len(made) <= 52
    assert kubernetes.object_name(name.upper()) != made or name.upper() == name
    for document in _rendered(_runtime(tmp_path, name=name)):
        _validate_k8s(document)


def test_what_a_pod_cannot_have_is_refused_naming_the_key(tmp_path):
    with pytest.raises(kubernetes.KubernetesError, match=r"runtime\.gpu\.devices: all"):
        kubernetes.render_manifests(_runtime(tmp_path, gpu={"devices": "all"}))
    with pytest.raises(kubernetes.KubernetesError) as raised:
        kubernetes.render_manifests(_runtime(tmp_path, kube={"image": None, "claims": {"data": "corpus"}}))
    message = str(raised.value)
    for key in ("runtime.kubernetes.image", "runtime.kubernetes.claims.model", "runtime.kubernetes.claims.checkpoints"):
        assert key in message
    with pytest.raises(kubernetes.KubernetesError, match=r"runtime\.environment\.HF_TOKEN"):
        kubernetes.render_manifests(_runtime(tmp_path, environment={"HF_TOKEN": None}))


def test_render_kubernetes_task_prints_yaml_and_refuses_bad_input_without_a_traceback(tmp_path):
    runtime = _runtime(tmp_path)
    task = [sys.executable, "-m", "invoke", "--search-root", str(REPO), "render", "--config", str(runtime.config_path)]
    done = subprocess.run([*task, "--kubernetes", "--", "--max_lr", "1e-3"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert [d["kind"] for d in yaml.safe_load_all(done.stdout) if d] == ["ConfigMap", "Service", "Job"]
    done = subprocess.run([*task, "--kubernetes", "--trainjob"], capture_output=True, text=True)
    assert [d["kind"] for d in yaml.safe_load_all(done.stdout) if d] == ["ConfigMap", "TrainJob"]
    done = subprocess.run([*task, "--trainjob"], capture_output=True, text=True)
    assert done.returncode == 2 and "--trainjob goes with --kubernetes" in done.stderr
    done = subprocess.run([*task, "--kubernetes", "--", "--max_step", "5"], capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "max_step" in done.stderr
    plain = tmp_path / "plain.yaml"
    plain.write_text("runtime: {job_name: p, gpu: {devices: none}, container: {cuda_tag: cpu}}\n", encoding="utf-8")
    env = {**os.environ}
    done = subprocess.run([*task[:-1], str(plain), "--kubernetes"], capture_output=True, text=True, env=env)
    assert done.returncode == 2 and "runtime.kubernetes: missing" in done.stderr and "Traceback" not in done.stderr
