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
    assert any("GEMM" in s and "never timed against it" in s for s in info.skipped)


def test_cpu_router_gemm_is_matched_with_its_bf16_operands():
    """The router's CPU form, ``x.float() @ W.float().t()``, is the bf16 GEMM with fp32
    logits (so that dispatch sees bf16 operands), not an fp32 GEMM of the casts."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    from kimi_inductor.passes.gemm_neighbours import match_gemm

    x, w = torch.randn(2, 64).to(torch.bfloat16), torch.randn(32, 64).to(torch.bfloat16)
    gm = make_fx(lambda x, w: x.float() @ w.float().t(), decomposition_table=select_decomp_table())(x, w)
    found = [m for n in gm.graph.nodes if (m := match_gemm(n)) is not None]
    assert len(found) == 1
    xs, ws, acc, out_dtype = found[0]
    assert (xs.meta["val"].dtype, ws.meta["val"].dtype, acc, out_dtype) == (torch.bfloat16, torch.bfloat16, None,
                                                                         torch.float32)


@pytest.mark.skipif(bool(__import__("kimi_inductor.kernels", fromlist=["skinny_gemm"]).skinny_gemm.cute_available()),
                    reason="the fusions live in the CuTe GEMV (the cute extra)")
@pytest.mark.parametrize("rows, fused", [(1, True), (8, False)])
def test_norm_and_situ_fuse_into_their_gemms_at_k3_shapes(rows, fused):
    """The latent MoE tail (RMSNorm -> up-projection with the shared experts' output as
    accumulator), MLA's q_a norm -> q_b and the shared experts' gate_up -> SiTU at TP8
    per-rank shapes, decomposed as AOTAutograd does: at one row each pair becomes one
    fused op; at 8 rows (the Triton GEMM's territory) nothing is fused
    and the report says why."""
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from kimi_inductor.config import Options
    from kimi_inductor.passes.decoder import DecoderGraph
    from kimi_inductor.passes.lower_kernels import LowerKernels
    from kimi_inductor.passes.manager import PassContext
    from kimi_inductor.passes.report import MatchReport
    from kimi_inductor.stock.attn_res import rms_norm
    from kimi_inductor.stock.layers import situ_and_mul

    def tail(y, gy, w_up, shared, qa, gq, w_qb, x, w_gu):
        up = torch.addmm(shared, rms_norm(y, gy, 1e-5), w_up.t())
        q = rms_norm(qa, gq, 1e-6) @ w_qb.t()
        return up, q, situ_and_mul(x @ w_gu.t(), 4.0, 25.0)

    bf16 = torch.bfloat16
    with FakeTensorMode():
        args = [torch.empty(rows, 3584, dtype=bf16), torch.empty(3584, dtype=bf16), torch.empty(7168, 3584, dtype=bf16),
                torch.empty(rows, 7168, dtype=bf16), torch.empty(rows, 1536, dtype=bf16),
                torch.empty(1536, dtype=bf16), torch.empty(2304, 1536, dtype=bf16),
                torch.empty(rows, 7168, dtype=bf16), torch.empty(12288, 7168, dtype=bf16)]
        gm = make_fx(tail, decomposition_table=select_decomp_table())(*args)
    info = LowerKernels()(gm, PassContext(gm, Options(), MatchReport(), DecoderGraph()))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    kk, aten = torch.ops.kimi_kernels, torch.ops.aten
    if fused:
        assert targets.count(kk.rms_norm_mm.default) == 2 and targets.count(kk.mm_situ.default) == 1
        assert not {aten.rsqrt.default, aten.tanh.default, aten.mm.default, aten.addmm.default} & set(targets)
    else:
        assert not {kk.rms_norm_mm.default, kk.mm_situ.default} & set(targets)
        for kind, gemm in (("rms_norm", "7168x3584"), ("rms_norm", "2304x1536"), ("situ", "12288x7168")):
            assert any(f"{kind} next to GEMM {gemm}, not fused: tl_dot" in s for s in info.skipped)


@pytest.mark.parametrize("rows, lowered", [(1, True), (2, False), (65, False)])
def test_mla_per_head_gemms_are_lowered_at_k3_shapes(rows, lowered):
    """MLA's absorption (q_nope [T, 12, 128] as heads x W_UK [12, 128, 512]) and v
    up-projection (latent [T, 12, 512] x W_UV^T [12, 512, 128]) at TP8 per-rank shapes, as
    AOTAutograd spells stock's (bmm of permuted views, the weights views of kv_b):
    ``skinny_bmm`` at one row (where it measured faster in the layer), the bmm kept with
    its reason from two; on CPU the op is ``torch.bmm`` (same bits)."""
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from kimi_inductor.config import Options
    from kimi_inductor.passes.decoder import DecoderGraph
    from kimi_inductor.passes.lower_kernels import LowerKernels
    from kimi_inductor.passes.manager import PassContext
    from kimi_inductor.passes.report import MatchReport

    def heads(q, kv_b, latent):  # stock's weights: views of kv_b [12, nope + v, 512]
        ql = torch.bmm(q[..., :128].permute(1, 0, 2), kv_b[:, :128]).permute(1, 0, 2)
        return ql, torch.bmm(latent.permute(1, 0, 2), kv_b[:, 128:].transpose(1, 2)).permute(1, 0, 2)

    bf16 = torch.bfloat16
    with FakeTensorMode():
        args = [torch.empty(rows, 12, 192, dtype=bf16), torch.empty(12, 256, 512, dtype=bf16),
                torch.empty(rows, 12, 512, dtype=bf16)]
        gm = make_fx(heads, decomposition_table=select_decomp_table())(*args)
    info = LowerKernels()(gm, PassContext(gm, Options(), MatchReport(), DecoderGraph()))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.kimi_kernels.skinny_bmm.default) == (2 if lowered else 0)
    assert targets.count(torch.ops.aten.bmm.default) == (0 if lowered else 2)
    reason = "65 rows (> 64" if rows > 64 else "cuBLAS was faster from 2 rows"
    assert lowered or any(f"per-head GEMM 12x128x512: {reason}" in s for s in info.skipped)
    g = torch.Generator().manual_seed(rows)
    real = [torch.randn(a.shape, generator=g).to(bf16) for a in args]
    gm.recompile()
    assert all(torch.equal(a, b) for a, b in zip(gm(*real), heads(*real)))


@pytest.mark.parametrize("rows, lowered", [(1, True), (2, True), (3, False)])
def test_mla_v_up_and_output_gate_are_one_launch_at_k3_shapes(rows, lowered):
    """MLA's tail as AOTAutograd spells stock's: the v up-projection (latent [T, 12, 512] x
    W_UV^T, heads permuted back, copied when T > 1), the sigmoid output gate and o_proj:
    ``skinny_bmm_gate`` where it is measured (``FASTEST_BMM_GATE``), else the bmm kept
    with its reason; on CPU bitwise the unlowered graph."""
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from kimi_inductor.config import Options
    from kimi_inductor.passes.decoder import DecoderGraph
    from kimi_inductor.passes.lower_kernels import LowerKernels
    from kimi_inductor.passes.manager import PassContext
    from kimi_inductor.passes.report import MatchReport
    from kimi_inductor.stock.mla import output_gate

    def tail(latent, kv_b, gate, w_o):
        attn = torch.bmm(latent.transpose(0, 1), kv_b[:, 128:].transpose(1, 2)).transpose(0, 1)
        return output_gate(attn.reshape(latent.shape[0], -1), gate) @ w_o.t()

    bf16 = torch.bfloat16
    shapes = [(rows, 12, 512), (12, 256, 512), (rows, 1536), (7168, 1536)]
    with FakeTensorMode():
        gm = make_fx(tail, decomposition_table=select_decomp_table())(*[torch.empty(s, dtype=bf16) for s in shapes])
    info = LowerKernels()(gm, PassContext(gm, Options(), MatchReport(), DecoderGraph()))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    kk = torch.ops.kimi_kernels
    assert targets.count(kk.skinny_bmm_gate.default) == lowered
    assert lowered or any(s.endswith("per-head GEMM 12x512x128 + output gate, unfused: 3 rows: taken up to 2 "
                                     "(skinny_gemm.FASTEST_BMM_GATE)") for s in info.skipped)
    if lowered:
        assert not {torch.ops.aten.bmm.default, torch.ops.aten.sigmoid.default, torch.ops.aten.clone.default} \
            & set(targets)
    g = torch.Generator().manual_seed(rows)
    real = [torch.randn(s, generator=g).to(bf16) for s in shapes]
    gm.recompile()
    assert torch.equal(gm(*real), tail(*real))


def test_fused_ops_compute_stock_on_cpu():
    """The fused ops' CPU references are stock's functions around the same GEMM."""
    from kimi_inductor.stock.attn_res import rms_norm
    from kimi_inductor.stock.layers import situ_and_mul

    g = torch.Generator().manual_seed(0)
    x, w, nw = (torch.randn(*s, generator=g).to(torch.bfloat16) for s in [(3, 64), (32, 64), (64,)])
    acc = torch.randn(3, 32, generator=g).to(torch.bfloat16)
    assert torch.equal(torch.ops.kimi_kernels.rms_norm_mm(x, nw, 1e-5, w, acc, torch.bfloat16),
                       torch.addmm(acc, rms_norm(x, nw, 1e-5), w.t()))
    assert torch.equal(torch.ops.kimi_kernels.mm_situ(x, w, 4.0, 25.0), situ_and_mul(x @ w.t(), 4.0, 25.0))


def test_vllm_kda_group_without_its_gated_norm_says_where_the_path_ends():
    """vLLM's KDA recurrence whose output reaches the gated norm only through an op the
    matcher does not follow (here a clone): the group is kept, and the reason names the
    op, so a graph spelled differently (e.g. on another device) is diagnosable from the
    report alone."""
    import operator

    from torch import fx
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table, triton_kernel_wrapper_functional

    from kimi_inductor.passes import vllm_kda
    from kimi_inductor.passes.graph import TritonCall

    def kernel(name):  # a stand-in for the jitted kernel: only its module and name are read
        def fn():
            pass
        fn.__module__, _, fn.__name__ = name.rpartition(".")
        return fn

    def launch(g, name, **tensors):
        kwargs = dict(kernel_idx=kernel_side_table.add_kernel(kernel(name)),
                      constant_args_idx=kernel_side_table.add_constant_args(dict(vllm_kda.NORM_FLAGS)),
                      grid=[(1, 1, 1)], tma_descriptor_metadata={}, kwargs=tensors, tensors_to_clone=list(tensors))
        return g.call_function(triton_kernel_wrapper_functional, (), kwargs)

    def graph(through_clone):
        g = fx.Graph()
        buf = g.placeholder("buf")
        rec = launch(g, vllm_kda.REC, out=buf)
        out = g.call_function(operator.getitem, (rec, "out"))
        x = g.call_function(torch.ops.aten.view.default, (out, [-1, 16]))
        if through_clone:
            x = g.call_function(torch.ops.aten.clone.default, (x,))
        norm = launch(g, vllm_kda.NORM, x=x, y=x)
        g.output(g.call_function(operator.getitem, (norm, "y")))
        return TritonCall(rec)

    assert isinstance(vllm_kda._norm_after(graph(False)), TritonCall)
    reason = vllm_kda._norm_after(graph(True))
    assert reason == "no gated RMSNorm reads its output (its path ends at aten.clone.default)", reason



@pytest.mark.parametrize("row", [32, 30])
def test_byte_pages_respells_typed_views_of_byte_slices_exactly(row):
    """byte_pages on vLLM's binding of two typed states in an int8 page (bf16 bytes [0, 8),
    then fp32 bytes [8, 24) read from the first write-back):
    ``view.dtype(slice(page))`` -> ``slice(view.dtype(page))`` and each write-back
    scatters into the typed page; the same values. Where the page's rows are not whole
    elements of a view (30 bytes: no fp32 view) that pair is left as it is, with the
    reason."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from kimi_inductor.passes.byte_pages import BytePages

    aten = torch.ops.aten

    def step(page, y):
        conv = page[:, :8].view(torch.bfloat16)
        page = torch.slice_scatter(page, (conv * 2).view(torch.int8), 1, 0, 8)
        state = page[:, 8:24].view(torch.float32)
        return torch.slice_scatter(page, (state * 2 + y).view(torch.int8), 1, 8, 24), state.sum(1)

    page = torch.randn(3, 16, dtype=torch.bfloat16).view(torch.int8)[:, :row]  # finite bf16 and fp32 bytes
    y = torch.randn(3, 4)
    gm = make_fx(step, tracing_mode="fake")(page, y)
    for node in [n for n in gm.graph.nodes if n.target is aten.detach.default]:  # as in a post-grad graph
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    want = step(page, y)
    info = BytePages()(gm, None)
    gm.recompile()
    got = gm(page, y)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    sliced = [n for n in gm.graph.nodes if n.target is aten.view.dtype and n.args[0].target is aten.slice.Tensor]
    scatters = [n.args[2:] for n in gm.graph.nodes if n.target is aten.slice_scatter.default]
    assert info.matched == 4
    if row % 4:
        assert info.rewritten == 2 and len(sliced) == 1 and scatters == [(1, 0, 4), (1, 8, 24)]
        assert len(info.skipped) == 2 and all("not a whole-element slice" in s for s in info.skipped)
    else:
        assert info.rewritten == 4 and not sliced and scatters == [(1, 0, 4), (1, 2, 6)]


def test_mla_kv_norm_moves_into_the_cache_write(fake_world):
    """Each MLA layer's kv_a RMSNorm, read only by its core, becomes the core's cache write
    (``mla_decode(..., kv_norm_weight=...)``): no norm kernel of its own."""
    graphs = {}
    compile_tiny("tiny", group=fake_world(2), q=1, requests=2, padding=1,
                 observer=lambda stage, gm: graphs.setdefault(stage, gm.graph))
    calls = [n for n in graphs["after lower_kernels"].nodes if n.target is torch.ops.kimi_kernels.mla_decode.default]
    # as Inductor re-inplaces it: the op called with its schema's positions (kv_norm_weight, kv_norm_eps last)
    assert len(calls) == 3 and all(n.args[9].op == "placeholder" and n.args[10] == 1e-5 for n in calls)
    assert not any(n.args[2].target is torch.ops.aten.mul.Tensor for n in calls)  # kv_c: not the norm's output


@pytest.mark.parametrize("merge_into_up", [2, 1])
def test_mla_merge_moves_into_the_gated_v_up_projection(monkeypatch, merge_into_up):
    """Up to ``MERGE_INTO_UP`` rows each MLA core and its tail (the v up-projection read
    only by the output gate) become one ``mla_decode_gated`` (the splits' merge inside the
    up-projection), whether or not ``skinny_bmm_gate`` would take the tail (at the tiny
    stack's shapes it would not); above it the report says why not. On CPU the step is
    bitwise the unfolded one."""
    from kimi_inductor.kernels import mla_decode as mla_kernel

    monkeypatch.setattr(mla_kernel, "MERGE_INTO_UP", merge_into_up)
    graphs = {}
    backend, out = compile_tiny("tiny", q=1, requests=2, padding=0,
                                observer=lambda stage, gm: graphs.setdefault(stage, gm.graph))
    targets = [n.target for n in graphs["after lower_kernels"].nodes]  # re-inplaced, as Inductor leaves them
    kk = torch.ops.kimi_kernels
    folded = merge_into_up >= 2
    assert targets.count(kk.mla_decode_gated.default) == (3 if folded else 0)
    assert targets.count(kk.mla_decode.default) == (0 if folded else 3)
    info = next(p for p in backend.report.passes if p.name == "lower_kernels")
    assert folded or any("merge apart from the v up-projection: 2 rows: taken up to 1" in s for s in info.skipped)
    monkeypatch.setattr(mla_kernel, "MERGE_INTO_UP", 0)
    assert torch.equal(compile_tiny("tiny", q=1, requests=2, padding=0)[1], out)
