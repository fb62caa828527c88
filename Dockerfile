# One image for the bootstrap node and the peers: `diloco-peer <command>`.
#   docker build -t diloco-peer .                                   # CPU (torch CPU wheels)
#   docker build -t diloco-peer:gpu --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 .
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

WORKDIR /app
RUN pip install --index-url "$TORCH_INDEX" torch
COPY pyproject.toml README.md ./
COPY diloco_peer ./diloco_peer
COPY configs ./configs
RUN pip install .

# checkpoints, identity keys and the bootstrap's address live in volumes (see docker-compose.yml)
VOLUME ["/data"]
ENTRYPOINT ["diloco-peer"]
CMD ["--help"]
