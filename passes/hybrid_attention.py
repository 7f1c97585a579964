"""hybrid_attention: rewrite the sequence-parallel decoder into the hybrid step.

Matches (``decoder.py``) a whole SP decoder: the embedding's entry shard, per layer
an SP gather before the attention and an SP reduce-scatter after its o-projection,
the exit gather. Rewrites, per layer (T rows, G ranks, c = ceil(T / G)):

    before (SP)                               after (hybrid)
    x = shard(embed)              [c]         x = embed                        [T]
    bank = empty(c, NB, H)                    bank = empty(T, NB, H)
    h = attn_res(...)             [c]         h = attn_res(...)                [T]
    h = all_gather(h)[:T]         [T]         -
    a = o_proj(core(h))           [T] partial a = o_proj(core(h))              [T] partial
    a = reduce_scatter(pad(a))    [c]         a = all_reduce(a)                [T]
    x = attn_res(...)             [c]         x = attn_res(...)                [T]
    y = moe(x)                    [c]         y = all_gather(moe(shard(x)))[:T] [T]
    y = dense(x)                  [c]         y = dense(x)                     [T]
    out = all_gather(final)[:T]               out = final                      [T]

Why it is exact: an all-reduce is a reduce-scatter followed by an all-gather, and
AttnRes is row-wise, so every rank computes on all rows what the ranks computed on
their shards; only the MoE keeps the shard (``shard`` is the entry's own pad + rank
slice, so the MoE and its padding mask see exactly the rows they saw in SP).

Invariants. Relies on: a post-grad graph in SP layout with valid ``meta["val"]``.
Establishes: every residual-stream tensor (prefix, bank, AttnRes and attention
inputs/outputs) has T rows and is identical on every rank; one all-reduce per
attention layer (plus the embedding's), one all-gather per MoE layer, no
reduce-scatter; mutation semantics are untouched (only inputs of the wrapped
AttnRes calls change). The rewrite is whole-graph: the residual state is
replicated everywhere or nowhere, so one layer that does not match leaves the
graph in SP and the report names it. A dense MLP whose subgraph is tied to c rows
(a hard-coded view) stays on the shard with an all-gather, and the report says so.

Order: first; later passes (MoE routing, kernel lowering) see the hybrid graph.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

from .collectives import Collective, emit_all_reduce, emit_sp_gather
from .decoder import DecoderGraph, Entry
from .graph import refresh_meta
from .report import PassInfo

aten = torch.ops.aten


class HybridAttention:
    name = "hybrid_attention"

    def __call__(self, gm: fx.GraphModule, ctx) -> PassInfo:
        info = PassInfo(self.name)
        dg = ctx.decoder()
        reason = self._refusal(dg, ctx.options)
        if reason:
            info.skipped.append(reason)
            ctx.mark_all(rewritten=False, reason=reason)
            return info
        info.matched = len(dg.layers)
        _rewrite(gm, dg)
        dense_on_all_rows = _dense_fits(gm)
        if not dense_on_all_rows:  # put the dense MLPs back on the shard, as the MoEs are
            moved = DecoderGraph.parse(gm.graph)
            for layer in moved.layers:
                if layer.moe is None:
                    _on_shard(gm.graph, layer, dg.entry, dg.rows, dg.layers[0].gather)
            gm.recompile()
            refresh_meta(gm)
        info.rewritten = len(dg.layers)
        for layer in dg.layers:
            if layer.moe is not None:
                mlp = "MoE on the rank's row shard + all-gather"
            elif dense_on_all_rows:
                mlp = "dense MLP on all rows"
            else:
                mlp = "dense MLP kept on the row shard + all-gather (its subgraph is tied to c rows)"
            ctx.mark(layer.index, rewritten=True,
                     reason=f"all-gather + reduce-scatter -> one all-reduce; {mlp}")
        return info

    @staticmethod
    def _refusal(dg: DecoderGraph, options) -> str:
        if not dg.is_decoder:
            return "; ".join(dg.problems) or "no decoder layers"
        layout = dg.layout
        if layout == "tp":
            return "TP layout: attention rows are already replicated (o_proj all-reduce kept)"
        if layout == "single":
            return "one rank: no TP collectives to rewrite"
        if layout != "sp":
            missing = [l.index for l in dg.layers if l.gather is None or l.scatter is None]
            return (f"not a whole SP decoder (layers without SP gather/reduce-scatter: {missing}, "
                    f"entry shard {'found' if dg.entry else 'missing'}, exit gather "
                    f"{'found' if dg.exit_gather else 'missing'}): left in SP")
        if dg.bank is None:
            return "the AttnRes bank is not a plain allocation"
        sizes = {c.bindings["group_size"] for l in dg.layers for c in (l.gather, l.scatter)}
        rows = {l.gather.bindings["rows"] for l in dg.layers}
        if len(sizes) != 1 or len(rows) != 1:
            return f"layers disagree on the group size {sizes} or rows {rows}"
        decode = options.decode
        if decode.tp is not None and dg.group_size != decode.tp:
            return f"graph has TP size {dg.group_size}, options say decode.tp={decode.tp}"
        if decode.q is not None and dg.q is not None and dg.q != decode.q:
            return f"graph verifies q={dg.q} tokens per request, options say decode.q={decode.q}"
        if decode.capture_sizes and dg.rows not in decode.capture_sizes:
            return f"batch rows {dg.rows} not in decode.capture_sizes {list(decode.capture_sizes)}"
        return ""


def _dense_fits(gm: fx.GraphModule) -> bool:
    """Refresh the fake values; do the dense MLPs (now fed T rows) produce T rows?"""
    try:
        refresh_meta(gm)
    except Exception:  # a row-count-specific op (e.g. a hard-coded view) in a dense MLP
        return False
    dg = DecoderGraph.parse(gm.graph)
    rows = _rows(dg.layers[0].pre.output(0))
    return all(statically_known_true(sym_eq(_rows(l.mlp_out), rows)) for l in dg.layers if l.moe is None)


def _rewrite(gm: fx.GraphModule, dg: DecoderGraph) -> None:
    g, entry, rows = gm.graph, dg.entry, dg.rows
    first = dg.layers[0].pre
    first.set_arg("prefix", entry.embedding, drop_view=entry.slice_node is None)
    new_bank = _with_rows(g, dg.bank, rows)
    dg.bank.replace_all_uses_with(new_bank)
    dead: list[fx.Node] = [dg.bank, *([entry.slice_node] if entry.slice_node else [])]
    for layer in dg.layers:
        layer.gather.out.replace_all_uses_with(layer.gather.input)
        reduced = emit_all_reduce(g, layer.scatter.out, layer.scatter.input, layer.scatter)
        layer.scatter.out.replace_all_uses_with(reduced)
        dead += layer.gather.nodes + layer.scatter.nodes
        if layer.moe is not None:
            _on_shard(g, layer, entry, rows, dg.layers[0].gather)
    dg.exit_gather.out.replace_all_uses_with(dg.final.output(0))
    dead += dg.exit_gather.nodes
    if entry.pad is not None and entry.embedding.users:
        dead += [u for u in entry.embedding.users if u.target is aten.constant_pad_nd.default]
    _erase_unused(g, dead)
    g.lint()
    gm.recompile()


def _on_shard(g: fx.Graph, layer, entry: Entry, rows: Any, like: Collective) -> None:
    """Run ``layer``'s MLP on this rank's shard of its input and gather its output."""
    x = layer.mlp_in
    if entry.pad is not None:
        with g.inserting_after(x):
            x = g.call_function(aten.constant_pad_nd.default, (x, entry.pad, 0.0))
    with g.inserting_after(x):
        shard = g.call_function(aten.slice.Tensor, (x, 0, entry.start, entry.end))
    for user in list(layer.mlp_in.users):
        if user in layer.mlp_nodes:
            user.replace_input_with(layer.mlp_in, shard)
    full = emit_sp_gather(g, layer.mlp_out, layer.mlp_out, rows, like)
    layer.next_res.set_arg("delta", full)


def _with_rows(g: fx.Graph, alloc: fx.Node, rows: Any) -> fx.Node:
    """A copy of allocation ``alloc`` with ``rows`` as its first dimension."""
    index = 1 if alloc.target is aten.new_empty.default else 0
    args = list(alloc.args)
    args[index] = [rows, *args[index][1:]]
    with g.inserting_after(alloc):
        return g.call_function(alloc.target, tuple(args), dict(alloc.kwargs))


def _erase_unused(g: fx.Graph, nodes: list[fx.Node]) -> None:
    pending = [n for n in dict.fromkeys(nodes) if n.graph is g]
    changed = True
    while changed:
        changed = False
        for n in list(pending):
            if not n.users:
                inputs = n.all_input_nodes
                g.erase_node(n)
                pending.remove(n)
                pending += [i for i in inputs if i.op == "call_function" and not i.users and i not in pending
                            and i.target in (aten.constant_pad_nd.default, aten.slice.Tensor)]
                changed = True


def _rows(node: fx.Node) -> Any:
    val = node.meta.get("val")
    return None if val is None else val.shape[0]
