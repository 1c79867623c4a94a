"""`invoke eval` through the real engine: a tiny model with a tokenizer of its own trains a few steps in its container,
then lm-evaluation-harness runs on its checkpoint in the job's image with the harness added, on a task of our own
whose data is a local file; the results file is written, `invoke status` lists it, preflight checks the image. The same
evaluation as a job of a real Slurm cluster on this host (`invoke eval --submit`, launcher docker)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from astrai.common.contract import EVAL_RESULTS_DIR
from astrai.host import compose, slurm_script
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
    # The job's container stays the job's: the evaluation ran under a project of its own.
    assert "exited (exit code 0)" in status, status
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
