"""What our Triton kernels share: whether Triton is here, whether it interprets (CPU,
``TRITON_INTERPRET=1``), stock's bf16 rounding done exactly, stock's SiTU in fp32, and
programmatic dependent launch (PDL).

Triton is optional (a dependency only where its wheels exist: Linux x86_64). Without
it every name below still imports (``triton``, ``tl`` and ``bf16_round`` are None)
and each op dispatches to its CPU reference."""

from __future__ import annotations

import functools
import os

import torch

SMS = 132  # streaming multiprocessors of the H200 the launch heuristics were measured on

try:
    import triton
    import triton.language as tl

    INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # as triton.jit decided at import
except ImportError:  # CPU machines without Triton use the references
    triton, tl, INTERPRET = None, None, False

bf16_round = pdl_release = pdl_wait = situ = None


def pdl_allowed() -> bool:
    """Whether decode kernels may launch with PDL where the GPU has it:
    ``KIMI_INDUCTOR_PDL=0`` turns it off everywhere (to measure what it gives)."""
    return os.environ.get("KIMI_INDUCTOR_PDL", "1") != "0"


@functools.lru_cache
def pdl(device) -> dict:
    """Launch options for a decode kernel on ``device``: on SM90+ GPUs programmatic
    dependent launch (the kernel may be scheduled while the one before it in the stream
    or CUDA graph still runs, and waits in ``pdl_wait`` for its results), else none."""
    on = triton is not None and not INTERPRET and device.type == "cuda" and pdl_allowed()
    on = on and torch.cuda.get_device_capability(device)[0] >= 9
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


_counters: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` zeroed int32 arrival counters on ``device``, shared by the kernels
    whose last program to arrive at a counter reduces the others' partials and resets it
    to 0 (so they are zero between calls of kernels on one stream). Allocated on first
    use, which must come before CUDA-graph capture."""
    have = _counters.get(device)
    if have is None or have.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("kimi_kernels: run the step once before CUDA-graph capture (its kernels allocate "
                               "their arrival counters on first use)")
        have = _counters[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return have


if triton is not None:

    @triton.jit
    def pdl_wait(PDL: tl.constexpr, RELEASE: tl.constexpr = True):
        """First statement of a kernel launched with ``pdl``: wait until the grids it
        depends on have finished and their writes are visible (nothing before it may read
        or write memory), then let the next kernel be scheduled (unless not RELEASE: then
        ``pdl_release`` does, later)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            if RELEASE:
                tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def pdl_release(PDL: tl.constexpr):
        """Let the next kernel be scheduled (after ``pdl_wait(PDL, RELEASE=False)``): a
        kernel releases only after its own wait, so the kernels two launches back are
        complete whenever a kernel runs."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def bf16_round(x, ROUND: tl.constexpr):
        """Round fp32 to the nearest bf16 (ties to even), kept in fp32; the identity when
        not ROUND (fp32 activations). Integer ops, so the Triton interpreter (whose
        float conversion truncates) rounds as the GPU does."""
        if ROUND:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            x = (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
        return x

    @triton.jit
    def _tanh(x):
        """fp32 tanh within 2 ulp (exact exp; the GPU's approximate exp adds about one):
        below |x| = 0.6 an odd polynomial (a minimax fit of tanh(x)/x - 1 in x^2), where
        (1 - e) / (1 + e) with e = exp(-2|x|) cancels (63 ulp off at |x| = 0.007, and 0
        below 3e-8); above it that form (at most 1.6 bits cancel). Triton has no expm1
        on every backend (the interpreter included)."""
        a = tl.abs(x)
        s = a * a
        p = -0.005895158741623163 * s + 0.020795971155166626
        p = p * s - 0.053783830255270004
        p = p * s + 0.13331924378871918
        p = p * s - 0.33333298563957214
        small = a + a * s * p
        e = tl.exp(-2.0 * a)
        t = tl.where(a < 0.6, small, (1.0 - e) / (1.0 + e))
        return tl.where(x < 0, -t, t)

    @triton.jit
    def situ(gate, up, beta, linear_beta):
        """Stock's SiTU-GLU on fp32 gate / up (``stock.layers.situ_and_mul`` before its
        rounding): beta tanh(gate / beta) sigmoid(gate) * lb tanh(up / lb)."""
        return beta * _tanh(gate / beta) * tl.sigmoid(gate) * (linear_beta * _tanh(up / linear_beta))
