"""Each native family beyond Llama trained as the trainer trains it, from a transformers folder with every feature
the family has: pre-training (seq), SFT on the family's real chat template, LoRA; each run stopped and resumed
takes the steps an uninterrupted run takes, bit for bit; every checkpoint loads in transformers with our logits;
`invoke export` writes a LoRA checkpoint merged and as a PEFT adapter folder that transformers and PEFT read.

In-process runs on one thread, a few steps each (conftest's run_trainer and make_trainer).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from chat_data import sft_records
from conftest import CORPUS_FILES
from hf_folders import FAMILY_CASES, make_hf_model
from real_chat_templates import make_family_folder
from safetensors.torch import load_file
from trainer_runs import final_weights

from astrai.common.checkpoints import CheckpointMeta, latest_complete_checkpoint
from astrai.common.settings import LoRASettings
from astrai.data.pipeline import prepare
from astrai.data.tokenizing import HFTokenizer
from astrai.host.export import export_checkpoint
from astrai.trainer.models import lora
from astrai.trainer.models.weights import load_pretrained

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TEMPLATES = {"gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3", "olmo2": "olmo2", "granite": "granite3"}
"""Each family, and the chat template (real_chat_templates.py) its instruction-tuned models ship."""
RUN = {"max_steps": 4, "ckpt_interval": 2, "log_interval": 1, "val_fraction": 0.0}
SFT = {"train_type": "sft", "window_size": 96}
LORA = {"lora_rank": 4, "lora_alpha": 8}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def family(request, tmp_path_factory):
    """(family, base model folder, seq data, sft data): one tokenizer of the family's kind with its chat template."""
    name = request.param
    root = tmp_path_factory.mktemp(name)
    records = sft_records(40)
    if name == "gemma2":  # Gemma 2's template refuses a system message
        records = [{"messages": [m for m in r["messages"] if m["role"] != "system"]} for r in records]
    texts = [path.read_text() for path in CORPUS_FILES] + [m["content"] for r in records for m in r["messages"]]
    folder = make_family_folder(root / "tokenizer", TEMPLATES[name], texts * 3)
    tokenizer = HFTokenizer(folder)
    # Room for the SFT windows (Granite's case keeps dynamic NTK, at a longer max_position_embeddings).
    case = {**FAMILY_CASES[name], "vocab_size": 1024, "max_positions": 128, "seed": 2}
    base = make_hf_model(root / "base", **case)
    assert tokenizer.vocab_size <= 1024
    seq, sft = root / "seq", root / "sft"
    prepare(seq, CORPUS_FILES, tokenizer=tokenizer)
    sft_file = root / "sft.jsonl"
    sft_file.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    prepare(sft, [sft_file], tokenizer=tokenizer, kind="sft")
    return name, base, seq, sft


def _whole_and_resumed(tmp_path: Path, train_yaml, run_trainer, make_trainer, **keys) -> Path:
    """Train max_steps at once, and again stopped at half and resumed: the same final checkpoint; its folder."""
    whole = train_yaml(tmp_path / "whole.yaml", ckpt_dir=str(tmp_path / "whole"), **RUN, **keys)
    run_trainer(whole)
    parts = train_yaml(tmp_path / "parts.yaml", ckpt_dir=str(tmp_path / "parts"), **RUN, **keys)
    stats = run_trainer(parts, steps=2)
    assert stats.steps == 2
    resumed = make_trainer(parts)
    try:
        assert resumed.progress.step == 2
        resumed.train()
    finally:
        resumed.close()
    assert final_weights(tmp_path / "parts", 4) == final_weights(tmp_path / "whole", 4)
    return latest_complete_checkpoint(tmp_path / "whole").path


def _loads_in_transformers_with_our_logits(checkpoint: Path, base: Path) -> None:
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    tokens = torch.randint(0, 1024, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours = load_pretrained(checkpoint)(tokens)
        assert (hf.eval()(tokens).logits - ours).abs().max().item() <= 1e-5
        assert (load_pretrained(base)(tokens) - ours).abs().max().item() > 1e-3  # training changed the model


@pytest.mark.slow
def test_pretraining_stops_resumes_exactly_and_its_checkpoints_load_in_transformers(
    tmp_path, family, train_yaml, run_trainer, make_trainer, one_thread
):
    name, base, seq, _ = family
    checkpoint = _whole_and_resumed(
        tmp_path, train_yaml, run_trainer, make_trainer, param_path=str(base), data_root_path=str(seq)
    )
    assert json.loads((checkpoint / "config.json").read_text())["model_type"] == name
    _loads_in_transformers_with_our_logits(checkpoint, base)


@pytest.mark.slow
def test_sft_on_the_familys_own_chat_template_stops_resumes_exactly(
    tmp_path, family, train_yaml, run_trainer, make_trainer, one_thread
):
    _, base, _, sft = family
    keys = dict(param_path=str(base), data_root_path=str(sft), **SFT)
    checkpoint = _whole_and_resumed(tmp_path, train_yaml, run_trainer, make_trainer, **keys)
    _loads_in_transformers_with_our_logits(checkpoint, base)
    # The template travels with the data into every checkpoint: transformers renders the same conversation.
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "cat"}], tokenize=False)


@pytest.mark.slow
def test_lora_stops_resumes_exactly_and_exports_merged_and_as_a_peft_adapter(
    tmp_path, family, train_yaml, run_trainer, make_trainer, one_thread
):
    name, base, _, sft = family
    keys = dict(param_path=str(base), data_root_path=str(sft), **SFT, **LORA)
    checkpoint = _whole_and_resumed(tmp_path, train_yaml, run_trainer, make_trainer, **keys)
    # Our model with the checkpoint's adapters, as the trainer holds it.
    model = load_pretrained(base)
    record = CheckpointMeta.read(checkpoint).lora
    settings = LoRASettings(record["rank"], record["alpha"], record["dropout"], tuple(record["targets"]))
    lora.add_adapters(model, settings)
    adapters = lora.from_peft_names(load_file(checkpoint / "model.safetensors"), str(checkpoint))
    lora.load_adapters(model, adapters, str(checkpoint))
    tokens = torch.randint(0, 1024, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = model(tokens)

    merged = tmp_path / "merged"
    export_checkpoint(checkpoint, merged, "float32", 1 << 30, base=base)
    assert json.loads((merged / "config.json").read_text())["model_type"] == name
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    adapter = tmp_path / "adapter"
    export_checkpoint(checkpoint, adapter, None, 1 << 30, adapter=True)
    modules = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    fused = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert set(modules) == (
        fused if name == "phi3" else {f"{p}_proj" for p in ("q", "k", "v", "o", "gate", "up", "down")}
    )
    loaded = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter
    ).eval()
    with torch.no_grad():
        # Merged, W + s * B @ A rounds otherwise than W x + s * B (A x) (as test_lora_training allows).
        assert (hf(tokens).logits - ours).abs().max().item() <= 1e-4
        assert (loaded(tokens).logits - ours).abs().max().item() <= 1e-5
        assert (load_pretrained(base)(tokens) - ours).abs().max().item() > 1e-4  # the adapters trained
