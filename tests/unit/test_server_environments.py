"""Server environments on the host (runtime.environments): what the trainer is told, the Compose service beside it
(the job's own network only, hardened like the trainer), the Kubernetes sidecar, the Slurm step, what the image
installs, and the refusals, each naming the key. The engine's own behaviour is tests/docker/test_agents_job.py's."""

from __future__ import annotations

import json
import subprocess

import kubernetes_validate
import pytest

from astrai.common.contract import ENV_ENVIRONMENTS, EPISODE_PACKAGES, OPENENV_PACKAGE
from astrai.host import compose, kubernetes, launch, slurm_script
from astrai.host.runtime import resolve_runtime
from astrai.host.trainer_config import model_packages_of
from tests.support import REPO, write_config

TRAINER = {
    "training": {
        "train_type": "online_grpo",
        "environment": {"server": "sandbox"},
        "rewards": ["astrai.rewards:exact_answer"],
    }
}


def _runtime(tmp_path, environments=None, **block):
    runtime = {
        "job_name": "agents",
        "gpu": {"devices": "none"},
        "container": {"cuda_tag": "cpu"},
        "environments": environments
        if environments is not None
        else {"sandbox": {"build": "./sandbox", "port": 8000}, "calc": {"image": "calc:1", "port": 9000}},
        **block,
    }
    return resolve_runtime(write_config(tmp_path, runtime, TRAINER))


def test_the_trainer_is_told_where_each_server_is_by_its_service_or_beside_it(tmp_path):
    runtime = _runtime(tmp_path)
    assert [server.name for server in runtime.environments] == ["calc", "sandbox"]
    assert runtime.environments[1].build == tmp_path / "sandbox"  # relative to the YAML's folder
    node = json.loads(launch.node_spec(runtime).environment[ENV_ENVIRONMENTS])
    assert node == {"calc": "http://env-calc:9000", "sandbox": "http://env-sandbox:8000"}
    beside = json.loads(launch.scheduler_spec(runtime).environment[ENV_ENVIRONMENTS])
    assert beside == {"calc": "http://localhost:9000", "sandbox": "http://localhost:8000"}
    assert ENV_ENVIRONMENTS not in launch.node_spec(_runtime(tmp_path / "none", environments={})).environment


def test_each_server_is_a_compose_service_on_the_jobs_network_only_hardened_like_the_trainer(tmp_path):
    runtime = _runtime(tmp_path)
    document = compose.render_override(runtime, uid=1234, gid=5678)
    services = document["services"]
    assert services["trainer"]["depends_on"] == ["env-calc", "env-sandbox"]
    built, given = services["env-sandbox"], services["env-calc"]
    assert built["build"] == {"context": str(tmp_path / "sandbox")}
    assert built["image"] == f"{compose.job_project(runtime)}-env-sandbox" and given["image"] == "calc:1"
    for service in (built, given):
        assert service["cap_drop"] == ["ALL"] and service["read_only"] is True and service["user"] == "1234:5678"
        assert service["security_opt"] == ["no-new-privileges:true"] and service["tmpfs"] == ["/tmp:mode=1777"]
        # No port reaches the host, and no network but the project's default one (the job's own).
        assert not {"ports", "networks", "network_mode", "expose", "extra_hosts"} & set(service), service
    assert compose.environment_services(runtime) == ["env-calc", "env-sandbox"]


@pytest.mark.skipif(subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0,
                    reason="needs Compose v2 to read the override")  # fmt: skip
def test_compose_reads_the_override_with_its_servers(tmp_path):
    runtime = _runtime(tmp_path)
    (tmp_path / "sandbox").mkdir()
    override = compose.write_override(runtime, path=tmp_path / "override.yml")
    command = compose.compose_command(runtime, "config", "--format", "json", override=override)
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert set(services["trainer"]["depends_on"]) == {"env-calc", "env-sandbox"}
    assert services["env-calc"]["cap_drop"] == ["ALL"] and services["env-calc"]["read_only"] is True


def test_a_kubernetes_pod_runs_each_server_as_a_native_sidecar_hardened_like_the_trainer(tmp_path):
    kube = {
        "image": "registry.example/astrai-train:v1",
        "claims": {"data": "corpus", "model": "base", "checkpoints": "ckpts"},
    }
    runtime = _runtime(tmp_path, {"calc": {"image": "registry.example/calc:1", "port": 9000}}, kubernetes=kube)
    job = next(o for o in kubernetes.render_manifests(runtime) if o["kind"] == "Job")
    pod = job["spec"]["template"]["spec"]
    (sidecar,) = pod["initContainers"]
    trainer = pod["containers"][0]
    assert sidecar["name"] == "env-calc" and sidecar["restartPolicy"] == "Always"
    assert sidecar["image"] == "registry.example/calc:1" and sidecar["ports"][0]["containerPort"] == 9000
    assert sidecar["securityContext"] == trainer["securityContext"]
    env = {item["name"]: item.get("value") for item in trainer["env"]}
    assert json.loads(env[ENV_ENVIRONMENTS]) == {"calc": "http://localhost:9000"}
    kubernetes_validate.validate(job, kubernetes_validate.utils.latest_version(), strict=True)
    with pytest.raises(kubernetes.KubernetesError, match=r"runtime.environments: a TrainJob's runtime owns"):
        kubernetes.render_manifests(runtime, trainjob=True)
    built = _runtime(tmp_path / "built", {"calc": {"build": "./calc", "port": 9000}}, kubernetes=kube)
    with pytest.raises(kubernetes.KubernetesError, match=r"runtime.environments.calc.build: Kubernetes pulls images"):
        kubernetes.render_manifests(built)


@pytest.mark.parametrize("launcher", ["pyxis", "apptainer"])
def test_under_slurm_each_server_is_a_step_beside_the_trainers(tmp_path, launcher):
    slurm = {"launcher": launcher, "image": "registry.example/astrai-train:v1"}
    runtime = _runtime(tmp_path, {"calc": {"image": "calc:1", "port": 9000}}, slurm=slurm)
    script = slurm_script.render_script(runtime, [], python="python3")
    runner = "--container-image=calc:1" if launcher == "pyxis" else "apptainer run --contain calc:1"
    step = next(line for line in script.splitlines() if line.startswith("srun --overlap"))
    assert runner in step and step.endswith("&"), script
    assert script.index("srun --overlap") < script.index("step=$!")  # before the trainer's step
    assert "kill $environments" in script and '"calc": "http://localhost:9000"' in script
    built = _runtime(tmp_path / "built", {"calc": {"build": "./calc", "port": 9000}}, slurm=slurm)
    assert any("runtime.environments.calc.build: the" in problem for problem in slurm_script.config_problems(built))


def test_the_docker_launcher_leaves_the_servers_to_compose(tmp_path):
    runtime = _runtime(tmp_path, {"calc": {"image": "calc:1", "port": 9000}}, slurm={"launcher": "docker"})
    assert "srun --overlap" not in slurm_script.render_script(runtime, [], python="python3")


def test_the_trainer_image_installs_what_episodes_and_openenvs_client_need(tmp_path):
    runtime = _runtime(tmp_path, {"sandbox": {"image": "sandbox:1", "port": 8000}})
    assert model_packages_of(runtime) == (*EPISODE_PACKAGES, OPENENV_PACKAGE)
    assert model_packages_of(runtime, ["--environment", "/data/env.py:Env"]) == EPISODE_PACKAGES
    assert model_packages_of(runtime, ["--environment", "null", "--tools", "[]"]) == ()


def test_preflight_checks_the_episodes_in_the_built_image_and_says_when_it_is_not_built(tmp_path, monkeypatch):
    """The tools' line waits for the trainer image (the check runs there, as the trainer will); a server the job's
    environment names and runtime.environments lacks is refused naming both; a job without episodes has no lines."""
    from astrai.host import engine
    from astrai.host.checklist import FAIL, SKIP
    from astrai.host.environment_checks import agent_checks, environment_checks
    from astrai.host.trainer_config import read_trainer_config

    monkeypatch.setattr(engine, "image_labels", lambda image: None)
    runtime = _runtime(tmp_path)
    config = read_trainer_config(runtime, [])
    (check,) = agent_checks(runtime, config, [])
    assert check.mark == SKIP and "once `invoke start` has built it, before the trainer starts" in check.detail, check
    assert agent_checks(runtime, read_trainer_config(runtime, ["--train_type", "seq"]), []) == []

    runtime = _runtime(tmp_path, {"calc": {"image": "calc:1", "port": 9000}})
    (check,) = environment_checks(runtime, read_trainer_config(runtime, []))
    assert check.mark == FAIL and "runtime.environments has no sandbox (it has calc)" in check.detail, check
    assert "add runtime.environments.sandbox" in check.hint, check
