"""``kimi_kernels::skinny_mm``: decode-size GEMMs ``[acc +] x W^T`` for M <= 64 rows.

Semantics: ``out = (acc + x @ W^T)`` with x [M, K], W [N, K] (the weight as stored, no
transpose copy), fp32 accumulation, one rounding to ``out_dtype`` (bf16, or fp32 for
the MoE router's logits). ``acc`` (optional, [M, N]) is the addmm accumulator of the
latent MoE tail (the shared experts' output).

Decode GEMMs stream the weight once: the byte floor of one call is
``N K s_w + M K s_x + M N s_o`` (s = bytes per element); at M <= 64 the weight is
all of it (e.g. the TP8 KDA in-projection, 6288 x 7168 bf16: 90 MB -> 21.1 us at
4.28 TB/s).

Implementations, each deterministic (replicated GEMMs give every rank the same bits):
  * ``cute_gemv``: CuTe DSL, CUDA-core split-K GEMV with a last-CTA reduction, M <= 8
    (SM90 / SM100; needs ``nvidia-cutlass-dsl``);
  * ``tl_dot``: Triton, the weight as the ``wgmma``'s 64-row side, K split only to fill
    one wave and reduced by the last CTA to arrive, M <= 64; also what runs under
    ``TRITON_INTERPRET=1`` on CPU;
  * cuBLAS (``reference``), wherever it measured faster.
Dispatch (``choose``): the fastest of the three per (N, K, M) as measured inside CUDA
graphs (``FASTEST``); shapes not measured stay on cuBLAS.

Two fused neighbours, where the CuTe GEMV runs (``choose_fused``; elsewhere the
``lower_kernels`` pass leaves the pair unfused):
  * ``kimi_kernels::rms_norm_mm``: ``[acc +] rms_norm(x, norm_weight, eps) W^T`` (the MLA
    q_a norm before q_b, the latent MoE norm before its up-projection);
  * ``kimi_kernels::mm_situ``: ``situ_and_mul(x W^T, beta, linear_beta)`` (the SiTU MLP's
    gate_up, whose [gate | up] halves meet in one lane).
Their CPU references are the stock functions composed with ``reference``.

``kimi_kernels::skinny_bmm``: ``x @ W`` per head, x [B, M, K] and W [B, K, N] with any
strides (MLA's absorption W_UK and v up-projection W_UV^T, views of kv_b), fp32 accumulation, one
rounding, as ``torch.bmm``; the Triton ``tl_dot.run_bmm`` where it measured faster than
cuBLAS in the layer (``FASTEST_BMM``: it launches with PDL, cuBLAS does not).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from kimi_inductor.stock.attn_res import rms_norm
from kimi_inductor.stock.layers import situ_and_mul
from kimi_inductor.stock.mla import output_gate

from ..common import INTERPRET, triton
from . import tl_dot

NAMESPACE = "kimi_kernels"
MAX_ROWS = 64
UNMEASURED = "cuBLAS: our kernels were never timed against it at this shape"
RESULTS = "docs/results/gemm_h200_v2.json (CuTe GEMV), docs/results/gemm_h100_v1.json (Triton)"
# (N, K) -> ((up to M rows, implementation), ...): the fastest per row count, side by side
# in CUDA graphs (benchmarks/gemm.py, RESULTS): the CuTe GEMV where it beat cuBLAS on an
# H200, the Triton GEMM from there on where it beat cuBLAS on an H100 (1.02-1.22x at 1-64
# rows); rows past the last entry stay on cuBLAS. Without CuTe DSL its rows go to Triton.
FASTEST: dict[tuple[int, int], tuple[tuple[int, str], ...]] = {
    (6288, 7168): ((2, "cute_gemv"), (64, "tl_dot")),  # KDA in-projection
    (7168, 1536): ((2, "cute_gemv"), (64, "tl_dot")),  # attention o-projection
    (3648, 7168): ((2, "cute_gemv"), (64, "tl_dot")),  # MLA q_a + kv_a + gate
    (2304, 1536): ((2, "cute_gemv"), (16, "tl_dot")),  # MLA q_b
    (896, 7168): ((2, "cute_gemv"), (32, "tl_dot")),  # MoE router (fp32 logits)
    (3584, 7168): ((2, "cute_gemv"), (64, "tl_dot")),  # MoE latent down
    (7168, 3584): ((4, "cute_gemv"), (64, "tl_dot")),  # MoE latent up
    (12288, 7168): ((2, "cute_gemv"), (32, "tl_dot")),  # shared experts gate_up (SP, replicated)
    (7168, 6144): ((4, "cute_gemv"), (64, "tl_dot")),  # shared experts down (SP, replicated)
}

BMM_RESULTS = "docs/results/session21_h100/mla_layer_bmm_ab.json"
# (B, K, N) -> up to M rows: where the MLA layer ran faster with ``tl_dot.run_bmm`` than
# with cuBLAS's bmm, side by side in one process, each variant compiled on its own
# (benchmarks/mla_layer.py --bmm-ab, BMM_RESULTS, H100 with CuTe GEMVs): every per-head
# GEMM on cuBLAS is 2.1 / 2.8 % slower at 1 / 2 rows (with the gated form below at 2);
# ours for both at every row count equals this table at 2 rows (57.05 against 57.24 us)
# and is 17 % slower at 8 (87.57 against 75.06)
FASTEST_BMM: dict[tuple[int, int, int], int] = {
    (12, 128, 512): 1,  # MLA absorption, TP8 (12 heads)
    (12, 512, 128): 1,  # MLA v up-projection
}
# (B, K, N) -> up to M rows: the v up-projection with MLA's output gate in its epilogue
# (``skinny_bmm_gate``: one launch in place of the bmm, the heads' layout copy and the gate).
# The bmm followed by Inductor's copy and gate instead (same run): 0.8 / 2.7 % slower at
# 1 / 2 rows (46.18 / 58.76 against 45.82 / 57.24 us).
FASTEST_BMM_GATE: dict[tuple[int, int, int], int] = {
    (12, 512, 128): 2,
}


@functools.lru_cache(maxsize=None)
def cute_available() -> str:
    """'' when CuTe DSL and its TVM-FFI launcher import, else why not."""
    try:
        import tvm_ffi  # noqa: F401

        from . import cute_gemv  # noqa: F401
    except ImportError as e:
        return f"CuTe DSL is not installed ({e.name}: pip install 'kimi-inductor[cute]')"
    return ""


def supported(M: int, N: int, K: int, dtype: torch.dtype) -> str:
    """Why no implementation covers this GEMM ('' when one does)."""
    if triton is None:
        return "Triton is not installed"
    if M > MAX_ROWS:
        return f"{M} rows (> {MAX_ROWS}: cuBLAS/Inductor territory)"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"dtype {dtype}"
    if K % 8 or N % 8:
        return f"N={N}, K={K} not multiples of 8"
    return ""


def choose(M: int, N: int, K: int, dtype: torch.dtype) -> tuple[str, str]:
    """(implementation, why): 'cute_gemv', 'tl_dot' or 'cublas', with the reason the
    measured fastest is not taken."""
    why = supported(M, N, K, dtype)
    if why:
        return "cublas", why
    if (N, K) not in FASTEST:
        return "cublas", f"{UNMEASURED} (skinny_gemm.FASTEST)"
    impl = next((impl for rows, impl in FASTEST[(N, K)] if M <= rows), "")
    if not impl:
        return "cublas", f"cuBLAS was faster from {FASTEST[(N, K)][-1][0] + 1} rows ({RESULTS})"
    if impl == "cute_gemv":
        why = cute_available() or (dtype != torch.bfloat16 and f"dtype {dtype}") or _cute().supported(M, N, K)
        if why:
            return "tl_dot", f"not the CuTe GEMV: {why}"
    return impl, ""


def choose_bmm(B: int, M: int, K: int, N: int, dtype: torch.dtype) -> str:
    """Why the per-head GEMM stays on cuBLAS ('' when ``tl_dot.run_bmm`` takes it)."""
    why = supported(M, N, K, dtype)
    if why:
        return why
    if (B, K, N) not in FASTEST_BMM:
        return f"{UNMEASURED} (skinny_gemm.FASTEST_BMM)"
    if M > FASTEST_BMM[(B, K, N)]:
        return f"cuBLAS was faster from {FASTEST_BMM[(B, K, N)] + 1} rows ({BMM_RESULTS})"
    return ""


def choose_bmm_gate(B: int, M: int, K: int, N: int, dtype: torch.dtype) -> str:
    """Why the gated per-head GEMM stays unfused ('' when ``tl_dot.run_bmm`` takes it)."""
    why = supported(M, N, K, dtype)
    if why:
        return why
    if M > FASTEST_BMM_GATE.get((B, K, N), 0):
        return f"{M} rows: taken up to {FASTEST_BMM_GATE.get((B, K, N), 0)} (skinny_gemm.FASTEST_BMM_GATE)"
    return ""


def choose_fused(kind: str, M: int, N: int, K: int, dtype: torch.dtype) -> str:
    """Why ``kind`` ('rms_norm' or 'situ') is not fused into this GEMM ('' when the CuTe
    GEMV takes both: at the shapes and rows where that measured faster on H200,
    ``cute_gemv.TUNED_FUSED``); N: the weight's rows."""
    impl, why = choose(M, N, K, dtype)
    if impl != "cute_gemv":
        return why or f"{impl} is the fastest plain GEMM here (the fusion lives in the CuTe GEMV)"
    cg = _cute()
    if (kind, N, K, M) not in cg.TUNED_FUSED:
        return "not measured faster than the unfused pair at this shape (cute_gemv.TUNED_FUSED)"
    return cg.supported(M, N, K, fusion=cg.Fusion(eps=1.0) if kind == "rms_norm" else cg.Fusion(situ=(1.0, 1.0)))


def _cute():
    from . import cute_gemv

    return cute_gemv


def _fake(x, weight, acc, out_dtype):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=out_dtype)


@torch.library.custom_op(f"{NAMESPACE}::skinny_mm", mutates_args=())
def skinny_mm(x: Tensor, weight: Tensor, acc: Optional[Tensor], out_dtype: torch.dtype) -> Tensor:
    M, K = x.shape
    N = weight.shape[0]
    if INTERPRET and not x.is_cuda and not supported(M, N, K, x.dtype):
        return tl_dot.run(x.contiguous(), weight, acc, out_dtype)
    impl = choose(M, N, K, x.dtype)[0] if x.is_cuda else "cublas"
    if impl == "cublas":
        return reference(x, weight, acc, out_dtype)
    assert weight.stride(1) == 1 and (acc is None or acc.is_contiguous())
    if impl == "cute_gemv":  # reads a row-strided x in place
        return _cute().run(x, weight.contiguous(), acc, out_dtype)
    return tl_dot.run(x if x.stride(1) == 1 else x.contiguous(), weight, acc, out_dtype)


skinny_mm.register_fake(_fake)


@torch.library.custom_op(f"{NAMESPACE}::skinny_bmm", mutates_args=())
def skinny_bmm(x: Tensor, weight: Tensor) -> Tensor:
    B, M, K = x.shape
    N = weight.shape[2]
    if weight.shape[:2] != (B, K):
        raise ValueError(f"kimi_kernels.skinny_bmm: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not "
                         "multiply: the weight must be [B, K, N] for x [B, M, K]")
    ours = not choose_bmm(B, M, K, N, x.dtype) if x.is_cuda else INTERPRET and not supported(M, N, K, x.dtype)
    return tl_dot.run_bmm(x, weight) if ours else torch.bmm(x, weight)


@skinny_bmm.register_fake
def _(x, weight):
    return x.new_empty(x.shape[0], x.shape[1], weight.shape[2])


@torch.library.custom_op(f"{NAMESPACE}::skinny_bmm_gate", mutates_args=())
def skinny_bmm_gate(x: Tensor, weight: Tensor, gate: Tensor) -> Tensor:
    """MLA's v up-projection and output gate in one launch: ``output_gate(y, gate)`` with
    y = ``bmm(x, W)`` [B, M, N] laid out as [M, B N] (heads side by side), gate [M, B N]."""
    B, M, K = x.shape
    N = weight.shape[2]
    if weight.shape[:2] != (B, K) or gate.shape != (M, B * N):
        raise ValueError(f"kimi_kernels.skinny_bmm_gate: x {tuple(x.shape)}, weight {tuple(weight.shape)} and gate "
                         f"{tuple(gate.shape)} do not match: weight [B, K, N] and gate [M, B N] for x [B, M, K]")
    ours = not choose_bmm_gate(B, M, K, N, x.dtype) if x.is_cuda else INTERPRET and not supported(M, N, K, x.dtype)
    if ours:
        return tl_dot.run_bmm(x, weight, gate if gate.stride(1) == 1 else gate.contiguous())
    return output_gate(torch.bmm(x, weight).transpose(0, 1).reshape(M, B * N), gate)


@skinny_bmm_gate.register_fake
def _(x, weight, gate):
    return x.new_empty(x.shape[1], x.shape[0] * weight.shape[2])


def _fused_here(x: Tensor, kind: str, weight: Tensor) -> bool:
    return x.is_cuda and not choose_fused(kind, x.shape[0], weight.shape[0], x.shape[1], x.dtype)


@torch.library.custom_op(f"{NAMESPACE}::rms_norm_mm", mutates_args=())
def rms_norm_mm(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, acc: Optional[Tensor],
                out_dtype: torch.dtype) -> Tensor:
    if _fused_here(x, "rms_norm", weight):
        cg = _cute()
        return cg.run(x, weight.contiguous(), acc, out_dtype, fusion=cg.Fusion(eps=eps),
                      norm_weight=norm_weight.contiguous())
    return skinny_mm(rms_norm(x, norm_weight, eps), weight, acc, out_dtype)


@rms_norm_mm.register_fake
def _(x, norm_weight, eps, weight, acc, out_dtype):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=out_dtype)


@torch.library.custom_op(f"{NAMESPACE}::mm_situ", mutates_args=())
def mm_situ(x: Tensor, weight: Tensor, beta: float, linear_beta: float) -> Tensor:
    if _fused_here(x, "situ", weight):
        cg = _cute()
        return cg.run(x, weight.contiguous(), None, x.dtype, fusion=cg.Fusion(situ=(beta, linear_beta)))
    return situ_and_mul(skinny_mm(x, weight, None, x.dtype), beta, linear_beta)


@mm_situ.register_fake
def _(x, weight, beta, linear_beta):
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


def reference(x: Tensor, weight: Tensor, acc: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """``[acc +] x W^T`` as stock computes it (addmm / mm, or fp32 logits from bf16)."""
    if out_dtype == x.dtype:
        return torch.addmm(acc, x, weight.t()) if acc is not None else x @ weight.t()
    out = x.to(out_dtype) @ weight.to(out_dtype).t()
    return out + acc.to(out_dtype) if acc is not None else out
