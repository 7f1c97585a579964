"""Collectives of the decoder graph: the patterns the passes match and the ops they emit.

Two spellings reach us: functional collectives (``_c10d_functional.*`` followed by
``wait_tensor``; our stock decoder, torch.distributed code) and vLLM's collective
ops (``torch.ops.vllm.all_gather / reduce_scatter / all_reduce``; vLLM models).
The patterns below are Inductor pattern-matcher patterns; group names are
wildcards, so the same patterns match any process group.

SP gather   ``all_gather(x)[:rows]``      (rows = the step's T; drops SP pad rows)
SP scatter  ``reduce_scatter(pad(y))``    (pad rows to a multiple of G; may be absent)
all-reduce  ``all_reduce(y)``
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch._inductor.pattern_matcher import CallFunction, KeywordArg, Match

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _wait(inner):
    return CallFunction(c10d.wait_tensor.default, inner)


def _vllm(name: str):
    """vLLM's collective op, when vLLM (or a look-alike) registered it."""
    ns = getattr(torch.ops, "vllm", None)
    packet = getattr(ns, name, None) if ns is not None else None
    return None if packet is None else packet.default


def _gather_patterns():
    """With and without the ``[:rows]`` slice (Inductor drops it when T divides by G)."""
    gathers = [("c10d", _wait(CallFunction(c10d.all_gather_into_tensor.default, KeywordArg("x"),
                                           KeywordArg("group_size"), KeywordArg("group_name"))))]
    op = _vllm("all_gather")
    if op is not None:
        gathers.append(("vllm", CallFunction(op, KeywordArg("x"), 0, KeywordArg("group_size"),
                                             KeywordArg("group_name"))))
    for spelling, gather in gathers:
        yield spelling, CallFunction(aten.slice.Tensor, gather, 0, 0, KeywordArg("rows"))
        yield spelling, gather


def _scatter_patterns():
    for padded in (True, False):
        y = CallFunction(aten.constant_pad_nd.default, KeywordArg("y"), KeywordArg("pad"), 0.0) if padded \
            else KeywordArg("y")
        yield "c10d", _wait(CallFunction(c10d.reduce_scatter_tensor.default, y, "sum", KeywordArg("group_size"),
                                         KeywordArg("group_name")))
        op = _vllm("reduce_scatter")
        if op is not None:
            yield "vllm", CallFunction(op, y, 0, KeywordArg("group_size"), KeywordArg("group_name"))


def _all_reduce_patterns():
    yield "c10d", _wait(CallFunction(c10d.all_reduce.default, KeywordArg("y"), "sum", KeywordArg("group_name")))
    op = _vllm("all_reduce")
    if op is not None:
        yield "vllm", CallFunction(op, KeywordArg("y"), KeywordArg("group_name"))


@dataclass
class Collective:
    """A matched collective: ``out`` is the node its consumers read."""

    kind: str  # "sp_gather" | "sp_scatter" | "all_reduce"
    spelling: str  # "c10d" | "vllm"
    out: fx.Node
    nodes: list[fx.Node]
    bindings: dict[str, Any]

    @property
    def input(self) -> fx.Node:
        return self.bindings["x" if self.kind == "sp_gather" else "y"]

    @property
    def group_name(self) -> str:
        return self.bindings["group_name"]


def _chain_nodes(out: fx.Node, bound) -> list[fx.Node]:
    """The matched nodes: ``out`` and its producers down to the bound input."""
    stop = {b for b in bound if isinstance(b, fx.Node)}
    nodes, node = [], out
    while isinstance(node, fx.Node) and node not in stop:
        nodes.append(node)
        node = node.args[0]
    return nodes


def _match(kind: str, patterns, node: fx.Node) -> Collective | None:
    for spelling, pattern in patterns:
        m = pattern.match(node)
        if isinstance(m, Match):
            bindings = dict(m.kwargs)
            if kind == "sp_gather" and "rows" not in bindings:  # unsliced: all G c rows
                val = node.meta.get("val")
                bindings["rows"] = None if val is None else val.shape[0]
            return Collective(kind, spelling, node, _chain_nodes(node, m.kwargs.values()), bindings)
    return None


def sp_gather(node: fx.Node) -> Collective | None:
    return _match("sp_gather", _gather_patterns(), node)


def sp_scatter(node: fx.Node) -> Collective | None:
    return _match("sp_scatter", _scatter_patterns(), node)


def all_reduce(node: fx.Node) -> Collective | None:
    return _match("all_reduce", _all_reduce_patterns(), node)


COLLECTIVE_OPS = {
    c10d.all_reduce.default: "all_reduce",
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
}


def count(graph: fx.Graph) -> dict[str, int]:
    """Collectives in ``graph`` by kind (both spellings)."""
    ops = dict(COLLECTIVE_OPS)
    for name in ("all_reduce", "all_gather", "reduce_scatter"):
        op = _vllm(name)
        if op is not None:
            ops[op] = name
    out = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
    for node in graph.nodes:
        if node.op == "call_function" and node.target in ops:
            out[ops[node.target]] += 1
    return out


def _chain(graph: fx.Graph, after: fx.Node, calls: list) -> fx.Node:
    """Insert ``calls`` [(target, args_fn)] one after another after ``after``."""
    node = after
    prev = None
    for target, make_args in calls:
        with graph.inserting_after(node):
            node = graph.call_function(target, make_args(prev))
        prev = node
    return node


def emit_all_reduce(graph: fx.Graph, after: fx.Node, y: fx.Node, like: Collective) -> fx.Node:
    """``all_reduce(y)`` in the spelling of ``like``, inserted after ``after``."""
    if like.spelling == "vllm":
        return _chain(graph, after, [(_vllm("all_reduce"), lambda _: (y, like.group_name))])
    return _chain(graph, after, [(c10d.all_reduce.default, lambda _: (y, "sum", like.group_name)),
                                 (c10d.wait_tensor.default, lambda ar: (ar,))])


def emit_sp_gather(graph: fx.Graph, after: fx.Node, x: fx.Node, rows: Any, like: Collective) -> fx.Node:
    """``all_gather(x)[:rows]`` in the spelling of ``like``, inserted after ``after``."""
    size = like.bindings["group_size"]
    if like.spelling == "vllm":
        steps = [(_vllm("all_gather"), lambda _: (x, 0, size, like.group_name))]
    else:
        steps = [(c10d.all_gather_into_tensor.default, lambda _: (x, size, like.group_name)),
                 (c10d.wait_tensor.default, lambda ag: (ag,))]
    steps.append((aten.slice.Tensor, lambda gathered: (gathered, 0, 0, rows)))
    return _chain(graph, after, steps)
