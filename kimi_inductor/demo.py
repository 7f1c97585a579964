"""The main job: the tiny stock Kimi K3 decoder on several CPU ranks, compiled by
``kimi_specialized``, with its match report and an equality check against stock.

On every rank (gloo, spawned for the user) the same random checkpoint decodes the
same steps twice: the stock decoder in SP layout (eager, per-layer timings) and the
decoder compiled by ``kimi_specialized``. The outputs must agree:
  * bitwise, in bf16, when the rewrite's all-reduce sums the o-projection partials
    in the order stock's reduce-scatter does (gloo: G = 2, or T a multiple of G);
  * otherwise within the bf16 band: no further from stock than 2.5 x the distance
    between stock in bf16 and stock in fp32 (docs/testing.md);
  * in fp32 (``--dtype float32``): within 1e-4 of the output scale.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from .config import Options
from .harness import DecodeRun, decode_many, progress as say
from .launch import run_ranks
from .passes.report import LayerReport


def demo(preset: str = "tiny", ranks: int = 2, q: int = 4, steps: int = 8, requests: int = 3, padding: int = 1,
         dtype: str = "bfloat16", compiler: str = "eager", dcp: int = 1, json_path: str | None = None,
         progress: bool = False) -> dict[str, Any]:
    """``progress``: rank 0 prints each run's steps (and the compile) on stderr."""
    stock = DecodeRun(preset=preset, layout="sp", q=q, steps=steps, requests=requests, padding=padding,
                      dtype=dtype, dcp=dcp, layer_timings=True, progress=f"stock SP {dtype}" if progress else "")
    compiled = dataclasses.replace(stock, layer_timings=False, backend="kimi_specialized",
                                   options={"compiler": compiler}, progress="kimi_specialized" if progress else "")
    rows = (requests + padding) * q
    # sharded_moe sums partial shared-expert outputs in bf16 across ranks: a band, not bitwise
    sharded_moe = ranks > 1 and rows <= Options().decode.sharded_moe_rows
    bitwise = dtype == "bfloat16" and not sharded_moe and (ranks <= 2 or rows % ranks == 0)
    runs = [stock, compiled]
    if dtype == "bfloat16" and not bitwise:
        runs.append(dataclasses.replace(stock, dtype="float32", layer_timings=False,
                                        progress="stock SP float32 (the bf16 band's reference)" if progress else ""))
    if progress:
        say(f"demo: {len(runs)} runs of {steps} steps ({rows} rows) on {ranks} CPU rank{'s' if ranks > 1 else ''}"
            f"{' (spawning gloo processes)' if ranks > 1 else ''}")
    results = run_ranks(decode_many, ranks, runs) if ranks > 1 else [decode_many(runs)]
    ref, out = results[0][0], results[0][1]
    diff = float((out["outputs"] - ref["outputs"]).abs().max())
    scale = float(ref["outputs"].abs().max())
    if dtype == "float32":
        rule, tolerance = "fp32: 1e-4 of the output scale", 1e-4 * scale
    elif bitwise:
        rule, tolerance = "bf16, same summation order as stock: bitwise", 0.0
    else:
        noise = float((ref["outputs"] - results[0][2]["outputs"]).abs().max())
        rule, tolerance = "bf16 band: 2.5 x |stock bf16 - stock fp32|", 2.5 * noise
    report = out["report"]
    timings = ref.get("layer_seconds", {})
    layers = []
    for info, rep in zip(ref["layers"], report["layers"]):
        t = sorted(timings.get(info["index"], [0.0]))
        layers.append({**{k: rep[k] for k in ("index", "kind", "mlp", "spelling", "rewritten", "rewritten_by",
                                               "reason", "notes")},
                       "shapes": info["shapes"], "stock_ms": 1e3 * t[len(t) // 2]})
    result = {
        "preset": preset, "ranks": ranks, "dcp": dcp, "q": q, "steps": steps, "rows": rows, "dtype": dtype,
        "compiler": compiler, "layers": layers,
        "collectives_stock": report["collectives_before"], "collectives_compiled": report["collectives_after"],
        "max_abs_diff": diff, "tolerance": tolerance, "tolerance_rule": rule, "agree": diff <= tolerance,
        "all_ranks_identical": all(bool((r[1]["outputs"] == out["outputs"]).all()) for r in results),
        "step_ms": {"stock": _median_ms(ref["seconds"]), "compiled": _median_ms(out["seconds"][1:])},
    }
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(result, fh, indent=2)
    return result


def _median_ms(seconds: list[float]) -> float:
    s = sorted(seconds) or [0.0]
    return 1e3 * s[len(s) // 2]


def format_demo(r: dict[str, Any]) -> str:
    lines = [f"kimi_specialized on the {r['preset']} Kimi K3 decoder: {r['ranks']} CPU ranks (gloo), "
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
    lines.append(f"step time (CPU, median): stock {r['step_ms']['stock']:.1f} ms, "
                 f"compiled {r['step_ms']['compiled']:.1f} ms")
    lines.append(f"max |compiled - stock| = {r['max_abs_diff']:.3g} (tolerance {r['tolerance']:.3g}: "
                 f"{r['tolerance_rule']}) -> {'AGREE' if r['agree'] else 'DISAGREE'}; "
                 f"ranks identical: {r['all_ranks_identical']}")
    return "\n".join(lines)
