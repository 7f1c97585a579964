"""One MLA (or, with ``--kind dsa``, K3.1 DSA) layer decode step at long context on G GPUs (NCCL, TP layout, 12 heads per
rank as at TP8, hidden 7168, 64-token virtual blocks): decode context parallel G
(each rank holds every G-th position: query all-gather, partial attention, LSE
all-gather, reduce-scatter over heads) vs DCP 1 (every rank holds the whole cache),
both compiled by kimi_specialized (``lower_kernels``: our Triton MLA cores) and run in
CUDA graphs, side by side in one run; with the byte floor of each (weights + the cache
rows a rank reads + activations; for DSA the rank's index cache plus its share of the
top-k latent rows).

    python benchmarks/dcp_mla.py --gpus 2 --context 32768 131072 --requests 1 8 --json dcp.json
    python benchmarks/dcp_mla.py --gpus 2 --kind dsa --context 32768 131072 --requests 1 8 --json dcp_dsa.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.func import functional_call

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, floor_us, graph_time_us, require_rewritten, run_on_gpus  # noqa: E402
from mla_layer import random_params  # noqa: E402

from kimi_inductor.backend import KimiSpecialized  # noqa: E402
from kimi_inductor.stock import DecodeStep, KimiK3Config, Parallel  # noqa: E402
from kimi_inductor.stock.dsa import SparseLatentAttention  # noqa: E402
from kimi_inductor.stock.mla import MultiHeadLatentAttention  # noqa: E402

BLOCK = 64


def _rank(rank: int, world: int, port: int, kind: str, contexts: list[int], requests: list[int], q: int,
          out: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    dsa = kind == "dsa"
    base = KimiK3Config.preset("kimi-k3.1" if dsa else "kimi-k3")
    config = base.replace(num_attention_heads=12 * world)
    index_dim = config.dsa_config["index_head_dim"] if dsa else 0
    res = Results(f"dcp_{kind}_{world}gpus")
    for dcp_size in (1, world):
        cls = SparseLatentAttention if dsa else MultiHeadLatentAttention
        layer = cls(config, Parallel("tp", group, dcp=dcp_size), device="meta")
        params = random_params(layer, torch.Generator().manual_seed(0), "cuda")
        weight_bytes = sum(t.numel() * t.element_size() for t in params.values())

        def step(params, x, slots, table, seq_lens, cache):
            s = DecodeStep(input_ids=seq_lens, state_slots=table, num_accepted=seq_lens, slot_mapping=slots,
                           block_table=table, seq_lens=seq_lens, is_padding=seq_lens)
            return functional_call(layer, params, (x, s, cache))

        for context in contexts:
            for R in requests:
                torch._dynamo.reset()
                gen = torch.Generator().manual_seed(R)
                per_req = -(-context // BLOCK)
                x = torch.randn(R * q, config.hidden_size, generator=gen).to(device="cuda", dtype=torch.bfloat16)
                table = (1 + torch.arange(R * per_req, dtype=torch.int32).view(R, per_req)).cuda()
                seq_lens = torch.full((R,), context, dtype=torch.int32, device="cuda")
                pos = torch.arange(context - q, context, device="cuda")
                slots = (table.long().gather(1, (pos // BLOCK).expand(R, q)) * BLOCK + pos % BLOCK).view(-1)
                cache = tuple(torch.empty(1 + R * per_req, BLOCK // dcp_size, width, dtype=torch.bfloat16,
                                          device="cuda").normal_() for width in (config.latent_row, index_dim) if width)
                backend = KimiSpecialized({"passes": ["lower_kernels"]})
                kimi = torch.compile(step, backend=backend, dynamic=False)
                kimi(params, x, slots, table, seq_lens, cache)
                require_rewritten(backend, "dcp_mla")
                t = graph_time_us(lambda i: kimi(params, x, slots, table, seq_lens, cache), calls=10, replays=5)
                read = min(context, config.dsa_config["index_topk"]) if dsa else context
                cache_bytes = R * (read * config.latent_row + context * index_dim) * 2 / dcp_size
                fl = floor_us(weight_bytes + cache_bytes + 2 * R * q * config.hidden_size * 2)
                row = dict(rank=rank, dcp=dcp_size, context=context, requests=R, q=q, floor_us=fl, kimi_us=t,
                           kimi_x_floor=t / fl)
                res.add(echo=rank == 0, **row)
                del cache
    if out:
        res.dump(f"{out}.rank{rank}")
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--kind", choices=["mla", "dsa"], default="mla")
    p.add_argument("--context", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--requests", type=int, nargs="+", default=[1, 8])
    p.add_argument("--q", type=int, default=1)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    run_on_gpus(_rank, args.gpus, (args.kind, args.context, args.requests, args.q), args.json)

if __name__ == "__main__":
    main()
