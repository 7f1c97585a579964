"""byte_pages: typed views of byte pages spelt so that Inductor compiles them right.

vLLM binds a KDA layer's cache as one int8 page per slot and hands its kernels typed
states as dtype views of byte slices of the page; functionalized, a step reads and
writes back (x: int8 [S, B], a state of dtype t, r = t.itemsize, byte range [a, b))::

    before                                         after
    s = view.dtype(slice(x, -1, a, b), t)          s = slice(view.dtype(x, t), -1, a/r, b/r)
    x' = slice_scatter(x, view.dtype(y, int8),     x' = view.dtype(slice_scatter(view.dtype(x, t),
                       -1, a, b)                                    y, -1, a/r, b/r), int8)

Inductor (torch 2.11-2.13) miscompiles a mutation through the left-hand spelling: the
mutated state is rebuilt in a fresh buffer with the page's row stride and the slice's
storage offset, so the kernel's writes land outside it (docs/vllm.md, "Numerics";
on the H200 471 of 1024 bytes of a page differ, ``benchmarks/vllm_inductor_bisect.py``).
The right-hand spelling, the one functionalization itself produces for a slice of a
typed view, compiles exactly. ``lower_kernels`` replaces vLLM's KDA groups with our
op, which takes the page whole; this pass covers the groups it keeps (and any other
kernel bound the same way).

Invariants. Relies on ``meta["val"]``. Rewrites only where the identity is exact:
the slice is along the last dim of a byte tensor whose last dim is contiguous, a, b
and the row length are multiples of r, and every other stride too. Establishes: the
same values (each rewrite is an identity of views), no ``view.dtype`` of a byte slice
left where those conditions hold. Order: last (after ``lower_kernels``, whose vLLM
KDA matcher reads the page in vLLM's spelling).
"""

from __future__ import annotations

import torch
from torch import fx

from .graph import erase_unused
from .report import PassInfo

aten = torch.ops.aten
BYTES = (torch.int8, torch.uint8)


def _typed_range(page, dim, start, end, step, dtype: torch.dtype) -> tuple[int, int] | None:
    """[start / r, end / r) when ``slice(page, dim, start, end, step)`` viewed as
    ``dtype`` (r = its itemsize) is that slice of ``page`` viewed as ``dtype``, else None
    (``start`` / ``end`` None: the slice's defaults)."""
    val = page.meta.get("val") if isinstance(page, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dtype not in BYTES or val.dim() == 0:
        return None
    r, shape, stride = dtype.itemsize, val.shape, val.stride()
    start, end = start or 0, shape[-1] if end is None else end
    if r < 2 or step != 1 or dim not in (-1, val.dim() - 1) or stride[-1] != 1:
        return None
    if not all(isinstance(v, int) for v in (start, end, shape[-1], *stride[:-1])):
        return None
    end = min(end, shape[-1])
    if start % r or end % r or shape[-1] % r or not 0 <= start <= end or any(s % r for s in stride[:-1]):
        return None
    return start // r, end // r


class BytePages:
    name = "byte_pages"

    def __call__(self, gm: fx.GraphModule, ctx) -> PassInfo:
        info, g = PassInfo(self.name), gm.graph
        for node in list(g.nodes):
            if node.op != "call_function":
                continue
            if node.target is aten.view.dtype and _is_slice(node.args[0]) and node.args[1] not in BYTES:
                (page, dim, *bounds), dtype = _args(node.args[0], 1), node.args[1]  # a read
            elif node.target is aten.slice_scatter.default and _is_typed_bytes(node.args[1]):
                (page, src, dim, *bounds) = _args(node, 2)  # a write: src = view.dtype(y, int8)
                dtype = src.args[0].meta["val"].dtype
            else:
                continue
            info.matched += 1
            typed_range = _typed_range(page, dim, *bounds, dtype)
            if typed_range is None:
                info.skipped.append(f"{node.name}: not a whole-element slice of a contiguous byte page")
                continue
            with g.inserting_before(node):
                typed = g.call_function(aten.view.dtype, (page, dtype))
                if node.target is aten.view.dtype:
                    new = g.call_function(aten.slice.Tensor, (typed, dim, *typed_range))
                else:
                    scattered = g.call_function(aten.slice_scatter.default, (typed, src.args[0], dim, *typed_range))
                    new = g.call_function(aten.view.dtype, (scattered, page.meta["val"].dtype))
            new.meta["val"] = node.meta["val"]  # at once: a later match reads the page it produces
            node.replace_all_uses_with(new)
            erase_unused(g, [node])
            info.rewritten += 1
        return info


def _args(node: fx.Node, tensors: int) -> list:
    """``node``'s ``tensors`` tensor args, then dim, start, end, step with the slice's
    defaults (0, None, None, 1)."""
    return (list(node.args) + [0, None, None, 1][len(node.args) - tensors:])[:tensors + 4]


def _is_slice(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is aten.slice.Tensor


def _is_typed_bytes(node) -> bool:
    """``view.dtype(y, byte dtype)`` of a non-byte ``y``."""
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target is aten.view.dtype
            and node.args[1] in BYTES and isinstance(node.args[0], fx.Node)
            and node.args[0].meta.get("val") is not None and node.args[0].meta["val"].dtype not in BYTES)
