"""The latent MoE layer's dense projections around its routed experts, in ``sharded_moe``'s
layout (all T rows on every rank, the shared experts and the latent up-projection
TP-sharded: rank r of G owns column block r of the shared width D and of the latent L),
each one launch instead of four or five:

``kimi_kernels::moe_in(x, W_router, W_latent, W_gate_up, shard, shards, beta, lb,
                       bias=None, top_k=0, renormalize=False, scale=1.0)``
    -> (logits, z, h, weights, ids): for x [M, H] bf16,
    logits = x W_router^T   [M, E] fp32 (bf16 products, fp32 sums: stock's router)
    z      = x W_latent^T   [M, L] bf16 (the latent down-projection, replicated)
    h      = situ_and_mul([x W_gate_up[s]^T | x W_gate_up[D + s]^T], beta, lb)   [M, D/G]
             with W_gate_up = [gate; up] [2 D, H] and s = rows [r D/G, (r + 1) D/G);
    weights, ids = select_experts(logits, bias, top_k, renormalize, scale)
             [M, top_k] fp32 / int32 (``moe_router``'s op), [M, 0] when top_k = 0.
``kimi_kernels::moe_out(h, normed, W_down, W_up, shard, shards)``
    -> h W_down[:, s]^T + normed[:, l] W_up[:, l]^T   [M, H] bf16, this rank's partial
    sum (the all-reduce completes it) for h [M, D/G], normed [M, L] (the routed output's
    RMSNorm, left to Inductor: it fuses with the bf16 cast after the experts' all-reduce),
    W_down [H, D], W_up [H, L], l = columns [r L/G, (r + 1) L/G).

Rounding points are stock's: GEMM outputs bf16 (the shared down-projection's partial is
rounded before the up-projection's GEMM adds to it, as addmm's bf16 accumulator), SiTU in
fp32 on the bf16 gate / up. The weights' blocks are read in place (views of the full
weights: no per-rank copies).

GPU implementations (decode: the weights are the bytes):
  * ``moe_in``: the CuTe DSL GEMV's grouped form (``skinny_gemm.cute_gemv.MoEInGemv``):
    router, latent and the shared gate / up block share x and one launch, M <= 4; the
    last router CTA also chooses the experts (top_k <= 32) while the rest still stream,
    else ``select_experts`` runs after it. Past 4 rows (up to 64) a Triton form
    (``run_in``): one launch of 64-row weight tiles on the tensor cores' M side, a shared
    tile holding 32 gate and the matching 32 up rows, ``select_experts`` after it
    (``in_triton_rows``: 1.33-1.37x faster than the ops it replaces at 8-64 rows, H100);
  * ``moe_out``: Triton, one program per BN output columns: h and the normalised latent's
    block against the two weights' column blocks, one K loop each (tensor-core ``tl.dot``,
    rows padded to 16), M <= 64.
Elsewhere (CPU, other shapes) the references: the stock math of the replaced ops.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from kimi_inductor.stock.layers import situ_and_mul
from kimi_inductor.stock.moe import router_logits

from .common import INTERPRET, bf16_round, pdl, pdl_wait, situ, tl, triton
from . import skinny_gemm
from .skinny_gemm import tl_dot

NAMESPACE = "kimi_kernels"
MAX_ROWS_IN = 4  # measured faster than the ops it replaces up to 4 rows (49.6 vs 47.5 us at 8: H200)
MAX_ROWS_OUT = 64


def blocks(width: int, shard: int, shards: int) -> tuple[int, int]:
    """(start, size) of block ``shard`` of ``shards`` in a dimension of ``width``."""
    size = width // shards
    return shard * size, size


def implementation_in(x: Tensor, router_weight: Tensor, latent_weight: Tensor, gate_up_weight: Tensor,
                      shards: int) -> tuple[str, str]:
    """(name, why) of what ``moe_in`` runs for these operands: 'cute' (M <= MAX_ROWS_IN),
    'triton' (past it, up to ``in_triton_rows``) or 'reference'."""
    M, K = x.shape
    if x.device.type != "cuda":
        return "reference", f"on {x.device.type}"
    weights = (router_weight, latent_weight, gate_up_weight)
    if x.dtype != torch.bfloat16 or any(w.dtype != torch.bfloat16 for w in weights):
        return "reference", "not bf16"
    if not all(w.is_contiguous() for w in weights):
        return "reference", "a weight is not contiguous (the kernels stream whole rows)"
    if M > MAX_ROWS_IN:
        if M > max_rows_in():
            return "reference", f"{M} rows > {max_rows_in()}"
        if triton is None or K % 16 or (gate_up_weight.shape[0] // 2) % shards:
            return "reference", "Triton is not installed" if triton is None else f"K = {K} or the shard"
        return "triton", ""
    if skinny_gemm.cute_available():
        return "reference", skinny_gemm.cute_available()
    return _cute_shapes(M, K, router_weight.shape[0], latent_weight.shape[0], gate_up_weight.shape[0] // 2, shards)


@functools.lru_cache(maxsize=None)
def _cute_shapes(M: int, K: int, E: int, L: int, D: int, shards: int) -> tuple[str, str]:
    """Whether the grouped CuTe GEMV covers these shapes (asked once per shape: the op
    calls ``implementation_in`` on every step)."""
    from .skinny_gemm import cute_gemv

    if D % shards:
        return "reference", f"shared width {D} does not split over {shards} ranks"
    why = cute_gemv.moe_in_supported(M, K, E, L, D // shards, cute_gemv.moe_in_config(M))
    return ("reference", why) if why else ("cute", "")


def moe_in_reference(x, router_weight, latent_weight, gate_up_weight, shard, shards, beta, linear_beta):
    D = gate_up_weight.shape[0] // 2
    a, width = blocks(D, shard, shards)
    gate, up = x @ gate_up_weight[a:a + width].t(), x @ gate_up_weight[D + a:D + a + width].t()
    logits = x @ router_weight.t() if x.dtype == torch.float32 else router_logits(x, router_weight)
    return (logits, x @ latent_weight.t(),
            situ_and_mul(torch.cat([gate, up], 1), beta, linear_beta))


def fused_routing(x: Tensor, router_weight: Tensor, top_k: int, renormalize: bool, scale: float):
    """The ``Routing`` that the CuTe kernel fuses for these operands, or None (then
    ``select_experts`` runs after it)."""
    from .skinny_gemm import cute_gemv

    routing = cute_gemv.Routing(router_weight.shape[0], top_k, renormalize, scale)
    M = x.shape[0]
    return None if cute_gemv.routing_supported(M, cute_gemv.moe_in_config(M), routing) else routing


@torch.library.custom_op(f"{NAMESPACE}::moe_in", mutates_args=())
def moe_in(x: Tensor, router_weight: Tensor, latent_weight: Tensor, gate_up_weight: Tensor, shard: int,
           shards: int, beta: float, linear_beta: float, bias: Tensor | None = None, top_k: int = 0,
           renormalize: bool = False, scale: float = 1.0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    M = x.shape[0]
    impl = implementation_in(x, router_weight, latent_weight, gate_up_weight, shards)[0]
    routing = None
    if impl == "reference":
        logits, z, h = moe_in_reference(x, router_weight, latent_weight, gate_up_weight, shard, shards, beta,
                                        linear_beta)
    elif impl == "triton":
        logits, z, h = run_in(x, router_weight, latent_weight, gate_up_weight, shard, shards, beta, linear_beta)
    else:
        from .skinny_gemm import cute_gemv

        routing = fused_routing(x, router_weight, top_k, renormalize, scale) if top_k else None
        logits, z, h, weights, ids = cute_gemv.run_moe_in(
            x.contiguous(), router_weight, latent_weight, gate_up_weight, shard, shards, (beta, linear_beta),
            None if routing is None else bias.float().contiguous(), routing, bool(pdl(x.device)["PDL"]))
    if routing is None:
        weights, ids = (torch.ops.kimi_kernels.select_experts(logits, bias, top_k, renormalize, scale) if top_k
                        else (logits.new_empty(M, 0), logits.new_empty(M, 0, dtype=torch.int32)))
    return logits, z, h, weights, ids


@moe_in.register_fake
def _(x, router_weight, latent_weight, gate_up_weight, shard, shards, beta, linear_beta, bias=None, top_k=0,
      renormalize=False, scale=1.0):
    M = x.shape[0]
    return (x.new_empty(M, router_weight.shape[0], dtype=torch.float32), x.new_empty(M, latent_weight.shape[0]),
            x.new_empty(M, gate_up_weight.shape[0] // 2 // shards), x.new_empty(M, top_k, dtype=torch.float32),
            x.new_empty(M, top_k, dtype=torch.int32))


def implementation_out(h: Tensor, normed: Tensor) -> tuple[str, str]:
    """(name, why) of what ``moe_out`` runs: 'triton' or 'reference'."""
    if triton is None:
        return "reference", "Triton is not installed"
    if not h.is_cuda and not INTERPRET:
        return "reference", f"on {h.device.type}"
    if h.shape[0] > MAX_ROWS_OUT:
        return "reference", f"{h.shape[0]} rows > {MAX_ROWS_OUT}"
    if h.dtype != torch.bfloat16 or normed.dtype != torch.bfloat16:
        return "reference", "not bf16"
    return "triton", ""


def moe_out_reference(h, normed, down_weight, up_weight, shard, shards):
    a, width = blocks(down_weight.shape[1], shard, shards)
    la, lw = blocks(up_weight.shape[1], shard, shards)
    return torch.addmm(h @ down_weight[:, a:a + width].t(), normed[:, la:la + lw], up_weight[:, la:la + lw].t())


@torch.library.custom_op(f"{NAMESPACE}::moe_out", mutates_args=())
def moe_out(h: Tensor, normed: Tensor, down_weight: Tensor, up_weight: Tensor, shard: int, shards: int) -> Tensor:
    if implementation_out(h, normed)[0] == "reference":
        return moe_out_reference(h, normed, down_weight, up_weight, shard, shards)
    return _run_out(h.contiguous(), normed, down_weight, up_weight, shard, shards)


@moe_out.register_fake
def _(h, normed, down_weight, up_weight, shard, shards):
    return h.new_empty(h.shape[0], down_weight.shape[0])


if triton is not None:

    @triton.jit
    def _dot(a, w, acc, DOT_F32: tl.constexpr):
        """acc + a w^T; fp32 IEEE under the interpreter (its bf16 dot is wrong)."""
        if DOT_F32:
            return acc + tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        return acc + tl.dot(a, tl.trans(w))

    @triton.jit
    def _block_dot(x_ptr, w_ptr, rm, rn, m_ok, n_ok, stride_x, stride_w, acc, K: tl.constexpr, BK: tl.constexpr,
                   DOT_F32: tl.constexpr):
        """acc + x[rm, :K] W[rn, :K]^T (x and W already offset to their blocks)."""
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            k_ok = rk < K
            a = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _dot(a, w, acc, DOT_F32)
        return acc

    @triton.jit
    def _moe_out_kernel(h_ptr, y_ptr, wd_ptr, wu_ptr, out_ptr, M, N, stride_h, stride_y, stride_wd, stride_wu,
                        stride_out, DS: tl.constexpr, LS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
        """out[:, n block] = bf16(bf16(h W_d[n, :DS]^T) + y[:, :LS] W_u[n, :LS]^T); the pointers
        are at the blocks' first columns."""
        pdl_wait(PDL)
        rm = tl.arange(0, BM)
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        m_ok, n_ok = rm < M, rn < N
        zero = tl.zeros([BM, BN], dtype=tl.float32)
        shared = bf16_round(_block_dot(h_ptr, wd_ptr, rm, rn, m_ok, n_ok, stride_h, stride_wd, zero, DS, BK, DOT_F32),
                            True)
        out = _block_dot(y_ptr, wu_ptr, rm, rn, m_ok, n_ok, stride_y, stride_wu, shared, LS, BK, DOT_F32)
        tl.store(out_ptr + rm[:, None] * stride_out + rn[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _moe_in_kernel(x_ptr, wr_ptr, wl_ptr, wgu_ptr, logits_ptr, z_ptr, h_ptr, M, E, L, DG, a0, D, stride_x,
                       beta, linear_beta, TR, TL, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
        """Program t streams BN weight rows against x^T (the weight on the MMA's M side):
        t < TR the router's rows (fp32 logits), t < TR + TL the latent's (bf16 z), else
        BN / 2 shared outputs j: gate row a0 + j and up row D + a0 + j in one tile, whose
        halves meet in the SiTU (stock's rounding points: gate and up rounded to bf16)."""
        pdl_wait(PDL)
        t = tl.program_id(0)
        HALF: tl.constexpr = BN // 2
        r = tl.arange(0, BN)
        rm = tl.arange(0, BM)
        if t < TR:
            rows = t * BN + r
            live = rows < E
            w_ptr = wr_ptr
        elif t < TR + TL:
            rows = (t - TR) * BN + r
            live = rows < L
            w_ptr = wl_ptr
        else:
            j = (t - TR - TL) * HALF + r % HALF
            live = j < DG
            rows = a0 + j + (r >= HALF).to(tl.int32) * D
            w_ptr = wgu_ptr
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + rk[None, :], mask=live[:, None], other=0.0)
            x = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=(rm < M)[:, None], other=0.0)
            acc = _dot(w, x, acc, DOT_F32)  # acc^T [BN, BM] += W x^T
        mask = live[:, None] & (rm < M)[None, :]
        if t < TR:
            tl.store(logits_ptr + rm[None, :] * E + rows[:, None], acc, mask=mask)
        elif t < TR + TL:
            tl.store(z_ptr + rm[None, :] * L + rows[:, None], acc.to(z_ptr.dtype.element_ty), mask=mask)
        else:
            gate, up = tl.split(tl.permute(tl.reshape(acc, [2, HALF, BM]), (1, 2, 0)))  # rows j, HALF + j
            act = situ(bf16_round(gate, True), bf16_round(up, True), beta, linear_beta)
            jh = (t - TR - TL) * HALF + tl.arange(0, HALF)
            tl.store(h_ptr + rm[None, :] * DG + jh[:, None], act.to(h_ptr.dtype.element_ty),
                     mask=(jh < DG)[:, None] & (rm < M)[None, :])


def in_triton_rows() -> int:
    """The most rows the Triton ``moe_in`` takes past the CuTe GEMV's ``MAX_ROWS_IN``: 64.
    The sharded MoE layer's non-expert work with it against the ops it replaces, side by
    side on an H100 (``benchmarks/moe_sharding.py``, docs/results/session12_h100/): 49.9 /
    50.5 / 51.2 / 55.3 us against 66.4 / 67.5 / 70.1 / 75.0 at 8 / 16 / 32 / 64 rows (5-7
    rows not timed). ``KIMI_INDUCTOR_MOE_IN_ROWS=4`` turns it off, to measure it."""
    value = os.environ.get("KIMI_INDUCTOR_MOE_IN_ROWS", str(MAX_ROWS_OUT))
    if not value.isdigit():
        raise ValueError(f"KIMI_INDUCTOR_MOE_IN_ROWS={value!r}: give a row count (4 turns moe_in's Triton form off, "
                         f"{MAX_ROWS_OUT} is the default)")
    return min(MAX_ROWS_OUT, int(value))


def max_rows_in() -> int:
    """The most rows ``moe_in`` takes on the GPU (the CuTe GEMV's or its Triton form's)."""
    return max(MAX_ROWS_IN, in_triton_rows())


def run_in(x: Tensor, router_weight: Tensor, latent_weight: Tensor, gate_up_weight: Tensor, shard: int,
           shards: int, beta: float, linear_beta: float) -> tuple[Tensor, Tensor, Tensor]:
    """(logits, z, h) of ``moe_in`` in one Triton launch, M <= 64: 64 weight rows per
    program (the router's, the latent's, or 32 gate + 32 up rows of the shared block),
    all of K, no split (K3 at G = 8: 14 + 56 + 24 programs)."""
    M, K = x.shape
    E, L, D = router_weight.shape[0], latent_weight.shape[0], gate_up_weight.shape[0] // 2
    a0, DG = blocks(D, shard, shards)
    BN, BK = 64, min(128, triton.next_power_of_2(K))
    assert K % BK == 0 and x.stride(1) == 1 and all(w.is_contiguous() for w in (router_weight, latent_weight,
                                                                                 gate_up_weight))
    TR, TL, TS = triton.cdiv(E, BN), triton.cdiv(L, BN), triton.cdiv(DG, BN // 2)
    logits = torch.empty(M, E, dtype=torch.float32, device=x.device)
    z = torch.empty(M, L, dtype=x.dtype, device=x.device)
    h = torch.empty(M, DG, dtype=x.dtype, device=x.device)
    tiles = TR + TL + TS
    _moe_in_kernel[(tiles,)](
        x, router_weight, latent_weight, gate_up_weight, logits, z, h, M, E, L, DG, a0, D, x.stride(0), beta,
        linear_beta, TR, TL, K=K, BM=max(16, triton.next_power_of_2(M)), BN=BN, BK=BK, DOT_F32=INTERPRET,
        num_warps=4, num_stages=tl_dot.stages(tiles), **pdl(x.device))
    return logits, z, h


@functools.lru_cache(maxsize=None)
def out_config(M: int) -> dict[str, int]:
    """The H200 sweep's best (benchmarks/moe_sharding.py --sweep): 32 columns per program
    up to 16 rows, 64 from there."""
    return dict(BM=max(16, triton.next_power_of_2(M)), BN=32 if M <= 16 else 64, BK=256, num_warps=4,
                num_stages=3)


def _run_out(h, normed, down_weight, up_weight, shard, shards, cfg: dict | None = None) -> Tensor:
    M = h.shape[0]
    N = down_weight.shape[0]
    d0, ds = blocks(down_weight.shape[1], shard, shards)
    l0, ls = blocks(up_weight.shape[1], shard, shards)
    assert down_weight.stride(1) == 1 and up_weight.stride(1) == 1 and normed.stride(1) == 1 and h.shape[1] == ds
    cfg = dict(cfg or out_config(M))
    out = torch.empty(M, N, dtype=h.dtype, device=h.device)
    _moe_out_kernel[(triton.cdiv(N, cfg["BN"]),)](
        h, normed[:, l0:], down_weight[:, d0:], up_weight[:, l0:], out, M, N, h.stride(0), normed.stride(0),
        down_weight.stride(0), up_weight.stride(0), out.stride(0), DS=ds, LS=ls, DOT_F32=INTERPRET, **cfg,
        **pdl(h.device))
    return out
