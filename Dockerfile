# The trainer image. Build it with `invoke build --config train.yaml`, which passes
# the build arguments below from the YAML's `runtime.container` block.
#
# Layers go from slow-changing to fast-changing, so a code-only change rebuilds
# only the last COPY (seconds). A base image that already holds Python 3.10+,
# torch, safetensors, PyYAML and NumPy builds with no network at all.

ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG CUDA_TAG=cpu
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1

# Install only what the base lacks. torch comes from the PyTorch index of the
# requested CUDA build (cu128, cpu, ...); the small pure packages from PyPI.
# TensorBoard (event files) is optional: it is added only when something required
# was missing, i.e. when this build goes to the network anyway. A base image that
# holds everything required but TensorBoard still builds offline; the trainer
# then says once that event files are off.
ARG TENSORBOARD_VERSION=2.21.0
RUN set -eu; \
    if ! command -v python3 >/dev/null 2>&1; then \
        echo "error: the base image has no python3; set runtime.container.base_image to an image with Python 3.10+" >&2; \
        exit 1; \
    fi; \
    python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { \
        echo "error: the base image's python3 is older than 3.10" >&2; exit 1; }; \
    online=no; \
    if ! python3 -c 'import torch' >/dev/null 2>&1; then \
        echo "installing torch for ${CUDA_TAG}"; \
        python3 -m pip install --index-url "https://download.pytorch.org/whl/${CUDA_TAG}" torch; \
        online=yes; \
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
ENV HOME=/home/astrai

WORKDIR /app
ENV PYTHONPATH=/app
COPY astrai /app/astrai
USER ${UID}:${GID}

ENTRYPOINT ["python3", "-m", "astrai.entrypoint"]
