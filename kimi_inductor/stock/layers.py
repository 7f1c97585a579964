"""Weight-only building blocks of the stock decoder: linear layers, RMSNorm, SiTU.

Parameters are allocated empty in the model dtype; checkpoints fill them
(``checkpoint.py``). Every GEMM is ``F.linear`` on 2-D bf16 activations (fp32
accumulation, bf16 output), as vLLM's unquantised linears are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attn_res import rms_norm


class Linear(nn.Module):
    """``y = x W^T`` with a per-rank ``weight`` [out, in] and no bias."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device), requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)


def situ_and_mul(x: Tensor, beta: float, linear_beta: float) -> Tensor:
    """SiTU-GLU on ``[gate | up]``: beta tanh(g/beta) sigmoid(g) * lb tanh(u/lb), fp32."""
    d = x.shape[-1] // 2
    gate, up = x[..., :d].float(), x[..., d:].float()
    act = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    return (act * (linear_beta * torch.tanh(up / linear_beta))).to(x.dtype)
