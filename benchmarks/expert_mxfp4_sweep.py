"""Tile sweep of the SM90 MXFP4 expert kernels (kernels/expert_mxfp4.py) on one GPU: warps
per CTA x n8 tiles of pairs per pass at EP 8 shapes (112 local experts, random MXFP4
codes and scales in the kernel's layout), each in a CUDA graph, with the CUDA kernels of
one default call (torch profiler, summed by name); then the default against the Triton
MXFP4 kernel at EP 1 (896 experts).

    python benchmarks/expert_mxfp4_sweep.py --json X
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, floor_us, graph_time_us  # noqa: E402
from moe_experts import routing  # noqa: E402
from step_breakdown import profile_kernels  # noqa: E402

from kimi_inductor.kernels import expert_ffn as X  # noqa: E402
from kimi_inductor.kernels import expert_mxfp4 as MX  # noqa: E402

L, I, TOP_K = 3584, 3072, 16  # Kimi K3's latent, expert width, top-k
EXPERT_BYTES = (2 * I * L + L * I) // 2 * 17 // 16  # codes + E8M0 scales


def experts(E: int):
    """(checkpoint MXFP4 (q13, s13, q2, s2), the same in the kernel's layout)."""
    q13 = torch.randint(0, 256, (E, 2 * I, L // 2), dtype=torch.uint8, device="cuda")
    s13 = torch.randint(120, 128, (E, 2 * I, L // 32), dtype=torch.uint8, device="cuda")
    q2 = torch.randint(0, 256, (E, L, I // 2), dtype=torch.uint8, device="cuda")
    s2 = torch.randint(120, 128, (E, L, I // 32), dtype=torch.uint8, device="cuda")
    return (q13, s13, q2, s2), (*MX.mma_layout(q13, s13, True), *MX.mma_layout(q2, s2, False))


def kernels_us(fn, calls: int = 10) -> dict[str, float]:
    """CUDA kernel time per call, summed by (shortened) kernel name."""
    out: dict[str, float] = {}
    for name, us in profile_kernels(fn, calls):
        out[name[:60]] = out.get(name[:60], 0.0) + us / calls
    return out


def main(argv=None) -> Results:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    res = Results("expert_mxfp4_sweep")
    (_, (c13, t13, c2, t2)) = experts(112)
    for rows in (1, 8, 32, 64):
        ids, w = routing(rows, 112, TOP_K, gen, "cuda")
        lat = torch.randn(rows, L, generator=gen).to(torch.bfloat16).cuda()
        args_ = (lat, w, ids, c13, c2, 4.0, 25.0, t13, t2)
        row = dict(experts=112, rows=rows,
                   floor_us=floor_us(int(torch.unique(ids).numel()) * EXPERT_BYTES + rows * L * 6))
        for warps in (2, 4, 8):
            for tiles in (1, 2, 4):
                if rows > 1 or tiles == 1:
                    row[f"w{warps}_t{tiles}_us"] = graph_time_us(
                        lambda i: X.mma_grouped(*args_, tiles=tiles, warps=warps), calls=5, replays=5)
        row["kernels_us"] = kernels_us(lambda: X.mma_grouped(*args_))
        res.add(**row)
    del c13, t13, c2, t2
    torch.cuda.empty_cache()
    (q13, s13, q2, s2), (c13, t13, c2, t2) = experts(896)
    for rows in (1, 8, 64):
        ids, w = routing(rows, 896, TOP_K, gen, "cuda")
        lat = torch.randn(rows, L, generator=gen).to(torch.bfloat16).cuda()
        row = dict(experts=896, rows=rows,
                   floor_us=floor_us(int(torch.unique(ids).numel()) * EXPERT_BYTES + rows * L * 6))
        row["triton_us"] = graph_time_us(lambda i: X.grouped(lat, w, ids, q13, q2, 4.0, 25.0, s13, s2), calls=5,
                                         replays=5)
        row["mma_us"] = graph_time_us(lambda i: X.mma_grouped(lat, w, ids, c13, c2, 4.0, 25.0, t13, t2), calls=5,
                                      replays=5)
        res.add(**row)
    if args.json:
        res.dump(args.json)
    return res


if __name__ == "__main__":
    main()
