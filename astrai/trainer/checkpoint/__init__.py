"""Checkpoints on the trainer's side, in two parts, as Lightning's CheckpointIO splits them.

- :mod:`~astrai.trainer.checkpoint.files`: the file format, written and read with torch;
- :mod:`~astrai.trainer.checkpoint.manager`: when to save, the background writer, the collectives
  and resuming with fallback.

The folder rules both sides share are :mod:`astrai.common.checkpoints`.
"""
