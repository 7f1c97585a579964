"""Decode GEMMs at TP8 per-rank shapes: our skinny GEMM vs cuBLAS vs the byte floor.

    python benchmarks/gemm.py --json gemm.json [--rows 1 8 32 64]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, floor_us, graph_time_us  # noqa: E402

import kimi_inductor.kernels  # noqa: E402,F401

SHAPES = {  # name: (N, K, out dtype) per rank at TP8 (kimi_k3_stock.md section 11)
    "kda_in_proj": (6288, 7168, torch.bfloat16),
    "attn_o_proj": (7168, 1536, torch.bfloat16),
    "mla_qkv_a_g": (3648, 7168, torch.bfloat16),
    "mla_q_b": (2304, 1536, torch.bfloat16),
    "moe_router": (896, 7168, torch.float32),
    "moe_latent_down": (3584, 7168, torch.bfloat16),
    "moe_latent_up": (7168, 3584, torch.bfloat16),
    "shared_gate_up": (12288, 7168, torch.bfloat16),
    "shared_down": (7168, 6144, torch.bfloat16),
}


def cublas(x, w, out_dtype):
    if out_dtype == torch.float32:
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    return torch.mm(x, w.t())


def main(argv=None) -> Results:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--json")
    args = p.parse_args(argv)
    res = Results("gemm")
    for name in args.shapes:
        N, K, out_dtype = SHAPES[name]
        weights = [torch.randn(N, K, device="cuda").mul_(K**-0.5).to(torch.bfloat16) for _ in range(args.copies)]
        for M in args.rows:
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            ref = cublas(x, weights[0], out_dtype).float()
            ours = torch.ops.kimi_kernels.skinny_mm(x, weights[0], None, out_dtype).float()
            err = float((ours - ref).abs().max() / ref.abs().max())
            t_cublas = graph_time_us(lambda i: cublas(x, weights[i % args.copies], out_dtype))
            t_ours = graph_time_us(lambda i: torch.ops.kimi_kernels.skinny_mm(x, weights[i % args.copies], None,
                                                                              out_dtype))
            nbytes = N * K * 2 + M * K * 2 + M * N * (4 if out_dtype == torch.float32 else 2)
            fl = floor_us(nbytes)
            res.add(shape=name, N=N, K=K, M=M, floor_us=fl, cublas_us=t_cublas, ours_us=t_ours,
                    ours_frac=fl / t_ours, cublas_frac=fl / t_cublas, rel_err=err)
        del weights
    if args.json:
        res.dump(args.json)
    return res


if __name__ == "__main__":
    main()
