"""Kubernetes: the job as manifests (`invoke render --kubernetes`), for any cluster or for Kubeflow Trainer.

Without an operator: a ConfigMap holding train.yaml, a headless Service and an
Indexed Job with one pod per node (``runtime.nodes.count``). A pod's node rank
is its completion index; node 0 is reached at ``<job>-0.<service>`` (the
Service gives the pods DNS names), and the rendezvous id is the Job's uid, so a
Job created again under the same name never meets the old one's store.

With ``--trainjob``: a Kubeflow Trainer ``TrainJob`` (API
``trainer.kubeflow.org/v1alpha1`` as Kubeflow Trainer v2.3.0 serves it, on its
``torch-distributed`` ClusterTrainingRuntime) plus the ConfigMap. The runtime
gives each pod PET_NODE_RANK, PET_NNODES and PET_MASTER_ADDR/PORT, which the
entrypoint takes when the ASTRAI_ names are unset.

Both carry what the Docker job has: GPU limits (``nvidia.com/gpu``), a grace
period of ``stop_grace_period`` (Kubernetes' 30 s default would cut the
emergency checkpoint short), ``/dev/shm`` in memory, a non-root user without
capabilities on a read-only root file system with writable scratch, and
``max_restarts`` as the Job's back-off limit.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import yaml

from astrai.common.config import HOST_SECTION, trainer_sections
from astrai.common.configfile import load_yaml
from astrai.common.contract import (
    CONTAINER_HOME,
    ENV_NODE_RANK,
    ENV_RDZV_ENDPOINT,
    ENV_RDZV_ID,
    ENV_STOPPED_EXIT_CODE,
    EXIT_STOPPED_UNFINISHED,
    LABEL_JOB,
)
from astrai.common.errors import AstraiError
from astrai.host import compose, launch
from astrai.host.hostuser import host_user_ids
from astrai.host.runtime import Runtime

RENDEZVOUS_PORT = 29500
TRAINJOB_API = "trainer.kubeflow.org/v1alpha1"
TRAINER_VERSION = "v2.3.0"
"""The Kubeflow Trainer release whose TrainJob schema the manifests are checked against (schema/)."""
TRAINJOB_RUNTIME = "torch-distributed"
TRAINJOB_SCHEMA_PATH = Path(__file__).parent / f"trainjob-{TRAINER_VERSION}.schema.json"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
CONTROLLER_UID_LABEL = "batch.kubernetes.io/controller-uid"
CONTAINER_NAME = "trainer"
TRAINJOB_CONTAINER = "node"
"""The container torch-distributed's pods run the trainer in."""
SHM_SIZE = "16Gi"
"""Ceiling of the in-memory /dev/shm (counts against the pod's memory)."""
DEFAULT_UID = 1000
"""The pod's user when the manifests are rendered as root (a pod may not run as root here)."""


CONFIG_KEY = "train.yaml"
"""The key of the job's ConfigMap that the pods mount at the config's container path."""


class KubernetesError(AstraiError):
    exit_code = 2


def object_name(job_name: str) -> str:
    """A DNS label for the job's objects (at most 52 characters, so ``<name>-<index>`` stays a valid host name)."""
    cleaned = re.sub(r"[^a-z0-9-]+", "-", job_name.lower()).strip("-")
    name = f"astrai-{cleaned}"
    if cleaned != job_name or len(name) > 52:
        digest = hashlib.sha256(job_name.encode()).hexdigest()[:8]
        name = f"{name[:43].rstrip('-')}-{digest}"
    return name


def render_manifests(runtime: Runtime, trainer_args: list[str] = (), *, trainjob: bool = False) -> list[dict]:
    """Every object of the job, in the order `kubectl apply` should create them."""
    settings = kubernetes_settings(runtime)
    name = object_name(runtime.job_name)
    config = config_map(runtime, name)
    if trainjob:
        return [config, _trainjob(runtime, name, list(trainer_args))]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(runtime, name),
        "spec": {
            "clusterIP": "None",
            # Node 0's name must resolve before its pod is ready: the others look it up while it starts.
            "publishNotReadyAddresses": True,
            "selector": {LABEL_JOB: runtime.job_name},
            "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT}],
        },
    }
    env = environment(runtime, trainer_args)
    env += [
        _from_field(ENV_NODE_RANK, f"metadata.annotations['{INDEX_ANNOTATION}']"),
        {"name": ENV_RDZV_ENDPOINT, "value": f"{name}-0.{name}.{settings.namespace}.svc:{RENDEZVOUS_PORT}"},
        _from_field(ENV_RDZV_ID, f"metadata.labels['{CONTROLLER_UID_LABEL}']"),
    ]
    pod = pod_spec(runtime, name, CONTAINER_NAME, env, list(trainer_args))
    pod["subdomain"] = name
    pod["restartPolicy"] = "Never"
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata(runtime, name),
        "spec": {
            "completionMode": "Indexed",
            "completions": runtime.node_count,
            "parallelism": runtime.node_count,
            # A failed pod is replaced (and resumes from the newest checkpoint) at most max_restarts times.
            "backoffLimit": runtime.max_restarts,
            # A pod the cluster took away (evicted, drained, preempted) stops gracefully with its own exit code, or
            # is marked as disrupted: both are replaced without counting toward backoffLimit, never taken for done.
            "podFailurePolicy": {
                "rules": [
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                    {
                        "action": "Ignore",
                        "onExitCodes": {
                            "containerName": CONTAINER_NAME,
                            "operator": "In",
                            "values": [EXIT_STOPPED_UNFINISHED],
                        },
                    },
                ]
            },
            "template": {"metadata": {"labels": {LABEL_JOB: runtime.job_name}}, "spec": pod},
        },
    }
    return [config, service, job]


def _from_field(name: str, path: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def dump_manifests(runtime: Runtime, objects: list[dict]) -> str:
    header = f"# Generated by `invoke render --kubernetes` from {runtime.config_path}; apply with kubectl apply -f.\n"
    # Every string double-quoted: no reader may take an argument such as 1e-3 for a number.
    body = yaml.dump_all(
        objects, Dumper=compose.QuotingDumper, sort_keys=False, allow_unicode=True, explicit_start=True, width=1000
    )
    return header + body


def kubernetes_settings(runtime: Runtime):
    settings = runtime.kubernetes
    if settings is None:
        raise KubernetesError(
            f"{runtime.config_path}: runtime.kubernetes: missing: add a runtime.kubernetes block with image and "
            "claims (data, model, checkpoints) to render this job for Kubernetes"
        )
    problems = []
    if settings.image is None:
        problems.append(
            "runtime.kubernetes.image: missing: the image in your registry (push what `invoke build` makes), "
            "such as registry.example/astrai-train:v1"
        )
    problems += [
        f"runtime.kubernetes.claims.{key}: missing: the persistent volume claim mounted at {target}"
        for key, target in ((mount.key, mount.target) for mount in launch.mounts(runtime) if mount.key != "config")
        if settings.claims.get(key) is None
    ]
    if runtime.devices == "all":
        problems.append(
            "runtime.gpu.devices: all cannot be a Kubernetes GPU request; list the GPUs each pod takes, "
            "such as [0, 1, 2, 3] for four"
        )
    problems += [
        f"runtime.environments.{server.name}.build: Kubernetes pulls images: build it, push it to your registry and "
        "give image: instead"
        for server in runtime.environments
        if server.build is not None
    ]
    if problems:
        raise KubernetesError("\n".join(f"{runtime.config_path}: {problem}" for problem in problems))
    return settings


def metadata(runtime: Runtime, name: str) -> dict:
    return {"name": name, "namespace": runtime.kubernetes.namespace, "labels": {LABEL_JOB: runtime.job_name}}


def config_map(runtime: Runtime, name: str) -> dict:
    """train.yaml as the pods' trainer reads it: its trainer sections only, written anew. The host's ``runtime:``
    block and the file's comments (an old token in a comment, say) are not published to the cluster."""
    trainer_sections(runtime.config_path)  # refuses what the trainer would refuse, before anything is written
    sections = {key: value for key, value in load_yaml(runtime.config_path).items() if key != HOST_SECTION}
    text = f"# Generated by `invoke render --kubernetes` from {runtime.config_path.name}: its trainer sections.\n"
    text += yaml.safe_dump(sections, sort_keys=True, allow_unicode=True) if sections else ""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(runtime, f"{name}-config"),
        "data": {CONFIG_KEY: text},
    }


def literal(text: str) -> str:
    """A string Kubernetes passes on as written: it expands ``$(VAR)`` in a container's env values, command and
    args, and ``$$(`` is its escape for a literal ``$(``."""
    return text.replace("$(", "$$(")


def environment(runtime: Runtime, trainer_args: list[str] | tuple[str, ...] = ()) -> list[dict]:
    """The container's environment as the Docker job has it, minus what each pod takes from Kubernetes."""
    # Each pod's rank and the rendezvous come from the Job (below); the device plugin decides which GPUs it sees.
    spec = launch.scheduler_spec(runtime, trainer_args)
    env = spec.environment
    # A pod stopped short of the end (an eviction, a drain, a preemption) exits non-zero, and is retried.
    env[ENV_STOPPED_EXIT_CODE] = str(EXIT_STOPPED_UNFINISHED)
    # The trackers' variables and the judges' keys come from the job's Secret, by name; a key the Secret lacks is
    # left unset.
    secret = {name for name in spec.secrets if env.get(name) is None}
    passed = [key for key, value in env.items() if value is None and key not in secret]
    if passed:
        raise KubernetesError(
            f"{runtime.config_path}: runtime.environment.{passed[0]}: null passes a variable through from your shell, "
            "which a pod does not have; give it a value (or a Secret by editing the manifest)"
        )
    return [
        _from_secret(key, tracker_secret_name(runtime)) if key in secret else {"name": key, "value": literal(value)}
        for key, value in sorted(env.items())
    ]


def tracker_secret_name(runtime: Runtime) -> str:
    """The Secret a job's pods read their trackers' variables from (``kubectl create secret generic NAME
    --from-literal=WANDB_API_KEY=...``): the job's object name and ``-trackers``."""
    return f"{object_name(runtime.job_name)}-trackers"


def _from_secret(name: str, secret: str) -> dict:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": name, "optional": True}}}


def _resources(runtime: Runtime) -> dict:
    if not runtime.uses_gpu:
        return {}
    count = str(len(runtime.devices))
    return {"limits": {"nvidia.com/gpu": count}}


def _volume_mount(mount: launch.Mount) -> dict:
    """A mount of the spec as the pod's volume of the same name mounts it (the YAML from the job's ConfigMap)."""
    entry = {"name": mount.key, "mountPath": mount.target}
    if mount.key == "config":
        entry["subPath"] = CONFIG_KEY
    if mount.read_only:
        entry["readOnly"] = True
    return entry


def pod_spec(runtime: Runtime, name: str, container: str, env: list[dict], trainer_args: list[str]) -> dict:
    settings = runtime.kubernetes
    uid, gid = host_user_ids()
    if uid == 0:
        uid, gid = DEFAULT_UID, DEFAULT_UID
    scratch = [("tmp", "/tmp"), ("home", CONTAINER_HOME)]
    trainer = {
        "name": container,
        "image": settings.image,
        "env": env,
        "ports": [{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT}],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
        },
        "volumeMounts": [
            *(_volume_mount(mount) for mount in launch.mounts(runtime)),
            {"name": "dshm", "mountPath": "/dev/shm"},
            *({"name": volume, "mountPath": path} for volume, path in scratch),
        ],
    }
    if trainer_args:
        trainer["args"] = [literal(arg) for arg in trainer_args]
    resources = _resources(runtime)
    if resources:
        trainer["resources"] = resources
    claims = settings.claims
    pod = {
        # Kubernetes waits this long after SIGTERM before SIGKILL: the emergency checkpoint's time.
        "terminationGracePeriodSeconds": runtime.stop_grace_seconds,
        "securityContext": {"runAsUser": uid, "runAsGroup": gid, "fsGroup": gid, "runAsNonRoot": True},
        "containers": [trainer],
        "volumes": [
            {"name": "data", "persistentVolumeClaim": {"claimName": claims["data"], "readOnly": True}},
            {"name": "model", "persistentVolumeClaim": {"claimName": claims["model"], "readOnly": True}},
            {"name": "checkpoints", "persistentVolumeClaim": {"claimName": claims["checkpoints"]}},
            {"name": "config", "configMap": {"name": f"{name}-config"}},
            # Docker's 64 MB /dev/shm default breaks NCCL and DataLoader workers; Kubernetes' is no bigger.
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}},
            *({"name": volume, "emptyDir": {}} for volume, _ in scratch),
        ],
    }
    if runtime.environments:
        # Native sidecars (init containers that keep running): they start before the trainer, which reaches them on
        # localhost, and stop when it ends, so the pod completes with it.
        pod["initContainers"] = [_sidecar(server, trainer["securityContext"]) for server in runtime.environments]
    if settings.node_selector:
        pod["nodeSelector"] = dict(settings.node_selector)
    if settings.tolerations:
        pod["tolerations"] = [dict(item) for item in settings.tolerations]
    return pod


def _sidecar(server, security: dict) -> dict:
    """A server environment beside the trainer in its pod, hardened as the trainer is, with a scratch /tmp."""
    return {
        "name": launch.environment_service(server),
        "image": server.image,
        "restartPolicy": "Always",
        "ports": [{"name": f"env-{server.port}", "containerPort": server.port}],
        "securityContext": dict(security),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }


def _trainjob(runtime: Runtime, name: str, trainer_args: list[str]) -> dict:
    """A TrainJob on torch-distributed: its trainer is our entrypoint, its pods patched like the Job's."""
    if runtime.environments:
        raise KubernetesError(
            f"{runtime.config_path}: runtime.environments: a TrainJob's runtime owns its pods' containers, so the "
            "server environments cannot join them; render the Indexed Job (without --trainjob)"
        )
    pod = pod_spec(runtime, name, TRAINJOB_CONTAINER, [], trainer_args)
    container = pod["containers"][0]
    trainer = {
        "image": runtime.kubernetes.image,
        "command": ["python3", "-m", "astrai.trainer.entrypoint"],
        "numNodes": runtime.node_count,
        # No ENV_STOPPED_EXIT_CODE: a TrainJob's runtime has no failure policy that would retry an exit of 76.
        "env": [item for item in environment(runtime, trainer_args) if item["name"] != ENV_STOPPED_EXIT_CODE],
    }
    if trainer_args:
        trainer["args"] = [literal(arg) for arg in trainer_args]
    if container.get("resources"):
        trainer["resourcesPerNode"] = container["resources"]
    patch = {
        key: pod[key]
        for key in ("terminationGracePeriodSeconds", "securityContext", "volumes", "nodeSelector", "tolerations")
        if key in pod
    }
    patch["containers"] = [
        {
            "name": TRAINJOB_CONTAINER,
            "securityContext": container["securityContext"],
            "volumeMounts": container["volumeMounts"],
        }
    ]
    return {
        "apiVersion": TRAINJOB_API,
        "kind": "TrainJob",
        "metadata": metadata(runtime, name),
        "spec": {
            "runtimeRef": {
                "name": TRAINJOB_RUNTIME,
                "kind": "ClusterTrainingRuntime",
                "apiGroup": "trainer.kubeflow.org",
            },
            "trainer": trainer,
            "runtimePatches": [
                {
                    "manager": "astrai.ai/invoke-render",
                    "trainingRuntimeSpec": {
                        "template": {
                            "spec": {
                                "replicatedJobs": [
                                    {"name": "node", "template": {"spec": {"template": {"spec": patch}}}}
                                ]
                            }
                        }
                    },
                }
            ],
        },
    }


def trainjob_schema() -> dict:
    """The openAPIV3Schema of Kubeflow Trainer's TrainJob CRD at TRAINER_VERSION (vendored under schema/)."""
    return json.loads(TRAINJOB_SCHEMA_PATH.read_text(encoding="utf-8"))
