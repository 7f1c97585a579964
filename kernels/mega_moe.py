"""``kimi_kernels::mega_moe``: MegaMoE's contract for any GPU (and CPU): the routed
experts of this rank's row shard, expert-parallel over the group, in one op.

Semantics (= stock ``kimi::ep_experts``, and DeepGEMM's ``fp8_fp4_mega_moe`` up to its
FP8/FP4 quantisation): latent [c, L] bf16 (this rank's c rows), topk_weights [c, k]
fp32, topk_ids [c, k] int32 global expert ids, -1 for a row that is not routed (the
padding rows: the ``mega_moe`` pass sets their ids to -1 and weights to 0). Experts
``[first_expert, first_expert + E)`` live on this rank (w13 [E, 2 I, L], w2 [E, L, I];
or MXFP4 with ``w13_scale`` / ``w2_scale`` as ``expert_ffn`` takes them),
the group's G ranks hold all G E of them (vLLM's ``--enable-expert-parallel``
partition). Returns y [c, L] bf16: for each row the weighted sum of its k experts'
outputs, wherever they live. More than ``max_num_tokens`` rows raise ``ValueError``
(MegaMoE's symmetric-buffer capacity).

On SM100 with DeepGEMM installed (and a process group) the op is one
``fp8_fp4_mega_moe`` launch (``mega_moe_deepgemm.py``: MXFP4 experts, FP8 dispatch,
stock vLLM's SM100 numerics). Elsewhere (Hopper, CPU), our exchange: dispatch = one
all-gather of every rank's (latent, weights, ids), packed into one byte message; each
rank runs its own experts on the G c gathered rows (``expert_ffn``: pairs of other
ranks' experts and of padding rows are skipped); combine = one reduce-scatter of the
fp32 partials, so each row's sum arrives on its own rank. At decode sizes this dense
exchange moves what an all-to-all would (with top-16 of 896 experts over G <= 8 ranks,
a token misses a given rank's experts with probability (1 - 1/G)^16, 12% at G = 8), has
static shapes (capturable in CUDA graphs, no host-side split sizes) and runs on NCCL or
gloo.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from . import expert_ffn as experts
from . import mega_moe_deepgemm as deepgemm

NAMESPACE = "kimi_kernels"
# torch >= 2.13 renames these (the old names warn); torch 2.11 has only the old ones.
_all_gather_into = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def check_capacity(rows: int, max_num_tokens: int) -> None:
    if rows > max_num_tokens:
        raise ValueError(
            f"mega_moe got {rows} tokens on this rank, but its exchange was sized for max_num_tokens="
            f"{max_num_tokens} (raise vLLM's max_num_batched_tokens / Parallel.max_num_tokens, or run "
            f"a smaller batch)")


def implementation(device: torch.device, hidden: int, intermediate: int, mxfp4: bool = False,
                   mma_layout: bool = False) -> tuple[str, str]:
    """(name, reason) of what runs the op on ``device``: DeepGEMM MegaMoE where it can
    (SM100, bf16 experts: it quantises them itself), else the all-gather / grouped
    experts (``expert_ffn``; ``mma_layout``: MXFP4 in the SM90 kernel's layout) /
    reduce-scatter path."""
    if device.type == "meta":
        return "chosen at run time", "compiled on the meta device"
    why = "the experts are already MXFP4 (ours takes them as stored)" if mxfp4 else \
        deepgemm.unsupported(device, hidden, intermediate)
    if not why:
        return "deepgemm", "DeepGEMM fp8_fp4_mega_moe (MXFP4 experts, FP8 dispatch, NVLink exchange)"
    impl, reason = experts.implementation(device, mxfp4, mma_layout)
    return impl, f"{reason}; not DeepGEMM MegaMoE: {why}"


def _pack(parts: list[Tensor]) -> Tensor:
    return torch.cat([p.contiguous().view(torch.uint8).reshape(p.shape[0], -1) for p in parts], 1)


def _unpack(message: Tensor, like: list[Tensor]) -> list[Tensor]:
    widths = [p[:1].contiguous().view(torch.uint8).numel() for p in like]
    return [chunk.contiguous().view(p.dtype).reshape(-1, *p.shape[1:])
            for chunk, p in zip(message.split(widths, dim=1), like)]


def _fake(latent, topk_weights, topk_ids, w13, w2, first_expert, group_name, max_num_tokens, beta, linear_beta,
          w13_scale=None, w2_scale=None):
    return torch.empty_like(latent)


@torch.library.custom_op(f"{NAMESPACE}::mega_moe", mutates_args=())
def mega_moe(latent: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor, first_expert: int,
             group_name: str, max_num_tokens: int, beta: float, linear_beta: float, w13_scale: Tensor | None = None,
             w2_scale: Tensor | None = None) -> Tensor:
    rows = latent.shape[0]
    check_capacity(rows, max_num_tokens)
    group = dist.distributed_c10d._resolve_process_group(group_name) if group_name else None
    size = 1 if group is None else dist.get_world_size(group)
    if (group is not None and w13_scale is None
            and not deepgemm.unsupported(latent.device, latent.shape[1], w2.shape[2])
            and first_expert == dist.get_rank(group) * w13.shape[0]):  # DeepGEMM's contiguous partition
        return deepgemm.run(latent, topk_weights, topk_ids, w13, w2, group, max_num_tokens, beta, linear_beta)
    parts = [latent, topk_weights.float(), topk_ids.int()]
    if size > 1:  # dispatch: every rank receives every rank's rows
        message = _pack(parts)
        gathered = message.new_empty(size * rows, message.shape[1])
        _all_gather_into(gathered, message, group=group)
        parts = _unpack(gathered, parts)
    all_latent, all_weights, all_ids = parts
    local_ids = torch.where(all_ids >= 0, all_ids - first_expert, -1)
    partial = torch.ops.kimi_kernels.expert_ffn(all_latent, all_weights, local_ids, w13, w2, beta, linear_beta,
                                                w13_scale, w2_scale)
    if size > 1:  # combine: each row's sum over every rank's experts, on its own rank
        out = partial.new_empty(rows, partial.shape[1])
        _reduce_scatter_into(out, partial, group=group)
        partial = out
    return partial.to(latent.dtype)


mega_moe.register_fake(_fake)
