# The Docker sandbox's base image: one container per trajectory, no network
# (thundersync_core/rollout/sandbox/docker_backend.py). It holds what agents and task
# verifiers call: bash, coreutils, python3, git and patch, and pytest for SWE grading.
#
#   docker build -f infra/sandbox.Dockerfile -t thundersync-sandbox:latest infra
#   thundersync sandbox exec --backend docker --image thundersync-sandbox:latest -- pytest --version
FROM python:3.11-slim-bookworm

RUN apt-get update \
 && apt-get install -y --no-install-recommends git patch procps \
 && rm -rf /var/lib/apt/lists/* \
 && pip install --no-cache-dir pytest==9.2.0

WORKDIR /app
