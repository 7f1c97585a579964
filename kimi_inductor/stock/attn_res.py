"""AttnRes: block attention residuals (``kimi::attn_res``) and RMSNorm.

The residual stream of Kimi K3 is a bank of saved block sums ``bank`` [R, NB, H]
plus the running sum of the current block ``prefix`` [R, H]. One call, per row and
in fp32:

1. ``p = prefix``; with a ``delta``: ``p = bf16(prefix + delta)`` and ``p`` is
   written back into ``prefix`` (in place).
2. ``block_write_idx >= 0``: ``bank[:, block_write_idx] = p`` (in place).
3. Sources ``s_0..s_{n-1} = bank[:, :n]``, ``s_n = p`` (n = ``num_blocks``); each
   scores ``<s_j, norm_weight * qk_weight> * rsqrt(mean(s_j^2) + eps)``; a softmax
   over sources mixes the raw sources (``n = 0``: the mix is ``p``).
4. With ``output_norm_weight``: RMSNorm of the mix (the fused input /
   post-attention layernorm), else the mix; returned as a new bf16 tensor.

vLLM 0.33.0 runs this as a user Triton kernel that mutates ``prefix`` and the bank
(a native op on SM100); here it is the opaque op ``kimi::attn_res`` with both
mutations declared.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .library import stock_op


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """vLLM's RMSNorm: normalise in fp32, round to the weight dtype, scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf.to(weight.dtype) * weight).to(x.dtype)


def _fake(prefix, delta, bank, norm_weight, qk_weight, output_norm_weight,
          num_blocks, block_write_idx, eps, output_norm_eps):
    return torch.empty_like(prefix)


@stock_op("attn_res", mutates_args=("prefix", "bank"), fake=_fake)
def attn_res(
    prefix: Tensor,
    delta: Optional[Tensor],
    bank: Tensor,
    norm_weight: Tensor,
    qk_weight: Tensor,
    output_norm_weight: Optional[Tensor],
    num_blocks: int,
    block_write_idx: int,
    eps: float,
    output_norm_eps: float,
) -> Tensor:
    p = prefix.float()
    if delta is not None:
        p = (p + delta.float()).to(prefix.dtype)
        prefix.copy_(p)
        p = p.float()
    if block_write_idx >= 0:
        bank[:, block_write_idx].copy_(p)
    if num_blocks == 0:
        mixed = p
    else:
        sources = torch.cat([bank[:, :num_blocks].float(), p.unsqueeze(1)], dim=1)
        query = norm_weight.float() * qk_weight.float()
        rstd = torch.rsqrt(sources.pow(2).mean(-1) + eps)
        weights = torch.softmax((sources * query).sum(-1) * rstd, dim=-1)
        mixed = (weights.unsqueeze(-1) * sources).sum(1)
    if output_norm_weight is not None:
        rstd = torch.rsqrt(mixed.pow(2).mean(-1, keepdim=True) + output_norm_eps)
        mixed = mixed * rstd * output_norm_weight.float()
    return mixed.to(prefix.dtype)
