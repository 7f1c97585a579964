"""MXFP4 expert projections for SM90 in CuTe DSL: ``expert_ffn``'s up (gate_up + SiTU) and
down (times the routing weight) kernels when the experts are MXFP4 in the kernel's layout
(``mma_layout``), replacing the Triton WGMMA kernels there.

Why a second kernel: the Triton one upcasts each K step's [rows, BK] tile into the WGMMA's
register operand and stores x, the other operand, to shared memory with barriers every
step, so per program the loads, the upcast and the MMA run in series (docs/kernels.md).
Here nothing goes through shared memory and nothing waits on another warp:

* a warp owns 16 weight rows of one expert (a block; two at two tiles,
  ``blocks_per_warp``), the A operand of ``mma.sync.m16n8k16`` (bf16, fp32 accumulate),
  over all of K; the up projection's 16 rows are 8 gate rows and their 8 up rows, so
  each lane holds both halves of its outputs for SiTU;
* per lane and 64-element K chunk the codes are 16 bytes, one load, which are exactly the
  lane's A fragments of the chunk's four MMAs (``mma_layout``); the warp loads the next
  256 elements' codes and scales while it multiplies these (across passes too: the last
  block prefetches the next pass's first), and the down kernel loads its first block
  before it waits on the up kernel (PDL: the up kernel lets it launch once its own wait
  is done, so its weights stream during the up kernel's last wave);
* the B operand is 8 pairs' rows of x (one n8 tile; NT tiles per pass over the weight),
  one 16-byte load per lane and two MMAs from global memory (L1 / L2: the warps of a CTA
  share them). An expert with at most 8 pairs takes a one-tile loop whatever NT is (both
  loops are compiled; the branch is per expert, uniform in the CTA), so NT sized for the
  busy experts costs the cold ones no MMAs on repeated pairs.

Upcast: register i of a lane's MMA fragment (two values) takes its codes' magnitude bits
(e1 e0 m) to bf16 bits 8-6 and sign to bit 15 by rotating the word and masking it (``PARTS``:
an AND for register 0, a rotation and an AND for 1 and 2, two of each for 3; 13 integer
and packed-multiply instructions a word): as a bf16 that is the E2M1 value times 2^-126 exactly (e = 0
lands on the subnormal 0.5 m 2^-126). One packed multiply by the group's E8M0 scale
times 2^126, 2^(s - 1) as a bf16 (a byte permute and a multiply-add per row and group),
makes it the dequantised weight, exactly (a power of two times at most two significant
bits): the MMAs accumulate straight into the fp32 result, which is the dequantised
expert's up to fp32 summation order. 2^(s - 1) is a finite bf16 for s <= 128 (scales up
to 2^1; released checkpoints' are far below): ``mma_layout`` refuses larger ones, and
those experts stay in the checkpoint layout (the Triton kernel).

Layout (``mma_layout``; the checkpoint's bytes reordered, uint8 and 5-D, read as int32
words): codes [E, N / 16, K / 64, 32, 16], scales [E, N / 16, K / 256, 32, 4]. Block b's
fragment row r is weight row 16 b + r, or for gate_up rows 8 b + r (r < 8) and
I + 8 b + r - 8. For lane t (g = t // 4, q = t % 4), word j of chunk c holds MMA j's
values: register i (0..3), half h is row g + 8 (i & 1), K element
64 c + 32 (j >> 1) + 8 q + 4 (j & 1) + 2 (i >> 1) + h (a permutation of K within each
32-element scale group, which x follows), its nibble at ``SLOT_BITS``. Scale word
of lane t and 256-block: bytes (group 2 q, row g), (2 q, g + 8), (2 q + 1, g),
(2 q + 1, g + 8) of the block's 8 groups; chunk c's lanes take lane (g, c % 4)'s word by
a shuffle.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import cutlass
    import cutlass.cute as cute
    from cuda.bindings.driver import CUstream
    from cutlass import BFloat16, Float32, Int32, const_expr
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor
except ImportError:  # the `cute` extra is not installed
    cutlass = None

WARP = 32
CHUNK = 64  # K elements per lane's 16 bytes of codes
BLOCK_K = 256  # K elements per scale word (and per prefetch)
MASK = 0x81C081C0  # bf16x2 magnitude bits 8-6 and signs
# register i = OR over its parts (r, m) of (word rotated left by r) AND m; the parts' masks
# split MASK. The words' bits: 3 rotations of MASK's pattern and a fourth register from two
# (the fewest instructions a word: no 4 rotations of the pattern tile the word)
PARTS = (((0, MASK),), ((4, MASK),), ((10, MASK),), ((6, 0x80C080C0), (30, 0x01000100)))
MAX_SCALE = 128  # E8M0 bytes whose 2^(s - 1) is a finite bf16


def supported(N: int, K: int, scales: Tensor | None = None) -> str:
    """Why the kernel cannot take an [N, K] weight with E8M0 ``scales`` ('' when it can)."""
    if N % 16 or K % BLOCK_K:
        return f"[{N}, {K}]: the SM90 MXFP4 kernel needs N % 16 == 0 and K % {BLOCK_K} == 0"
    top = int(scales.max()) if scales is not None and scales.numel() else 0
    if top > MAX_SCALE:
        return (f"E8M0 scale byte {top} (2^{top - 127}): the SM90 MXFP4 kernel folds the scale into a bf16 "
                f"multiply, 2^(s - 1), and takes bytes up to {MAX_SCALE} (2^1)")
    return ""


def runs_on(device) -> bool:
    """Whether this kernel serves ``expert_ffn`` on ``device`` (an SM90+ GPU with CuTe DSL)."""
    from .expert_ffn import implementation

    device = torch.device(device or "cpu")
    return device.type == "cuda" and implementation(device, True, True)[0] == "cute"


def experts_supported(w13: Tensor, w13_scale: Tensor, w2: Tensor, w2_scale: Tensor) -> str:
    """Why the kernel cannot take these checkpoint-layout MXFP4 experts ('' when it can)."""
    return (supported(w13.shape[1], 2 * w13.shape[2], w13_scale)
            or supported(w2.shape[1], 2 * w2.shape[2], w2_scale))


def _block_rows(N: int, gate_up: bool) -> Tensor:
    """[N / 16, 16]: the weight row of each block's fragment row."""
    r = torch.arange(16)
    if gate_up:
        b = torch.arange(N // 16)[:, None]
        return torch.where(r < 8, 8 * b + r, N // 2 + 8 * b + r - 8)
    return torch.arange(N).view(-1, 16)


def _source_bit(i: int, target: int) -> int:
    """The word bit that register i's ``PARTS`` move to bf16x2 bit ``target``."""
    (r, _), = [(r, m) for r, m in PARTS[i] if m >> target & 1]
    return (target - r) % 32


# per word slot (il, ih, h), in that nesting: where the nibble of register i = il + 2 ih,
# half h has its bits (m, e0, e1, sign): the sources of bf16 bits 6, 7, 8, 15 (+ 16 h)
SLOT_BITS = [[_source_bit(il + 2 * ih, t + 16 * h) for t in (6, 7, 8, 15)]
             for il in range(2) for ih in range(2) for h in range(2)]


def _nibble_bits() -> Tensor:
    """[8, 16] int64: nibble v placed at each word slot's bits (``SLOT_BITS``)."""
    v = torch.arange(16)
    return torch.stack([sum(((v >> b) & 1) << pos[b] for b in range(4)) for pos in SLOT_BITS])


def mma_layout(codes: Tensor, scales: Tensor, gate_up: bool) -> tuple[Tensor, Tensor]:
    """Checkpoint MXFP4 (codes [E, N, K / 2] uint8, low nibble = even column; scales [E, N,
    K / 32] uint8) -> the kernel's, the same bytes reordered (codes [E, N / 16, K / 64, 32,
    16] uint8, scales [E, N / 16, K / 256, 32, 4] uint8: still uint8, 5-D), expert by
    expert; ``gate_up``: N = 2 I rows, gate then up."""
    E, N, half_k = codes.shape
    K = 2 * half_k
    if why := supported(N, K, scales):
        raise ValueError(f"mma_layout: {why}; keep these experts in the checkpoint's layout")
    rows = _block_rows(N, gate_up).to(codes.device)
    lut = _nibble_bits().to(codes.device)
    out_c = torch.empty(E, N // 16, K // CHUNK, WARP, 4, dtype=torch.int32, device=codes.device)
    out_s = torch.empty(E, N // 16, K // BLOCK_K, WARP, 1, dtype=torch.int32, device=codes.device)
    for e in range(E):
        nib = torch.stack([codes[e] & 15, codes[e] >> 4], -1).view(N, K)[rows]  # uint8 [NB, 16, K]
        # K element 64 c + 32 jh + 8 q + 4 jl + 2 ih + h is MMA j = 2 jh + jl's (q, ih, h); row
        # 8 il + g: [NB, il, g, c, jh, q, jl, ih, h] -> [NB, c, g, q, j, slot = (il, ih, h)]
        nib = nib.view(N // 16, 2, 8, K // CHUNK, 2, 4, 2, 2, 2).permute(0, 3, 2, 5, 4, 6, 1, 7, 8).reshape(
            N // 16, K // CHUNK, 8, 4, 4, 8)
        word = sum(lut[slot][nib[..., slot].long()] for slot in range(8))  # int64 [NB, c, g, q, j]
        out_c[e] = word.reshape(N // 16, K // CHUNK, WARP, 4).to(torch.int32)
        s = scales[e].long()[rows].view(N // 16, 2, 8, K // BLOCK_K, 4, 2)  # [NB, r8, g, blk, q, group parity]
        sw = (s << (8 * (2 * torch.arange(2, device=codes.device).view(1, 1, 1, 1, 1, 2)
                         + torch.arange(2, device=codes.device).view(1, 2, 1, 1, 1, 1)))).sum((1, 5))
        out_s[e] = sw.permute(0, 2, 1, 3).reshape(N // 16, K // BLOCK_K, WARP, 1).to(torch.int32)
    return out_c.view(torch.uint8), out_s.view(torch.uint8)


def checkpoint_layout(codes: Tensor, scales: Tensor, gate_up: bool) -> tuple[Tensor, Tensor]:
    """The inverse of ``mma_layout``: back to checkpoint codes [E, N, K / 2] and scales
    [E, N, K / 32] (uint8), expert by expert."""
    E, NB, KC = codes.shape[:3]
    N, K = 16 * NB, CHUNK * KC
    rows = _block_rows(N, gate_up).to(codes.device).reshape(-1)
    out_c = torch.empty(E, N, K // 2, dtype=torch.uint8, device=codes.device)
    out_s = torch.empty(E, N, K // 32, dtype=torch.uint8, device=codes.device)
    for e in range(E):
        w = codes[e].view(torch.int32).view(NB, KC, 8, 4, 4)  # [NB, c, g, q, j]
        nib = torch.stack([sum(((w >> p[b]) & 1) << b for b in range(4)) for p in SLOT_BITS], -1).to(torch.uint8)
        # [NB, c, g, q, jh, jl, il, ih, h] -> [NB, il, g, c, jh, q, jl, ih, h]: row 8 il + g of block, K element
        # 64 c + 32 jh + 8 q + 4 jl + 2 ih + h
        flat = torch.empty(N, K, dtype=torch.uint8, device=codes.device)
        flat[rows] = nib.view(NB, KC, 8, 4, 2, 2, 2, 2, 2).permute(0, 6, 2, 1, 4, 3, 5, 7, 8).reshape(N, K)
        out_c[e] = flat[:, 0::2] | (flat[:, 1::2] << 4)
        sw = scales[e].view(torch.int32).view(NB, -1, 8, 4)  # [NB, blk, g, q]: bytes (parity, r8) at 2 parity + r8
        groups = torch.stack([torch.stack([(sw >> (8 * (2 * par + r))) & 0xFF for par in range(2)], -1)
                              for r in range(2)], 1)  # [NB, r8, blk, g, q, parity]
        out_s[e, rows] = groups.permute(0, 1, 3, 2, 4, 5).reshape(N, K // 32).to(torch.uint8)
    return out_c, out_s


if cutlass is not None:

    @dsl_user_op
    def _asm_i32(asm: str, *args, loc=None, ip=None) -> Int32:
        return Int32(llvm.inline_asm(T.i32(), [Int32(a).ir_value(loc=loc, ip=ip) for a in args], asm,
                                     "=r" + ",r" * len(args), loc=loc, ip=ip))

    @dsl_user_op
    def _as_f32(bits: Int32, *, loc=None, ip=None) -> Float32:
        return Float32(llvm.inline_asm(T.f32(), [Int32(bits).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=f,r",
                                       loc=loc, ip=ip))

    @dsl_user_op
    def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, *, loc=None, ip=None):
        """``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``: (d0, d1, d2, d3)."""
        ops = [Int32(v).ir_value(loc=loc, ip=ip) for v in (a0, a1, a2, a3, b0, b1)]
        ops += [Float32(v).ir_value(loc=loc, ip=ip) for v in (c0, c1, c2, c3)]
        res = llvm.inline_asm(
            llvm.StructType.get_literal([T.f32()] * 4), ops,
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
            "{$8, $9}, {$10, $11, $12, $13};", "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", loc=loc, ip=ip)
        return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4))

    @cute.jit
    def _upcast(w: Int32, i: cutlass.Constexpr, f: Int32) -> Int32:
        """Register i's two E2M1 values of code word ``w`` as bf16x2 (times 2^-126, ``PARTS``),
        then times the bf16x2 ``f`` (one packed multiply; -0 addend keeps the sign of zero)."""
        asm = "{ .reg .b32 t, v, z; mov.b32 v, 0; "
        for r, m in PARTS[i]:
            asm += f"shf.l.wrap.b32 t, $1, $1, {r}; and.b32 t, t, {m:#010x}; or.b32 v, v, t; "
        return _asm_i32(asm + "mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, v, $2, z; }", w, f)

    @cute.jit
    def _scale_bf16x2(word: Int32, byte: cutlass.Constexpr) -> Int32:
        """2^126 2^(s - 127) = 2^(s - 1) as bf16x2 for the E8M0 byte ``byte`` of ``word``
        (s <= 128; bf16 bits (s + 126) << 7): the byte in both halves, times 128, plus 0x3F00."""
        sel = 0x4040 | byte | (byte << 8)
        return _asm_i32("{ .reg .b32 t; prmt.b32 t, $1, 0, " + str(sel) + "; mad.lo.u32 $0, t, 128, 0x3F003F00; }",
                        word)

    @cute.jit
    def _tanh(x: Float32) -> Float32:
        """fp32 tanh as ``common._tanh``: an odd polynomial below |x| = 0.6, else
        (1 - e) / (1 + e) with e = exp(-2 |x|)."""
        a = cute.arch.fmax(x, -x)
        s = a * a
        p = Float32(-0.005895158741623163) * s + Float32(0.020795971155166626)
        p = p * s - Float32(0.053783830255270004)
        p = p * s + Float32(0.13331924378871918)
        p = p * s - Float32(0.33333298563957214)
        t = a + a * s * p
        if a >= Float32(0.6):
            e = cute.math.exp(Float32(-2.0) * a)
            t = (Float32(1.0) - e) / (Float32(1.0) + e)
        if x < Float32(0.0):
            t = -t
        return t

    class Mxfp4Experts:
        """One compiled projection: ``gate_up`` (h = SiTU(x W13^T), bf16 [P, I]) or down
        (y = bf16(h W2^T) times the pair's routing weight, fp32 [P, L]); ``tiles``: n8
        tiles of pairs per pass over the weight; ``warps`` per CTA, ``rb`` 16-row blocks
        per warp; ``min_blocks``: CTAs an SM the registers must allow (the launch bound;
        0: the compiler's choice, as measured; e.g. 4 takes the two-tile loop from 161
        registers to 128 with no spills, session 25)."""

        def __init__(self, gate_up: bool, top_k: int, tiles: int, warps: int, beta: float, linear_beta: float,
                     pdl: bool, rb: int = 1, min_blocks: int = 0):
            self.gate_up, self.top_k, self.tiles, self.warps, self.pdl, self.rb = gate_up, top_k, tiles, warps, pdl, rb
            self.beta, self.linear_beta, self.min_blocks = beta, linear_beta, min_blocks

        @cute.jit
        def __call__(self, x: cute.Tensor, codes: cute.Tensor, scales: cute.Tensor, slots: cute.Tensor,
                     order: cute.Tensor, starts: cute.Tensor, counts: cute.Tensor, weights: cute.Tensor,
                     out: cute.Tensor, stream: CUstream):
            load_w = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Int32, num_bits_per_copy=128,
                                         load_cache_mode=cute.nvgpu.LoadCacheMode.STREAMING)
            load_x = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Int32, num_bits_per_copy=128,
                                         load_cache_mode=cute.nvgpu.LoadCacheMode.ALWAYS)
            blocks = cute.size(codes, mode=[1])
            bound = {"min_blocks_per_mp": self.min_blocks} if self.min_blocks else {}
            self.kernel(x, codes, scales, slots, order, starts, counts, weights, out, load_w, load_x).launch(
                grid=[cute.size(slots), cute.ceil_div(blocks, self.warps * self.rb), 1], block=[self.warps * WARP, 1, 1],
                stream=stream, use_pdl=self.pdl, **bound)

        @cute.kernel
        def kernel(self, x: cute.Tensor, codes: cute.Tensor, scales: cute.Tensor, slots: cute.Tensor,
                   order: cute.Tensor, starts: cute.Tensor, counts: cute.Tensor, weights: cute.Tensor,
                   out: cute.Tensor, load_w: cute.CopyAtom, load_x: cute.CopyAtom):
            """x [rows, K / 2] int32 (bf16 pairs): the latent (gate_up, row = pair // top_k)
            or h (down, row = the pair's position); slots [S]: the expert of each grid row
            (E: none); out: h [P, I] bf16 or y [P, L] fp32."""
            RB: cutlass.Constexpr = self.rb
            early: cutlass.Constexpr = self.pdl and not self.gate_up  # down: its first codes before the wait
            slot, by, _ = cute.arch.block_idx()
            lane = cute.arch.lane_idx()
            b = (by * self.warps + cute.arch.warp_idx()) * RB  # the warp's first 16-row block
            if const_expr(self.pdl and self.gate_up):
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()  # the down kernel may load its weights
            E = cute.size(counts)
            e = slots[slot]
            count = Int32(0)
            if e < E and b < cute.size(codes, mode=[1]):
                count = counts[e]
            start = starts[e % E]
            xv = cute.logical_divide(x, (None, 4))  # [row, (4 words, K / 8)]
            cur = cute.make_rmem_tensor(cute.make_layout(16 * RB), Int32)  # per block: 4 chunks x 4 words
            nxt = cute.make_rmem_tensor(cute.make_layout(16 * RB), Int32)
            sw = cute.make_rmem_tensor(cute.make_layout(RB), Int32)
            sw_next = cute.make_rmem_tensor(cute.make_layout(RB), Int32)
            ce, se = _expert(codes, e % E), _expert(scales, e % E)
            sw.fill(0)
            if count > 0:  # the first block's codes (before the wait: the weights do not depend on x)
                for r in cutlass.range_constexpr(RB):
                    for c in cutlass.range_constexpr(4):
                        cute.copy(load_w, ce[b + r, c, lane, None], _words(cur, 4 * r + c))
                    sw[r] = se[b + r, 0, lane]
            if const_expr(early):
                cute.arch.griddepcontrol_wait()
            args = (xv, ce, se, cur, nxt, sw, sw_next, order, weights, out, start, count, b, lane, load_w, load_x)
            if const_expr(self.tiles == 1):
                self.passes(1, *args)
            else:  # an expert with at most 8 pairs takes the one-tile loop: no MMAs on repeated pairs
                if count <= 8:
                    self.passes(1, *args)
                else:
                    self.passes(self.tiles, *args)

        @cute.jit
        def passes(self, NT: cutlass.Constexpr, xv: cute.Tensor, ce: cute.Tensor, se: cute.Tensor, cur: cute.Tensor,
                   nxt: cute.Tensor, sw: cute.Tensor, sw_next: cute.Tensor, order: cute.Tensor,
                   weights: cute.Tensor, out: cute.Tensor, start: Int32, count: Int32, b: Int32, lane: Int32,
                   load_w: cute.CopyAtom, load_x: cute.CopyAtom):
            """The warp's passes over its blocks' weights, NT n8 tiles of pairs (8 NT) a pass;
            ``cur`` / ``sw`` hold the first block's codes and scales on entry."""
            RB: cutlass.Constexpr = self.rb
            g = lane // 4
            q = lane % 4
            blocks_k = cute.size(se, mode=[1])
            xr = cute.make_rmem_tensor(cute.make_layout((NT, 2, 4), stride=(8, 4, 1)), Int32)
            acc = cute.make_rmem_tensor(cute.make_layout((RB, NT, 4), stride=(4 * NT, 4, 1)), Float32)
            rows = cute.make_rmem_tensor(cute.make_layout(NT), Int32)
            for m0 in cutlass.range(0, count, 8 * NT, unroll=1):
                for nt in cutlass.range_constexpr(NT):  # lane's B column: pair m0 + 8 nt + g
                    p = start + cutlass.min(m0 + 8 * nt + g, count - 1)
                    if const_expr(self.gate_up):
                        rows[nt] = order[p] // self.top_k
                    else:
                        rows[nt] = p
                acc.fill(0.0)
                for blk in cutlass.range(blocks_k, unroll=1):
                    sw_next.store(sw.load())
                    if blk + 1 < blocks_k or m0 + 8 * NT < count:  # the next block, or the next pass's first
                        ahead = blk + 1
                        if ahead == blocks_k:
                            ahead = Int32(0)
                        for r in cutlass.range_constexpr(RB):
                            for c in cutlass.range_constexpr(4):
                                cute.copy(load_w, ce[b + r, 4 * ahead + c, lane, None], _words(nxt, 4 * r + c))
                            sw_next[r] = se[b + r, ahead, lane]
                    for c in cutlass.range_constexpr(4):
                        kq = (blk * BLOCK_K + c * CHUNK) // 8 + q  # x's 16 bytes of MMAs 0 and 1
                        for nt in cutlass.range_constexpr(NT):
                            for jh in cutlass.range_constexpr(2):
                                cute.copy(load_x, xv[rows[nt], (None, kq + 4 * jh)], xr[nt, jh, None])
                        for r in cutlass.range_constexpr(RB):  # x's fragments serve every block of the warp
                            sc = cute.arch.shuffle_sync(sw[r], offset=g * 4 + c)
                            for half in cutlass.range_constexpr(2):  # the chunk's two scale groups: rows g, g + 8
                                f_lo, f_hi = _scale_bf16x2(sc, 2 * half), _scale_bf16x2(sc, 2 * half + 1)
                                for jj in cutlass.range_constexpr(2):
                                    w = cur[16 * r + 4 * c + 2 * half + jj]
                                    a0, a1 = _upcast(w, 0, f_lo), _upcast(w, 1, f_hi)
                                    a2, a3 = _upcast(w, 2, f_lo), _upcast(w, 3, f_hi)
                                    for nt in cutlass.range_constexpr(NT):
                                        d = _mma(a0, a1, a2, a3, xr[nt, half, 2 * jj], xr[nt, half, 2 * jj + 1],
                                                 acc[r, nt, 0], acc[r, nt, 1], acc[r, nt, 2], acc[r, nt, 3])
                                        for v in cutlass.range_constexpr(4):
                                            acc[r, nt, v] = d[v]
                    cur.store(nxt.load())
                    sw.store(sw_next.load())
                for r in cutlass.range_constexpr(RB):
                    self.epilogue(NT, acc, r, out, weights, order, start, count, m0, b + r, g, q)

        @cute.jit
        def epilogue(self, NT: cutlass.Constexpr, acc: cute.Tensor, r: cutlass.Constexpr, out: cute.Tensor,
                     weights: cute.Tensor, order: cute.Tensor, start: Int32, count: Int32, m0: Int32, b: Int32,
                     g: Int32, q: Int32):
            """Lane (g, q) holds, per n8 tile, rows g (acc 0, 1) and g + 8 (acc 2, 3) for
            pairs m0 + 8 nt + 2 q + (0, 1)."""
            for nt in cutlass.range_constexpr(NT):
                for h in cutlass.range_constexpr(2):
                    m = m0 + 8 * nt + 2 * q + h
                    if m < count:
                        if const_expr(self.gate_up):  # rows g / g + 8: gate / up of output 8 b + g
                            gate = acc[r, nt, h].to(BFloat16).to(Float32)
                            up = acc[r, nt, 2 + h].to(BFloat16).to(Float32)
                            act = (Float32(self.beta) * _tanh(gate / Float32(self.beta))
                                   * (Float32(1.0) / (Float32(1.0) + cute.math.exp(-gate)))
                                   * (Float32(self.linear_beta) * _tanh(up / Float32(self.linear_beta))))
                            out[start + m, 8 * b + g] = act.to(BFloat16)
                        else:
                            w = weights[order[start + m]]
                            out[start + m, 16 * b + g] = acc[r, nt, h].to(BFloat16).to(Float32) * w
                            out[start + m, 16 * b + 8 + g] = acc[r, nt, 2 + h].to(BFloat16).to(Float32) * w

    @cute.jit
    def _expert(t: cute.Tensor, e: Int32) -> cute.Tensor:
        """Expert e's slice of an [E, ...] weight tensor, offset in 64 bits (all experts'
        codes exceed 2^31 int32 words at 896 experts)."""
        return cute.make_tensor((t.iterator + cutlass.Int64(e) * t.layout.stride[0]).align(16),
                                cute.select(t.layout, mode=list(range(1, cute.rank(t)))))

    @cute.jit
    def _words(buf: cute.Tensor, c: cutlass.Constexpr) -> cute.Tensor:
        """Words 4 c .. 4 c + 3 of a register buffer (block r's chunk c is 4 r + c)."""
        return cute.make_tensor(buf.iterator + 4 * c, cute.make_layout(4))


def _fake(dtype, shape):
    stride, acc = [], 1
    for d in reversed(shape):
        stride.insert(0, acc)
        acc *= d
    return make_fake_tensor(dtype, shape, tuple(stride), assumed_align=16)


def compile_projection(gate_up: bool, E: int, N: int, K: int, rows: int, pairs: int, top_k: int, tiles: int,
                       warps: int, beta: float, linear_beta: float, pdl: bool, x_stride: int | None = None,
                       arch: str = "", rb: int = 1, min_blocks: int = 0):
    """The executor of one projection (compiled against fake tensors, no GPU needed; launched
    on torch's current stream): N weight rows (2 I for gate_up), K; x [rows, K] bf16 with
    row stride ``x_stride`` (K when None); ``arch`` (e.g. ``sm_90a``) compiles for that target."""
    kernel = Mxfp4Experts(gate_up, top_k, tiles, warps, beta, linear_beta, pdl, rb, min_blocks)
    out = (_fake(BFloat16, (pairs, N // 2)) if gate_up else _fake(Float32, (pairs, N)))
    x = make_fake_tensor(Int32, (rows, K // 2), ((x_stride or K) // 2, 1), assumed_align=16)
    args = (x, _fake(Int32, (E, N // 16, K // CHUNK, WARP, 4)), _fake(Int32, (E, N // 16, K // BLOCK_K, WARP)),
            _fake(Int32, (min(E, pairs),)), _fake(Int32, (pairs,)), _fake(Int32, (E,)), _fake(Int32, (E,)),
            _fake(Float32, (pairs,)), out, make_fake_stream(use_tvm_ffi_env_stream=True))
    options = "--enable-tvm-ffi" + (f" --gpu-arch {arch}" if arch else "")
    return cute.compile(kernel, *args, options=options)


def tiles_for(pairs: int, slots: int, top_k: int) -> int:
    """n8 tiles of pairs per pass over an expert's weight (the most: an expert with at most
    8 pairs takes the one-tile loop whatever this is). One up to 8 rows (a row sends at most
    one pair to an expert: one pass) or a mean of 3 pairs per busy expert (rounded up), two
    up to 12, else four. Measured with the one-tile loop for cold experts on an H100
    (docs/results/session15_h100/mxfp4_sweep_{rule,e112_r16}.json, us): EP 8 shapes (112
    experts), one tile against two 622.5 / 632.9 at 16 rows (mean 2.3), two against one
    685.5 / 709.6 at 32 (mean 4.6: the few experts past 8 pairs no longer take two passes)
    and 739.2 / 1052.0 at 64 (mean 9.1); EP 1 (896), one tile 1.3 % faster at 32 and 64
    rows (means 1 and 1.1: no expert to gain, two blocks per warp to pay)."""
    mean = -(-pairs // max(1, slots))
    if pairs // top_k <= 8 or mean <= 3:
        return 1
    return 2 if mean <= 12 else 4


def blocks_per_warp(tiles: int, blocks: int) -> int:
    """16-row blocks per warp: two at two tiles (the warp's x fragments then serve two
    blocks' MMAs: half the x loads per weight byte), else one. Measured on the H200
    (docs/results/moe_experts_mxfp4_mma_h200_rb.json): at two tiles 1.05-1.08x faster
    (EP 8 64 rows: 633.5 against 671.3 us); at one tile within 0.5 % from 8 rows but at
    EP 1 64 rows (1.04x faster), 1.04-1.06x slower at one row; at four 1.00-1.03x slower.
    Two need an even ``blocks`` (N / 16)."""
    return 2 if tiles == 2 and blocks % 2 == 0 else 1


_executors: dict[tuple, object] = {}


def projection(gate_up: bool, x: Tensor, codes: Tensor, pairs: int, top_k: int, tiles: int, warps: int,
               beta: float, linear_beta: float, pdl: bool, rb: int = 1, min_blocks: int = 0):
    """The compiled kernel for these shapes (compiled on first use, outside CUDA-graph
    capture); x: the activations' int32 view [rows, K / 2]."""
    E, NB, KC = codes.shape[:3]
    key = (gate_up, E, NB, KC, x.shape[0], x.stride(0), pairs, top_k, tiles, warps, beta, linear_beta, pdl,
           x.device.index, rb, min_blocks)
    if key not in _executors:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"kimi_kernels.expert_ffn: no SM90 MXFP4 executor for {key} during CUDA-graph "
                               "capture; warm up the step before capturing it")
        _executors[key] = compile_projection(gate_up, E, 16 * NB, CHUNK * KC, x.shape[0], pairs, top_k, tiles,
                                             warps, beta, linear_beta, pdl, x_stride=2 * x.stride(0), rb=rb,
                                             min_blocks=min_blocks)
    return _executors[key]
