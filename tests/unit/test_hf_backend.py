"""model.backend: a family the trainer does not compute (GPT-NeoX) trains through transformers.

seq, sft, dpo and online_grpo steps with LoRA on every linear layer of its blocks; the export (merged, loaded by
AutoModelForCausalLM with the trainer's logits; the PEFT folder, loaded by PEFT); a stop and resume that ends bitwise
as the uninterrupted run; which backend ``auto`` picks, and ``native`` refused for a family it lacks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainer_runs import TRAINER, Run, final_weights, metrics_step, run_to_end, stop_gracefully

from astrai.common.backends import resolve_backend
from astrai.common.checkpoints import latest_complete_checkpoint
from astrai.common.config import load_trainer_config
from astrai.common.configfile import ConfigError
from astrai.common.contract import REASON_EMERGENCY
from astrai.common.plan import resolve_plan
from astrai.host.export import export_checkpoint
from astrai.trainer.models.hf_model import TransformersModel
from astrai.trainer.models.lora import adapter_parameters
from astrai.trainer.models.scoring import TokenTargets

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LORA = {"lora_rank": 4, "lora_alpha": 8}
NEOX_LINEARS = ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")


def _write_neox(folder: Path, vocab_size: int) -> Path:
    config = transformers.GPTNeoXConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        rotary_pct=0.5,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def neox(tmp_path_factory, chat_world) -> Path:
    """A tiny random GPT-NeoX folder as save_pretrained writes it (its output matrix as ``embed_out``), with a
    vocabulary that holds the chat world's tokens and the byte-level corpus'."""
    from tokenizers import Tokenizer

    world = chat_world[0]
    vocab = max(Tokenizer.from_file(str(world.tokenizer / "tokenizer.json")).get_vocab_size(), 300)
    return _write_neox(tmp_path_factory.mktemp("neox"), vocab)


def _neox_yaml(write, path: Path, neox: Path, **keys) -> Path:
    return write(path, **keys, param_path=str(neox))


def test_auto_picks_native_for_llama_and_transformers_for_gpt_neox(tiny_model, neox, job_yaml, capsys):
    assert resolve_backend("auto", "llama") == "native"
    assert resolve_backend("auto", "gpt_neox") == "transformers"
    assert resolve_backend("transformers", "llama") == "transformers"
    native = resolve_plan(load_trainer_config(job_yaml()), "cpu", 1)
    assert (native.backend, native.model_type) == ("native", "llama")
    assert "model: llama native" in native.lines()
    plan = resolve_plan(load_trainer_config(job_yaml(param_path=str(neox))), "cpu", 1)
    assert plan.backend == "transformers" and not plan.compile
    assert "model: gpt_neox via transformers (no native implementation: slower than native families)" in plan.lines()
    from astrai.trainer.run.loop import dry_run

    assert dry_run(load_trainer_config(job_yaml(param_path=str(tiny_model)), [("backend", "transformers")])) == 0
    assert "model: llama via transformers (model.backend: transformers: slower than native families)" in (
        capsys.readouterr().out
    )


def test_native_with_a_family_it_lacks_is_refused_naming_the_key(neox, job_yaml):
    config = load_trainer_config(job_yaml(param_path=str(neox)), [("backend", "native")])
    with pytest.raises(ConfigError, match="model.backend: native, but model_type 'gpt_neox' has no native") as error:
        resolve_plan(config, "cpu", 1)
    assert "set model.backend: transformers" in str(error.value)
    with pytest.raises(ConfigError, match="model.backend: expected auto | native | transformers"):
        load_trainer_config(job_yaml(), [("backend", "hf")])
    for key, value, message in [
        ("lora_targets", "q_proj,v_proj", "training.lora_targets q_proj, v_proj: with model.backend transformers"),
        ("format", "sharded", "ckpt.format: sharded is not supported with model.backend transformers"),
        ("parallel_mode", "fsdp", "parallel.parallel_mode: fsdp is not supported with model.backend transformers"),
    ]:
        lora = {"lora_rank": 4} if key == "lora_targets" else {}
        config = load_trainer_config(job_yaml(param_path=str(neox), **lora), [(key, value)])
        with pytest.raises(ConfigError, match=message):
            resolve_plan(config, "cpu", 2, value if key == "parallel_mode" else "ddp")
    lines = resolve_plan(load_trainer_config(job_yaml(param_path=str(neox), lora_rank=4)), "cpu", 1).lines()
    assert any(line.startswith("lora: rank 4") and "every linear layer of each decoder block" in line for line in lines)


def test_the_adapter_scores_as_the_library_computes_with_packed_records(neox):
    from astrai.trainer.models.hf_model import load_transformers_start

    config, weights = load_transformers_start(neox)
    model = TransformersModel(config)
    model.load_weights(weights, str(neox))
    library = transformers.AutoModelForCausalLM.from_pretrained(neox, dtype=torch.float32).eval()
    model.eval()
    tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = library(tokens).logits
        assert torch.equal(model(tokens), logits)
        scores = model(tokens[:, :-1], score=TokenTargets(tokens[:, 1:], entropy=True))
        expected = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        assert (scores.logps - expected).abs().max() <= 1e-5
        # Two records packed in a row score as each alone.
        segments = torch.tensor([[0] * 8 + [1] * 8] * 2)
        positions = torch.arange(8).repeat(2).expand(2, -1)
        packed = model(tokens, positions, segments, score=TokenTargets(tokens)).logps
        alone = model(tokens[:, 8:], score=TokenTargets(tokens[:, 8:])).logps
        assert (packed[:, 8:] - alone).abs().max() <= 1e-5


def test_seq_with_lora_adapts_every_block_linear_and_exports_merged_and_peft(
    tmp_path, job_yaml, make_trainer, neox, one_thread
):
    trainer = make_trainer(job_yaml(param_path=str(neox), max_steps=3, ckpt_interval=3, **LORA))
    try:
        adapters = adapter_parameters(trainer.model)
        assert set(adapters) == {
            f"gpt_neox.layers.{i}.{linear}.lora_{ab}.weight" for i in range(2) for linear in NEOX_LINEARS for ab in "AB"
        }
        trainer.train()
        generator = torch.Generator().manual_seed(3)
        for param in adapter_parameters(trainer.model).values():  # adapters that visibly change the logits
            with torch.no_grad():
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
        tokens = torch.randint(0, 256, (2, 24), generator=generator)
        trainer.model.eval()
        with torch.no_grad():
            ours = trainer.model(tokens)
        checkpoint = trainer.save_checkpoint(REASON_EMERGENCY)
    finally:
        trainer.close()
    saved = load_file(checkpoint / "model.safetensors")
    assert all(name.startswith("base_model.model.gpt_neox.layers.") and ".lora_" in name for name in saved)
    assert json.loads((checkpoint / "config.json").read_text()) == json.loads((neox / "config.json").read_text())

    merged = tmp_path / "merged"
    export_checkpoint(checkpoint, merged, "float32", 1 << 30, base=neox)
    library = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (library(tokens).logits - ours).abs().max() <= 1e-4

    folder = tmp_path / "adapter"
    export_checkpoint(checkpoint, folder, None, 1 << 30, adapter=True)
    assert json.loads((folder / "adapter_config.json").read_text())["target_modules"] == sorted(
        linear.rpartition(".")[2] for linear in NEOX_LINEARS
    )
    base = transformers.AutoModelForCausalLM.from_pretrained(neox, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, folder).eval()
    with torch.no_grad():
        assert (loaded(tokens).logits - ours).abs().max() <= 1e-4


@pytest.mark.parametrize(("kind", "lora"), [("sft", True), ("dpo", True), ("dpo", False)])
def test_sft_and_dpo_steps(tmp_path, post_yaml, make_trainer, neox, one_thread, kind, lora):
    path = post_yaml(
        tmp_path / f"{kind}.yaml",
        kind,
        param_path=str(neox),
        ckpt_dir=str(tmp_path / "ckpt"),
        max_steps=2,
        log_interval=1,
        batch_per_device=2,
        **(LORA if lora else {}),
    )
    trainer = make_trainer(path)
    try:
        trainer.train()
    finally:
        trainer.close()
    first = json.loads((tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()[0])
    assert math.isfinite(first["loss"])
    if kind == "dpo":  # the reference (the model with its adapters off, or a frozen copy) starts at ln 2
        assert abs(first["loss"] - math.log(2)) <= 1e-6
    assert latest_complete_checkpoint(tmp_path / "ckpt").step == 2


@pytest.mark.parametrize("kind", ["online_grpo", "online_dpo"])
def test_online_steps_with_lora(tmp_path, train_yaml, make_trainer, neox, one_thread, kind):
    from astrai.data.pipeline import prepare

    records = tmp_path / "prompts.jsonl"
    records.write_text(
        "".join(json.dumps({"prompt": f"say {n % 10}:", "digit": str(n % 10)}) + "\n" for n in range(8)),
        encoding="utf-8",
    )
    prepare(tmp_path / "data", [records], kind="prompts")
    rewards = tmp_path / "rewards.py"
    rewards.write_text(
        "def first_code(prompts, completions, **fields):\n"
        "    return [ord(c[0]) / 1000 if c else 0.0 for c in completions]\n",
        encoding="utf-8",
    )
    path = train_yaml(
        tmp_path / "grpo.yaml",
        train_type=kind,
        data_root_path=str(tmp_path / "data"),
        rewards=[f"{rewards}:first_code"],
        **({"num_generations": 4} if kind == "online_grpo" else {}),
        max_completion_length=5,
        batch_per_device=2,
        max_steps=2,
        ckpt_interval=2,
        log_interval=1,
        warmup_ratio=0.0,
        param_path=str(neox),
        ckpt_dir=str(tmp_path / "ckpt"),
        **LORA,
    )
    trainer = make_trainer(path)
    try:
        trainer.train()
    finally:
        trainer.close()
    lines = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "loss" in line] == [1, 2]
    assert latest_complete_checkpoint(tmp_path / "ckpt").step == 2


@pytest.mark.slow
@pytest.mark.parametrize("lora", [True, False])
def test_a_stopped_and_resumed_run_ends_bitwise_as_an_uninterrupted_one(tmp_path, train_yaml, trainer_env, neox, lora):
    keys = {"max_steps": 20, "ckpt_interval": 5, "log_interval": 1, "param_path": str(neox), **(LORA if lora else {})}
    whole = train_yaml(tmp_path / "whole.yaml", ckpt_dir=str(tmp_path / "whole"), **keys)
    run_to_end([*TRAINER, "--config", str(whole)], trainer_env, tmp_path / "whole.log")
    parts = train_yaml(tmp_path / "parts.yaml", ckpt_dir=str(tmp_path / "parts"), **keys)
    # Stopped (SIGTERM) once step 3 is logged: the run saves where it is, and the second run resumes there.
    stop_gracefully(
        Run([*TRAINER, "--config", str(parts)], trainer_env, tmp_path / "first.log"),
        lambda: metrics_step(tmp_path / "parts") >= 3,
    )
    stopped = latest_complete_checkpoint(tmp_path / "parts")
    assert stopped is not None and stopped.step < 20
    run = run_to_end([*TRAINER, "--config", str(parts)], trainer_env, tmp_path / "second.log")
    assert f"resumed from {stopped.path}" in run.output()
    assert final_weights(tmp_path / "parts", 20) == final_weights(tmp_path / "whole", 20)


def test_the_image_gets_transformers_only_for_a_job_that_trains_through_it(tmp_path, neox, tiny_model):
    import shutil

    import yaml

    from astrai.host import compose
    from astrai.host.runtime import resolve_runtime

    def packages(model: Path, *args: str) -> str:
        folder = tmp_path / model.name
        shutil.copytree(model, folder / "m")
        for name in ("d", "c"):
            (folder / name).mkdir()
        block = {"job_name": "hf", "gpu": {"devices": "none"}, "paths": {"data": "d", "model": "m", "checkpoints": "c"}}
        (folder / "train.yaml").write_text(yaml.safe_dump({"runtime": block}))
        document = compose.render_override(resolve_runtime(folder / "train.yaml"), list(args), uid=1000, gid=1000)
        shutil.rmtree(folder)
        return document["services"]["trainer"]["build"]["args"]["MODEL_PACKAGES"]

    assert packages(neox) == "transformers==5.25.0"
    assert packages(tiny_model) == ""
    assert packages(tiny_model, "--backend", "transformers") == "transformers==5.25.0"


def test_preflight_names_the_model_type_and_says_the_path_is_slower(tmp_path, neox):
    import shutil

    import yaml

    from astrai.host import preflight
    from astrai.host.runtime import resolve_runtime
    from astrai.host.trainer_config import read_trainer_config

    shutil.copytree(neox, tmp_path / "m")
    for name in ("d", "c"):
        (tmp_path / name).mkdir()
    block = {"job_name": "hf", "gpu": {"devices": "none"}, "paths": {"data": "d", "model": "m", "checkpoints": "c"}}
    (tmp_path / "train.yaml").write_text(yaml.safe_dump({"runtime": block, "training": LORA}))
    runtime = resolve_runtime(tmp_path / "train.yaml")
    config = read_trainer_config(runtime, [])
    model, check = preflight._model_check(runtime, config)
    assert check.mark == preflight.PASS and model[0].model_type == "gpt_neox"
    assert "model: gpt_neox via transformers (no native implementation: slower than native families)" in check.detail
    plan = preflight.container_plan(runtime, config, at_least_one=True)
    assert plan.backend == "transformers"
    refused = read_trainer_config(runtime, ["--backend", "native"])
    _, check = preflight._model_check(runtime, refused)
    assert check.mark == preflight.FAIL and "set model.backend: transformers" in check.detail


def test_rollouts_left_padded_in_one_batch_are_what_transformers_generates_for_each_prompt(neox):
    from astrai.common.settings import Sampling
    from astrai.trainer.generation.library import TransformersDecoding
    from astrai.trainer.models.hf_model import load_transformers_start

    config, weights = load_transformers_start(neox)
    model = TransformersModel(config)
    model.load_weights(weights, str(neox))
    model.eval()
    library = transformers.AutoModelForCausalLM.from_pretrained(neox, dtype=torch.float32).eval()
    prompts = [[5, 17, 42, 9, 100], [7, 3], [250, 1, 8]]
    got = TransformersDecoding(model).generate(prompts, Sampling(max_new_tokens=8))
    for prompt, completion in zip(prompts, got, strict=True):
        expected = library.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert completion == expected[0, len(prompt) :].tolist()


def _trained(trainer) -> tuple[torch.Tensor, torch.Tensor, Path]:
    """Train ``trainer`` to its end: (tokens, the trained model's logits of them, its last checkpoint)."""
    try:
        trainer.train()
        tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
        trainer.model.eval()
        with torch.no_grad():
            ours = trainer.model(tokens)
    finally:
        trainer.close()
    return tokens, ours, latest_complete_checkpoint(Path(trainer.config.ckpt.ckpt_dir)).path


def test_a_full_checkpoint_is_a_folder_transformers_loads_with_the_trainers_logits(
    tmp_path, job_yaml, make_trainer, neox, one_thread
):
    tokens, ours, checkpoint = _trained(make_trainer(job_yaml(param_path=str(neox), max_steps=2, ckpt_interval=2)))
    for folder in (checkpoint, export_checkpoint(checkpoint, tmp_path / "export", "float32", 1 << 30).out):
        library = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            assert torch.equal(library(tokens).logits, ours)


@pytest.mark.parametrize("family", ["gpt2", "tied llama"])
def test_a_tied_output_projection_trains_once_and_loads_back(tmp_path, job_yaml, make_trainer, tiny_model, family):
    """GPT-2 (and the tiny preset through transformers) tie the output projection to the embedding: the folder holds
    it once, the model built for it shares the tensor, the checkpoint loads with the trainer's logits. GPT-2's
    blocks compute with Conv1D, no nn.Linear: LoRA is refused saying so."""
    folder = tiny_model
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=320, n_embd=32, n_layer=2, n_head=4, n_positions=128)
        torch.manual_seed(0)
        folder = tmp_path / "gpt2 é"
        transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    tokens, ours, checkpoint = _trained(
        make_trainer(job_yaml(param_path=str(folder), max_steps=2, backend="transformers"))
    )
    library = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(library(tokens).logits, ours)
    if family == "gpt2":  # refused by the run plan, before anything is built: the layers' kind named
        with pytest.raises(ConfigError, match="gpt2: its decoder blocks hold no nn.Linear layer for LoRA .* Conv1D"):
            make_trainer(job_yaml(param_path=str(folder), backend="transformers", **LORA), ckpt_dir=tmp_path / "lora")
