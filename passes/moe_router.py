"""The MoE router's expert choice as one op (``kimi_kernels.select_experts``,
``kernels/moe_router.py``); part of ``lower_kernels``.

Matches stock's ``select_experts`` as AOTAutograd decomposes it (any MoE layer, any layout):

    s = sigmoid(logits)                  logits [M, E] fp32
    i = topk(add(s, bias), k)[1]         (the values unread)
    w = gather(s, 1, i)
    w = div(w, sum(w, [-1], True))       (when renormalising)
    weights, ids = mul(w, scale), convert(i, int32)
        -> weights, ids = select_experts(logits, bias, k, renormalize, scale)

Only this exact shape: the indices read by nothing but the gather and the cast, the
scores by nothing but the add and the gather, topk over the last dimension, largest,
sorted. Anything else keeps its ops (nothing reported: a graph without the pattern has
no router to lower).
"""

from __future__ import annotations

import operator
from numbers import Number
from types import SimpleNamespace

import torch
from torch import fx

aten, prims = torch.ops.aten, torch.ops.prims
kk = torch.ops.kimi_kernels


def _only(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def bind(topk: fx.Node) -> SimpleNamespace | None:
    """The routing ops around ``topk``, or None when they are not stock's."""
    add, k = topk.args[:2]
    if (topk.kwargs or list(topk.args[2:]) not in ([], [-1], [-1, True], [-1, True, True])
            or not isinstance(add, fx.Node) or add.target is not aten.add.Tensor):
        return None
    scores, bias = add.args
    if not isinstance(scores, fx.Node) or scores.target is not aten.sigmoid.default or len(add.users) != 1:
        return None
    logits = scores.args[0]
    if logits.meta["val"].dtype != torch.float32 or logits.meta["val"].dim() != 2:
        return None
    if not isinstance(bias, fx.Node) or bias.meta["val"].dim() != 1:
        return None
    ids = _only(topk)
    if ids is None or ids.target is not operator.getitem or ids.args[1] != 1:
        return None
    users = {u.target: u for u in ids.users}
    gather, cast = users.get(aten.gather.default), users.get(prims.convert_element_type.default)
    if len(ids.users) != 2 or gather is None or cast is None or cast.args[1] != torch.int32:
        return None
    if gather.args != (scores, 1, ids) or set(scores.users) != {add, gather}:
        return None
    renormalize = len(gather.users) == 2
    w = gather
    if renormalize:
        total = next((u for u in gather.users if u.target is aten.sum.dim_IntList), None)
        div = next((u for u in gather.users if u.target is aten.div.Tensor), None)
        if total is None or div is None or total.args[1:] != ([-1], True) or div.args != (gather, total) \
                or len(total.users) != 1:
            return None
        w = div
    mul = _only(w)
    if mul is None or mul.target is not aten.mul.Tensor or mul.args[0] is not w or not isinstance(mul.args[1], Number):
        return None
    return SimpleNamespace(logits=logits, bias=bias, k=k, renormalize=renormalize, scale=float(mul.args[1]),
                           weights=mul, ids=cast, first=scores)


def lower(g: fx.Graph, b: SimpleNamespace) -> fx.Node:
    with g.inserting_before(b.first):
        call = g.call_function(kk.select_experts.default, (b.logits, b.bias, b.k, b.renormalize, b.scale))
        outs = [g.call_function(operator.getitem, (call, i)) for i in range(2)]
    call.meta["val"] = (b.weights.meta["val"], b.ids.meta["val"])
    for old, new in zip((b.weights, b.ids), outs):
        new.meta["val"] = old.meta["val"]
        old.replace_all_uses_with(new)
    return call
