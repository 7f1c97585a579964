"""kimi_kernels::dsa_select (the DSA indexer's scores and top-k) against stock's select_topk.

Selections must be equal (the scores differ from stock's fp32 einsum only in summation
order; the test data has no near-ties but many exact ones: ReLU zeros, padding requests,
requests with fewer visible positions than top-k); scores within 1e-4 relative.
"""

import pytest
import torch

import kimi_inductor.kernels  # noqa: F401
from kimi_inductor.kernels import dsa_index
from kimi_inductor.stock import dsa
from kimi_inductor.stock.mla import causal_mask, gather_context

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (heads, head_dim, block, blocks per request, topk): K3.1's indexer on the GPU, small in the interpreter
SHAPES = [(32, 128, 64, 64, 2048), (32, 128, 64, 8, 64)] if DEVICE == "cuda" else [(4, 16, 16, 4, 8), (8, 32, 8, 6, 20)]


def case(heads, dim, block, nblocks, q, seq_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    R = len(seq_lens)
    cache = torch.randn(R * nblocks + 3, block, dim, generator=g).to(torch.bfloat16)
    cache[:, ::3] = 0  # every third position scores exactly 0 (ReLU ties)
    table = torch.randperm(R * nblocks + 3, generator=g)[:R * nblocks].view(R, nblocks).int()
    index_q = torch.randn(R * q, heads, dim, generator=g).to(torch.bfloat16)
    index_w = torch.randn(R * q, heads, generator=g)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return [t.to(DEVICE) for t in (index_q, index_w, cache, table, lens)]


@pytest.mark.parametrize("heads, dim, block, nblocks, topk", SHAPES)
@pytest.mark.parametrize("q", [1, 3, 4])
def test_selection_matches_stock(heads, dim, block, nblocks, topk, q):
    cap = block * nblocks
    lens = [cap, cap // 2 + 5, q, 0, topk // 2 + q]  # full, partial, tiny, padding, fewer than top-k
    args = case(heads, dim, block, nblocks, q, lens, seed=q)
    got = torch.ops.kimi_kernels.dsa_select(*args, topk).cpu()
    cpu = [a.cpu() for a in args]
    want = dsa.select_topk(*cpu, topk)
    assert torch.equal(got, want)
    if DEVICE == "cuda" or dsa_index.INTERPRET:
        index_q, index_w, cache, table, lens_t = cpu
        keys = gather_context(cache, table)
        stock = dsa.index_scores(index_q.view(len(lens), q, heads, dim), index_w.view(len(lens), q, heads), keys,
                                 causal_mask(lens_t, q, keys.shape[1]))
        ours = dsa_index.scores(*args).cpu()
        assert torch.equal(ours.isinf(), stock.isinf())
        fin = stock.isfinite()
        assert torch.allclose(ours[fin], stock[fin], rtol=1e-4, atol=1e-4)


def test_select_breaks_ties_like_a_stable_sort():
    scores = torch.tensor([[[0.0, -0.0, 1.0, 1.0, float("-inf"), 0.5, -0.0, 1.0, -2.0, -2.0]]], device=DEVICE)
    lens = torch.tensor([10], dtype=torch.int32, device=DEVICE)
    for k in range(1, 11):
        assert torch.equal(dsa_index.select(scores, lens, k).cpu(), dsa.topk_mask(scores.cpu(), k)), k


@pytest.mark.parametrize("form", ["select", "radix_select"])
@pytest.mark.parametrize("width, topk", [(5000, 2048), (9000, 300), (700, 2048), (dsa_index.SELECT_MAX + 5, 3000)])
def test_select_matches_a_stable_sort(width, topk, form):
    """Rows of mixed magnitudes and signs, many exact ties (values on a coarse grid),
    causal -inf tails (q = 3) and a padding request; ``select`` holds rows up to
    SELECT_MAX in registers and sends wider ones to ``radix_select`` (chunks of
    RADIX_CHUNK), which takes every width."""
    g = torch.Generator().manual_seed(width)
    R, Q = 3, 3
    scale = 10.0 ** torch.randint(-3, 3, (R, Q, 1), generator=g)  # mixed magnitudes per row
    scores = (torch.randn(R, Q, width, generator=g) * 8).round() / 4 * scale
    lens = torch.tensor([width, width // 2 + 1, 0], dtype=torch.int32)
    visible = causal_mask(lens, Q, width)
    scores = scores.masked_fill(~visible, float("-inf"))
    got = getattr(dsa_index, form)(scores.to(DEVICE), lens.to(DEVICE), topk).cpu()
    assert torch.equal(got, dsa.topk_mask(scores, topk))


def test_positions_list_the_union_of_a_requests_selections():
    g = torch.Generator().manual_seed(3)
    selected = torch.rand(3, 4, 5000, generator=g) < torch.tensor([0.001, 0.05, 0.0]).view(3, 1, 1)
    lens = torch.tensor([5000, 2600, 9], dtype=torch.int32)  # shorter than the table: nothing selected past them
    selected &= torch.arange(5000) < lens.view(3, 1, 1)
    pos, counts = dsa_index.positions(selected.to(DEVICE), lens.to(DEVICE), topk=300)
    pos, counts = pos.cpu(), counts.cpu()
    assert pos.shape == (3, 1200)
    for r in range(3):
        want = selected[r].any(0).nonzero().flatten().int()
        assert counts[r] == len(want) and torch.equal(pos[r, :len(want)], want)
