"""The projections of a ``sharded_moe`` layer as two launches (``kimi_kernels.moe_in`` /
``moe_out``, ``kernels/moe_projections.py``); part of ``lower_kernels``.

Matches, in a MoE layer that ``sharded_moe`` rewrote (x: the layer's MoE input, all T
rows; block r of G: rows or columns [r n / G, (r + 1) n / G) of a dimension of n):

    logits = <GEMM, fp32 out>(x, W_router)                  the router
    z      = <GEMM>(x, W_latent)                             the latent down-projection
    gate   = mm(x, permute(W_gu[block r of the gate rows]))  row blocks of one [gate; up]
    up     = mm(x, permute(W_gu[D + the same block]))        weight [2 D, H]
    h      = situ_and_mul(gate, up)                          (stock's SiTU: gemm_neighbours)
        -> logits, z, h = moe_in(x, W_router, W_latent, W_gu, r, G, beta, linear_beta)
    weights, ids = select_experts(logits, bias, k, renorm, scale)   (moe_router's op, if it
        -> moe_in(..., bias, k, renorm, scale)[3:]                   alone reads the logits)
    o = addmm(mm(h, permute(W_down[:, block r])), normed[:, block r], permute(W_up[:, block r]))
        -> o = moe_out(h, normed, W_down, W_up, r, G)     (normed: the routed output's RMSNorm)

Each op computes the replaced ops' function (its CPU reference is them; on CPU the
lowered layer is the unlowered one). Only these exact shapes are taken: anything else
in the layer (another GEMM reading x, a second reader of a GEMM output, blocks of
different ranks) keeps the ops as they were, and the report says why. Rows: moe_in
up to ``max_rows_in()``, moe_out up to ``MAX_ROWS_OUT`` (the GPU
kernels' limits).
"""

from __future__ import annotations

import operator
from types import SimpleNamespace

import torch
from torch import fx

from kimi_inductor.kernels import moe_projections as kernel

from .decoder import Layer, _between
from .gemm_neighbours import match_gemm, situ_pair_of
from .graph import ancestors

aten = torch.ops.aten
kk = torch.ops.kimi_kernels


def _block(w: fx.Node, dim: int) -> tuple[fx.Node, int, int] | None:
    """(base, start, size) when ``w`` is ``slice(base, dim, start, start + size)``."""
    if isinstance(w, fx.Node) and w.target is aten.slice.Tensor and len(w.args) == 4 and w.args[1] == dim:
        base, _, start, end = w.args
        return base, start, end - start
    return None


def _shard(start: int, size: int, width: int) -> tuple[int, int] | None:
    """(r, G) when [start, start + size) is block r of G of a dimension of ``width``."""
    if size <= 0 or start % size or width % size or start + size > width:
        return None
    return start // size, width // size


def bind(layer: Layer) -> SimpleNamespace | None:
    """None for a layer that ``sharded_moe`` did not rewrite (no row or column blocks);
    else ``into`` / ``out``: moe_in's / moe_out's pieces, or why they are kept (str)."""
    x, region = layer.mlp_in, _between(layer.mlp_in, layer.mlp_out)
    gemms = {n: m for n in region if (m := match_gemm(n)) is not None}
    gate_up = [n for n, m in gemms.items() if m[0] is x and _block(m[1], 0) is not None]
    tails = [n for n, m in gemms.items() if m[2] is not None and _block(m[1], 1) is not None]
    if not gate_up and not tails:
        return None
    return SimpleNamespace(x=x, into=_bind_in(x, region, gemms, gate_up), out=_bind_out(gemms, tails))


def _bind_in(x: fx.Node, region: set[fx.Node], gemms: dict, gate_up: list[fx.Node]) -> SimpleNamespace | str:
    rows = x.meta["val"].shape[0]
    most = kernel.max_rows_in()
    if not isinstance(rows, int) or rows > most:
        return (f"moe_in: {rows} rows (its Triton form takes up to {most})" if most > kernel.MAX_ROWS_IN else
                f"moe_in: {rows} rows (the fused GEMV takes up to {kernel.MAX_ROWS_IN}; its Triton form is off: "
                "KIMI_INDUCTOR_MOE_IN_ROWS)")
    readers = {n: m for n, m in gemms.items() if m[0] is x}
    situ = [n for n in region if (m := situ_pair_of(n)) is not None and {m[0], m[1]} == set(gate_up)]
    if len(gate_up) != 2 or len(situ) != 1:
        return "moe_in: the shared experts are not one SiTU of a gate and an up row block"
    gate, up, beta, linear_beta = situ_pair_of(situ[0])
    (base, a, width), (base_up, a_up, width_up) = (_block(gemms[n][1], 0) for n in (gate, up))
    D = base.meta["val"].shape[0] // 2
    shard = _shard(a, width, D)
    if base is not base_up or width != width_up or a_up != D + a or shard is None:
        return "moe_in: the gate and up blocks are not block r of the gate rows and of the up rows of one weight"
    others = [n for n in readers if n not in (gate, up)]
    router = [n for n in others if readers[n][3] == torch.float32]
    # the experts' latent reaches expert_ffn directly, or through sharded_moe's message to the DP peers
    feeds = set().union(*(ancestors(n, {x}) for n in region if n.target is kk.expert_ffn.default))
    latent = [n for n in others if n not in router and n in feeds]
    if len(router) != 1 or len(latent) != 1 or len(others) != 2 or any(readers[n][2] is not None for n in others):
        return ("moe_in: x is not read by exactly a router (fp32 logits), the experts' latent down-projection "
                "and the shared block")
    if any(not readers[n][1].meta["val"].is_contiguous() for n in others):
        return "moe_in: the router or latent weight is not whole"
    if any(len(n.users) != 1 for n in (gate, up)):
        return "moe_in: the gate or up block has readers besides its SiTU"
    return SimpleNamespace(router=router[0], latent=latent[0], gate=gate, up=up, h=situ[0], w_gu=base,
                           shard=shard, beta=beta, linear_beta=linear_beta, route=_route_of(router[0]))


def _route_of(router: fx.Node) -> fx.Node | None:
    """The ``select_experts`` call (``moe_router``) that alone reads the router's logits,
    with its bias defined before the router: moe_in takes it in."""
    route = next(iter(router.users)) if len(router.users) == 1 else None
    if route is None or route.target is not kk.select_experts.default or route.args[0] is not router:
        return None
    bias = route.args[1]
    order = {n: i for i, n in enumerate(router.graph.nodes)}
    return route if not isinstance(bias, fx.Node) or order[bias] < order[router] else None


def _bind_out(gemms: dict, tails: list[fx.Node]) -> SimpleNamespace | str:
    if len(tails) != 1:
        return "moe_out: not one addmm over a column block of the up-projection"
    tail = tails[0]
    normed, w_up, acc, _ = gemms[tail]
    shared = gemms.get(acc)
    rows = normed.meta["val"].shape[0]
    if not isinstance(rows, int) or rows > kernel.MAX_ROWS_OUT:
        return f"moe_out: {rows} rows (the kernel takes up to {kernel.MAX_ROWS_OUT})"
    if shared is None or shared[2] is not None or _block(shared[1], 1) is None or len(acc.users) != 1:
        return "moe_out: the accumulator is not the shared experts' down-projection block (read once)"
    latent_block = _block(normed, 1)
    if latent_block is None:
        return "moe_out: the up-projection does not read a column block of the latent"
    (w_down, d0, dw), (w_u, l0, lw) = _block(shared[1], 1), _block(w_up, 1)
    shard_d = _shard(d0, dw, w_down.meta["val"].shape[1])
    shard_l = _shard(l0, lw, w_u.meta["val"].shape[1])
    if shard_d is None or shard_d != shard_l or latent_block[1:] != (l0, lw):
        return "moe_out: the down, latent and up blocks are not the same rank's block"
    return SimpleNamespace(tail=tail, h=shared[0], normed=latent_block[0], w_down=w_down, w_up=w_u, shard=shard_d)


def lower(g: fx.Graph, b: SimpleNamespace) -> list[tuple[fx.Node, str]]:
    """Replace the bound pieces (those that bound); the new nodes and their kind."""
    new, renamed = [], {}
    if not isinstance(b.into, str):
        p = b.into
        order = {n: i for i, n in enumerate(g.nodes)}
        first = min((p.router, p.latent, p.gate, p.up), key=order.__getitem__)
        w_router, w_latent = (match_gemm(n)[1] for n in (p.router, p.latent))
        olds = {0: p.router, 1: p.latent, 2: p.h}
        routing = ()
        if p.route is not None:  # its (weights, ids) getitems become moe_in's 3 and 4
            routing = p.route.args[1:]
            olds.update({3 + u.args[1]: u for u in p.route.users})
        with g.inserting_before(first):
            call = g.call_function(kk.moe_in.default, (b.x, w_router, w_latent, p.w_gu, *p.shard, p.beta,
                                                       p.linear_beta, *routing))
            outs = {i: g.call_function(operator.getitem, (call, i)) for i in olds}
        vals = [p.router, p.latent, p.h] + ([] if p.route is None else list(p.route.meta["val"]))
        call.meta["val"] = tuple(v.meta["val"] if isinstance(v, fx.Node) else v for v in vals)
        for i, old in olds.items():
            outs[i].meta["val"] = old.meta["val"]
            old.replace_all_uses_with(outs[i])
            renamed[old] = outs[i]
        new.append((call, "moe_in_routed" if routing else "moe_in"))
    if not isinstance(b.out, str):
        p = b.out
        with g.inserting_before(p.tail):
            call = g.call_function(kk.moe_out.default, (renamed.get(p.h, p.h), p.normed, p.w_down, p.w_up, *p.shard))
        call.meta["val"] = p.tail.meta["val"]
        p.tail.replace_all_uses_with(call)
        new.append((call, "moe_out"))
    return new
