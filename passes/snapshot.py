"""Readable, run-stable text of one decoder layer's region of a post-grad graph.

Used for expecttest snapshots, ``python -m kimi_inductor explain`` and the docs.
A region is the graph-order span of a layer: ``attention`` from its pre-attention
AttnRes to its post-attention AttnRes, ``mlp`` from there to the next AttnRes.
Normalised so that it does not change between runs: nodes are numbered in order
(``%0``, ``%1``...), values from outside the region are ``%in0``, ``%in1``...,
size symbols are renamed ``s0``, ``s1``... in order of appearance.
"""

from __future__ import annotations

import operator
import re

import torch
from torch import fx

from .decoder import DecoderGraph, _between
from .graph import OpCall, TritonCall

_DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32", torch.int32: "i32", torch.int64: "i64", torch.int8: "i8",
           torch.bool: "b8", torch.uint8: "u8"}


def region_nodes(graph: fx.Graph, layer: int, part: str) -> list[fx.Node]:
    """Nodes of ``layer``'s ``attention`` (pre-attention AttnRes -> the value the
    post-attention AttnRes reads) or ``mlp`` (post-attention AttnRes output -> the
    next AttnRes' delta) dataflow, in graph order."""
    dg = DecoderGraph.parse(graph)
    if not dg.layers:
        raise ValueError("; ".join(dg.problems) or "no decoder layers in this graph")
    if not 0 <= layer < len(dg.layers):
        raise ValueError(f"layer {layer} out of range (the graph has {len(dg.layers)} layers)")
    l = dg.layers[layer]
    if part == "attention":
        pre_out = l.pre.output
        nodes = _between(pre_out, l.attn_out) | {l.pre.node, pre_out}
    elif part == "mlp":
        nodes = _between(l.mlp_in, l.mlp_out)
    else:
        raise ValueError(f"part must be 'attention' or 'mlp', got {part!r}")
    return [n for n in graph.nodes if n in nodes]


def region_text(gm: fx.GraphModule, layer: int, part: str) -> str:
    nodes = region_nodes(gm.graph, layer, part)
    names = {n: f"%{i}" for i, n in enumerate(nodes)}
    outside: dict[fx.Node, str] = {}

    def ref(a):
        if isinstance(a, fx.Node):
            if a not in names and a not in outside:
                outside[a] = f"%in{len(outside)}"
            return names.get(a) or outside[a]
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(ref(x) for x in a) + "]"
        if isinstance(a, torch.dtype):
            return _DTYPES.get(a, str(a))
        if isinstance(a, float):
            return f"{a:g}"
        return repr(a) if isinstance(a, str) else str(a)

    lines: list[str] = []
    for n in nodes:
        triton = TritonCall.of(n)
        if n.target is operator.getitem:
            rhs = f"{ref(n.args[0])}[{n.args[1]}]"
        elif triton is not None:  # by kernel name; tensors by name, then the constants
            args = [f"{k}={ref(v)}" for k, v in n.kwargs["kwargs"].items()]
            args += [f"{k}={ref(v)}" for k, v in triton.constants.items()] + [f"grid={ref(triton.grid)}"]
            rhs = f"triton.{triton.name.rsplit('.', 1)[-1]}({', '.join(args)})"
        else:
            call = OpCall.of(n)
            if call is not None and call.wrapped:
                target = f"{n.target.__name__}[{_op(call.op)}]"
                args = [ref(a) for a in n.args[1:]]
            else:
                target = _op(call.op) if call is not None else str(getattr(n.target, "__name__", n.target))
                args = [ref(a) for a in n.args]
            kwargs = [f"{k}={ref(v)}" for k, v in n.kwargs.items()
                      if k not in ("layout", "device", "pin_memory")]
            rhs = f"{target}({', '.join(args + kwargs)})"
        lines.append(f"{names[n]} = {rhs}{_type(n)}")
    inputs = [f"{name} = {_describe(n)}{_type(n)}" for n, name in outside.items()]
    return _rename_symbols("\n".join(inputs + lines))


def _describe(n: fx.Node) -> str:
    if n.op == "placeholder":
        return "input"
    call = OpCall.of(n)
    return f"{_op(call.op)}(...)" if call is not None else str(getattr(n.target, "__name__", n.target))


def _op(op: torch._ops.OpOverload) -> str:
    name = op._schema.name.split("::")
    return f"{name[0].replace('_c10d_functional', 'c10d')}.{name[1]}"


def _type(n: fx.Node) -> str:
    val = n.meta.get("val")
    if isinstance(val, torch.Tensor):
        return f"  : {_DTYPES.get(val.dtype, str(val.dtype))}{list(val.shape)}"
    return ""


def _rename_symbols(text: str) -> str:
    seen: dict[str, str] = {}

    def sub(m):
        return seen.setdefault(m.group(0), f"s{len(seen)}")

    return re.sub(r"\b[su]\d+\b", sub, text)
