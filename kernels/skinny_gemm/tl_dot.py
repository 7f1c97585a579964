"""Triton tensor-core skinny GEMM (``run``: decode GEMMs of 2-64 rows, and what runs off
the GPU under ``TRITON_INTERPRET=1``) and the per-head skinny GEMM (``run_bmm``: MLA's
absorption and v up-projection).

``run``: the weight is the MMA's wide operand and x its narrow one, out^T [BN, BM] =
W [BN, BK] x^T [BK, BM] (``wgmma`` m64 n16..64 on SM90, x padded to BM >= 16 rows), one
program per 64 weight rows, W streaming through ``cp.async`` (or TMA) stages. K is split
only as far as the programs stay one wave; the tile's last program to arrive (an
arrival counter) sums the fp32 partials in split order, so the result is deterministic
and one launch. Under ``TRITON_INTERPRET=1`` the dot runs in fp32 (the interpreter's
bf16 dot is wrong), and so does it for fp32 operands (the fp32 model of the
exact-function checks), in IEEE fp32: ``tl.dot``'s default for fp32 is TF32, 1e-3 off at
K = 7168 (docs/testing.md). Both kernels launch with programmatic dependent launch on
SM90+ (``common.pdl``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..common import INTERPRET, SMS, arrival_counters, bf16_round, pdl, pdl_wait, tl, triton

if triton is not None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    @triton.jit
    def _mm_kernel(x_ptr, w_ptr, acc_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_x, stride_w, stride_acc,
                   stride_out, SPLIT, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, REDUCE: tl.constexpr,
                   HAS_ACC: tl.constexpr, DOT_F32: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr):
        """Program (n tile, K chunk): out^T[BN, BM] = W[BN, chunk] x^T[chunk, BM]. With
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
    def _bmm_kernel(x_ptr, w_ptr, out_ptr, gate_ptr, M, N, K, stride_xb, stride_xm, stride_xk, stride_wb, stride_wk,
                    stride_wn, stride_ob, stride_om, stride_gm, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    DOT_F32: tl.constexpr, ROUND: tl.constexpr, GATE: tl.constexpr, PDL: tl.constexpr):
        """One program per (head b, BN columns): out[b, :M, cols] = x[b] W[b][:, cols]; with
        GATE, rounded, times sigmoid(gate[m, b N + col]) and rounded again (out's strides
        then those of [M, B N])."""
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
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        acc = bf16_round(acc, ROUND)
        if GATE:
            g = tl.load(gate_ptr + rm[:, None] * stride_gm + b * N + rn[None, :], mask=mask, other=0.0)
            acc = bf16_round(acc * tl.sigmoid(g.to(tl.float32)), ROUND)
        tl.store(out_ptr + b * stride_ob + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)


class Tile(NamedTuple):
    """Launch of ``_mm_kernel``: BN weight rows x BK per step, K in SPLIT chunks."""
    bn: int
    bk: int
    split: int
    stages: int
    warps: int
    tma: bool = False


def config(M: int, N: int, K: int, itemsize: int = 2) -> Tile:
    """BN 64 (one warpgroup's MMA height), BK 128, one CTA per 64 weight rows streaming all
    of K: K is split only where the tiles would leave over 2/3 of the SMs idle (then into
    one wave); stages by how many CTAs share an SM: 7 where under half the SMs have one,
    5 up to one CTA per SM, 3 beyond (two share an SM) or for fp32 operands. On an H100
    at the nine TP8 shapes this was the best or within 2.5 % of the best of 13-33
    tilings at 1-64 rows, except split K at 32-64 rows (q_b, router: 6-14 %)
    (``benchmarks/gemm.py --tiles``, docs/results/gemm_h100_v1.json)."""
    tiles = triton.cdiv(N, 64)
    split = SMS // tiles if 3 * tiles <= SMS else 1
    return Tile(64, 128, split, stages(tiles, split, itemsize), 4)


def stages(tiles: int, split: int = 1, itemsize: int = 2) -> int:
    """Pipeline stages of a weight-streaming grid of ``tiles`` x ``split`` CTAs (``config``'s
    rule): 7 where under half the SMs have one, 5 up to one per SM, 3 beyond or for fp32."""
    if itemsize > 2 or tiles > SMS:
        return 3
    return 7 if split == 1 and 2 * tiles <= SMS else 5


def run(x: Tensor, weight: Tensor, acc: Tensor | None, out_dtype: torch.dtype, cfg: Tile | None = None) -> Tensor:
    """x [M, K] (unit K stride) times weight [N, K]^T (+ acc [M, N]) -> [M, N] ``out_dtype``."""
    M, K = x.shape
    N = weight.shape[0]
    cfg = cfg or config(M, N, K, x.element_size())
    bm = max(16, triton.next_power_of_2(M))
    tiles = triton.cdiv(N, cfg.bn)
    out = torch.empty(M, N, dtype=out_dtype, device=x.device)
    ws = torch.empty(tiles * cfg.split * cfg.bn * bm, dtype=torch.float32, device=x.device) if cfg.split > 1 else out
    cnt = arrival_counters(x.device, tiles) if cfg.split > 1 else out
    acc_arg = acc if acc is not None else out
    w = TensorDescriptor.from_tensor(weight, [cfg.bn, cfg.bk]) if cfg.tma else weight
    _mm_kernel[(tiles, cfg.split)](
        x, w, acc_arg, out, ws, cnt, M, N, K, x.stride(0), weight.stride(0), acc_arg.stride(0), out.stride(0),
        cfg.split, BM=bm, BN=cfg.bn, BK=cfg.bk, REDUCE=cfg.split > 1, HAS_ACC=acc is not None,
        DOT_F32=dot_f32(x.dtype), TMA=cfg.tma, num_warps=cfg.warps, num_stages=cfg.stages, **pdl(x.device))
    return out


def bmm_config(B: int, M: int, K: int, N: int) -> dict[str, int]:
    """Tiles of the per-head GEMM: BN columns per program, narrower when the heads' slabs
    would not fill the SMs; K in one pass up to 128 (MLA's K: 128 and 512)."""
    bn = 32 if B * triton.cdiv(N, 32) >= SMS else 16
    return dict(BM=max(16, triton.next_power_of_2(M)), BN=bn, BK=min(128, max(16, triton.next_power_of_2(K))))


def run_bmm(x: Tensor, weight: Tensor, gate: Tensor | None = None) -> Tensor:
    """x [B, M, K] times weight [B, K, N], both with any strides (MLA's heads are a
    permuted view of q, its weights views of kv_b: W_UK N-contiguous, W_UV^T K-contiguous;
    Triton specialises the unit stride) -> [B, M, N] contiguous, in x's dtype, fp32
    accumulation. With ``gate`` [M, B N] (unit column stride): the heads side by side,
    [M, B N], each rounded product times sigmoid(gate) (MLA's output gate)."""
    B, M, K = x.shape
    N = weight.shape[2]
    cfg = bmm_config(B, M, K, N)
    out = torch.empty(M, B * N, dtype=x.dtype, device=x.device) if gate is not None else \
        torch.empty(B, M, N, dtype=x.dtype, device=x.device)
    strides = (N, B * N) if gate is not None else (out.stride(0), out.stride(1))
    _bmm_kernel[(B, triton.cdiv(N, cfg["BN"]))](
        x, weight, out, gate if gate is not None else out, M, N, K, *x.stride(), *weight.stride(), *strides,
        gate.stride(0) if gate is not None else 0, DOT_F32=dot_f32(x.dtype), ROUND=x.dtype == torch.bfloat16,
        GATE=gate is not None, num_warps=4, num_stages=3, **cfg, **pdl(x.device))
    return out


def dot_f32(dtype: torch.dtype) -> bool:
    """Whether the dot runs in IEEE fp32: fp32 operands, or the interpreter."""
    return INTERPRET or dtype == torch.float32
