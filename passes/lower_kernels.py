"""lower_kernels: replace decode subgraphs by our kernels (``kimi_inductor.kernels``).

Matches and produces (M = rows, at most 64):

    before                                          after
    mm(x, permute(W, [1, 0]))                       kimi_kernels.skinny_mm(x, W, None, bf16)
    addmm(acc, x, permute(W, [1, 0]))               kimi_kernels.skinny_mm(x, W, acc, bf16)
    mm(f32(x), permute(f32(W), [1, 0]))  (router)   kimi_kernels.skinny_mm(x, W, None, f32)
    mm.dtype(x, permute(W), f32)         (router)   kimi_kernels.skinny_mm(x, W, None, f32)
    bmm(x, W)  (MLA absorption, v up-projection)    kimi_kernels.skinny_bmm(x, W)
    output_gate(bmm(x, W) as [M, B N], g)           kimi_kernels.skinny_bmm_gate(x, W, g)  (MLA's v up + gate)
      with x = kimi_kernels.mla_decode(...)^T       kimi_kernels.mla_decode_gated(..., W, g)  (the core's
        read by it alone                              merge inside the v up-projection, where measured faster)
    g1 = <any of the above>(f_a, W_fb)
    kimi.kda_decode(mixed_qkv, g1, ...)             kimi_kernels.kda_decode(mixed_qkv, f_a, W_fb, ...)
    kimi.mla_decode(ql_nope, q_pe, ...)             kimi_kernels.mla_decode(ql_nope, q_pe, ...)
      with kv_c = rms_norm(x, w, eps) read by it    kimi_kernels.mla_decode(..., x, ..., kv_norm_weight=w, eps)
    vLLM's KDA group: its Triton chain, or its      kimi_kernels.kda_decode_paged(...) on its page
      native decode where ours is measured faster     (passes/vllm_kda.py; kda_decode.versus_native)
    vLLM's MLA insert + decode pair (CPU backend)   kimi_kernels.mla_decode(ql_nope, q_pe, ...)
      (passes/vllm_mla.py)
    kimi.mla_decode_dcp(...)  (DCP partials)        kimi_kernels.mla_decode_dcp(...)
    kimi.dsa_decode(...)  (DSA, no DCP)             kimi_kernels.dsa_decode(...)
    kimi.attn_res(prefix, delta, bank, ...)         kimi_kernels.attn_res(prefix, delta, bank, ...)
    another spelling's AttnRes (vLLM's Triton       kimi_kernels.attn_res(...), only at block counts
      _attn_res_kernel launch)                        where ours is faster (attn_res.versus_vllm:
                                                      none on H200, so vLLM's stays)
    <GEMM>(rms_norm(x, w_n, eps), W, acc)           kimi_kernels.rms_norm_mm(x, w_n, eps, W, acc, dt)
    situ_and_mul(<GEMM>(x, W), b, lb)               kimi_kernels.mm_situ(x, W, b, lb)
    stock's select_experts (sigmoid, biased top-k,  kimi_kernels.select_experts(...)
      gather, renormalise, scale)                     (passes/moe_router.py)
    a sharded_moe layer's router (and its           kimi_kernels.moe_in(...) and moe_out(...)
      select_experts), latent down, shared block      (passes/moe_projections.py)
      with SiTU / its down and up blocks

The two fusions (patterns in ``gemm_neighbours``) happen only where the CuTe GEMV runs
the GEMM (``skinny_gemm.choose_fused``); elsewhere the GEMM is lowered alone.

Each replacement computes the same function (the kernels' CPU references are the
replaced ops; on CPU the lowered graph is bitwise the unlowered one; for vLLM's KDA
group and MLA pair they are stock's same math, equal to summation order). A GEMM with
more than 64 rows, an unsupported dtype or shape, or a KDA layer or vLLM MLA pair the
kernel does not cover stays as it was, and the report says why.

Invariants. Relies on: ``meta["val"]`` of the matched nodes. Establishes: the same
values and mutations (``auto_functionalized_v2`` around ``kimi.kda_decode`` /
``kimi.mla_decode``, or vLLM's insert + decode pair, becomes one around the
``kimi_kernels`` op with the same bases); row layouts unchanged; decoder ops (attention
cores, AttnRes) survive its dead-code removal even when unread, so the decoder still
parses after it.

Order: after hybrid_attention (so that replicated and sharded rows are final).
"""

from __future__ import annotations

import operator
from collections import Counter

import torch
from torch import fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2

from kimi_inductor.kernels import attn_res as attn_res_kernel
from kimi_inductor.kernels import kda_decode as kda_kernel
from kimi_inductor.kernels import mla_decode as mla_kernel
from kimi_inductor.kernels import skinny_gemm

from . import moe_projections, moe_router, roles, vllm_kda, vllm_mla
from .decoder import _between
from .gemm_neighbours import gated_heads_of, match_gemm, mla_output_of, rms_norm_of, situ_of
from .graph import OpCall, TritonCall, op_name
from .report import PassInfo

aten, prims = torch.ops.aten, torch.ops.prims
kimi, kk = torch.ops.kimi, torch.ops.kimi_kernels


def _mla_unsupported(call: OpCall) -> str:
    ql = call.arg("ql_nope").meta["val"]
    return mla_kernel.supported(ql.shape[-1], call.arg("q_pe").meta["val"].shape[-1], ql.dtype)


def _attn_res_unsupported(call: OpCall) -> str:
    prefix = call.arg("prefix").meta["val"]
    return attn_res_kernel.supported(prefix.shape[-1], prefix.dtype)


# stock op -> (our op with the same arguments and mutations, its name in the report,
# why our kernel cannot take a call ('' when it can))
SWAPS = {kimi.mla_decode.default: (kk.mla_decode.default, "MLA core", _mla_unsupported),
         kimi.mla_decode_dcp.default: (kk.mla_decode_dcp.default, "MLA core", _mla_unsupported),
         kimi.dsa_decode.default: (kk.dsa_decode.default, "MLA core", _mla_unsupported),
         kimi.attn_res.default: (kk.attn_res.default, "AttnRes", _attn_res_unsupported)}


class LowerKernels:
    name = "lower_kernels"

    def __call__(self, gm: fx.GraphModule, ctx) -> PassInfo:
        info = PassInfo(self.name)
        g = gm.graph
        per_node: dict[fx.Node, str] = {}
        kept = Counter()
        dg = ctx.decoder
        decoder_calls = [r for l in dg.layers for r in (l.pre, l.post, l.core)] + ([dg.final] if dg.final else []) \
            + [c for c in dg.fragment if isinstance(c, roles.Core)]
        foreign = [c for c in decoder_calls if isinstance(c, roles.Core) and c.spelling != "kimi"]
        dropped = set()  # replaced cores (decoder ops survive dead-code removal otherwise)
        lowered = {kk.kda_decode_paged.default}  # ours already (a second run of the pass)
        for core in [c for c in foreign if c.kind == "kda" and getattr(OpCall.of(c.node), "op", None) not in lowered]:
            info.matched += 1
            group = vllm_kda.bind(core.node)
            if isinstance(group, str):
                why, gemm = group, None
            else:
                why, gemm = kda_kernel.supported(group.conv_width, group.head_dim), match_gemm(group.g1)
                why = why or (kda_kernel.versus_native(group.requests) if group.native else "")
                if not why and (gemm is None or gemm[2] is not None):
                    why = f"its g1 is not a plain f_b GEMM (it is {op_name(group.g1)})"
            if why:
                kept[f"KDA core ({core.spelling}): {why}"] += 1
                continue
            per_node[_replace(dg, core, vllm_kda.lower(g, group, f_a=gemm[0], f_b=gemm[1]))] = "kda"
            dropped.add(core.node)
            info.rewritten += 1
        for core in [c for c in foreign if c.kind == "mla"]:
            info.matched += 1
            group = vllm_mla.bind(core.node)
            why = group if isinstance(group, str) else mla_kernel.supported(group.latent, group.rope, group.dtype)
            if why:
                kept[f"MLA core ({core.spelling}): {why}"] += 1
                continue
            per_node[_replace(dg, core, vllm_mla.lower(g, group))] = "mla"
            info.rewritten += 1
        ours = [OpCall.of(c.node) for c in decoder_calls if c.spelling == "kimi"]
        for res in [c for c in decoder_calls if isinstance(c, roles.AttnRes) and c.spelling != "kimi"]:
            info.matched += 1
            prefix = res.arg("prefix").meta["val"]
            why = attn_res_kernel.supported(prefix.shape[-1], prefix.dtype) or \
                attn_res_kernel.versus_vllm(res.arg("num_blocks"))
            if why:
                kept[f"AttnRes ({res.spelling}): {why}"] += 1
                continue
            new = _lower_attn_res(g, res)
            dg.replaced(res.node, new)
            per_node[new] = "attn_res"
            info.rewritten += 1
        # KDA first: its f_b GEMM folds into the fused kernel
        for call in [c for c in ours if c.op is kimi.kda_decode.default]:
            info.matched += 1
            g1 = call.arg("g1")
            gemm = match_gemm(g1) if isinstance(g1, fx.Node) else None
            conv_width = call.arg("conv_weight").meta["val"].shape[-1]
            why = kda_kernel.supported(conv_width, call.arg("recurrent_state").meta["val"].shape[-1])
            if gemm is None or gemm[2] is not None or call.node.target is not auto_functionalized_v2:
                why = why or "its g1 is not a plain f_b GEMM"
            if why:
                kept[f"KDA core: {why}"] += 1
                continue
            per_node[_replace(dg, call, _fuse_kda(g, call, f_a=gemm[0], f_b=gemm[1]))] = "kda"
            info.rewritten += 1
        for call in [c for c in ours if c.op in SWAPS]:
            info.matched += 1
            ours_op, label, unsupported = SWAPS[call.op]
            why = unsupported(call)
            if call.node.target is not auto_functionalized_v2:
                why = why or "not an auto_functionalized_v2 call"
            if why:
                kept[f"{label}: {why}"] += 1
                continue
            core = roles.core(call.node)
            kwargs = dict(call.node.kwargs)
            if ours_op is kk.mla_decode.default and (norm := rms_norm_of(kwargs["kv_c"])) is not None:
                kwargs.update(kv_c=norm[0], kv_norm_weight=norm[1], kv_norm_eps=norm[2])  # the cache write norms
            per_node[_replace(dg, call, _swap(g, call, ours_op, kwargs))] = core.kind if core is not None else "attn_res"
            info.rewritten += 1
        _dead_code_out(g, dropped)  # dead casts would count as readers of a norm or a GEMM
        for topk in [n for n in g.nodes if n.target is aten.topk.default]:  # the MoE router's choice
            bound = moe_router.bind(topk)
            if bound is not None:
                info.matched += 1
                per_node[moe_router.lower(g, bound)] = "route"
                info.rewritten += 1
        _dead_code_out(g)  # the router's replaced ops: the logits' one reader is its op
        for layer in [l for l in dg.layers if l.moe is not None]:  # sharded_moe's layers: two launches
            bound = moe_projections.bind(layer)
            if bound is None:
                continue
            info.matched += 1
            kept.update(f"MoE projections: {why}" for why in (bound.into, bound.out) if isinstance(why, str))
            if not isinstance(bound.into, str) and bound.into.route is not None:
                per_node.pop(bound.into.route)  # moe_in takes the router's choice in
            lowered_here = moe_projections.lower(g, bound)
            per_node.update(lowered_here)
            info.rewritten += bool(lowered_here)
        _dead_code_out(g)
        situ_after = {m[0]: (n, *m[1:]) for n in g.nodes if (m := situ_of(n)) is not None}  # GEMM -> its SiTU
        for node in list(g.nodes):
            gemm = match_gemm(node)
            if gemm is None:
                continue
            x, w, acc, out_dtype = gemm
            info.matched += 1
            M, K = x.meta["val"].shape
            N = w.meta["val"].shape[0]
            if not isinstance(M, int):
                kept[f"GEMM {N}x{K}: symbolic rows"] += 1
                continue
            if not w.meta["val"].is_contiguous():
                kept[f"GEMM {N}x{K}: a column block of its weight (sharded_moe): cuBLAS reads it in place"] += 1
                continue
            dtype = x.meta["val"].dtype
            impl, why = skinny_gemm.choose(M, N, K, dtype)
            if impl == "cublas":
                kept[f"GEMM {N}x{K}: {why}"] += 1
                continue
            fusable = {}
            for kind, found in (("rms_norm", rms_norm_of(x)),
                                ("situ", situ_after.get(node) if acc is None and out_dtype == dtype else None)):
                why = found is not None and skinny_gemm.choose_fused(kind, M, N, K, dtype)
                if why:
                    kept[f"{kind} next to GEMM {N}x{K}, not fused: {why}"] += 1
                elif found is not None:
                    fusable[kind] = found
            if "situ" in fusable:
                out, beta, linear_beta = fusable["situ"]  # x W^T and its SiTU-GLU: one op in place of the SiTU
                with g.inserting_before(out):
                    new = g.call_function(kk.mm_situ.default, (x, w, beta, linear_beta))
                new.meta["val"] = out.meta["val"]  # a later GEMM (the down-projection) reads it
                out.replace_all_uses_with(new)
                per_node[new] = "gemm_situ"
            else:
                norm = fusable.get("rms_norm")
                with g.inserting_before(node):
                    new = g.call_function(kk.rms_norm_mm.default, (*norm, w, acc, out_dtype)) \
                        if norm else g.call_function(kk.skinny_mm.default, (x, w, acc, out_dtype))
                new.meta["val"] = node.meta["val"]
                node.replace_all_uses_with(new)
                g.erase_node(node)
                per_node[new] = "norm_gemm" if norm else "gemm"
            info.rewritten += 1
        gated = {m[0]: (n, m[1]) for n in g.nodes if (m := gated_heads_of(n)) is not None}  # bmm -> its gate
        for node in [n for n in g.nodes if n.target is aten.bmm.default]:  # MLA's per-head GEMMs
            x, w = node.args
            info.matched += 1
            (B, M, K), N, dtype = x.meta["val"].shape, w.meta["val"].shape[2], x.meta["val"].dtype
            if node in gated:  # the v up-projection and the output gate: one launch
                out, gate = gated[node]
                why = (not isinstance(M, int) and "symbolic rows") or skinny_gemm.choose_bmm_gate(B, M, K, N, dtype)
                core = mla_output_of(x) if isinstance(M, int) else None
                if core is not None:  # the core's splits merge inside the up-projection
                    why_not = mla_kernel.merge_into_up(M) or _reads_before(core, out)
                    if not why_not:
                        new = _merge_into_up(g, dg, core, w, gate, out)
                        dropped.add(core)
                        per_node.pop(core, None)
                        per_node[new] = "mla_gate"
                        info.rewritten += 1
                        continue
                    kept[f"MLA core's merge apart from the v up-projection: {why_not}"] += 1
                if not why:
                    with g.inserting_before(out):
                        new = g.call_function(kk.skinny_bmm_gate.default, (x, w, gate))
                    new.meta["val"] = out.meta["val"]
                    out.replace_all_uses_with(new)
                    per_node[new] = "bmm_gate"
                    info.rewritten += 1
                    continue
                kept[f"per-head GEMM {B}x{K}x{N} + output gate, unfused: {why}"] += 1
            why = (not isinstance(M, int) and "symbolic rows") or skinny_gemm.choose_bmm(B, M, K, N, dtype)
            if why:
                kept[f"per-head GEMM {B}x{K}x{N}: {why}"] += 1
                continue
            with g.inserting_before(node):
                new = g.call_function(kk.skinny_bmm.default, (x, w))
            new.meta["val"] = node.meta["val"]
            node.replace_all_uses_with(new)
            g.erase_node(node)
            per_node[new] = "bmm"
            info.rewritten += 1
        _dead_code_out(g, dropped)
        info.skipped += [f"{n} x kept: {why}" for why, n in kept.items()]
        _annotate(ctx, per_node)
        return info


def _dead_code_out(g: fx.Graph, dropped: set[fx.Node] = frozenset()) -> None:
    """Dead pure nodes out, except decoder ops (attention cores, AttnRes) other than the
    ``dropped`` ones this pass replaced: an explain graph on the meta device leaves the
    last AttnRes unread, and the report's decoder parse must still see every layer
    (Inductor removes what is truly dead later)."""
    def keep(n: fx.Node) -> bool:
        return n.is_impure() or (n not in dropped and (roles.core(n) is not None or roles.attn_res(n) is not None))

    g.eliminate_dead_code(is_impure_node=keep)


def _fuse_kda(g: fx.Graph, call: OpCall, f_a: fx.Node, f_b: fx.Node) -> fx.Node:
    kwargs = {k: v for k, v in call.node.kwargs.items() if k != "g1"}
    kwargs.update(f_a=f_a, f_b_weight=f_b)
    return _swap(g, call, kk.kda_decode.default, kwargs)


def _lower_attn_res(g: fx.Graph, res: roles.AttnRes) -> fx.Node:
    """Our AttnRes op in place of another spelling's call of the same role (the role's
    contract: prefix += delta in place, the bank write, the mix), wrapped as post-grad
    graphs wrap mutating ops. What else the call returned (a Triton launch returns every
    pointer argument) is its unchanged input."""
    names = ("delta", "norm_weight", "qk_weight", "output_norm_weight", "num_blocks", "block_write_idx", "eps",
             "output_norm_eps")
    kwargs = {name: res.arg(name) for name in names}
    kwargs.update(_prefix_base_index=0, _bank_base_index=1, _all_bases=[res.arg("prefix"), res.arg("bank")])
    with g.inserting_before(res.node):
        new = g.call_function(auto_functionalized_v2, (kk.attn_res.default,), kwargs)
        out, prefix, bank = (g.call_function(operator.getitem, (new, i)) for i in range(3))
    # later matches in this pass read the values (the manager's MetaUpdater redoes them)
    vals = [res.output.meta["val"], res.arg("prefix").meta["val"], res.arg("bank").meta["val"]]
    new.meta["val"] = tuple(vals)
    for node, val in zip((out, prefix, bank), vals):
        node.meta["val"] = val
    for old, value in ((res.output, out), (res.updated("prefix"), prefix), (res.updated("bank"), bank)):
        if old is not None:
            old.replace_all_uses_with(value)
            g.erase_node(old)
    for user in list(res.node.users):
        user.replace_all_uses_with(TritonCall.of(res.node).arg(user.args[1]))
        g.erase_node(user)
    g.erase_node(res.node)
    return new


def _replace(dg, call: OpCall | roles.Core, new: fx.Node) -> fx.Node:
    dg.replaced(call.node, new)
    return new


def _reads_before(core: fx.Node, out: fx.Node) -> str:
    """Why ``core``'s other outputs (the new cache) cannot move down to ``out`` ('' when
    nothing reads them before it)."""
    order = {n: i for i, n in enumerate(out.graph.nodes)}
    early = [u for item in core.users if item.args[1] != 0 for u in item.users if order[u] < order[out]]
    return f"its cache is read before the output gate ({early[0].name})" if early else ""


def _merge_into_up(g: fx.Graph, dg, core: fx.Node, w: fx.Node, gate: fx.Node, out: fx.Node) -> fx.Node:
    """``kimi_kernels.mla_decode_gated`` (same bases) at ``out``, the output gate of the v
    up-projection of ``core``'s output: ``out`` and the new cache read from it; the old
    chain is left unread (dead-code removal takes it)."""
    with g.inserting_before(out):
        new = g.call_function(auto_functionalized_v2, (kk.mla_decode_gated.default,),
                              dict(core.kwargs, w_uv=w, gate=gate))
        value = g.call_function(operator.getitem, (new, 0))
    new.meta.update({k: v for k, v in core.meta.items() if k != "eager_input_vals"})
    new.meta["val"] = (out.meta["val"], *core.meta["val"][1:])
    value.meta["val"] = out.meta["val"]
    out.replace_all_uses_with(value)
    for item in [n for n in core.users if n.args[1] != 0]:
        with g.inserting_after(value):
            moved = g.call_function(operator.getitem, (new, item.args[1]))
        moved.meta["val"] = item.meta["val"]
        item.replace_all_uses_with(moved)
    dg.replaced(core, new)
    return new


def _swap(g: fx.Graph, call: OpCall, op, kwargs: dict) -> fx.Node:
    """The wrapped call of ``op`` with ``kwargs`` (same mutated bases) in place of ``call``."""
    with g.inserting_before(call.node):
        fused = g.call_function(auto_functionalized_v2, (op,), kwargs)
    fused.meta.update({k: v for k, v in call.node.meta.items() if k != "eager_input_vals"})
    call.node.replace_all_uses_with(fused)
    g.erase_node(call.node)
    return fused


def _annotate(ctx, per_node: dict[fx.Node, str]) -> None:
    """Per layer: which of its subgraphs now run our kernels."""
    for layer in ctx.decoder.layers:
        attn = [n for n in _between(layer.pre.output, layer.attn_out) if n in per_node]
        mlp = [n for n in _between(layer.mlp_in, layer.mlp_out) if n in per_node]
        res = sum(c.node in per_node for c in (layer.pre, layer.post))
        ctx.note(layer.index, LowerKernels.name, "kernels",
                 f"attention: {_summary(attn, per_node)}; mlp: {_summary(mlp, per_node)}"
                 + (f"; AttnRes: fused x{res}" if res else ""), rewritten=bool(attn or mlp or res))


LABELS = {"kda": "fused KDA", "mla": "MLA core", "dsa": "DSA core", "gemm": "skinny GEMM", "bmm": "per-head GEMM",
          "norm_gemm": "RMSNorm + GEMM", "gemm_situ": "GEMM + SiTU", "bmm_gate": "per-head GEMM + gate",
          "mla_gate": "MLA core + v up-projection + gate",
          "moe_in": "router + latent down + shared gate/up SiTU (one launch)",
          "moe_in_routed": "router + top-k + latent down + shared gate/up SiTU (one launch)",
          "moe_out": "shared down + up (one GEMM)", "route": "router top-k (one launch)"}


def _summary(nodes, per_node) -> str:
    c = Counter(per_node[n] for n in nodes)
    return ", ".join(f"{label} x{c[kind]}" for kind, label in LABELS.items() if c[kind]) or "stock"
