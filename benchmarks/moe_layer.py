"""One Kimi K3 MoE layer decode step on one H200 (EP 1: all 896 experts here, bf16, or
MXFP4 as the checkpoint ships them with ``--mxfp4``):
router (fp32 logits, sigmoid top-16), latent down-projection, routed experts, RMSNorm,
up-projection, shared experts, inside CUDA graphs:

* kimi_specialized: the ``mega_moe`` pass (grouped Triton experts, ``expert_ffn``) and
  ``lower_kernels``, compiled by Inductor;
* stock, Inductor + graph: the stock layer compiled by Inductor with its experts in
  their capturable form (``moe_experts.dense_experts``: the stock expert loop has
  data-dependent shapes and cannot be captured);
* floor: every non-expert weight, the weights of the experts the router picked, and
  the activations, at 4.28 TB/s.

    python benchmarks/moe_layer.py --rows 1 8 32 64 --json moe_layer.json [--mxfp4]
    python benchmarks/moe_layer.py --smoke      # CPU, the tiny preset: checks the script runs
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import torch
from torch.func import functional_call

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, floor_us, graph_time_us, require_rewritten  # noqa: E402
from moe_experts import dense_experts  # noqa: E402

from kimi_inductor.backend import KimiSpecialized  # noqa: E402
from kimi_inductor.kernels.expert_ffn import implementation  # noqa: E402
from kimi_inductor.kernels.expert_mxfp4 import mma_layout  # noqa: E402
from kimi_inductor.baseline import stock_inductor  # noqa: E402
from kimi_inductor.stock import KimiK3Config, Parallel  # noqa: E402
from kimi_inductor.stock.moe import KimiMoE, router_logits, select_experts  # noqa: E402
from kimi_inductor.stock.mxfp4 import expert_weights  # noqa: E402


def _dense_fused(latent, topk_weights, topk_ids, w13, w2, beta, linear_beta, w13_scale=None, w2_scale=None):
    """``kimi::fused_experts`` in capturable form (MXFP4 experts dequantised first)."""
    w13, w2 = expert_weights(w13, w2, w13_scale, w2_scale, latent.dtype)
    return dense_experts(latent, topk_weights, topk_ids, w13, w2, beta, linear_beta).to(latent.dtype)


def stock_inductor_with(capturable: dict) -> Callable:
    """``stock_inductor`` with each stock op in ``capturable`` (op overload -> function)
    replaced by its capturable form."""

    def backend(gm, example_inputs, **kwargs):
        for node in gm.graph.nodes:
            target = node.target
            op = target.default if isinstance(target, torch._ops.OpOverloadPacket) else target
            if node.op == "call_function" and op in capturable:
                node.target = capturable[op]
        gm.recompile()
        return stock_inductor(gm, example_inputs)

    return backend


def random_params(layer: KimiMoE, device) -> dict[str, torch.Tensor]:
    """Random weights of the layer's parameters; MXFP4 experts (``store_mxfp4``) get random
    codes and E8M0 scales 2^-7..2^0 (as ``moe_experts.py``)."""
    out = {}
    for name, p in layer.named_parameters():
        t = torch.empty(p.shape, dtype=p.dtype, device=device)
        if p.dtype == torch.uint8:
            t.random_(120, 128) if name.endswith("_scale") else t.random_(0, 256)
        elif name.endswith("norm.weight"):
            t.fill_(1.0)
        elif name.endswith("e_score_correction_bias"):
            t.normal_(0, 0.01)
        else:
            t.normal_(0, p.shape[-1] ** -0.5)
        out[name] = t
    return out


def sm90_params(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` with MXFP4 experts reordered for the SM90 expert kernel where it runs
    (``KimiMoE.mxfp4_for_sm90``; what ``build_model`` loads there), else ``params``."""
    w13 = params["experts.w13_weight"]
    if w13.dtype != torch.uint8 or implementation(w13.device, True, True)[0] != "cute":
        return params
    out = dict(params)
    for name, gate_up in (("experts.w13_weight", True), ("experts.w2_weight", False)):
        out[name], out[name + "_scale"] = mma_layout(params[name], params[name + "_scale"], gate_up)
    return out


def weight_bytes(params: dict[str, torch.Tensor]) -> tuple[float, int]:
    """(bytes of one routed expert, its MXFP4 scales included, bytes of every other weight)
    of a KimiMoE's parameters."""
    nbytes = {n: t.numel() * t.element_size() for n, t in params.items()}
    experts = sum(v for n, v in nbytes.items() if n.startswith("experts."))
    return experts / params["experts.w13_weight"].shape[0], sum(nbytes.values()) - experts


def main(argv=None) -> Results:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--smoke", action="store_true", help="CPU, the tiny preset, no timing")
    p.add_argument("--mxfp4", action="store_true", help="MXFP4 routed experts, held packed (issue 18)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    config = KimiK3Config.preset("tiny" if args.smoke else "kimi-k3")
    layer = KimiMoE(config, Parallel(), device="meta")
    if args.mxfp4:
        layer.store_mxfp4()
    params = random_params(layer, device)
    kimi_params = sm90_params(params)  # the baseline reads the checkpoint's layout, as stock does
    expert_bytes, other_bytes = weight_bytes(params)

    def step(params, x, is_padding):
        return functional_call(layer, params, (x, is_padding))

    res = Results("moe_layer")
    gen = torch.Generator().manual_seed(0)
    for rows in args.rows:
        torch._dynamo.reset()
        x = torch.randn(rows, config.hidden_size, generator=gen).to(device=device, dtype=torch.bfloat16)
        pad = torch.zeros(rows, dtype=torch.bool, device=device)
        dense = stock_inductor_with({torch.ops.kimi.fused_experts.default: _dense_fused})
        stock = torch.compile(step, backend=dense, dynamic=False)
        backend = KimiSpecialized({"passes": ["mega_moe", "lower_kernels"]})
        kimi = torch.compile(step, backend=backend, dynamic=False)
        want, got = stock(params, x, pad).float(), kimi(kimi_params, x, pad).float()
        err = float(((got - want).norm(dim=1) / want.norm(dim=1)).max())
        _, ids = select_experts(router_logits(x, params["gate.weight"]), params["gate.e_score_correction_bias"],
                                config.num_experts_per_token, True, 1.0)
        active = int(torch.unique(ids).numel())
        require_rewritten(backend, "moe_layer")
        if args.smoke:
            res.add(rows=rows, active_experts=active, rel_err=err)
            continue
        fl = floor_us(other_bytes + active * expert_bytes + rows * config.hidden_size * 2 * 2)
        t_stock = graph_time_us(lambda i: stock(params, x, pad), calls=3, replays=3)
        t_kimi = graph_time_us(lambda i: kimi(kimi_params, x, pad), calls=5, replays=5)
        res.add(rows=rows, experts="mxfp4" if args.mxfp4 else "bf16", active_experts=active, floor_us=fl,
                inductor_us=t_stock, kimi_us=t_kimi,
                kimi_x_floor=t_kimi / fl, speedup=t_stock / t_kimi, rel_err=err)
    if args.json:
        res.dump(args.json)
    return res


if __name__ == "__main__":
    main()
