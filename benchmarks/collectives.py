"""The decode step's NCCL collectives on G GPUs, each captured in a CUDA graph (issue 19,
item 2: the collective latencies the token projection takes).

At R rows of the residual stream ([R, 7168] bf16), the three collectives a step runs:

* all-reduce of [R, 7168] (the hybrid attention's o-projection, sharded_moe's two);
* all-gather of each rank's c = ceil(R / G) rows into [G c, 7168] (SP attention, the EP
  dispatch);
* reduce-scatter of [G c, 7168] into c rows per rank (SP o-projection, the EP combine).

Times are per call: ``calls`` back-to-back calls in one graph, median over replays
(``common.graph_time_us``), rank 0's row and the slowest rank's.

    python benchmarks/collectives.py --gpus 2 --rows 1 2 8 32 64 --json X
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, graph_time_us, run_on_gpus  # noqa: E402

HIDDEN = 7168


def _rank(rank: int, world: int, port: int, rows_list: list[int], out: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    res = Results(f"collectives_g{world}")
    for rows in rows_list:
        c = math.ceil(rows / world)
        full = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        shard = torch.randn(c, HIDDEN, device="cuda", dtype=torch.bfloat16)
        gathered = torch.empty(world * c, HIDDEN, device="cuda", dtype=torch.bfloat16)
        calls = {
            "all_reduce": lambda i: dist.all_reduce(full),
            "all_gather": lambda i: dist.all_gather_into_tensor(gathered, shard),
            "reduce_scatter": lambda i: dist.reduce_scatter_tensor(shard, gathered),
        }
        row = dict(rank=rank, rows=rows, shard_rows=c, bytes_per_rank=rows * HIDDEN * 2)
        for name, fn in calls.items():
            dist.barrier()
            us = torch.tensor(graph_time_us(fn, calls=20, replays=10), device="cuda")
            slowest = us.clone()
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            row.update({f"{name}_us": float(us), f"{name}_slowest_us": float(slowest)})
        res.add(echo=rank == 0, **row)
    if out:
        res.dump(f"{out}.rank{rank}")
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 32, 64])
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    run_on_gpus(_rank, args.gpus, (args.rows,), args.json)


if __name__ == "__main__":
    main()
