"""mega_moe: route each MoE layer's experts through our grouped expert kernels.

Matches and produces (c = this rank's rows, G = group size):

    before                                             after
    kimi.ep_experts(latent, w, ids, is_padding,        pad = unsqueeze(is_padding, 1)
                    w13, w2, first, group, cap, ...    kimi_kernels.mega_moe(latent,
                    [, w13_scale, w2_scale])               where(pad, 0, w),
                                                           where(pad, -1, ids),
                                                           w13, w2, first, group, cap, ...
                                                           [, w13_scale, w2_scale])
    kimi.fused_experts(latent, w, ids, w13, w2, ...)   bf16(kimi_kernels.expert_ffn(latent, w,
                                                           ids, w13, w2, ... [, scales]))

MXFP4 experts (the checkpoint's codes + E8M0 scales, loaded packed) keep their scales
through the rewrite: the grouped kernels upcast them in registers.

``ep_experts`` is the SP / hybrid MoE (experts partitioned over the group, MegaMoE's
contract): it becomes one ``mega_moe`` op (dispatch, grouped experts, combine) whose
padding rows carry expert id -1 and weight 0, so no rank computes them. A layer with
TP-sharded experts (``fused_experts``: the TP layout, or one rank) keeps its layout and
runs the same grouped kernel without an exchange. Router, latent down-projection,
post-combine norm, up-projection and shared experts stay as stock computes them. The
report names, per MoE layer, the op and the implementation it runs on this device
(``mega_moe.implementation``: DeepGEMM MegaMoE on SM100, else our grouped Triton
experts, with the reason; ``expert_ffn.implementation`` for TP-sharded experts).

Invariants. Relies on: ``meta["val"]`` of the matched calls. Establishes: the same
values (the ops' CPU references are stock's loop: on CPU the routed graph equals the
stock graph up to the fp32 order of the cross-rank sum); no new mutation; row layouts
unchanged.

Order: after hybrid_attention (it routes the hybrid graph's shard MoEs), before
lower_kernels.
"""

from __future__ import annotations

import importlib

import torch
from torch import fx

from kimi_inductor.kernels import expert_ffn, mega_moe

from .graph import OpCall
from .report import PassInfo
from .roles import Experts

aten, prims = torch.ops.aten, torch.ops.prims
kimi, kk = torch.ops.kimi, torch.ops.kimi_kernels


OURS = {"kimi_kernels::mega_moe", "kimi_kernels::expert_ffn", "kimi_vllm::mega_moe",  # what this pass emits
        "kimi_vllm::sharded_moe"}  # (and sharded_moe)


class MegaMoE:
    name = "mega_moe"

    def __call__(self, gm: fx.GraphModule, ctx) -> PassInfo:
        info = PassInfo(self.name)
        g, dg = gm.graph, ctx.decoder
        routed: dict[fx.Node, str] = {}
        moes = [l.moe for l in dg.layers if l.moe is not None] + [e for e in dg.fragment if isinstance(e, Experts)]
        for moe in moes:
            call = OpCall.of(moe.node)
            if call.op._schema.name in OURS:  # already ours
                continue
            info.matched += 1
            if moe.refusal:
                routed[moe.node] = why = f"{moe.spelling} MoE kept: {moe.refusal}"
                if why not in info.skipped:
                    info.skipped.append(why)
                continue
            op, what = _route_layer(g, moe) if moe.kind == "layer" else _route(g, call)
            dg.replaced(call.node, op)
            routed[op] = what
            info.rewritten += 1
        _annotate(ctx, routed)
        return info


def _route(g: fx.Graph, call: OpCall) -> tuple[fx.Node, str]:
    """Replace a stock experts call; returns our op's node and what it runs."""
    arg, node = call.arg, call.node
    latent, w2 = arg("latent").meta["val"], arg("w2").meta["val"]
    scales = () if arg("w13_scale") is None else (arg("w13_scale"), arg("w2_scale"))
    mma = w2.dim() == 5  # MXFP4 in the SM90 kernel's layout (kernels/expert_mxfp4.py)
    if call.op is kimi.ep_experts.default:
        impl, why = mega_moe.implementation(latent.device, latent.shape[1], w2.shape[2], mxfp4=bool(scales),
                                            mma_layout=mma)
    else:
        impl, why = expert_ffn.implementation(latent.device, bool(scales), mma)
    common = (arg("w13"), arg("w2"))
    act = (arg("beta"), arg("linear_beta"), *scales)
    with g.inserting_before(node):
        if call.op is kimi.ep_experts.default:
            pad = g.call_function(aten.unsqueeze.default, (arg("is_padding"), 1))
            weights = _fill_rows(g, arg("topk_weights"), pad, 0.0)
            ids = _fill_rows(g, arg("topk_ids"), pad, -1)
            new = op = g.call_function(kk.mega_moe.default, (
                arg("latent"), weights, ids, *common, arg("first_expert"), arg("group_name"),
                arg("max_num_tokens"), *act))
            what = ("mega_moe: EP exchange " + ("inside DeepGEMM" if impl == "deepgemm" else
                    "(all-gather dispatch, reduce-scatter combine)") + ", padding rows not routed")
        else:
            op = g.call_function(kk.expert_ffn.default, (
                arg("latent"), arg("topk_weights"), arg("topk_ids"), *common, *act))
            new = g.call_function(prims.convert_element_type.default, (op, node.meta["val"].dtype))
            what = "expert_ffn: TP-sharded experts, no exchange"
    node.replace_all_uses_with(new)
    g.erase_node(node)
    return op, f"{what}; {'MXFP4' if scales else 'bf16'} experts; {impl}: {why}"


def _route_layer(g: fx.Graph, moe) -> tuple[fx.Node, str]:
    """Replace a whole-layer MoE op (vLLM's ``moe_forward_shared``) by ``kimi_vllm.mega_moe``,
    which returns the same (shared, routed) pair."""
    importlib.import_module("kimi_inductor.vllm_moe")  # registers kimi_vllm::mega_moe (needs vLLM)
    node, inputs = moe.node, moe.inputs
    latent = inputs["latent"].meta["val"]
    with g.inserting_before(node):
        op = g.call_function(torch.ops.kimi_vllm.mega_moe.default, tuple(
            inputs[k] for k in ("latent", "router_logits", "shared_in", "layer_name")))
    node.replace_all_uses_with(op)
    g.erase_node(node)
    impl, why = mega_moe.implementation(latent.device, latent.shape[1], latent.shape[1])  # the width: at run time
    return op, (f"kimi_vllm.mega_moe: vLLM's router and shared experts, our EP experts over vLLM's EP group, "
                f"padding rows not routed; {impl}: {why}")


def _fill_rows(g: fx.Graph, x: fx.Node, mask: fx.Node, value) -> fx.Node:
    """``where(mask, value, x)`` as post-grad graphs spell ``masked_fill``."""
    val = x.meta["val"]
    fill = g.call_function(aten.full.default, ([], value),
                           dict(dtype=val.dtype, layout=torch.strided, device=val.device, pin_memory=False))
    return g.call_function(aten.where.self, (mask, fill, x))


def _annotate(ctx, routed: dict[fx.Node, str]) -> None:
    for layer in ctx.decoder.layers:
        if layer.moe is not None:
            node = layer.moe.node
            ctx.note(layer.index, MegaMoE.name, "moe", routed.get(node, "stock"),
                     rewritten=node in routed and OpCall.of(node).op._schema.name in OURS)
