"""`invoke eval` through the real engine: a tiny model with a tokenizer of its own trains a few steps in its container,
then lm-evaluation-harness runs on its checkpoint in the job's image with the harness added, on a task of our own
whose data is a local file; the results file is written, `invoke status` lists it, preflight checks the image. The same
evaluation as a job of a real Slurm cluster on this host (`invoke eval --submit`, launcher docker)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
import yaml

from astrai.common.contract import EVAL_RESULTS_DIR
from astrai.host import compose, harness, slurm_script
from astrai.host.runtime import resolve_runtime
from tests.support import REPO

pytestmark = pytest.mark.docker

CORPUS = sorted((REPO / "examples" / "corpus").glob("*.txt"))
FACTS = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " blue"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " five", " Paris"], "answer": 0},
    {"question": "The sky is", "choices": [" green", " blue", " four"], "answer": 1},
]
TASK = """task: tiny_facts
dataset_path: json
dataset_kwargs:
  data_files:
    test: facts.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_target: answer
doc_to_choice: choices
metric_list:
  - metric: acc
"""


TRAINED = {"training": {"max_steps": 4}, "ckpt": {"ckpt_interval": 4}, "log": {"log_interval": 2}}


def _model_with_tokenizer(folder) -> None:
    """A tiny Llama with a byte-level BPE tokenizer of its own (transformers loads both)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([path.read_text(encoding="utf-8") for path in CORPUS], trainer)
    folder.mkdir(parents=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<pad>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)


def _trained(job) -> None:
    """The job with a model and tokenizer of its own, its data, the task folder data/tasks, and step 4's checkpoint."""
    shutil.rmtree(job.folder / "params")
    shutil.rmtree(job.folder / "data")
    _model_with_tokenizer(job.folder / "params")
    subprocess.run(
        [sys.executable, "-m", "astrai.data", "prepare", "--tokenizer", str(job.folder / "params"), "--out",
         str(job.folder / "data"), *map(str, CORPUS)],
        check=True, capture_output=True,
    )  # fmt: skip
    tasks = job.folder / "data" / "tasks"
    tasks.mkdir()
    (tasks / "facts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in FACTS * 2), encoding="utf-8")
    (tasks / "facts.yaml").write_text(TASK, encoding="utf-8")
    job.invoke("init")
    job.invoke("start")
    assert job.wait_for_exit().exit_code == 0, job.logs()


def test_invoke_eval_runs_the_harness_on_a_checkpoint_in_the_jobs_image(make_job):
    job = make_job(trainer=TRAINED)
    _trained(job)
    result = job.invoke(
        "eval", "--checkpoint", "epoch_0_step_4", "--tasks", "data/tasks/facts.yaml", "--limit", "4", timeout=1800
    )
    assert "epoch_0_step_4: tiny_facts acc " in result.stdout and "(limit 4)" in result.stdout, result.stdout
    document = json.loads((job.job_dir / EVAL_RESULTS_DIR / "epoch_0_step_4.json").read_text())
    assert document["step"] == 4 and document["lm_eval_version"] == "0.4.13" and document["limit"] == 4
    accuracy = document["results"]["tiny_facts"]["acc,none"]
    assert 0 <= accuracy <= 1 and document["n-samples"]["tiny_facts"]["effective"] == 4
    status = job.invoke("status").stdout
    assert f"eval        epoch_0_step_4: tiny_facts acc {accuracy:.4f}" in status, status
    # The job's container stays the job's: the evaluation ran under a project of its own, whose network is gone.
    assert "exited (exit code 0)" in status, status
    label = f"label=com.docker.compose.project={job.project}{harness.EVAL_PROJECT_SUFFIX}"
    networks = subprocess.run(["docker", "network", "ls", "-q", "--filter", label], capture_output=True, text=True)
    assert networks.returncode == 0 and networks.stdout.split() == [], networks
    preflight = job.invoke("preflight").stdout
    assert f"{compose.project_name(job.name)}-trainer:eval holds lm-eval==0.4.13" in preflight, preflight
    refused = job.invoke("eval", "--tasks", "/nowhere/facts.yaml", check=False)
    assert refused.returncode == 2 and "no such task file or folder" in refused.stderr, refused.stderr


@pytest.mark.slow
def test_invoke_eval_submit_evaluates_as_a_slurm_job_of_the_real_cluster(make_job, cluster):
    """The docker launcher: the node's task runs the harness as `invoke eval` does here, and the results land in the
    job dir, where `invoke status` lists them."""
    job = make_job(
        runtime={"slurm": {"time": "00:30:00"}}, trainer=TRAINED, env={"SLURM_CONF": cluster.env["SLURM_CONF"]}
    )
    _trained(job)
    asked = ["--checkpoint", "epoch_0_step_4", "--tasks", "data/tasks/facts.yaml", "--limit", "4"]
    script = job.invoke("eval", "--submit", "--dry-run", *asked).stdout
    assert script.startswith("#!/bin/bash\n") and " -m astrai.host.harness --config " in script, script
    assert not (job.job_dir / EVAL_RESULTS_DIR).exists()
    submitted = job.invoke("eval", "--submit", *asked)
    found = re.search(r"^Submitted batch job (\d+)$", submitted.stdout, re.MULTILINE)
    assert found, submitted.stdout
    job_id = found.group(1)
    output = job.job_dir / compose.STATE_DIR_NAME / slurm_script.SLURM_DIR_NAME / f"eval-{job_id}.out"
    try:
        state = _finished(cluster, job_id, timeout=1200)
    finally:
        cluster.run("scancel", job_id, check=False)
    shown = output.read_text(errors="replace") if output.exists() else "(no output)"
    assert state == "COMPLETED", shown
    assert "epoch_0_step_4: tiny_facts acc " in shown and "(limit 4)" in shown, shown
    document = json.loads((job.job_dir / EVAL_RESULTS_DIR / "epoch_0_step_4.json").read_text())
    assert document["step"] == 4 and document["limit"] == 4 and document["n-samples"]["tiny_facts"]["effective"] == 4
    status = job.invoke("status").stdout
    accuracy = document["results"]["tiny_facts"]["acc,none"]
    assert f"eval        epoch_0_step_4: tiny_facts acc {accuracy:.4f}" in status, status


def _finished(cluster, job_id: str, timeout: float) -> str:
    """The Slurm job's state once it has ended (the cluster keeps ended jobs for MinJobAge seconds)."""
    deadline = time.monotonic() + timeout
    state = "UNKNOWN"
    while time.monotonic() < deadline:
        result = cluster.run("scontrol", "show", "job", "--oneliner", job_id, check=False)
        state = dict(re.findall(r"(\w+)=(\S*)", result.stdout)).get("JobState", state)
        if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            return state
        time.sleep(2)
    raise AssertionError(f"Slurm job {job_id} still {state} after {timeout} s")


@pytest.mark.slow
def test_the_kubernetes_job_of_invoke_eval_runs_as_its_pod_spec_states(make_job):
    """No cluster is reachable here: the Job's one pod runs on the local engine as its spec states it (as
    test_kubernetes_pods does the training's), in the image a user pushes: the job's with the harness."""
    job = make_job(trainer=TRAINED)
    _trained(job)
    document = yaml.safe_load(job.config.read_text())
    image = compose.eval_image_name(resolve_runtime(job.config))
    claims = {"data": "corpus", "model": "base-model", "checkpoints": "runs"}
    document["runtime"]["kubernetes"] = {"namespace": "ml", "image": image, "claims": claims}
    job.config.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    runtime = resolve_runtime(job.config)
    override = compose.write_override(runtime, evaluation=True)
    project = compose.job_project(runtime) + harness.EVAL_PROJECT_SUFFIX
    build = compose.compose_command(runtime, "build", compose.SERVICE, override=override, project=project)
    built = subprocess.run(build, capture_output=True, text=True)
    assert built.returncode == 0, built.stdout + built.stderr
    asked = ["--checkpoint", "epoch_0_step_4", "--tasks", "data/tasks/facts.yaml", "--limit", "4"]
    documents = [d for d in yaml.safe_load_all(job.invoke("eval", "--kubernetes", *asked).stdout) if d]
    assert [d["kind"] for d in documents] == ["ConfigMap", "Job"]
    pod_security = documents[1]["spec"]["template"]["spec"]["securityContext"]
    # What fsGroup does to a claim: the pod's group may write it.
    os.chown(runtime.job_dir, pod_security["runAsUser"], pod_security["fsGroup"])
    name = f"{job.name}-eval-pod"
    folders = {"corpus": "data", "base-model": "params", "runs": "checkpoints"}
    command = _pod_as_docker_run(job, documents, name, folders)
    subprocess.run(command, check=True, capture_output=True)
    subprocess.run(["docker", "wait", name], capture_output=True, timeout=1200)
    logs = subprocess.run(["docker", "logs", name], capture_output=True, text=True)
    state = subprocess.run(["docker", "inspect", "-f", "{{.State.ExitCode}}", name], capture_output=True, text=True)
    assert state.stdout.strip() == "0", f"{' '.join(command)}\n{logs.stdout}{logs.stderr}"
    document = json.loads((runtime.job_dir / EVAL_RESULTS_DIR / "epoch_0_step_4.json").read_text())
    assert document["step"] == 4 and document["n-samples"]["tiny_facts"]["effective"] == 4
    accuracy = document["results"]["tiny_facts"]["acc,none"]
    status = job.invoke("status").stdout
    assert f"eval        epoch_0_step_4: tiny_facts acc {accuracy:.4f}" in status, status


def _pod_as_docker_run(job, documents: list[dict], name: str, claims: dict[str, str]) -> list[str]:
    """``docker run`` of the Job's pod as a kubelet would run it: its user and group, hardening, volumes (claims as the
    job's folders, the ConfigMap as its file, emptyDirs as folders anyone may write, or tmpfs in memory), environment,
    command and args."""
    config_map, job_object = documents
    pod = job_object["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    security, pod_security = container["securityContext"], pod["securityContext"]
    command = ["docker", "run", "--detach", "--name", name, "--network", "none"]
    command += ["--label", f"com.docker.compose.project={job.project}{harness.EVAL_PROJECT_SUFFIX}"]  # the tear-down
    command += ["--user", f"{pod_security['runAsUser']}:{pod_security['runAsGroup']}"]
    command += ["--group-add", str(pod_security["fsGroup"])]
    if security["capabilities"]["drop"] == ["ALL"]:
        command += ["--cap-drop", "ALL"]
    if security["allowPrivilegeEscalation"] is False:
        command += ["--security-opt", "no-new-privileges:true"]
    if security["readOnlyRootFilesystem"]:
        command.append("--read-only")
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    (key,) = config_map["data"]
    config_file = job.folder / f"configmap-{key}"
    config_file.write_text(config_map["data"][key], encoding="utf-8")
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]
            read_only = mount.get("readOnly") or claim.get("readOnly")
            source = job.folder / claims[claim["claimName"]]
            command += ["--mount", f"type=bind,src={source},dst={mount['mountPath']}" + (",readonly" * bool(read_only))]
        elif "configMap" in volume:
            assert volume["configMap"]["name"] == config_map["metadata"]["name"] and mount["subPath"] == key
            command += ["--mount", f"type=bind,src={config_file},dst={mount['mountPath']},readonly"]
        elif volume["emptyDir"].get("medium") == "Memory":
            command += ["--tmpfs", f"{mount['mountPath']}:exec,mode=1777"]
        else:
            # The kubelet's emptyDir: a folder of the node that anyone may write, whatever the image holds there
            # (Docker's tmpfs would take the mode of the image's folder: /home/astrai is root's).
            empty = job.folder / f"emptydir-{mount['name']}"
            empty.mkdir()
            empty.chmod(0o777)
            command += ["--mount", f"type=bind,src={empty},dst={mount['mountPath']}"]
    for item in container["env"]:
        assert "value" in item, item  # no index nor uid: a Job of one pod
        command += ["--env", f"{item['name']}={item['value']}"]
    entrypoint, *rest = container["command"]
    return [*command, "--entrypoint", entrypoint, container["image"], *rest, *container.get("args", [])]
