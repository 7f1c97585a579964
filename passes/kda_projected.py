"""A KDA layer's in-projection and its fused decode as one op, the recurrence beside the
output gate's weight stream (``kimi_kernels.kda_decode_projected``,
``kernels/kda_projected.py``); part of ``lower_kernels``, after its GEMMs are lowered.

Matches (x: the layer's normalised rows, M of them; P = H D):

    y = kimi_kernels.skinny_mm(x, W_in, None, dt)         (dt: x's dtype)
    pieces = split_with_sizes(y, sizes, -1)                read only here
    o = kimi_kernels.kda_decode(mixed_qkv=pieces[a], f_a=pieces[b], g2=pieces[c],
                                beta=pieces[d], ...)       (auto_functionalized_v2)
        -> o = kimi_kernels.kda_decode_projected(x, W_in, columns, ...)   same bases

``columns``: the four pieces' first columns in y. Taken only where the op overlaps the
two kernels at these shapes (``kda_projected.overlapped``) and where that measured faster
than the pair (``kda_projected.FASTER_ROWS``); elsewhere the pair stays and the report
says why. The op's CPU reference is the pair, so on CPU the graph computes the same bits.
"""

from __future__ import annotations

import operator
from types import SimpleNamespace

import torch
from torch import fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2

from kimi_inductor.kernels import kda_projected as kernel

aten = torch.ops.aten
kk = torch.ops.kimi_kernels
PIECES = ("mixed_qkv", "g2", "f_a", "beta")  # in ``columns``' order


def bind(kda: fx.Node) -> SimpleNamespace | str:
    """The pieces of ``kda`` (an ``auto_functionalized_v2`` of ``kimi_kernels.kda_decode``)
    as one in-projection, or why they are not."""
    getitems = [kda.kwargs[name] for name in PIECES]
    if any(not isinstance(n, fx.Node) or n.target is not operator.getitem for n in getitems):
        return "its inputs are not pieces of one split"
    split = getitems[0].args[0]
    if any(n.args[0] is not split for n in getitems) or split.target is not aten.split_with_sizes.default \
            or split.args[2:] not in ((-1,), (1,)):
        return "its inputs are not pieces of one column split"
    gemm = split.args[0]
    if gemm.target is not kk.skinny_mm.default:
        return "its in-projection is not a lowered skinny GEMM"
    x, w, acc, out_dtype = gemm.args
    if acc is not None or out_dtype != x.meta["val"].dtype:
        return "its in-projection adds an accumulator or changes dtype"
    readers = {u for item in split.users for u in item.users}
    if len(gemm.users) != 1 or readers != {kda}:
        return "the in-projection's output has other readers"
    offsets = [sum(split.args[1][:i]) for i in range(len(split.args[1]))]
    columns = [offsets[n.args[1]] for n in getitems]
    (M, K), N = x.meta["val"].shape, w.meta["val"].shape[0]
    rec = kda.kwargs["_all_bases"][kda.kwargs["_recurrent_state_base_index"]].meta["val"]
    H, D = rec.shape[1], rec.shape[-1]
    if not isinstance(M, int):
        return "symbolic rows"
    why = kernel.overlapped(M, N, K, columns[1], H * D, x.meta["val"].dtype,
                            kda.kwargs["conv_weight"].meta["val"].shape[-1], D) or kernel.faster(M)
    return why or SimpleNamespace(x=x, w=w, columns=columns, gemm=gemm, split=split)


def lower(g: fx.Graph, kda: fx.Node, bound: SimpleNamespace) -> fx.Node:
    """``kda_decode_projected`` (same bases) in place of ``kda``; the GEMM and its split are
    left unread (dead-code removal takes them)."""
    kwargs = {k: v for k, v in kda.kwargs.items() if k not in PIECES}
    kwargs.update(x=bound.x, in_weight=bound.w, columns=bound.columns)
    with g.inserting_before(kda):
        new = g.call_function(auto_functionalized_v2, (kk.kda_decode_projected.default,), kwargs)
    new.meta.update({k: v for k, v in kda.meta.items() if k != "eager_input_vals"})
    kda.replace_all_uses_with(new)
    g.erase_node(kda)
    return new
