"""One MLA (or K3.1 DSA) layer decode step at TP8 per-rank shapes (12 of 96 heads, hidden
7168, latent 512 + rope 64, a paged cache of 64-token blocks, every request at
``--context`` tokens): fused_qkv_a_g -> norms -> q_b -> absorption -> [DSA: indexer
projections, index-cache write, scores, top-2048] -> core (cache write + attention) ->
v up-projection -> output gate -> o_proj partial (no AttnRes, no all-reduce).
kimi_specialized (``lower_kernels``: the split-KV Triton core, with DSA's selection mask)
vs stock compiled by Inductor (through the stock math) vs the byte floor (weights, the
cache rows the layer must read: all of them for MLA; for DSA the index cache plus only
the top-k latent rows, activations), inside CUDA graphs.

    python benchmarks/mla_layer.py --rows 1 8 32 64 --q 1 4 --context 4096 --json mla.json
    python benchmarks/mla_layer.py --kind dsa --rows 1 8 32 64 --q 1 --context 8192 --json dsa.json
    python benchmarks/mla_layer.py --rows 1 2 8 --q 1 --bmm-ab --json X  # per-head GEMM lowerings off / everywhere
    python benchmarks/mla_layer.py --rows 1 2 8 --q 1 --merge-ab --json X  # the split merge in the v up-projection
    python benchmarks/mla_layer.py --rows 8 32 --q 1 --capacity 32768 --json X  # a table sized like vLLM's
    python benchmarks/mla_layer.py --smoke [--kind dsa]   # CPU, tiny shapes: checks the script runs
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
from torch.func import functional_call

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, floor_us, graph_time_us, require_rewritten  # noqa: E402
from step_breakdown import kernel_profile  # noqa: E402

from kimi_inductor.backend import KimiSpecialized  # noqa: E402
from kimi_inductor.kernels import mla_decode as mla_kernel  # noqa: E402
from kimi_inductor.kernels import skinny_gemm  # noqa: E402
from kimi_inductor.baseline import stock_inductor  # noqa: E402
from kimi_inductor.stock import DecodeStep, KimiK3Config, Parallel  # noqa: E402
from kimi_inductor.stock.dsa import SparseLatentAttention  # noqa: E402
from kimi_inductor.stock.mla import MultiHeadLatentAttention  # noqa: E402


# kimi_specialized with other dispatch tables, timed beside it: name -> (module, the values
# the variant compiles with). --bmm-ab: per-head GEMM lowerings switched off, or on at every row count; --merge-ab:
# the core's split merge in the gated v up-projection at every row count, or never.
BMM_VARIANTS = {
    "gate_unfused": (skinny_gemm, {"FASTEST_BMM_GATE": {}}),  # our bmm, then Inductor's copy + gate
    "cublas_bmm": (skinny_gemm, {"FASTEST_BMM": {}, "FASTEST_BMM_GATE": {}}),  # every per-head GEMM on cuBLAS
    "ours_bmm": (skinny_gemm, {"FASTEST_BMM": {(12, 128, 512): 64, (12, 512, 128): 64},  # ours at every row
                               "FASTEST_BMM_GATE": {(12, 512, 128): 64}}),                # count, gate fused
}
MERGE_VARIANTS = {
    "merge_in_up": (mla_kernel, {"MERGE_INTO_UP": 64}),
    "merge_apart": (mla_kernel, {"MERGE_INTO_UP": 0}),
}


@contextlib.contextmanager
def patched(module, values):
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def random_params(layer, gen: torch.Generator, device) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in layer.named_parameters():
        t = torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5 if p.dim() == 2 else 0.1)
        out[name] = (t + 1 if name.endswith("layernorm.weight") else t).to(device=device, dtype=p.dtype)
    return out


def main(argv=None) -> Results:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--q", type=int, nargs="+", default=[1, 4])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--capacity", type=int, default=0,
                   help="positions the block table holds per request (vLLM: max_model_len; default: --context); "
                        "entries past the context name block 0")
    p.add_argument("--kind", choices=["mla", "dsa"], default="mla")
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, no timing")
    p.add_argument("--profile", action="store_true",
                   help="also list kimi_specialized's kernels per row count (take it with KIMI_INDUCTOR_PDL=0) "
                        "and its timeline (kimi_timeline: with PDL its overlaps show the release points)")
    p.add_argument("--bmm-ab", action="store_true",
                   help=f"also time kimi_specialized with other per-head GEMM tables: {', '.join(BMM_VARIANTS)}")
    p.add_argument("--merge-ab", action="store_true",
                   help=f"also time kimi_specialized with the MLA merge moved: {', '.join(MERGE_VARIANTS)}")
    p.add_argument("--json")
    args = p.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    dsa = args.kind == "dsa"
    base = KimiK3Config.preset({("mla", False): "kimi-k3", ("dsa", False): "kimi-k3.1", ("mla", True): "tiny",
                                ("dsa", True): "tiny-k3.1"}[args.kind, args.smoke])
    config = base.replace(num_attention_heads=base.num_attention_heads // (1 if args.smoke else 8))
    layer = (SparseLatentAttention if dsa else MultiHeadLatentAttention)(config, Parallel(), device="meta")
    index_dim = config.dsa_config["index_head_dim"] if dsa else 0
    block, context = (4, 16) if args.smoke else (64, args.context)
    width = -(-max(args.capacity * (not args.smoke), context) // block)
    gen = torch.Generator().manual_seed(0)
    copies = [random_params(layer, gen, device) for _ in range(1 if args.smoke else args.copies)]
    weight_bytes = sum(t.numel() * t.element_size() for t in copies[0].values())

    def step(params, x, slots, table, seq_lens, cache):
        s = DecodeStep(input_ids=seq_lens, state_slots=table, num_accepted=seq_lens, slot_mapping=slots,
                       block_table=table, seq_lens=seq_lens, is_padding=seq_lens)
        return functional_call(layer, params, (x, s, cache))

    res = Results(f"{args.kind}_layer")
    for q in args.q:
        for rows in args.rows:
            if rows % q:
                continue
            R, per_req = rows // q, -(-context // block)
            torch._dynamo.reset()
            x = torch.randn(rows, config.hidden_size, generator=gen).to(device=device, dtype=torch.bfloat16)
            table = torch.zeros(R, width, dtype=torch.int32)
            table[:, :per_req] = 1 + torch.arange(R * per_req, dtype=torch.int32).view(R, per_req)
            table = table.to(device)
            seq_lens = torch.full((R,), context, dtype=torch.int32, device=device)
            pos = torch.arange(context - q, context, device=device)
            slots = (table.long().gather(1, (pos // block).expand(R, q)) * block + pos % block).view(-1)
            caches = [tuple(torch.randn(1 + R * per_req, block, width, generator=gen).to(device=device,
                                                                                      dtype=torch.bfloat16)
                            for width in (config.latent_row, index_dim) if width)
                      for _ in range(1 if args.smoke else args.copies)]
            stock = torch.compile(step, backend=stock_inductor, dynamic=False)
            backend = KimiSpecialized({"passes": ["lower_kernels"], "compiler": "inductor"})
            kimi = torch.compile(step, backend=backend, dynamic=False)
            c1, c2 = [tuple(c.clone() for c in caches[0]) for _ in range(2)]
            want = stock(copies[0], x, slots, table, seq_lens, c1).float()
            got = kimi(copies[0], x, slots, table, seq_lens, c2).float()
            err = float(((got - want).norm(dim=-1) / want.norm(dim=-1)).max())
            require_rewritten(backend, "mla_layer")
            variants = {}
            chosen = {**(BMM_VARIANTS if args.bmm_ab else {}), **(MERGE_VARIANTS if args.merge_ab else {})}
            for name, (module, values) in chosen.items():
                variant = KimiSpecialized({"passes": ["lower_kernels"], "compiler": "inductor"})
                variants[name] = fn = torch.compile(step, backend=variant, dynamic=False)
                with patched(module, values):  # compiled at its first call
                    out = fn(copies[0], x, slots, table, seq_lens, tuple(c.clone() for c in caches[0])).float()
                require_rewritten(variant, "mla_layer")  # its own compile: the passes' uuid covers the tables
                err = max(err, float(((out - want).norm(dim=-1) / want.norm(dim=-1)).max()))
            if args.smoke:
                res.add(q=q, rows=rows, rel_err=err, cache_equal=all(map(torch.equal, c1, c2)))
                continue
            n = len(copies)
            t_stock = graph_time_us(lambda i: stock(copies[i % n], x, slots, table, seq_lens, caches[i % n]))
            t_kimi = graph_time_us(lambda i: kimi(copies[i % n], x, slots, table, seq_lens, caches[i % n]))
            read = min(context, config.dsa_config["index_topk"]) if dsa else context
            cache_bytes = R * (read * config.latent_row + context * index_dim) * 2
            fl = floor_us(weight_bytes + cache_bytes + 2 * rows * config.hidden_size * 2)
            res.add(q=q, rows=rows, context=context, capacity=width * block, floor_us=fl, inductor_us=t_stock,
                    kimi_us=t_kimi, kimi_x_floor=t_kimi / fl, speedup=t_stock / t_kimi, rel_err=err)
            for name, fn in variants.items():
                t = graph_time_us(lambda i: fn(copies[i % n], x, slots, table, seq_lens, caches[i % n]))
                res.rows[-1].update({f"kimi_{name}_us": t, f"{name}_x_kimi": t / t_kimi})
            if variants:
                lower = next(p for p in backend.report.passes if p.name == "lower_kernels")
                res.rows[-1]["bmm_kept"] = [s for s in lower.skipped if "per-head" in s]
            if args.profile:
                res.rows[-1]["kimi_kernels_us"], res.rows[-1]["kimi_timeline"] = kernel_profile(
                    lambda: kimi(copies[0], x, slots, table, seq_lens, caches[0]), top=24)
    if args.json:
        res.dump(args.json)
    return res


if __name__ == "__main__":
    main()
