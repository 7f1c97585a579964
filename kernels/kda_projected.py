"""``kimi_kernels::kda_decode_projected``: a KDA layer's in-projection and its decode step,
the recurrence running while the output gate's weight rows stream.

Semantics: ``y = x W_in^T`` ([M, N], ``skinny_mm``'s one rounding), then
``kimi_kernels::kda_decode(y[:, qkv:qkv + 3P], y[:, fa:fa + D], f_b_weight, y[:, g2:g2 + P],
y[:, beta:beta + H], ...)`` (P = H D; ``columns`` = (qkv, g2, fa, beta), stock's
[q k v | g | f_a | b | pad] order is (0, 3P, 4P, 4P + D)), updating the conv and recurrent
states in place. Where the overlap below does not run, exactly that composition.

Why: at one row the in-projection is a 90 MB weight stream (21 us on an H200) and the
KDA kernel a latency chain (about 5 us) that needs every column of y but the output gate
g2's (22 MB of the stream) until its gated norm. Chained, the two add up. Here, three
launches: the CuTe GEMV of every column but g2's (``cute_gemv.Skip``); the KDA kernel,
which leaves the gate out (z = RMSNorm(o) w, fp32) and arrives at a counter per
(request, head); and the GEMV of g2's rows with the gate in its epilogue
(``Fusion.gate_after``: out = z sigmoid(x W_g^T)), which does not wait for the KDA kernel
(PDL: it is scheduled once the KDA kernel has done its loads) but only, after its K loop,
for the counter. So g2's rows stream while the recurrence runs. Deadlock-free: the gated
GEMV is scheduled only after every KDA program has started (PDL releases once every CTA
has), so every arrival it waits for comes. Why not one GEMV that computes g2's tiles last:
a decode GEMV's CTAs of one wave share the bandwidth and finish together, so no tile
order frees the KDA inputs early (timed: docs/performance.md).

Runs on CUDA where the CuTe GEMV takes the in-projection (``skinny_gemm.choose``) and the
g2 columns are whole tiles of it, and the Triton KDA kernel takes the layer; elsewhere the
composition (the CPU reference, Triton under the interpreter).
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


GATE_CONFIG = (1, 4, 1, 4)  # (R, warps, split, unroll) of the gated GEMV (cute_gemv.Config)


def gate_config():
    """The gated GEMV's configuration (``GATE_CONFIG``): one output per warp, 4 warps, whole
    K, 4 steps in flight (the in-projection's at one row: P / 4 CTAs, one wave)."""
    return skinny_gemm._cute().Config(*GATE_CONFIG)


def overlapped(M: int, N: int, K: int, g2_at: int, width: int, dtype: torch.dtype, conv_width: int,
               head_dim: int) -> str:
    """Why the in-projection and the KDA kernel do not overlap at these shapes ('' when
    they do): ``width`` = P, g2's columns."""
    impl, why = skinny_gemm.choose(M, N, K, dtype)
    if impl != "cute_gemv":
        return f"the in-projection runs on {impl}, not the CuTe GEMV{': ' + why if why else ''}"
    why = kda.supported(conv_width, head_dim)
    if why:
        return f"KDA kernel: {why}"
    cg = skinny_gemm._cute()
    skip = cg.skip_tiles(M, N, K, g2_at, g2_at + width)
    return skip if isinstance(skip, str) else cg.supported(M, width, K, gate_config())


_counters: dict[torch.device, Tensor] = {}


def gate_counter(device: torch.device) -> Tensor:
    """The KDA kernel's arrivals and the gated GEMV's (``Fusion.gate_after``), zero between
    calls; allocated on first use, before CUDA-graph capture."""
    if device not in _counters:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("kimi_kernels.kda_decode_projected: run the step once before CUDA-graph capture (its "
                               "counters are allocated on first use)")
        _counters[device] = torch.zeros(skinny_gemm._cute().GATE_ARRIVALS + 1, dtype=torch.int32, device=device)
    return _counters[device]


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
        lo, hi = columns[1], columns[1] + H * D
        mixed_qkv, f_a, g2, beta = _pieces(cg.run(x, in_weight, None, x.dtype, skip=cg.skip_tiles(M, N, K, lo, hi)),
                                           columns, H, D)  # g2's columns unwritten, unread
        counter = gate_counter(x.device)
        z = kda.launch(mixed_qkv, f_a, f_b_weight, g2, beta, conv_weight, A_log, dt_bias, norm_weight, conv_state,
                       recurrent_state, state_slots, num_accepted, lower_bound, norm_eps, gate_counter=counter)
        return cg.run(x, in_weight[lo:hi], None, x.dtype, cfg=gate_config(),
                      fusion=cg.Fusion(gate_after=state_slots.shape[0] * H), z=z, counters=counter)
    mixed_qkv, f_a, g2, beta = _pieces(skinny_gemm.skinny_mm(x, in_weight, None, x.dtype), columns, H, D)
    return kda.kda_decode(mixed_qkv, f_a, f_b_weight, g2, beta, conv_weight, A_log, dt_bias, norm_weight,
                          conv_state, recurrent_state, state_slots, num_accepted, lower_bound, norm_eps)


@kda_decode_projected.register_fake
def _(x, in_weight, columns, f_b_weight, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state,
      state_slots, num_accepted, lower_bound, norm_eps):
    return x.new_empty(x.shape[0], recurrent_state.shape[1] * recurrent_state.shape[-1])
