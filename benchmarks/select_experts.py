"""The MoE router's expert choice at Kimi K3 shapes (896 experts, top-16, renormalised,
scale 2.5): ``kimi_kernels.select_experts`` at 1-8 warps per row vs stock's routing ops
compiled by Inductor, each in a CUDA graph, on one GPU.

    python benchmarks/select_experts.py --rows 1 8 64 --json X
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, graph_time_us  # noqa: E402

from kimi_inductor.kernels import moe_router  # noqa: E402
from kimi_inductor.stock.moe import select_experts  # noqa: E402


def main(argv=None) -> Results:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--json")
    args = p.parse_args(argv)
    bias = torch.randn(896, device="cuda") * 0.1
    route = (bias, 16, True, 2.5)
    stock = torch.compile(lambda logits: select_experts(logits, *route), dynamic=False)
    res, chosen = Results("select_experts"), moe_router.WARPS
    for M in args.rows:
        logits = torch.randn(M, 896, device="cuda") * 3
        for warps in (1, 2, 4, 8):
            moe_router.WARPS = warps
            res.add(rows=M, op="select_experts", num_warps=warps, us=graph_time_us(
                lambda i: torch.ops.kimi_kernels.select_experts(logits, *route), calls=10, replays=5))
        moe_router.WARPS = chosen
        res.add(rows=M, op="select_experts replaced ops", us=graph_time_us(lambda i: stock(logits), calls=10,
                                                                           replays=5))
    if args.json:
        res.dump(args.json)
    return res


if __name__ == "__main__":
    main()
