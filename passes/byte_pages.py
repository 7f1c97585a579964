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


def _ratio(page: fx.Node, dim, start, end, dtype: torch.dtype) -> int:
    """r when ``slice(page, dim, start, end)`` viewed as ``dtype`` is the slice
    [start / r, end / r) of ``page`` viewed as ``dtype``, else 0."""
    val = page.meta.get("val") if isinstance(page, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dtype not in BYTES or val.dim() == 0:
        return 0
    r = dtype.itemsize
    shape, stride = val.shape, val.stride()
    if r < 2 or dim not in (-1, val.dim() - 1) or stride[-1] != 1:
        return 0
    if not all(isinstance(v, int) for v in (start, end, shape[-1], *stride[:-1])):
        return 0
    end = min(end, shape[-1])
    return r if start % r == end % r == shape[-1] % r == 0 and 0 <= start <= end and all(s % r == 0 for s in stride[:-1]) else 0


class BytePages:
    name = "byte_pages"

    def __call__(self, gm: fx.GraphModule, ctx) -> PassInfo:
        info, g = PassInfo(self.name), gm.graph
        for node in list(g.nodes):
            if node.op != "call_function":
                continue
            if node.target is aten.view.dtype and _is_slice(node.args[0]) and node.args[1] not in BYTES:
                page, dim, start, end, step = _slice_args(node.args[0])
                info.matched += 1
                r = _ratio(page, dim, start, end, node.args[1])
                if not r or step != 1:
                    info.skipped.append(f"{node.name}: not a whole-element slice of a contiguous byte page")
                    continue
                with g.inserting_before(node):
                    typed = g.call_function(aten.view.dtype, (page, node.args[1]))
                    new = g.call_function(aten.slice.Tensor, (typed, dim, start // r, min(end, _len(page)) // r))
                _replace(g, node, new)
                info.rewritten += 1
            elif node.target is aten.slice_scatter.default and _is_typed_bytes(node.args[1]):
                page, src = node.args[0], node.args[1].args[0]
                dim, start, end, step = (list(node.args[2:]) + [0, None, None, 1][len(node.args) - 2:])[:4]
                start, info.matched = start or 0, info.matched + 1
                dtype = src.meta["val"].dtype
                r = _ratio(page, dim, start, end if end is not None else _len(page), dtype)
                if not r or step != 1:
                    info.skipped.append(f"{node.name}: not a whole-element slice of a contiguous byte page")
                    continue
                end = min(end if end is not None else _len(page), _len(page))
                with g.inserting_before(node):
                    typed = g.call_function(aten.view.dtype, (page, dtype))
                    scattered = g.call_function(aten.slice_scatter.default, (typed, src, dim, start // r, end // r))
                    new = g.call_function(aten.view.dtype, (scattered, page.meta["val"].dtype))
                _replace(g, node, new)
                info.rewritten += 1
        return info


def _replace(g: fx.Graph, node: fx.Node, new: fx.Node) -> None:
    """``new`` (the same view, re-spelt) in place of ``node``; it takes ``node``'s value
    at once, since a later match reads the page it produces."""
    new.meta["val"] = node.meta["val"]
    node.replace_all_uses_with(new)
    erase_unused(g, [node])


def _is_slice(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is aten.slice.Tensor


def _slice_args(node: fx.Node):
    """(input, dim, start, end, step) of ``aten.slice.Tensor`` with its defaults."""
    x, dim, start, end, step = (list(node.args) + [0, None, None, 1][len(node.args) - 1:])[:5]
    return x, dim, start or 0, end if end is not None else _len(x), step


def _len(node: fx.Node):
    return node.meta["val"].shape[-1]


def _is_typed_bytes(node) -> bool:
    """``view.dtype(y, byte dtype)`` of a non-byte ``y``."""
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target is aten.view.dtype
            and node.args[1] in BYTES and isinstance(node.args[0], fx.Node)
            and node.args[0].meta.get("val") is not None and node.args[0].meta["val"].dtype not in BYTES)
