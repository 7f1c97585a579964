"""MXFP4, the format of Kimi K3's released routed experts (OCP MX): per row, two E2M1
codes per byte (low nibble = the even column; sign bit 3, exponent bits 2-1, mantissa
bit 0: 0, 0.5, 1, 1.5, 2, 3, 4, 6) and one E8M0 scale per 32 values (x 2^(s - 127)).
An expert's [N, K] weight is ``packed`` [N, K / 2] uint8 + ``scales`` [N, K / 32] uint8.
"""

from __future__ import annotations

import torch
from torch import Tensor

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4_quantize(w: Tensor) -> tuple[Tensor, Tensor]:
    """[rows, cols] float -> (packed uint8 [rows, cols/2], scales uint8 [rows, cols/32])."""
    rows, cols = w.shape
    g = w.float().view(rows, cols // 32, 32)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    x = (g / torch.exp2(exp)).view(rows, cols)
    code = (x.abs()[..., None] - E2M1.to(x.device)).abs().argmin(-1)
    code = (code | ((x < 0) & (code > 0)).long() << 3).to(torch.uint8)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed, (exp.view(rows, cols // 32) + 127).to(torch.uint8)


def mxfp4_dequantize(packed: Tensor, scales: Tensor) -> Tensor:
    """(packed [rows, cols / 2], scales [rows, cols / 32]) -> [rows, cols] bf16 (exact)."""
    rows = packed.shape[0]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(rows, -1).int()
    e, m = ((codes >> 1) & 3).float(), (codes & 1).float()  # E2M1[codes & 7], without a table (compiles anywhere)
    vals = torch.where(e == 0, 0.5 * m, (1 + 0.5 * m) * torch.exp2(e - 1)) * (1 - 2 * (codes >> 3)).float()
    scale = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=1)
    return (vals * scale).to(torch.bfloat16)


def dequantize_experts(packed: Tensor, scales: Tensor) -> Tensor:
    """[E, N, K / 2] + [E, N, K / 32] -> [E, N, K] bf16, expert by expert as ``mxfp4_dequantize``."""
    E, N, _ = packed.shape
    return mxfp4_dequantize(packed.reshape(E * N, -1), scales.reshape(E * N, -1)).view(E, N, -1)


def expert_weights(w13: Tensor, w2: Tensor, w13_scale: Tensor | None, w2_scale: Tensor | None,
                   dtype: torch.dtype = torch.bfloat16):
    """(w13, w2) as weights: dequantised to ``dtype`` (the activations') where they are
    MXFP4 (scales given; the values are exact in bf16 and fp32), in the checkpoint's
    layout or the SM90 kernel's (5-D, ``kernels.expert_mxfp4.mma_layout``)."""
    if w13_scale is None:
        return w13, w2
    if w13.dim() == 5:
        from kimi_inductor.kernels.expert_mxfp4 import checkpoint_layout

        (w13, w13_scale), (w2, w2_scale) = (checkpoint_layout(w13, w13_scale, True),
                                            checkpoint_layout(w2, w2_scale, False))
    return dequantize_experts(w13, w13_scale).to(dtype), dequantize_experts(w2, w2_scale).to(dtype)
