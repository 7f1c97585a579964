"""Registration of the stock decoder's opaque ops (namespace ``kimi``).

Where vLLM's graph holds an opaque op (a user Triton kernel, a CUDA extension op, a
pybind call) the replica holds a ``torch.library`` custom op, so that a captured
graph has the op-level shape our passes match. Each op has one semantics: its
reference, written in plain torch, which is also its implementation on every
device. ``REFERENCES`` maps each op to that reference so a baseline compiler can
trace through the stock math instead of stopping at the op.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

NAMESPACE = "kimi"
REFERENCES: dict[torch._ops.OpOverload, Callable] = {}


def stock_op(name: str, mutates_args: Iterable[str], fake: Callable):
    """Register ``fn`` as ``kimi::<name>`` (all devices) with ``fake`` for tracing."""

    def register(fn: Callable):
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", fn, mutates_args=tuple(mutates_args))
        op.register_fake(fake)
        REFERENCES[getattr(torch.ops.kimi, name).default] = fn
        return op

    return register
