"""MXFP4 expert projections on SM90 warpgroup MMAs (``wgmma.mma_async``, register A): the
``expert_mxfp4`` kernels' math with the activations read from shared memory.

Why: from 32 pairs per pass the ``mma.sync`` kernel is bound by what each warp loads per
weight byte, x's fragments (16 bytes per lane, n8 tile and 64-element chunk), re-read by
every warp from L1 / L2 (docs/performance.md, 2026-12-04 session 6). Here a CTA stages a
pass's 8 ``tiles`` pair rows of x (all of K) in shared memory once, and every warpgroup's
MMAs read them from there through a matrix descriptor, for every weight row the CTA owns.

* Weights: the same bytes, layout (``expert_mxfp4.mma_layout``), upcast and scales. A
  warpgroup owns 64 weight rows (four of the layout's 16-row blocks, warp w the block
  4 grp + w): ``wgmma.mma_async.m64nNk16`` takes each warp's A fragment in exactly
  ``mma.sync.m16n8k16``'s register layout, so a lane's code word is its four A registers
  of one k16 MMA, as there. N = 8 ``tiles`` pairs.
* x in shared memory, no swizzle, K-major, in the layout's K permutation: the B operand
  of MMA (chunk c, j) is k16 unit u = 4 c + j; its core matrices (8 pairs x 8 k, 128
  bytes) are ``[u][kk][nn]`` (kk: logical k 0-7 / 8-15; nn: pairs 8 nn ..), the word of
  pair 8 nn + r, logical k 8 kk + 2 q + (0, 1) at byte 128 ((2 u + kk) NT + nn) + 16 r +
  4 q. That word holds x's K elements 64 c + 32 (j >> 1) + 8 q + 4 (j & 1) + 2 kk + (0,
  1), the weights' permutation; so each 16-byte load of x (words 4 v .. 4 v + 3, v = 8 c
  + 4 jh + q) scatters to the four core matrices (j = 2 jh + jl, kk), word 2 jl + kk.
  Descriptor: start (its byte address) >> 4, LBO (the K step, kk) = 128 NT bytes, SBO
  (the N step, nn) = 128 bytes, no swizzle.
* A CTA: ``groups`` warpgroups, one expert (grid x: the slot), the 64-row groups cy +
  ``ctas`` (wg + groups i) (grid y: cy). Per pass it stages x (8 NT x K bf16: 57 / 115 KB
  at K = 3584, one / two tiles), then each warpgroup runs its groups' K loops: per 64-
  element chunk the four MMAs' A registers upcast, ``wgmma.fence``, four MMAs on one
  accumulator, commit, wait for all but this chunk's group (so the upcast of the next
  chunk overlaps these MMAs); the codes of the next step (``span`` 256-element blocks;
  across groups and passes) load while this one multiplies, the first before the PDL
  wait (down). Two blocks per step double the bytes in flight per warp (ptxas: 155
  registers against 86 at two tiles, so at most three warpgroups).
* Accumulators: warp w, n8 tile t: d[4 t + (0, 1)] rows g, d[4 t + (2, 3)] rows g + 8,
  pairs 8 t + 2 q + (0, 1): ``mma.sync``'s per tile, so ``Mxfp4Experts.epilogue`` writes
  them. Every output is the same fp32 sum of bf16 products in the same k16 order as the
  ``mma.sync`` kernel; within one k16 step the tensor core's own order.

Needs N % 64 == 0 (``supported``): K3's gate_up (6144) and down (3584) rows are.
"""

from __future__ import annotations

from torch import Tensor

from . import expert_mxfp4 as MX
from .common import SMS

try:
    import cutlass
    import cutlass.cute as cute
    from cuda.bindings.driver import CUstream
    from cutlass import Float32, Int32, const_expr
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op
except ImportError:  # the `cute` extra is not installed
    cutlass = None

ROWS = 64  # weight rows per warpgroup MMA (m64)
CORE = 128  # bytes of one 8 x 16-byte core matrix
REGS = {1: 96, 2: 160}  # registers per thread by blocks per step (ptxas: 86 / 155 at two tiles)


def b_word(u, kk, nn, r, qq, tiles: int):
    """Shared-memory word (int32) of x in the B layout: k16 unit u, logical k half kk,
    pairs 8 nn .., pair row r, word qq of the core matrix row (Python or DSL integers)."""
    return ((2 * u + kk) * tiles + nn) * (CORE // 4) + 4 * r + qq


def lbo(tiles: int) -> int:
    """Descriptor leading byte offset: from logical k 0-7 to 8-15 of a unit (K step)."""
    return 4 * (b_word(0, 1, 0, 0, 0, tiles) - b_word(0, 0, 0, 0, 0, tiles))


def sbo(tiles: int) -> int:
    """Descriptor stride byte offset: from pairs 8 nn .. to 8 (nn + 1) .. (N step)."""
    return 4 * (b_word(0, 0, 1, 0, 0, tiles) - b_word(0, 0, 0, 0, 0, tiles))


def supported(N: int) -> str:
    """Why the WGMMA kernel cannot take N weight rows ('' when it can)."""
    return "" if N % ROWS == 0 else f"{N} weight rows: the WGMMA MXFP4 kernel needs N % {ROWS} == 0"


def smem_bytes(tiles: int, K: int) -> int:
    """Shared memory of one CTA: a pass's 8 ``tiles`` rows of x, all of K, bf16."""
    return 16 * tiles * K


def ctas_for(slots: int, groups_total: int, groups: int, tiles: int, K: int, sms: int, span: int = 1) -> int:
    """CTAs per expert: the split with the fewest group steps, (waves of the ``slots``
    experts' CTAs) x (64-row groups per warpgroup), among those that leave each
    warpgroup at least four groups, so that a CTA's staging of x (115 KB at two tiles)
    stays under a quarter of the codes it reads (122 KB per group at K = 3584)."""
    per_sm = max(1, min((227 * 1024) // (smem_bytes(tiles, K) + 1024),  # shared memory
                        65536 // (128 * groups * REGS[span])))  # registers
    best, best_cost = 1, None
    for c in range(1, max(1, groups_total // (4 * groups)) + 1):
        cost = -(-slots * c // (sms * per_sm)) * -(-groups_total // (c * groups))
        if best_cost is None or cost < best_cost:
            best, best_cost = c, cost
    return best


if cutlass is not None:

    @dsl_user_op
    def _wgmma(acc: list, a: tuple, desc_lo: Int32, desc_hi: Int32, *, loc=None, ip=None) -> list:
        """``wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16`` (A: registers, B: the
        descriptor {desc_lo, desc_hi}; N = 2 len(acc)), accumulating: the new accumulators."""
        n = len(acc)
        d = ", ".join(f"${i}" for i in range(n))
        asm = ("{ .reg .pred p; .reg .b64 desc; setp.ne.b32 p, 1, 0; mov.b64 desc, {$%d, $%d}; "
               "wgmma.mma_async.sync.aligned.m64n%dk16.f32.bf16.bf16 {%s}, {$%d, $%d, $%d, $%d}, desc, p, 1, 1, 0; }"
               % (n + 4, n + 5, 2 * n, d, n, n + 1, n + 2, n + 3))
        cons = ",".join(["=f"] * n + ["r"] * 6 + [str(i) for i in range(n)])
        ops = [Int32(v).ir_value(loc=loc, ip=ip) for v in (*a, desc_lo, desc_hi)]
        ops += [Float32(v).ir_value(loc=loc, ip=ip) for v in acc]
        res = llvm.inline_asm(llvm.StructType.get_literal([T.f32()] * n), ops, asm, cons, has_side_effects=True,
                              loc=loc, ip=ip)
        return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(n)]

    class WgmmaExperts(MX.Mxfp4Experts):
        """One compiled projection as ``Mxfp4Experts`` (same arguments and outputs) on
        warpgroup MMAs: ``groups`` warpgroups per CTA, ``ctas`` CTAs per expert, K the
        projection's reduction length."""

        def __init__(self, gate_up: bool, top_k: int, tiles: int, groups: int, ctas: int, K: int, beta: float,
                     linear_beta: float, pdl: bool, span: int = 1):
            super().__init__(gate_up, top_k, tiles, 4 * groups, beta, linear_beta, pdl)
            self.groups, self.ctas, self.K, self.span = groups, ctas, K, span

        @cute.jit
        def __call__(self, x: cute.Tensor, codes: cute.Tensor, scales: cute.Tensor, slots: cute.Tensor,
                     order: cute.Tensor, starts: cute.Tensor, counts: cute.Tensor, weights: cute.Tensor,
                     out: cute.Tensor, stream: CUstream):
            load_w, load_x = MX._loads()
            self.kernel(x, codes, scales, slots, order, starts, counts, weights, out, load_w, load_x).launch(
                grid=[cute.size(slots), self.ctas, 1], block=[self.groups * 128, 1, 1],
                smem=smem_bytes(self.tiles, self.K), stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, x: cute.Tensor, codes: cute.Tensor, scales: cute.Tensor, slots: cute.Tensor,
                   order: cute.Tensor, starts: cute.Tensor, counts: cute.Tensor, weights: cute.Tensor,
                   out: cute.Tensor, load_w: cute.CopyAtom, load_x: cute.CopyAtom):
            """As ``Mxfp4Experts.kernel``; grid (slot, CTA of the expert)."""
            NT: cutlass.Constexpr = self.tiles
            S: cutlass.Constexpr = self.span
            early: cutlass.Constexpr = self.pdl and not self.gate_up
            slot, cy, _ = cute.arch.block_idx()
            warp = cute.arch.warp_idx()
            lane = cute.arch.lane_idx()
            wg = warp // 4
            g = lane // 4
            q = lane % 4
            smem = cutlass.utils.SmemAllocator()
            xs = smem.allocate_tensor(Int32, cute.make_layout(smem_bytes(NT, self.K) // 4), byte_alignment=128)
            # descriptor words: start address >> 4 | LBO >> 4 << 16; SBO >> 4 (high word); no swizzle
            desc_lo0 = (xs.iterator.toint() >> 4) | ((lbo(NT) // 16) << 16)
            desc_hi = Int32(sbo(NT) // 16)
            unit = 4 * b_word(1, 0, 0, 0, 0, NT) // 16  # one k16 unit's B, in 16-byte steps
            if const_expr(self.pdl and self.gate_up):
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()
            E = cute.size(counts)
            e = slots[slot]
            count = Int32(0)
            if e < E:
                count = counts[e]
            start = starts[e % E]
            n_groups = cute.size(codes, mode=[1]) // 4
            steps = cute.size(scales, mode=[2]) // S
            first = cy + self.ctas * wg  # this warpgroup's groups: first, first + step, ..
            step = self.ctas * self.groups
            mine = first < n_groups and count > 0
            xv = cute.logical_divide(x, (None, 4))  # [row, (4 words, K / 8)]
            cur = cute.make_rmem_tensor(cute.make_layout(16 * S), Int32)  # S blocks x 4 chunks x 4 words
            nxt = cute.make_rmem_tensor(cute.make_layout(16 * S), Int32)
            sw = cute.make_rmem_tensor(cute.make_layout(S), Int32)
            sw_next = cute.make_rmem_tensor(cute.make_layout(S), Int32)
            xr = cute.make_rmem_tensor(cute.make_layout(4), Int32)
            acc = cute.make_rmem_tensor(cute.make_layout((1, NT, 4), stride=(4 * NT, 4, 1)), Float32)
            ce, se = MX._expert(codes, e % E), MX._expert(scales, e % E)
            sw.fill(0)
            if mine:  # the first step's codes (before the wait: the weights do not depend on x)
                for c in cutlass.range_constexpr(4 * S):
                    cute.copy(load_w, ce[4 * first + warp % 4, c, lane, None], MX._words(cur, c))
                for i in cutlass.range_constexpr(S):
                    sw[i] = se[4 * first + warp % 4, i, lane]
            if const_expr(early):
                cute.arch.griddepcontrol_wait()
            for m0 in cutlass.range(0, count, 8 * NT, unroll=1):
                cute.arch.sync_threads()  # the last pass's MMAs have read x
                self.stage(x, xv, xs, order, start, count, m0, warp, lane, load_x, xr)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.sync_threads()
                for grp in cutlass.range(first, n_groups, step, unroll=1):
                    b = 4 * grp + warp % 4
                    acc.fill(0.0)
                    for st in cutlass.range(steps, unroll=1):
                        sw_next.store(sw.load())
                        ahead, ahead_grp = st + 1, grp  # the next step: of this group, the next, or the next pass's first
                        if ahead == steps:
                            ahead, ahead_grp = Int32(0), grp + step
                            if ahead_grp >= n_groups:
                                ahead_grp = first
                                if m0 + 8 * NT >= count:
                                    ahead_grp = n_groups
                        if ahead_grp < n_groups:
                            for c in cutlass.range_constexpr(4 * S):
                                cute.copy(load_w, ce[4 * ahead_grp + warp % 4, 4 * S * ahead + c, lane, None],
                                          MX._words(nxt, c))
                            for i in cutlass.range_constexpr(S):
                                sw_next[i] = se[4 * ahead_grp + warp % 4, S * ahead + i, lane]
                        for c in cutlass.range_constexpr(4 * S):  # chunk c % 4 of the step's block c // 4
                            sc = cute.arch.shuffle_sync(sw[c // 4], offset=g * 4 + c % 4)
                            a = []
                            for half in cutlass.range_constexpr(2):
                                f_lo, f_hi = MX._scale_bf16x2(sc, 2 * half), MX._scale_bf16x2(sc, 2 * half + 1)
                                for jj in cutlass.range_constexpr(2):
                                    w = cur[4 * c + 2 * half + jj]
                                    a.append((MX._upcast(w, 0, f_lo), MX._upcast(w, 1, f_hi),
                                              MX._upcast(w, 2, f_lo), MX._upcast(w, 3, f_hi)))
                            cute.nvgpu.warpgroup.fence()
                            for j in cutlass.range_constexpr(4):
                                d = _wgmma([acc[0, t, v] for t in range(NT) for v in range(4)], a[j],
                                           desc_lo0 + ((st * 4 * S + c) * 4 + j) * unit, desc_hi)
                                for t in cutlass.range_constexpr(NT):
                                    for v in cutlass.range_constexpr(4):
                                        acc[0, t, v] = d[4 * t + v]
                            cute.nvgpu.warpgroup.commit_group()
                            cute.nvgpu.warpgroup.wait_group(1)
                        cur.store(nxt.load())
                        sw.store(sw_next.load())
                    cute.nvgpu.warpgroup.wait_group(0)
                    self.epilogue(acc, 0, out, weights, order, start, count, m0, b, g, q)

        @cute.jit
        def stage(self, x: cute.Tensor, xv: cute.Tensor, xs: cute.Tensor, order: cute.Tensor, start: Int32,
                  count: Int32, m0: Int32, warp: Int32, lane: Int32, load_x: cute.CopyAtom, xr: cute.Tensor):
            """x's rows of pairs m0 .. m0 + 8 NT - 1 (the last pair's past ``count``) into
            ``xs`` in the B layout: warp task (nn, vq) = 8 pairs x 4 of x's 16-byte words
            (v = 4 vq + lane % 4), lane (r, qq) = (lane // 4, lane % 4); its four words go
            to core matrices (u = 2 vq + jl, kk), conflict-free per word."""
            NT: cutlass.Constexpr = self.tiles
            r = lane // 4
            qq = lane % 4
            for t in cutlass.range(warp, NT * (self.K // 32), 4 * self.groups, unroll=1):
                nn = t % NT
                vq = t // NT
                p = start + cutlass.min(m0 + 8 * nn + r, count - 1)
                row = p
                if const_expr(self.gate_up):
                    row = order[p] // self.top_k
                cute.copy(load_x, xv[row, (None, 4 * vq + qq)], xr)
                for w in cutlass.range_constexpr(4):  # word 2 jl + kk -> (u = 2 vq + jl, kk)
                    u = 2 * vq + w // 2
                    xs[b_word(u, w % 2, nn, r, qq, NT)] = xr[w]


def compile_projection(gate_up: bool, E: int, N: int, K: int, rows: int, pairs: int, top_k: int, tiles: int,
                       groups: int, ctas: int, beta: float, linear_beta: float, pdl: bool,
                       x_stride: int | None = None, arch: str = "", span: int = 1):
    """The executor of one projection, as ``expert_mxfp4.compile_projection``."""
    if why := supported(N):
        raise ValueError(why)
    if (K // MX.BLOCK_K) % span:
        raise ValueError(f"K = {K}: {span} blocks of {MX.BLOCK_K} per step need K % {span * MX.BLOCK_K} == 0")
    kernel = WgmmaExperts(gate_up, top_k, tiles, groups, ctas, K, beta, linear_beta, pdl, span)
    return MX.compile_kernel(kernel, gate_up, E, N, K, rows, pairs, x_stride, arch)


def projection(gate_up: bool, x: Tensor, codes: Tensor, pairs: int, top_k: int, tiles: int, shape: tuple,
               beta: float, linear_beta: float, pdl: bool, slots: int):
    """The compiled kernel for these shapes, as ``expert_mxfp4.projection``; ``shape`` =
    (warpgroups, CTAs per expert (0: ``ctas_for`` the ``slots`` grid rows)[, 256-element
    blocks per step (codes loaded a step ahead), 1 by default])."""
    E, NB, KC = codes.shape[:3]
    K = MX.CHUNK * KC
    groups, ctas, span = (*shape, 1)[:3]
    ctas = ctas or ctas_for(slots, NB // 4, groups, tiles, K, SMS, span)
    key = ("wgmma", gate_up, E, NB, KC, x.shape[0], x.stride(0), pairs, top_k, tiles, groups, ctas, span, beta,
           linear_beta, pdl, x.device.index)
    return MX.executor(key, lambda: compile_projection(gate_up, E, 16 * NB, K, x.shape[0], pairs, top_k, tiles,
                                                       groups, ctas, beta, linear_beta, pdl,
                                                       x_stride=2 * x.stride(0), span=span))
