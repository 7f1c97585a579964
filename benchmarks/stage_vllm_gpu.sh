#!/usr/bin/env bash
# Stage vLLM 0.33.0 for the H200 image (Python 3.12, torch 2.11, no vLLM, no pydantic) in
# .device/vllm/ (gitignored), for benchmarks/vllm_stack.py (docs/vllm.md, "vLLM's K3 stack
# on one H200"):
#
#   vllm-0.33.0-py.tar.xz  vLLM's Python files (.py, .json, .jinja, py.typed) and its
#                          dist-info, without its compiled extensions (built for torch 2.14)
#                          and C++ headers: ~7 MB
#   c_symbols.txt          the libtorch symbols vLLM's _C_stable_libtorch extension imports
#                          (vllm_stack.py reports which of them the GPU's torch lacks)
#   wheels/                py3.12 manylinux wheels of the packages importing vLLM needs that
#                          the image lacks: ~18 MB
#
# Usage: benchmarks/stage_vllm_gpu.sh [VLLM_DIR]
#   VLLM_DIR: an installed vllm 0.33.0 package folder (site-packages/vllm) to take the files
#   from; without it the wheel is downloaded (pip download --no-deps vllm==0.33.0, ~0.5 GB).
#
# On the GPU (carry .device/vllm):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device/vllm/wheels/*.whl
#   tar -xJf .device/vllm/vllm-0.33.0-py.tar.xz -C /tmp/site && export PYTHONPATH=$PWD:/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
out=.device/vllm
mkdir -p "$out/wheels"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [ $# -ge 1 ]; then
    site=$(cd "$1/.." && pwd)
else
    python3 -m pip download -q --no-deps --only-binary=:all: vllm==0.33.0 -d "$work/wheel"
    mkdir -p "$work/site"
    python3 -m zipfile -e "$work"/wheel/vllm-0.33.0-*.whl "$work/site"
    site=$work/site
fi
test -d "$site/vllm-0.33.0.dist-info" || { echo "no vllm-0.33.0.dist-info beside $site/vllm" >&2; exit 1; }

(cd "$site" && find vllm vllm-0.33.0.dist-info -type f \
    \( -name '*.py' -o -name '*.json' -o -name '*.jinja' -o -name py.typed -o -name METADATA \
       -o -name entry_points.txt -o -name top_level.txt -o -name WHEEL \) ! -path '*__pycache__*' \
    | sort > "$work/files")
tar -C "$site" -cf - -T "$work/files" | xz -T0 -6 > "$out/vllm-0.33.0-py.tar.xz"
nm -D --undefined-only "$site/vllm/_C_stable_libtorch.abi3.so" | awk '{print $2}' \
    | grep -E '^(aoti_torch_|torch_)' | sort -u > "$out/c_symbols.txt"

# The packages vLLM 0.33.0's import of its config, model and layer modules reaches that the
# image lacks (its pins from requirements/vllm-cpu.txt); found by importing with the image's
# package set and nothing else.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$out/wheels" \
    pyzmq==27.3.0 pydantic==2.14.4 pydantic_core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0 \
    cbor2==6.3.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 openai-harmony==0.0.8 openai==3.57.0 \
    jiter==0.19.0 sniffio==1.3.1 pybase64==1.5.1 cachetools==8.0.2 msgspec==0.23.0 xgrammar==0.2.8 \
    apache-tvm-ffi==0.1.15.post2 fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2 \
    partial-json-parser==0.2.1.1.post7 llguidance==1.9.1 compressed-tensors==0.17.0 loguru==0.7.3
du -sh "$out"/*
