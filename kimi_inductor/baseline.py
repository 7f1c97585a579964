"""The stock baseline compiler: Inductor tracing through the stock math.

``stock_inductor`` is a torch.compile backend that replaces every opaque stock op
(``kimi::attn_res``, ``kda_decode``, ``mla_decode``, ...) in the Dynamo graph by its
plain-torch reference before handing the graph to Inductor, so that Inductor can fuse
the stock math instead of calling an opaque op: the strongest stock alternative to
compare ``kimi_specialized`` against (with CUDA graphs around both).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import fx

from .stock.library import REFERENCES


def inline_stock_ops(gm: fx.GraphModule) -> int:
    """Point every call of a stock op at its reference; returns how many."""
    count = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        op = target.default if isinstance(target, torch._ops.OpOverloadPacket) else target
        if op in REFERENCES:
            node.target = REFERENCES[op]
            count += 1
    gm.recompile()
    return count


def stock_inductor(gm: fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
    from torch._inductor.compile_fx import compile_fx

    inline_stock_ops(gm)
    return compile_fx(gm, example_inputs)
