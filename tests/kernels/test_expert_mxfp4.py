"""The SM90 MXFP4 expert kernels (kernels/expert_mxfp4.py): their weight layout on the CPU
(a bijection of the checkpoint's bytes; read back with the kernel's own bit arithmetic,
emulated in torch, it is the dequantised expert exactly), their sm_90a compile without a
GPU, and on the GPU the op on experts in that layout (``mma_grouped``) against the stock
loop on the dequantised experts and against the Triton MXFP4 kernel (tolerance as
tests/kernels/test_expert_ffn.py: fp32 sums in another order).
"""

import pytest
import torch

import kimi_inductor.kernels  # noqa: F401
from kimi_inductor.kernels import expert_ffn as X
from kimi_inductor.kernels import expert_mxfp4 as MX
from kimi_inductor.kernels.skinny_gemm import cute_available
from kimi_inductor.stock.mxfp4 import dequantize_experts

needs_cute = pytest.mark.skipif(bool(cute_available()), reason=cute_available() or "")
on_gpu = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                            reason="needs an SM90+ GPU")


def _checkpoint(E, N, K, seed=0, lo=100, hi=129, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    codes = torch.randint(0, 256, (E, N, K // 2), generator=g, device=device, dtype=torch.uint8)
    scales = torch.randint(lo, hi, (E, N, K // 32), generator=g, device=device, dtype=torch.uint8)
    return codes, scales


def _routed(T, k, E, L, I):
    """Random K3-like routing (local, other ranks' and padding ids) and MXFP4 experts on the
    GPU: (latent, weights, ids, checkpoint (q13, s13, q2, s2), MMA layout (c13, t13, c2, t2))."""
    g = torch.Generator().manual_seed(T * k)
    ids = torch.randint(-1, 2 * E, (T, k), generator=g).int().cuda()
    latent = torch.randn(T, L, generator=g).to(torch.bfloat16).cuda()
    weights = torch.rand(T, k, generator=g).cuda()
    return (latent, weights, ids) + _experts(E, L, I, 1, 115, 125)


def _hot():
    """One hot expert (80 pairs: several passes), one with 11 pairs, one with 7 (the
    one-tile loop at any tiles), padding and remote ids, small shapes."""
    E, L, I, T = 4, 512, 256, 80
    ids = torch.tensor([[1, E + 1]] * T)
    ids[::7, 1] = 0
    ids[5::11, 1] = 2
    ids[3] = -1
    return (torch.randn(T, L).to(torch.bfloat16).cuda(), torch.rand(T, 2).cuda(), ids.int().cuda()) + \
        _experts(E, L, I, 3, 118, 126)


def _experts(E, L, I, seed, lo, hi):
    q13, s13 = _checkpoint(E, 2 * I, L, seed=seed, lo=lo, hi=hi, device="cuda")
    q2, s2 = _checkpoint(E, L, I, seed=seed + 1, lo=118, hi=126, device="cuda")
    return (q13, s13, q2, s2), MX.mma_layout(q13, s13, True) + MX.mma_layout(q2, s2, False)


def _close(got, other, what=""):
    err = (got - other).norm(dim=1) / other.norm(dim=1).clamp_min(1e-6)
    assert err.max() < 1e-2, f"{what}row relative error {err.max():.2e}"
    assert ((got - other).abs() <= 2**-5 * other.abs().amax(1, keepdim=True) + 1e-6).all()


def _kernel_read(codes, scales, gate_up):
    """The weights as the kernel reads the MMA layout: each lane's words through the
    upcast's integer ops, its scale word from lane (g, chunk % 4), placed at the MMA
    fragment's (row, K) position."""
    E, NB, KC = codes.shape[:3]
    N, K = 16 * NB, MX.CHUNK * KC
    rows = MX._block_rows(N, gate_up)
    w = codes.view(torch.int32).long() & 0xFFFFFFFF
    sw = scales.view(torch.int32).squeeze(-1).long() & 0xFFFFFFFF
    W = torch.zeros(E, N, K)
    for i in range(4):
        v = sum((((w << r) | (w >> (32 - r))) & 0xFFFFFFFF) & m for r, m in MX.PARTS[i])  # rotations, masks
        for h in range(2):
            bits = ((v >> (16 * h)) & 0xFFFF).to(torch.int32) << 16
            val = bits.view(torch.float32)  # [E, NB, KC, lane, j]: the E2M1 value x 2^-126
            for lane in range(32):
                g, q = divmod(lane, 4)
                for c in range(KC):
                    word = sw[:, :, c // 4, 4 * g + c % 4]  # the shuffle
                    for j in range(4):
                        s = (word >> (8 * (2 * (j // 2) + (i & 1)))) & 0xFF
                        f = (((s + 126) << 7) << 16).to(torch.int32).view(torch.float32)  # bf16 2^(s - 1)
                        k = MX.CHUNK * c + 32 * (j >> 1) + 8 * q + 4 * (j & 1) + 2 * (i >> 1) + h
                        W[:, rows[:, g + 8 * (i & 1)], k] = (val[:, :, c, lane, j] * f).bfloat16().float()
    return W


@pytest.mark.parametrize("gate_up", [False, True])
def test_mma_layout_is_a_bijection_of_the_checkpoint_bytes(gate_up):
    codes, scales = _checkpoint(3, 64, 768)
    c, s = MX.mma_layout(codes, scales, gate_up)
    assert c.dtype == torch.uint8 and c.numel() == codes.numel() and s.numel() == scales.numel()
    back = MX.checkpoint_layout(c, s, gate_up)
    assert torch.equal(back[0], codes) and torch.equal(back[1], scales)


@pytest.mark.parametrize("gate_up", [False, True])
def test_kernel_reads_the_dequantised_experts_exactly(gate_up):
    codes, scales = _checkpoint(2, 32, 512, lo=0, hi=MX.MAX_SCALE + 1)  # every E8M0 scale the layout takes
    got = _kernel_read(*MX.mma_layout(codes, scales, gate_up), gate_up)
    assert torch.equal(got, dequantize_experts(codes, scales).float())


def test_scales_above_two_keep_the_checkpoint_layout():
    codes, scales = _checkpoint(1, 32, 512)
    scales[0, 3, 5] = MX.MAX_SCALE + 1  # 2^2: its 2^(s - 1) is not a finite bf16
    with pytest.raises(ValueError, match="E8M0 scale byte 129.*checkpoint's layout"):
        MX.mma_layout(codes, scales, True)


@needs_cute
@pytest.mark.parametrize("gate_up, tiles", [(True, 1), (False, 1), (True, 4), (False, 2), (True, 2)])
def test_compiles_for_sm90a(gate_up, tiles):
    N, K = (6144, 3584) if gate_up else (3584, 3072)
    MX.compile_projection(gate_up, 112, N, K, 8, 128, 16, tiles, 4, 1.0, 1.0, True, arch="sm_90a",
                          rb=MX.blocks_per_warp(tiles, N // 16))


@pytest.mark.gpu
@on_gpu
@needs_cute
@pytest.mark.parametrize("E, L, I", [(8, 3584, 3072), (5, 512, 256)])
@pytest.mark.parametrize("T, k", [(1, 16), (8, 16), (64, 16), (5, 3)])
def test_mma_grouped_matches_the_stock_loop(T, k, E, L, I):
    latent, weights, ids, (q13, s13, q2, s2), (c13, t13, c2, t2) = _routed(T, k, E, L, I)
    got = torch.ops.kimi_kernels.expert_ffn(latent, weights, ids, c13, c2, 4.0, 25.0, t13, t2)  # its 5-D layout
    want = X.reference(latent, weights, ids, q13, q2, 4.0, 25.0, s13, s2)
    triton = X.grouped(latent, weights, ids, q13, q2, 4.0, 25.0, s13, s2)
    for other in (want, triton):
        _close(got, other)
    assert (got[(ids < 0).all(1)] == 0).all()


@pytest.mark.gpu
@on_gpu
@needs_cute
def test_mma_grouped_hot_expert_takes_several_passes():
    latent, weights, ids, (q13, s13, q2, s2), (c13, t13, c2, t2) = _hot()
    want = X.reference(latent, weights, ids, q13, q2, 4.0, 25.0, s13, s2)
    one = X.mma_grouped(latent, weights, ids, c13, c2, 4.0, 25.0, t13, t2, tiles=1)
    for tiles in (1, 2, 4):
        for rb in (1, 2):
            got = X.mma_grouped(latent, weights, ids, c13, c2, 4.0, 25.0, t13, t2, tiles=tiles, rb=rb)
            _close(got, want, f"{tiles} tiles, {rb} blocks per warp: ")
            assert torch.equal(got, one)  # every output's dot in the same order
    # a launch bound (``expert_mxfp4_sweep.py --min-blocks``) changes registers, not values
    # (its compile queries the device: GPU only)
    assert torch.equal(X.mma_grouped(latent, weights, ids, c13, c2, 4.0, 25.0, t13, t2, tiles=2, min_blocks=4), one)
