"""FX helpers for the post-grad (functionalized, aten-level) decoder graph.

Ops with mutable arguments appear there wrapped: ``auto_functionalized_v2(op,
_all_bases=[...], _<arg>_base_index=i, [view info], **other_args)`` returning
``(output, *updated_bases)`` (or ``auto_functionalized(op, **args)`` returning
``(output, *updated_args)`` with v1). ``OpCall`` reads any of the three spellings
(plain call, v1, v2) so that passes can ask for "the op and its arguments".

A user Triton kernel launched from Python (vLLM's AttnRes, KDA and conv kernels) is
``triton_kernel_wrapper_functional(kernel_idx, constant_args_idx, grid, ..., kwargs,
tensors_to_clone)`` returning ``{name: new value}`` of every tensor it may write;
``TritonCall`` reads it: its kernel, tensor and constant arguments by name, its grid.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_v2
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table, triton_kernel_wrapper_functional

_VIEW_KEYS = ("size", "stride", "storage_offset", "slice_dim", "slice_start", "slice_end", "alias")


@dataclass
class OpCall:
    """One call of ``op`` in the graph, in any spelling."""

    node: fx.Node
    op: torch._ops.OpOverload

    @staticmethod
    def of(node: fx.Node) -> "OpCall | None":
        if node.op != "call_function":
            return None
        if node.target in (auto_functionalized, auto_functionalized_v2):
            return OpCall(node, node.args[0])
        if isinstance(node.target, torch._ops.OpOverload):
            return OpCall(node, node.target)
        return None

    @property
    def wrapped(self) -> bool:
        return self.node.target in (auto_functionalized, auto_functionalized_v2)

    def arg(self, name: str) -> Any:
        """The argument ``name``: a node, a constant, or, for a v2 mutable argument,
        its base node (``view(name)`` says whether it is a view of that base)."""
        node = self.node
        if node.target is auto_functionalized_v2 and f"_{name}_base_index" in node.kwargs:
            return node.kwargs["_all_bases"][node.kwargs[f"_{name}_base_index"]]
        if self.wrapped:
            return node.kwargs[name]
        schema = self.op._schema
        for i, a in enumerate(schema.arguments):
            if a.name == name:
                if name in node.kwargs:
                    return node.kwargs[name]
                return node.args[i] if i < len(node.args) else a.default_value
        raise KeyError(name)

    def view(self, name: str) -> dict[str, Any]:
        """v2 view information of mutable argument ``name`` ({} when it is the base)."""
        if self.node.target is not auto_functionalized_v2:
            return {}
        return {k: self.node.kwargs[f"_{name}_{k}"] for k in _VIEW_KEYS if f"_{name}_{k}" in self.node.kwargs}

    def output(self, index: int = 0) -> fx.Node | None:
        """The node holding result ``index`` (for wrapped calls: the ``getitem``)."""
        if not self.wrapped:
            return self.node if index == 0 else None
        for user in self.node.users:
            if user.target is operator.getitem and user.args[1] == index:
                return user
        return None

    def mutated_output(self, name: str) -> fx.Node | None:
        """The node holding the new value of mutable argument ``name``."""
        node = self.node
        if node.target is auto_functionalized_v2:
            return self.output(1 + node.kwargs[f"_{name}_base_index"])
        if node.target is auto_functionalized:
            mutable = [a.name for a in self.op._schema.arguments if a.alias_info and a.alias_info.is_write]
            return self.output(1 + mutable.index(name))
        return None

    def set_arg(self, name: str, value: Any, drop_view: bool = False) -> None:
        """Replace argument ``name``; for a v2 base, ``drop_view`` makes the new
        value the argument itself rather than a view of it."""
        node = self.node
        kwargs = dict(node.kwargs)
        if node.target is auto_functionalized_v2 and f"_{name}_base_index" in kwargs:
            bases = list(kwargs["_all_bases"])
            bases[kwargs[f"_{name}_base_index"]] = value
            kwargs["_all_bases"] = bases
            if drop_view:
                for k in _VIEW_KEYS:
                    kwargs.pop(f"_{name}_{k}", None)
        elif self.wrapped or name in kwargs:
            kwargs[name] = value
        else:
            args = list(node.args)
            index = [a.name for a in self.op._schema.arguments].index(name)
            args[index] = value
            node.args = tuple(args)
        node.kwargs = kwargs


@dataclass
class TritonCall:
    """One functional launch of a user Triton kernel."""

    node: fx.Node

    @staticmethod
    def of(node: fx.Node) -> "TritonCall | None":
        if node.op == "call_function" and node.target is triton_kernel_wrapper_functional:
            return TritonCall(node)
        return None

    @property
    def name(self) -> str:
        """``module.function`` of the kernel's Python source (under its ``triton.jit``,
        autotuner and heuristics wrappers)."""
        fn = kernel_side_table.get_kernel(self.node.kwargs["kernel_idx"])
        while hasattr(fn, "fn"):
            fn = fn.fn
        return f"{fn.__module__}.{fn.__name__}"

    @property
    def constants(self) -> dict[str, Any]:
        return kernel_side_table.get_constant_args(self.node.kwargs["constant_args_idx"])

    def arg(self, name: str, default: Any = None) -> Any:
        """A tensor argument (node), else a constant one, else ``default``."""
        tensors = self.node.kwargs["kwargs"]
        return tensors[name] if name in tensors else self.constants.get(name, default)

    def output(self, name: str) -> fx.Node | None:
        """The node holding the value of tensor argument ``name`` after the launch."""
        for user in self.node.users:
            if user.target is operator.getitem and user.args[1] == name:
                return user
        return None

    def set_arg(self, name: str, value: fx.Node) -> None:
        kwargs = dict(self.node.kwargs)
        kwargs["kwargs"] = {**kwargs["kwargs"], name: value}
        self.node.kwargs = kwargs

    @property
    def grid(self) -> list:
        return self.node.kwargs["grid"]

    def set_grid(self, grid: list) -> None:
        self.node.kwargs = {**self.node.kwargs, "grid": grid}


def calls(graph: fx.Graph, ops: Iterable[torch._ops.OpOverload]) -> list[OpCall]:
    """Every call of ``ops``, in graph order."""
    wanted = set(ops)
    out = []
    for node in graph.nodes:
        call = OpCall.of(node)
        if call is not None and call.op in wanted:
            out.append(call)
    return out


def ancestors(node: fx.Node, stop: set[fx.Node] = frozenset()) -> set[fx.Node]:
    """Every node ``node`` depends on, not looking past ``stop``."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        for arg in n.all_input_nodes:
            if arg not in seen and arg not in stop:
                seen.add(arg)
                todo.append(arg)
    return seen


def erase_unused(g: fx.Graph, nodes: list[fx.Node], follow: Callable[[fx.Node], bool] = lambda n: True) -> None:
    """Erase each of ``nodes`` once nothing reads it, then, transitively, the producers of
    an erased node that ``follow`` accepts and nothing reads any more (never a graph input)."""
    pending = [n for n in dict.fromkeys(nodes) if n.graph is g and n.op == "call_function"]
    changed = True
    while changed:
        changed = False
        for n in list(pending):
            if n.users:
                continue
            pending.remove(n)
            inputs = n.all_input_nodes
            g.erase_node(n)
            pending += [i for i in inputs if i.op == "call_function" and i not in pending and follow(i)]
            changed = True


class MetaUpdater:
    """Keeps ``meta["val"]`` right while passes rewrite a graph: Inductor's
    ``FakeTensorUpdater`` re-propagates fake values from the nodes a pass changed or
    added, and the ``eager_input_vals`` Inductor keeps for wrapped custom ops follow
    their nodes' current arguments. Create it before the first rewrite."""

    def __init__(self, gm: fx.GraphModule):
        from torch._inductor.fx_utils import FakeTensorUpdater

        self.gm, self.updater = gm, FakeTensorUpdater(_updater_arg(FakeTensorUpdater, gm))

    def update(self) -> int:
        from torch._guards import detect_fake_mode
        from torch._inductor.virtualized import V

        nodes = self.gm.graph.nodes
        # FakeTensorUpdater compares dict results by their keys only, so it would keep a
        # Triton launch's old outputs: re-run every launch and its getitems.
        processed = self.updater.processed_hashes
        for node in nodes:
            if node.target is triton_kernel_wrapper_functional:
                node.meta.pop("val", None)
                for n in (node, *node.users):
                    processed.discard(self.updater.hash_node(n))
        mode = detect_fake_mode([n.meta.get("val") for n in nodes if n.op == "placeholder"])
        with V.set_fake_mode(mode):
            updated = self.updater.incremental_update()
        for node in nodes:
            if "eager_input_vals" in node.meta:
                node.meta["eager_input_vals"] = fx.map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
        return updated


def _updater_arg(updater: type, gm: fx.GraphModule):
    """What ``FakeTensorUpdater`` takes: the GraphModule (torch >= 2.12) or its graph
    (torch 2.11, what the H200 machines run)."""
    params = list(inspect.signature(updater.__init__).parameters)
    return gm.graph if params[1:2] == ["graph"] else gm


def op_name(node: fx.Node) -> str:
    call = OpCall.of(node)
    if call is not None:
        return f"{call.op._schema.name.replace('::', '.')}"
    return str(node.target)
