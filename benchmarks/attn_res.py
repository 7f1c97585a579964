"""AttnRes alone (one ``kimi::attn_res`` call: prefix update, bank write, the softmax mix
over the saved blocks and the output RMSNorm) at Kimi K3's hidden size: our kernel vs
the stock math compiled by Inductor vs the byte floor, inside CUDA graphs; with
``--vllm ROOT`` (vLLM 0.33.0's wheel unpacked there) also vLLM's own AttnRes as it runs
on this GPU (its Triton ``_attn_res_kernel``; the native one is SM100-only), the kernel
``lower_kernels`` replaces in vLLM's graph.

    python benchmarks/attn_res.py --json attn_res.json [--rows 1 8 32 64] [--blocks 4 12] [--vllm ROOT]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, floor_us, graph_time_us, vllm_kernel_module  # noqa: E402

import kimi_inductor.kernels  # noqa: E402,F401
from kimi_inductor.stock.library import REFERENCES  # noqa: E402


def main(argv=None) -> Results:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 4, 7], help="saved blocks mixed (num_blocks; 0-7 in K3: 93 layers, blocks of 12)")
    p.add_argument("--json")
    p.add_argument("--vllm", help="vLLM 0.33.0's wheel unpacked here: time its AttnRes too")
    args = p.parse_args(argv)
    vllm = args.vllm and vllm_kernel_module(args.vllm, "models/kimi_k3/nvidia/ops/attn_res.py").attn_res
    H, bf16 = 7168, torch.bfloat16
    stock = torch.compile(REFERENCES[torch.ops.kimi.attn_res.default], dynamic=False)
    res = Results("attn_res")
    for n in args.blocks:
        for rows in args.rows:
            torch._dynamo.reset()
            g = torch.Generator(device="cuda").manual_seed(rows + n)
            prefix, delta = (torch.randn(rows, H, device="cuda", generator=g).to(bf16) for _ in range(2))
            bank = torch.randn(rows, n + 2, H, device="cuda", generator=g).to(bf16)
            w = [1 + 0.1 * torch.randn(H, device="cuda", generator=g).to(bf16) for _ in range(3)]
            call = (delta, bank, w[0], w[1], w[2], n, n, 1e-6, 1e-5)  # mixes n blocks, writes block n
            want = REFERENCES[torch.ops.kimi.attn_res.default](prefix.clone(), *call)  # eager stock

            def err(out):
                return float(((out.float() - want.float()).abs() / want.float().abs().amax(-1, keepdim=True)).max())

            # Inductor's compile of stock is not bitwise stock: it keeps the prefix update in
            # fp32 (no bf16 rounding before the softmax), which moves near-tied scores
            inductor_err = err(stock(prefix.clone(), *call))
            ours_err = err(torch.ops.kimi_kernels.attn_res(prefix.clone(), *call))
            vllm_err = vllm and err(vllm(prefix.clone(), *call))  # before the timed calls update prefix in place
            # prefix read + write, delta, bank write, n bank rows, output
            fl = floor_us(rows * H * 2 * (5 + n) + 3 * H * 2)
            row = dict(rows=rows, blocks=n, floor_us=fl)
            row["inductor_us"] = graph_time_us(lambda i: stock(prefix, *call))
            row["ours_us"] = graph_time_us(lambda i: torch.ops.kimi_kernels.attn_res(prefix, *call))
            row.update(speedup=row["inductor_us"] / row["ours_us"], ours_x_floor=row["ours_us"] / fl,
                       ours_err=ours_err, inductor_err=inductor_err)
            if vllm:
                row.update(vllm_err=vllm_err, vllm_us=graph_time_us(lambda i: vllm(prefix, *call)))
                row["vllm_over_ours"] = row["vllm_us"] / row["ours_us"]
            res.add(**row)
    if args.json:
        res.dump(args.json)
    return res


if __name__ == "__main__":
    main()
