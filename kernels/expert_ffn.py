"""``kimi_kernels::expert_ffn``: the routed experts of the latent MoE on this rank, grouped.

Semantics (the stock ``combine_experts`` loop): for latent x [T, L] bf16, routing
weights w [T, k] fp32 and local expert ids [T, k] int32 (an id outside [0, E) is an
expert of another rank, or -1 for a padding row: skipped),

    out[t] = sum_j w[t, j] * bf16(W2_e bf16(SiTU(bf16(W13_e x_t))))      e = ids[t, j]

in fp32 [T, L], with w13 [E, 2 I, L] (gate rows, then up rows) and w2 [E, L, I]. The
rounding points are stock's: each GEMM's output is bf16 (vLLM's unquantised experts),
SiTU runs in fp32 and returns bf16, the weighted sum is fp32.

GPU implementation (Triton; decode sizes: T k <= a few thousand (token, expert) pairs,
E local experts of 6144 x 3584 and 3584 x 3072 at Kimi K3's shapes). Every expert's
weights are read once per step, whatever its row count, so the kernel is a grouped
weight-streaming GEMM:

  1. sort the pairs by expert (``torch.argsort``, stable) and count them per expert
     (scatter-add): capturable in CUDA graphs, no host synchronisation;
  2. ``_up_kernel``, one program per (expert slot, BN columns of I): slot i takes the
     i-th expert with pairs (``_expert``; min(E, T k) slots, so at one row 16 slots, not
     E), gathers its pairs' latent rows, streams the gate and up slabs of W13_e, applies
     SiTU, writes h [P, I] in pair order; slots left without an expert return at once;
  3. ``_down_kernel``, one program per (expert slot, BN columns of L): h rows of the
     expert times W2_e, rounded to bf16, times the pair's routing weight -> y [P, L] fp32;
  4. ``_combine_kernel``: out[t] = the sum of its pairs' y rows, in slot order
     (deterministic; no atomics).

The byte floor is the weights of the experts that got a pair (plus activations). The
CPU reference is the stock loop; the interpreter (``TRITON_INTERPRET=1``) runs the
kernels with fp32 dots (its bf16 dot is wrong).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from kimi_inductor.stock.mxfp4 import expert_weights
from kimi_inductor.stock.moe import combine_experts

from .common import INTERPRET, pdl, pdl_wait, bf16_round, situ, tl, triton

NAMESPACE = "kimi_kernels"


@functools.lru_cache
def implementation(device: torch.device, mxfp4: bool = False, mma_layout: bool = False) -> tuple[str, str]:
    """(name, reason) of the implementation the op runs on ``device`` (asked once per
    device: the op calls it on every step); ``mxfp4``: for experts stored as MXFP4,
    ``mma_layout``: in the SM90 kernel's layout (``expert_mxfp4.mma_layout``, 5-D)."""
    if device.type == "meta":
        return "chosen at run time", "compiled on the meta device"
    if mma_layout:
        from .skinny_gemm import cute_available

        kind = "SM90 MXFP4 expert kernel (CuTe DSL, mma.sync, codes in its MMA layout)"
        if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
            return "reference", f"{device.type}: the {kind} needs an SM90+ GPU (the reference reads its layout)"
        if cute_available():
            return "reference", f"the {kind} needs CuTe DSL: {cute_available()}"
        return "cute", kind
    if triton is None:
        return "reference", "Triton is not installed"
    kind = "grouped Triton MXFP4 expert kernel (in-register E2M1 upcast)" if mxfp4 else "grouped Triton expert kernel"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major < (9 if mxfp4 else 8):
            return "reference", f"SM{major}{minor}: the {kind} needs SM{90 if mxfp4 else 80} or newer"
        return "triton", f"{kind} on SM{major}{minor}"
    if INTERPRET:
        return "triton", f"{kind} under TRITON_INTERPRET=1"
    return "reference", f"{device.type}: the torch reference (the Triton kernel needs a GPU)"


def block_rows(pairs: int, experts: int) -> int:
    """BM, the rows of one pass over a weight slab: twice an expert's expected pair
    count (16 minimum for ``tl.dot``). Every further pass of a hot expert re-reads its
    slab from HBM (the slabs in flight exceed L2), so the headroom is for routing skew:
    at 16 pairs per expert on average, BM 16 cost 1.46x the floor (issue 19)."""
    per_expert = triton.cdiv(pairs, max(1, min(experts, pairs)))
    return 16 if per_expert <= 8 else 32 if per_expert <= 16 else 64


if triton is not None:

    @triton.jit
    def _e2m1(code):
        """fp32 value of 4-bit E2M1 codes: sign bit 3, exponent bits 2-1, mantissa bit 0."""
        e = ((code >> 1) & 3).to(tl.float32)
        m = (code & 1).to(tl.float32)
        value = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * tl.exp2(e - 1.0))
        return tl.where((code & 8) != 0, -value, value)

    @triton.jit
    def _e2m1_exact(codes, scales):
        """``_e2m1_bf16`` in plain Triton (the interpreter has no inline PTX): the bf16
        (even, odd) column values of MXFP4 bytes ``codes`` with each byte's E8M0 scale."""
        scale = tl.exp2(scales.to(tl.float32) - 127.0)
        return (_e2m1(codes & 15) * scale).to(tl.bfloat16), (_e2m1(codes >> 4) * scale).to(tl.bfloat16)

    # E2M1 codes + E8M0 scales -> bf16, 4 bytes (8 values) per call, in integer and
    # packed-bf16 instructions (about 4.5 per value; Triton's own dot_scaled upcast took
    # twice the time). Per pair of bytes [b0, b1]: each nibble's magnitude bits (e1 e0 m)
    # go to bf16 bits 8-6 and its sign to bit 15, which is the value times 2^-126 exactly
    # (e = 0 lands on a bf16 subnormal: 0.5 m 2^-126); one multiply by f = 2^(min(s, 128) - 1)
    # and one by g = 2^(max(s, 128) - 128) (1 for every scale up to 2^1) give the value times
    # 2^(s - 127), each product exact (bf16 multiplies keep subnormals).
    _E2M1_ASM: tl.constexpr = tl.constexpr("\n".join(
        ["{", ".reg .b32 t, s, a, b, f, g, u, z, nz, c;", "mov.b32 z, 0;", "mov.b32 nz, 0x80008000;",
         "mov.b32 c, 0x00800080;"]
        + [line for sel, lo, hi in (("0x4140", "$0", "$2"), ("0x4342", "$1", "$3")) for line in (
            f"prmt.b32 t, $4, z, {sel};", f"prmt.b32 s, $5, z, {sel};",  # [b0, 0, b1, 0], [s0, 0, s1, 0]
            "min.u16x2 a, s, c;", "max.u16x2 b, s, c;",
            "mad.lo.u32 f, a, 128, 0x3F003F00;", "mad.lo.u32 g, b, 128, 0xFF7FFF80;",
            *(ins for out, mag, sign in ((lo, 6, 12), (hi, 2, 8)) for ins in (
                f"shl.b32 u, t, {mag};", f"shl.b32 a, t, {sign};", "and.b32 u, u, 0x01C001C0;",
                "lop3.b32 u, u, a, 0x80008000, 0xF8;",  # u | (a & 0x80008000)
                "fma.rn.bf16x2 u, u, f, nz;", f"fma.rn.bf16x2 {out}, u, g, nz;")))]
        + ["}"]))

    @triton.jit
    def _e2m1_bf16(codes, scales):
        """bf16 (even, odd) column values of MXFP4 bytes ``codes`` (low nibble = even
        column) with each byte's E8M0 scale ``scales`` (same shape, uint8), as
        ``mxfp4_dequantize`` rounds them."""
        return tl.inline_asm_elementwise(_E2M1_ASM, "=r,=r,=r,=r,r,r", [codes, scales],
                                         dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)

    @triton.jit
    def _prefetch_l2(ptrs):
        """Starts moving the 128-byte line at each of ``ptrs`` from HBM into L2 (no
        register written, nothing waited on)."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\nmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)

    @triton.jit
    def _dot(a, b, acc, DOT_F32: tl.constexpr):
        if DOT_F32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)

    @triton.jit
    def _mxfp4_matmul(x_rows, xmask, w_ptr, s_ptr, rows, wmask_n, K, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, DOT_F32: tl.constexpr, PREFETCH: tl.constexpr):
        """x[:, :K] W[rows]^T -> [BM, BN] fp32 for an MXFP4 W [N, K / 2 bytes] + scales [N, K / 32].

        The weight is the left operand (W x^T: the tile [BN, BK / 2] read as stored,
        K-contiguous, upcast to bf16 in registers by ``_e2m1_bf16``, or ``_e2m1_exact`` for
        fp32 x and in the interpreter; the few rows of x are the right operand), transposed
        once at the end; the upcast's (even, odd) values of each byte interleave into K
        order. PREFETCH > 0: each K step first asks L2 for the codes and scales of the
        step PREFETCH ahead (one line per row each), so HBM reads run ahead of the
        registers' one-stage loop."""
        KB = tl.multiple_of(K // 2, 16)  # bytes per weight row (K % BK == 0: no mask along K)
        KS = tl.multiple_of(K // 32, 4)
        w_ptrs = w_ptr + rows[:, None] * KB + tl.arange(0, BK // 2)[None, :]
        s_ptrs = s_ptr + rows[:, None] * KS + tl.arange(0, BK // 32)[None, :]
        safe_rows = tl.where(wmask_n, rows, 0)
        acc_t = tl.zeros([BN, BM], dtype=tl.float32)
        for k0 in range(0, K, BK):
            if PREFETCH > 0:
                ahead = tl.minimum(k0 + PREFETCH * BK, K - BK)
                _prefetch_l2(w_ptr + safe_rows * KB + ahead // 2)
                _prefetch_l2(s_ptr + safe_rows * KS + ahead // 32)
            w = tl.load(w_ptrs + k0 // 2, mask=wmask_n[:, None], other=0)
            s = tl.load(s_ptrs + k0 // 32, mask=wmask_n[:, None], other=127)
            s = tl.reshape(tl.broadcast_to(s[:, :, None], [BN, BK // 32, 16]), [BN, BK // 2])
            if DOT_F32:
                even, odd = _e2m1_exact(w, s)
            else:
                even, odd = _e2m1_bf16(w, s)
            tile = tl.reshape(tl.join(even, odd), [BN, BK])
            x_t = tl.load(x_rows + (k0 + tl.arange(0, BK))[None, :], mask=xmask[:, None], other=0.0)
            acc_t = _dot(tile, tl.trans(x_t), acc_t, DOT_F32)
        return tl.trans(acc_t)

    @triton.jit
    def _expert(counts_ptr, E, SCAN: tl.constexpr):
        """The local expert of this program's row of the grid: with SCAN (a power of two
        >= E) the grid has a row per expert slot, and slot i takes the i-th expert with
        pairs (E if none is left: the program reads no count and returns); SCAN 0:
        the grid has a row per expert."""
        slot = tl.program_id(0)
        if SCAN == 0:
            e = slot
        else:
            ids = tl.arange(0, SCAN)
            busy = (tl.load(counts_ptr + ids, mask=ids < E, other=0) > 0).to(tl.int32)
            hit = (busy != 0) & (tl.cumsum(busy, 0) == slot + 1)
            e = tl.sum(tl.where(hit, ids, 0)) + (1 - tl.sum(hit.to(tl.int32))) * E
        return e

    @triton.jit
    def _up_kernel(x_ptr, stride_x, w13_ptr, s13_ptr, order_ptr, starts_ptr, counts_ptr, h_ptr, E, L, I, beta,
                   linear_beta, TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   DOT_F32: tl.constexpr, ROUND: tl.constexpr, MXFP4: tl.constexpr, PREFETCH: tl.constexpr,
                   SCAN: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        e = _expert(counts_ptr, E, SCAN)
        count = tl.load(counts_ptr + e, mask=e < E, other=0)
        if count == 0:
            return
        start = tl.load(starts_ptr + e)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = rn < I
        w_base = w13_ptr + e.to(tl.int64) * 2 * I * (L // 2 if MXFP4 else L)
        s_base = s13_ptr + e.to(tl.int64) * 2 * I * (L // 32)
        for m0 in range(0, count, BM):
            rm = m0 + tl.arange(0, BM)
            mmask = rm < count
            token = tl.load(order_ptr + start + rm, mask=mmask, other=0) // TOP_K
            x_rows = x_ptr + token[:, None].to(tl.int64) * stride_x
            if MXFP4:  # the gate and up rows as one [2 BN]-row tile, split after
                j = tl.arange(0, 2 * BN)
                col = tl.program_id(1) * BN + j % BN
                acc = _mxfp4_matmul(x_rows, mmask, w_base, s_base, col + (j // BN) * I, col < I, L, BM, 2 * BN, BK,
                                    DOT_F32, PREFETCH)
                acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, [BM, 2, BN]), [0, 2, 1]))
            else:
                acc_g = tl.zeros([BM, BN], dtype=tl.float32)
                acc_u = tl.zeros([BM, BN], dtype=tl.float32)
                for k0 in range(0, L, BK):
                    rk = k0 + tl.arange(0, BK)
                    kmask = rk < L
                    x = tl.load(x_rows + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
                    wmask = kmask[:, None] & nmask[None, :]
                    wg = tl.load(w_base + rn[None, :] * L + rk[:, None], mask=wmask, other=0.0)  # [BK, BN]
                    wu = tl.load(w_base + (I + rn)[None, :] * L + rk[:, None], mask=wmask, other=0.0)
                    acc_g = _dot(x, wg, acc_g, DOT_F32)
                    acc_u = _dot(x, wu, acc_u, DOT_F32)
            gate = bf16_round(acc_g, ROUND)
            up = bf16_round(acc_u, ROUND)
            act = situ(gate, up, beta, linear_beta)
            tl.store(h_ptr + (start + rm)[:, None].to(tl.int64) * I + rn[None, :],
                     bf16_round(act, ROUND).to(h_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])

    @triton.jit
    def _down_kernel(h_ptr, w2_ptr, s2_ptr, weights_ptr, order_ptr, starts_ptr, counts_ptr, y_ptr, E, L, I,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_F32: tl.constexpr,
                     ROUND: tl.constexpr, MXFP4: tl.constexpr, PREFETCH: tl.constexpr, SCAN: tl.constexpr,
                     PDL: tl.constexpr):
        pdl_wait(PDL)
        e = _expert(counts_ptr, E, SCAN)
        count = tl.load(counts_ptr + e, mask=e < E, other=0)
        if count == 0:
            return
        start = tl.load(starts_ptr + e)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = rn < L
        w_base = w2_ptr + e.to(tl.int64) * L * (I // 2 if MXFP4 else I)
        s_base = s2_ptr + e.to(tl.int64) * L * (I // 32)
        for m0 in range(0, count, BM):
            rm = m0 + tl.arange(0, BM)
            mmask = rm < count
            h_rows = h_ptr + (start + rm)[:, None].to(tl.int64) * I
            if MXFP4:
                acc = _mxfp4_matmul(h_rows, mmask, w_base, s_base, rn, nmask, I, BM, BN, BK, DOT_F32, PREFETCH)
            else:
                acc = tl.zeros([BM, BN], dtype=tl.float32)
                for k0 in range(0, I, BK):
                    rk = k0 + tl.arange(0, BK)
                    kmask = rk < I
                    h = tl.load(h_rows + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
                    w = tl.load(w_base + rn[None, :] * I + rk[:, None], mask=kmask[:, None] & nmask[None, :],
                                other=0.0)
                    acc = _dot(h, w, acc, DOT_F32)
            pair = tl.load(order_ptr + start + rm, mask=mmask, other=0)
            weight = tl.load(weights_ptr + pair, mask=mmask, other=0.0)
            y = bf16_round(acc, ROUND) * weight[:, None]
            tl.store(y_ptr + (start + rm)[:, None].to(tl.int64) * L + rn[None, :], y,
                     mask=mmask[:, None] & nmask[None, :])

    @triton.jit
    def _combine_kernel(y_ptr, position_ptr, out_ptr, L, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
        pdl_wait(PDL)
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        cmask = cols < L
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(TOP_K):  # slot order: deterministic
            p = tl.load(position_ptr + t * TOP_K + j)
            acc += tl.load(y_ptr + tl.maximum(p, 0).to(tl.int64) * L + cols, mask=cmask & (p >= 0), other=0.0)
        tl.store(out_ptr + t.to(tl.int64) * L + cols, acc, mask=cmask)


    @triton.jit
    def _group_kernel(ids_ptr, order_ptr, starts_ptr, counts_ptr, position_ptr, slots_ptr, P, E, S,
                      PB: tl.constexpr, BP: tl.constexpr, EB: tl.constexpr, COMPARE: tl.constexpr,
                      PDL: tl.constexpr):
        """``group_pairs`` in one launch (P <= PB pairs, E + 2 <= EB), BP pairs per program.
        A pair's key is its local expert, or E for another rank's; its place in the order
        is the number of pairs whose key is smaller, or equal and earlier (one [BP, PB]
        comparison: stable). Program 0 also writes the keys' histogram (``tl.histogram``,
        or with ``COMPARE`` one [EB, PB] comparison), its exclusive prefix sum and the slots."""
        pdl_wait(PDL)
        q = tl.arange(0, PB)
        ids = tl.load(ids_ptr + q, mask=q < P, other=-1)
        key = tl.where(q < P, tl.where((ids >= 0) & (ids < E), ids, E), E + 1)
        p = tl.program_id(0) * BP + tl.arange(0, BP)
        mine = tl.load(ids_ptr + p, mask=p < P, other=-1)
        mine = tl.where((mine >= 0) & (mine < E), mine, E)
        before = (key[None, :] < mine[:, None]) | ((key[None, :] == mine[:, None]) & (q[None, :] < p[:, None]))
        pos = tl.sum(before.to(tl.int32), 1)
        tl.store(order_ptr + pos, p, mask=p < P)
        tl.store(position_ptr + p, tl.where(mine < E, pos, -1), mask=p < P)
        if tl.program_id(0) == 0:
            bins = tl.arange(0, EB)
            if COMPARE:
                counts = tl.sum((key[None, :] == bins[:, None]).to(tl.int32), 1)
            else:
                counts = tl.histogram(key, EB)
            starts = tl.cumsum(counts, 0) - counts
            tl.store(counts_ptr + bins, counts, mask=bins < E)
            tl.store(starts_ptr + bins, starts, mask=bins < E)
            busy = (counts > 0) & (bins < E)
            slot = tl.cumsum(busy.to(tl.int32), 0) - 1
            tl.store(slots_ptr + bins, tl.full([EB], 0, tl.int32) + E, mask=bins < S)
            tl.debug_barrier()
            tl.store(slots_ptr + slot, bins, mask=busy & (slot < S))


# Pairs ``_group_kernel`` takes (more go to torch), and pairs per program. On the H200
# (docs/results/group_pairs_micro_h200.json) 4 warps beat 8 at every size measured (by
# 0.1-4.4 us), and at one row over 896 experts the [EB, PB] comparison took 2.1 us less
# than ``tl.histogram`` over 1024 bins (0.2 us more over 128: there the histogram stays).
GROUP_PAIRS_MAX, GROUP_BLOCK = 1024, 32


def group_pairs(topk_ids: Tensor, experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(order, starts, counts, position, slots): the (token, slot) pairs sorted by local expert.

    order [T k] int32: pair indices (t k + j), this rank's pairs first, by expert, stable;
    starts/counts [E] int32: each expert's range in ``order``; position [T k] int32:
    where pair t k + j sits in ``order``, -1 when its expert is not local; slots
    [min(E, T k)] int32: the i-th local expert with pairs (E: none). One Triton launch up
    to ``GROUP_PAIRS_MAX`` pairs (decode), else torch's sort and scans (``expert_slots``).
    """
    flat = topk_ids.reshape(-1)
    P, n_slots = flat.numel(), min(experts, flat.numel())
    if triton is not None and (flat.is_cuda or INTERPRET) and P <= GROUP_PAIRS_MAX:
        out = [torch.empty(n, dtype=torch.int32, device=flat.device) for n in (P, experts, experts, P, n_slots)]
        PB, EB = max(16, triton.next_power_of_2(P)), triton.next_power_of_2(experts + 2)
        BP = min(PB, GROUP_BLOCK)
        _group_kernel[(triton.cdiv(P, BP),)](flat.to(torch.int32).contiguous(), *out, P, experts, n_slots, PB=PB,
                                             BP=BP, EB=EB, COMPARE=PB == 16 and EB >= 512, num_warps=4,
                                             **pdl(flat.device))
        return tuple(out)
    local = (flat >= 0) & (flat < experts)
    key = torch.where(local, flat, experts).to(torch.int64)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(experts + 1, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    counts = counts[:experts]
    starts = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    position = torch.empty_like(key).scatter_(0, order, torch.arange(key.numel(), device=flat.device))
    position = torch.where(local, position, -1)
    return (order.to(torch.int32), starts, counts.contiguous(), position.to(torch.int32),
            expert_slots(counts, n_slots))


def _fake(latent, topk_weights, topk_ids, w13, w2, beta, linear_beta, w13_scale=None, w2_scale=None):
    return latent.new_empty(latent.shape, dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::expert_ffn", mutates_args=())
def expert_ffn(latent: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor, beta: float,
               linear_beta: float, w13_scale: Tensor | None = None, w2_scale: Tensor | None = None) -> Tensor:
    """With scales, the experts are MXFP4 as the checkpoint stores them (``stock.mxfp4``):
    w13 [E, 2 I, L / 2] uint8 codes + w13_scale [E, 2 I, L / 32], w2 [E, L, I / 2] + w2_scale
    [E, L, I / 32], upcast tile by tile in registers: the result is the op on the
    dequantised experts (bitwise on H200 at the default tiles: the same bf16 weights and
    dots)."""
    impl = implementation(latent.device, w13_scale is not None, w13.dim() == 5)[0]
    if impl == "cute" and latent.dtype == torch.bfloat16:
        return mma_grouped(latent, topk_weights, topk_ids, w13, w2, beta, linear_beta, w13_scale, w2_scale)
    if impl != "triton" or latent.dtype not in (torch.bfloat16, torch.float32):
        return reference(latent, topk_weights, topk_ids, w13, w2, beta, linear_beta, w13_scale, w2_scale)
    return grouped(latent, topk_weights, topk_ids, w13, w2, beta, linear_beta, w13_scale, w2_scale)


def grouped(latent: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor, beta: float,
            linear_beta: float, w13_scale: Tensor | None = None, w2_scale: Tensor | None = None,
            BM: int | None = None, BN: int | None = None, BK: int | None = None, num_stages: int | None = None,
            num_warps: int = 4, maxnreg: int | None = None, prefetch: int | None = None,
            compact: bool = True) -> Tensor:
    """The Triton implementation (MXFP4 weights when their scales are given); tile sizes,
    a register cap (``maxnreg``: more programs per SM; 0 for none), for MXFP4 an L2
    prefetch distance in K steps (``prefetch``, ``_mxfp4_matmul``) and the grid
    (``compact``: over expert slots, ``_expert``; False: a program row per local expert)
    as arguments for the benchmark's sweep. Defaults, measured on H200
    (``benchmarks/moe_experts.py``): bf16 BN 32 (64 within 1%), BK 128, 3 stages; MXFP4
    BN 64 (its up tile is 2 BN rows of gate and up), BK 256, 1 stage (8-30 % faster than
    BK 128 / 3 stages, BN 32 and 128 slower; loading each K step's tiles into registers
    one step ahead was 1.45-1.62x slower), at most 128 registers (four programs per SM
    instead of two, no spills in the up kernel, 16 bytes in the down kernel: 1.05-1.15x
    faster than the uncapped 240 / 164, bitwise the same), prefetch 1 (distance 2 and 4
    slower). The slot grid and the prefetch together: 1.01-1.05x faster at EP 8 shapes
    and 1.32x at one row at EP 1 (MXFP4; bf16, slots alone: 1.17x there, within 1 %
    elsewhere)."""
    T, top_k = topk_ids.shape
    E, two_i, L = w13.shape[0], w13.shape[1], latent.shape[1]
    I = two_i // 2
    mxfp4 = w13_scale is not None
    BN = BN or (64 if mxfp4 else 32)
    BK = BK or (256 if mxfp4 else 128)
    num_stages = num_stages or (1 if mxfp4 else 3)
    prefetch = 0 if INTERPRET or not mxfp4 else 1 if prefetch is None else prefetch  # no inline PTX interpreted
    maxnreg = (128 if mxfp4 else None) if maxnreg is None else (maxnreg or None)  # 0: no cap
    assert latent.stride(1) == 1 and w13.is_contiguous() and w2.is_contiguous()
    if mxfp4:  # the MXFP4 K loop has no mask along K: BK divides L and I
        BK = math.gcd(BK, L, I)
        assert w13_scale.is_contiguous() and w2_scale.is_contiguous() and BK % 32 == 0
    order, starts, counts, position, _ = group_pairs(topk_ids, E)
    n_pairs = T * top_k
    h = latent.new_empty(n_pairs, I)
    y = torch.empty(n_pairs, L, dtype=torch.float32, device=latent.device)
    out = torch.empty(T, L, dtype=torch.float32, device=latent.device)
    tiles = dict(BM=BM or block_rows(n_pairs, E), BN=BN, BK=BK)
    launch = pdl(latent.device)
    flags = dict(DOT_F32=INTERPRET or latent.dtype == torch.float32,  # the interpreter's bf16 dot is wrong
                 ROUND=latent.dtype == torch.bfloat16, MXFP4=mxfp4, PREFETCH=prefetch,
                 SCAN=triton.next_power_of_2(E) if compact else 0, num_warps=num_warps, num_stages=num_stages,
                 maxnreg=maxnreg, **launch)
    slots = min(E, n_pairs) if compact else E
    _up_kernel[(slots, triton.cdiv(I, BN))](latent, latent.stride(0), w13, w13_scale if mxfp4 else w13, order,
                                            starts, counts, h, E, L, I, beta, linear_beta, TOP_K=top_k, **tiles,
                                            **flags)
    _down_kernel[(slots, triton.cdiv(L, BN))](h, w2, w2_scale if mxfp4 else w2, topk_weights.contiguous().view(-1),
                                              order, starts, counts, y, E, L, I, **tiles, **flags)
    block = 512
    _combine_kernel[(T, triton.cdiv(L, block))](y, position, out, L, TOP_K=top_k, BLOCK=block, **launch)
    return out


def expert_slots(counts: Tensor, slots: int) -> Tensor:
    """[slots] int32: slot i's local expert, the i-th with pairs (E: none); capturable."""
    E = counts.numel()
    busy = counts > 0
    at = torch.where(busy, torch.cumsum(busy, 0) - 1, E)
    table = torch.full((E + 1,), E, dtype=torch.int32, device=counts.device)
    table.scatter_(0, at, torch.arange(E, dtype=torch.int32, device=counts.device))
    return table[:slots]


def mma_grouped(latent: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor, beta: float,
                linear_beta: float, w13_scale: Tensor, w2_scale: Tensor, tiles: int | None = None,
                warps: int = 4, rb: int | None = None, min_blocks: int = 0) -> Tensor:
    """The SM90 CuTe DSL kernels for MXFP4 experts in their MMA layout
    (``expert_mxfp4.mma_layout``: w13 [E, 2 I / 16, L / 64, 32, 16] uint8, ...): the pairs
    grouped by expert as ``grouped``, the up and down projections one warp per 16 weight
    rows, then ``_combine_kernel``. ``tiles``, ``warps``, ``rb``, ``min_blocks``: the
    projections' choices (``expert_mxfp4.Mxfp4Experts``), for sweeps."""
    from . import expert_mxfp4 as MX

    T, top_k = topk_ids.shape
    E, n_pairs = w13.shape[0], T * top_k
    I, L = 8 * w13.shape[1], latent.shape[1]
    order, starts, counts, position, slots = group_pairs(topk_ids, E)
    tiles = tiles or MX.tiles_for(n_pairs, slots.numel(), top_k)
    on = bool(pdl(latent.device)["PDL"])
    h = latent.new_empty(n_pairs, I)
    y = torch.empty(n_pairs, L, dtype=torch.float32, device=latent.device)
    weights = topk_weights.contiguous().view(-1)
    if latent.stride(0) % 8 and T > 1:  # x's 16-byte loads need 16-byte rows
        latent = latent.contiguous()
    for gate_up, x, w, s, out in ((True, latent, w13, w13_scale, h), (False, h, w2, w2_scale, y)):
        x32, w32, s32 = x.view(torch.int32), w.view(torch.int32), s.view(torch.int32).squeeze(-1)
        blocks = rb or MX.blocks_per_warp(tiles, w.shape[1])
        MX.projection(gate_up, x32, w32, n_pairs, top_k, tiles, warps, beta, linear_beta, on, blocks, min_blocks)(
            x32, w32, s32, slots, order, starts, counts, weights, out)
    out = torch.empty(T, L, dtype=torch.float32, device=latent.device)
    block = 512
    _combine_kernel[(T, triton.cdiv(L, block))](y, position, out, L, TOP_K=top_k, BLOCK=block, **pdl(latent.device))
    return out


expert_ffn.register_fake(_fake)


def sm90_sources(tiles: dict, top_k: int = 16) -> dict:
    """{"up": ASTSource, "down": ASTSource}: the grouped kernels as ``grouped`` launches
    them (``tiles``: BM, BN, BK, DOT_F32, ROUND, MXFP4, PDL), with the launch's
    specialisation (16-divisible pointers, L, I and the latent stride), to compile for
    sm_90 without a GPU (``tests/test_triton_compiles.py``, ``benchmarks/expert_sass.py``)."""
    from triton.compiler import ASTSource

    weight = "*u8" if tiles["MXFP4"] else "*bf16"
    rows = {"order_ptr": "*i32", "starts_ptr": "*i32", "counts_ptr": "*i32"}
    up = {"x_ptr": "*bf16", "stride_x": "i32", "w13_ptr": weight, "s13_ptr": weight, **rows, "h_ptr": "*bf16",
          "E": "i32", "L": "i32", "I": "i32", "beta": "fp32", "linear_beta": "fp32", "TOP_K": "constexpr",
          **{k: "constexpr" for k in tiles}}
    down = {"h_ptr": "*bf16", "w2_ptr": weight, "s2_ptr": weight, "weights_ptr": "*fp32", **rows, "y_ptr": "*fp32",
            "E": "i32", "L": "i32", "I": "i32", **{k: "constexpr" for k in tiles}}

    def source(kernel, sig, constexprs):
        attrs = {(i,): [["tt.divisibility", 16]] for i, (k, v) in enumerate(sig.items())
                 if v.startswith("*") or k in ("L", "I", "stride_x")}
        return ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs)

    return {"up": source(_up_kernel, up, {"TOP_K": top_k, **tiles}), "down": source(_down_kernel, down, tiles)}


def reference(latent, topk_weights, topk_ids, w13, w2, beta, linear_beta, w13_scale=None, w2_scale=None) -> Tensor:
    """The stock expert loop over the local experts (fp32 sum in expert order), on the
    dequantised experts where they are MXFP4."""
    w13, w2 = expert_weights(w13, w2, w13_scale, w2_scale, latent.dtype)
    return combine_experts(latent, topk_weights, topk_ids, w13, w2, 0, beta, linear_beta)
