"""What our Triton kernels share: whether Triton is here, whether it interprets (CPU,
``TRITON_INTERPRET=1``), and stock's bf16 rounding done exactly.

Triton is optional (a dependency only where its wheels exist: Linux x86_64). Without
it every name below still imports (``triton``, ``tl`` and ``bf16_round`` are None)
and each op dispatches to its CPU reference."""

from __future__ import annotations

import os

SMS = 132  # streaming multiprocessors of the H200 the launch heuristics were measured on

try:
    import triton
    import triton.language as tl

    INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # as triton.jit decided at import
except ImportError:  # CPU machines without Triton use the references
    triton, tl, INTERPRET = None, None, False

bf16_round = None
if triton is not None:

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
