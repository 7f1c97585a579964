"""The GEMMs with a fused neighbour, at TP8 per-rank shapes, each in a CUDA graph:

* fused: ``kimi_kernels.rms_norm_mm`` / ``mm_situ`` (one CuTe GEMV launch);
* unfused: what ``lower_kernels`` emits without the fusion (Inductor's norm / SiTU kernel
  and our GEMM: ``skinny_mm``), compiled by Inductor;
* Inductor: the stock math (norm + ``addmm`` / ``mm`` + SiTU) compiled by Inductor (cuBLAS);
* floor: weight + activations at 4.28 TB/s.

    python benchmarks/gemm_fusions.py --json gemm_fusions.json [--rows 1 2] [--sweep]

``--sweep`` also times the fused GEMV over a few configurations (outputs per warp, warps,
K split, unroll) and records the best (``cute_gemv.TUNED_FUSED`` holds the winners).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, floor_us, graph_time_us  # noqa: E402

import kimi_inductor.kernels  # noqa: E402,F401
from kimi_inductor.stock.attn_res import rms_norm  # noqa: E402
from kimi_inductor.stock.layers import situ_and_mul  # noqa: E402

kk = torch.ops.kimi_kernels
CASES = {  # name: (fusion, N, K, with acc)
    "moe_norm_latent_up": ("rms_norm", 7168, 3584, True),
    "mla_q_a_norm_q_b": ("rms_norm", 2304, 1536, False),
    "shared_gate_up_situ": ("situ", 12288, 7168, False),
}


def variants(fusion: str):
    """(fused, unfused, stock) callables of (x, w, extra, acc)."""
    if fusion == "rms_norm":
        return (lambda x, w, g, acc: kk.rms_norm_mm(x, g, 1e-5, w, acc, torch.bfloat16),
                lambda x, w, g, acc: kk.skinny_mm(rms_norm(x, g, 1e-5), w, acc, torch.bfloat16),
                lambda x, w, g, acc: torch.addmm(acc, rms_norm(x, g, 1e-5), w.t()) if acc is not None
                else rms_norm(x, g, 1e-5) @ w.t())
    return (lambda x, w, g, acc: kk.mm_situ(x, w, 4.0, 25.0),
            lambda x, w, g, acc: situ_and_mul(kk.skinny_mm(x, w, None, torch.bfloat16), 4.0, 25.0),
            lambda x, w, g, acc: situ_and_mul(x @ w.t(), 4.0, 25.0))


def sweep(fusion: str, M: int, N: int, K: int, x, weights, g, acc) -> dict[str, float]:
    from kimi_inductor.kernels.skinny_gemm import cute_gemv

    fuse = cute_gemv.Fusion(eps=1e-5) if fusion == "rms_norm" else cute_gemv.Fusion(situ=(4.0, 25.0))
    base = cute_gemv.fused_config(M, N, K, fuse)
    cands = {base._replace(r=r, warps=w, split=sp, unroll=u)
             for r in (1, 2, 4) for w in (2, 4, 8) for sp in (1, 2) for u in (2, 4, 8)}
    times = {}
    for cfg in sorted(c for c in cands if not cute_gemv.supported(M, N, K, c, fuse)
                      and K // (cute_gemv.STEP * c.split) >= c.unroll):
        times[",".join(map(str, cfg))] = graph_time_us(
            lambda i: cute_gemv.run(x, weights[i % len(weights)], acc, torch.bfloat16, cfg, fuse, g), calls=10,
            replays=5)
    return times


def main(argv=None) -> Results:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--json")
    args = p.parse_args(argv)
    res = Results("gemm_fusions")
    for name, (fusion, N, K, with_acc) in CASES.items():
        weights = [torch.randn(N, K, device="cuda").mul_(K**-0.5).to(torch.bfloat16) for _ in range(args.copies)]
        g = (1 + 0.1 * torch.randn(K, device="cuda")).to(torch.bfloat16)
        fused, unfused, stock = variants(fusion)
        unfused_c, stock_c = (torch.compile(f, dynamic=False) for f in (unfused, stock))
        for M in args.rows:
            torch._dynamo.reset()
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            n_out = N // 2 if fusion == "situ" else N
            acc = torch.randn(M, n_out, device="cuda").to(torch.bfloat16) if with_acc else None
            want = stock(x, weights[0], g, acc).float()
            err = float((fused(x, weights[0], g, acc).float() - want).abs().max() / want.abs().max())
            fl = floor_us(N * K * 2 + M * K * 2 + M * n_out * 2 * (2 if with_acc else 1))
            row = dict(case=name, M=M, N=N, K=K, floor_us=fl, rel_err=err)
            for label, fn in (("fused", fused), ("unfused", unfused_c), ("inductor", stock_c)):
                row[f"{label}_us"] = graph_time_us(lambda i: fn(x, weights[i % args.copies], g, acc))
            row.update(fused_frac=fl / row["fused_us"], vs_unfused=row["unfused_us"] / row["fused_us"],
                       vs_inductor=row["inductor_us"] / row["fused_us"])
            if args.sweep:
                times = sweep(fusion, M, N, K, x, weights, g, acc)
                best = min(times, key=times.get)
                row.update(best_cfg=best, best_us=times[best], sweep=times)
            res.add(**row)
        del weights
    if args.json:
        res.dump(args.json)
    return res


if __name__ == "__main__":
    main()
