"""sharded_moe: at small batches, run each hybrid MoE layer on all rows with its shared
experts and latent up-projection TP-sharded over the group.

After hybrid_attention every rank holds all T rows, yet each MoE layer still runs on
the rank's row shard (c = ceil(T / G) rows, padded) and reads its non-expert weights
whole: at one row the shared experts (gate_up 2 D x H, down H x D) and the latent
projections are most of a layer's bytes on every rank. Rewrites, per MoE layer of the
hybrid graph (r = this rank, D = shared width, L = latent, s_r = columns [r D/G,
(r+1) D/G) of the shared width, l_r = [r L/G, (r+1) L/G) of the latent):

    before (hybrid, row shard)                  after (all rows, sharded)
    x = pad(x_T)[rows of r]          [c]        x = x_T                             [T]
    router, z = x W_down^T           [c]        the same ops on [T]
    y = experts(z, ids, pad_c)       [c]        y = bf16(all_reduce(expert_ffn(z,    [T]
        (EP exchange: all-gather                   ids - first (-1 on padding rows))))
         dispatch, combine)                        (local experts on every row, fp32 sum)
    g, u = (x W_gu^T)[:, :D], [:, D:]           g = x W_gu[s_r]^T, u = x W_gu[D + s_r]^T
    s = SiTU(g, u) W_d^T                        s = SiTU(g, u) W_d[:, s_r]^T        (partial)
    o = s + norm(y) W_up^T           [c]        o = s + norm(y)[:, l_r] W_up[:, l_r]^T (partial)
    out = all_gather(o)[:T]          [T]        out = all_reduce(o)                  [T]

Collectives per layer: two all-reduces (fp32 [T, L], bf16 [T, H]) in place of the EP
dispatch, the combine and the all-gather. Per-rank non-expert bytes: router + latent
down + (shared + latent up) / G. The latent down-projection stays replicated: sharding
it needs an all-gather of z before the experts, and at G = 8 the 7/8 of its bytes saved
(45 MB at K3, 10.4 us at 4.28 TB/s) is less than one measured small-message NCCL
collective (12.0 us, ``kernels_and_limits.md`` 1.3).

Chosen by row count: T <= ``decode.sharded_moe_rows`` (default 64). Both layouts split
the FLOPs by G; the sharded layer reads 1/G of the shared and up-projection bytes and has
one collective less. Measured on the H200 at K3 shapes, G = 8 (``benchmarks/
moe_sharding.py``): its non-expert work takes 0.54-0.62 of the row shard's at 1-128 rows;
beyond the measured decode sizes the layer keeps the row shard.
On SM100 the row shard stays when DeepGEMM MegaMoE runs its experts (the fused exchange
is MegaMoE's point; not measured against this layout).

Why it is exact: the router, latent down-projection, norm, shared MLP and the tail GEMM
are row-local (``row_local`` proves it; the experts op is row-local in its latent,
weights and ids), so on all rows they compute what the ranks computed on their shards;
the routed experts on every row with the rank's local experts, fp32-summed over the
ranks, are the EP op's own arithmetic (stock's ``ep_experts`` sums fp32 partials the same
way); a GEMM over a column block of the shared width or the latent is a partial sum the
all-reduce completes (bf16 partials, as stock's TP layout sums its shared expert).
Padding rows are routed nowhere (expert id -1), as before.

Data parallelism (vLLM's ``-dp N`` with EP: the experts' EP group is N TP groups of G
ranks, EP rank d G + t being rank t of TP group d): the routed experts see every
group's rows. Before them, each rank all-gathers from its DP peers (EP ranks t, G + t,
...: a group the deployment made, vLLM's DP group; none is created here) their T rows'
latent, weights and global expert ids in one fp32 message [N T, L + 2 k]; after them,
the fp32 partial [N T, L] is reduce-scattered back over the peers to the group's T rows,
then all-reduced in the TP group as above: the sum over all N G ranks' experts, each
row's own. Two collectives over the peers per layer in place of the EP exchange's two
over all N G ranks. Without the peers' group, or with an EP group that is not whole TP
groups in that order, the layer keeps the row shard with the reason.

vLLM's MoE layer op ``(s, y) = moe(z, logits, x, name)`` (``vllm.moe_forward_shared``,
or ``kimi_vllm.mega_moe`` in its place) holds the top-k, shared and routed experts; its
router GEMM, latent down-projection, norm and up-projection are in the graph. The same
rows and tail are taken, and the op becomes ``kimi_vllm.sharded_moe(z, logits, x, name)``
on all rows, whose pair is this rank's partials (the shared experts' column block s_r
in bf16, the local experts on every row in fp32): the graph sums y over the ranks (fp32
all-reduce) and the tail as above. With vLLM's data parallelism the op itself gathers
its DP peers' rows for the experts and reduce-scatters back (``vllm_moe.sharded_moe``).
Kept when vLLM's EP group is neither its TP group nor its DP replicas' TP groups in order.

Invariants. Relies on: the hybrid graph (``DecoderGraph.hybrid``), a static T, valid
``meta["val"]``. Establishes: every MoE layer it rewrites reads and writes T rows,
identical on every rank; no all-gather remains in it; weight slices are views (row
blocks, or column blocks that the GEMM reads with their leading dimension, which
``lower_kernels`` leaves to cuBLAS). A layer that does not match keeps the row shard
and the report says why.

Order: after mega_moe (it replaces mega_moe's exchange by the all-rows form), before
lower_kernels.
"""

from __future__ import annotations

import functools
import importlib
import operator
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from kimi_inductor.kernels import expert_ffn
from kimi_inductor.kernels import mega_moe as mega_moe_kernel

from . import collectives, row_local
from .decoder import DecoderGraph, Layer, _between
from .graph import OpCall, ancestors, erase_unused
from .gemm_neighbours import match_gemm
from .mega_moe import MegaMoE, _fill_rows
from .report import PassInfo

aten, prims = torch.ops.aten, torch.ops.prims
kimi, kk = torch.ops.kimi, torch.ops.kimi_kernels

EP_OPS = (kimi.ep_experts.default, kk.mega_moe.default)
LAYER_OPS = {"vllm::moe_forward_shared", "kimi_vllm::mega_moe"}  # vLLM's whole MoE layer, and ours in its place


class ShardedMoE:
    name = "sharded_moe"

    def __call__(self, gm: fx.GraphModule, ctx) -> PassInfo:
        info = PassInfo(self.name)
        dg: DecoderGraph = ctx.decoder
        moe_layers = [l for l in dg.layers if l.moe is not None]
        why = _refusal(dg, ctx.options.decode.sharded_moe_rows) if moe_layers else ""
        for layer in moe_layers:
            info.matched += 1
            plan = None if why else _match(layer)
            reason = why or (plan if isinstance(plan, str) else "")
            if reason:
                if reason not in info.skipped:
                    info.skipped.append(reason)
                ctx.note(layer.index, self.name, "moe_layout", f"row shard kept: {reason}", rewritten=False)
                continue
            _rewrite(gm.graph, dg, layer, plan)
            info.rewritten += 1
            ctx.note(layer.index, self.name, "moe_layout", plan.summary, rewritten=True)
            impl, because = expert_ffn.implementation(plan.x.meta["val"].device)
            experts = ("vLLM's experts as loaded, padding rows not routed" if getattr(plan, "layer_op", False) else
                       f"{'MXFP4' if plan.mxfp4 else 'bf16'} experts")
            what = ("kimi_vllm.sharded_moe: vLLM's router, the rank's block of its shared experts, "
                    if getattr(plan, "layer_op", False) else "expert_ffn: ")
            ctx.note(layer.index, MegaMoE.name, "moe", f"{what}the rank's local experts on every row (the EP exchange "
                     f"replaced by sharded_moe); {experts}; {impl}: {because}", rewritten=True)
        return info


def _refusal(dg: DecoderGraph, max_rows: int) -> str:
    if not dg.hybrid:
        return "not the hybrid step (hybrid_attention did not rewrite this graph)"
    rows = dg.tokens
    if not isinstance(rows, int):
        return "symbolic rows: the layout is chosen by row count"
    if rows > max_rows:
        return f"{rows} rows > decode.sharded_moe_rows = {max_rows}"
    return ""


def _match(layer: Layer) -> "SimpleNamespace | str":
    """The layer's pieces (a namespace), or why it keeps the row shard."""
    E = OpCall.of(layer.moe.node)
    whole = E is not None and layer.moe.kind == "layer" and E.op._schema.name in LAYER_OPS
    if E is None or (E.op not in EP_OPS and not whole):
        return (f"{layer.moe.spelling} MoE op {layer.moe.node.target}: only the expert-parallel experts op or "
                "vLLM's MoE layer op is taken")
    if whole and layer.moe.refusal:
        return layer.moe.refusal
    shard, full = layer.mlp_in, layer.mlp_out
    if shard.target is not aten.slice.Tensor or shard.args[1] != 0:
        return "the MoE input is not the hybrid step's row shard"
    x = shard.args[0]
    if x.target is aten.constant_pad_nd.default:
        x = x.args[0]
    gather = collectives.sp_gather(full)
    if gather is None:
        return "the MoE output is not all-gathered"
    pre = gather.input
    tail = _tail(pre)
    if tail is None:
        return "the MoE output is not shared + norm(y) W_up^T (an addmm, or an add of the mm)"
    normed, w_up, acc = tail
    if whole:
        return _match_layer_op(layer, E, shard, x, gather, pre, normed, w_up, acc)
    shared = match_gemm(acc)
    if shared is None or shared[2] is not None:
        return "the shared experts do not end in a plain down-projection GEMM"
    h, w_down_shared = shared[0], shared[1]
    region = layer.mlp_nodes - set(gather.nodes) - {full}
    found = [(n, halves) for n in ancestors(h, {shard}) & region if (m := match_gemm(n)) is not None and m[0] is shard
             and m[2] is None and (halves := _halves(n)) is not None]
    if len(found) != 1:
        return "the shared experts do not start with one gate_up GEMM read as two column halves"
    gu, halves = found[0]
    gate_up = match_gemm(gu)
    if not _elementwise(set(halves), h):
        return "the shared experts' activation is not elementwise in the gate and up halves"
    if E.node not in ancestors(normed, {shard}):
        return "the tail GEMM does not read the routed experts' output"
    latent = match_gemm(E.arg("latent"))
    if latent is None or latent[0] is not shard:
        return "the latent down-projection does not read the row shard"
    if E.op is kk.mega_moe.default:  # mega_moe's where(pad, 0 / -1, .): take the router's values
        weights, ids = E.arg("topk_weights").args[2], E.arg("topk_ids").args[2]
        pad = E.arg("topk_ids").args[0]  # unsqueeze(mask, 1), read by both where's
        mask = pad.args[0]
        impl = mega_moe_kernel.implementation(x.meta["val"].device, 0, 0)[0]
        if impl == "deepgemm":
            return "DeepGEMM MegaMoE runs these experts (SM100): its fused exchange is kept"
    else:
        weights, ids, mask = E.arg("topk_weights"), E.arg("topk_ids"), E.arg("is_padding")
        pad = mask
    mask_all = _rows_of(mask, x.meta["val"].shape[0])
    if mask_all is None:
        return "the padding mask is not a slice of the step's padding mask"
    tp = dist.distributed_c10d._resolve_process_group(layer.reduce.group_name)
    G, rank = dist.get_world_size(tp), dist.get_rank(tp)
    peers = _dp_peers(dist.distributed_c10d._resolve_process_group(E.arg("group_name")), tp)
    if isinstance(peers, str):
        return peers
    D, L = gu.meta["val"].shape[1] // 2, normed.meta["val"].shape[1]
    if D % G or L % G:
        return f"shared width {D} or latent {L} does not split over {G} ranks"
    why = row_local.reason(region, shard, sink=gather.nodes[-1], also=(pad,))
    if why:
        return f"not proven row-local: {why}"
    summary = _summary(x, G, "shared experts", "", 1 if peers is None else peers.size())
    return SimpleNamespace(E=E, shard=shard, x=x, full=full, gather=gather, pre=pre, normed=normed, w_up=w_up,
                           h=h, w_down_shared=w_down_shared, gu=gu, halves=halves, w_gu=gate_up[1], weights=weights,
                           ids=ids, pad=pad, mask_all=mask_all, mxfp4=E.arg("w13_scale") is not None, region=region,
                           G=G, rank=rank, D=D, L=L, peers=peers, summary=summary)


def _dp_peers(ep: dist.ProcessGroup, tp: dist.ProcessGroup) -> "dist.ProcessGroup | str | None":
    """The group of this rank's data-parallel peers when the experts' EP group is larger
    than the TP group (None when they are the same ranks in the same order), or why the
    layer keeps the row shard. Expected layout (vLLM's): EP rank d G + t is rank t of TP
    group d; the peers are EP ranks t, G + t, ... in that order, a group the deployment
    made (vLLM's DP group; ``harness.data_parallel_groups``): this pass creates none."""
    G, t, P, e = tp.size(), tp.rank(), ep.size(), ep.rank()
    d = e // G
    if P % G or e % G != t or [dist.get_global_rank(ep, d * G + i) for i in range(G)] != \
            dist.get_process_group_ranks(tp):
        return (f"the experts' EP group ({P} ranks, this rank {e}) is not whole TP groups of {G} one after "
                f"another with this rank at d x {G} + its TP rank {t}")
    if P == G:
        return None
    want = [dist.get_global_rank(ep, j * G + t) for j in range(P // G)]
    for pg in dist.distributed_c10d._world.pg_group_ranks:
        if isinstance(pg, dist.ProcessGroup) and dist.get_process_group_ranks(pg) == want:
            return pg
    return (f"data parallel: no process group of this rank's DP peers (global ranks {want}) exists; create it "
            "before compiling (vLLM's DP group is it)")


def _tail(pre: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(normed, W_up, acc) where ``pre`` = acc + normed W_up^T: one addmm, or the add of a
    plain GEMM read only there (as a graph holds it without Inductor's addmm fusion)."""
    m = match_gemm(pre)
    if m is not None:
        return m[:3] if m[2] is not None else None
    if pre.target is not aten.add.Tensor or len(pre.args) != 2 or pre.kwargs:
        return None
    for mm, acc in (pre.args, pre.args[::-1]):
        m = match_gemm(mm) if isinstance(mm, fx.Node) else None
        if m is not None and m[2] is None and len(mm.users) == 1 and isinstance(acc, fx.Node) and \
                acc.meta["val"].dtype == mm.meta["val"].dtype == pre.meta["val"].dtype:
            return m[0], m[1], acc
    return None


def _unviewed(node: fx.Node) -> fx.Node:
    """``node`` without the views of the same shape on top of it (``reshape(x, [-1, H])``)."""
    while node.target in (aten.reshape.default, aten.view.default, aten._unsafe_view.default) and \
            node.meta["val"].shape == node.args[0].meta["val"].shape:
        node = node.args[0]
    return node


def _match_layer_op(layer: Layer, E: OpCall, shard: fx.Node, x: fx.Node, gather, pre: fx.Node, normed: fx.Node,
                    w_up: fx.Node, acc: fx.Node) -> "SimpleNamespace | str":
    """vLLM's MoE layer op ``(shared, routed) = moe(latent, router_logits, shared_in, name)``
    (``vllm.moe_forward_shared``, or ``kimi_vllm.mega_moe`` in its place): its shared
    experts and routed experts are split inside ``kimi_vllm.sharded_moe``, the latent
    up-projection in the graph."""
    vllm_moe = importlib.import_module("kimi_inductor.vllm_moe")  # registers kimi_vllm::sharded_moe
    inputs = layer.moe.inputs
    outs = {u.args[1]: u for u in E.node.users if u.target is operator.getitem}
    if _unviewed(inputs["shared_in"]) is not shard:
        return "the shared experts do not read the row shard"
    if acc is not outs.get(0) or outs.get(1) not in ancestors(normed) or outs[0] in ancestors(normed):
        return "the MoE output is not shared + norm(routed) W_up^T"
    latent = match_gemm(inputs["latent"])
    if latent is None or _unviewed(latent[0]) is not shard:
        return "the latent down-projection does not read the row shard"
    if shard not in ancestors(inputs["router_logits"]):
        return "the router does not read the row shard"
    if mega_moe_kernel.implementation(x.meta["val"].device, 0, 0)[0] == "deepgemm":
        return "DeepGEMM MegaMoE runs these experts (SM100): its fused exchange is kept"
    G, rank, why = vllm_moe.tp_shard()
    if why:
        return why
    L = normed.meta["val"].shape[1]
    if L % G:
        return f"latent {L} does not split over {G} ranks"
    region = layer.mlp_nodes - set(gather.nodes) - {layer.mlp_out}
    why = row_local.reason(region, shard, sink=gather.nodes[-1])
    if why:
        return f"not proven row-local: {why}"
    return SimpleNamespace(layer_op=True, E=E, shard=shard, x=x, gather=gather, pre=pre, normed=normed, w_up=w_up,
                           outs=outs, region=region, G=G, rank=rank, L=L,
                           summary=_summary(x, G, "vLLM's shared experts", ", kimi_vllm.sharded_moe",
                                            getattr(vllm_moe.dp_peers(), "world_size", 1)))


def _summary(x: fx.Node, G: int, shared: str, how: str, replicas: int = 1) -> str:
    """The layer's ``moe_layout`` note (``replicas``: data-parallel TP groups)."""
    dp = "" if replicas == 1 else (f"; data parallel: the rows of all {replicas} TP groups gathered for the "
                                   "routed experts, their fp32 partials reduce-scattered back")
    return (f"all {x.meta['val'].shape[0]} rows on every rank: {shared} and latent up-projection TP-sharded "
            f"(1/{G} of their weights{how}), router and latent down replicated; routed experts summed over the "
            f"ranks (fp32 all-reduce){dp}; one all-reduce in place of the all-gather")


def _halves(gu: fx.Node) -> list[fx.Node] | None:
    """[gate, up] when ``gu`` [T, 2 D] is read only as its column halves [:, :D], [:, D:]."""
    width = gu.meta["val"].shape[1]
    users = sorted(gu.users, key=lambda u: u.args[2] if u.target is aten.slice.Tensor else -1)
    if len(users) != 2 or any(u.target is not aten.slice.Tensor or u.args[1] != 1 for u in users):
        return None
    (g0, g1), (u0, u1) = (users[0].args[2:4], users[1].args[2:4])
    return users if 2 * g1 == width and g0 == 0 and u0 == g1 and u1 >= width else None


def _elementwise(halves: set[fx.Node], h: fx.Node) -> bool:
    """Whether ``h`` is computed from ``halves`` by elementwise ops only (so column j of h
    reads column j of each half: a column block of the width is computed alone)."""
    nodes = set().union(*(_between(half, h) for half in halves)) - halves
    for n in nodes:
        if n.target is not prims.convert_element_type.default and not (
                isinstance(n.target, torch._ops.OpOverload) and torch.Tag.pointwise in n.target.tags):
            return False
        if any(a not in nodes | halves and a.meta["val"].dim() > 0 for a in n.all_input_nodes):
            return False
    return True


def _rows_of(mask: Any, rows: int) -> fx.Node | None:
    """The T-row padding mask that the row-shard mask ``mask`` was sliced (and padded) from."""
    node = mask
    while isinstance(node, fx.Node) and (node.target is aten.constant_pad_nd.default or
                                         (node.target is aten.slice.Tensor and node.args[1] == 0)):
        node = node.args[0]
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return node if node is not mask and val is not None and val.dim() == 1 and val.shape[0] == rows else None


def _block(g: fx.Graph, w: fx.Node, dim: int, start: int, size: int) -> fx.Node:
    """``w[start:start + size]`` along ``dim``, transposed (a GEMM's right operand)."""
    return g.call_function(aten.permute.default, (g.call_function(
        aten.slice.Tensor, (w, dim, start, start + size)), [1, 0]))


def _all_rows(layer: Layer, p: SimpleNamespace, also: tuple = ()) -> None:
    """The proven row-local region reads all T rows: x in place of the row shard."""
    row_local.set_rows(p.region, p.shard, p.x.meta["val"].shape[0], also=also)
    for user in list(p.shard.users):
        if user in p.region:
            user.replace_input_with(p.shard, p.x)


def _finish(g: fx.Graph, layer: Layer, p: SimpleNamespace, shared: fx.Node, dead: list[fx.Node]) -> None:
    """out = all_reduce(shared + norm(y)[:, l_r] W_up[:, l_r]^T) in place of the all-gather."""
    L, r = p.L // p.G, p.rank
    with g.inserting_before(p.pre):
        normed = g.call_function(aten.slice.Tensor, (p.normed, 1, r * L, (r + 1) * L))
        partial_out = g.call_function(aten.addmm.default, (shared, normed, _block(g, p.w_up, 1, r * L, L)))
    out = collectives.emit_all_reduce(g, partial_out, partial_out, layer.reduce)
    layer.mlp_out.replace_all_uses_with(out)
    layer.next_res.set_arg("delta", out)
    layer.mlp_in, layer.mlp_out = p.x, out
    erase_unused(g, [*dead, *p.gather.nodes, p.pre, p.shard])


def _rewrite_layer_op(g: fx.Graph, dg: DecoderGraph, layer: Layer, p: SimpleNamespace) -> None:
    _all_rows(layer, p)
    E, like = p.E.node, layer.reduce
    with g.inserting_before(E):
        op = g.call_function(torch.ops.kimi_vllm.sharded_moe.default, tuple(
            layer.moe.inputs[k] for k in ("latent", "router_logits", "shared_in", "layer_name")))
        shared, partial = (g.call_function(operator.getitem, (op, i)) for i in (0, 1))
    summed = collectives.emit_all_reduce(g, partial, partial, like)
    with g.inserting_after(summed):
        routed = g.call_function(prims.convert_element_type.default, (summed, p.outs[1].meta["val"].dtype))
    p.outs[1].replace_all_uses_with(routed)
    dg.replaced(E, op)
    _finish(g, layer, p, shared, [*p.outs.values(), E])


def _from_peers(g: fx.Graph, before: fx.Node, peers, nodes: tuple, like: tuple) -> tuple[fx.Node, ...]:
    """``nodes`` (latent [T, L], weights [T, k], ids [T, k]; shaped and typed as ``like``'s
    values) of every DP peer's T rows ([P T, .], peer order), in one all-gather of their
    fp32 concatenation (exact: bf16 latents, fp32 weights, ids below 2^24)."""
    vals = [n.meta["val"] for n in like]
    widths = [v.shape[1] for v in vals]
    with g.inserting_before(before):
        packed = g.call_function(aten.cat.default, ([g.call_function(
            prims.convert_element_type.default, (n, torch.float32)) for n in nodes], 1))
    gathered = collectives.emit_all_gather(g, packed, packed, peers)
    out, start = [], 0
    with g.inserting_before(before):
        for v, width in zip(vals, widths):
            part = g.call_function(aten.slice.Tensor, (gathered, 1, start, start + width))
            out.append(g.call_function(prims.convert_element_type.default, (part, v.dtype)))
            start += width
    return tuple(out)


def _rewrite(g: fx.Graph, dg: DecoderGraph, layer: Layer, p: SimpleNamespace) -> None:
    if getattr(p, "layer_op", False):
        return _rewrite_layer_op(g, dg, layer, p)
    _all_rows(layer, p, also=(p.pad,))
    like = layer.reduce  # the attention's all-reduce: its spelling and group
    block = functools.partial(_block, g)

    # routed experts: this rank's experts on every row, summed over the ranks in fp32
    E, first = p.E, p.E.arg("first_expert")
    scales = () if E.arg("w13_scale") is None else (E.arg("w13_scale"), E.arg("w2_scale"))
    latent, weights, ids = E.arg("latent"), p.weights, p.ids
    with g.inserting_before(E.node):  # padding rows routed nowhere (-1)
        ids = _fill_rows(g, ids, g.call_function(aten.unsqueeze.default, (p.mask_all, 1)), -1)
    if p.peers is not None:  # every DP peer's rows, their global expert ids
        peers = collectives.over(like, p.peers.group_name, p.peers.size())
        latent, weights, ids = _from_peers(g, E.node, peers, (latent, weights, ids), (latent, weights, p.ids))
    if first:  # local expert ids (padding rows and other ranks' experts out of [0, local))
        with g.inserting_before(E.node):
            ids = g.call_function(aten.sub.Tensor, (ids, first))
    with g.inserting_before(E.node):
        ffn = partial = g.call_function(kk.expert_ffn.default, (
            latent, weights, ids, E.arg("w13"), E.arg("w2"), E.arg("beta"), E.arg("linear_beta"), *scales))
    if p.peers is not None:  # this TP group's rows, summed over the peers' experts
        partial = collectives.emit_reduce_scatter(g, ffn, ffn, peers)
    summed = collectives.emit_all_reduce(g, partial, partial, like)
    with g.inserting_after(summed):
        routed = g.call_function(prims.convert_element_type.default, (summed, E.node.meta["val"].dtype))
    E.node.replace_all_uses_with(routed)
    dead = E.node.all_input_nodes
    g.erase_node(E.node)
    dg.replaced(E.node, ffn)

    # shared experts and latent up-projection: this rank's column blocks, partial sums
    D, r = p.D // p.G, p.rank
    with g.inserting_before(p.gu):
        gate = g.call_function(aten.mm.default, (p.x, block(p.w_gu, 0, r * D, D)))
        up = g.call_function(aten.mm.default, (p.x, block(p.w_gu, 0, p.D + r * D, D)))
    for half, new in zip(p.halves, (gate, up)):
        half.replace_all_uses_with(new)
    with g.inserting_before(p.pre):
        shared = g.call_function(aten.mm.default, (p.h, block(p.w_down_shared, 1, r * D, D)))
    _finish(g, layer, p, shared, [*dead, *p.halves, p.gu])
