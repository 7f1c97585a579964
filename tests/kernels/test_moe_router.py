"""kimi_kernels::select_experts against stock's select_experts: the same experts in the same
order (no exact ties in random fp32 scores) and weights to fp32 rounding; the Triton
kernel in the interpreter on CPU, on the GPU for real."""

import pytest
import torch

from kimi_inductor.kernels import moe_router
from kimi_inductor.stock.moe import select_experts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("M, E, k", [(1, 896, 16), (64, 896, 16), (5, 48, 6), (0, 16, 2)])
@pytest.mark.parametrize("renormalize, scale", [(True, 2.5), (False, 1.0)])
def test_select_experts_matches_stock(M, E, k, renormalize, scale):
    g = torch.Generator().manual_seed(M + E)
    logits = (torch.randn(M, E, generator=g) * 3).to(DEVICE)
    bias = (torch.randn(E, generator=g) * 0.1).to(DEVICE)
    weights, ids = torch.ops.kimi_kernels.select_experts(logits, bias, k, renormalize, scale)
    want_w, want_ids = select_experts(logits, bias, k, renormalize, scale)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32 and ids.shape == (M, k)
    assert torch.equal(ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(weights.cpu(), want_w.cpu(), rtol=2e-6, atol=1e-7)
    expect = "triton" if DEVICE == "cuda" or moe_router.INTERPRET else "reference"
    assert moe_router.implementation(logits, k)[0] == expect
