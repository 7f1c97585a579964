"""Decode a random Kimi K3 checkpoint for several steps on this rank.

``DecodeRun`` describes a run (preset, layout, batch, steps, compilation);
``decode(run)`` executes it on the calling rank (the default process group, or a
single rank when none is initialised) and returns the live rows of every step's
output, so runs in different layouts, rank counts or compilers can be compared.
With ``dp`` > 1 the ranks form ``dp`` TP groups of world / dp ranks (data parallel,
SP layout), each decoding its own batch, the routed experts over all ranks.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .stock import KimiK3Config, Parallel
from .stock.batch import DecodeBatch
from .stock.checkpoint import build_model, random_checkpoint


@dataclass(frozen=True)
class DecodeRun:
    preset: str = "tiny"
    layout: str = "tp"
    requests: int = 3
    q: int = 1
    padding: int = 1
    steps: int = 16
    seed: int = 0
    experts: str = "bf16"
    max_num_tokens: int = 8192
    dcp: int = 1  # decode context parallel size: 1 or the TP size
    dp: int = 1  # data-parallel TP groups (SP layout; the routed experts over every rank)
    backend: str | None = None  # None: eager stock; else a torch.compile backend name
    options: dict[str, Any] = field(default_factory=dict)
    dtype: str = "bfloat16"  # or "float32" (exact-equivalence checks)
    device: str = "cpu"  # "cuda": this rank's GPU (launch.run_ranks(..., backend="nccl"))
    layer_timings: bool = False
    progress: str = ""  # a label: rank 0 prints each step (and the compile) on stderr; "": silent


def progress(message: str) -> None:
    """One progress line on stderr (stdout keeps the result)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def data_parallel_groups(dp: int) -> tuple[dist.ProcessGroup, int]:
    """(this rank's TP group, its TP group's index d) for ``dp`` groups of world / dp
    consecutive ranks; also creates each TP index's group of DP peers (ranks t, G + t,
    ...: vLLM's DP group), which sharded_moe looks up. Every rank must call it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if dp < 1 or world % dp:
        raise ValueError(f"{world} ranks do not split into {dp} data-parallel TP groups")
    G = world // dp
    tp_groups = [dist.new_group(list(range(d * G, (d + 1) * G))) for d in range(dp)]
    for t in range(G):
        dist.new_group(list(range(t, world, G)))
    return tp_groups[rank // G], rank // G


def decode(run: DecodeRun) -> dict[str, Any]:
    group = dist.group.WORLD if dist.is_initialized() else None
    say = progress if run.progress and (group is None or dist.get_rank() == 0) else (lambda message: None)
    replica = 0
    if run.dp > 1:
        if group is None:
            raise ValueError(f"dp={run.dp} needs an initialised process group of several ranks")
        group, replica = data_parallel_groups(run.dp)
    par = Parallel(run.layout, group, run.max_num_tokens, run.dcp, dist.group.WORLD if run.dp > 1 else None)
    config = KimiK3Config.preset(run.preset)
    say(f"{run.progress}: building the {run.preset} model ({run.layout.upper()} layout, {run.dtype})")
    device = torch.device(run.device, torch.cuda.current_device()) if run.device == "cuda" else run.device
    model = build_model(config, random_checkpoint(config, run.seed, run.experts), par, device=device,
                        dtype=getattr(torch, run.dtype))
    batch = DecodeBatch(run.requests, run.q, run.padding, config.vocab_size, seed=run.seed + 1 + 1000 * replica)
    caches = model.allocate_caches(batch.num_slots, batch.num_blocks, batch.block_size, batch.q, device=device)
    timings = _time_layers(model) if run.layer_timings else None
    step_fn = model
    if run.backend == "kimi_specialized":
        from . import register

        register()  # a source checkout has no entry point
    if run.backend is not None:
        step_fn = torch.compile(model, backend=run.backend, options=run.options or None, dynamic=False)
    outputs, seconds = [], []
    with torch.no_grad():
        for i in range(run.steps):
            step = model.validate_step(batch.step(), caches).to(device)
            if i == 0 and run.backend is not None:
                say(f"{run.progress}: compiling the decode step with {run.backend} (Dynamo, AOTAutograd, our passes"
                    f"{', Inductor' if (run.options or {}).get('compiler', 'inductor') == 'inductor' else ''}) "
                    "and running step 1 ...")
            start = time.perf_counter()
            out = step_fn(step, caches)
            seconds.append(time.perf_counter() - start)
            say(f"{run.progress}: step {i + 1}/{run.steps} done ({1e3 * seconds[-1]:.0f} ms)")
            outputs.append(out[batch.real_rows().to(device)].float().cpu())
            batch.accept()
    result = {"outputs": torch.stack(outputs), "seconds": seconds, "rows": batch.rows,
              "layers": describe(model)}
    if run.backend == "kimi_specialized":
        from .backend import match_report

        result["report"] = match_report(step_fn).to_dict()
    if timings is not None:
        result["layer_seconds"] = timings
    return result


def describe(model) -> list[dict[str, Any]]:
    """Per layer: index, attention kind, MLP kind and this rank's weight shapes."""
    out = []
    for layer in model.model.layers:
        shapes = {name: list(p.shape) for name, p in layer.named_parameters()
                  if name.startswith(("self_attn.", "block_sparse_moe.experts.", "mlp.")) and p.dim() > 1}
        out.append({"index": layer.layer_idx, "kind": layer.kind,
                    "mlp": "moe" if layer.is_moe_layer else "dense", "shapes": shapes})
    return out


def _time_layers(model) -> dict[int, list[float]]:
    """Wall time of every decoder layer's forward, per call (eager runs only)."""
    times: dict[int, list[float]] = {}
    for layer in model.model.layers:
        def pre(mod, args, _i=layer.layer_idx):
            mod._t0 = time.perf_counter()

        def post(mod, args, out, _i=layer.layer_idx):
            times.setdefault(_i, []).append(time.perf_counter() - mod._t0)

        layer.register_forward_pre_hook(pre)
        layer.register_forward_hook(post)
    return times


def decode_many(runs: list[DecodeRun]) -> list[dict[str, Any]]:
    """``decode`` for each run in turn (one process group serves them all)."""
    return [decode(run) for run in runs]
