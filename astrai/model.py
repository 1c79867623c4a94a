"""A decoder-only transformer language model in plain PyTorch.

Token embedding, rotary position embedding, RMSNorm, causal attention through
``scaled_dot_product_attention`` (optionally with fewer key/value heads than
query heads), a SwiGLU MLP and an optionally tied output embedding. A base
model folder holds ``config.json`` (the architecture) and ``model.safetensors``.

Write a fresh base model::

    python -m astrai.model init params --preset tiny
    python -m astrai.model init params --preset small --vocab_size 512 --max_seq_len 2048
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from astrai.contract import MODEL_CONFIG_FILE, WEIGHTS_FILE



class ModelLoadError(Exception):
    """A model folder whose config or weights cannot be used; the message says which file and tensor."""


@dataclass(frozen=True)
class ModelConfig:
    """The architecture; stored as ``config.json`` next to the weights."""

    vocab_size: int = 320
    """Embedding rows. The byte tokenizer needs 257; 320 rounds that up to a multiple of 64 for fast matmuls."""
    dim: int = 128
    """Width of the residual stream."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads per attention layer; must divide ``dim``."""
    n_kv_heads: int = 4
    """Key/value heads; fewer than ``n_heads`` gives grouped-query attention. Must divide ``n_heads``."""
    ffn_hidden_dim: int = 384
    """Hidden width of the SwiGLU MLP."""
    max_seq_len: int = 1024
    """Longest sequence the rotary tables cover; ``window_size`` must not exceed it."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    tie_embeddings: bool = True
    """Reuse the token embedding as the output projection (saves ``vocab_size * dim`` parameters)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name}: expected a positive number, got {value!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"tie_embeddings: expected true or false, got {self.tie_embeddings!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim({self.dim}) must be a multiple of n_heads({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads({self.n_heads}) must be a multiple of n_kv_heads({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(
                f"head dim dim({self.dim}) / n_heads({self.n_heads}) = {self.head_dim} "
                f"must be even for rotary embedding"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        """Build from parsed JSON; unknown or badly typed fields raise ValueError."""
        if not isinstance(values, dict):
            raise ValueError("expected a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)

    @classmethod
    def load(cls, folder: Path) -> ModelConfig:
        """Read ``folder/config.json``; any problem raises ModelLoadError naming the file."""
        path = Path(folder) / MODEL_CONFIG_FILE
        try:
            with open(path, encoding="utf-8") as handle:
                return cls.from_dict(json.load(handle))
        except FileNotFoundError:
            raise ModelLoadError(f"{path}: not found") from None
        except (OSError, ValueError, TypeError) as error:
            raise ModelLoadError(f"{path}: {error}") from None


PRESETS = {
    # About 0.9M parameters: fast enough for tests on one CPU thread.
    "tiny": ModelConfig(),
    # About 25M parameters.
    "small": ModelConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=8, ffn_hidden_dim=1408),
    # About 125M parameters; grouped-query attention keeps the KV projections small.
    "base": ModelConfig(dim=768, n_layers=18, n_heads=12, n_kv_heads=4, ffn_hidden_dim=2304, max_seq_len=2048),
}


def rotary_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (max_seq_len, head_dim // 2)."""
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim))
    angles = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Rotate the two halves of each head as pairs (the GPT-NeoX layout); x is (B, H, T, D).
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q = self.wq(x).view(batch, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden_dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_hidden_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Maps token ids (B, T) to next-token logits (B, T, vocab_size)."""

    def __init__(self, config: ModelConfig, activation_checkpointing: bool = False):
        super().__init__()
        self.config = config
        # Recompute each block's activations in backward instead of storing them: less memory, ~30% more compute.
        self.activation_checkpointing = activation_checkpointing
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        # A tied model has no separate output tensor, so the state dict never holds two names for one tensor
        # (which safetensors refuses to save).
        self.output = None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = rotary_tables(config)
        # Derived from the config, so not part of the state dict.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """GPT-2 style init: N(0, 0.02), with residual output projections scaled down by depth."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                nn.init.normal_(param, std=residual_std, generator=generator)
            elif param.dim() >= 2:
                nn.init.normal_(param, std=0.02, generator=generator)
            else:
                nn.init.ones_(param)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq_len = tokens.shape[1]
        if seq_len > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {self.config.max_seq_len}")
        cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            if self.activation_checkpointing and self.training:
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        x = self.norm(x)
        if self.output is None:
            return F.linear(x, self.tok_embeddings.weight)
        return self.output(x)


def num_parameters(config: ModelConfig) -> int:
    """Parameter count of a config, computed without allocating weights."""
    with torch.device("meta"):
        model = Transformer(config)
    return sum(p.numel() for p in model.parameters())


def check_state_dict(state: dict[str, torch.Tensor], config: ModelConfig, source: Path | str) -> None:
    """Raise ModelLoadError unless ``state`` has exactly the tensors, shapes and dtypes the config implies."""
    with torch.device("meta"):
        expected = Transformer(config).state_dict()
    for name, want in expected.items():
        if name not in state:
            raise ModelLoadError(f"{source}: tensor {name!r} is missing (config.json expects shape {list(want.shape)})")
        got = state[name]
        if tuple(got.shape) != tuple(want.shape):
            raise ModelLoadError(
                f"{source}: tensor {name!r} has shape {list(got.shape)}, config.json expects {list(want.shape)}"
            )
        if not got.is_floating_point():
            raise ModelLoadError(f"{source}: tensor {name!r} has dtype {got.dtype}, expected a floating point dtype")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ModelLoadError(f"{source}: unexpected tensor {unexpected[0]!r} (not in the architecture of config.json)")


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


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """Read a ``model.safetensors`` file to CPU; a missing or damaged file raises ModelLoadError."""
    try:
        return load_file(path, device="cpu")
    except FileNotFoundError:
        if Path(path).exists():
            raise ModelLoadError(f"{path}: cannot be read by uid {os.getuid()}; check its permissions") from None
        raise ModelLoadError(f"{path}: not found") from None
    except (OSError, SafetensorError) as error:
        raise ModelLoadError(f"{path}: {error}") from None


def load_base_model(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and checked weights of a base model folder (``config.json`` + ``model.safetensors``)."""
    folder = Path(folder)
    config = ModelConfig.load(folder)
    state = load_weights(folder / WEIGHTS_FILE)
    check_state_dict(state, config, folder / WEIGHTS_FILE)
    return config, state


def write_base_model(folder: Path, config: ModelConfig, seed: int = 0) -> int:
    """Initialise a model from ``seed`` and write it to ``folder``; returns the parameter count."""
    folder.mkdir(parents=True, exist_ok=True)
    model = Transformer(config)
    model.init_weights(torch.Generator().manual_seed(seed))
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    # Write under temporary names and rename, so an interrupted init never leaves a half-written model.
    weights_tmp = folder / f".{WEIGHTS_FILE}.tmp"
    config_tmp = folder / f".{MODEL_CONFIG_FILE}.tmp"
    save_tensors(state, weights_tmp, metadata={"format": "pt"})
    config_tmp.write_text(config.to_json(), encoding="utf-8")
    os.replace(weights_tmp, folder / WEIGHTS_FILE)
    os.replace(config_tmp, folder / MODEL_CONFIG_FILE)
    return sum(t.numel() for t in state.values())


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m astrai.model", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    init = commands.add_parser("init", help="write a freshly initialised base model (config.json, model.safetensors)")
    init.add_argument("dir", type=Path, help="model folder to write")
    init.add_argument("--preset", choices=sorted(PRESETS), required=True, help="architecture to start from")
    init.add_argument("--seed", type=int, default=0, help="seed of the weight initialisation (default 0)")
    init.add_argument("--force", action="store_true", help="overwrite a model that already exists in DIR")
    for field in dataclasses.fields(ModelConfig):
        kind = _parse_bool if field.type == "bool" else float if field.type == "float" else int
        init.add_argument(f"--{field.name}", type=kind, help=f"override the preset's {field.name}")
    args = parser.parse_args(argv)

    overrides = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(ModelConfig) if getattr(args, f.name) is not None
    }
    try:
        config = dataclasses.replace(PRESETS[args.preset], **overrides)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not args.force and ((args.dir / WEIGHTS_FILE).exists() or (args.dir / MODEL_CONFIG_FILE).exists()):
        print(f"error: {args.dir} already holds a model; pass --force to overwrite it", file=sys.stderr)
        return 1
    count = write_base_model(args.dir, config, seed=args.seed)
    print(f"wrote {args.preset} model ({count / 1e6:.2f}M parameters) to {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
