"""lower_kernels: which subgraphs of the tiny stack it lowers, and what it reports.

Numerics of the lowered decoder: test_hybrid_attention.py (every pass, bitwise against
stock on CPU, where the kernels' references run) and test_gpu_decode.py (H200).
"""

import pytest
import torch
from helpers import compile_tiny

pytest.importorskip("triton")


@pytest.mark.parametrize("preset", ["tiny", "tiny-k3.1"])
def test_attention_cores_are_lowered_and_reported(fake_world, preset):
    backend, _ = compile_tiny(preset, group=fake_world(2), q=4, requests=2, padding=1)
    report = backend.report
    info = next(p for p in report.passes if p.name == "lower_kernels")
    for layer in report.layers:
        note = layer.notes["kernels"]
        attention = note.split(";")[0]
        if layer.kind == "kda":
            assert "fused KDA x1" in attention
        else:
            assert {"mla": "MLA core x1", "dsa": "DSA core x1"}[layer.kind] in attention
        assert note.endswith("AttnRes: fused x2")  # pre- and post-attention
    cores = len(report.layers)
    assert info.rewritten >= cores
    # cuBLAS keeps every tiny GEMM: our GEMMs are dispatched only at measured TP8 shapes
    assert any("GEMM" in s and "cuBLAS is the fastest" in s for s in info.skipped)


def test_cpu_router_gemm_is_matched_with_its_bf16_operands():
    """The router's CPU form, ``x.float() @ W.float().t()``, is the bf16 GEMM with fp32
    logits (so that dispatch sees bf16 operands), not an fp32 GEMM of the casts."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    from kimi_inductor.passes.lower_kernels import match_gemm

    x, w = torch.randn(2, 64).to(torch.bfloat16), torch.randn(32, 64).to(torch.bfloat16)
    gm = make_fx(lambda x, w: x.float() @ w.float().t(), decomposition_table=select_decomp_table())(x, w)
    found = [m for n in gm.graph.nodes if (m := match_gemm(n)) is not None]
    assert len(found) == 1
    xs, ws, acc, out_dtype = found[0]
    assert (xs.meta["val"].dtype, ws.meta["val"].dtype, acc, out_dtype) == (torch.bfloat16, torch.bfloat16, None,
                                                                         torch.float32)
