"""``kimi_kernels::kda_decode_projected``: a KDA layer's in-projection and its decode step,
the recurrence running while the output gate's weight rows stream.

Semantics: ``y = x W_in^T`` ([M, N], ``skinny_mm``'s one rounding), then
``kimi_kernels::kda_decode(y[:, qkv:qkv + 3P], y[:, fa:fa + D], f_b_weight, y[:, g2:g2 + P],
y[:, beta:beta + H], ...)`` (P = H D; ``columns`` = (qkv, g2, fa, beta), stock's
[q k v | g | f_a | b | pad] order is (0, 3P, 4P, 4P + D)), updating the conv and recurrent
states in place. Where the overlap below does not run, exactly that composition.

Why: at one row the in-projection is a 90 MB weight stream (21 us on an H200) and the
KDA kernel a latency chain (about 5 us) that reads every column of y but the output
gate g2's (22 MB of the stream) until its gated norm. Chained, the two add up. Here the
CuTe GEMV computes g2's tiles last (``cute_gemv.Defer``) and flags the end of the other
tiles and of g2's; the KDA kernel, launched (PDL) once the other tiles' loops are done,
waits on the first flag instead of the GEMV's completion and on the second only before
its norm, so the recurrence runs while g2's rows stream. Deadlock-free: the KDA kernel is
scheduled only after every GEMV CTA has started (PDL releases after all CTAs trigger), so
every tile it waits for is running or done.

Runs on CUDA where the CuTe GEMV takes the in-projection (``skinny_gemm.choose``) and
can defer g2's outputs (whole tiles, no K split), and the Triton KDA kernel takes the
layer; elsewhere the composition (the CPU reference, Triton under the interpreter).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import kda_decode as kda
from . import skinny_gemm
from .common import INTERPRET

NAMESPACE = "kimi_kernels"


# rows -> whether the overlap measured faster than the GEMV and the KDA kernel chained
# (benchmarks/kda_layer.py --projected): not yet timed on a GPU.
FASTER_ROWS: dict[int, bool] = {}


def faster(M: int) -> str:
    """Why the pair stays at M rows ('' where the overlap measured faster)."""
    if M not in FASTER_ROWS:
        return f"{M} rows: not measured against the pair (kda_projected.FASTER_ROWS)"
    return "" if FASTER_ROWS[M] else f"{M} rows: the pair measured faster (kda_projected.FASTER_ROWS)"


def overlapped(M: int, N: int, K: int, g2_at: int, width: int, dtype: torch.dtype, conv_width: int,
               head_dim: int) -> str:
    """Why the GEMV and the KDA kernel do not overlap at these shapes ('' when they do):
    ``width`` = P, g2's columns."""
    impl, why = skinny_gemm.choose(M, N, K, dtype)
    if impl != "cute_gemv":
        return f"the in-projection runs on {impl}, not the CuTe GEMV{': ' + why if why else ''}"
    why = kda.supported(conv_width, head_dim)
    if why:
        return f"KDA kernel: {why}"
    defer = skinny_gemm._cute().defer_tiles(M, N, K, g2_at, g2_at + width)
    return defer if isinstance(defer, str) else ""


def _pieces(y: Tensor, columns: list[int], H: int, D: int) -> tuple[Tensor, ...]:
    qkv, g2, fa, beta = columns
    return y[:, qkv:qkv + 3 * H * D], y[:, fa:fa + D], y[:, g2:g2 + H * D], y[:, beta:beta + H]


@torch.library.custom_op(f"{NAMESPACE}::kda_decode_projected", mutates_args=("conv_state", "recurrent_state"))
def kda_decode_projected(
    x: Tensor, in_weight: Tensor, columns: list[int], f_b_weight: Tensor, conv_weight: Tensor, A_log: Tensor,
    dt_bias: Tensor, norm_weight: Tensor, conv_state: Tensor, recurrent_state: Tensor, state_slots: Tensor,
    num_accepted: Tensor, lower_bound: float, norm_eps: float,
) -> Tensor:
    H, D = recurrent_state.shape[1], recurrent_state.shape[-1]
    (M, K), N = x.shape, in_weight.shape[0]
    if x.is_cuda and not INTERPRET and not overlapped(M, N, K, columns[1], H * D, x.dtype, conv_weight.shape[-1], D):
        cg = skinny_gemm._cute()
        y, signal = cg.run(x, in_weight.contiguous(), None, x.dtype,
                           defer=cg.defer_tiles(M, N, K, columns[1], columns[1] + H * D))
        mixed_qkv, f_a, g2, beta = _pieces(y, columns, H, D)
        return kda.launch(mixed_qkv, f_a, f_b_weight, g2, beta, conv_weight, A_log, dt_bias, norm_weight,
                          conv_state, recurrent_state, state_slots, num_accepted, lower_bound, norm_eps, signal)
    mixed_qkv, f_a, g2, beta = _pieces(skinny_gemm.skinny_mm(x, in_weight, None, x.dtype), columns, H, D)
    return kda.kda_decode(mixed_qkv, f_a, f_b_weight, g2, beta, conv_weight, A_log, dt_bias, norm_weight,
                          conv_state, recurrent_state, state_slots, num_accepted, lower_bound, norm_eps)


@kda_decode_projected.register_fake
def _(x, in_weight, columns, f_b_weight, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state,
      state_slots, num_accepted, lower_bound, norm_eps):
    return x.new_empty(x.shape[0], recurrent_state.shape[1] * recurrent_state.shape[-1])
