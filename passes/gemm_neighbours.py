"""The RMSNorm before a GEMM and the SiTU-GLU after one, as post-grad (aten) patterns.

Inductor pattern-matcher patterns of stock's functions as AOTAutograd decomposes them
(``stock.attn_res.rms_norm``, ``stock.layers.situ_and_mul``), and a spelling's RMSNorm op
and SiTU op (``roles.rms_norm`` / ``roles.situ``: vLLM's ``vllm_ir.rms_norm``,
``_C.situ_and_mul``); ``lower_kernels`` fuses a matched pair
into one CuTe GEMV (``kimi_kernels.rms_norm_mm`` / ``mm_situ``).

    rms_norm(x, w, eps)   mul(bf16(mul(xf, rsqrt(add(mean(pow(xf, 2), [-1], True), eps)))), w)
                          with xf = f32(x)
    situ_and_mul(h, b, l) dt(mul(mul(mul(tanh(div(g, b)), b), sigmoid(g)), mul(tanh(div(u, l)), l)))
                          with g = f32(h[:, :d]), u = f32(h[:, d:])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch._inductor.pattern_matcher import CallFunction, KeywordArg, Match

from . import roles

aten, prims = torch.ops.aten, torch.ops.prims


def _f32(inner, users: int = 1):
    return CallFunction(prims.convert_element_type.default, inner, torch.float32, _users=users)


_xf = _f32(KeywordArg("x"), users=2)
_rstd = CallFunction(aten.rsqrt.default, CallFunction(aten.add.Tensor, CallFunction(
    aten.mean.dim, CallFunction(aten.pow.Tensor_Scalar, _xf, 2), [-1], True), KeywordArg("eps")))
RMS_NORM = CallFunction(aten.mul.Tensor, CallFunction(prims.convert_element_type.default, CallFunction(
    aten.mul.Tensor, _xf, _rstd), KeywordArg("dtype")), KeywordArg("norm_weight"))

_gate = _f32(CallFunction(aten.slice.Tensor, KeywordArg("gate_of"), 1, 0, KeywordArg("d")), users=2)
_up = _f32(CallFunction(aten.slice.Tensor, KeywordArg("up_of"), 1, KeywordArg("d_up"), KeywordArg("end")))
_act = CallFunction(aten.mul.Tensor, CallFunction(aten.mul.Tensor, CallFunction(aten.tanh.default, CallFunction(
    aten.div.Tensor, _gate, KeywordArg("beta"))), KeywordArg("beta_out")), CallFunction(aten.sigmoid.default, _gate))
_linear = CallFunction(aten.mul.Tensor, CallFunction(aten.tanh.default, CallFunction(
    aten.div.Tensor, _up, KeywordArg("linear_beta"))), KeywordArg("linear_beta_out"))
SITU = CallFunction(prims.convert_element_type.default, CallFunction(aten.mul.Tensor, _act, _linear),
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
    if kw is None or kw["dtype"] != kw["x"].meta["val"].dtype:
        return None
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
