"""The SiTU MLP (dense layer 0, shared experts) and the latent MoE of Kimi K3.

MoE data flow for x [rows, hidden] (section 9 of the reference):
  router   logits = x W_gate^T in fp32; scores = sigmoid; ids = top-k of
           scores + e_score_correction_bias; weights = renormalised unbiased scores
           x routed_scaling_factor
  latent   z = routed_expert_down_proj(x)                   [rows, latent]
  experts  y = sum_k w_k W2_k SiTU(W1_k z, W3_k z)          (opaque op, below)
  tail     out = shared_experts(x) + routed_expert_up_proj(RMSNorm(y))
           (one ``addmm``: the shared output is the accumulator, as vLLM fuses it)

Routed experts, by layout:
  tp  ``kimi::fused_experts``: every expert on this rank's 1/G of the expert FFN
      width (padded to ``min_moe_intermediate_per_partition``, as vLLM pads without
      EP); y and the TP-sharded shared expert are partials, each all-reduced.
  sp  ``kimi::ep_experts``: MegaMoE's contract. Experts are partitioned over the EP
      group of P ranks (the TP group, or with data parallelism every TP group's ranks:
      experts e in [ep_rank E/P, (ep_rank+1) E/P) live here); the op sends each
      token to the ranks owning its experts, runs them and combines the weighted
      outputs back on the token's rank. Rows flagged in ``is_padding`` are not
      routed (zero output); more than ``max_num_tokens`` rows raise ``ValueError``.
      The shared expert is replicated.
Experts are bf16, or MXFP4 as a checkpoint ships them (``store_mxfp4``: codes and E8M0
scales, passed to the expert ops as optional ``w13_scale`` / ``w2_scale``, which
dequantise them: ``stock.mxfp4``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .config import KimiK3Config
from .layers import Linear, RMSNorm, situ_and_mul
from .library import stock_op
from .mxfp4 import expert_weights
from .parallel import Parallel, all_reduce

_all_gather_into = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class KimiMLP(nn.Module):
    """gate_up -> SiTU -> down. ``sharded``: TP-sharded weights (output is a partial)."""

    def __init__(self, config: KimiK3Config, intermediate: int, par: Parallel, sharded: bool, device=None):
        super().__init__()
        width = par.shard(intermediate, "MLP width") if sharded else intermediate
        self.gate_up_proj = Linear(config.hidden_size, 2 * width, device=device)
        self.down_proj = Linear(width, config.hidden_size, device=device)
        self.beta, self.linear_beta = config.activation_situ_beta, config.activation_situ_linear_beta

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(situ_and_mul(self.gate_up_proj(x), self.beta, self.linear_beta))


class DenseMLP(KimiMLP):
    """Layer 0's MLP: TP-sharded with an all-reduce (tp), replicated on the shard (sp)."""

    def __init__(self, config: KimiK3Config, par: Parallel, device=None):
        super().__init__(config, config.intermediate_size, par, not par.sequence_parallel, device)
        self.par = par

    def forward(self, x: Tensor, is_padding: Tensor | None = None) -> Tensor:
        out = super().forward(x)
        return out if self.par.sequence_parallel else all_reduce(out, self.par)


def router_logits(x: Tensor, weight: Tensor) -> Tensor:
    """bf16 x bf16 -> fp32 logits (vLLM's ``GateLinear`` with ``out_dtype`` fp32)."""
    if x.is_cuda:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return x.float() @ weight.float().t()


def select_experts(logits: Tensor, bias: Tensor, top_k: int, renormalize: bool, scale: float):
    """Sigmoid routing with a selection-only bias: (weights fp32, ids int32) [rows, k]."""
    scores = torch.sigmoid(logits)
    ids = torch.topk(scores + bias, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * scale, ids.to(torch.int32)


def combine_experts(latent: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor,
                    first_expert: int, beta: float, linear_beta: float, routed: Tensor | None = None) -> Tensor:
    """fp32 sum over the (row, k) pairs whose expert lives in ``w13``/``w2``.

    w13 [E_l, 2 I, latent] (gate rows, then up rows), w2 [E_l, latent, I]; expert
    ``first_expert + e`` is ``w13[e]``. ``routed`` [rows] masks rows that take part.
    """
    local = topk_ids.long() - first_expert
    hit = (local >= 0) & (local < w13.shape[0])
    if routed is not None:
        hit &= routed[:, None]
    out = latent.new_zeros(latent.shape[0], w2.shape[1], dtype=torch.float32)
    for e in local[hit].unique().tolist():
        rows, slot = ((local == e) & hit).nonzero(as_tuple=True)
        h = situ_and_mul(F.linear(latent[rows], w13[e]), beta, linear_beta)
        y = F.linear(h, w2[e]).float() * topk_weights[rows, slot, None].float()
        out.index_add_(0, rows, y)
    return out


def _fused_fake(latent, topk_weights, topk_ids, w13, w2, beta, linear_beta, w13_scale=None, w2_scale=None):
    return torch.empty_like(latent)


@stock_op("fused_experts", mutates_args=(), fake=_fused_fake)
def fused_experts(latent: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor,
                  beta: float, linear_beta: float, w13_scale: Tensor | None = None,
                  w2_scale: Tensor | None = None) -> Tensor:
    w13, w2 = expert_weights(w13, w2, w13_scale, w2_scale, latent.dtype)
    return combine_experts(latent, topk_weights, topk_ids, w13, w2, 0, beta, linear_beta).to(latent.dtype)


def _ep_fake(latent, topk_weights, topk_ids, is_padding, w13, w2, first_expert, group_name,
             max_num_tokens, beta, linear_beta, w13_scale=None, w2_scale=None):
    return torch.empty_like(latent)


@stock_op("ep_experts", mutates_args=(), fake=_ep_fake)
def ep_experts(latent: Tensor, topk_weights: Tensor, topk_ids: Tensor, is_padding: Tensor, w13: Tensor,
               w2: Tensor, first_expert: int, group_name: str, max_num_tokens: int, beta: float,
               linear_beta: float, w13_scale: Tensor | None = None, w2_scale: Tensor | None = None) -> Tensor:
    rows = latent.shape[0]
    if rows > max_num_tokens:
        raise ValueError(
            f"MegaMoE got {rows} tokens, but the symmetric buffer was sized for {max_num_tokens} "
            f"(raise max_num_tokens or use a smaller batch)")
    group = dist.distributed_c10d._resolve_process_group(group_name)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    # dispatch: every rank receives every token (latent, weights, ids, padding in one
    # message) and runs the experts it owns
    k = topk_ids.shape[1]
    message = torch.cat([latent.float(), topk_weights.float(), topk_ids.float(), is_padding.float()[:, None]], 1)
    gathered = message.new_empty(size * rows, message.shape[1])
    _all_gather_into(gathered, message, group=group)
    latent_all, weights_all, ids_all, pad_all = gathered.split([latent.shape[1], k, k, 1], dim=1)
    w13, w2 = expert_weights(w13, w2, w13_scale, w2_scale, latent.dtype)
    partial = combine_experts(latent_all.to(latent.dtype), weights_all, ids_all.long(), w13, w2, first_expert,
                              beta, linear_beta, routed=pad_all[:, 0] == 0)
    # combine: sum every expert's weighted output on the token's own rank
    dist.all_reduce(partial, group=group)
    return partial[rank * rows : (rank + 1) * rows].to(latent.dtype)


class KimiMoE(nn.Module):
    """vLLM's ``KimiMoE`` (latent MoE with MegaMoE under SP) on one rank."""

    def __init__(self, config: KimiK3Config, par: Parallel, device=None):
        super().__init__()
        self.par = par
        E, latent, H = config.num_experts, config.routed_expert_hidden_size, config.hidden_size
        self.top_k, self.renormalize = config.num_experts_per_token, config.moe_renormalize
        self.scale = config.routed_scaling_factor
        self.beta, self.linear_beta = config.activation_situ_beta, config.activation_situ_linear_beta
        if config.num_expert_group != 1 or config.topk_group != 1:
            raise ValueError("Kimi K3's router has one expert group (num_expert_group = topk_group = 1)")
        self.gate = Linear(H, E, device=device)
        self.gate.e_score_correction_bias = nn.Parameter(
            torch.empty(E, dtype=torch.float32, device=device), requires_grad=False)
        self.routed_expert_down_proj = Linear(H, latent, device=device)
        self.routed_expert_norm = RMSNorm(latent, config.rms_norm_eps, device=device)
        self.routed_expert_up_proj = Linear(latent, H, device=device)
        shared = config.moe_intermediate_size * config.num_shared_experts
        self.shared_experts = KimiMLP(config, shared, par, not par.sequence_parallel, device)
        self.experts = nn.Module()
        if par.sequence_parallel:
            if E % par.ep_size:
                raise ValueError(f"experts {E} are not divisible by the EP size {par.ep_size}")
            local, width = E // par.ep_size, config.moe_intermediate_size
            self.experts.first_expert = par.ep_rank * local
        else:
            local = E
            width = par.shard(config.moe_intermediate_size, "expert FFN width")
            if par.size > 1:
                width = max(width, config.min_moe_intermediate_per_partition)
            self.experts.first_expert = 0
        self.experts.w13_weight = nn.Parameter(
            torch.empty(local, 2 * width, latent, dtype=torch.bfloat16, device=device), requires_grad=False)
        self.experts.w2_weight = nn.Parameter(
            torch.empty(local, latent, width, dtype=torch.bfloat16, device=device), requires_grad=False)

    def store_mxfp4(self) -> None:
        """Hold the routed experts as the checkpoint's MXFP4 (``stock.mxfp4``): w13_weight /
        w2_weight become uint8 codes [E, N, K / 2] with ``*_weight_scale`` [E, N, K / 32]
        beside them (17/64 of the bf16 bytes); the expert ops dequantise.
        Needs K (the latent and the expert FFN width on this rank) a multiple of 32."""
        ex = self.experts
        for name in ("w13_weight", "w2_weight"):
            E, N, K = getattr(ex, name).shape
            if K % 32:
                raise ValueError(f"MXFP4 experts need rows of whole 32-value scale groups; {name} of this rank "
                                 f"has {K} columns (TP-sharded expert FFN width): use the SP layout (experts "
                                 f"whole on their EP rank) or a TP size that keeps the width a multiple of 32")
            device = getattr(ex, name).device
            setattr(ex, name, nn.Parameter(torch.empty(E, N, K // 2, dtype=torch.uint8, device=device),
                                           requires_grad=False))
            setattr(ex, name + "_scale", nn.Parameter(torch.empty(E, N, K // 32, dtype=torch.uint8, device=device),
                                                      requires_grad=False))

    def mxfp4_for_sm90(self) -> None:
        """Reorder the MXFP4 experts' bytes into the SM90 expert kernel's layout
        (``kernels.expert_mxfp4.mma_layout``: still uint8, the same bytes, 5-D), layer by
        layer at load time; the expert ops read either layout (the stock math dequantises
        it back)."""
        from kimi_inductor.kernels.expert_mxfp4 import mma_layout

        ex = self.experts
        for name, gate_up in (("w13_weight", True), ("w2_weight", False)):
            codes, scales = mma_layout(getattr(ex, name), getattr(ex, name + "_scale"), gate_up)
            setattr(ex, name, nn.Parameter(codes, requires_grad=False))
            setattr(ex, name + "_scale", nn.Parameter(scales, requires_grad=False))

    def forward(self, x: Tensor, is_padding: Tensor) -> Tensor:
        logits = router_logits(x, self.gate.weight)
        weights, ids = select_experts(logits, self.gate.e_score_correction_bias, self.top_k,
                                      self.renormalize, self.scale)
        latent = self.routed_expert_down_proj(x)
        w13, w2 = self.experts.w13_weight, self.experts.w2_weight
        scales = (self.experts.w13_weight_scale, self.experts.w2_weight_scale) if w13.dtype == torch.uint8 else ()
        if self.par.sequence_parallel:
            routed = torch.ops.kimi.ep_experts(
                latent, weights, ids, is_padding, w13, w2, self.experts.first_expert,
                self.par.experts_group.group_name, self.par.max_num_tokens, self.beta, self.linear_beta, *scales)
            shared = self.shared_experts(x)
        else:
            routed = all_reduce(
                torch.ops.kimi.fused_experts(latent, weights, ids, w13, w2, self.beta, self.linear_beta, *scales),
                self.par)
            shared = all_reduce(self.shared_experts(x), self.par)
        return torch.addmm(shared, self.routed_expert_norm(routed), self.routed_expert_up_proj.weight.t())
