"""kimi_kernels::skinny_mm against torch's GEMMs (bf16 out: within one bf16 ulp)."""

import pytest
import torch

import kimi_inductor.kernels  # noqa: F401

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (N, K): TP8 per-rank shapes on the GPU; small ones (incl. a K split) in the interpreter
SHAPES = [(6288, 7168), (7168, 1536), (896, 7168), (2304, 1536)] if DEVICE == "cuda" else [(48, 64), (32, 2048)]


@pytest.mark.parametrize("N, K", SHAPES)
@pytest.mark.parametrize("M", [1, 5, 16, 64])
@pytest.mark.parametrize("out_dtype, with_acc", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)])
def test_skinny_mm_matches_torch(M, N, K, out_dtype, with_acc):
    g = torch.Generator().manual_seed(M + N + K)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g) * K**-0.5).to(torch.bfloat16)
    acc = torch.randn(M, N, generator=g).to(out_dtype) if with_acc else None
    want = x.float() @ w.float().t()  # exact products, fp32 sums
    if acc is not None:
        want = want + acc.float()
    got = torch.ops.kimi_kernels.skinny_mm(x.to(DEVICE), w.to(DEVICE), None if acc is None else acc.to(DEVICE),
                                           out_dtype).cpu()
    assert got.dtype == out_dtype and got.shape == (M, N)
    ulp = 2.0**-7 if out_dtype == torch.bfloat16 else 1e-5
    assert ((got.float() - want).abs() <= ulp * want.abs().clamp_min(1.0) + 1e-3).all()
