"""The routed experts of one Kimi K3 MoE layer on one rank (latent 3584, expert FFN 3072,
bf16 weights, top-16), at c rows per rank:

* ours: ``kimi_kernels.expert_ffn`` (grouped Triton kernel), inside a CUDA graph, for
  a sweep of slab widths BN;
* stock loop: the stock expert loop (``combine_experts``: one pair of GEMMs per expert
  that got rows); data-dependent shapes and host synchronisation, so it runs eagerly;
* Inductor + graph: the capturable form of the stock math (every local expert on every
  row, routing weight 0 where not routed: batched GEMMs), compiled by Inductor and
  captured in the CUDA graph;
* floor: the weights of the experts that got a pair, plus activations, at 4.28 TB/s;
* ``--mxfp4``: ours on MXFP4 experts (``expert_ffn`` with scales; 4.25 bits per
  weight) against the floor of those bytes, its error against ours on the dequantised
  experts, and (EP 8 shapes) Inductor on the MXFP4 experts: every local expert
  dequantised, then the capturable dense math, compiled and captured.

``--experts 112`` is a rank of EP 8 (it runs the 16 c (token, expert) pairs of the
group's 8 c rows that hit its experts, i.e. as many as c rows with 16 local experts
each); ``--experts 896`` is EP 1.

    python benchmarks/moe_experts.py --experts 112 896 --rows 1 8 32 64 --json moe_experts.json [--mxfp4]
    python benchmarks/moe_experts.py --experts 64 --rows 8 32 64 128 --bm 16 32 64 --skew 1  # BM rule
    python benchmarks/moe_experts.py --smoke     # CPU, tiny shapes: checks the script runs
    python benchmarks/moe_experts.py --plot moe_experts.json moe_experts.png
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, floor_us, graph_time_us  # noqa: E402

from kimi_inductor.kernels import expert_ffn as X  # noqa: E402
from kimi_inductor.kernels import expert_mxfp4 as MX  # noqa: E402
from kimi_inductor.kernels.skinny_gemm import cute_available  # noqa: E402
from kimi_inductor.stock.layers import situ_and_mul  # noqa: E402
from kimi_inductor.stock.mxfp4 import dequantize_experts  # noqa: E402

BETA, LINEAR_BETA = 4.0, 25.0


def dense_experts(latent, weights, ids, w13, w2, beta=BETA, linear_beta=LINEAR_BETA):
    """Every expert on every row, weighted by a dense [T, E] routing matrix (capturable)."""
    route = torch.zeros(latent.shape[0], w13.shape[0], device=latent.device).scatter_(1, ids.long(), weights)
    h = torch.matmul(latent, w13.transpose(1, 2))  # [E, T, 2I]
    y = torch.matmul(situ_and_mul(h, beta, linear_beta), w2.transpose(1, 2))  # [E, T, L]
    return (y.float() * route.t()[:, :, None]).sum(0)


def dequant_dense(latent, weights, ids, q13, q2, s13, s2):
    return dense_experts(latent, weights, ids, dequantize_experts(q13, s13), dequantize_experts(q2, s2))


def routing(rows: int, experts: int, top_k: int, gen: torch.Generator, device, skew: float = 0.0):
    """(ids, weights): top_k distinct experts per row, uniform, or with ``skew`` > 0 the
    top_k of random logits plus a per-expert bias of std ``skew`` (hot experts)."""
    if skew:
        logits = torch.randn(rows, experts, generator=gen) + skew * torch.randn(experts, generator=gen)
        ids = torch.topk(logits, top_k, dim=1).indices.int()
    else:
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(rows)]).int()
    weights = torch.rand(rows, top_k, generator=gen)
    return ids.to(device), (weights / weights.sum(1, keepdim=True)).to(device)


def eager_time_us(fn, iters: int = 5) -> float:
    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def plot(json_path: str, png: str) -> None:
    """Time against rows per expert count: ours MXFP4 (both kernels) / bf16, Inductor, both
    byte floors."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.load(open(json_path))["rows"]
    counts = sorted({r["experts"] for r in rows})
    fig, axes = plt.subplots(1, len(counts), figsize=(5.5 * len(counts), 4), squeeze=False)
    series = (("mxfp4_mma_us", "o-", "ours, MXFP4 (SM90 CuTe DSL, mma.sync)"),
              ("mxfp4_triton_us", "D-", "ours, MXFP4 (Triton WGMMA)"), ("ours_us", "s-", "ours, bf16"),
              ("inductor_dequant_dense_us", "^-", "Inductor: dequantise + dense"),
              ("mxfp4_floor_us", "k--", "MXFP4 byte floor"), ("floor_us", "k:", "bf16 byte floor"))
    for ax, E in zip(axes[0], counts):
        rs = [r for r in rows if r["experts"] == E]
        for key, style, label in series:
            if all(key in r for r in rs):
                ax.plot([r["rows"] for r in rs], [r[key] for r in rs], style, label=label)
        ax.set(xscale="log", yscale="log", xlabel="rows", ylabel="us", title=f"routed experts, {E} local, H200")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> Results:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, nargs="+", default=[112, 896])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--bn", type=int, nargs="+", default=[32, 64])
    p.add_argument("--bm", type=int, nargs="+", default=[],
                   help="also time these pair blocks BM (default: the rule, expert_ffn.block_rows)")
    p.add_argument("--full-grid", action="store_true",
                   help="also time our bf16 kernel with programs for every local expert (grouped(compact=False))")
    p.add_argument("--skew", type=float, default=0.0, help="routing skew: per-expert logit bias std (0: uniform)")
    p.add_argument("--mxfp4", action="store_true", help="also our kernel on MXFP4 experts (random codes and scales)")
    p.add_argument("--mxfp4-tiles", nargs="+", default=["64,256,4,1", "64,128,4,3"],
                   help="MXFP4 tiles to time, each BN,BK,num_warps,num_stages[,maxnreg[,prefetch[,compact]]] (maxnreg "
                        "0: no register cap, left out: the kernel's default; prefetch: L2 prefetch distance in K "
                        "steps; compact 0: programs for every local expert)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, no timing")
    p.add_argument("--json")
    p.add_argument("--plot", nargs=2, metavar=("JSON", "PNG"), help="only plot an --mxfp4 run's JSON (matplotlib)")
    args = p.parse_args(argv)
    if args.plot:
        return plot(*args.plot)
    device = "cpu" if args.smoke else "cuda"
    L, I, top_k = (64, 32, 4) if args.smoke else (3584, 3072, 16)
    experts = [8] if args.smoke else args.experts
    gen = torch.Generator().manual_seed(0)
    # one allocation of the largest expert count; smaller counts use its first experts
    E_max = max(experts)
    w13 = torch.empty(E_max, 2 * I, L, dtype=torch.bfloat16, device=device).normal_(0, L**-0.5)
    w2 = torch.empty(E_max, L, I, dtype=torch.bfloat16, device=device).normal_(0, I**-0.5)
    expert_bytes = (w13[0].numel() + w2[0].numel()) * 2
    if args.mxfp4:  # the checkpoint's layout: two E2M1 codes per byte, one E8M0 scale per 32 values
        q13, q2 = (torch.randint(0, 256, (*w.shape[:2], w.shape[2] // 2), dtype=torch.uint8, device=device)
                   for w in (w13, w2))
        s13, s2 = (torch.randint(120, 128, (*w.shape[:2], w.shape[2] // 32), dtype=torch.uint8, device=device)
                   for w in (w13, w2))
        mx_bytes = expert_bytes // 4 + expert_bytes // 32
        mma = None if args.smoke or cute_available() else (MX.mma_layout(q13, s13, True), MX.mma_layout(q2, s2, False))
    dense = torch.compile(dense_experts, dynamic=False)
    inductor_dequant = torch.compile(dequant_dense, dynamic=False)
    res = Results("moe_experts")
    for E in experts:
        for rows in args.rows:
            ids, weights = routing(rows, E, top_k, gen, device, args.skew)
            latent = torch.randn(rows, L, generator=gen).to(device=device, dtype=torch.bfloat16)
            a = (latent, weights, ids, w13[:E], w2[:E])
            want = X.reference(*a, BETA, LINEAR_BETA)
            got = torch.ops.kimi_kernels.expert_ffn(*a, BETA, LINEAR_BETA)
            err = float(((got - want).norm(dim=1) / want.norm(dim=1)).max())
            if args.smoke:
                res.add(experts=E, rows=rows, rel_err=err)
                continue
            active = int(torch.unique(ids).numel())
            fl = floor_us(active * expert_bytes + rows * L * (2 + 4))
            row = dict(experts=E, rows=rows, active_experts=active, skew=args.skew,
                       max_pairs=int(torch.bincount(ids.flatten().long()).max()),
                       block_rows=X.block_rows(ids.numel(), E), floor_us=fl, rel_err=err)
            for bm in args.bm:
                row[f"ours_bm{bm}_us"] = graph_time_us(lambda i: X.grouped(*a, BETA, LINEAR_BETA, BM=bm), calls=5,
                                                       replays=5)
            for bn in args.bn:
                t = graph_time_us(lambda i: X.grouped(*a, BETA, LINEAR_BETA, BN=bn), calls=5, replays=5)
                row[f"ours_bn{bn}_us"] = t
                if args.full_grid:
                    row[f"ours_bn{bn}_full_grid_us"] = graph_time_us(
                        lambda i: X.grouped(*a, BETA, LINEAR_BETA, BN=bn, compact=False), calls=5, replays=5)
            best = min(row[f"ours_bn{bn}_us"] for bn in args.bn)
            row["ours_us"], row["ours_of_ceiling"] = best, fl / best
            if args.mxfp4:
                mx = (latent, weights, ids, q13[:E], q2[:E])
                scales = (s13[:E], s2[:E])
                if E <= 128:  # against our bf16 kernel on the dequantised experts (the same bf16 weights)
                    deq = (dequantize_experts(q13[:E], s13[:E]), dequantize_experts(q2[:E], s2[:E]))
                    mine, bf16 = (X.grouped(*mx, BETA, LINEAR_BETA, *scales),
                                  X.grouped(latent, weights, ids, *deq, BETA, LINEAR_BETA))
                    row["mxfp4_rel_err"] = float(((mine - bf16).norm(dim=1) / bf16.norm(dim=1)).max())
                    del deq
                for tile in args.mxfp4_tiles:
                    bn, bk, w, st, *cap = map(int, tile.split(","))
                    cap, ahead, compact = (cap + [None, None, 1])[:3]
                    row[f"mxfp4_{tile.replace(',', '_')}_us"] = graph_time_us(
                        lambda i: X.grouped(*mx, BETA, LINEAR_BETA, *scales, BN=bn, BK=bk, num_warps=w, num_stages=st,
                                            maxnreg=cap, prefetch=ahead, compact=bool(compact)), calls=5, replays=5)
                if E <= 128:  # Inductor: dequantise every local expert, then the capturable dense math
                    row["inductor_dequant_dense_us"] = graph_time_us(lambda i: inductor_dequant(*mx, *scales), calls=2,
                                                                     replays=3)
                row["mxfp4_us"] = min(row[f"mxfp4_{t.replace(',', '_')}_us"] for t in args.mxfp4_tiles)
                if mma is not None:  # the SM90 CuTe DSL kernels on the same experts in their MMA layout
                    (c13, t13), (c2, t2) = mma
                    kw = (latent, weights, ids, c13[:E], c2[:E], BETA, LINEAR_BETA, t13[:E], t2[:E])
                    ref = X.grouped(*mx, BETA, LINEAR_BETA, *scales)
                    row["mxfp4_mma_rel_err"] = float(((X.mma_grouped(*kw) - ref).norm(dim=1)
                                                      / ref.norm(dim=1)).max())
                    row["mxfp4_mma_us"] = graph_time_us(lambda i: X.mma_grouped(*kw), calls=5, replays=5)
                    row["mxfp4_triton_us"] = row["mxfp4_us"]
                    row["mxfp4_us"] = min(row["mxfp4_us"], row["mxfp4_mma_us"])
                row["mxfp4_floor_us"] = floor_us(active * mx_bytes + rows * L * (2 + 4))
                row["mxfp4_of_ceiling"] = row["mxfp4_floor_us"] / row["mxfp4_us"]
                row["mxfp4_speedup"] = best / row["mxfp4_us"]
            row["stock_loop_eager_us"] = eager_time_us(lambda: X.reference(*a, BETA, LINEAR_BETA))
            row["inductor_dense_us"] = graph_time_us(lambda i: dense(*a), calls=2, replays=3)
            row["dense_floor_us"] = floor_us(E * expert_bytes)
            res.add(**row)
    if args.json:
        res.dump(args.json)
    return res


if __name__ == "__main__":
    main()
