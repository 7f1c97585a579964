"""kimi_kernels::skinny_mm and its implementations against fp32 GEMMs (bf16 out: within one
bf16 ulp); the CuTe DSL GEMV compiles for sm_90a without a GPU."""

import os

import pytest
import torch

from kimi_inductor.kernels import skinny_gemm
from kimi_inductor.kernels.common import arrival_counters
from kimi_inductor.kernels.skinny_gemm import tl_dot

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (N, K): TP8 per-rank shapes on the GPU; small ones (incl. a K split) in the interpreter
SHAPES = [(6288, 7168), (7168, 1536), (896, 7168), (2304, 1536)] if DEVICE == "cuda" else [(48, 64), (32, 2048)]
OUTS = [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)]
needs_cute = pytest.mark.skipif(bool(skinny_gemm.cute_available()), reason=skinny_gemm.cute_available() or "")


def operands(M, N, K, out_dtype, with_acc):
    g = torch.Generator().manual_seed(M + N + K)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g) * K**-0.5).to(torch.bfloat16)
    acc = torch.randn(M, N, generator=g).to(out_dtype) if with_acc else None
    want = x.float() @ w.float().t()  # exact products, fp32 sums
    if acc is not None:
        want = want + acc.float()
    dev = [t.to(DEVICE) if t is not None else None for t in (x, w, acc)]
    return dev, want


def check(got, want, out_dtype):
    got = got.cpu()
    assert got.dtype == out_dtype and got.shape == want.shape
    ulp = 2.0**-7 if out_dtype == torch.bfloat16 else 1e-5
    assert ((got.float() - want).abs() <= ulp * want.abs().clamp_min(1.0) + 1e-3).all()


@pytest.mark.parametrize("N, K", SHAPES)
@pytest.mark.parametrize("M", [1, 5, 16, 64])
@pytest.mark.parametrize("out_dtype, with_acc", OUTS)
def test_skinny_mm_matches_torch(M, N, K, out_dtype, with_acc):
    """The Triton kernel (the op itself in the interpreter); on the GPU the op runs what
    ``choose`` names (cuBLAS may reduce in bf16, so it is compared with torch's GEMM)."""
    (x, w, acc), want = operands(M, N, K, out_dtype, with_acc)
    got = torch.ops.kimi_kernels.skinny_mm(x, w, acc, out_dtype)
    if DEVICE == "cpu":
        check(got, want, out_dtype)
        return
    check(tl_dot.run(x, w, acc, out_dtype), want, out_dtype)
    impl = skinny_gemm.choose(M, N, K, x.dtype)[0]
    if impl == "cublas":
        assert torch.equal(got, skinny_gemm.reference(x, w, acc, out_dtype))
    else:
        check(got, want, out_dtype)


@pytest.mark.parametrize("N, K", SHAPES)
@pytest.mark.parametrize("M", [1, 5, 16, 64])
@pytest.mark.parametrize("out_dtype, with_acc", OUTS)
@pytest.mark.parametrize("split, tma", [(1, False), (3, False), (3, True)])
def test_weight_wide_gemm_matches_torch(M, N, K, out_dtype, with_acc, split, tma):
    """``tl_dot.run`` (W the MMA's wide side, K chunks reduced by the last program to
    arrive; W through pointers or a TMA descriptor) within one bf16 ulp of the fp32
    product, for a partial N tile and a K that the chunks do not divide; the counters are
    back to zero after every call."""
    (x, w, acc), want = operands(M, N, K, out_dtype, with_acc)
    cfg = tl_dot.Tile(bn=64 if DEVICE == "cuda" else 32, bk=128 if DEVICE == "cuda" else 16, split=split,
                      stages=4, warps=4, tma=tma)
    for _ in range(2):
        check(tl_dot.run(x, w, acc, out_dtype, cfg), want, out_dtype)
    assert not arrival_counters(x.device, N).any()


@pytest.mark.parametrize("B, K, N", [(12, 128, 512), (12, 512, 128)] if DEVICE == "cuda" else [(3, 32, 48), (4, 256, 40)])
@pytest.mark.parametrize("M", [1, 5, 17, 64])
def test_per_head_gemm_matches_torch(B, K, N, M):
    """``skinny_bmm`` on views as stock's MLA makes them (q_nope a permuted slice of q; the
    weight a slice of kv_b [B, K + 64, N] or the transpose of one of [B, N, K + 64])
    against the fp32 product within one bf16 ulp; the Triton kernel itself on the GPU
    too, and the op equals ``torch.bmm`` where it keeps cuBLAS."""
    g = torch.Generator().manual_seed(B + K + N + M)
    q = torch.randn(M, B, K + 64, generator=g).to(torch.bfloat16).to(DEVICE)
    x = q[..., :K].permute(1, 0, 2)
    for w in ((torch.randn(B, K + 64, N, generator=g) * K**-0.5).to(torch.bfloat16).to(DEVICE)[:, :K],
              (torch.randn(B, N, K + 64, generator=g) * K**-0.5).to(torch.bfloat16).to(DEVICE)[..., :K].transpose(1, 2)):
        want = x.float().cpu() @ w.float().cpu()
        got = torch.ops.kimi_kernels.skinny_bmm(x, w)
        check(got, want, torch.bfloat16)
        if DEVICE == "cuda":
            check(tl_dot.run_bmm(x, w), want, torch.bfloat16)
            if skinny_gemm.choose_bmm(B, M, K, N, x.dtype):
                assert torch.equal(got, torch.bmm(x, w))
        xf, wf = x.float(), w.float()  # fp32 operands: IEEE fp32 dots
        assert (tl_dot.run_bmm(xf, wf).cpu() - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("B, K, N", [(12, 512, 128)] if DEVICE == "cuda" else [(4, 256, 40)])
@pytest.mark.parametrize("M", [1, 2, 5])
def test_per_head_gemm_with_the_output_gate(B, K, N, M):
    """``skinny_bmm_gate`` (MLA's v up-projection, heads side by side, times sigmoid of a
    column slice of the gate): stock's ``output_gate`` of the rounded product, within one
    bf16 ulp of each rounding (the product's fp32 sums differ in order)."""
    from kimi_inductor.stock.mla import output_gate

    g = torch.Generator().manual_seed(B + M)
    x = torch.randn(M, B, K, generator=g).to(torch.bfloat16).to(DEVICE).permute(1, 0, 2)
    w = (torch.randn(B, N, K + 64, generator=g) * K**-0.5).to(torch.bfloat16).to(DEVICE)[..., :K].transpose(1, 2)
    gate = torch.randn(M, B * N + 32, generator=g).to(torch.bfloat16).to(DEVICE)[:, 16:16 + B * N]
    want = output_gate((x.float() @ w.float()).to(torch.bfloat16).transpose(0, 1).reshape(M, B * N), gate)
    got = torch.ops.kimi_kernels.skinny_bmm_gate(x, w, gate)
    assert got.shape == (M, B * N) and got.is_contiguous()
    check(got, want.float().cpu(), torch.bfloat16)
    if DEVICE == "cuda" and skinny_gemm.choose_bmm_gate(B, M, K, N, x.dtype):
        assert torch.equal(got, output_gate(torch.bmm(x, w).transpose(0, 1).reshape(M, B * N), gate))
    with pytest.raises(ValueError, match="gate \\[M, B N\\] for x"):
        torch.ops.kimi_kernels.skinny_bmm_gate(x, w, gate[:, :-8])


def test_per_head_gemm_dispatch_names_its_reason():
    assert skinny_gemm.choose_bmm(12, 1, 128, 512, torch.bfloat16) == ""
    assert "faster from 2 rows" in skinny_gemm.choose_bmm(12, 2, 512, 128, torch.bfloat16)  # measured
    assert "never timed" in skinny_gemm.choose_bmm(4, 1, 16, 32, torch.bfloat16)  # a shape never measured
    assert "rows" in skinny_gemm.choose_bmm(12, 65, 128, 512, torch.bfloat16)
    with pytest.raises(ValueError, match="must be \\[B, K, N\\]"):
        torch.ops.kimi_kernels.skinny_bmm(torch.zeros(12, 1, 128), torch.zeros(12, 512, 128))


@pytest.mark.parametrize("M", [8, 16])
def test_split_k_gemm_on_fp32_operands_is_fp32(M):
    """fp32 x and W (the fp32 model of the exact-function checks, where ``choose`` still
    picks the split-K kernel): IEEE fp32 dots, as cuBLAS without TF32. With tl.dot's TF32
    default the shared experts' gate_up (8 x 12288 x 7168) was 8e-4 off (H200)."""
    N, K = (12288, 7168) if DEVICE == "cuda" else (32, 2048)
    g = torch.Generator().manual_seed(M)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) * K**-0.5
    want = x.double() @ w.double().t()
    got = tl_dot.run(x.to(DEVICE), w.to(DEVICE), None, torch.float32).cpu().double()
    assert (got - want).norm() / want.norm() < 1e-5


@pytest.mark.gpu
@needs_cute
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("N, K", SHAPES + [(3648, 7168)])
@pytest.mark.parametrize("M", [1, 2, 5, 8])
@pytest.mark.parametrize("out_dtype, with_acc", OUTS)
def test_cute_gemv_matches_torch(M, N, K, out_dtype, with_acc):
    from kimi_inductor.kernels.skinny_gemm import cute_gemv

    (x, w, acc), want = operands(M, N, K, out_dtype, with_acc)
    base = cute_gemv.config(M, N, K)
    for cfg in {base, base._replace(split=1), base._replace(r=1)}:
        if cute_gemv.supported(M, N, K, cfg):
            continue
        outs = [cute_gemv.run(x, w, acc, out_dtype, cfg) for _ in range(3)]  # counters reset between calls
        check(outs[0], want, out_dtype)
        assert all(torch.equal(o, outs[0]) for o in outs)  # deterministic split-K


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("M, N, K", [(1, 7168, 1536), (2, 2304, 1536), (4, 3648, 7168), (8, 896, 7168)])
def test_cute_gemv_reading_weights_before_its_pdl_wait_changes_no_bit(monkeypatch, M, N, K):
    """``KIMI_INDUCTOR_GEMV_PRELOAD``: a warp's first steps of W read before the PDL wait
    (all six of o_proj's at one row) are summed in the same order: bitwise the output
    without it, and torch's within the bf16 tolerance."""
    from kimi_inductor.kernels.skinny_gemm import cute_gemv

    (x, w, acc), want = operands(M, N, K, torch.bfloat16, True)
    monkeypatch.setenv("KIMI_INDUCTOR_GEMV_PRELOAD", "0")
    base = cute_gemv.run(x, w, acc, torch.bfloat16)
    monkeypatch.setenv("KIMI_INDUCTOR_GEMV_PRELOAD", "6")
    ahead = cute_gemv.run(x, w, acc, torch.bfloat16)
    check(ahead, want, torch.bfloat16)
    assert torch.equal(ahead, base)


@needs_cute
def test_cute_gemv_preload_reads_weights_before_the_pdl_wait(tmp_path):
    """The sm_90a PTX of o_proj's GEMV at one row (2 weight rows per warp, 6 warp steps):
    with ``preload`` 6 its 12 weight loads come before ``griddepcontrol.wait``, without it
    none (x is read only after the wait in both)."""
    import subprocess
    import sys

    code = ("import torch\n"
            "from kimi_inductor.kernels.skinny_gemm import cute_gemv as G\n"
            "for p in (0, 6):\n"
            "    exe = G.compile_gemv(1, 7168, 1536, True, torch.bfloat16, G.config(1, 7168, 1536), arch='sm_90a',\n"
            "                         pdl=True, preload=p)\n"
            "    lines = exe.artifacts.PTX.splitlines()\n"
            "    wait = next(i for i, l in enumerate(lines) if 'griddepcontrol.wait' in l)\n"
            "    print(sum('ld.global' in l for l in lines[:wait]))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "CUTE_DSL_KEEP": "ptx"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["0", "12"]


@needs_cute
@pytest.mark.parametrize("M, N, K, pdl, x_stride", [(1, 6288, 7168, True, None), (8, 896, 7168, False, None),
                                                    (4, 2304, 1536, True, None), (2, 2304, 1536, True, 3648)])
def test_cute_gemv_compiles_for_sm90a(M, N, K, pdl, x_stride):
    """Also with x a column slice of a wider activation (MLA's q_a in the fused q_a / kv_a /
    gate output, 3648 wide at TP8), read in place."""
    from kimi_inductor.kernels.skinny_gemm import cute_gemv

    cfg = cute_gemv.config(M, N, K)
    assert not cute_gemv.supported(M, N, K, cfg)
    exe = cute_gemv.compile_gemv(M, N, K, True, torch.bfloat16, cfg, arch="sm_90a", pdl=pdl, x_stride=x_stride)
    assert exe.has_gpu_module


@needs_cute
def test_cute_gemv_reads_row_strided_x_where_aligned():
    """``row_stride``: the compiled row stride, or None where ``run`` must copy x."""
    from kimi_inductor.kernels.skinny_gemm import cute_gemv

    wide = torch.empty(4, 3648, dtype=torch.bfloat16)
    assert cute_gemv.row_stride(wide[:, :1536]) == 3648 and cute_gemv.row_stride(wide[:, 1536:3584]) == 3648
    assert cute_gemv.row_stride(wide[:1, 1536:3584]) == 2048  # one row: K
    assert cute_gemv.row_stride(wide[:, 4:1540]) is None  # 8-byte aligned rows
    assert cute_gemv.row_stride(torch.empty(4, 1539, dtype=torch.bfloat16)[:, :1536]) is None  # odd row stride
    assert cute_gemv.row_stride(wide[:, :1536].t().contiguous().t()) is None  # column-major


def test_dispatch_names_its_reason():
    assert skinny_gemm.choose(128, 6288, 7168, torch.bfloat16) == ("cublas", "128 rows (> 64: cuBLAS/Inductor territory)")
    impl, why = skinny_gemm.choose(64, 48, 64, torch.bfloat16)  # a shape never measured
    assert impl == "cublas" and "never timed" in why
    assert skinny_gemm.choose(8, 12288, 7168, torch.bfloat16) == ("tl_dot", "")
    assert skinny_gemm.choose(64, 12288, 7168, torch.bfloat16)[0] == "cublas"  # measured faster there
    no_cute = skinny_gemm.cute_available()
    assert skinny_gemm.choose(1, 6288, 7168, torch.bfloat16) == (
        ("cute_gemv", "") if not no_cute else ("tl_dot", f"not the CuTe GEMV: {no_cute}"))
    # the GEMV reads bf16 only: fp32 operands take the Triton GEMM
    assert skinny_gemm.choose(1, 6288, 7168, torch.float32) == ("tl_dot", "not the CuTe GEMV: dtype torch.float32")


@pytest.mark.gpu
@needs_cute
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [2, 5])
def test_cute_gemv_on_a_column_slice_equals_it_on_a_copy(M):
    """x a column slice of a wider activation (read in place, no copy kernel): the same
    bits as on a compact copy, plain and with the RMSNorm prologue."""
    N, K = 2304, 1536
    (x, w, acc), want = operands(M, N, K, torch.bfloat16, True)
    wide = torch.randn(M, 3648, device=DEVICE).to(torch.bfloat16)
    wide[:, 1536:3072] = x
    view = wide[:, 1536:3072]
    norm = torch.randn(K, device=DEVICE).to(torch.bfloat16)
    from kimi_inductor.kernels.skinny_gemm import cute_gemv

    for fusion, nw in ((cute_gemv.PLAIN, None), (cute_gemv.Fusion(eps=1e-6), norm)):
        a = cute_gemv.run(view, w, acc, torch.bfloat16, fusion=fusion, norm_weight=nw)
        b = cute_gemv.run(x.contiguous(), w, acc, torch.bfloat16, fusion=fusion, norm_weight=nw)
        assert torch.equal(a, b)
    check(cute_gemv.run(view, w, acc, torch.bfloat16), want, torch.bfloat16)


@pytest.mark.gpu
@needs_cute
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
def test_cute_gemv_in_cuda_graph():
    """Captured on torch's capture stream and replayed on new inputs (split-K counters reset)."""
    from kimi_inductor.kernels.skinny_gemm import cute_gemv

    M, N, K = 2, 896, 7168
    (x, w, acc), _ = operands(M, N, K, torch.bfloat16, True)
    assert cute_gemv.config(M, N, K).split > 1
    cute_gemv.run(x, w, acc, torch.bfloat16)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cute_gemv.run(x, w, acc, torch.bfloat16)
    for seed in range(3):
        x.copy_(torch.randn(M, K, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16))
        graph.replay()
        want = x.float().cpu() @ w.float().cpu().t() + acc.float().cpu()
        check(out, want, torch.bfloat16)


def fused_reference(kind, x, w, extra, acc):
    """fp32 math of the fused op with stock's rounding points where ours keeps them."""
    from kimi_inductor.stock.attn_res import rms_norm
    from kimi_inductor.stock.layers import situ_and_mul

    xc, wc = x.cpu(), w.cpu()
    if kind == "rms_norm":
        want = rms_norm(xc, extra.cpu(), 1e-5).float() @ wc.float().t()
        return want + acc.cpu().float() if acc is not None else want
    h = (xc.float() @ wc.float().t()).to(torch.bfloat16)  # stock's GEMM output, bf16
    return situ_and_mul(h, 4.0, 25.0).float()


@pytest.mark.gpu
@needs_cute
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind, N, K, with_acc", [("rms_norm", 7168, 3584, True), ("rms_norm", 2304, 1536, False),
                                                  ("situ", 12288, 7168, False), ("situ", 1024, 2048, False)])
@pytest.mark.parametrize("M", [1, 2, 4])
def test_cute_gemv_fusions_match_stock(kind, N, K, with_acc, M):
    """RMSNorm prologue (within one bf16 rounding of the normalised row: 2^-6 of the
    output) and SiTU epilogue (stock's rounding points: one bf16 ulp of h, two of the
    output), at the K3 shapes and a K split; 3 calls bitwise equal."""
    from kimi_inductor.kernels.skinny_gemm import cute_gemv

    (x, w, acc), _ = operands(M, N, K, torch.bfloat16, with_acc)
    g = torch.Generator().manual_seed(M)
    extra = (1 + 0.1 * torch.randn(K, generator=g)).to(torch.bfloat16).to(DEVICE)
    fusion = cute_gemv.Fusion(eps=1e-5) if kind == "rms_norm" else cute_gemv.Fusion(situ=(4.0, 25.0))
    want = fused_reference(kind, x, w, extra, acc)
    base = cute_gemv.fused_config(M, N, K, fusion)
    for cfg in {base, base._replace(split=2), base._replace(split=1)}:
        if cute_gemv.supported(M, N, K, cfg, fusion):
            continue
        outs = [cute_gemv.run(x, w, acc, torch.bfloat16, cfg, fusion, extra) for _ in range(3)]
        got = outs[0].cpu().float()
        assert got.shape == want.shape
        assert ((got - want).abs() <= 2.0**-6 * want.abs().clamp_min(1.0) + 2e-3).all(), (cfg, (got - want).abs().max())
        assert all(torch.equal(o, outs[0]) for o in outs)
    op = torch.ops.kimi_kernels.rms_norm_mm(x, extra, 1e-5, w, acc, torch.bfloat16) if kind == "rms_norm" \
        else torch.ops.kimi_kernels.mm_situ(x, w, 4.0, 25.0)
    assert op.shape == want.shape


@needs_cute
@pytest.mark.parametrize("M, N, K, fusion", [(1, 7168, 3584, "rms_norm"), (1, 2304, 1536, "rms_norm"),
                                             (1, 12288, 7168, "situ"), (2, 1024, 2048, "situ")])
def test_cute_gemv_fusions_compile_for_sm90a(M, N, K, fusion):
    from kimi_inductor.kernels.skinny_gemm import cute_gemv

    fusion = cute_gemv.Fusion(eps=1e-5) if fusion == "rms_norm" else cute_gemv.Fusion(situ=(4.0, 25.0))
    for cfg in {cute_gemv.fused_config(M, N, K, fusion), cute_gemv.fused_config(M, N, K, fusion)._replace(split=2)}:
        assert not cute_gemv.supported(M, N, K, cfg, fusion)
        assert cute_gemv.compile_gemv(M, N, K, fusion.eps is not None, torch.bfloat16, cfg, arch="sm_90a",
                                      fusion=fusion).has_gpu_module
