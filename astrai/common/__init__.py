"""The shared layer: names, rules and file formats that the host and the trainer both rely on.

Everything here imports without torch (the host never installs it); the trainer imports it too,
so both sides read train.yaml, checkpoint folders, model folders, data folders and metrics.jsonl
the same way.
"""
