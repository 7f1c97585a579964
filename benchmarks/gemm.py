"""Decode GEMMs at TP8 per-rank shapes: our skinny GEMMs (CuTe DSL GEMV, Triton split-K)
vs cuBLAS vs the byte floor, each in a CUDA graph.

    python benchmarks/gemm.py --json gemm.json [--rows 1 2 4 8 16 32 64] [--sweep] [--tiles]

``--sweep`` also times a few CuTe configurations around ``cute_gemv.config`` (outputs per
warp x K split, and for 1-2 outputs per warp 4 or 8 warps x 2- or 4-deep unroll) and
records the best; ``fastest`` is what ``skinny_gemm.FASTEST`` holds. ``--tiles`` also times
the Triton GEMM (``tl_dot.run``) over ``tile_configs`` and records the best.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from triton.runtime.errors import OutOfResources

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, floor_us, graph_time_us  # noqa: E402

from kimi_inductor.kernels import skinny_gemm  # noqa: E402
from kimi_inductor.kernels.skinny_gemm import tl_dot  # noqa: E402

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
    # sharded_moe's shared gate and up row blocks, each its own GEMM where moe_in does not
    # take them (not in skinny_gemm.FASTEST, so on cuBLAS)
    "shared_gate_g8": (768, 7168, torch.bfloat16),
    "shared_gate_g2": (3072, 7168, torch.bfloat16),
}


def cublas(x, w, out_dtype):
    if out_dtype == torch.float32:
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    return torch.mm(x, w.t())


def cute_configs(M, N, K, sweep):
    from kimi_inductor.kernels.skinny_gemm import cute_gemv

    base = cute_gemv.config(M, N, K)
    cands = {base}
    if sweep:
        steps = K // cute_gemv.STEP
        splits = [d for d in range(1, steps + 1) if steps % d == 0 and steps // d >= 2]
        i = splits.index(base.split)
        for r in (1, 2, 4):
            for split in splits[max(0, i - 1):i + 2]:
                cands.add(base._replace(r=r, split=split, unroll=min(4, steps // split)))
                if r <= 2:  # fewer bytes in flight per warp, more warps per CTA
                    cands |= {base._replace(r=r, warps=w, split=split, unroll=u)
                              for w in (4, 8) for u in (2, 4) if u <= steps // split}
    return [c for c in cands if not cute_gemv.supported(M, N, K, c)], base


def tile_configs(M, N, K, top=()):
    """``tl_dot.Tile`` candidates: BK 128 / 256, 3 / 5 / 7 stages, K splits of one and two
    waves; ``config``'s with W through TMA and with BN 128 (4 or 8 warps); with ``top``
    (the best configurations at another M) those and ``config`` only. (The first sweep,
    ``gemm_tiles_h100_v1.json``, also crossed BN 128 and TMA with the rest: neither won.)"""
    base = tl_dot.config(M, N, K)
    if top:
        return list(dict.fromkeys([base, *top]))
    cands, tiles = [base], -(-N // 64)
    for bk in (128, 256):
        for split in {1, max(1, tl_dot.SMS // tiles), max(1, 2 * tl_dot.SMS // tiles)}:
            for stages in (3, 5, 7):
                cands.append(tl_dot.Tile(64, bk, split, stages, 4))
    cands += [base._replace(tma=True), base._replace(bn=128, split=max(1, tl_dot.SMS // -(-N // 128))),
              base._replace(bn=128, split=max(1, tl_dot.SMS // -(-N // 128)), warps=8)]
    return list(dict.fromkeys(c for c in cands if c.split >= 1))


def main(argv=None) -> Results:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--tiles", action="store_true")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--json")
    args = p.parse_args(argv)
    res = Results("gemm")
    for name in args.shapes:
        top = ()
        N, K, out_dtype = SHAPES[name]
        weights = [torch.randn(N, K, device="cuda").mul_(K**-0.5).to(torch.bfloat16) for _ in range(args.copies)]
        for M in args.rows:
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            ref = cublas(x, weights[0], out_dtype).float()

            def err(out):
                return float((out.float() - ref).abs().max() / ref.abs().max())

            nbytes = N * K * 2 + M * K * 2 + M * N * (4 if out_dtype == torch.float32 else 2)
            fl = floor_us(nbytes)
            row = dict(shape=name, N=N, K=K, M=M, floor_us=fl)
            row["cublas_us"] = graph_time_us(lambda i: cublas(x, weights[i % args.copies], out_dtype))
            row["tl_dot_us"] = graph_time_us(lambda i: tl_dot.run(x, weights[i % args.copies], None, out_dtype))
            row["tl_dot_err"] = err(tl_dot.run(x, weights[0], None, out_dtype))
            if M <= 8 and not skinny_gemm.cute_available():
                from kimi_inductor.kernels.skinny_gemm import cute_gemv

                cands, base = cute_configs(M, N, K, args.sweep)
                times, errs = {}, []
                for cfg in cands:  # three calls each: the split-K counters must reset
                    errs += [err(cute_gemv.run(x, weights[0], None, out_dtype, cfg)) for _ in range(3)]
                    times[cfg] = graph_time_us(lambda i: cute_gemv.run(x, weights[i % args.copies], None, out_dtype,
                                                                       cfg))
                best = min(times, key=times.get)
                row.update(cute_gemv_us=times[base], cute_gemv_cfg=list(base), cute_gemv_err=max(errs),
                           cute_best_us=times[best], cute_best_cfg=list(best))
                if args.sweep:
                    row["cute_sweep"] = {",".join(map(str, c)): t for c, t in sorted(times.items())}
            if args.tiles:
                times = {}
                for cfg in tile_configs(M, N, K, top):
                    try:
                        errs = [err(tl_dot.run(x, weights[0], None, out_dtype, cfg)) for _ in range(2)]
                    except OutOfResources:  # BN x BK x stages past the shared memory
                        continue
                    row["tl_dot_err"] = max(row["tl_dot_err"], *errs)
                    times[cfg] = graph_time_us(lambda i: tl_dot.run(x, weights[i % args.copies], None, out_dtype, cfg))
                ranked = sorted(times, key=times.get)
                top = top or ranked[:5]
                row.update(tl_best_us=times[ranked[0]], tl_best_cfg=list(ranked[0]),
                           tl_sweep={",".join(map(str, c)): t for c, t in times.items()})
            print(", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                            if k != "tl_sweep"), flush=True)
            impls = {k[:-3]: v for k, v in row.items() if k in ("cublas_us", "tl_dot_us", "cute_gemv_us")}
            row["fastest"] = min(impls, key=impls.get)
            row["best_frac"] = fl / impls[row["fastest"]]
            res.add(**row)
        del weights
        if args.json:  # after every shape: a sweep cut short keeps what it measured
            res.dump(args.json)
    return res


if __name__ == "__main__":
    main()
