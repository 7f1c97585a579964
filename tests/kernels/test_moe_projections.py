"""kimi_kernels::moe_in / moe_out (sharded_moe's projections in two launches) against their
references: moe_out's Triton kernel in the interpreter and on the GPU against its rounding
points in fp32 GEMMs, moe_in's CuTe GEMV on the GPU; moe_in compiles for sm_90a without a GPU."""

import pytest
import torch

from kimi_inductor.kernels import moe_projections as mp
from kimi_inductor.kernels import skinny_gemm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cute = pytest.mark.skipif(bool(skinny_gemm.cute_available()), reason=skinny_gemm.cute_available() or "")
# (H, D, L, E) of Kimi K3 on the GPU; small ones in the interpreter
SHAPE = (7168, 6144, 3584, 896) if DEVICE == "cuda" else (64, 96, 128, 16)
SITU = (4.0, 25.0)


def weights(H, D, L, E, seed=0):
    g = torch.Generator().manual_seed(seed)

    def proj(n, k):
        return (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16).to(DEVICE)

    return dict(router=proj(E, H), latent=proj(L, H), gate_up=proj(2 * D, H), down=proj(H, D), up=proj(H, L),
                norm=(1 + 0.1 * torch.randn(L, generator=g)).to(torch.bfloat16).to(DEVICE))


def rows(M, n, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(M, n, generator=g) * scale).to(torch.bfloat16).to(DEVICE)


@pytest.mark.parametrize("M", [1, 3, 8, 64])
@pytest.mark.parametrize("shard, shards", [(0, 1), (1, 2), (3, 8)])
def test_moe_out_matches_its_reference(M, shard, shards):
    """Same rounding points (the shared partial rounded to bf16, then the up-projection
    added in fp32 and rounded), fp32 summation order only (interpreter: fp32 dots; GPU:
    tensor cores): within one bf16 ulp of the shared partial plus one of the output. The
    want is that staged form in fp32 GEMMs, not ``moe_out_reference``: cuBLAS's bf16
    ``addmm`` on an H100 lands one output ulp off it (-8.375 for -8.3416 at [4, 5372] of
    the 8-row case: the product rounded before the accumulator is added)."""
    H, D, L, _ = SHAPE
    w = weights(*SHAPE)
    h, normed = rows(M, D // shards, M, 2.0), rows(M, L, M + 1)
    a, width = mp.blocks(D, shard, shards)
    la, lw = mp.blocks(L, shard, shards)
    shared = h.float() @ w["down"][:, a:a + width].float().t()
    up = normed[:, la:la + lw].float() @ w["up"][:, la:la + lw].float().t()
    want = (shared.to(torch.bfloat16).float() + up).to(torch.bfloat16)
    got = torch.ops.kimi_kernels.moe_out(h, normed, w["down"], w["up"], shard, shards)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert mp.implementation_out(h, normed)[0] == ("triton" if DEVICE == "cuda" or mp.INTERPRET else "reference")
    err = (got.float() - want.float()).abs()
    assert (err <= 2.0**-7 * (want.float().abs() + shared.abs()) + 1e-3).all(), err.max()


@pytest.mark.skipif(DEVICE != "cuda" and not mp.INTERPRET, reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("M", [5, 8, 64])
@pytest.mark.parametrize("shard, shards", [(0, 1), (1, 2), (3, 8)])
def test_moe_in_triton_matches_its_reference(M, shard, shards):
    """The Triton moe_in (past the CuTe GEMV's rows): logits are fp32 sums of exact
    products (1e-5), the latent one bf16 rounding, h stock's SiTU rounding points (one bf16
    ulp of gate / up, two of h); rows masked past M, padded to 16 / 64."""
    w = weights(*SHAPE)
    x = rows(M, SHAPE[0], M)
    want = mp.moe_in_reference(x, w["router"], w["latent"], w["gate_up"], shard, shards, *SITU)
    got = mp.run_in(x, w["router"], w["latent"], w["gate_up"], shard, shards, *SITU)
    for g, ref, tol in zip(got, want, (1e-5, 2.0**-7, 2.0**-6)):
        assert g.shape == ref.shape and g.dtype == ref.dtype
        err = (g.float() - ref.float()).abs()
        assert (err <= tol * ref.float().abs().clamp_min(1.0) + 1e-4).all(), err.max()


@pytest.mark.gpu
@needs_cute
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("shard, shards", [(0, 8), (5, 8), (1, 2)])
def test_moe_in_matches_its_reference(M, shard, shards):
    """Logits: fp32 sums of exact products (1e-5); latent: one bf16 rounding; h: stock's
    SiTU rounding points (one bf16 ulp of gate / up, two of h). Three calls bitwise equal."""
    w = weights(*SHAPE)
    x = rows(M, SHAPE[0], M)
    assert mp.implementation_in(x, w["router"], w["latent"], w["gate_up"], shards) == ("cute", "")
    want = mp.moe_in_reference(x, w["router"], w["latent"], w["gate_up"], shard, shards, *SITU)
    outs = [torch.ops.kimi_kernels.moe_in(x, w["router"], w["latent"], w["gate_up"], shard, shards, *SITU)
            for _ in range(3)]
    for got, ref, tol in zip(outs[0], want, (1e-5, 2.0**-7, 2.0**-6)):
        assert got.shape == ref.shape and got.dtype == ref.dtype
        err = (got.float() - ref.float()).abs()
        assert (err <= tol * ref.float().abs().clamp_min(1.0) + 1e-4).all(), err.max()
    assert all(torch.equal(a, b) for o in outs[1:] for a, b in zip(o, outs[0]))


@pytest.mark.gpu
@needs_cute
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 2, 4])
@pytest.mark.parametrize("E, k, renormalize, scale", [(896, 16, True, 2.5), (896, 32, False, 1.0), (48, 6, True, 1.0)])
def test_moe_in_chooses_the_experts(M, E, k, renormalize, scale):
    """The choice made by the last router CTA is ``select_experts`` of the kernel's own
    logits: the same experts in the same order, weights to fp32 rounding; the last row
    is a zero (padding) row; ten calls, so the arrival counter resets."""
    from kimi_inductor.kernels.skinny_gemm import cute_gemv
    from kimi_inductor.stock.moe import select_experts

    H, D, L, _ = SHAPE
    w = weights(H, D, L, E)
    x = rows(M, H, M)
    x[-1] = 0
    bias = (torch.randn(E, generator=torch.Generator().manual_seed(E)) * 0.1).to(DEVICE)
    assert mp.fused_routing(x, w["router"], k, renormalize, scale) is not None
    for _ in range(10):
        logits, *_, weights_, ids = torch.ops.kimi_kernels.moe_in(x, w["router"], w["latent"], w["gate_up"], 1, 8,
                                                                  *SITU, bias, k, renormalize, scale)
        want_w, want_ids = select_experts(logits, bias, k, renormalize, scale)
        assert ids.dtype == torch.int32 and ids.shape == (M, k) and torch.equal(ids, want_ids.int())
        torch.testing.assert_close(weights_, want_w, rtol=2e-6, atol=1e-7)
    assert cute_gemv.routing_supported(M, cute_gemv.moe_in_config(M), cute_gemv.Routing(E, 33, True, 1.0))


@pytest.mark.gpu
@needs_cute
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
def test_moe_in_choice_breaks_ties_by_index():
    """All 896 scores equal (zero rows, zero bias: past the threshold's candidate limit):
    the k lowest experts, as ``select_experts``' order; renormalised weights 1/k."""
    H, D, L, E = SHAPE
    w = weights(H, D, L, E)
    x, bias = torch.zeros(2, H, dtype=torch.bfloat16, device=DEVICE), torch.zeros(E, device=DEVICE)
    *_, weights_, ids = torch.ops.kimi_kernels.moe_in(x, w["router"], w["latent"], w["gate_up"], 0, 8, *SITU, bias,
                                                      16, True, 2.0)
    assert torch.equal(ids.cpu(), torch.arange(16, dtype=torch.int32).expand(2, 16))
    torch.testing.assert_close(weights_, torch.full_like(weights_, 2.0 / 16))


def test_moe_in_routed_reference_is_select_experts():
    """Off the GPU kernel, moe_in's choice is the ``select_experts`` op after the reference
    (stock's math on CPU, its Triton kernel in the interpreter)."""
    H, D, L, E = 64, 96, 128, 16
    w = {k: v.cpu() for k, v in weights(H, D, L, E).items()}
    x, bias = rows(3, H, 0).cpu(), torch.linspace(-0.1, 0.1, E)
    logits, z, h, weights_, ids = torch.ops.kimi_kernels.moe_in(x, w["router"], w["latent"], w["gate_up"], 1, 2,
                                                                *SITU, bias, 4, True, 2.5)
    want_w, want_ids = torch.ops.kimi_kernels.select_experts(logits, bias, 4, True, 2.5)
    assert torch.equal(weights_, want_w) and torch.equal(ids, want_ids)
    assert torch.ops.kimi_kernels.moe_in(x, w["router"], w["latent"], w["gate_up"], 1, 2, *SITU)[3].shape == (3, 0)


@needs_cute
@pytest.mark.parametrize("M, routed", [(1, True), (4, True), (8, False)])
def test_moe_in_compiles_for_sm90a(M, routed):
    from kimi_inductor.kernels.skinny_gemm import cute_gemv

    routing = cute_gemv.Routing(896, 16, True, 2.5) if routed else None
    exe = cute_gemv.compile_moe_in(M, 7168, 896, 3584, 12288, 768, SITU, cute_gemv.moe_in_config(M), routing,
                                   pdl=routed, arch="sm_90a")
    assert exe.has_gpu_module


def test_moe_in_reference_is_the_replaced_ops():
    """On CPU the op is its reference: the router's fp32 logits, the latent GEMM and
    stock's SiTU of the gate / up blocks of rank 1 of 2."""
    from kimi_inductor.stock.layers import situ_and_mul

    H, D, L, E = 64, 96, 128, 16
    w = {k: v.cpu() for k, v in weights(H, D, L, E).items()}
    x = rows(3, H, 0).cpu()
    logits, z, h, _, _ = torch.ops.kimi_kernels.moe_in(x, w["router"], w["latent"], w["gate_up"], 1, 2, *SITU)
    gu = w["gate_up"].float()
    assert torch.equal(logits, x.float() @ w["router"].float().t())
    assert torch.equal(z, x @ w["latent"].t())
    blocks = torch.cat([x @ w["gate_up"][48:96].t(), x @ w["gate_up"][144:192].t()], 1)
    assert torch.equal(h, situ_and_mul(blocks, *SITU)) and gu.shape == (2 * D, H)
