"""Fine-tuning in the container as the README walks it: SFT on chat data, then DPO from the SFT result.

The data is prepared on the host with the base model's chat template; both jobs run in the real
engine, preflight and status say what a user needs to see, a stop is honoured. The DPO job trains
LoRA adapters (asked for on the command line, its base held in bf16), and its final checkpoint,
exported merged into the SFT model, chats in transformers with its own template.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from astrai.common.checkpoints import latest_complete_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from chat_data import SYSTEM_PROMPT, make_chat_world  # noqa: E402

pytestmark = pytest.mark.docker


def _prepare(kind: str, tokenizer: Path, out: Path, records: Path) -> None:
    command = [sys.executable, "-m", "astrai.data", "prepare", "--kind", kind, "--tokenizer", str(tokenizer)]
    subprocess.run([*command, "--out", str(out), str(records)], check=True, capture_output=True)


def test_sft_then_dpo_jobs_run_in_the_container_and_end_as_a_chat_model(make_job, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    world = make_chat_world(tmp_path / "world")
    sft = make_job(
        trainer={
            "data": {"window_size": 96},
            "training": {"train_type": "sft", "max_steps": 1000, "max_lr": 3e-3, "batch_per_device": 4},
            "ckpt": {"ckpt_interval": 1000},
        }
    )
    for name in ("params", "data"):
        shutil.rmtree(sft.folder / name)
    shutil.copytree(world.model, sft.folder / "params")
    _prepare("sft", world.tokenizer, sft.folder / "data", world.sft_file)

    sft.invoke("init")
    checklist = sft.invoke("preflight").stdout
    fit = next(line for line in checklist.splitlines() if "data fits model" in line)
    assert fit.startswith("✓") and "packed windows of 96" in fit, checklist
    assert "240 sequences as" in fit and "0 cut to the window (data.overlong: truncate)" in fit, fit
    stopped = sft.stop_and_finish()
    assert f"_step_{stopped} (epoch" in sft.logs() and "sft: 240 sequences as" in sft.logs()
    tuned = latest_complete_checkpoint(sft.job_dir)
    assert tuned.meta.train_type == "sft" and tuned.step == stopped + 10

    # DPO from the SFT result: the reference is the model the run starts from.
    dpo = make_job(
        runtime={"paths": {"model": str(tuned.path)}},
        trainer={
            "data": {"window_size": 48},
            "training": {"train_type": "dpo", "max_steps": 12, "max_lr": 1e-3, "batch_per_device": 4},
            "ckpt": {"ckpt_interval": 1000},
            "log": {"log_interval": 4},
        },
    )
    shutil.rmtree(dpo.folder / "data")
    _prepare("dpo", world.tokenizer, dpo.folder / "data", world.dpo_file)
    dpo.invoke("init")
    checklist = dpo.invoke("preflight").stdout
    reference = next(line for line in checklist.splitlines() if "dpo reference" in line)
    assert reference.startswith("✓") and str(tuned.path) in reference, checklist
    dpo.invoke("start", "--", "--lora_rank", "4", "--lora_alpha", "8", "--lora_base_dtype", "bfloat16")
    assert dpo.wait_for_exit().exit_code == 0, dpo.logs()
    logs = dpo.logs()
    assert "dpo: reference log-probabilities of 160 pairs computed" in logs, logs
    assert "the frozen base held in bfloat16" in logs and "| lora r4 " in logs, logs
    assert (dpo.job_dir / "reference_logps.safetensors").is_file()
    status = dpo.invoke("status").stdout
    line = next(line for line in status.splitlines() if line.startswith("dpo"))
    assert "rewards chosen" in line and "margin" in line and "accuracy" in line, status
    final = latest_complete_checkpoint(dpo.job_dir)
    assert final.meta.train_type == "dpo" and final.meta.reference["path"] == "/models/base"
    assert len(final.meta.reference["sha256"]) == 64
    assert final.meta.lora["rank"] == 4 and final.meta.lora["base_dtype"] == "bfloat16"
    assert all(".lora_" in name for name in load_file(final.path / "model.safetensors"))

    merged = tmp_path / "merged"
    dpo.invoke("export", "--out", str(merged))  # the adapters folded into the job's model folder (the SFT result)
    tokenizer = AutoTokenizer.from_pretrained(merged)
    model = AutoModelForCausalLM.from_pretrained(merged)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "cat sat"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    assert model.generate(prompt, max_new_tokens=4, do_sample=False).shape[1] > prompt.shape[1]


REWARD_FILE = '''
def digits(prompts, completions, digit, **fields):
    """The share of the completion's first four characters that are the prompt's digit."""
    return [sum(c == d for c in completion[:4]) / 4 for d, completion in zip(digit, completions)]
'''


def test_an_online_grpo_job_scores_with_a_reward_file_in_its_data_folder(make_job, tmp_path):
    """The user's reward is a .py file in the mounted data folder, run by the trainer (non-root, read-only root);
    preflight counts the prompts, status shows the rewards, and the job dir holds the completions log."""
    job = make_job(
        trainer={
            "training": {
                "train_type": "online_grpo",
                "rewards": ["/data/my rewards.py:digits"],
                "num_generations": 4,
                "max_completion_length": 5,
                "batch_per_device": 2,
                "max_steps": 6,
                "max_lr": 1e-3,
            },
            "ckpt": {"ckpt_interval": 1000},
            "log": {"log_interval": 2},
        }
    )
    shutil.rmtree(job.folder / "data")
    records = tmp_path / "prompts.jsonl"
    records.write_text("".join(f'{{"prompt": "repeat: {n}", "digit": "{n}"}}\n' for n in range(10)), encoding="utf-8")
    command = [sys.executable, "-m", "astrai.data", "prepare", "--kind", "prompts", "--out", str(job.folder / "data")]
    subprocess.run([*command, str(records)], check=True, capture_output=True)
    (job.folder / "data" / "my rewards.py").write_text(REWARD_FILE, encoding="utf-8")
    job.invoke("init")
    checklist = job.invoke("preflight").stdout
    fit = next(line for line in checklist.splitlines() if "data fits model" in line)
    assert fit.startswith("✓") and "10 training prompts, 5 steps per epoch" in fit, checklist
    job.invoke("start")
    assert job.wait_for_exit().exit_code == 0, job.logs()
    logs = job.logs()
    assert "online_grpo: rewards digits x1" in logs and "| reward " in logs, logs
    status = job.invoke("status").stdout
    line = next(line for line in status.splitlines() if line.startswith("rewards"))
    assert line.startswith("rewards     reward ") and "(digits " in line and "groups without signal" in line, status
    completions = (job.job_dir / "completions.log").read_text(encoding="utf-8")
    assert completions.startswith("step 2 | prompt ") and "(digits " in completions
    assert latest_complete_checkpoint(job.job_dir).meta.train_type == "online_grpo"


def test_preflight_refuses_a_reward_that_does_not_import_in_the_image_and_the_fixed_one_trains(make_job, tmp_path):
    """The reward file exists and parses on the host, but imports a module the image does not have: preflight shows
    the ✗ naming the entry (once the image is built), start refuses before the trainer's container; fixed, it trains."""
    job = make_job(
        trainer={
            "data": {"window_size": 64},
            "training": {
                "train_type": "online_grpo",
                "rewards": ["/data/my rewards.py:brevity"],
                "num_generations": 2,
                "max_completion_length": 4,
                "batch_per_device": 2,
                "max_steps": 3,
            },
            "ckpt": {"ckpt_interval": 1000},
            "log": {"log_interval": 1},
        }
    )
    records = tmp_path / "prompts.jsonl"
    records.write_text("".join(f'{{"prompt": "n° {i} $x:"}}\n' for i in range(8)), encoding="utf-8")
    shutil.rmtree(job.folder / "data")
    prepare = [sys.executable, "-m", "astrai.data", "prepare", "--kind", "prompts", "--out", str(job.folder / "data")]
    subprocess.run([*prepare, str(records)], check=True, capture_output=True)
    reward = job.folder / "data" / "my rewards.py"
    body = "def brevity(prompts, completions, **fields):\n    return [-len(c) / 10 for c in completions]\n"
    reward.write_text("import not_in_the_image\n\n" + body, encoding="utf-8")
    job.invoke("init")
    job.invoke("build")

    checked = job.invoke("preflight", check=False)
    line = next(line for line in checked.stdout.splitlines() if line[2:].startswith("rewards"))
    assert checked.returncode != 0 and line.startswith("✗"), checked.stdout
    assert "/data/my rewards.py:brevity" in checked.stdout and "not_in_the_image" in checked.stdout, checked.stdout

    refused = job.invoke("start", check=False)  # its preflight, with the image it built, says the same
    assert refused.returncode != 0 and "✗ rewards" in refused.stdout and "not_in_the_image" in refused.stdout, refused
    assert job.container() is None

    reward.write_text(body, encoding="utf-8")
    checked = job.invoke("preflight")
    line = next(line for line in checked.stdout.splitlines() if line[2:].startswith("rewards"))
    assert line.startswith("✓") and "brevity" in line, checked.stdout
    job.invoke("start")
    assert job.wait_for_exit().exit_code == 0, job.logs()
    assert job.checkpoints()[-1] == (3, "final") and "reward" in job.logs()
