"""Triton kernels compile for sm_90 without a GPU: the interpreter runs what the compiler
may still reject (constexpr rules, types of loop-carried values), so CI compiles them too."""

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kimi_inductor.kernels import dsa_index  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)


def aligned(sig: dict, names) -> dict:
    """``ASTSource`` attrs: these arguments 16-byte divisible, as the launcher specialises
    aligned pointers and strides (without it the compile emits no ``cp.async``)."""
    return {(list(sig).index(name),): [["tt.divisibility", 16]] for name in names}


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
    sig = {"sel_ptr": "*i1", "seq_lens_ptr": "*i32", "pos_ptr": "*i32", "count_ptr": "*i32", "W": "i32", "CAP": "i32",
           "Q": "constexpr", "BLOCK": "constexpr"}
    src = ASTSource(dsa_index._positions_kernel, sig, constexprs={"Q": 4, "BLOCK": 8192})
    kernel = triton.compile(src, target=SM90, options={"num_warps": 16})
    assert ".target sm_90" in kernel.asm["ptx"]


@pytest.mark.skipif(dsa_index.INTERPRET, reason="TRITON_INTERPRET=1 replaces the jitted kernels")
@pytest.mark.parametrize("q", [1, 4])
def test_dsa_scores_kernel_compiles_for_sm90(q):
    """K3.1's indexer (32 heads of 128): programs past the request's length only store."""
    sig = {"q_ptr": "*bf16", "w_ptr": "*fp32", "cache_ptr": "*bf16", "block_table_ptr": "*i32", "stride_bt": "i32",
           "seq_lens_ptr": "*i32", "out_ptr": "*fp32", "W": "i32",
           **{k: "constexpr" for k in ("Q", "N", "QN", "D", "BLOCK", "BP", "DOT_F32")}}
    src = ASTSource(dsa_index._scores_kernel, sig, constexprs={"Q": q, "N": 32, "QN": 32 * q, "D": 128, "BLOCK": 64,
                                                               "BP": dsa_index.BP, "DOT_F32": False})
    assert ".target sm_90" in triton.compile(src, target=SM90, options={"num_warps": 4}).asm["ptx"]


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


def skinny_gemm_ptx(M: int, dtype: str, dot_f32: bool) -> str:
    """PTX of ``tl_dot._mm_kernel`` at its default tiles for MLA's q_b (K split in 3), with the 16-byte divisibility the launcher specialises pointers and K-strides to."""
    from kimi_inductor.kernels.skinny_gemm import tl_dot

    sig = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "acc_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
           "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_x": "i32",
           "stride_w": "i32", "stride_acc": "i32", "stride_out": "i32", "SPLIT": "i32",
           **{k: "constexpr" for k in ("BM", "BN", "BK", "REDUCE", "HAS_ACC", "DOT_F32", "TMA", "PDL")}}
    attrs = aligned(sig, ("x_ptr", "w_ptr", "acc_ptr", "out_ptr", "ws_ptr", "K", "stride_x", "stride_w", "stride_acc",
                          "stride_out"))
    cfg = tl_dot.config(M, 2304, 1536, 4 if dtype == "fp32" else 2)
    assert cfg.split > 1
    constexprs = {"BM": max(16, M), "BN": cfg.bn, "BK": cfg.bk, "REDUCE": cfg.split > 1, "HAS_ACC": True,
                  "DOT_F32": dot_f32, "TMA": False, "PDL": True}
    return triton.compile(ASTSource(tl_dot._mm_kernel, sig, constexprs=constexprs, attrs=attrs), target=SM90,
                          options={"num_warps": cfg.warps, "num_stages": cfg.stages}).asm["ptx"]


@pytest.mark.skipif(dsa_index.INTERPRET, reason="TRITON_INTERPRET=1 replaces the jitted kernels")
@pytest.mark.parametrize("M", [8, 64])
def test_skinny_gemm_compiles_for_sm90_to_pipelined_wgmma(M):
    """The weight is the 64-row side of ``wgmma`` (n = the few x rows), its tiles stream
    through ``cp.async`` stages, the K chunks meet at an acq_rel arrival counter, PDL."""
    ptx = skinny_gemm_ptx(M, "bf16", False)
    assert f"wgmma.mma_async.sync.aligned.m64n{max(16, M)}k16.f32.bf16" in ptx
    assert "cp.async.cg" in ptx and "griddepcontrol.wait" in ptx and "atom.global.gpu.acq_rel.add" in ptx


@pytest.mark.skipif(dsa_index.INTERPRET, reason="TRITON_INTERPRET=1 replaces the jitted kernels")
@pytest.mark.parametrize("dot_f32", [False, True])
def test_skinny_gemm_on_fp32_operands_is_ieee_fp32(dot_f32):
    """fp32 operands (the fp32 model of the exact-function checks) take the IEEE fp32 dot:
    ``tl.dot``'s fp32 default is TF32, which put the compiled fp32 decoder 1e-3 off fp32
    stock at K3 shapes (docs/testing.md, "bf16 at K3 per-rank shapes")."""
    import torch

    from kimi_inductor.kernels.skinny_gemm import tl_dot

    assert tl_dot.dot_f32(torch.float32) and tl_dot.dot_f32(torch.bfloat16) == tl_dot.INTERPRET
    assert ("tf32" in skinny_gemm_ptx(8, "fp32", dot_f32)) != dot_f32


@pytest.mark.skipif(dsa_index.INTERPRET, reason="TRITON_INTERPRET=1 replaces the jitted kernels")
@pytest.mark.parametrize("K, N, unit, gate", [(128, 512, "stride_wn", False), (512, 128, "stride_wk", False),
                                           (512, 128, "stride_wk", True)])
def test_per_head_gemm_compiles_for_sm90_with_pdl_and_strided_operands(K, N, unit, gate):
    """MLA's absorption (W_UK N-contiguous) and v up-projection (W_UV^T K-contiguous, also
    with the output gate): x a permuted view (K contiguous), bf16 tensor-core dots,
    launched with PDL."""
    from kimi_inductor.kernels.skinny_gemm import tl_dot

    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "gate_ptr": "*bf16", "M": "i32", "N": "i32",
           "K": "i32", **{s: "i32" for s in ("stride_xb", "stride_xm", "stride_xk", "stride_wb", "stride_wk",
                                             "stride_wn", "stride_ob", "stride_om", "stride_gm")},
           "BM": "constexpr", "BN": "constexpr", "BK": "constexpr", "DOT_F32": "constexpr", "ROUND": "constexpr",
           "GATE": "constexpr", "PDL": "constexpr"}
    assert list(sig) == tl_dot._bmm_kernel.arg_names
    constexprs = {**tl_dot.bmm_config(12, 1, K, N), "DOT_F32": False, "ROUND": True, "GATE": gate, "PDL": True,
                  "stride_xk": 1, unit: 1}
    ptx = triton.compile(ASTSource(tl_dot._bmm_kernel, sig, constexprs=constexprs), target=SM90,
                         options={"num_warps": 4, "num_stages": 3}).asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "mma" in ptx


@pytest.mark.skipif(dsa_index.INTERPRET, reason="TRITON_INTERPRET=1 replaces the jitted kernels")
@pytest.mark.parametrize("mxfp4, dot_f32", [(False, False), (True, False), (True, True)])
def test_expert_kernels_compile_for_sm90_with_bf16_and_mxfp4_weights(mxfp4, dot_f32):
    """The grouped expert kernels with the weights in registers from bf16 or MXFP4 (uint8
    codes + E8M0 scales, dequantised to bf16 for the tensor-core dot, or for fp32
    activations' IEEE dot)."""
    from kimi_inductor.kernels import expert_ffn

    tiles = {"BM": 16, "BN": 32, "BK": 128, "DOT_F32": dot_f32, "ROUND": not dot_f32, "MXFP4": mxfp4,
             "PREFETCH": 2 if mxfp4 else 0, "SCAN": 1024 if mxfp4 else 0, "PDL": True}
    for source in expert_ffn.sm90_sources(tiles).values():
        compiled = triton.compile(source, target=SM90, options={"num_warps": 4, "num_stages": 3})
        assert ".target sm_90" in compiled.asm["ptx"]
        assert "griddepcontrol.wait" in compiled.asm["ptx"]  # launched with programmatic dependent launch
        assert compiled.asm["ptx"].count("prefetch.global.L2") == (2 if mxfp4 else 0)  # codes and scales, per step


@pytest.mark.skipif(dsa_index.INTERPRET, reason="TRITON_INTERPRET=1 replaces the jitted kernels")
@pytest.mark.parametrize("pairs, experts", [(16, 112), (1024, 896)])
def test_pair_grouping_kernel_compiles_for_sm90(pairs, experts):
    """``expert_ffn._group_kernel`` (comparisons, histogram, prefix sums) at its smallest
    and largest decode sizes."""
    from kimi_inductor.kernels import expert_ffn

    sig = {**{n: "*i32" for n in ("ids_ptr", "order_ptr", "starts_ptr", "counts_ptr", "position_ptr", "slots_ptr")},
           "P": "i32", "E": "i32", "S": "i32", "PB": "constexpr", "BP": "constexpr", "EB": "constexpr",
           "COMPARE": "constexpr", "PDL": "constexpr"}
    for compare in (False, True):
        source = ASTSource(expert_ffn._group_kernel, sig, constexprs={
            "PB": pairs, "BP": min(pairs, expert_ffn.GROUP_BLOCK), "EB": triton.next_power_of_2(experts + 2),
            "COMPARE": compare, "PDL": True})
        assert "griddepcontrol.wait" in triton.compile(source, target=SM90, options={"num_warps": 4}).asm["ptx"]


@pytest.mark.skipif(dsa_index.INTERPRET, reason="TRITON_INTERPRET=1 replaces the jitted kernels")
def test_mxfp4_expert_kernels_fit_their_register_cap():
    """The MXFP4 expert kernels at their default tile (BN 64, BK 256, 4 warps, one stage,
    L2 prefetch one step ahead, the grid over expert slots) under the default cap of 128
    registers (four programs per SM), as ptxas allocates them for sm_90a with the
    launch's specialisation: the up kernel without spills, the down kernel with at most
    32 bytes (measured 0 and 16)."""
    import os
    import re
    import subprocess

    from kimi_inductor.kernels import expert_ffn

    tiles = {"BM": 16, "BN": 64, "BK": 256, "DOT_F32": False, "ROUND": True, "MXFP4": True, "PREFETCH": 1,
             "SCAN": 128, "PDL": True}
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    for name, source in expert_ffn.sm90_sources(tiles).items():
        ptx = triton.compile(source, target=SM90, options={"num_warps": 4, "num_stages": 1, "maxnreg": 128}).asm["ptx"]
        info = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", "-", "-o", os.devnull], input=ptx,
                              capture_output=True, text=True, check=True).stderr
        regs = int(re.search(r"Used (\d+) registers", info).group(1))
        spilled = int(re.search(r"(\d+) bytes spill stores", info).group(1))
        assert regs <= 128 and spilled <= {"up": 0, "down": 32}[name], info


@pytest.mark.skipif(dsa_index.INTERPRET, reason="TRITON_INTERPRET=1 replaces the jitted kernels")
@pytest.mark.parametrize("nv, bc", [(1, 128), (4, 32), (1, 32)])
def test_kda_kernel_compiles_for_sm90(nv, bc):
    """The fused KDA decode kernel at TP8 per-rank shapes (12 heads of 128), states
    addressed by slot stride, S whole or in chunks of ``bc`` rows; with PDL it releases
    o_proj only after its wait and its state load (the recurrent state's fp32 loads come
    before ``launch_dependents``)."""
    from kimi_inductor.kernels import kda_decode

    ptrs = {"qkv_ptr": "*bf16", "fa_ptr": "*bf16", "fbw_ptr": "*bf16", "g2_ptr": "*bf16", "beta_ptr": "*bf16",
            "convw_ptr": "*fp32", "alog_ptr": "*fp32", "dtb_ptr": "*fp32", "normw_ptr": "*bf16", "conv_ptr": "*bf16",
            "rec_ptr": "*fp32", "slots_ptr": "*i32", "acc_ptr": "*i32", "out_ptr": "*bf16", "ws_ptr": "*fp32",
            "cnt_ptr": "*i32"}
    ints = ("stride_qkv", "stride_fa", "stride_g2", "stride_beta", "stride_conv_s", "stride_conv_r", "stride_rec_s",
            "stride_out", "stride_cw_j", "stride_cw_p")
    params = kda_decode._kda_decode_kernel.arg_names
    constexprs = {"H": 12, "D": 128, "Q": 1, "ROUND": True, "DOT_F32": False, "NV": nv, "BC": bc, "PDL": True,
                  "stride_cw_t": 1}  # stock's conv weight: Triton specialises the unit stride
    sig = {name: ptrs.get(name) or ("i32" if name in ints else "fp32" if name in ("lower_bound", "eps")
                                    else "constexpr") for name in params}
    compiled = triton.compile(ASTSource(kda_decode._kda_decode_kernel, sig, constexprs=constexprs), target=SM90,
                              options={"num_warps": 4})
    ptx = compiled.asm["ptx"]
    assert ".target sm_90" in ptx
    wait, release = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
    assert wait < release and ptx.count("griddepcontrol.launch_dependents") == 1
    assert ptx[wait:release].count("ld.global") >= ptx[release:].count("ld.global")


@pytest.mark.skipif(dsa_index.INTERPRET, reason="TRITON_INTERPRET=1 replaces the jitted kernels")
def test_moe_out_and_select_experts_kernels_compile_for_sm90():
    """With PDL (griddepcontrol) as they launch on the H200."""
    from kimi_inductor.kernels import moe_projections, moe_router

    ints = {k: "i32" for k in ("M", "N", "stride_h", "stride_y", "stride_wd", "stride_wu", "stride_out")}
    sig = {"h_ptr": "*bf16", "y_ptr": "*bf16", "wd_ptr": "*bf16", "wu_ptr": "*bf16", "out_ptr": "*bf16", **ints,
           **{k: "constexpr" for k in ("DS", "LS", "BM", "BN", "BK", "DOT_F32", "PDL")}}
    src = ASTSource(moe_projections._moe_out_kernel, sig, constexprs={"DS": 768, "LS": 448, "BM": 16, "BN": 32,
                                                                        "BK": 256, "DOT_F32": False, "PDL": True})
    assert "griddepcontrol.wait" in triton.compile(src, target=SM90, options={"num_warps": 4}).asm["ptx"]
    sig = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "w_ptr": "*fp32", "ids_ptr": "*i32", "E": "i32",
           "stride_l": "i32", "scale": "fp32", **{k: "constexpr" for k in ("K", "BK", "BE", "RENORM", "PDL")}}
    src = ASTSource(moe_router._select_kernel, sig, constexprs={"K": 16, "BK": 16, "BE": 1024, "RENORM": True,
                                                                "PDL": True})
    assert "griddepcontrol.wait" in triton.compile(src, target=SM90, options={"num_warps": 4}).asm["ptx"]


@pytest.mark.skipif(dsa_index.INTERPRET, reason="TRITON_INTERPRET=1 replaces the jitted kernels")
@pytest.mark.parametrize("M", [8, 64])
def test_triton_moe_in_compiles_for_sm90_to_pipelined_wgmma(M):
    """K3 at G = 8: every tile (router, latent, 32 gate + 32 up rows) is a 64-row ``wgmma``
    side streamed through ``cp.async`` stages, with PDL."""
    from kimi_inductor.kernels import moe_projections

    sig = {"x_ptr": "*bf16", "wr_ptr": "*bf16", "wl_ptr": "*bf16", "wgu_ptr": "*bf16", "logits_ptr": "*fp32",
           "z_ptr": "*bf16", "h_ptr": "*bf16", **{k: "i32" for k in ("M", "E", "L", "DG", "a0", "D", "stride_x")},
           "beta": "fp32", "linear_beta": "fp32", "TR": "i32", "TL": "i32",
           **{k: "constexpr" for k in ("K", "BM", "BN", "BK", "DOT_F32", "PDL")}}
    attrs = aligned(sig, ("x_ptr", "wr_ptr", "wl_ptr", "wgu_ptr", "logits_ptr", "z_ptr", "h_ptr", "E", "L", "DG", "a0",
                          "D", "stride_x"))
    src = ASTSource(moe_projections._moe_in_kernel, sig, attrs=attrs,
                    constexprs={"K": 7168, "BM": max(16, M), "BN": 64, "BK": 128, "DOT_F32": False, "PDL": True})
    ptx = triton.compile(src, target=SM90, options={"num_warps": 4, "num_stages": 5}).asm["ptx"]
    assert f"wgmma.mma_async.sync.aligned.m64n{max(16, M)}k16.f32.bf16" in ptx
    assert "cp.async.cg" in ptx and "griddepcontrol.wait" in ptx


@pytest.mark.skipif(dsa_index.INTERPRET, reason="TRITON_INTERPRET=1 replaces the jitted kernels")
def test_mla_cache_insert_and_combine_compile_for_sm90():
    """The MLA cache write (also normalising kv_c, the layer's kv_a RMSNorm) and the
    splits' merge, with PDL as they launch on the H200."""
    from kimi_inductor.kernels import mla_decode

    sig = {"a_ptr": "*bf16", "stride_a": "i32", "b_ptr": "*bf16", "stride_b": "i32", "slot_ptr": "*i64",
           "cache_ptr": "*bf16", "norm_ptr": "*bf16", "eps": "fp32", "block_local": "i32", "dcp_rank": "i32",
           "dcp_size": "i32", **{k: "constexpr" for k in ("A", "B", "AP", "BP", "ROW", "NORM", "ROUND", "PDL")}}
    assert list(sig) == mla_decode._insert_kernel.arg_names
    for norm in (False, True):
        src = ASTSource(mla_decode._insert_kernel, sig, constexprs={"A": 512, "B": 64, "AP": 512, "BP": 64,
                                                                    "ROW": 576, "NORM": norm, "ROUND": True,
                                                                    "PDL": True})
        ptx = triton.compile(src, target=SM90, options={"num_warps": 1}).asm["ptx"]
        assert "griddepcontrol.wait" in ptx and ("rsqrt" in ptx) == norm
    sig = {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "nrows": "i32",
           "n_split": "i32", **{k: "constexpr" for k in ("L", "BL", "SP", "WITH_LSE", "PDL")}}
    for sp, with_lse in ((32, False), (256, True)):
        src = ASTSource(mla_decode._combine_kernel, sig, constexprs={"L": 512, "BL": max(16, 4096 // sp), "SP": sp,
                                                                     "WITH_LSE": with_lse, "PDL": True})
        assert "griddepcontrol.wait" in triton.compile(src, target=SM90, options={"num_warps": 4}).asm["ptx"]



@pytest.mark.skipif(dsa_index.INTERPRET, reason="TRITON_INTERPRET=1 replaces the jitted kernels")
@pytest.mark.parametrize("tokens", [1, 2])
def test_mla_merge_inside_the_gated_v_up_projection_compiles_for_sm90(tokens):
    """``mla_decode_gated``'s merge: 129 splits (one row at 4K with the fresh split), K3's
    TP8 heads (L 512, V 128), the head's last program to arrive summing its blocks."""
    from kimi_inductor.kernels import mla_decode

    sig = {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "w_ptr": "*bf16", "stride_wb": "i32", "stride_wk": "i32",
           "stride_wn": "i32", "gate_ptr": "*bf16", "stride_g": "i32", "out_ptr": "*bf16", "ws_ptr": "*fp32",
           "cnt_ptr": "*i32", "nrows": "i32", "n_split": "i32", "N": "i32", "V": "i32",
           **{k: "constexpr" for k in ("T", "L", "BL", "SP", "VP", "ROUND", "PDL")}}
    assert list(sig) == mla_decode._combine_up_kernel.arg_names
    src = ASTSource(mla_decode._combine_up_kernel, sig, constexprs={
        "T": tokens, "L": 512, "BL": mla_decode.merge_block(512, 256), "SP": 256, "VP": 128, "ROUND": True,
        "PDL": True})
    ptx = triton.compile(src, target=SM90, options={"num_warps": 4}).asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "atom.global.gpu.acq_rel.add" in ptx


@pytest.mark.skipif(dsa_index.INTERPRET, reason="TRITON_INTERPRET=1 replaces the jitted kernels")
@pytest.mark.parametrize("has_list, fresh", [(False, True), (True, False)])
def test_mla_split_kernel_compiles_for_sm90(has_list, fresh):
    """The split-KV core at K3's TP8 tile (16 rows, 32 positions a step), each program
    sizing its chunk from its request's length, with PDL; its cache tiles stream through
    ``cp.async`` (given the 16-byte alignment the launcher specialises pointers to). With
    ``fresh`` (MLA) its last split attends, normalises and writes the step's rows
    (``rsqrt``: the kv norm); DSA's listed positions keep the cache write apart."""
    from kimi_inductor.kernels import mla_decode

    sig = {"qn_ptr": "*bf16", "stride_qn_t": "i32", "stride_qn_h": "i32", "qp_ptr": "*bf16", "stride_qp_t": "i32",
           "stride_qp_h": "i32", "cache_ptr": "*bf16", "table_ptr": "*i32", "stride_table": "i32",
           "seq_ptr": "*i32", "sel_ptr": "*i32", "stride_sel": "i32", "list_ptr": "*i32", "stride_list": "i32",
           "count_ptr": "*i32", "acc_ptr": "*fp32", "ml_ptr": "*fp32", "kv_ptr": "*bf16", "stride_kv": "i32",
           "kpe_ptr": "*bf16", "stride_kpe": "i32", "slot_ptr": "*i64", "norm_ptr": "*bf16", "eps": "fp32",
           "N": "i32", "Q": "i32", "R_DIM": "i32", "scale": "fp32", "dcp_rank": "i32", "dcp_size": "i32",
           **{k: "constexpr" for k in ("L", "RP", "ROW", "BLOCK", "BM", "BS", "HAS_SEL", "HAS_LIST", "WHOLE",
                                       "FRESH", "QP", "NORM", "NORM_ROUND", "DOT_F32", "ROUND", "PDL")}}
    assert list(sig) == mla_decode._mla_split_kernel.arg_names
    attrs = aligned(sig, [n for n in sig if n.endswith("_ptr")] + ["stride_qn_t", "stride_qn_h", "stride_qp_t",
                                                                   "stride_qp_h"])
    constexprs = {"L": 512, "RP": 64, "ROW": 576, "BLOCK": 64, "BM": 16, "BS": mla_decode.BS, "HAS_SEL": False,
                  "HAS_LIST": has_list, "WHOLE": not has_list, "FRESH": fresh, "QP": 16, "NORM": fresh,
                  "NORM_ROUND": True, "DOT_F32": False, "ROUND": True, "PDL": True}
    src = ASTSource(mla_decode._mla_split_kernel, sig, constexprs=constexprs, attrs=attrs)
    ptx = triton.compile(src, target=SM90, options={"num_warps": 4, "num_stages": 2}).asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "cp.async.cg" in ptx and ("rsqrt" in ptx) == fresh
