"""The KDA output gate's GEMV beside the recurrence, in the fused KDA kernel (used by
``lower_kernels`` on our KDA op, either spelling's).

At one row the KDA layer is a 90 MB in-projection, a latency-bound recurrence (about 5 us
on a few dozen SMs) and o_proj. The in-projection's gate rows g2 (P of its rows, 22 MB at
TP8) are read only by the gated norm at the recurrence's end: computed in the KDA kernel
by programs of their own, they stream while the recurrence runs instead of before it.

Matches (T rows; R requests of q tokens, T = R q; P = H D)::

    proj  = mm(x [T, hidden], permute(W [N, hidden]))       (read by the split alone)
    parts = split_with_sizes(proj, sizes, -1);  g2 = parts[i] [T, P]   (read by the op alone)
    out   = auto_functionalized_v2(kimi_kernels.kda_decode[_paged], ..., g2=g2 [or g2[:R]], ...)

and produces::

    proj' = kimi_kernels.skinny_mm(x, W, None, dtype, s, P)    [T, N - P]  (W's rows but [s, s + P))
    parts'= split_with_sizes(proj', sizes without P, -1)      (every other part's readers moved)
    out   = auto_functionalized_v2(..., g2=None, x=x [or x[:R]], g2_weight=W[s:s + P], ...)

with s = sum(sizes[:i]): W read in place by both (a row slice is a view). Taken where
``kda_decode.gate_in_kernel`` says (measured faster, by request count) and where our GEMV
kernels can leave the rows out (``skinny_gemm.gap_supported``, not on cuBLAS); anywhere
else the op keeps g2 and ``bind`` says why.

Invariants: the same values (the op's reference computes g2 = x W_g2^T, on CPU bitwise the
full product's columns; on the GPU a different fp32 summation order before the same
bf16 rounding), the same mutations, the other parts of the projection unchanged.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from kimi_inductor.kernels import kda_decode as kda_kernel
from kimi_inductor.kernels import skinny_gemm

from .gemm_neighbours import match_gemm
from .graph import OpCall

aten, kk = torch.ops.aten, torch.ops.kimi_kernels


@dataclass
class Fold:
    call: OpCall  # our KDA op
    x: fx.Node  # the in-projection's input [T, hidden]
    weight: fx.Node  # its weight [N, hidden]
    split: fx.Node  # split_with_sizes of its output
    index: int  # g2's part
    rows: int | None  # the op's requests' rows of T (g2 cut to them), None: all T

    @property
    def gap(self) -> tuple[int, int]:
        sizes = self.split.args[1]
        return sum(sizes[:self.index]), sizes[self.index]


def bind(call: OpCall) -> Fold | str:
    """The fold for our KDA op ``call``, or why its output gate stays in the projection."""
    g2, rows = call.arg("g2"), None
    if not isinstance(g2, fx.Node):
        return "its g2 is not a graph value"
    if g2.target is aten.slice.Tensor and tuple(g2.args[1:3]) == (0, 0) and len(g2.users) == 1:
        g2, rows = g2.args[0], g2.args[3]  # the requests' rows of the projection's T
    split = g2.args[0] if g2.target is operator.getitem else None
    if split is None or split.target is not aten.split_with_sizes.default or split.args[2] not in (-1, 1):
        return "its g2 is not a column block of the in-projection's output"
    proj = split.args[0]
    gemm = match_gemm(proj)
    if gemm is None or gemm[2] is not None or gemm[3] != gemm[0].meta["val"].dtype or len(proj.users) != 1:
        return "its g2 is not a column block of a plain in-projection GEMM read by that split alone"
    if len(g2.users) != 1:
        return "the in-projection's g2 columns have other readers"
    x, weight = gemm[0], gemm[1]
    fold = Fold(call, x, weight, split, g2.args[1], rows)
    (M, K), N = x.meta["val"].shape, weight.meta["val"].shape[0]
    why = kda_kernel.gate_in_kernel(call.arg("state_slots").meta["val"].shape[0])
    if not why and not weight.meta["val"].is_contiguous():
        why = "the in-projection's weight is a strided view"
    if not why and not isinstance(M, int):
        why = "symbolic rows (the GEMV is compiled per row count)"
    why = why or skinny_gemm.gap_supported(N, *fold.gap)
    if not why:
        impl, why_impl = skinny_gemm.choose(M, N, K, x.meta["val"].dtype, fold.gap)
        why = f"the in-projection runs on cuBLAS here ({why_impl})" if impl == "cublas" else ""
    return why or fold


def lower(g: fx.Graph, fold: Fold) -> fx.Node:
    """The projection without the gate rows, its parts moved, the op computing g2; returns
    the new projection node."""
    start, width = fold.gap
    x, w, old = fold.x, fold.weight, fold.split
    sizes = [n for i, n in enumerate(old.args[1]) if i != fold.index]
    with g.inserting_before(old):
        proj = g.call_function(kk.skinny_mm.default, (x, w, None, x.meta["val"].dtype, start, width))
        proj.meta["val"] = x.meta["val"].new_empty((x.meta["val"].shape[0], w.meta["val"].shape[0] - width))
        split = g.call_function(aten.split_with_sizes.default, (proj, sizes, -1))
        split.meta["val"] = list(torch.split(proj.meta["val"], sizes, -1))
    for part in [u for u in old.users if u.args[1] != fold.index]:
        j = part.args[1] - (part.args[1] > fold.index)
        with g.inserting_before(part):
            new = g.call_function(operator.getitem, (split, j))
        new.meta["val"] = split.meta["val"][j]
        part.replace_all_uses_with(new)
    node = fold.call.node
    with g.inserting_before(node):
        g2_weight = g.call_function(aten.slice.Tensor, (w, 0, start, start + width))
        g2_weight.meta["val"] = w.meta["val"][start:start + width]
        if fold.rows is not None:
            x = g.call_function(aten.slice.Tensor, (x, 0, 0, fold.rows))
            x.meta["val"] = fold.x.meta["val"][:fold.rows]
    node.kwargs = {**node.kwargs, "g2": None, "x": x, "g2_weight": g2_weight}
    return proj
