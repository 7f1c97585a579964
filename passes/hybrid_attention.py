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
AttnRes is row-wise (its role's contract, in every spelling), so every rank computes
on all rows what the ranks computed on their shards. Nothing else crosses a
collective unproven: a dense MLP runs on all rows only where ``row_local`` proves
it row-local; the MoE, and a dense MLP without that proof, keep the shard
(``shard`` is the entry's own pad + rank slice, so they and the padding mask see
exactly the rows they saw in SP) and are all-gathered after. Spellings that size
by rows beyond the tensors (vLLM's AttnRes grid and output buffer) are resized
through the role (``AttnRes.set_rows``).

Invariants. Relies on: a post-grad graph in SP layout with valid ``meta["val"]``.
Establishes: every residual-stream tensor (prefix, bank, AttnRes and attention
inputs/outputs) has T rows and is identical on every rank; one all-reduce per
attention layer (plus the embedding's), one all-gather per MoE layer, no
reduce-scatter; mutation semantics are untouched (only inputs of the wrapped
AttnRes calls change). The rewrite is whole-graph: the residual state is
replicated everywhere or nowhere, so one layer that does not match leaves the
graph in SP and the report names it; so does a residual value read on the shard by
anything but the collectives the rewrite removes. The ``DecoderGraph`` is updated
to the hybrid layout (layout ``hybrid``, ``reduce`` per layer, MLP bounds).

Order: first; later passes (MoE routing, kernel lowering) see the hybrid graph.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from . import row_local
from .collectives import Collective, emit_all_reduce, emit_sp_gather
from .decoder import DecoderGraph, Entry, Layer
from .graph import erase_unused
from .report import PassInfo
from .roles import resize_rows

aten = torch.ops.aten


class HybridAttention:
    name = "hybrid_attention"

    def __call__(self, gm: fx.GraphModule, ctx) -> PassInfo:
        info = PassInfo(self.name)
        dg = ctx.decoder
        reason = _refusal(dg)
        if reason:
            info.skipped.append(reason)
            ctx.mark_all(rewritten=False, reason=reason)
            return info
        info.matched = len(dg.layers)
        on_shard = {l.index: row_local.reason(l.mlp_nodes, l.mlp_in, sink=l.next_res.node)
                    for l in dg.layers if l.moe is None}
        _rewrite(gm.graph, dg, on_shard)
        info.rewritten = len(dg.layers)
        for layer in dg.layers:
            if layer.moe is not None:
                mlp = "MoE on the rank's row shard + all-gather"
            elif not on_shard[layer.index]:
                mlp = "dense MLP on all rows (row-local)"
            else:
                mlp = f"dense MLP kept on the row shard + all-gather (not proven row-local: {on_shard[layer.index]})"
            ctx.mark(layer.index, rewritten=True, reason=f"all-gather + reduce-scatter -> one all-reduce; {mlp}")
        return info


def _refusal(dg: DecoderGraph) -> str:
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
    if any(c.group_name is None for l in dg.layers for c in (l.gather, l.scatter)):
        return "a collective's process group is not known (a custom all-reduce op without a vllm:: collective)"
    sizes = {c.bindings["group_size"] for l in dg.layers for c in (l.gather, l.scatter)}
    rows = {l.gather.bindings["rows"] for l in dg.layers}
    if len(sizes) != 1 or len(rows) != 1:
        return f"layers disagree on the group size {sizes} or rows {rows}"
    for l in dg.layers:  # what reads the residual stream on the shard must be what we move
        extra = [u for u in l.pre.output.users if u not in l.gather.nodes]
        if extra:
            return f"layer {l.index}: its attention input is also read on the row shard by {extra[0].name}"
    extra = [u for u in dg.final.output.users if u not in dg.exit_gather.nodes]
    if extra:
        return f"the final AttnRes output is also read on the row shard by {extra[0].name}"
    return ""


def _rewrite(g: fx.Graph, dg: DecoderGraph, on_shard: dict[int, str]) -> None:
    entry, rows, like = dg.entry, dg.rows, dg.layers[0].gather
    first = dg.layers[0].pre
    first.set_arg("prefix", entry.embedding, drop_view=entry.slice_node is None)
    new_bank = resize_rows(g, dg.bank, rows)
    dg.bank.replace_all_uses_with(new_bank)
    dead: list[fx.Node] = [dg.bank, *([entry.slice_node] if entry.slice_node else [])]
    for res in {r.node: r for l in dg.layers for r in (l.pre, l.post, l.next_res)}.values():
        res.set_rows(g, rows)
    for layer in dg.layers:
        layer.gather.out.replace_all_uses_with(layer.gather.input)
        reduced = emit_all_reduce(g, layer.scatter.out, layer.scatter.input, layer.scatter)
        layer.scatter.out.replace_all_uses_with(reduced)
        dead += layer.gather.nodes + layer.scatter.nodes
        layer.reduce = Collective("all_reduce", layer.scatter.spelling, reduced, [reduced],
                                  {"y": layer.scatter.input, "group_name": layer.scatter.group_name,
                                   "group_size": layer.scatter.bindings["group_size"]})
        layer.attn_out, layer.gather, layer.scatter = reduced, None, None
        if layer.moe is not None or on_shard[layer.index]:
            _on_shard(g, layer, entry, rows, like)
        else:
            row_local.set_rows(layer.mlp_nodes, layer.mlp_in, rows)
    dg.exit_gather.out.replace_all_uses_with(dg.final.output)
    dead += dg.exit_gather.nodes
    if entry.pad is not None and entry.embedding.users:
        dead += [u for u in entry.embedding.users if u.target is aten.constant_pad_nd.default]
    erase_unused(g, dead, follow=lambda n: n.target in (aten.constant_pad_nd.default, aten.slice.Tensor))
    g.lint()
    dg.bank, dg.entry, dg.exit_gather, dg.hybrid = new_bank, None, None, True


def _on_shard(g: fx.Graph, layer: Layer, entry: Entry, rows: Any, like: Collective) -> None:
    """Run ``layer``'s MLP on this rank's shard of its input and gather its output."""
    x, region = layer.mlp_in, layer.mlp_nodes
    if entry.pad is not None:
        with g.inserting_after(x):
            x = g.call_function(aten.constant_pad_nd.default, (x, entry.pad, 0.0))
    with g.inserting_after(x):
        shard = g.call_function(aten.slice.Tensor, (x, 0, entry.start, entry.end))
    for user in list(layer.mlp_in.users):
        if user in region:
            user.replace_input_with(layer.mlp_in, shard)
    full = emit_sp_gather(g, layer.mlp_out, layer.mlp_out, rows, like)
    layer.next_res.set_arg("delta", full)
    layer.mlp_in, layer.mlp_out = shard, full
