"""A MoE layer's non-expert work on one rank at Kimi K3 shapes, in the hybrid step's row
shard vs ``sharded_moe``'s layout (issue 19, item 3), on one GPU.

Per MoE layer and rank, at T rows of the step and G ranks:

* ``row_shard`` (hybrid_attention alone): c = ceil(T / G) rows; router (896 x 7168, fp32
  logits, top-16), latent down (3584 x 7168), shared experts (gate_up 12288 x 7168, SiTU,
  down 7168 x 6144), the post-expert RMSNorm and the up-projection (7168 x 3584) added
  to the shared output: every weight read whole;
* ``sharded``: T rows; router and latent down whole; the shared experts' gate and up
  row blocks (2 x 768 x 7168 at G = 8), the down-projection's and the up-projection's
  column blocks (7168 x 768, 7168 x 448), read as views, as the pass emits them.

The routed experts are not timed: in both layouts a rank runs its own experts on every
row's pairs (the EP dispatch gathers all rows; the sharded layer has them), the same
work. Collectives are not timed either (one GPU): the row shard has three per layer
(EP dispatch all-gather, combine reduce-scatter, output all-gather), the sharded layer
two all-reduces; ``kernels_and_limits.md`` 1.3 has their measured 2 x H200 latencies.
Each layout is one function compiled by Inductor (``torch.compile``, same settings for
both) and timed in a CUDA graph (``common.graph_time_us``); the floor is its weight
bytes at 4.28 TB/s. A third column, ``kimi``: the sharded layer as ``lower_kernels``
emits it (``kimi_kernels.moe_in`` with the expert choice / ``moe_out`` within their row
limits, else the GEMMs as the pass leaves them and ``kimi_kernels.select_experts``; the
latent RMSNorm compiled by Inductor), its output checked against the sharded form's.
``--sweep`` also times the ops' configurations alone (moe_in with and without the
choice; past 4 rows its Triton form, without it) and the ops each replaces; ``--profile``
lists the kimi layer's kernels. ``KIMI_INDUCTOR_MOE_IN_ROWS=4`` takes moe_in's Triton form
past 4 rows away from the kimi layer, as from lower_kernels (the A/B of session 12).

    python benchmarks/moe_sharding.py --rows 1 2 8 32 64 --ranks 8 --sweep --profile --json X
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, floor_us, graph_time_us  # noqa: E402
from step_breakdown import kernel_table  # noqa: E402

from kimi_inductor.kernels import moe_projections, moe_router, skinny_gemm  # noqa: E402
from kimi_inductor.stock.config import KimiK3Config  # noqa: E402
from kimi_inductor.stock.layers import situ_and_mul  # noqa: E402
from kimi_inductor.stock.attn_res import rms_norm  # noqa: E402
from kimi_inductor.stock.moe import router_logits, select_experts  # noqa: E402


def layer(x, y, w, cfg, shared_cols=None, latent_cols=None):
    """The MoE's non-expert work on rows x [R, H] with expert output y [R, L]; with
    column blocks: this rank's partial output (``sharded_moe``'s form)."""
    logits = router_logits(x, w["gate"])
    weights, ids = select_experts(logits, w["bias"], cfg.num_experts_per_token, cfg.moe_renormalize,
                                  cfg.routed_scaling_factor)
    z = x @ w["down"].t()
    gu = w["gate_up"]
    if shared_cols is None:
        h = situ_and_mul(x @ gu.t(), cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
        shared = h @ w["shared_down"].t()
        return torch.addmm(shared, rms_norm(y, w["norm"], cfg.rms_norm_eps), w["up"].t()), z, weights, ids
    a, b = shared_cols
    D = gu.shape[0] // 2
    h = situ_and_mul(torch.cat([x @ gu[a:b].t(), x @ gu[D + a:D + b].t()], 1), cfg.activation_situ_beta,
                     cfg.activation_situ_linear_beta)
    shared = h @ w["shared_down"][:, a:b].t()
    la, lb = latent_cols
    normed = rms_norm(y, w["norm"], cfg.rms_norm_eps)[:, la:lb]
    return torch.addmm(shared, normed, w["up"][:, la:lb].t()), z, weights, ids


def _gemm(x, weight, out_dtype):
    """A GEMM as lower_kernels leaves it: ``skinny_mm`` where ``skinny_gemm.choose`` picks
    one of ours, else the aten op."""
    if skinny_gemm.choose(x.shape[0], weight.shape[0], x.shape[1], x.dtype)[0] != "cublas":
        return torch.ops.kimi_kernels.skinny_mm(x, weight, None, out_dtype)
    return router_logits(x, weight) if out_dtype == torch.float32 else x @ weight.t()


def projections_in(x, w, cfg, shard, shards, fused):
    """(logits, z, h, weights, ids): ``moe_in`` with the routing, or the ops lower_kernels
    emits without it (``select_experts`` on the GEMM's logits)."""
    situ = (cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    route = (w["bias"], cfg.num_experts_per_token, cfg.moe_renormalize, cfg.routed_scaling_factor)
    if fused:
        return torch.ops.kimi_kernels.moe_in(x, w["gate"], w["down"], w["gate_up"], shard, shards, *situ, *route)
    D = w["gate_up"].shape[0] // 2
    a, width = moe_projections.blocks(D, shard, shards)
    h = situ_and_mul(torch.cat([x @ w["gate_up"][a:a + width].t(), x @ w["gate_up"][D + a:D + a + width].t()], 1),
                     *situ)
    logits = _gemm(x, w["gate"], torch.float32)
    return logits, _gemm(x, w["down"], x.dtype), h, *torch.ops.kimi_kernels.select_experts(logits, *route)


def projections_out(h, normed, w, shard, shards, fused):
    op = torch.ops.kimi_kernels.moe_out if fused else moe_projections.moe_out_reference
    return op(h, normed, w["shared_down"], w["up"], shard, shards)


def kimi_layer(x, y, w, cfg, shard, shards):
    """The sharded layer as lower_kernels emits it (rank ``shard`` of ``shards``)."""
    M = x.shape[0]
    logits, z, h, weights, ids = projections_in(x, w, cfg, shard, shards, M <= moe_projections.max_rows_in())
    normed = rms_norm(y, w["norm"], cfg.rms_norm_eps)
    out = projections_out(h, normed, w, shard, shards, M <= moe_projections.MAX_ROWS_OUT)
    return out, z, weights, ids


def sweep(res, x, y, w, cfg, G):
    """Each op alone over its configurations (rank 0's blocks), and the ops it replaces
    (compiled by Inductor), per row count."""
    from kimi_inductor.kernels.skinny_gemm import cute_gemv

    situ = (cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    M = x.shape[0]
    chosen_warps = moe_router.WARPS
    h = x[:, :w["shared_down"].shape[1] // G].contiguous()
    rows = []
    route = (w["bias"], cfg.num_experts_per_token, cfg.moe_renormalize, cfg.routed_scaling_factor)
    routing = cute_gemv.Routing(w["gate"].shape[0], *route[1:])
    pdl = bool(moe_router.pdl(x.device)["PDL"])
    if M <= moe_projections.MAX_ROWS_IN and not skinny_gemm.cute_available():
        base = cute_gemv.moe_in_config(M)
        for c in [base._replace(split=sp) for sp in (1, 2, 4)]:  # the router's K split
            if cute_gemv.moe_in_supported(M, x.shape[1], routing.experts, w["down"].shape[0],
                                          w["gate_up"].shape[0] // 2 // G, c):
                continue
            for routed in (routing, None) if c == base else (routing,):
                t = graph_time_us(lambda i: cute_gemv.run_moe_in(x, w["gate"], w["down"], w["gate_up"], 0, G, situ,
                                                                 w["bias"], routed, pdl, c), calls=10, replays=5)
                rows.append(dict(op="moe_in" + (" routed" if routed else ""), config=list(c), us=t))
    if M > moe_projections.MAX_ROWS_IN:  # the Triton form, then select_experts (as the op runs it)
        rows.append(dict(op="moe_in triton", us=graph_time_us(
            lambda i: torch.ops.kimi_kernels.select_experts(
                moe_projections.run_in(x, w["gate"], w["down"], w["gate_up"], 0, G, *situ)[0], *route),
            calls=10, replays=5)))
    unfused = torch.compile(lambda x: projections_in(x, w, cfg, 0, G, False), dynamic=False)
    rows.append(dict(op="moe_in replaced ops", us=graph_time_us(lambda i: unfused(x), calls=10, replays=5)))
    for bn in (32, 64):
        for bk in (128, 256):
            for stages in (2, 3):
                c = dict(BM=max(16, 1 << (M - 1).bit_length()), BN=bn, BK=bk, num_warps=4, num_stages=stages)
                t = graph_time_us(lambda i: moe_projections._run_out(h, y, w["shared_down"], w["up"], 0, G, c),
                                  calls=10, replays=5)
                rows.append(dict(op="moe_out", config=c, us=t))
    unfused = torch.compile(lambda h, y: projections_out(h, y, w, 0, G, False), dynamic=False)
    rows.append(dict(op="moe_out replaced ops", us=graph_time_us(lambda i: unfused(h, y), calls=10, replays=5)))
    logits = torch.randn(M, w["gate"].shape[0], device=x.device)
    for warps in (1, 2, 4):
        moe_router.WARPS = warps
        rows.append(dict(op="select_experts", config=dict(num_warps=warps), us=graph_time_us(
            lambda i: torch.ops.kimi_kernels.select_experts(logits, *route), calls=10, replays=5)))
    moe_router.WARPS = chosen_warps
    stock = torch.compile(lambda l: select_experts(l, *route), dynamic=False)
    rows.append(dict(op="select_experts replaced ops", us=graph_time_us(lambda i: stock(logits), calls=10, replays=5)))
    best = {op: min((r for r in rows if r["op"] == op), key=lambda r: r["us"])
            for op in {r["op"] for r in rows}}
    res.add(rows=M, sweep_best=best, sweep=sorted(rows, key=lambda r: (r["op"], r["us"])), echo=False)
    print(M, best, flush=True)


def partial_sum_error(x, y, w, cfg, G) -> float:
    """Largest row error of the G ranks' partial outputs summed (what the all-reduce
    computes) against the unsharded layer on the same rows (both bf16)."""
    D, L = w["gate_up"].shape[0] // 2 // G, w["up"].shape[1] // G
    full = layer(x, y, w, cfg)[0].float()
    summed = sum(layer(x, y, w, cfg, (r * D, (r + 1) * D), (r * L, (r + 1) * L))[0].float() for r in range(G))
    return float(((summed - full).norm(dim=-1) / full.norm(dim=-1)).max())


def main(argv=None) -> Results:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 32, 64])
    p.add_argument("--ranks", type=int, default=8, help="G, the TP group")
    p.add_argument("--sweep", action="store_true", help="also time moe_in / moe_out configurations alone")
    p.add_argument("--profile", action="store_true", help="also list the kimi layer's kernels per row count")
    p.add_argument("--json")
    args = p.parse_args(argv)
    cfg = KimiK3Config.preset("kimi-k3")
    H, L, E = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.num_experts
    D = cfg.moe_intermediate_size * cfg.num_shared_experts
    G = args.ranks
    gen = torch.Generator(device="cuda").manual_seed(0)

    def proj(n, k):
        return (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).bfloat16()

    w = dict(gate=proj(E, H), bias=torch.randn(E, generator=gen, device="cuda") * 0.1, down=proj(L, H),
             gate_up=proj(2 * D, H), shared_down=proj(H, D), up=proj(H, L),
             norm=torch.ones(L, dtype=torch.bfloat16, device="cuda"))
    whole = sum(t.numel() * t.element_size() for k, t in w.items() if k != "norm")
    sharded_bytes = whole - (w["gate_up"].nbytes + w["shared_down"].nbytes + w["up"].nbytes) * (G - 1) // G
    row_shard = torch.compile(lambda x, y: layer(x, y, w, cfg), dynamic=False)
    r, Ds, Ls = 0, D // G, L // G
    sharded = torch.compile(lambda x, y: layer(x, y, w, cfg, (r * Ds, (r + 1) * Ds), (r * Ls, (r + 1) * Ls)),
                            dynamic=False)
    kimi = torch.compile(lambda x, y: kimi_layer(x, y, w, cfg, r, G), dynamic=False)
    res = Results("moe_sharding")
    res.meta.update(ranks=G, hidden=H, latent=L, shared_width=D, router_experts=E,
                    weight_bytes=dict(row_shard=whole, sharded=sharded_bytes))
    for T in args.rows:
        c = math.ceil(T / G)
        xs = {n: torch.randn(n, H, generator=gen, device="cuda").bfloat16() for n in (c, T)}
        ys = {n: torch.randn(n, L, generator=gen, device="cuda").bfloat16() for n in (c, T)}
        with torch.no_grad():
            t_row = graph_time_us(lambda i: row_shard(xs[c], ys[c]), calls=10, replays=5)
            t_sh = graph_time_us(lambda i: sharded(xs[T], ys[T]), calls=10, replays=5)
            t_kimi = graph_time_us(lambda i: kimi(xs[T], ys[T]), calls=10, replays=5)
            err = partial_sum_error(xs[T], ys[T], w, cfg, G)
            want, got = sharded(xs[T], ys[T]), kimi(xs[T], ys[T])
            kimi_err = float(((got[0] - want[0]).float().norm(dim=-1) / want[0].float().norm(dim=-1)).max())
            same_ids = bool(torch.equal(got[3].sort(-1).values, want[3].sort(-1).values))
        fl_row, fl_sh = floor_us(whole), floor_us(sharded_bytes)
        res.add(rows=T, shard_rows=c, row_shard_us=t_row, sharded_us=t_sh, ratio=t_sh / t_row,
                row_shard_floor_us=fl_row, sharded_floor_us=fl_sh, row_shard_x_floor=t_row / fl_row,
                sharded_x_floor=t_sh / fl_sh, partial_sum_rel_err=err, kimi_us=t_kimi, kimi_x_floor=t_kimi / fl_sh,
                kimi_vs_row_shard=t_kimi / t_row, kimi_rel_err=kimi_err, kimi_same_experts=same_ids)
        if args.sweep:
            sweep(res, xs[T], ys[T], w, cfg, G)
        if args.profile:
            res.add(rows=T, kimi_kernels_us=kernel_table(lambda: kimi(xs[T], ys[T])), echo=False)
            print(T, res.rows[-1]["kimi_kernels_us"], flush=True)
    if args.json:
        res.dump(args.json)
    return res


if __name__ == "__main__":
    main()
