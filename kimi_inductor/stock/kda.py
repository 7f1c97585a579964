"""KDA (Kimi Delta Attention) decode: the module and its core op ``kimi::kda_decode``.

Per rank (H_l = heads / G, D = head_dim, P = H_l D):
  in_proj_qkvgfab  x [T, hidden] -> [q P | k P | v P | g P | f_a D | b H_l | pad]
                   (f_a replicated; pad makes the width a multiple of 16)
  f_b_proj         g1 = f_a [T, D] -> [T, P]   (decay-gate pre-activation)
  kimi::kda_decode (conv, gates, delta rule, gated RMSNorm; updates the states)
  o_proj           [T, P] -> [T, hidden]: all-reduced in TP, a partial in SP.

``kimi::kda_decode`` stands where vLLM runs ``_C.fused_kda_decode`` (or its Triton
conv + recurrence + norm). Per request r with tokens t = 0..q-1, per head:
  1. short conv: window = 3 saved raw inputs (starting at offset accepted-1) + the
     new raw inputs; y = SiLU(sum_j w[:, j] window[t + j]) in fp32, stored bf16.
     The conv state becomes [window[1:3], new inputs] (3 + q - 1 rows).
  2. q = y_q / sqrt(|y_q|^2 + 1e-6) D^-1/2, k = y_k / sqrt(|y_k|^2 + 1e-6), v = y_v.
  3. g = lower_bound sigmoid(exp(A_log[h]) (g1 + dt_bias)), beta = sigmoid(b).
  4. S [V, K] fp32 from slot ``state_slots[r, accepted-1]``; per token
     S = S exp(g)[None, :]; u = beta (v - S k); S += u k^T; o = S q; S is stored
     into ``state_slots[r, t]``.
  5. out = RMSNorm(bf16(o)) * o_norm * sigmoid(g2) (eps 1e-5, fp32, stored bf16).
A request whose first slot is <= 0 is padding: zero output, no state update
(vLLM zeroes only the first token of a padded verify request; the rest is unused).
The reference masks padding rather than skipping it, so Inductor can trace it and
CUDA graphs can capture it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import KimiK3Config
from .layers import Linear
from .library import stock_op
from .parallel import Parallel, all_reduce
from .state import DecodeStep, LayerCache, check_q


def _fake(mixed_qkv, g1, g2, beta, conv_weight, A_log, dt_bias, norm_weight, conv_state,
          recurrent_state, state_slots, num_accepted, lower_bound, norm_eps):
    check_q(state_slots.shape[1], "kimi::kda_decode")
    return mixed_qkv.new_empty(mixed_qkv.shape[0], g2.shape[1])


@stock_op("kda_decode", mutates_args=("conv_state", "recurrent_state"), fake=_fake)
def kda_decode(
    mixed_qkv: Tensor,
    g1: Tensor,
    g2: Tensor,
    beta: Tensor,
    conv_weight: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    norm_weight: Tensor,
    conv_state: Tensor,
    recurrent_state: Tensor,
    state_slots: Tensor,
    num_accepted: Tensor,
    lower_bound: float,
    norm_eps: float,
) -> Tensor:
    # Written without data-dependent shapes (padding is masked, not skipped) so that
    # Inductor can trace it and CUDA graphs can capture it (the stock baseline).
    R, q = state_slots.shape
    check_q(q, "kimi::kda_decode")
    T, P = g2.shape
    H, V, K = recurrent_state.shape[1:]
    slots = state_slots.long().clamp(min=0)  # [R, q]; slot 0 is the null slot
    live = state_slots[:, 0] > 0  # [R]
    start = (num_accepted.long() - 1).clamp(min=0)  # [R]
    x = mixed_qkv.view(R, q, -1)  # [R, q, 3P]

    # 1. short convolution over [3 saved inputs | q new inputs]
    width = conv_weight.shape[-1]
    saved = conv_state[slots[:, 0]]  # [R, width-1+q-1, 3P]
    offsets = start[:, None] + torch.arange(width - 1, device=x.device)
    window = saved.gather(1, offsets[..., None].expand(-1, -1, saved.shape[-1]))
    full = torch.cat([window, x], dim=1).float()  # [R, width-1+q, 3P]
    w = conv_weight.view(-1, width).float()  # [3P, width]
    y = torch.stack([(full[:, t : t + width] * w.t()).sum(1) for t in range(q)], dim=1)
    y = F.silu(y).to(mixed_qkv.dtype)
    new_conv = torch.cat([window[:, 1:], x], dim=1).to(conv_state.dtype)
    conv_state[slots[:, 0]] = torch.where(live[:, None, None], new_conv, saved)

    # 2-3. normalised q/k, gates
    qf, kf, vf = y.float().view(R, q, 3, H, K).unbind(2)
    qf = qf / torch.sqrt(qf.pow(2).sum(-1, keepdim=True) + 1e-6) * K**-0.5
    kf = kf / torch.sqrt(kf.pow(2).sum(-1, keepdim=True) + 1e-6)
    g1f = g1.view(R, q, H, K).float() + dt_bias.float().view(H, K)
    gate = lower_bound * torch.sigmoid(torch.exp(A_log.float()).view(H, 1) * g1f)
    b = torch.sigmoid(beta.view(R, q, H).float())

    # 4. delta rule, one token at a time; token t's state goes to slot t
    state = recurrent_state[slots.gather(1, start[:, None]).squeeze(1)].float()  # [R, H, V, K]
    outs = []
    for t in range(q):
        state = state * torch.exp(gate[:, t]).unsqueeze(2)
        u = (vf[:, t] - (state @ kf[:, t].unsqueeze(-1)).squeeze(-1)) * b[:, t].unsqueeze(-1)
        state = state + u.unsqueeze(-1) * kf[:, t].unsqueeze(2)
        outs.append((state @ qf[:, t].unsqueeze(-1)).squeeze(-1))
        keep = (live & (state_slots[:, t] > 0))[:, None, None, None]
        recurrent_state[slots[:, t]] = torch.where(keep, state.to(recurrent_state.dtype), recurrent_state[slots[:, t]])
    o = torch.stack(outs, dim=1)  # [R, q, H, V]

    # 5. gated RMSNorm; padding requests output zeros
    of = o.to(g2.dtype).float()
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + norm_eps)
    of = of * norm_weight.float() * torch.sigmoid(g2.view(R, q, H, V).float())
    of = torch.where(live[:, None, None, None], of, 0.0)
    return of.reshape(T, P).to(g2.dtype)


class KimiDeltaAttention(nn.Module):
    """vLLM's ``KimiK3DeltaAttention`` on one rank (module and parameter names kept)."""

    def __init__(self, config: KimiK3Config, par: Parallel, device=None):
        super().__init__()
        self.par = par
        self.head_dim = D = config.kda_head_dim
        self.local_heads = par.shard(config.kda_heads, "KDA heads")
        self.local_size = P = self.local_heads * D
        self.conv_size = config.conv_size
        self.lower_bound = config.gate_lower_bound
        self.eps = config.rms_norm_eps
        width = 4 * P + D + self.local_heads
        self.in_proj_padding = -width % 16
        self.in_proj_qkvgfab = Linear(config.hidden_size, width + self.in_proj_padding, device=device)
        self.f_b_proj = Linear(D, P, device=device)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(
            torch.empty(3 * P, 1, self.conv_size, dtype=torch.float32, device=device), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.local_heads, dtype=torch.float32, device=device),
                                  requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(P, dtype=torch.float32, device=device), requires_grad=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.empty(D, dtype=torch.bfloat16, device=device),
                                          requires_grad=False)
        self.o_proj = Linear(P, config.hidden_size, device=device)

    def forward(self, x: Tensor, step: DecodeStep, cache: LayerCache) -> Tensor:
        conv_state, recurrent_state = cache
        P, D = self.local_size, self.head_dim
        split = [3 * P, P, D, self.local_heads, self.in_proj_padding]
        mixed_qkv, g2, f_a, beta, _ = self.in_proj_qkvgfab(x).split(split, dim=-1)
        g1 = self.f_b_proj(f_a)
        core = torch.ops.kimi.kda_decode(
            mixed_qkv, g1, g2, beta, self.conv1d.weight, self.A_log, self.dt_bias,
            self.o_norm.weight, conv_state, recurrent_state, step.state_slots,
            step.num_accepted, self.lower_bound, self.eps,
        )
        out = self.o_proj(core)
        return out if self.par.sequence_parallel else all_reduce(out, self.par)

    @staticmethod
    def cache_shapes(config: KimiK3Config, par: Parallel, num_slots: int, q: int, dtype: torch.dtype):
        P = par.shard(config.kda_heads, "KDA heads") * config.kda_head_dim
        D = config.kda_head_dim
        return (
            ((num_slots, config.conv_size - 1 + q - 1, 3 * P), dtype),
            ((num_slots, P // D, D, D), torch.float32),
        )
