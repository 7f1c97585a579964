"""One KDA layer decode step at TP8 per-rank shapes (12 heads x 128, hidden 7168):
kimi_specialized (lowered kernels) vs stock compiled by Inductor vs the byte floor,
each inside CUDA graphs. The step is in_proj -> f_b -> conv/gates/delta rule/norm ->
o_proj partial (no AttnRes, no all-reduce), as the reference KDA measurement. A lone
layer is a layer fragment: kimi_specialized lowers it (lower_kernels only).

``--vllm ROOT`` (vLLM 0.33.0's wheel unpacked there; q = 1) adds the stock vLLM chain of
the same step as its SM90 Triton path runs it, in the same CUDA graphs: cuBLAS in_proj,
vLLM's decode core (``kda_kernel.vllm_core``: f_b GEMM, its Triton conv update, packed
recurrent decode, gated norm) and cuBLAS o_proj. ``--vllm-native SO`` (vLLM 0.33.0's
``_C_stable_libtorch.abi3.so``, stable ABI: it loads on the GPU image's torch) adds the
chain vLLM runs on SM90 at 12 heads with its CUDA build: the same with its native
``_C::fused_kda_decode`` as the core (``kda_kernel.vllm_native``).

    python benchmarks/kda_layer.py --json kda.json [--rows 1 8 32 64] [--q 1 4] [--vllm ROOT] [--vllm-native SO]
        [--profile]
    python benchmarks/kda_layer.py --smoke          # CPU, tiny shapes: checks the script runs
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.func import functional_call

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, floor_us, graph_time_us, require_rewritten  # noqa: E402

from kda_kernel import vllm_core, vllm_native, vllm_native_weights  # noqa: E402
from step_breakdown import kernel_profile, kernel_table  # noqa: E402

from kimi_inductor.backend import KimiSpecialized  # noqa: E402
from kimi_inductor.baseline import stock_inductor  # noqa: E402
from kimi_inductor.stock import DecodeStep, KimiK3Config, Parallel  # noqa: E402
from kimi_inductor.stock.kda import KimiDeltaAttention  # noqa: E402


def layer_config(heads: int, head_dim: int, hidden: int) -> KimiK3Config:
    base = KimiK3Config.preset("kimi-k3")
    la = dict(base.linear_attn_config, num_heads=heads, head_dim=head_dim)
    return base.replace(hidden_size=hidden, linear_attn_config=la)


def random_params(layer: KimiDeltaAttention, gen: torch.Generator, device) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in layer.named_parameters():
        t = torch.randn(p.shape, generator=gen)
        if name == "A_log":
            t = torch.log(torch.rand(p.shape, generator=gen) * 15 + 1)
        elif p.dim() == 2:
            t = t * p.shape[1] ** -0.5
        elif name == "o_norm.weight":
            t = 1 + 0.1 * t
        else:
            t = 0.5 * t
        out[name] = t.to(device=device, dtype=p.dtype)
    return out


def state_bytes(requests: int, q: int, heads: int, d: int, conv_rows: int) -> float:
    rec = requests * heads * d * d * 4 * (1 + q)  # read one state, write q
    conv = requests * conv_rows * 3 * heads * d * 2 * 2
    return rec + conv


def vllm_chain(core, layer: KimiDeltaAttention):
    """(params, x, slots, conv, rec, extra) -> the layer's o_proj partial [T, hidden]
    through vLLM's kernels with decode ``core`` (``vllm_core``'s, or ``vllm_native`` with
    its weights in ``extra``), q = 1 (``slots`` [T, 1]; the caches updated in place)."""
    P, D, H = layer.local_size, layer.head_dim, layer.local_heads
    split = [3 * P, P, D, H, layer.in_proj_padding]

    def step(params, x, slots, conv, rec, extra=None):
        mixed, g2, f_a, beta, _ = (x @ params["in_proj_qkvgfab.weight"].t()).split(split, dim=-1)
        o = core(dict(mixed_qkv=mixed, g2=g2, f_a=f_a, beta=beta, f_b_weight=params["f_b_proj.weight"],
                      conv_weight=params["conv1d.weight"], A_log=params["A_log"], dt_bias=params["dt_bias"],
                      norm_weight=params["o_norm.weight"], conv_state=conv, recurrent_state=rec, state_slots=slots,
                      lower_bound=layer.lower_bound, norm_eps=layer.eps, **(extra or {})))
        return o.reshape(x.shape[0], P) @ params["o_proj.weight"].t()

    return step


def main(argv=None) -> Results:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--q", type=int, nargs="+", default=[1, 4])
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, no timing")
    p.add_argument("--vllm", help="vLLM 0.33.0's wheel unpacked here: time its chain too (q = 1)")
    p.add_argument("--vllm-native", help="vLLM 0.33.0's _C_stable_libtorch.abi3.so: time its native chain (q = 1)")
    p.add_argument("--profile", action="store_true",
                   help="also list the kernels of each side per row count (take it with KIMI_INDUCTOR_PDL=0: "
                        "an early-launched kernel's wait counts in its duration) and kimi_specialized's timeline "
                        "(kimi_timeline: with PDL its overlaps show where each kernel released the next)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    heads, d, hidden = (2, 16, 64) if args.smoke else (12, 128, 7168)
    layer = KimiDeltaAttention(layer_config(heads, d, hidden), Parallel(), device="meta")
    gen = torch.Generator().manual_seed(0)
    copies = [random_params(layer, gen, device) for _ in range(1 if args.smoke else args.copies)]
    chains = {}  # name -> (step, per-copy extra inputs)
    if args.vllm:
        chains["vllm"] = vllm_chain(vllm_core(args.vllm), layer), [None] * len(copies)
    if args.vllm_native:
        torch.ops.load_library(args.vllm_native)
        chains["vllm_native"] = vllm_chain(vllm_native, layer), [
            vllm_native_weights(c["conv1d.weight"], c["o_norm.weight"]) for c in copies]
    weight_bytes = sum(t.numel() * t.element_size() for t in copies[0].values())

    def step(params, x, slots, accepted, conv, rec):
        s = DecodeStep(input_ids=x, state_slots=slots, num_accepted=accepted, slot_mapping=x, block_table=slots,
                       seq_lens=accepted, is_padding=x)
        return functional_call(layer, params, (x, s, (conv, rec)))

    res = Results("kda_layer")
    for q in args.q:
        for rows in args.rows:
            if rows % q:
                continue
            R = rows // q
            torch._dynamo.reset()
            x = torch.randn(rows, hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
            slots = (1 + torch.arange(R * q, dtype=torch.int32).view(R, q)).to(device)
            accepted = torch.full((R,), q, dtype=torch.int32, device=device)
            conv_shape, rec_shape = (s for s, _ in KimiDeltaAttention.cache_shapes(layer_config(heads, d, hidden), Parallel(), 1 + R * q, q, torch.bfloat16))
            conv = (0.5 * torch.randn(conv_shape, generator=gen)).to(device=device, dtype=torch.bfloat16)
            rec = (0.1 * torch.randn(rec_shape, generator=gen)).to(device=device)
            start = time.perf_counter()
            stock = torch.compile(step, backend=stock_inductor, dynamic=False)
            backend = KimiSpecialized({"passes": ["lower_kernels"], "compiler": "inductor"})
            kimi = torch.compile(step, backend=backend, dynamic=False)
            c1, r1, c2, r2 = conv.clone(), rec.clone(), conv.clone(), rec.clone()
            want = stock(copies[0], x, slots, accepted, c1, r1).float()
            got = kimi(copies[0], x, slots, accepted, c2, r2).float()
            err = float((got - want).abs().max() / want.abs().max())
            state_err = float((r1 - r2).abs().max())
            compile_s = time.perf_counter() - start
            require_rewritten(backend, "kda_layer")
            if args.smoke:
                res.add(q=q, rows=rows, rel_err=err, state_err=state_err)
                continue
            row = dict(q=q, rows=rows)
            for name, (chain, extra) in chains.items() if q == 1 else ():
                # on the caches as they were for ``want`` (the timing below advances them)
                got = chain(copies[0], x, slots, conv.clone(), rec.clone(), extra[0]).float()
                row[f"{name}_rel_err"] = float((got - want).abs().max() / want.abs().max())
            n = len(copies)
            t_stock = graph_time_us(lambda i: stock(copies[i % n], x, slots, accepted, conv, rec))
            t_kimi = graph_time_us(lambda i: kimi(copies[i % n], x, slots, accepted, conv, rec))
            nbytes = weight_bytes + state_bytes(R, q, heads, d, conv_shape[1]) + 2 * rows * hidden * 2
            fl = floor_us(nbytes)
            row.update(floor_us=fl, inductor_us=t_stock, kimi_us=t_kimi, kimi_x_floor=t_kimi / fl,
                       speedup=t_stock / t_kimi, rel_err=err, state_err=state_err, compile_s=compile_s)
            for name, (chain, extra) in chains.items() if q == 1 else ():
                row[f"{name}_us"] = graph_time_us(lambda i: chain(copies[i % n], x, slots, conv, rec, extra[i % n]))
                row[f"{name}_over_kimi"] = row[f"{name}_us"] / t_kimi
            if args.profile:
                row["kimi_kernels_us"], row["kimi_timeline"] = kernel_profile(
                    lambda: kimi(copies[0], x, slots, accepted, conv, rec))
                for name, (chain, extra) in chains.items() if q == 1 else ():
                    row[f"{name}_kernels_us"] = kernel_table(lambda: chain(copies[0], x, slots, conv, rec, extra[0]))
            res.add(**row)
    if args.json:
        res.dump(args.json)
    return res


if __name__ == "__main__":
    main()
