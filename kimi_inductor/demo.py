"""The main job: the tiny stock Kimi K3 decoder on several CPU ranks, compiled by
``kimi_specialized``, with its match report and an equality check against stock.

On every rank (gloo, spawned for the user) the same random checkpoint decodes the
same steps twice: the stock decoder in SP layout (eager, per-layer timings) and the
decoder compiled by ``kimi_specialized`` (with ``dp`` > 1, ``dp`` TP groups of ``ranks``
ranks each decode their own requests and share the routed experts; the report and the
check are TP group 0's). The outputs must agree (docs/testing.md):
  * bitwise, in bf16, with the eager compiler, when the rewrite's all-reduce sums the
    o-projection partials in the order stock's reduce-scatter does (gloo: G = 2, or T a
    multiple of G) and no MoE layer is split over the ranks;
  * otherwise within the bf16 band: the compiled run's median row error against stock
    in fp32 at most 2.5 x stock bf16's own, + 0.01 (a router's top-k flip at a near
    tie puts single rows far off in any two bf16 runs, so no maximum is compared);
  * in fp32 (``--dtype float32``): within 1e-4 of the output scale.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from typing import Any

from .config import Options
from .harness import DecodeRun, decode_many, progress as say
from .launch import run_ranks
from .passes.report import LayerReport


def demo(preset: str = "tiny", ranks: int = 2, q: int = 4, steps: int = 8, requests: int = 3, padding: int = 1,
         dtype: str = "bfloat16", compiler: str = "eager", dcp: int = 1, dp: int = 1, json_path: str | None = None,
         progress: bool = False) -> dict[str, Any]:
    """``progress``: rank 0 prints each run's steps (and the compile) on stderr."""
    stock = DecodeRun(preset=preset, layout="sp", q=q, steps=steps, requests=requests, padding=padding,
                      dtype=dtype, dcp=dcp, dp=dp, layer_timings=True, progress=f"stock SP {dtype}" if progress else "")
    compiled = dataclasses.replace(stock, layer_timings=False, backend="kimi_specialized",
                                   options={"compiler": compiler}, progress="kimi_specialized" if progress else "")
    rows = (requests + padding) * q
    # sharded_moe sums partial shared-expert outputs in bf16 across ranks: a band, not bitwise
    sharded_moe = ranks > 1 and rows <= Options().decode.sharded_moe_rows
    # Inductor's code generation does not keep every bf16 rounding of stock's eager ops
    bitwise = dtype == "bfloat16" and compiler == "eager" and not sharded_moe and (ranks <= 2 or rows % ranks == 0)
    runs = [stock, compiled]
    if dtype == "bfloat16" and not bitwise:
        runs.append(dataclasses.replace(stock, dtype="float32", layer_timings=False,
                                        progress="stock SP float32 (the bf16 band's reference)" if progress else ""))
    world = ranks * dp
    if progress:
        say(f"demo: {len(runs)} runs of {steps} steps ({rows} rows) on {world} CPU rank{'s' if world > 1 else ''}"
            f"{f' ({dp} TP groups of {ranks})' if dp > 1 else ''}{' (spawning gloo processes)' if world > 1 else ''}")
    results = run_ranks(decode_many, world, runs) if world > 1 else [decode_many(runs)]
    ref, out = results[0][0], results[0][1]
    diff = float((out["outputs"] - ref["outputs"]).abs().max())
    scale = float(ref["outputs"].abs().max())
    measured, value = "max |compiled - stock|", diff
    if dtype == "float32":
        rule, tolerance = "fp32: 1e-4 of the output scale", 1e-4 * scale
    elif bitwise:
        rule, tolerance = "bf16, same summation order as stock: bitwise", 0.0
    else:
        ref32 = results[0][2]["outputs"]
        stock_error = _median_row_error(ref["outputs"], ref32)
        measured, value = "median row error vs stock fp32", _median_row_error(out["outputs"], ref32)
        rule, tolerance = f"bf16 band: 2.5 x stock bf16's ({stock_error:.3g}) + 0.01", 2.5 * stock_error + 0.01
    report = out["report"]
    timings = ref.get("layer_seconds", {})
    layers = []
    for info, rep in zip(ref["layers"], report["layers"]):
        t = sorted(timings.get(info["index"], [0.0]))
        layers.append({**{k: rep[k] for k in ("index", "kind", "mlp", "spelling", "rewritten", "rewritten_by",
                                               "reason", "notes")},
                       "shapes": info["shapes"], "stock_ms": 1e3 * t[len(t) // 2]})
    result = {
        "preset": preset, "ranks": ranks, "dp": dp, "dcp": dcp, "q": q, "steps": steps, "rows": rows, "dtype": dtype,
        "compiler": compiler, "layers": layers,
        "collectives_stock": report["collectives_before"], "collectives_compiled": report["collectives_after"],
        "max_abs_diff": diff, "measured": measured, "value": value, "tolerance": tolerance,
        "tolerance_rule": rule, "agree": value <= tolerance,
        "all_ranks_identical": all(bool((r[1]["outputs"] == out["outputs"]).all()) for r in results[:ranks]),
        # the first step of each run is its warm-up (and the compile): left out of both
        "step_ms": {"stock": _median_ms(ref["seconds"][1:]), "compiled": _median_ms(out["seconds"][1:])},
    }
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(result, fh, indent=2)
    return result


def _median_ms(seconds: list[float]) -> float | None:
    return 1e3 * statistics.median(seconds) if seconds else None


def _median_row_error(x, ref) -> float:
    """Median over steps and rows of |x - ref| / |ref| per output row."""
    return float(((x.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)).median())


def format_demo(r: dict[str, Any]) -> str:
    ranks = f"{r['ranks']} CPU ranks (gloo)" if r["ranks"] > 1 else "1 CPU rank"
    if r.get("dp", 1) > 1:
        ranks = f"DP {r['dp']} x {ranks}, the routed experts over all {r['dp'] * r['ranks']}; TP group 0's"
    lines = [f"kimi_specialized on the {r['preset']} Kimi K3 decoder: {ranks}, "
             f"DCP {r['dcp']}, {r['rows']} rows (q={r['q']}), {r['steps']} steps, {r['dtype']}, "
             f"{r['compiler']} compiler",
             f"{'layer':>5} {'attn':<4} {'mlp':<5} {'stock ms':>8}  rewritten by"]
    for l in r["layers"]:
        lines.append(f"{l['index']:>5} {l['kind']:<4} {l['mlp']:<5} {l['stock_ms']:>8.2f}  "
                     f"{', '.join(l['rewritten_by']) or 'no pass'}")
        row = LayerReport(**{k: l[k] for k in ("index", "kind", "mlp", "reason", "notes")})
        lines += [f"{'':>26}{label}: {text}" for label, text in row.statements()]
    first = r["layers"][0]["shapes"]
    lines.append("rank-0 weights of layer 0: " + ", ".join(f"{k} {v}" for k, v in first.items()))
    lines.append(f"collectives per step: stock {r['collectives_stock']} -> kimi_specialized "
                 f"{r['collectives_compiled']}")
    if r["step_ms"]["stock"] is not None:
        lines.append(f"step time (CPU, median after the first step): stock {r['step_ms']['stock']:.1f} ms, "
                     f"compiled {r['step_ms']['compiled']:.1f} ms")
    else:
        lines.append("step time: not measured (one step: it is the warm-up and the compile)")
    lines.append(f"{r['measured']} = {r['value']:.3g} (tolerance {r['tolerance']:.3g}: {r['tolerance_rule']}) -> "
                 f"{'AGREE' if r['agree'] else 'DISAGREE'}; max |compiled - stock| = {r['max_abs_diff']:.3g}; "
                 f"ranks identical: {r['all_ranks_identical']}")
    return "\n".join(lines)
