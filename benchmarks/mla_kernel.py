"""The MLA decode core alone (``kernels/mla_decode.attend``: attention over an already
written paged latent cache, 576 values per position) against its byte floor (the cache
rows it reads), sweeping its tile sizes: positions per step BS, the split cap, pipeline
stages. N = 12 heads is a TP8 rank; N = 24 is a DCP 2 rank (it attends with the group's
heads over half the positions). Inside CUDA graphs, cycling over enough cache copies to
stream from HBM.

    python benchmarks/mla_kernel.py --json mla_kernel.json
    python benchmarks/mla_kernel.py --heads 12 --context 4096 --requests 1 8 --steps 1 2 4 --json X
    python benchmarks/mla_kernel.py --heads 12 --context 4096 --requests 8 32 64 --bs 32 64 --caps 256 \
        --stages 1 2 3 4 --warps 0 8 --json X   # warps 0: the kernel's default
Every configuration's output is checked against the default's (``*_err``: its largest
difference over the default's largest value); one that does not fit the GPU (shared
memory, registers) is recorded as ``*_skipped`` with Triton's reason.

``--fa3 SO`` also times stock vLLM's SM90 MLA decode on the same cache: its
FLASH_ATTN_MLA backend (first on SM90 in vLLM 0.33.0's priority list) calls FlashAttention
3 with the latent as a second value operand, loaded here from vLLM's wheel
(``vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so``, stable-ABI; ``benchmarks/stage_vllm_kernels.sh``
stages it for the GPU) and called as that backend calls
it under full CUDA graphs: scheduler metadata built before the graph, at most 32 splits
(``flash_attn_max_num_splits_for_cuda_graph``). Neither column includes the cache write.

    python benchmarks/mla_kernel.py --heads 12 --context 4096 --requests 1 2 8 32 64 --bs 32 --caps 256 \
        --fa3 _vllm_fa3_C.abi3.so --json X
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, floor_us, graph_time_us  # noqa: E402

from kimi_inductor.kernels import mla_decode as M  # noqa: E402

L, RD, BLOCK = 512, 64, 64
FA3_SPLITS = 32  # vLLM's flash_attn_max_num_splits_for_cuda_graph


def fa3_decode(ql, qp, table, seq, scale, context):
    """A callable running vLLM's FLASH_ATTN_MLA decode (FlashAttention 3: q = q_pe against
    the cache's k_pe, q_v = ql_nope against its latent, one query row per request) with
    its scheduler metadata built once, as vLLM builds it before a CUDA graph's replay."""
    fa, R, N = torch.ops._vllm_fa3_C, ql.shape[0], ql.shape[1]
    cu_q = torch.arange(R + 1, dtype=torch.int32, device=ql.device)
    meta = fa.get_scheduler_metadata(R, 1, context, N, 1, RD, L, torch.bfloat16, seq, cu_q, None, None, None, None,
                                     BLOCK, 0, True, -1, -1, False, FA3_SPLITS, None, 0)

    def run(cache):
        return fa.fwd(qp, cache[..., L:].unsqueeze(-2), cache[..., :L].unsqueeze(-2), None, None, ql, None, cu_q,
                      None, None, None, seq, 1, context, table, None, None, None, None, None, None, None, None,
                      scale, True, -1, -1, 0.0, True, meta, FA3_SPLITS, None, 0, None, 1, 0, None)[0]
    return run


def main(argv=None) -> Results:
    p = argparse.ArgumentParser()
    p.add_argument("--heads", type=int, nargs="+", default=[12, 24])
    p.add_argument("--context", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--requests", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, nargs="+", default=[1],
                   help="least BS steps per split (more splits at short contexts)")
    p.add_argument("--bs", type=int, nargs="+", default=[32, 64], help="positions per step")
    p.add_argument("--caps", type=int, nargs="+", default=[64, 256], help="most splits per request")
    p.add_argument("--stages", type=int, nargs="+", default=[2], help="software pipeline stages")
    p.add_argument("--warps", type=int, nargs="+", default=[0], help="warps per program (0: the default)")
    p.add_argument("--fa3", help="vLLM's _vllm_fa3_C.abi3.so: also time its FLASH_ATTN_MLA decode")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.fa3:
        torch.ops.load_library(args.fa3)
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = Results("mla_kernel")
    sweep = list(itertools.product(args.bs, args.caps, args.stages, args.steps, args.warps))
    for N, context, R in itertools.product(args.heads, args.context, args.requests):
        per_req = context // BLOCK
        nbytes = R * context * (L + RD) * 2
        copies = max(1, -(-200 * 2**20 // nbytes))
        caches = [torch.randn(1 + R * per_req, BLOCK, L + RD, device="cuda", generator=gen).bfloat16()
                  for _ in range(copies)]
        table = (1 + torch.arange(R * per_req, dtype=torch.int32, device="cuda")).view(R, per_req)
        seq = torch.full((R,), context, dtype=torch.int32, device="cuda")
        ql = torch.randn(R, N, L, device="cuda", generator=gen).bfloat16()
        qp = torch.randn(R, N, RD, device="cuda", generator=gen).bfloat16()
        row = dict(heads=N, context=context, requests=R, floor_us=floor_us(nbytes))
        want = M.attend(ql, qp, caches[0], table, seq, 0.04).float()
        for bs, most, stages, steps, warps in sweep:
            key = (f"bs{bs}_cap{most}_st{stages}" + (f"_steps{steps}" if steps != 1 else "")
                   + (f"_w{warps}" if warps else ""))
            try:
                got = M.attend(ql, qp, caches[0], table, seq, 0.04, bs=bs, most_splits=most, num_stages=stages,
                               steps=steps, num_warps=warps or None).float()
            except triton.runtime.errors.OutOfResources as e:  # e.g. BS 128 x 2 stages of shared memory
                row[key + "_skipped"] = str(e).splitlines()[0]
                continue
            row[key + "_err"] = float((got - want).abs().max() / want.abs().max())
            row[key + "_us"] = graph_time_us(
                lambda i: M.attend(ql, qp, caches[i % copies], table, seq, 0.04, bs=bs, most_splits=most,
                                   num_stages=stages, steps=steps, num_warps=warps or None), calls=10, replays=5)
        best = min((v, k) for k, v in row.items() if k.startswith("bs") and k.endswith("_us"))
        row["best"], row["best_us"], row["best_of_ceiling"] = best[1], best[0], row["floor_us"] / best[0]
        if args.fa3:
            fa3 = fa3_decode(ql, qp, table, seq, 0.04, context)
            row["fa3_err"] = float((fa3(caches[0]).float() - want).abs().max() / want.abs().max())
            row["fa3_us"] = graph_time_us(lambda i: fa3(caches[i % copies]), calls=10, replays=5)
            row["fa3_over_best"] = row["fa3_us"] / best[0]
        res.add(**row)
        del caches
    if args.json:
        res.dump(args.json)
    return res


if __name__ == "__main__":
    main()
