"""`invoke eval` without Docker: lm-evaluation-harness on a checkpoint of a tiny model with a local task, its results
file equal to `lm_eval` run by hand on the exported folder, the results in the tracker run that made the checkpoint,
what the host hands the container (paths, arguments, the image with the harness), and what it refuses.

The Docker test (tests/docker/test_eval_job.py) runs the same through the real engine.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml
from hf_folders import make_hf_model, make_tokenizer

from astrai.common.contract import EVAL_RESULTS_DIR, LABEL_EVAL_PACKAGES
from astrai.data.pipeline import prepare
from astrai.data.tokenizing import HFTokenizer
from astrai.host import compose
from astrai.host.harness import (
    HarnessError,
    checkpoint_source,
    describe_results,
    eval_arguments,
    results_of,
    task_arguments,
)
from astrai.host.runtime import resolve_runtime
from astrai.trainer.run.harness import HarnessError as InImageError
from astrai.trainer.run.harness import flat_results, resolve_tasks
from tests.support import REPO, placeholder_checkpoint

FACTS = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " blue"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " five", " Paris"], "answer": 0},
    {"question": "The sky is", "choices": [" green", " blue", " four"], "answer": 1},
    {"question": "Water is", "choices": [" wet", " dry", " loud"], "answer": 0},
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
    aggregation: mean
    higher_is_better: true
"""


def write_task(folder) -> None:
    """A harness task of our own on a local JSON Lines file (its path relative to the YAML)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "facts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in FACTS * 2), encoding="utf-8")
    (folder / "facts.yaml").write_text(TASK, encoding="utf-8")


def make_tokenized_job(root, train_yaml, run_trainer):
    """A tiny Llama with a tokenizer of its own, trained 4 steps on the example corpus prepared with it: (the job dir,
    its checkpoint)."""
    texts = [path.read_text(encoding="utf-8") for path in sorted((REPO / "examples" / "corpus").glob("*.txt"))]
    base = make_tokenizer(root / "base", texts, vocab_size=320, special=("<|endoftext|>", "<pad>"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<pad>"}
    (base / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    make_hf_model(base, vocab_size=320, hidden_size=32, intermediate_size=64, eos_token_id=0)
    prepare(root / "data", sorted((REPO / "examples" / "corpus").glob("*.txt")), tokenizer=HFTokenizer(base))
    path = train_yaml(
        root / "train.yaml",
        data_root_path=str(root / "data"),
        param_path=str(base),
        ckpt_dir=str(root / "job"),
        max_steps=4,
        ckpt_interval=4,
        log_interval=2,
    )
    run_trainer(path)
    return root / "job", root / "job" / "epoch_0_step_4"


# --- in the image --------------------------------------------------------------------------------------------------


def test_tasks_are_names_task_files_or_folders_of_them(tmp_path):
    write_task(tmp_path / "tasks")
    (tmp_path / "tasks" / "two.yaml").write_text("task: [first_one, second_one]\nclass: !function x.y\n")
    found = resolve_tasks([str(tmp_path / "tasks" / "facts.yaml"), "hellaswag"], [])
    assert found.names == ("tiny_facts", "hellaswag") and found.folders == (tmp_path / "tasks",)
    assert resolve_tasks([str(tmp_path / "tasks")], []).names == ("tiny_facts", "first_one", "second_one")
    for given, message in (
        ([str(tmp_path / "nothing.yaml")], "no such task file or folder"),
        ([str(tmp_path)], "the folder holds no task YAML"),
        ([], "name at least one task"),
    ):
        with pytest.raises(InImageError, match=message):
            resolve_tasks(given, [])


def test_results_become_metrics_by_task_metric_and_filter():
    results = {
        "tiny_facts": {"alias": "tiny_facts", "acc,none": 0.5, "acc_stderr,none": 0.1, "sample_len": 8},
        "gsm": {"exact_match,strict-match": 0.25, "exact_match,flexible": float("nan")},
    }
    assert flat_results(results) == {
        "lm_eval/tiny_facts/acc": 0.5,
        "lm_eval/tiny_facts/acc_stderr": 0.1,
        "lm_eval/gsm/exact_match/strict-match": 0.25,
    }


@pytest.mark.slow
def test_the_harness_on_a_checkpoint_equals_lm_eval_run_by_hand_and_reaches_the_checkpoints_tracker_run(
    tmp_path, train_yaml, run_trainer, one_thread
):
    from astrai.evaluate import main
    from astrai.host.export import export_checkpoint

    job, checkpoint = make_tokenized_job(tmp_path, train_yaml, run_trainer)
    write_task(tmp_path / "tasks")
    out = job / EVAL_RESULTS_DIR / "epoch_0_step_4.json"
    assert (
        main(["--checkpoint", str(checkpoint), "--tasks", str(tmp_path / "tasks" / "facts.yaml"), "--out", str(out)])
        == 0
    )
    ours = json.loads(out.read_text())
    assert ours["name"] == "epoch_0_step_4" and ours["step"] == 4 and ours["lm_eval_version"] == "0.4.13"
    assert ours["tasks"] == ["tiny_facts"] and ours["n-samples"]["tiny_facts"]["effective"] == 8
    # lm_eval by hand, its own command, on the exported folder: the same accuracy.
    export_checkpoint(checkpoint, tmp_path / "exported", None, 5 * 2**30)
    by_hand = subprocess.run(
        [
            sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={tmp_path / 'exported'}",
            "--tasks", "tiny_facts", "--include_path", str(tmp_path / "tasks"), "--device", "cpu",
            "--output_path", str(tmp_path / "by-hand"),
        ],
        cwd=tmp_path / "tasks", capture_output=True, text=True, timeout=600,
        env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )  # fmt: skip
    assert by_hand.returncode == 0, by_hand.stderr[-3000:]
    (written,) = (tmp_path / "by-hand").rglob("results_*.json")
    theirs = json.loads(written.read_text())["results"]["tiny_facts"]
    assert ours["results"]["tiny_facts"]["acc,none"] == theirs["acc,none"]


@pytest.mark.slow
def test_the_results_go_to_the_mlflow_run_that_made_the_checkpoint_at_its_step(tmp_path, train_yaml, run_trainer):
    from mlflow.tracking import MlflowClient

    from astrai.common.checkpoints import CheckpointMeta
    from astrai.evaluate import main

    job, checkpoint = make_tokenized_job(tmp_path, train_yaml, run_trainer)
    config = yaml.safe_load((tmp_path / "train.yaml").read_text())
    config["log"] = {**config.get("log", {}), "report_to": ["mlflow"]}
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(config))
    shutil.rmtree(job)
    run_trainer(tmp_path / "train.yaml")
    run_id = CheckpointMeta.read(checkpoint).trackers["mlflow"]
    write_task(tmp_path / "tasks")
    out = job / EVAL_RESULTS_DIR / "epoch_0_step_4.json"
    arguments = ["--checkpoint", str(checkpoint), "--tasks", str(tmp_path / "tasks"), "--out", str(out)]
    assert main([*arguments, "--config", str(tmp_path / "train.yaml"), "--limit", "4"]) == 0
    history = MlflowClient(tracking_uri=f"file://{job}/mlruns").get_metric_history(run_id, "lm_eval/tiny_facts/acc")
    assert [(point.step, point.value) for point in history] == [
        (4, json.loads(out.read_text())["results"]["tiny_facts"]["acc,none"])
    ]


def test_a_checkpoint_without_a_tokenizer_or_that_scores_is_refused_saying_why(tmp_path, tiny_model, capsys):
    from astrai.evaluate import main

    write_task(tmp_path / "tasks")
    arguments = ["--tasks", str(tmp_path / "tasks"), "--out", str(tmp_path / "out.json")]
    assert main(["--checkpoint", str(tiny_model), *arguments]) == 1
    assert "holds no Hugging Face tokenizer" in capsys.readouterr().err
    assert main(["--checkpoint", str(tmp_path / "nothing"), *arguments]) == 1
    assert "no config.json" in capsys.readouterr().err
    assert main(["--checkpoint", str(tiny_model), *arguments, "--limit", "0"]) == 2
    assert "--limit must be an integer >= 1" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


# --- on the host ---------------------------------------------------------------------------------------------------


def _runtime(tmp_path, tiny_model):
    (tmp_path / "data").mkdir(exist_ok=True)
    runtime = {"job_name": "evals", "gpu": {"devices": "none"}, "container": {"cuda_tag": "cpu"}}
    runtime["paths"] = {"data": str(tmp_path / "data"), "model": str(tiny_model), "checkpoints": str(tmp_path / "ck")}
    (tmp_path / "train.yaml").write_text(yaml.safe_dump({"runtime": runtime}), encoding="utf-8")
    return resolve_runtime(str(tmp_path / "train.yaml"))


def test_the_host_names_checkpoint_and_tasks_by_their_paths_in_the_container(tmp_path, tiny_model):
    runtime = _runtime(tmp_path, tiny_model)
    checkpoint = placeholder_checkpoint(runtime.job_dir, 0, 8)
    write_task(tmp_path / "data" / "tasks")
    assert checkpoint_source(runtime, "epoch_0_step_8") == (checkpoint, "/checkpoints/evals/epoch_0_step_8")
    assert checkpoint_source(runtime, None)[1] == "/checkpoints/evals/epoch_0_step_8"  # the newest
    assert checkpoint_source(runtime, str(tiny_model))[1] == "/models/base"
    given = task_arguments(runtime, [str(tmp_path / "data" / "tasks" / "facts.yaml"), "arc_easy"])
    assert given == ["/data/tasks/facts.yaml", "arc_easy"]
    assert eval_arguments(runtime, "/checkpoints/evals/epoch_0_step_8", given, 10, 0, "cpu") == [
        "--checkpoint", "/checkpoints/evals/epoch_0_step_8", "--tasks", "/data/tasks/facts.yaml,arc_easy",
        "--out", "/checkpoints/evals/eval/epoch_0_step_8.json", "--device", "cpu",
        "--config", "/run/astrai/train.yaml", "--limit", "10", "--num_fewshot", "0",
    ]  # fmt: skip
    (tmp_path / "elsewhere.yaml").write_text(TASK)
    with pytest.raises(HarnessError, match="--tasks .*elsewhere.yaml is in no folder the job's container mounts"):
        task_arguments(runtime, [str(tmp_path / "elsewhere.yaml")])
    with pytest.raises(HarnessError, match="no such task file or folder"):
        task_arguments(runtime, [str(tmp_path / "data" / "nothing.yaml")])
    adapters = {"rank": 4, "alpha": 8, "dropout": 0.0, "targets": ["q_proj"]}
    lora = {**adapters, "base": {"path": "/models/base", "sha256": "0" * 64}, "base_dtype": "float32"}
    placeholder_checkpoint(runtime.job_dir, 0, 9, meta={"lora": lora})
    with pytest.raises(HarnessError, match="holds LoRA adapters only; merge them into a model folder first"):
        checkpoint_source(runtime, "epoch_0_step_9")


def test_the_image_it_runs_in_is_the_jobs_with_the_harness_tagged_apart(tmp_path, tiny_model):
    runtime = _runtime(tmp_path, tiny_model)
    job = compose.render_override(runtime, uid=1000, gid=1000)
    evaluation = compose.render_override(runtime, uid=1000, gid=1000, evaluation=True)
    added = evaluation["services"]["trainer"]
    assert added["image"] == f"{compose.image_name(runtime)}:eval" and "image" not in job["services"]["trainer"]
    assert (
        added["build"]["args"]["EVAL_PACKAGES"]
        == "lm-eval==0.4.13 accelerate==1.16.0 peft==0.21.2 transformers==5.25.0"
    )
    # Everything else is the job's: mounts, user, environment, hardening.
    del added["image"], added["build"]["args"]["EVAL_PACKAGES"]
    assert evaluation == job
    command = compose.compose_command(runtime, "run", override=tmp_path / "x.yml", project="astrai-evals-eval")
    assert command[command.index("--project-name") + 1] == "astrai-evals-eval"
    assert "ai.astrai.eval_packages" == LABEL_EVAL_PACKAGES and LABEL_EVAL_PACKAGES in (REPO / "Dockerfile").read_text()


def test_status_lists_each_checkpoints_results(tmp_path, tiny_model):
    from astrai.host.status import format_status, job_status

    runtime = _runtime(tmp_path, tiny_model)
    folder = runtime.job_dir / EVAL_RESULTS_DIR
    folder.mkdir(parents=True)
    for step in (20, 10):
        document = {
            "name": f"epoch_0_step_{step}",
            "step": step,
            "limit": 50,
            "num_fewshot": None,
            "results": {"tiny_facts": {"acc,none": step / 40, "acc_stderr,none": 0.1, "alias": "tiny_facts"}},
        }
        (folder / f"epoch_0_step_{step}.json").write_text(json.dumps(document))
    (folder / "broken.json").write_text("{")
    assert [document["step"] for document in results_of(runtime)] == [10, 20]
    assert describe_results(results_of(runtime)[0]) == "epoch_0_step_10: tiny_facts acc 0.2500 (limit 50)"
    lines = format_status(job_status(runtime))
    assert [line for line in lines if line.startswith("eval ")] == [
        "eval        epoch_0_step_10: tiny_facts acc 0.2500 (limit 50)",
        "eval        epoch_0_step_20: tiny_facts acc 0.5000 (limit 50)",
    ]


def test_the_eval_extra_pins_what_the_image_installs():
    import configparser

    from astrai.common.backends import TRANSFORMERS_PACKAGE
    from astrai.common.contract import LM_EVAL_PACKAGES

    extras = configparser.ConfigParser()
    extras.read(REPO / "setup.cfg")
    pinned = extras["options.extras_require"]["eval"].split()
    assert pinned == [*LM_EVAL_PACKAGES, TRANSFORMERS_PACKAGE] == list(compose.eval_packages())
    assert set(LM_EVAL_PACKAGES[:2]) <= set(extras["options.extras_require"]["dev"].split())


# --- through a scheduler -------------------------------------------------------------------------------------------


def _cluster_runtime(tmp_path, tiny_model, launcher: str):
    (tmp_path / "data").mkdir(exist_ok=True)
    runtime = {
        "job_name": "evals",
        "gpu": {"devices": [0]},
        "container": {"cuda_tag": "cu128"},
        "paths": {"data": str(tmp_path / "data"), "model": str(tiny_model), "checkpoints": str(tmp_path / "ck")},
        "slurm": {"partition": "gpu", "time": "02:00:00", "launcher": launcher, "image": "/images/astrai-eval.sqsh"},
        "kubernetes": {
            "namespace": "ml",
            "image": "registry.example/astrai-train:eval",
            "claims": {"data": "corpus", "model": "base-model", "checkpoints": "ckpts"},
        },
    }
    (tmp_path / "train.yaml").write_text(yaml.safe_dump({"runtime": runtime}), encoding="utf-8")
    return resolve_runtime(str(tmp_path / "train.yaml"))


@pytest.mark.parametrize("launcher", ["docker", "pyxis", "apptainer"])
def test_a_slurm_job_of_one_node_evaluates_as_each_launcher_runs_the_trainer(tmp_path, tiny_model, launcher):
    import shlex

    from astrai.host.eval_jobs import render_eval_script
    from astrai.host.harness import checked_evaluation

    runtime = _cluster_runtime(tmp_path, tiny_model, launcher)
    placeholder_checkpoint(runtime.job_dir, 0, 8)
    write_task(tmp_path / "data" / "my tasks $x")
    task = str(tmp_path / "data" / "my tasks $x" / "facts.yaml")
    evaluation = checked_evaluation(runtime, None, [task], 10, None)
    script = render_eval_script(runtime, evaluation.host_arguments(), evaluation.image_arguments(runtime))
    assert "#SBATCH --nodes=1\n#SBATCH --ntasks=1\n#SBATCH --gpus-per-node=1\n#SBATCH --partition=gpu\n" in script
    assert "#SBATCH --time=02:00:00\n#SBATCH --no-requeue\n" in script and "eval-%j.out" in script
    command = shlex.split(script.rstrip().splitlines()[-1].removeprefix("exec "))
    assert command[:3] == ["srun", "--nodes=1", "--ntasks=1"]
    if launcher == "docker":
        assert command[4:9] == ["-m", "astrai.host.harness", "--config", str(runtime.config_path), "--checkpoint"]
        assert command[9:] == [str(runtime.job_dir / "epoch_0_step_8"), "--tasks", task, "--limit", "10"]
    else:
        evaluate = command[command.index("astrai.evaluate") + 1 :]
        assert evaluate == [
            "--checkpoint", "/checkpoints/evals/epoch_0_step_8", "--tasks", "/data/my tasks $x/facts.yaml",
            "--out", "/checkpoints/evals/eval/epoch_0_step_8.json", "--device", "cuda",
            "--config", "/run/astrai/train.yaml", "--limit", "10",
        ]  # fmt: skip
        assert "/images/astrai-eval.sqsh" in (
            command if launcher == "apptainer" else [c.split("=", 1)[-1] for c in command]
        )


def test_a_kubernetes_job_of_one_pod_runs_the_harness_in_the_trainers_pod_template(tmp_path, tiny_model):
    import kubernetes_validate

    from astrai.host import kubernetes
    from astrai.host.eval_jobs import render_eval_manifests
    from astrai.host.harness import checked_evaluation

    runtime = _cluster_runtime(tmp_path, tiny_model, "docker")
    placeholder_checkpoint(runtime.job_dir, 0, 8)
    write_task(tmp_path / "data" / "tasks")
    evaluation = checked_evaluation(runtime, "epoch_0_step_8", [str(tmp_path / "data" / "tasks")], None, 3)
    text = kubernetes.dump_manifests(runtime, render_eval_manifests(runtime, evaluation.image_arguments(runtime)))
    config, job = [document for document in yaml.safe_load_all(text) if document is not None]
    for document in (config, job):
        kubernetes_validate.validate(document, kubernetes_validate.utils.latest_version(), strict=True)
    assert config["metadata"]["name"] == "astrai-evals-eval-config" and job["spec"]["backoffLimit"] == 0
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "registry.example/astrai-train:eval"
    assert container["command"] == ["python3", "-m", "astrai.evaluate"]
    assert container["args"][:4] == ["--checkpoint", "/checkpoints/evals/epoch_0_step_8", "--tasks", "/data/tasks"]
    assert (
        container["args"][-2:] == ["--num_fewshot", "3"] and container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    )
    trainer = kubernetes.render_manifests(runtime)[2]["spec"]["template"]["spec"]
    assert pod["volumes"][:3] == trainer["volumes"][:3] and pod["securityContext"] == trainer["securityContext"]


def test_the_results_go_to_the_wandb_run_of_the_checkpoint_on_their_own_step_axis(tmp_path):
    from astrai.common.config import LogSection, WandbSettings
    from astrai.trainer.run.trackers import report_results
    from tests.trackers_support import wandb_records, wandb_runs

    log = LogSection(report_to=("wandb",), wandb=WandbSettings(mode="offline", project="astrai tests"))
    said = []
    values = {"lm_eval/tiny_facts/acc": 0.75}
    assert report_results(log, tmp_path, {"wandb": "run12345"}, 40, values, said.append) == {"wandb": "run12345"}
    (run,) = wandb_runs(tmp_path / "wandb")
    records = wandb_records(run)
    assert records["id"] == "run12345" and said == []
    logged = [values for rows in records["history"].values() for values in rows]
    assert {"lm_eval/tiny_facts/acc": 0.75, "lm_eval/step": 40}.items() <= logged[-1].items()
    # A checkpoint that names no run of a tracker the job reports to: said, not sent.
    assert report_results(log, tmp_path, {}, 40, values, said.append) == {}
    assert said == ["warning: the checkpoint names no wandb run; the results go to metrics of the job dir only"]
