"""DeepGEMM MegaMoE (``fp8_fp4_mega_moe``, SM100 only) behind ``kimi_kernels::mega_moe``.

Same contract as the op (``mega_moe.py``): this rank's c rows [c, L] bf16, fp32 weights
and int32 global ids [c, k] (-1: a padding row, not dispatched), experts partitioned
contiguously over the group (rank r owns ``[r E, (r + 1) E)``), y [c, L] bf16. DeepGEMM
does the dispatch (NVLink P2P into the peers' symmetric buffers), both grouped GEMMs,
SiTU and the weighted combine in one launch. Numerics are stock vLLM's SM100 path, not
our bf16 one: the experts run in MXFP4 (E2M1 values, one UE8M0 scale per 32 along K,
the released checkpoint's format), the latent is dispatched in FP8 E4M3 with one UE8M0
scale per 32, and the L1 output is requantised to FP8 inside the kernel.

Here (all through DeepGEMM's own helpers):

* weights: the bf16 ``w13`` [E, 2I, L] / ``w2`` [E, L, I] are cast to MXFP4
  (``utils.per_token_cast_to_fp4``, packed scales) and put in the kernel layout
  (``transform_weights_for_mega_moe``: gate/up interleaved by 8 rows, scales in UTCCP
  order), scales MN-major; once per weight tensor (cached by storage);
* the symmetric buffer (``get_symm_buffer_for_mega_moe``, activation ``situ``): one per
  (group, shape), created on the first call (it synchronises the group, so the first
  call must run before CUDA-graph capture, as vLLM's warm-up does);
* per call: the latent cast to FP8 (``utils.per_token_cast_to_fp8``, packed UE8M0) and
  the ids and weights copied into the buffer, then one ``fp8_fp4_mega_moe``.

Our machines are Hopper: this path has never run here. CI checks its plumbing against a
stand-in ``deep_gemm`` that dequantises what it is given (tests/test_mega_moe_deepgemm.py);
the layouts are DeepGEMM's, produced by DeepGEMM's functions. ``KIMI_MEGA_MOE=triton``
keeps our grouped Triton kernel on SM100 (bf16 experts, stock's rounding points).
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

GRAN_K = 32  # elements per UE8M0 scale (MX block)
_weights: dict[tuple, tuple] = {}
_buffers: dict[tuple, object] = {}


@functools.lru_cache
def deep_gemm() -> Optional[ModuleType]:
    """DeepGEMM: a pip-installed ``deep_gemm`` first, then the copy vLLM vendors."""
    for name in ("deep_gemm", "vllm.third_party.deep_gemm"):
        try:
            return importlib.import_module(name)
        except Exception:  # ImportError, or a CUDA library missing at import
            continue
    return None


@functools.lru_cache
def unsupported(device: torch.device, hidden: int, intermediate: int) -> str:
    """Why DeepGEMM MegaMoE cannot take these shapes on ``device`` ('' when it can)."""
    if os.environ.get("KIMI_MEGA_MOE", "auto") == "triton":
        return "KIMI_MEGA_MOE=triton"
    if device.type != "cuda":
        return f"{device.type} (DeepGEMM MegaMoE is SM100-only)"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 10:
        return f"SM{major}{minor} (DeepGEMM MegaMoE is SM100-only)"
    if hidden % 128 or intermediate % 128:
        return f"latent {hidden} / expert width {intermediate} not multiples of 128"
    dg = deep_gemm()
    if dg is None or not hasattr(dg, "fp8_fp4_mega_moe"):
        return "deep_gemm with fp8_fp4_mega_moe is not installed (pip install deep_gemm, or vLLM's vendored copy)"
    if not dist.is_initialized():
        return "torch.distributed is not initialised (the symmetric buffer needs a process group)"
    return ""


def _mxfp4(dg: ModuleType, w: Tensor) -> tuple[Tensor, Tensor]:
    """[E, N, K] bf16 -> (packed E2M1 [E, N, K / 2] int8, packed UE8M0 [E, N, K / 128] int32)."""
    E, N, K = w.shape
    values, scales = dg.utils.per_token_cast_to_fp4(w.reshape(E * N, K), use_ue8m0=True, gran_k=GRAN_K,
                                                    use_packed_ue8m0=True)
    return values.view(E, N, K // 2), scales.view(E, N, -1)


def _mn_major(scales: Tensor) -> Tensor:
    return scales.transpose(-1, -2).contiguous().transpose(-1, -2)


def kernel_weights(dg: ModuleType, w13: Tensor, w2: Tensor) -> tuple:
    """(l1, l2) in MegaMoE's layout, built once per (w13, w2) storage."""
    key = (w13.untyped_storage().data_ptr(), w13.storage_offset(), w2.untyped_storage().data_ptr(),
           w2.storage_offset(), tuple(w13.shape), tuple(w2.shape))
    if key not in _weights:
        l1, l2 = dg.transform_weights_for_mega_moe(_mxfp4(dg, w13), _mxfp4(dg, w2), activation="situ")
        _weights[key] = ((l1[0], _mn_major(l1[1])), (l2[0], _mn_major(l2[1])))
    return _weights[key]


def symm_buffer(dg: ModuleType, device: torch.device, group, experts: int, max_num_tokens: int, top_k: int,
                hidden: int, intermediate: int):
    key = (id(group), device, experts, max_num_tokens, top_k, hidden, intermediate)
    if key not in _buffers:
        _buffers[key] = dg.get_symm_buffer_for_mega_moe(group, experts, max_num_tokens, top_k, hidden, intermediate,
                                                        mma_type="fp8xfp4", activation="situ")
    return _buffers[key]


def run(latent: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor, group,
        max_num_tokens: int, beta: float, linear_beta: float) -> Tensor:
    """One ``fp8_fp4_mega_moe`` launch over ``group`` (this rank owns experts
    ``[rank E, (rank + 1) E)``)."""
    dg = deep_gemm()
    rows, top_k = topk_ids.shape
    experts, intermediate = w13.shape[0] * group.size(), w2.shape[2]
    l1, l2 = kernel_weights(dg, w13, w2)
    buf = symm_buffer(dg, latent.device, group, experts, max_num_tokens, top_k, latent.shape[1], intermediate)
    x, x_scales = dg.utils.per_token_cast_to_fp8(latent, use_ue8m0=True, gran_k=GRAN_K, use_packed_ue8m0=True)
    buf.x[:rows].copy_(x)
    buf.x_sf[:rows].copy_(x_scales)
    buf.topk_idx[:rows].copy_(topk_ids)
    buf.topk_weights[:rows].copy_(topk_weights)
    y = torch.empty_like(latent, dtype=torch.bfloat16)
    dg.fp8_fp4_mega_moe(y, l1, l2, buf, activation="situ", activation_alpha=beta, activation_beta=linear_beta)
    return y
