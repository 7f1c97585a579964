"""lower_kernels: which subgraphs of the tiny stack it lowers, and what it reports.

Numerics of the lowered decoder: test_hybrid_attention.py (every pass, bitwise against
stock on CPU, where the kernels' references run) and test_gpu_decode.py (H200).
"""

import pytest
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
    cores = len(report.layers)
    assert info.rewritten >= cores
    # cuBLAS keeps every tiny GEMM: our GEMMs are dispatched only at measured TP8 shapes
    assert any("GEMM" in s and "cuBLAS is the fastest" in s for s in info.skipped)
