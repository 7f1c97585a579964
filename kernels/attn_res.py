"""``kimi_kernels::attn_res``: AttnRes (block attention residuals) in one Triton kernel.

Semantics: stock ``kimi::attn_res`` (``stock/attn_res.py``): per row, ``p = prefix [+ delta]``
(rounded to the stream dtype and written back into ``prefix``), ``p`` stored into
``bank[:, block_write_idx]`` when that is >= 0, then a softmax over the sources
``bank[:, :num_blocks]`` and ``p`` of ``<s, norm_weight * qk_weight> * rsqrt(mean(s^2) + eps)``
mixes the raw sources, and the optional output RMSNorm (the fused input /
post-attention layernorm) scales the mix; bf16 out.

Layout: one program per row holds the whole hidden row (H = 7168: 8192 lanes over 16
warps) and walks the sources once with an online softmax (running max, sum and
weighted sum, fp32; sources in pairs, their four sums in one block reduction, the next
pair's loads in flight while one is reduced), so each bank row is read once and the
prefix update, the bank write, the mix and the output norm are one launch instead of
Inductor's chain of reductions. Stock's softmax-then-sum and the online form differ
only in fp32 rounding order (outputs within one bf16 rounding).

Byte floor of one call: R rows x (prefix read + write, delta, bank row write,
``num_blocks`` bank rows, output) x H x 2 bytes: 100 KB per row at 4 saved blocks.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

import kimi_inductor.stock.attn_res  # noqa: F401  (registers kimi::attn_res)
from kimi_inductor.stock.library import REFERENCES

from .common import INTERPRET, pdl, pdl_wait, bf16_round, tl, triton

NAMESPACE = "kimi_kernels"
MAX_HIDDEN = 16384
VERSUS_VLLM = "docs/results/attn_res_vllm_h200_v2.json"
# Saved-block counts at which this kernel beats vLLM 0.33.0's Triton AttnRes on H200
# (benchmarks/attn_res.py --vllm, VERSUS_VLLM; both launched with PDL): 4, where vLLM's
# takes 1.06-1.14x our time (1-64 rows); at 1 block 0.92-0.99x and at 7 0.79-0.88x, so
# lower_kernels keeps vLLM's there (counts not measured count as vLLM's). Its
# four-source tiles are not why (ours with them measured the same).
FASTER_THAN_VLLM_AT_BLOCKS: frozenset[int] = frozenset({4})
MEASURED_AGAINST_VLLM_AT_BLOCKS = (1, 4, 7)


def versus_vllm(num_blocks: int) -> str:
    """Why vLLM's Triton AttnRes stays at ``num_blocks`` saved blocks ('' where ours is faster)."""
    if num_blocks in FASTER_THAN_VLLM_AT_BLOCKS:
        return ""
    if num_blocks in MEASURED_AGAINST_VLLM_AT_BLOCKS:
        return f"vLLM's Triton kernel is as fast or faster on H200 at {num_blocks} saved blocks ({VERSUS_VLLM})"
    return f"vLLM's Triton kernel kept: ours not measured against it at {num_blocks} saved blocks ({VERSUS_VLLM})"


def supported(hidden: int, dtype: torch.dtype) -> str:
    """Why the Triton kernel cannot take this row ('' when it can)."""
    if triton is None:
        return "Triton is not installed"
    if hidden > MAX_HIDDEN:
        return f"hidden {hidden} (> {MAX_HIDDEN}: one program holds a whole row)"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"dtype {dtype}"
    return ""


if triton is not None:

    @triton.jit
    def _scores(a, b, query, H, eps):
        """<s, query> * rsqrt(mean(s^2) + eps) of two sources: the four sums in one block
        reduction."""
        sums = tl.sum(tl.join(tl.join(a * query, b * query), tl.join(a * a, b * b)), 0)  # [(a, b), (dot, sq)]
        dots, sqs = tl.split(sums)
        return tl.split(dots * tl.rsqrt(sqs / H + eps))

    @triton.jit
    def _attn_res_kernel(prefix_ptr, stride_prefix, delta_ptr, stride_delta, bank_ptr, stride_bank_r,
                         stride_bank_b, norm_ptr, qk_ptr, out_norm_ptr, out_ptr, stride_out, H, num_blocks,
                         write_idx, eps, out_eps, BH: tl.constexpr, HAS_DELTA: tl.constexpr,
                         HAS_OUT_NORM: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        r = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BH)
        mask = offs < H
        p = tl.load(prefix_ptr + r * stride_prefix + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_DELTA:
            p = bf16_round(p + tl.load(delta_ptr + r * stride_delta + offs, mask=mask, other=0.0).to(tl.float32),
                           ROUND)
            tl.store(prefix_ptr + r * stride_prefix + offs, p.to(prefix_ptr.dtype.element_ty), mask=mask)
        bank_row = bank_ptr + r * stride_bank_r
        if write_idx >= 0:
            tl.store(bank_row + write_idx * stride_bank_b + offs, p.to(bank_ptr.dtype.element_ty), mask=mask)
        tl.debug_barrier()  # the bank row just written may be a source below
        query = tl.load(norm_ptr + offs, mask=mask, other=0.0).to(tl.float32) * \
            tl.load(qk_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        mixed = p
        if num_blocks > 0:
            best, _ = _scores(p, p, query, H, eps)  # the last source: p
            total = 1.0
            acc = p
            src = bank_row + offs
            a = tl.load(src, mask=mask, other=0.0)
            b = tl.load(src + stride_bank_b, mask=mask & (1 < num_blocks), other=0.0)
            for j in range(0, num_blocks, 2):  # sources in pairs, the next pair's loads in flight
                na = tl.load(src + (j + 2) * stride_bank_b, mask=mask & (j + 2 < num_blocks), other=0.0)
                nb = tl.load(src + (j + 3) * stride_bank_b, mask=mask & (j + 3 < num_blocks), other=0.0)
                af, bf = a.to(tl.float32), b.to(tl.float32)
                score_a, score_b = _scores(af, bf, query, H, eps)
                score_b = tl.where(j + 1 < num_blocks, score_b, float("-inf"))
                top = tl.maximum(best, tl.maximum(score_a, score_b))
                keep, wa, wb = tl.exp(best - top), tl.exp(score_a - top), tl.exp(score_b - top)
                acc = acc * keep + af * wa + bf * wb
                total = total * keep + wa + wb
                best = top
                a, b = na, nb
            mixed = acc / total
        if HAS_OUT_NORM:
            w_out = tl.load(out_norm_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            mixed = mixed * tl.rsqrt(tl.sum(mixed * mixed, 0) / H + out_eps) * w_out
        tl.store(out_ptr + r * stride_out + offs, bf16_round(mixed, ROUND).to(out_ptr.dtype.element_ty), mask=mask)


def _fake(prefix, delta, bank, norm_weight, qk_weight, output_norm_weight, num_blocks, block_write_idx, eps,
          output_norm_eps):
    return torch.empty_like(prefix)


@torch.library.custom_op(f"{NAMESPACE}::attn_res", mutates_args=("prefix", "bank"))
def attn_res(prefix: Tensor, delta: Optional[Tensor], bank: Tensor, norm_weight: Tensor, qk_weight: Tensor,
             output_norm_weight: Optional[Tensor], num_blocks: int, block_write_idx: int, eps: float,
             output_norm_eps: float) -> Tensor:
    args = (prefix, delta, bank, norm_weight, qk_weight, output_norm_weight, num_blocks, block_write_idx, eps,
            output_norm_eps)
    R, H = prefix.shape
    if not (prefix.is_cuda or INTERPRET) or supported(H, prefix.dtype) or R == 0:
        return REFERENCES[torch.ops.kimi.attn_res.default](*args)
    assert prefix.stride(1) == 1 and bank.stride(2) == 1 and (delta is None or delta.stride(1) == 1)
    out = torch.empty_like(prefix)
    _attn_res_kernel[(R,)](
        prefix, prefix.stride(0), delta if delta is not None else prefix, delta.stride(0) if delta is not None else 0,
        bank, bank.stride(0), bank.stride(1), norm_weight, qk_weight,
        output_norm_weight if output_norm_weight is not None else norm_weight, out, out.stride(0), H, num_blocks,
        block_write_idx, eps, output_norm_eps, BH=triton.next_power_of_2(H), HAS_DELTA=delta is not None,
        HAS_OUT_NORM=output_norm_weight is not None, ROUND=prefix.dtype == torch.bfloat16,
        num_warps=16 if H > 4096 else 4, **pdl(prefix.device))
    return out


attn_res.register_fake(_fake)
