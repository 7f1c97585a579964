"""``kimi_kernels::select_experts``: the MoE router's expert choice in one launch.

Semantics (stock ``select_experts``): for fp32 logits [M, E] and a selection bias [E],

    scores = sigmoid(logits); ids = top_k(scores + bias)       (descending)
    weights = scores[ids] (/ their sum when renormalising) * scale

returns (weights [M, k] fp32, ids [M, k] int32). The bias only chooses; the weights are
the unbiased scores.

GPU / interpreter (Triton): one program per row holds the row's E biased scores in
registers and takes the k largest by k max passes over packed (score, index) keys (the
lowest index among equal values), so the choice equals ``torch.topk``'s except for exact
ties of fp32 biased scores. Stock's
graph runs this as 3-5 kernels (sigmoid + bias, aten top-k, gather and renormalisation);
at decode they are a few microseconds each of launch and tail. E up to 4096.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kimi_inductor.stock.moe import select_experts as stock_select

from .common import INTERPRET, pdl, pdl_wait, tl, triton

NAMESPACE = "kimi_kernels"
MAX_EXPERTS = 4096
WARPS = 4  # per row's program


def implementation(logits: Tensor, top_k: int) -> tuple[str, str]:
    """(name, why): 'triton' or 'reference'."""
    if triton is None:
        return "reference", "Triton is not installed"
    if not logits.is_cuda and not INTERPRET:
        return "reference", f"on {logits.device.type}"
    if logits.dtype != torch.float32 or logits.shape[1] > MAX_EXPERTS or top_k > logits.shape[1]:
        return "reference", f"{logits.dtype} logits of {logits.shape[1]} experts, top {top_k}"
    return "triton", ""


@torch.library.custom_op(f"{NAMESPACE}::select_experts", mutates_args=())
def select_experts(logits: Tensor, bias: Tensor, top_k: int, renormalize: bool,
                   scale: float) -> tuple[Tensor, Tensor]:
    if implementation(logits, top_k)[0] == "reference":
        return stock_select(logits, bias, top_k, renormalize, scale)
    M, E = logits.shape
    weights = torch.empty(M, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(M, top_k, dtype=torch.int32, device=logits.device)
    if M:
        _select_kernel[(M,)](logits, bias.float().contiguous(), weights, ids, E, logits.stride(0), scale, K=top_k,
                             BK=triton.next_power_of_2(top_k), BE=triton.next_power_of_2(E), RENORM=renormalize,
                             num_warps=WARPS, **pdl(logits.device))
    return weights, ids


@select_experts.register_fake
def _(logits, bias, top_k, renormalize, scale):
    M = logits.shape[0]
    return logits.new_empty(M, top_k), logits.new_empty(M, top_k, dtype=torch.int32)


if triton is not None:

    @triton.jit
    def _sigmoid(x):
        return 1.0 / (1.0 + tl.exp(-x))

    @triton.jit
    def _select_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, E, stride_l, scale, K: tl.constexpr, BK: tl.constexpr,
                       BE: tl.constexpr, RENORM: tl.constexpr, PDL: tl.constexpr):
        """Each pass takes the max of one int64 key per expert: the biased score's bits in
        signed order (high word) and BE - 1 - e (low word: the lowest index wins a tie),
        one block reduction per chosen expert; the weights are gathered afterwards."""
        pdl_wait(PDL)
        row = tl.program_id(0)
        e = tl.arange(0, BE)
        ok = e < E
        logit = tl.load(logits_ptr + row * stride_l + e, mask=ok, other=0.0)
        chosen = tl.where(ok, _sigmoid(logit) + tl.load(bias_ptr + e, mask=ok, other=0.0), float("-inf"))
        bits = chosen.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
        key = (ordered << 32) | (BE - 1 - e).to(tl.int64)
        j = tl.arange(0, BK)
        ids = tl.zeros([BK], dtype=tl.int32)
        for i in tl.static_range(K):
            best = tl.max(key, 0)
            ids = tl.where(j == i, (BE - 1 - (best & 0xFFFFFFFF)).to(tl.int32), ids)
            key = tl.where(key == best, -9223372036854775807 - 1, key)
        weights = _sigmoid(tl.load(logits_ptr + row * stride_l + ids, mask=j < K, other=0.0))
        weights = tl.where(j < K, weights, 0.0)
        if RENORM:
            weights = weights / tl.sum(weights, 0)
        tl.store(w_ptr + row * K + j, weights * scale, mask=j < K)
        tl.store(ids_ptr + row * K + j, ids, mask=j < K)
