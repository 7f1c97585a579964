"""Where a compiled decoder step's GPU time goes, measured (issue 19, item 1).

The step's kernels are profiled (CUPTI, through ``torch.profiler``; launched without a
CUDA graph, which changes launch gaps, not kernel durations) and each kernel is given
to a part of the model by its position in the stream: our AttnRes kernel runs exactly
2 L + 1 times per step (pre- and post-attention of every layer, then the final mix), so

    after AttnRes 2i      -> layer i's attention ("attention kda" / "attention mla")
    after AttnRes 2i + 1  -> layer i's MLP ("dense mlp", or for a MoE layer "experts"
                             for the grouped expert kernels and "moe non-expert" for
                             the rest: router, latent and shared projections, routing)
    after AttnRes 2L      -> "entry / exit" (final norm, the next step's embedding)

with AttnRes itself ("attn_res") and NCCL kernels ("collectives") counted wherever they
run. The parts sum to the step's kernel time; the CUDA-graph replay time of the same
step minus that sum is the idle time between kernels. With programmatic dependent
launch (our Triton kernels on SM90, ``kernels/common.py::pdl``) a kernel starts early and
its duration includes its wait for the one before it, so the parts overlap and their sum
can exceed the replay time; ``KIMI_INDUCTOR_PDL=0`` gives a disjoint split (each result
file's ``meta.pdl`` says which).

    python benchmarks/step_breakdown.py OUT.png STEP.json [STEP.json ...]  # the plot
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections import defaultdict

ATTN_RES = "_attn_res_kernel"
EXPERT_KERNELS = ("_up_kernel", "_down_kernel", "_combine_kernel")  # kernels/expert_ffn.py
MXFP4_EXPERT_KERNEL = "expert_mxfp4Mxfp4Experts"  # in the CuTe DSL kernel's name (kernels/expert_mxfp4.py)
PARTS = ("attention kda", "attention mla", "attn_res", "moe non-expert", "experts", "dense mlp", "collectives",
         "entry / exit")


def kernel_events(fn, calls: int = 3) -> list[tuple[str, float, float]]:
    """(name, start, duration) in microseconds of every GPU kernel of ``calls`` calls of
    ``fn``, in start order."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = json.load(open(path))["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    return [(e["name"], float(e["ts"]), float(e["dur"])) for e in kernels]


def profile_kernels(fn, calls: int = 3) -> list[tuple[str, float]]:
    """(name, microseconds) of every GPU kernel of ``calls`` calls of ``fn``, in start order."""
    return [(name, dur) for name, _, dur in kernel_events(fn, calls)]


def _table(kernels: list[tuple[str, float]], calls: int, top: int) -> list[dict]:
    """Costliest first: name and microseconds per call (``top`` of them)."""
    per: dict[str, float] = {}
    for name, us in kernels:
        per[name] = per.get(name, 0.0) + us / calls
    return [dict(kernel=k[:90], us=v) for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:top]]


def kernel_table(fn, calls: int = 3, top: int = 12) -> list[dict]:
    """The kernels of ``calls`` calls of ``fn``, costliest first: name and microseconds per
    call (``top`` of them)."""
    return _table(profile_kernels(fn, calls), calls, top)


def kernel_profile(fn, calls: int = 3, top: int = 12) -> tuple[list[dict], list[dict]]:
    """``kernel_table`` and the timeline of one call of ``fn``, from one profile. The
    timeline: each kernel's start and end in microseconds after the call's first kernel
    started, the mean over ``calls`` calls of the same kernels. With PDL a kernel starts
    when its CTAs are scheduled, before its wait, so a start before the previous kernel's
    end is where that kernel released it."""
    events = kernel_events(fn, calls)
    n = len(events) // calls
    if n * calls != len(events):
        raise ValueError(f"{len(events)} kernels in {calls} calls: the calls differ, no one timeline")
    timeline = []
    for i in range(n):
        per = [events[c * n + i] for c in range(calls)]
        start = sum(ts - events[c * n][1] for c, (_, ts, _) in enumerate(per)) / calls
        timeline.append(dict(kernel=per[0][0][:90], start_us=start, end_us=start + sum(d for *_, d in per) / calls))
    return _table([(name, dur) for name, _, dur in events], calls, top), timeline


def attribute(kernels: list[tuple[str, float]], layers: list[tuple[str, str]], calls: int):
    """(part, kernel name, microseconds) of each kernel of ``calls`` steps of a decoder
    whose layers are ``layers`` [(attention kind, "moe" | "dense")]; ValueError when the
    AttnRes count does not delimit the steps."""
    per_step = 2 * len(layers) + 1
    seen = sum(name == ATTN_RES for name, _ in kernels)
    if seen != calls * per_step:
        raise ValueError(f"{seen} AttnRes kernels for {calls} steps of {len(layers)} layers "
                         f"(expected {calls * per_step}): the step's kernels cannot be delimited")
    count = -1  # AttnRes calls seen so far in this step
    for name, us in kernels:
        if name == ATTN_RES:
            count = (count + 1) % per_step
            part = "attn_res"
        elif "nccl" in name.lower():
            part = "collectives"
        elif count < 0 or count == per_step - 1:
            part = "entry / exit"
        else:
            kind, mlp = layers[count // 2]
            if count % 2 == 0:
                part = f"attention {'kda' if kind == 'kda' else 'mla'}"
            elif mlp == "moe":
                part = "experts" if name in EXPERT_KERNELS or MXFP4_EXPERT_KERNEL in name else "moe non-expert"
            else:
                part = "dense mlp"
        yield part, name, us


def breakdown(kernels: list[tuple[str, float]], layers: list[tuple[str, str]], calls: int) -> dict[str, float]:
    """Microseconds per step by part (``PARTS``)."""
    out = defaultdict(float)
    for part, _, us in attribute(kernels, layers, calls):
        out[part] += us / calls
    return {part: out[part] for part in PARTS}


def top_kernels(kernels: list[tuple[str, float]], layers: list[tuple[str, str]], calls: int,
                n: int = 6) -> dict[str, list[tuple[str, float]]]:
    """Per part, its ``n`` kernels (by name) with the most microseconds per step."""
    by_name = defaultdict(float)
    for part, name, us in attribute(kernels, layers, calls):
        by_name[part, name] += us / calls
    return {part: sorted(((name, us) for (p, name), us in by_name.items() if p == part), key=lambda k: -k[1])[:n]
            for part in PARTS}


def plot(png_path: str, *json_paths: str) -> str:
    """Stacked bars of each row's ``kimi_breakdown_us`` with its CUDA-graph time and floor
    marked (rank 0's of a multi-GPU run); a (q, rows) point of a later file replaces an
    earlier file's."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = {}
    for path in json_paths:
        points.update({(r["q"], r["rows"]): r for r in json.load(open(path))["rows"]
                       if "kimi_breakdown_us" in r and r.get("rank", 0) == 0})
    if not points:
        raise ValueError(f"{', '.join(json_paths)}: no kimi_breakdown_us rows (run decode_step.py on a GPU)")
    rows = [points[k] for k in sorted(points)]
    labels = [f"{r['rows']} rows\nq={r['q']}" for r in rows]
    fig, ax = plt.subplots(figsize=(1.4 * len(rows) + 3, 4.5))
    bottom = [0.0] * len(rows)
    for part in PARTS:
        vals = [r["kimi_breakdown_us"].get(part, 0.0) for r in rows]
        if any(vals):
            ax.bar(labels, vals, bottom=bottom, label=part)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot(labels, [r["kimi_us"] for r in rows], "k_", markersize=30, mew=2, label="step, CUDA graph")
    ax.plot(labels, [r["floor_us"] for r in rows], "r_", markersize=30, mew=2, label="byte floor")
    ax.set_ylabel("us per step")
    ranks = rows[0].get("ranks", 1)
    ax.set_title("kimi_specialized decoder step by part (kernel time), "
                 + ("one H200" if ranks == 1 else f"rank 0 of {ranks} H200s"))
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    return png_path


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python benchmarks/step_breakdown.py OUT.png STEP.json [STEP.json ...]")
    print(plot(*sys.argv[1:]))
