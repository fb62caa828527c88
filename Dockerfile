# One image for the bootstrap node and the peers: `diloco-peer <command>`.
#   docker build -t diloco-peer .                                   # CPU (torch CPU wheels)
#   docker build -t diloco-peer:gpu --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 \
#                --build-arg EXTRAS=hf .                           # GPU, with C4 + tokenizers for the llama configs
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# optional dependencies of the package (pyproject.toml), e.g. "hf" for the llama configs' data
ARG EXTRAS=""
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

RUN pip install --index-url "$TORCH_INDEX" torch
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY diloco_peer ./diloco_peer
COPY configs ./configs
# A regular (not editable) install, the shipped configs inside it as package data; the sources then go, so
# that the image runs what a wheel installs and nothing of the checkout (tests/test_install.py checks the same).
RUN pip install ".${EXTRAS:+[$EXTRAS]}" && cd / && rm -rf /src

# checkpoints, identity keys and the bootstrap's address live in volumes (see docker-compose.yml)
VOLUME ["/data"]
WORKDIR /data
ENTRYPOINT ["diloco-peer"]
CMD ["--help"]
