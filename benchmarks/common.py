"""Shared pieces of the GPU benchmarks: CUDA-graph timing, byte floors, results.

Method (docs/performance.md): every variant runs inside one CUDA graph that calls it
``calls`` times, cycling over ``copies`` copies of its weights so that consecutive
calls stream from HBM, not L2; the time of one call is the median replay time over
``replays`` replays divided by ``calls``. The floor is the bytes the call must move
(weights + state read/write + activations) at the measured 4.28 TB/s copy ceiling.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any, Callable

import torch

from kimi_inductor.kernels.common import pdl
from kimi_inductor.kernels.skinny_gemm import cute_available

HBM = 4.28e12  # bytes/s, device-to-device copy on H200 (kernels_and_limits.md)


def floor_us(nbytes: float) -> float:
    return nbytes / HBM * 1e6


def graph_time_us(fn: Callable[[int], Any], calls: int = 20, replays: int = 10, warmup: int = 3) -> float:
    """Median microseconds of ``fn(i)`` (i = call index) captured ``calls`` times in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(warmup):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


class Results:
    """Rows of measurements, printed as a table and written as JSON."""

    def __init__(self, name: str):
        self.name, self.rows, self.meta = name, [], {
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "cute_dsl": cute_available() or "available",  # without it 1-2 row GEMMs take the Triton GEMM
            "pdl": torch.cuda.is_available() and pdl(torch.device("cuda"))["PDL"],  # our kernels' launches
        }
        if torch.cuda.is_available() and self.meta["cute_dsl"] != "available":
            print(f"note: {self.meta['cute_dsl']}; kimi_specialized's 1-2 row GEMMs run on the Triton GEMM, "
                  "not the CuTe GEMV", flush=True)

    def add(self, echo: bool = True, **row: Any) -> None:
        self.rows.append(row)
        if echo:
            print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    def dump(self, path: str) -> None:
        with open(path, "w") as fh:
            json.dump({"benchmark": self.name, "meta": self.meta, "rows": self.rows}, fh, indent=1)


def run_on_gpus(fn: Callable, gpus: int, args: tuple, json_path: str) -> None:
    """``fn(rank, gpus, port, *args, json_path)`` on ``gpus`` spawned processes (one GPU each;
    ``fn`` initialises NCCL on ``port`` and writes ``json_path + ".rank<r>"``); the ranks'
    JSON rows are merged into ``json_path``."""
    import os
    import socket

    import torch.multiprocessing as mp

    if torch.cuda.device_count() < gpus:
        raise ValueError(f"needs {gpus} GPUs, found {torch.cuda.device_count()}")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(fn, args=(gpus, port, *args, json_path), nprocs=gpus, start_method="spawn")
    if json_path:
        merged = [json.load(open(f"{json_path}.rank{r}")) for r in range(gpus)]
        json.dump({**merged[0], "rows": [row for m in merged for row in m["rows"]]}, open(json_path, "w"), indent=1)
        for r in range(gpus):
            os.remove(f"{json_path}.rank{r}")



def require_rewritten(backend, what: str) -> None:
    """Stop a timing run whose kimi_specialized graph was left unchanged (its "kimi"
    column would silently be stock): a lone attention or MoE layer on one rank is a layer
    fragment that mega_moe and lower_kernels rewrite; a TP layer with its collectives is
    not (the passes that take those need the whole decoder)."""
    report = backend.report
    lowered = sum(p.rewritten for p in report.passes)
    if not (report.decoder or report.fragment) or not lowered:
        raise SystemExit(f"{what}: kimi_specialized left the graph unchanged ({report.reason or 'nothing matched'}); "
                         "time the layer inside a decoder step instead (benchmarks/decode_step.py)")


def vllm_kernel_module(root: str, relpath: str):
    """vLLM 0.33.0's Python module ``relpath`` (e.g. ``models/kimi_k3/nvidia/ops/attn_res.py``)
    loaded from its wheel unpacked at ``root`` (``pip download --no-deps vllm==0.33.0`` and
    unzip), for its Triton kernels as vLLM launches them on this GPU. vLLM's CUDA build pins
    torch 2.14 and cannot be installed here, so the few vllm modules such a file imports
    are stood in for: ``vllm.triton_utils`` (Triton itself), ``vllm.platforms`` (this
    device's capability: SM100-only native kernels are not taken; PDL launches from SM90),
    ``vllm._custom_ops`` (empty: the CUDA extension is absent), and the constants and
    helpers its KDA kernels import (``cdiv``, ``next_power_of_2``, the null block / pad
    slot ids, fla's ``exp`` / ``log`` as vLLM defines them without FLA_USE_FAST_OPS)."""
    import importlib.util
    import sys
    import types

    import triton
    import triton.language as tl

    major, minor = torch.cuda.get_device_capability()
    platform = types.SimpleNamespace(
        is_device_capability_family=lambda family: major * 10 == family,
        is_arch_support_pdl=lambda: major >= 9, is_cpu=lambda: False)
    stubs = {"vllm": {}, "vllm._custom_ops": {}, "vllm.triton_utils": {"triton": triton, "tl": tl},
             "vllm.platforms": {"current_platform": platform},
             "vllm.utils.math_utils": {"cdiv": triton.cdiv, "next_power_of_2": triton.next_power_of_2},
             "vllm.v1.attention.backends.utils": {"NULL_BLOCK_ID": 0, "PAD_SLOT_ID": -1},
             "vllm.third_party.flash_linear_attention.ops.op": {"exp": tl.exp, "log": tl.log}}  # FLA_USE_FAST_OPS=0
    for name, attrs in stubs.items():
        module = sys.modules.setdefault(name, types.ModuleType(name))
        if name == "vllm":
            module.__path__ = []
        for key, value in attrs.items():
            setattr(module, key, value)
    name = "vllm." + relpath.removesuffix(".py").replace("/", ".")
    spec = importlib.util.spec_from_file_location(name, f"{root}/vllm/{relpath}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
