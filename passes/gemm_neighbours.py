"""A linear layer's GEMM, the RMSNorm before one and the SiTU-GLU after one, as post-grad
(aten) patterns.

Inductor pattern-matcher patterns of stock's functions as AOTAutograd decomposes them
(``stock.attn_res.rms_norm``, ``stock.layers.situ_and_mul``), and a spelling's RMSNorm op
and SiTU op (``roles.rms_norm`` / ``roles.situ``: vLLM's ``vllm_ir.rms_norm``,
``_C.situ_and_mul``); ``lower_kernels`` fuses a matched pair
into one CuTe GEMV (``kimi_kernels.rms_norm_mm`` / ``mm_situ``).

    rms_norm(x, w, eps)   mul(bf16(mul(xf, rsqrt(add(mean(pow(xf, 2), [-1], True), eps)))), w)
                          with xf = f32(x)
    situ_and_mul(h, b, l) dt(mul(mul(mul(tanh(div(g, b)), b), sigmoid(g)), mul(tanh(div(u, l)), l)))
                          with g = f32(h[:, :d]), u = f32(h[:, d:]) (or g, u = f32(gate), f32(up):
                          sharded_moe's two row-block GEMMs, ``situ_pair_of``)
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2
from torch._inductor.pattern_matcher import CallFunction, KeywordArg, Match

from . import roles

aten, prims = torch.ops.aten, torch.ops.prims


def _weight(node) -> fx.Node | None:
    """W when ``node`` is ``permute(W, [1, 0])`` (the transposed view linear uses)."""
    if isinstance(node, fx.Node) and node.target is aten.permute.default and list(node.args[1]) == [1, 0]:
        return node.args[0]
    return None


def _source(node, dtype: torch.dtype):
    """x when ``node`` is ``convert_element_type(x, dtype)``."""
    if isinstance(node, fx.Node) and node.target is prims.convert_element_type.default and node.args[1] == dtype:
        return node.args[0]
    return None


def match_gemm(node: fx.Node):
    """(x, W, acc, out_dtype) for a linear layer's GEMM, else None."""
    if node.op != "call_function":
        return None
    if node.target is aten.mm.default:
        x, wt = node.args
        w = _weight(wt)
        xs, ws = _source(x, torch.float32), _source(w, torch.float32)
        if xs is not None and ws is not None:  # bf16 operands, fp32 logits (the router on CPU)
            return xs, ws, None, torch.float32
        if w is not None:
            return x, w, None, node.meta["val"].dtype
    if node.target is aten.addmm.default and len(node.args) == 3 and not node.kwargs:
        acc, x, wt = node.args
        w = _weight(wt)
        if w is not None:
            return x, w, acc, node.meta["val"].dtype
    if node.target is aten.mm.dtype:
        x, wt, out_dtype = node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs["out_dtype"]
        w = _weight(wt)
        if w is not None:
            return x, w, None, out_dtype
    return None


def _f32(inner, users: int = 1):
    return CallFunction(prims.convert_element_type.default, inner, torch.float32, _users=users)


_xf = _f32(KeywordArg("x"), users=2)
_rstd = CallFunction(aten.rsqrt.default, CallFunction(aten.add.Tensor, CallFunction(
    aten.mean.dim, CallFunction(aten.pow.Tensor_Scalar, _xf, 2), [-1], True), KeywordArg("eps")))
RMS_NORM = CallFunction(aten.mul.Tensor, CallFunction(prims.convert_element_type.default, CallFunction(
    aten.mul.Tensor, _xf, _rstd), KeywordArg("dtype")), KeywordArg("norm_weight"))



def _situ(gate, up):
    """SiTU-GLU of the (bf16) gate and up patterns."""
    g, u = _f32(gate, users=2), _f32(up)
    act = CallFunction(aten.mul.Tensor, CallFunction(aten.mul.Tensor, CallFunction(aten.tanh.default, CallFunction(
        aten.div.Tensor, g, KeywordArg("beta"))), KeywordArg("beta_out")), CallFunction(aten.sigmoid.default, g))
    linear = CallFunction(aten.mul.Tensor, CallFunction(aten.tanh.default, CallFunction(
        aten.div.Tensor, u, KeywordArg("linear_beta"))), KeywordArg("linear_beta_out"))
    return CallFunction(prims.convert_element_type.default, CallFunction(aten.mul.Tensor, act, linear),
                        KeywordArg("dtype"))


SITU = _situ(CallFunction(aten.slice.Tensor, KeywordArg("gate_of"), 1, 0, KeywordArg("d")),
             CallFunction(aten.slice.Tensor, KeywordArg("up_of"), 1, KeywordArg("d_up"), KeywordArg("end")))
SITU_PAIR = _situ(KeywordArg("gate"), KeywordArg("up"))  # gate and up from two GEMMs (sharded_moe's blocks)
OUTPUT_GATE = CallFunction(prims.convert_element_type.default, CallFunction(
    aten.mul.Tensor, _f32(KeywordArg("x")), CallFunction(aten.sigmoid.default, _f32(KeywordArg("gate")))),
    KeywordArg("dtype"))


def _bind(pattern, node) -> dict[str, Any] | None:
    if not isinstance(node, fx.Node):
        return None
    m = pattern.match(node)
    return m.kwargs if isinstance(m, Match) else None


def rms_norm_of(node) -> tuple[fx.Node, fx.Node, float] | None:
    """(x, norm_weight, eps) when ``node`` is stock's RMSNorm of x (the aten pattern, or a
    spelling's RMSNorm op: ``roles.rms_norm``) and the GEMM is its only reader; else None."""
    if not isinstance(node, fx.Node) or len(node.users) != 1:
        return None
    spelled = roles.rms_norm(node)
    if spelled is not None:
        return spelled
    kw = _bind(RMS_NORM, node)
    if kw is None or kw["dtype"] != kw["x"].meta["val"].dtype or not isinstance(kw["eps"], (int, float)):
        return None  # (a traced eps: a symbolic graph's arithmetic)
    return kw["x"], kw["norm_weight"], float(kw["eps"])


def situ_of(node) -> tuple[fx.Node, float, float] | None:
    """(h, beta, linear_beta) when ``node`` is stock's SiTU-GLU of h [M, 2 d], halves [:d]
    and [d:] of the same h, which nothing else reads (the aten pattern, or a spelling's
    SiTU op: ``roles.situ``); else None."""
    if isinstance(node, fx.Node) and (spelled := roles.situ(node)) is not None:
        return spelled
    kw = _bind(SITU, node)
    if kw is None:
        return None
    h = kw["gate_of"]
    width = h.meta["val"].shape[1]
    if (kw["up_of"] is not h or len(h.users) != 2 or 2 * kw["d"] != width or kw["d_up"] != kw["d"]
            or kw["end"] < width or kw["beta"] != kw["beta_out"] or kw["linear_beta"] != kw["linear_beta_out"]
            or kw["dtype"] != h.meta["val"].dtype):
        return None
    return h, float(kw["beta"]), float(kw["linear_beta"])


def situ_pair_of(node) -> tuple[fx.Node, fx.Node, float, float] | None:
    """(gate, up, beta, linear_beta) when ``node`` is stock's SiTU-GLU of two separate bf16
    tensors gate and up of one shape (``sharded_moe``'s gate and up row blocks); else None."""
    kw = _bind(SITU_PAIR, node)
    if kw is None or kw["beta"] != kw["beta_out"] or kw["linear_beta"] != kw["linear_beta_out"]:
        return None
    gate, up = kw["gate"], kw["up"]
    vals = [n.meta["val"] for n in (gate, up)]
    if vals[0].shape != vals[1].shape or not all(v.dtype == kw["dtype"] for v in vals):
        return None
    return gate, up, float(kw["beta"]), float(kw["linear_beta"])


def gated_heads_of(node) -> tuple[fx.Node, fx.Node] | None:
    """(bmm, gate) when ``node`` is stock's MLA output gate (``stock.mla.output_gate``) of a
    per-head GEMM's output laid out as [M, B N] (``bmm(x, W)`` [B, M, N] permuted to
    [M, B, N], copied if need be, reshaped), each step read by the next alone; else None."""
    kw = _bind(OUTPUT_GATE, node)
    if kw is None:
        return None
    chain = kw["x"]
    if chain.target not in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        return None
    perm = chain.args[0]
    if perm.target is aten.clone.default:
        perm = perm.args[0]
    bmm = perm.args[0] if perm.target is aten.permute.default and list(perm.args[1]) == [1, 0, 2] else None
    if bmm is None or bmm.target is not aten.bmm.default:
        return None
    B, M, N = bmm.meta["val"].shape
    steps = [bmm, perm, *([chain.args[0]] if chain.args[0] is not perm else []), chain]
    if (any(len(n.users) != 1 for n in steps) or tuple(chain.meta["val"].shape) != (M, B * N)
            or kw["dtype"] != bmm.meta["val"].dtype or tuple(kw["gate"].meta["val"].shape) != (M, B * N)):
        return None
    return bmm, kw["gate"]


def mla_output_of(x: fx.Node) -> fx.Node | None:
    """The wrapped ``kimi_kernels.mla_decode`` call when ``x`` is its output [T, N, L] with
    the heads first ([N, T, L]: a permute or transpose) and the view its one reader; else None."""
    if len(x.users) != 1 or not ((x.target is aten.permute.default and list(x.args[1]) == [1, 0, 2])
                                 or (x.target is aten.transpose.int and sorted(x.args[1:]) == [0, 1])):
        return None
    item = x.args[0]
    if item.target is not operator.getitem or item.args[1] != 0 or len(item.users) != 1:
        return None
    core = item.args[0]
    if core.target is not auto_functionalized_v2 or core.args[0] is not torch.ops.kimi_kernels.mla_decode.default:
        return None
    return core
