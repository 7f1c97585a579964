"""Triton split-K skinny GEMM (tensor-core ``tl.dot``), for 8 < M <= 64 and off-GPU tests;
and the per-head skinny GEMM (``run_bmm``: MLA's absorption and v up-projection).

x is padded to BM >= 16 rows for ``tl.dot``; W is tiled into BN-column slabs (one program
each) and, when that leaves too few programs to keep every SM streaming, K is split into
SPLIT chunks whose fp32 partials a second kernel sums in a fixed order (deterministic).
Under ``TRITON_INTERPRET=1`` the dot runs in fp32 (the interpreter's bf16 dot is wrong), and
so does it for fp32 operands (the fp32 model of the exact-function checks), in IEEE fp32:
``tl.dot``'s default for fp32 is TF32, 1e-3 off at K = 7168 (docs/testing.md). Both
kernels launch with programmatic dependent launch on SM90+ (``common.pdl``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..common import INTERPRET, SMS, arrival_counters, bf16_round, pdl, pdl_wait, tl, triton

if triton is not None:
    from triton.tools.tensor_descriptor import TensorDescriptor


def config(M: int, N: int, K: int) -> dict[str, int]:
    """Tile sizes: BN-column slabs, and a K split when the slabs alone are too few."""
    bm = max(16, triton.next_power_of_2(M))
    bk = min(256, max(16, triton.next_power_of_2(K)))
    bn = 32 if N // 32 >= 2 * SMS else 16
    slabs = triton.cdiv(N, bn)
    split = max(1, min(triton.cdiv(2 * SMS, slabs), triton.cdiv(K, 4 * bk), 16))
    return dict(BM=bm, BN=bn, BK=bk, SPLIT=split)


if triton is not None:

    @triton.jit
    def _mm_kernel(x_ptr, w_ptr, acc_ptr, out_ptr, ws_ptr, M, N, K, stride_x, stride_w, stride_acc, stride_out,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                   HAS_ACC: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        chunk = tl.cdiv(tl.cdiv(K, SPLIT), BK) * BK
        k_lo = pid_k * chunk
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(k_lo, tl.minimum(k_lo + chunk, K), BK):
            rk = k0 + tl.arange(0, BK)
            x = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                        other=0.0)
            w = tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K),
                        other=0.0)
            if DOT_F32:
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT == 1:
            if HAS_ACC:
                acc += tl.load(acc_ptr + rm[:, None] * stride_acc + rn[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + rm[:, None] * stride_out + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(ws_ptr + (pid_k * M + rm[:, None]) * N + rn[None, :], acc, mask=mask)

    @triton.jit
    def _split_sum_kernel(ws_ptr, acc_ptr, out_ptr, M, N, stride_acc, stride_out,
                          SPLIT: tl.constexpr, BLOCK: tl.constexpr, HAS_ACC: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < M * N
        m, n = i // N, i % N
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(SPLIT):  # fixed order: deterministic
            total += tl.load(ws_ptr + s * M * N + i, mask=mask, other=0.0)
        if HAS_ACC:
            total += tl.load(acc_ptr + m * stride_acc + n, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * stride_out + n, total.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _mm_t_kernel(x_ptr, w_ptr, acc_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_x, stride_w, stride_acc,
                     stride_out, SPLIT, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     REDUCE: tl.constexpr, HAS_ACC: tl.constexpr, DOT_F32: tl.constexpr, TMA: tl.constexpr,
                     PDL: tl.constexpr):
        """Program (n tile, K chunk): out^T[BN, BM] = W[BN, chunk] x^T[chunk, BM], W as the dot's
        wide operand (64 or 128 weight rows per MMA, the few x rows as its narrow side). With
        SPLIT > 1 (REDUCE) each chunk's fp32 partial goes to ws[n tile, split] and the tile's
        last program to arrive at cnt[n tile] sums them in split order (deterministic) and
        writes."""
        pdl_wait(PDL)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        chunk = tl.cdiv(tl.cdiv(K, SPLIT), BK) * BK
        k_lo = pid_k * chunk
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        for k0 in range(k_lo, tl.minimum(k_lo + chunk, K), BK):
            rk = k0 + tl.arange(0, BK)
            if TMA:  # w_ptr is a TensorDescriptor of W [N, K], block [BN, BK] (zero past the edges)
                w = w_ptr.load([pid_n * BN, k0])
            else:
                w = tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :],
                            mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
            x = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                        other=0.0)
            if DOT_F32:
                acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(x), acc)
        if REDUCE:
            tile = ws_ptr + (pid_n * SPLIT * BN + tl.arange(0, BN)[:, None]) * BM + rm[None, :]
            tl.store(tile + pid_k * BN * BM, acc)
            tl.debug_barrier()  # every thread's partial is written before the arrival
            arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT - 1:
                tl.store(cnt_ptr + pid_n, 0)
                acc = tl.load(tile, cache_modifier=".cg")
                for s in range(1, SPLIT):
                    acc += tl.load(tile + s * BN * BM, cache_modifier=".cg")
                _store_t(acc, acc_ptr, out_ptr, rm, rn, M, N, stride_acc, stride_out, HAS_ACC)
        else:
            _store_t(acc, acc_ptr, out_ptr, rm, rn, M, N, stride_acc, stride_out, HAS_ACC)

    @triton.jit
    def _store_t(acc, acc_ptr, out_ptr, rm, rn, M, N, stride_acc, stride_out, HAS_ACC: tl.constexpr):
        """out[m, n] = acc[n, m] (+ acc_ptr[m, n]), rounded once to out's dtype."""
        mask = (rn[:, None] < N) & (rm[None, :] < M)
        if HAS_ACC:
            acc += tl.load(acc_ptr + rm[None, :] * stride_acc + rn[:, None], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rm[None, :] * stride_out + rn[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _bmm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xb, stride_xm, stride_xk, stride_wb, stride_wk,
                    stride_wn, stride_ob, stride_om, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    DOT_F32: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr):
        """One program per (head b, BN columns): out[b, :M, cols] = x[b] W[b][:, cols]."""
        pdl_wait(PDL)
        b = tl.program_id(0).to(tl.int64)
        rm = tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            x = tl.load(x_ptr + b * stride_xb + rm[:, None] * stride_xm + rk[None, :] * stride_xk,
                        mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            w = tl.load(w_ptr + b * stride_wb + rk[:, None] * stride_wk + rn[None, :] * stride_wn,
                        mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
            if DOT_F32:
                acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
        tl.store(out_ptr + b * stride_ob + rm[:, None] * stride_om + rn[None, :],
                 bf16_round(acc, ROUND).to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def bmm_config(B: int, M: int, K: int, N: int) -> dict[str, int]:
    """Tiles of the per-head GEMM: BN columns per program, narrower when the heads' slabs
    would not fill the SMs; K in one pass up to 128 (MLA's K: 128 and 512)."""
    bn = 32 if B * triton.cdiv(N, 32) >= SMS else 16
    return dict(BM=max(16, triton.next_power_of_2(M)), BN=bn, BK=min(128, max(16, triton.next_power_of_2(K))))


def run_bmm(x: Tensor, weight: Tensor) -> Tensor:
    """x [B, M, K] times weight [B, K, N], both with any strides (MLA's heads are a
    permuted view of q, its weights views of kv_b: W_UK N-contiguous, W_UV^T K-contiguous;
    Triton specialises the unit stride) -> [B, M, N] contiguous, in x's dtype, fp32
    accumulation."""
    B, M, K = x.shape
    N = weight.shape[2]
    cfg = bmm_config(B, M, K, N)
    out = torch.empty(B, M, N, dtype=x.dtype, device=x.device)
    _bmm_kernel[(B, triton.cdiv(N, cfg["BN"]))](
        x, weight, out, M, N, K, *x.stride(), *weight.stride(), out.stride(0), out.stride(1),
        DOT_F32=dot_f32(x.dtype), ROUND=x.dtype == torch.bfloat16, num_warps=4, num_stages=3, **cfg,
        **pdl(x.device))
    return out


def dot_f32(dtype: torch.dtype) -> bool:
    """Whether the dot runs in IEEE fp32: fp32 operands, or the interpreter."""
    return INTERPRET or dtype == torch.float32


def run(x: Tensor, weight: Tensor, acc: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    M, K = x.shape
    N = weight.shape[0]
    cfg = config(M, N, K)
    out = torch.empty(M, N, dtype=out_dtype, device=x.device)
    split = cfg["SPLIT"]
    ws = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else out
    acc_arg = acc if acc is not None else out
    grid = (triton.cdiv(N, cfg["BN"]), split)
    launch = pdl(x.device)
    _mm_kernel[grid](x, weight, acc_arg, out, ws, M, N, K, x.stride(0), weight.stride(0), acc_arg.stride(0),
                     out.stride(0), HAS_ACC=acc is not None, DOT_F32=dot_f32(x.dtype), num_warps=4, num_stages=4,
                     **cfg, **launch)
    if split > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(M * N, block),)](ws, acc_arg, out, M, N, acc_arg.stride(0), out.stride(0),
                                                          SPLIT=split, BLOCK=block, HAS_ACC=acc is not None, **launch)
    return out


class Tile(NamedTuple):
    """Launch of ``_mm_t_kernel``: BN weight rows x BK per step, K in SPLIT chunks."""
    bn: int
    bk: int
    split: int
    stages: int
    warps: int
    tma: bool = False


def config_t(M: int, N: int, K: int) -> Tile:
    """BN 64 (one warpgroup's MMA height), BK 128; K split until the tiles reach 2 waves."""
    bn, bk = 64, 128
    tiles = triton.cdiv(N, bn)
    split = max(1, min(triton.cdiv(2 * SMS, tiles), triton.cdiv(K, 4 * bk), 16))
    return Tile(bn, bk, split, 4, 4)


def run_t(x: Tensor, weight: Tensor, acc: Tensor | None, out_dtype: torch.dtype, cfg: Tile | None = None) -> Tensor:
    """x [M, K] (unit K stride) times weight [N, K]^T (+ acc [M, N]) -> [M, N] ``out_dtype``."""
    M, K = x.shape
    N = weight.shape[0]
    cfg = cfg or config_t(M, N, K)
    bm = max(16, triton.next_power_of_2(M))
    tiles = triton.cdiv(N, cfg.bn)
    out = torch.empty(M, N, dtype=out_dtype, device=x.device)
    ws = torch.empty(tiles * cfg.split * cfg.bn * bm, dtype=torch.float32, device=x.device) if cfg.split > 1 else out
    cnt = arrival_counters(x.device, tiles) if cfg.split > 1 else out
    acc_arg = acc if acc is not None else out
    w = TensorDescriptor.from_tensor(weight, [cfg.bn, cfg.bk]) if cfg.tma else weight
    _mm_t_kernel[(tiles, cfg.split)](
        x, w, acc_arg, out, ws, cnt, M, N, K, x.stride(0), weight.stride(0), acc_arg.stride(0), out.stride(0),
        cfg.split, BM=bm, BN=cfg.bn, BK=cfg.bk, REDUCE=cfg.split > 1, HAS_ACC=acc is not None,
        DOT_F32=dot_f32(x.dtype), TMA=cfg.tma, num_warps=cfg.warps, num_stages=cfg.stages, **pdl(x.device))
    return out
