"""The passes of ``kimi_specialized``, in the order they run (the only list of them).

    hybrid_attention  SP decoder -> hybrid step (first: later passes see final row layouts)
    mega_moe          routed experts -> our expert-parallel / grouped expert kernels
    sharded_moe       small batches: hybrid MoE layers on all rows, shared experts and
                      latent up-projection TP-sharded (after mega_moe: replaces its exchange)
    lower_kernels     decode subgraphs -> our Triton / CuTe DSL kernels
    byte_pages        typed views of byte cache pages re-spelt as Inductor compiles them
                      right (last: lower_kernels matches vLLM's spelling)
"""

from __future__ import annotations

from .byte_pages import BytePages
from .hybrid_attention import HybridAttention
from .lower_kernels import LowerKernels
from .mega_moe import MegaMoE
from .sharded_moe import ShardedMoE

PASSES = {p.name: p for p in (HybridAttention, MegaMoE, ShardedMoE, LowerKernels, BytePages)}
PASS_ORDER = tuple(PASSES)
