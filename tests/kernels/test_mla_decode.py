"""kimi_kernels::mla_decode (split-KV Triton) against stock's kimi::mla_decode.

Tolerance: the kernel rounds the softmax probabilities to bf16 for the P V dot (as
vLLM's Triton MLA does; stock's reference keeps them fp32) and sums in other orders:
bf16 outputs agree within 2^-6 of each row's largest value (about two bf16 roundings);
fp32 activations (fp32 dots, no rounding) within 1e-5. Cache writes are identical.
"""

import pytest
import torch

import kimi_inductor.kernels  # noqa: F401
from kimi_inductor.kernels import mla_decode as M

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (heads, latent L, rope R, block size, blocks per request): K3 at TP8 on the GPU; on the
# CPU blocks narrower than a step (rows gathered one by one) and two steps wide (a step's rows
# read as one slab of their block)
SHAPES = [(12, 512, 64, 64, 64)] if DEVICE == "cuda" else [(4, 32, 8, 4, 12), (4, 32, 8, 64, 2)]


def _case(R, q, N, L, RD, block, per_req, dtype, seed=0, longest=None):
    """R requests (the last one padding) at random contexts up to ``longest`` (default:
    the table's capacity, per_req blocks)."""
    g = torch.Generator().manual_seed(seed)
    capacity = per_req * block
    seq = torch.randint(q, (longest or capacity) + 1, (R,), generator=g).int()
    seq[-1] = 0  # a padding request
    table = (1 + torch.arange(R * per_req)).view(R, per_req).int()
    table = table[:, torch.randperm(per_req, generator=g)]  # blocks out of order
    cache = torch.randn(1 + R * per_req, block, L + RD, generator=g).to(dtype)
    pos = (seq.long()[:, None] - q + torch.arange(q)).clamp(min=0)
    slots = table.long().gather(1, pos // block) * block + pos % block
    slots[-1] = -1
    T = R * q
    args = [torch.randn(T, N, L, generator=g).to(dtype) * 0.3, torch.randn(T, N, RD, generator=g).to(dtype) * 0.3,
            torch.randn(T, L, generator=g).to(dtype), torch.randn(T, RD, generator=g).to(dtype), cache,
            slots.view(-1), table, seq]
    return [a.to(DEVICE) for a in args], (L + RD) ** -0.5


@pytest.fixture(params=["fresh split", "insert first"])
def cache_write(request, monkeypatch):
    """How the step's rows reach the core, whatever ``splits`` would choose at these
    shapes: attended and written by a split of their own, or written first by ``insert``."""
    splits = M.splits

    def forced(*args, fresh=False, **kwargs):
        n = splits(*args, **kwargs)
        return (n + 1 if request.param == "fresh split" else 0) if fresh else n

    monkeypatch.setattr(M, "splits", forced)


@pytest.mark.parametrize("N, L, RD, block, per_req", SHAPES)
@pytest.mark.parametrize("R, q", [(1, 1), (3, 1), (2, 4), (5, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_stock(R, q, N, L, RD, block, per_req, dtype, cache_write):
    args, scale = _case(R, q, N, L, RD, block, per_req, dtype, seed=R * 10 + q)
    mine = [a.clone() for a in args]
    want = M.reference(*args, scale)
    got = torch.ops.kimi_kernels.mla_decode(*mine, scale)
    assert torch.equal(mine[4], args[4])  # the cache writes
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not got[-q:].any()  # padding request
    tol = 1e-5 if dtype == torch.float32 else 2**-6
    bound = tol * want.float().abs().amax(-1, keepdim=True) + 1e-6
    assert ((got.float() - want.float()).abs() <= bound).all(), (got.float() - want.float()).abs().max()


@pytest.mark.parametrize("N, L, RD, block, per_req", SHAPES)
@pytest.mark.parametrize("R, q", [(3, 1), (2, 4)])
def test_rows_past_each_request_are_never_read(R, q, N, L, RD, block, per_req, cache_write):
    """Cache rows at or past a request's length (in its last block: a step's rows past
    its chunk lie in the same block) may hold anything, NaN included: the output is
    bitwise the one over a clean cache. (Stock's reference reads whole blocks, so it is
    not the comparison here.)"""
    args, scale = _case(R, q, N, L, RD, block, per_req, torch.bfloat16, seed=3)
    table, seq = args[-2].cpu(), args[-1].cpu()
    poisoned = args[4].clone()
    for r in range(R):
        past = torch.arange(int(seq[r]), per_req * block)
        poisoned[table[r].long()[past // block], past % block] = float("nan")
    clean = torch.ops.kimi_kernels.mla_decode(*[a.clone() for a in args], scale)
    got = torch.ops.kimi_kernels.mla_decode(*[a.clone() for a in args[:4]], poisoned, *args[5:], scale)
    assert torch.equal(got, clean)


@pytest.mark.parametrize("N, L, RD, block, per_req", SHAPES)
@pytest.mark.parametrize("norm", [False, True])
def test_a_token_without_a_slot_attends_the_cached_row(N, L, RD, block, per_req, norm, cache_write):
    """The step's rows are attended from kv_c / k_pe, except a token whose slot is -1
    (not written): stock reads the cache's row at its position, and so does the kernel."""
    R, q = 3, 2
    args, scale = _case(R, q, N, L, RD, block, per_req, torch.bfloat16, seed=11)
    args[5][1] = -1  # request 0's second token
    args[5][2] = -1  # request 1's first token
    w = (1 + 0.1 * torch.randn(L, generator=torch.Generator().manual_seed(1))).bfloat16().to(DEVICE)
    want_args = [a.clone() for a in args]
    if norm:
        from kimi_inductor.stock.attn_res import rms_norm

        want_args[2] = rms_norm(want_args[2], w, 1e-6)
    want = M.reference(*want_args, scale)
    mine = [a.clone() for a in args]
    kw = dict(kv_norm_weight=w, kv_norm_eps=1e-6) if norm else {}
    got = torch.ops.kimi_kernels.mla_decode(*mine, scale, **kw)
    tol = dict(rtol=2**-7, atol=1e-6) if norm else dict(rtol=0, atol=0)
    torch.testing.assert_close(mine[4].float(), want_args[4].float(), **tol)
    bound = 2**-6 * want.float().abs().amax(-1, keepdim=True) + 1e-6
    assert ((got.float() - want.float()).abs() <= bound).all()


@pytest.mark.parametrize("N, L, RD, block, per_req", SHAPES)
def test_wide_table_splits_each_request(N, L, RD, block, per_req):
    """A table sized for a far longer max_model_len than the contexts (as vLLM's is):
    each request's positions are split by its own length, down to one BS step each."""
    R, q = 3, 1
    args, scale = _case(R, q, N, L, RD, block, 8 * per_req, torch.bfloat16, seed=7, longest=per_req * block // 2)
    n_split = M.splits(R, 1, 8 * per_req * block)
    assert n_split * M.BS > int(args[-1].max()), "some splits must hold no positions of the request"
    want = M.reference(*args, scale)
    got = torch.ops.kimi_kernels.mla_decode(*[a.clone() for a in args], scale)
    bound = 2**-6 * want.float().abs().amax(-1, keepdim=True) + 1e-6
    assert ((got.float() - want.float()).abs() <= bound).all()


@pytest.mark.parametrize("N, L, RD, block, per_req", SHAPES)
@pytest.mark.parametrize("rank", [0, 1, 2])
@pytest.mark.parametrize("with_selection", [False, True])
def test_dcp_partials_match_stock(N, L, RD, block, per_req, rank, with_selection):
    """DCP = 3: the cache is this rank's (every third position), slots are global, and
    DSA's selection narrows what is visible."""
    R, q, size = 3, 2, 3
    args, scale = _case(R, q, 3 * N, L, RD, block, per_req, torch.bfloat16, seed=rank)
    T = R * q
    selected = None
    if with_selection:
        g = torch.Generator().manual_seed(5)
        selected = (torch.rand(T, per_req * block, generator=g) < 0.3).to(DEVICE)
    ql, qp, kv_c, k_pe, cache, slots, table, seq = args
    # global slots over virtual blocks of block * size positions
    pos = (seq.long()[:, None] - q + torch.arange(q, device=DEVICE)).clamp(min=0)
    slots = (table.long().gather(1, pos // (block * size)) * block * size + pos % (block * size)).view(-1)
    slots[-q:] = -1
    full = (ql, qp, kv_c, k_pe, cache, slots, table, seq, selected, rank, size, scale)
    mine = [a.clone() if isinstance(a, torch.Tensor) else a for a in full]
    want_out, want_lse = torch.ops.kimi.mla_decode_dcp(*full)
    got_out, got_lse = torch.ops.kimi_kernels.mla_decode_dcp(*mine)
    assert torch.equal(mine[4], cache)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-4, atol=1e-4)
    bound = 2**-6 * want_out.abs().amax(-1, keepdim=True) + 1e-6
    assert ((got_out - want_out).abs() <= bound).all()


def test_splits_use_static_sizes_only():
    assert M.splits(1, 1, 64 * 1024) == 64 and M.splits(64, 2, 4096) == 2 and M.splits(1, 1, 16) == 1
    for requests in (1, 2, 8, 32, 64, 100, 300):  # one wave of two programs per SM
        n = M.splits(requests, 1, 4096)
        assert n == 1 or requests * n <= 2 * M.SMS
    assert [M.row_block(n) for n in (1, 12, 24, 96)] == [16, 16, 32, 64]
    # the step's own split: one more for one request, in place of one where that costs
    # the others no BS step, else none (the cache written first)
    assert [M.splits(r, 1, 4096, most=256, fresh=True) for r in (1, 2, 8, 32)] == [129, 0, 33, 0]


@pytest.mark.parametrize("N, L, RD, block, per_req", SHAPES)
@pytest.mark.parametrize("R, q", [(3, 1), (2, 4)])
def test_dsa_matches_stock(N, L, RD, block, per_req, R, q):
    """DSA without DCP: stock's indexer top-k (a quarter of the capacity), then the kernel
    over the selected positions; both caches written as stock writes them."""
    args, scale = _case(R, q, N, L, RD, block, per_req, torch.bfloat16, seed=R + q)
    ql, qp, kv_c, k_pe, cache, slots, table, seq = args
    g = torch.Generator().manual_seed(7)
    n_idx, d_idx = 2, 16
    index_cache = torch.randn(cache.shape[0], block, d_idx, generator=g).to(torch.bfloat16).to(DEVICE)
    index = [torch.randn(R * q, n_idx, d_idx, generator=g).to(torch.bfloat16).to(DEVICE),
             torch.randn(R * q, d_idx, generator=g).to(torch.bfloat16).to(DEVICE),
             torch.rand(R * q, n_idx, generator=g).to(torch.bfloat16).to(DEVICE)]
    full = (ql, qp, kv_c, k_pe, *index, cache, index_cache, slots, table, seq, per_req * block // 4, scale)
    mine = [a.clone() if isinstance(a, torch.Tensor) else a for a in full]
    want = torch.ops.kimi.dsa_decode(*full)
    got = torch.ops.kimi_kernels.dsa_decode(*mine)
    assert torch.equal(mine[7], cache) and torch.equal(mine[8], index_cache)
    bound = 2**-6 * want.float().abs().amax(-1, keepdim=True) + 1e-6
    assert ((got.float() - want.float()).abs() <= bound).all()


@pytest.mark.skipif(DEVICE != "cuda" and not M.INTERPRET, reason="needs a GPU or TRITON_INTERPRET=1")
def test_insert_takes_views_as_vllm_hands_them():
    """The cache write from a strided kv_c and a [T, 1, R] k_pe view (vLLM's MLA spelling)
    equals stock's ``write_cache`` of their concatenation; slot -1 is not written."""
    from kimi_inductor.stock.mla import write_cache

    g = torch.Generator().manual_seed(0)
    T, L, RD, block = 5, 32, 8, 4
    kv_a = torch.randn(T, L + RD + 16, generator=g).bfloat16().to(DEVICE)  # [kv_c | k_pe | more] rows
    kv_c, k_pe = kv_a[:, :L], kv_a[:, L:L + RD].unsqueeze(1)
    # no slot in block 0: stock's write_cache rewrites slot 0 for slot -1 (block 0 is
    # never used), so a real write there would race with it on the GPU
    slots = torch.tensor([5, 17, -1, 4, 9], device=DEVICE)
    cache = torch.randn(6, block, L + RD, generator=g).bfloat16().to(DEVICE)
    want = cache.clone()
    write_cache(want, slots, torch.cat([kv_c, k_pe[:, 0]], dim=-1))
    M.insert(cache, slots, kv_c, k_pe)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("N, L, RD, block, per_req", SHAPES[:1])
def test_the_core_takes_views_as_vllm_hands_them(N, L, RD, block, per_req, cache_write):
    """kv_c a row-strided slice of the fused projection's output and k_pe a [T, 1, R] view
    of it (vLLM's MLA spelling): the same cache and output as contiguous copies."""
    args, scale = _case(3, 2, N, L, RD, block, per_req, torch.bfloat16, seed=13)
    T = args[2].shape[0]
    fused = torch.randn(T, 8 + L + RD + 8, generator=torch.Generator().manual_seed(2)).bfloat16().to(DEVICE)
    fused[:, 8:8 + L], fused[:, 8 + L:8 + L + RD] = args[2], args[3]
    views = [a.clone() for a in args]
    views[2], views[3] = fused[:, 8:8 + L], fused[:, 8 + L:8 + L + RD].unsqueeze(1)
    want = torch.ops.kimi_kernels.mla_decode(*args, scale)
    got = torch.ops.kimi_kernels.mla_decode(*views, scale)
    assert torch.equal(views[4], args[4]) and torch.equal(got, want)


@pytest.mark.skipif(DEVICE != "cuda" and not M.INTERPRET, reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("N, L, RD, block, per_req", SHAPES[:1])
def test_kv_norm_in_the_cache_write(N, L, RD, block, per_req, cache_write):
    """``mla_decode(..., kv_norm_weight=w)``: kv_c before the layer's kv_a RMSNorm, applied
    by the cache write: the rows stock's ``rms_norm`` then write give, within one bf16
    rounding (the mean of squares sums in another order), and the attention over them."""
    from kimi_inductor.stock.attn_res import rms_norm

    args, scale = _case(3, 2, N, L, RD, block, per_req, torch.bfloat16, seed=5)
    w = (1 + 0.1 * torch.randn(L, generator=torch.Generator().manual_seed(1))).bfloat16().to(DEVICE)
    want_args = [a.clone() for a in args]
    want_args[2] = rms_norm(want_args[2], w, 1e-6)
    want = M.reference(*want_args, scale)
    mine = [a.clone() for a in args]
    got = torch.ops.kimi_kernels.mla_decode(*mine, scale, kv_norm_weight=w, kv_norm_eps=1e-6)
    torch.testing.assert_close(mine[4].float(), want_args[4].float(), rtol=2**-7, atol=1e-6)
    bound = 2**-6 * want.float().abs().amax(-1, keepdim=True) + 1e-6
    assert ((got.float() - want.float()).abs() <= bound).all()


@pytest.mark.parametrize("N, L, RD, block, per_req", SHAPES[:1])
@pytest.mark.parametrize("R", [2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_merge_inside_the_gated_v_up_projection(R, N, L, RD, block, per_req, dtype, cache_write, monkeypatch):
    """``mla_decode_gated``: the splits merged inside MLA's v up-projection and output
    gate. The cache writes equal ``mla_decode``'s; the result is stock's tail
    (``output_gate`` of the rounded bmm) on ``mla_decode``'s output within one ulp of each
    rounding (the product's fp32 sums differ in order), zero for the padding request, and
    bitwise the same when called again (the arrival counters reset). On the CPU the
    latent is split in two merge blocks (the GPU's 512 in 32), so the head's last program
    sums blocks of others."""
    from kimi_inductor.stock.mla import output_gate

    if DEVICE == "cpu":
        monkeypatch.setattr(M, "merge_block", lambda L, sp: L // 2)

    args, scale = _case(R, 1, N, L, RD, block, per_req, dtype, seed=R)
    V = 128 if DEVICE == "cuda" else 24  # not a power of two on the CPU: the masked columns
    g = torch.Generator().manual_seed(R)
    w = (torch.randn(N, V, L + 8, generator=g) * L**-0.5).to(dtype).to(DEVICE)[..., :L].transpose(1, 2)
    gate = torch.randn(R, N * V + 16, generator=g).to(dtype).to(DEVICE)[:, 8:8 + N * V]
    plain, fused = [a.clone() for a in args], [a.clone() for a in args]
    attn = torch.ops.kimi_kernels.mla_decode(*plain, scale)
    got = torch.ops.kimi_kernels.mla_decode_gated(*fused, scale, w, gate)
    assert torch.equal(fused[4], plain[4])
    want = output_gate((attn.float().transpose(0, 1) @ w.float()).to(dtype).transpose(0, 1).reshape(R, N * V), gate)
    assert got.shape == want.shape and got.dtype == dtype and not got[-1].any()
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
    assert ((got.float() - want.float()).abs() <= ulp * want.float().abs().clamp_min(1.0) + 1e-3).all()
    assert torch.equal(torch.ops.kimi_kernels.mla_decode_gated(*[a.clone() for a in args], scale, w, gate), got)
    assert not M.arrival_counters(got.device, N)[:N].any()
    with pytest.raises(ValueError, match="gate \\[T, N V\\]"):
        torch.ops.kimi_kernels.mla_decode_gated(*args, scale, w, gate[:, :-8])
