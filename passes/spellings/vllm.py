"""vLLM 0.33.0's spelling of Kimi K3 (``vllm.models.kimi_k3.nvidia``), as its decode graph
reaches a post-grad pass (functional: Triton launches are ``triton_kernel_wrapper_functional``,
mutating ``_C`` ops ``auto_functionalized_v2``). Everything is matched by name, so this
module needs neither vLLM nor its CUDA extension to be importable.

    AttnRes   ``ops.attn_res._attn_res_kernel`` launched with grid (R, 1, 1): tensors
              ``prefix_ptr`` (+ ``delta_ptr`` when it has one), ``blocks_ptr``, the three
              weights and ``output_ptr`` (an [R, H] ``empty`` it allocates), constants
              ``num_blocks``, ``block_write_idx``, ``eps``, ``output_norm_eps`` in the
              kernel side table; or ``_C::kimi_k3_attn_res`` (SM100, H = 7168) with the
              same arguments and ``output``
    KDA       ``_C::fused_kda_decode``, else the Triton recurrence
              (``fused_recurrent_kda_packed_decode_kernel`` / ``fused_recurrent_kda_fwd_kernel``)
              that follows the conv update; q is not visible in the call; and
              ``kimi_kernels::kda_decode_paged``, ours in place of the group (``passes/vllm_kda.py``)
    MLA       ``_C::fused_kimi_k3_mla_decode_q_concat_kv_cache_insert`` (the q concat and
              cache insert that starts every MLA decode core); ours in place of the
              insert + decode pair (``passes/vllm_mla.py``) is ``kimi_kernels::mla_decode``,
              read by the kimi spelling
    RMSNorm   ``vllm_ir::rms_norm(x, weight, epsilon)``; SiTU-GLU ``_C::situ_and_mul(out,
              input, beta, linear_beta)`` (the fusions of a norm / SiTU with their GEMM)
    experts   ``vllm::moe_forward_shared`` / ``vllm::moe_forward``: the whole MoE (top-k,
              routed and shared experts) in one op that finds its layer by name; and
              ``kimi_vllm::mega_moe`` (the row shard) / ``kimi_vllm::sharded_moe`` (all
              rows, split over the group), ours in its place
    collectives ``vllm::all_gather(x, 0, G, group)``, ``vllm::reduce_scatter(y, 0, G, group)``,
              ``vllm::all_reduce(y, group)``; with CUDA custom all-reduce (SP gathers of
              small inputs) ``_C_custom_ar::custom_all_gather`` / ``custom_reduce_scatter``
              writing a fresh ``out`` buffer. Rewrites emit the ``vllm::`` ops, which pick
              the custom kernels themselves where they apply.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2
from torch._inductor.pattern_matcher import CallFunction, Ignored, KeywordArg

from ..graph import OpCall, TritonCall
from ..roles import AttnRes, CollectiveSpelling, Core, Experts, OpAttnRes, Spelling, resize_rows

NAME = "vllm"
K3 = "vllm.models.kimi_k3.nvidia.ops"
ATTN_RES_KERNEL = f"{K3}.attn_res._attn_res_kernel"
KDA_KERNELS = {f"{K3}.third_party.kda.fused_recurrent.fused_recurrent_kda_packed_decode_kernel",
               f"{K3}.third_party.kda.fused_recurrent.fused_recurrent_kda_fwd_kernel"}
CORE_OPS = {"_C::fused_kda_decode": "kda", "_C::fused_kimi_k3_mla_decode_q_concat_kv_cache_insert": "mla",
            "kimi_kernels::kda_decode_paged": "kda"}  # the last: ours in place of the KDA group (lower_kernels)
EXPERT_OPS = {"vllm::moe_forward_shared", "vllm::moe_forward"}
LAYER_MOE_INPUTS = ("latent", "router_logits", "shared_in", "layer_name")
# The MoE layer ops are row-wise in their three row inputs; the row shard's ops look their
# padding rows up by the shard's position, so the one pass that moves their rows
# (sharded_moe) puts kimi_vllm::sharded_moe (the step's rows in order) in their place.
LAYER_ROWS = ("hidden_states", "router_logits", "shared_experts_input")
ROW_LOCAL_OPS = {"vllm_ir::rms_norm": ("x",), "_C::situ_and_mul": ("input",),
                 "vllm::moe_forward_shared": LAYER_ROWS, "kimi_vllm::mega_moe": LAYER_MOE_INPUTS[:3],
                 "kimi_vllm::sharded_moe": LAYER_MOE_INPUTS[:3]}


def _op_name(node: fx.Node) -> str | None:
    call = OpCall.of(node)
    return None if call is None else call.op._schema.name


class TritonAttnRes(AttnRes):
    """``_attn_res_kernel``: the role's names with a ``_ptr`` suffix for tensors (the bank
    is ``blocks_ptr``)."""

    def __init__(self, call: TritonCall):
        self.call, self.node, self.spelling = call, call.node, NAME

    @staticmethod
    def _key(name: str) -> str:
        if name in ("num_blocks", "block_write_idx", "eps", "output_norm_eps"):
            return name
        return "blocks_ptr" if name == "bank" else f"{name}_ptr"

    def arg(self, name: str) -> Any:
        return self.call.arg(self._key(name))

    @property
    def output(self) -> fx.Node | None:
        return self.call.output("output_ptr")

    def updated(self, name: str) -> fx.Node | None:
        return self.call.output(self._key(name))

    def set_arg(self, name: str, value: Any, drop_view: bool = False) -> None:
        self.call.set_arg(self._key(name), value)

    def set_rows(self, g: fx.Graph, rows: Any) -> None:
        """One program per row: the grid and the ``output_ptr`` allocation follow R."""
        alloc = self.call.arg("output_ptr")
        self.call.set_arg("output_ptr", resize_rows(g, alloc, rows))
        self.call.set_grid([(rows, *self.call.grid[0][1:])])


def _attn_res(node: fx.Node) -> AttnRes | None:
    triton = TritonCall.of(node)
    if triton is not None:
        return TritonAttnRes(triton) if triton.name == ATTN_RES_KERNEL else None
    return OpAttnRes(OpCall.of(node), NAME, out="output") if _op_name(node) == "_C::kimi_k3_attn_res" else None


def _core(node: fx.Node) -> Core | None:
    triton = TritonCall.of(node)
    if triton is not None:
        return Core(node, "kda", NAME) if triton.name in KDA_KERNELS else None
    kind = CORE_OPS.get(_op_name(node))
    return None if kind is None else Core(node, kind, NAME, dcp=None if kind != "kda" else 1)  # DCP not in the op


def _experts(node: fx.Node) -> Experts | None:
    """``moe_forward_shared(hidden_states, router_logits, shared_experts_input, input_ids,
    layer_name, hidden_dim_unpadded) -> (shared, routed)``; ``moe_forward`` (no shared
    experts, writes its input) is recognised and kept."""
    name = _op_name(node)
    if name in ("kimi_vllm::mega_moe", "kimi_vllm::sharded_moe"):  # ours, in its place
        return Experts(node, "layer", NAME, lambda n: dict(zip(LAYER_MOE_INPUTS, n.args)))
    if name not in EXPERT_OPS:
        return None
    input_ids = node.args[3] if len(node.args) > 3 else None
    refusal = ("vllm::moe_forward (a MoE without shared experts) is not routed: K3's MoE always has them"
               if name == "vllm::moe_forward" else
               "input_ids-based (hash) routing is not routed through ours" if input_ids is not None else "")
    return Experts(node, "layer", NAME, lambda n: dict(zip(LAYER_MOE_INPUTS, (*n.args[:3], n.args[4]))), refusal)


def _vllm(name: str):
    """vLLM's collective op (None until vLLM, or a look-alike, registered it)."""
    packet = getattr(getattr(torch.ops, "vllm", None), name, None)
    return None if packet is None else packet.default


def _custom_ar(name: str):
    """vLLM's CUDA custom all-reduce extension op (None where it is not loaded)."""
    packet = getattr(getattr(torch.ops, "_C_custom_ar", None), name, None)
    return None if packet is None else packet.default


def _patterns(name: str, *args) -> list:
    op = _vllm(name)
    return [] if op is None else [CallFunction(op, *args)]


def _custom_patterns(name: str, inp) -> list:
    """``_C_custom_ar.<name>(fa, inp, out, reg_buffer, size)`` as the functional graph
    holds it: the new value of ``out``, a fresh allocation (its group is completed by
    ``_complete``)."""
    op = _custom_ar(name)
    if op is None:
        return []
    call = CallFunction(auto_functionalized_v2, op, fa=Ignored(), inp=inp, reg_buffer=Ignored(),
                        reg_buffer_sz_bytes=Ignored(), _out_base_index=0, _all_bases=[Ignored()])
    return [CallFunction(operator.getitem, call, 1)]


def _complete(kind: str, out: fx.Node, bindings: dict) -> None:
    """A custom all-reduce op names no group: its size from the shapes, its name from
    the vLLM collectives elsewhere in the graph (the TP group's; None when there are none).
    ``vllm::all_reduce`` names only its group: its size from vLLM's group of that name
    (left out where this process has none)."""
    if "group_name" in bindings:
        if "group_size" not in bindings:
            from vllm.distributed import parallel_state  # the graph holds vLLM's ops: vLLM is here

            group = parallel_state._groups.get(bindings["group_name"], lambda: None)()
            if group is not None:
                bindings["group_size"] = group.world_size
        return
    call = out
    while call.target is not auto_functionalized_v2:  # under the [:rows] slice and the getitem
        call = call.args[0]
    rows_in, rows_out = (a.meta["val"].shape[0] for a in (call.kwargs["inp"], call.kwargs["_all_bases"][0]))
    bindings["group_size"] = rows_out // rows_in if kind == "sp_gather" else rows_in // rows_out
    ops = {_vllm(name): index for name, index in (("all_reduce", 1), ("all_gather", 3), ("reduce_scatter", 3))}
    bindings["group_name"] = next((n.args[ops[n.target]] for n in out.graph.nodes if n.target in ops), None)


def _emit(g: fx.Graph, after: fx.Node, name: str, args: tuple) -> fx.Node:
    with g.inserting_after(after):
        return g.call_function(_vllm(name), args)


COLLECTIVES = CollectiveSpelling(
    gathers=lambda: _patterns("all_gather", KeywordArg("x"), 0, KeywordArg("group_size"), KeywordArg("group_name"))
    + _custom_patterns("custom_all_gather", KeywordArg("x")),
    scatters=lambda y: _patterns("reduce_scatter", y, 0, KeywordArg("group_size"), KeywordArg("group_name"))
    + _custom_patterns("custom_reduce_scatter", y),
    all_reduces=lambda: _patterns("all_reduce", KeywordArg("y"), KeywordArg("group_name")),
    emit_all_reduce=lambda g, after, y, like: _emit(g, after, "all_reduce", (y, like.group_name)),
    emit_all_gather=lambda g, after, x, like: _emit(
        g, after, "all_gather", (x, 0, like.bindings["group_size"], like.group_name)),
    emit_reduce_scatter=lambda g, after, y, like: _emit(
        g, after, "reduce_scatter", (y, 0, like.bindings["group_size"], like.group_name)),
    ops=lambda: {op: name for name, op in (*((n, _vllm(n)) for n in ("all_reduce", "all_gather", "reduce_scatter")),
                                          ("all_gather", _custom_ar("custom_all_gather")),
                                          ("reduce_scatter", _custom_ar("custom_reduce_scatter")),
                                          ("all_reduce", _custom_ar("all_reduce"))) if op is not None},
    complete=_complete,
)

def _rms_norm(node: fx.Node) -> tuple[Any, Any, float] | None:
    """``vllm_ir::rms_norm(x, weight, epsilon, variance_size=None)``, weighted over the
    whole row: stock's RMSNorm (vLLM's reference rounds to the weight dtype, then scales)."""
    if _op_name(node) != "vllm_ir::rms_norm":
        return None
    args = {**dict(zip(("x", "weight", "epsilon", "variance_size"), node.args)), **node.kwargs}
    if args.get("weight") is None or args.get("variance_size") is not None:
        return None
    return args["x"], args["weight"], float(args["epsilon"])


def _situ(node: fx.Node) -> tuple[Any, float, float] | None:
    """``getitem(auto_functionalized_v2(_C.situ_and_mul, input=h, beta, linear_beta,
    out=empty), 1)``: the op's output buffer, its only use; linear_beta > 0 (<= 0 is vLLM's
    "unset", which stock's SiTU does not have)."""
    if node.target is not operator.getitem or not isinstance(node.args[0], fx.Node):
        return None
    call = OpCall.of(node.args[0])
    if call is None or not call.wrapped or call.op._schema.name != "_C::situ_and_mul" or len(call.node.users) != 1:
        return None
    h, beta, linear_beta = call.arg("input"), call.arg("beta"), call.arg("linear_beta")
    if not isinstance(h, fx.Node) or len(h.users) != 1 or linear_beta <= 0:
        return None
    return h, float(beta), float(linear_beta)


SPELLING = Spelling(NAME, _attn_res, _core, _experts, COLLECTIVES, row_local=ROW_LOCAL_OPS, rms_norm=_rms_norm,
                    situ=_situ,
                    notes="vLLM 0.33.0's Kimi K3: Triton launches, _C ops, vllm:: collectives")
