"""Collectives of the decoder graph: the patterns the passes match and the ops they emit.

One role in several spellings: each spelling of ``roles.SPELLINGS`` declares how it
writes all-gather, reduce-scatter and all-reduce over the TP group (our replica:
``_c10d_functional.*`` + ``wait_tensor``; vLLM: ``vllm::all_gather`` ...). The shapes
the decoder uses are built here around them, as Inductor pattern-matcher patterns with
wildcard group names:

SP gather   ``all_gather(x)[:rows]``      (rows = the step's T; drops SP pad rows;
                                           the slice is absent when T divides by G)
SP scatter  ``reduce_scatter(pad(y))``    (pad rows to a multiple of G; may be absent)
all-reduce  ``all_reduce(y)``

A rewrite emits a collective in the spelling of the one it replaces (``over``: in that
spelling, over another group).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch._inductor.pattern_matcher import CallFunction, KeywordArg, Match

from .graph import OpCall
from .roles import SPELLINGS, collective_spelling

aten = torch.ops.aten


def _spelled():
    return [(s.name, s.collectives) for s in SPELLINGS if s.collectives is not None]


def _completed(kind: str, spelling: str, node: fx.Node, bindings: dict) -> dict:
    complete = collective_spelling(spelling).complete
    if complete is not None:
        complete(kind, node, bindings)
    return bindings


def _gather_patterns():
    for name, c in _spelled():
        for gather in c.gathers():
            yield name, CallFunction(aten.slice.Tensor, gather, 0, 0, KeywordArg("rows"))
            yield name, gather


def _scatter_patterns():
    for padded in (True, False):
        y = CallFunction(aten.constant_pad_nd.default, KeywordArg("y"), KeywordArg("pad"), 0.0) if padded \
            else KeywordArg("y")
        for name, c in _spelled():
            for scatter in c.scatters(y):
                yield name, scatter


def _all_reduce_patterns():
    for name, c in _spelled():
        for reduce in c.all_reduces():
            yield name, reduce


@dataclass
class Collective:
    """A matched collective: ``out`` is the node its consumers read."""

    kind: str  # "sp_gather" | "sp_scatter" | "all_reduce"
    spelling: str  # the name of the spelling it is written in
    out: fx.Node
    nodes: list[fx.Node]
    bindings: dict[str, Any]

    @property
    def input(self) -> fx.Node:
        return self.bindings["x" if self.kind == "sp_gather" else "y"]

    @property
    def group_name(self) -> str:
        return self.bindings["group_name"]


def over(like: Collective, group_name: str, group_size: int) -> Collective:
    """``like``'s spelling over another group (to emit collectives there)."""
    return dataclasses.replace(like, bindings={**like.bindings, "group_name": group_name, "group_size": group_size})


def _chain_nodes(out: fx.Node, bound) -> list[fx.Node]:
    """The matched nodes: ``out`` and its producers down to the bound input."""
    stop = {b for b in bound if isinstance(b, fx.Node)}
    nodes, node = [], out
    while isinstance(node, fx.Node) and node not in stop:
        nodes.append(node)
        node = node.args[0]
    return nodes


def _match(kind: str, patterns, node: fx.Node) -> Collective | None:
    if node.op != "call_function":
        return None
    for spelling, pattern in patterns:
        m = pattern.match(node)
        if isinstance(m, Match):
            bindings = _completed(kind, spelling, node, dict(m.kwargs))
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


def count(graph: fx.Graph) -> dict[str, int]:
    """Collectives in ``graph`` by kind (every spelling)."""
    ops = {op: kind for _, c in _spelled() for op, kind in c.ops().items()}
    out = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
    for node in graph.nodes:
        call = OpCall.of(node)
        if call is not None and call.op in ops:
            out[ops[call.op]] += 1
    return out


def emit_all_reduce(graph: fx.Graph, after: fx.Node, y: fx.Node, like: Collective) -> fx.Node:
    """``all_reduce(y)`` in the spelling of ``like``, inserted after ``after``."""
    return collective_spelling(like.spelling).emit_all_reduce(graph, after, y, like)


def emit_all_gather(graph: fx.Graph, after: fx.Node, x: fx.Node, like: Collective) -> fx.Node:
    """``all_gather(x)`` along dim 0 in the spelling (and group) of ``like``."""
    return collective_spelling(like.spelling).emit_all_gather(graph, after, x, like)


def emit_reduce_scatter(graph: fx.Graph, after: fx.Node, y: fx.Node, like: Collective) -> fx.Node:
    """``reduce_scatter(y)`` (sum, this rank's 1/G of the rows) in the spelling of ``like``."""
    return collective_spelling(like.spelling).emit_reduce_scatter(graph, after, y, like)


def emit_sp_gather(graph: fx.Graph, after: fx.Node, x: fx.Node, rows: Any, like: Collective) -> fx.Node:
    """``all_gather(x)[:rows]`` in the spelling of ``like``, inserted after ``after``."""
    gathered = emit_all_gather(graph, after, x, like)
    with graph.inserting_after(gathered):
        return graph.call_function(aten.slice.Tensor, (gathered, 0, 0, rows))
