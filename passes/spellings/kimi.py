"""Our replica's spelling (``kimi_inductor.stock``): ``kimi::`` ops, the
``kimi_kernels::`` ops our passes put in their place, and torch's functional
collectives (``_c10d_functional.*`` + ``wait_tensor``).

    AttnRes   kimi.attn_res / kimi_kernels.attn_res (auto_functionalized_v2: prefix, bank)
    KDA       kimi.kda_decode / kimi_kernels.kda_decode; q = state_slots.shape[1]
    MLA       kimi.mla_decode, kimi.mla_decode_dcp (DCP partials; with ``selected``: DSA)
              and their kimi_kernels twins
    DSA       kimi.dsa_decode / kimi_kernels.dsa_decode
    experts   kimi.ep_experts / kimi_kernels.mega_moe (ep), kimi.fused_experts /
              kimi_kernels.expert_ffn (tp)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import fx
from torch._inductor.pattern_matcher import CallFunction, KeywordArg

import kimi_inductor.kernels  # noqa: F401  (registers kimi_kernels::*)

from ..graph import OpCall
from ..roles import AttnRes, CollectiveSpelling, Core, Experts, OpAttnRes, Spelling

kimi, kk = torch.ops.kimi, torch.ops.kimi_kernels
aten, c10d = torch.ops.aten, torch.ops._c10d_functional
NAME = "kimi"

ATTN_RES = {kimi.attn_res.default, kk.attn_res.default}
CORES = {kimi.kda_decode.default: "kda", kk.kda_decode.default: "kda",
         kimi.mla_decode.default: "mla", kk.mla_decode.default: "mla", kk.mla_decode_gated.default: "mla",
         kimi.mla_decode_dcp.default: "mla", kk.mla_decode_dcp.default: "mla",
         kimi.dsa_decode.default: "dsa", kk.dsa_decode.default: "dsa"}
DCP_CORES = {kimi.mla_decode_dcp.default, kk.mla_decode_dcp.default}
EXPERTS = {kimi.ep_experts.default: "ep", kk.mega_moe.default: "ep",
           kimi.fused_experts.default: "tp", kk.expert_ffn.default: "tp"}


def _attn_res(node: fx.Node) -> AttnRes | None:
    call = OpCall.of(node)
    return OpAttnRes(call, NAME) if call is not None and call.op in ATTN_RES else None


def _core(node: fx.Node) -> Core | None:
    call = OpCall.of(node)
    if call is None or call.op not in CORES:
        return None
    kind, q, dcp = CORES[call.op], None, 1
    if kind == "kda":
        slots = call.arg("state_slots")
        val = slots.meta.get("val") if isinstance(slots, fx.Node) else None
        q = None if val is None else val.shape[1]
    if call.op in DCP_CORES:
        dcp = call.arg("dcp_size")
        if call.arg("selected") is not None:
            kind = "dsa"
    return Core(node, kind, NAME, q=q, dcp=dcp)


def _experts(node: fx.Node) -> Experts | None:
    call = OpCall.of(node)
    return Experts(node, EXPERTS[call.op], NAME) if call is not None and call.op in EXPERTS else None


def _wait(inner):
    return CallFunction(c10d.wait_tensor.default, inner)


def _chain(g: fx.Graph, after: fx.Node, steps: list) -> fx.Node:
    """Insert ``steps`` [(target, args_fn(previous node))] one after another after ``after``."""
    node, prev = after, None
    for target, make_args in steps:
        with g.inserting_after(node):
            node = g.call_function(target, make_args(prev))
        prev = node
    return node


def _emit_all_reduce(g: fx.Graph, after: fx.Node, y: fx.Node, like) -> fx.Node:
    return _chain(g, after, [(c10d.all_reduce.default, lambda _: (y, "sum", like.group_name)),
                             (c10d.wait_tensor.default, lambda ar: (ar,))])


def _emit_all_gather(g: fx.Graph, after: fx.Node, x: fx.Node, like) -> fx.Node:
    size = like.bindings["group_size"]
    return _chain(g, after, [(c10d.all_gather_into_tensor.default, lambda _: (x, size, like.group_name)),
                             (c10d.wait_tensor.default, lambda ag: (ag,))])


def _emit_reduce_scatter(g: fx.Graph, after: fx.Node, y: fx.Node, like) -> fx.Node:
    size = like.bindings["group_size"]
    return _chain(g, after, [(c10d.reduce_scatter_tensor.default, lambda _: (y, "sum", size, like.group_name)),
                             (c10d.wait_tensor.default, lambda rs: (rs,))])


def _complete(kind: str, out: fx.Node, bindings: dict) -> None:
    """An all-reduce names only its group: its size from c10d's group of that name (left
    out where this process has no such group)."""
    if "group_size" not in bindings:
        try:
            bindings["group_size"] = dist.distributed_c10d._resolve_process_group(bindings["group_name"]).size()
        except RuntimeError:
            pass


COLLECTIVES = CollectiveSpelling(
    gathers=lambda: [_wait(CallFunction(c10d.all_gather_into_tensor.default, KeywordArg("x"),
                                        KeywordArg("group_size"), KeywordArg("group_name")))],
    scatters=lambda y: [_wait(CallFunction(c10d.reduce_scatter_tensor.default, y, "sum", KeywordArg("group_size"),
                                           KeywordArg("group_name")))],
    all_reduces=lambda: [_wait(CallFunction(c10d.all_reduce.default, KeywordArg("y"), "sum",
                                            KeywordArg("group_name")))],
    emit_all_reduce=_emit_all_reduce,
    emit_all_gather=_emit_all_gather,
    emit_reduce_scatter=_emit_reduce_scatter,
    ops=lambda: {c10d.all_reduce.default: "all_reduce", c10d.all_gather_into_tensor.default: "all_gather",
                 c10d.reduce_scatter_tensor.default: "reduce_scatter"},
    complete=_complete,
)

# the EP experts ops: output row r is row r's routed experts (the exchange moves rows, never mixes them)
ROW_LOCAL_OPS = {"kimi::ep_experts": ("latent", "topk_weights", "topk_ids", "is_padding"),
                 "kimi_kernels::mega_moe": ("latent", "topk_weights", "topk_ids")}

SPELLING = Spelling(NAME, _attn_res, _core, _experts, COLLECTIVES, row_local=ROW_LOCAL_OPS,
                    notes="kimi_inductor.stock's kimi:: ops (and our kimi_kernels:: ops), "
                          "torch functional collectives")
