"""``kimi_kernels::kda_decode``: one KDA decode step of a layer in one Triton kernel.

Semantics: ``kimi::kda_decode`` (stock/kda.py) with the decay-gate projection folded
in: ``g1 = f_a @ f_b_weight^T`` (bf16 GEMM), i.e. f_b_proj, short conv, gates, beta,
the delta rule over the q tokens of each request and the gated RMSNorm, updating the
conv and recurrent states in place. States are addressed by slot stride: each slot's
conv window [2 + q, 3 P] (channels contiguous) and recurrent state [H, V, K]
(contiguous) may sit in a larger per-slot page, as vLLM binds a KDA layer's two states
as dtype views of one int8 page. The conv weight is stock's [3P, 1, W] or any strided
[3, P, W] (vLLM's native-decode copy [3, W, P] transposed); the norm weight bf16 or fp32.

Layout: one program per (request, head, V block) with its rows of the head's fp32 state
S [V, K] in registers (D = 128, one V block: 128 values per thread at 4 warps). The program loads the head's
3 x 128 conv channels of history, computes g1 = f_a f_b^T for the request's q tokens in
one dot (rounded to bf16 as stock's GEMM output), then per token: conv (4 taps) -> SiLU
-> bf16, L2-normalised q/k, gate, beta, decay / correction / rank-1 update / readout, the
state written to that token's slot, bf16 output -> RMSNorm * w * sigmoid(g2). Padding
requests (first slot <= 0) store zeros and touch no state. mixed_qkv, f_a, g2 and beta are
read through their row strides: the op takes any layout (``flexible_layout``), so Inductor
hands it the in-projection's column slices as views, not copies (with its row padding,
the output's stride is not the slices' FX stride).

Chunks (``v_split``'s BC < D / NV: at q = 1 where the programs outnumber the SMs but
fit three an SM): a program streams its V block in chunks of BC rows, each chunk's S
rows and v window loaded one chunk ahead, q/k/gate/beta of a one-token step computed
once for every chunk, the pre-norm o rows to the fp32 workspace and normalised after
the last chunk (a 32-row chunk: 168 registers a thread, three programs an SM; the whole
block: 255 and two).

V split (``v_split``: NV = 4 blocks when few requests leave SMs idle): every program
of a head recomputes q, k, the gate and g1 (cheap) and owns BV = D / NV rows of S and the
matching v channels. The gated RMSNorm spans all of V and the q/k conv channels are read
by every program, so each program writes its pre-norm o rows to an fp32 workspace and
bumps the head's arrival counter (acq_rel); the last to arrive writes the q/k conv
state and normalises every token, then resets the counter (one kernel; the arrival
order does not change any value).

PDL: the kernel releases its dependents (o_proj's GEMV, which reads its weights before
its own wait) only after its state and weight loads, not at its start: that overlaps
o_proj's weight stream with the latency-bound recurrence without competing with its
loads (the KDA layer 1.5-1.8 us faster at one row, docs/performance.md, session 11).

Byte floor of one call (R requests, H_l heads, D = 128, fp32 state): R H_l (2 x 64 KB
state read/write) + f_b (H_l D^2 bf16) + R q (3 + 1 + 1) H_l D bf16 activations.
At TP8 (H_l = 12): 1.6 MB per request -> 0.37 us per request at 4.28 TB/s.

Implementations: Triton on CUDA (and under ``TRITON_INTERPRET=1`` on CPU, for
tests); the stock reference elsewhere (CPU, or shapes the kernel does not cover).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

import kimi_inductor.stock.kda  # noqa: F401  (registers kimi::kda_decode)
from kimi_inductor.stock.library import REFERENCES
from kimi_inductor.stock.state import check_q

from .common import INTERPRET, arrival_counters, bf16_round, pdl, pdl_release, pdl_wait, SMS, tl, triton

NAMESPACE = "kimi_kernels"


def supported(conv_width: int, head_dim: int) -> str:
    """Why the Triton kernel cannot take these shapes ('' when it can)."""
    if triton is None:
        return "Triton is not installed"
    if conv_width != 4:
        return f"conv width {conv_width} (the kernel unrolls 4 taps)"
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 128:
        return f"head_dim {head_dim} (the kernel needs a power of two in 16..128)"
    return ""


if triton is not None:

    @triton.jit
    def _kda_decode_kernel(
        qkv_ptr, stride_qkv, fa_ptr, stride_fa, fbw_ptr, g2_ptr, stride_g2, beta_ptr, stride_beta,
        convw_ptr, stride_cw_j, stride_cw_p, stride_cw_t, alog_ptr, dtb_ptr, normw_ptr,
        conv_ptr, stride_conv_s, stride_conv_r, rec_ptr, stride_rec_s, slots_ptr, acc_ptr, out_ptr, stride_out, ws_ptr,
        cnt_ptr,
        lower_bound, eps,
        H: tl.constexpr, D: tl.constexpr, Q: tl.constexpr, ROUND: tl.constexpr, DOT_F32: tl.constexpr,
        NV: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_wait(PDL, RELEASE=False)  # released below, after the loads
        r = tl.program_id(0)
        h = tl.program_id(1)
        BV: tl.constexpr = D // NV
        NC: tl.constexpr = BV // BC  # chunks of BC rows of S, streamed one ahead
        d = tl.arange(0, D)
        vb = tl.program_id(2) * BV + tl.arange(0, BC)  # this program's first chunk of S rows (and v channels)
        P = H * D
        slot0 = tl.load(slots_ptr + r * Q)
        live = slot0 > 0
        slot0 = tl.maximum(slot0, 0).to(tl.int64)
        # the states start at slot [r, accepted - 1]; with one token that is slot0 (stock's
        # index is out of range for any other), read with no dependent load before the state
        if Q == 1:
            start = 0
            start_slot = slot0
        else:
            start = tl.maximum(tl.load(acc_ptr + r) - 1, 0)
            start_slot = tl.maximum(tl.load(slots_ptr + r * Q + start), 0).to(tl.int64)

        # conv history (3 saved raw inputs) and the 4 taps of the head's q and k channels
        cq, ck = h * D + d, P + h * D + d
        hist = conv_ptr + slot0 * stride_conv_s + start * stride_conv_r
        q0 = tl.load(hist + cq).to(tl.float32)
        q1 = tl.load(hist + stride_conv_r + cq).to(tl.float32)
        q2 = tl.load(hist + 2 * stride_conv_r + cq).to(tl.float32)
        k0 = tl.load(hist + ck).to(tl.float32)
        k1 = tl.load(hist + stride_conv_r + ck).to(tl.float32)
        k2 = tl.load(hist + 2 * stride_conv_r + ck).to(tl.float32)
        xq = tl.load(qkv_ptr + r * Q * stride_qkv + cq).to(tl.float32)  # the first token's q and k inputs
        xk = tl.load(qkv_ptr + r * Q * stride_qkv + ck).to(tl.float32)
        # conv weight [3 (q, k, v), P, 4 taps] by its strides: stock's [3P, 1, 4] or vLLM's
        # native-decode copy [3, 4, P] transposed
        wq = convw_ptr + (h * D + d) * stride_cw_p
        wk = wq + stride_cw_j
        wt = stride_cw_t
        wq0, wq1, wq2, wq3 = tl.load(wq), tl.load(wq + wt), tl.load(wq + 2 * wt), tl.load(wq + 3 * wt)
        wk0, wk1, wk2, wk3 = tl.load(wk), tl.load(wk + wt), tl.load(wk + 2 * wt), tl.load(wk + 3 * wt)
        # g1 = f_a f_b^T for all q tokens at once (one dot, rows padded to 16), so that the
        # f_b rows need not stay in registers next to the state during the token loop
        tl.static_assert(Q <= 16, "kda_decode: the gate rows hold at most 16 tokens (the op allows q <= 8)")
        tq = tl.arange(0, 16)
        fa_all = tl.load(fa_ptr + (r * Q + tq)[:, None] * stride_fa + d[None, :], mask=(tq < Q)[:, None], other=0.0)
        fbw_t = tl.load(fbw_ptr + (h * D + d)[None, :] * D + d[:, None])  # [D in, D out]
        if DOT_F32:
            g1_all = tl.dot(fa_all.to(tl.float32), fbw_t.to(tl.float32), input_precision="ieee")
        else:
            g1_all = tl.dot(fa_all, fbw_t)
        g1_all = bf16_round(g1_all, ROUND)  # [16, D]: stock rounds the f_b GEMM's output to bf16
        a_h = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
        dtb = tl.load(dtb_ptr + h * D + d).to(tl.float32)
        norm_w = tl.load(normw_ptr + d).to(tl.float32)
        head = h * D * D
        S = tl.load(rec_ptr + start_slot * stride_rec_s + head + vb[:, None] * D + d[None, :])  # [BC, K]
        cv = 2 * P + h * D + vb  # the first chunk's v channels and their window
        v0 = tl.load(hist + cv).to(tl.float32)
        v1 = tl.load(hist + stride_conv_r + cv).to(tl.float32)
        v2 = tl.load(hist + 2 * stride_conv_r + cv).to(tl.float32)
        # Every thread must have read the saved conv window and state before any thread
        # overwrites them (a token's state may land in the slot it started from, and
        # the new conv rows overlap the window; elements can be replicated across threads).
        tl.debug_barrier()
        pdl_release(PDL)  # o_proj's GEMV may stream its weights now: this kernel's first loads are out

        # the new conv state: the window's last two saved inputs, then the q tokens' own;
        # with a V split the q/k channels (read by every program of the head) are written
        # by the last one to finish
        conv_out = conv_ptr + slot0 * stride_conv_s
        if NV == 1:
            _store_qk_window(conv_out, stride_conv_r, cq, ck, q1, q2, k1, k2, xq, xk, qkv_ptr, stride_qkv, r, Q, live)
        if Q == 1:  # the one token's q, k, gate and beta serve every chunk
            qn, kn, gate, beta = _qk_gate(xq, xk, q0, q1, q2, k0, k1, k2, wq0, wq1, wq2, wq3, wk0, wk1, wk2, wk3, g1_all,
                                          tq, 0, a_h, dtb, lower_bound, beta_ptr + r * stride_beta + h, D, ROUND)

        for c in tl.range(0, NC, loop_unroll_factor=1):
            v = vb + c * BC
            cv = 2 * P + h * D + v
            if NC > 1:
                # every thread has read this chunk's rows and window (loaded one chunk
                # ahead; elements can be replicated across threads) before any overwrites them
                tl.debug_barrier()
                nxt = c + 1 < NC
                S_next = tl.load(rec_ptr + start_slot * stride_rec_s + head + (v + BC)[:, None] * D + d[None, :],
                                 mask=nxt)
                n0 = tl.load(hist + cv + BC, mask=nxt).to(tl.float32)
                n1 = tl.load(hist + stride_conv_r + cv + BC, mask=nxt).to(tl.float32)
                n2 = tl.load(hist + 2 * stride_conv_r + cv + BC, mask=nxt).to(tl.float32)
            wv = convw_ptr + 2 * stride_cw_j + (h * D + v) * stride_cw_p
            wv0, wv1, wv2, wv3 = tl.load(wv), tl.load(wv + wt), tl.load(wv + 2 * wt), tl.load(wv + 3 * wt)
            tl.store(conv_out + cv, v1.to(conv_ptr.dtype.element_ty), mask=live)
            tl.store(conv_out + stride_conv_r + cv, v2.to(conv_ptr.dtype.element_ty), mask=live)
            a0, a1, a2, b0, b1, b2 = q0, q1, q2, k0, k1, k2  # the q/k windows, rolled per token
            for t in tl.range(0, Q, loop_unroll_factor=1):  # rolled: 1.5x faster than unrolled at q = 4
                row = r * Q + t
                xv = tl.load(qkv_ptr + row * stride_qkv + cv).to(tl.float32)
                yv = v0 * wv0 + v1 * wv1 + v2 * wv2 + xv * wv3
                yv = bf16_round(yv * tl.sigmoid(yv), ROUND)
                v0, v1, v2 = v1, v2, xv
                tl.store(conv_out + (2 + t) * stride_conv_r + cv, xv.to(conv_ptr.dtype.element_ty), mask=live)
                if Q > 1:
                    iq = tl.load(qkv_ptr + row * stride_qkv + cq).to(tl.float32)
                    ik = tl.load(qkv_ptr + row * stride_qkv + ck).to(tl.float32)
                    qn, kn, gate, beta = _qk_gate(iq, ik, a0, a1, a2, b0, b1, b2, wq0, wq1, wq2, wq3, wk0, wk1, wk2, wk3,
                                                  g1_all, tq, t, a_h, dtb, lower_bound, beta_ptr + row * stride_beta + h,
                                                  D, ROUND)
                    a0, a1, a2 = a1, a2, iq
                    b0, b1, b2 = b1, b2, ik

                S = S * tl.exp(gate)[None, :]
                u = beta * (yv - tl.sum(S * kn[None, :], 1))
                S = S + u[:, None] * kn[None, :]
                o = bf16_round(tl.sum(S * qn[None, :], 1), ROUND)
                slot_t = tl.load(slots_ptr + r * Q + t)
                keep = live & (slot_t > 0)
                slot_t = tl.maximum(slot_t, 0).to(tl.int64)
                tl.store(rec_ptr + slot_t * stride_rec_s + head + v[:, None] * D + d[None, :], S, mask=keep)
                if NV == 1 and NC == 1:
                    _gated_norm(o, row, h, d, g2_ptr, stride_g2, norm_w, out_ptr, stride_out, live, eps, D, ROUND)
                else:
                    tl.store(ws_ptr + (row * H + h) * D + v, o)
            if NC > 1:
                S, v0, v1, v2 = S_next, n0, n1, n2

        if NV > 1:
            # the head's last program to arrive (every other one has read the conv window
            # and written its o rows) writes the q/k conv channels and normalises
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + r * H + h, 1, sem="acq_rel", scope="gpu")
            if arrived == NV - 1:
                tl.store(cnt_ptr + r * H + h, 0)
                _store_qk_window(conv_out, stride_conv_r, cq, ck, q1, q2, k1, k2, xq, xk, qkv_ptr, stride_qkv, r, Q,
                                 live)
                _normalise(ws_ptr, r, h, d, g2_ptr, stride_g2, norm_w, out_ptr, stride_out, live, eps, H, D, Q, ROUND)
        elif NC > 1:
            tl.debug_barrier()  # every chunk's o rows are out
            _normalise(ws_ptr, r, h, d, g2_ptr, stride_g2, norm_w, out_ptr, stride_out, live, eps, H, D, Q, ROUND)

    @triton.jit
    def _qk_gate(xq, xk, q0, q1, q2, k0, k1, k2, wq0, wq1, wq2, wq3, wk0, wk1, wk2, wk3, g1_all, tq, t, a_h, dtb,
                 lower_bound, beta_ptr, D: tl.constexpr, ROUND: tl.constexpr):
        """Token ``t``'s L2-normalised q (scaled by D^-1/2) and k after conv and SiLU, its
        gate and beta (``xq``, ``xk``: its q/k inputs; ``q0..k2``: the window before it)."""
        yq = q0 * wq0 + q1 * wq1 + q2 * wq2 + xq * wq3
        yk = k0 * wk0 + k1 * wk1 + k2 * wk2 + xk * wk3
        yq = bf16_round(yq * tl.sigmoid(yq), ROUND)
        yk = bf16_round(yk * tl.sigmoid(yk), ROUND)
        qn = yq / tl.sqrt(tl.sum(yq * yq, 0) + 1e-6) * (1.0 / tl.sqrt(D * 1.0))
        kn = yk / tl.sqrt(tl.sum(yk * yk, 0) + 1e-6)
        g1 = tl.sum(tl.where((tq == t)[:, None], g1_all, 0.0), 0)
        gate = lower_bound * tl.sigmoid(a_h * (g1 + dtb))
        beta = tl.sigmoid(tl.load(beta_ptr).to(tl.float32))
        return qn, kn, gate, beta

    @triton.jit
    def _store_qk_window(conv_out, stride_conv_r, cq, ck, q1, q2, k1, k2, xq, xk, qkv_ptr, stride_qkv, r,
                         Q: tl.constexpr, live):
        """The q/k channels of the new conv state: the window's last two saved inputs, then
        the q tokens' own (``xq``, ``xk``: the first token's, in registers)."""
        _store_conv_rows(conv_out, 0, stride_conv_r, cq, ck, q1, k1, live)
        _store_conv_rows(conv_out, 1, stride_conv_r, cq, ck, q2, k2, live)
        _store_conv_rows(conv_out, 2, stride_conv_r, cq, ck, xq, xk, live)
        for t in tl.range(1, Q, loop_unroll_factor=1):
            row = r * Q + t
            _store_conv_rows(conv_out, 2 + t, stride_conv_r, cq, ck, tl.load(qkv_ptr + row * stride_qkv + cq),
                             tl.load(qkv_ptr + row * stride_qkv + ck), live)

    @triton.jit
    def _normalise(ws_ptr, r, h, d, g2_ptr, stride_g2, norm_w, out_ptr, stride_out, live, eps, H: tl.constexpr,
                   D: tl.constexpr, Q: tl.constexpr, ROUND: tl.constexpr):
        """Every token's head output from its pre-norm o rows in the workspace."""
        for t in tl.range(0, Q, loop_unroll_factor=1):
            row = r * Q + t
            o = tl.load(ws_ptr + (row * H + h) * D + d, cache_modifier=".cg")
            _gated_norm(o, row, h, d, g2_ptr, stride_g2, norm_w, out_ptr, stride_out, live, eps, D, ROUND)

    @triton.jit
    def _store_conv_rows(conv_out, i, stride_conv_r, cq, ck, xq, xk, live):
        """Row ``i`` of the new conv state, q and k channels (padding requests write nothing)."""
        tl.store(conv_out + i * stride_conv_r + cq, xq.to(conv_out.dtype.element_ty), mask=live)
        tl.store(conv_out + i * stride_conv_r + ck, xk.to(conv_out.dtype.element_ty), mask=live)

    @triton.jit
    def _gated_norm(o, row, h, d, g2_ptr, stride_g2, norm_w, out_ptr, stride_out, live, eps, D: tl.constexpr,
                    ROUND: tl.constexpr):
        """One token's head output: RMSNorm(o) * w * sigmoid(g2), rounded to bf16 (zeros for padding)."""
        g2 = tl.load(g2_ptr + row * stride_g2 + h * D + d).to(tl.float32)
        y = o * tl.rsqrt(tl.sum(o * o, 0) / D + eps) * norm_w * tl.sigmoid(g2)
        y = tl.where(live, bf16_round(y, ROUND), 0.0)
        tl.store(out_ptr + row * stride_out + h * D + d, y.to(out_ptr.dtype.element_ty))


def _fake(mixed_qkv, f_a, f_b_weight, g2, beta, conv_weight, A_log, dt_bias, norm_weight, conv_state,
          recurrent_state, state_slots, num_accepted, lower_bound, norm_eps):
    check_q(state_slots.shape[1], "kimi_kernels::kda_decode")
    return g2.new_empty(g2.shape)


@torch.library.custom_op(f"{NAMESPACE}::kda_decode", mutates_args=("conv_state", "recurrent_state"),
                         tags=(torch.Tag.flexible_layout,))
def kda_decode(
    mixed_qkv: Tensor, f_a: Tensor, f_b_weight: Tensor, g2: Tensor, beta: Tensor, conv_weight: Tensor,
    A_log: Tensor, dt_bias: Tensor, norm_weight: Tensor, conv_state: Tensor, recurrent_state: Tensor,
    state_slots: Tensor, num_accepted: Tensor, lower_bound: float, norm_eps: float,
) -> Tensor:
    check_q(state_slots.shape[1], "kimi_kernels::kda_decode")  # the kernel pads the q tokens' gate rows to 16
    H, D = recurrent_state.shape[1], recurrent_state.shape[-1]
    use_triton = (mixed_qkv.is_cuda or INTERPRET) and not supported(
        conv_weight.shape[-1], D)
    if not use_triton:
        return reference(mixed_qkv, f_a, f_b_weight, g2, beta, conv_weight, A_log, dt_bias, norm_weight,
                         conv_state, recurrent_state, state_slots, num_accepted, lower_bound, norm_eps)
    R, Q = state_slots.shape
    assert recurrent_state[0].is_contiguous() and conv_state.stride(2) == 1
    mixed_qkv, f_a, g2, beta = (t if t.stride(-1) == 1 else t.contiguous() for t in (mixed_qkv, f_a, g2, beta))
    f_b_weight, A_log, dt_bias, norm_weight = (t.contiguous() for t in (f_b_weight, A_log, dt_bias, norm_weight))
    out = torch.empty(g2.shape, dtype=g2.dtype, device=g2.device)
    nv, bc = v_split(R, H, D, Q)
    _kda_decode_kernel[(R, H, nv)](*kernel_args(
        mixed_qkv, f_a, f_b_weight, g2, beta, conv_weight, A_log, dt_bias, norm_weight, conv_state,
        recurrent_state, state_slots, num_accepted, out, lower_bound, norm_eps, nv, bc),
        H=H, D=D, Q=Q, ROUND=mixed_qkv.dtype == torch.bfloat16,
        DOT_F32=INTERPRET or mixed_qkv.dtype == torch.float32,  # the interpreter's bf16 dot is wrong
        NV=nv, BC=bc, num_warps=4, **pdl(mixed_qkv.device))  # 4 beat 2, 8 and 16 at every size on H200: docs/results/kda_kernel_h200_v{1,2,3}.json
    return out


# This kernel against vLLM's native SM90 decode (its CUDA build's ``_C::fused_kda_decode``
# after its f_b GEMM on cuBLAS), by request count at q = 1 and TP8 per-rank shapes: True
# where ours was faster (``benchmarks/kda_kernel.py --vllm-native``; H200, session 23:
# docs/results/session23_h200/kda_kernel_native.json, ours 1.67 / 1.67 / 1.32 / 0.81 / 0.91x).
VERSUS_NATIVE: dict[int, bool] = {1: True, 2: True, 8: True, 32: False, 64: False}


def versus_native(requests) -> str:
    """Why vLLM's native decode stays at ``requests`` ('' where ours replaces it). Ours
    where it was measured faster at the nearest measured counts on both sides (past the
    table: its largest); with a symbolic count (one graph for every size), at every one."""
    if not VERSUS_NATIVE:
        return "vLLM's native decode kept: ours not yet measured against it (benchmarks/kda_kernel.py --vllm-native)"
    counts = sorted(VERSUS_NATIVE)
    near = counts
    if isinstance(requests, int):
        near = [c for c in counts if c <= requests][-1:] + ([c for c in counts if c >= requests][:1] or counts[-1:])
    slower = sorted({c for c in near if not VERSUS_NATIVE[c]})
    return f"vLLM's native decode is as fast or faster at {slower} requests (of {requests}; " \
        "benchmarks/kda_kernel.py --vllm-native)" if slower else ""


# Rows of S a program streams at a time where its programs overfill the SMs but at most
# three an SM (0: always the whole block). H100, TP8 heads, q = 1, kernel us whole / 32-row
# chunks (docs/results/session23_h100/kda_kernel_chunk.json, kda_regs.json): 7.19 / 8.02
# at 8 requests, 13.76 / 10.68 at 16, 17.01 / 15.63 at 24, 18.93 / 15.36 at 32, 32.59 /
# 39.36 at 48, 45.02 / 54.29 at 64; at q = 4 the chunks lost at every count.
CHUNK = 32


def chunk_rows() -> int:
    """CHUNK, or ``KIMI_INDUCTOR_KDA_CHUNK`` (0: off, to measure what it gives)."""
    value = os.environ.get("KIMI_INDUCTOR_KDA_CHUNK", str(CHUNK))
    rows = int(value) if value.isdigit() else -1
    if rows and (rows & (rows - 1) or not 1 <= rows <= 128):
        raise ValueError(f"KIMI_INDUCTOR_KDA_CHUNK={value!r}: rows of S a program streams at a time must be 0 (off) "
                         "or a power of two up to 128 (a chunk tiles the head's V rows)")
    return rows


def v_split(R: int, H: int, D: int, Q: int = 1) -> tuple[int, int]:
    """(NV, BC): V blocks per head, and the rows of S a program holds at a time.

    NV = 4 while the split programs fill at most 3/4 of the SMs, else 1. On H200 at 12
    heads 4 blocks gain at 1 request (kernel 5.8 vs 6.4 us at q = 1, 11.5 vs 16.7 at q = 4,
    docs/results/kda_kernel_h200_v5.json) and 2 (the q = 4, 8-row layer step: 53.5 vs
    59.9 us, kda_layer_q4_h200_v5.json) and lose from 8 requests on; 2 blocks never won.
    BC = ``CHUNK`` rows streamed one ahead where a one-token step's programs outnumber the
    SMs but fit three an SM (a [128, 128] fp32 block is 255 registers a thread at 4 warps,
    with spills: two programs an SM; a 32-row chunk with the next in flight 168: three),
    so that each program overlaps its next rows' loads with its arithmetic; else the
    whole block, D / NV (past three an SM the whole blocks keep more bytes in flight)."""
    nv, chunk = 4 if R * H * 4 <= 3 * SMS // 4 else 1, chunk_rows()
    return nv, (min(chunk, D // nv) if chunk and Q == 1 and SMS < R * H * nv <= 3 * SMS else D // nv)


def kernel_args(mixed_qkv, f_a, f_b_weight, g2, beta, conv_weight, A_log, dt_bias, norm_weight, conv_state,
                recurrent_state, state_slots, num_accepted, out, lower_bound, norm_eps, nv: int = 1,
                bc: int = 0) -> tuple:
    """The Triton kernel's positional arguments (strides, and with ``nv`` > 1 or ``bc``
    rows of a block at a time the pre-norm workspace, with ``nv`` > 1 the arrival
    counters, included)."""
    R, H, D = state_slots.shape[0], recurrent_state.shape[1], recurrent_state.shape[-1]
    ws = torch.empty(out.shape[0], H, D, dtype=torch.float32, device=out.device) \
        if nv > 1 or 0 < bc < D // nv else out
    cnt = arrival_counters(out.device, R * H) if nv > 1 else state_slots
    cw = conv_weight if conv_weight.dim() == 3 and conv_weight.shape[0] == 3 else conv_weight.view(3, -1, conv_weight.shape[-1])
    return (mixed_qkv, mixed_qkv.stride(0), f_a, f_a.stride(0), f_b_weight, g2, g2.stride(0), beta, beta.stride(0),
            cw, *cw.stride(), A_log, dt_bias, norm_weight, conv_state, conv_state.stride(0), conv_state.stride(1),
            recurrent_state, recurrent_state.stride(0), state_slots, num_accepted, out, out.stride(0), ws, cnt,
            lower_bound, norm_eps)


kda_decode.register_fake(_fake)


def page_states(page: Tensor, conv_start: int, state_len: int, conv_dim: int, dtype: torch.dtype, rec_start: int,
                heads: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """(conv_state [S, state_len, conv_dim] ``dtype``, recurrent_state [S, H, D, D] fp32):
    views of the byte ranges at ``conv_start`` / ``rec_start`` of every slot's row of
    ``page`` [S, bytes] int8 (vLLM's KDA cache binding: one page per slot holds both)."""
    S = page.shape[0]
    conv_bytes = state_len * conv_dim * dtype.itemsize
    conv = page[:, conv_start:conv_start + conv_bytes].view(dtype).view(S, state_len, conv_dim)
    rec = page[:, rec_start:rec_start + heads * head_dim * head_dim * 4].view(torch.float32)
    return conv, rec.view(S, heads, head_dim, head_dim)


def _fake_paged(mixed_qkv, f_a, f_b_weight, g2, beta, conv_weight, A_log, dt_bias, norm_weight, page, conv_start,
                state_len, rec_start, state_slots, num_accepted, lower_bound, norm_eps):
    check_q(state_slots.shape[1], "kimi_kernels::kda_decode_paged")
    return g2.new_empty(g2.shape)


@torch.library.custom_op(f"{NAMESPACE}::kda_decode_paged", mutates_args=("page",), tags=(torch.Tag.flexible_layout,))
def kda_decode_paged(
    mixed_qkv: Tensor, f_a: Tensor, f_b_weight: Tensor, g2: Tensor, beta: Tensor, conv_weight: Tensor,
    A_log: Tensor, dt_bias: Tensor, norm_weight: Tensor, page: Tensor, conv_start: int, state_len: int,
    rec_start: int, state_slots: Tensor, num_accepted: Tensor, lower_bound: float, norm_eps: float,
) -> Tensor:
    """``kda_decode`` with both states in ``page`` [S, bytes] int8 (``page_states``: the conv
    state at byte ``conv_start``, ``state_len`` x conv width in mixed_qkv's dtype; the
    recurrent state [H, D, D] fp32 at byte ``rec_start``), updated in place: one mutated
    tensor, as vLLM binds a KDA layer's cache, so that a functional graph can hold the
    call (a dtype view of a graph input is not a base ``auto_functionalized_v2`` takes)."""
    H, D = beta.shape[1], g2.shape[1] // beta.shape[1]
    conv, rec = page_states(page, conv_start, state_len, mixed_qkv.shape[1], mixed_qkv.dtype, rec_start, H, D)
    return torch.ops.kimi_kernels.kda_decode(mixed_qkv, f_a, f_b_weight, g2, beta, conv_weight, A_log, dt_bias,
                                             norm_weight, conv, rec, state_slots, num_accepted, lower_bound, norm_eps)


kda_decode_paged.register_fake(_fake_paged)


def reference(mixed_qkv, f_a, f_b_weight, g2, beta, conv_weight, A_log, dt_bias, norm_weight, conv_state,
              recurrent_state, state_slots, num_accepted, lower_bound, norm_eps):
    """The op's semantics: stock's f_b_proj GEMM, then stock's ``kimi::kda_decode`` (with
    the conv weight as stock's [3P, 1, W])."""
    g1 = F.linear(f_a, f_b_weight)
    conv_weight = conv_weight.reshape(-1, 1, conv_weight.shape[-1])
    return REFERENCES[torch.ops.kimi.kda_decode.default](mixed_qkv, g1, g2, beta, conv_weight, A_log, dt_bias, norm_weight,
                                     conv_state, recurrent_state, state_slots, num_accepted, lower_bound,
                                     norm_eps)
