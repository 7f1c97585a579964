"""``expert_ffn.group_pairs`` on one GPU: the one-launch Triton kernel (``_group_kernel``)
against torch's path (stable argsort, scatter-add, scans), each in a CUDA graph, at top-16
over 112 (EP 8) and 896 (EP 1) local experts, with both results checked equal.

    python benchmarks/group_pairs.py --json X
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, graph_time_us  # noqa: E402
from moe_experts import routing  # noqa: E402

from kimi_inductor.kernels import expert_ffn as X  # noqa: E402


def main(argv=None) -> Results:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    p.add_argument("--json")
    args = p.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    res, limit = Results("group_pairs"), X.GROUP_PAIRS_MAX
    for E in (112, 896):
        for T in args.rows:
            ids, _ = routing(T, E, 16, gen, "cuda")
            row = dict(experts=E, rows=T, pairs=16 * T)
            for name, cap in (("kernel", limit), ("torch", 0)):
                X.GROUP_PAIRS_MAX = cap
                row[name] = X.group_pairs(ids, E)
                row[f"{name}_us"] = graph_time_us(lambda i: X.group_pairs(ids, E), calls=20, replays=7)
            X.GROUP_PAIRS_MAX = limit
            row["equal"] = all(torch.equal(a, b) for a, b in zip(row.pop("kernel"), row.pop("torch")))
            res.add(**row)
    if args.json:
        res.dump(args.json)
    return res


if __name__ == "__main__":
    main()
