"""DSA's indexer alone (scores of every visible position + top-2048, K3.1 shapes: 32 heads
x 128, the paged bf16 index cache) at q = 1: ``kimi_kernels.dsa_select`` vs stock's
``select_topk`` compiled by Inductor (gathered keys, fp32 einsum, stable full sort) vs
the byte floor (the index cache rows below seq_len + the scores), in CUDA graphs; with
the scoring kernel and the selection timed apart, and the selection kernel beside the
best torch form of the same selection (one ``torch.topk`` on int64 (score, reversed
position) keys, the form the kernel replaced).

    python benchmarks/dsa_index.py --json dsa_index.json [--requests 1 8 32 64] [--context 8192 32768]
    python benchmarks/dsa_index.py --sweep --json sweep.json   # the two selection forms side by side
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, floor_us, graph_time_us  # noqa: E402

import kimi_inductor.kernels  # noqa: E402,F401
from kimi_inductor.kernels import dsa_index  # noqa: E402
from kimi_inductor.stock.dsa import select_topk  # noqa: E402

HEADS, DIM, BLOCK, TOPK = 32, 128, 64, 2048


def topk_keys_mask(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The selection as one ``torch.topk`` on int64 keys (the score's order-preserving bits
    above the reversed position: the largest keys are the best scores, earliest first)."""
    W = scores.shape[-1]
    bits = (scores + 0.0).view(torch.int32)  # + 0.0: -0.0 and 0.0 are one score
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    keys = (ordered << 32) | (W - 1 - torch.arange(W, device=scores.device))
    best = torch.topk(keys, min(topk, W), dim=-1, sorted=False).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, best, True) & (scores > float("-inf"))


def main(argv=None) -> Results:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--context", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--sweep", action="store_true",
                   help="time the selection's two forms only (radix, registers per warps)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    stock = torch.compile(select_topk, dynamic=False)
    res = Results("dsa_index")
    for context, R in itertools.product(args.context, args.requests):
        torch._dynamo.reset()
        per_req = context // BLOCK
        cache = torch.randn(R * per_req, BLOCK, DIM, device="cuda", generator=gen).to(torch.bfloat16)
        table = torch.randperm(R * per_req, device="cuda", generator=gen).view(R, per_req).int()
        lens = torch.full((R,), context, dtype=torch.int32, device="cuda")
        index_q = torch.randn(R, HEADS, DIM, device="cuda", generator=gen).to(torch.bfloat16)
        index_w = torch.randn(R, HEADS, device="cuda", generator=gen)
        call = (index_q, index_w, cache, table, lens, TOPK)
        if args.sweep:
            sc = dsa_index.scores(*call[:5])
            row = dict(requests=R, context=context, radix_us=graph_time_us(
                lambda i: dsa_index.radix_select(sc, lens, TOPK), 5, 5))
            if context <= dsa_index.SELECT_MAX:
                row.update({f"registers_w{w}_us": graph_time_us(lambda i: dsa_index.select(sc, lens, TOPK, w), 5, 5)
                            for w in (8, 16, 32)})
            res.add(**row)
            continue
        same = bool(torch.equal(torch.ops.kimi_kernels.dsa_select(*call), stock(*call)))
        fl = floor_us(R * context * (DIM * 2 + 4))
        row = dict(requests=R, context=context, floor_us=fl, same_selection=same)
        row["inductor_us"] = graph_time_us(lambda i: stock(*call), calls=5, replays=5)
        row["ours_us"] = graph_time_us(lambda i: torch.ops.kimi_kernels.dsa_select(*call), calls=5, replays=5)
        sc = dsa_index.scores(*call[:5])
        row["scores_only_us"] = graph_time_us(lambda i: dsa_index.scores(*call[:5]), calls=5, replays=5)
        row["select_us"] = graph_time_us(lambda i: dsa_index.select(sc, lens, TOPK), calls=5, replays=5)
        row["torch_topk_us"] = graph_time_us(lambda i: topk_keys_mask(sc, TOPK), calls=5, replays=5)
        row["select_same"] = bool(torch.equal(dsa_index.select(sc, lens, TOPK), topk_keys_mask(sc, TOPK)))
        row.update(speedup=row["inductor_us"] / row["ours_us"], ours_x_floor=row["ours_us"] / fl)
        res.add(**row)
        del cache
    if args.json:
        res.dump(args.json)
    return res


if __name__ == "__main__":
    main()
