"""kimi_kernels::attn_res against stock's kimi::attn_res.

The prefix update and the bank write are bitwise stock's; the output differs only in
the fp32 order of the online softmax: within one bf16 rounding (2^-7 relative) for bf16
streams; fp32 within 1e-5 relative plus 2e-5 of the row's largest value.
"""

import pytest
import torch

import kimi_inductor.kernels  # noqa: F401

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN = 7168 if DEVICE == "cuda" else 96  # K3's hidden size on the GPU; toy rows in the interpreter


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("num_blocks, write_idx", [(0, 0), (1, -1), (3, -1), (3, 2), (4, 1), (5, 4), (6, -1)])
@pytest.mark.parametrize("with_delta, with_out_norm", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_stock(rows, num_blocks, write_idx, with_delta, with_out_norm, dtype):
    g = torch.Generator().manual_seed(rows * 100 + num_blocks * 10 + write_idx)
    H, NB = HIDDEN, 6

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    args = [r(rows, H), r(rows, H) if with_delta else None, r(rows, NB, H), 1 + r(H, scale=0.1), r(H, scale=0.05),
            1 + r(H, scale=0.1) if with_out_norm else None, num_blocks, write_idx, 1e-6, 1e-5]
    mine = [a.clone().to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    want = torch.ops.kimi.attn_res(*args)
    got = torch.ops.kimi_kernels.attn_res(*mine).cpu()
    assert torch.equal(mine[0].cpu(), args[0]) and torch.equal(mine[2].cpu(), args[2])  # prefix and bank writes
    # bf16: one rounding of each value (plus 1 % of one of the row's largest); fp32: the
    # 7168-term sums in another order (measured 2e-6 on rows of magnitude ~3)
    tol, row_tol = (2**-7, 2**-7 * 1e-2) if dtype == torch.bfloat16 else (1e-5, 2e-5)
    bound = tol * want.float().abs() + row_tol * want.float().abs().amax(-1, keepdim=True) + 1e-6
    assert ((got.float() - want.float()).abs() <= bound).all(), (got.float() - want.float()).abs().max()
