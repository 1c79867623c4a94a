"""The trainer layer: what runs inside the container (or on any machine with torch), grouped by lifetime.

- ``launch``: the container's process before torch (the entrypoint, torchrun, the stop signals while starting);
- ``feed``: token windows and post-training records, what the data loader hands the loop;
- ``models``: the native model and its parts, experts, LoRA and NF4, the transformers model, the backend, compiling;
- ``generation``: the generation engines, stop tokens, and ``python -m astrai.model``;
- ``objectives``: what a step optimises, its rollouts and rewards, and agents' episodes;
- ``checkpoint``: checkpoints written and read, in every format;
- ``run``: one training run: building it, the loop, the optimizer, validation, evaluation, reports and trackers,
  distributed set-up and determinism.

``entrypoint`` keeps the container's entrypoint at the name images and manifests give it.
"""
