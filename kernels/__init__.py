"""Our kernels: ``torch.library`` custom ops (namespace ``kimi_kernels``), each with one
semantics (its CPU reference), its Triton / CuTe DSL implementations and one dispatch
rule, all in the op's file."""

from . import expert_ffn, kda_decode, mega_moe, mla_decode, skinny_gemm

__all__ = ["expert_ffn", "kda_decode", "mega_moe", "mla_decode", "skinny_gemm"]
