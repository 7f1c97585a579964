"""vLLM 0.33.0's own Kimi K3 layer stack on one GPU: compiled by Inductor against
rewritten by ``kimi_specialized``, both timed in CUDA graphs (issue 17, item 3).

The model is vLLM's ``KimiLinearForCausalLM`` as ``kimi_inductor.vllm_cpu`` builds it
(vLLM's modules, its ``load_weights`` and ``bind_kv_cache``, its KDA / MLA metadata
builders), here with every tensor on the GPU (``build(device="cuda")``) at TP 1:

* ``tiny``: the tiny K3 config (``--layers`` in K3's KDA:MLA schedule, hidden 128),
  our replica's random checkpoint;
* ``k3-rank``: Kimi K3 at one TP8 rank's shapes (``k3_rank.per_rank_config``: hidden
  7168, 12 KDA heads of 128, MLA latent 512 + 64, ``--experts`` routed experts of full
  width), weights drawn on the GPU.

Each row count R gets one decode step of R requests plus ``--padding`` CUDA-graph
padding rows at ``--context`` tokens of (random) cache, from vLLM's own metadata; the
backbone (``model.model``) is compiled with fullgraph Dynamo, ``dynamic=False``:

* ``inductor``: ``torch.compile(backend="inductor")``, vLLM's graph unrewritten (which
  Inductor miscompiles: docs/vllm.md, "Numerics");
* ``pages``: vLLM's graph with only ``byte_pages`` (``kimi_specialized`` with
  ``passes=["byte_pages"]``: the page views Inductor compiles right; and, as our backend
  compiles, Inductor's own kernels with PDL, no shape padding), the correct baseline;
* ``kimi``: ``backend="kimi_specialized"`` (every pass; its match report is printed and
  summarised per row in the JSON);

and timed with ``common.graph_time_us`` (one CUDA graph replaying the step ``--calls``
times). Both outputs are compared with vLLM's eager forward of the same step from the
same cache state (live rows; padding rows hold whatever each leaves there): the bf16
band of docs/testing.md is a median row error under 3 %.

What runs is what vLLM 0.33.0 runs without its CUDA extension (``_C`` is built for torch
2.14; the H200 image has 2.11): its Python modules and Triton kernels on vLLM's CPU
platform class with CUDA tensors, the shims of ``vllm_cpu.SHIMS`` installed for CUDA, its
``_C`` ops stood in (``meta.stood_in`` in the JSON). On the H200 (``.device/vllm/``,
built by ``benchmarks/stage_vllm_gpu.sh``, carried; docs/vllm.md)::

    python benchmarks/vllm_stack.py --presets tiny k3-rank --rows 1 8 32 --json vllm_stack.json

Each preset runs in a process of its own (vLLM's state is per process); a preset that
fails or runs out of ``--deadline-s`` leaves its error and the rows it finished.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, graph_time_us  # noqa: E402

PRESETS = ("tiny", "k3-rank")
# per variant, the compilations tried in order: (backend, options); a later one only if
# the earlier failed (the row says why and which one ran)
PAGES = {"passes": ["byte_pages"]}
VARIANTS = {"inductor": [("inductor", None), ("aot_eager", None)],
            "pages": [("kimi_specialized", PAGES)],
            "kimi": [("kimi_specialized", {}), ("kimi_specialized", {"compiler": "eager"})]}
SMOKE = {"inductor": [("aot_eager", None)], "pages": [("kimi_specialized", {**PAGES, "compiler": "eager"})],
         "kimi": [("kimi_specialized", {"compiler": "eager"})]}


def build(args):
    """(vllm_config, model) for ``args.preset`` on ``args.device``."""
    from kimi_inductor import vllm_cpu

    max_model_len = args.context + 64
    if args.preset == "tiny":
        return vllm_cpu.build(tp=1, sp=False, layers=args.layers, device=args.device, max_model_len=max_model_len)
    from k3_rank import checkpoint, per_rank_config

    config = per_rank_config(args.layers, args.experts, tp=8)
    # transformers' config check wants an even RoPE head_dim, by default hidden / heads
    # (7168 / 12 is not); K3's MLA is NoPE and vLLM's K3 reads no head_dim
    config = config.replace(extra={**config.extra, "head_dim": config.v_head_dim})
    return vllm_cpu.build(tp=1, sp=False, device=args.device, weights=(config, checkpoint(config, 0, args.device)),
                          max_model_len=max_model_len)


def report_summary(report) -> dict[str, Any]:
    """The kimi_specialized report in brief: per pass matched / rewritten / skipped
    reasons, per layer what rewrote it."""
    out = report.to_dict()
    return {"passes": {p["name"]: {k: p[k] for k in ("matched", "rewritten", "skipped") if k in p}
                       for p in out["passes"]},
            "layers": [{k: layer.get(k) for k in ("index", "kind", "mlp", "rewritten_by")} for layer in out["layers"]],
            "layout": out.get("layout_after") or out.get("layout")}


def measure_one(args) -> None:
    """One preset in this process: rows appended to ``args.json`` as they finish."""
    from kimi_inductor import vllm_cpu

    deadline = time.monotonic() + args.deadline_s

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    res = Results(f"vllm_stack_{args.preset}")
    res.meta.update(preset=args.preset, layers=args.layers, context=args.context, padding=args.padding)
    if args.preset == "k3-rank":
        res.meta["experts"] = args.experts

    def save():
        if args.json:
            res.dump(args.json)

    start = time.perf_counter()
    vllm_config, model = build(args)
    import vllm

    res.meta.update(vllm=vllm.__version__, build_s=time.perf_counter() - start,
                    stood_in={name: vllm_cpu.SHIMS[name] for name, devices in vllm_cpu.SHIM_DEVICES.items()
                              if "cuda" in devices},
                    params=sum(p.numel() for p in model.parameters()))
    print(f"built vLLM's {type(model).__name__} ({args.preset}, {res.meta['params'] / 1e6:.1f} M parameters) "
          f"in {res.meta['build_s']:.1f} s", flush=True)
    save()
    printed_report = False
    for requests in args.rows:
        if time.monotonic() > deadline - args.row_s:
            res.add(requests=requests, skipped=f"out of time (deadline {args.deadline_s} s)")
            save()
            continue
        row: dict[str, Any] = dict(requests=requests, padding=args.padding, rows=requests + args.padding,
                                   context=args.context)
        batch = vllm_cpu.decode_batch(model, vllm_config, requests, args.padding, max_context=args.context + 16,
                                      device=args.device, context=args.context)
        step = vllm_cpu.next_step(vllm_config, batch)
        state = [t.clone() for c in batch.caches.values() for t in (c if isinstance(c, list) else [c])]

        def restore():
            live = [t for c in batch.caches.values() for t in (c if isinstance(c, list) else [c])]
            for t, saved in zip(live, state):
                t.copy_(saved)

        try:
            eager = vllm_cpu.eager_step(model, vllm_config, step)[:requests].float()
            sync()
        except Exception as e:  # noqa: BLE001  (the row says why)
            eager = None
            row["eager_error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        outs = {}
        for name, attempts in (SMOKE if args.smoke else VARIANTS).items():
            restore()
            for attempt, (backend, options) in enumerate(attempts):
                try:
                    compiled = vllm_cpu.compile_backbone(model, backend, options)
                    t0 = time.perf_counter()
                    out = compiled.step(vllm_config, step)
                    sync()
                    row[f"{name}_compile_s"] = time.perf_counter() - t0
                    row[f"{name}_backend"] = backend if options is None else f"{backend} {json.dumps(options)}"
                    break
                except Exception as e:  # noqa: BLE001
                    row[f"{name}_error" + (f"_{attempt}" if attempt else "")] = f"{type(e).__name__}: {e}"[:2000]
                    traceback.print_exc()
                    restore()
            else:
                continue
            outs[name] = out[:requests].float()
            if name == "kimi":
                report = compiled.backend.report
                row["kimi_report"] = report_summary(report)
                if not printed_report:
                    print(report.format(), flush=True)
                    printed_report = True
            try:
                if args.smoke:  # the CPU check times nothing
                    continue
                with torch.no_grad():
                    row[f"{name}_us"] = graph_time_us(lambda i: compiled.step(vllm_config, step), calls=args.calls,
                                                      replays=args.replays)
            except Exception as e:  # noqa: BLE001
                row[f"{name}_timing_error"] = f"{type(e).__name__}: {e}"[:2000]
                traceback.print_exc()
            del compiled
        for name, out in outs.items():
            for ref_name, ref in (("eager", eager), ("inductor", outs.get("inductor"))):
                if ref is None or ref_name == name:
                    continue
                err = (out - ref).norm(dim=-1) / ref.norm(dim=-1)
                row[f"{name}_vs_{ref_name}_row_err"] = dict(median=float(err.median()), max=float(err.max()),
                                                            finite=bool(torch.isfinite(out).all()))
        kimi_ref = row.get("kimi_vs_eager_row_err") or row.get("kimi_vs_inductor_row_err")
        if kimi_ref:
            row["in_bf16_band"] = kimi_ref["finite"] and kimi_ref["median"] < 0.03
        for base in ("inductor", "pages"):
            if f"{base}_us" in row and "kimi_us" in row:
                row["speedup" if base == "inductor" else f"speedup_vs_{base}"] = row[f"{base}_us"] / row["kimi_us"]
        res.add(**{k: v for k, v in row.items() if k != "kimi_report"}, echo=True)
        res.rows[-1]["kimi_report"] = row.get("kimi_report")
        save()
        del batch, step, state
        if args.device == "cuda":
            torch.cuda.empty_cache()


def run_presets(args) -> None:
    """Every preset in a child process of its own, within ``--deadline-s`` in all; the
    children's JSON merged into ``args.json`` after each."""
    merged: dict[str, Any] = {"benchmark": "vllm_stack", "meta": {}, "presets": {}}
    res = Results("vllm_stack")
    merged["meta"] = {**res.meta, "python": sys.version.split()[0], "argv": sys.argv[1:],
                      "extension_probe": extension_probe(args.symbols)}
    try:
        import triton

        merged["meta"]["triton"] = triton.__version__
    except ImportError:
        pass
    end = time.monotonic() + args.deadline_s
    for i, preset in enumerate(args.presets):
        left = end - time.monotonic()
        share = left if i == len(args.presets) - 1 else left * args.first_share
        part = f"{args.json or 'vllm_stack.json'}.{preset}"
        cmd = [sys.executable, __file__, "--one", preset, "--json", part, "--deadline-s", str(int(share - 15)),
               "--rows", *map(str, args.rows), "--padding", str(args.padding), "--context", str(args.context),
               "--experts", str(args.experts), "--calls", str(args.calls), "--replays", str(args.replays),
               "--row-s", str(args.row_s)] + ["--smoke"] * args.smoke
        if args.layers is not None:
            cmd += ["--layers", str(args.layers)]
        print(f"== {preset}: {' '.join(cmd[1:])} (at most {share:.0f} s)", flush=True)
        entry: dict[str, Any] = {}
        with open(f"{part}.log", "w") as log:  # the child's whole output, kept beside the JSON
            try:
                entry["returncode"] = subprocess.run(cmd, timeout=max(30, share), stdout=log,
                                                     stderr=subprocess.STDOUT).returncode
            except subprocess.TimeoutExpired:
                entry["returncode"] = "timeout"
        with open(f"{part}.log") as log:
            out = log.read()
        sys.stdout.write(out[-6000:])
        if entry["returncode"]:
            entry["error_tail"] = out[-4000:]
        if os.path.exists(part):
            with open(part) as fh:
                entry.update(json.load(fh))
            os.remove(part)
        merged["presets"][preset] = entry
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(merged, fh, indent=1)


def extension_probe(path: str | None) -> dict[str, Any] | None:
    """Which of the libtorch symbols vLLM's ``_C_stable_libtorch`` extension imports
    (listed in ``path`` by ``stage_vllm_gpu.sh``) this torch's libraries lack: the
    reason the extension cannot load here, without carrying it."""
    if not path or not os.path.exists(path):
        return None
    import ctypes

    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    paths = [os.path.join(lib, f"{name}.so") for name in ("libtorch_cpu", "libtorch_cuda", "libtorch")]
    libs = [ctypes.CDLL(path_, mode=ctypes.RTLD_GLOBAL) for path_ in paths if os.path.exists(path_)]
    with open(path) as fh:
        wanted = [line.strip() for line in fh if line.strip()]
    missing = [s for s in wanted if not any(hasattr(lib_, s) for lib_ in libs)]
    return {"symbols": len(wanted), "missing_in_this_torch": missing, "torch": torch.__version__}


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--presets", nargs="+", default=["tiny"], choices=PRESETS)
    p.add_argument("--one", choices=PRESETS, help=argparse.SUPPRESS)  # a child: this preset in this process
    p.add_argument("--layers", type=int, help="decoder layers (default: 5 for tiny, 4 for k3-rank)")
    p.add_argument("--experts", type=int, default=16, help="k3-rank: routed experts (top-k is K3's 16)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32], help="live requests per step")
    p.add_argument("--padding", type=int, default=1, help="CUDA-graph padding rows after the requests")
    p.add_argument("--context", type=int, default=1024, help="tokens already in every request's cache")
    p.add_argument("--calls", type=int, default=10, help="steps per CUDA graph")
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--deadline-s", type=float, default=1800, help="wall-clock budget for everything")
    p.add_argument("--first-share", type=float, default=0.45, help="share of the budget for each preset but the last")
    p.add_argument("--row-s", type=float, default=45, help="a row count is not started with less time left")
    p.add_argument("--symbols", default=".device/vllm/c_symbols.txt",
                   help="libtorch symbols vLLM's _C extension imports (stage_vllm_gpu.sh)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU check of the machinery: tiny shapes, aot_eager and our eager compiler, no timing")
    p.add_argument("--json")
    args = p.parse_args(argv)
    args.device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.rows, args.context = [2], min(args.context, 20)
    if args.one:
        args.preset = args.one
        if args.layers is None:
            args.layers = 5 if args.preset == "tiny" else 4
        measure_one(args)
    else:
        run_presets(args)


if __name__ == "__main__":
    main()
