"""A native model's folder in and out: the presets ``init`` writes, reading a folder's weights (either naming, one
file or shards) checked against its config, Hugging Face's names for a state dict, loading a base model or a
checkpoint, and writing a model folder atomically."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from astrai.common.contract import MODEL_CONFIG_FILE, WEIGHTS_FILE
from astrai.common.model_folder import (
    ModelConfig,
    ModelLoadError,
    describe,
    expert_pieces,
    inspect_weights,
    saved_name,
    tensor_shapes,
)
from astrai.common.safetensors_file import FLOAT_DTYPES
from astrai.trainer.models.native import Transformer

PRESETS = {
    # About 0.9M parameters: fast enough for tests on one CPU thread.
    "tiny": ModelConfig(),
    # About 25M parameters.
    "small": ModelConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=8, ffn_hidden_dim=1408),
    # About 125M parameters; grouped-query attention keeps the KV projections small.
    "base": ModelConfig(dim=768, n_layers=18, n_heads=12, n_kv_heads=4, ffn_hidden_dim=2304, max_seq_len=2048),
}


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.save_file`` with the usual file mode.

    safetensors creates files readable by their owner only; a base model made
    by one user must stay readable by the container, which may run as another.
    """
    save_file(tensors, path, metadata=metadata)
    os.chmod(path, _FILE_MODE)


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


# Read once at import: changing the umask later, from the checkpoint writer thread, would race other threads.
_FILE_MODE = 0o666 & ~_umask()


def read_weights(folder: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The weights of a model folder, by our tensor names, in the dtype they are stored in.

    Reads either naming, one file or shards, fp32, bf16 or fp16. The file headers are checked against the
    config first (missing, unexpected, misshapen tensors), so a bad folder fails before any weight is read.
    bf16 and fp16 weights become fp32 when ``load_state_dict`` copies them into the (fp32) model: that
    copy happens anyway, so widening them here would only add a pass over every weight.

    Each file's header is read once (by the check): the tensors are then views of the file mapped into
    memory (copy-on-write), read from the disk as they are used.
    """
    summary = inspect_weights(folder, config)
    state = {}
    pieces: dict[str, list] = {}
    for path, names in summary.names.items():
        start, layout = summary.layouts[path]
        try:
            with open(path, "rb") as handle:
                mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY) if start < _size(handle) else None
        except OSError as error:
            raise ModelLoadError(f"{path}: {error.strerror}") from None
        for stored, ours in names.items():
            dtype, shape, (begin, end) = layout[stored]
            kind = _TORCH_DTYPES[dtype]
            if end == begin:
                state[ours] = torch.empty(shape, dtype=kind)
                continue
            count = (end - begin) // kind.itemsize
            tensor = torch.frombuffer(mapped, dtype=kind, count=count, offset=start + begin).view(shape)
            if stored in summary.pieces:
                pieces.setdefault(ours, []).append((summary.pieces[stored], tensor))
            else:
                state[ours] = tensor
    shapes = tensor_shapes(config)
    for ours, parts in pieces.items():
        # An expert tensor stored in parts (each expert's matrices) is put together here: a copy.
        state[ours] = stacked = torch.empty(shapes[ours], dtype=parts[0][1].dtype)
        for piece, tensor in parts:
            piece.select(stacked).copy_(tensor)
    return state


# The weight dtypes a model folder may hold, as torch dtypes.
_TORCH_DTYPES = {name: getattr(torch, dtype) for name, dtype in FLOAT_DTYPES.items()}


def _size(handle) -> int:
    return os.fstat(handle.fileno()).st_size


def hf_state_dict(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The same tensors under Hugging Face's names in ``config``'s family, as written to ``model.safetensors``: as
    transformers' ``save_pretrained`` writes them (the experts one matrix per expert and projection)."""
    tensors = {}
    pieces: dict[str, list] = {}
    for stored, piece in expert_pieces(config, per_expert=True).items():
        pieces.setdefault(piece.name, []).append((stored, piece))
    for name, tensor in state.items():
        if name in pieces:
            tensors.update({stored: piece.select(tensor).contiguous() for stored, piece in pieces[name]})
        else:
            tensors[saved_name(name, config)] = tensor.contiguous()
    return tensors


def load_base_model(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and checked weights of a base model folder (ours, or a Hugging Face one of a native family)."""
    folder = Path(folder)
    config = ModelConfig.load(folder)
    return config, read_weights(folder, config)


def load_pretrained(folder: Path) -> Transformer:
    """The model of a folder (a base model, a Hugging Face folder of a native family or a checkpoint), fp32, in eval
    mode.

    ``model(tokens)`` maps token ids ``[batch, seq]`` to logits ``[batch, seq, vocab]``.
    """
    config, state = load_base_model(folder)
    model = Transformer(config)
    model.load_state_dict(state)
    return model.eval()


def describe_folder(folder: Path) -> str:
    """One line about a model folder (architecture, parameter count, dtype); a bad folder raises ModelLoadError."""
    config = ModelConfig.load(folder)
    return describe(folder, config, inspect_weights(folder, config))


def write_base_model(folder: Path, config: ModelConfig, seed: int = 0) -> int:
    """Initialise a model from ``seed`` and write it to ``folder``; returns the parameter count."""
    model = Transformer(config)
    model.init_weights(torch.Generator().manual_seed(seed))
    return save_model_folder(folder, config, model.state_dict())


def save_model_folder(folder: Path, config: ModelConfig, state: dict[str, torch.Tensor]) -> int:
    """Write ``config.json`` and ``model.safetensors`` (Hugging Face names) into ``folder``; the parameter count.

    Both go under temporary names first and are renamed, so an interrupted write never leaves half a model.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(state, config)
    weights_tmp = folder / f".{WEIGHTS_FILE}.tmp"
    config_tmp = folder / f".{MODEL_CONFIG_FILE}.tmp"
    save_tensors(tensors, weights_tmp, metadata={"format": "pt"})
    config_tmp.write_text(config.to_json(), encoding="utf-8")
    os.replace(weights_tmp, folder / WEIGHTS_FILE)
    os.replace(config_tmp, folder / MODEL_CONFIG_FILE)
    return sum(t.numel() for t in tensors.values())
