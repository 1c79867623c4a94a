"""A model folder, read without torch: which tensors its architecture holds, under which Hugging Face names, and
what its weight files hold.

The host (preflight) and the trainer read folders through this module, so both accept and refuse the same ones.
``config.json`` is read by :mod:`astrai.common.model_config` (one of the families the trainer computes itself:
MODEL_TYPES). Weights are ``model.safetensors``, or shards listed in ``model.safetensors.index.json``, under the
family's Hugging Face tensor names (``model.layers.0.self_attn.q_proj.weight``); :func:`hf_name` maps ours
(``layers.0.attention.wq.weight``) onto them, family by family: the norms of a block are named by where they sit,
and Phi-3's fused projections (``qkv_proj``, ``gate_up_proj``) are matrices of their own.

A mixture of experts (``qwen3_moe``, ``mixtral``) holds each sparse layer's experts stacked: ``feed_forward.gate_up``
(experts, 2 * expert_hidden_dim, dim), gate rows then up rows, and ``feed_forward.down`` (experts, dim,
expert_hidden_dim), beside the router ``feed_forward.router.weight`` (experts, dim). A folder may store them as
transformers 5.x holds them (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``) or one matrix per expert and
projection, as ``save_pretrained`` writes them (``mlp.experts.{e}.gate_proj.weight``; Mixtral's
``block_sparse_moe.experts.{e}.w1.weight``, w3 the up projection, w2 the down one): :class:`ExpertPiece`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from astrai.common.contract import META_FILE, MODEL_CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE
from astrai.common.families import family
from astrai.common.layers import BLOCK_NORMS, layer_tensors
from astrai.common.model_config import (  # noqa: F401  (the names model folders are read with)
    MODEL_TYPES,
    ROPE_TYPES,
    ModelConfig,
    RopeScaling,
)
from astrai.common.safetensors_file import FLOAT_DTYPES, ModelLoadError, read_header, read_layout  # noqa: F401

# Tensor names

PROJECTIONS = {
    # ours -> Hugging Face's, for the linear layers of a block
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wqkv": "self_attn.qkv_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w13": "mlp.gate_up_proj",
    "feed_forward.w2": "mlp.down_proj",
}
_QK_NORMS = {"attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm"}
_TOP_PARTS = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head", "classifier": "score"}


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the architecture holds, by our module name, with its shape: each block's from the kinds of layer
    it is built of (:mod:`astrai.common.layers`)."""
    shapes = {"tok_embeddings.weight": (config.vocab_size, config.dim)}
    for i in range(config.n_layers):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in layer_tensors(config, i).items()})
    shapes["norm.weight"] = (config.dim,)
    if config.num_labels is not None:  # a sequence classifier: its score head in place of the output projection
        shapes["classifier.weight"] = (config.num_labels, config.dim)
    elif not config.tie_embeddings:
        shapes["output.weight"] = (config.vocab_size, config.dim)
    return shapes


def num_parameters(config: ModelConfig) -> int:
    return sum(math.prod(shape) for shape in tensor_shapes(config).values())


def num_active_parameters(config: ModelConfig) -> int:
    """The parameters one token is computed with: all of them but the experts the router does not choose for it."""
    unused = config.n_experts - config.experts_per_token
    per_expert = 3 * config.dim * (config.expert_hidden_dim or 0)
    return num_parameters(config) - len(config.sparse_layers) * unused * per_expert


# Experts

_EXPERT_HF = {"gate_up": "experts.gate_up_proj", "down": "experts.down_proj"}
"""The stacked tensors, ours -> transformers 5.x's names (where save_pretrained writes each expert's matrices is the
family's: its spec's ExpertNames)."""


@dataclass(frozen=True)
class ExpertPiece:
    """What a stored tensor holds of a stacked expert tensor: ``expert`` e's matrix (None: every expert's, the 5.x
    stacked layout), its ``half`` of the rows (gate or up of gate_up; None: all)."""

    name: str
    expert: int | None
    half: str | None

    def units(self, config: ModelConfig) -> set[tuple[int, str | None]]:
        """The (expert, half) parts of our tensor this piece fills."""
        experts = range(config.n_experts) if self.expert is None else (self.expert,)
        halves = ("gate", "up") if self.name.endswith("gate_up") and self.half is None else (self.half,)
        return {(e, h) for e in experts for h in halves}

    def shape(self, whole: tuple[int, ...]) -> tuple[int, ...]:
        """The stored shape of this piece of a tensor of shape ``whole``."""
        shape = whole if self.expert is None else whole[1:]
        if self.half is not None:
            shape = (shape[0] // 2, *shape[1:])
        return shape

    def select(self, stacked):
        """The part of ``stacked`` (our tensor) this piece is: a view of it."""
        part = stacked if self.expert is None else stacked[self.expert]
        if self.half is None:
            return part
        rows = part.shape[-2] // 2
        return part[..., :rows, :] if self.half == "gate" else part[..., rows:, :]


def expert_pieces(config: ModelConfig, per_expert: bool) -> dict[str, ExpertPiece]:
    """Stored name -> the piece of our stacked tensors it holds: each expert's matrices as save_pretrained writes
    them (``per_expert``), else transformers 5.x's stacked ones."""
    pieces = {}
    names = family(config.family).experts
    for i in config.sparse_layers:
        for ours, stacked in _EXPERT_HF.items():
            name = f"layers.{i}.feed_forward.{ours}"
            if not per_expert:
                pieces[f"model.layers.{i}.mlp.{stacked}"] = ExpertPiece(name, None, None)
                continue
            for e in range(config.n_experts):
                for matrix, half in names.matrices[ours]:
                    pieces[f"model.layers.{i}.{names.parent}.experts.{e}.{matrix}.weight"] = ExpertPiece(name, e, half)
    return pieces


def _is_expert_tensor(name: str) -> bool:
    return name.endswith(("feed_forward.gate_up", "feed_forward.down"))


def hf_name(name: str, config: ModelConfig) -> str:
    """Hugging Face's name for one of our tensor names, in ``config``'s family.

    ``layers.0.attention.wq.weight`` -> ``model.layers.0.self_attn.q_proj.weight``
    """
    module, _, leaf = name.rpartition(".")
    if module in _TOP_PARTS:
        return f"{_TOP_PARTS[module]}.{leaf}"
    if _is_expert_tensor(name):  # transformers 5.x's stacked experts
        return f"model.{module.replace('feed_forward', 'mlp')}.{_EXPERT_HF[leaf]}"
    if module.endswith("feed_forward.router"):
        return f"model.{module.replace('feed_forward.router', 'mlp.gate')}.{leaf}"
    _, index, part = module.split(".", 2)
    hf = PROJECTIONS.get(part) or _QK_NORMS.get(part) or BLOCK_NORMS[config.block_norms][part]
    return f"model.layers.{index}.{hf}.{leaf}"


def hf_names(config: ModelConfig) -> dict[str, str]:
    """Hugging Face name -> our name, for every tensor of the architecture (experts: 5.x's stacked names)."""
    return {hf_name(name, config): name for name in tensor_shapes(config)}


def saved_name(name: str, config: ModelConfig) -> str:
    """The name save_pretrained gives one of our tensors other than the experts (a family's spec may save the router
    elsewhere: Mixtral's keeps its 4.x name)."""
    hf = hf_name(name, config)
    names = family(config.family).experts
    if names is not None and names.router_parent != "mlp" and name.endswith("feed_forward.router.weight"):
        return hf.replace(".mlp.gate.", f".{names.router_parent}.gate.")
    return hf


# LoRA targets

ADAPTER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of a block LoRA adapts, by PEFT's (Hugging Face's) module names. A layer that computes several
of them at once (Phi-3's ``qkv_proj``, ``gate_up_proj``) is named by its parts: FUSED_TARGETS."""
FUSED_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
EXPERT_TARGETS = ("gate_proj", "up_proj", "down_proj")
"""The targets that are a mixture of experts' experts. Its dense layers' MLPs (Qwen3-MoE's mlp_only_layers) are not
adapted: PEFT, given these targets on such a model, adapts the experts' stacked parameters alone."""
EXPERT_ADAPTERS = ("feed_forward.gate_up", "feed_forward.down")
"""Our stacked expert parameters LoRA adapts, in the order PEFT's target_parameters name them (PEFT_EXPERT_PARAMETERS):
one A (rank * experts, in) and one B (out, rank * experts) each, PEFT's 3-D layout."""
PEFT_EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
PEFT_EXPERT_MODULES = {"feed_forward.gate_up": "mlp.experts.base_layer", "feed_forward.down": "mlp.experts"}
"""Where PEFT keeps each expert adapter: it wraps the experts once per target parameter, the first innermost."""
PEFT_MODULES = {hf.rpartition(".")[2]: ours for ours, hf in PROJECTIONS.items()}
"""PEFT's name of each linear layer of a block (every family's), and ours."""
PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a Hugging Face module name in an adapter file."""


def canonical_targets(targets) -> tuple[str, ...]:
    """LoRA targets by ADAPTER_TARGETS' names: a fused layer's name stands for its parts (in order, each once)."""
    names: list[str] = []
    for target in targets:
        names += [part for part in FUSED_TARGETS.get(target, (target,)) if part not in names]
    return tuple(names)


def adapted_modules(config: ModelConfig, targets) -> tuple[str, ...]:
    """Our names of the linear layers of each block that LoRA on ``targets`` adapts in ``config``'s family.

    A fused layer (Phi-3) is adapted as PEFT adapts it, one A and one B for the whole matrix, when every part of it
    is named; ValueError for some of its parts without the others, which one matrix cannot give.
    """
    wanted = canonical_targets(targets)
    experts = [target for target in wanted if target in EXPERT_TARGETS]
    if config.n_experts and experts:
        left_out = [target for target in EXPERT_TARGETS if target not in experts]
        if left_out:
            raise ValueError(
                f"lora_targets {', '.join(wanted)}: a mixture of experts' experts are adapted whole (one A and B per "
                f"expert on gate and up together, one on down, as PEFT adapts transformers' stacked experts); name "
                f"{', '.join(left_out)} too, or none of {', '.join(EXPERT_TARGETS)}"
            )
        attention = tuple(PEFT_MODULES[target] for target in wanted if target not in EXPERT_TARGETS)
        return attention + EXPERT_ADAPTERS
    if not config.fused_projections:
        return tuple(PEFT_MODULES[target] for target in wanted)
    modules: list[str] = []
    for target in wanted:
        fused = next((name for name, parts in FUSED_TARGETS.items() if target in parts), None)
        if fused is None:
            modules.append(PEFT_MODULES[target])
            continue
        left_out = [part for part in FUSED_TARGETS[fused] if part not in wanted]
        if left_out:
            parts = FUSED_TARGETS[fused]
            raise ValueError(
                f"lora_targets {', '.join(wanted)}: {config.model_type} computes {', '.join(parts)} in one layer "
                f"({fused}), which is adapted whole; name {', '.join(left_out)} too, or none of {', '.join(parts)}"
            )
        if PEFT_MODULES[fused] not in modules:
            modules.append(PEFT_MODULES[fused])
    return tuple(modules)


def num_adapter_parameters(config: ModelConfig, rank: int, targets) -> int:
    """What LoRA of ``rank`` on ``targets`` (PEFT's names) trains: rank * (in + out) for each adapted matrix. An
    estimate for any targets: a fused layer named in part counts whole (the trainer refuses such targets)."""
    wanted = canonical_targets(targets)
    shapes = tensor_shapes(config)
    if config.n_experts:
        # The experts: one A and B per expert on gate and up together, one on down (a part counts them all).
        mlp = {target for target in wanted if target in EXPERT_TARGETS}
        d, h = config.dim, config.expert_hidden_dim
        per_expert = rank * (d + 2 * h) + rank * (h + d) if mlp else 0
        return len(config.sparse_layers) * config.n_experts * per_expert + sum(
            rank * sum(shapes[f"layers.{index}.{PEFT_MODULES[target]}.weight"])
            for index in range(config.n_layers)
            for target in wanted
            if target not in mlp
        )
    whole = [part for parts in FUSED_TARGETS.values() if set(parts) & set(wanted) for part in parts]
    return sum(
        rank * sum(shapes[f"layers.{index}.{module}.weight"])
        for index in range(config.n_layers)
        for module in adapted_modules(config, (*wanted, *whole) if config.fused_projections else wanted)
    )


def peft_adapter_config(rank: int, alpha: float, dropout: float, modules, base_model: str = "", parameters=()) -> str:
    """adapter_config.json of a plain LoRA adapter (no bias, DoRA or rsLoRA), as PEFT writes and reads it;
    ``modules``: the PEFT names of the layers it adapts (the model's own: ``qkv_proj`` in a Phi-3); ``parameters``:
    the stacked expert parameters it adapts (PEFT's target_parameters)."""
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    if parameters:
        config["target_parameters"] = list(parameters)
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def peft_target(name: str) -> tuple[str, str] | None:
    """(the Hugging Face weight an adapter tensor of PEFT's name belongs to, "A" or "B"), or None.

    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` -> ``model.layers.0.self_attn.q_proj.weight``
    """
    head, found, part = name.removeprefix(PEFT_PREFIX).partition(".lora_")
    if not name.startswith(PEFT_PREFIX) or not found or part not in ("A.weight", "B.weight"):
        return None
    return f"{head}.weight", part[0]


def peft_modules_of(names) -> tuple[str, ...]:
    """The PEFT module names (``q_proj``, ``qkv_proj``) an adapter file's tensors (PEFT's names) adapt, sorted (the
    experts' adapters left out: PEFT_EXPERT_PARAMETERS)."""
    found = {peft_target(name) for name in names if not peft_expert_adapter(name)}
    return tuple(sorted({weight.rsplit(".", 2)[-2] for weight, _ in found - {None}}))


def peft_expert_adapter(name: str) -> tuple[str, str] | None:
    """(our stacked expert parameter, "A" or "B") an adapter tensor of PEFT's name belongs to, or None.

    ``base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight`` -> (``layers.0.feed_forward.gate_up``, A)
    """
    head, found, part = name.removeprefix(PEFT_PREFIX + "model.layers.").partition(".lora_")
    index, _, module = head.partition(".")
    if not name.startswith(PEFT_PREFIX) or not found or not index.isdigit() or part not in ("A.weight", "B.weight"):
        return None
    ours = next((ours for ours, peft in PEFT_EXPERT_MODULES.items() if peft == module), None)
    return None if ours is None else (f"layers.{index}.{ours}", part[0])


def _ignored(hf: str, config: ModelConfig) -> bool:
    # Older Llama exports store the RoPE frequencies (derived, not weights); tied models sometimes
    # store the output matrix although it is the embedding.
    return hf.endswith(".rotary_emb.inv_freq") or (config.tie_embeddings and hf == "lm_head.weight")


# Weight files


@dataclass(frozen=True)
class WeightsSummary:
    """What a folder's weight files hold, checked against its config."""

    files: tuple[Path, ...]
    names: dict[Path, dict[str, str]]
    """For each file: name in the file -> our tensor name (tensors the loader skips are not listed)."""
    layouts: dict[Path, tuple[int, dict[str, tuple[str, tuple[int, ...], tuple[int, int]]]]]
    """For each file: where its data starts, and each tensor's dtype, shape and byte range (read_layout)."""
    dtypes: tuple[str, ...]
    """torch dtype names found, e.g. ('bfloat16',)."""
    num_parameters: int
    pieces: dict[str, ExpertPiece] = dataclasses.field(default_factory=dict)
    """The stored tensors that hold a part of a stacked expert tensor (``names`` gives which), and which part."""


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder: ``model.safetensors``, or the shards its index names."""
    folder = Path(folder)
    single, index = folder / WEIGHTS_FILE, folder / WEIGHTS_INDEX_FILE
    if single.is_file():
        return [single]
    if not index.is_file():
        raise ModelLoadError(f"{folder}: {WEIGHTS_FILE} is missing (and no {WEIGHTS_INDEX_FILE} lists shards)")
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError("weight_map is not a non-empty object")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ModelLoadError(f"{index}: unreadable shard index ({type(error).__name__}: {error})") from None
    files = []
    for name in sorted(set(weight_map.values()), key=str):
        if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
            raise ModelLoadError(f"{index}: weight_map names {name!r}, expected a file name in {folder}")
        if not (folder / name).is_file():
            tensor = next(t for t, f in weight_map.items() if f == name)
            raise ModelLoadError(f"{index}: weight_map puts {tensor!r} in {name}, which is missing from {folder}")
        files.append(folder / name)
    return files


def model_digest(folder: Path) -> str:
    """SHA-256 over a model folder's config.json and weight files (in name order): which model it is exactly."""
    folder = Path(folder)
    digest = hashlib.sha256()
    for path in [folder / MODEL_CONFIG_FILE, *weight_files(folder)]:
        digest.update(path.name.encode() + b"\0")
        try:
            with path.open("rb") as handle:
                while chunk := handle.read(1 << 23):
                    digest.update(chunk)
        except OSError as error:
            raise ModelLoadError(f"{path}: cannot be read ({error.strerror})") from None
    return digest.hexdigest()


def _refuse_adapters_only(folder: Path) -> None:
    """A LoRA checkpoint's weights are adapters, not a model: say so, and how to get a model folder from it."""
    try:
        lora = json.loads((folder / META_FILE).read_bytes()).get("lora")
    except (OSError, ValueError, AttributeError):
        return
    if isinstance(lora, dict):
        base = lora.get("base", {}).get("path") if isinstance(lora.get("base"), dict) else None
        raise ModelLoadError(
            f"{folder} is a LoRA checkpoint: its weights are adapters of the base model {base}, not a whole model; "
            "`invoke export --checkpoint ... --out DIR` writes it merged into a model folder to start from"
        )


BASE_SAMPLES_PER_TENSOR = 8
BASE_SAMPLE_BYTES = 4096


def base_digest(folder: Path) -> str:
    """SHA-256 of what identifies a base model cheaply: config.json, each weight file's safetensors header and size,
    and eight evenly spaced 4 KiB samples of every tensor's data. A LoRA checkpoint records it: its adapters
    belong to that base alone.

    The header says which tensors there are (names, dtypes, shapes); the samples of every tensor tell two models of
    the same architecture apart (a base, its fine-tune, its merge with adapters, which changes whole matrices)
    while reading a few megabytes of an 8B model instead of all of it.
    """
    folder = Path(folder)
    digest = hashlib.sha256()
    try:
        digest.update((folder / MODEL_CONFIG_FILE).read_bytes())
        for path in weight_files(folder):
            data_start, layout = read_layout(path)
            with path.open("rb") as handle:
                digest.update(path.name.encode() + b"\0" + str(os.fstat(handle.fileno()).st_size).encode() + b"\0")
                digest.update(handle.read(data_start))
                for _, _, (begin, stop) in sorted(layout.values(), key=lambda entry: entry[2]):
                    step = max((stop - begin) // BASE_SAMPLES_PER_TENSOR, 1)
                    for offset in range(begin, stop, step)[:BASE_SAMPLES_PER_TENSOR]:
                        handle.seek(data_start + offset)
                        digest.update(handle.read(min(BASE_SAMPLE_BYTES, stop - offset)))
    except OSError as error:
        raise ModelLoadError(f"{folder}: cannot be read ({error.strerror})") from None
    return digest.hexdigest()


def other_base(
    holder: Path, lora: dict, folder: Path, digest: str | None = None, named: str | None = None
) -> str | None:
    """None when ``folder`` is the base model the LoRA adapters in ``holder`` were trained on (``lora``: what their
    checkpoint records, :attr:`astrai.common.checkpoints.CheckpointMeta.lora`), else the sentence saying it is not;
    ``digest``: the folder's :func:`base_digest` when already computed; ``named``: how the sentence names the folder."""
    recorded = lora["base"]
    digest = base_digest(folder) if digest is None else digest
    if digest == recorded["sha256"]:
        return None
    return (
        f"{holder} holds LoRA adapters of the base model {recorded['path']} (sha256 {recorded['sha256'][:12]}), and "
        f"{named or folder} is another model (sha256 {digest[:12]}): adapters fit only the base they were trained on"
    )


def inspect_weights(folder: Path, config: ModelConfig) -> WeightsSummary:
    """Check, from the file headers alone, that a folder's weights are exactly what its config implies."""
    _refuse_adapters_only(Path(folder))
    files = weight_files(folder)
    shapes, from_hf, pieces = _expected(config)
    names: dict[Path, dict[str, str]] = {}
    found: dict[tuple[str, object], Path] = {}
    dtypes = set()
    layouts = {}
    for path in files:
        names[path] = in_file = {}
        layouts[path] = layout = read_layout(path)
        for stored, (dtype, shape, _) in layout[1].items():
            name, piece = from_hf.get(stored), pieces.get(stored)
            if name is None and piece is None:
                if _ignored(stored, config):
                    continue
                raise ModelLoadError(f"{path}: unexpected tensor {stored!r} (not in the architecture of config.json)")
            if piece is not None:
                name = piece.name
            expected = shapes[name] if piece is None else piece.shape(shapes[name])
            for unit in piece.units(config) if piece is not None else (None,):
                if (name, unit) in found:
                    other = found[(name, unit)].name
                    raise ModelLoadError(f"{path}: tensor {stored!r} holds weights stored twice (also in {other})")
                found[(name, unit)] = path
            if shape != expected:
                raise ModelLoadError(
                    f"{path}: tensor {stored!r} has shape {list(shape)}, config.json expects {list(expected)}"
                )
            if dtype not in FLOAT_DTYPES:
                raise ModelLoadError(
                    f"{path}: tensor {stored!r} has dtype {dtype}, expected one of {', '.join(FLOAT_DTYPES.values())}"
                )
            in_file[stored] = name
            dtypes.add(FLOAT_DTYPES[dtype])
    for name in shapes:
        units = ExpertPiece(name, None, None).units(config) if _is_expert_tensor(name) else {None}
        if any((name, unit) not in found for unit in units):
            raise ModelLoadError(
                f"{Path(folder)}: tensor {hf_name(name, config)!r} is missing from the weights "
                f"(config.json expects shape {list(shapes[name])}, or each expert's matrices)"
            )
    return WeightsSummary(
        tuple(files),
        names,
        layouts,
        tuple(sorted(dtypes)),
        num_parameters(config),
        {stored: piece for stored, piece in pieces.items() if any(stored in n for n in names.values())},
    )


@functools.lru_cache(maxsize=8)
def _expected(config: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, str], dict[str, ExpertPiece]]:
    # Computed once per architecture: the loader looks every stored tensor up in these.
    shapes = tensor_shapes(config)
    from_hf = {hf: name for hf, name in hf_names(config).items() if not _is_expert_tensor(name)}
    from_hf.update({saved_name(name, config): name for name in shapes if not _is_expert_tensor(name)})
    return shapes, from_hf, {**expert_pieces(config, True), **expert_pieces(config, False)}


def describe(folder: Path, config: ModelConfig, weights: WeightsSummary) -> str:
    """One line: the family and what it computes beyond Llama, parameter count, dtype, files."""
    shards = f"{len(weights.files)} shards" if len(weights.files) > 1 else weights.files[0].name
    extras = []
    if config.n_kv_heads != config.n_heads:
        extras.append(f"GQA {config.n_heads}/{config.n_kv_heads}")
    extras += _features(config)
    if config.tie_embeddings:
        extras.append("tied")
    detail = f", {', '.join(extras)}" if extras else ""
    return (
        f"{config.model_type} ({config.n_layers} layers, dim {config.dim}, vocab {config.vocab_size}{detail}), "
        f"{_count(weights.num_parameters)} parameters, {'/'.join(weights.dtypes)}, {shards}"
    )


def _features(config: ModelConfig) -> list[str]:
    """What the model computes beyond a Llama block, in a few words each."""
    found = []
    if config.local_layers:
        found.append(_sliding_pattern(config))
    elif config.sliding_window is not None:
        found.append(f"sliding window {config.sliding_window}")
    caps = [
        (what, cap)
        for what, cap in (("attention", config.attn_logit_softcapping), ("logits", config.final_logit_softcapping))
        if cap
    ]
    if caps:
        found.append("soft-capping " + ", ".join(f"{what} {cap:g}" for what, cap in caps))
    if config.rope_scaling is not None:
        found.append(f"rope {config.rope_scaling.rope_type}" + (" (global layers)" if config.local_rope_theta else ""))
    if config.local_rope_theta is not None:
        found.append(f"local rope base {config.local_rope_theta:g}")
    if config.partial_rotary_factor != 1.0:
        found.append(f"rotary {config.rotary_dim}/{config.head_size} of each head")
    if config.fused_projections:
        found.append("fused qkv_proj, gate_up_proj")
    if config.qk_norm is not None:
        found.append(f"q/k norms per {config.qk_norm}")
    if config.n_experts:
        dense = f", {len(config.dense_layers)} dense layers" if config.dense_layers else ""
        found.append(
            f"{config.n_experts} experts, {config.experts_per_token} per token{dense}, "
            f"{_count(num_active_parameters(config))} active parameters per token"
        )
    if config.attention_multiplier is not None:
        found.append(
            f"multipliers embedding {config.embedding_multiplier:g}, attention {config.attention_multiplier:g}, "
            f"residual {config.residual_multiplier:g}, logits /{config.logits_scaling:g}"
        )
    return found


def _sliding_pattern(config: ModelConfig) -> str:
    """``sliding window 512 on 5 of every 6 layers`` (a regular pattern ending each period with a global layer),
    else ``sliding window 512 on 13 of 26 layers``."""
    local = set(config.local_layers)
    period = next((i + 1 for i in range(config.n_layers) if i not in local), config.n_layers + 1)
    regular = all((i in local) == bool((i + 1) % period) for i in range(config.n_layers))
    if regular and period <= config.n_layers:
        return f"sliding window {config.local_window} on {period - 1} of every {period} layers"
    return f"sliding window {config.local_window} on {len(local)} of {config.n_layers} layers"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)
