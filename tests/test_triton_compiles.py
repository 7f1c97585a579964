"""Triton kernels compile for sm_90 without a GPU: the interpreter runs what the compiler
may still reject (constexpr rules, types of loop-carried values), so CI compiles them too."""

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kimi_inductor.kernels import dsa_index  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)


@pytest.mark.skipif(dsa_index.INTERPRET, reason="TRITON_INTERPRET=1 replaces the jitted kernels")
@pytest.mark.parametrize("q", [1, 4])
def test_dsa_select_kernel_compiles_for_sm90(q):
    sig = {"scores_ptr": "*fp32", "seq_lens_ptr": "*i32", "out_ptr": "*i1", "W": "i32", "K": "i32",
           "Q": "constexpr", "BLOCK": "constexpr"}
    src = ASTSource(dsa_index._select_kernel, sig, constexprs={"Q": q, "BLOCK": dsa_index.SELECT_MAX})
    kernel = triton.compile(src, target=SM90, options={"num_warps": 16})
    assert ".target sm_90" in kernel.asm["ptx"]


@pytest.mark.skipif(dsa_index.INTERPRET, reason="TRITON_INTERPRET=1 replaces the jitted kernels")
def test_dsa_positions_kernel_compiles_for_sm90():
    sig = {"sel_ptr": "*i1", "pos_ptr": "*i32", "count_ptr": "*i32", "W": "i32", "CAP": "i32",
           "Q": "constexpr", "BLOCK": "constexpr"}
    src = ASTSource(dsa_index._positions_kernel, sig, constexprs={"Q": 4, "BLOCK": 8192})
    kernel = triton.compile(src, target=SM90, options={"num_warps": 16})
    assert ".target sm_90" in kernel.asm["ptx"]


@pytest.mark.skipif(dsa_index.INTERPRET, reason="TRITON_INTERPRET=1 replaces the jitted kernels")
def test_dsa_radix_kernels_compile_for_sm90():
    common = {"scores_ptr": "*fp32", "seq_lens_ptr": "*i32", "merged_ptr": "*i32", "last_ptr": "*i32"}
    ints = {"W": "i32", "K": "i32", "NC": "i32"}
    for p in range(4):
        sig = {**common, **ints, "Q": "constexpr", "PASS": "constexpr", "C": "constexpr"}
        src = ASTSource(dsa_index._radix_hist_kernel, sig, constexprs={"Q": 1, "PASS": p, "C": dsa_index.RADIX_CHUNK})
        assert ".target sm_90" in triton.compile(src, target=SM90, options={"num_warps": 16}).asm["ptx"]
    sig = {**common, "out_ptr": "*i1", **ints, "Q": "constexpr", "C": "constexpr", "NCP": "constexpr"}
    src = ASTSource(dsa_index._radix_mask_kernel, sig, constexprs={"Q": 4, "C": dsa_index.RADIX_CHUNK, "NCP": 16})
    assert ".target sm_90" in triton.compile(src, target=SM90, options={"num_warps": 16}).asm["ptx"]
