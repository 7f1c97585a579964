"""``kimi_kernels::dsa_select``: DSA's lightning indexer and its top-k over the paged index cache.

Semantics: stock ``stock.dsa.select_topk``. For request r's query j (q per request, seq_len
s_r), every position p <= s_r - q + j scores

    I[r, j, p] = sum_h w[r j, h] relu(<index_q[r j, h], index_cache[p]>)

and the ``topk`` best visible positions are selected (all when fewer are visible); ties
go to the earlier position. Returns [R, q, W] bool, W the block table's capacity.

Layout. ``_scores_kernel``, one program per (request, BP positions): it reads its positions'
keys straight from the paged cache through the block table (no gathered copy), multiplies
them by all q x n query rows of the request in one ``tl.dot`` ([q n, d] x [d, BP], bf16
products, fp32 sums), applies ReLU and the head weights, sums the heads and writes fp32
scores, -inf where not visible. The top-k is one ``torch.topk`` on int64 keys
(the score's order-preserving bits << 32 | (W - 1 - position)): the largest keys are
the best scores and, among equal scores, the earliest positions: stock's stable
descending sort, without sorting the whole row.

Byte floor: the index cache rows below seq_len (d x 2 bytes each) plus the scores. On
the H200 (benchmarks/dsa_index.py) the scoring kernel takes 4-48 us at 8K positions x
1-64 requests, and ``torch.topk`` (k = 2048, radix passes over 64-bit keys) 60-105 us:
the top-k, not the scoring, is what is left; a selection kernel is the next step (a
threshold form, one fp32 top-k for the k-th score and then the ties, measured slower).
Scores differ from stock's fp32 einsum only in summation order; exact zeros (ReLU) and
exact ties are the same, so the selection is stock's except for scores that agree to
fp32 rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kimi_inductor.stock.dsa import select_topk

from .common import INTERPRET, tl, triton

NAMESPACE = "kimi_kernels"
BP = 64  # positions per program


def supported(rows: int, heads: int, dim: int) -> str:
    """Why the Triton scorer cannot take this indexer ('' when it can)."""
    if triton is None:
        return "Triton is not installed"
    if heads & (heads - 1):
        return f"{heads} index heads (a power of two)"
    if rows * heads > 256:
        return f"{rows} query rows x {heads} heads per request (> 256 rows in one dot)"
    if dim & (dim - 1) or not 16 <= dim <= 256:
        return f"index head_dim {dim} (a power of two in 16..256)"
    return ""


if triton is not None:

    @triton.jit
    def _scores_kernel(q_ptr, w_ptr, cache_ptr, block_table_ptr, stride_bt, seq_lens_ptr, out_ptr, W,
                       Q: tl.constexpr, N: tl.constexpr, QN: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                       BP: tl.constexpr, DOT_F32: tl.constexpr):
        r = tl.program_id(0)
        p0 = tl.program_id(1) * BP
        rows = tl.arange(0, QN)  # (query j, head h) = (rows // N, rows % N)
        dims = tl.arange(0, D)
        pos = p0 + tl.arange(0, BP)
        seq_len = tl.load(seq_lens_ptr + r)
        live = pos < seq_len  # positions any query of this request may see
        slot = tl.load(block_table_ptr + r * stride_bt + pos // BLOCK, mask=live, other=0).to(tl.int64)
        keys = tl.load(cache_ptr + (slot * BLOCK + pos % BLOCK)[:, None] * D + dims[None, :], mask=live[:, None],
                       other=0.0)  # [BP, D]
        in_q = rows < Q * N
        t_rows = (r * Q + rows // N).to(tl.int64)
        q = tl.load(q_ptr + (t_rows * N + rows % N)[:, None] * D + dims[None, :], mask=in_q[:, None], other=0.0)
        if DOT_F32:
            logits = tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)))
        else:
            logits = tl.dot(q, tl.trans(keys))  # [QN, BP] fp32
        w = tl.load(w_ptr + t_rows * N + rows % N, mask=in_q, other=0.0)
        weighted = tl.maximum(logits, 0.0) * w[:, None]
        scores = tl.sum(tl.reshape(weighted, (QN // N, N, BP)), 1)  # [QN // N, BP]: one row per query
        j = tl.arange(0, QN // N)
        visible = pos[None, :] <= (seq_len - Q + j)[:, None]
        scores = tl.where(visible, scores, float("-inf"))
        tl.store(out_ptr + ((r * Q + j) * W)[:, None] + pos[None, :], scores,
                 mask=(j < Q)[:, None] & (pos < W)[None, :])


def scores(index_q: Tensor, index_w: Tensor, index_cache: Tensor, block_table: Tensor, seq_lens: Tensor) -> Tensor:
    """The indexer's scores [R, q, W] fp32 (-inf where not visible)."""
    T, N, D = index_q.shape
    R = block_table.shape[0]
    Q, block = T // R, index_cache.shape[1]
    W = block_table.shape[1] * block
    out = torch.empty(R, Q, W, dtype=torch.float32, device=index_q.device)
    assert index_q.is_contiguous() and index_cache.is_contiguous() and index_w.is_contiguous()
    qn = max(16, triton.next_power_of_2(Q * N))
    _scores_kernel[(R, triton.cdiv(W, BP))](
        index_q, index_w.float(), index_cache, block_table, block_table.stride(0), seq_lens, out, W,
        Q=Q, N=N, QN=qn, D=D, BLOCK=block, BP=BP, DOT_F32=INTERPRET or index_q.dtype == torch.float32,
        num_warps=8 if qn * BP > 8192 else 4)
    return out


def topk_mask(scores: Tensor, topk: int) -> Tensor:
    """Stock's ``topk_mask`` (the ``topk`` best visible positions, ties to the earlier one)
    as one top-k on int64 keys: the score's order-preserving bits above the reversed
    position."""
    W = scores.shape[-1]
    bits = (scores + 0.0).view(torch.int32)  # + 0.0: -0.0 and 0.0 are one score
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()  # int order = float order
    keys = (ordered << 32) | (W - 1 - torch.arange(W, device=scores.device))
    best = torch.topk(keys, min(topk, W), dim=-1, sorted=False).indices
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, best, True)
    return chosen & (scores > float("-inf"))


def _fake(index_q, index_w, index_cache, block_table, seq_lens, topk):
    R = block_table.shape[0]
    return index_q.new_empty(R, index_q.shape[0] // R, block_table.shape[1] * index_cache.shape[1], dtype=torch.bool)


@torch.library.custom_op(f"{NAMESPACE}::dsa_select", mutates_args=())
def dsa_select(index_q: Tensor, index_w: Tensor, index_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
               topk: int) -> Tensor:
    R = block_table.shape[0]
    T, N, D = index_q.shape
    if not (index_q.is_cuda or INTERPRET) or supported(T // R, N, D):
        return select_topk(index_q, index_w, index_cache, block_table, seq_lens, topk)
    return topk_mask(scores(index_q.contiguous(), index_w.contiguous(), index_cache, block_table, seq_lens), topk)


dsa_select.register_fake(_fake)
