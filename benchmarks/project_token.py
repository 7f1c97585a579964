"""Project the 93-layer Kimi K3 decode token at TP 8 / EP 8, and at the seed's DCP 8 x EP 32,
from measured pieces (issue 19, item 2). CPU only: reads the committed H200 results,
prints the arithmetic.

Per rank and layer, at R rows (q = 1):

    attention   KDA or MLA layer step as main runs it (PDL on every kernel, the GEMV
                releasing at exit: ``kda_layer_q1_h200_v11`` at 1 / 2 / 8 rows, else
                ``_v10_noprefetch`` / ``_v10``; MLA with one-step chunks and the per-head GEMMs:
                ``mla_layer_h200_v8``)
    AttnRes     2 fused calls (``attn_res_h200_v2``: the median over 1-7 saved blocks)
    MoE         non-expert work (``moe_sharding_h200_v5`` at 1 / 2 / 4 rows, else ``_v4``): the row shard, the
                sharded layer as Inductor compiles it, or as lower_kernels runs it
                (``kimi_us``: moe_in with the expert choice, moe_out)
    experts     the slowest rank's experts: E[max over the 8 EP ranks of the distinct
                experts R rows pick there] (uniform top-16 of 896, simulated) x our
                grouped kernel's time per active expert at EP 8 shapes
                (``moe_experts_h200_v1``, 112 local experts; ``main_mxfp4``: the same
                with the checkpoint's MXFP4 experts on the SM90 CuTe DSL kernel,
                ``moe_experts_mxfp4_mma_h200_v5``)
    collectives NCCL in CUDA graphs, measured on 2 x H200 (kernels_and_limits.md 1.3;
                TP 8 not measured): attention all-reduce + the MoE's (row shard: EP
                dispatch all-gather, combine reduce-scatter, output all-gather; sharded:
                two all-reduces)

Token = 68 KDA + 24 MLA MoE layers + layer 0 (KDA, dense MLP at its TP 8 byte floor);
the embedding, final norm and LM head are left out. ``row_shard`` is main before
sharded_moe (17965bb); ``sharded`` is sharded_moe with its projections on Inductor (main
before the projection kernels); ``main`` is main now (bf16 experts); ``main_mxfp4`` is
main now with the released checkpoint's MXFP4 experts.

DCP 8 x EP 32 (``-tp 8 -dcp 8 -dp 4``: four TP 8 groups of R rows each, the experts over
all 32 ranks, 28 each), per rank and layer, the same pieces but:

    attention   MLA: + DCP's query all-gather, LSE all-gather and reduce-scatter over heads
                (intra-node); its core assumed as fast as DCP 1's (the same heads x positions)
    experts     the slowest of 32 ranks over the 4 R rows of all groups
    MoE         ``dp_row_shard``: the row shard (past sharded_moe's rows), its dispatch
                all-gather and combine reduce-scatter over the 32 ranks; ``dp_sharded``:
                sharded_moe's DP form, within each TP group, the routed experts' rows
                all-gathered over the 4 DP peers of a TP index and their fp32 partials
                reduce-scattered back
    inter-node  an unmeasured assumption: ``--internode-us`` (default 25: twice the 2-GPU
                NCCL latency) + the bytes that leave the node at 48 GB/s per GPU (DeepEP
                V1's published low-latency RDMA bandwidth at EP 32, H800 with CX7 400 Gb/s)

    python benchmarks/project_token.py [--json X] [--plot PNG] [--internode-us 25]

``--plot``: where a KDA MoE layer's time goes (attention, AttnRes, MoE non-expert,
experts, collectives) per row count: row shard, sharded (Inductor projections), main.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

RESULTS = os.path.join(os.path.dirname(__file__), "..", "docs", "results")
COLLECTIVE_US = {1: 12.6, 8: 12.6, 64: 19.0}  # 2 x H200, rows of 7168 bf16 (all-reduce / -gather / RS mean)
HBM = 4.28e12
RDMA = 48e9  # bytes/s per GPU off the node (DeepEP V1 low-latency dispatch at EP 32, published)
ROW = 7168 * 2  # one bf16 hidden row


def _rows(name: str) -> list[dict]:
    with open(os.path.join(RESULTS, name)) as fh:
        return json.load(fh)["rows"]


def _at(rows: list[dict], R: int, key: str, **match) -> float:
    vals = [r[key] for r in rows if key in r and r.get("rows") == R and all(r.get(k) == v for k, v in match.items())]
    if not vals:
        raise KeyError(f"no {key} at {R} rows {match}")
    return statistics.median(vals)


def _first(R: int, key: str, *names: str, **match) -> float:
    """``_at`` in the first of ``names`` that has R rows."""
    for name in names:
        try:
            return _at(_rows(name), R, key, **match)
        except KeyError:
            pass
    raise KeyError(f"no {key} at {R} rows in {names}")


def slowest_rank_experts(R: int, experts: int = 896, top_k: int = 16, ranks: int = 8, trials: int = 2000) -> float:
    g = torch.Generator().manual_seed(0)
    per = experts // ranks
    most = [torch.bincount(torch.unique(torch.stack([torch.randperm(experts, generator=g)[:top_k]
                                                     for _ in range(R)])) // per, minlength=ranks).max().item()
            for _ in range(trials)]
    return sum(most) / trials


def internode_us(latency_us: float, rows_off_node: float, row_bytes: int = ROW) -> float:
    return latency_us + rows_off_node * row_bytes / RDMA * 1e6


def dcp8_ep32(R: int, pieces: dict, moe: dict, per_expert: float, per_expert_mxfp4: float,
              latency_us: float) -> dict:
    """The token at DCP 8 x EP 32 from the TP 8 pieces (module docstring)."""
    tp, dp = 8, 4
    coll = pieces["collective_us"]
    slowest = slowest_rank_experts(dp * R, ranks=tp * dp)
    c = -(-R // tp)  # a rank's row shard
    dispatch = internode_us(latency_us, (tp * dp - tp) * c)  # all-gather over 32 ranks, 24 of them off the node
    exchanges = {"dp_row_shard": (moe["row_shard"], 2 * dispatch + coll),  # + the output's all-gather in TP
                 "dp_sharded": (moe["kimi"], internode_us(latency_us, (dp - 1) * R)
                                + internode_us(latency_us, (dp - 1) * R, 2 * ROW) + 2 * coll)}
    mla = pieces["mla_attention_us"] + 3 * coll
    out = dict(slowest_rank_experts=slowest, mla_attention_us=mla, internode_latency_us=latency_us)
    for name, (nonexpert, moe_coll) in exchanges.items():
        for suffix, us_per_expert in (("", per_expert), ("_mxfp4", per_expert_mxfp4)):
            ex = us_per_expert * slowest
            moe_layer = pieces["attn_res_us"] + nonexpert + ex + coll + moe_coll
            token = (68 * (pieces["kda_attention_us"] + moe_layer) + 24 * (mla + moe_layer)
                     + pieces["kda_attention_us"] + pieces["attn_res_us"] + pieces["dense_mlp_us"] + coll)
            out[name + suffix] = dict(moe_nonexpert_us=nonexpert, experts_us=ex, collectives_us=coll + moe_coll,
                                      kda_layer_us=pieces["kda_attention_us"] + moe_layer,
                                      mla_layer_us=mla + moe_layer, token_ms=token / 1e3, tokens_per_s=1e6 / token)
    return out


def project(R: int, internode_latency_us: float = 25.0) -> dict:
    kda = _first(R, "kimi_us", "kda_layer_q1_h200_v11.json", "kda_layer_q1_h200_v10_noprefetch.json",
                 "kda_layer_q1_h200_v10.json", q=1)
    mla = _at(_rows("mla_layer_h200_v8.json"), R, "kimi_us", q=1)
    attn_res = 2 * _at(_rows("attn_res_h200_v2.json"), R, "ours_us")
    moe = {layout: _first(R, f"{layout}_us", "moe_sharding_h200_v5.json", "moe_sharding_h200_v4.json")
           for layout in ("row_shard", "sharded", "kimi")}
    ex = [r for r in _rows("moe_experts_h200_v1.json") if r["experts"] == 112 and r["rows"] == R]
    per_expert = ex[0]["ours_us"] / ex[0]["active_experts"]
    mx = [r for r in _rows("moe_experts_mxfp4_mma_h200_v5.json") if r["experts"] == 112 and r["rows"] == R]
    per_expert_mxfp4 = mx[0]["mxfp4_mma_us"] / mx[0]["active_experts"]  # the SM90 CuTe DSL kernel
    slowest = slowest_rank_experts(R)
    experts = per_expert * slowest
    coll = COLLECTIVE_US[R]
    dense_mlp = 3 * 7168 * (18432 // 8) * 2 / HBM * 1e6  # layer 0's TP 8 dense MLP at its byte floor
    out = dict(rows=R, kda_attention_us=kda, mla_attention_us=mla, attn_res_us=attn_res, experts_us=experts,
               slowest_rank_experts=slowest, us_per_expert=per_expert, us_per_expert_mxfp4=per_expert_mxfp4,
               collective_us=coll, dense_mlp_us=dense_mlp)
    for name, layout, moe_collectives, ex_us in (("row_shard", "row_shard", 3, experts),
                                                 ("sharded", "sharded", 2, experts),
                                                 ("main", "kimi", 2, experts),
                                                 ("main_mxfp4", "kimi", 2, per_expert_mxfp4 * slowest)):
        moe_layer = attn_res + moe[layout] + ex_us + (1 + moe_collectives) * coll
        token = 68 * (kda + moe_layer) + 24 * (mla + moe_layer) + kda + attn_res + dense_mlp + coll
        out[name] = dict(moe_nonexpert_us=moe[layout], experts_us=ex_us, collectives_us=(1 + moe_collectives) * coll,
                           kda_layer_us=kda + moe_layer, mla_layer_us=mla + moe_layer,
                           token_ms=token / 1e3, tokens_per_s=1e6 / token)
    out["speedup"] = out["row_shard"]["token_ms"] / out["main"]["token_ms"]
    out["dcp8_ep32"] = dcp8_ep32(R, out, moe, per_expert, per_expert_mxfp4, internode_latency_us)
    return out


def plot(rows: list[dict], png: str) -> None:
    """Stacked bars: a KDA MoE layer's projected time by part, per row count and layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = (("attention", lambda r, v: r["kda_attention_us"]), ("AttnRes", lambda r, v: r["attn_res_us"]),
             ("MoE non-expert", lambda r, v: v["moe_nonexpert_us"]), ("routed experts", lambda r, v: r["experts_us"]),
             ("collectives", lambda r, v: v["collectives_us"]))
    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 4))
    for ax, r in zip(axes, rows):
        bottom = [0.0, 0.0, 0.0]
        for name, get in parts:
            vals = [get(r, r[layout]) for layout in ("row_shard", "sharded", "main")]
            ax.bar(["row shard", "sharded", "main"], vals, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set(title=f"{r['rows']} row{'s' if r['rows'] > 1 else ''}", ylabel="us per KDA MoE layer (projected)")
    axes[-1].legend(fontsize=8)
    fig.suptitle("Kimi K3 TP 8 / EP 8, one rank, from measured H200 pieces (2-GPU collective latency)", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def _print_layouts(r: dict, layouts: tuple[str, ...]) -> None:
    for layout in layouts:
        v = r[layout]
        print(f"    {layout:18s}: experts {v['experts_us']:.1f}, MoE non-expert {v['moe_nonexpert_us']:.1f}, "
              f"collectives {v['collectives_us']:.1f}, KDA layer {v['kda_layer_us']:.1f}, MLA layer "
              f"{v['mla_layer_us']:.1f} us -> token {v['token_ms']:.2f} ms, {v['tokens_per_s']:.1f} tokens/s per user")


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--json")
    p.add_argument("--plot", help="write the per-layer breakdown plot here")
    p.add_argument("--internode-us", type=float, default=25.0,
                   help="DCP 8 x EP 32: the fixed cost of one inter-node collective (assumed, not measured)")
    args = p.parse_args(argv)
    rows = [project(R, args.internode_us) for R in args.rows]
    if args.plot:
        plot(rows, args.plot)
    for r in rows:
        print(f"R={r['rows']:3d}: attention KDA {r['kda_attention_us']:.1f} / MLA {r['mla_attention_us']:.1f}, "
              f"AttnRes {r['attn_res_us']:.1f}, experts {r['experts_us']:.1f} ({r['slowest_rank_experts']:.1f} on "
              f"the slowest rank x {r['us_per_expert']:.1f}), collective {r['collective_us']:.1f} us")
        _print_layouts(r, ("row_shard", "sharded", "main", "main_mxfp4"))
        print(f"    main vs row shard: {r['speedup']:.2f}x")
        d = r["dcp8_ep32"]
        print(f"    DCP 8 x EP 32 (inter-node collective {d['internode_latency_us']:.1f} us + bytes): "
              f"{d['slowest_rank_experts']:.1f} experts on the slowest rank, MLA {d['mla_attention_us']:.1f} us")
        _print_layouts(d, ("dp_row_shard", "dp_row_shard_mxfp4", "dp_sharded", "dp_sharded_mxfp4"))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"benchmark": "project_token", "rows": rows}, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
