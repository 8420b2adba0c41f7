# The Docker sandbox's base image: one container per trajectory, no network
# (thundersync_core/rollout/sandbox/docker_backend.py). It holds what agents and task
# verifiers call: bash, coreutils, python3, git and patch, and pytest for SWE grading.
#
# Where a registry can be reached; elsewhere `thundersync sandbox build-image` makes the
# default image from Debian's packages (infra/README.md).
#   docker build -f infra/sandbox.Dockerfile -t thundersync-sandbox:slim infra
#   thundersync sandbox exec --backend docker --image thundersync-sandbox:slim -- pytest --version
FROM python:3.11-slim-bookworm

RUN apt-get update \
 && apt-get install -y --no-install-recommends git patch procps \
 && rm -rf /var/lib/apt/lists/* \
 && pip install --no-cache-dir pytest==9.2.0

WORKDIR /app
