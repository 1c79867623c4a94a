# The trainer image. Build it with `invoke build --config train.yaml`, which passes
# the build arguments below from the YAML's `runtime.container` block.
#
# Layers go from slow-changing to fast-changing, so a code-only change rebuilds
# only the last COPY (seconds). A base image that already holds Python 3.10+,
# torch 2.13.0, safetensors, PyYAML and NumPy builds with no network at all.

ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# Declared again to be seen after FROM (the error messages name it).
ARG BASE_IMAGE
ARG CUDA_TAG=cpu
# One torch in every image: the version the tests run (astrai/common/contract.py TORCH_VERSION).
ARG TORCH_VERSION=2.13.0
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1

# Install only what the base lacks. A CUDA runtime base has no Python: python3
# comes from the distribution. torch comes pinned from the PyTorch index of the
# requested build (cu128, cpu, ...); a base that already holds a different torch
# fails here rather than train on a version nobody tested. The small pure
# packages come from PyPI.
# TensorBoard (event files) is optional: it is added only when something required
# was missing, i.e. when this build goes to the network anyway. A base image that
# holds everything required but TensorBoard still builds offline; the trainer
# then says once that event files are off.
ARG TENSORBOARD_VERSION=2.21.0
RUN set -eu; \
    online=no; \
    if ! command -v python3 >/dev/null 2>&1; then \
        if ! command -v apt-get >/dev/null 2>&1; then \
            echo "error: the base image has no python3 and no apt-get;" \
                 "set runtime.container.base_image to an image with Python 3.10+" >&2; \
            exit 1; \
        fi; \
        echo "installing python3 from the distribution"; \
        apt-get update -qq; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3 python3-pip >/dev/null; \
        rm -rf /var/lib/apt/lists/*; \
        online=yes; \
    fi; \
    python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { \
        echo "error: the base image's python3 is older than 3.10" >&2; exit 1; }; \
    found=$(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null || true); \
    if [ -z "${found}" ]; then \
        echo "installing torch ${TORCH_VERSION} for ${CUDA_TAG}"; \
        python3 -m pip install --index-url "https://download.pytorch.org/whl/${CUDA_TAG}" "torch==${TORCH_VERSION}"; \
        online=yes; \
    elif [ "${found%%+*}" != "${TORCH_VERSION}" ]; then \
        echo "error: the base image ${BASE_IMAGE} holds torch ${found}, but astrai runs torch ${TORCH_VERSION} only;" \
             "use a base image without torch (the build installs ${TORCH_VERSION})" \
             "or with torch ${TORCH_VERSION}" >&2; \
        exit 1; \
    elif [ "${found#*+}" != "${found}" ] && [ "${found#*+}" != "${CUDA_TAG}" ]; then \
        echo "error: the base image ${BASE_IMAGE} holds torch ${found}, a build for ${found#*+}, but" \
             "runtime.container.cuda_tag is ${CUDA_TAG}; use a base image without torch" \
             "or with torch ${TORCH_VERSION}+${CUDA_TAG}" >&2; \
        exit 1; \
    fi; \
    for module in safetensors:safetensors yaml:pyyaml numpy:numpy; do \
        if ! python3 -c "import ${module%%:*}" >/dev/null 2>&1; then \
            python3 -m pip install "${module#*:}"; \
            online=yes; \
        fi; \
    done; \
    if ! python3 -c 'import tensorboard' >/dev/null 2>&1; then \
        if [ "${online}" = yes ]; then \
            python3 -m pip install "tensorboard==${TENSORBOARD_VERSION}"; \
        else \
            echo "note: the base image has no tensorboard and this build needs no network, so none is added:" \
                 "TensorBoard event files will be off"; \
        fi; \
    fi
# Experiment tracker clients (log.report_to: mlflow, wandb), only when the job reports to one. A layer of its own
# before the code, so a code change does not install them again; `invoke start` passes the pinned versions
# (astrai/common/contract.py TRACKER_PACKAGES).
ARG TRACKER_PACKAGES=""
RUN set -eu; \
    if [ -n "${TRACKER_PACKAGES}" ]; then \
        echo "installing the tracker clients: ${TRACKER_PACKAGES}"; \
        python3 -m pip install --quiet ${TRACKER_PACKAGES}; \
    fi
# transformers, only for a job whose model trains through it (model.backend: transformers, or auto with a family
# the trainer does not compute), and torchao, only for a job whose LoRA base is held in 4 bits
# (training.lora_base_dtype: nf4); `invoke start` passes the pinned versions (astrai/common/backends.py,
# astrai/common/nf4.py).
ARG MODEL_PACKAGES=""
RUN set -eu; \
    if [ -n "${MODEL_PACKAGES}" ]; then \
        echo "installing the model's packages: ${MODEL_PACKAGES}"; \
        python3 -m pip install --quiet ${MODEL_PACKAGES}; \
    fi
# lm-evaluation-harness, only in the image `invoke eval` runs (the job's image with this layer, tagged :eval):
# `invoke eval` passes the pinned versions (astrai/common/contract.py LM_EVAL_PACKAGES) and preflight reads the label.
ARG EVAL_PACKAGES=""
RUN set -eu; \
    if [ -n "${EVAL_PACKAGES}" ]; then \
        echo "installing lm-evaluation-harness: ${EVAL_PACKAGES}"; \
        python3 -m pip install --quiet ${EVAL_PACKAGES}; \
    fi
LABEL ai.astrai.eval_packages="${EVAL_PACKAGES}"
# What `invoke status` and `invoke preflight` report (label names: astrai/common/contract.py).
LABEL ai.astrai.torch="${TORCH_VERSION}" \
      ai.astrai.cuda_tag="${CUDA_TAG}"

# A user with the host's UID/GID, so files written under /checkpoints belong to
# the host user. With a root host user (UID 0) the container simply runs as root.
ARG UID=1000
ARG GID=1000
RUN set -eu; \
    if [ "${UID}" != "0" ]; then \
        getent group "${GID}" >/dev/null || groupadd --gid "${GID}" astrai; \
        getent passwd "${UID}" >/dev/null || \
            useradd --uid "${UID}" --gid "${GID}" --no-create-home --home-dir /home/astrai --shell /bin/sh astrai; \
    fi; \
    mkdir -p /home/astrai; \
    chown "${UID}:${GID}" /home/astrai
# CONTAINER_HOME in astrai/common/contract.py; at run time a scratch tmpfs (the root file system is read-only).
ENV HOME=/home/astrai

WORKDIR /app
ENV PYTHONPATH=/app
COPY astrai /app/astrai
# Compiled once here: the root file system is read-only at run time, so every trainer process would compile the
# package from source again (torch and the other packages come compiled by pip).
RUN python3 -m compileall -q /app/astrai
USER ${UID}:${GID}

ENTRYPOINT ["python3", "-m", "astrai.trainer.entrypoint"]
