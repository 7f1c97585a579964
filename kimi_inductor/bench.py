"""``python -m kimi_inductor bench``: run the GPU benchmarks of ``benchmarks/`` in turn,
with a progress bar, write their JSON into one folder and plot the layer steps and the
decoder step by part. A benchmark that stops (e.g. a lone MoE layer, which the passes do
not rewrite outside a decoder) is reported and skipped.

Needs a checkout (the benchmarks live beside the package) and a CUDA GPU; ``--smoke``
runs the KDA layer benchmark's CPU smoke mode instead (no timings). The two-GPU
benchmarks (expert parallel, DCP) run only when two GPUs are visible.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

SUITE = {  # name: (script, arguments)
    "decode_step": ("decode_step.py", []),  # the whole decoder step (issue 19); --step runs these two
    "decode_step_g2": ("decode_step.py", ["--gpus", "2", "--q", "1"]),  # the hybrid step on 2 GPUs (NCCL)
    "kda_layer_q1": ("kda_layer.py", ["--rows", "1", "2", "8", "32", "64", "--q", "1"]),
    "kda_layer_q4": ("kda_layer.py", ["--rows", "8", "32", "64", "--q", "4"]),
    "kda_kernel": ("kda_kernel.py", []),
    "attn_res": ("attn_res.py", []),
    "mla_layer": ("mla_layer.py", []),
    "dsa_layer": ("mla_layer.py", ["--kind", "dsa", "--q", "1", "--context", "8192"]),
    "dsa_layer_q4": ("mla_layer.py", ["--kind", "dsa", "--q", "4", "--rows", "8", "32", "64", "--context", "8192"]),
    "mla_kernel": ("mla_kernel.py", []),
    "gemm": ("gemm.py", ["--sweep"]),
    "gemm_fusions": ("gemm_fusions.py", []),
    "dsa_index": ("dsa_index.py", []),
    "dsa_index_128k": ("dsa_index.py", ["--context", "131072", "--requests", "1", "8"]),
    "dsa_select_sweep": ("dsa_index.py", ["--sweep", "--requests", "1", "8", "64", "--context", "8192", "16384",
                                          "32768", "131072"]),
    "moe_experts": ("moe_experts.py", []),
    "moe_layer": ("moe_layer.py", []),
    "mega_moe_ep2": ("mega_moe.py", ["--gpus", "2"]),  # only with two GPUs visible
    "moe_layer_ep2": ("moe_layer_ep.py", ["--gpus", "2"]),
    "dcp_mla": ("dcp_mla.py", ["--gpus", "2"]),
    "dcp_dsa": ("dcp_mla.py", ["--gpus", "2", "--kind", "dsa"]),
}


STEP = ["decode_step", "decode_step_g2"]  # bench --step


def check_only(only: list[str] | None, suite: dict = SUITE) -> None:
    """``ValueError`` naming the names of ``only`` that ``suite`` does not hold."""
    if only and (unknown := [n for n in only if n not in suite]):
        raise ValueError(f"no benchmark named {', '.join(unknown)}; the suite: {', '.join(suite)}")


def bench(out_dir: str, only: list[str] | None = None, smoke: bool = False) -> dict[str, str]:
    root = Path(__file__).resolve().parent.parent / "benchmarks"
    if not root.is_dir():
        raise ValueError(f"no benchmarks/ folder beside the package ({root}): run from a checkout")
    suite = {"kda_layer_smoke": ("kda_layer.py", ["--smoke", "--rows", "1", "--q", "1"])} if smoke else SUITE
    check_only(only, suite)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in suite if only is None or n in only]
    if not smoke:
        import torch

        gpus = torch.cuda.device_count()
        names = [n for n in names if "--gpus" not in suite[n][1] or int(suite[n][1][1]) <= gpus]
    try:
        from tqdm import tqdm
    except ImportError:  # a plain loop without the bar
        def tqdm(items, **kwargs):
            return items
    written = {}
    for name in tqdm(names, desc="kimi_inductor bench", unit="benchmark"):
        script, args = suite[name]
        path = out / f"{name}.json"
        sys.argv = [script, *args, "--json", str(path)]
        try:
            runpy.run_path(str(root / script), run_name="__main__")
        except SystemExit as stop:  # a benchmark that cannot measure here says why; the rest still run
            if stop.code in (None, 0):
                raise
            print(f"{name}: not run: {stop.code}", file=sys.stderr)
            continue
        written[name] = str(path)
    if not smoke:
        plot(out)
        sys.path.insert(0, str(root))
        import step_breakdown

        for name in [n for n in STEP if n in written]:
            try:
                step_breakdown.plot(str(out / f"{name}.png"), written[name])
            except ImportError:  # no matplotlib: the JSON holds the breakdown
                break
    return written


PANELS = {"kda_layer_q1": "KDA layer, q = 1", "kda_layer_q4": "KDA layer, q = 4",
          "mla_layer": "MLA layer, q = 1, 4K context", "dsa_layer": "DSA layer, q = 1, 8K context",
          "dsa_layer_q4": "DSA layer, q = 4, 8K context"}


def plot(out: Path) -> Path | None:
    """Layer step time against rows (TP8 per rank): stock Inductor + CUDA graphs,
    kimi_specialized and the floor, one panel per layer result found in ``out``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    found = {n: json.loads((out / f"{n}.json").read_text())["rows"] for n in PANELS if (out / f"{n}.json").exists()}
    if not found:
        return None
    fig, axes = plt.subplots(1, len(found), figsize=(4.5 * len(found), 4), squeeze=False)
    for ax, (name, rows) in zip(axes[0], found.items()):
        rows = [r for r in rows if r.get("q", 1) == (4 if name.endswith("q4") else 1)]
        x = [r["rows"] for r in rows]
        for key, label in (("inductor_us", "stock, Inductor + CUDA graph"), ("vllm_us", "stock vLLM chain"),
                           ("kimi_us", "kimi_specialized"), ("floor_us", "byte floor (4.28 TB/s)")):
            if rows and all(key in r for r in rows):
                ax.plot(x, [r[key] for r in rows], marker="o", label=label)
        ax.set_title(PANELS[name])
        ax.set_xlabel("rows")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
    axes[0][0].set_ylabel("us per step")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    target = out / "layers.png"
    fig.savefig(target, dpi=110)
    return target
