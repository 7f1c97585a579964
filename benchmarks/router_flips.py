"""Router top-k flips at K3 per-rank shapes (issue 15, item 9(b)).

The model: the stock decoder at TP8 per-rank shapes on one GPU (hidden 7168, 4 layers =
3 KDA + 1 MLA as K3 schedules them, 12 heads, layer 0 dense at 33792 / 8, MoE layers
1-3 with 64 experts of 3072 x 3584 (latent), top-16, 2 shared experts, a vocabulary of
163840 / 8), R requests of one token at ``--context`` tokens of cache (random latent
cache rows, KDA recurrent and conv states: no prefill) and ``--steps`` decode steps from
there, repeated for ``--trials`` token seeds on the same weights.

Variants (each against eager fp32 stock, ``fp32``, row by row):
  bf16                eager bf16 stock
  bf16_inductor       stock compiled by plain Inductor (no rewrite: a control)
  bf16_mega_moe       kimi_specialized with mega_moe only
  bf16_lower_kernels  kimi_specialized with lower_kernels only
  bf16_all            kimi_specialized with every pass
  fp32_all            kimi_specialized with every pass, fp32 (must be the same function)

Every MoE router call goes through one recording op (``routerflip::select``, the stock
sigmoid / biased top-k / renormalised weights) that keeps the fp32 logits of every row,
layer and step. Per row, the first (step, MoE layer) whose selected expert set differs
from fp32 stock's is the row's *flip*; the *margin* there is fp32 stock's gap between the
k-th and (k+1)-th selection score (sigmoid(logit) + bias), and ``dscore`` is how far the
variant's own selection scores of that row moved from fp32 stock's (max over experts;
a flip needs ``margin <= 2 dscore``). The op stands in for stock's selection in every
variant, so the router's logits are each graph's own while the selection is computed
alike. Each variant is then run again with its routing forced to fp32 stock's expert ids
(its own scores weight them): whatever error is left is not routing. ``check`` is the
tolerance rule of docs/testing.md.

    python benchmarks/router_flips.py --json router_flips.json          # one H200, about 80 s
    python benchmarks/router_flips.py --smoke                           # CPU, tiny shapes

JSON: ``meta``, ``variants`` (per variant: seconds of compile and run, per trial / step /
row the relative error against fp32 stock and the forced-routing error, per row the first
flip, per MoE layer the score move, the match report), ``margins`` (fp32 stock's margin
at every (layer, trial, step, row)), ``table`` (one line per row that flipped in any
variant), ``violations`` (what breaks the rule) and ``gemm_fp32`` (the Triton split-K
GEMM with fp32 operands against cuBLAS fp32 at the shared-expert gate_up shape).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
from torch import Tensor

from kimi_inductor.stock import Parallel
from kimi_inductor.stock import moe as stock_moe
from kimi_inductor.stock.batch import DecodeBatch
from kimi_inductor.stock.checkpoint import build_model

sys.path.insert(0, os.path.dirname(__file__))
from k3_rank import checkpoint, fill_caches, per_rank_config, smoke_config  # noqa: E402

VARIANTS = {  # name: (dtype, backend, options), in the order they run
    "fp32": ("float32", None, None),
    "bf16": ("bfloat16", None, None),
    "bf16_all": ("bfloat16", "kimi_specialized", {}),
    "bf16_mega_moe": ("bfloat16", "kimi_specialized", {"passes": ["mega_moe"]}),
    "bf16_lower_kernels": ("bfloat16", "kimi_specialized", {"passes": ["lower_kernels"]}),
    "fp32_all": ("float32", "kimi_specialized", {}),
    "bf16_inductor": ("bfloat16", "inductor", None),
}


# ------------------------------------------------------------- the router probe
class Probe:
    """What the ``routerflip::select`` op records and forces, per MoE layer."""

    layer_of: dict[int, int] = {}  # bias data_ptr -> layer index
    logits: dict[int, list[Tensor]] = {}  # layer -> one [rows, E] fp32 per call
    force: dict[int, list[Tensor]] | None = None  # layer -> ids per call (fp32 stock's)

    @classmethod
    def reset(cls, force=None):
        cls.logits, cls.force = {}, force


@torch.library.custom_op("routerflip::select", mutates_args=())
def _select(logits: Tensor, bias: Tensor, top_k: int, renormalize: bool, scale: float) -> tuple[Tensor, Tensor]:
    layer = Probe.layer_of[bias.data_ptr()]
    calls = Probe.logits.setdefault(layer, [])
    scores = torch.sigmoid(logits.float())
    if Probe.force is not None:
        ids = Probe.force[layer][len(calls)].to(logits.device).long()
    else:
        ids = torch.topk(scores + bias, top_k, dim=-1).indices
    calls.append(logits.detach().float().cpu())
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * scale, ids.to(torch.int32)


@_select.register_fake
def _(logits, bias, top_k, renormalize, scale):
    rows = logits.shape[0]
    return logits.new_empty(rows, top_k, dtype=torch.float32), logits.new_empty(rows, top_k, dtype=torch.int32)


def _select_experts(logits, bias, top_k, renormalize, scale):
    return torch.ops.routerflip.select(logits, bias, top_k, renormalize, float(scale))


def install_probe(model) -> None:
    stock_moe.select_experts = _select_experts  # KimiMoE.forward looks it up at call / trace time
    for layer in model.model.layers:
        if layer.is_moe_layer:
            Probe.layer_of[layer.block_sparse_moe.gate.e_score_correction_bias.data_ptr()] = layer.layer_idx


# ------------------------------------------------------------------- the runs
def run_variant(model, fn, config, args, force_ids=None) -> dict[str, Any]:
    """Every trial: fill the caches, decode ``steps`` steps; outputs [trials, steps, rows, H]
    and logits {layer: [trials, steps, rows, E]}."""
    device = next(model.parameters()).device
    outs, logits = [], {}
    for trial in range(args.trials):
        batch = DecodeBatch(args.requests, 1, 0, config.vocab_size, block_size=args.block,
                            max_context=args.context + args.steps, seed=100 + trial)
        batch.context[:] = args.context - 1  # the first step's token is token ``context``
        caches = model.allocate_caches(batch.num_slots, batch.num_blocks, batch.block_size, 1, device=device)
        fill_caches(caches, 7 + trial, device)
        Probe.reset(None if force_ids is None else {l: list(v[trial]) for l, v in force_ids.items()})
        steps = []
        with torch.no_grad():
            for _ in range(args.steps):
                steps.append(fn(batch.step().to(device), caches).float().cpu())
                batch.accept()
        outs.append(torch.stack(steps))
        for layer, calls in Probe.logits.items():
            assert len(calls) == args.steps, f"layer {layer}: {len(calls)} router calls in {args.steps} steps"
            logits.setdefault(layer, []).append(torch.stack(calls))
        del caches
    return {"out": torch.stack(outs), "logits": {l: torch.stack(v) for l, v in logits.items()}}


# --------------------------------------------------------------------- analysis
def selection(logits: Tensor, bias: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(score = sigmoid(logit) + bias, sorted expert ids of the top k) for [..., E] logits."""
    score = torch.sigmoid(logits.double()) + bias.double()
    return score, torch.topk(score, k, dim=-1).indices.sort(-1).values


def margin(score: Tensor, k: int) -> Tensor:
    """The gap between the k-th and (k+1)-th selection score."""
    top = torch.topk(score, k + 1, dim=-1).values
    return top[..., k - 1] - top[..., k]


def first_flips(ref_logits: dict[int, Tensor], logits: dict[int, Tensor], biases: dict[int, Tensor],
                k: int) -> list[dict[str, Any]]:
    """Per (trial, row): the first (step, layer), in execution order, whose selected set
    differs from the reference's, with the reference margin, the variant's own margin, the
    largest score move and the experts swapped there; None where none differs."""
    layers = sorted(ref_logits)
    trials, steps, rows, _ = ref_logits[layers[0]].shape
    out = []
    for trial in range(trials):
        for row in range(rows):
            found = None
            for step in range(steps):
                for layer in layers:
                    s_ref, ids_ref = selection(ref_logits[layer][trial, step, row], biases[layer], k)
                    s_run, ids_run = selection(logits[layer][trial, step, row], biases[layer], k)
                    if torch.equal(ids_ref, ids_run):
                        continue
                    rank = torch.argsort(s_ref, descending=True).argsort()  # 0-based rank under the reference
                    lost = sorted(set(ids_ref.tolist()) - set(ids_run.tolist()))
                    gained = sorted(set(ids_run.tolist()) - set(ids_ref.tolist()))
                    found = dict(step=step, layer=layer, margin=float(margin(s_ref, k)),
                                 own_margin=float(margin(s_run, k)),
                                 dscore=float((s_run - s_ref).abs().max()),
                                 lost=[(e, int(rank[e]) + 1) for e in lost],
                                 gained=[(e, int(rank[e]) + 1) for e in gained])
                    break
                if found:
                    break
            out.append(dict(trial=trial, row=row, flip=found))
    return out


def row_errors(out: Tensor, ref: Tensor) -> Tensor:
    """||out - ref|| / ||ref|| per (trial, step, row)."""
    return (out - ref).norm(dim=-1) / ref.norm(dim=-1)


def score_moves(ref_logits, logits, biases) -> dict[int, float]:
    """Per layer, the median over rows (first step only: before any flip can feed back)
    of the largest selection-score move against the reference."""
    return {l: float(((torch.sigmoid(logits[l][:, 0].double()) - torch.sigmoid(ref_logits[l][:, 0].double()))
                      .abs().amax(-1)).median()) for l in ref_logits}


# ------------------------------------------------------------ fp32 GEMM check
def gemm_fp32_check(device) -> dict[str, float]:
    """The Triton split-K GEMM (``tl_dot``) with fp32 operands against cuBLAS fp32 at the
    shared experts' gate_up shape (8 x 12288 x 7168, where lower_kernels picks it)."""
    from kimi_inductor.kernels.skinny_gemm import tl_dot

    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(8, 7168, generator=gen, device=device)
    w = torch.randn(12288, 7168, generator=gen, device=device) * 7168**-0.5
    exact = (x.double() @ w.double().t())
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    cublas = x @ w.t()
    torch.backends.cuda.matmul.allow_tf32 = prev
    ours = tl_dot.run(x, w, None, torch.float32)
    rel = lambda a: float((a.double() - exact).norm() / exact.norm())  # noqa: E731
    return {"cublas_fp32_rel": rel(cublas), "tl_dot_fp32_rel": rel(ours)}


# ------------------------------------------------------------------------ main
def main(argv=None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=4000, help="tokens already in every request's cache")
    p.add_argument("--requests", type=int, default=8, help="rows (one token per request)")
    p.add_argument("--steps", type=int, default=4, help="decode steps per trial")
    p.add_argument("--trials", type=int, default=4, help="token / cache seeds on the same weights")
    p.add_argument("--seed", type=int, default=0, help="weights")
    p.add_argument("--block", type=int, default=64, help="latent-cache block size")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--mxfp4", action="store_true", help="MXFP4 routed experts, loaded packed")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, eager compiler")
    p.add_argument("--json")
    args = p.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.context, args.block = min(args.context, 40), 4
    config = smoke_config() if args.smoke else per_rank_config()
    k = config.num_experts_per_token
    from kimi_inductor import register

    register()
    t0 = time.time()
    tensors = checkpoint(config, args.seed, device, args.mxfp4)
    print(f"checkpoint {time.time() - t0:.1f} s", flush=True)
    models: dict[str, Any] = {}

    def model_for(dtype: str):
        if dtype not in models:
            models[dtype] = build_model(config, tensors, Parallel(), device=device, dtype=getattr(torch, dtype))
            install_probe(models[dtype])
        return models[dtype]

    moe_layers = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
    biases = {i: tensors[f"model.layers.{i}.block_sparse_moe.gate.e_score_correction_bias"].float().cpu()
              for i in moe_layers}
    names = ["fp32"] + [n for n in args.variants if n != "fp32"]
    results: dict[str, Any] = {}
    extra = {"gemm_fp32": gemm_fp32_check(device)} if device == "cuda" else {}
    for name in names:
        dtype, backend, options = VARIANTS[name]
        model = model_for(dtype)
        torch._dynamo.reset()
        fn = model
        if backend is not None:
            if args.smoke:  # no code generation on the CPU
                backend, options = ("eager", None) if backend == "inductor" else \
                    (backend, {**options, "compiler": "eager"})
            fn = torch.compile(model, backend=backend, options=options, dynamic=False)
        t0 = time.time()
        res = run_variant(model, fn, config, args)
        res["seconds"] = time.time() - t0
        if backend == "kimi_specialized":
            from kimi_inductor.backend import match_report

            res["report"] = match_report(fn).to_dict()
        if name != "fp32":  # forced routing: fp32 stock's ids, step by step
            ref = results["fp32"]
            ids = {l: selection(v, biases[l], k)[1] for l, v in ref["logits"].items()}
            res["forced"] = run_variant(model, fn, config, args, force_ids=ids)
        results[name] = res
        print(f"{name}: {res['seconds']:.1f} s", flush=True)
        if len(results) > 1 and args.json:  # what is done so far, in case the run is cut short
            with open(args.json, "w") as fh:
                json.dump({**analyse(results, config, args, biases, moe_layers, device), **extra}, fh, indent=1)
    out = {**analyse(results, config, args, biases, moe_layers, device), **extra}
    out["violations"] = check(out)
    print(format_summary(out), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return out


def analyse(results, config, args, biases, moe_layers, device) -> dict[str, Any]:
    """The JSON of the variants in ``results`` against ``results["fp32"]``."""
    k = config.num_experts_per_token
    ref = results["fp32"]
    out: dict[str, Any] = {"meta": dict(
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu", torch=torch.__version__,
        time=time.strftime("%Y-%m-%d %H:%M:%S"), config=dict(
            hidden=config.hidden_size, layers=config.num_hidden_layers,
            kinds=[config.layer_kind(i) for i in range(config.num_hidden_layers)], moe_layers=moe_layers,
            heads=config.num_attention_heads, experts=config.num_experts, top_k=k,
            expert_width=config.moe_intermediate_size, latent=config.routed_expert_hidden_size,
            vocab=config.vocab_size),
        rows=args.requests, context=args.context, steps=args.steps, trials=args.trials, seed=args.seed,
        block=args.block)}
    ref_scores = {l: selection(v, biases[l], k)[0] for l, v in ref["logits"].items()}
    all_margins = torch.stack([margin(s, k) for s in ref_scores.values()])  # [layers, trials, steps, rows]
    out["margins"] = {"layers": moe_layers, "values": all_margins.tolist(),
                      "median": float(all_margins.median()), "min": float(all_margins.min())}
    out["variants"] = {}
    for name, res in results.items():
        if name == "fp32":
            continue
        err = row_errors(res["out"], ref["out"])
        flips = first_flips(ref["logits"], res["logits"], biases, k)
        v = dict(seconds=res["seconds"], error=err.tolist(), flips=flips,
                 score_move=score_moves(ref["logits"], res["logits"], biases),
                 median_error=float(err.median()), max_error=float(err.max()), report=res.get("report"))
        flipped = torch.zeros_like(err, dtype=torch.bool)  # [trial, step, row]: flipped at or before the step
        for f in flips:
            if f["flip"] is not None:
                flipped[f["trial"], f["flip"]["step"]:, f["row"]] = True
        v["rows_flipped"] = int(flipped[:, -1].sum())
        v["max_error_unflipped"] = float(err[~flipped].max()) if (~flipped).any() else None
        v["median_error_unflipped"] = float(err[~flipped].median()) if (~flipped).any() else None
        if "forced" in res:
            ferr = row_errors(res["forced"]["out"], ref["out"])
            v.update(forced_error=ferr.tolist(), forced_median_error=float(ferr.median()),
                     forced_max_error=float(ferr.max()))
        out["variants"][name] = v
    table = []
    for trial in range(args.trials):
        for row in range(args.requests):
            line = dict(trial=trial, row=row)
            for name, v in out["variants"].items():
                f = next(f["flip"] for f in v["flips"] if f["trial"] == trial and f["row"] == row)
                last = v["error"][trial][-1][row]
                line[name] = dict(error=round(last, 4), flip=f and {kk: (round(vv, 6) if isinstance(vv, float)
                                                                         else vv) for kk, vv in f.items()})
            if any(line[n]["flip"] for n in out["variants"]):
                table.append(line)
    out["table"] = table
    return out


def check(out: dict[str, Any], band: float = 2.0, fp32_tol: float = 1e-4) -> list[str]:
    """The tolerance rule for bf16 at K3 per-rank shapes (docs/testing.md); returns what
    breaks it. bf16 stock's own errors against fp32 stock are the band (B):

    1. routing held fixed (fp32 stock's expert ids forced): the median and the largest
       row error of every bf16 variant within ``band`` x B's;
    2. router inputs: per MoE layer, the median (over rows, first step) of the largest
       selection-score move within ``band`` x B's;
    3. free-running: every row at every step whose selected experts matched fp32 stock's
       at every MoE layer so far: the largest row error within ``band`` x B's, the median
       within ``band`` x B's median;
    4. rows whose selection flipped (a near tie: the table reports step, layer, fp32
       margin and score move): no error bound.

    fp32 variants: within ``fp32_tol`` with routing forced and on every row not flipped."""
    bad = []
    base = out["variants"].get("bf16")
    for name, v in out["variants"].items():
        if name == "bf16":
            continue
        if name.startswith("fp32"):
            for key in ("forced_max_error", "max_error_unflipped"):
                if v.get(key) is not None and v[key] > fp32_tol:
                    bad.append(f"{name}: {key} {v[key]:.2e} > {fp32_tol:.0e}")
            continue
        if base is None:
            bad.append(f"{name}: no bf16 stock run to take the band from")
            continue
        measured = {key: (v.get(key), base.get(key)) for key in
                    ("forced_median_error", "forced_max_error", "median_error_unflipped", "max_error_unflipped")}
        measured.update({f"score move, layer {layer}": (move, base["score_move"][layer])
                         for layer, move in v["score_move"].items()})
        for label, (got, ref) in measured.items():
            if got is not None and ref is not None and got > band * ref:
                bad.append(f"{name}: {label} {got:.4g} > {band} x bf16 stock's {ref:.4g}")
    return bad


def format_summary(out: dict[str, Any]) -> str:
    lines = [f"fp32 stock margins (k-th - (k+1)-th score): median {out['margins']['median']:.2e}, "
             f"min {out['margins']['min']:.2e}"]
    lines.append("variant              median err  max err  max err (no flip)  rows flipped  "
                 "forced: median / max   score move per MoE layer")
    for name, v in out["variants"].items():
        forced = (f"{v['forced_median_error']:.4f} / {v['forced_max_error']:.4f}" if "forced_median_error" in v
                  else "-")
        unflipped = "-" if v["max_error_unflipped"] is None else f"{v['max_error_unflipped']:.4f}"
        moves = " ".join(f"{m:.1e}" for m in v["score_move"].values())
        lines.append(f"{name:20s} {v['median_error']:.4f}      {v['max_error']:.4f}   {unflipped:17s}  "
                     f"{v['rows_flipped']:12d}  {forced:21s}  {moves}")
    lines.append("rows that flipped (trial, row): per variant first (step, layer), fp32 margin, score move, "
                 "last-step error")
    for line in out["table"]:
        cells = []
        for name in out["variants"]:
            f = line[name]["flip"]
            cells.append(f"{name}: " + (f"s{f['step']} L{f['layer']} m={f['margin']:.1e} d={f['dscore']:.1e} "
                                        f"e={line[name]['error']:.3f}" if f else f"- e={line[name]['error']:.3f}"))
        lines.append(f"  ({line['trial']}, {line['row']})  " + " | ".join(cells))
    if "gemm_fp32" in out:
        lines.append(f"fp32 GEMM 8x12288x7168 vs fp64: {out['gemm_fp32']}")
    bad = check(out)
    lines.append("tolerance rule (docs/testing.md): " + ("met" if not bad else "BROKEN: " + "; ".join(bad)))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main() and 0)
