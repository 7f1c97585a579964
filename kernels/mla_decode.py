"""``kimi_kernels::mla_decode``: MLA's decode core over the paged latent cache
(split-KV flash decoding), in place of stock ``kimi::mla_decode``.

Semantics (stock's): write each token's ``[kv_c | k_pe]`` row (L + R values) at its
slot (slots < 0: not written), then for query token j of request r (position
seq_len - q + j) attend over every cached position s <= that position with scores
``([ql_nope | q_pe] . cache[s]) * scale`` (fp32), softmax, and return
``sum_s p_s cache[s][:L]`` in bf16 [T, N, L]. Requests with seq_len 0 give zeros.

Layout. MLA decode is multi-query: the N heads (and the q tokens) of a request share
one latent row per position, so a program takes BM query rows (flattened (token, head)
pairs of one request: all of them up to 64, so that the cache is streamed once per
request) against a chunk of the request's positions:

  grid (R, ceil(q N / BM), SPLITS). A program streams its chunk BS positions at a time
  (latent [BS, L] and rope [BS, R] tiles: where BS divides the block size, chunks start
  at multiples of BS, so a step's rows are consecutive rows of one block, read as one
  slab from a single table entry; else each row through the block table), scores them
  with two ``tl.dot`` (latent and rope parts), applies the causal mask of each query
  token, keeps an online softmax (max m, sum l) and accumulates P V in fp32 [BM, L];
  writes (acc, m, l) per split. ``_combine_kernel`` merges the splits with their
  log-sum-exp weights and rounds once to bf16: a program per (row, L block) loads every
  split's partial at once ([SPLITS, BL]), so its latency does not grow with the splits.

The step's own rows are attended before they are in the cache: the split kernel's last
split of each (request, row group) takes the request's Q fresh positions
from kv_c / k_pe (with the layer's kv_a RMSNorm when given, rounded as stock's), attends
them with the causal mask among the step's tokens, and (first row group) stores them at
their slots; the other splits divide the positions before the step, which every query
row sees (no causal mask in their loop). So the cache write, stock's cat + indexed write
(and norm), costs no launch. A token whose slot is not its position's slot in the table
(slot -1: vLLM's padding) is attended from the cache's row there, as stock reads it
after its write. Where ``splits`` finds that split no place that measured faster (2, 16,
32 requests at 4K), and for DCP and DSA, ``_insert_kernel`` (``insert``: one program
per token, the kv norm applied) writes the rows first.

SPLITS is chosen on the host from static sizes only (request count, the block table's
capacity), so the op is capturable in CUDA graphs; each program divides its request's
own length (``seq_lens``) by SPLITS on the device, so a table sized for a long
max_model_len (vLLM's) does not leave one split with a short request's whole context.
Rounding: P is rounded to bf16 for the P V dot (tensor cores), as vLLM's Triton MLA
does; scores, softmax and the accumulator are fp32 (stock's reference keeps P in fp32:
the difference is below one bf16 rounding of the output). fp32 activations take fp32
dots with P unrounded.

``kimi_kernels::mla_decode_dcp`` is the same kernel for decode context parallelism
(stock ``kimi::mla_decode_dcp``, ``stock/dcp.py``): this rank's cache holds every G-th
position, so a context index maps to global position (i // B) B G + (i % B) G + rank
for the causal mask, the loop stops at the rank's own count of positions, an optional
``selected`` mask (DSA's top-k) narrows the visible positions, and the combine returns
the fp32 partial output with its log-sum-exp for the cross-rank merge.

``kimi_kernels::dsa_decode`` (stock ``kimi::dsa_decode``, DSA without DCP): the cache
writes, the indexer's scores and top-k (``kimi_kernels.dsa_select``, ``dsa_index.py``),
and the attention is this kernel over a list of positions: the union of the request's
query rows' selections (``dsa_index.positions``, at most q x topk), each row masked to its
own. A program reads only listed latent rows (through the block table), so the core
reads the top-k rows, whatever the context; splits divide the list, not the context.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kimi_inductor.stock.attn_res import rms_norm
from kimi_inductor.stock.library import REFERENCES
from kimi_inductor.stock.state import tokens_per_request

from .common import INTERPRET, SMS, arrival_counters, pdl, pdl_wait, bf16_round, tl, triton
from . import dsa_index

NAMESPACE = "kimi_kernels"
BS = 32  # the default positions per step (``tiles``)


def supported(latent: int, rope: int, dtype: torch.dtype) -> str:
    """Why the Triton kernel cannot take these shapes ('' when it can)."""
    if triton is None:
        return "Triton is not installed"
    if latent & (latent - 1) or latent < 16:
        return f"kv_lora_rank {latent} (the kernel needs a power of two >= 16)"
    if rope > 256:
        return f"rope dims {rope}"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"dtype {dtype}"
    return ""


if triton is not None:

    @triton.jit
    def _attend_step(qn, qp, kv, kp, visible, m, l, acc, scale, DOT_F32: tl.constexpr, ROUND: tl.constexpr):
        """One online-softmax step of BM query rows over [BS, L] latent and [BS, R] rope
        rows (``visible`` [BM, BS]): the new (m, l, acc)."""
        if DOT_F32:
            kv = kv.to(tl.float32)
            kp = kp.to(tl.float32)
            s = tl.dot(qn, tl.trans(kv), input_precision="ieee") + tl.dot(qp, tl.trans(kp), input_precision="ieee")
        else:
            s = tl.dot(qn, tl.trans(kv)) + tl.dot(qp, tl.trans(kp))
        s = tl.where(visible, s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        if DOT_F32:
            pv = tl.dot(bf16_round(p, ROUND), kv, input_precision="ieee")
        else:
            pv = tl.dot(p.to(kv.dtype), kv)
        return m_new, l, acc * alpha[:, None] + pv

    @triton.jit
    def _kv_rms_norm(x, norm_ptr, eps, A: tl.constexpr, ROUND: tl.constexpr):
        """Stock's ``rms_norm`` of rows x [rows, A] (weight at ``norm_ptr``), rounded where
        stock rounds when ROUND; fp32."""
        xf = x.to(tl.float32)
        xf = bf16_round(xf * tl.rsqrt(tl.sum(xf * xf, 1) / A + eps)[:, None], ROUND)
        return bf16_round(xf * tl.load(norm_ptr + tl.arange(0, A)).to(tl.float32)[None, :], ROUND)

    @triton.jit
    def _mla_split_kernel(qn_ptr, stride_qn_t, stride_qn_h, qp_ptr, stride_qp_t, stride_qp_h, cache_ptr,
                          table_ptr, stride_table, seq_ptr, sel_ptr, stride_sel, list_ptr, stride_list, count_ptr,
                          acc_ptr, ml_ptr, kv_ptr, stride_kv, kpe_ptr, stride_kpe, slot_ptr, norm_ptr, eps,
                          N, Q, R_DIM, scale, dcp_rank, dcp_size,
                          L: tl.constexpr, RP: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr,
                          BM: tl.constexpr, BS: tl.constexpr, HAS_SEL: tl.constexpr, HAS_LIST: tl.constexpr,
                          WHOLE: tl.constexpr, FRESH: tl.constexpr, QP: tl.constexpr, NORM: tl.constexpr,
                          NORM_ROUND: tl.constexpr, DOT_F32: tl.constexpr, ROUND: tl.constexpr,
                          PDL: tl.constexpr):
        pdl_wait(PDL)
        r = tl.program_id(0)
        rows = tl.program_id(1) * BM + tl.arange(0, BM)  # (token j, head n) pairs of request r
        split = tl.program_id(2)
        rmask = rows < Q * N
        tok = r * Q + rows // N
        head = rows % N
        dl = tl.arange(0, L)
        dr = tl.arange(0, RP)
        qn = tl.load(qn_ptr + tok[:, None] * stride_qn_t + head[:, None] * stride_qn_h + dl[None, :],
                     mask=rmask[:, None], other=0.0)
        qp = tl.load(qp_ptr + tok[:, None] * stride_qp_t + head[:, None] * stride_qp_h + dr[None, :],
                     mask=rmask[:, None] & (dr < R_DIM)[None, :], other=0.0)
        if DOT_F32:
            qn = qn.to(tl.float32)
            qp = qp.to(tl.float32)
        seq = tl.load(seq_ptr + r)
        last = seq - Q + rows // N  # the last (global) position each row sees
        local_len = tl.maximum(seq - dcp_rank + dcp_size - 1, 0) // dcp_size  # this rank's positions < seq
        if HAS_LIST:  # the split's share of the request's listed positions
            local_len = tl.load(count_ptr + r)
        n_cached = tl.num_programs(2)
        if FRESH:  # the last split takes the step's own Q positions, the others those cached before
            n_cached -= 1
            local_len = tl.maximum(seq - Q, 0)
        # the request's own positions split evenly (whole BS steps): the table's width
        # (vLLM sizes it for max_model_len) sets only how many splits there are
        chunk = tl.cdiv(tl.cdiv(local_len, n_cached), BS) * BS
        start = split * chunk
        end = tl.minimum(start + chunk, local_len)
        m = tl.full([BM], float("-inf"), tl.float32)
        l = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, L], dtype=tl.float32)
        if FRESH:
            if split == n_cached:
                # token i of the step: its row from kv_c / k_pe (the kv norm applied, rounded
                # to the cache's dtype, stored at its slot by the first row group) where its
                # slot is its position's slot in the table, else the cache's row there (as
                # stock, which writes before it reads); causal among the step's tokens.
                # Every load is issued before the store (no round trip after it).
                i = tl.arange(0, QP)
                pos = seq - Q + i
                valid = (i < Q) & (pos >= 0)
                t = r * Q + i
                slot = tl.load(slot_ptr + t, mask=i < Q, other=-1).to(tl.int64)
                at = tl.maximum(pos, 0)
                own = tl.load(table_ptr + r * stride_table + at // BLOCK, mask=valid, other=0).to(tl.int64)
                own = own * BLOCK + at % BLOCK
                kv = tl.load(kv_ptr + t[:, None] * stride_kv + dl[None, :], mask=(i < Q)[:, None], other=0.0)
                kp = tl.load(kpe_ptr + t[:, None] * stride_kpe + dr[None, :],
                             mask=(i < Q)[:, None] & (dr < R_DIM)[None, :], other=0.0).to(cache_ptr.dtype.element_ty)
                stale = valid & (slot != own)
                old_kv = tl.load(cache_ptr + own[:, None] * ROW + dl[None, :], mask=stale[:, None], other=0.0)
                old_kp = tl.load(cache_ptr + own[:, None] * ROW + L + dr[None, :],
                                 mask=stale[:, None] & (dr < R_DIM)[None, :], other=0.0)
                if NORM:
                    kv = _kv_rms_norm(kv, norm_ptr, eps, L, NORM_ROUND)
                kv = kv.to(cache_ptr.dtype.element_ty)
                if tl.program_id(1) == 0:
                    store = (i < Q) & (slot >= 0)
                    tl.store(cache_ptr + slot[:, None] * ROW + dl[None, :], kv, mask=store[:, None])
                    tl.store(cache_ptr + slot[:, None] * ROW + L + dr[None, :], kp,
                             mask=store[:, None] & (dr < R_DIM)[None, :])
                kv = tl.where(stale[:, None], old_kv, kv)
                kp = tl.where(stale[:, None], old_kp, kp)
                visible = valid[None, :] & (pos[None, :] <= last[:, None])
                m, l, acc = _attend_step(qn, qp, kv, kp, visible, m, l, acc, scale, DOT_F32, ROUND)
        row_kv = tl.arange(0, BS)[:, None] * ROW + dl[None, :]
        row_kp = tl.arange(0, BS)[:, None] * ROW + L + dr[None, :]
        for p0 in range(start, end, BS):
            pos = p0 + tl.arange(0, BS)
            pmask = pos < end
            if HAS_LIST:
                pos = tl.load(list_ptr + r * stride_list + pos, mask=pmask, other=0)
            if WHOLE:  # BS divides BLOCK and p0 is a multiple of BS: one block's consecutive rows
                step = cache_ptr + (tl.load(table_ptr + r * stride_table + p0 // BLOCK).to(tl.int64) * BLOCK
                                    + p0 % BLOCK) * ROW
                kv = tl.load(step + row_kv, mask=pmask[:, None], other=0.0)  # [BS, L]
                kp = tl.load(step + row_kp, mask=pmask[:, None] & (dr < R_DIM)[None, :], other=0.0)
            else:
                block = tl.load(table_ptr + r * stride_table + pos // BLOCK, mask=pmask, other=0)
                phys = (block.to(tl.int64) * BLOCK + pos % BLOCK) * ROW
                kv = tl.load(cache_ptr + phys[:, None] + dl[None, :], mask=pmask[:, None], other=0.0)  # [BS, L]
                kp = tl.load(cache_ptr + phys[:, None] + L + dr[None, :],
                             mask=pmask[:, None] & (dr < R_DIM)[None, :], other=0.0)
            if FRESH:  # every cached position precedes the step's: visible to all its rows
                visible = pmask[None, :]
            else:
                where = (pos // BLOCK) * BLOCK * dcp_size + (pos % BLOCK) * dcp_size + dcp_rank  # global position
                visible = (where[None, :] <= last[:, None]) & pmask[None, :]
            if HAS_SEL:
                visible &= tl.load(sel_ptr + tok[:, None] * stride_sel + pos[None, :],
                                   mask=rmask[:, None] & pmask[None, :], other=0) != 0
            m, l, acc = _attend_step(qn, qp, kv, kp, visible, m, l, acc, scale, DOT_F32, ROUND)
        out_rows = r * Q * N + rows
        nrows = tl.num_programs(0) * Q * N
        tl.store(acc_ptr + (split * nrows + out_rows)[:, None].to(tl.int64) * L + dl[None, :], acc,
                 mask=rmask[:, None])
        tl.store(ml_ptr + (split * nrows + out_rows) * 2, m, mask=rmask)
        tl.store(ml_ptr + (split * nrows + out_rows) * 2 + 1, l, mask=rmask)

    @triton.jit
    def _merge(acc_ptr, ml_ptr, at, live, dl, L: tl.constexpr):
        """One row's split partials (indices ``at`` [SP], ``live`` ones written) over columns
        dl merged with their log-sum-exp weights: (fp32 output, 0 where nothing was
        attended; the largest max; the weighted sum of the splits' sums)."""
        m = tl.load(ml_ptr + at * 2, mask=live, other=float("-inf"))
        top = tl.max(m, 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp(m - top)  # 0 for empty splits
        den = tl.sum(w * tl.load(ml_ptr + at * 2 + 1, mask=live, other=0.0), 0)
        part = tl.load(acc_ptr + at[:, None].to(tl.int64) * L + dl[None, :], mask=live[:, None], other=0.0)
        num = tl.sum(w[:, None] * part, 0)
        return tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0), top, den

    @triton.jit
    def _combine_kernel(acc_ptr, ml_ptr, out_ptr, lse_ptr, nrows, n_split, L: tl.constexpr, BL: tl.constexpr,
                        SP: tl.constexpr, WITH_LSE: tl.constexpr, PDL: tl.constexpr):
        """Program (row, L block): the splits' partials [SP, BL] loaded at once (no loop
        over splits), merged with their log-sum-exp weights; one rounding."""
        pdl_wait(PDL)
        row = tl.program_id(0)
        dl = tl.program_id(1) * BL + tl.arange(0, BL)
        s = tl.arange(0, SP)
        out, top, den = _merge(acc_ptr, ml_ptr, s * nrows + row, s < n_split, dl, L)
        tl.store(out_ptr + row.to(tl.int64) * L + dl, out.to(out_ptr.dtype.element_ty))
        if WITH_LSE:
            if tl.program_id(1) == 0:
                tl.store(lse_ptr + row, tl.where(den > 0, top + tl.log(tl.where(den > 0, den, 1.0)), float("-inf")))

    @triton.jit
    def _combine_up_kernel(acc_ptr, ml_ptr, w_ptr, stride_wb, stride_wk, stride_wn, gate_ptr, stride_g, out_ptr,
                           ws_ptr, cnt_ptr, nrows, n_split, N, V, T: tl.constexpr, L: tl.constexpr,
                           BL: tl.constexpr, SP: tl.constexpr, VP: tl.constexpr, ROUND: tl.constexpr,
                           PDL: tl.constexpr):
        """Program (head h, L block j), for each of the T tokens: the splits' partials of
        row (token, h) merged over the block (``_merge``, as ``_combine_kernel``; one rounding:
        the attention output), times W[h][block, :V] (the v up-projection) -> fp32 [V] in
        ws[h, j, token]. The head's last program to arrive at cnt[h] sums the blocks in
        block order (deterministic), rounds (the bmm's output), multiplies by
        sigmoid(gate[token, h V:(h + 1) V]), rounds and stores out[token, h V:(h + 1) V]."""
        pdl_wait(PDL)
        h = tl.program_id(0)
        j = tl.program_id(1)
        NB: tl.constexpr = L // BL
        dl = j * BL + tl.arange(0, BL)
        dv = tl.arange(0, VP)
        s = tl.arange(0, SP)
        live = s < n_split
        w = tl.load(w_ptr + h * stride_wb + dl[:, None] * stride_wk + dv[None, :] * stride_wn,
                    mask=(dv < V)[None, :], other=0.0).to(tl.float32)  # [BL, VP]
        for t in tl.static_range(T):
            x = bf16_round(_merge(acc_ptr, ml_ptr, s * nrows + t * N + h, live, dl, L)[0], ROUND)
            tl.store(ws_ptr + ((h * NB + j) * T + t) * VP + dv, tl.sum(x[:, None] * w, 0))
        tl.debug_barrier()  # every thread's partial is written before the arrival
        arrived = tl.atomic_add(cnt_ptr + h, 1, sem="acq_rel", scope="gpu")
        if arrived == NB - 1:
            tl.store(cnt_ptr + h, 0)
            b = tl.arange(0, NB)
            for t in tl.static_range(T):
                y = tl.sum(tl.load(ws_ptr + ((h * NB + b)[:, None] * T + t) * VP + dv[None, :], cache_modifier=".cg"), 0)
                g = tl.load(gate_ptr + t * stride_g + h * V + dv, mask=dv < V, other=0.0).to(tl.float32)
                y = bf16_round(bf16_round(y, ROUND) * tl.sigmoid(g), ROUND)
                tl.store(out_ptr + t * N * V + h * V + dv, y.to(out_ptr.dtype.element_ty), mask=dv < V)

    @triton.jit
    def _insert_kernel(a_ptr, stride_a, b_ptr, stride_b, slot_ptr, cache_ptr, norm_ptr, eps, block_local, dcp_rank,
                       dcp_size, A: tl.constexpr, B: tl.constexpr, AP: tl.constexpr, BP: tl.constexpr,
                       ROW: tl.constexpr, NORM: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr):
        """Program t: token t's row [a | b] (A + B values) stored at its slot of the paged
        cache [blocks, block_local, ROW]; under DCP (``dcp_size`` > 1) global slot ->
        this rank's slot (``stock.dcp.local_slots``), other ranks' positions skipped, as are
        slots < 0. With NORM (A a power of two), a is stored as stock's ``rms_norm(a, w,
        eps)`` (w at ``norm_ptr``; rounded where stock rounds when ROUND)."""
        pdl_wait(PDL)
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        virtual = block_local * dcp_size
        offset = slot % virtual
        if (slot >= 0) & (offset % dcp_size == dcp_rank):
            row = cache_ptr + ((slot // virtual) * block_local + offset // dcp_size) * ROW
            da = tl.arange(0, AP)
            x = tl.load(a_ptr + t * stride_a + da, mask=da < A)
            if NORM:
                x = tl.reshape(_kv_rms_norm(tl.reshape(x, [1, AP]), norm_ptr, eps, A, ROUND), [AP])
            tl.store(row + da, x.to(cache_ptr.dtype.element_ty), mask=da < A)
            if B > 0:
                db = tl.arange(0, BP)
                y = tl.load(b_ptr + t * stride_b + db, mask=db < B)
                tl.store(row + A + db, y.to(cache_ptr.dtype.element_ty), mask=db < B)


def _rows(t: Tensor) -> Tensor:
    """t [T, ...] as [T, d] rows with a unit last stride (a view where it can be)."""
    return t.reshape(t.shape[0], -1) if t.stride(-1) == 1 else t.reshape(t.shape[0], -1).contiguous()


def insert(cache: Tensor, slot_mapping: Tensor, a: Tensor, b: Tensor | None = None, dcp_rank: int = 0,
           dcp_size: int = 1, norm: tuple[Tensor, float] | None = None) -> None:
    """``write_cache(cache, slots, cat([a, b], -1))`` in one launch: a [T, A] (and b [T, B];
    trailing dims flattened) rows, any row stride; ``slots``: ``dcp.local_slots`` of ``slot_mapping`` under DCP.
    ``norm`` (weight [A], eps): a is written as stock's ``rms_norm(a, weight, eps)``."""
    a, b = (_rows(t) if t is not None else None for t in (a, b))
    T, A = a.shape
    B = 0 if b is None else b.shape[1]
    assert cache.is_contiguous() and cache.shape[-1] == A + B and (norm is None or A & (A - 1) == 0)
    b = a if b is None else b
    weight, eps = norm if norm is not None else (a, 0.0)
    _insert_kernel[(T,)](a, a.stride(0), b, b.stride(0), slot_mapping, cache, weight, eps, cache.shape[1], dcp_rank,
                         dcp_size, A=A, B=B, AP=triton.next_power_of_2(A), BP=triton.next_power_of_2(max(B, 1)),
                         ROW=cache.shape[-1], NORM=norm is not None, ROUND=weight.dtype == torch.bfloat16,
                         num_warps=1, **pdl(a.device))


# Tokens up to which the splits merge inside the gated v up-projection
# (``mla_decode_gated``, in place of the merge and ``skinny_bmm_gate`` or the bmm and
# gate). Timed in the layer beside the merge's own launch (benchmarks/mla_layer.py
# --merge-ab, H100, docs/results/session20_h100/mla_layer_merge_ab.json and
# mla_layer_ab_triton_gemv*.json): 2.1-4.4 % faster at one row; 2.3-4.3 % slower at two,
# 32 % at eight.
MERGE_INTO_UP = 1


def merge_into_up(tokens: int) -> str:
    """Why the splits' merge stays a launch of its own at ``tokens`` rows ('' when the
    gated v up-projection takes it)."""
    return "" if tokens <= MERGE_INTO_UP else f"{tokens} rows: taken up to {MERGE_INTO_UP} (mla_decode.MERGE_INTO_UP)"


def merge_block(L: int, sp: int) -> int:
    """BL, the latent columns of a merge program: [SP, BL] partials, 32 fp32 values a
    thread at 4 warps."""
    return min(L, max(16, 4096 // sp))


def tiles(bm: int) -> tuple[int, int]:
    """(BS positions per step, split cap) for BM rows: the best of the sweep in
    docs/results/mla_kernel_h200_v1.json at 128K context (16 rows: 32 / 256; 32 rows:
    64 / 64)."""
    return (32, 256) if bm <= 16 else (64, 64)


def row_block(rows: int) -> int:
    """BM: every (token, head) row of a request in one program when it fits (16..64),
    so that the request's cache is streamed once."""
    return min(64, max(16, triton.next_power_of_2(rows)))


def splits(requests: int, groups: int, capacity: int, bs: int = BS, most: int = 64, steps: int = 1,
           fresh: bool = False) -> int:
    """KV splits per (request, row group): at most two programs per SM (one wave; a
    rounded-up count left a partial second wave: 32 / 64 requests at 4K took 9 / 19 %
    longer, docs/results/mla_layer_h100_v10*.json), chunks of at least ``steps`` BS
    positions of a full table (static sizes only: capturable; the kernel divides each
    request's own length). One step: at 4K context and one request
    128 splits took 9.3 us against 14.3 with chunks of 4 steps (32 splits), the same at
    8 requests (26.6 us): docs/results/mla_kernel_h200_v2.json.

    ``fresh``: the count with the step's own split among them: one more for a single
    request (1.1-2.2 % faster at one row on an H100), one in place of the others' last
    where that costs them no BS step (1.9-2.2 % faster at 8 rows); else 0, and the cache
    is written first by ``insert``: one split fewer costs a step more than that launch
    (32 rows at 4K: 2.6 % slower), and one more beside two requests' 128 each measured
    3.2-4.3 % slower at 2 rows, though the kernel alone (no PDL) was faster (unexplained). Side by
    side on an H100: docs/results/session19_h100/mla_layer_fresh*.json against
    mla_layer_before_fresh*.json."""
    n = max(1, min(2 * SMS // (requests * groups), triton.cdiv(capacity, steps * bs), most))
    if not fresh:
        return n
    if requests * groups == 1 and n < 2 * SMS:
        return n + 1
    per = lambda k: triton.cdiv(capacity, k * bs)  # noqa: E731 (BS steps a split streams)
    return n if n > 1 and per(n - 1) == per(n) else 0


def _fake(ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens, scale, kv_norm_weight=None,
          kv_norm_eps=0.0):
    tokens_per_request(ql_nope.shape[0], block_table.shape[0], "kimi_kernels::mla_decode")
    return ql_nope.new_empty(ql_nope.shape)


@torch.library.custom_op(f"{NAMESPACE}::mla_decode", mutates_args=("kv_cache",))
def mla_decode(ql_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
               block_table: Tensor, seq_lens: Tensor, scale: float, kv_norm_weight: Optional[Tensor] = None,
               kv_norm_eps: float = 0.0) -> Tensor:
    """With ``kv_norm_weight``: kv_c before its RMSNorm (the layer's kv_a norm), which the
    cache write applies (``insert``): one kernel fewer."""
    return _decode(ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens, scale, kv_norm_weight,
                   kv_norm_eps)


def _gated_fake(ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens, scale, w_uv, gate,
                kv_norm_weight=None, kv_norm_eps=0.0):
    tokens_per_request(ql_nope.shape[0], block_table.shape[0], "kimi_kernels::mla_decode_gated")
    return gate.new_empty(gate.shape)


@torch.library.custom_op(f"{NAMESPACE}::mla_decode_gated", mutates_args=("kv_cache",))
def mla_decode_gated(ql_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor,
                     slot_mapping: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float, w_uv: Tensor,
                     gate: Tensor, kv_norm_weight: Optional[Tensor] = None, kv_norm_eps: float = 0.0) -> Tensor:
    """``mla_decode`` followed by MLA's v up-projection and output gate
    (``skinny_bmm_gate(attn^T, w_uv, gate)``: w_uv [N, L, V], gate [T, N V]) -> [T, N V]: the
    splits' merge is the up-projection's first step (one launch fewer)."""
    T, N, L = ql_nope.shape
    if w_uv.shape[:2] != (N, L) or gate.shape != (T, N * w_uv.shape[2]):
        raise ValueError(f"kimi_kernels.mla_decode_gated: w_uv {tuple(w_uv.shape)} and gate {tuple(gate.shape)} do "
                         f"not match the query {tuple(ql_nope.shape)}: w_uv [N, L, V] and gate [T, N V]")
    return _decode(ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens, scale, kv_norm_weight,
                   kv_norm_eps, up=(w_uv, gate if gate.stride(1) == 1 else gate.contiguous()))


def _decode(ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens, scale, kv_norm_weight,
            kv_norm_eps, up=None):
    tokens_per_request(ql_nope.shape[0], block_table.shape[0], "kimi_kernels::mla_decode")
    norm = None if kv_norm_weight is None else (kv_norm_weight.contiguous(), kv_norm_eps)
    if not _use_triton(ql_nope, q_pe):
        kv_c = kv_c if norm is None else rms_norm(kv_c, *norm)
        out = reference(ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens, scale)
        return out if up is None else torch.ops.kimi_kernels.skinny_bmm_gate(out.transpose(0, 1), *up)
    return attend(ql_nope, q_pe, kv_cache, block_table, seq_lens, scale, fresh=(kv_c, k_pe, slot_mapping, norm),
                  up=up)


mla_decode_gated.register_fake(_gated_fake)


def _use_triton(ql_nope: Tensor, q_pe: Tensor) -> bool:
    return (ql_nope.is_cuda or INTERPRET) and not supported(ql_nope.shape[-1], q_pe.shape[-1], ql_nope.dtype)


def attend(ql_nope: Tensor, q_pe: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
           dcp_rank: int = 0, dcp_size: int = 1, selected: Tensor | None = None, with_lse: bool = False,
           listed: tuple[Tensor, Tensor] | None = None, bm: int | None = None, bs: int | None = None,
           most_splits: int | None = None, num_stages: int = 2, steps: int = 1, num_warps: int | None = None,
           fresh: tuple[Tensor, Tensor, Tensor, tuple[Tensor, float] | None] | None = None,
           up: tuple[Tensor, Tensor] | None = None):
    """The Triton attention over the (already written) cache: [T, N, L] in the query
    dtype, or with ``with_lse`` (DCP partials) fp32 [T, N, L] and the LSE [T, N].
    ``listed`` (DSA without DCP: ``dsa_index.positions``): only these positions of each
    request are read. ``fresh`` (kv_c, k_pe, slot_mapping, kv norm or None; not with DCP or
    ``listed``): the step's rows are not yet in the cache; a split of their own per
    request and row group attends them from kv_c / k_pe and writes them (``insert``'s
    work, no launch of its own), or ``insert`` writes them first where ``splits`` finds
    that split no place that measured faster. ``up`` (W_UV [N, L, V] any strides, gate
    [T, N V] unit column stride; not with ``with_lse``): the splits merge into the v
    up-projection and output gate (``_combine_up_kernel``) -> [T, N V]. Tile arguments are
    for the benchmark's sweep (``benchmarks/mla_kernel.py``)."""
    T, N, L = ql_nope.shape
    R, (_, block, row) = block_table.shape[0], kv_cache.shape
    Q = tokens_per_request(T, R, "kimi_kernels MLA attention")
    bm = bm or row_block(Q * N)
    # fp32 activations double the tiles' shared memory: 32 positions per step then
    bs = bs or (min(32, tiles(bm)[0]) if ql_nope.dtype == torch.float32 else tiles(bm)[0])
    most_splits = most_splits or tiles(bm)[1]
    groups = triton.cdiv(Q * N, bm)
    capacity = listed[0].shape[1] if listed is not None else block_table.shape[1] * block
    assert fresh is None or (dcp_size == 1 and listed is None)
    n_split = splits(R, groups, capacity, bs, most_splits, steps, fresh=fresh is not None)
    if fresh is not None and not n_split:  # no place for the step's own split: write first
        insert(kv_cache, fresh[2], fresh[0], fresh[1], norm=fresh[3])
        fresh, n_split = None, splits(R, groups, capacity, bs, most_splits, steps)
    acc = torch.empty(n_split, T * N, L, dtype=torch.float32, device=ql_nope.device)
    ml = torch.empty(n_split, T * N, 2, dtype=torch.float32, device=ql_nope.device)
    sel = selected.view(torch.uint8) if selected is not None else seq_lens
    plist, counts = listed if listed is not None else (block_table, seq_lens)
    R_DIM = q_pe.shape[-1]
    assert ql_nope.stride(2) == 1 and q_pe.stride(2) == 1 and kv_cache.is_contiguous()
    kv_c, k_pe, slot_mapping, norm = fresh if fresh is not None else (seq_lens, seq_lens, seq_lens, None)
    kv_c, k_pe = (_rows(kv_c), _rows(k_pe)) if fresh is not None else (kv_c, k_pe)
    norm_w, eps = norm if norm is not None else (seq_lens, 0.0)
    launch = pdl(ql_nope.device)
    _mla_split_kernel[(R, groups, n_split)](
        ql_nope, ql_nope.stride(0), ql_nope.stride(1), q_pe, q_pe.stride(0), q_pe.stride(1), kv_cache,
        block_table, block_table.stride(0), seq_lens, sel, sel.stride(0) if selected is not None else 0,
        plist, plist.stride(0), counts, acc, ml, kv_c, kv_c.stride(0), k_pe, k_pe.stride(0), slot_mapping,
        norm_w, eps, N, Q, R_DIM, scale, dcp_rank, dcp_size,
        L=L, RP=max(16, triton.next_power_of_2(R_DIM)), ROW=row, BLOCK=block, BM=bm, BS=bs,
        HAS_SEL=selected is not None, HAS_LIST=listed is not None, WHOLE=listed is None and block % bs == 0,
        FRESH=fresh is not None, QP=max(16, triton.next_power_of_2(Q)), NORM=norm is not None,
        NORM_ROUND=norm_w.dtype == torch.bfloat16, DOT_F32=INTERPRET or ql_nope.dtype == torch.float32,
        ROUND=ql_nope.dtype == torch.bfloat16, num_warps=num_warps or max(4, bm // 4), num_stages=num_stages,
        **launch)
    sp = triton.next_power_of_2(n_split)
    bl = merge_block(L, sp)
    if up is not None:
        w, gate = up
        V = w.shape[2]
        assert not with_lse and w.shape[:2] == (N, L) and gate.shape == (T, N * V) and gate.stride(1) == 1
        vp = triton.next_power_of_2(V)
        out = torch.empty(T, N * V, dtype=ql_nope.dtype, device=ql_nope.device)
        ws = torch.empty(N * (L // bl) * T * vp, dtype=torch.float32, device=ql_nope.device)
        _combine_up_kernel[(N, L // bl)](acc, ml, w, *w.stride(), gate, gate.stride(0), out, ws,
                                         arrival_counters(ql_nope.device, N), T * N, n_split, N, V, T=T, L=L,
                                         BL=bl, SP=sp, VP=vp, ROUND=ql_nope.dtype == torch.bfloat16, **launch)
        return out
    out = torch.empty(T, N, L, dtype=torch.float32 if with_lse else ql_nope.dtype, device=ql_nope.device)
    lse = torch.empty(T, N, dtype=torch.float32, device=ql_nope.device) if with_lse else out
    _combine_kernel[(T * N, L // bl)](acc, ml, out, lse, T * N, n_split, L=L, BL=bl, SP=sp, WITH_LSE=with_lse,
                                      **launch)
    return (out, lse) if with_lse else out


mla_decode.register_fake(_fake)


def _dcp_fake(ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens, selected, dcp_rank,
              dcp_size, scale):
    T, N, L = ql_nope.shape
    tokens_per_request(T, block_table.shape[0], "kimi_kernels::mla_decode_dcp")
    return ql_nope.new_empty(T, N, L, dtype=torch.float32), ql_nope.new_empty(T, N, dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::mla_decode_dcp", mutates_args=("kv_cache",))
def mla_decode_dcp(ql_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor,
                   slot_mapping: Tensor, block_table: Tensor, seq_lens: Tensor, selected: Optional[Tensor],
                   dcp_rank: int, dcp_size: int, scale: float) -> tuple[Tensor, Tensor]:
    """DCP partials (stock ``kimi::mla_decode_dcp``): all gathered heads over this rank's
    positions (and, for DSA, only the ``selected`` ones) -> fp32 output and LSE."""
    tokens_per_request(ql_nope.shape[0], block_table.shape[0], "kimi_kernels::mla_decode_dcp")
    args = (ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens, selected, dcp_rank,
            dcp_size, scale)
    if not _use_triton(ql_nope, q_pe):
        return REFERENCES[torch.ops.kimi.mla_decode_dcp.default](*args)
    insert(kv_cache, slot_mapping, kv_c, k_pe, dcp_rank, dcp_size)
    return attend(ql_nope, q_pe, kv_cache, block_table, seq_lens, scale, dcp_rank, dcp_size, selected,
                  with_lse=True)


mla_decode_dcp.register_fake(_dcp_fake)


def _dsa_fake(ql_nope, q_pe, kv_c, k_pe, index_q, index_k, index_w, kv_cache, index_cache, slot_mapping,
              block_table, seq_lens, topk, scale):
    tokens_per_request(ql_nope.shape[0], block_table.shape[0], "kimi_kernels::dsa_decode")
    return ql_nope.new_empty(ql_nope.shape)


@torch.library.custom_op(f"{NAMESPACE}::dsa_decode", mutates_args=("kv_cache", "index_cache"))
def dsa_decode(ql_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor, index_q: Tensor, index_k: Tensor,
               index_w: Tensor, kv_cache: Tensor, index_cache: Tensor, slot_mapping: Tensor, block_table: Tensor,
               seq_lens: Tensor, topk: int, scale: float) -> Tensor:
    """DSA's core (stock ``kimi::dsa_decode``): both cache writes, the indexer's top-k
    (``dsa_select``), then this kernel over the listed positions the request's queries
    selected (each query row masked to its own selection)."""
    tokens_per_request(ql_nope.shape[0], block_table.shape[0], "kimi_kernels::dsa_decode")
    args = (ql_nope, q_pe, kv_c, k_pe, index_q, index_k, index_w, kv_cache, index_cache, slot_mapping,
            block_table, seq_lens, topk, scale)
    if not _use_triton(ql_nope, q_pe):
        return REFERENCES[torch.ops.kimi.dsa_decode.default](*args)
    insert(kv_cache, slot_mapping, kv_c, k_pe)
    insert(index_cache, slot_mapping, index_k)
    selected = dsa_index.dsa_select(index_q, index_w, index_cache, block_table, seq_lens, topk)
    return attend(ql_nope, q_pe, kv_cache, block_table, seq_lens, scale, selected=selected.flatten(0, 1),
                  listed=dsa_index.positions(selected, seq_lens, topk))


dsa_decode.register_fake(_dsa_fake)


def reference(ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens, scale):
    """The op's semantics: stock's ``kimi::mla_decode``."""
    return REFERENCES[torch.ops.kimi.mla_decode.default](ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping,
                                                         block_table, seq_lens, scale)
