"""A graph with a symbolic batch, compiled again with static rows at each capture size.

vLLM's compilation modes 1 and 2 hand ``kimi_specialized`` one Dynamo graph for every
batch size (it marks the token count T dynamic), but what the passes do depends on T:
``decode.capture_sizes`` (vLLM's CUDA-graph sizes in a deployment) gates every pass, and
``sharded_moe`` and the kernel choices of ``lower_kernels`` are made by row count. So
the backend compiles that graph once as it is (symbolic T: what runs at every size
outside the capture sizes, e.g. prefill) and returns ``BySize``, which on the first call
at each capture size compiles the graph again with that call's arguments as the example
inputs (static shapes: the passes see an int T) and runs that compile at this size from
then on, as vLLM's own backend does for its ``compile_sizes``. vLLM's warmup calls every
capture size before it captures; a first call inside CUDA-graph capture raises.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def row_argument(example_inputs: list, rows: str) -> tuple[int, int | None] | None:
    """Where the symbol ``rows`` (the step's T, as the passes report it) arrives in the
    graph's arguments: ``(i, None)``, argument i is T; ``(i, d)``, dimension d of tensor
    argument i is T; None: nowhere."""
    def named(size: Any) -> bool:
        return isinstance(size, torch.SymInt) and str(size.node.expr) == rows

    for i, x in enumerate(example_inputs):
        if named(x):
            return i, None
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor) and any(named(s) for s in x.shape):
            return i, next(d for d, s in enumerate(x.shape) if named(s))
    return None


def static_inputs(args: list) -> list:
    """``args`` as example inputs with static shapes: fake tensors of a new mode (real
    tensors would be given symbolic sizes again; its shape environment is for the
    graph's data-dependent scalars), other values as they are."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    return [mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a for a in args]


class BySize:
    """``generic`` (the symbolic compile) at every T outside ``sizes``; at T in ``sizes``,
    ``compile_static(inputs)`` of the first call's arguments (``static_inputs``), kept for that T."""

    def __init__(self, generic: Callable, compile_static: Callable[[list], Callable],
                 where: tuple[int, int | None], sizes: tuple[int, ...]):
        self.generic, self.compile_static, self.where, self.sizes = generic, compile_static, where, set(sizes)
        self.static: dict[int, Callable] = {}

    def rows(self, args: tuple) -> int:
        i, d = self.where
        return int(args[i] if d is None else args[i].shape[d])

    def __call__(self, *args: Any) -> Any:
        rows = self.rows(args)
        if rows not in self.sizes:
            return self.generic(*args)
        compiled = self.static.get(rows)
        if compiled is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"kimi_specialized compiles the {rows}-row graph on its first call at that size, "
                                   "which must come before CUDA-graph capture (vLLM's warmup runs every capture "
                                   "size first)")
            compiled = self.static[rows] = self.compile_static(static_inputs(list(args)))
        return compiled(*args)
