"""``kda_decode_projected``'s parts, alone and chained, at TP8 per-rank shapes (12 heads x
128, hidden 7168), each in CUDA graphs over 4 weight copies: the in-projection GEMV (all of
it, and without g2's tiles), the KDA kernel, o_proj, and the in-projection + KDA kernel
(+ o_proj) as the pair of ops and as ``kda_decode_projected``. Where the layer's time
goes when the two overlap (``benchmarks/kda_layer.py --projected`` times the layer).

    python benchmarks/kda_projected.py --rows 1 2 --json parts.json   (KIMI_INDUCTOR_PDL=0: without PDL)
    python benchmarks/kda_projected.py --rows 1 --variants --json X   # gated GEMV configs x release points
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, graph_time_us  # noqa: E402

from kimi_inductor.kernels import kda_decode as kda_kernel  # noqa: E402
from kimi_inductor.kernels import kda_projected as kp  # noqa: E402
from kimi_inductor.kernels.skinny_gemm import cute_gemv as G  # noqa: E402

H, D, HIDDEN, N = 12, 128, 7168, 6288  # N: [q k v | g | f_a | b | pad]
P = H * D
COPIES = 4
# the gated GEMV's (R, warps, split, unroll) and the KDA kernel's release at its start
VARIANTS = [(cfg, early) for cfg in ((1, 4, 1, 4), (1, 4, 1, 8), (1, 4, 1, 16)) for early in (False, True)]


def main(argv=None) -> Results:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2])
    p.add_argument("--variants", action="store_true",
                   help="also time kda_decode_projected per gated GEMV config and KDA release point (VARIANTS), "
                        "each checked bitwise against the pair, and g2's rows alone as a plain GEMV per config")
    p.add_argument("--json")
    args = p.parse_args(argv)
    kk, bf, dev = torch.ops.kimi_kernels, torch.bfloat16, "cuda"
    res = Results("kda_projected")
    for M in args.rows:
        g = torch.Generator().manual_seed(M)

        def rand(*shape, scale=1.0, dtype=bf):
            return (torch.randn(*shape, generator=g) * scale).to(dtype).to(dev)

        W = [rand(N, HIDDEN, scale=HIDDEN**-0.5) for _ in range(COPIES)]
        Wo = [rand(HIDDEN, P, scale=P**-0.5) for _ in range(COPIES)]
        x = rand(M, HIDDEN)
        st = dict(f_b_weight=rand(P, D, scale=D**-0.5), conv_weight=rand(3 * P, 1, 4, scale=0.5, dtype=torch.float32),
                  A_log=torch.log(torch.rand(H, generator=g) * 15 + 1).to(dev),
                  dt_bias=rand(P, scale=0.5, dtype=torch.float32), norm_weight=1 + rand(D, scale=0.1),
                  conv_state=rand(1 + M, 3, 3 * P, scale=0.5), recurrent_state=rand(1 + M, H, D, D, scale=0.1,
                                                                                    dtype=torch.float32),
                  state_slots=(1 + torch.arange(M, dtype=torch.int32)).view(M, 1).to(dev),
                  num_accepted=torch.ones(M, dtype=torch.int32, device=dev), lower_bound=-5.0, norm_eps=1e-5)
        y0 = kk.skinny_mm(x, W[0], None, bf)
        skip = G.skip_tiles(M, N, HIDDEN, 3 * P, 4 * P)

        def pieces(y):
            return dict(mixed_qkv=y[:, :3 * P], f_a=y[:, 4 * P:4 * P + D], g2=y[:, 3 * P:4 * P],
                        beta=y[:, 4 * P + D:4 * P + D + H])

        def pair(i, oproj=True):
            o = kk.kda_decode(**pieces(kk.skinny_mm(x, W[i % COPIES], None, bf)), **st)
            return kk.skinny_mm(o, Wo[i % COPIES], None, bf) if oproj else o

        def projected(i, oproj=True):
            o = kk.kda_decode_projected(x, W[i % COPIES], [0, 3 * P, 4 * P, 4 * P + D], **st)
            return kk.skinny_mm(o, Wo[i % COPIES], None, bf) if oproj else o

        row = dict(rows=M)
        row["in_proj_us"] = graph_time_us(lambda i: kk.skinny_mm(x, W[i % COPIES], None, bf))
        row["in_proj_without_g2_us"] = graph_time_us(lambda i: G.run(x, W[i % COPIES], None, bf, skip=skip))
        row["kda_us"] = graph_time_us(lambda i: kk.kda_decode(**pieces(y0), **st))
        row["o_proj_us"] = graph_time_us(lambda i: kk.skinny_mm(y0[:, :P], Wo[i % COPIES], None, bf))
        row["pair_us"] = graph_time_us(lambda i: pair(i, False))
        row["projected_us"] = graph_time_us(lambda i: projected(i, False))
        row["pair_o_proj_us"] = graph_time_us(pair)
        row["projected_o_proj_us"] = graph_time_us(projected)
        if args.variants:
            frozen = {k: v.clone() for k, v in st.items() if k in ("conv_state", "recurrent_state")}

            def states():  # the same starting states for the pair and every variant
                return {**st, **{k: v.clone() for k, v in frozen.items()}}

            s0 = states()
            want = kk.kda_decode(**pieces(kk.skinny_mm(x, W[0], None, bf)), **s0)
            for cfg, early in VARIANTS:
                name = "u%d%s" % (cfg[3], "_early" if early else "")
                kp.GATE_CONFIG, kda_kernel.LATE_RELEASE_AT_START = cfg, early
                s1 = states()
                got = kk.kda_decode_projected(x, W[0], [0, 3 * P, 4 * P, 4 * P + D], **s1)
                row[f"{name}_bitwise"] = bool(torch.equal(got, want) and torch.equal(s1["recurrent_state"],
                                                                                     s0["recurrent_state"]))
                row[f"{name}_projected_us"] = graph_time_us(lambda i: projected(i, False))
                row[f"{name}_projected_o_proj_us"] = graph_time_us(projected)
                if not early:
                    row[f"g2_gemv_u{cfg[3]}_us"] = graph_time_us(
                        lambda i: G.run(x, W[i % COPIES][3 * P:4 * P], None, bf, cfg=G.Config(*cfg)))
            kp.GATE_CONFIG, kda_kernel.LATE_RELEASE_AT_START = VARIANTS[0]
        res.add(**row)
    if args.json:
        res.dump(args.json)
    return res


if __name__ == "__main__":
    main()
