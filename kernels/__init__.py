"""Our kernels: ``torch.library`` custom ops (namespace ``kimi_kernels``), each with one
semantics (its CPU reference), its Triton / CuTe DSL implementations and one dispatch
rule, all in the op's file.

Only ``kimi_inductor.kernels`` registers the ops. From a checkout's root this folder is
also importable as a top-level ``kernels`` (transformers imports it while probing for
the Hugging Face ``kernels`` package); registering again from there would replace our
ops and invalidate every ``torch.ops.kimi_kernels`` object the passes hold."""

if __name__ == "kimi_inductor.kernels":
    from . import (attn_res, dsa_index, expert_ffn, kda_decode, mega_moe, mla_decode, moe_projections, moe_router,
                   skinny_gemm)

    __all__ = ["attn_res", "dsa_index", "expert_ffn", "kda_decode", "mega_moe", "mla_decode", "moe_projections",
               "moe_router", "skinny_gemm"]
