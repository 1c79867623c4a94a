"""Evaluation and rewards from models: what judging a model costs, and whether its numbers are the references'.

- ``eval_vs_manual``: the wall time of the generative evaluation in the loop (``GenerativeEval.run`` of a `tiny`
  trainer: 64 prompts of ``log.eval_prompts`` completed greedily, 32 tokens each, in batches of 8, scored by a reward
  function, the metrics gathered and reported) over the same generation and scoring done by hand on the same prompts
  (a ``DecodeEngine`` of the same capacity, the same batches, ``score``), in alternating turns (11; 7 with --quick).
- ``reward_model_vs_transformers``: the largest difference between a reward model's scores in the trainer (a tiny
  Llama classifier of ours, rows of several lengths batched and padded) and transformers'
  ``AutoModelForSequenceClassification`` on the same tokens, one row at a time.
- ``bradley_terry_vs_trl``: the largest difference between the reward model's Bradley–Terry loss (with TRL's centring
  term) and TRL 1.16's ``RewardTrainer.compute_loss`` on the same rewards.
- ``judge_256_s``: seconds to score 256 completions with a remote judge (``kind: openai``, ``max_in_flight: 16``)
  against a server on this host, in a process of its own, answering each request in 50 ms (median of 5 batches; 3
  with --quick). 256 / 16 x 50 ms = 0.8 s is the floor.
- ``lm_eval_same_accuracy``: ``python -m astrai.evaluate`` (what ``invoke eval`` runs in the image) on a checkpoint of
  a tiny model with a local task gives the accuracy ``lm_eval`` run by hand on the exported folder gives.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

from bench.common import REPO, Figures, fix_threads

TURNS = (7, 11)
JUDGE_BATCHES = (3, 5)
JUDGE_DELAY = 0.05
PROMPTS, EVAL_TOKENS, EVAL_BATCH = 64, 32, 8

REWARD = "def length(prompts, completions, **fields):\n    return [len(c) / 32 for c in completions]\n"
SERVER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from judge_server import JudgeServer
server = JudgeServer(delay=float(sys.argv[2]))
print(server.url, flush=True)
time.sleep(3600)
"""


def run(quick: bool) -> Figures:
    figures = Figures()
    fix_threads()
    with tempfile.TemporaryDirectory(prefix="astrai-bench-judging-") as work:
        folder = Path(work)
        _eval_vs_manual(figures, folder, TURNS[0] if quick else TURNS[1])
        _reward_model(figures, folder)
        _bradley_terry(figures)
        _judge(figures, JUDGE_BATCHES[0] if quick else JUDGE_BATCHES[1])
        _lm_eval(figures, folder)
    return figures


def _eval_vs_manual(figures: Figures, folder: Path, turns: int) -> None:
    from astrai.common.config import build_config
    from astrai.data.pipeline import prepare
    from astrai.trainer.generation.decoding import DecodeEngine, Draws
    from astrai.trainer.launch.distributed import init_distributed
    from astrai.trainer.objectives.rewards import score
    from astrai.trainer.run.loop import open_trainer
    from bench.trainer_speed import make_assets

    params, data = make_assets(folder, "tiny")
    records = folder / "prompts.jsonl"
    records.write_text("".join(json.dumps({"prompt": f"Tell me about {n}:"}) + "\n" for n in range(PROMPTS)))
    prepare(data / "eval", [records], kind="prompts")
    (folder / "reward.py").write_text(REWARD)
    config = build_config(
        {
            "data": {"data_root_path": str(data), "window_size": 64, "num_workers": 0},
            "training": {"max_steps": 10**6, "batch_per_device": 8, "device": "cpu"},
            "ckpt": {"ckpt_dir": str(folder / "job"), "param_path": str(params), "ckpt_interval": 10**9},
            "log": {
                "eval_prompts": "eval",
                "eval_rewards": _specs([f"{folder / 'reward.py'}:length"]),
                "eval_max_completion_length": EVAL_TOKENS,
                "eval_batch_size": EVAL_BATCH,
                "eval_interval": 10**9,
            },
        }
    )
    trainer = open_trainer(config, init_distributed("none", "cpu"))
    try:
        evaluation, model = trainer.evaluation, trainer.model
        engine = DecodeEngine(model, capacity=evaluation.engine.capacity, rows_per_part=evaluation.engine.rows_per_part)
        prompts, sampling = evaluation.prompts, evaluation.settings.sampling

        def by_hand() -> None:
            model.eval()
            for numbers in evaluation.batches():
                ids = [prompts.ids[number] for number in numbers]
                completions = engine.generate(ids, sampling, evaluation.stop, [Draws(len(ids))])
                texts = [evaluation.decode(completion) for completion in completions]
                score(evaluation.rewards, [prompts.texts[n] for n in numbers], texts, prompts.fields_of(numbers, 1))
            model.train()

        def in_the_loop() -> None:
            evaluation.run(model, 0)

        in_the_loop(), by_hand()  # warm up: each engine makes its decode steps once
        loop_times, hand_times = [], []
        for _ in range(turns):
            began = time.perf_counter()
            in_the_loop()
            loop_times.append(time.perf_counter() - began)
            began = time.perf_counter()
            by_hand()
            hand_times.append(time.perf_counter() - began)
        figures.ratio("eval_vs_manual", loop_times, hand_times)
        figures.median("eval_s", loop_times)
    finally:
        trainer.close()


def _specs(entries):
    from astrai.common.reward_specs import parse_rewards

    return parse_rewards(entries)


def _reward_model(figures: Figures, folder: Path) -> None:
    import dataclasses

    from transformers import AutoModelForSequenceClassification

    from astrai.trainer.launch.distributed import init_distributed
    from astrai.trainer.models.native import Transformer
    from astrai.trainer.models.weights import PRESETS, save_model_folder
    from astrai.trainer.objectives.model_rewards import load_model_reward

    config = dataclasses.replace(PRESETS["tiny"], num_labels=1, pad_token_id=0)
    model = Transformer(config)
    model.init_weights(torch.Generator().manual_seed(0))
    save_model_folder(folder / "rm", config, model.state_dict())
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randint(1, config.vocab_size, (length,), generator=generator).tolist() for length in (5, 17, 64, 3)]
    ours = load_model_reward(_specs([{"model": str(folder / "rm")}])[0], init_distributed("none", "cpu"), _off())
    scored = ours.function.score_rows(rows * 4)
    reference = AutoModelForSequenceClassification.from_pretrained(folder / "rm", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = [float(reference(torch.tensor([row])).logits[0, 0]) for row in rows * 4]
    gaps = [abs(a - b) for a, b in zip(scored, theirs, strict=True)]
    figures.observed("reward_model_vs_transformers", max(gaps), {"ours": scored, "transformers": theirs})


def _off():
    return torch.autocast("cpu", enabled=False)


def _bradley_terry(figures: Figures) -> None:
    from trl import RewardTrainer

    from astrai.trainer.objectives.reward_model import bradley_terry_loss

    generator = torch.Generator().manual_seed(0)
    chosen, rejected = torch.randn(64, generator=generator) * 4, torch.randn(64, generator=generator) * 4
    metrics = {key: [] for key in ("num_tokens", "min_reward", "mean_reward", "max_reward", "accuracy", "margin")}
    identity = types.SimpleNamespace(gather_for_metrics=lambda x: x, gather=lambda x: x)
    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True),
        args=types.SimpleNamespace(center_rewards_coefficient=0.01),
        accelerator=identity,
        _metrics={"train": metrics},
        _total_train_tokens=0,
        _tp_size=1,
    )
    logits = torch.cat([chosen, rejected]).unsqueeze(-1)
    inputs = {"attention_mask": torch.ones(128, 8, dtype=torch.long)}
    theirs = RewardTrainer.compute_loss(trainer, lambda **_: types.SimpleNamespace(logits=logits), inputs)
    ours = bradley_terry_loss(chosen, rejected, 0.01).mean()
    figures.observed(
        "bradley_terry_vs_trl", abs(ours.item() - theirs.item()), {"ours": ours.item(), "trl": theirs.item()}
    )


def _judge(figures: Figures, batches: int) -> None:
    from astrai.trainer.objectives.judges import load_judge

    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(REPO / "tests" / "unit"), str(JUDGE_DELAY)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = server.stdout.readline().strip()
        entry = {"url": url + "/v1/chat/completions", "kind": "openai", "max_in_flight": 16}
        entry["prompt"] = "{prompt}\nRESPONSE:\n{completion}"
        judge = load_judge(_specs([entry])[0])
        completions = [f"completion {n}" for n in range(256)]
        judge.function(["p"] * 16, completions[:16])  # the workers' connections are new in every batch; warm the server
        times = []
        for _ in range(batches):
            began = time.perf_counter()
            values = judge.function(["p"] * 256, completions)
            times.append(time.perf_counter() - began)
            assert all(value is not None for value in values)
        figures.median("judge_256_s", times)
    finally:
        server.kill()
        server.wait()


def _lm_eval(figures: Figures, folder: Path) -> None:
    """The harness through astrai.evaluate on a trained checkpoint, and lm_eval's own command on its export."""
    sys.path.insert(0, str(REPO / "tests" / "unit"))
    from test_harness import make_tokenized_job, write_task

    from astrai.common.config import KEY_SECTION
    from astrai.evaluate import main
    from astrai.host.export import export_checkpoint
    from astrai.trainer.launch.distributed import init_distributed
    from astrai.trainer.run.loop import open_trainer

    def train_yaml(path, **keys):
        import yaml

        document = {}
        values = {"window_size": 32, "batch_per_device": 4, "num_workers": 0, "device": "cpu", **keys}
        for key, value in values.items():
            document.setdefault(KEY_SECTION[key], {})[key] = value
        path.write_text(yaml.safe_dump(document))
        return path

    def run_trainer(path):
        from astrai.common.config import load_trainer_config

        trainer = open_trainer(load_trainer_config(path), init_distributed("none", "cpu"))
        try:
            trainer.train()
        finally:
            trainer.close()

    root = folder / "harness"
    root.mkdir()
    job, checkpoint = make_tokenized_job(root, train_yaml, run_trainer)
    write_task(root / "tasks")
    out = root / "ours.json"
    assert main(["--checkpoint", str(checkpoint), "--tasks", str(root / "tasks"), "--out", str(out)]) == 0
    ours = json.loads(out.read_text())["results"]["tiny_facts"]["acc,none"]
    export_checkpoint(checkpoint, root / "exported", None, 5 * 2**30)
    by_hand = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={root / 'exported'}",
         "--tasks", "tiny_facts", "--include_path", str(root / "tasks"), "--device", "cpu",
         "--output_path", str(root / "by-hand")],
        cwd=root / "tasks", capture_output=True, text=True,
        env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(root)},
    )  # fmt: skip
    if by_hand.returncode != 0:
        raise RuntimeError(by_hand.stderr[-2000:])
    (written,) = (root / "by-hand").rglob("results_*.json")
    theirs = json.loads(written.read_text())["results"]["tiny_facts"]["acc,none"]
    figures.observed("lm_eval_same_accuracy", ours == theirs, {"invoke_eval": ours, "lm_eval_by_hand": theirs})
