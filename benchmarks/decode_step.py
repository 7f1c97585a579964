"""The whole decoder step at Kimi K3 per-rank shapes on one GPU or G (issue 19, item 1).

The model: the stock decoder at TP8 per-rank shapes (``k3_rank.per_rank_config``:
hidden 7168, ``--layers`` in K3's KDA:MLA schedule with AttnRes blocks, layer 0 dense,
MoE layers with ``--experts`` routed experts of full width, the experts an EP rank
holds), R requests of q tokens at ``--context`` tokens of cache (random cache contents, no
prefill), one step from ``model.forward`` to the final hidden states. Variants, each
timed inside CUDA graphs (``common.graph_time_us``, the same step replayed):

* ``kimi``: ``torch.compile(model, backend="kimi_specialized")``, every pass;
* ``inductor``: the stock model compiled by Inductor, its routed experts in their
  capturable dense form (the stock expert loop has data-dependent shapes);
* ``floor``: every weight the step reads (all non-expert weights, the experts its rows
  picked, per MoE layer), the KDA states read and written, the MLA latent cache rows
  read, at 4.28 TB/s.

For ``kimi`` the JSON also has ``kimi_breakdown_us``: its kernel time per part of the
model (attention, AttnRes, MoE non-expert, experts, ...; ``step_breakdown.py``, which
also draws the plot) and ``kimi_top_kernels_us``: each part's costliest kernels.

``--gpus G`` (2, 4, 8; NCCL, one process per GPU) runs the same per-rank shapes as a
group: the stock decoder in its SP layout at TP G / EP G (G x 12 heads, G x ``--experts``
experts), kimi_specialized's hybrid step (hybrid_attention, mega_moe, sharded_moe,
lower_kernels) against stock SP compiled by Inductor (its EP experts in the capturable
all-gather / dense / reduce-scatter form); every rank times its own CUDA graph in step
with the others and writes its rows (``rank``). The floor counts the SP layout's
per-rank bytes (the experts of this rank that any rank's rows picked), so sharded_moe,
which reads less, can go below it. ``--smoke --gpus 2``: 2 CPU ranks (gloo).

Compile time: the first call of each variant (``compile_s``, cold in a fresh process)
and again after ``torch._dynamo.reset()`` (``recompile_s``, Inductor's caches warm).

    python benchmarks/decode_step.py --rows 1 2 8 32 64 --q 1 4 --json step.json [--mxfp4]
    python -m kimi_inductor bench --step
    python benchmarks/decode_step.py --gpus 2 --rows 1 2 8 32 64 --q 1 --json step_g2.json
    python benchmarks/decode_step.py --smoke [--gpus 2]   # CPU, tiny shapes, no timing
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import step_breakdown  # noqa: E402
from common import Results, floor_us, graph_time_us  # noqa: E402
from k3_rank import checkpoint, fill_caches, per_rank_config, smoke_config  # noqa: E402
from moe_layer import _dense_fused, stock_inductor_with  # noqa: E402
from moe_layer_ep import _dense_ep_experts  # noqa: E402

from kimi_inductor.backend import KimiSpecialized  # noqa: E402
from kimi_inductor.launch import run_ranks  # noqa: E402
from kimi_inductor.stock import Parallel  # noqa: E402
from kimi_inductor.stock import moe as stock_moe  # noqa: E402
from kimi_inductor.stock.batch import DecodeBatch  # noqa: E402
from kimi_inductor.stock.checkpoint import build_model  # noqa: E402


def experts_hit(model, step, caches, G: int, rank: int) -> list[int]:
    """Per MoE layer, how many of this rank's experts the step's rows (every rank's) pick
    (one eager step on copies of the caches, the router's selection recorded)."""
    picked, select = [], stock_moe.select_experts

    def record(*args, **kwargs):
        weights, ids = select(*args, **kwargs)
        picked.append(ids)
        return weights, ids

    stock_moe.select_experts = record
    try:
        with torch.no_grad():
            model(step, [tuple(t.clone() for t in c) for c in caches])
    finally:
        stock_moe.select_experts = select
    local = model.config.num_experts // G
    hit = []
    for ids in picked:
        if G > 1:
            every = [torch.empty_like(ids) for _ in range(G)]
            dist.all_gather(every, ids)
            ids = torch.cat(every)
        ids = ids - rank * local
        hit.append(int(torch.unique(ids[(ids >= 0) & (ids < local)]).numel()))
    return hit


def floor_bytes(model, caches, hit: list[int], rows: int, requests: int, context: int) -> int:
    """What one step must move: weights (experts: those hit), states, cache rows read."""
    nbytes, expert_bytes = 0, 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if ".experts." in name:
            expert_bytes += size // p.shape[0]  # per expert, summed over the layer's tensors
        else:
            nbytes += size
    moe_layers = sum(layer.is_moe_layer for layer in model.model.layers)
    nbytes += sum(hit) * expert_bytes // max(1, moe_layers)
    for layer, cache in zip(model.model.layers, caches):
        if layer.kind == "kda":  # conv and recurrent state of each request: read and written
            nbytes += 2 * sum(t[0].numel() * t.element_size() for t in cache) * requests
        else:  # latent cache rows of the context (and DSA's index rows)
            nbytes += sum(t.shape[-1] * t.element_size() for t in cache) * requests * context
    hidden = model.config.hidden_size
    return nbytes + rows * hidden * 2 * 2


def measure(args) -> list[dict[str, Any]]:
    """The step's rows on this process: one device, or rank r of the default process
    group (G ranks: SP layout, TP G with the per-rank shapes of TP 8, EP G)."""
    G, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    device = "cpu" if args.smoke else "cuda"
    config = smoke_config() if args.smoke else per_rank_config(args.layers, args.experts * G, tp=8 // G)
    par = Parallel("sp", dist.group.WORLD) if G > 1 else Parallel()
    tensors = checkpoint(config, 0, device, args.mxfp4)
    model = build_model(config, tensors, par, device=device)  # MXFP4: in the SM90 kernel's layout where it runs
    # the baseline as a user runs stock: MXFP4 experts as the checkpoint stores them
    stock = build_model(config, tensors, par, device=device, mxfp4_layout="checkpoint") if args.mxfp4 else model
    del tensors
    inductor = stock_inductor_with({torch.ops.kimi.fused_experts.default: _dense_fused,
                                    torch.ops.kimi.ep_experts.default: _dense_ep_experts})
    kimi_options = {"compiler": "eager"} if args.smoke else {}
    res = Results("decode_step")

    def sync():
        if G > 1:
            dist.barrier()

    for q in args.q:
        for rows in args.rows:
            if rows % q:
                continue
            R = rows // q
            batch = DecodeBatch(R, q, 0, config.vocab_size, block_size=args.block, max_context=args.context + q)
            batch.context[:] = args.context - 1
            caches = model.allocate_caches(batch.num_slots, batch.num_blocks, batch.block_size, q, device=device)
            fill_caches(caches, 7, device)
            step = batch.step().to(device)
            hit = experts_hit(model, step, caches, G, rank)
            row: dict[str, Any] = dict(q=q, rows=rows, requests=R, context=args.context, experts_hit=hit,
                                       experts="mxfp4" if args.mxfp4 else "bf16")
            if G > 1:
                row.update(rank=rank, ranks=G)
            outs = {}
            for name, backend in (("kimi", KimiSpecialized(kimi_options)),
                                  ("inductor", "eager" if args.smoke else inductor)):
                times = []
                for _ in range(2):  # cold, then again with Inductor's caches warm
                    torch._dynamo.reset()
                    fn = torch.compile(model if name == "kimi" else stock, backend=backend, dynamic=False)
                    start = time.perf_counter()
                    with torch.no_grad():
                        outs[name] = fn(step, [tuple(t.clone() for t in c) for c in caches]).float()
                    if device == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
                row[f"{name}_compile_s"], row[f"{name}_recompile_s"] = times
                if name == "kimi":
                    row["rewritten_layers"] = sum(layer.rewritten for layer in backend.report.layers)
                    row["layout"] = backend.report.layout_after
                if not args.smoke:  # timed on its own copy: replays advance the caches
                    scratch = [tuple(t.clone() for t in c) for c in caches]
                    with torch.no_grad():
                        sync()
                        row[f"{name}_us"] = graph_time_us(lambda i: fn(step, scratch), calls=5, replays=5)
                        sync()
                        if name == "kimi":
                            layers = [(layer.kind, layer.mlp) for layer in backend.report.layers]
                            kernels = step_breakdown.profile_kernels(lambda: fn(step, scratch), calls=3)
                            try:
                                parts = step_breakdown.breakdown(kernels, layers, 3)
                                row.update(kimi_breakdown_us=parts, kimi_kernel_us=sum(parts.values()),
                                           kimi_top_kernels_us=step_breakdown.top_kernels(kernels, layers, 3))
                            except ValueError as e:  # the times stand; the row says why it has no parts
                                row["kimi_breakdown_error"] = str(e)
                    del scratch
            ref = outs["inductor"]
            row["rel_err"] = float(((outs["kimi"] - ref).norm(dim=-1) / ref.norm(dim=-1)).max())
            if not args.smoke:
                fl = floor_us(floor_bytes(model, caches, hit, rows, R, args.context))
                row.update(floor_us=fl, kimi_x_floor=row["kimi_us"] / fl, speedup=row["inductor_us"] / row["kimi_us"])
            res.add(echo=rank == 0, **row)
    return res.rows


def main(argv=None) -> Results:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 32, 64], help="rows per step (R q)")
    p.add_argument("--q", type=int, nargs="+", default=[1, 4], help="tokens per request")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (K3's KDA:MLA schedule)")
    p.add_argument("--experts", type=int, default=64, help="routed experts per MoE layer on each rank")
    p.add_argument("--context", type=int, default=4000, help="tokens already in every request's cache")
    p.add_argument("--block", type=int, default=64, help="latent-cache block size")
    p.add_argument("--mxfp4", action="store_true", help="MXFP4 routed experts, loaded packed (issue 18)")
    p.add_argument("--gpus", type=int, default=1, choices=(1, 2, 4, 8),
                   help="G ranks, one GPU each (NCCL); with --smoke, G CPU ranks (gloo)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, eager compilers, no timing")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.smoke:
        args.context, args.block = min(args.context, 40), 4
    res = Results("decode_step" if args.gpus == 1 else f"decode_step_{args.gpus}gpus")
    if args.gpus == 1:
        res.rows = measure(args)
    else:
        if not args.smoke and torch.cuda.device_count() < args.gpus:
            raise SystemExit(f"decode_step: --gpus {args.gpus} needs {args.gpus} GPUs, found "
                             f"{torch.cuda.device_count()}")
        ranks = run_ranks(measure, args.gpus, args, backend="gloo" if args.smoke else "nccl")
        res.rows = [row for rows in ranks for row in rows]
    if args.json:
        res.dump(args.json)
    return res


if __name__ == "__main__":
    main()
