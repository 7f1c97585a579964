"""One Kimi K3 MoE layer decode step at EP G on G GPUs (NCCL), in the SP layout the hybrid
step runs it in: each rank routes its own c rows (router, latent down), the routed
experts are expert-parallel over the G ranks (896 / G each, bf16, or MXFP4 as the
checkpoint ships them with ``--mxfp4``), then RMSNorm, up projection and the replicated
shared experts:

* kimi_specialized: the ``mega_moe`` pass (one all-gather dispatch, grouped Triton
  experts, one reduce-scatter combine) and ``lower_kernels``, compiled by Inductor, in a
  CUDA graph on every rank;
* stock: the same layer eagerly (stock ``kimi::ep_experts``: all-gather, a host-synced
  expert loop, all-reduce; not capturable);
* stock, Inductor + graph: the stock layer compiled by Inductor with its experts in their
  capturable form (all-gather, every local expert on every row, MXFP4 experts
  dequantised first, reduce-scatter), in a CUDA graph;
* floor: every non-expert weight, the weights of this rank's experts that got a pair,
  and the activations, at 4.28 TB/s (the exchange's communication not included).

    python benchmarks/moe_layer_ep.py --gpus 2 --rows 1 8 32 64 --json moe_layer_ep2.json [--mxfp4]
    python benchmarks/moe_layer_ep.py --smoke [--mxfp4]  # 2 CPU ranks (gloo), the tiny preset
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch.func import functional_call

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, floor_us, graph_time_us, require_rewritten, run_on_gpus  # noqa: E402
from moe_experts import eager_time_us  # noqa: E402
from moe_layer import random_params, sm90_params, stock_inductor_with, weight_bytes  # noqa: E402

from kimi_inductor.backend import KimiSpecialized  # noqa: E402
from kimi_inductor.stock import KimiK3Config, Parallel  # noqa: E402
from kimi_inductor.stock.layers import situ_and_mul  # noqa: E402
from kimi_inductor.stock.moe import KimiMoE, router_logits, select_experts  # noqa: E402
from kimi_inductor.stock.mxfp4 import expert_weights  # noqa: E402


def _dense_ep_experts(latent, topk_weights, topk_ids, is_padding, w13, w2, first_expert, group_name, max_num_tokens,
                      beta, linear_beta, w13_scale=None, w2_scale=None):
    """Stock ``ep_experts`` in a capturable form: all-gather the rows, every local expert
    (dequantised where MXFP4) on every row weighted by a dense routing matrix,
    reduce-scatter the fp32 sums."""
    w13, w2 = expert_weights(w13, w2, w13_scale, w2_scale, latent.dtype)
    weights = torch.where(is_padding[:, None], 0.0, topk_weights.float())
    x, w, ids = (fc.all_gather_tensor(t, 0, group_name) for t in (latent, weights, topk_ids))
    local = ids.long() - first_expert
    hit = (local >= 0) & (local < w13.shape[0])
    route = torch.zeros(x.shape[0], w13.shape[0], device=x.device).scatter_add_(
        1, torch.where(hit, local, 0), torch.where(hit, w, 0.0))
    h = situ_and_mul(torch.matmul(x, w13.transpose(1, 2)), beta, linear_beta)  # [E, G c, I]
    y = (torch.matmul(h, w2.transpose(1, 2)).float() * route.t()[:, :, None]).sum(0)
    return fc.reduce_scatter_tensor(y, "sum", 0, group_name).to(latent.dtype)


def _rank(rank: int, world: int, port: int, rows_list: list[int], mxfp4: bool, out: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    _measure(rows_list, smoke=False, mxfp4=mxfp4, out=out)
    dist.destroy_process_group()


def _measure(rows_list: list[int], smoke: bool, mxfp4: bool = False, out: str = "") -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cpu" if smoke else f"cuda:{rank}"
    config = KimiK3Config.preset("tiny" if smoke else "kimi-k3")
    layer = KimiMoE(config, Parallel("sp", dist.group.WORLD), device="meta")
    if mxfp4:
        layer.store_mxfp4()
    torch.manual_seed(rank)  # each rank its own experts; the replicated weights made equal below
    params = random_params(layer, device)
    for name, t in params.items():
        if not name.startswith("experts."):
            dist.broadcast(t, 0)
    kimi_params = sm90_params(params)  # the baselines read the checkpoint's layout, as stock does
    local = params["experts.w13_weight"].shape[0]
    expert_bytes, other_bytes = weight_bytes(params)

    def step(params, x, is_padding):
        return functional_call(layer, params, (x, is_padding))

    res = Results(f"moe_layer_ep{world}")
    for rows in rows_list:
        torch._dynamo.reset()
        gen = torch.Generator().manual_seed(rows * world + rank)
        x = torch.randn(rows, config.hidden_size, generator=gen).to(device=device, dtype=torch.bfloat16)
        pad = torch.zeros(rows, dtype=torch.bool, device=device)
        backend = KimiSpecialized({"passes": ["mega_moe", "lower_kernels"]})
        kimi = torch.compile(step, backend=backend, dynamic=False)
        dense = stock_inductor_with({torch.ops.kimi.ep_experts.default: _dense_ep_experts})
        inductor = torch.compile(step, backend=dense, dynamic=False)
        want, got = step(params, x, pad).float(), kimi(kimi_params, x, pad).float()
        err = float(((got - want).norm(dim=1) / want.norm(dim=1)).max())
        inductor_err = float(((inductor(params, x, pad).float() - want).norm(dim=1) / want.norm(dim=1)).max())
        # this rank's experts that any rank's rows picked (what its experts read)
        _, ids = select_experts(router_logits(x, params["gate.weight"]), params["gate.e_score_correction_bias"],
                                config.num_experts_per_token, True, 1.0)
        every = [torch.empty_like(ids) for _ in range(world)]
        dist.all_gather(every, ids)
        ids = torch.cat(every) - rank * local
        active = int(torch.unique(ids[(ids >= 0) & (ids < local)]).numel())
        row = dict(rank=rank, rows=rows, experts="mxfp4" if mxfp4 else "bf16", active_experts=active, rel_err=err,
                   inductor_rel_err=inductor_err)
        require_rewritten(backend, "moe_layer_ep")
        if not smoke:
            fl = floor_us(other_bytes + active * expert_bytes + rows * config.hidden_size * 2 * 2)
            t_kimi = graph_time_us(lambda i: kimi(kimi_params, x, pad), calls=5, replays=5)
            dist.barrier()
            t_inductor = graph_time_us(lambda i: inductor(params, x, pad), calls=5, replays=5)
            dist.barrier()
            t_stock = eager_time_us(lambda: step(params, x, pad))
            row.update(floor_us=fl, kimi_us=t_kimi, inductor_us=t_inductor, stock_eager_us=t_stock,
                       kimi_x_floor=t_kimi / fl, speedup_vs_inductor=t_inductor / t_kimi, speedup=t_stock / t_kimi)
        res.add(echo=rank == 0, **row)
    if out:
        res.dump(f"{out}.rank{rank}")
    return res.rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--smoke", action="store_true", help="2 CPU ranks (gloo), tiny preset, no timing")
    p.add_argument("--mxfp4", action="store_true", help="MXFP4 routed experts, held packed (issue 18)")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if args.smoke:
        from kimi_inductor.launch import run_ranks

        run_ranks(_measure, 2, args.rows, True, args.mxfp4)
        return
    run_on_gpus(_rank, args.gpus, (args.rows, args.mxfp4), args.json)


if __name__ == "__main__":
    main()
