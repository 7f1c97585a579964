"""Row locality: the proof a rewrite needs before it moves a subgraph across a collective.

A subgraph fed by ``src`` ([R, ...], R rows) is *row-local* when row r of every value it
computes from ``src`` depends on row r of ``src`` only (and on values that do not depend
on ``src`` at all, such as weights). Such a subgraph computes the same rows whether it
runs on a rank's shard of the rows or on all of them, so the hybrid step may run it on
all rows. The proof is by construction over the subgraph in graph order; a value is
*row-carrying* when it depends on ``src``, and every row-carrying node must be one of:

    pointwise ops          row-carrying operands [R, ...] of the output's rank; other
                           operands broadcast without a row dimension (lower rank, or
                           leading size 1)
    mm / addmm / mm.dtype  row-carrying left operand, right operand not (addmm's
                           accumulator: [R, N] rows, or without a row dimension)
    reductions, softmax,   over dimensions other than 0
    topk, gather
    views and layout ops   keeping dimension 0 as it is (view/reshape to [R, ...],
                           permute with 0 first, slice/split/select/squeeze/unsqueeze/
                           cat off dimension 0, getitem of a split)
    declared custom ops    ``roles.row_local_args``: a spelling's row-wise ops, by the
                           arguments they read row by row; a buffer they write must be
                           a fresh allocation of the rows (resized with them)

and no row-carrying value may be read outside the subgraph (except by ``sink``, the
consumer of its result). Anything else (``y.mean(0)``, an index along rows, a view
that folds rows) is not proven, and ``reason`` names it.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

from .graph import OpCall, op_name
from .roles import ALLOCATIONS, resize_rows, row_local_args

aten, prims = torch.ops.aten, torch.ops.prims

GEMMS = {aten.mm.default: (0,), aten.mm.dtype: (0,), aten.addmm.default: (1,)}
REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default, aten.var.correction,
              aten._softmax.default, aten._log_softmax.default}
DIM_OPS = {aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default, aten.select.int,
           aten.squeeze.dim, aten.unsqueeze.default, aten.narrow.default, aten.slice_scatter.default,
           aten.select_scatter.default, aten.cat.default, aten.topk.default, aten.gather.default}
SIZED = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}
SAME_ROWS = SIZED | {aten.clone.default, aten.alias.default, aten._to_copy.default}


def _val(a: Any) -> Any:
    return a.meta.get("val") if isinstance(a, fx.Node) else None


def _same(a: Any, b: Any) -> bool:
    return statically_known_true(sym_eq(a, b))


def _rows_kept(node: fx.Node, rows: Any) -> bool:
    val = _val(node)
    vals = [v for v in (val if isinstance(val, (list, tuple)) else [val]) if v is not None]
    return bool(vals) and all(isinstance(v, torch.Tensor) and v.dim() > 0 and _same(v.shape[0], rows) for v in vals)


def _dims(node: fx.Node) -> list[int]:
    """The dimension arguments of a reduction / dim op, normalised (may be empty: all)."""
    if node.target is aten.cat.default:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    elif node.target in (aten.split.Tensor, aten.split_with_sizes.default):
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    elif node.target is aten.slice_scatter.default:
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    elif node.target is aten.select_scatter.default:
        dim = node.args[2]
    elif node.target is aten.topk.default:
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    elif node.target is aten.var.correction:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    elif node.target is aten.slice.Tensor:
        dim = node.args[1] if len(node.args) > 1 else 0
    else:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dim is None:
        return []
    ndim = _val(node.args[0] if node.target is not aten.cat.default else node.args[0][0]).dim()
    if node.target is aten.unsqueeze.default:
        ndim += 1
    return [d % ndim for d in (dim if isinstance(dim, (list, tuple)) else [dim])]


def _rule(node: fx.Node, carried: set[fx.Node], rows: Any) -> str:
    """'' when ``node`` keeps rows local, else why not."""
    target = node.target
    if not _rows_kept(node, rows):
        return "its output does not keep the rows in dimension 0"
    if target is operator.getitem:  # one output of a node proven row-local
        return ""
    if target in GEMMS:
        index = GEMMS[target][0]
        if node.args[index] not in carried or node.args[index + 1] in carried:
            return "a GEMM whose right operand depends on the rows"
        if index and node.args[0] in carried and _val(node.args[0]).dim() != 2:  # addmm's accumulator
            return "a row-carrying accumulator broadcast into the rows"
        return ""
    if target in REDUCTIONS or target in DIM_OPS:
        dims = _dims(node)
        if not dims and target in REDUCTIONS:
            return "a reduction over every dimension"
        if 0 in dims:
            return "it works along dimension 0 (the rows)"
        if target in (aten.cat.default, aten.slice_scatter.default, aten.select_scatter.default):
            tensors = node.args[0] if target is aten.cat.default else node.args[:2]
            if not all(t in carried for t in tensors):
                return "it joins row-carrying values with values that are not"
        return ""
    if target is aten.permute.default:
        return "" if list(node.args[1])[0] % _val(node).dim() == 0 else "it moves dimension 0"
    if target in SAME_ROWS or target is prims.convert_element_type.default:
        return ""
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        out = _val(node)
        for a in node.all_input_nodes:
            v = _val(a)
            if not isinstance(v, torch.Tensor):
                continue
            if a in carried and v.dim() != out.dim():
                return "a row-carrying operand broadcast into another dimension"
            if a not in carried and v.dim() == out.dim() and not _same(v.shape[0], 1):
                return "an operand from outside has a row dimension"
        return ""
    call = OpCall.of(node)
    names = None if call is None else row_local_args(call.op._schema.name)
    if names is not None:
        for a in call.op._schema.arguments:
            value = call.arg(a.name)
            if not isinstance(value, fx.Node):
                continue
            if a.name in names:
                if value not in carried:
                    return f"its row-wise argument {a.name} comes from outside"
            elif value in carried:
                return f"a row-carrying value enters {a.name}, which it does not read row by row"
            elif _buffer(call, a) and not (value.target in ALLOCATIONS and _same(_val(value).shape[0], rows)):
                return f"its output buffer {a.name} is not a fresh allocation of the rows"
        return ""
    return "not known to be row-local"


def _buffer(call: OpCall, argument) -> bool:
    """Whether ``argument`` is a buffer the op writes (its rows then follow the input's)."""
    return argument.alias_info is not None and argument.alias_info.is_write


def _carried(nodes: set[fx.Node], src: fx.Node, also: tuple = ()) -> tuple[list[fx.Node], str]:
    """The row-carrying nodes of ``nodes`` in graph order, and '' or why one is not row-local."""
    rows = _val(src).shape[0]
    carried = {src, *also}
    for node in src.graph.nodes:
        if node in carried or node not in nodes or not any(a in carried for a in node.all_input_nodes):
            continue
        why = _rule(node, carried, rows)
        if why:
            return [], f"{op_name(node)}: {why}"
        carried.add(node)
    return [n for n in src.graph.nodes if n in carried], ""


def reason(nodes: set[fx.Node], src: fx.Node, sink: fx.Node | None = None, also: tuple = ()) -> str:
    """'' when the subgraph ``nodes`` (all fed by ``src``) is row-local, else the first
    op that is not proven and why. ``also``: further row sources with ``src``'s rows (a
    padding mask sliced like it), which others may read too."""
    carried, why = _carried(nodes, src, also)
    for node in carried:
        if node in also:
            continue
        outside = [u for u in node.users if u not in nodes and u is not sink]
        if outside and not why:
            why = f"{op_name(node)}: its value is also read by {op_name(outside[0])}, outside the subgraph"
    return why


def set_rows(nodes: set[fx.Node], src: fx.Node, rows: Any, also: tuple = ()) -> None:
    """Make a proven row-local subgraph take ``rows`` rows: the sizes its views and
    expands spell out keep dimension 0 as the rows (``_rule``), so that entry becomes
    ``rows``, and the buffers of declared row-local ops are allocated with ``rows``.
    Call before ``src`` changes."""
    g = src.graph
    for node in _carried(nodes, src, also)[0]:
        if node.target in SIZED:
            args = list(node.args)
            args[1] = [rows, *args[1][1:]]
            node.args = tuple(args)
        call = OpCall.of(node)
        if call is not None and row_local_args(call.op._schema.name) is not None:
            for a in call.op._schema.arguments:
                if _buffer(call, a) and isinstance(call.arg(a.name), fx.Node):
                    call.set_arg(a.name, resize_rows(g, call.arg(a.name), rows), drop_view=True)
