"""CuTe DSL split-K GEMV for decode rows (M <= 8): ``out = [acc +] x W^T``, SM90 / SM100.

At M <= 8 a decode GEMM is a weight stream: the CUDA cores keep up with 4.28 TB/s (M FMAs
per weight element), so the kernel needs no tensor cores, only many bytes in flight.

Layout of the work. x [M, K] and W [N, K] are K-contiguous bf16 (x's rows may be a
column slice of a wider tensor: its row stride is compiled in, ``row_stride``). A CTA of WARPS warps owns
WARPS * R consecutive outputs n and one K chunk of K / SPLIT; warp w takes outputs
n0 + w R .. n0 + w R + R - 1. Its 32 lanes stride the chunk in 16-byte vectors (8 elements,
256 per warp step); each step issues R streaming weight loads (evict-first: the weights
never fit in L2) and M cached x loads (x is re-read by every CTA: L1/L2 hits), unrolled U
steps deep for memory-level parallelism. Per lane M x R fp32 partial sums, then a warp
butterfly reduction.

Split-K without a second kernel: with SPLIT > 1 each CTA writes its fp32 partials to
``ws[split, m, n]``, fences, and bumps the tile's arrival counter; the CTA that arrives
last sums the SPLIT partials in split order (deterministic: every TP rank gets the same
bits), adds ``acc``, rounds once to the output dtype and resets the counter to 0 for the
next call. Each compiled shape has its own zeroed counters, allocated with its executor
before CUDA-graph capture: two GEMMs of one shape must not run concurrently on two
streams.

Fused neighbours (``Fusion``), each one launch instead of two:

* RMSNorm prologue (``rms_norm_mm``): ``out = [acc +] rmsnorm(x) W^T``. Lanes multiply x
  by the norm weight as they load it and also sum x^2 over their K chunk; the row's
  ``rsqrt(mean(x^2) + eps)`` scales the finished dot products (a row scale commutes
  with the GEMM), so no pass over x precedes the weight stream. With SPLIT > 1 the
  chunks' sums of squares travel in column N of the workspace. Stock rounds the
  normalised row to bf16 before its GEMM; here it stays fp32 (within one bf16 rounding
  of the output).
* SiTU-GLU epilogue (``mm_situ``): ``out = situ_and_mul(x W^T)`` for W = [gate; up]
  [2 I, K]: a warp owns R outputs and streams both their gate rows n and up rows
  I + n, so each output's two dot products meet in one lane, which rounds them to bf16
  (stock's GEMM output), applies SiTU in fp32 and rounds once more (stock's points).

On SM90+ the GEMV launches with programmatic dependent launch (``common.pdl``): its CTAs
may be scheduled while the kernel before it still runs and wait for it in ``pdl_wait``,
so a CUDA graph of decode kernels loses no launch gap at a GEMV. W does not depend on
that kernel: each warp reads its first P = 6 warp steps of W into registers before the
wait (``read_ahead``; o_proj's whole K at one row), so they stream while the kernel
before it finishes; the KDA kernel releases o_proj only after its own loads, so the two
streams do not compete. The GEMV releases the kernel after it once every CTA has issued
its weight loads (``pdl_wait``).

Constraints (checked by ``supported``): K % (256 SPLIT) == 0, N % R == 0, 16-byte aligned
rows.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, const_expr
from cuda.bindings.driver import CUstream
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

from ..common import SMS, pdl

VEC = 8  # bf16 elements per 16-byte load
WARP = 32
STEP = WARP * VEC  # K elements one warp covers per step
MAX_ROWS = 8
DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float32: Float32, torch.int32: Int32}


class Fusion(NamedTuple):
    """What the GEMV fuses: a RMSNorm prologue (``eps``), a SiTU-GLU epilogue (``situ`` =
    (beta, linear beta)), or neither. Constants of the compiled kernel."""

    eps: float | None = None
    situ: tuple[float, float] | None = None


PLAIN = Fusion()


class Config(NamedTuple):
    r: int  # outputs per warp
    warps: int  # warps per CTA
    split: int  # K chunks (CTAs per output tile)
    unroll: int  # warp steps in flight


# (N, K, M) -> the best configuration of the H200 sweeps at the TP8 shapes
# (benchmarks/gemm.py --sweep: docs/results/gemm_h200_v2.json, and the wider sweep with
# 8 warps and 2-deep unroll, gemm_h200_v4_{small,large}.json, for 1 row and the small
# shapes at 2); ``config`` elsewhere.
TUNED = {
    (6288, 7168, 1): Config(1, 4, 1, 4),
    (6288, 7168, 2): Config(2, 4, 1, 4),
    (6288, 7168, 4): Config(4, 4, 1, 4),
    (7168, 1536, 1): Config(2, 8, 1, 2),
    (7168, 1536, 2): Config(2, 4, 1, 2),
    (7168, 1536, 4): Config(2, 4, 1, 4),
    (3648, 7168, 1): Config(1, 4, 1, 2),
    (3648, 7168, 2): Config(1, 4, 1, 4),
    (3648, 7168, 4): Config(4, 4, 2, 4),
    (2304, 1536, 1): Config(1, 4, 1, 2),
    (2304, 1536, 2): Config(1, 4, 1, 2),
    (2304, 1536, 4): Config(1, 4, 1, 4),
    (896, 7168, 1): Config(1, 8, 7, 2),
    (896, 7168, 2): Config(2, 8, 7, 4),
    (896, 7168, 4): Config(2, 4, 7, 4),
    (3584, 7168, 1): Config(1, 4, 1, 4),
    (3584, 7168, 2): Config(1, 4, 1, 4),
    (3584, 7168, 4): Config(4, 4, 2, 4),
    (7168, 3584, 1): Config(2, 4, 1, 2),
    (7168, 3584, 2): Config(2, 4, 1, 4),
    (7168, 3584, 4): Config(2, 4, 1, 4),
    (12288, 7168, 1): Config(1, 4, 1, 4),
    (12288, 7168, 2): Config(1, 4, 1, 4),
    (12288, 7168, 4): Config(4, 4, 1, 4),
    (7168, 6144, 1): Config(2, 4, 1, 2),
    (7168, 6144, 2): Config(2, 4, 1, 4),
    (7168, 6144, 4): Config(2, 4, 1, 4),
}


def config(M: int, N: int, K: int) -> Config:
    """TUNED where measured; else two outputs per warp up to 4 rows, four from there (x
    loads per weight load fall with R), and K split until about four 128-thread CTAs per
    SM stream, keeping at least two warp steps per chunk. At the TP8 shapes this rule is
    within 11 % of the sweep's best except q_b at 2-4 rows (1.3-1.6x:
    docs/results/gemm_h200_v3.json), hence the table."""
    if (N, K, M) in TUNED:
        return TUNED[(N, K, M)]
    r = 2 if M <= 4 else 4
    warps = 4
    tiles = -(-N // (warps * r))
    steps = K // STEP
    split = 1
    for d in range(1, steps + 1):
        if steps % d == 0 and steps // d >= 2:
            split = d
            if tiles * d >= 4 * SMS:
                break
    return Config(r, warps, split, min(4, steps // split))


# (fusion, N, K, M) -> the best configuration of the H200 sweep of the fused GEMVs
# (benchmarks/gemm_fusions.py --sweep, docs/results/gemm_fusions_h200_sweep.json); the
# fusions are used only here, where they measured faster than the unfused pair.
TUNED_FUSED = {
    ("rms_norm", 7168, 3584, 1): Config(2, 8, 1, 2),  # MoE latent norm -> up-projection
    ("rms_norm", 7168, 3584, 2): Config(2, 2, 1, 2),
    ("rms_norm", 2304, 1536, 1): Config(1, 4, 1, 2),  # MLA q_a norm -> q_b
    ("rms_norm", 2304, 1536, 2): Config(2, 2, 1, 2),
    ("situ", 12288, 7168, 1): Config(2, 4, 1, 4),  # shared experts gate_up -> SiTU
    ("situ", 12288, 7168, 2): Config(1, 2, 1, 4),
}


def fusion_kind(fusion: Fusion) -> str:
    return "situ" if fusion.situ else "rms_norm" if fusion.eps is not None else ""


def fused_config(M: int, N: int, K: int, fusion: Fusion) -> Config:
    """TUNED_FUSED where measured; else ``config`` of the plain GEMM of the same weight,
    with SiTU's warps taking half the outputs (two weight rows each: the same rows in
    flight)."""
    if (fusion_kind(fusion), N, K, M) in TUNED_FUSED:
        return TUNED_FUSED[(fusion_kind(fusion), N, K, M)]
    cfg = config(M, N, K)
    return cfg._replace(r=max(1, cfg.r // 2)) if fusion.situ else cfg


def supported(M: int, N: int, K: int, cfg: Config | None = None, fusion: Fusion = PLAIN) -> str:
    """N: the weight's rows (2 I with SiTU)."""
    cfg = cfg or fused_config(M, N, K, fusion)
    if fusion.situ and N % 2:
        return f"N={N}: SiTU needs [gate; up] halves"
    N = N // 2 if fusion.situ else N
    if M > MAX_ROWS:
        return f"{M} rows (> {MAX_ROWS}: the CUDA cores no longer keep up with the weight stream)"
    wrows = 2 * cfg.r if fusion.situ else cfg.r
    if M * wrows > WARP:
        return f"{M} rows x {wrows} weight rows per warp exceed the {WARP} lanes that write them"
    if K % (STEP * cfg.split) or N % cfg.r:
        return f"N={N}, K={K}: K must split into whole {STEP}-element warp steps"
    return ""


class SplitKGemv:
    """One compiled configuration: rows M, outputs per warp R, warps per CTA, split, unroll."""

    def __init__(self, rows: int, r: int, warps: int, split: int, unroll: int, has_acc: bool, in_dtype, out_dtype,
                 fusion: Fusion = PLAIN, k: int = 0, half: int = 0, pdl: bool = False, preload: int = 0):
        self.rows, self.r, self.warps, self.split, self.unroll, self.pdl = rows, r, warps, split, unroll, pdl
        self.preload = min(preload, k // (STEP * split)) if pdl else 0  # warp steps of W read before the wait
        self.has_acc, self.in_dtype, self.out_dtype = has_acc, in_dtype, out_dtype
        self.norm, self.situ = fusion.eps is not None, fusion.situ is not None
        self.eps, self.inv_k = fusion.eps or 0.0, 1.0 / max(k, 1)
        self.beta, self.linear_beta = fusion.situ or (1.0, 1.0)
        self.tile = warps * r  # outputs per CTA
        self.wrows = 2 * r if self.situ else r  # weight rows per warp
        self.half = half  # SiTU: rows from a gate row to its up row (0: the outputs n)

    @cute.jit
    def __call__(self, x: cute.Tensor, w: cute.Tensor, gamma: cute.Tensor, acc: cute.Tensor, out: cute.Tensor,
                 ws: cute.Tensor, counters: cute.Tensor, stream: CUstream):
        n = cute.size(out, mode=[1])
        k = cute.size(w, mode=[1])
        load_w, load_x = _loads(self.in_dtype)
        self.kernel(x, w, gamma, acc, out, ws, counters, n, k, load_w, load_x).launch(
            grid=[cute.ceil_div(n, self.tile), self.split, 1], block=[self.warps * WARP, 1, 1], stream=stream,
            use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, x: cute.Tensor, w: cute.Tensor, gamma: cute.Tensor, acc: cute.Tensor, out: cute.Tensor,
               ws: cute.Tensor, counters: cute.Tensor, n: Int32, k: Int32, load_w: cute.CopyAtom,
               load_x: cute.CopyAtom):
        """n: outputs (weight rows, or their halves with SiTU); ws [SPLIT, M, weight rows (+ 1
        with RMSNorm: the chunk's sum of x^2)]."""
        bx, s, _ = cute.arch.block_idx()
        # W does not depend on the kernels before this one: its first warp steps are read
        # before the PDL wait, overlapping their tail (``preload``)
        n0 = bx * self.tile + cute.arch.warp_idx() * self.r
        half = self.half if const_expr(self.half and self.split == 1) else n  # as tile_of / split_tile read W
        kv0 = s * (k // (STEP * self.split)) * WARP + cute.arch.lane_idx()
        ahead = self.read_ahead(w, n0, n, half, kv0, load_w)
        pdl_wait(self.pdl)
        if const_expr(self.split == 1):
            self.tile_of(x, w, gamma, acc, out, bx, load_w, load_x, ahead)
        else:
            flag = cutlass.memory.SmemAllocator().allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)
            self.split_tile(x, w, gamma, acc, out, ws, counters, bx, s, flag, load_w, load_x, ahead)

    @cute.jit
    def split_tile(self, x: cute.Tensor, w: cute.Tensor, gamma: cute.Tensor, acc: cute.Tensor, out: cute.Tensor,
                   ws: cute.Tensor, counters: cute.Tensor, bx: Int32, s: Int32, flag: cute.Tensor,
                   load_w: cute.CopyAtom, load_x: cute.CopyAtom, ahead: cute.Tensor | None = None):
        """CTA (``bx``, ``s``): K chunk s of output tile bx; the CTA that arrives last at
        ``counters[bx]`` sums the tile's partials and writes it. Returns whether this CTA
        did (uniform over the CTA). ``flag``: one Int32 of shared memory."""
        rows: cutlass.Constexpr = self.rows
        r: cutlass.Constexpr = self.r
        wrows: cutlass.Constexpr = self.wrows
        split: cutlass.Constexpr = self.split
        tile: cutlass.Constexpr = self.tile
        n = cute.size(out, mode=[1])
        k = cute.size(w, mode=[1])
        tidx, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        n0 = bx * tile + warp * r
        part, sq = self.partials()
        if n0 < n:
            self.dot(x, w, gamma, n0, n, s * (k // (STEP * split)) * WARP + lane, k // (STEP * split), load_w,
                     load_x, part, sq, ahead)
            for m in cutlass.range_constexpr(rows):
                for j in cutlass.range_constexpr(wrows):
                    if lane == m * wrows + j:
                        ws[s, m, n0 + j % r + (j // r) * n] = part[m, j]
                if const_expr(self.norm):
                    if lane == 0 and warp == 0:
                        ws[s, m, n] = sq[m]  # every tile writes the same value
        last = arrived_last(counters, bx, split, flag)
        if last:
            if tidx < tile * rows:
                m = tidx // tile
                nn = bx * tile + tidx % tile
                if nn < n:
                    total, up, ss = Float32(0.0), Float32(0.0), Float32(0.0)
                    for i in cutlass.range_constexpr(split):
                        total = total + ws[i, m, nn]
                        if const_expr(self.situ):
                            up = up + ws[i, m, n + nn]
                        if const_expr(self.norm):
                            ss = ss + ws[i, m, n]
                    out[m, nn] = self.finish(total, up, ss, acc, m, nn)
        return last

    @cute.jit
    def partials(self):
        """Per lane: M x (weight rows) fp32 dot partials and M sums of x^2 (RMSNorm), zeroed."""
        part = cute.make_rmem_tensor(cute.make_layout((self.rows, self.wrows), stride=(self.wrows, 1)), Float32)
        part.fill(0.0)
        sq = cute.make_rmem_tensor(cute.make_layout(self.rows), Float32)
        sq.fill(0.0)
        return part, sq

    @cute.jit
    def read_ahead(self, w: cute.Tensor, n0: Int32, n: Int32, half, kv0: Int32, load_w: cute.CopyAtom):
        """The warp's weight vectors of its first ``preload`` warp steps, [steps, weight rows,
        VEC] in registers (rows as ``dot`` reads them; nothing read past the last output)."""
        ahead = cute.make_rmem_tensor(
            cute.make_layout((max(self.preload, 1), self.wrows, VEC), stride=(self.wrows * VEC, VEC, 1)),
            self.in_dtype)
        if const_expr(self.preload > 0):
            if n0 < n:
                wv = cute.logical_divide(w, (None, VEC))
                for t in cutlass.range_constexpr(self.preload):
                    for j in cutlass.range_constexpr(self.wrows):
                        cute.copy(load_w, wv[n0 + j % self.r + (j // self.r) * half, (None, kv0 + t * WARP)],
                                  ahead[t, j, None])
        return ahead

    @cute.jit
    def dot(self, x: cute.Tensor, w: cute.Tensor, gamma: cute.Tensor, n0: Int32, half, kv0: Int32, steps: Int32,
            load_w: cute.CopyAtom, load_x: cute.CopyAtom, part: cute.Tensor, sq: cute.Tensor,
            ahead: cute.Tensor | None = None):
        """The warp's dot products over ``steps`` warp steps from 16-byte vector ``kv0``,
        warp-reduced into ``part`` (and ``sq``): outputs n0 .. n0 + R - 1, whose weight rows
        are n0 + j and, with SiTU, the up rows half + n0 + j; the first ``preload`` steps'
        weights are ``ahead``'s (``read_ahead``; None without preload: ``MoEInGemv``)."""
        rows: cutlass.Constexpr = self.rows
        r: cutlass.Constexpr = self.r
        wrows: cutlass.Constexpr = self.wrows
        # (row, (vector, k vector)) views: one 16-byte load is the slice [row, (None, kv)]
        xv = cute.logical_divide(x, (None, VEC))
        wv = cute.logical_divide(w, (None, VEC))
        xr = cute.make_rmem_tensor(cute.make_layout((rows, VEC), stride=(VEC, 1)), self.in_dtype)
        wr = cute.make_rmem_tensor(cute.make_layout((wrows, VEC), stride=(VEC, 1)), self.in_dtype)
        gr = cute.make_rmem_tensor(cute.make_layout(VEC), self.in_dtype)
        gv = cute.logical_divide(gamma, (None, VEC))  # gamma [1, K]
        for t in cutlass.range_constexpr(self.preload):
            self.accumulate(xv, gv, kv0 + t * WARP, ahead[t, None, None], xr, gr, load_x, part, sq)
        for t in cutlass.range(self.preload, steps, 1, unroll=self.unroll):
            kv = kv0 + t * WARP
            for j in cutlass.range_constexpr(wrows):  # SiTU: gate rows n0.., then up rows half + n0..
                cute.copy(load_w, wv[n0 + j % r + (j // r) * half, (None, kv)], wr[j, None])
            self.accumulate(xv, gv, kv, wr, xr, gr, load_x, part, sq)
        cute.arch.griddepcontrol_launch_dependents()  # see ``pdl_wait`` (nothing in a launch without PDL)
        for m in cutlass.range_constexpr(rows):
            for j in cutlass.range_constexpr(wrows):
                part[m, j] = cute.arch.warp_reduction_sum(part[m, j])
            if const_expr(self.norm):
                sq[m] = cute.arch.warp_reduction_sum(sq[m])

    @cute.jit
    def accumulate(self, xv: cute.Tensor, gv: cute.Tensor, kv: Int32, wr: cute.Tensor, xr: cute.Tensor,
                   gr: cute.Tensor, load_x: cute.CopyAtom, part: cute.Tensor, sq: cute.Tensor):
        """One warp step: x's (and gamma's) vectors ``kv`` times the weight vectors ``wr``
        [weight rows, VEC] into the lane's ``part`` (and ``sq``)."""
        for m in cutlass.range_constexpr(self.rows):
            cute.copy(load_x, xv[m, (None, kv)], xr[m, None])
        xf = xr.load().to(Float32)
        wf = wr.load().to(Float32)
        if const_expr(self.norm):
            cute.copy(load_x, gv[0, (None, kv)], gr)
            gf = gr.load().to(Float32)
        for e in cutlass.range_constexpr(VEC):
            for m in cutlass.range_constexpr(self.rows):
                xe = xf[m, e]
                if const_expr(self.norm):
                    sq[m] = sq[m] + xe * xe
                    xe = xe * gf[e]
                for j in cutlass.range_constexpr(self.wrows):
                    part[m, j] = part[m, j] + xe * wf[j, e]

    @cute.jit
    def tile_of(self, x: cute.Tensor, w: cute.Tensor, gamma: cute.Tensor, acc: cute.Tensor, out: cute.Tensor,
                bx: Int32, load_w: cute.CopyAtom, load_x: cute.CopyAtom, ahead: cute.Tensor | None = None):
        """CTA ``bx``'s outputs over all of K (no split): out[:, bx TILE .. (bx + 1) TILE).
        With SiTU the up rows start ``self.half`` rows after the gate rows (0: after all n
        gate rows, the [gate; up] weight)."""
        n = cute.size(out, mode=[1])
        lane = cute.arch.lane_idx()
        n0 = bx * self.tile + cute.arch.warp_idx() * self.r
        part, sq = self.partials()
        if n0 < n:
            self.dot(x, w, gamma, n0, self.half if self.half else n, lane, cute.size(w, mode=[1]) // STEP, load_w,
                     load_x, part, sq, ahead)
            for m in cutlass.range_constexpr(self.rows):
                for j in cutlass.range_constexpr(self.r):
                    if lane == m * self.r + j:
                        up = part[m, self.r + j] if const_expr(self.situ) else part[m, j]
                        out[m, n0 + j] = self.finish(part[m, j], up, sq[m], acc, m, n0 + j)

    @cute.jit
    def finish(self, total: Float32, up: Float32, ss: Float32, acc: cute.Tensor, m: Int32, nn: Int32):
        """One output from its dot product(s): SiTU of (gate, up) at stock's rounding points,
        or the RMSNorm row scale, then the accumulator; rounded once to the output dtype."""
        if const_expr(self.situ):
            g = total.to(self.in_dtype).to(Float32)
            u = up.to(self.in_dtype).to(Float32)
            act = self.beta * cute.math.tanh(g / self.beta) / (Float32(1.0) + cute.math.exp(-g))
            total = (act * (self.linear_beta * cute.math.tanh(u / self.linear_beta))).to(self.in_dtype).to(Float32)
        if const_expr(self.norm):
            total = total * cute.math.rsqrt(ss * self.inv_k + self.eps)
        if const_expr(self.has_acc):
            total = total + acc[m, nn].to(Float32)
        return total.to(self.out_dtype)


class Routing(NamedTuple):
    """The router's expert choice fused into ``MoEInGemv`` (``select_experts``'s semantics:
    top ``k`` of sigmoid(logits) + bias, weights the unbiased scores [renormalised] x
    ``scale``); constants of the compiled kernel."""

    experts: int
    k: int
    renormalize: bool
    scale: float


MAX_ROUTED_K = WARP  # one lane per chosen expert
CANDIDATES = 64  # scores at or above the threshold ranked directly (about 21 for K3's router)


class MoEInGemv:
    """The MoE layer's three GEMVs over one x [M, K] in one launch (``kimi_kernels::moe_in``):
    router logits (fp32 out), latent down-projection, and a block of the shared experts'
    gate / up rows with the SiTU-GLU epilogue. CTAs [0, B_router) take the router's
    outputs, the next B_latent the latent's, the rest the shared block's, each the plain
    GEMV's whole-K tile (no split: the three together are hundreds of tiles). Router and
    shared CTAs take half the latent's outputs per warp where it has two or more (a
    shared output is two weight rows: so the latent's and the shared CTAs stream the same
    bytes). The shared block's weight is the row range [a, D + a + width) of [gate; up]
    (D = its gate rows), read in place: gate row a + j, up row D + a + j. ``cfg.split``
    splits the router's K (``SplitKGemv.split_tile``): a CTA's time is its K steps'
    latency, so its CTAs then finish before the others.

    With ``routing``: the router CTA that finishes last (an arrival counter, as the split-K
    GEMV's) also chooses each row's experts: warp m puts row m's E biased scores in
    shared memory (registers would cost the GEMV occupancy), takes the k-th largest of
    its 32 lanes' maxima as a threshold that at least k scores reach, and ranks the
    scores at or above it among themselves (ties: the lowest index, as
    ``select_experts``); past ``CANDIDATES`` of them, k warp arg-max passes. Lane j writes
    expert j and its weight. Launched with programmatic dependent launch when ``pdl``."""

    def __init__(self, rows: int, cfg: Config, n_router: int, n_latent: int, n_shared: int, half: int,
                 situ: tuple[float, float], routing: Routing | None = None, pdl: bool = False):
        def segment(r, out_dtype, fusion=PLAIN, half=0, split=1):
            return SplitKGemv(rows, r, cfg.warps, split, cfg.unroll, False, cutlass.BFloat16, out_dtype, fusion,
                              half=half)

        small = halved(cfg)
        self.segments = (segment(small, Float32, split=cfg.split), segment(cfg.r, cutlass.BFloat16),
                         segment(small, cutlass.BFloat16, Fusion(situ=situ), half))
        self.tiles = tuple(-(-n // s.tile) for n, s in zip((n_router, n_latent, n_shared), self.segments))
        self.blocks = (self.tiles[0] * cfg.split, *self.tiles[1:])
        self.threads = cfg.warps * WARP
        self.rows, self.routing, self.pdl = rows, routing, pdl

    @cute.jit
    def __call__(self, x: cute.Tensor, w_router: cute.Tensor, w_latent: cute.Tensor, w_shared: cute.Tensor,
                 logits: cute.Tensor, latent: cute.Tensor, shared: cute.Tensor, bias: cute.Tensor,
                 weights: cute.Tensor, ids: cute.Tensor, ws: cute.Tensor, counters: cute.Tensor, stream: CUstream):
        load_w, load_x = _loads(cutlass.BFloat16)
        self.kernel(x, w_router, w_latent, w_shared, logits, latent, shared, bias, weights, ids, ws, counters, load_w,
                    load_x).launch(grid=[sum(self.blocks), 1, 1], block=[self.threads, 1, 1], stream=stream,
                                   use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, x: cute.Tensor, w_router: cute.Tensor, w_latent: cute.Tensor, w_shared: cute.Tensor,
               logits: cute.Tensor, latent: cute.Tensor, shared: cute.Tensor, bias: cute.Tensor,
               weights: cute.Tensor, ids: cute.Tensor, ws: cute.Tensor, counters: cute.Tensor,
               load_w: cute.CopyAtom, load_x: cute.CopyAtom):
        """ws [split, M, E]: the router's K-chunk partials; counters [router tiles + 1]: the
        tiles' arrivals, then the finished tiles' (the choice)."""
        b0: cutlass.Constexpr = self.blocks[0]
        b1: cutlass.Constexpr = self.blocks[0] + self.blocks[1]
        tiles: cutlass.Constexpr = self.tiles[0]
        bx, _, _ = cute.arch.block_idx()
        pdl_wait(self.pdl)
        if bx < b0:  # x stands in for the unused norm weight and accumulator
            smem = cutlass.memory.SmemAllocator()
            flag = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)
            finished = True
            if const_expr(self.segments[0].split == 1):
                self.segments[0].tile_of(x, w_router, x, x, logits, bx, load_w, load_x)
            else:  # the chunks of a tile are CTAs bx, bx + tiles, ...
                finished = self.segments[0].split_tile(x, w_router, x, x, logits, ws, counters, bx % tiles, bx // tiles, flag,
                                             load_w, load_x)
            if const_expr(self.routing is not None):
                rows: cutlass.Constexpr = self.rows
                scores = smem.allocate_tensor(Float32, cute.make_layout((rows, self.routing.experts),
                                                                        stride=(self.routing.experts, 1)))
                cand = smem.allocate_tensor(Int32, cute.make_layout((rows, CANDIDATES), stride=(CANDIDATES, 1)))
                chosen = smem.allocate_tensor(Int32, cute.make_layout((rows, WARP), stride=(WARP, 1)))
                if finished:
                    if arrived_last(counters, tiles, tiles, flag):
                        self.route(logits, bias, weights, ids, scores, cand, chosen)
        else:
            if bx < b1:
                self.segments[1].tile_of(x, w_latent, x, x, latent, bx - b0, load_w, load_x)
            else:
                self.segments[2].tile_of(x, w_shared, x, x, shared, bx - b1, load_w, load_x)

    @cute.jit
    def route(self, logits: cute.Tensor, bias: cute.Tensor, weights: cute.Tensor, ids: cute.Tensor,
              scores: cute.Tensor, cand: cute.Tensor, chosen: cute.Tensor):
        """Warp m < M: row m's top k (see the class). Shared memory: ``scores`` [M, E] the
        biased scores, ``cand`` [M, CANDIDATES] and ``chosen`` [M, 32] expert ids."""
        E: cutlass.Constexpr = self.routing.experts
        k: cutlass.Constexpr = self.routing.k
        lane = cute.arch.lane_idx()
        m = cute.arch.warp_idx()
        if m < self.rows:
            top = Float32(-math.inf)  # the lane's largest score
            for e in cutlass.range(lane, E, WARP, unroll=4):
                v = _sigmoid(logits[m, e]) + bias[e].to(Float32)
                scores[m, e] = v
                if v > top:
                    top = v
            # t = the k-th largest of the 32 lanes' maxima: at least k scores reach it
            rank = Int32(0)
            for d in cutlass.range_constexpr(1, WARP):
                other = cute.arch.shuffle_sync(top, offset=(lane + d) % WARP)
                if other > top or (other == top and (lane + d) % WARP < lane):
                    rank = rank + 1
            t = cute.arch.warp_reduction_max(top if rank == k - 1 else Float32(-math.inf))
            count = Int32(0)
            for e in cutlass.range(lane, E, WARP, unroll=4):
                count = count + Int32(scores[m, e] >= t)
            end = count  # inclusive prefix sum over the lanes
            for d in cutlass.range_constexpr(5):
                below = cute.arch.shuffle_sync_up(end, offset=1 << d)
                if lane >= (1 << d):
                    end = end + below
            total = cute.arch.shuffle_sync(end, offset=WARP - 1)
            if total <= CANDIDATES:  # the candidates' ranks among themselves are the choice
                at = end - count
                for e in cutlass.range(lane, E, WARP, unroll=4):
                    if scores[m, e] >= t:
                        cand[m, at] = e
                        at = at + 1
                cute.arch.sync_warp()
                for j in cutlass.range(lane, total, WARP):
                    e = cand[m, j]
                    v = scores[m, e]
                    r = Int32(0)
                    for i in cutlass.range(total, unroll=4):
                        other_e = cand[m, i]
                        other = scores[m, other_e]
                        if other > v or (other == v and other_e < e):
                            r = r + 1
                    if r < k:
                        chosen[m, r] = e
            else:  # ties past the threshold: k warp arg-max passes
                for j in cutlass.range(k):
                    best, best_e = Float32(-math.inf), Int32(E)
                    for e in cutlass.range(lane, E, WARP, unroll=4):
                        if scores[m, e] > best:
                            best, best_e = scores[m, e], e
                    for d in cutlass.range_constexpr(5):
                        other = cute.arch.shuffle_sync_bfly(best, offset=1 << d)
                        other_e = cute.arch.shuffle_sync_bfly(best_e, offset=1 << d)
                        if other > best or (other == best and other_e < best_e):
                            best, best_e = other, other_e
                    if lane == 0:
                        chosen[m, j] = best_e
                        scores[m, best_e] = Float32(-math.inf)
                    cute.arch.sync_warp()
            cute.arch.sync_warp()
            w, e = Float32(0.0), Int32(0)
            if lane < k:
                e = chosen[m, lane]
                w = _sigmoid(logits[m, e])
            if const_expr(self.routing.renormalize):
                w = w / cute.arch.warp_reduction_sum(w)
            if lane < k:
                weights[m, lane] = w * self.routing.scale
                ids[m, lane] = e


@cute.jit
def pdl_wait(pdl: cutlass.Constexpr):
    """In a kernel launched with programmatic dependent launch (``pdl``): wait until the
    grids it depends on have finished and their writes are visible (nothing before it may
    read what they write or write anything; the GEMV reads only W before it, ``preload``).
    It does not release the next kernel here (``launch_dependents``): a GEMV is a grid of
    hundreds of CTAs, and a next kernel scheduled at their start holds SM slots they need
    (the KDA layer step 36.9 / 42.5 against 35.2 / 36.2 us at 1 / 2 rows released at
    exit, docs/performance.md). ``dot`` releases it after its K loop, once every CTA (the
    last wave included) has issued its weight loads, so the next kernel's CTAs take the
    SMs the first waves freed (with the KDA kernel's late release and the preload: the
    KDA layer 1.5-1.8 us faster at one row on an H100, session 11)."""
    if const_expr(pdl):
        cute.arch.griddepcontrol_wait()


@cute.jit
def arrived_last(counters: cute.Tensor, i: Int32, count: Int32, flag: cute.Tensor):
    """Whether this CTA is the last of ``count`` to arrive at ``counters[i]`` (then the
    others' writes before their arrival are visible to it); the last resets the counter
    for the next call. Uniform over the CTA; ``flag``: one Int32 of shared memory."""
    tidx, _, _ = cute.arch.thread_idx()
    cute.arch.fence_acq_rel_gpu()
    cute.arch.sync_threads()
    if tidx == 0:
        arrived = cute.arch.atomic_add((counters.iterator + i).llvm_ptr, Int32(1), sem="acq_rel", scope="gpu")
        flag[0] = Int32(arrived == count - 1)
        if arrived == count - 1:
            counters[i] = Int32(0)
    cute.arch.sync_threads()
    last = flag[0] != 0
    if last:
        cute.arch.fence_acq_rel_gpu()
    return last


@cute.jit
def _sigmoid(v: Float32) -> Float32:
    return Float32(1.0) / (Float32(1.0) + cute.math.exp(-v))


# rows -> the best ``MoEInGemv`` configuration (with the expert choice) of the H200 sweep at
# K3 shapes, G = 8 (benchmarks/moe_sharding.py --sweep, docs/results/moe_sharding_h200_v4_sweep.json)
TUNED_MOE_IN = {1: Config(2, 8, 2, 2), 2: Config(1, 8, 2, 4), 4: Config(1, 4, 2, 4)}


def moe_in_config(M: int) -> Config:
    """TUNED_MOE_IN where measured; else one output per warp, 4 warps, 4 steps unrolled."""
    return TUNED_MOE_IN.get(M, Config(1, 4, 1, 4))


def halved(cfg: Config) -> int:
    """Outputs per warp of ``MoEInGemv``'s router and shared segments."""
    return max(1, cfg.r // 2)


def moe_in_supported(M: int, K: int, n_router: int, n_latent: int, width: int, cfg: Config) -> str:
    """Why ``MoEInGemv`` cannot take these shapes ('' when it can); ``width``: the shared
    block's outputs."""
    small = halved(cfg)
    situ = Fusion(situ=(1.0, 1.0))
    for r, n, fusion, split in ((small, n_router, PLAIN, cfg.split), (cfg.r, n_latent, PLAIN, 1),
                                (small, 2 * width, situ, 1)):
        why = supported(M, n, K, Config(r, cfg.warps, split, cfg.unroll), fusion)
        if why:
            return why
    return ""


def routing_supported(M: int, cfg: Config, routing: Routing) -> str:
    """Why ``MoEInGemv`` cannot fuse this choice of experts ('' when it can)."""
    if routing.k > MAX_ROUTED_K or routing.k > routing.experts or M > cfg.warps:
        return (f"top {routing.k} of {routing.experts} for {M} rows (the fused choice takes k <= {MAX_ROUTED_K}, "
                f"one warp per row: {cfg.warps})")
    return ""


def compile_moe_in(M: int, K: int, n_router: int, n_latent: int, gate_up_rows: int, width: int,
                   situ: tuple[float, float], cfg: Config, routing: Routing | None = None, pdl: bool = False,
                   arch: str = ""):
    """The ``MoEInGemv`` executor for one shape (as ``compile_gemv``); ``gate_up_rows``:
    the full [gate; up] weight's rows (2 D), ``width``: the block's outputs."""
    half = gate_up_rows // 2
    kernel = MoEInGemv(M, cfg, n_router, n_latent, width, half, situ, routing, pdl)
    bf16, k = torch.bfloat16, routing.k if routing else 1
    args = (_fake(bf16, (M, K)), _fake(bf16, (n_router, K)), _fake(bf16, (n_latent, K)),
            _fake(bf16, (half + width, K)), _fake(torch.float32, (M, n_router)), _fake(bf16, (M, n_latent)),
            _fake(bf16, (M, width)), _fake(torch.float32, (n_router,)), _fake(torch.float32, (M, k)),
            _fake(torch.int32, (M, k)), _fake(torch.float32, (cfg.split, M, n_router)),
            _fake(torch.int32, (kernel.tiles[0] + 1,)), make_fake_stream(use_tvm_ffi_env_stream=True))
    options = "--enable-tvm-ffi" + (f" --gpu-arch {arch}" if arch else "")
    return cute.compile(kernel, *args, options=options)


def _loads(in_dtype):
    """The 16-byte global -> register loads: weights streaming (evict-first), x cached."""
    bits = VEC * in_dtype.width
    load_w = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), in_dtype, num_bits_per_copy=bits,
                                 load_cache_mode=cute.nvgpu.LoadCacheMode.STREAMING)
    load_x = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), in_dtype, num_bits_per_copy=bits,
                                 load_cache_mode=cute.nvgpu.LoadCacheMode.ALWAYS)
    return load_w, load_x


def _fake(dtype, shape):
    return make_fake_compact_tensor(DTYPES[dtype], shape, stride_order=tuple(reversed(range(len(shape)))),
                                    assumed_align=16)


def compile_gemv(M: int, N: int, K: int, has_acc: bool, out_dtype: torch.dtype, cfg: Config, arch: str = "",
                 fusion: Fusion = PLAIN, pdl: bool = False, x_stride: int | None = None, preload: int = 0):
    """The executor for one shape (compiled against fake tensors: no GPU or data needed;
    called with torch tensors, it launches on torch's current stream, CUDA graphs included);
    ``arch`` (e.g. ``sm_90a``) compiles for that target instead of the current GPU.
    N: the weight's rows; ``pdl``: launched with programmatic dependent launch;
    ``x_stride``: x's row stride (``row_stride``), K when omitted; ``preload``: warp steps
    of W each warp reads before its PDL wait (with ``pdl``; at most its chunk's steps)."""
    kernel = SplitKGemv(M, cfg.r, cfg.warps, cfg.split, cfg.unroll, has_acc, cutlass.BFloat16, DTYPES[out_dtype],
                        fusion, K, pdl=pdl, preload=preload)
    n_out = N // 2 if fusion.situ else N
    x = make_fake_tensor(cutlass.BFloat16, (M, K), (x_stride or K, 1), assumed_align=16)
    args = (x, _fake(torch.bfloat16, (N, K)), _fake(torch.bfloat16, (1, K)),
            _fake(out_dtype, (M, n_out)), _fake(out_dtype, (M, n_out)),
            _fake(torch.float32, (cfg.split, M, N + (fusion.eps is not None))),
            _fake(torch.int32, (tiles(n_out, cfg),)),
            make_fake_stream(use_tvm_ffi_env_stream=True))  # launches on torch's current stream
    options = "--enable-tvm-ffi" + (f" --gpu-arch {arch}" if arch else "")
    return cute.compile(kernel, *args, options=options)


PRELOAD = 6  # warp steps of W read before the PDL wait: all of o_proj's K at one row


def preload_steps() -> int:
    """Warp steps of W a GEMV launched with PDL reads before its wait, overlapping the
    kernel before it: PRELOAD, or ``KIMI_INDUCTOR_GEMV_PRELOAD`` (0: none, to measure
    what it gives)."""
    return int(os.environ.get("KIMI_INDUCTOR_GEMV_PRELOAD", PRELOAD))


def row_stride(x: torch.Tensor) -> int | None:
    """x's row stride where the GEMV can read x in place (K-contiguous rows, 16-byte
    aligned: a column slice of a wider activation, e.g. MLA's q_a part of the fused
    q_a / kv_a / gate output), else None (``run`` copies it). One row: K."""
    M, K = x.shape
    if x.stride(1) != 1 or x.data_ptr() % 16:
        return None
    if M == 1 or x.stride(0) == K:
        return K
    return x.stride(0) if x.stride(0) % VEC == 0 else None


def tiles(N: int, cfg: Config) -> int:
    return -(-N // (cfg.warps * cfg.r))


_executors: dict[tuple, tuple[object, torch.Tensor]] = {}  # key -> (executor, its tiles' arrival counters)


def run(x: torch.Tensor, weight: torch.Tensor, acc: torch.Tensor | None, out_dtype: torch.dtype,
        cfg: Config | None = None, fusion: Fusion = PLAIN, norm_weight: torch.Tensor | None = None) -> torch.Tensor:
    M, K = x.shape
    N = weight.shape[0]
    n_out = N // 2 if fusion.situ else N
    cfg = cfg or fused_config(M, N, K, fusion)
    on = bool(pdl(x.device)["PDL"])
    stride = row_stride(x)
    if stride is None:  # a fresh compact copy (``contiguous`` keeps a misaligned one-row view)
        x, stride = torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x), K
    ahead = preload_steps() if on else 0
    key = (M, N, K, acc is not None, out_dtype, cfg, fusion, on, stride, ahead, x.device.index)
    if key not in _executors:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"kimi_kernels.skinny_mm: no CuTe executor for {key} during CUDA-graph capture; "
                               "warm up the step before capturing it")
        counters = torch.zeros(tiles(n_out, cfg), dtype=torch.int32, device=x.device)  # reset by each last CTA
        _executors[key] = compile_gemv(M, N, K, acc is not None, out_dtype, cfg, fusion=fusion, pdl=on,
                                       x_stride=stride, preload=ahead), counters
    exe, counters = _executors[key]
    out = torch.empty(M, n_out, dtype=out_dtype, device=x.device)
    ws = torch.empty(cfg.split, M, N + (fusion.eps is not None), dtype=torch.float32, device=x.device)
    gamma = (norm_weight if norm_weight is not None else weight[0]).view(1, K)  # read only with RMSNorm
    exe(x, weight, gamma, acc if acc is not None else out, out, ws, counters)
    return out


def run_moe_in(x: torch.Tensor, router_weight: torch.Tensor, latent_weight: torch.Tensor,
               gate_up_weight: torch.Tensor, shard: int, shards: int, situ: tuple[float, float],
               bias: torch.Tensor | None = None, routing: Routing | None = None, pdl: bool = False,
               cfg: Config | None = None) -> tuple[torch.Tensor, ...]:
    """``kimi_kernels::moe_in`` on the GPU: (logits fp32, latent, h, weights fp32, ids int32)
    from one launch; weights / ids [M, k] with ``routing`` (bias: [E] fp32), else [M, 0]."""
    M, K = x.shape
    D = gate_up_weight.shape[0] // 2
    width = D // shards
    cfg = cfg or moe_in_config(M)
    E, L = router_weight.shape[0], latent_weight.shape[0]
    key = ("moe_in", M, K, E, L, 2 * D, width, situ, cfg, routing, pdl, x.device.index)
    if key not in _executors:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"kimi_kernels.moe_in: no CuTe executor for {key} during CUDA-graph capture; "
                               "warm up the step before capturing it")
        # the router tiles' arrival counters and the choice's, each reset by its last CTA
        counters = torch.zeros(tiles(E, cfg._replace(r=halved(cfg))) + 1, dtype=torch.int32, device=x.device)
        _executors[key] = compile_moe_in(M, K, E, L, 2 * D, width, situ, cfg, routing, pdl), counters
    exe, counters = _executors[key]
    k = routing.k if routing else 0
    logits = torch.empty(M, E, dtype=torch.float32, device=x.device)
    latent = torch.empty(M, L, dtype=x.dtype, device=x.device)
    h = torch.empty(M, width, dtype=x.dtype, device=x.device)
    weights = torch.empty(M, max(k, 1), dtype=torch.float32, device=x.device)  # one unwritten column at k = 0
    ids = torch.empty(M, max(k, 1), dtype=torch.int32, device=x.device)
    ws = torch.empty(cfg.split, M, E, dtype=torch.float32, device=x.device)
    exe(x, router_weight, latent_weight, gate_up_weight[shard * width:D + (shard + 1) * width], logits, latent, h,
        logits[0] if bias is None else bias, weights, ids, ws, counters)
    return logits, latent, h, weights[:, :k], ids[:, :k]
