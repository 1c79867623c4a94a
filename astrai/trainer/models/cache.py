"""Generation's key/value cache (buffers of a fixed capacity, which slots hold a token), and the additive masks it
and the model build."""

from __future__ import annotations

import torch

from astrai.common.model_folder import ModelConfig
from astrai.trainer.models.rope import rotary_tables


class KVCache:
    """Every layer's keys and values in buffers of a fixed capacity, and which of their slots hold a token.

    Its state lives in device tensors (the next slot, each row's next rotary position, the visible slots), so a
    decode step (:meth:`Transformer.decode_step`) reads no Python number that changes from one token to the next:
    the same kernels, on the same buffers, compute every step (what a CUDA graph replays).
    """

    def __init__(self, config: ModelConfig, batch: int, capacity: int, device: torch.device, dtype: torch.dtype):
        shape = (batch, config.n_kv_heads, capacity, config.head_size)
        self.capacity = capacity
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.visible = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        """Which slots hold a token (not left padding, not yet written)."""
        self.slot = torch.zeros((), dtype=torch.long, device=device)
        """The slot the next token goes into."""
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        """Each row's rotary position of its next token (its real tokens so far)."""
        self.length = 0
        """Slots filled, as the eager path (:meth:`begin`) counts them; a decode step counts on the device."""
        self.local_window = config.attention_window if config.window_layers else None
        """A windowed layer (every layer of a Mistral, Gemma's local ones) sees the last local_window tokens only."""
        self.rotary: dict[bool, tuple[torch.Tensor, torch.Tensor]] | None = None
        """The rotary tables (cos, sin) of every position of the cache, by layer kind (windowed or not), owned by the
        cache so that they live as long as the decode step that reads them (a captured step keeps their addresses);
        None for a RoPE that changes with the length, whose tables each step computes (such steps are not captured)."""
        if not config.rope_depends_on_length:
            kinds = {False, bool(config.window_layers)}
            self.rotary = {local: rotary_tables(config, capacity, device, None, local) for local in kinds}
        self._slots = torch.arange(capacity, device=device)
        self._step = False

    def reset(self) -> None:
        """Empty, in place: the buffers stay where they are (a captured decode step keeps reading them)."""
        self.visible.zero_()
        self.slot.zero_()
        self.positions.zero_()
        self.length = 0

    def store(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Put a layer's new keys and values (B, H, T, D) into their slots; every slot's (B, H, capacity, D)."""
        keys, values = keys.to(self.keys[layer].dtype), values.to(self.values[layer].dtype)
        if self._step:
            self.keys[layer].index_copy_(2, self.slot.view(1), keys)
            self.values[layer].index_copy_(2, self.slot.view(1), values)
        else:
            self.keys[layer][:, :, self.length : self.length + keys.shape[2]] = keys
            self.values[layer][:, :, self.length : self.length + keys.shape[2]] = values
        return self.keys[layer], self.values[layer]

    def begin(self, real: torch.Tensor) -> tuple[torch.Tensor, dict[bool, torch.Tensor]]:
        """Note which of the next T tokens (B, T) are real; their positions (B, T) and the additive attention masks
        (B, 1, T, capacity) of the forward pass that adds them, by layer kind (local or not). Eager: T and the slots
        filled are Python numbers."""
        start, count = self.length, real.shape[1]
        if start + count > self.capacity:
            raise ValueError(f"{start + count} tokens do not fit a cache of {self.capacity}")
        self._step = False
        self.visible[:, start : start + count] = real
        positions = (self.positions.unsqueeze(1) + real.cumsum(dim=1) - 1).clamp(min=0)
        query = torch.arange(start, start + count, device=real.device).unsqueeze(1)
        key = self._slots.unsqueeze(0)
        allowed = (key <= query).unsqueeze(0) & self.visible.unsqueeze(1)
        masks = {False: _padded_mask(allowed, key == query)}
        if self.local_window is not None:
            # Cache slots and positions differ by a row's left padding only, so their distances are the same.
            masks[True] = _padded_mask(allowed & (key > query - self.local_window).unsqueeze(0), key == query)
        return positions, masks

    def begin_step(self) -> tuple[torch.Tensor, dict[bool, torch.Tensor]]:
        """One real token per row into the next slot, with device state only: its positions (B, 1) and the attention
        masks (B, 1, 1, capacity) by layer kind."""
        self._step = True
        self.visible.index_fill_(1, self.slot.view(1), True)
        masks = {False: _step_mask(self.visible)}
        if self.local_window is not None:
            masks[True] = _step_mask(self.visible & (self._slots > self.slot - self.local_window).unsqueeze(0))
        return self.positions.unsqueeze(1), masks

    def advance(self, real: torch.Tensor | None = None) -> None:
        """Count the tokens just added: ``real`` (B, T) of :meth:`begin`'s pass, or one per row of a step."""
        if real is None:
            self.slot.add_(1)
            self.positions.add_(1)
            self._step = False
            return
        self.length += real.shape[1]
        self.slot.fill_(self.length)
        self.positions.add_(real.sum(dim=1))


def _step_mask(visible: torch.Tensor) -> torch.Tensor:
    return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, float("-inf"))[:, None, None, :]


def _padded_mask(allowed: torch.Tensor, itself: torch.Tensor) -> torch.Tensor:
    # A padding query sees itself: its row stays finite (and nothing real ever attends to it).
    allowed = allowed | itself.unsqueeze(0)
    return torch.zeros(allowed.shape, device=allowed.device).masked_fill_(~allowed, float("-inf")).unsqueeze(1)


def additive_mask(allowed: torch.Tensor) -> torch.Tensor:
    # Additive (0 / -inf), built once for every layer: attention with a float mask is the faster path.
    return torch.zeros(allowed.shape, device=allowed.device).masked_fill_(~allowed, float("-inf"))
