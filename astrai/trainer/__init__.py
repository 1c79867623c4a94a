"""The trainer layer: what runs inside the container (or on any machine with torch).

The training loop, checkpoint I/O, the model, data loading, distributed setup, and the
container's entrypoint, which starts them.
"""
