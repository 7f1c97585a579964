"""The DeepGEMM MegaMoE path of kimi_kernels::mega_moe (SM100), checked without SM100.

DeepGEMM's own Python (vLLM's vendored copy: the MXFP4 / FP8 casts and
``transform_weights_for_mega_moe``) runs for real; its compiled extension, the
symmetric buffer and the ``fp8_fp4_mega_moe`` launch are a stand-in that undoes the
documented kernel layout (gate/up interleaved by 8 rows, UTCCP scale order),
dequantises and computes the expert-parallel MoE over the gloo group. This checks what
we hand DeepGEMM (casts, layouts, ids of padding rows, the SiTU scales, the contiguous
expert partition), not the SM100 kernel itself: that has never run on our machines.
Tolerance: MXFP4 experts against stock's bf16 ones, 0.3 of the output's norm (a wrong
layout or a swapped gate / up is ~1.0).
"""

import sys
import types

import pytest
import torch
import torch.distributed as dist

from kimi_inductor.kernels import mega_moe, mega_moe_deepgemm
from kimi_inductor.launch import run_ranks
from kimi_inductor.stock.layers import situ_and_mul

pytest.importorskip("vllm")
LOCAL, LATENT, WIDTH, TOP_K, ROWS = 3, 128, 128, 3, 5


def _vendored_deep_gemm():
    """vLLM's vendored DeepGEMM with its CUDA extension stubbed out (CPU)."""
    def no_op(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return lambda *a, **k: None

    def stub(name):
        m = types.ModuleType(name)
        m.__path__, m.__getattr__ = [], no_op
        sys.modules[name] = m
    stub("vllm.third_party.deep_gemm._C")
    stub("vllm.third_party.deep_gemm._C.locality_domain")
    import vllm.third_party.deep_gemm as dg
    return dg


def _stand_in(dg, calls: list):
    """get_symm_buffer_for_mega_moe and fp8_fp4_mega_moe, in torch on CPU."""
    def buffer(group, experts, max_tokens, top_k, hidden, intermediate, mma_type, activation):
        assert (mma_type, activation) == ("fp8xfp4", "situ")
        return types.SimpleNamespace(group=group, experts=experts, x=torch.zeros(max_tokens, hidden).to(
            torch.float8_e4m3fn), x_sf=torch.zeros(max_tokens, hidden // 128, dtype=torch.int32),
            topk_idx=torch.zeros(max_tokens, top_k, dtype=torch.int64), topk_weights=torch.zeros(max_tokens, top_k))

    def dequant(w, sf, utccp):
        E, N, _ = w.shape
        if utccp:  # undo _transpose_sf_for_utccp
            sf = sf.reshape(E, -1, 32, 4, sf.shape[-1]).transpose(2, 3).reshape(E, N, -1)
        out = dg.utils.cast_back_from_fp4(w.reshape(E * N, -1), sf.contiguous().reshape(E * N, -1), gran_k=32,
                                          use_packed_ue8m0=True)
        return out.reshape(E, N, -1)

    def kernel(y, l1, l2, buf, activation, activation_alpha, activation_beta):
        calls.append(dict(activation=activation, alpha=activation_alpha, beta=activation_beta))
        rows, group = y.shape[0], buf.group
        w13 = dequant(*l1, utccp=True)
        E, N, L = w13.shape  # undo _interleave_weights: [gate 8 | up 8] blocks -> [gate | up]
        w13 = w13.reshape(E, N // 16, 2, 8, L).transpose(1, 2).reshape(E, N, L)
        w2 = dequant(*l2, utccp=True)
        x = dg.utils.cast_back_from_fp8(buf.x[:rows], buf.x_sf[:rows], gran_k=32, use_packed_ue8m0=True)
        parts = [x, buf.topk_idx[:rows].float(), buf.topk_weights[:rows]]
        world, rank = group.size(), group.rank()
        outs = []
        for p in parts:
            got = [torch.empty_like(p) for _ in range(world)]
            dist.all_gather(got, p, group=group)
            outs.append(torch.cat(got))
        xs, ids, ws = outs
        partial = torch.zeros(world * rows, L)
        for t in range(world * rows):
            for j in range(ids.shape[1]):
                e = int(ids[t, j]) - rank * E
                if 0 <= e < E:
                    h = situ_and_mul(xs[t] @ w13[e].t(), activation_alpha, activation_beta)
                    partial[t] += ws[t, j] * (h @ w2[e].t())
        out = torch.empty(rows, L)
        dist.reduce_scatter(out, list(partial.split(rows)), group=group)
        y.copy_(out)

    return types.SimpleNamespace(utils=dg.utils, transform_weights_for_mega_moe=dg.transform_weights_for_mega_moe,
                                 get_symm_buffer_for_mega_moe=buffer, fp8_fp4_mega_moe=kernel)


def _deepgemm_case():
    calls = []
    fake = _stand_in(_vendored_deep_gemm(), calls)
    mega_moe_deepgemm.deep_gemm = lambda: fake
    mega_moe_deepgemm.unsupported = lambda *a: ""  # as on SM100 with DeepGEMM installed
    group = dist.group.WORLD
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(3)
    experts = LOCAL * world
    latent = torch.randn(world * ROWS, LATENT, generator=g).bfloat16()
    weights = torch.rand(world * ROWS, TOP_K, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:TOP_K] for _ in range(world * ROWS)]).int()
    is_padding = torch.zeros(world * ROWS, dtype=torch.bool)
    is_padding[[1, world * ROWS - 1]] = True
    w13 = (torch.randn(experts, 2 * WIDTH, LATENT, generator=g) * 0.1).bfloat16()
    w2 = (torch.randn(experts, LATENT, WIDTH, generator=g) * 0.1).bfloat16()
    mine, local = slice(rank * ROWS, (rank + 1) * ROWS), slice(rank * LOCAL, (rank + 1) * LOCAL)
    args = (w13[local], w2[local], rank * LOCAL, group.group_name)
    stock = torch.ops.kimi.ep_experts(latent[mine], weights[mine], ids[mine], is_padding[mine], *args, 64, 4.0, 25.0)
    pad = is_padding[mine, None]
    routed = (latent[mine], weights[mine].masked_fill(pad, 0.0), ids[mine].masked_fill(pad, -1))
    ours = torch.ops.kimi_kernels.mega_moe(*routed, *args, 64, 4.0, 25.0)
    again = torch.ops.kimi_kernels.mega_moe(*routed, *args, 64, 4.0, 25.0)
    impl = mega_moe.implementation(torch.device("cpu"), LATENT, WIDTH)
    return stock, ours, again, pad[:, 0], calls, impl, len(mega_moe_deepgemm._weights)


@pytest.mark.parametrize("world", [1, 2])
def test_deepgemm_path_hands_megamoe_its_contract(world):
    for stock, ours, again, pad, calls, impl, cached in run_ranks(_deepgemm_case, world):
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, again)
        assert calls == [dict(activation="situ", alpha=4.0, beta=25.0)] * 2
        assert cached == 1  # weights cast and transformed once
        assert impl[0] == "deepgemm"
        assert not ours[pad].any()  # padding rows: ids -1, not dispatched
        real = ~pad
        err = (ours[real].float() - stock[real].float()).norm() / stock[real].float().norm()
        assert err < 0.3, err


def test_deepgemm_is_refused_off_sm100(monkeypatch):
    cpu = torch.device("cpu")
    impl, why = mega_moe.implementation(cpu, 3584, 3072)
    assert impl == "reference" and "not DeepGEMM MegaMoE: cpu (DeepGEMM MegaMoE is SM100-only)" in why
    mega_moe_deepgemm.unsupported.cache_clear()
    monkeypatch.setenv("KIMI_MEGA_MOE", "triton")
    assert mega_moe_deepgemm.unsupported(cpu, 3584, 3072) == "KIMI_MEGA_MOE=triton"
    mega_moe_deepgemm.unsupported.cache_clear()
