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
scores, -inf where not visible.

Selection: scores become order-preserving uint32 keys (-0.0 and 0.0 one key); the k-th
largest key T is found exactly, and the mask keeps every key above T and the first keys
equal to T in position order (a prefix sum): stock's stable descending sort, unsorted.
Rows with at most k visible positions take them all. Two forms, by the static width W:

* ``_select_kernel`` (W <= SELECT_MAX): one program per query row, the row in registers,
  T bisected two bits per step (three counts of keys at or above the step's candidates,
  packed into one int64 block sum: 16 sums in all).
* ``_radix_hist_kernel`` x 4 + ``_radix_mask_kernel`` (wider rows): RADIX_CHUNK scores per
  program, all chunks in parallel; four byte passes whose chunk histograms are merged
  with integer atomics (exact: deterministic), each program re-deriving the digits found
  so far from the merged histograms; the last pass also keeps per-chunk counts, from
  which each chunk knows how many keys equal to T precede it.

On the H200 (benchmarks/dsa_index.py) the register form takes 19-20 us at 8K and 32 at 16K,
the radix form 38-42 us from 16K to 128K scores at 1-32 rows: 1.5-3.1x faster than one
``torch.topk`` on int64 (score, position) keys.

Byte floor: the index cache rows below seq_len (d x 2 bytes each) plus the scores.
Scores differ from stock's fp32 einsum only in summation order; exact zeros (ReLU) and
exact ties are the same, so the selection is stock's except for scores that agree to
fp32 rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kimi_inductor.stock.dsa import select_topk
from kimi_inductor.stock.state import check_q, tokens_per_request

from .common import INTERPRET, tl, triton

NAMESPACE = "kimi_kernels"
BP = 64  # positions per scoring program
SELECT_MAX = 16384  # the widest score row the selection kernel holds in registers
RADIX_CHUNK = 8192  # scores per program of the wider rows' radix select


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
        j = tl.arange(0, QN // N)
        out = out_ptr + ((r * Q + j) * W)[:, None] + pos[None, :]
        out_mask = (j < Q)[:, None] & (pos < W)[None, :]
        if p0 < seq_len:
            live = pos < seq_len  # positions any query of this request may see
            slot = tl.load(block_table_ptr + r * stride_bt + pos // BLOCK, mask=live, other=0).to(tl.int64)
            keys = tl.load(cache_ptr + (slot * BLOCK + pos % BLOCK)[:, None] * D + dims[None, :],
                           mask=live[:, None], other=0.0)  # [BP, D]
            in_q = rows < Q * N
            t_rows = (r * Q + rows // N).to(tl.int64)
            q = tl.load(q_ptr + (t_rows * N + rows % N)[:, None] * D + dims[None, :], mask=in_q[:, None], other=0.0)
            if DOT_F32:
                logits = tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee")
            else:
                logits = tl.dot(q, tl.trans(keys))  # [QN, BP] fp32
            w = tl.load(w_ptr + t_rows * N + rows % N, mask=in_q, other=0.0)
            weighted = tl.maximum(logits, 0.0) * w[:, None]
            scores = tl.sum(tl.reshape(weighted, (QN // N, N, BP)), 1)  # [QN // N, BP]: one row per query
            visible = pos[None, :] <= (seq_len - Q + j)[:, None]
            tl.store(out, tl.where(visible, scores, float("-inf")), mask=out_mask)
        else:  # past the request's length (the table is as wide as max_model_len): nothing to read
            tl.store(out, tl.full([QN // N, BP], float("-inf"), tl.float32), mask=out_mask)

    @triton.jit
    def _key(score):
        """fp32 -> uint32 in the same order (-0.0 and 0.0 one key; every key of a non-NaN
        score is > 0)."""
        bits = tl.where(score == 0.0, 0.0, score).to(tl.int32, bitcast=True)
        return (bits ^ ((bits >> 31) | -2147483648)).to(tl.uint32, bitcast=True)

    @triton.jit
    def _visible(seq_lens_ptr, row, Q: tl.constexpr, W):
        """How many positions query row ``row`` (request row // Q, token row % Q) sees."""
        return tl.minimum(tl.maximum(tl.load(seq_lens_ptr + row // Q) - Q + row % Q + 1, 0), W)

    @triton.jit
    def _write_mask(out_ptr, idx, W, live, score, key, thresh, want, before):
        """The row's mask at positions idx: keys above thresh, and keys equal to it while
        fewer than ``want`` came before (``before`` of them in earlier chunks)."""
        tie = (live & (key == thresh)).to(tl.int32)
        rank = before + tl.cumsum(tie, 0) - tie
        take = (score > float("-inf")) & ((key > thresh) | ((tie == 1) & (rank < want)))
        tl.store(out_ptr + idx, take, mask=idx < W)

    @triton.jit
    def _select_kernel(scores_ptr, seq_lens_ptr, out_ptr, W, K, Q: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # request row // Q, query token row % Q
        n = _visible(seq_lens_ptr, row, Q, W)
        offs = tl.arange(0, BLOCK)  # BLOCK >= W
        live = offs < n
        score = tl.load(scores_ptr + row.to(tl.int64) * W + offs, mask=live, other=float("-inf"))
        key = tl.where(live, _key(score), 0)
        thresh = tl.full((), 0, tl.uint32)  # the k-th largest key; 0: take every visible position
        want = n  # how many keys equal to thresh belong to the top k
        if n > K:
            for step in tl.static_range(16):
                shift = 30 - 2 * step
                # keys >= each candidate with the next two bits 01 / 10 / 11: three counts, one sum
                packed = ((key >= (thresh | tl.full((), 1 << shift, tl.uint32))).to(tl.int64)
                          + ((key >= (thresh | tl.full((), 2 << shift, tl.uint32))).to(tl.int64) << 21)
                          + ((key >= (thresh | tl.full((), 3 << shift, tl.uint32))).to(tl.int64) << 42))
                counts = tl.sum(packed, 0)
                digit = (((counts & 0x1FFFFF) >= K).to(tl.uint32) + (((counts >> 21) & 0x1FFFFF) >= K).to(tl.uint32)
                         + ((counts >> 42) >= K).to(tl.uint32))
                thresh |= digit << shift
            want = K - tl.sum((key > thresh).to(tl.int32), 0)
        _write_mask(out_ptr + row.to(tl.int64) * W, offs, W, live, score, key, thresh, want, 0)

    @triton.jit
    def _radix_state(merged_ptr, row, K, PASSES: tl.constexpr):
        """After PASSES byte digits (from the row's merged histograms [4, 256]): the key
        bits found (thresh, under the mask fixed) and how many keys equal to the final
        threshold still belong to the top K (want)."""
        bins = tl.arange(0, 256)
        thresh = tl.full((), 0, tl.uint32)
        fixed = tl.full((), 0, tl.uint32)
        want = K
        for p in tl.static_range(PASSES):
            shift = 24 - 8 * p
            hist = tl.load(merged_ptr + (row * 4 + p) * 256 + bins)
            at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # keys with a digit >= bin
            b = tl.sum((at_least >= want).to(tl.int32), 0) - 1
            want -= tl.sum(tl.where(bins > b, hist, 0), 0)
            thresh |= b.to(tl.uint32) << shift
            fixed |= tl.full((), 255 << shift, tl.uint32)
        return thresh, fixed, want

    @triton.jit
    def _radix_hist_kernel(scores_ptr, seq_lens_ptr, merged_ptr, last_ptr, W, K, NC, Q: tl.constexpr,
                           PASS: tl.constexpr, C: tl.constexpr):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        n = _visible(seq_lens_ptr, row, Q, W)
        if (n > K) & (chunk * C < n):
            thresh, fixed, want = _radix_state(merged_ptr, row, K, PASS)
            idx = chunk * C + tl.arange(0, C)
            live = idx < n
            key = _key(tl.load(scores_ptr + row.to(tl.int64) * W + idx, mask=live, other=0.0))
            digit = ((key >> (24 - 8 * PASS)) & 255).to(tl.int32)
            hist = tl.histogram(digit, 256, mask=live & ((key & fixed) == thresh))
            bins = tl.arange(0, 256)
            tl.atomic_add(merged_ptr + (row * 4 + PASS) * 256 + bins, hist, sem="relaxed")
            if PASS == 3:  # per chunk: bin T's count is this chunk's keys equal to T
                tl.store(last_ptr + (row * NC + chunk) * 256 + bins, hist)

    @triton.jit
    def _radix_mask_kernel(scores_ptr, seq_lens_ptr, merged_ptr, last_ptr, out_ptr, W, K, NC,
                           Q: tl.constexpr, C: tl.constexpr, NCP: tl.constexpr):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        n = _visible(seq_lens_ptr, row, Q, W)
        idx = chunk * C + tl.arange(0, C)
        live = idx < n
        score = tl.load(scores_ptr + row.to(tl.int64) * W + idx, mask=live, other=float("-inf"))
        key = tl.where(live, _key(score), 0)
        thresh = tl.full((), 0, tl.uint32)  # 0: take every visible position
        want = n
        before = tl.full((), 0, tl.int32)  # keys equal to thresh in earlier chunks
        if n > K:
            thresh, fixed, want = _radix_state(merged_ptr, row, K, 4)
            earlier = tl.arange(0, NCP)
            before = tl.sum(tl.load(last_ptr + (row * NC + earlier) * 256 + (thresh & 255).to(tl.int32),
                                    mask=earlier < chunk, other=0), 0)
        _write_mask(out_ptr + row.to(tl.int64) * W, idx, W, live, score, key, thresh, want, before)

    @triton.jit
    def _positions_kernel(sel_ptr, seq_lens_ptr, pos_ptr, count_ptr, W, CAP, Q: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        before = 0  # positions already listed
        # no query selects a position at or past the request's length: the table's width
        # (max_model_len) need not be scanned
        for start in range(0, tl.minimum(tl.load(seq_lens_ptr + r), W), BLOCK):
            idx = start + offs
            live = idx < W
            chosen = tl.zeros([BLOCK], tl.int32)
            for j in tl.static_range(Q):
                chosen |= tl.load(sel_ptr + (r * Q + j).to(tl.int64) * W + idx, mask=live, other=0).to(tl.int32)
            rank = before + tl.cumsum(chosen, 0) - chosen
            tl.store(pos_ptr + r.to(tl.int64) * CAP + rank, idx, mask=(chosen != 0) & (rank < CAP))
            before += tl.sum(chosen, 0)
        tl.store(count_ptr + r, tl.minimum(before, CAP))


def scores(index_q: Tensor, index_w: Tensor, index_cache: Tensor, block_table: Tensor, seq_lens: Tensor) -> Tensor:
    """The indexer's scores [R, q, W] fp32 (-inf where not visible)."""
    T, N, D = index_q.shape
    R = block_table.shape[0]
    Q, block = tokens_per_request(T, R, "kimi_kernels DSA indexer scores"), index_cache.shape[1]
    W = block_table.shape[1] * block
    out = torch.empty(R, Q, W, dtype=torch.float32, device=index_q.device)
    assert index_q.is_contiguous() and index_cache.is_contiguous() and index_w.is_contiguous()
    qn = max(16, triton.next_power_of_2(Q * N))
    _scores_kernel[(R, triton.cdiv(W, BP))](
        index_q, index_w.float(), index_cache, block_table, block_table.stride(0), seq_lens, out, W,
        Q=Q, N=N, QN=qn, D=D, BLOCK=block, BP=BP, DOT_F32=INTERPRET or index_q.dtype == torch.float32,
        num_warps=8 if qn * BP > 8192 else 4)
    return out


def select(scores: Tensor, seq_lens: Tensor, topk: int, warps: int | None = None) -> Tensor:
    """Stock's ``topk_mask`` of the indexer's scores [R, q, W] (-inf where not visible):
    the ``topk`` best visible positions of each query row, ties to the earlier position ->
    [R, q, W] bool. ``warps``: for the benchmark's sweep (benchmarks/dsa_index.py --sweep)."""
    R, Q, W = scores.shape
    check_q(Q, "kimi_kernels DSA top-k selection")
    if W > SELECT_MAX:
        return radix_select(scores, seq_lens, topk)
    block = max(128, triton.next_power_of_2(W))
    out = torch.empty(R, Q, W, dtype=torch.bool, device=scores.device)
    _select_kernel[(R * Q,)](scores, seq_lens, out, W, topk, Q=Q, BLOCK=block,
                             num_warps=warps or max(4, min(16, block // 512)))
    return out


def radix_select(scores: Tensor, seq_lens: Tensor, topk: int) -> Tensor:
    """``select`` for rows of any width: chunks of RADIX_CHUNK scores in parallel, four
    byte passes (histograms merged with integer atomics: deterministic), then the mask."""
    R, Q, W = scores.shape
    check_q(Q, "kimi_kernels DSA top-k selection")
    rows, nc = R * Q, triton.cdiv(W, RADIX_CHUNK)
    merged = torch.zeros(rows, 4, 256, dtype=torch.int32, device=scores.device)
    last = torch.empty(rows, nc, 256, dtype=torch.int32, device=scores.device)
    for p in range(4):
        _radix_hist_kernel[(rows, nc)](scores, seq_lens, merged, last, W, topk, nc, Q=Q, PASS=p, C=RADIX_CHUNK,
                                       num_warps=16)
    out = torch.empty(R, Q, W, dtype=torch.bool, device=scores.device)
    _radix_mask_kernel[(rows, nc)](scores, seq_lens, merged, last, out, W, topk, nc, Q=Q, C=RADIX_CHUNK,
                                   NCP=max(2, triton.next_power_of_2(nc)), num_warps=16)
    return out


def positions(selected: Tensor, seq_lens: Tensor, topk: int) -> tuple[Tensor, Tensor]:
    """The positions any query of a request selected, in position order: selected [R, q, W]
    bool (``select``'s: nothing at or past the request's ``seq_lens``) -> (positions
    [R, min(W, q topk)] int32, counts [R] int32); entries past a request's count are unset.
    What the DSA core gathers instead of streaming every position."""
    R, Q, W = selected.shape
    check_q(Q, "kimi_kernels DSA position lists")
    cap = min(W, Q * topk)
    pos = torch.empty(R, cap, dtype=torch.int32, device=selected.device)
    counts = torch.empty(R, dtype=torch.int32, device=selected.device)
    _positions_kernel[(R,)](selected, seq_lens, pos, counts, W, cap, Q=Q, BLOCK=8192, num_warps=16)
    return pos, counts


def _fake(index_q, index_w, index_cache, block_table, seq_lens, topk):
    R = block_table.shape[0]
    Q = tokens_per_request(index_q.shape[0], R, "kimi_kernels::dsa_select")
    return index_q.new_empty(R, Q, block_table.shape[1] * index_cache.shape[1], dtype=torch.bool)


@torch.library.custom_op(f"{NAMESPACE}::dsa_select", mutates_args=())
def dsa_select(index_q: Tensor, index_w: Tensor, index_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
               topk: int) -> Tensor:
    R = block_table.shape[0]
    T, N, D = index_q.shape
    tokens_per_request(T, R, "kimi_kernels::dsa_select")
    if not (index_q.is_cuda or INTERPRET) or supported(T // R, N, D):
        return select_topk(index_q, index_w, index_cache, block_table, seq_lens, topk)
    scored = scores(index_q.contiguous(), index_w.contiguous(), index_cache, block_table, seq_lens)
    return select(scored, seq_lens, topk)


dsa_select.register_fake(_fake)
