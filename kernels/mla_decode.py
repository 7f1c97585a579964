"""``kimi_kernels::mla_decode``: MLA's decode core over the paged latent cache
(split-KV flash decoding), in place of stock ``kimi::mla_decode``.

Semantics (stock's): write each token's ``[kv_c | k_pe]`` row (L + R values) at its
slot (slots < 0: not written), then for query token j of request r (position
seq_len - q + j) attend over every cached position s <= that position with scores
``([ql_nope | q_pe] . cache[s]) * scale`` (fp32), softmax, and return
``sum_s p_s cache[s][:L]`` in bf16 [T, N, L]. Requests with seq_len 0 give zeros.

Layout. MLA decode is multi-query: the N heads (and the q tokens) of a request share
one latent row per position, so a program takes BM = 16 query rows (flattened
(token, head) pairs of one request) against a chunk of the request's positions:

  grid (R, ceil(q N / BM), SPLITS). A program streams its chunk BS positions at a time
  (block table -> physical rows; latent [BS, L] and rope [BS, R] tiles), scores them
  with two ``tl.dot`` (latent and rope parts), applies the causal mask of each query
  token, keeps an online softmax (max m, sum l) and accumulates P V in fp32 [BM, L];
  writes (acc, m, l) per split. ``_combine_kernel`` merges the splits with their
  log-sum-exp weights and rounds once to bf16.

SPLITS is chosen on the host from static sizes only (request count, the block table's
capacity), so the op is capturable in CUDA graphs. Rounding: P is rounded to bf16 for
the P V dot (tensor cores), as vLLM's Triton MLA does; scores, softmax and the
accumulator are fp32 (stock's reference keeps P in fp32: the difference is below one
bf16 rounding of the output). fp32 activations take fp32 dots with P unrounded.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kimi_inductor.stock.library import REFERENCES
from kimi_inductor.stock.mla import write_cache

from .common import INTERPRET, bf16_round, tl, triton

NAMESPACE = "kimi_kernels"
SMS = 132  # H200
BM, BS = 16, 32


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
    def _mla_split_kernel(qn_ptr, stride_qn_t, stride_qn_h, qp_ptr, stride_qp_t, stride_qp_h, cache_ptr,
                          table_ptr, stride_table, seq_ptr, acc_ptr, ml_ptr, N, Q, R_DIM, chunk, scale,
                          L: tl.constexpr, RP: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr,
                          BM: tl.constexpr, BS: tl.constexpr, DOT_F32: tl.constexpr, ROUND: tl.constexpr):
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
        last = seq - Q + rows // N  # the last position each row sees
        start = split * chunk
        end = tl.minimum(start + chunk, seq)
        m = tl.full([BM], float("-inf"), tl.float32)
        l = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, L], dtype=tl.float32)
        for p0 in range(start, end, BS):
            pos = p0 + tl.arange(0, BS)
            pmask = pos < end
            block = tl.load(table_ptr + r * stride_table + pos // BLOCK, mask=pmask, other=0)
            phys = (block.to(tl.int64) * BLOCK + pos % BLOCK) * ROW
            kv = tl.load(cache_ptr + phys[:, None] + dl[None, :], mask=pmask[:, None], other=0.0)  # [BS, L]
            kp = tl.load(cache_ptr + phys[:, None] + L + dr[None, :], mask=pmask[:, None] & (dr < R_DIM)[None, :],
                         other=0.0)
            if DOT_F32:
                kv = kv.to(tl.float32)
                kp = kp.to(tl.float32)
                s = tl.dot(qn, tl.trans(kv), input_precision="ieee") + tl.dot(qp, tl.trans(kp), input_precision="ieee")
            else:
                s = tl.dot(qn, tl.trans(kv)) + tl.dot(qp, tl.trans(kp))
            visible = (pos[None, :] <= last[:, None]) & pmask[None, :]
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
            acc = acc * alpha[:, None] + pv
            m = m_new
        out_rows = r * Q * N + rows
        nrows = tl.num_programs(0) * Q * N
        tl.store(acc_ptr + (split * nrows + out_rows)[:, None].to(tl.int64) * L + dl[None, :], acc,
                 mask=rmask[:, None])
        tl.store(ml_ptr + (split * nrows + out_rows) * 2, m, mask=rmask)
        tl.store(ml_ptr + (split * nrows + out_rows) * 2 + 1, l, mask=rmask)

    @triton.jit
    def _combine_kernel(acc_ptr, ml_ptr, out_ptr, nrows, L: tl.constexpr, SPLITS: tl.constexpr):
        row = tl.program_id(0)
        dl = tl.arange(0, L)
        top = float("-inf")
        for s in tl.static_range(SPLITS):
            top = tl.maximum(top, tl.load(ml_ptr + (s * nrows + row) * 2))
        top = tl.where(top == float("-inf"), 0.0, top)
        num = tl.zeros([L], dtype=tl.float32)
        den = 0.0
        for s in tl.static_range(SPLITS):
            w = tl.exp(tl.load(ml_ptr + (s * nrows + row) * 2) - top)
            den += w * tl.load(ml_ptr + (s * nrows + row) * 2 + 1)
            num += w * tl.load(acc_ptr + (s * nrows + row).to(tl.int64) * L + dl)
        out = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
        tl.store(out_ptr + row.to(tl.int64) * L + dl, out.to(out_ptr.dtype.element_ty))


def splits(requests: int, groups: int, capacity: int) -> int:
    """KV splits per (request, row group): enough programs for every SM, chunks of at
    least 4 BS positions (static sizes only: capturable)."""
    return max(1, min(triton.cdiv(2 * SMS, requests * groups), triton.cdiv(capacity, 4 * BS), 64))


def _fake(ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens, scale):
    return ql_nope.new_empty(ql_nope.shape)


@torch.library.custom_op(f"{NAMESPACE}::mla_decode", mutates_args=("kv_cache",))
def mla_decode(ql_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
               block_table: Tensor, seq_lens: Tensor, scale: float) -> Tensor:
    T, N, L = ql_nope.shape
    use_triton = (ql_nope.is_cuda or INTERPRET) and not supported(L, q_pe.shape[-1], ql_nope.dtype)
    if not use_triton:
        return reference(ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens, scale)
    write_cache(kv_cache, slot_mapping, torch.cat([kv_c, k_pe], dim=-1))
    R, (_, block, row) = block_table.shape[0], kv_cache.shape
    Q = T // R
    groups = triton.cdiv(Q * N, BM)
    n_split = splits(R, groups, block_table.shape[1] * block)
    chunk = triton.cdiv(triton.cdiv(block_table.shape[1] * block, n_split), BS) * BS
    acc = torch.empty(n_split, T * N, L, dtype=torch.float32, device=ql_nope.device)
    ml = torch.empty(n_split, T * N, 2, dtype=torch.float32, device=ql_nope.device)
    out = torch.empty(T, N, L, dtype=ql_nope.dtype, device=ql_nope.device)
    R_DIM = q_pe.shape[-1]
    assert ql_nope.stride(2) == 1 and q_pe.stride(2) == 1 and kv_cache.is_contiguous()
    _mla_split_kernel[(R, groups, n_split)](
        ql_nope, ql_nope.stride(0), ql_nope.stride(1), q_pe, q_pe.stride(0), q_pe.stride(1), kv_cache,
        block_table, block_table.stride(0), seq_lens, acc, ml, N, Q, R_DIM, chunk, scale,
        L=L, RP=max(16, triton.next_power_of_2(R_DIM)), ROW=row, BLOCK=block, BM=BM, BS=BS,
        DOT_F32=INTERPRET or ql_nope.dtype == torch.float32, ROUND=ql_nope.dtype == torch.bfloat16,
        num_warps=4, num_stages=2)
    _combine_kernel[(T * N,)](acc, ml, out, T * N, L=L, SPLITS=n_split)
    return out


mla_decode.register_fake(_fake)


def reference(ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens, scale):
    """The op's semantics: stock's ``kimi::mla_decode``."""
    return REFERENCES[torch.ops.kimi.mla_decode.default](ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping,
                                                         block_table, seq_lens, scale)
