"""What ``kimi_specialized`` returns for one Dynamo graph, and how it is saved.

Dynamo's AOT compile (``torch.compile(fn).aot_compile(...)``, ``save_compiled_function``,
``torch.compiler.load_compiled_function``; vLLM's default on torch >= 2.10) requires a
backend's result to be a ``SerializableCallable``. ``CompiledGraph`` is ours. It runs the
compiled graph and saves what rebuilds it, not the compiled code:

* the Dynamo graph as the backend received it (``GraphPickler``; per-node module stacks
  dropped), its example inputs as fake tensors (shape, stride, dtype, device; no data),
* the backend options (JSON),
* the user Triton kernels its launches name (``triton_kernel_wrapper_*``: by import
  path, and the launch configs of the single-config autotuner Dynamo wraps around a
  launch given ``num_warps=``; with their constant arguments), re-registered in the
  loading process's kernel side table, the launches' indices rewritten to the new
  entries.

Loading compiles that graph again through ``kimi_specialized`` with the saved options,
when vLLM calls ``finalize_loading`` or else at the first call. Inductor's FX graph cache
and our stored match reports make that a cache hit while the cache directory still holds
them (vLLM points ``TORCHINDUCTOR_CACHE_DIR`` into its AOT cache). vLLM's own backend
saves its graphs the same way. Symbolic sizes (vLLM marks the token count dynamic)
travel with the inputs' shape environment.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import pickle
from typing import Any, Callable

import sympy
import torch
from torch import fx
from torch._dynamo.aot_compile_types import SerializableCallable
from torch._higher_order_ops.triton_kernel_wrap import (
    kernel_side_table,
    triton_kernel_wrapper_functional,
    triton_kernel_wrapper_mutation,
)
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx._graph_pickler import GraphPickler
from torch.fx._graph_pickler import Options as PickleOptions

_LAUNCHES = (triton_kernel_wrapper_mutation, triton_kernel_wrapper_functional)
_DROPPED_META = ("example_value", "nn_module_stack", "source_fn_stack", "fwd_nn_module_stack")


class CompiledGraph(SerializableCallable):
    """``compiled`` (the callable the compile produced) for the Dynamo graph ``graph``
    with ``example_inputs``, compiled with ``options`` (``Options.to_json()``)."""

    def __init__(self, compiled: Callable | None, graph: fx.GraphModule, example_inputs: list,
                 options: str, fake_mode: FakeTensorMode | None = None):
        self.compiled = compiled
        self.graph = graph
        self.example_inputs = example_inputs
        self.options = options
        self._fake_mode = fake_mode  # set when loaded: the mode of the loaded inputs

    @classmethod
    def of(cls, compiled: Callable, gm: fx.GraphModule, example_inputs: list, options: str) -> "CompiledGraph":
        """Keep a copy of ``gm`` taken before the compile (Inductor's pre-grad passes
        rewrite the Dynamo graph in place)."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        fakes = [p.meta.get("example_value", x) for p, x in zip(placeholders, example_inputs)]
        return cls(compiled, copy_graph(gm), fakes, options)

    def __call__(self, *args: Any) -> Any:
        if self.compiled is None:
            self.finalize_loading()
        return self.compiled(*args)

    def finalize_loading(self, vllm_config: Any = None) -> None:
        """Compile the loaded graph (vLLM calls this right after loading)."""
        from torch._guards import TracingContext, tracing

        from .backend import KimiSpecialized
        from .config import Options

        if self.compiled is not None:
            return
        backend = KimiSpecialized.for_options(Options.from_mapping(json.loads(self.options)))
        with tracing(TracingContext(self._fake_mode)):
            self.compiled = backend(self.graph, list(self.example_inputs)).compiled

    @classmethod
    def serialize_compile_artifacts(cls, fn: "CompiledGraph") -> bytes:
        kernels, constants = {}, {}
        for node in _launches(fn.graph):
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            kernels[node.kwargs["kernel_idx"]] = _describe(kernel)
            constants[node.kwargs["constant_args_idx"]] = kernel_side_table.get_constant_args(
                node.kwargs["constant_args_idx"])
        for module in fn.graph.modules():
            if isinstance(module, fx.GraphModule):
                for node in module.graph.nodes:
                    for key in _DROPPED_META:
                        node.meta.pop(key, None)
        state = {
            "graph": _Pickler.dumps(fn.graph, PickleOptions(ops_filter=None)),
            "example_inputs": _Pickler.dumps(_as_fake(fn.example_inputs)),
            "options": fn.options,
            "kernels": kernels,
            "constant_args": constants,
        }
        return pickle.dumps(state)

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> "CompiledGraph":
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        importlib.import_module(f"{__package__}.kernels")  # registers the kimi_kernels:: ops a saved graph names
        state = pickle.loads(data)
        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
        inputs = GraphPickler.loads(state["example_inputs"], fake_mode)  # first: it fills the shape environment
        graph = GraphPickler.loads(state["graph"], fake_mode)
        kernel_idx = {old: kernel_side_table.add_kernel(_rebuild(*kernel)) for old, kernel in state["kernels"].items()}
        constant_idx = {old: kernel_side_table.add_constant_args(args)
                        for old, args in state["constant_args"].items()}
        for node in _launches(graph):
            node.kwargs = {**node.kwargs, "kernel_idx": kernel_idx[node.kwargs["kernel_idx"]],
                           "constant_args_idx": constant_idx[node.kwargs["constant_args_idx"]]}
        graph.recompile()
        return cls(None, graph, inputs, state["options"], fake_mode)


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule with a copy of ``gm``'s graph (its attributes shared)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


class _Pickler(GraphPickler):
    """``GraphPickler`` that also drops the fake mode from the description of a view's
    base (torch 2.13 drops it from the view's own description only, and a fake mode does
    not pickle: every example input that is a view failed), and pickles the torch sympy
    functions of symbolic sizes by name."""

    def reducer_override(self, obj: object) -> Any:
        if isinstance(obj, type) and issubclass(obj, sympy.Function) and hasattr(obj, "_torch_unpickler"):
            return obj._torch_unpickler, (obj._torch_handler_name,)  # a shape expression's torch function
        reduced = super().reducer_override(obj)
        if isinstance(obj, FakeTensor):
            data = reduced[1][0]
            if data.metadata.base is not None:
                data.metadata = dataclasses.replace(
                    data.metadata, base=dataclasses.replace(data.metadata.base, fake_mode=None))
        return reduced


def _launches(gm: fx.GraphModule):
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            yield from (n for n in module.graph.nodes if n.op == "call_function" and n.target in _LAUNCHES)


def _as_fake(inputs: list) -> list:
    """Example inputs as fake tensors (Dynamo's own, with their symbolic sizes, where the
    graph's placeholders hold them; real ones described by shape, stride, dtype, device)."""
    mode = FakeTensorMode()
    return [mode.from_tensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) else x
            for x in inputs]


def _describe(kernel: Any) -> tuple[tuple[str, str, int], list | None]:
    """A Triton kernel as (import path, autotune configs): where it is importable
    (configs None), or, for the single-config ``Autotuner`` Dynamo wraps around
    a kernel launched with ``num_warps=`` and the like, the wrapped kernel's path and
    those configs."""
    from triton.runtime.autotuner import Autotuner

    path = _import_path(kernel)
    if path is not None:
        return path, None
    if isinstance(kernel, Autotuner) and not (kernel.perf_model or kernel.early_config_prune):
        path = _import_path(kernel.fn)
        if path is not None:
            return path, [copy.copy(c) for c in kernel.configs]
    fn = getattr(kernel, "fn", kernel)
    raise ValueError(f"cannot save the Triton kernel {getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', fn)} "
                     f"({type(kernel).__name__}): it is not importable as a module attribute; define it at module level")


def _rebuild(path: tuple[str, str, int], configs: list | None) -> Any:
    import triton

    kernel = _import(path)
    return kernel if configs is None else triton.autotune(configs=configs, key=[])(kernel)


def _import_path(kernel: Any) -> tuple[str, str, int] | None:
    """``(module, qualified name, depth)``: ``kernel`` is the attribute ``name`` unwrapped
    ``depth`` times through ``.fn`` (``@triton.heuristics`` around ``@triton.jit``: Dynamo
    folds the heuristics into its configs and launches the inner ``JITFunction``)."""
    fn = kernel
    while not hasattr(fn, "__code__") and hasattr(fn, "fn"):
        fn = fn.fn
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if module is None or name is None or "<locals>" in name:
        return None
    attr = _import((module, name, 0))
    for depth in range(8):
        if attr is kernel:
            return module, name, depth
        attr = getattr(attr, "fn", None)
    return None


def _import(path: tuple[str, str, int]) -> Any:
    module, name, depth = path
    attr = importlib.import_module(module)
    for part in name.split("."):  # a qualified name: a kernel may be a class attribute
        attr = getattr(attr, part, None)
    for _ in range(depth):
        attr = getattr(attr, "fn", None)
    return attr
