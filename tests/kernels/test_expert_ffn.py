"""kimi_kernels::expert_ffn (grouped Triton experts) against the stock expert loop.

Tolerance: the kernel and the reference round the same values to bf16 at the same
points, but their fp32 dot products sum in different orders, so an intermediate can
round to the neighbouring bf16 value; per row the relative error stays below 1e-2
(measured: < 5e-4 on H200 at Kimi K3's shapes, < 4e-4 in the interpreter) and no
element is off by more than 2^-5 of the row's largest.
"""

import pytest
import torch

import kimi_inductor.kernels  # noqa: F401
from kimi_inductor.kernels import expert_ffn as X
from kimi_inductor.stock.mxfp4 import dequantize_experts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (experts, latent L, width I): Kimi K3's expert shapes on the GPU (8 of a rank's 112),
# small ones with ragged tiles in the interpreter
SHAPES = [(8, 3584, 3072)] if DEVICE == "cuda" else [(5, 64, 48), (3, 160, 32)]


def _inputs(T, k, E, L, I, ids, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    latent = torch.randn(T, L, generator=g, device=DEVICE).to(dtype)
    weights = torch.rand(T, k, generator=g, device=DEVICE)
    w13 = (torch.randn(E, 2 * I, L, generator=g, device=DEVICE) * L**-0.5).to(dtype)
    w2 = (torch.randn(E, L, I, generator=g, device=DEVICE) * I**-0.5).to(dtype)
    return latent, weights, ids.to(DEVICE).int(), w13, w2


def _check(args, exact=False):
    got = torch.ops.kimi_kernels.expert_ffn(*args, 4.0, 25.0)
    want = X.reference(*args, 4.0, 25.0)
    assert got.dtype == torch.float32 and got.shape == want.shape
    if exact:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    err = (got - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-6)
    assert err.max() < 1e-2, f"row relative error {err.max():.2e}"
    assert ((got - want).abs() <= 2**-5 * want.abs().amax(1, keepdim=True) + 1e-6).all()


@pytest.mark.parametrize("E, L, I", SHAPES)
@pytest.mark.parametrize("T, k", [(1, 16), (8, 16), (64, 16), (5, 3)])
def test_random_routing(T, k, E, L, I):
    g = torch.Generator().manual_seed(T * k)
    # ids of local experts, of other ranks' experts (>= E) and padding (-1)
    ids = torch.randint(-1, 2 * E, (T, k), generator=g)
    _check(_inputs(T, k, E, L, I, ids, seed=T))


@pytest.mark.parametrize("E, L, I", SHAPES)
def test_hot_expert_spans_several_row_blocks_and_idle_experts_return(E, L, I):
    T, k = 80, 2
    ids = torch.tensor([[1, E + 1]] * T)  # every row: local expert 1 and a remote one
    ids[::7, 1] = 0
    ids[3] = -1  # a padding row: zero output
    args = _inputs(T, k, E, L, I, ids, seed=1)
    _check(args)
    assert not torch.ops.kimi_kernels.expert_ffn(*args, 4.0, 25.0)[3].any()


def test_fp32_matches_the_loop_exactly():
    E, L, I = SHAPES[-1]
    ids = torch.randint(-1, E + 1, (6, 4), generator=torch.Generator().manual_seed(2))
    _check(_inputs(6, 4, E, L, I, ids, dtype=torch.float32), exact=True)


def test_pairs_are_grouped_by_local_expert():
    ids = torch.tensor([[2, -1, 0], [5, 2, 1], [0, 0, 9]], device=DEVICE)
    order, starts, counts, position, slots = X.group_pairs(ids, experts=3)
    assert counts.tolist() == [3, 1, 2] and starts.tolist() == [0, 3, 4]
    assert order[:6].tolist() == [2, 6, 7, 5, 0, 4]  # stable: row order within an expert
    assert position.tolist() == [4, -1, 0, -1, 5, 3, 1, 2, -1]
    assert slots.tolist() == [0, 1, 2]


@pytest.mark.parametrize("T, k, E", [(1, 16, 112), (1, 16, 896), (8, 16, 896), (16, 16, 112), (5, 3, 4),
                                     (16, 16, 64), (64, 16, 112), (37, 16, 896)])
def test_one_launch_grouping_is_torch_s(T, k, E, monkeypatch):
    """``_group_kernel`` (up to GROUP_PAIRS_MAX pairs) gives torch's stable sort, counts,
    starts, positions and slots, with remote ids and padding; past it, torch's runs."""
    ids = torch.randint(-1, E + E // 2, (T, k), generator=torch.Generator().manual_seed(T)).to(DEVICE)
    got = X.group_pairs(ids, E)
    monkeypatch.setattr(X, "GROUP_PAIRS_MAX", 0)
    want = X.group_pairs(ids, E)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.int32 and torch.equal(g.cpu(), w.cpu())


def _ulps(x, ref):
    """|x - ref| in units of fp32 ulp at |ref|."""
    step = torch.nextafter(ref.abs(), torch.tensor(float("inf"), device=ref.device)) - ref.abs()
    return ((x - ref).abs() / step).max().item()


@pytest.mark.parametrize("lo, hi", [(-7.0, -3.0), (-3.0, -1.0), (-1.5, -0.25)])
def test_fp32_situ_is_accurate_at_small_arguments(lo, hi):
    """The kernel's fp32 SiTU against torch's at tanh arguments 10^lo..10^hi (below 0.6:
    the polynomial branch). ``(1 - e) / (1 + e)`` with e = exp(-2|x|) cancelled there: off
    by 63 ulp at |u / 25| = 0.007, by millions (0) below 1e-7. One-hot latents and an
    identity down projection make the op's output the up kernel's SiTU itself."""
    n, beta, linear_beta = 32, 4.0, 25.0
    g = torch.Generator().manual_seed(int(-lo * 10))

    def args():  # magnitudes log-uniform in 10^lo..10^hi, random signs: [n, n]
        sign = torch.where(torch.rand(n, n, generator=g) < 0.5, -1.0, 1.0)
        return sign * 10 ** (torch.rand(n, n, generator=g) * (hi - lo) + lo)

    gate, up = beta * args(), linear_beta * args()  # gate[i, t]: latent row t (one-hot), column i
    w13 = torch.cat([gate, up])[None].to(DEVICE)
    eye = torch.eye(n, device=DEVICE)
    got = torch.ops.kimi_kernels.expert_ffn(eye, torch.ones(n, 1, device=DEVICE),
                                            torch.zeros(n, 1, dtype=torch.int32, device=DEVICE), w13, eye[None],
                                            beta, linear_beta)
    g_t, u_t = gate.T.to(DEVICE), up.T.to(DEVICE)  # got[t, i] = SiTU(gate[i, t], up[i, t])
    torch_fp32 = beta * torch.tanh(g_t / beta) * torch.sigmoid(g_t) * (linear_beta * torch.tanh(u_t / linear_beta))
    g64, u64 = g_t.double(), u_t.double()
    exact = (beta * torch.tanh(g64 / beta) * torch.sigmoid(g64) * (linear_beta * torch.tanh(u64 / linear_beta))).float()
    # measured: interpreter 2-4 ulp (torch 2-4); H200 5-6 (torch 5-7): its exp, sigmoid and division approximate
    assert _ulps(got, exact) <= _ulps(torch_fp32, exact) + 2
    assert _ulps(got, torch_fp32) <= (4 if DEVICE == "cpu" else 8)


# MXFP4 experts: widths multiples of 32 (one scale per 32 values)
MX_SHAPES = [(4, 3584, 3072)] if DEVICE == "cuda" else [(5, 64, 64), (3, 160, 32)]


def _mxfp4(w):
    """[E, N, K] -> the checkpoint's MXFP4 (packed [E, N, K / 2], scales [E, N, K / 32])."""
    from kimi_inductor.stock.mxfp4 import mxfp4_quantize

    E, N, K = w.shape
    packed, scales = mxfp4_quantize(w.reshape(E * N, K))
    return packed.view(E, N, K // 2), scales.view(E, N, K // 32)


@pytest.mark.parametrize("E, L, I", MX_SHAPES)
@pytest.mark.parametrize("T, k", [(1, 16), (8, 16), (5, 3)])
def test_mxfp4_experts_are_the_experts_of_their_dequantised_weights(T, k, E, L, I):
    """expert_ffn with MXFP4 experts (codes + scales) upcasts each weight tile to the bf16
    values ``dequantize_experts`` gives: within the tolerance above of the stock loop on
    the dequantised experts."""
    g = torch.Generator().manual_seed(T * k + 1)
    ids = torch.randint(-1, 2 * E, (T, k), generator=g)
    latent, weights, ids, w13, w2 = _inputs(T, k, E, L, I, ids, seed=T + 1)
    (q13, s13), (q2, s2) = _mxfp4(w13), _mxfp4(w2)
    deq13, deq2 = dequantize_experts(q13, s13), dequantize_experts(q2, s2)
    assert deq13.shape == w13.shape and deq2.shape == w2.shape
    got = torch.ops.kimi_kernels.expert_ffn(latent, weights, ids, q13, q2, 4.0, 25.0, s13, s2)
    want = X.reference(latent, weights, ids, deq13, deq2, 4.0, 25.0)
    err = (got - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-6)
    assert err.max() < 1e-2, f"row relative error {err.max():.2e}"
    assert ((got - want).abs() <= 2**-5 * want.abs().amax(1, keepdim=True) + 1e-6).all()


@pytest.mark.parametrize("T, k", [(1, 4), (3, 4), (40, 4)])
def test_grid_over_busy_experts_gives_the_same_result(T, k):
    """The grid over min(E, T k) expert slots, slot i taking the i-th expert with pairs
    (fewer than E slots at one row, E when T k >= E), and for MXFP4 the L2 prefetch:
    bitwise what a program per expert computes, with padding (-1) and other ranks' ids."""
    E, L, I = MX_SHAPES[0]
    ids = torch.randint(-1, E + 3, (T, k), generator=torch.Generator().manual_seed(T))
    latent, weights, ids, w13, w2 = _inputs(T, k, E, L, I, ids, seed=T)
    (q13, s13), (q2, s2) = _mxfp4(w13), _mxfp4(w2)
    for experts in ((w13, w2, None, None), (q13, q2, s13, s2)):
        args = (latent, weights, ids, *experts[:2], 4.0, 25.0, *experts[2:])
        assert torch.equal(X.grouped(*args), X.grouped(*args, compact=False, prefetch=0))


def test_mxfp4_upcast_is_exact_for_every_e8m0_scale():
    """E8M0 scales 100..160 (2^-27..2^33, beyond the 2^1 where a one-multiply upcast
    overflows) and every code: the MXFP4 experts give what the same kernels give on their
    dequantised bf16 experts, up to fp32 summation order."""
    E, L, I = MX_SHAPES[0]
    g = torch.Generator().manual_seed(7)

    def packed(n, k):
        return (torch.randint(0, 256, (E, n, k // 2), generator=g, dtype=torch.uint8).to(DEVICE),
                torch.randint(100, 161, (E, n, k // 32), generator=g, dtype=torch.uint8).to(DEVICE))

    (q13, s13), (q2, s2) = packed(2 * I, L), packed(L, I)
    ids = torch.randint(0, E, (4, 2), generator=g, dtype=torch.int32).to(DEVICE)
    weights = torch.rand(4, 2, generator=g).to(DEVICE)
    latent = (torch.randn(4, L, generator=g) * 2.0**-40).to(DEVICE, torch.bfloat16)
    got = torch.ops.kimi_kernels.expert_ffn(latent, weights, ids, q13, q2, 4.0, 25.0, s13, s2)
    want = torch.ops.kimi_kernels.expert_ffn(latent, weights, ids, dequantize_experts(q13, s13),
                                             dequantize_experts(q2, s2), 4.0, 25.0)
    assert torch.isfinite(got).all()
    err = (got - want).norm(dim=1) / want.norm(dim=1)
    assert err.max() < 1e-2, f"row relative error {err.max():.2e}"
