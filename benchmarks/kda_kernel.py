"""The fused KDA decode kernel alone (f_b GEMM + conv + gates + delta rule + gated norm)
at TP8 per-rank heads (12 x 128): ours (per num_warps and V split) vs the stock math
compiled by Inductor vs the byte floor, inside CUDA graphs; and, when fla-core imports, fla's
``fused_recurrent_kda`` (the Triton family vLLM's stock KDA comes from) on the same state:
gates, beta, q/k L2 norm and the delta rule with the state updated in place, but no f_b
GEMM, conv or gated norm, so it does a subset of our kernel's work.

``--vllm ROOT`` (vLLM 0.33.0's wheel unpacked there; q = 1) adds vLLM's own decode core
as its KDA layer runs it on SM90, on the same tensors: the f_b GEMM (cuBLAS), its Triton
``causal_conv1d_update`` (silu), ``fused_recurrent_kda_packed_decode`` and the gated
RMSNorm (fla's ``forward_native``, compiled by Inductor as in vLLM's graph): the work
our one kernel does, for the choice rule of issue 17.

``--vllm-native SO`` (vLLM 0.33.0's ``_C_stable_libtorch.abi3.so``, staged by
``benchmarks/stage_vllm_kernels.sh``; q = 1) adds the decode
vLLM runs on SM90 at 12 heads with its CUDA build: the f_b GEMM (cuBLAS), then its native
``_C::fused_kda_decode`` (conv, gates, delta rule and gated norm in one CUDA kernel),
called as its KDA layer calls it (width-major fp32 conv weight, fp32 norm weight), with
its output's relative error against the stock math (``vllm_native_err``), beside our op as
lower_kernels emits it on vLLM's graph (on the native op's weights, at ``v_split``'s choice);
their ratio fills ``kda_decode.VERSUS_NATIVE``.

    python benchmarks/kda_kernel.py --json kda_kernel.json [--vllm ROOT] [--vllm-native SO]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from common import Results, floor_us, graph_time_us, vllm_kernel_module  # noqa: E402
from test_kda_decode import inputs  # noqa: E402

import kimi_inductor.kernels.kda_decode as K  # noqa: E402
from kimi_inductor.kernels.common import pdl  # noqa: E402


def fla_recurrence(R: int, q: int, H: int, D: int, state: torch.Tensor):
    """fla's decode recurrence on ``state`` [R, H, D, D] (fp32, updated in place), or None."""
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except ImportError:
        return None
    T = R * q
    g = torch.Generator(device="cuda").manual_seed(0)
    qkvg = [torch.randn(1, T, H, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(4)]
    beta = torch.randn(1, T, H, device="cuda", generator=g).to(torch.bfloat16)
    a_log, dt_bias = torch.zeros(H, device="cuda"), torch.zeros(H * D, device="cuda")
    cu = torch.arange(0, T + 1, q, dtype=torch.long, device="cuda")
    return lambda i: fused_recurrent_kda_fwd(*qkvg, beta, A_log=a_log, dt_bias=dt_bias, initial_state=state,
                                             inplace_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                             use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                             lower_bound=-5.0)


def vllm_core(root: str):
    """(x, out) -> vLLM's KDA decode core on our ``inputs`` (one token per request)."""
    conv = vllm_kernel_module(root, "model_executor/layers/mamba/ops/causal_conv1d.py").causal_conv1d_update
    rec = vllm_kernel_module(root, "models/kimi_k3/nvidia/ops/third_party/kda/fused_recurrent.py")

    @torch.compile(dynamic=False)
    def gated_norm(o, g, weight, eps: float):  # fla's FusedRMSNormGated.forward_native, sigmoid gate
        x = o.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        return (x * torch.sigmoid(g.float())).to(o.dtype)

    def core(x):
        R, H, D = x["beta"].shape[0], x["recurrent_state"].shape[1], x["recurrent_state"].shape[-1]
        slots = x["state_slots"][:, 0]
        mixed = conv(x["mixed_qkv"], x["conv_state"].transpose(1, 2), x["conv_weight"].view(3 * H * D, -1), None,
                     activation="silu", conv_state_indices=slots, validate_data=False,
                     out=torch.empty_like(x["mixed_qkv"], memory_format=torch.contiguous_format))
        g1 = (x["f_a"] @ x["f_b_weight"].t()).view(1, R, H, D)
        o, _ = rec.fused_recurrent_kda_packed_decode(mixed, g1, x["beta"].unsqueeze(0), x["A_log"], x["dt_bias"],
                                                     x["lower_bound"], x["recurrent_state"], slots)
        return gated_norm(o.view(R, H, D), x["g2"].view(R, H, D), x["norm_weight"], x["norm_eps"])

    return core


def vllm_native_weights(conv_weight, norm_weight) -> dict[str, torch.Tensor]:
    """The weights vLLM's KDA layer keeps for its native decode: ``decode_conv1d_weight``
    (width-major [3, width, P]) and ``decode_norm_weight`` (fp32)."""
    return dict(decode_conv1d_weight=conv_weight.view(3, conv_weight.shape[0] // 3, -1).transpose(1, 2).contiguous(),
                decode_norm_weight=norm_weight.float())


def vllm_native(x):
    """vLLM's native SM90 KDA decode core on ``vllm_core``'s inputs plus
    ``vllm_native_weights`` (one token per request) -> [R, H D]: the f_b GEMM, then
    ``_C::fused_kda_decode`` on the same caches, as vLLM's KDA layer calls it."""
    R, H, D = x["beta"].shape[0], x["recurrent_state"].shape[1], x["recurrent_state"].shape[-1]
    g1 = (x["f_a"] @ x["f_b_weight"].t()).view(1, R, H, D)
    out = torch.empty(1, R, H, D, dtype=x["mixed_qkv"].dtype, device=g1.device)
    torch.ops._C.fused_kda_decode(x["mixed_qkv"], x["decode_conv1d_weight"], None, x["conv_state"].transpose(1, 2),
                                  g1, x["beta"].unsqueeze(0), x["A_log"], x["dt_bias"], x["state_slots"][:, 0],
                                  x["recurrent_state"], out, x["lower_bound"], x["g2"].view(R, H, D),
                                  x["decode_norm_weight"], x["norm_eps"])
    return out.view(R, H * D)


def main(argv=None) -> Results:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--q", type=int, nargs="+", default=[1, 4])
    p.add_argument("--warps", type=int, nargs="+", default=[4])
    p.add_argument("--v-split", type=int, nargs="+", default=[1, 2, 4], help="V blocks per head")
    p.add_argument("--v-chunk", type=int, nargs="+", default=[0], choices=[0, 8, 16, 32, 64, 128],
                   help="rows of S a program streams at a time (0: its whole block)")
    p.add_argument("--vllm", help="vLLM 0.33.0's wheel unpacked here: time its decode core too (q = 1)")
    p.add_argument("--vllm-native", help="vLLM 0.33.0's _C_stable_libtorch.abi3.so: time its fused_kda_decode (q = 1)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    H, D = 12, 128
    vllm = args.vllm and vllm_core(args.vllm)
    if args.vllm_native:
        torch.ops.load_library(args.vllm_native)
    res = Results("kda_kernel")
    stock = torch.compile(K.reference, dynamic=False)
    for q in args.q:
        for R in args.requests:
            x = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs(R, q, H, D, seed=1).items()}
            x["state_slots"][:] = (1 + torch.arange(R * q, dtype=torch.int32, device="cuda")).view(R, q)
            x["num_accepted"][:] = q
            out = torch.empty_like(x["g2"])
            names = ("mixed_qkv", "f_a", "f_b_weight", "g2", "beta", "conv_weight", "A_log", "dt_bias", "norm_weight",
                     "conv_state", "recurrent_state", "state_slots", "num_accepted")
            nbytes = (R * H * D * D * 4 * (1 + q) + H * D * D * 2 + R * (2 + q) * 3 * H * D * 2 * 2
                      + R * q * (5 * H * D + D + H) * 2)
            row = dict(q=q, requests=R, floor_us=floor_us(nbytes))
            row["inductor_us"] = graph_time_us(lambda i: stock(**x))
            for w in args.warps:
                for nv in args.v_split:
                    for bc in args.v_chunk:
                        bc = min(bc or D // nv, D // nv)
                        kargs = K.kernel_args(**{k: x[k] for k in names}, out=out, lower_bound=-5.0, norm_eps=1e-5,
                                              nv=nv, bc=bc)
                        row[f"ours_w{w}_nv{nv}" + (f"_bc{bc}" if bc < D // nv else "") + "_us"] = graph_time_us(
                            lambda i: K._kda_decode_kernel[(R, H, nv)](*kargs, H=H, D=D, Q=q, ROUND=True, DOT_F32=False,
                                                                       NV=nv, BC=bc, num_warps=w, **pdl(out.device)))
            row["v_split"], row["v_chunk"] = K.v_split(R, H, D, q)
            if vllm and q == 1:
                row["vllm_core_us"] = graph_time_us(lambda i: vllm(x))
                best = min(v for k, v in row.items() if k.startswith("ours_w"))
                row["vllm_over_ours"] = row["vllm_core_us"] / best
            if args.vllm_native and q == 1:
                nx = {**x, **vllm_native_weights(x["conv_weight"], x["norm_weight"])}
                fresh = {**nx, "conv_state": x["conv_state"].clone(), "recurrent_state": x["recurrent_state"].clone()}
                want = K.reference(**{**x, "conv_state": fresh["conv_state"].clone(),
                                      "recurrent_state": fresh["recurrent_state"].clone()}).float()
                row["vllm_native_err"] = float((vllm_native(fresh).float() - want).norm() / want.norm())
                row["vllm_native_us"] = graph_time_us(lambda i: vllm_native(nx))
                # ours as lower_kernels emits it there: on the native op's weights, at v_split's choice
                mine = {**{k: x[k] for k in names}, "conv_weight": nx["decode_conv1d_weight"].transpose(1, 2),
                        "norm_weight": nx["decode_norm_weight"]}
                row["ours_native_weights_us"] = graph_time_us(lambda i: torch.ops.kimi_kernels.kda_decode(**mine,
                                                                                   lower_bound=-5.0, norm_eps=1e-5))
                row["vllm_native_over_ours"] = row["vllm_native_us"] / row["ours_native_weights_us"]
            fla = fla_recurrence(R, q, H, D, torch.zeros(R, H, D, D, device="cuda"))
            if fla is not None:
                row["fla_recurrence_us"] = graph_time_us(fla)
            res.add(**row)
    if args.json:
        res.dump(args.json)
    if args.vllm_native:  # kda_decode.VERSUS_NATIVE, from this GPU's run
        print("VERSUS_NATIVE =", {r["requests"]: r["vllm_native_over_ours"] > 1 for r in res.rows if r["q"] == 1})
    return res


if __name__ == "__main__":
    main()
