"""The expert-parallel MoE exchange on G GPUs (NCCL): ``kimi_kernels.mega_moe`` (all-gather
dispatch + grouped Triton experts + reduce-scatter combine) inside a CUDA graph, vs the
stock ``kimi::ep_experts`` (all-gather + expert loop + all-reduce; host-synchronising,
so eager), vs our grouped experts alone on the gathered rows (what the exchange adds),
vs the floor (the bytes of this rank's experts that got a pair at 4.28 TB/s).

Kimi K3 shapes: 896 experts over G ranks (448 each at G = 2), latent 3584, FFN 3072,
top-16, bf16 weights; c rows per rank, routed uniformly over all 896 experts.

    python benchmarks/mega_moe.py --gpus 2 --rows 1 8 32 64 --json mega_moe_ep2.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, floor_us, graph_time_us, run_on_gpus  # noqa: E402
from moe_experts import BETA, LINEAR_BETA, eager_time_us, routing  # noqa: E402

import kimi_inductor.kernels  # noqa: E402,F401
import kimi_inductor.stock  # noqa: E402,F401

EXPERTS, L, I, TOP_K = 896, 3584, 3072, 16


def _rank(rank: int, world: int, port: int, rows_list: list[int], out: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    local = EXPERTS // world
    w13 = torch.empty(local, 2 * I, L, dtype=torch.bfloat16, device="cuda").normal_(0, L**-0.5)
    w2 = torch.empty(local, L, I, dtype=torch.bfloat16, device="cuda").normal_(0, I**-0.5)
    expert_bytes = (w13[0].numel() + w2[0].numel()) * 2
    res = Results(f"mega_moe_ep{world}")
    for rows in rows_list:
        gen = torch.Generator().manual_seed(rows)  # the same routing on every rank: slice ours
        ids, weights = routing(world * rows, EXPERTS, TOP_K, gen, "cuda")
        latent = torch.randn(world * rows, L, generator=gen).to(device="cuda", dtype=torch.bfloat16)
        mine = slice(rank * rows, (rank + 1) * rows)
        a = (latent[mine].contiguous(), weights[mine].contiguous(), ids[mine].contiguous())
        pad = torch.zeros(rows, dtype=torch.bool, device="cuda")
        common = (w13, w2, rank * local, group.group_name, 8192, BETA, LINEAR_BETA)
        ours = torch.ops.kimi_kernels.mega_moe(*a, *common)
        stock = torch.ops.kimi.ep_experts(*a, pad, *common)
        err = float(((ours.float() - stock.float()).norm(dim=1) / stock.float().norm(dim=1)).max())
        local_ids = torch.where(ids >= 0, ids - rank * local, -1)
        hit = local_ids[(local_ids >= 0) & (local_ids < local)]
        active = int(torch.unique(hit).numel())
        t_ours = graph_time_us(lambda i: torch.ops.kimi_kernels.mega_moe(*a, *common), calls=5, replays=5)
        t_experts = graph_time_us(lambda i: torch.ops.kimi_kernels.expert_ffn(latent, weights, local_ids, w13, w2,
                                                                             BETA, LINEAR_BETA), calls=5, replays=5)
        dist.barrier()
        t_stock = eager_time_us(lambda: torch.ops.kimi.ep_experts(*a, pad, *common))
        fl = floor_us(active * expert_bytes)
        row = dict(rank=rank, rows=rows, active_experts=active, floor_us=fl, ours_us=t_ours,
                   experts_only_us=t_experts, stock_eager_us=t_stock, ours_of_ceiling=fl / t_ours, rel_err=err)
        res.add(echo=rank == 0, **row)
    if out:
        res.dump(f"{out}.rank{rank}")
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    run_on_gpus(_rank, args.gpus, (args.rows,), args.json)

if __name__ == "__main__":
    main()
