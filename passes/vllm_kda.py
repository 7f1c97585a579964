"""vLLM 0.33.0's KDA decode core group, read from its graph and replaced by our fused kernel
(``kimi_kernels.kda_decode_paged``); used by ``lower_kernels``.

Matches (q = 1 decode, T rows of which the first R are live; P = H D; vLLM's binding of a
KDA layer's cache: one int8 page per slot, the conv state at bytes [c0, c1) as bf16
[S, state_len, 3P], the recurrent state at [r0, r1) as fp32 [S, H, D, D]) either spelling.
vLLM's native SM90 decode (its CUDA build, 12 heads)::

    new  = auto_functionalized_v2(_C.fused_kda_decode, x=mixed_qkv [R, 3P], weight [3, W, P],
               bias=None, raw_g=views of g1 [T, P] (= the f_b GEMM), raw_beta=views of beta [T, H],
               A_log, dt_bias, state_indices=slots [R], lower_bound, output_gate=views of g2,
               norm_weight (fp32), norm_eps; conv_state / state / out = views of the bases
               [view.dtype(slice(page0, c0:c1), bf16), view.dtype(slice(page0, r0:r1), f32),
               empty [1, T, H, D]] (out: rows [0, R)))
    page2 = slice_scatter(slice_scatter(page0, view(new[1], i8), c0:c1), view(new[2], i8), r0:r1)
    y    = new[3] [1, T, H, D]

and its Triton chain (the other platforms, or ``kda_decode_backend="triton"``)::

    conv = triton _causal_conv1d_update_kernel(x_ptr=unsqueeze(mixed_qkv [R, 3P]),
               w_ptr=view(W_conv), conv_state_ptr=permute(view(view(slice(page0, c0:c1), bf16))),
               conv_state_indices_ptr=slots [R], SILU, no bias, seqlen 1, dim-contiguous state)
    page1 = slice_scatter(page0, view(view(permute(conv[conv_state_ptr])), i8), c0:c1)
    rec  = triton fused_recurrent_kda_packed_decode_kernel(mixed_qkv=conv[o_ptr] views,
               raw_g=views of g1 [T, P] (= the f_b GEMM), raw_beta=views of beta [T, H], A_log,
               dt_bias, state=view(view(slice(page1, r0:r1), f32)), state_indices=slots,
               scale=D^-1/2)
    page2 = slice_scatter(page1, view(view(rec[state]), i8), r0:r1)
    norm = triton layer_norm_gated_fwd_kernel(x=rows of rec[out], g=view(g2 [T, P]), w,
               sigmoid, RMS, no bias / residual) -> y [T H, D]

and produces::

    new  = auto_functionalized_v2(kimi_kernels.kda_decode_paged, mixed_qkv, f_a[:R], W_fb,
               g2[:R], beta[:R], W_conv [3P, 1, 4], A_log, dt_bias, w, page=page0, c0,
               state_len, r0, slots[:, None], ones [R], lower_bound, eps)
    y    -> view(slice_scatter(zeros [T, P], new[0], rows :R), y's shape);  page2 -> new[1]

(the native decode's conv weight enters as its [3, P, W] transposed view: our kernel reads
either layout; its fp32 norm weight holds the bf16 values).

Every constant and layout above is checked; a group that differs is kept and ``bind``
says why. Invariants: the same values (our op's CPU reference is stock's KDA decode,
whose math and rounding points are vLLM's), the same mutation (the page), padding rows
zero (vLLM leaves them unwritten).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2

from .graph import OpCall, TritonCall

aten = torch.ops.aten
K3 = "vllm.models.kimi_k3.nvidia.ops.third_party.kda.fused_recurrent"
REC = f"{K3}.fused_recurrent_kda_packed_decode_kernel"
CONV = "vllm.model_executor.layers.mamba.ops.causal_conv1d._causal_conv1d_update_kernel"
NATIVE = "_C::fused_kda_decode"
NORM = "vllm.third_party.flash_linear_attention.ops.kda.layer_norm_gated_fwd_kernel"
CONV_FLAGS = {"SILU_ACTIVATION": True, "HAS_BIAS": False, "IS_VARLEN": False, "IS_SPEC_DECODING": False,
              "seqlen": 1, "stride_conv_state_dim": 1}
NORM_FLAGS = {"ACTIVATION": "sigmoid", "IS_RMS_NORM": True, "HAS_BIAS": False, "HAS_RESIDUAL": False,
              "HAS_WEIGHT": True}


@dataclass
class KdaGroup:
    anchor: fx.Node  # our op goes before it
    y: fx.Node  # the normalised output, [T H, D] (Triton group) or [1, T, H, D] (native)
    page: fx.Node  # the page before the step (page0)
    page_out: fx.Node  # the page after both write-backs (page2)
    conv_start: int
    state_len: int
    rec_start: int
    conv_width: int
    head_dim: int
    args: dict[str, Any]  # our op's arguments but f_a / f_b_weight, g2 / beta of all T rows
    g1: fx.Node  # the f_b GEMM's output [T, P]
    native: bool  # vLLM's native decode (else its Triton chain)

    @property
    def requests(self):
        """R: an int, or a SymInt where the graph serves every size."""
        return self.args["mixed_qkv"].meta["val"].shape[0]


# Inductor spells every view as a reshape before its post-grad passes (``view_to_reshape``)
_VIEW = (aten.view.default, aten.reshape.default)


def _is(node: Any, target) -> bool:
    """``node`` calls ``target`` (``aten.view.default``: a view or Inductor's reshape of it)."""
    targets = _VIEW if target is aten.view.default else (target,)
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _through(node: Any, *targets) -> Any:
    """The input under a chain of single-input views ``targets`` (outermost first)."""
    for target in targets:
        if not _is(node, target):
            return None
        node = node.args[0]
    return node


def _write_back(state: fx.Node | None) -> fx.Node | None:
    """The ``slice_scatter(page, view(..., int8), 1, start, end)`` a launch's new state
    value feeds (its only user chain), else None."""
    node = state
    while node is not None and len(node.users) == 1:
        node = next(iter(node.users))
        if _is(node, aten.slice_scatter.default):
            return node
        if node.target not in (aten.permute.default, *_VIEW, aten.view.dtype):
            return None
    return None


def bind(core: fx.Node) -> KdaGroup | str:
    """vLLM's KDA core group around ``core`` (its Triton recurrence launch or its native
    decode call), or why not."""
    call = OpCall.of(core)
    if call is not None and call.wrapped and call.op.name() == NATIVE:
        return _bind_native(call)
    rec = TritonCall.of(core)
    if rec is None or rec.name != REC:
        return "neither vLLM's Triton packed KDA decode nor its native one (its spec-decode path is not lowered)"
    return _bind_triton(rec)


def _bind_triton(rec: TritonCall) -> KdaGroup | str:
    mixed = _through(rec.arg("mixed_qkv"), aten.squeeze.dim, aten.unsqueeze.default, aten.squeeze.dim)
    if not (_is(mixed, operator.getitem) and mixed.args[1] == "o_ptr"):
        return "its packed QKV is not the conv update's output"
    conv = TritonCall.of(mixed.args[0])
    if conv is None or conv.name != CONV:
        return "its packed QKV is not the conv update's output"
    if any(conv.arg(k) != v for k, v in CONV_FLAGS.items()) or conv.arg("state_len") != conv.arg("KERNEL_WIDTH") - 1:
        return f"conv update flags {({k: conv.arg(k) for k in (*CONV_FLAGS, 'state_len')})} (ours: one token, silu, " \
               "no bias, states [S, width - 1, dim])"
    norm = _norm_after(rec)
    if isinstance(norm, str):
        return norm
    # the page: conv state = permute(view(view.dtype(slice(page0, 1, c0, c1))))
    conv_bytes = _through(conv.arg("conv_state_ptr"), aten.permute.default, aten.view.default)  # view.dtype
    conv_slice = _through(conv_bytes, aten.view.dtype)
    rec_slice = _through(rec.arg("state"), aten.view.default, aten.view.dtype)
    page1, page2 = _write_back(conv.output("conv_state_ptr")), _write_back(rec.output("state"))
    if not (_is(conv_slice, aten.slice.Tensor) and _is(rec_slice, aten.slice.Tensor) and page1 is not None
            and page2 is not None and rec_slice.args[0] is page1 and page2.args[0] is page1
            and page1.args[0] is conv_slice.args[0]
            and tuple(page1.args[2:]) == tuple(conv_slice.args[1:]) == (1, *conv_slice.args[2:])
            and tuple(page2.args[2:]) == tuple(rec_slice.args[1:])):
        return "its conv and recurrent states are not byte ranges of one int8 page per slot (vLLM's binding)"
    page = page1.args[0]
    x = _through(conv.arg("x_ptr"), aten.unsqueeze.default)
    if x is None or conv_bytes.args[1] != x.meta["val"].dtype:
        return "its conv state's dtype is not its packed QKV's"
    D = rec.arg("K")
    if rec.arg("V") != D or abs(rec.arg("scale") - D**-0.5) > 1e-6 * D**-0.5 or not rec.arg("USE_LOWER_BOUND"):
        return f"recurrence K={D} V={rec.arg('V')} scale={rec.arg('scale')} (ours: V = K, scale K^-1/2, a lower bound)"
    raw_g = _through(rec.arg("raw_g"), aten.slice.Tensor, aten.view.default, aten.view.default)
    beta = _through(rec.arg("raw_beta"), aten.slice.Tensor, aten.unsqueeze.default)
    g2 = norm.arg("g")
    while _is(g2, aten.view.default):  # [T, H, D] views of the in-projection's [T, P] columns
        g2 = g2.args[0]
    if raw_g is None or beta is None or g2.meta["val"].dim() != 2:
        return "its gate, beta or packed QKV inputs are not the in-projection's columns"
    w = conv.arg("w_ptr")
    conv_weight = _through(w, aten.view.default) if _is(w, aten.view.default) else w
    slots = conv.arg("conv_state_indices_ptr")
    if rec.arg("state_indices") is not conv.output("conv_state_indices_ptr") and rec.arg("state_indices") is not slots:
        return "its recurrence and conv update read different state slots"
    return KdaGroup(anchor=rec.node, y=norm.output("y"), page=page, page_out=page2, conv_start=conv_slice.args[2],
                    state_len=conv.arg("state_len"), rec_start=rec_slice.args[2], conv_width=conv.arg("KERNEL_WIDTH"),
                    head_dim=D, g1=raw_g, native=False, args=dict(
                        mixed_qkv=x, g2=g2, beta=beta, conv_weight=conv_weight, A_log=rec.arg("A_log"),
                        dt_bias=rec.arg("dt_bias"), norm_weight=norm.arg("w"), state_slots=slots,
                        lower_bound=float(rec.arg("lower_bound")), norm_eps=float(norm.arg("eps"))))


def _norm_after(rec: TritonCall) -> TritonCall | str:
    """The gated RMSNorm launch that reads the recurrence's output rows (through views
    and scatters into the [T, H, D] buffer); else why not, naming where the path ends."""
    out, seen, ends = rec.output("out"), set(), set()
    frontier = [out] if out is not None else []
    while frontier:
        node = frontier.pop()
        for user in node.users:
            call = TritonCall.of(user)
            if call is not None and call.name == NORM:
                bad = {k: call.arg(k) for k, v in NORM_FLAGS.items() if call.arg(k) != v}
                return call if not bad else f"gated norm flags {bad} (ours: sigmoid-gated RMSNorm with a weight)"
            if user not in seen and user.op == "call_function" and user.target in (
                    aten.select.int, aten.slice_scatter.default, aten.select_scatter.default, *_VIEW):
                seen.add(user)
                frontier.append(user)
            elif user not in seen:
                ends.add(call.name.rsplit(".", 1)[-1] if call is not None else str(user.target))
    if out is None:
        return "the recurrence's output is not read"
    return f"no gated RMSNorm reads its output (its path ends at {', '.join(sorted(ends)) or 'nothing'})"


def _columns(node: Any) -> Any:
    """The 2-D tensor [T, n] under a chain of row slices and views (a [1, R, H, D] or
    [R, H, D] operand of the native decode cut from the in-projection's columns)."""
    while _is(node, aten.view.default) or _is(node, aten.slice.Tensor) or _is(node, aten.unsqueeze.default):
        node = node.args[0]
    return node if isinstance(node, fx.Node) and node.meta["val"].dim() == 2 else None


def _bind_native(call: OpCall) -> KdaGroup | str:
    """vLLM's native decode: one functionalized ``_C::fused_kda_decode`` whose conv state
    [S, 3P, L] (stride 1 over channels), recurrent state [S, H, D, D] fp32 and output
    [1, R, H, D] are views of three bases: the two dtype views of the page's byte ranges
    and an empty [1, T, H, D]; the conv weight is its [3, W, P] copy, the norm weight fp32."""
    if call.arg("bias") is not None or call.arg("output_gate") is None or call.arg("norm_weight") is None \
            or call.arg("lower_bound") is None:
        return "native KDA decode with a conv bias, or without its gated norm or gate lower bound (ours: K3's)"
    x, weight = call.arg("x"), call.arg("weight")
    rec, conv = call.view("state"), call.view("conv_state")
    if set(rec) != {"size", "stride", "storage_offset"} or set(conv) != set(rec):
        return "its states are not strided views of their bases"
    _, H, D, K = rec["size"]
    S, C, L = conv["size"]
    P, W = H * D, L + 1
    states = {}
    for name, view, dtype, shape in (("conv_state", conv, x.meta["val"].dtype, (S, C, L)),
                                     ("state", rec, torch.float32, (S, H, D, D))):
        base = call.arg(name)
        page_slice = _through(base, aten.view.dtype)
        val = base.meta["val"]
        want_stride = (val.stride(0), 1, C) if name == "conv_state" else (val.stride(0), D * D, D, 1)
        if not (_is(page_slice, aten.slice.Tensor) and base.args[1] == dtype and page_slice.args[1] == 1
                and tuple(view["size"]) == shape and tuple(view["stride"]) == want_stride
                and view["storage_offset"] == val.storage_offset()):
            return "its conv and recurrent states are not byte ranges of one int8 page per slot (vLLM's binding)"
        states[name] = page_slice, _write_back(call.mutated_output(name))
    (conv_slice, page1), (rec_slice, page2) = states["conv_state"], states["state"]
    if not (page1 is not None and page2 is not None and page1.args[0] is conv_slice.args[0]
            and rec_slice.args[0] is conv_slice.args[0] and page2.args[0] is page1
            and tuple(page1.args[2:]) == tuple(conv_slice.args[1:]) and tuple(page2.args[2:]) == tuple(rec_slice.args[1:])):
        return "its states are not written back to their page ranges (conv, then recurrent)"
    out = call.view("out")
    y = call.mutated_output("out")
    if out != {"slice_dim": 1, "slice_start": 0, "slice_end": out.get("slice_end")} \
            or y is None or not _is(call.arg("out"), aten.empty.memory_format):
        return "its output is not rows [0, R) of a fresh [1, T, H, D] buffer"
    # each operand a [.., H, D] (beta [.., H]) row range of a whole [T, P] ([T, H]) column block
    operands = {"raw_g": (H, D), "output_gate": (H, D), "raw_beta": (H,)}
    g1, g2, beta = (_columns(call.arg(name)) for name in operands)
    if K != D or C != 3 * P or tuple(weight.meta["val"].shape) != (3, W, P) or None in (g1, g2, beta) \
            or any(tuple(call.arg(name).meta["val"].shape[-len(tail):]) != tail for name, tail in operands.items()) \
            or any(tuple(t.meta["val"].shape[1:]) != (n,) for t, n in ((g1, P), (g2, P), (beta, H))):
        return f"native decode shapes (states {conv['size']} / {rec['size']}, weight {tuple(weight.meta['val'].shape)}) " \
               "are not K3's packed [3P] channels, [3, W, P] conv weight and [T, P] / [T, H] gate columns"
    return KdaGroup(anchor=call.node, y=y, page=conv_slice.args[0], page_out=page2,
                    conv_start=conv_slice.args[2], state_len=L, rec_start=rec_slice.args[2], conv_width=W,
                    head_dim=D, g1=g1, native=True, args=dict(
                        mixed_qkv=x, g2=g2, beta=beta, conv_weight=weight, A_log=call.arg("A_log"),
                        dt_bias=call.arg("dt_bias"), norm_weight=call.arg("norm_weight"),
                        state_slots=call.arg("state_indices"), lower_bound=float(call.arg("lower_bound")),
                        norm_eps=float(call.arg("norm_eps"))))


def _full(g: fx.Graph, size: list, value, like: fx.Node) -> fx.Node:
    """``aten.full`` with ``like``'s dtype and device: the spelling a post-grad graph has
    (``*_like`` factories are decomposed before it; Inductor 2.11 cannot lower them)."""
    val = like.meta["val"]
    return g.call_function(aten.full.default, (size, value), dict(dtype=val.dtype, device=val.device,
                                                                   pin_memory=False))


def lower(g: fx.Graph, group: KdaGroup, f_a: fx.Node, f_b: fx.Node) -> fx.Node:
    """Emit our op in place of the group (see the module docstring); returns its node.
    Row counts may be symbolic (vLLM marks the token count dynamic): R is read from the
    live packed QKV, T from the gate's columns, never written as a number."""
    a, y = group.args, group.y
    P = a["g2"].meta["val"].shape[1]
    with g.inserting_before(group.anchor):
        def rows_of(node):  # its row count: a number, or read from it when symbolic
            n = node.meta["val"].shape[0]
            return n if isinstance(n, int) else g.call_function(aten.sym_size.int, (node, 0))

        R, T = rows_of(a["mixed_qkv"]), rows_of(a["g2"])

        def rows(node):
            return g.call_function(aten.slice.Tensor, (node, 0, 0, R))

        conv_weight, W = a["conv_weight"], group.conv_width
        if tuple(conv_weight.meta["val"].shape) == (3, W, P):  # the native decode's copy: a [3, P, W] view
            conv_weight = g.call_function(aten.permute.default, (conv_weight, [0, 2, 1]))
        elif tuple(conv_weight.meta["val"].shape) != (3 * P, 1, W):
            conv_weight = g.call_function(aten.view.default, (conv_weight, [3 * P, 1, W]))
        slots = a["state_slots"]
        kwargs = dict(mixed_qkv=a["mixed_qkv"], f_a=rows(f_a), f_b_weight=f_b, g2=rows(a["g2"]), beta=rows(a["beta"]),
                      conv_weight=conv_weight, A_log=a["A_log"], dt_bias=a["dt_bias"], norm_weight=a["norm_weight"],
                      conv_start=group.conv_start, state_len=group.state_len, rec_start=group.rec_start,
                      state_slots=g.call_function(aten.unsqueeze.default, (slots, 1)),
                      num_accepted=_full(g, [R], 1, slots),
                      lower_bound=a["lower_bound"], norm_eps=a["norm_eps"], _page_base_index=0,
                      _all_bases=[group.page])
        new = g.call_function(auto_functionalized_v2, (torch.ops.kimi_kernels.kda_decode_paged.default,), kwargs)
        out = g.call_function(operator.getitem, (new, 0))
        page = g.call_function(operator.getitem, (new, 1))
        # values set here, not left to the fake-value updater: torch 2.11's skips higher-order ops
        out.meta["val"] = a["g2"].meta["val"].new_empty((a["mixed_qkv"].meta["val"].shape[0], P))
        page.meta["val"] = group.page_out.meta["val"]
        new.meta["val"] = (out.meta["val"], page.meta["val"])
        zeros = _full(g, [T, P], 0, a["g2"])  # padding rows zero
        full = g.call_function(aten.slice_scatter.default, (zeros, out, 0, 0, R))
        flat = g.call_function(aten.view.default, (full, [n if isinstance(n, int) else -1 for n in y.meta["val"].shape]))
    y.replace_all_uses_with(flat)
    group.page_out.replace_all_uses_with(page)
    return new
